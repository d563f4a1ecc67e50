//! raid1's resync engine, on the worker: resync (regions that may differ
//! after a crash or on a new array), recover (rebuild legs that are not in
//! sync), check (count sectors that differ), repair (rewrite them), and
//! read repair (rewrite a region on a leg that failed a read).
//!
//! One region at a time, under the barrier: the worker sets it, waits for
//! the region's writes in flight to drain (new ones park), copies the
//! region in chunks (several in flight) from the source leg, then lifts
//! the barrier and kicks the parked writes. `max_recovery_rate` paces the
//! start of each region.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use udm_core::{AlignedBuf, Op};

use super::state::{self, Action, NO_BARRIER};
use super::worker::Worker;

/// Most bytes of one resync I/O.
const CHUNK_BYTES: u64 = 1 << 20;
/// Chunks in flight per region.
const CHUNKS_IN_FLIGHT: u32 = 8;
/// How often a rebuild records where it is (see `Worker::checkpoint`).
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// How often a resync waiting for a region's writes to drain looks again
/// without being poked (a write's count-out is a plain store, and the poke
/// it sends may have missed the barrier).
const DRAIN_RECHECK: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Resync,
    Recover,
    Check,
    Repair,
    /// Rewrite the region on these legs.
    ReadRepair(u64),
    /// Recovery copied everything: flush, then the legs are in sync.
    FinishRecovery,
}

/// The region being worked on.
pub(crate) struct Job {
    kind: Kind,
    region: u64,
    /// Sectors of the region: `next` is the first not yet issued.
    next: u64,
    end: u64,
    out: u32,
    source: usize,
    /// Legs written (resync, recover, read repair) or compared (check,
    /// repair).
    targets: u64,
    /// Waiting for the region's writes to drain.
    draining: bool,
    /// See [`Job::recheck`].
    recheck: Instant,
    /// The source failed: do the region again.
    retry: bool,
}

impl Job {
    /// While waiting for the region's writes to drain: when to look again
    /// if no write's count-out pokes the worker first.
    pub fn recheck(&self) -> Option<Instant> {
        self.draining.then_some(self.recheck)
    }
}

impl Worker {
    pub fn resync_step(self: &Rc<Self>) {
        let sh = &*self.sh;
        let draining = {
            let j = self.job.borrow();
            j.as_ref().map(|j| (j.draining, j.region))
        };
        match draining {
            Some((true, r)) => {
                if !sh.writing(r) {
                    if let Some(j) = self.job.borrow_mut().as_mut() {
                        j.draining = false;
                    }
                    self.pump();
                } else if let Some(j) = self.job.borrow_mut().as_mut() {
                    j.recheck = Instant::now() + DRAIN_RECHECK;
                }
                return;
            }
            Some((false, _)) => return,
            None => {}
        }
        if sh.retired.load(Ordering::Acquire) {
            return;
        }
        if let Some(t) = self.not_before.get() {
            if Instant::now() < t {
                return;
            }
            self.not_before.set(None);
        }
        let Some((kind, region)) = self.next_job() else {
            return;
        };
        if kind == Kind::FinishRecovery {
            self.finish_recovery();
            return;
        }
        let Some(mut source) = sh.source() else {
            // Nothing reads: nothing to copy from.
            let mut st = sh.lock();
            st.action = Action::Idle;
            return;
        };
        let live = sh.live();
        let targets = match kind {
            Kind::Resync => live & !(1 << source),
            Kind::Recover => live & !sh.insync.load(Ordering::Acquire),
            Kind::Check | Kind::Repair => sh.readable() & !(1 << source),
            Kind::ReadRepair(legs) => {
                if legs & (1 << source) != 0 {
                    let other = sh.readable() & !legs;
                    if other == 0 {
                        return;
                    }
                    source = other.trailing_zeros() as usize;
                }
                legs & live & !(1 << source)
            }
            Kind::FinishRecovery => 0,
        };
        let s0 = region << sh.cfg.region_shift;
        let end = (s0 + (1 << sh.cfg.region_shift)).min(sh.cfg.len);
        sh.barrier.store(region, Ordering::SeqCst);
        *self.job.borrow_mut() = Some(Job {
            kind,
            region,
            next: s0,
            end,
            out: 0,
            source,
            targets,
            draining: true,
            recheck: Instant::now() + DRAIN_RECHECK,
            retry: false,
        });
        if !sh.writing(region) {
            if let Some(j) = self.job.borrow_mut().as_mut() {
                j.draining = false;
            }
            self.pump();
        }
    }

