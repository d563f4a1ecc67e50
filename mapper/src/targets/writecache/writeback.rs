//! The writecache's worker: a thread with its own reactor and channels to
//! the origin and the cache (the kernel's workqueue). It loads or formats
//! the metadata, runs commits (on FLUSH, FUA, autocommit and to release
//! freed blocks), and writes back: above `high_watermark` down to
//! `low_watermark`, everything on `flush`/`cleaner`, and blocks older than
//! `max_age`. Writeback takes the oldest committed blocks, sorts them by
//! origin sector and merges neighbours into large origin writes.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use udm_core::{
    AlignedBuf, BioFlags, BioPtr, Caps, Channel, Error, ErrorKind, Op, Poller, Reactor,
    ReactorConfig, Status, SECTOR_SHIFT,
};

use super::cache::{self, Shared, St, State, NONE};
use super::meta::{DiskEntry, Super, MBLOCK_BYTES, SB_BYTES};

/// Most blocks one writeback batch takes.
const BATCH_BYTES: u64 = 16 << 20;
/// Largest origin write writeback issues.
const MAX_RUN_BYTES: u64 = 1 << 20;

/// Writes of the entry array a format keeps in flight.
const FORMAT_DEPTH: usize = 4;

/// A format's progress (see [`Worker::format`]).
struct Format {
    /// Bytes of the entry array, and the most one write carries.
    total: u64,
    chunk: u64,
    /// Where the next write starts.
    next: Cell<u64>,
    /// Writers still running.
    inflight: Cell<usize>,
    ok: Cell<bool>,
    result: Rc<Cell<Option<Result<(), Error>>>>,
}

/// Most writeback buffers (each up to MAX_RUN_BYTES) kept for reuse.
const MAX_SPARE_BUFS: usize = 16;

type Done = Box<dyn FnOnce(Status, AlignedBuf)>;

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
struct Batch {
    blocks: Vec<u32>,
    runs: Vec<Run>,
}

struct IoCtx {
    buf: AlignedBuf,
    done: Done,
}

pub(crate) struct Worker {
    shared: Arc<Shared>,
    reactor: *const Reactor,
    origin: Rc<dyn Channel>,
    cache: Rc<dyn Channel>,
    inflight: Cell<u64>,
    commit_busy: Cell<bool>,
    wb_busy: Cell<bool>,
    cache_fua: bool,
    /// Writeback buffers handed back after their origin write, reused so
    /// that a buffer is zeroed once, not per group (zeroing every group's
    /// buffer before the cache reads overwrite it cost the worker a third
    /// of its instructions at 512-byte blocks).
    bufs: RefCell<Vec<AlignedBuf>>,
    /// A commit waiting for its generation's data writes to drain (see
    /// `State::unwritten`): its generation and continuation.
    barrier_then: RefCell<Option<(u64, Then)>>,
}

type Then = Option<Box<dyn FnOnce(bool)>>;

fn io_done(bio: BioPtr) {
    // SAFETY: private is the Box<IoCtx> leaked in `Worker::io`, taken back once.
    let ctx = unsafe { Box::from_raw(bio.private() as *mut IoCtx) };
    let s = bio.status();
    drop(bio);
    let IoCtx { buf, done } = *ctx;
    done(s, buf);
}

impl Worker {
    fn reactor(&self) -> &Reactor {
        // SAFETY: the worker lives inside `run`, on the reactor's thread,
        // and `run` drains all of its I/O before the reactor is dropped.
        unsafe { &*self.reactor }
    }

    /// Issues one I/O on `ch` with `buf` as its data (moved in, handed back
    /// to `done`).
    fn io(
        self: &Rc<Self>,
        cache: bool,
        op: Op,
        flags: BioFlags,
        sector: u64,
        mut buf: AlignedBuf,
        done: impl FnOnce(Status, AlignedBuf) + 'static,
    ) {
        let mut bio = self.reactor().alloc_bio();
        bio.flags = flags;
        if op.has_data() {
            bio.op = op;
            bio.sector = sector;
            // SAFETY: the buffer moves into the IoCtx below, which keeps it
            // (its heap block does not move) until io_done runs.
            unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
        } else {
            bio.set_dataless(op, sector, 0);
        }
        self.issue(cache, bio, buf, Box::new(done));
    }

