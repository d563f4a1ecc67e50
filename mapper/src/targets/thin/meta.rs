//! What the pool needs of its metadata ([`MetaStore`]): the calls of
//! [`ThinMetadata`] (Linux's on-disk format) that the engine makes, as a
//! trait, so that the engine does not depend on how the metadata is kept
//! (and a test may give it a model).

use udm_core::Error;

use super::metadata::{is_no_space, ThinMetadata};

/// Where a virtual block lives, and whether another device maps it too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lookup {
    /// The data block.
    pub block: u64,
    /// Whether the block's reference count is above one (a write must copy).
    pub shared: bool,
}

/// The metadata of one pool: devices, their mappings, space and
/// transactions (the kernel's `dm-thin-metadata.h`). Single-threaded: the
/// pool's worker owns it.
pub(crate) trait MetaStore {
    /// Creates an empty thin device `dev`.
    fn create_thin(&mut self, dev: u32) -> Result<(), Error>;
    /// Creates `dev` as a snapshot of `origin` (which shares all its blocks).
    fn create_snap(&mut self, dev: u32, origin: u32) -> Result<(), Error>;
    /// Deletes `dev` and drops its references to its blocks.
    fn delete_thin(&mut self, dev: u32) -> Result<(), Error>;
    /// Whether `dev` exists.
    fn device_exists(&self, dev: u32) -> bool;
    /// The mapping of `vblock` of `dev`.
    fn lookup(&mut self, dev: u32, vblock: u64) -> Result<Option<Lookup>, Error>;
    /// Maps `vblock` of `dev` to `block` (which the caller allocated),
    /// dropping a reference to the block it mapped before.
    fn insert(&mut self, dev: u32, vblock: u64, block: u64) -> Result<(), Error>;
    /// Unmaps `begin..end` of `dev`; returns how many blocks were unmapped.
    fn remove_range(&mut self, dev: u32, begin: u64, end: u64) -> Result<u64, Error>;
    /// A free data block, its reference count one; `Ok(None)` when the
    /// data device is full.
    fn alloc_data_block(&mut self) -> Result<Option<u64>, Error>;
    /// Drops the reference [`MetaStore::alloc_data_block`] gave, for a
    /// block that was not mapped.
    fn release_data_block(&mut self, block: u64) -> Result<(), Error>;
    /// Takes a reference to free `block` again, outside the transaction
    /// (a reserve kept over a commit).
    fn claim_data_block(&mut self, block: u64) -> Result<(), Error>;
    /// Makes the transaction durable.
    fn commit(&mut self) -> Result<(), Error>;
    /// Drops every change since the last commit.
    fn abort(&mut self) -> Result<(), Error>;
    /// The userspace transaction id.
    fn transaction_id(&self) -> u64;
    /// Sets the transaction id to `new` if it is `old`.
    fn set_transaction_id(&mut self, old: u64, new: u64) -> Result<(), Error>;
    /// Takes a snapshot of the metadata for userspace tools.
    fn reserve_metadata_snap(&mut self) -> Result<(), Error>;
    /// Drops the metadata snapshot.
    fn release_metadata_snap(&mut self) -> Result<(), Error>;
    /// The metadata snapshot's root block, if one is held.
    fn held_root(&self) -> Option<u64>;
    /// Grows the data space to `nr_blocks`.
    fn resize_data_dev(&mut self, nr_blocks: u64) -> Result<(), Error>;
    /// (used, total) data blocks.
    fn data_usage(&self) -> (u64, u64);
    /// (used, total) metadata blocks.
    fn metadata_usage(&self) -> (u64, u64);
    /// Blocks `dev` maps.
    fn mapped_blocks(&self, dev: u32) -> Result<u64, Error>;
    /// The highest virtual block `dev` maps.
    fn highest_mapped(&mut self, dev: u32) -> Result<Option<u64>, Error>;
    /// Whether the metadata asks for an offline check.
    fn needs_check(&self) -> bool;
    /// The mapped runs of `begin..end` of `dev`: (virtual block, data
    /// block, length).
    fn mapped_ranges(
        &mut self,
        dev: u32,
        begin: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64)>, Error>;
    /// Grows the metadata space to `nr_blocks`.
    fn resize_metadata_dev(&mut self, nr_blocks: u64) -> Result<(), Error>;
}

