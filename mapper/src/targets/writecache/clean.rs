//! Writeback's I/O: which committed blocks go back to the origin, and
//! copying them there (cache reads gathered into large origin writes, a
//! flush, then the blocks are freed with markers in the next commit).

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use udm_core::{AlignedBuf, BioFlags, Caps, Op, Status};

use super::entry::{St, NONE};
use super::state::State;
use super::worker::{Done, Worker, MAX_RUN_BYTES};

/// Most blocks one writeback batch takes.
const BATCH_BYTES: u64 = 16 << 20;

/// Most writeback buffers (each up to MAX_RUN_BYTES) kept for reuse.
const MAX_SPARE_BUFS: usize = 16;

/// Blocks contiguous both on the origin and on the cache.
#[derive(Clone, Copy, Debug)]
struct Run {
    ob: u64,
    b: u32,
    len: u32,
}

/// What one writeback pass took: its blocks (pinned, in list order) and
/// the same blocks as runs.
#[derive(Default)]
pub(crate) struct Batch {
    pub blocks: Vec<u32>,
    runs: Vec<Run>,
}

impl Worker {
    /// Picks the oldest committed blocks that may go back, up to a batch.
    pub fn pick(&self, st: &mut State, now: Instant) -> Batch {
        let sh = &*self.shared;
        let n = sh.geo.n_blocks as u64;
        let used = st.used(n);
        if sh.above_high_watermark(st) {
            st.wb_active = true;
        }
        if used * 100 <= n * sh.cfg.low_watermark as u64 {
            st.wb_active = false;
        }
        let all = st.writeback_all > 0 || st.cleaner;
        let paused = st
            .last_origin_write
            .is_some_and(|t| now.duration_since(t) < sh.cfg.pause_writeback);
        // Watermark writeback takes the oldest blocks beyond the low
        // watermark and no more (as dm's loop on freelist_low_watermark):
        // the newest stay cached. Counted in live blocks, the only ones
        // writeback frees; the others (superseded, their free markers not
        // yet durable) are freed by commits.
        let mut over_low = if st.wb_active && !paused {
            let low = n * sh.cfg.low_watermark as u64 / 100;
            st.live.saturating_sub(st.wb_inflight).saturating_sub(low)
        } else {
            0
        };
        let age_limit = sh.cfg.max_age.map(|a| {
            sh.now_ms()
                .saturating_sub(a.as_millis().min(u32::MAX as u128) as u32)
        });
        if !all && over_low == 0 && age_limit.is_none() {
            return Batch::default();
        }
        let mut max = (BATCH_BYTES / sh.cfg.block_size as u64).max(1);
        if sh.cfg.writeback_jobs > 0 {
            max = max.min((sh.cfg.writeback_jobs as u64).saturating_sub(st.wb_inflight));
        }
        let mut out = Vec::new();
        let mut runs: Vec<Run> = Vec::new();
        let max_run = (MAX_RUN_BYTES / sh.cfg.block_size as u64).max(1);
        let mut b = st.lru_head;
        let mut scanned = 0u64;
        let mut need_commit = false;
        while b != NONE && (out.len() as u64) < max && scanned < 4 * max + 4096 {
            let e = st.entries[b as usize];
            scanned += 1;
            if !all && over_low == 0 {
                // Only max_age is left: the list is oldest first, so stop
                // at the first block young enough.
                match age_limit {
                    Some(lim) if e.born_ms <= lim => {}
                    _ => break,
                }
            }
            if e.st == St::Live && !e.wb && e.writes == 0 {
                if may_go_back(st, b) {
                    // With it, the cached neighbours on the origin that may
                    // go back too (as dm-writecache takes the following
                    // entries of its tree): an aged cache holds many
                    // neighbours, and they go back in one large origin
                    // write instead of one small write each, later.
                    // Watermark writeback alone takes no more than the
                    // blocks over the low watermark: the newest stay.
                    let ob = e.ob as u64;
                    let mut room = (max - out.len() as u64).min(max_run);
                    if !all && age_limit.is_none() {
                        room = room.min(over_low.max(1));
                    }
                    let mut lo = ob;
                    while lo > 0 && ob - lo + 1 < room && may_go_back_ob(st, lo - 1) {
                        lo -= 1;
                    }
                    let mut hi = ob + 1;
                    while hi < sh.origin_blocks && hi - lo < room && may_go_back_ob(st, hi) {
                        hi += 1;
                    }
                    let before = out.len();
                    for o in lo..hi {
                        let cb = st.map[o as usize];
                        take(st, cb, o, &mut out, &mut runs);
                    }
                    over_low = over_low.saturating_sub((out.len() - before) as u64);
                } else if !st.discarding(e.ob as u64) {
                    need_commit = true;
                }
            }
            b = e.next;
        }
        if need_commit || (out.is_empty() && (st.live > 0 || !st.free_pending.is_empty()) && all) {
            let pg = st.pending_gen;
            st.commit_wanted = st.commit_wanted.max(pg);
        }
        st.wb_inflight += out.len() as u64;
        sh.wb_blocks.store(st.wb_inflight, Ordering::Relaxed);
        Batch { blocks: out, runs }
    }

