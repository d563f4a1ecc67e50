//! raid1's shared state: the configuration, what the I/O path reads on
//! every bio (atomics: per-region writers and bits, leg masks), and what
//! only the worker and the slow paths change (behind a mutex).
//!
//! The I/O path and the worker meet on two handshakes, each a store then a
//! load on both sides (sequentially consistent), so that one of the two
//! always sees the other:
//! - a write counts itself in its regions' writers, then looks at
//!   `barrier`; a resync sets `barrier`, then waits for the writers to
//!   drain;
//! - a write counts itself, then looks at `ondisk`; the daemon clears
//!   `ondisk`, then looks at the writers (and puts the bit back if any).
//!
//! Writers are counted per reactor ([`Counts`]): only the reactor's channel
//! changes its counts, so counting a write out is a plain store (no locked
//! instruction, which would wait for the leg's copy to leave the store
//! buffer); counting in is one locked add, the handshakes' store-load
//! order. The worker sums the counts over the reactors.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use udm_core::{BlockDevice, ReactorHandle};

/// No region under the resync barrier.
pub(crate) const NO_BARRIER: u64 = u64::MAX;

/// One leg: its metadata device (if any) and its data device.
pub(crate) struct Leg {
    pub meta: Option<Arc<dyn BlockDevice>>,
    pub data: Arc<dyn BlockDevice>,
}

/// What the table line says.
pub(crate) struct Config {
    pub legs: Vec<Leg>,
    /// The array's length in sectors.
    pub len: u64,
    /// log2 of the region size in sectors.
    pub region_shift: u32,
    pub nregions: u64,
    pub write_mostly: u64,
    pub rebuild: u64,
    pub nosync: bool,
    pub sync: bool,
    /// KiB/s per leg; 0 for no limit.
    pub max_recovery_rate: u64,
    pub daemon_sleep: Duration,
}

/// A background action (dm-raid's `sync_action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Idle,
    Resync,
    Recover,
    Check,
    Repair,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Idle => "idle",
            Action::Resync => "resync",
            Action::Recover => "recover",
            Action::Check => "check",
            Action::Repair => "repair",
        }
    }
}

/// What the worker and the slow paths share behind the lock.
pub(crate) struct State {
    /// Regions whose dirty bit writes wait for (bit per region).
    pub want_mark: Vec<u64>,
    pub mark_wanted: bool,
    /// The superblock must be written (a leg failed, a rebuild ended).
    pub sb_wanted: u64,
    /// The last superblock generation written.
    pub sb_done: u64,
    /// The rebuild's checkpoint the superblock records (region index; see
    /// `Super::recovery_offset`), and where a rebuild starts.
    pub recovery_offset: u64,
    /// The running action and where it is (region index).
    pub action: Action,
    pub frozen: bool,
    pub cursor: u64,
    /// Sectors found different by the last check or repair.
    pub mismatches: u64,
    /// Reads that failed on a leg and succeeded on another: (region, legs
    /// to rewrite).
    pub repairs: Vec<(u64, u64)>,
    /// The worker is started on the array (the table is live).
    pub active: bool,
    /// The array's identity and events count (the superblock's).
    pub uuid: [u8; 16],
    pub events: u64,
}

