//! The metadata space map (dm-space-map-metadata.c): counts the metadata
//! device's own blocks, its index one block of up to 255 bitmap entries.
//!
//! dm's version must allocate while it is being changed (a new bitmap
//! block changes a bitmap), and queues those recursive operations. Here
//! the counts live in memory through the transaction; the commit writes
//! the overflow tree, takes a new index block, then gives every changed
//! bitmap a new block until no allocation changes a bitmap that has not
//! got one yet (each bitmap moves once, so this ends), and only then
//! encodes the bitmaps and the index.

use std::collections::BTreeMap;
use std::sync::Arc;

use udm_core::Error;

use super::{le32, load_error, Counts, IndexEntry, SmRoot, ENTRIES_PER_BITMAP};
use crate::block::{zeroed, Block};
use crate::btree::{self, NoRefs};
use crate::checksum::BlockKind;
use crate::tm::{put64, Tm};
use crate::{corrupt, Result};

/// The index block's capacity (`MAX_METADATA_BITMAPS`).
pub const MAX_BITMAPS: usize = 255;
/// The most metadata blocks the map can count (255 bitmaps' worth, 15.8 GiB).
pub const MAX_BLOCKS: u64 = MAX_BITMAPS as u64 * ENTRIES_PER_BITMAP;

/// The metadata space map.
pub struct MetadataSpaceMap {
    /// The counts.
    pub counts: Counts,
    locations: Vec<u64>,
    index_block: u64,
    ref_count_root: u64,
}

impl MetadataSpaceMap {
    /// A map that counts nothing, for a [`Tm`] before its map is loaded.
    pub fn placeholder() -> MetadataSpaceMap {
        MetadataSpaceMap {
            counts: Counts::new(0, "metadata"),
            locations: Vec::new(),
            index_block: 0,
            ref_count_root: 0,
        }
    }

    /// A new map of `nr_blocks` with the superblock at `superblock`
    /// referenced. Call [`format_finish`] once it is in its [`Tm`].
    pub fn format(nr_blocks: u64, superblock: u64) -> Result<MetadataSpaceMap> {
        if nr_blocks > MAX_BLOCKS {
            return Err(Error::invalid(format!(
                "metadata space map: {nr_blocks} blocks, at most {MAX_BLOCKS}"
            )));
        }
        let mut counts = Counts::new(nr_blocks, "metadata");
        counts.inc(superblock)?;
        let pages = counts.nr_pages();
        Ok(MetadataSpaceMap {
            counts,
            locations: vec![0; pages],
            index_block: 0,
            ref_count_root: 0,
        })
    }

    /// The blocks the map itself lives in as of its last commit: its
    /// bitmaps, its index block and its overflow tree's root.
    pub fn own_blocks(&self) -> (Vec<u64>, u64, u64) {
        (
            self.locations.clone(),
            self.index_block,
            self.ref_count_root,
        )
    }

    /// Grows the map to `nr_blocks`.
    pub fn extend(&mut self, nr_blocks: u64) -> Result<()> {
        if nr_blocks > MAX_BLOCKS {
            return Err(Error::invalid(format!(
                "metadata space map: {nr_blocks} blocks, at most {MAX_BLOCKS}"
            )));
        }
        self.counts.extend(nr_blocks);
        self.locations.resize(self.counts.nr_pages(), 0);
        Ok(())
    }
}

/// Gives a new map its (empty) overflow tree.
pub fn format_finish(tm: &mut Tm) -> Result<()> {
    tm.sm.ref_count_root = btree::empty(tm, 4)?;
    Ok(())
}

