//! A thin volume as its reactors see it ([`Vol`]): the cache of its
//! mappings that the fast path reads without a lock, and the in-flight
//! counts (dm's `all_io_ds` deferred set) that let the worker wait for the
//! I/O remapped before it unmaps or moves a block.
//!
//! Only the pool's worker writes the cache; reactors read it. An entry is
//! one word:
//!
//! ```text
//!   0                     unknown: ask the worker
//!   1                     not mapped (reads as zeroes or the external origin)
//!   block << 2 | 2 | s    mapped to `block`; s = 1 if shared (writes copy)
//!   4 | w << 3            being provisioned by a reactor (its write is in
//!                         flight); w = 1 if the worker holds bios for it
//! ```
//!
//! A reactor provisions a block itself when the worker let it
//! ([`Vol::provision`]): it takes a data block the worker reserved for it,
//! moves the entry from unmapped to provisioning (a compare-and-swap: one
//! reactor wins, the rest ask the worker, which holds their bios until
//! the provisioning ends), writes, and then maps the entry and records
//! the mapping in the pool's journal, which the worker inserts into the
//! metadata before anything else it does.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Entries per lazily allocated page of the cache (32 KiB).
const PAGE: usize = 4096;

/// The entry of an unknown block.
pub(crate) const UNKNOWN: u64 = 0;
/// The entry of a block known to be unmapped.
pub(crate) const UNMAPPED: u64 = 1;
/// Set in the entry of a mapped block.
pub(crate) const MAPPED: u64 = 2;
/// Set in the entry of a mapped block that another device shares.
pub(crate) const SHARED: u64 = 1;
/// The entry of a block a reactor is provisioning.
pub(crate) const PROVISIONING: u64 = 4;
/// Set in a provisioning entry when the worker holds bios for the block.
pub(crate) const WAITING: u64 = 8;

/// Whether `e` is the entry of a block being provisioned by a reactor.
#[inline]
pub(crate) fn provisioning(e: u64) -> bool {
    e & !WAITING == PROVISIONING
}

/// The entry of a block mapped to `block`.
#[inline]
pub(crate) fn mapped(block: u64, shared: bool) -> u64 {
    block << 2 | MAPPED | shared as u64
}

/// One thin target's view of its device: mapping cache and in-flight
/// counts. Shared by the target (its reactors) and the pool's worker.
pub(crate) struct Vol {
    /// The thin device id.
    pub dev: u32,
    /// Virtual blocks the target covers.
    pub nr_blocks: u64,
    pages: Box<[OnceLock<Box<[AtomicU64]>>]>,
    /// Set once the worker has loaded every mapping ([`Vol::load`]): from
    /// then on a page never allocated holds only unmapped blocks (the
    /// worker allocates a page before it maps a block in it).
    complete: AtomicBool,
    /// Which counter new remaps count in (its low bit).
    epoch: AtomicU64,
    /// Reactors may provision unmapped blocks of this view themselves (set
    /// by the worker while this is its device's only view and the pool
    /// writes; cleared, and the view drained, before anything that must
    /// see every mapping: a snapshot, a second view).
    pub provision: AtomicBool,
    /// Remapped bios in flight, by the epoch they started in, counted per
    /// thread (see [`Vol::enter`]); the last slot is shared by threads
    /// past [`SLOTS`] and by every thread without membarrier.
    slots: Box<[Slot]>,
}

/// Threads with a counter of their own in each volume.
const SLOTS: usize = 64;

/// One thread's in-flight counts, by epoch, on a cache line of its own.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    n: [AtomicU64; 2],
}

/// Whether membarrier(2)'s private expedited command works here (checked
/// once; without it the counts are atomic read-modify-writes).
fn membarrier_ok() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // SAFETY: membarrier takes no pointers; registering only changes
        // how later membarrier calls of this process behave.
        unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                MEMBARRIER_REGISTER_PRIVATE_EXPEDITED,
                0,
                0,
            ) == 0
        }
    })
}

const MEMBARRIER_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
const MEMBARRIER_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

