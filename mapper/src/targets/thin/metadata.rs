//! The thin pool's metadata (dm-thin-metadata.c's job) in Linux's format,
//! kept by `udm_pdata`'s copy-on-write B-trees and space maps:
//!
//! - the superblock at block 0 (magic 27022010, version 2, flags with
//!   needs_check, the userspace transaction id, the held metadata snapshot,
//!   both space maps' roots, the two trees' roots, the block sizes);
//! - the device-details tree: dev id → (mapped blocks, transaction id,
//!   creation time, snapshotted time);
//! - the two-level mapping tree: dev id → the root of that device's tree of
//!   virtual block → (data block << 24 | time). A snapshot starts as a
//!   second reference to its origin's tree; copy-on-write splits them.
//!
//! Nothing here is written in place but the superblock: a commit writes the
//! transaction's blocks, flushes, then writes the superblock and flushes,
//! so a crash leaves the last commit readable (see `udm_pdata::tm`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use udm_core::{Error, ErrorKind};
use udm_pdata::block::{zeroed, Block};
use udm_pdata::btree::{self, NoRefs, ValueType};
use udm_pdata::checksum::{self, BlockKind};
use udm_pdata::space_map::disk::DiskSpaceMap;
use udm_pdata::space_map::metadata::MAX_BLOCKS;
use udm_pdata::space_map::SmRoot;
use udm_pdata::tm::{get32, get64, put32, put64, Tm};

pub use udm_pdata::block::BlockIo;

pub(crate) mod fuzzing;
pub use udm_pdata::is_no_space;

/// dm-thin's superblock magic.
const MAGIC: u64 = 27022010;
/// The format version written (dm's THIN_MAX_VERSION); 1 is read too.
const VERSION: u32 = 2;
/// Superblock flag: the metadata must be checked before it is used.
const NEEDS_CHECK: u32 = 1;
/// Metadata blocks are 8 sectors.
const METADATA_BLOCK_SECTORS: u32 = 8;
/// Dev ids are 24 bits wide (dm's MAX_DEV_ID).
pub const MAX_DEV_ID: u32 = (1 << 24) - 1;
/// Data block sizes: 64 KiB to 1 GiB in 64 KiB steps, in sectors.
const MIN_DATA_BLOCK: u32 = 128;
const MAX_DATA_BLOCK: u32 = 2 * 1024 * 1024;
/// The fewest metadata blocks a pool is formatted on.
const MIN_METADATA_BLOCKS: u64 = 16;
/// The most new metadata blocks one change to one mapping can take on a
/// metadata device of `total` blocks: a shadow and a split at each level of
/// both levels of trees, a new root for each, and a margin. No tree is
/// deeper than one whose root has two children and whose other nodes the
/// least (84 children, a third of 252) that fills `total` blocks.
fn op_blocks(total: u64) -> u64 {
    let (mut levels, mut nodes) = (2u64, 2u64);
    while nodes < total {
        nodes = nodes.saturating_mul(84);
        levels += 1;
    }
    4 * levels + 8
}

/// dm's reserve of metadata blocks for commits: a tenth, at most 16 MiB.
fn metadata_reserve(total: u64) -> u64 {
    (total / 10).min(4096)
}

// Superblock field offsets (struct thin_disk_superblock).
const SB_FLAGS: usize = 4;
const SB_UUID: usize = 16;
const SB_MAGIC: usize = 32;
const SB_VERSION: usize = 40;
const SB_TIME: usize = 44;
const SB_TRANS_ID: usize = 48;
const SB_HELD_ROOT: usize = 56;
const SB_DATA_SM: usize = 64;
const SB_META_SM: usize = 192;
const SB_MAPPING_ROOT: usize = 320;
const SB_DETAILS_ROOT: usize = 328;
const SB_DATA_BLOCK_SIZE: usize = 336;
const SB_META_BLOCK_SIZE: usize = 340;
const SB_META_NR_BLOCKS: usize = 344;
const SB_COMPAT: usize = 352;
const SB_COMPAT_RO: usize = 356;
const SB_INCOMPAT: usize = 360;

/// A virtual block's mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// The data block it maps to.
    pub block: u64,
    /// Whether the data block may be shared with a snapshot or origin, so
    /// that a write must copy it first (see [`ThinMetadata::lookup`]).
    pub shared: bool,
}

/// A device's details (struct disk_device_details).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Details {
    mapped_blocks: u64,
    transaction_id: u64,
    creation_time: u32,
    snapshotted_time: u32,
}

impl Details {
    fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&self.mapped_blocks.to_le_bytes());
        b[8..16].copy_from_slice(&self.transaction_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.creation_time.to_le_bytes());
        b[20..24].copy_from_slice(&self.snapshotted_time.to_le_bytes());
        b
    }
    fn decode(b: &[u8]) -> Details {
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |o: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[o..o + 4]);
            u32::from_le_bytes(a)
        };
        Details {
            mapped_blocks: u64_at(0),
            transaction_id: u64_at(8),
            creation_time: u32_at(16),
            snapshotted_time: u32_at(20),
        }
    }
}

/// The superblock's fields that are not space map roots.
#[derive(Clone, Debug)]
struct Superblock {
    flags: u32,
    uuid: [u8; 16],
    time: u32,
    trans_id: u64,
    held_root: u64,
    mapping_root: u64,
    details_root: u64,
    data_block_size: u32,
    metadata_nr_blocks: u64,
    compat: u32,
    compat_ro: u32,
}