/// The state every reactor's channel and the worker share.
pub(crate) struct Shared {
    pub cfg: Config,
    st: Mutex<State>,
    /// Every leg (a mask of `cfg.legs.len()` bits).
    all: u64,
    /// Every reactor's writes in flight per region.
    writers: Mutex<Vec<Counts>>,
    /// Regions whose dirty bit is durable: writes go straight to the legs.
    pub ondisk: Vec<AtomicU64>,
    /// Regions written since the daemon last looked (kept dirty a pass).
    pub touched: Vec<AtomicU64>,
    /// Regions that may differ between legs until resynced: reads go to
    /// the resync's source leg.
    pub unsynced: Vec<AtomicU64>,
    /// Any region unsynced (saves the lookup on reads otherwise).
    pub any_unsynced: AtomicBool,
    /// The region the resync holds, or [`NO_BARRIER`].
    pub barrier: AtomicU64,
    /// A newer instance on the same metadata went live: this one only
    /// marks (never clears) and starts no resync.
    pub retired: AtomicBool,
    /// No leg's metadata could be written: writes fail.
    pub meta_dead: AtomicBool,
    /// Legs failed ('D').
    pub failed: AtomicU64,
    /// Legs in sync ('A'); a live leg not in it is being rebuilt ('a').
    pub insync: AtomicU64,
    /// The common case of the read path in one word (see [`Shared::paths`]):
    /// [`PAIR`] and the two legs reads choose between, or 0.
    pub read_pair: AtomicU64,
    /// The same for writes: [`PAIR`] and the two live legs, or 0.
    pub write_pair: AtomicU64,
    /// Serializes [`Shared::paths`], so that the last to run stores what
    /// the last change made.
    paths_lock: Mutex<()>,
    /// Events raised (leg failures, actions finished) for `udm wait`.
    pub events: AtomicU64,
    pub worker: OnceLock<ReactorHandle>,
    pub poked: AtomicBool,
    pub stop: AtomicBool,
    /// Each reactor's channel: its handle and local key.
    pub chans: Mutex<Vec<(ReactorHandle, u64)>>,
}

/// In [`Shared::read_pair`] and [`Shared::write_pair`]: the common case
/// holds; the two legs are in bits 0..8 and 8..16.
pub(crate) const PAIR: u64 = 1 << 63;

/// One reactor's writes in flight per region (see the module docs).
pub(crate) type Counts = Arc<[AtomicU32]>;

#[inline]
pub(crate) fn test(v: &[AtomicU64], i: u64) -> bool {
    v[(i / 64) as usize].load(Ordering::SeqCst) & (1 << (i % 64)) != 0
}

#[inline]
pub(crate) fn set(v: &[AtomicU64], i: u64) {
    v[(i / 64) as usize].fetch_or(1 << (i % 64), Ordering::SeqCst);
}

#[inline]
pub(crate) fn clear(v: &[AtomicU64], i: u64) {
    v[(i / 64) as usize].fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
}

