//! Space maps: a reference count per block, as dm keeps them on disk
//! (`dm-space-map-common.c`): bitmap blocks of 2-bit counts (0, 1, 2, and
//! 3 for "look in the overflow tree"), an index of those bitmaps, and a
//! B-tree of 32-bit counts for blocks referenced three times or more.
//!
//! [`Counts`] holds a space map's counts in memory, as its bitmap words,
//! loaded at open and written back at commit: the bitmaps are 1/16320 of
//! the blocks they count, and holding them makes the metadata space map's
//! recursion (allocating a block for a bitmap changes a bitmap) a loop
//! at commit instead of a reentrant allocator. [`disk::DiskSpaceMap`]
//! (data blocks; its index is a B-tree) and [`metadata::MetadataSpaceMap`]
//! (metadata blocks; its index is one block) store them.

pub mod disk;
pub mod metadata;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use udm_core::Error;

use crate::block::Block;
use crate::{corrupt, no_space, Result, BLOCK_SIZE};

/// Blocks counted by one bitmap block (4080 bytes of 2-bit entries).
pub const ENTRIES_PER_BITMAP: u64 = ((BLOCK_SIZE - BITMAP_HEADER) * 4) as u64;
const BITMAP_HEADER: usize = 16;
const WORDS: usize = (BLOCK_SIZE - BITMAP_HEADER) / 8;
const LOW_BITS: u64 = 0x5555_5555_5555_5555;

/// One bitmap's 64-bit words as on disk: entry `i` of a word has its high
/// bit at bit `2i` and its low bit at bit `2i + 1` (dm's `test_bit_le`
/// order), so count 1 is bit `2i + 1` alone.
pub type Page = [u64; WORDS];

/// One index entry as stored on disk (`struct disk_index_entry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// Where the bitmap lives.
    pub blocknr: u64,
    /// Free entries in the bitmap (over the whole bitmap, as dm counts).
    pub nr_free: u32,
    /// No entry before this one is free.
    pub none_free_before: u32,
}

impl IndexEntry {
    /// Its 16 bytes on disk.
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.blocknr.to_le_bytes());
        b[8..12].copy_from_slice(&self.nr_free.to_le_bytes());
        b[12..].copy_from_slice(&self.none_free_before.to_le_bytes());
        b
    }
    /// Decodes 16 bytes.
    pub fn decode(b: &[u8]) -> IndexEntry {
        IndexEntry {
            blocknr: le64(&b[..8]),
            nr_free: le32(&b[8..12]),
            none_free_before: le32(&b[12..16]),
        }
    }
}

/// A space map's on-disk root (`struct disk_sm_root`), 32 of the 128 bytes
/// the superblock keeps for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmRoot {
    /// Blocks counted.
    pub nr_blocks: u64,
    /// Blocks with a count above zero.
    pub nr_allocated: u64,
    /// The index: a B-tree root (data) or the index block (metadata).
    pub bitmap_root: u64,
    /// The overflow counts' B-tree.
    pub ref_count_root: u64,
}

impl SmRoot {
    /// The 128 bytes the superblock holds (the rest zero).
    pub fn encode(&self) -> [u8; 128] {
        let mut b = [0u8; 128];
        b[..8].copy_from_slice(&self.nr_blocks.to_le_bytes());
        b[8..16].copy_from_slice(&self.nr_allocated.to_le_bytes());
        b[16..24].copy_from_slice(&self.bitmap_root.to_le_bytes());
        b[24..32].copy_from_slice(&self.ref_count_root.to_le_bytes());
        b
    }
    /// Decodes the first 32 of those bytes.
    pub fn decode(b: &[u8]) -> SmRoot {
        SmRoot {
            nr_blocks: le64(&b[..8]),
            nr_allocated: le64(&b[8..16]),
            bitmap_root: le64(&b[16..24]),
            ref_count_root: le64(&b[24..32]),
        }
    }
}

pub(crate) fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

pub(crate) fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn entry(w: u64, i: u64) -> u32 {
    let hi = (w >> (2 * i)) & 1;
    let lo = (w >> (2 * i + 1)) & 1;
    (hi << 1 | lo) as u32
}

fn with_entry(w: u64, i: u64, v: u32) -> u64 {
    let cleared = w & !(3 << (2 * i));
    let hi = u64::from(v >> 1 & 1) << (2 * i);
    let lo = u64::from(v & 1) << (2 * i + 1);
    cleared | hi | lo
}