    /// Submits `bio` on the cache (or origin) channel, counted in flight
    /// until `done` runs; `buf` (what the bio's segment points into, or
    /// empty) is kept alive until then and handed back to `done`.
    fn issue(self: &Rc<Self>, cache: bool, mut bio: BioPtr, buf: AlignedBuf, done: Done) {
        self.inflight.set(self.inflight.get() + 1);
        let me = self.clone();
        let ctx = Box::new(IoCtx {
            buf,
            done: Box::new(move |s, b| {
                me.inflight.set(me.inflight.get() - 1);
                done(s, b)
            }),
        });
        bio.set_end_io(io_done, Box::into_raw(ctx).cast());
        if cache {
            self.cache.submit(bio)
        } else {
            self.origin.submit(bio)
        }
    }

    /// Issues one I/O on `ch` whose data is `len` bytes at `data`, which
    /// the worker owns.
    ///
    /// # Safety
    /// `data..data + len` stays valid until `done` runs, and nobody else
    /// writes it meanwhile (for a write; for a read, nobody else touches
    /// it).
    unsafe fn io_at(
        self: &Rc<Self>,
        cache: bool,
        op: Op,
        sector: u64,
        data: *mut u8,
        len: usize,
        done: impl FnOnce(Status) + 'static,
    ) {
        let mut bio = self.reactor().alloc_bio();
        bio.op = op;
        bio.sector = sector;
        // SAFETY: the caller keeps the range valid until `done` runs.
        unsafe { bio.add_seg(data, len) };
        self.issue(
            cache,
            bio,
            AlignedBuf::default(),
            Box::new(move |s, _| done(s)),
        );
    }

    fn fail(&self, st: &mut State) {
        st.error = Status::IoErr.errno();
    }

    // -------------------------------------------------------------------
    // Load / format
    // -------------------------------------------------------------------

    fn load(self: &Rc<Self>, result: Rc<Cell<Option<Result<(), Error>>>>) {
        let sh = self.shared.clone();
        let me = self.clone();
        let sb_sector = sh.cfg.start_sector;
        self.io(
            true,
            Op::Read,
            BioFlags::NONE,
            sb_sector,
            AlignedBuf::new(SB_BYTES as usize),
            move |s, buf| {
                if !s.is_ok() {
                    return result.set(Some(Err(Error::new(
                        ErrorKind::Io,
                        format!("writecache: reading the superblock failed: {s}"),
                    ))));
                }
                match Super::decode(&buf) {
                    Err(e) => result.set(Some(Err(e))),
                    Ok(None) => me.format(result),
                    Ok(Some(sb)) => {
                        let g = &sh.geo;
                        if sb.block_size != g.block_size {
                            return result.set(Some(Err(Error::invalid(format!(
                                "writecache: block size {} does not match the cache's ({})",
                                g.block_size, sb.block_size
                            )))));
                        }
                        if sb.n_blocks != g.n_blocks {
                            return result.set(Some(Err(Error::invalid(format!(
                                "writecache: the cache holds {} blocks but this table gives it {}",
                                sb.n_blocks, g.n_blocks
                            )))));
                        }
                        me.read_entries(sb.seq, result);
                    }
                }
            },
        );
    }

    /// A new cache: zero the entry array, then write a superblock. The
    /// array goes out in writes no larger than the cache takes
    /// ([`Worker::max_meta_io`]), [`FORMAT_DEPTH`] at a time, each from a
    /// zeroed buffer it reuses: a large cache's array is gigabytes, and
    /// allocating it all at once as write buffers could exhaust memory.
    fn format(self: &Rc<Self>, result: Rc<Cell<Option<Result<(), Error>>>>) {
        let total = self.shared.geo.mblocks as u64 * MBLOCK_BYTES as u64;
        let f = Rc::new(Format {
            total,
            chunk: self.max_meta_io() as u64,
            next: Cell::new(0),
            inflight: Cell::new(0),
            ok: Cell::new(true),
            result,
        });
        for _ in 0..FORMAT_DEPTH {
            if f.next.get() >= total || !f.ok.get() {
                break;
            }
            f.inflight.set(f.inflight.get() + 1);
            let n = f.chunk.min(total);
            self.format_next(f.clone(), AlignedBuf::new(n as usize));
        }
    }

