//! udm's device mapper: dm's tables and targets, in userspace.
//!
//! A [`MappedDevice`] maps I/O through a [`Table`] of [`Target`]s, each built
//! from a dmsetup table line by its [`TargetType`]'s constructor. The core
//! here owns lookup, splitting, flush fan-out, limit stacking and live table
//! changes; targets (in [`targets`]) only remap.
//!
//! ```text
//!   MapperChannel::submit ── fast path (io.rs): remap the caller's bio in place
//!            │
//!            └──────────── clone path (clone.rs): split into clones, fan out flushes
//! ```

#![deny(missing_docs)]

mod clone;
pub mod device;
#[doc(hidden)]
pub mod fuzzing;
mod io;
pub mod stats;
pub mod table;
mod table_io;
pub mod target;
pub mod targets;
mod waiter;

pub use device::MappedDevice;
pub use io::MapperChannel;
pub use table::{parse, Registry, Table, TargetSpec};
pub use target::{
    BlockMap, CtrCtx, DevArea, DeviceResolver, EndIoWhen, Map, MapCtx, StatusType, Target,
    TargetType,
};
