//! udm's I/O core: the kernel's bio and block-device model, in userspace.
//!
//! - [`Bio`]/[`BioPtr`]: the I/O descriptor, owned and passed down the stack,
//!   with inline completion frames so stacking layers never allocate.
//! - [`BlockDevice`]/[`Channel`]: the device contract; capabilities and limits
//!   are data ([`Limits`], [`Caps`]); I/O goes through per-reactor channels.
//! - [`AlignedBuf`]: memory any device can do (O_DIRECT) I/O to.
//! - [`Mmap`]: a memory mapping, owned and unmapped once.
//! - [`ReactorPool`]: reactor threads started, pinned, stopped and joined together.
//! - [`Reactor`]: one per thread, run to completion, with its own io_uring
//!   ([`Ring`]), descriptor cache and completion list.
//! - [`access`]: who may connect to udm's unix sockets (their mode, their
//!   directory, each peer's credentials).
//! - `testing` (with the `test-util` feature only): what the test suites
//!   share, such as a watchdog for waits on a reactor and temp directories.
//!
//! ```text
//!   submitter ──BioPtr──▶ Channel::submit ──▶ … ──▶ backend (ring / memory)
//!       ▲                                                   │
//!       └──── end_io ◀── popped frames ◀── Reactor turn ◀───┘
//! ```

#![deny(missing_docs)]

pub mod access;
pub mod affinity;
pub mod bio;
pub mod buf;
pub mod cputime;
pub mod device;
pub mod dispatch;
pub mod error;
pub mod fuzz_corpus;
pub mod memlock;
pub mod mmap;
pub mod pool;
pub mod reactor;
pub mod ring;
#[cfg(feature = "test-util")]
pub mod testing;
mod trial;

pub use bio::{Bio, BioFlags, BioPtr, EndIo, Op, Seg, Status, SECTOR_SHIFT, SECTOR_SIZE};
pub use buf::AlignedBuf;
pub use device::{
    bio_status, check_bio, push_extent, Alloc, BlockDevice, Caps, Channel, Extent, Limits,
    BLOCK_STATUS_MAX_EXTENTS,
};
pub use dispatch::{merge_report, AutoTrial, Dispatch};
pub use error::{Error, ErrorKind, Result};
pub use mmap::Mmap;
pub use pool::{PoolConfig, ReactorPool, StopToken};
pub use reactor::{
    CacheStats, CompletionMode, PassEnd, Poller, Reactor, ReactorConfig, ReactorHandle,
    RegisteredRegion, WorkQueue, DEFAULT_CACHE_SIZE,
};
pub use ring::{cqe_more, Ring, RingFd, RingKind, RingOp, MAX_REGISTERED_BUFFER};

/// The io_uring crate the core's [`Ring`] is built on, for callers that build
/// their own entries for [`Ring::push_op`].
pub use io_uring;