    /// Writes the next piece of the entry array from `buf` (zeroes), or,
    /// when none is left, retires this writer; the last one writes the
    /// superblock.
    fn format_next(self: &Rc<Self>, f: Rc<Format>, mut buf: AlignedBuf) {
        let off = f.next.get();
        if off >= f.total || !f.ok.get() {
            f.inflight.set(f.inflight.get() - 1);
            if f.inflight.get() == 0 {
                self.format_done(&f);
            }
            return;
        }
        let n = f.chunk.min(f.total - off);
        f.next.set(off + n);
        buf.resize(n as usize);
        let sector = self.shared.cfg.start_sector + ((SB_BYTES + off) >> SECTOR_SHIFT);
        let me = self.clone();
        self.io(
            true,
            Op::Write,
            BioFlags::NONE,
            sector,
            buf,
            move |s, buf| {
                if !s.is_ok() {
                    f.ok.set(false);
                }
                me.format_next(f, buf);
            },
        );
    }

    fn format_done(self: &Rc<Self>, f: &Format) {
        let result = f.result.clone();
        if !f.ok.get() {
            return result.set(Some(Err(Error::new(
                ErrorKind::Io,
                "writecache: formatting the metadata failed",
            ))));
        }
        let n = self.shared.geo.n_blocks;
        self.shared.lock().free.free(0, n);
        self.write_super(0, move |s| {
            result.set(Some(if s.is_ok() {
                Ok(())
            } else {
                Err(Error::new(
                    ErrorKind::Io,
                    "writecache: writing the superblock failed",
                ))
            }))
        });
    }

    fn read_entries(self: &Rc<Self>, sb_seq: u64, result: Rc<Cell<Option<Result<(), Error>>>>) {
        let g = self.shared.geo;
        let total = g.mblocks as usize * MBLOCK_BYTES;
        // In pieces no larger than the cache takes in one I/O (a file caps
        // I/Os at 8 MiB; the array of a 1 GiB cache of 512-byte blocks is
        // 32 MiB), gathered into one buffer.
        let chunk = self.max_meta_io();
        let pieces = total.div_ceil(chunk);
        let left = Rc::new(Cell::new(pieces));
        let ok = Rc::new(Cell::new(true));
        let all = Rc::new(std::cell::RefCell::new(vec![0u8; total]));
        let mut off = 0;
        while off < total {
            let n = chunk.min(total - off);
            let sector = self.shared.cfg.start_sector + ((SB_BYTES + off as u64) >> SECTOR_SHIFT);
            let (me, left, ok, all, result) = (
                self.clone(),
                left.clone(),
                ok.clone(),
                all.clone(),
                result.clone(),
            );
            let at = off;
            self.io(
                true,
                Op::Read,
                BioFlags::NONE,
                sector,
                AlignedBuf::new(n),
                move |s, buf| {
                    ok.set(ok.get() && s.is_ok());
                    all.borrow_mut()[at..at + buf.len()].copy_from_slice(&buf);
                    left.set(left.get() - 1);
                    if left.get() > 0 {
                        return;
                    }
                    if !ok.get() {
                        return result.set(Some(Err(Error::new(
                            ErrorKind::Io,
                            "writecache: reading the metadata failed",
                        ))));
                    }
                    me.rebuild(sb_seq, &all.borrow());
                    // Commit the cleaned-up image before serving I/O: stale
                    // and torn leftovers become free markers on disk.
                    me.shared.lock().commit_wanted = sb_seq + 1;
                    let r2 = result.clone();
                    me.start_commit(Some(Box::new(move |ok| {
                        r2.set(Some(if ok {
                            Ok(())
                        } else {
                            Err(Error::new(
                                ErrorKind::Io,
                                "writecache: committing the recovered metadata failed",
                            ))
                        }))
                    })));
                },
            );
            off += n;
        }
    }

