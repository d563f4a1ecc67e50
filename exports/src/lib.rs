//! udm's exports: block devices handed to programs outside the process.
//!
//! - [`nbd`]: the Network Block Device protocol (fixed newstyle handshake,
//!   structured replies, `base:allocation`), served from the reactors.
//! - [`ublk`]: a Linux block device (`/dev/ublkbN`) served by the kernel's
//!   ublk driver over io_uring URING_CMDs on the reactors' own rings.
//! - [`vhost`]: vhost-user-blk, for virtual machines: the guest's virtqueues
//!   run on the reactors, its memory is the I/O buffer.
//!
//! All of a process's exports draw on one [`limits::Pool`]: a connection
//! cap and one budget for the buffers their requests hold.
//!
//! Exports sit on top of the stack: they serve any
//! `Arc<dyn udm_core::BlockDevice>` and know nothing of targets or backends.

#![deny(missing_docs)]

pub mod front;
pub mod limits;
pub mod nbd;
pub mod ublk;
pub mod vhost;