impl Superblock {
    fn encode(&self, data_sm: &[u8; 128], meta_sm: &[u8; 128]) -> Box<Block> {
        let mut b = zeroed();
        put32(&mut b, SB_FLAGS, self.flags);
        b[SB_UUID..SB_UUID + 16].copy_from_slice(&self.uuid);
        put64(&mut b, SB_MAGIC, MAGIC);
        put32(&mut b, SB_VERSION, VERSION);
        put32(&mut b, SB_TIME, self.time);
        put64(&mut b, SB_TRANS_ID, self.trans_id);
        put64(&mut b, SB_HELD_ROOT, self.held_root);
        b[SB_DATA_SM..SB_DATA_SM + 128].copy_from_slice(data_sm);
        b[SB_META_SM..SB_META_SM + 128].copy_from_slice(meta_sm);
        put64(&mut b, SB_MAPPING_ROOT, self.mapping_root);
        put64(&mut b, SB_DETAILS_ROOT, self.details_root);
        put32(&mut b, SB_DATA_BLOCK_SIZE, self.data_block_size);
        put32(&mut b, SB_META_BLOCK_SIZE, METADATA_BLOCK_SECTORS);
        put64(&mut b, SB_META_NR_BLOCKS, self.metadata_nr_blocks);
        put32(&mut b, SB_COMPAT, self.compat);
        put32(&mut b, SB_COMPAT_RO, self.compat_ro);
        put32(&mut b, SB_INCOMPAT, 0);
        b
    }

    /// Checks and decodes block 0 (dm's `sb_check` and `__check_incompat_features`).
    fn decode(b: &Block, data_block_sectors: u32) -> Result<Superblock, Error> {
        if !checksum::verify(b, BlockKind::Superblock) {
            return Err(bad("superblock checksum mismatch"));
        }
        if get64(b, 8) != 0 {
            return Err(bad(format!("superblock says it is block {}", get64(b, 8))));
        }
        if get64(b, SB_MAGIC) != MAGIC {
            return Err(bad(format!("bad superblock magic {}", get64(b, SB_MAGIC))));
        }
        let version = get32(b, SB_VERSION);
        if !(1..=VERSION).contains(&version) {
            return Err(bad(format!("unsupported metadata version {version}")));
        }
        let incompat = get32(b, SB_INCOMPAT);
        if incompat != 0 {
            return Err(bad(format!(
                "unsupported incompatible features {incompat:#x}"
            )));
        }
        let mbs = get32(b, SB_META_BLOCK_SIZE);
        if mbs != METADATA_BLOCK_SECTORS {
            return Err(bad(format!(
                "metadata block size {mbs} sectors, expected 8"
            )));
        }
        let dbs = get32(b, SB_DATA_BLOCK_SIZE);
        if dbs != data_block_sectors {
            return Err(bad(format!(
                "data block size {dbs} sectors differs from the table's {data_block_sectors}"
            )));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[SB_UUID..SB_UUID + 16]);
        Ok(Superblock {
            flags: get32(b, SB_FLAGS),
            uuid,
            time: get32(b, SB_TIME),
            trans_id: get64(b, SB_TRANS_ID),
            held_root: get64(b, SB_HELD_ROOT),
            mapping_root: get64(b, SB_MAPPING_ROOT),
            details_root: get64(b, SB_DETAILS_ROOT),
            data_block_size: dbs,
            metadata_nr_blocks: get64(b, SB_META_NR_BLOCKS),
            compat: get32(b, SB_COMPAT),
            compat_ro: get32(b, SB_COMPAT_RO),
        })
    }
}

fn bad(msg: impl std::fmt::Display) -> Error {
    Error::invalid(format!("thin metadata: {msg}"))
}

fn no_device(dev: u32) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("thin device {dev} does not exist"),
    )
}

fn le64(v: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&v[..8]);
    u64::from_le_bytes(a)
}

/// The mapping trees' values: a data block and the time it was mapped,
/// referencing the data block in the data space map.
struct DataRefs<'a>(&'a mut DiskSpaceMap);

impl ValueType for DataRefs<'_> {
    fn size(&self) -> usize {
        8
    }
    fn inc(&mut self, _: &mut Tm, v: &[u8]) -> udm_pdata::Result<()> {
        self.0.counts.inc(le64(v) >> 24).map(drop)
    }
    fn dec(&mut self, _: &mut Tm, v: &[u8]) -> udm_pdata::Result<()> {
        self.0.counts.dec(le64(v) >> 24).map(drop)
    }
}

/// The top-level tree's values: a device's mapping tree, referenced in the
/// metadata space map; the last reference going deletes the tree.
struct SubtreeRefs<'a>(&'a mut DiskSpaceMap);

impl ValueType for SubtreeRefs<'_> {
    fn size(&self) -> usize {
        8
    }
    fn inc(&mut self, tm: &mut Tm, v: &[u8]) -> udm_pdata::Result<()> {
        tm.inc(le64(v))
    }
    fn dec(&mut self, tm: &mut Tm, v: &[u8]) -> udm_pdata::Result<()> {
        btree::del(tm, &mut DataRefs(self.0), le64(v))
    }
}

