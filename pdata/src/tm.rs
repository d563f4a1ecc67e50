//! The transaction manager (dm-transaction-manager.c's job): blocks written
//! in a transaction go to new locations ("shadows") counted by the metadata
//! space map, so that the last committed metadata stays intact on disk
//! until a commit writes every new block, flushes, and only then writes the
//! superblock that points at them (and flushes again).

use std::collections::HashMap;
use std::sync::Arc;

use crate::block::{zeroed, Block, BlockCache, BlockIo};
use crate::checksum::BlockKind;
use crate::space_map::metadata::MetadataSpaceMap;
use crate::{Result, BLOCK_SIZE};

/// Blocks of the current transaction and the metadata space map.
pub struct Tm {
    cache: BlockCache,
    /// Blocks allocated in this transaction, held until commit.
    dirty: HashMap<u64, (BlockKind, Arc<Block>)>,
    /// The metadata space map (public to the space map's commit).
    pub sm: MetadataSpaceMap,
    /// Free blocks kept for commits: allocations outside one fail first.
    reserve: u64,
    /// Whether allocations may take the reserve (a commit is running).
    committing: bool,
}

/// Blocks kept in the read cache (32 MiB): the nodes of 2 million mappings.
const CACHE_BLOCKS: usize = 8192;

impl Tm {
    /// A transaction manager over `io` with the metadata space map `sm`.
    pub fn new(io: Box<dyn BlockIo>, sm: MetadataSpaceMap) -> Tm {
        Tm {
            cache: BlockCache::new(io, CACHE_BLOCKS),
            dirty: HashMap::new(),
            sm,
            reserve: 0,
            committing: false,
        }
    }

    /// A transaction manager over a blank device of `nr_blocks` blocks: a
    /// new metadata space map, with block 0 referenced for a superblock.
    pub fn format(io: Box<dyn BlockIo>, nr_blocks: u64) -> Result<Tm> {
        let sm = MetadataSpaceMap::format(nr_blocks, 0)?;
        let mut tm = Tm::new(io, sm);
        crate::space_map::metadata::format_finish(&mut tm)?;
        Ok(tm)
    }

    /// Opens the device with the metadata space map whose root is `root`
    /// (from a superblock).
    pub fn open(io: Box<dyn BlockIo>, root: &crate::space_map::SmRoot) -> Result<Tm> {
        let mut tm = Tm::new(io, MetadataSpaceMap::placeholder());
        crate::space_map::metadata::load(&mut tm, root)?;
        Ok(tm)
    }

    /// Takes the device out (dropping the transaction), leaving a
    /// transaction manager whose every I/O fails.
    pub fn take_io(&mut self) -> Box<dyn BlockIo> {
        self.dirty.clear();
        self.cache.take_io()
    }

    /// Gives back the device, dropping the transaction.
    pub fn into_io(self) -> Box<dyn BlockIo> {
        self.cache.into_io()
    }

    /// Block `b` as a `kind` block (this transaction's version if it has one).
    pub fn read(&mut self, b: u64, kind: BlockKind) -> Result<Arc<Block>> {
        if let Some((_, blk)) = self.dirty.get(&b) {
            return Ok(blk.clone());
        }
        self.cache.read(b, kind)
    }

    /// Block `b` unchecked, as on disk (a superblock that may be blank).
    pub fn read_raw(&mut self, b: u64) -> Result<Box<Block>> {
        self.cache.read_raw(b)
    }

    /// A free block, referenced once; outside a commit, the reserve's
    /// blocks are not handed out.
    fn alloc(&mut self) -> Result<u64> {
        if !self.committing && self.free_blocks() <= self.reserve {
            return Err(crate::no_space("metadata (the rest is kept for commits)"));
        }
        self.sm.counts.alloc()
    }

    /// Blocks that can be allocated before the commit: free now and at the
    /// last commit (those freed since are not).
    pub fn free_blocks(&self) -> u64 {
        self.sm.counts.nr_allocatable()
    }

    /// Keeps `blocks` free blocks for commits: as dm's thin metadata keeps
    /// `min(4096, total / 10)`, so that the changes made up to the point
    /// where space runs out can still be committed.
    pub fn set_reserve(&mut self, blocks: u64) {
        self.reserve = blocks;
    }

    /// The blocks kept for commits.
    pub fn reserve(&self) -> u64 {
        self.reserve
    }

    /// Lets allocations take the reserve (while a commit runs) or not.
    pub fn use_reserve(&mut self, on: bool) {
        self.committing = on;
    }

