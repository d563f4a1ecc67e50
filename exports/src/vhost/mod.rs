//! vhost-user-blk export: a udm device served to a virtual machine's
//! frontend (QEMU, Cloud Hypervisor, crosvm, libblkio) over a unix
//! socket, with the guest's memory as the I/O buffers.
//!
//! ```text
//!   server.rs    the socket; the control thread speaks vhost-user with one
//!      │         frontend at a time (vhost's BackendReqHandler parses and
//!      │         answers the messages) and accepts the next when it goes
//!   control.rs   the device side of the messages: features, config space,
//!      │         memory table, each ring's setup; starts and stops rings
//!      │ Start / stop / call / memory, via ReactorHandle::send
//!      ▼
//!   queue.rs     one virtqueue on one reactor: the kick eventfd polled on the
//!      │         reactor's io_uring, chains → requests → the export front
//!      │         (crate::front), used ring + call eventfd at end of turn
//!   chain.rs     a descriptor chain → a virtio-blk request (fuzzed)
//!   inflight.rs  the frontend's inflight file: heads taken and not yet
//!                answered, resubmitted by the next udm after a crash
//!   memory.rs    the guest's memory regions, mapped
//!   fixed.rs     …and registered with each reactor's io_uring (fixed buffers)
//!   config.rs    feature bits and the configuration space
//! ```
//!
//! Offered: VIRTIO_BLK_F_SIZE_MAX, SEG_MAX, BLK_SIZE, TOPOLOGY, FLUSH,
//! CONFIG_WCE, MQ, RO (read-only exports), DISCARD and WRITE_ZEROES (when
//! the device has them), GET_ID; VIRTIO_RING_F_EVENT_IDX and
//! INDIRECT_DESC; protocol features MQ, CONFIG, CONFIGURE_MEM_SLOTS,
//! REPLY_ACK, INFLIGHT_SHMFD (udm may be killed and started again under a
//! running guest: the next udm resubmits what was in flight), BACKEND_REQ
//! (a device that grows is announced with a config-change message: see
//! the server) and RESET_DEVICE.

pub mod chain;
pub mod config;
mod control;
pub mod fixed;
pub mod fuzzing;
pub mod inflight;
pub mod memory;
mod queue;
pub mod server;

pub use server::{Clients, Server, ServerConfig};
