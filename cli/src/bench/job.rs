//! One bench job: a reactor on its own thread keeping `iodepth` I/Os in
//! flight against one device, as fio's job or bdevperf's per-core loop.
//!
//! Each I/O takes a fresh descriptor from the reactor's cache (so the
//! descriptor cache is exercised as the kernel's bio cache is), submits it,
//! and the completion records the latency and issues the slot's next I/O.
//!
//! With queued dispatch ([`JobCfg::dispatch`], seed 004) the I/Os issued in
//! one batch (the start of a phase, or one reactor turn's completions) are
//! held, then sorted by op and sector at the batch's end, and adjacent ones
//! go as one bio with a segment per I/O, up to the device's `max_io_bytes`
//! and `max_segments`; its completion completes each I/O in it (as the
//! export front's queued dispatch does). Stream dispatch holds an I/O only
//! while the next one issued continues it, and sorts nothing; auto (where
//! merging does not help the device) holds as stream does only while other
//! I/Os are in flight, and sends a lone or scattered I/O direct, except
//! that a sequential run held goes on across a jump (the I/O after a held
//! run is held wherever it starts: [`STREAMING`]); at iodepth 1 it is
//! direct. Auto on a device that merging helps weighs queued against
//! direct at iodepths above 1 ([`AutoTrial`]): at the end of each reactor
//! turn past an epoch's end the trial may change the mode, and the I/Os
//! issued after go the new way (what is held was sent at the turn's end,
//! before).

use std::cell::{Cell, UnsafeCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use udm_backends::AlignedBuf;
use udm_core::cputime::thread_cpu;
use udm_core::{
    AutoTrial, Bio, BioPtr, BlockDevice, CacheStats, Channel, Dispatch, Error, Op, Reactor, Status,
    SECTOR_SHIFT,
};

use super::pattern;
use crate::{alloc, clock};

/// The I/O pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Sequential mixed.
    ReadWrite,
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Random mixed.
    RandRw,
}

impl Pattern {
    /// Parses fio's names.
    pub fn parse(s: &str) -> Option<Pattern> {
        Some(match s {
            "read" => Pattern::Read,
            "write" => Pattern::Write,
            "rw" | "readwrite" => Pattern::ReadWrite,
            "randread" => Pattern::RandRead,
            "randwrite" => Pattern::RandWrite,
            "randrw" => Pattern::RandRw,
            _ => return None,
        })
    }
    /// fio's name.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::ReadWrite => "rw",
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::RandRw => "randrw",
        }
    }
    fn random(self) -> bool {
        matches!(
            self,
            Pattern::RandRead | Pattern::RandWrite | Pattern::RandRw
        )
    }
}

/// What one job does.
#[derive(Clone, Debug)]
pub struct JobCfg {
    /// Pattern.
    pub rw: Pattern,
    /// Percentage of reads in mixed patterns.
    pub mix_read: u32,
    /// Block size in bytes.
    pub bs: u32,
    /// I/Os in flight.
    pub iodepth: u32,
    /// First sector of this job's region.
    pub region_start: u64,
    /// Blocks in this job's region.
    pub region_blocks: u64,
    /// Time-based run length (None: one pass over the region).
    pub runtime: Option<Duration>,
    /// Write the region first, unmeasured.
    pub prefill: bool,
    /// Write a pattern over the region, then read it back and compare.
    pub verify: bool,
    /// PRNG seed.
    pub seed: u64,
    /// Direct (each I/O submitted as issued), queued, stream or auto.
    pub dispatch: Dispatch,
    /// Auto dispatch weighs queued against direct (the device reports
    /// that merging helps it: [`Dispatch::choose`], and more than one I/O
    /// is in flight).
    pub weigh: bool,
}

/// What one job measured.
pub struct JobResult {
    /// Latency histogram in ns.
    pub hist: Histogram<u64>,
    /// I/Os completed in the measured phases.
    pub ios: u64,
    /// Reads completed.
    pub reads: u64,
    /// Writes completed.
    pub writes: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// I/Os that completed with an error.
    pub errors: u64,
    /// The first error.
    pub first_error: Option<String>,
    /// Blocks compared in verify.
    pub verified: u64,
    /// Blocks that did not match.
    pub mismatches: u64,
    /// The first mismatch.
    pub first_mismatch: Option<String>,
    /// Wall time of the measured phases.
    pub elapsed: Duration,
    /// Heap allocations on this thread during the measured phases.
    pub allocs: u64,
    /// CPU time of this thread (user, system) during the measured phases.
    pub cpu: (Duration, Duration),
    /// Descriptor-cache counters over the measured phases.
    pub cache: CacheStats,
    /// Auto dispatch's trial ([`JobCfg::weigh`]): the epochs that ran
    /// queued and direct, and the mode it ended in.
    pub weighed: Option<((u64, u64), Dispatch)>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Prefill,
    /// Prefilled; waiting for the measured phase to start.
    Ready,
    Run,
    VerifyWrite,
    VerifyRead,
    Done,
}