    /// A new zeroed `kind` block, referenced once.
    pub fn new_block(&mut self, kind: BlockKind) -> Result<u64> {
        let b = self.alloc()?;
        self.dirty.insert(b, (kind, Arc::from(zeroed())));
        Ok(b)
    }

    /// Block `b` of this transaction, to change it. Only blocks returned by
    /// [`Tm::new_block`] or [`Tm::shadow`] in this transaction may be changed.
    pub fn get_mut(&mut self, b: u64) -> Result<&mut Block> {
        match self.dirty.get_mut(&b) {
            Some((_, blk)) => Ok(Arc::make_mut(blk)),
            None => Err(crate::corrupt(b, "changed without being shadowed")),
        }
    }

    /// A block to write `b`'s new version in: `b` itself if this
    /// transaction made it and nothing else references it, else a copy in
    /// a new block, with `b`'s reference moved to it. The flag says that
    /// `b` was shared, so that the copy's children gain a reference (dm's
    /// `dm_tm_shadow_block` and its `inc_children`).
    pub fn shadow(&mut self, b: u64, kind: BlockKind) -> Result<(u64, bool)> {
        let count = self.sm.counts.get(b)?;
        if count == 1 && self.dirty.contains_key(&b) {
            return Ok((b, false));
        }
        let data = self.read(b, kind)?;
        let new = self.alloc()?;
        self.dirty.insert(new, (kind, data));
        self.sm.counts.dec(b)?;
        Ok((new, count > 1))
    }

    /// Adds a reference to `b`.
    pub fn inc(&mut self, b: u64) -> Result<()> {
        self.sm.counts.inc(b).map(drop)
    }

    /// Drops a reference to `b`; returns the count left.
    pub fn dec(&mut self, b: u64) -> Result<u32> {
        self.sm.counts.dec(b)
    }

    /// `b`'s reference count.
    pub fn count(&self, b: u64) -> Result<u32> {
        self.sm.counts.get(b)
    }

    /// Sets a block of this transaction to `data` as a `kind` block (the
    /// space maps' bitmaps and index, written at commit).
    pub fn put(&mut self, b: u64, kind: BlockKind, data: Box<Block>) {
        self.dirty.insert(b, (kind, Arc::from(data)));
    }

    /// Commits: the metadata space map's own blocks, every block of the
    /// transaction, a flush, then `superblock` at block `at` and a flush.
    /// `superblock` is called once the metadata space map is final, with
    /// its root, and returns the superblock's bytes.
    pub fn commit(
        &mut self,
        at: u64,
        superblock: impl FnOnce(&[u8; 128]) -> Box<Block>,
    ) -> Result<()> {
        let committing = std::mem::replace(&mut self.committing, true);
        let r = self.commit_inner(at, superblock);
        self.committing = committing;
        r
    }

    fn commit_inner(
        &mut self,
        at: u64,
        superblock: impl FnOnce(&[u8; 128]) -> Box<Block>,
    ) -> Result<()> {
        let sm_root = crate::space_map::metadata::commit(self)?;
        let sb = superblock(&sm_root.encode());
        let mut dirty: Vec<_> = self.dirty.drain().collect();
        // In block order, for a sequential write.
        dirty.sort_unstable_by_key(|(b, _)| *b);
        for (b, (kind, data)) in &dirty {
            self.cache.write(*b, *kind, data)?;
        }
        self.cache.flush()?;
        self.cache.write(at, BlockKind::Superblock, &sb)?;
        self.cache.flush()?;
        self.sm.counts.committed();
        Ok(())
    }

    /// Writes `block` at `at` now and flushes (dm's in-place superblock
    /// update for needs_check, outside any transaction).
    pub fn write_now(&mut self, at: u64, kind: BlockKind, block: &Block) -> Result<()> {
        self.cache.write(at, kind, block)?;
        self.cache.flush()
    }

    /// The device's size in blocks.
    pub fn device_blocks(&self) -> u64 {
        self.cache.nr_blocks()
    }

    /// Looks at the device's size again (it may have grown); returns it.
    pub fn refresh_device_size(&mut self) -> Result<u64> {
        self.cache.refresh_size()
    }
}

/// Reads the little-endian u64 at `off` of a block.
pub fn get64(b: &Block, off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// Reads the little-endian u32 at `off` of a block.
pub fn get32(b: &Block, off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

/// Writes a little-endian u64 at `off`.
pub fn put64(b: &mut Block, off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Writes a little-endian u32 at `off`.
pub fn put32(b: &mut Block, off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

const _: () = assert!(BLOCK_SIZE == 4096);