/// The metadata in Linux's format.
impl MetaStore for ThinMetadata {
    fn create_thin(&mut self, dev: u32) -> Result<(), Error> {
        ThinMetadata::create_thin(self, dev)
    }
    fn create_snap(&mut self, dev: u32, origin: u32) -> Result<(), Error> {
        ThinMetadata::create_snap(self, dev, origin)
    }
    fn delete_thin(&mut self, dev: u32) -> Result<(), Error> {
        ThinMetadata::delete_thin(self, dev)
    }
    fn device_exists(&self, dev: u32) -> bool {
        ThinMetadata::device_exists(self, dev)
    }
    fn lookup(&mut self, dev: u32, vblock: u64) -> Result<Option<Lookup>, Error> {
        Ok(ThinMetadata::lookup(self, dev, vblock)?.map(|l| Lookup {
            block: l.block,
            shared: l.shared,
        }))
    }
    fn insert(&mut self, dev: u32, vblock: u64, block: u64) -> Result<(), Error> {
        ThinMetadata::insert(self, dev, vblock, block)
    }
    fn remove_range(&mut self, dev: u32, begin: u64, end: u64) -> Result<u64, Error> {
        ThinMetadata::remove_range(self, dev, begin, end)
    }
    fn alloc_data_block(&mut self) -> Result<Option<u64>, Error> {
        match ThinMetadata::alloc_data_block(self) {
            Ok(b) => Ok(Some(b)),
            Err(e) if is_no_space(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn release_data_block(&mut self, block: u64) -> Result<(), Error> {
        ThinMetadata::release_data_block(self, block)
    }
    fn claim_data_block(&mut self, block: u64) -> Result<(), Error> {
        ThinMetadata::claim_data_block(self, block)
    }
    fn commit(&mut self) -> Result<(), Error> {
        ThinMetadata::commit(self)
    }
    fn abort(&mut self) -> Result<(), Error> {
        ThinMetadata::abort(self)
    }
    fn transaction_id(&self) -> u64 {
        ThinMetadata::transaction_id(self)
    }
    fn set_transaction_id(&mut self, old: u64, new: u64) -> Result<(), Error> {
        ThinMetadata::set_transaction_id(self, old, new)
    }
    fn reserve_metadata_snap(&mut self) -> Result<(), Error> {
        ThinMetadata::reserve_metadata_snap(self)
    }
    fn release_metadata_snap(&mut self) -> Result<(), Error> {
        ThinMetadata::release_metadata_snap(self)
    }
    fn held_root(&self) -> Option<u64> {
        ThinMetadata::held_root(self)
    }
    fn resize_data_dev(&mut self, nr_blocks: u64) -> Result<(), Error> {
        ThinMetadata::resize_data_dev(self, nr_blocks)
    }
    fn data_usage(&self) -> (u64, u64) {
        ThinMetadata::data_usage(self)
    }
    fn metadata_usage(&self) -> (u64, u64) {
        ThinMetadata::metadata_usage(self)
    }
    fn mapped_blocks(&self, dev: u32) -> Result<u64, Error> {
        ThinMetadata::mapped_blocks(self, dev)
    }
    fn highest_mapped(&mut self, dev: u32) -> Result<Option<u64>, Error> {
        ThinMetadata::highest_mapped(self, dev)
    }
    fn needs_check(&self) -> bool {
        ThinMetadata::needs_check(self)
    }
    fn mapped_ranges(
        &mut self,
        dev: u32,
        begin: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64)>, Error> {
        ThinMetadata::mapped_ranges(self, dev, begin, end)
    }
    fn resize_metadata_dev(&mut self, nr_blocks: u64) -> Result<(), Error> {
        ThinMetadata::resize_metadata_dev(self, nr_blocks)
    }
}
