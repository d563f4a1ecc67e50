//! The engine's map path: how a caller's read or write becomes sub-I/Os on
//! the cache and the origin, decided under the lock (cache hits and misses
//! as runs, new blocks allocated in extents, their entries and image
//! written in one pass).

use std::time::Instant;

use super::entry::{Entry, St, NONE};
use super::image::Image;
use super::meta::DiskEntry;
use super::state::{Shared, State};
use super::stream;

/// Sub-I/O kinds, in the top byte of a sub-bio's context word.
/// An overwrite in place of cached blocks.
pub(crate) const K_CACHE_WRITE: u64 = 1;
pub(crate) const K_CACHE_READ: u64 = 2;
pub(crate) const K_ORIGIN: u64 = 3;
/// The first write of newly allocated blocks.
pub(crate) const K_CACHE_NEW: u64 = 4;
/// Context bit: a cache write mapped in an odd generation.
pub(crate) const CTX_ODD: u64 = 1 << 55;

/// One I/O the engine issues for a caller's bio.
#[derive(Clone, Copy)]
pub(crate) struct Sub {
    /// Kind, and CTX_ODD for cache writes of an odd generation.
    pub kind: u64,
    /// First cache block (cache kinds) or origin block.
    pub block: u64,
    /// Offset in the caller's bio, in blocks.
    pub off: u64,
    /// Length in blocks.
    pub n: u64,
}

impl Sub {
    /// The context word of its bio: kind, generation parity, block.
    pub fn ctx(&self) -> u64 {
        (self.kind & 0xff) << 56 | self.kind >> 8 << 55 | self.block
    }
}

/// Read runs: cached blocks contiguous on the cache in one read, misses
/// contiguous on the origin in another.
///
/// Returns false, having issued and pinned nothing, when the read overlaps
/// a block whose first write has not completed: the block is mapped (so
/// later writes find it) but holds whatever it held before it was
/// allocated — another sector's data. The read waits for the write rather
/// than returning that (a read concurrent with a write may return the old
/// data or the new, never a third thing).
pub(crate) fn map_read(st: &mut State, ob0: u64, n: u64, subs: &mut Vec<Sub>) -> bool {
    let mut i = 0;
    while i < n {
        let b = st.map[(ob0 + i) as usize];
        let mut k = 1;
        if b != NONE {
            while i + k < n && st.map[(ob0 + i + k) as usize] == b + k as u32 {
                k += 1;
            }
            if st.any_unwritten(b, k as u32) {
                // Unpin what this read pinned so far.
                for s in subs.drain(..) {
                    if s.kind == K_CACHE_READ {
                        for e in &mut st.entries[s.block as usize..(s.block + s.n) as usize] {
                            e.reads -= 1;
                        }
                    }
                }
                return false;
            }
            for e in &mut st.entries[b as usize..(b as u64 + k) as usize] {
                e.reads += 1;
            }
            st.stats.read_hits += k;
            subs.push(Sub {
                kind: K_CACHE_READ,
                block: b as u64,
                off: i,
                n: k,
            });
        } else {
            while i + k < n && st.map[(ob0 + i + k) as usize] == NONE {
                k += 1;
            }
            subs.push(Sub {
                kind: K_ORIGIN,
                block: ob0 + i,
                off: i,
                n: k,
            });
        }
        i += k;
    }
    st.stats.reads += n;
    true
}