    pub fn writeback(self: &Rc<Self>, batch: Batch) {
        let sh = self.shared.clone();
        let bs = sh.cfg.block_size as usize;
        let bss = sh.cfg.bs_sectors();
        let Batch { blocks, mut runs } = batch;
        // Sort by origin block (runs never overlap on the origin: a block
        // has one live copy) and group runs contiguous on the origin into
        // origin writes of at most MAX_RUN_BYTES; a group reads each of its
        // runs (contiguous on the cache) into its part of one buffer.
        runs.sort_unstable_by_key(|r| r.ob);
        let max_run = (MAX_RUN_BYTES / bs as u64).max(1) as u32;
        let mut groups: Vec<(u64, u32, Vec<Run>)> = Vec::new();
        for mut r in runs {
            while r.len > 0 {
                let open = groups
                    .last()
                    .is_some_and(|g| g.0 + g.1 as u64 == r.ob && g.1 < max_run);
                if !open {
                    groups.push((r.ob, 0, Vec::new()));
                }
                let g = groups.last_mut().expect("a group was just ensured");
                let take = r.len.min(max_run - g.1);
                match g.2.last_mut() {
                    // Contiguous on the cache as well: one read.
                    Some(p) if p.b + p.len == r.b => p.len += take,
                    _ => g.2.push(Run {
                        ob: r.ob,
                        b: r.b,
                        len: take,
                    }),
                }
                g.1 += take;
                r.ob += take as u64;
                r.b += take;
                r.len -= take;
            }
        }
        self.wb_busy.set(true);
        // One list for the whole batch, shared by its pieces (the last one
        // to finish hands it on).
        let all_blocks = Rc::new(blocks);
        let left = Rc::new(Cell::new(groups.len() as u64));
        let ok = Rc::new(Cell::new(true));
        for (first_ob, len, pieces) in groups {
            let n = len as usize * bs;
            let mut buf = self.bufs.borrow_mut().pop().unwrap_or_default();
            // Shrinking keeps the bytes; growth within the capacity zeroes
            // only what it adds, growth past it reallocates.
            buf.resize(n);
            let base_ptr = buf.as_mut_ptr();
            let pieces_left = Rc::new(Cell::new(pieces.len() as u64));
            let read_ok = Rc::new(Cell::new(true));
            let held = Rc::new(Cell::new(Some(buf)));
            let origin_sector = first_ob * bss;
            for p in pieces {
                let mut bio = self.reactor().alloc_bio();
                bio.op = Op::Read;
                bio.sector = sh.cache_sector(p.b);
                // SAFETY: the group's buffer is kept in `held` until the
                // last piece completes (below), and pieces are disjoint
                // ranges of it.
                unsafe {
                    bio.add_seg(
                        base_ptr.add((p.ob - first_ob) as usize * bs),
                        p.len as usize * bs,
                    )
                };
                let me = self.clone();
                let (pieces_left, read_ok, held) =
                    (pieces_left.clone(), read_ok.clone(), held.clone());
                let (left, ok) = (left.clone(), ok.clone());
                let all_blocks = all_blocks.clone();
                let fua = sh.cfg.fua;
                let done: Done = Box::new(move |s, _| {
                    read_ok.set(read_ok.get() && s.is_ok());
                    pieces_left.set(pieces_left.get() - 1);
                    if pieces_left.get() > 0 {
                        return;
                    }
                    let Some(buf) = held.take() else { return };
                    if !read_ok.get() {
                        ok.set(false);
                        left.set(left.get() - 1);
                        if left.get() == 0 {
                            me.writeback_flush(all_blocks, false);
                        }
                        return;
                    }
                    let flags = if fua { BioFlags::FUA } else { BioFlags::NONE };
                    let me2 = me.clone();
                    me.io(
                        false,
                        Op::Write,
                        flags,
                        origin_sector,
                        buf,
                        move |s, buf| {
                            let mut spare = me2.bufs.borrow_mut();
                            if spare.len() < MAX_SPARE_BUFS {
                                spare.push(buf);
                            }
                            drop(spare);
                            ok.set(ok.get() && s.is_ok());
                            left.set(left.get() - 1);
                            if left.get() == 0 {
                                me2.writeback_flush(all_blocks, ok.get());
                            }
                        },
                    );
                });
                self.issue(true, bio, AlignedBuf::default(), done);
            }
        }
    }

