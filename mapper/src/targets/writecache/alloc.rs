//! Free cache blocks, kept as extents (runs of consecutive free blocks).
//!
//! dm-writecache keeps its free SSD blocks in an rbtree of single blocks and
//! takes the next one after the last; the seed patch extends a write while
//! the following block happens to be free too. Its reviewer's worry: once
//! the cache has aged, consecutive free blocks become rare and the writes
//! small again. Here free space is a set of extents, indexed both by start
//! (to coalesce a freed run with its neighbours) and by size (to find a run
//! big enough). A request takes the *smallest* extent that holds it whole
//! (best fit: small holes are used up by small writes, big extents stay big
//! for big writes), or, when none is big enough, the largest there is.
//! Freed runs merge with adjacent free space at once, so written-back space
//! returns as one extent however it was split.

use std::collections::{BTreeMap, BTreeSet};

/// Free cache blocks as extents. Block numbers are cache block indexes.
#[derive(Debug, Default)]
pub(crate) struct FreeExtents {
    /// start → length.
    by_start: BTreeMap<u32, u32>,
    /// (length, start), for best-fit lookups.
    by_size: BTreeSet<(u32, u32)>,
    free: u64,
    /// Where the next allocation starts looking (just past the last one).
    cursor: u32,
}

impl FreeExtents {
    /// No free blocks.
    pub fn new() -> FreeExtents {
        FreeExtents::default()
    }

    /// Free blocks in total.
    pub fn free_blocks(&self) -> u64 {
        self.free
    }

    /// How many extents the free space is in.
    #[cfg(test)]
    pub fn extents(&self) -> usize {
        self.by_start.len()
    }

    /// The longest free extent.
    #[cfg(test)]
    pub fn largest(&self) -> u32 {
        self.by_size.iter().next_back().map_or(0, |&(l, _)| l)
    }

    fn insert(&mut self, start: u32, len: u32) {
        self.by_start.insert(start, len);
        self.by_size.insert((len, start));
    }

    fn remove(&mut self, start: u32, len: u32) {
        self.by_start.remove(&start);
        self.by_size.remove(&(len, start));
    }

    /// Takes up to `want` consecutive blocks (at least one, if any is free).
    /// Returns the first block and how many were taken.
    ///
    /// Next fit, like a log: the first extent from the cursor on (wrapping)
    /// that holds `want` whole, looking at a bounded number of extents;
    /// failing that, the smallest extent that holds it anywhere; failing
    /// that, the largest. Blocks written together thus lie together, and
    /// writeback (oldest first) frees whole regions, which coalesce back
    /// into large extents; small holes left by overwrites are skipped by
    /// large writes until their neighbours are freed and they merge.
    pub fn alloc(&mut self, want: u32) -> Option<(u32, u32)> {
        if want == 0 || self.free == 0 {
            return None;
        }
        const LOOK: usize = 64;
        let found = self
            .by_start
            .range(self.cursor..)
            .chain(self.by_start.range(..self.cursor))
            .take(LOOK)
            .find(|(_, &l)| l >= want)
            .map(|(&s, &l)| (l, s));
        let (len, start) = match found {
            Some(x) => x,
            None => match self.by_size.range((want, 0)..).next() {
                Some(&x) => x,
                None => *self.by_size.iter().next_back()?,
            },
        };
        self.remove(start, len);
        let take = len.min(want);
        if take < len {
            self.insert(start + take, len - take);
        }
        self.free -= take as u64;
        self.cursor = start + take;
        Some((start, take))
    }