/// [`Job::issue`]'s copies: direct dispatch,
const M_DIRECT: u8 = 0;
/// auto (on a device that merging does not help: `Dispatch::choose`),
const M_AUTO: u8 = 1;
/// queued or stream,
const M_HOLD: u8 = 2;
/// auto weighing queued against direct ([`JobCfg::weigh`]): queued's copy
/// or direct's as the trial's mode is now.
const M_WEIGH: u8 = 3;

/// Auto dispatch's [`Job::next_block`] once an I/O that continued the one
/// before was held: the next I/O is held too, wherever it starts. A
/// sequential stream that jumps (a job wrapping to the region's start, a
/// client seeking) goes on from where it lands; sent direct, the jump's
/// first I/O would go alone, and on a device whose completions come back
/// in the groups they went down in (an O_DIRECT file on tmpfs) it stays
/// alone for ever: every later batch goes as 1 + 31 bios at QD32, where
/// queued dispatch sends one. A block number no device reaches.
const STREAMING: u64 = u64::MAX;

struct Slot {
    job: *const Job,
    buf: *mut u8,
    t0: u64,
    /// Queued dispatch: the held I/O, and the next slot of its merged bio
    /// (null: the last).
    op: Op,
    sector: u64,
    next: *mut Slot,
}

struct Job {
    cfg: JobCfg,
    reactor: *const Reactor,
    chan: Rc<dyn Channel>,
    buf_index: u16,
    bs_sectors: u64,
    phase: Cell<Phase>,
    inflight: Cell<u32>,
    /// Blocks issued in the current pass (pass-based phases).
    issued: Cell<u64>,
    deadline: Cell<u64>,
    rng: Cell<u64>,
    /// The order of the current random pass (fio's random map), and how
    /// many blocks of the pass were issued.
    rmap: Cell<RandomMap>,
    rpos: Cell<u64>,
    generation: u64,
    stats: UnsafeCell<Stats>,
    progress: Arc<AtomicU64>,
    slots: UnsafeCell<Vec<Slot>>,
    /// Queued dispatch: the slots whose I/O is held until [`Job::unplug`]
    /// (capacity iodepth, so it never grows).
    plug: UnsafeCell<Vec<*mut Slot>>,
    /// Stream and auto dispatch: the block after the I/O issued last; in
    /// auto dispatch [`STREAMING`] while a sequential run is held.
    next_block: Cell<u64>,
    /// The largest merged bio: the device's limits.
    max_bytes: u32,
    max_segs: usize,
    /// Auto dispatch's trial ([`JobCfg::weigh`]), and its mode: `Queued`
    /// or `Direct` (read per I/O).
    trial: Cell<Option<AutoTrial>>,
    weighed_mode: Cell<Dispatch>,
}

struct Stats {
    hist: Histogram<u64>,
    ios: u64,
    reads: u64,
    writes: u64,
    bytes: u64,
    errors: u64,
    first_error: Option<String>,
    verified: u64,
    mismatches: u64,
    first_mismatch: Option<String>,
}

impl Job {
    /// Runs `f` on the statistics.
    #[inline]
    fn with_stats<R>(&self, f: impl FnOnce(&mut Stats) -> R) -> R {
        // SAFETY: the job runs on one thread, and `f` (code in this file
        // that only updates counters) cannot reach with_stats again.
        f(unsafe { &mut *self.stats.get() })
    }