    /// What to do next, and on which region; updates the action.
    fn next_job(&self) -> Option<(Kind, u64)> {
        let sh = &*self.sh;
        let n = sh.cfg.nregions;
        let mut st = sh.lock();
        if st.frozen {
            return None;
        }
        while let Some((r, legs)) = st.repairs.pop() {
            if legs & sh.live() != 0 && r < n {
                return Some((Kind::ReadRepair(legs), r));
            }
        }
        let recovering = sh.live() & !sh.insync.load(Ordering::Acquire);
        if recovering != 0 && sh.source().is_some() {
            if st.action != Action::Recover {
                st.action = Action::Recover;
                st.cursor = st.recovery_offset;
            }
            if st.cursor >= n {
                return Some((Kind::FinishRecovery, 0));
            }
            return Some((Kind::Recover, st.cursor));
        }
        if sh.any_unsynced.load(Ordering::Acquire) {
            if st.action != Action::Resync {
                st.action = Action::Resync;
                st.cursor = 0;
            }
            let from = st.cursor;
            for r in (from..n).chain(0..from) {
                if state::test(&sh.unsynced, r) {
                    st.cursor = r;
                    return Some((Kind::Resync, r));
                }
            }
            sh.any_unsynced.store(false, Ordering::Release);
            sh.paths();
            st.cursor = n;
            st.action = Action::Idle;
            sh.events.fetch_add(1, Ordering::AcqRel);
            return None;
        }
        match st.action {
            Action::Check | Action::Repair => {
                if st.cursor >= n {
                    st.action = Action::Idle;
                    sh.events.fetch_add(1, Ordering::AcqRel);
                    return None;
                }
                let k = if st.action == Action::Check {
                    Kind::Check
                } else {
                    Kind::Repair
                };
                Some((k, st.cursor))
            }
            Action::Resync | Action::Recover => {
                st.action = Action::Idle;
                None
            }
            Action::Idle => None,
        }
    }

    /// The rebuilt legs hold everything: flush them, then they are in sync
    /// (the superblock written next says so).
    fn finish_recovery(self: &Rc<Self>) {
        let sh = &*self.sh;
        let legs = sh.live() & !sh.insync.load(Ordering::Acquire);
        *self.job.borrow_mut() = Some(Job {
            kind: Kind::FinishRecovery,
            region: 0,
            next: 0,
            end: 0,
            out: 1,
            source: 0,
            targets: legs,
            draining: false,
            recheck: Instant::now(),
            retry: false,
        });
        let me = self.clone();
        self.flush_legs(true, legs, move |bad| {
            let sh = &*me.sh;
            if bad != 0 {
                sh.fail_legs(bad);
            }
            sh.insync.fetch_or(legs & !bad, Ordering::AcqRel);
            sh.paths();
            {
                let mut st = sh.lock();
                st.action = Action::Idle;
                st.recovery_offset = 0;
                st.sb_wanted += 1;
            }
            sh.events.fetch_add(1, Ordering::AcqRel);
            *me.job.borrow_mut() = None;
            me.step();
        });
    }

    /// Issues the region's next chunks; finishes the region when all are
    /// done.
    fn pump(self: &Rc<Self>) {
        loop {
            let next = {
                let mut jb = self.job.borrow_mut();
                let Some(j) = jb.as_mut() else { return };
                if j.draining {
                    return;
                }
                if j.next < j.end && j.out < CHUNKS_IN_FLIGHT && !j.retry {
                    let n = (j.end - j.next).min(CHUNK_BYTES >> 9);
                    let s = j.next;
                    j.next += n;
                    j.out += 1;
                    Some((j.kind, s, n, j.source, j.targets))
                } else {
                    if j.out > 0 {
                        return;
                    }
                    None
                }
            };
            match next {
                Some((kind, s, n, source, targets)) => self.chunk(kind, s, n, source, targets),
                None => return self.finish_region(),
            }
        }
    }

    fn chunk_done(self: &Rc<Self>) {
        if let Some(j) = self.job.borrow_mut().as_mut() {
            j.out -= 1;
        }
        self.pump();
    }