/// Bit `2i` set for each entry `i` of `w` that is not zero.
fn used_mask(w: u64) -> u64 {
    (w | w >> 1) & LOW_BITS
}

/// A space map's counts, in memory, with the counts of its last commit
/// beside them: a block freed in this transaction is not handed out again
/// before the commit, since the committed metadata may still point at it
/// (dm's `sm_ll_find_common_free_block` over the old and new maps).
pub struct Counts {
    nr_blocks: u64,
    pages: Vec<Arc<Page>>,
    old: Vec<Arc<Page>>,
    overflow: BTreeMap<u64, u32>,
    touched: BTreeSet<u64>,
    nr_allocated: u64,
    /// Blocks free now and at the last commit: what [`Counts::alloc`] can hand out.
    nr_allocatable: u64,
    hint: u64,
    what: &'static str,
}

impl Counts {
    /// `nr_blocks` blocks, all free; `what` names the map in errors.
    pub fn new(nr_blocks: u64, what: &'static str) -> Counts {
        let mut c = Counts {
            nr_blocks: 0,
            pages: Vec::new(),
            old: Vec::new(),
            overflow: BTreeMap::new(),
            touched: BTreeSet::new(),
            nr_allocated: 0,
            nr_allocatable: 0,
            hint: 0,
            what,
        };
        c.extend(nr_blocks);
        c.old = c.pages.clone();
        c
    }

    /// Counts loaded from disk: the bitmap blocks' bytes and the overflow
    /// tree's entries. Errors if a bitmap entry says "overflow" without an
    /// overflow count (or the counts disagree).
    pub fn load(
        nr_blocks: u64,
        bitmaps: &[Arc<Block>],
        overflow: BTreeMap<u64, u32>,
        what: &'static str,
    ) -> Result<Counts> {
        let want = nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize;
        if bitmaps.len() != want {
            return Err(Error::invalid(format!(
                "{what} space map: {} bitmaps for {nr_blocks} blocks",
                bitmaps.len()
            )));
        }
        let mut pages = Vec::with_capacity(want);
        let mut nr_allocated = 0;
        let mut nr_overflow = 0u64;
        for (i, b) in bitmaps.iter().enumerate() {
            let mut p = [0u64; WORDS];
            for (w, word) in p.iter_mut().enumerate() {
                let off = BITMAP_HEADER + 8 * w;
                *word = le64(&b[off..off + 8]);
            }
            // Entries past the end of the map do not count.
            let base = i as u64 * ENTRIES_PER_BITMAP;
            for (w, word) in p.iter().enumerate() {
                let first = base + 32 * w as u64;
                if first >= nr_blocks {
                    break;
                }
                let mut m = used_mask(*word);
                let mut three = *word & (*word >> 1) & LOW_BITS;
                if nr_blocks - first < 32 {
                    let keep = (1u64 << (2 * (nr_blocks - first))) - 1;
                    m &= keep;
                    three &= keep;
                }
                nr_allocated += u64::from(m.count_ones());
                nr_overflow += u64::from(three.count_ones());
            }
            pages.push(Arc::new(p));
        }
        if nr_overflow != overflow.len() as u64 {
            return Err(Error::invalid(format!(
                "{what} space map: {nr_overflow} bitmap entries overflow, {} overflow counts",
                overflow.len()
            )));
        }
        let c = Counts {
            nr_blocks,
            old: pages.clone(),
            pages,
            overflow,
            touched: BTreeSet::new(),
            nr_allocated,
            nr_allocatable: nr_blocks - nr_allocated,
            hint: 0,
            what,
        };
        for (&b, &n) in &c.overflow {
            if b >= nr_blocks || n < 3 || c.entry(b) != 3 {
                return Err(Error::invalid(format!(
                    "{what} space map: overflow count {n} for block {b} disagrees with its bitmap"
                )));
            }
        }
        Ok(c)
    }

    fn entry(&self, b: u64) -> u32 {
        let (p, w, i) = Self::place(b);
        entry(self.pages[p][w], i)
    }

    fn place(b: u64) -> (usize, usize, u64) {
        let p = (b / ENTRIES_PER_BITMAP) as usize;
        let e = b % ENTRIES_PER_BITMAP;
        (p, (e / 32) as usize, e % 32)
    }

    fn check(&self, b: u64) -> Result<()> {
        if b >= self.nr_blocks {
            return Err(Error::invalid(format!(
                "{} space map: block {b} is beyond its {} blocks",
                self.what, self.nr_blocks
            )));
        }
        Ok(())
    }