/// Write runs from block `from`; returns where it stopped (`n` when done,
/// less when the cache ran out of free blocks).
pub(crate) fn map_write(
    sh: &Shared,
    st: &mut State,
    ob0: u64,
    n: u64,
    mut i: u64,
    now: u32,
    subs: &mut Vec<Sub>,
) -> u64 {
    while i < n {
        let ob = ob0 + i;
        let b = st.map[ob as usize];
        if b != NONE && st.in_place_ok(b) {
            // Overwrite in place, as one I/O while the blocks lie
            // contiguously on the cache (dm commit ee50cc19).
            let mut k = 1;
            st.entries[b as usize].writes += 1;
            while i + k < n
                && st.map[(ob + k) as usize] == b + k as u32
                && st.in_place_ok(b + k as u32)
            {
                st.entries[(b + k as u32) as usize].writes += 1;
                k += 1;
            }
            st.stats.write_hits_uncommitted += k;
            st.stats.writes += k;
            subs.push(Sub {
                kind: K_CACHE_WRITE | st.write_started(),
                block: b as u64,
                off: i,
                n: k,
            });
            i += k;
            continue;
        }
        if b == NONE && st.cleaner && !st.shadowed(ob) {
            // The cleaner caches nothing new: straight to the origin —
            // unless an older entry for the block may still be on disk (its
            // free marker not durable yet), which a crash would bring back
            // over this write: that write goes to the cache, newer there.
            let mut k = 1;
            while i + k < n && st.map[(ob + k) as usize] == NONE && !st.shadowed(ob + k) {
                k += 1;
            }
            st.stats.writes_around += k;
            st.stats.writes += k;
            st.last_origin_write = Some(Instant::now());
            subs.push(Sub {
                kind: K_ORIGIN,
                block: ob,
                off: i,
                n: k,
            });
            i += k;
            continue;
        }
        // New blocks: as many as follow that need one, in as few extents
        // as the free space allows.
        let mut m = 1;
        let mut any_old = b != NONE;
        if !st.cleaner {
            // Uncached blocks all need one: find their run in bulk.
            m += unmapped_prefix(&st.map[(ob + 1) as usize..(ob0 + n) as usize]) as u64;
        }
        while i + m < n {
            let nb = st.map[(ob + m) as usize];
            let needs = if nb == NONE {
                !st.cleaner || st.shadowed(ob + m)
            } else {
                !st.in_place_ok(nb)
            };
            if !needs {
                break;
            }
            any_old |= nb != NONE;
            m += 1;
        }
        let want = if sh.cfg.nocoalesce { 1 } else { m as u32 };
        let Some((start, got)) = st.free.alloc(want) else {
            return i;
        };
        // The run is handled as one: superseded copies first (unlinking
        // them may move the LRU tail), then the new entries, written whole
        // and already linked to each other, then the run joins the tail.
        let mut superseded = 0u64;
        if any_old {
            for k in 0..got {
                let obk = ob + k as u64;
                let old = st.map[obk as usize];
                if old != NONE {
                    // The old copy stays on disk until this one is committed.
                    st.entries[old as usize].st = St::Superseded;
                    st.lru_remove(old);
                    st.push_superseded(old, start + k);
                    st.shadow_add(obk);
                    superseded += 1;
                }
            }
        }
        let last = start + got - 1;
        // Whole entries, already linked to each other, and their image
        // (published now, see `State::unwritten`), in one branch-free pass;
        // the run's ends are linked to the LRU list after it.
        let tail = st.lru_tail;
        let run = NewRun {
            start,
            got,
            ob,
            g: st.pending_gen,
            bss: sh.cfg.bs_sectors(),
            now,
        };
        let stm = &mut *st;
        // Streamed (and fenced inside, before the plain stores to the
        // run's ends below and the release of the lock that publishes the
        // run) when long enough.
        if got >= STREAM_MIN_RUN {
            fill_run::<true>(&mut stm.entries, &mut stm.image, run);
        } else {
            fill_run::<false>(&mut stm.entries, &mut stm.image, run);
        }
        st.image_changed(start, got, got as u64);
        st.set_unwritten(start, got, true);
        st.entries[start as usize].prev = tail;
        st.entries[last as usize].next = NONE;
        st.map[ob as usize..(ob + got as u64) as usize]
            .iter_mut()
            .zip(start..)
            .for_each(|(m, nb)| *m = nb);
        if tail == NONE {
            st.lru_head = start;
        } else {
            st.entries[tail as usize].next = start;
        }
        st.lru_tail = last;
        st.live += got as u64 - superseded;
        st.stats.write_hits_committed += superseded;
        st.stats.writes_allocate += got as u64 - superseded;
        st.stats.writes += got as u64;
        subs.push(Sub {
            kind: K_CACHE_NEW | st.write_started(),
            block: start as u64,
            off: i,
            n: got as u64,
        });
        i += got as u64;
    }
    n
}

/// New runs at least this long write their metadata with streaming stores
/// (see [`stream`]): 64 entries are 32 whole cache lines of entries and 16
/// of image. Shorter runs keep it in the cache, where a small write's
/// next access (its overwrite, its writeback) finds it; streaming them cost
/// a 4 KiB random overwrite a fifth of its rate.
const STREAM_MIN_RUN: u32 = 64;