/// A thin pool's metadata. Single-threaded: the pool wraps it in a mutex.
///
/// Running out of space, data or metadata, is told by [`is_no_space`] and
/// changes nothing: a change is refused before it starts unless the
/// metadata device has room for its worst case beyond the blocks kept for
/// commits (see [`ThinMetadata::metadata_free`]), so what was done before
/// still commits. After any other error from a call that changes the
/// metadata, once it has started (an I/O error, corruption found), the
/// transaction is in an unknown state: every later change is refused until
/// [`ThinMetadata::abort`], as dm's pool falls back to read-only mode.
pub struct ThinMetadata {
    tm: Tm,
    data_sm: DiskSpaceMap,
    sb: Superblock,
    details: BTreeMap<u32, Details>,
    changed: BTreeSet<u32>,
    /// The last committed superblock, for updating its flags in place.
    committed: Box<Block>,
    read_only: bool,
    failed: bool,
    /// Whether anything changed since the last commit (a commit with
    /// nothing to write writes nothing, so a periodic commit of an idle
    /// pool costs no I/O).
    dirty: bool,
}

impl ThinMetadata {
    /// Formats the device when its first block is all zeroes (as dm does),
    /// else opens it; refuses a bad checksum or magic, a data block size
    /// other than `data_block_sectors`, or needs_check set (unless
    /// `read_only`), each with a one-line error.
    ///
    /// `nr_data_blocks` is the data device's size: a formatted pool counts
    /// that many, an opened one grows to it (as dm's pool does when it
    /// resumes on a bigger data device) and refuses a smaller one.
    pub fn open_or_format(
        mut io: Box<dyn BlockIo>,
        data_block_sectors: u32,
        nr_data_blocks: u64,
        read_only: bool,
    ) -> Result<Self, Error> {
        if !data_block_sectors.is_multiple_of(MIN_DATA_BLOCK)
            || !(MIN_DATA_BLOCK..=MAX_DATA_BLOCK).contains(&data_block_sectors)
        {
            return Err(Error::invalid(format!(
                "data block size {data_block_sectors} sectors is not a multiple of 128 between 128 and 2097152"
            )));
        }
        if io.nr_blocks() == 0 {
            return Err(bad("the metadata device is empty"));
        }
        let mut b0 = zeroed();
        io.read(0, &mut b0)?;
        if b0.iter().all(|&x| x == 0) {
            if read_only {
                return Err(bad(
                    "the metadata device is blank and the pool is read-only",
                ));
            }
            return Self::format(io, data_block_sectors, nr_data_blocks);
        }
        Self::open(io, &b0, data_block_sectors, Some(nr_data_blocks), read_only)
    }

    fn format(
        io: Box<dyn BlockIo>,
        data_block_sectors: u32,
        nr_data_blocks: u64,
    ) -> Result<Self, Error> {
        let nr = io.nr_blocks().min(MAX_BLOCKS);
        if nr < MIN_METADATA_BLOCKS {
            return Err(bad(format!(
                "the metadata device is too small ({nr} blocks, at least {MIN_METADATA_BLOCKS})"
            )));
        }
        let mut tm = Tm::format(io, nr)?;
        tm.set_reserve(metadata_reserve(nr));
        let data_sm = DiskSpaceMap::format(&mut tm, nr_data_blocks)?;
        let mapping_root = btree::empty(&mut tm, 8)?;
        let details_root = btree::empty(&mut tm, 24)?;
        let sb = Superblock {
            flags: 0,
            uuid: [0; 16],
            time: 0,
            trans_id: 0,
            held_root: 0,
            mapping_root,
            details_root,
            data_block_size: data_block_sectors,
            metadata_nr_blocks: nr,
            compat: 0,
            compat_ro: 0,
        };
        let mut md = ThinMetadata {
            tm,
            data_sm,
            sb,
            details: BTreeMap::new(),
            changed: BTreeSet::new(),
            committed: zeroed(),
            read_only: false,
            failed: false,
            dirty: true,
        };
        md.commit()?;
        Ok(md)
    }

    fn open(
        io: Box<dyn BlockIo>,
        b0: &Block,
        data_block_sectors: u32,
        nr_data_blocks: Option<u64>,
        read_only: bool,
    ) -> Result<Self, Error> {
        let sb = Superblock::decode(b0, data_block_sectors)?;
        if sb.flags & NEEDS_CHECK != 0 && !read_only {
            return Err(bad(
                "marked needs_check: run thin_check (or open read-only)",
            ));
        }
        if sb.metadata_nr_blocks > io.nr_blocks() {
            return Err(bad(format!(
                "the metadata device has {} blocks, its metadata counts {}",
                io.nr_blocks(),
                sb.metadata_nr_blocks
            )));
        }
        let meta_root = SmRoot::decode(&b0[SB_META_SM..SB_META_SM + 32]);
        if meta_root.nr_blocks != sb.metadata_nr_blocks {
            return Err(bad(format!(
                "metadata space map counts {} blocks, the superblock {}",
                meta_root.nr_blocks, sb.metadata_nr_blocks
            )));
        }
        let ctx = |e: Error| e.context("thin metadata");
        let mut tm = Tm::open(io, &meta_root).map_err(ctx)?;
        tm.set_reserve(metadata_reserve(meta_root.nr_blocks));
        let data_root = SmRoot::decode(&b0[SB_DATA_SM..SB_DATA_SM + 32]);
        let data_sm = DiskSpaceMap::load(&mut tm, &data_root).map_err(ctx)?;
        let mut details = BTreeMap::new();
        btree::range(&mut tm, sb.details_root, 0, u64::MAX, 24, &mut |k, v| {
            let dev =
                u32::try_from(k).map_err(|_| bad(format!("device id {k} in the details tree")))?;
            details.insert(dev, Details::decode(v));
            Ok(())
        })
        .map_err(ctx)?;
        // The mapping tree's top level must name the same devices.
        let mut devs = Vec::new();
        btree::range(&mut tm, sb.mapping_root, 0, u64::MAX, 8, &mut |k, _| {
            devs.push(k);
            Ok(())
        })
        .map_err(ctx)?;
        if !devs
            .iter()
            .copied()
            .eq(details.keys().map(|&d| u64::from(d)))
        {
            return Err(bad(
                "the mapping and device-details trees name different devices",
            ));
        }
        let mut md = ThinMetadata {
            tm,
            data_sm,
            sb,
            details,
            changed: BTreeSet::new(),
            committed: Box::new(*b0),
            read_only,
            failed: false,
            dirty: false,
        };
        if let Some(n) = nr_data_blocks {
            let have = md.data_sm.counts.nr_blocks();
            if n < have {
                return Err(bad(format!(
                    "the data device has {n} blocks, the pool's metadata counts {have} (a data device cannot shrink)"
                )));
            }
            if n > have && !read_only {
                md.data_sm.extend(n);
            }
        }
        Ok(md)
    }