    /// Returns `len` blocks from `start` to the free space, merging them
    /// with free neighbours. The blocks must not be free already.
    pub fn free(&mut self, mut start: u32, mut len: u32) {
        if len == 0 {
            return;
        }
        self.free += len as u64;
        if let Some((&ps, &pl)) = self.by_start.range(..start).next_back() {
            debug_assert!(ps + pl <= start, "double free of cache block {start}");
            if ps + pl == start {
                self.remove(ps, pl);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.by_start.get(&(start + len)) {
            self.remove(start + len, nl);
            len += nl;
        }
        self.insert(start, len);
    }

    /// Whether block `b` is free.
    #[cfg(test)]
    pub fn is_free(&self, b: u32) -> bool {
        self.by_start
            .range(..=b)
            .next_back()
            .is_some_and(|(&s, &l)| b < s + l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small PRNG (splitmix64) so the aging tests are reproducible.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }

    #[test]
    fn frees_coalesce_with_both_neighbours() {
        let mut f = FreeExtents::new();
        f.free(0, 4);
        f.free(8, 4);
        assert_eq!(f.extents(), 2);
        f.free(4, 4);
        assert_eq!(f.extents(), 1);
        assert_eq!(f.largest(), 12);
        assert_eq!(f.free_blocks(), 12);
    }

    #[test]
    fn next_fit_skips_holes_too_small() {
        let mut f = FreeExtents::new();
        f.free(0, 100);
        f.free(200, 3);
        assert_eq!(f.alloc(50), Some((0, 50)));
        assert_eq!(
            f.alloc(20),
            Some((50, 20)),
            "next fit: right after the last"
        );
        assert_eq!(f.alloc(40), Some((70, 30)), "partial when nothing fits");
        assert_eq!(f.alloc(2), Some((200, 2)));
        assert_eq!(f.alloc(1), Some((202, 1)));
        assert_eq!(f.alloc(1), None);
        // Freed in pieces, the space comes back as one extent.
        f.free(0, 50);
        f.free(70, 30);
        f.free(50, 20);
        assert_eq!(f.extents(), 1);
        assert_eq!(f.alloc(100), Some((0, 100)));
        // A hole too small for a large write is skipped, not split into.
        f.free(10, 2);
        f.free(40, 60);
        assert_eq!(
            f.alloc(8),
            Some((40, 8)),
            "first fit from the cursor, wrapping"
        );
    }

    /// Simulates the writecache's life, block by block as the engine does:
    /// large writes take runs of blocks, random single-block overwrites move
    /// a block elsewhere (its old copy is freed), and writeback frees the
    /// oldest blocks first, down to the low watermark — many times over.
    /// Returns the share of `want`-block writes that still get one extent
    /// afterwards, as the cache fills from the low watermark to well past
    /// the high one (writeback keeps it in between in steady state).
    fn age(n: u32, want: u32, passes: usize, seed: u64) -> f64 {
        let mut f = FreeExtents::new();
        f.free(0, n);
        let mut rng = Rng(seed);
        let mut clock = 0u64;
        let mut birth = vec![u64::MAX; n as usize];
        // (birth, block): the writeback order, oldest first.
        let mut lru: BTreeSet<(u64, u32)> = BTreeSet::new();
        let take = |f: &mut FreeExtents,
                    lru: &mut BTreeSet<(u64, u32)>,
                    birth: &mut Vec<u64>,
                    clock: u64,
                    w: u32| {
            let mut left = w;
            while left > 0 {
                let Some((s, l)) = f.alloc(left) else { break };
                for b in s..s + l {
                    birth[b as usize] = clock;
                    lru.insert((clock, b));
                }
                left -= l;
            }
        };
        for _ in 0..passes {
            // Fill to the high watermark with large writes.
            while f.free_blocks() > n as u64 / 2 {
                clock += 1;
                take(&mut f, &mut lru, &mut birth, clock, want);
            }
            // Random single-block overwrites of cached blocks.
            for _ in 0..n / 8 {
                let b = (rng.next() % n as u64) as u32;
                if birth[b as usize] == u64::MAX {
                    continue;
                }
                lru.remove(&(birth[b as usize], b));
                birth[b as usize] = u64::MAX;
                f.free(b, 1);
                clock += 1;
                take(&mut f, &mut lru, &mut birth, clock, 1);
            }
            // Write back oldest first, to the low watermark.
            while f.free_blocks() < n as u64 * 55 / 100 {
                let Some((_, b)) = lru.pop_first() else { break };
                birth[b as usize] = u64::MAX;
                f.free(b, 1);
            }
        }
        let (mut writes, mut whole) = (0u64, 0u64);
        while f.free_blocks() > n as u64 * 35 / 100 {
            writes += 1;
            let (_, l) = f.alloc(want).expect("free space");
            if l == want {
                whole += 1;
            } else {
                let _ = f.alloc(want - l);
            }
        }
        whole as f64 / writes as f64
    }

    #[test]
    fn writes_stay_large_as_the_cache_ages() {
        // 64 Ki blocks (a 256 MiB cache of 4 KiB blocks), 512 KiB writes =
        // 128 blocks, 20 fill/overwrite/writeback cycles.
        for seed in 1..=3 {
            let whole = age(65536, 128, 20, seed);
            assert!(
                whole > 0.95,
                "seed {seed}: only {whole:.2} of large writes got one extent"
            );
        }
    }

    #[test]
    fn every_block_is_handed_out_once() {
        let mut f = FreeExtents::new();
        f.free(0, 1000);
        let mut rng = Rng(7);
        let mut owned = vec![false; 1000];
        let mut held = Vec::new();
        for _ in 0..20_000 {
            if rng.next().is_multiple_of(2) {
                if let Some((s, l)) = f.alloc(1 + (rng.next() % 40) as u32) {
                    for b in s..s + l {
                        assert!(!owned[b as usize], "block {b} handed out twice");
                        owned[b as usize] = true;
                    }
                    held.push((s, l));
                }
            } else if !held.is_empty() {
                let (s, l) = held.swap_remove((rng.next() % held.len() as u64) as usize);
                for b in s..s + l {
                    owned[b as usize] = false;
                }
                f.free(s, l);
            }
            let used = owned.iter().filter(|&&o| o).count() as u64;
            assert_eq!(f.free_blocks() + used, 1000);
        }
        for (s, l) in held {
            f.free(s, l);
        }
        assert_eq!(f.extents(), 1, "all space coalesces back into one extent");
        assert!(f.is_free(999));
    }
}