    /// Rebuilds the in-memory state from the entry array: for each origin
    /// block the committed entry with the highest seq wins; everything else
    /// is free.
    fn rebuild(&self, sb_seq: u64, buf: &[u8]) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let n = sh.geo.n_blocks;
        let mut st = sh.lock();
        st.committed = sb_seq;
        st.pending_gen = sb_seq + 1;
        let mut winners: Vec<(u64, u32)> = Vec::new();
        for b in 0..n {
            let o = b as usize * 16;
            let e = DiskEntry::decode(&buf[o..o + 16]);
            let valid = e.seq != 0
                && e.seq <= sb_seq
                && e.sector.is_multiple_of(bs)
                && e.sector / bs < sh.origin_blocks;
            // Entries start free (State::new): a loser or a leftover only
            // needs its free marker written.
            if !valid {
                if e != DiskEntry::FREE {
                    st.mark_free(b);
                }
                continue;
            }
            let ob = e.sector / bs;
            let cur = st.map[ob as usize];
            if cur != NONE {
                if st.entries[cur as usize].seq >= e.seq {
                    st.mark_free(b);
                    continue;
                }
                st.entries[cur as usize] = cache::Entry::FREE;
                st.mark_free(cur);
            }
            st.map[ob as usize] = b;
            let en = &mut st.entries[b as usize];
            en.ob = ob as u32;
            en.seq = e.seq;
            en.st = St::Live;
            winners.push((e.seq, b));
        }
        // The image, from the rebuilt states (the markers above are in it
        // already; the winners are not).
        for &(_, b) in &winners {
            let e = st.disk_entry(b as usize, bs);
            st.set_image(b, e);
        }
        // Oldest first in the writeback order.
        winners.sort_unstable();
        for &(_, b) in &winners {
            if st.entries[b as usize].st == St::Live
                && st.map[st.entries[b as usize].ob as usize] == b
            {
                st.lru_push(b);
                st.live += 1;
            }
        }
        let mut b = 0;
        while b < n {
            if st.entries[b as usize].st == St::Free {
                let s = b;
                while b < n && st.entries[b as usize].st == St::Free {
                    b += 1;
                }
                st.free.free(s, b - s);
            } else {
                b += 1;
            }
        }
    }

    // -------------------------------------------------------------------
    // Commit
    // -------------------------------------------------------------------

    fn write_super(self: &Rc<Self>, seq: u64, done: impl FnOnce(Status) + 'static) {
        let g = self.shared.geo;
        let mut buf = AlignedBuf::new(SB_BYTES as usize);
        Super {
            block_size: g.block_size,
            n_blocks: g.n_blocks,
            seq,
        }
        .encode(&mut buf);
        let me = self.clone();
        self.io(
            true,
            Op::Write,
            BioFlags::FUA,
            self.shared.cfg.start_sector,
            buf,
            move |s, _| {
                if !s.is_ok() || me.cache_fua {
                    return done(s);
                }
                me.io(
                    true,
                    Op::Flush,
                    BioFlags::NONE,
                    0,
                    AlignedBuf::default(),
                    move |s, _| done(s),
                );
            },
        );
    }

    /// Publishes the next generation: changed metadata blocks, a flush of
    /// the cache and the origin, then the superblock with FUA.
    fn start_commit(self: &Rc<Self>, then: Then) {
        let sh = &*self.shared;
        assert!(!self.commit_busy.get(), "writecache: two commits at once");
        self.commit_busy.set(true);
        // The dirty metadata blocks, merged into runs, are written from the
        // image itself: holding them (see `image`) freezes them for this
        // commit, and writers copy a held block before changing it. The
        // lock is held only to pick and mark the blocks.
        let mut runs: Vec<(u32, *const u8, usize)> = Vec::new();
        let max = (self.max_meta_io() / MBLOCK_BYTES) as u32;
        let gen = {
            let mut st = sh.lock();
            let gen = st.pending_gen;
            st.pending_gen += 1;
            st.uncommitted = 0;
            st.dirty_since = None;
            let nm = st.dirty.len() as u32;
            let mut m = 0;
            let mut left = st.ndirty;
            while m < nm && left > 0 {
                if !st.dirty[m as usize] {
                    m += 1;
                    continue;
                }
                let start = m;
                while m < nm && st.dirty[m as usize] && m - start < max {
                    st.dirty[m as usize] = false;
                    m += 1;
                }
                let (m0, m1) = (start as usize, m as usize);
                left -= m1 - m0;
                if cfg!(feature = "paranoid")
                    && !st.image_is_consistent(m0, m1, sh.cfg.bs_sectors())
                {
                    // Fail the cache (all I/O errors) rather than panic the
                    // worker, which would leave I/O hanging.
                    eprintln!("writecache: the metadata image differs from the entries in metadata blocks {m0}..{m1}");
                    self.fail(&mut st);
                }
                runs.push((start, st.image.hold(m0, m1), (m1 - m0) * MBLOCK_BYTES));
            }
            st.ndirty = 0;
            gen
        };
        let left = Rc::new(Cell::new(runs.len() as u64 + 1));
        let ok = Rc::new(Cell::new(true));
        let then = Rc::new(Cell::new(then));
        let step = {
            let me = self.clone();
            let (left, ok, then) = (left.clone(), ok.clone(), then.clone());
            move |s: Status| {
                ok.set(ok.get() && s.is_ok());
                left.set(left.get() - 1);
                if left.get() == 0 {
                    // Nothing reads the held blocks any more.
                    me.shared.lock().image.release();
                    me.commit_flush(gen, ok.get(), then.take());
                }
            }
        };
        let step = Rc::new(step);
        for (m, data, len) in runs {
            let sector = sh.cfg.start_sector + (sh.geo.mblock_offset(m) >> SECTOR_SHIFT);
            let step = step.clone();
            // SAFETY: the image holds these blocks until `step` has seen
            // every write complete: nobody changes them (writers copy a
            // held block first) and the image, owned by the shared state
            // that the worker keeps alive, does not free or move them. The
            // write only reads them, though `io_at` takes a *mut.
            unsafe {
                self.io_at(true, Op::Write, sector, data as *mut u8, len, move |s| {
                    step(s)
                })
            };
        }
        step(Status::Ok);
    }

    /// The most bytes of metadata one I/O carries (a commit's write, a
    /// load's read): MAX_RUN_BYTES, or less if the cache device takes less
    /// in one I/O, in whole metadata blocks.
    fn max_meta_io(&self) -> usize {
        let l = self.shared.cfg.cache.limits();
        (l.max_io_bytes as usize)
            .min(MAX_RUN_BYTES as usize)
            .max(MBLOCK_BYTES)
            / MBLOCK_BYTES
            * MBLOCK_BYTES
    }

    fn commit_flush(self: &Rc<Self>, gen: u64, ok: bool, then: Then) {
        if !ok {
            return self.commit_done(gen, false, then);
        }
        {
            // Entries are published when their blocks are allocated: the
            // data writes of this generation must be done before the flush
            // that makes the commit durable. The last one pokes `step`.
            let mut st = self.shared.lock();
            if st.inflight_writes[(gen & 1) as usize] > 0 {
                st.barrier = gen;
                *self.barrier_then.borrow_mut() = Some((gen, then));
                return;
            }
            if st.error != 0 {
                // A data write failed: its entry must not become durable.
                drop(st);
                return self.commit_done(gen, false, then);
            }
        }
        // Both devices: the cache holds the data and entries, the origin
        // what was written around the cache.
        let left = Rc::new(Cell::new(2u32));
        let good = Rc::new(Cell::new(true));
        let then = Rc::new(Cell::new(then));
        for cache in [true, false] {
            let (me, left, good, then) = (self.clone(), left.clone(), good.clone(), then.clone());
            self.io(
                cache,
                Op::Flush,
                BioFlags::NONE,
                0,
                AlignedBuf::default(),
                move |s, _| {
                    good.set(good.get() && s.is_ok());
                    left.set(left.get() - 1);
                    if left.get() > 0 {
                        return;
                    }
                    if !good.get() {
                        return me.commit_done(gen, false, then.take());
                    }
                    let me2 = me.clone();
                    me.write_super(gen, move |s| me2.commit_done(gen, s.is_ok(), then.take()));
                },
            );
        }
    }

    fn commit_done(self: &Rc<Self>, gen: u64, ok: bool, then: Then) {
        let sh = &*self.shared;
        {
            let mut st = sh.lock();
            if !ok {
                self.fail(&mut st);
            } else {
                st.committed = gen;
                // Free markers now durable: the blocks are reusable. The
                // lists hold runs (a 512 KiB overwrite of 512-byte blocks is
                // one item, not 1024), and the loops below are flat passes
                // over a run's entries: this all happens under the lock.
                let fp = std::mem::take(&mut st.free_pending);
                let mut keep = Vec::new();
                let mut freed: Vec<(u32, u32)> = Vec::with_capacity(fp.len());
                for f in fp {
                    if f.gen > gen {
                        keep.push(f);
                        continue;
                    }
                    let mut run = (f.b, 0);
                    for b in f.b..f.b + f.len {
                        let ob = st.entries[b as usize].ob;
                        st.shadow_sub(ob as u64);
                        if st.release(b) {
                            run.1 += 1;
                        } else {
                            // Pinned by I/O: freed when unpinned.
                            if run.1 > 0 {
                                freed.push(run);
                            }
                            run = (b + 1, 0);
                        }
                    }
                    if run.1 > 0 {
                        freed.push(run);
                    }
                }
                // Back to the free extents in block order, neighbours
                // merged. Random overwrites free blocks scattered over the
                // cache, in the order their successors were written: one
                // extent insert each held the lock for 15-30 ms per commit
                // (4 KiB random writes at QD1); sorted, neighbours merge and
                // the inserts walk the tree in order.
                freed.sort_unstable();
                let mut run = (0, 0);
                for (b, len) in freed {
                    if run.1 > 0 && run.0 + run.1 == b {
                        run.1 += len;
                    } else {
                        st.free.free(run.0, run.1);
                        run = (b, len);
                    }
                }
                st.free.free(run.0, run.1);
                st.free_pending = keep;
                // Superseded blocks whose successor is now durable get a
                // free marker in the next commit.
                let sup = std::mem::take(&mut st.superseded);
                // (Those that must wait go back through push_superseded,
                // which merges them into runs again.)
                let pg = st.pending_gen;
                for r in sup {
                    let mut ready = (r.old, 0);
                    for k in 0..r.len {
                        let s = st.entries[(r.by + k) as usize].seq;
                        if s != 0 && s <= gen {
                            st.entries[(r.old + k) as usize].st = St::FreePending;
                            ready.1 += 1;
                            continue;
                        }
                        st.mark_free_run(ready.0, ready.1);
                        ready = (r.old + k + 1, 0);
                        st.push_superseded(r.old + k, r.by + k);
                    }
                    st.mark_free_run(ready.0, ready.1);
                }
                // Space is wanted: do not wait for autocommit to release.
                let n = sh.geo.n_blocks as u64;
                let pressed = st.writeback_all > 0
                    || st.space_waiters > 0
                    || st.wb_active
                    || st.used(n) * 100 >= n * sh.cfg.low_watermark as u64;
                if pressed && !st.free_pending.is_empty() {
                    st.commit_wanted = st.commit_wanted.max(pg);
                }
            }
        }
        self.commit_busy.set(false);
        if let Some(f) = then {
            f(ok);
        }
        sh.kick_all();
        sh.poke();
    }

    // -------------------------------------------------------------------
    // Writeback
    // -------------------------------------------------------------------

    /// Picks the oldest committed blocks that may go back, up to a batch.
    fn pick(&self, st: &mut State, now: Instant) -> Batch {
        let sh = &*self.shared;
        let n = sh.geo.n_blocks as u64;
        let used = st.used(n);
        if used * 100 >= n * sh.cfg.high_watermark as u64 {
            st.wb_active = true;
        }
        if used * 100 <= n * sh.cfg.low_watermark as u64 {
            st.wb_active = false;
        }
        let all = st.writeback_all > 0 || st.cleaner;
        let paused = st
            .last_origin_write
            .is_some_and(|t| now.duration_since(t) < sh.cfg.pause_writeback);
        let by_watermark = st.wb_active && !paused;
        let age_limit = sh.cfg.max_age.map(|a| {
            sh.now_ms()
                .saturating_sub(a.as_millis().min(u32::MAX as u128) as u32)
        });
        if !all && !by_watermark && age_limit.is_none() {
            return Batch::default();
        }
        let mut max = (BATCH_BYTES / sh.cfg.block_size as u64).max(1);
        if sh.cfg.writeback_jobs > 0 {
            max = max.min((sh.cfg.writeback_jobs as u64).saturating_sub(st.wb_inflight));
        }
        let mut out = Vec::new();
        let mut runs: Vec<Run> = Vec::new();
        let mut b = st.lru_head;
        let mut scanned = 0u64;
        let mut need_commit = false;
        while b != NONE && (out.len() as u64) < max && scanned < 4 * max + 4096 {
            let e = st.entries[b as usize];
            scanned += 1;
            if !all && !by_watermark {
                // max_age only: the list is oldest first, so stop at the
                // first block young enough.
                match age_limit {
                    Some(lim) if e.born_ms <= lim => {}
                    _ => break,
                }
            }
            if e.st == St::Live && !e.wb && e.writes == 0 {
                if e.seq != 0 && e.seq <= st.committed && !st.shadowed(e.ob as u64) {
                    out.push(b);
                    // The origin block is read here anyway: runs are built
                    // now, so writeback sorts and merges without the lock
                    // and per run, not per block (blocks written together
                    // sit together in the list, on the cache and on the
                    // origin: a 512 KiB write of 512-byte blocks is one run,
                    // not 1024 entries to sort).
                    match runs.last_mut() {
                        Some(r) if r.b + r.len == b && r.ob + r.len as u64 == e.ob as u64 => {
                            r.len += 1
                        }
                        _ => runs.push(Run {
                            ob: e.ob as u64,
                            b,
                            len: 1,
                        }),
                    }
                } else {
                    need_commit = true;
                }
            }
            b = e.next;
        }
        if need_commit || (out.is_empty() && (st.live > 0 || !st.free_pending.is_empty()) && all) {
            let pg = st.pending_gen;
            st.commit_wanted = st.commit_wanted.max(pg);
        }
        for &b in &out {
            let e = &mut st.entries[b as usize];
            e.wb = true;
            e.reads += 1;
            let ob = e.ob as usize;
            st.wb_ob[ob] += 1;
        }
        st.wb_inflight += out.len() as u64;
        sh.wb_blocks.store(st.wb_inflight, Ordering::Relaxed);
        Batch { blocks: out, runs }
    }

    fn writeback(self: &Rc<Self>, batch: Batch) {
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

    // -------------------------------------------------------------------
    // The loop
    // -------------------------------------------------------------------

    /// Looks at the state and starts what is due.
    fn step(self: &Rc<Self>) {
        let sh = &*self.shared;
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let resume = {
            let mut st = sh.lock();
            let drained = st.barrier != 0 && st.inflight_writes[(st.barrier & 1) as usize] == 0;
            if drained {
                st.barrier = 0;
            }
            drained
        };
        if resume {
            if let Some((gen, then)) = self.barrier_then.take() {
                self.commit_flush(gen, true, then);
            }
        }
        let (commit, batch) = {
            let mut st = sh.lock();
            if !st.ready || st.error != 0 {
                // Parked bios must still hear about the error.
                (false, Batch::default())
            } else {
                // Pick first: it may find that writeback needs a commit.
                let batch = if self.wb_busy.get() {
                    Batch::default()
                } else {
                    self.pick(&mut st, now)
                };
                let auto_time = st
                    .dirty_since
                    .is_some_and(|t| now.duration_since(t) >= sh.cfg.autocommit_time);
                let commit = !self.commit_busy.get()
                    && (st.commit_wanted >= st.pending_gen
                        || st.uncommitted >= sh.cfg.autocommit_blocks
                        || auto_time);
                (commit, batch)
            }
        };
        if commit {
            self.start_commit(None);
        }
        if !batch.blocks.is_empty() {
            self.writeback(batch);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let sh = &*self.shared;
        let st = sh.lock();
        let mut d = st.dirty_since.map(|t| t + sh.cfg.autocommit_time);
        if sh.cfg.max_age.is_some() && st.lru_head != NONE {
            // Look again in a while; max_age is coarse (as in dm).
            let t = Instant::now() + Duration::from_millis(100);
            d = Some(d.map_or(t, |x| x.min(t)));
        }
        if st.last_origin_write.is_some() && st.wb_active {
            let t = Instant::now() + Duration::from_millis(50);
            d = Some(d.map_or(t, |x| x.min(t)));
        }
        d
    }
}

struct WorkerPoller(Rc<Worker>);

impl Poller for WorkerPoller {
    fn poll(&self) -> usize {
        let w = &self.0;
        let due = self.deadline().is_some_and(|d| d <= Instant::now());
        if w.shared.poked.swap(false, Ordering::AcqRel) || due {
            w.step();
            return 1;
        }
        0
    }

    fn deadline(&self) -> Option<Instant> {
        if self.0.shared.stop.load(Ordering::Acquire) {
            return None;
        }
        self.0.next_deadline()
    }
}

/// Starts the worker thread; returns once the metadata is loaded (or
/// formatted), or with the error that prevented it.
pub(crate) fn start(shared: Arc<Shared>) -> Result<std::thread::JoinHandle<()>, Error> {
    let (tx, rx) = mpsc::channel::<Result<(), Error>>();
    let sh = shared.clone();
    let join = std::thread::Builder::new()
        .name("writecache".into())
        .spawn(move || run(sh, tx))
        .map_err(|e| Error::os("writecache: spawning the worker thread", e))?;
    match rx.recv() {
        Ok(Ok(())) => Ok(join),
        Ok(Err(e)) => {
            let _ = join.join();
            Err(e)
        }
        Err(_) => {
            let _ = join.join();
            Err(Error::new(
                ErrorKind::Io,
                "writecache: the worker thread died while loading",
            ))
        }
    }
}

fn run(sh: Arc<Shared>, tx: mpsc::Sender<Result<(), Error>>) {
    // UDM_WC_WORKER_POLL=1 makes the worker spin instead of sleeping in
    // io_uring_enter: valgrind (3.19) holds its big lock across that call,
    // so a sleeping worker would stop every other thread under callgrind
    // (scripts/bench/instr-per-io.sh sets it and counts the other threads only).
    let mut rc = ReactorConfig::default();
    if std::env::var_os("UDM_WC_WORKER_POLL").is_some_and(|v| v == "1") {
        rc.mode = udm_core::CompletionMode::Poll;
    }
    let reactor = match Reactor::new(rc) {
        Ok(r) => r,
        Err(e) => {
            let _ = tx.send(Err(Error::os(
                "writecache: creating the worker's reactor",
                e,
            )));
            return;
        }
    };
    let open = |d: &Arc<dyn udm_core::BlockDevice>| d.clone().open(&reactor);
    let (origin, cache) = match (open(&sh.cfg.origin), open(&sh.cfg.cache)) {
        (Ok(o), Ok(c)) => (o, c),
        (Err(e), _) | (_, Err(e)) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    let _ = sh.worker.set(reactor.handle());
    let w = Rc::new(Worker {
        shared: sh.clone(),
        reactor: &reactor as *const Reactor,
        origin,
        cache,
        inflight: Cell::new(0),
        commit_busy: Cell::new(false),
        wb_busy: Cell::new(false),
        cache_fua: sh.cfg.cache.caps().contains(Caps::FUA),
        bufs: RefCell::new(Vec::new()),
        barrier_then: RefCell::new(None),
    });
    let result: Rc<Cell<Option<Result<(), Error>>>> = Rc::new(Cell::new(None));
    w.load(result.clone());
    let mut loaded = None;
    reactor.run_until(|| {
        if loaded.is_none() {
            loaded = result.take();
        }
        loaded.is_some() && w.inflight.get() == 0
    });
    match loaded {
        Some(Ok(())) => {
            sh.lock().ready = true;
            let _ = tx.send(Ok(()));
        }
        Some(Err(e)) => {
            let _ = tx.send(Err(e));
            return;
        }
        None => return,
    }
    reactor.add_poller(Rc::new(WorkerPoller(w.clone())));
    sh.poke();
    reactor.run_until(|| sh.stop.load(Ordering::Acquire) && w.inflight.get() == 0);
    // Every callback (which dereferences the reactor) has run.
}