    /// Refuses a change to mappings or devices, changing nothing, unless
    /// the metadata device has room for the most it can take beyond the
    /// commit reserve: running out half-way would leave the transaction
    /// to be aborted, as dm's pool does when its metadata runs out.
    fn room_for_change(&self) -> Result<(), Error> {
        if self.metadata_free() < op_blocks(self.tm.sm.counts.nr_blocks()) {
            return Err(udm_pdata::no_space("thin pool metadata device"));
        }
        Ok(())
    }

    /// Runs a change, refusing it on a read-only or failed pool and marking
    /// the pool failed if it errs half-way.
    fn change<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R, Error>) -> Result<R, Error> {
        if self.read_only {
            return Err(Error::invalid("thin pool metadata is read-only"));
        }
        if self.failed {
            return Err(Error::new(
                ErrorKind::Io,
                "thin pool metadata failed an operation: abort the transaction first",
            ));
        }
        self.dirty = true;
        let r = f(self);
        if r.is_err() {
            self.failed = true;
        }
        r
    }

    fn subtree(&mut self, dev: u32) -> Result<u64, Error> {
        let v = btree::lookup_with(&mut self.tm, self.sb.mapping_root, u64::from(dev), 8, le64)?;
        v.ok_or_else(|| no_device(dev))
    }

    /// Runs `f` on `dev`'s mapping tree and stores the root it returns.
    fn with_subtree<R>(
        &mut self,
        dev: u32,
        f: impl FnOnce(&mut Tm, &mut DiskSpaceMap, u64) -> udm_pdata::Result<(u64, R)>,
    ) -> Result<R, Error> {
        let sub = self.subtree(dev)?;
        // Shadow the top level's path first: when its leaf is shared (a
        // metadata snapshot), its copy adds a reference to `sub`, which
        // must be there before `sub` itself is shadowed.
        let key = u64::from(dev);
        let refs = &mut SubtreeRefs(&mut self.data_sm);
        self.sb.mapping_root = btree::insert(
            &mut self.tm,
            refs,
            self.sb.mapping_root,
            key,
            &sub.to_le_bytes(),
        )?
        .0;
        let (new, r) = f(&mut self.tm, &mut self.data_sm, sub)?;
        if new != sub {
            // The old root's reference moved to the new one when it was
            // shadowed: the old value is not dropped.
            let refs = &mut SubtreeRefs(&mut self.data_sm);
            self.sb.mapping_root = btree::insert(
                &mut self.tm,
                refs,
                self.sb.mapping_root,
                key,
                &new.to_le_bytes(),
            )?
            .0;
        }
        Ok(r)
    }

    fn details_mut(&mut self, dev: u32) -> Result<&mut Details, Error> {
        self.changed.insert(dev);
        self.details.get_mut(&dev).ok_or_else(|| no_device(dev))
    }

    fn check_new_dev(&self, dev: u32) -> Result<(), Error> {
        if dev > MAX_DEV_ID {
            return Err(Error::invalid(format!(
                "thin device id {dev} is above {MAX_DEV_ID}"
            )));
        }
        if self.details.contains_key(&dev) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("thin device {dev} already exists"),
            ));
        }
        Ok(())
    }

    /// Creates thin device `dev` with no mappings; a dev id in use is an error.
    pub fn create_thin(&mut self, dev: u32) -> Result<(), Error> {
        self.check_new_dev(dev)?;
        self.room_for_change()?;
        self.change(|md| {
            let sub = btree::empty(&mut md.tm, 8)?;
            let refs = &mut SubtreeRefs(&mut md.data_sm);
            md.sb.mapping_root = btree::insert(
                &mut md.tm,
                refs,
                md.sb.mapping_root,
                u64::from(dev),
                &sub.to_le_bytes(),
            )?
            .0;
            md.details.insert(
                dev,
                Details {
                    mapped_blocks: 0,
                    transaction_id: md.sb.trans_id,
                    creation_time: md.sb.time,
                    snapshotted_time: md.sb.time,
                },
            );
            md.changed.insert(dev);
            Ok(())
        })
    }

    /// Creates `dev` as a snapshot of `origin`: it shares the origin's
    /// mapping tree (one more reference to its root), and the pool's time
    /// moves on, so that every mapping made before now reads as shared in
    /// both and a write to either copies first.
    pub fn create_snap(&mut self, dev: u32, origin: u32) -> Result<(), Error> {
        self.check_new_dev(dev)?;
        self.room_for_change()?;
        if !self.details.contains_key(&origin) {
            return Err(no_device(origin));
        }
        self.change(|md| {
            let sub = md.subtree(origin)?;
            md.tm.inc(sub)?;
            let refs = &mut SubtreeRefs(&mut md.data_sm);
            md.sb.mapping_root = btree::insert(
                &mut md.tm,
                refs,
                md.sb.mapping_root,
                u64::from(dev),
                &sub.to_le_bytes(),
            )?
            .0;
            md.sb.time = md.sb.time.wrapping_add(1);
            let time = md.sb.time;
            let o = md.details_mut(origin)?;
            o.snapshotted_time = time;
            let mapped = o.mapped_blocks;
            md.details.insert(
                dev,
                Details {
                    mapped_blocks: mapped,
                    transaction_id: md.sb.trans_id,
                    creation_time: time,
                    snapshotted_time: time,
                },
            );
            md.changed.insert(dev);
            Ok(())
        })
    }

    /// Deletes `dev` and drops its mapping tree's reference (freeing what
    /// no snapshot shares).
    pub fn delete_thin(&mut self, dev: u32) -> Result<(), Error> {
        if !self.details.contains_key(&dev) {
            return Err(no_device(dev));
        }
        self.room_for_change()?;
        self.change(|md| {
            let key = u64::from(dev);
            md.sb.details_root =
                btree::remove(&mut md.tm, &mut NoRefs(24), md.sb.details_root, key)?.0;
            let refs = &mut SubtreeRefs(&mut md.data_sm);
            let (root, old) = btree::remove(&mut md.tm, refs, md.sb.mapping_root, key)?;
            md.sb.mapping_root = root;
            if let Some(old) = old {
                refs.dec(&mut md.tm, &old)?;
            }
            md.details.remove(&dev);
            md.changed.remove(&dev);
            Ok(())
        })
    }

    /// Whether `dev` exists.
    pub fn device_exists(&self, dev: u32) -> bool {
        self.details.contains_key(&dev)
    }

    /// The devices, in id order.
    pub fn devices(&self) -> Vec<u32> {
        self.details.keys().copied().collect()
    }

    /// The mapping of `vblock` in `dev`, as dm's `dm_thin_find_block`.
    ///
    /// Shared is dm's test: the mapping's time is before the device's
    /// snapshotted time, i.e. the mapping existed when the device was last
    /// snapshotted (or was the origin of one). It is exact where it
    /// matters (a block mapped since the last snapshot is this device's
    /// alone) and conservative otherwise: a snapshot since deleted, or one
    /// that has itself broken sharing, still reads as sharing, which costs
    /// a needless copy but never a lost one. dm decides this without
    /// reading the data space map's count on every write; a count above 1
    /// would be exact but costs a lookup per I/O, and counts include
    /// references held by a metadata snapshot.
    pub fn lookup(&mut self, dev: u32, vblock: u64) -> Result<Option<Lookup>, Error> {
        let snapshotted = self
            .details
            .get(&dev)
            .ok_or_else(|| no_device(dev))?
            .snapshotted_time;
        let sub = self.subtree(dev)?;
        let Some(bt) = btree::lookup_with(&mut self.tm, sub, vblock, 8, le64)? else {
            return Ok(None);
        };
        Ok(Some(Lookup {
            block: bt >> 24,
            shared: snapshotted > (bt & 0xff_ffff) as u32,
        }))
    }

    /// Maps `vblock` of `dev` to `data_block` (allocated by
    /// [`ThinMetadata::alloc_data_block`], whose reference the mapping
    /// takes); an old mapping's reference is dropped (unless it is the same
    /// data block, as dm's `data_block_equal`).
    pub fn insert(&mut self, dev: u32, vblock: u64, data_block: u64) -> Result<(), Error> {
        if !self.details.contains_key(&dev) {
            return Err(no_device(dev));
        }
        if data_block >= self.data_sm.counts.nr_blocks() || data_block >= 1 << 40 {
            return Err(Error::invalid(format!(
                "data block {data_block} is beyond the data device"
            )));
        }
        let v = (data_block << 24 | u64::from(self.sb.time & 0xff_ffff)).to_le_bytes();
        self.room_for_change()?;
        self.change(|md| {
            let new = md.with_subtree(dev, |tm, dsm, sub| {
                let refs = &mut DataRefs(dsm);
                let (root, old) = btree::insert(tm, refs, sub, vblock, &v)?;
                if let Some(old) = &old {
                    if le64(old) >> 24 != data_block {
                        refs.dec(tm, old)?;
                    }
                }
                Ok((root, old.is_none()))
            })?;
            if new {
                let d = md.details_mut(dev)?;
                d.mapped_blocks = d.mapped_blocks.saturating_add(1);
            }
            Ok(())
        })
    }

    /// Unmaps `vblock` of `dev` (nothing to do if it is not mapped).
    pub fn remove(&mut self, dev: u32, vblock: u64) -> Result<(), Error> {
        self.remove_range(dev, vblock, vblock.saturating_add(1))
            .map(drop)
    }

    /// Unmaps `[begin, end)` of `dev`; returns how many blocks were mapped.
    /// Running out of metadata space part of the way is an error (told by
    /// [`is_no_space`]) after the blocks before it were unmapped, with the
    /// pool still usable: each removal is checked for room first.
    pub fn remove_range(&mut self, dev: u32, begin: u64, end: u64) -> Result<u64, Error> {
        if !self.details.contains_key(&dev) {
            return Err(no_device(dev));
        }
        if begin >= end {
            return Ok(0);
        }
        self.room_for_change()?;
        let reserve = self.tm.reserve() + op_blocks(self.tm.sm.counts.nr_blocks());
        self.change(|md| {
            let (n, full) = md.with_subtree(dev, |tm, dsm, mut root| {
                let refs = &mut DataRefs(dsm);
                let mut at = begin;
                let mut n = 0u64;
                while at < end {
                    let Some((k, _)) = btree::lookup_next(tm, root, at, 8)? else {
                        break;
                    };
                    if k >= end {
                        break;
                    }
                    // Room for this removal (and the top level's update)?
                    if tm.free_blocks() < reserve {
                        return Ok((root, (n, true)));
                    }
                    let (r, v) = btree::remove(tm, refs, root, k)?;
                    root = r;
                    if let Some(v) = v {
                        refs.dec(tm, &v)?;
                        n += 1;
                    }
                    match k.checked_add(1) {
                        Some(k) => at = k,
                        None => break,
                    }
                }
                Ok((root, (n, false)))
            })?;
            if n > 0 {
                let d = md.details_mut(dev)?;
                d.mapped_blocks = d.mapped_blocks.saturating_sub(n);
            }
            Ok((n, full))
        })
        .and_then(|(n, full)| match full {
            true => Err(udm_pdata::no_space("thin pool metadata device")),
            false => Ok(n),
        })
    }

    /// A free data block, referenced once (free now and at the last commit,
    /// so that the committed metadata's blocks are never overwritten).
    /// Out of space is told by [`is_no_space`], and changes nothing.
    pub fn alloc_data_block(&mut self) -> Result<u64, Error> {
        if self.read_only || self.failed {
            return self.change(|_| Ok(0));
        }
        self.dirty = true;
        self.data_sm.counts.alloc().map_err(|e| {
            if is_no_space(&e) {
                udm_pdata::no_space("thin pool data device")
            } else {
                e
            }
        })
    }

    /// Drops the reference [`ThinMetadata::alloc_data_block`] gave, for a
    /// block that was not mapped after all (its zeroing failed, or the
    /// mapping was refused): free again once the transaction commits.
    pub fn release_data_block(&mut self, block: u64) -> Result<(), Error> {
        if block >= self.data_sm.counts.nr_blocks() {
            return Err(Error::invalid(format!(
                "data block {block} is beyond the data device"
            )));
        }
        self.change(|md| md.data_sm.counts.dec(block).map(drop))
    }

    /// Takes a reference to free data block `block` again: a reserved
    /// block given back before a commit (so that the commit does not count
    /// it) is reserved again after. Not a change of the transaction.
    pub fn claim_data_block(&mut self, block: u64) -> Result<(), Error> {
        if self.read_only || self.failed {
            return self.change(|_| Ok(()));
        }
        if block >= self.data_sm.counts.nr_blocks() {
            return Err(Error::invalid(format!(
                "data block {block} is beyond the data device"
            )));
        }
        match self.data_sm.counts.get(block)? {
            0 => Ok(self.data_sm.counts.set(block, 1)?),
            n => Err(Error::invalid(format!(
                "data block {block} is in use ({n} references)"
            ))),
        }
    }

    /// Commits the transaction: the changed device details and space maps,
    /// every new block, a flush, then the superblock and a flush.
    pub fn commit(&mut self) -> Result<(), Error> {
        if self.read_only || (!self.dirty && !self.failed) {
            return Ok(());
        }
        self.change(|md| {
            md.tm.use_reserve(true);
            let r = md.commit_changes();
            md.tm.use_reserve(false);
            r
        })?;
        self.dirty = false;
        Ok(())
    }

    fn commit_changes(&mut self) -> Result<(), Error> {
        let md = self;
        for dev in std::mem::take(&mut md.changed) {
            if let Some(d) = md.details.get(&dev) {
                md.sb.details_root = btree::insert(
                    &mut md.tm,
                    &mut NoRefs(24),
                    md.sb.details_root,
                    u64::from(dev),
                    &d.encode(),
                )?
                .0;
            }
        }
        let data_root = md.data_sm.commit(&mut md.tm)?.encode();
        let sb = md.sb.clone();
        let mut written = None;
        md.tm.commit(0, |meta_root| {
            let b = sb.encode(&data_root, meta_root);
            written = Some(b.clone());
            b
        })?;
        md.data_sm.committed();
        if let Some(mut b) = written {
            // As written: located at 0 and sealed.
            put64(&mut b, 8, 0);
            checksum::seal(&mut b, BlockKind::Superblock);
            md.committed = b;
        }
        Ok(())
    }

    /// Drops the transaction: back to the last commit, read again from the
    /// device. Metadata marked needs_check comes back read-only (dm's pool
    /// does not go back to writing until the metadata is repaired).
    pub fn abort(&mut self) -> Result<(), Error> {
        let mut io = self.tm.take_io();
        let mut b0 = zeroed();
        io.read(0, &mut b0)?;
        let read_only = self.read_only || self.needs_check();
        let md = Self::open(io, &b0, self.sb.data_block_size, None, read_only)?;
        *self = md;
        Ok(())
    }

    /// The userspace transaction id.
    pub fn transaction_id(&self) -> u64 {
        self.sb.trans_id
    }

    /// Sets the transaction id to `new` if it is `old` (dm's
    /// `set_transaction_id` message); committed with the transaction.
    pub fn set_transaction_id(&mut self, old: u64, new: u64) -> Result<(), Error> {
        if self.sb.trans_id != old {
            return Err(Error::invalid(format!(
                "transaction id is {}, not {old}",
                self.sb.trans_id
            )));
        }
        self.change(|md| {
            md.sb.trans_id = new;
            Ok(())
        })
    }

    /// Takes a metadata snapshot (dm's `reserve_metadata_snap`): commits,
    /// then copies the superblock to a new block that holds one more
    /// reference to the mapping and details trees, so `thin_dump -m` reads
    /// a consistent image while the pool changes. Committed at once.
    pub fn reserve_metadata_snap(&mut self) -> Result<(), Error> {
        if self.sb.held_root != 0 {
            return Err(Error::new(
                ErrorKind::Busy,
                "a metadata snapshot is already held: release it first",
            ));
        }
        self.commit()?;
        self.change(|md| {
            let copy = md.tm.new_block(BlockKind::Superblock)?;
            // The copy's space map roots are wiped, as dm does: they are
            // not published and would go stale.
            let held = md.sb.encode(&[0; 128], &[0; 128]);
            md.tm.put(copy, BlockKind::Superblock, held);
            md.tm.inc(md.sb.mapping_root)?;
            md.tm.inc(md.sb.details_root)?;
            md.sb.held_root = copy;
            Ok(())
        })?;
        self.commit()
    }

    /// Releases the metadata snapshot: its trees lose the references it
    /// held. Committed at once.
    pub fn release_metadata_snap(&mut self) -> Result<(), Error> {
        let held = self.sb.held_root;
        if held == 0 {
            return Err(Error::invalid("no metadata snapshot is held"));
        }
        self.change(|md| {
            let b = md.tm.read(held, BlockKind::Superblock)?;
            let (mapping, details) = (get64(&b, SB_MAPPING_ROOT), get64(&b, SB_DETAILS_ROOT));
            btree::del(&mut md.tm, &mut SubtreeRefs(&mut md.data_sm), mapping)?;
            btree::del(&mut md.tm, &mut NoRefs(24), details)?;
            md.tm.dec(held)?;
            md.sb.held_root = 0;
            Ok(())
        })?;
        self.commit()
    }

    /// The metadata snapshot's block, if one is held.
    pub fn held_root(&self) -> Option<u64> {
        (self.sb.held_root != 0).then_some(self.sb.held_root)
    }

    /// Grows the data device to `nr_blocks` (shrinking is refused, as dm).
    pub fn resize_data_dev(&mut self, nr_blocks: u64) -> Result<(), Error> {
        let have = self.data_sm.counts.nr_blocks();
        if nr_blocks < have {
            return Err(Error::invalid(format!(
                "data device cannot shrink from {have} to {nr_blocks} blocks"
            )));
        }
        self.change(|md| {
            md.data_sm.extend(nr_blocks);
            Ok(())
        })
    }

    /// Grows the metadata to `nr_blocks` of its device, which must have
    /// grown to hold them (shrinking is refused, and the space map counts at
    /// most 255 bitmaps' worth, as dm).
    pub fn resize_metadata_dev(&mut self, nr_blocks: u64) -> Result<(), Error> {
        let have = self.tm.sm.counts.nr_blocks();
        let nr_blocks = nr_blocks.min(MAX_BLOCKS);
        if nr_blocks < have {
            return Err(Error::invalid(format!(
                "metadata device cannot shrink from {have} to {nr_blocks} blocks"
            )));
        }
        if nr_blocks > self.tm.refresh_device_size()? {
            return Err(Error::invalid(format!(
                "metadata device has {} blocks, not {nr_blocks}",
                self.tm.device_blocks()
            )));
        }
        self.change(|md| {
            md.tm.sm.extend(nr_blocks)?;
            md.tm.set_reserve(metadata_reserve(nr_blocks));
            md.sb.metadata_nr_blocks = nr_blocks;
            Ok(())
        })
    }

    /// Data blocks (used, total).
    pub fn data_usage(&self) -> (u64, u64) {
        let c = &self.data_sm.counts;
        (c.nr_allocated(), c.nr_blocks())
    }

    /// Free metadata blocks beyond those kept for commits (dm's
    /// `dm_pool_get_free_metadata_block_count`): changes are refused when
    /// this runs low, so the pool's low-water event and read-only switch
    /// go by it.
    pub fn metadata_free(&self) -> u64 {
        self.tm.free_blocks().saturating_sub(self.tm.reserve())
    }

    /// Metadata blocks (used, total).
    pub fn metadata_usage(&self) -> (u64, u64) {
        let c = &self.tm.sm.counts;
        (c.nr_allocated(), c.nr_blocks())
    }

    /// The data block size in sectors.
    pub fn data_block_sectors(&self) -> u32 {
        self.sb.data_block_size
    }

    /// How many blocks `dev` maps.
    pub fn mapped_blocks(&self, dev: u32) -> Result<u64, Error> {
        Ok(self
            .details
            .get(&dev)
            .ok_or_else(|| no_device(dev))?
            .mapped_blocks)
    }

    /// The highest mapped virtual block of `dev`.
    pub fn highest_mapped(&mut self, dev: u32) -> Result<Option<u64>, Error> {
        let sub = self.subtree(dev)?;
        Ok(btree::last(&mut self.tm, sub, 8)?.map(|(k, _)| k))
    }

    /// Marks the metadata as needing `thin_check`: written into the last
    /// committed superblock at once, outside the transaction, as dm does
    /// when it gives up on its metadata (not written when read-only).
    pub fn set_needs_check(&mut self) -> Result<(), Error> {
        self.sb.flags |= NEEDS_CHECK;
        if self.read_only {
            return Ok(());
        }
        let mut b = self.committed.clone();
        let flags = get32(&b, SB_FLAGS) | NEEDS_CHECK;
        put32(&mut b, SB_FLAGS, flags);
        self.tm.write_now(0, BlockKind::Superblock, &b)?;
        checksum::seal(&mut b, BlockKind::Superblock);
        self.committed = b;
        Ok(())
    }

    /// Whether the metadata is marked as needing a check.
    pub fn needs_check(&self) -> bool {
        self.sb.flags & NEEDS_CHECK != 0
    }

    /// Checks that both space maps count exactly the references the
    /// metadata holds: every tree node, space map block and superblock (a
    /// held metadata snapshot's too) in the metadata space map, every
    /// mapping in the data space map. `thin_check` 0.9 lets a count that
    /// is too high pass as a leak; this does not. For tests and offline
    /// checks, right after a commit (the metadata space map's own blocks
    /// move at commit).
    pub fn check_counts(&mut self) -> Result<(), Error> {
        let mut meta: HashMap<u64, u32> = HashMap::new();
        let mut data: HashMap<u64, u32> = HashMap::new();
        meta.insert(0, 1);
        let tm = &mut self.tm;
        let mut roots = vec![(self.sb.mapping_root, self.sb.details_root)];
        if self.sb.held_root != 0 {
            *meta.entry(self.sb.held_root).or_default() += 1;
            let b = tm.read(self.sb.held_root, BlockKind::Superblock)?;
            roots.push((get64(&b, SB_MAPPING_ROOT), get64(&b, SB_DETAILS_ROOT)));
        }
        for (mapping, details) in roots {
            btree::count_refs(tm, details, 24, &mut meta, &mut |_, _, _| Ok(()))?;
            btree::count_refs(tm, mapping, 8, &mut meta, &mut |tm, meta, v| {
                btree::count_refs(tm, le64(v), 8, meta, &mut |_, _, v| {
                    *data.entry(le64(v) >> 24).or_default() += 1;
                    Ok(())
                })
            })?;
        }
        let (bitmaps, index, overflow) = self.data_sm.own_blocks();
        btree::count_refs(tm, index, 16, &mut meta, &mut |_, _, _| Ok(()))?;
        btree::count_refs(tm, overflow, 4, &mut meta, &mut |_, _, _| Ok(()))?;
        let (meta_bitmaps, meta_index, meta_overflow) = tm.sm.own_blocks();
        btree::count_refs(tm, meta_overflow, 4, &mut meta, &mut |_, _, _| Ok(()))?;
        for b in bitmaps.into_iter().chain(meta_bitmaps).chain([meta_index]) {
            *meta.entry(b).or_default() += 1;
        }
        let compare = |what: &str,
                       nr: u64,
                       refs: &HashMap<u64, u32>,
                       count: &dyn Fn(u64) -> udm_pdata::Result<u32>| {
            if let Some(b) = refs.keys().find(|&&b| b >= nr) {
                return Err(bad(format!(
                    "{what} block {b} is referenced but beyond the device"
                )));
            }
            for b in 0..nr {
                let (have, want) = (count(b)?, refs.get(&b).copied().unwrap_or(0));
                if have != want {
                    return Err(bad(format!(
                        "{what} block {b} is counted {have} times, referenced {want}"
                    )));
                }
            }
            Ok(())
        };
        let counts = &self.tm.sm.counts;
        compare("metadata", counts.nr_blocks(), &meta, &|b| counts.get(b))?;
        let counts = &self.data_sm.counts;
        compare("data", counts.nr_blocks(), &data, &|b| counts.get(b))
    }

    /// The mapped runs of `[begin, end)` of `dev`: (virtual block, data
    /// block, length), each run consecutive in both, for allocation maps.
    pub fn mapped_ranges(
        &mut self,
        dev: u32,
        begin: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64)>, Error> {
        let sub = self.subtree(dev)?;
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        btree::range(&mut self.tm, sub, begin, end, 8, &mut |k, v| {
            let b = le64(v) >> 24;
            match runs.last_mut() {
                Some((vb, db, len))
                    if vb.checked_add(*len) == Some(k) && db.checked_add(*len) == Some(b) =>
                {
                    *len += 1
                }
                _ => runs.push((k, b, 1)),
            }
            Ok(())
        })?;
        Ok(runs)
    }
}
