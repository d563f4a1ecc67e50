//! `thin-pool` and `thin`: thin provisioning and snapshots (dm-thin).
//!
//! Table lines (dm's syntax, `Documentation/admin-guide/device-mapper/
//! thin-provisioning.rst`):
//!
//! ```text
//! <start> <length> thin-pool <metadata dev> <data dev> <data block size> <low water mark> [<#features> <feature>...]
//! <start> <length> thin <pool dev> <dev id> [<external origin dev>]
//! ```
//!
//! - `data block size`: sectors per data block, 128 (64 KiB) to 2097152
//!   (1 GiB), a multiple of 128;
//! - `low water mark`: free data blocks at which the pool raises an event;
//! - features: `skip_block_zeroing`, `ignore_discard`,
//!   `no_discard_passdown`, `read_only`, `error_if_no_space`;
//! - `pool dev`: the udm device whose table holds the `thin-pool` target;
//!   `dev id`: a device created by the pool's `create_thin` or
//!   `create_snap` message; `external origin dev`: a read-only base that
//!   unprovisioned blocks read from.
//!
//! Status: the pool's is `<transaction id> <used metadata blocks>/<total>
//! <used data blocks>/<total> <held metadata root>|- ro|rw|out_of_data_space
//! discard_passdown|no_discard_passdown queue_if_no_space|error_if_no_space
//! needs_check|- <metadata low watermark>`; a volume's is `<nr mapped
//! sectors> <highest mapped sector>|-`. Pool messages: `create_thin <id>`,
//! `create_snap <id> <origin id>`, `delete <id>`, `set_transaction_id
//! <old> <new>`, `reserve_metadata_snap`, `release_metadata_snap`.
//!
//! How a bio goes:
//!
//! ```text
//!   thin map ── mapped, unshared (or a read) ──> data device, sector rewritten  (fast path)
//!      │  └──── known unmapped read ───────────> zeroes
//!      └─────── anything else ──> engine channel ──> pool worker (metadata, prison,
//!                                      ^              allocate, zero/copy, commit)
//!                                      └── answer ────┘  remap / write+insert / zero / complete
//! ```
//!
//! Files: `pool.rs` (the pool target, its shared state, the registry of
//! pools by metadata device), `thin.rs` (the volume target and its
//! engine), `vol.rs` (a volume's lock-free mapping cache and in-flight
//! epochs), `worker.rs` (the slow path and the bio prison), `meta.rs`
//! (what the worker needs of the metadata), `metadata.rs` (the metadata
//! in Linux's format, over the `udm-pdata` crate).

mod meta;
pub mod metadata;
mod metaio;
mod pool;
#[allow(clippy::module_inception)]
mod thin;
mod vol;
mod worker;

pub use pool::THIN_POOL;
pub use thin::THIN;
pub(crate) use vol::{Vol, MAPPED, SHARED};