/// Loads the map at `root` (from the superblock) into `tm`.
pub fn load(tm: &mut Tm, root: &SmRoot) -> Result<()> {
    let what = "metadata";
    if root.nr_blocks > MAX_BLOCKS || root.nr_blocks > tm.device_blocks() {
        return Err(Error::invalid(format!(
            "metadata space map counts {} blocks, the device has {}",
            root.nr_blocks,
            tm.device_blocks()
        )));
    }
    let index = tm.read(root.bitmap_root, BlockKind::Index)?;
    let pages = root.nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize;
    let mut locations = Vec::with_capacity(pages);
    let mut bitmaps: Vec<Arc<Block>> = Vec::with_capacity(pages);
    for p in 0..pages {
        let e = IndexEntry::decode(&index[16 + 16 * p..32 + 16 * p]);
        let b = tm
            .read(e.blocknr, BlockKind::Bitmap)
            .map_err(|err| load_error(what, root.bitmap_root, err))?;
        locations.push(e.blocknr);
        bitmaps.push(b);
    }
    let mut overflow = BTreeMap::new();
    btree::range(tm, root.ref_count_root, 0, u64::MAX, 4, &mut |k, v| {
        overflow.insert(k, le32(v));
        Ok(())
    })?;
    let counts = Counts::load(root.nr_blocks, &bitmaps, overflow, what)?;
    tm.sm = MetadataSpaceMap {
        counts,
        locations,
        index_block: root.bitmap_root,
        ref_count_root: root.ref_count_root,
    };
    Ok(())
}

/// Writes the map's changes into the transaction (see the module's docs);
/// returns its new root. Nothing may allocate after this until the commit.
pub fn commit(tm: &mut Tm) -> Result<SmRoot> {
    // Overflow counts first: the tree's changes allocate and free blocks,
    // but only ever between counts 0 and 1, so they touch no overflow count.
    loop {
        let touched = tm.sm.counts.take_touched();
        if touched.is_empty() {
            break;
        }
        let mut root = tm.sm.ref_count_root;
        for (b, n) in touched {
            root = match n {
                Some(n) => btree::insert(tm, &mut NoRefs(4), root, b, &n.to_le_bytes())?.0,
                None => btree::remove(tm, &mut NoRefs(4), root, b)?.0,
            };
        }
        tm.sm.ref_count_root = root;
    }
    let index = if tm.sm.index_block == 0 {
        tm.new_block(BlockKind::Index)?
    } else {
        tm.shadow(tm.sm.index_block, BlockKind::Index)?.0
    };
    tm.sm.index_block = index;
    let pages = tm.sm.counts.nr_pages();
    if pages > MAX_BITMAPS {
        return Err(corrupt(index, "metadata space map has too many bitmaps"));
    }
    let mut moved = vec![false; pages];
    loop {
        let mut any = false;
        for (p, moved) in moved.iter_mut().enumerate() {
            if *moved || !(tm.sm.counts.page_dirty(p) || tm.sm.locations[p] == 0) {
                continue;
            }
            let old = tm.sm.locations[p];
            let new = tm.new_block(BlockKind::Bitmap)?;
            if old != 0 {
                tm.dec(old)?;
            }
            tm.sm.locations[p] = new;
            *moved = true;
            any = true;
        }
        if !any {
            break;
        }
    }
    let mut ib = zeroed();
    for p in 0..pages {
        let (nr_free, none_free_before) = tm.sm.counts.page_free(p);
        let e = IndexEntry {
            blocknr: tm.sm.locations[p],
            nr_free,
            none_free_before,
        };
        ib[16 + 16 * p..32 + 16 * p].copy_from_slice(&e.encode());
        if moved[p] {
            let mut b = zeroed();
            tm.sm.counts.encode_page(p, &mut b);
            put64(&mut b, 8, tm.sm.locations[p]);
            tm.put(tm.sm.locations[p], BlockKind::Bitmap, b);
        }
    }
    tm.put(index, BlockKind::Index, ib);
    Ok(SmRoot {
        nr_blocks: tm.sm.counts.nr_blocks(),
        nr_allocated: tm.sm.counts.nr_allocated(),
        bitmap_root: index,
        ref_count_root: tm.sm.ref_count_root,
    })
}