    /// Copies (or compares) sectors `s..s + n` of the region.
    fn chunk(self: &Rc<Self>, kind: Kind, s: u64, n: u64, source: usize, targets: u64) {
        let len = (n << 9) as usize;
        let sh = self.sh.clone();
        let compare = matches!(kind, Kind::Check | Kind::Repair);
        let readers = if compare {
            targets | (1 << source)
        } else {
            1 << source
        };
        let bufs: Rc<RefCell<Vec<Option<AlignedBuf>>>> =
            Rc::new(RefCell::new((0..sh.cfg.legs.len()).map(|_| None).collect()));
        let left = Rc::new(Cell::new(readers.count_ones()));
        let bad = Rc::new(Cell::new(0u64));
        let mut m = readers;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            let (me, bufs, left, bad) = (self.clone(), bufs.clone(), left.clone(), bad.clone());
            let ch = self.data[i].clone();
            let b = self.buf(len);
            self.io(&ch, Op::Read, s, b, move |st, b| {
                if st.is_ok() {
                    bufs.borrow_mut()[i] = Some(b);
                } else {
                    bad.set(bad.get() | 1 << i);
                    me.give_back(b);
                }
                left.set(left.get() - 1);
                if left.get() == 0 {
                    me.chunk_read(kind, s, source, targets, bufs, bad.get());
                }
            });
        }
    }

    fn chunk_read(
        self: &Rc<Self>,
        kind: Kind,
        s: u64,
        source: usize,
        targets: u64,
        bufs: Rc<RefCell<Vec<Option<AlignedBuf>>>>,
        bad: u64,
    ) {
        let sh = self.sh.clone();
        if bad != 0 {
            sh.fail_legs(bad);
        }
        let src = bufs.borrow_mut()[source].take();
        let Some(src) = src else {
            // The source failed: the region is done again from another.
            for b in bufs.borrow_mut().iter_mut().filter_map(Option::take) {
                self.give_back(b);
            }
            if let Some(j) = self.job.borrow_mut().as_mut() {
                j.retry = true;
            }
            return self.chunk_done();
        };
        let len = src.len();
        let mut write_to = match kind {
            Kind::Check | Kind::Repair => {
                let mut differ = 0u64;
                let mut sectors = 0u64;
                for (i, b) in bufs.borrow().iter().enumerate() {
                    let Some(b) = b else { continue };
                    let d = src
                        .as_slice()
                        .chunks_exact(512)
                        .zip(b.as_slice().chunks_exact(512))
                        .filter(|(x, y)| x != y)
                        .count() as u64;
                    if d > 0 {
                        differ |= 1 << i;
                        sectors = sectors.max(d);
                    }
                }
                sh.lock().mismatches += sectors;
                if kind == Kind::Repair {
                    differ
                } else {
                    0
                }
            }
            _ => targets,
        };
        for b in bufs.borrow_mut().iter_mut().filter_map(Option::take) {
            self.give_back(b);
        }
        write_to &= sh.live();
        self.rate_bytes.set(self.rate_bytes.get() + len as u64);
        if write_to == 0 {
            self.give_back(src);
            return self.chunk_done();
        }
        let src = Rc::new(RefCell::new(src));
        let left = Rc::new(Cell::new(write_to.count_ones()));
        let failed = Rc::new(Cell::new(0u64));
        let ptr = src.borrow_mut().as_mut_ptr();
        let mut m = write_to;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            let (me, src, left, failed) = (self.clone(), src.clone(), left.clone(), failed.clone());
            let ch = self.data[i].clone();
            // SAFETY: `src` (whose heap block does not move) is kept alive
            // by this completion's capture until every write of it is done,
            // and nothing writes it meanwhile.
            unsafe {
                self.write_at(&ch, s, ptr, len, move |st| {
                    if !st.is_ok() {
                        failed.set(failed.get() | 1 << i);
                    }
                    left.set(left.get() - 1);
                    if left.get() == 0 {
                        if failed.get() != 0 {
                            me.sh.fail_legs(failed.get());
                        }
                        if let Ok(b) = Rc::try_unwrap(src) {
                            me.give_back(b.into_inner());
                        }
                        me.chunk_done();
                    }
                })
            };
        }
    }

    /// Records, at most every [`CHECKPOINT_EVERY`], that the rebuild has
    /// copied the regions below `at` onto `legs`: once a flush of those
    /// legs makes the copies durable, the next superblock says so, and a
    /// restart goes on from there.
    fn checkpoint(self: &Rc<Self>, at: u64, legs: u64) {
        let now = Instant::now();
        if self.checkpointing.get() || now < self.next_checkpoint.get() {
            return;
        }
        self.checkpointing.set(true);
        let me = self.clone();
        self.flush_legs(true, legs, move |bad| {
            let sh = &*me.sh;
            if bad != 0 {
                sh.fail_legs(bad);
            } else {
                let mut st = sh.lock();
                if st.action == Action::Recover && at > st.recovery_offset {
                    st.recovery_offset = at;
                    st.sb_wanted += 1;
                }
            }
            me.checkpointing.set(false);
            me.next_checkpoint.set(Instant::now() + CHECKPOINT_EVERY);
            me.step();
        });
    }

    /// The region is done: lift the barrier, move on, pace the next.
    fn finish_region(self: &Rc<Self>) {
        let Some(j) = self.job.borrow_mut().take() else {
            return;
        };
        let sh = &*self.sh;
        if !j.retry {
            let mut st = sh.lock();
            match j.kind {
                Kind::Resync => {
                    state::clear(&sh.unsynced, j.region);
                    st.cursor = j.region + 1;
                }
                Kind::Recover | Kind::Check | Kind::Repair => st.cursor = j.region + 1,
                _ => {}
            }
        }
        sh.barrier.store(NO_BARRIER, Ordering::SeqCst);
        sh.kick_all();
        if j.kind == Kind::Recover && !j.retry {
            self.checkpoint(j.region + 1, j.targets);
        }
        let rate = sh.cfg.max_recovery_rate;
        if rate > 0 {
            let t0 = self.rate_t0.get();
            let now = Instant::now();
            if now.duration_since(t0) > Duration::from_secs(1) {
                // A fresh window, so that an idle spell is no credit.
                self.rate_t0.set(now);
                self.rate_bytes.set(0);
            } else {
                let due = t0
                    + Duration::from_secs_f64(
                        self.rate_bytes.get() as f64 / (rate as f64 * 1024.0),
                    );
                if due > now {
                    self.not_before.set(Some(due));
                }
            }
        }
        self.step();
    }
}
