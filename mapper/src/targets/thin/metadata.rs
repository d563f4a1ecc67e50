//! The thin pool's metadata (dm-thin-metadata.c's job) in Linux's format:
//! a superblock, a device-details B-tree and the two-level mapping tree
//! (dev id → (virtual block → data block << 24 | time)), kept by
//! `udm_pdata`'s copy-on-write B-trees and space maps.

use udm_core::{Error, ErrorKind};
pub use udm_pdata::block::BlockIo;
pub use udm_pdata::is_no_space;

/// A virtual block's mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// The data block it maps to.
    pub block: u64,
    /// Whether the data block may be shared with a snapshot or origin, so
    /// that a write must copy it first (see [`ThinMetadata::lookup`]).
    pub shared: bool,
}

/// A thin pool's metadata. Single-threaded: the pool wraps it in a mutex.
pub struct ThinMetadata {
    _io: Box<dyn BlockIo>,
}

fn todo() -> Error {
    Error::new(ErrorKind::Unsupported, "thin metadata: not implemented yet")
}

impl ThinMetadata {
    /// Formats the device when its first block is all zeroes (as dm does),
    /// else opens it; refuses a bad checksum or magic, a data block size
    /// other than `data_block_sectors`, or needs_check set (unless
    /// `read_only`), each with a one-line error.
    pub fn open_or_format(
        io: Box<dyn BlockIo>,
        data_block_sectors: u32,
        nr_data_blocks: u64,
        read_only: bool,
    ) -> Result<Self, Error> {
        let _ = (io, data_block_sectors, nr_data_blocks, read_only);
        Err(todo())
    }
    /// Creates thin device `dev` with no mappings; a dev id in use is an error.
    pub fn create_thin(&mut self, dev: u32) -> Result<(), Error> {
        let _ = dev;
        Err(todo())
    }
    /// Creates `dev` as a snapshot of `origin`: it shares the origin's
    /// mapping subtree, and the pool's time moves on so that later writes
    /// to either break sharing.
    pub fn create_snap(&mut self, dev: u32, origin: u32) -> Result<(), Error> {
        let _ = (dev, origin);
        Err(todo())
    }
    /// Deletes `dev` and drops its mappings' references.
    pub fn delete_thin(&mut self, dev: u32) -> Result<(), Error> {
        let _ = dev;
        Err(todo())
    }
    /// Whether `dev` exists.
    pub fn device_exists(&self, dev: u32) -> bool {
        let _ = dev;
        false
    }
    /// The mapping of `vblock` in `dev`, as dm's `dm_thin_find_block`.
    pub fn lookup(&mut self, dev: u32, vblock: u64) -> Result<Option<Lookup>, Error> {
        let _ = (dev, vblock);
        Err(todo())
    }
    /// Maps `vblock` of `dev` to `data_block` (allocated by
    /// [`ThinMetadata::alloc_data_block`]); an old mapping's reference is dropped.
    pub fn insert(&mut self, dev: u32, vblock: u64, data_block: u64) -> Result<(), Error> {
        let _ = (dev, vblock, data_block);
        Err(todo())
    }
    /// Unmaps `vblock` of `dev`.
    pub fn remove(&mut self, dev: u32, vblock: u64) -> Result<(), Error> {
        let _ = (dev, vblock);
        Err(todo())
    }
    /// Unmaps `[begin, end)` of `dev`; returns how many blocks were mapped.
    pub fn remove_range(&mut self, dev: u32, begin: u64, end: u64) -> Result<u64, Error> {
        let _ = (dev, begin, end);
        Err(todo())
    }
    /// A free data block, referenced once; out of space is told by
    /// [`is_no_space`].
    pub fn alloc_data_block(&mut self) -> Result<u64, Error> {
        Err(todo())
    }
    /// Commits the transaction: new blocks, flush, then the superblock.
    pub fn commit(&mut self) -> Result<(), Error> {
        Err(todo())
    }
    /// Drops the transaction: back to the last commit.
    pub fn abort(&mut self) -> Result<(), Error> {
        Err(todo())
    }
    /// The userspace transaction id.
    pub fn transaction_id(&self) -> u64 {
        0
    }
    /// Sets the transaction id to `new` if it is `old`.
    pub fn set_transaction_id(&mut self, old: u64, new: u64) -> Result<(), Error> {
        let _ = (old, new);
        Err(todo())
    }
    /// Takes a metadata snapshot (dm's `reserve_metadata_snap`).
    pub fn reserve_metadata_snap(&mut self) -> Result<(), Error> {
        Err(todo())
    }
    /// Releases the metadata snapshot.
    pub fn release_metadata_snap(&mut self) -> Result<(), Error> {
        Err(todo())
    }
    /// The metadata snapshot's block, if one is held.
    pub fn held_root(&self) -> Option<u64> {
        None
    }
    /// Grows the data device to `nr_blocks` (shrinking is refused).
    pub fn resize_data_dev(&mut self, nr_blocks: u64) -> Result<(), Error> {
        let _ = nr_blocks;
        Err(todo())
    }
    /// Grows the metadata device to `nr_blocks` (shrinking is refused).
    pub fn resize_metadata_dev(&mut self, nr_blocks: u64) -> Result<(), Error> {
        let _ = nr_blocks;
        Err(todo())
    }
    /// Data blocks (used, total).
    pub fn data_usage(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Metadata blocks (used, total).
    pub fn metadata_usage(&self) -> (u64, u64) {
        (0, 0)
    }
    /// How many blocks `dev` maps.
    pub fn mapped_blocks(&self, dev: u32) -> Result<u64, Error> {
        let _ = dev;
        Err(todo())
    }
    /// The highest mapped virtual block of `dev`.
    pub fn highest_mapped(&mut self, dev: u32) -> Result<Option<u64>, Error> {
        let _ = dev;
        Err(todo())
    }
    /// Marks the metadata as needing `thin_check` (committed at once).
    pub fn set_needs_check(&mut self) -> Result<(), Error> {
        Err(todo())
    }
    /// Whether the metadata is marked as needing a check.
    pub fn needs_check(&self) -> bool {
        false
    }
    /// The mapped runs of `[begin, end)` of `dev`: (virtual block, data
    /// block, length), for allocation maps.
    pub fn mapped_ranges(
        &mut self,
        dev: u32,
        begin: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64)>, Error> {
        let _ = (dev, begin, end);
        Err(todo())
    }
}