    /// After the origin writes: flush the origin, then free the blocks (their
    /// free markers go in the next commit).
    fn writeback_flush(self: &Rc<Self>, blocks: Rc<Vec<u32>>, ok: bool) {
        let me = self.clone();
        let origin_fua = self.shared.cfg.fua && self.shared.cfg.origin.caps().contains(Caps::FUA);
        let finish = move |s: Status| me.writeback_done(&blocks, ok && s.is_ok());
        if !ok || origin_fua {
            return finish(Status::Ok);
        }
        self.io(
            false,
            Op::Flush,
            BioFlags::NONE,
            0,
            AlignedBuf::default(),
            move |s, _| finish(s),
        );
    }

    fn writeback_done(self: &Rc<Self>, blocks: &[u32], ok: bool) {
        let sh = &*self.shared;
        {
            let mut st = sh.lock();
            let pg = st.pending_gen;
            for &b in blocks {
                let e = &mut st.entries[b as usize];
                e.wb = false;
                e.reads -= 1;
                let (ob, live) = (e.ob, e.st == St::Live);
                st.wb_ob[ob as usize] -= 1;
                if !ok || !live || st.map[ob as usize] != b {
                    // Superseded while under writeback, it may have been
                    // released meanwhile: its last pin frees it.
                    st.unpinned(b);
                    continue;
                }
                st.release_live(b, ob as u64);
            }
            if !ok {
                self.fail(&mut st);
            }
            st.wb_inflight -= blocks.len() as u64;
            sh.wb_blocks.store(st.wb_inflight, Ordering::Relaxed);
            st.commit_wanted = st.commit_wanted.max(pg);
        }
        self.wb_busy.set(false);
        if !ok {
            sh.kick_all();
        }
        sh.cv.notify_all();
        sh.poke();
    }
}

/// Whether live cache block `b` may be written back now: committed (its
/// entry durable), not being written, not already under writeback, no
/// older entry of its origin block has a free marker still pending, and
/// no discard of its origin block is in flight (its data, landing on the
/// origin after the discard, would be what a newer write's copy uncovers
/// when the discard drops that copy).
fn may_go_back(st: &State, b: u32) -> bool {
    let e = &st.entries[b as usize];
    e.st == St::Live
        && !e.wb
        && e.writes == 0
        && e.seq != 0
        && e.seq <= st.committed
        && !st.shadowed(e.ob as u64)
        && !st.discarding(e.ob as u64)
}

/// Whether origin block `ob` is cached in a block that may go back now.
fn may_go_back_ob(st: &State, ob: u64) -> bool {
    let b = st.map[ob as usize];
    b != NONE && may_go_back(st, b)
}

/// Takes cache block `b` (caching origin block `ob`) for writeback: pins
/// it and adds it to the batch, merged into the last run when contiguous
/// both on the cache and on the origin. (The origin block is read here
/// anyway: runs are built now, so writeback sorts and merges without the
/// lock and per run, not per block: blocks written together sit together
/// in the list, on the cache and on the origin, and a 512 KiB write of
/// 512-byte blocks is one run, not 1024 entries to sort.)
fn take(st: &mut State, b: u32, ob: u64, out: &mut Vec<u32>, runs: &mut Vec<Run>) {
    let e = &mut st.entries[b as usize];
    e.wb = true;
    e.reads += 1;
    st.wb_ob[ob as usize] += 1;
    out.push(b);
    match runs.last_mut() {
        Some(r) if r.b + r.len == b && r.ob + r.len as u64 == ob => r.len += 1,
        _ => runs.push(Run { ob, b, len: 1 }),
    }
}