/// Makes every thread of the process run a full memory barrier (the slow
/// side of [`Vol::enter`]'s ordering).
fn membarrier() {
    // SAFETY: as in membarrier_ok; registered there before any use.
    unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_PRIVATE_EXPEDITED, 0, 0) };
}

thread_local! {
    /// This thread's slot in every volume's counters.
    static SLOT: usize = {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed).min(SLOTS)
    };
}

impl Vol {
    /// The view of device `dev` over `nr_blocks` virtual blocks, nothing
    /// known yet.
    pub fn new(dev: u32, nr_blocks: u64) -> Vol {
        // Registered before any volume counts anything.
        let _ = membarrier_ok();
        let n = nr_blocks.div_ceil(PAGE as u64) as usize;
        Vol {
            dev,
            nr_blocks,
            pages: (0..n).map(|_| OnceLock::new()).collect(),
            complete: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            provision: AtomicBool::new(false),
            slots: (0..=SLOTS).map(|_| Slot::default()).collect(),
        }
    }

    /// The entry of `vblock` (which must be below `nr_blocks`).
    #[inline]
    pub fn get(&self, vblock: u64) -> u64 {
        let (p, i) = (vblock as usize / PAGE, vblock as usize % PAGE);
        match self.pages.get(p).map(OnceLock::get) {
            Some(Some(page)) => page[i].load(Ordering::SeqCst),
            Some(None) if self.complete.load(Ordering::Relaxed) => UNMAPPED,
            _ => UNKNOWN,
        }
    }

