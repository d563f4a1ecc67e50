//! The disk space map (dm-space-map-disk.c): counts another device's
//! blocks (a thin pool's data blocks), its index a B-tree from bitmap
//! number to [`IndexEntry`], its bitmaps and B-trees on the metadata device.

use std::collections::BTreeMap;
use std::sync::Arc;

use udm_core::Error;

use super::{le32, load_error, Counts, IndexEntry, SmRoot, ENTRIES_PER_BITMAP};
use crate::block::{zeroed, Block};
use crate::btree::{self, NoRefs};
use crate::checksum::BlockKind;
use crate::tm::Tm;
use crate::Result;

/// The disk space map.
pub struct DiskSpaceMap {
    /// The counts.
    pub counts: Counts,
    locations: Vec<u64>,
    index_root: u64,
    ref_count_root: u64,
}

impl DiskSpaceMap {
    /// A new map of `nr_blocks`, its (empty) trees made in `tm`.
    pub fn format(tm: &mut Tm, nr_blocks: u64) -> Result<DiskSpaceMap> {
        let counts = Counts::new(nr_blocks, "data");
        Ok(DiskSpaceMap {
            locations: vec![0; counts.nr_pages()],
            counts,
            index_root: btree::empty(tm, 16)?,
            ref_count_root: btree::empty(tm, 4)?,
        })
    }

    /// Loads the map at `root`.
    pub fn load(tm: &mut Tm, root: &SmRoot) -> Result<DiskSpaceMap> {
        let what = "data";
        let pages = root.nr_blocks.div_ceil(ENTRIES_PER_BITMAP);
        let mut entries = Vec::new();
        btree::range(tm, root.bitmap_root, 0, u64::MAX, 16, &mut |k, v| {
            entries.push((k, IndexEntry::decode(v)));
            Ok(())
        })?;
        if entries.len() as u64 != pages || entries.iter().enumerate().any(|(i, e)| e.0 != i as u64)
        {
            return Err(Error::invalid(format!(
                "data space map: its index does not hold bitmaps 0..{pages}"
            )));
        }
        let mut bitmaps: Vec<Arc<Block>> = Vec::with_capacity(entries.len());
        for (_, e) in &entries {
            let b = tm
                .read(e.blocknr, BlockKind::Bitmap)
                .map_err(|err| load_error(what, e.blocknr, err))?;
            bitmaps.push(b);
        }
        let mut overflow = BTreeMap::new();
        btree::range(tm, root.ref_count_root, 0, u64::MAX, 4, &mut |k, v| {
            overflow.insert(k, le32(v));
            Ok(())
        })?;
        Ok(DiskSpaceMap {
            counts: Counts::load(root.nr_blocks, &bitmaps, overflow, what)?,
            locations: entries.iter().map(|(_, e)| e.blocknr).collect(),
            index_root: root.bitmap_root,
            ref_count_root: root.ref_count_root,
        })
    }

    /// Grows the map to `nr_blocks`.
    pub fn extend(&mut self, nr_blocks: u64) {
        self.counts.extend(nr_blocks);
        self.locations.resize(self.counts.nr_pages(), 0);
    }

    /// Writes the changed bitmaps, index entries and overflow counts into
    /// the transaction; returns the new root. Call [`DiskSpaceMap::committed`]
    /// once the transaction is on disk.
    pub fn commit(&mut self, tm: &mut Tm) -> Result<SmRoot> {
        for (b, n) in self.counts.take_touched() {
            self.ref_count_root = match n {
                Some(n) => {
                    btree::insert(tm, &mut NoRefs(4), self.ref_count_root, b, &n.to_le_bytes())?.0
                }
                None => btree::remove(tm, &mut NoRefs(4), self.ref_count_root, b)?.0,
            };
        }
        for p in 0..self.counts.nr_pages() {
            if !self.counts.page_dirty(p) && self.locations[p] != 0 {
                continue;
            }
            let new = tm.new_block(BlockKind::Bitmap)?;
            if self.locations[p] != 0 {
                tm.dec(self.locations[p])?;
            }
            self.locations[p] = new;
            let mut b = zeroed();
            self.counts.encode_page(p, &mut b);
            tm.put(new, BlockKind::Bitmap, b);
            let (nr_free, none_free_before) = self.counts.page_free(p);
            let e = IndexEntry {
                blocknr: new,
                nr_free,
                none_free_before,
            };
            self.index_root =
                btree::insert(tm, &mut NoRefs(16), self.index_root, p as u64, &e.encode())?.0;
        }
        Ok(SmRoot {
            nr_blocks: self.counts.nr_blocks(),
            nr_allocated: self.counts.nr_allocated(),
            bitmap_root: self.index_root,
            ref_count_root: self.ref_count_root,
        })
    }

    /// The blocks the map itself lives in as of its last commit: its
    /// bitmaps, and the roots of its index and overflow trees.
    pub fn own_blocks(&self) -> (Vec<u64>, u64, u64) {
        (self.locations.clone(), self.index_root, self.ref_count_root)
    }

    /// The transaction is on disk: its counts are the committed ones.
    pub fn committed(&mut self) {
        self.counts.committed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::MemIo;
    use crate::tm::get64;

    /// Commits `sm` with a test superblock holding both maps' roots.
    fn commit(tm: &mut Tm, sm: &mut DiskSpaceMap) {
        let data = sm.commit(tm).unwrap().encode();
        tm.commit(0, |meta| {
            let mut b = crate::block::zeroed();
            b[16..144].copy_from_slice(meta);
            b[144..272].copy_from_slice(&data);
            b
        })
        .unwrap();
        sm.committed();
    }

    fn reopen(io: &MemIo) -> (Tm, DiskSpaceMap) {
        let mut raw = crate::block::zeroed();
        crate::block::BlockIo::read(&mut io.clone(), 0, &mut raw).unwrap();
        let mut tm = Tm::open(Box::new(io.clone()), &SmRoot::decode(&raw[16..48])).unwrap();
        let sm = DiskSpaceMap::load(&mut tm, &SmRoot::decode(&raw[144..176])).unwrap();
        (tm, sm)
    }

    #[test]
    fn counts_survive_commit_and_reload_across_bitmaps_and_overflow() {
        let io = MemIo::new(2048);
        let mut tm = Tm::format(Box::new(io.clone()), 2048).unwrap();
        let nr = 3 * ENTRIES_PER_BITMAP + 100;
        let mut sm = DiskSpaceMap::format(&mut tm, nr).unwrap();
        let mut model = vec![0u32; nr as usize];
        let mut rng = 77u64;
        for round in 0..6 {
            for _ in 0..5000 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let b = rng % nr;
                let n = [0, 1, 2, 3, 7, 70000][(rng >> 40) as usize % 6];
                sm.counts.set(b, n).unwrap();
                model[b as usize] = n;
            }
            commit(&mut tm, &mut sm);
            if round % 2 == 1 {
                (tm, sm) = reopen(&io);
            }
            for (b, n) in model.iter().enumerate() {
                assert_eq!(
                    sm.counts.get(b as u64).unwrap(),
                    *n,
                    "block {b} in round {round}"
                );
            }
            let used = model.iter().filter(|n| **n > 0).count() as u64;
            assert_eq!(sm.counts.nr_allocated(), used);
        }
        // The superblock's own record of the metadata map is consistent.
        let sb = tm.read(0, BlockKind::Superblock).unwrap();
        assert_eq!(get64(&sb, 16), 2048);
    }
}
