//! Commits: publish the next generation (the changed metadata blocks, a
//! flush of both devices, the superblock with FUA), then free what its
//! durability releases. Why this is crash-safe: [`super::meta`].

use std::cell::Cell;
use std::rc::Rc;

use udm_core::{AlignedBuf, BioFlags, Op, Status, SECTOR_SHIFT};

use super::entry::St;
use super::meta::{Super, MBLOCK_BYTES, SB_BYTES};
use super::worker::{Then, Worker};

impl Worker {
    pub fn write_super(self: &Rc<Self>, seq: u64, done: impl FnOnce(Status) + 'static) {
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
    pub fn start_commit(self: &Rc<Self>, then: Then) {
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
                    tracing::error!(
                        "writecache: the metadata image differs from the entries in metadata blocks {m0}..{m1}"
                    );
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

    pub fn commit_flush(self: &Rc<Self>, gen: u64, ok: bool, then: Then) {
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
}