    /// Sets the entry of `vblock` (worker only), unless a reactor is
    /// provisioning the block: that reactor ends the provisioning.
    pub fn set(&self, vblock: u64, v: u64) {
        let Some(e) = self.entry(vblock, v) else {
            return;
        };
        let _ = e.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
            (!provisioning(cur)).then_some(v)
        });
    }

    /// The entry of `vblock` to change to `v` (its page made if need be);
    /// `None` past the end, or when `v` is unknown and the page is not
    /// there (it already reads as unknown).
    fn entry(&self, vblock: u64, v: u64) -> Option<&AtomicU64> {
        let (p, i) = (vblock as usize / PAGE, vblock as usize % PAGE);
        let slot = self.pages.get(p)?;
        if v == UNKNOWN && slot.get().is_none() && !self.complete.load(Ordering::Relaxed) {
            return None;
        }
        // A new page of a complete view starts unmapped: that is what its
        // absence meant.
        let fresh = if self.complete.load(Ordering::Relaxed) {
            UNMAPPED
        } else {
            UNKNOWN
        };
        let page = slot.get_or_init(|| (0..PAGE).map(|_| AtomicU64::new(fresh)).collect());
        Some(&page[i])
    }

    /// Marks `vblock` provisioning for the worker, which provisions it
    /// (worker only), if its entry is still `from`; false if a reactor
    /// changed it.
    pub fn take(&self, vblock: u64, from: u64) -> bool {
        self.entry(vblock, PROVISIONING).is_some_and(|e| {
            e.compare_exchange(from, PROVISIONING, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        })
    }

    /// Sets the entry of `vblock` whatever it was (worker only: the end of
    /// its own provisioning, see [`Vol::take`]).
    pub fn store(&self, vblock: u64, v: u64) {
        if let Some(e) = self.entry(vblock, v) {
            e.store(v, Ordering::SeqCst);
        }
    }

    /// Moves `vblock` from unmapped to provisioning (a reactor's claim);
    /// false if it is not unmapped (someone else got there first).
    #[inline]
    pub fn claim(&self, vblock: u64) -> bool {
        let (p, i) = (vblock as usize / PAGE, vblock as usize % PAGE);
        match self.pages.get(p).map(OnceLock::get) {
            Some(Some(page)) => page[i]
                .compare_exchange(UNMAPPED, PROVISIONING, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok(),
            // An unmapped block of a page not made yet: make it (rare).
            Some(None) if self.complete.load(Ordering::Relaxed) => {
                self.entry(vblock, UNMAPPED).is_some_and(|e| {
                    e.compare_exchange(UNMAPPED, PROVISIONING, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                })
            }
            _ => false,
        }
    }

    /// Ends a reactor's provisioning of `vblock` with entry `v`; returns
    /// whether the worker holds bios for it (and must be told). Nothing
    /// changes if the worker replaced the entry meanwhile (it forgot every
    /// entry after a metadata failure).
    pub fn end_provisioning(&self, vblock: u64, v: u64) -> bool {
        let Some(e) = self.entry(vblock, v) else {
            return false;
        };
        match e.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
            provisioning(cur).then_some(v)
        }) {
            Ok(old) => old & WAITING != 0,
            Err(_) => false,
        }
    }

    /// Marks a block a reactor is provisioning as waited for (worker
    /// only); false if it is no longer being provisioned.
    pub fn wait_for(&self, vblock: u64) -> bool {
        let (p, i) = (vblock as usize / PAGE, vblock as usize % PAGE);
        let Some(Some(page)) = self.pages.get(p).map(OnceLock::get) else {
            return false;
        };
        page[i]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                provisioning(cur).then_some(cur | WAITING)
            })
            .is_ok()
    }

    /// Loads the device's mappings (`runs` of (virtual block, data block,
    /// length), as the metadata lists them): every block is known after
    /// (worker only, before the view is registered). Mapped blocks are
    /// marked shared, as the runs do not say: a block's first write asks
    /// the worker, which corrects it.
    pub fn load(&self, runs: &[(u64, u64, u64)]) {
        for &(v, b, n) in runs {
            for i in 0..n {
                self.set(v + i, mapped(b + i, true));
            }
        }
        for slot in self.pages.iter() {
            if let Some(page) = slot.get() {
                for e in page.iter() {
                    let _ =
                        e.compare_exchange(UNKNOWN, UNMAPPED, Ordering::SeqCst, Ordering::SeqCst);
                }
            }
        }
        self.complete.store(true, Ordering::SeqCst);
    }

    /// Marks every mapped block shared (after a snapshot of this device:
    /// all its blocks are), so that writes to them go to the worker.
    pub fn share_all(&self) {
        for p in self.pages.iter().filter_map(OnceLock::get) {
            for e in p.iter() {
                let _ = e.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                    (v & MAPPED != 0).then_some(v | SHARED)
                });
            }
        }
    }

    /// Forgets every entry (the metadata dropped a transaction): each
    /// block is asked of the worker again.
    pub fn forget(&self) {
        self.complete.store(false, Ordering::SeqCst);
        for p in self.pages.iter().filter_map(OnceLock::get) {
            for e in p.iter() {
                e.store(UNKNOWN, Ordering::SeqCst);
            }
        }
    }

    /// Counts a remapped bio in flight; returns the epoch to pass to
    /// [`Vol::exit`] when it completes. Called before the cache is read,
    /// so that the worker's [`Vol::drain`] after a cache change waits for
    /// every bio that may have read the old entry.
    ///
    /// The count is a plain store to this thread's own counter, not a
    /// locked read-modify-write: on the fast path a locked instruction
    /// waits for the store buffer to drain (after a write's copy, 97% of
    /// the completion's cost). The store may become visible after the
    /// cache read that follows it; [`Vol::drain`]'s membarrier orders the
    /// two for the worker instead (see there).
    #[inline]
    pub fn enter(&self) -> usize {
        let e = (self.epoch.load(Ordering::Acquire) & 1) as usize;
        self.add(e, 1);
        std::sync::atomic::compiler_fence(Ordering::SeqCst);
        e
    }

    /// This thread's own counters, which [`Vol::enter_on`] and
    /// [`Vol::exit_on`] update with plain stores; `None` where updates
    /// must be atomic (past [`SLOTS`] threads, or without membarrier).
    pub fn counts(&self) -> Option<&[AtomicU64; 2]> {
        let s = SLOT.with(|s| *s);
        (s < SLOTS && membarrier_ok()).then(|| &self.slots[s].n)
    }

    /// [`Vol::enter`] with this thread's [`Vol::counts`] at hand.
    #[inline(always)]
    pub fn enter_on(&self, c: &[AtomicU64; 2]) -> usize {
        let e = (self.epoch.load(Ordering::Acquire) & 1) as usize;
        let c = &c[e];
        c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Release);
        std::sync::atomic::compiler_fence(Ordering::SeqCst);
        e
    }

    /// [`Vol::exit`] with the [`Vol::counts`] of the thread that entered
    /// (which must be this one).
    #[inline(always)]
    pub fn exit_on(c: &[AtomicU64; 2], e: usize) {
        let c = &c[e & 1];
        c.store(c.load(Ordering::Relaxed).wrapping_sub(1), Ordering::Release);
    }

    /// The match of [`Vol::enter`] (on any thread: the counts are summed).
    #[inline]
    pub fn exit(&self, e: usize) {
        self.add(e & 1, u64::MAX);
    }

    #[inline]
    fn add(&self, e: usize, d: u64) {
        let s = SLOT.with(|s| *s);
        if s < SLOTS && membarrier_ok() {
            // A plain update: only this thread writes this slot.
            let c = &self.slots[s].n[e];
            c.store(c.load(Ordering::Relaxed).wrapping_add(d), Ordering::Release);
        } else {
            self.slots[SLOTS].n[e].fetch_add(d, Ordering::SeqCst);
        }
    }

    /// Waits (worker only) until every bio that entered before this call
    /// has exited, or `limit` passed (a device that never completes must
    /// not stop the pool forever); returns whether they all did.
    ///
    /// Why no bio is missed: the caller changed the cache entries first,
    /// then this flips the epoch and runs membarrier, which makes every
    /// thread pass a full barrier. A bio whose thread passed it before
    /// reading the cache sees the change (and does not remap by the old
    /// entry); one whose thread passed it after has its count visible
    /// here. Counts of the old epoch then only fall, so a sum read slot by
    /// slot is at least the true one.
    pub fn drain(&self, limit: Duration) -> bool {
        let old = (self.epoch.fetch_add(1, Ordering::SeqCst) & 1) as usize;
        if membarrier_ok() {
            membarrier();
        }
        let start = Instant::now();
        loop {
            let sum = self.slots.iter().fold(0u64, |a, s| {
                a.wrapping_add(s.n[old].load(Ordering::Acquire))
            });
            if sum == 0 {
                return true;
            }
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_start_unknown_and_keep_what_the_worker_sets() {
        let v = Vol::new(1, 10_000);
        assert_eq!(v.get(9_999), UNKNOWN);
        v.set(9_999, mapped(77, false));
        assert_eq!(v.get(9_999) >> 2, 77);
        assert_eq!(v.get(9_999) & SHARED, 0);
        v.set(3, UNMAPPED);
        assert_eq!(v.get(3), UNMAPPED);
        v.share_all();
        assert_eq!(v.get(9_999), mapped(77, true));
        assert_eq!(v.get(3), UNMAPPED);
        // Loaded: blocks of pages never touched are unmapped; mapped runs
        // are shared until the worker knows better.
        let v = Vol::new(1, 10_000);
        v.load(&[(5, 100, 2)]);
        assert_eq!(v.get(6), mapped(101, true));
        assert_eq!(v.get(7), UNMAPPED);
        assert_eq!(v.get(9_000), UNMAPPED);
        v.set(9_001, mapped(3, false));
        assert_eq!(v.get(9_000), UNMAPPED, "a page made later starts unmapped");
        // Past the end: ignored, reads unknown.
        v.set(1 << 40, UNMAPPED);
        assert_eq!(v.get(1 << 40), UNKNOWN);
    }

    #[test]
    fn drain_waits_for_bios_of_the_old_epoch_only() {
        let v = Vol::new(1, 1);
        let e = v.enter();
        assert!(!v.drain(Duration::from_millis(5)));
        let f = v.enter();
        assert_ne!(e, f, "a drain moves new bios to the other epoch");
        v.exit(e);
        // Only f, in the epoch before this drain's flip, is waited for.
        assert!(!v.drain(Duration::from_millis(5)));
        v.exit(f);
        assert!(v.drain(Duration::from_millis(5)));
    }
}