/// A new run, as [`fill_run`] writes it: cache blocks `start..start + got`
/// caching origin blocks from `ob`, generation `g`, `bss` sectors a block,
/// cached at `now` (ms).
#[derive(Clone, Copy)]
struct NewRun {
    start: u32,
    got: u32,
    ob: u64,
    g: u64,
    bss: u64,
    now: u32,
}

/// Writes whole entries for a new run, already linked to each other, and
/// their image, in one branch-free pass per metadata block. Every field is
/// affine in the block's place in the run: counters stepped once per
/// block, no multiply and no index check in the inner loop. `NT`: with
/// streaming stores, fenced before it returns.
#[inline(always)]
fn fill_run<const NT: bool>(entries: &mut [Entry], image: &mut Image, run: NewRun) {
    let NewRun {
        start,
        got,
        ob,
        g,
        bss,
        now,
    } = run;
    // Fences on return, and on unwinding: nothing touches the run first.
    let _fence = NT.then_some(stream::Fence);
    image.for_each_run(start as usize, got as usize, |first, image| {
        let k = first as u32 - start;
        let (mut sector, mut obk, mut nb) = ((ob + k as u64) * bss, ob as u32 + k, first as u32);
        let ents = &mut entries[first..first + image.len()];
        for (e, out) in ents.iter_mut().zip(image) {
            let d = DiskEntry { sector, seq: g }.to_bytes();
            let n = Entry {
                ob: obk,
                seq: g,
                born_ms: now,
                prev: nb.wrapping_sub(1),
                next: nb.wrapping_add(1),
                st: St::Live,
                ..Entry::FREE
            };
            if NT {
                // SAFETY: `_fence` fences before this function returns or
                // unwinds, and nothing reads the run before then (the loop
                // writes each entry once; `block_mut` only touches other
                // metadata blocks, with plain stores).
                unsafe {
                    stream::bytes16(out, d);
                    stream::entry(e, n);
                }
            } else {
                *out = d;
                *e = n;
            }
            sector += bss;
            obk += 1;
            nb += 1;
        }
    });
}

/// How many of the first entries of `map` are unmapped (NONE): 16 at a
/// time with one AND each and no branch (vectorized), then one by one. A
/// large write to uncached space costs a few instructions per 16 blocks.
pub(crate) fn unmapped_prefix(map: &[u32]) -> usize {
    let mut k = 0;
    for c in map.chunks_exact(16) {
        if c.iter().fold(NONE, |a, &x| a & x) != NONE {
            break;
        }
        k += 16;
    }
    k + map[k..].iter().take_while(|&&x| x == NONE).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::writecache::meta::{ENTRIES_PER_MBLOCK, ENTRY_BYTES};

    /// A run's entries and image, written with plain stores or streamed.
    fn filled<const NT: bool>(start: u32, got: u32) -> (Vec<Entry>, Vec<u8>) {
        let n = 3 * ENTRIES_PER_MBLOCK;
        let mut entries = vec![Entry::FREE; n];
        let mut image = Image::new(3);
        let run = NewRun {
            start,
            got,
            ob: 1000,
            g: 7,
            bss: 8,
            now: 42,
        };
        fill_run::<NT>(&mut entries, &mut image, run);
        let bytes = (0..3).flat_map(|m| image.block(m).to_vec()).collect();
        (entries, bytes)
    }

    #[test]
    fn a_streamed_run_writes_what_plain_stores_write() {
        // Across a metadata block boundary, and short and long runs.
        for (start, got) in [(ENTRIES_PER_MBLOCK as u32 - 5, 200), (3, 1), (17, 64)] {
            let (e0, i0) = filled::<false>(start, got);
            let (e1, i1) = filled::<true>(start, got);
            assert_eq!(e0, e1, "entries of run {start}+{got}");
            assert_eq!(i0, i1, "image of run {start}+{got}");
            // The run's last block: the origin block, its links, its image.
            let (b, obl) = ((start + got - 1) as usize, 1000 + got as u64 - 1);
            assert_eq!(e1[b].ob as u64, obl);
            assert_eq!((e1[b].prev, e1[b].next), (b as u32 - 1, b as u32 + 1));
            assert_eq!(e1[start as usize - 1], Entry::FREE);
            assert_eq!(e1[(start + got) as usize], Entry::FREE);
            let d = DiskEntry::decode(&i1[b * ENTRY_BYTES as usize..]);
            assert_eq!((d.sector, d.seq), (obl * 8, 7));
        }
    }
}
