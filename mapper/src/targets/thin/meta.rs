//! What the pool needs of its metadata ([`MetaStore`]): the calls of
//! [`ThinMetadata`] (Linux's on-disk format) that the engine makes, as a
//! trait, so that the engine also runs over [`MemMeta`], a model of it in
//! memory (while the format cannot open a device, see `pool.rs`).

use std::collections::BTreeMap;

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
}

/// One transaction's state of [`MemMeta`].
#[derive(Clone, Default)]
struct MemState {
    devs: BTreeMap<u32, BTreeMap<u64, u64>>,
    refs: BTreeMap<u64, u32>,
    nr_blocks: u64,
    txid: u64,
    held: Option<u64>,
}

/// [`MetaStore`] in memory, with the kernel's transaction semantics
/// (changes visible at once, durable at [`MetaStore::commit`], dropped by
/// [`MetaStore::abort`]): the engine's unit tests run over it.
pub(crate) struct MemMeta {
    cur: MemState,
    committed: MemState,
    /// Where the next allocation starts looking (the kernel's space map
    /// searches from its last allocation too).
    hint: u64,
}

impl MemMeta {
    /// Empty metadata over `nr_blocks` data blocks.
    pub fn new(nr_blocks: u64) -> MemMeta {
        let s = MemState {
            nr_blocks,
            ..Default::default()
        };
        MemMeta {
            cur: s.clone(),
            committed: s,
            hint: 0,
        }
    }

    fn dev(&mut self, dev: u32) -> Result<&mut BTreeMap<u64, u64>, Error> {
        self.cur
            .devs
            .get_mut(&dev)
            .ok_or_else(|| Error::invalid(format!("device {dev} does not exist")))
    }

    fn dec(&mut self, block: u64) {
        if let Some(r) = self.cur.refs.get_mut(&block) {
            *r -= 1;
            if *r == 0 {
                self.cur.refs.remove(&block);
            }
        }
    }
}

impl MetaStore for MemMeta {
    fn create_thin(&mut self, dev: u32) -> Result<(), Error> {
        if self.cur.devs.contains_key(&dev) {
            return Err(Error::invalid(format!("device {dev} already exists")));
        }
        self.cur.devs.insert(dev, BTreeMap::new());
        Ok(())
    }

    fn create_snap(&mut self, dev: u32, origin: u32) -> Result<(), Error> {
        if self.cur.devs.contains_key(&dev) {
            return Err(Error::invalid(format!("device {dev} already exists")));
        }
        let m = self.dev(origin)?.clone();
        for b in m.values() {
            *self.cur.refs.entry(*b).or_insert(0) += 1;
        }
        self.cur.devs.insert(dev, m);
        Ok(())
    }

    fn delete_thin(&mut self, dev: u32) -> Result<(), Error> {
        let m = self
            .cur
            .devs
            .remove(&dev)
            .ok_or_else(|| Error::invalid(format!("device {dev} does not exist")))?;
        for b in m.values() {
            self.dec(*b);
        }
        Ok(())
    }

    fn device_exists(&self, dev: u32) -> bool {
        self.cur.devs.contains_key(&dev)
    }

    fn lookup(&mut self, dev: u32, vblock: u64) -> Result<Option<Lookup>, Error> {
        let Some(&block) = self.dev(dev)?.get(&vblock) else {
            return Ok(None);
        };
        let shared = self.cur.refs.get(&block).copied().unwrap_or(0) > 1;
        Ok(Some(Lookup { block, shared }))
    }

    fn insert(&mut self, dev: u32, vblock: u64, block: u64) -> Result<(), Error> {
        if let Some(old) = self.dev(dev)?.insert(vblock, block) {
            if old != block {
                self.dec(old);
            }
        }
        Ok(())
    }

    fn remove_range(&mut self, dev: u32, begin: u64, end: u64) -> Result<u64, Error> {
        let m = self.dev(dev)?;
        let keys: Vec<(u64, u64)> = m.range(begin..end).map(|(k, v)| (*k, *v)).collect();
        for (k, _) in &keys {
            m.remove(k);
        }
        for (_, b) in &keys {
            self.dec(*b);
        }
        Ok(keys.len() as u64)
    }

    fn alloc_data_block(&mut self) -> Result<Option<u64>, Error> {
        let n = self.cur.nr_blocks;
        for i in 0..n {
            let b = (self.hint + i) % n;
            // As the kernel's space map: a block freed in this transaction
            // is not reused before the commit (the committed metadata may
            // still map it).
            if !self.cur.refs.contains_key(&b) && !self.committed.refs.contains_key(&b) {
                self.cur.refs.insert(b, 1);
                self.hint = b + 1;
                return Ok(Some(b));
            }
        }
        Ok(None)
    }

    fn commit(&mut self) -> Result<(), Error> {
        self.committed = self.cur.clone();
        Ok(())
    }

    fn abort(&mut self) -> Result<(), Error> {
        self.cur = self.committed.clone();
        Ok(())
    }

    fn transaction_id(&self) -> u64 {
        self.cur.txid
    }

    fn set_transaction_id(&mut self, old: u64, new: u64) -> Result<(), Error> {
        if self.cur.txid != old {
            return Err(Error::invalid(format!(
                "transaction id is {}, not {old}",
                self.cur.txid
            )));
        }
        self.cur.txid = new;
        Ok(())
    }

    fn reserve_metadata_snap(&mut self) -> Result<(), Error> {
        if self.cur.held.is_some() {
            return Err(Error::invalid("a metadata snapshot is already held"));
        }
        self.cur.held = Some(1);
        Ok(())
    }

    fn release_metadata_snap(&mut self) -> Result<(), Error> {
        if self.cur.held.take().is_none() {
            return Err(Error::invalid("no metadata snapshot is held"));
        }
        Ok(())
    }

    fn held_root(&self) -> Option<u64> {
        self.cur.held
    }

    fn resize_data_dev(&mut self, nr_blocks: u64) -> Result<(), Error> {
        if nr_blocks < self.cur.nr_blocks {
            return Err(Error::invalid(format!(
                "cannot shrink the data device from {} to {nr_blocks} blocks",
                self.cur.nr_blocks
            )));
        }
        self.cur.nr_blocks = nr_blocks;
        Ok(())
    }

    fn data_usage(&self) -> (u64, u64) {
        (self.cur.refs.len() as u64, self.cur.nr_blocks)
    }

    fn metadata_usage(&self) -> (u64, u64) {
        let n: usize = self.cur.devs.values().map(|m| m.len()).sum();
        (1 + n as u64 / 256, 1 << 20)
    }

    fn mapped_blocks(&self, dev: u32) -> Result<u64, Error> {
        self.cur
            .devs
            .get(&dev)
            .map(|m| m.len() as u64)
            .ok_or_else(|| Error::invalid(format!("device {dev} does not exist")))
    }

    fn highest_mapped(&mut self, dev: u32) -> Result<Option<u64>, Error> {
        Ok(self.dev(dev)?.keys().next_back().copied())
    }

    fn needs_check(&self) -> bool {
        false
    }
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
}