    /// Blocks counted.
    pub fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }

    /// Blocks with a count above zero.
    pub fn nr_allocated(&self) -> u64 {
        self.nr_allocated
    }

    /// Blocks [`Counts::alloc`] can hand out before the commit: free now
    /// and at the last commit (blocks freed since are not).
    pub fn nr_allocatable(&self) -> u64 {
        self.nr_allocatable
    }

    /// Block `b`'s count.
    pub fn get(&self, b: u64) -> Result<u32> {
        self.check(b)?;
        match self.entry(b) {
            3 => self.overflow.get(&b).copied().ok_or_else(|| {
                Error::invalid(format!(
                    "{} space map: block {b} has no overflow count",
                    self.what
                ))
            }),
            v => Ok(v),
        }
    }

    /// Sets block `b`'s count.
    pub fn set(&mut self, b: u64, n: u32) -> Result<()> {
        let old = self.get(b)?;
        if old >= 3 || n >= 3 {
            self.touched.insert(b);
            if n >= 3 {
                self.overflow.insert(b, n);
            } else {
                self.overflow.remove(&b);
            }
        }
        let (p, w, i) = Self::place(b);
        let was_free = entry(self.old[p][w], i) == 0;
        let page = Arc::make_mut(&mut self.pages[p]);
        page[w] = with_entry(page[w], i, n.min(3));
        match (old, n) {
            (0, 1..) => {
                self.nr_allocated += 1;
                if was_free {
                    self.nr_allocatable -= 1;
                }
            }
            (1.., 0) => {
                self.nr_allocated -= 1;
                if was_free {
                    self.nr_allocatable += 1;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Adds a reference to `b`; returns the new count.
    pub fn inc(&mut self, b: u64) -> Result<u32> {
        let n = self.get(b)?.checked_add(1).ok_or_else(|| {
            Error::invalid(format!(
                "{} space map: block {b}'s count overflows",
                self.what
            ))
        })?;
        self.set(b, n)?;
        Ok(n)
    }

    /// Drops a reference to `b`; returns the new count. Dropping one from a
    /// free block means the metadata is inconsistent.
    pub fn dec(&mut self, b: u64) -> Result<u32> {
        let n = self.get(b)?;
        if n == 0 {
            return Err(Error::invalid(format!(
                "{} space map: block {b} is released more often than referenced",
                self.what
            )));
        }
        self.set(b, n - 1)?;
        Ok(n - 1)
    }

    /// A block free now and at the last commit, given a count of 1.
    pub fn alloc(&mut self) -> Result<u64> {
        let n = self.pages.len();
        if n == 0 {
            return Err(no_space(self.what));
        }
        let start = (self.hint / ENTRIES_PER_BITMAP) as usize % n;
        for k in 0..=n {
            let p = (start + k) % n;
            let first_word = if k == 0 {
                ((self.hint % ENTRIES_PER_BITMAP) / 32) as usize
            } else {
                0
            };
            for w in first_word..WORDS {
                let free = !(used_mask(self.pages[p][w]) | used_mask(self.old[p][w])) & LOW_BITS;
                if free == 0 {
                    continue;
                }
                let i = u64::from(free.trailing_zeros() / 2);
                let b = p as u64 * ENTRIES_PER_BITMAP + 32 * w as u64 + i;
                if b >= self.nr_blocks {
                    break;
                }
                self.set(b, 1)?;
                self.hint = b + 1;
                if self.hint >= self.nr_blocks {
                    self.hint = 0;
                }
                return Ok(b);
            }
        }
        Err(no_space(self.what))
    }

    /// Grows the map to `nr_blocks` (new blocks free).
    pub fn extend(&mut self, nr_blocks: u64) {
        if nr_blocks <= self.nr_blocks {
            return;
        }
        let want = nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize;
        while self.pages.len() < want {
            self.pages.push(Arc::new([0u64; WORDS]));
            // The old map gains the same (free) page: a fresh page is not
            // the old one, so it still reads as changed.
            self.old.push(Arc::new([0u64; WORDS]));
        }
        self.nr_allocatable += nr_blocks - self.nr_blocks;
        self.nr_blocks = nr_blocks;
    }

    /// How many bitmap pages there are.
    pub fn nr_pages(&self) -> usize {
        self.pages.len()
    }

    /// Whether page `p` changed since the last commit.
    pub fn page_dirty(&self, p: usize) -> bool {
        !Arc::ptr_eq(&self.pages[p], &self.old[p])
    }

    /// Page `p` as a bitmap block (its checksum and location set when written).
    pub fn encode_page(&self, p: usize, out: &mut Block) {
        out.fill(0);
        for (w, word) in self.pages[p].iter().enumerate() {
            let off = BITMAP_HEADER + 8 * w;
            out[off..off + 8].copy_from_slice(&word.to_le_bytes());
        }
    }

    /// Page `p`'s index entry fields: (free entries, first free entry).
    pub fn page_free(&self, p: usize) -> (u32, u32) {
        let mut nr_free = 0;
        let mut first = None;
        for (w, word) in self.pages[p].iter().enumerate() {
            let free = !used_mask(*word) & LOW_BITS;
            nr_free += free.count_ones();
            if first.is_none() && free != 0 {
                first = Some(32 * w as u32 + free.trailing_zeros() / 2);
            }
        }
        (nr_free, first.unwrap_or(ENTRIES_PER_BITMAP as u32))
    }

    /// The overflow counts changed since the last commit (and their current
    /// value, `None` when below 3 now); forgets them.
    pub fn take_touched(&mut self) -> Vec<(u64, Option<u32>)> {
        let t = std::mem::take(&mut self.touched);
        t.into_iter()
            .map(|b| (b, self.overflow.get(&b).copied()))
            .collect()
    }

    /// The counts become the committed ones.
    pub fn committed(&mut self) {
        self.old = self.pages.clone();
        self.nr_allocatable = self.nr_blocks - self.nr_allocated;
    }
}

pub(crate) fn load_error(what: &str, b: u64, e: Error) -> Error {
    corrupt(b, format!("{what} space map: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_go_through_the_bitmap_and_the_overflow_map() {
        let mut c = Counts::new(100, "test");
        for n in [1, 2, 3, 4, 70000, 2, 1, 0] {
            c.set(7, n).unwrap();
            assert_eq!(c.get(7).unwrap(), n);
        }
        assert_eq!(c.get(6).unwrap(), 0);
        assert_eq!(c.nr_allocated(), 0);
        assert!(c.dec(7).is_err());
        assert!(c.get(100).is_err());
    }

    #[test]
    fn count_one_is_the_low_bit_at_2i_plus_1() {
        let mut c = Counts::new(64, "test");
        c.set(0, 1).unwrap();
        c.set(1, 2).unwrap();
        c.set(2, 5).unwrap();
        let mut b = [0u8; BLOCK_SIZE];
        c.encode_page(0, &mut b);
        // entry 0 = 1: bit 1; entry 1 = 2: bit 2; entry 2 = 3: bits 4, 5.
        assert_eq!(le64(&b[16..24]), 0b11_01_10);
    }

    #[test]
    fn a_block_freed_in_a_transaction_is_reused_only_after_commit() {
        let mut c = Counts::new(3, "test");
        assert_eq!(c.alloc().unwrap(), 0);
        c.committed();
        c.dec(0).unwrap();
        assert_eq!(c.alloc().unwrap(), 1);
        assert_eq!(c.alloc().unwrap(), 2);
        let e = c.alloc().unwrap_err();
        assert!(crate::is_no_space(&e), "{e}");
        assert_eq!(c.nr_allocatable(), 0);
        c.committed();
        assert_eq!(c.nr_allocatable(), 1);
        assert_eq!(c.alloc().unwrap(), 0);
        assert_eq!(c.nr_allocated(), 3);
    }

    #[test]
    fn loading_what_was_encoded_gives_the_same_counts() {
        let mut c = Counts::new(ENTRIES_PER_BITMAP + 10, "test");
        for b in 0..ENTRIES_PER_BITMAP + 10 {
            c.set(b, (b % 5) as u32).unwrap();
        }
        let pages: Vec<Arc<Block>> = (0..c.nr_pages())
            .map(|p| {
                let mut b = [0u8; BLOCK_SIZE];
                c.encode_page(p, &mut b);
                Arc::new(b)
            })
            .collect();
        let l = Counts::load(c.nr_blocks(), &pages, c.overflow.clone(), "test").unwrap();
        for b in 0..ENTRIES_PER_BITMAP + 10 {
            assert_eq!(l.get(b).unwrap(), (b % 5) as u32);
        }
        assert_eq!(l.nr_allocated(), c.nr_allocated());
        assert!(Counts::load(c.nr_blocks(), &pages, BTreeMap::new(), "test").is_err());
    }
}