fn bits(n: u64) -> Vec<AtomicU64> {
    (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
}

impl Shared {
    pub fn new(cfg: Config) -> Shared {
        let n = cfg.nregions;
        let words = n.div_ceil(64) as usize;
        Shared {
            writers: Mutex::new(Vec::new()),
            // At most MAX_LEGS (32) legs.
            all: (1u64 << cfg.legs.len()) - 1,
            ondisk: bits(n),
            touched: bits(n),
            unsynced: bits(n),
            any_unsynced: AtomicBool::new(false),
            barrier: AtomicU64::new(NO_BARRIER),
            retired: AtomicBool::new(false),
            meta_dead: AtomicBool::new(false),
            failed: AtomicU64::new(0),
            insync: AtomicU64::new(0),
            read_pair: AtomicU64::new(0),
            write_pair: AtomicU64::new(0),
            paths_lock: Mutex::new(()),
            events: AtomicU64::new(0),
            st: Mutex::new(State {
                want_mark: vec![0; words],
                mark_wanted: false,
                sb_wanted: 0,
                sb_done: 0,
                action: Action::Idle,
                recovery_offset: 0,
                frozen: false,
                cursor: 0,
                mismatches: 0,
                repairs: Vec::new(),
                active: false,
                uuid: [0; 16],
                events: 0,
            }),
            worker: OnceLock::new(),
            poked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            chans: Mutex::new(Vec::new()),
            cfg,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the worker to look at the state again.
    pub fn poke(&self) {
        if !self.poked.swap(true, Ordering::AcqRel) {
            if let Some(h) = self.worker.get() {
                h.wake();
            }
        }
    }

    /// The legs that mask of all.
    #[inline]
    pub fn all_legs(&self) -> u64 {
        self.all
    }

    /// Live legs: every write goes to each.
    #[inline]
    pub fn live(&self) -> u64 {
        self.all_legs() & !self.failed.load(Ordering::Acquire)
    }

    /// Legs that may serve reads: live and in sync.
    #[inline]
    pub fn readable(&self) -> u64 {
        self.insync.load(Ordering::Acquire) & !self.failed.load(Ordering::Acquire)
    }

    /// Recomputes [`Shared::read_pair`] and [`Shared::write_pair`]; called
    /// after every change to `failed`, `insync`, `any_unsynced` or
    /// `meta_dead`. Reads: exactly two readable legs that are not
    /// write-mostly, and no region unsynced (no read needs the source
    /// leg). Writes: exactly two live legs, and metadata that can be
    /// written. A bio that reads a word just before a change acts as one
    /// that loaded the masks just before it did.
    pub fn paths(&self) {
        let _g = self.paths_lock.lock().unwrap_or_else(|p| p.into_inner());
        let pair = |m: u64| {
            if m.count_ones() == 2 {
                let b = (m & (m - 1)).trailing_zeros() as u64;
                PAIR | m.trailing_zeros() as u64 | b << 8
            } else {
                0
            }
        };
        let normal = self.readable() & !self.cfg.write_mostly;
        let r = if self.any_unsynced.load(Ordering::SeqCst) {
            0
        } else {
            pair(normal)
        };
        let w = if self.meta_dead.load(Ordering::SeqCst) {
            0
        } else {
            pair(self.live())
        };
        self.read_pair.store(r, Ordering::SeqCst);
        self.write_pair.store(w, Ordering::SeqCst);
    }

    /// The leg a resync copies from, and reads of unsynced regions go to:
    /// the first readable leg that is not write-mostly, else the first
    /// readable one.
    pub fn source(&self) -> Option<usize> {
        let r = self.readable();
        let normal = r & !self.cfg.write_mostly;
        let m = if normal != 0 { normal } else { r };
        (m != 0).then(|| m.trailing_zeros() as usize)
    }

    /// The regions `[sector, sector + sectors)` touch, first and last.
    #[inline]
    pub fn regions(&self, sector: u64, sectors: u64) -> (u64, u64) {
        let s = self.cfg.region_shift;
        (sector >> s, (sector + sectors.max(1) - 1) >> s)
    }

    /// New counts for a reactor's channel, summed by [`Shared::writing`].
    pub fn new_counts(&self) -> Counts {
        let c: Counts = (0..self.cfg.nregions).map(|_| AtomicU32::new(0)).collect();
        let mut w = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        // Counts only this list holds belong to closed channels (all zero).
        w.retain(|c| Arc::strong_count(c) > 1);
        w.push(c.clone());
        c
    }

    /// Whether a write to region `r` is in flight on any reactor.
    pub fn writing(&self, r: u64) -> bool {
        let w = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        w.iter().any(|c| c[r as usize].load(Ordering::SeqCst) != 0)
    }

    /// A write to regions `r0..=r1` starts on the reactor that owns `w`:
    /// counts it in, and returns whether it may go to the legs now. If not
    /// (a region is under the resync barrier, or its dirty bit is not
    /// durable yet) it is counted out again, the mark it needs is asked
    /// for, and the caller parks it until the worker kicks the channels.
    #[inline(always)]
    pub fn enter(&self, w: &[AtomicU32], r0: u64, r1: u64) -> bool {
        if r0 == r1 {
            // One region, already marked, no barrier on it (the common
            // case): one locked add, then loads.
            let r = r0;
            w[r as usize].fetch_add(1, Ordering::SeqCst);
            let (i, bit) = ((r / 64) as usize, 1u64 << (r % 64));
            if self.barrier.load(Ordering::SeqCst) != r
                && self.ondisk[i].load(Ordering::SeqCst) & bit != 0
            {
                if self.touched[i].load(Ordering::Relaxed) & bit == 0 {
                    self.touched[i].fetch_or(bit, Ordering::Relaxed);
                }
                return true;
            }
            return self.enter_retry(w, r);
        }
        self.enter_slow(w, r0, r1)
    }

    /// [`Shared::enter`] for one region that is not marked or is under
    /// the barrier: counted out again, then as any range.
    #[cold]
    fn enter_retry(&self, w: &[AtomicU32], r: u64) -> bool {
        self.exit(w, r, r);
        self.enter_slow(w, r, r)
    }

    /// [`Shared::enter`] for any range.
    #[cold]
    fn enter_slow(&self, w: &[AtomicU32], r0: u64, r1: u64) -> bool {
        let mut ok = true;
        for r in r0..=r1 {
            w[r as usize].fetch_add(1, Ordering::SeqCst);
        }
        let b = self.barrier.load(Ordering::SeqCst);
        if (r0..=r1).contains(&b) {
            ok = false;
        }
        let mut need_mark = false;
        if ok {
            for r in r0..=r1 {
                if !test(&self.ondisk, r) {
                    need_mark = true;
                }
                let (i, bit) = ((r / 64) as usize, 1u64 << (r % 64));
                if self.touched[i].load(Ordering::Relaxed) & bit == 0 {
                    self.touched[i].fetch_or(bit, Ordering::Relaxed);
                }
            }
        }
        if ok && !need_mark {
            return true;
        }
        self.exit(w, r0, r1);
        if need_mark {
            let mut st = self.lock();
            for r in r0..=r1 {
                if !test(&self.ondisk, r) {
                    st.want_mark[(r / 64) as usize] |= 1 << (r % 64);
                }
            }
            st.mark_wanted = true;
            drop(st);
            self.poke();
        }
        false
    }

    /// A write to regions `r0..=r1` is done with the legs, on the reactor
    /// that owns `w` (the only one that changes it: a load and a store).
    /// A resync that waits for one of the regions to drain is poked; should
    /// it miss the store, it looks again on its own (see
    /// `Worker::next_deadline`).
    #[inline(always)]
    pub fn exit(&self, w: &[AtomicU32], r0: u64, r1: u64) {
        if r0 == r1 {
            let c = &w[r0 as usize];
            let left = c.load(Ordering::Relaxed) - 1;
            c.store(left, Ordering::Release);
            if left == 0 && self.barrier.load(Ordering::SeqCst) == r0 {
                self.poke();
            }
            return;
        }
        self.exit_range(w, r0, r1)
    }

    /// [`Shared::exit`] for more than one region.
    #[inline(never)]
    fn exit_range(&self, w: &[AtomicU32], r0: u64, r1: u64) {
        let mut last = false;
        for r in r0..=r1 {
            let c = &w[r as usize];
            let left = c.load(Ordering::Relaxed) - 1;
            c.store(left, Ordering::Release);
            last |= left == 0;
        }
        if last && (r0..=r1).contains(&self.barrier.load(Ordering::SeqCst)) {
            self.poke();
        }
    }

    /// Legs `legs` failed an I/O: marks them failed, raises an event and
    /// asks for a superblock write; returns the generation of that write,
    /// which the I/O that saw the failure waits for before it completes
    /// (so that a leg holding stale data is never read after a crash).
    pub fn fail_legs(&self, legs: u64) -> u64 {
        let old = self.failed.fetch_or(legs, Ordering::AcqRel);
        self.paths();
        let mut st = self.lock();
        if old | legs != old {
            for i in 0..self.cfg.legs.len() {
                if legs & !old & (1 << i) != 0 {
                    tracing::warn!("raid1: leg {i} failed, the array goes on without it");
                }
            }
            self.events.fetch_add(1, Ordering::AcqRel);
            st.sb_wanted += 1;
        }
        let g = st.sb_wanted;
        drop(st);
        self.poke();
        g
    }

    /// Tells every reactor's channel to retry what it parked.
    pub fn kick_all(&self) {
        let chans = self.chans.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (h, key) in chans {
            h.send(move |r| {
                if let Some(ch) = r
                    .local(key)
                    .and_then(|c| c.downcast::<super::channel::RaidChannel>().ok())
                {
                    ch.kick();
                }
            });
        }
    }
}