    #[inline]
    fn next_rand(&self) -> u64 {
        // xorshift64*
        let mut x = self.rng.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// The next (op, block) for the current phase, or None when the phase
    /// has issued all it will.
    // Always: the inliner kept it in `issue` until `issue` had two copies.
    #[inline(always)]
    fn next_io(&self) -> Option<(Op, u64)> {
        let n = self.cfg.region_blocks;
        match self.phase.get() {
            Phase::Run => {
                let i = self.issued.get();
                if self.cfg.runtime.is_none() && i >= n {
                    return None;
                }
                self.issued.set(i + 1);
                let block = if self.cfg.rw.random() {
                    // Every pass covers the region once, in its own order
                    // (counted within the pass: no division per I/O).
                    let mut p = self.rpos.get();
                    if p == n {
                        self.rmap.set(RandomMap::new(n, self.cfg.seed ^ i));
                        p = 0;
                    }
                    self.rpos.set(p + 1);
                    self.rmap.get().get(p)
                } else {
                    i % n
                };
                let op = match self.cfg.rw {
                    Pattern::Read | Pattern::RandRead => Op::Read,
                    Pattern::Write | Pattern::RandWrite => Op::Write,
                    Pattern::ReadWrite | Pattern::RandRw => {
                        if (self.next_rand() % 100) < self.cfg.mix_read as u64 {
                            Op::Read
                        } else {
                            Op::Write
                        }
                    }
                };
                Some((op, block))
            }
            Phase::Prefill | Phase::VerifyWrite | Phase::VerifyRead => {
                let i = self.issued.get();
                if i >= n {
                    return None;
                }
                self.issued.set(i + 1);
                let block = if self.cfg.rw.random() {
                    self.rmap.get().get(i)
                } else {
                    i
                };
                let op = if self.phase.get() == Phase::VerifyRead {
                    Op::Read
                } else {
                    Op::Write
                };
                Some((op, block))
            }
            Phase::Ready | Phase::Done => None,
        }
    }

    /// Issues the slot's next I/O; false when the phase has no more.
    /// `M`: the job's dispatch ([`M_DIRECT`], [`M_AUTO`], [`M_HOLD`] or
    /// [`M_WEIGH`]). A copy per kind, so that direct's has no dispatch code
    /// at all (with auto's test inline in one copy for all modes, direct
    /// paid 5 more instructions per I/O in register saves; with the test
    /// out of line, auto paid a call) and auto's does not test for the
    /// others.
    #[inline]
    fn issue<const M: u8>(&self, slot: *mut Slot) -> bool {
        let Some((op, block)) = self.next_io() else {
            return false;
        };
        // SAFETY: the reactor outlives the job (run_on borrows it for its whole frame).
        let reactor = unsafe { &*self.reactor };
        let sector = self.cfg.region_start + block * self.bs_sectors;
        // SAFETY: slots live in the job's vector, which is not resized after setup.
        let s = unsafe { &mut *slot };
        if op == Op::Write && matches!(self.phase.get(), Phase::VerifyWrite) {
            // SAFETY: the slot's buffer is bs bytes of the job's buffer and
            // no I/O of this slot is in flight.
            let b = unsafe { std::slice::from_raw_parts_mut(s.buf, self.cfg.bs as usize) };
            pattern::fill(b, sector, self.generation);
        }
        let held = match M {
            M_DIRECT => false,
            M_AUTO => self.hold_auto(slot, op, block),
            M_WEIGH => {
                self.weighed_mode.get() == Dispatch::Queued && self.hold(slot, op, block, sector)
            }
            _ => self.hold(slot, op, block, sector),
        };
        if held {
            return true;
        }
        let mut bio = reactor.alloc_bio();
        bio.op = op;
        bio.sector = sector;
        // SAFETY: the slot's buffer stays allocated until the job ends, which
        // waits for every I/O to complete; only this I/O uses it meanwhile.
        unsafe { bio.add_seg(s.buf, self.cfg.bs as usize) };
        bio.buf_index = self.buf_index;
        bio.set_end_io(bench_end_io::<M>, slot.cast());
        self.inflight.set(self.inflight.get() + 1);
        s.t0 = clock::now();
        self.chan.submit(bio);
        true
    }

    /// Queued or stream dispatch: holds the slot's I/O until
    /// [`Job::unplug`] and returns true. In stream mode only an I/O that
    /// starts where the one issued before it ended is held (what is held
    /// goes first when it cannot take this one); any other sends what is
    /// held and returns false, to go direct. Out of line.
    #[inline(never)]
    fn hold(&self, slot: *mut Slot, op: Op, block: u64, sector: u64) -> bool {
        if self.cfg.dispatch == Dispatch::Stream {
            if self.next_block.replace(block + 1) != block {
                self.unplug();
                return false;
            }
            if !self.continues_plug(op, sector) {
                self.unplug();
            }
        }
        self.hold_slot(slot, op, sector);
        true
    }

    /// Auto dispatch: holds the I/O as stream does ([`Job::hold`]) only
    /// while other I/Os are in flight and it continues the one issued
    /// before it, or follows a held run ([`STREAMING`]); false: it goes
    /// direct. Inline, so that what goes direct pays only the test: a lone
    /// I/O (nothing in flight, so nothing held) is not even recorded, and a
    /// scattered one records where it ends but leaves a run held meanwhile
    /// to the batch's end.
    #[inline]
    fn hold_auto(&self, slot: *mut Slot, op: Op, block: u64) -> bool {
        // Held I/Os count as in flight: with none, nothing is held and
        // this one could merge with nothing. Where the last ended is
        // tested first: a scattered I/O then pays no load of the count.
        // A stream held stores nothing here: the run's end is the plug's.
        let last = self.next_block.get();
        if (last != block && last != STREAMING) || self.inflight.get() == 0 {
            self.next_block.set(block + 1);
            return false;
        }
        self.hold_auto_run(slot, op, block);
        true
    }

    /// [`Job::hold_auto`]'s holding, out of line: kept out of `issue`, it
    /// leaves direct's path there the registers it has in direct's copy.
    /// It finds the sector itself: passing it cost `issue` a spill. An I/O
    /// that extends the run held (or starts one: nothing held) keeps the
    /// stream's mark, so the next is held whatever it starts at; one that
    /// does not is a jump: the run goes, this one starts the next, and the
    /// I/O after it is held only if it continues it (scattered I/O drops
    /// back to direct's path after one held I/O).
    #[inline(never)]
    fn hold_auto_run(&self, slot: *mut Slot, op: Op, block: u64) {
        let sector = self.cfg.region_start + block * self.bs_sectors;
        if !self.continues_plug(op, sector) {
            self.unplug();
            self.next_block.set(block + 1);
        } else if self.next_block.get() != STREAMING {
            self.next_block.set(STREAMING);
        }
        self.hold_slot(slot, op, sector);
    }

    /// Adds the slot's I/O to the plug, until [`Job::unplug`].
    #[inline]
    fn hold_slot(&self, slot: *mut Slot, op: Op, sector: u64) {
        // SAFETY: slots live in the job's vector, which is not resized
        // after setup; no I/O of this slot is in flight.
        let s = unsafe { &mut *slot };
        s.op = op;
        s.sector = sector;
        self.inflight.set(self.inflight.get() + 1);
        s.t0 = clock::now();
        // SAFETY: the job runs on one thread and nothing else borrows the
        // plug list while this pushes (unplug does not issue).
        unsafe { (*self.plug.get()).push(slot) };
    }

    fn start_phase(&self, p: Phase) {
        self.phase.set(p);
        self.issued.set(0);
        if p == Phase::Run {
            if let Some(rt) = self.cfg.runtime {
                self.deadline.set(clock::now() + clock::ticks_in(rt));
            }
        }
        if matches!(p, Phase::Done | Phase::Ready) {
            return;
        }
        // The phase's first batch is one submission (the kernel plugs
        // one too): stream and auto hold its first I/O as well, as if it
        // continued a run (a phase starts at block 0 but for random
        // passes) with the batch in flight behind it. Sent alone, it would
        // split every later batch of a device whose completions come back
        // in the groups they went down in (the O_DIRECT file: 1 + 3 at QD4
        // for ever), where queued dispatch sends one bio.
        self.next_block.set(0);
        self.inflight.set(self.inflight.get() + 1);
        // SAFETY: the slot vector is not resized after setup.
        let n = unsafe { (*self.slots.get()).len() };
        for i in 0..n {
            // SAFETY: as above; `i` is in bounds.
            let slot = unsafe { (*self.slots.get()).as_mut_ptr().add(i) };
            // At iodepth 1 auto is direct: each I/O is alone in flight, so
            // its test could only ever say "send it" (and costs 8-11
            // instructions per I/O to say so).
            let more = match self.cfg.dispatch {
                Dispatch::Direct => self.issue::<M_DIRECT>(slot),
                Dispatch::Auto if self.cfg.weigh => self.issue::<M_WEIGH>(slot),
                Dispatch::Auto if self.cfg.iodepth == 1 => self.issue::<M_DIRECT>(slot),
                Dispatch::Auto => self.issue::<M_AUTO>(slot),
                _ => self.issue::<M_HOLD>(slot),
            };
            if !more {
                break;
            }
        }
        self.unplug();
        self.inflight.set(self.inflight.get() - 1);
        if self.inflight.get() == 0 {
            self.advance();
        }
    }

    /// Stream and auto dispatch: whether an I/O of `op` at `sector`, where
    /// the one issued before it ended, can join the run held (or nothing is
    /// held) within the device's limits. In auto dispatch the one before
    /// may have gone direct after the run: then it cannot.
    fn continues_plug(&self, op: Op, sector: u64) -> bool {
        // SAFETY: the job runs on one thread; nothing else borrows the
        // plug list during this call.
        let plug = unsafe { &*self.plug.get() };
        let Some(&last) = plug.last() else {
            return true;
        };
        // SAFETY: the plug's entries are slots of the job's vector, not
        // resized after setup.
        let (lop, lsector) = unsafe { ((*last).op, (*last).sector) };
        lop == op
            && lsector + self.bs_sectors == sector
            && plug.len() < self.max_segs
            && (plug.len() as u32 + 1) * self.cfg.bs <= self.max_bytes
    }

    /// Submits the I/Os held for queued or stream dispatch (queued sorts
    /// them by op and sector first; stream's are one run already),
    /// adjacent ones merged into one bio of a segment each. Nothing held
    /// (always, in direct mode): returns at once.
    #[inline]
    fn unplug(&self) {
        // SAFETY: the job runs on one thread; nothing else borrows the
        // plug list during this call.
        if unsafe { (*self.plug.get()).is_empty() } {
            return;
        }
        self.send_plug();
    }

    /// [`Job::unplug`]'s work, out of line: the hot callers only test
    /// whether anything is held.
    #[inline(never)]
    fn send_plug(&self) {
        // SAFETY: the job runs on one thread; nothing issues while this
        // runs (bios complete only from a later reactor turn).
        let plug = unsafe { &mut *self.plug.get() };
        // The plug's entries are slots of the job's vector, not resized
        // after setup, each with its I/O held ("see above" below).
        if self.cfg.dispatch == Dispatch::Queued || self.cfg.weigh {
            plug.sort_unstable_by_key(|&s| {
                // SAFETY: see above.
                unsafe { ((*s).op as u8, (*s).sector) }
            });
        }
        // SAFETY: as in issue.
        let reactor = unsafe { &*self.reactor };
        let bs = self.cfg.bs;
        let mut i = 0;
        while i < plug.len() {
            let first = plug[i];
            // SAFETY: see above.
            let (op, sector) = unsafe { ((*first).op, (*first).sector) };
            let (mut j, mut len) = (i + 1, bs);
            while j < plug.len()
                && j - i < self.max_segs
                && len + bs <= self.max_bytes
                // SAFETY: see above.
                && unsafe { (*plug[j]).op == op && (*plug[j]).sector == sector + (len >> SECTOR_SHIFT) as u64 }
            {
                len += bs;
                j += 1;
            }
            let mut bio = reactor.alloc_bio();
            bio.op = op;
            bio.sector = sector;
            for k in i..j {
                let next = if k + 1 < j {
                    plug[k + 1]
                } else {
                    std::ptr::null_mut()
                };
                // SAFETY: see above; the slot's buffer is bs bytes of the
                // job's buffer, allocated until the job ends, which waits
                // for every I/O; only this I/O uses it meanwhile.
                unsafe {
                    (*plug[k]).next = next;
                    bio.add_seg((*plug[k]).buf, bs as usize);
                }
            }
            if j == i + 1 {
                bio.buf_index = self.buf_index;
            }
            // Each I/O's next goes as the job's mode sends it (auto's
            // through auto's test, not stream's).
            let end_io = if self.cfg.weigh {
                bench_merged_end_io::<M_WEIGH>
            } else if self.cfg.dispatch == Dispatch::Auto {
                bench_merged_end_io::<M_AUTO>
            } else {
                bench_merged_end_io::<M_HOLD>
            };
            bio.set_end_io(end_io, first.cast());
            self.chan.submit(bio);
            i = j;
        }
        plug.clear();
    }

    /// Whether a reactor turn may leave an I/O held: in queued and stream
    /// dispatch, and in auto dispatch with more than one I/O in flight. At
    /// iodepth 1 every I/O a completion issues has nothing else in flight,
    /// so auto sends it direct, and the run loop need not look for a batch
    /// to send (a phase's first batch, held, [`Job::start_phase`] sends).
    /// Weighing queued against direct, it may hold at any iodepth.
    fn may_hold(&self) -> bool {
        match self.cfg.dispatch {
            Dispatch::Direct => false,
            Dispatch::Auto => self.cfg.iodepth > 1 || self.cfg.weigh,
            Dispatch::Queued | Dispatch::Stream => true,
        }
    }

    /// At the end of a reactor turn (what it held sent): ends the trial's
    /// epoch if it has run its time; the I/Os issued from now on go the
    /// way the trial chose for the next epoch.
    #[inline]
    fn weigh(&self) {
        if let Some(mut t) = self.trial.get() {
            let now = Instant::now();
            if now >= t.end() {
                let ios = self.with_stats(|st| st.ios);
                self.weighed_mode.set(t.end_epoch_at(now, ios));
                self.trial.set(Some(t));
            }
        }
    }

    /// Moves to the next phase once the current one has drained.
    fn advance(&self) {
        let next = match self.phase.get() {
            Phase::Prefill => Phase::Ready,
            Phase::VerifyWrite => Phase::VerifyRead,
            Phase::Ready | Phase::Run | Phase::VerifyRead | Phase::Done => Phase::Done,
        };
        self.start_phase(next);
    }
}

/// `M`: as in [`Job::issue`].
fn bench_end_io<const M: u8>(bio: BioPtr) {
    let slot = bio.private() as *mut Slot;
    // SAFETY: private is a slot of a live job (set in issue).
    let job = unsafe { &*(*slot).job };
    let now = clock::now();
    let phase = job.phase.get();
    if phase != Phase::Prefill {
        // SAFETY: as above.
        let t0 = unsafe { (*slot).t0 };
        let lat = clock::to_ns(now.wrapping_sub(t0));
        job.complete(bio.op, bio.len(), bio.sector, bio.status(), lat, slot);
    }
    drop(bio); // back to the cache before the next allocation
    job.inflight.set(job.inflight.get() - 1);
    let more = phase != Phase::Run || job.cfg.runtime.is_none() || now < job.deadline.get();
    if !(more && job.issue::<M>(slot)) && job.inflight.get() == 0 {
        job.advance();
    }
}

/// The end_io of a bio that [`Job::unplug`] sent (queued, stream or auto
/// dispatch): private is the first slot of the chain of I/Os it carries;
/// each completes with the bio's status.
/// `M`: as in [`Job::issue`] ([`M_AUTO`], [`M_HOLD`] or [`M_WEIGH`]).
fn bench_merged_end_io<const M: u8>(bio: BioPtr) {
    let mut slot = bio.private() as *mut Slot;
    // SAFETY: private is a slot of a live job (set in unplug).
    let job = unsafe { &*(*slot).job };
    let now = clock::now();
    let phase = job.phase.get();
    let status = bio.status();
    drop(bio);
    let bs = job.cfg.bs;
    while !slot.is_null() {
        // SAFETY: the chain's slots are the job's (unplug linked them);
        // `next` is read before the slot's next I/O relinks it.
        let (next, op, sector, t0) =
            unsafe { ((*slot).next, (*slot).op, (*slot).sector, (*slot).t0) };
        if phase != Phase::Prefill {
            let lat = clock::to_ns(now.wrapping_sub(t0));
            job.complete(op, bs, sector, status, lat, slot);
        }
        job.inflight.set(job.inflight.get() - 1);
        let more = phase != Phase::Run || job.cfg.runtime.is_none() || now < job.deadline.get();
        if !(more && job.issue::<M>(slot)) && job.inflight.get() == 0 {
            job.advance();
        }
        slot = next;
    }
}

impl Job {
    #[inline(always)]
    fn complete(
        &self,
        op: Op,
        len: u32,
        sector: u64,
        status: Status,
        lat_ns: u64,
        slot: *mut Slot,
    ) {
        let ios = self.with_stats(|st| {
            let _ = st.hist.record(lat_ns.max(1));
            st.ios += 1;
            st.bytes += len as u64;
            if op == Op::Read {
                st.reads += 1;
            } else {
                st.writes += 1;
            }
            st.ios
        });
        if ios & 1023 == 0 {
            self.progress.store(ios, Ordering::Relaxed);
        }
        if status != Status::Ok {
            self.record_error(op, len, sector, status);
        } else if self.phase.get() == Phase::VerifyRead {
            // SAFETY: the read completed into the slot's buffer; nothing else
            // uses it until the slot's next I/O.
            let b = unsafe { std::slice::from_raw_parts((*slot).buf, len as usize) };
            let r = pattern::check(b, sector, self.generation);
            self.with_stats(|st| {
                st.verified += 1;
                if let Err(m) = r {
                    st.mismatches += 1;
                    st.first_mismatch.get_or_insert(m);
                }
            });
        }
    }

