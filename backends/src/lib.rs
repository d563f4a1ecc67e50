//! udm's backends: the devices at the bottom of every stack.
//!
//! - [`ram`]: memory, allocated lazily (brd);
//! - [`null`]: completes without touching data, optional delay (null_blk);
//! - [`file`](mod@file): a regular file or block device through io_uring;
//! - [`powercut`]: wraps a device and can lose power (crash testing);
//! - [`rbd`]: a Ceph RBD image through librbd (feature `rbd`).

#![deny(missing_docs)]

pub mod file;
pub mod null;
pub mod powercut;
pub mod ram;
#[cfg(feature = "rbd")]
pub mod rbd;

pub use file::{FileDevice, FileOpts};
pub use null::NullDevice;
pub use powercut::{Power, PowerCut};
pub use ram::RamDevice;
#[cfg(feature = "rbd")]
pub use rbd::{RbdDevice, RbdOpts};
/// Re-exported from the core, where it now lives.
pub use udm_core::AlignedBuf;