    #[cold]
    fn record_error(&self, op: Op, len: u32, sector: u64, status: Status) {
        self.with_stats(|st| {
            st.errors += 1;
            if st.first_error.is_none() {
                st.first_error = Some(format!(
                    "{} of {len} bytes at sector {sector}: {status}",
                    op.name()
                ));
            }
        });
    }
}

/// A job's result, with the I/O buffer registered with its reactor: handed
/// out so that the caller frees it only after the reactor is gone (a
/// [`udm_core::ReactorPool`] drops a thread's reactor before handing on what
/// its main returned).
pub struct JobOutput {
    /// What the job measured, or why it failed.
    pub result: Result<JobResult, Error>,
    /// The buffer the job's I/O used.
    pub buf: AlignedBuf,
}

/// Runs one job to the end on `reactor` (the calling thread's).
pub fn run_job(
    reactor: &Reactor,
    dev: Arc<dyn BlockDevice>,
    cfg: JobCfg,
    ready: Arc<Barrier>,
    progress: Arc<AtomicU64>,
) -> JobOutput {
    let mut buf = AlignedBuf::new(cfg.bs as usize * cfg.iodepth as usize);
    let result = run_on(reactor, &mut buf, dev, cfg, ready, progress);
    JobOutput { result, buf }
}

fn run_on(
    reactor: &Reactor,
    buf: &mut AlignedBuf,
    dev: Arc<dyn BlockDevice>,
    cfg: JobCfg,
    ready: Arc<Barrier>,
    progress: Arc<AtomicU64>,
) -> Result<JobResult, Error> {
    let bs = cfg.bs as usize;
    let base = buf.as_mut_ptr();
    let chan = dev.clone().open(reactor)?;
    // SAFETY: `buf` is owned by run_job's caller, which frees it only after
    // the reactor is dropped (see JobOutput).
    let buf_index =
        unsafe { reactor.register_buffer(base, bs * cfg.iodepth as usize) }.unwrap_or(Bio::NO_BUF);
    let job = Job {
        bs_sectors: (cfg.bs >> SECTOR_SHIFT) as u64,
        reactor,
        chan,
        buf_index,
        phase: Cell::new(Phase::Done),
        inflight: Cell::new(0),
        issued: Cell::new(0),
        deadline: Cell::new(u64::MAX),
        rng: Cell::new(cfg.seed | 1),
        rmap: Cell::new(RandomMap::new(cfg.region_blocks, cfg.seed)),
        rpos: Cell::new(0),
        generation: cfg.seed,
        stats: UnsafeCell::new(Stats {
            hist: Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
                .map_err(|e| Error::invalid(format!("histogram: {e}")))?,
            ios: 0,
            reads: 0,
            writes: 0,
            bytes: 0,
            errors: 0,
            first_error: None,
            verified: 0,
            mismatches: 0,
            first_mismatch: None,
        }),
        progress,
        slots: UnsafeCell::new(Vec::new()),
        plug: UnsafeCell::new(Vec::with_capacity(cfg.iodepth as usize)),
        next_block: Cell::new(u64::MAX),
        max_bytes: dev.limits().max_io_bytes.max(cfg.bs),
        max_segs: dev.limits().max_segments.max(1) as usize,
        trial: Cell::new(None),
        weighed_mode: Cell::new(Dispatch::Queued),
        cfg,
    };
    {
        // SAFETY: setup, before any I/O: nothing else borrows the vector.
        let slots = unsafe { &mut *job.slots.get() };
        for i in 0..job.cfg.iodepth as usize {
            slots.push(Slot {
                job: &job,
                // SAFETY: i * bs is inside the iodepth * bs buffer.
                buf: unsafe { base.add(i * bs) },
                t0: 0,
                op: Op::Read,
                sector: 0,
                next: std::ptr::null_mut(),
            });
        }
    }
    ready.wait();

    if job.cfg.prefill && !job.cfg.verify {
        job.start_phase(Phase::Prefill);
        let prefilled = || job.phase.get() != Phase::Prefill;
        if job.may_hold() {
            reactor.run_until(|| {
                job.unplug();
                prefilled()
            });
        } else {
            reactor.run_until(prefilled);
        }
    }
    if !matches!(job.cfg.rw, Pattern::Read | Pattern::RandRead) {
        flush_first(reactor, &*job.chan);
    }
    let t0 = std::time::Instant::now();
    let a0 = alloc::thread_allocs();
    let c0 = thread_cpu();
    let k0 = reactor.cache_stats();
    if job.cfg.weigh {
        // Weighed over the measured phases only; a prefill is not the
        // workload.
        job.trial.set(Some(AutoTrial::new(t0, 0)));
        job.weighed_mode.set(Dispatch::Queued);
    }
    job.start_phase(if job.cfg.verify {
        Phase::VerifyWrite
    } else {
        Phase::Run
    });
    // Each call of the closure after a turn ends that turn's batch: the
    // I/Os its completions issued go down together (queued and stream
    // dispatch).
    // (Two loops, so that a job that never holds an I/O pays nothing for
    // the check.)
    let done = || job.phase.get() == Phase::Done && job.inflight.get() == 0;
    if job.cfg.weigh {
        reactor.run_until(|| {
            job.unplug();
            job.weigh();
            done()
        });
    } else if job.may_hold() {
        reactor.run_until(|| {
            job.unplug();
            done()
        });
    } else {
        reactor.run_until(done);
    }
    let elapsed = t0.elapsed();
    let allocs = alloc::thread_allocs() - a0;
    let c1 = thread_cpu();
    let k1 = reactor.cache_stats();

    let weighed = job.trial.get().map(|t| (t.epochs(), t.mode()));
    let Job { stats, chan, .. } = job;
    drop(chan);
    let st = stats.into_inner();
    Ok(JobResult {
        hist: st.hist,
        ios: st.ios,
        reads: st.reads,
        writes: st.writes,
        bytes: st.bytes,
        errors: st.errors,
        first_error: st.first_error,
        verified: st.verified,
        mismatches: st.mismatches,
        first_mismatch: st.first_mismatch,
        elapsed,
        allocs,
        cpu: (c1.0.saturating_sub(c0.0), c1.1.saturating_sub(c0.1)),
        cache: CacheStats {
            hits: k1.hits - k0.hits,
            misses: k1.misses - k0.misses,
            frees: k1.frees - k0.frees,
        },
        weighed,
    })
}

/// One flush, unmeasured, before a run that writes. A device whose cache
/// stays write-through until it sees a first flush (librbd's
/// `rbd_cache_writethrough_until_flush`, a guard for clients that never
/// flush) is then measured in the mode it serves every client that flushes
/// in, as fio's rbd engine measures it. Elsewhere a flush of nothing costs
/// nothing. Its status does not matter here: the run reports errors.
fn flush_first(reactor: &Reactor, chan: &dyn Channel) {
    fn done(bio: BioPtr) {
        let flag = bio.private() as *const Cell<bool>;
        // SAFETY: `private` is `flushed` below, which outlives the flush:
        // its frame waits in run_until until this sets it.
        unsafe { (*flag).set(true) };
    }
    let flushed = Cell::new(false);
    let mut bio = reactor.alloc_bio();
    bio.op = Op::Flush;
    bio.set_end_io(done, &flushed as *const Cell<bool> as *mut ());
    chan.submit(bio);
    reactor.run_until(|| flushed.get());
}

/// The order of a random pass, as fio's random map gives it: every block of
/// `0..n` exactly once (`fio --rw=randwrite --size=400M` writes each block
/// once, and so does `udm bench` with `--size`), without fio's bitmap or a
/// table of `n` entries. It is a keyed bijection of the next power of two
/// (two rounds of: xor a key, multiply by an odd key, xor-shift right; each is
/// a bijection on `bits`-bit numbers), cycle-walked into `0..n`: values at or
/// above `n` are mapped again until one lands inside, which keeps it a
/// bijection of `0..n` and takes under two steps on average.
#[derive(Clone, Copy, Debug)]
struct RandomMap {
    n: u64,
    mask: u64,
    shift: u32,
    xors: [u64; 2],
    muls: [u64; 2],
}

impl RandomMap {
    fn new(n: u64, seed: u64) -> RandomMap {
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(1);
        let mask = u64::MAX >> (64 - bits);
        let mut x = seed;
        let mut key = || {
            // splitmix64: independent-looking keys from one seed.
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        RandomMap {
            n,
            mask,
            shift: (bits / 2).max(1),
            xors: [key() & mask, key() & mask],
            muls: [key() | 1, key() | 1],
        }
    }

    #[inline]
    fn step(&self, mut x: u64) -> u64 {
        for r in 0..2 {
            x = (x ^ self.xors[r]).wrapping_mul(self.muls[r]) & self.mask;
            x ^= x >> self.shift;
        }
        x
    }

    /// The `i`-th block of the pass (`i < n`).
    #[inline]
    fn get(&self, i: u64) -> u64 {
        let mut x = self.step(i);
        while x >= self.n {
            x = self.step(x);
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::RandomMap;

    /// A random pass visits every block exactly once, whatever the size.
    #[test]
    fn random_map_is_a_permutation() {
        for n in (1..300).chain([1000, 4096, 4097, 65_537, 800]) {
            for seed in [0, 1, 0xdead_beef] {
                let m = RandomMap::new(n, seed);
                let mut seen = vec![false; n as usize];
                for i in 0..n {
                    let b = m.get(i) as usize;
                    assert!(!seen[b], "n {n} seed {seed}: block {b} twice");
                    seen[b] = true;
                }
            }
        }
    }

    /// The order is not the identity nor close to it, and passes differ.
    #[test]
    fn random_map_shuffles() {
        let n = 800;
        let (a, b) = (RandomMap::new(n, 1), RandomMap::new(n, 2));
        let fixed = (0..n).filter(|&i| a.get(i) == i).count();
        let ascending = (1..n).filter(|&i| a.get(i) == a.get(i - 1) + 1).count();
        let same = (0..n).filter(|&i| a.get(i) == b.get(i)).count();
        assert!(
            fixed < 20 && ascending < 40 && same < 20,
            "{fixed} {ascending} {same}"
        );
    }
}
