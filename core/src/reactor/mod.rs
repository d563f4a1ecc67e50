//! Reactors: one per thread, run to completion (SPDK's model).
//!
//! A reactor owns everything the hot path touches, so nothing there is shared
//! or locked: its descriptor cache, its list of completions to run, its
//! io_uring, the pollers of the devices it has channels to, and a table of
//! reactor-local objects (channels) that control messages can find. Other
//! threads reach a reactor only through its [`ReactorHandle`]'s mailbox.
//!
//! Completion modes: [`CompletionMode::Interrupt`] sleeps in the ring when
//! idle; [`CompletionMode::Poll`] spins; [`CompletionMode::Hybrid`] spins for
//! a while after the last completion, then sleeps;
//! [`CompletionMode::Adaptive`] spins only as long as recent idle gaps say
//! work is about to arrive (cpuidle-haltpoll's governor), so an idle reactor
//! costs nothing and a request-reply loop skips the sleep and the wakeup;
//! weighed ([`ReactorConfig::weigh_spin`], `udm serve`'s default), it also
//! tries sleeping at once now and then, and keeps doing so where that
//! costs less CPU per bio at the same throughput (a deep queue whose
//! client keeps sending), and weighs, for its sleeps, gathering the
//! completions that come within 50 µs of the first (see `spin`).
//!
//! Polled I/O (rings with [`RingKind::iopoll`], which complete nothing
//! unless polled) is polled precisely: a turn enters only the rings that
//! have I/O in flight, and the kernel polls only the hardware queues of
//! that ring's requests, each of which is one child bio with its own
//! cookie, so a split or striped bio polls exactly what its children wait
//! on. A reactor that would sleep with polled I/O in flight on one ring
//! waits in that ring instead, the kernel polling until a completion (fio
//! `--hipri`'s wait); with two such rings, or a poller's deadline to keep,
//! it spins over them. See docs/polling.md.

use std::any::Any;
use std::cell::{Cell, RefCell, UnsafeCell};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::bio::{Bio, BioFlags, BioPtr, Home, Status};
use crate::ring::{Ring, RingKind, MAX_REGISTERED_BUFFER};

mod handle;
mod spin;
mod work;

pub use handle::ReactorHandle;
use handle::{Mailbox, Msg};
pub use work::{PassEnd, Poller, WorkQueue};

/// The kernel's final `ALLOC_CACHE_MAX` for per-CPU bio caches.
pub const DEFAULT_CACHE_SIZE: usize = 256;

/// An adaptive reactor's idle spin yields the CPU (`sched_yield`, ~0.4 µs
/// in this VM) once in this many idle turns, not on every one: a turn's
/// polls see a request sooner than a yield returns, and a client that
/// shares the CPU still gets it within a few turns.
const YIELD_EVERY: u32 = 8;

/// How a reactor waits for completions when it has nothing else to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CompletionMode {
    /// Sleep in `io_uring_enter` until a completion, a timer or a message
    /// (on a reactor confined to one CPU, until a batch of completions: see
    /// [`crate::Ring::submit_and_wait`]).
    #[default]
    Interrupt,
    /// Never sleep: spin on completions (lowest latency, one busy core).
    Poll,
    /// Spin for [`ReactorConfig::hybrid_spin`] after the last completion, then sleep.
    Hybrid,
    /// Spin for a window that follows the idle gaps seen, at most
    /// [`ReactorConfig::hybrid_spin`], then sleep. A gap the window covered
    /// keeps it; a longer gap up to the cap doubles it (from a quarter of
    /// the cap); a gap beyond the cap halves it, and below a quarter of the
    /// cap it is 0. So a reactor whose work comes in request-reply loops
    /// spins across the gaps (no sleep, no cross-CPU wakeup for the next
    /// request), and one whose gaps are long sleeps at once.
    Adaptive,
}

/// How to build a reactor.
#[derive(Clone, Copy, Debug)]
pub struct ReactorConfig {
    /// Completion mode.
    pub mode: CompletionMode,
    /// Descriptors the cache keeps (0 disables the cache: every bio is malloc'd).
    pub cache_size: usize,
    /// Slots of the reactor's io_uring SQ.
    pub ring_entries: u32,
    /// How long hybrid mode spins before it sleeps; the most adaptive mode does.
    pub hybrid_spin: Duration,
    /// The reactor's ring has 128-byte SQEs ([`RingKind::sqe128`]), for
    /// exports whose commands are URING_CMDs (ublk).
    pub sqe128: bool,
    /// Adaptive mode: weigh the spin against sleeping at once. The reactor
    /// runs in epochs of a few milliseconds, most waiting the way that
    /// served more bios per CPU second without losing throughput, every
    /// few trying the other way; sleeping wins only where it keeps 85% of
    /// the throughput at 90% or less of the CPU per bio, and its sleeps
    /// gather where that wins by the same rule (see docs/polling.md).
    pub weigh_spin: bool,
}

impl Default for ReactorConfig {
    fn default() -> ReactorConfig {
        ReactorConfig {
            mode: CompletionMode::Interrupt,
            cache_size: DEFAULT_CACHE_SIZE,
            ring_entries: 1024,
            hybrid_spin: Duration::from_micros(50),
            sqe128: false,
            weigh_spin: false,
        }
    }
}

/// Counters of the descriptor cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Descriptors served from the cache.
    pub hits: u64,
    /// Descriptors allocated from the heap.
    pub misses: u64,
    /// Descriptors freed to the heap because the cache was full (or off).
    pub frees: u64,
}

/// A memory region registered with a reactor's rings in chunks
/// ([`Reactor::register_region`]): finds the buffer index of a range of
/// it in a few instructions.
#[derive(Debug)]
pub struct RegisteredRegion {
    base: usize,
    len: usize,
    shift: u32,
    /// Each chunk's index ([`Bio::NO_BUF`]: not registered).
    chunks: Vec<u16>,
}

impl RegisteredRegion {
    /// The index of the registered chunk that holds all of `[ptr,
    /// ptr+len)`, or [`Bio::NO_BUF`] (outside the region, across two
    /// chunks, or in a chunk the kernel refused).
    #[inline]
    pub fn index_of(&self, ptr: *const u8, len: usize) -> u16 {
        let off = (ptr as usize).wrapping_sub(self.base);
        if off >= self.len || len == 0 || len > self.len - off {
            return Bio::NO_BUF;
        }
        let c = off >> self.shift;
        if (off + len - 1) >> self.shift != c {
            return Bio::NO_BUF;
        }
        self.chunks[c]
    }

    /// Chunks registered (the others go plain).
    pub fn registered(&self) -> usize {
        self.chunks.iter().filter(|&&c| c != Bio::NO_BUF).count()
    }

    /// Chunks in all.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }
}

static NEXT_REACTOR_ID: AtomicU64 = AtomicU64::new(0);

/// The reactor core `bio` came from.
#[inline]
fn home_of(bio: &Bio) -> &ReactorCore {
    // SAFETY: a bio's `home` is only ever set by `ReactorCore::alloc_bio`,
    // to that core (Bio::new is crate-private and called only there); a
    // core outlives its bios (Reactor::drop leaks it while any are out),
    // and bios are !Send, so the core is alive and on this thread.
    unsafe { &*bio.home.cast::<ReactorCore>() }
}

// The parts of a bio's life that go through its reactor: allocation of a
// clone, deferred completion and return to the descriptor cache.

impl Bio {
    /// Allocates a descriptor from the same reactor, for a clone or child of
    /// this bio: same op and flags, no data, sector 0.
    #[inline]
    pub fn alloc_clone(&self) -> BioPtr {
        let mut c = home_of(self).alloc_bio();
        c.op = self.op;
        // A clone's data lands in its parent's buffers: nothing is lent to
        // it, and it was lent nothing. Its registered buffer comes with
        // the parent's segments (Bio::add_segs_from), not with the
        // descriptor: a clone given memory of its own must not claim it.
        c.flags = self.flags;
        c.flags.remove(BioFlags::MAY_LEND);
        c.flags.remove(BioFlags::LENT);
        c
    }

    /// Whether other completions wait on this bio's reactor: queued for
    /// its next pass ([`BioPtr::complete`], [`BioPtr::stage`]), or still
    /// to run in the pass running now. A device that serves a bio
    /// synchronously may then stage its work ([`BioPtr::stage`]), at no
    /// cost to a lone I/O, which finds nothing waiting.
    #[inline]
    pub fn completions_waiting(&self) -> bool {
        let home = home_of(self);
        home.more.get() || !home.done_tail.get().is_null() || !home.staged_tail.get().is_null()
    }
}

impl BioPtr {
    /// Sets the status and queues the bio for completion on its reactor's next
    /// turn. What a device's `submit` calls when it finishes synchronously.
    #[inline]
    pub fn complete(mut self, status: Status) {
        self.set_status(status);
        let home: *const ReactorCore = home_of(&self);
        // SAFETY: `home` outlives the bio (see home_of); `defer` takes the
        // bio, which must not be borrowed meanwhile, hence the raw pointer.
        unsafe { (*home).defer(self) };
    }

    /// Queues the bio for its current end_io at the start of its reactor's
    /// next pass over completions, before the completions queued for it:
    /// the bios staged run one after another, then every end_io of the
    /// pass. For a device that serves bios synchronously and gains from
    /// doing several together (the RAM disk: copies from memory outside
    /// the caches run faster back to back than with end_ios between them):
    /// it pushes an end_io ([`BioPtr::push_end_io`]) that does the work,
    /// pops its frame and ends in [`BioPtr::complete`], and stages the bio
    /// instead of serving it; the submitter's end_io then runs in the same
    /// pass, as it would have after `complete`.
    #[inline]
    pub fn stage(self) {
        let home: *const ReactorCore = home_of(&self);
        // SAFETY: as in `complete`.
        unsafe { (*home).stage(self) };
    }
}

impl Drop for BioPtr {
    #[inline]
    fn drop(&mut self) {
        home_of(self).free_bio(self.ptr);
    }
}

/// The part of a reactor that bios point at (`Bio::home`). Boxed so its
/// address is stable.
pub(crate) struct ReactorCore {
    id: usize,
    config: ReactorConfig,
    cache: UnsafeCell<Vec<NonNull<Bio>>>,
    stats: Cell<CacheStats>,
    outstanding: Cell<usize>,
    done_head: Cell<*mut Bio>,
    done_tail: Cell<*mut Bio>,
    /// Bios whose end_io runs before the next pass's completions
    /// ([`BioPtr::stage`]).
    staged_head: Cell<*mut Bio>,
    staged_tail: Cell<*mut Bio>,
    /// While a pass runs an end_io: whether others follow it in the pass.
    more: Cell<bool>,
    /// What runs when the pass over deferred completions ends
    /// ([`Reactor::at_pass_end`]), and whether anything does: the one load
    /// a pass pays.
    pass_end: RefCell<Vec<Rc<dyn PassEnd>>>,
    pass_end_armed: Cell<bool>,
    ring: Rc<Ring>,
    extra_rings: RefCell<Vec<Rc<Ring>>>,
    pollers: RefCell<Vec<Rc<dyn Poller>>>,
    /// Whether `pollers` is non-empty (a turn of a reactor without pollers
    /// pays one load for them).
    has_pollers: Cell<bool>,
    work: WorkQueue,
    locals: RefCell<HashMap<u64, Rc<dyn Any>>>,
    /// The registered-buffer table, by index (None: a free slot).
    buffers: RefCell<Vec<Option<libc::iovec>>>,
    mailbox: Arc<Mailbox>,
    wake_buf: UnsafeCell<u64>,
    wake_armed: Cell<bool>,
    last_work: Cell<Instant>,
    /// Adaptive mode: idle turns since the gap started
    /// ([`ReactorCore::idle_turn_yields`]).
    idle_turns: Cell<u32>,
    /// Adaptive mode: when the reactor went idle (None while it has work).
    idle_since: Cell<Option<Instant>>,
    /// Adaptive mode: how long it spins once idle before it sleeps.
    spin_window: Cell<Duration>,
    /// Adaptive mode with [`ReactorConfig::weigh_spin`]: the trial of
    /// spinning against sleeping at once.
    weigh: Option<spin::Weigh>,
}

impl ReactorCore {
    /// Adaptive mode, on a turn: whether to sleep now. A turn with work ends
    /// the idle gap and resizes the window by it; an idle turn spins while
    /// inside the window. With the window closed, a turn with work sleeps
    /// at once (the idle turn after it would): one `io_uring_enter`
    /// submits what the turn queued and waits, instead of a submit and,
    /// on the next turn, a wait. The idle gap then starts now; if the
    /// reactor cannot sleep after all, [`ReactorCore::adaptive_busy`]
    /// takes that back.
    ///
    /// Weighed, an epoch that sleeps at once closes the window for its
    /// length and leaves it as it was: its gaps hold a wakeup each, and say
    /// nothing of the gaps a spin sees.
    fn adaptive_sleep(&self, work: bool) -> bool {
        let at_once = self.weigh.as_ref().is_some_and(|w| w.sleeps_at_once());
        if work {
            if let Some(t0) = self.idle_since.take() {
                if !at_once {
                    self.spin_window.set(next_window(
                        self.spin_window.get(),
                        t0.elapsed(),
                        self.config.hybrid_spin,
                    ));
                }
            }
            if at_once || self.spin_window.get().is_zero() {
                self.go_idle();
                return true;
            }
            return false;
        }
        match self.idle_since.get() {
            None => {
                self.go_idle();
                self.weigh.as_ref().is_some_and(|w| w.sleeps_at_once())
                    || self.spin_window.get().is_zero()
            }
            Some(t0) => at_once || t0.elapsed() >= self.spin_window.get(),
        }
    }

    /// Adaptive mode: counts an idle turn of the gap; true on every
    /// [`YIELD_EVERY`]th, whose spin yields the CPU.
    #[inline]
    fn idle_turn_yields(&self) -> bool {
        let n = self.idle_turns.get().wrapping_add(1);
        self.idle_turns.set(n);
        n.is_multiple_of(YIELD_EVERY)
    }

    /// Adaptive mode: an idle gap starts (and, weighed, an epoch may end).
    #[inline]
    fn go_idle(&self) {
        let now = Instant::now();
        self.idle_since.set(Some(now));
        self.idle_turns.set(0);
        if let Some(w) = &self.weigh {
            w.at_idle(now, || self.bios_allocated());
        }
    }

    /// Descriptors allocated since the reactor started.
    fn bios_allocated(&self) -> u64 {
        let s = self.stats.get();
        s.hits + s.misses
    }

    /// Adaptive mode: a turn with work meant to sleep but could not (work
    /// is runnable): it is not idle.
    #[cold]
    fn adaptive_busy(&self) {
        self.idle_since.set(None);
    }
}

/// The adaptive spin window after an idle gap of `gap` (see
/// [`CompletionMode::Adaptive`]), for a cap of `max`.
fn next_window(w: Duration, gap: Duration, max: Duration) -> Duration {
    let start = max / 4;
    if gap <= w {
        w
    } else if gap <= max {
        (w * 2).max(start).min(max)
    } else if w / 2 < start {
        Duration::ZERO
    } else {
        w / 2
    }
}

impl ReactorCore {
    /// Takes a descriptor from the cache, or the heap. Inlined whole into
    /// the submitters (the heap's path apart): the fields the caller sets
    /// next are then stored once, not reset and set.
    #[inline(always)]
    fn alloc_bio(&self) -> BioPtr {
        // SAFETY: the cache vector is only touched by these methods, on
        // this thread, and none calls out while holding the borrow.
        let cache = unsafe { &mut *self.cache.get() };
        let Some(p) = cache.pop() else {
            return self.alloc_bio_new();
        };
        self.outstanding.set(self.outstanding.get() + 1);
        let mut st = self.stats.get();
        st.hits += 1;
        self.stats.set(st);
        let mut b = BioPtr::from_nonnull(p);
        b.reset();
        b
    }

    /// [`ReactorCore::alloc_bio`] with the cache empty: from the heap.
    #[cold]
    #[inline(never)]
    fn alloc_bio_new(&self) -> BioPtr {
        self.outstanding.set(self.outstanding.get() + 1);
        let mut st = self.stats.get();
        st.misses += 1;
        self.stats.set(st);
        BioPtr::from_box(Box::new(Bio::new(
            (self as *const ReactorCore).cast::<Home>(),
        )))
    }

    /// Returns a descriptor to the cache, or the heap when the cache is full.
    #[inline]
    pub(crate) fn free_bio(&self, p: NonNull<Bio>) {
        self.outstanding.set(self.outstanding.get() - 1);
        // SAFETY: as in alloc_bio.
        let cache = unsafe { &mut *self.cache.get() };
        if cache.len() < self.config.cache_size {
            cache.push(p);
        } else {
            let mut st = self.stats.get();
            st.frees += 1;
            self.stats.set(st);
            // SAFETY: every descriptor was made by Box::new in alloc_bio, and
            // the caller (BioPtr::drop) gives up its only handle.
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
    }

    /// Queues `bio` for its end_io at the reactor's next turn.
    #[inline]
    pub(crate) fn defer(&self, bio: BioPtr) {
        Self::append(&self.done_head, &self.done_tail, bio);
    }

    /// Queues `bio` for its end_io before the next turn's completions
    /// ([`BioPtr::stage`]).
    #[inline]
    fn stage(&self, bio: BioPtr) {
        Self::append(&self.staged_head, &self.staged_tail, bio);
    }

    /// Appends `bio` to the list from `head` to `tail`.
    #[inline]
    fn append(head: &Cell<*mut Bio>, tail: &Cell<*mut Bio>, bio: BioPtr) {
        let p = bio.into_raw();
        // SAFETY: `p` is a live descriptor we now own through the list.
        unsafe { (*p).next = std::ptr::null_mut() };
        let t = tail.get();
        if t.is_null() {
            head.set(p);
        } else {
            // SAFETY: the tail is a live descriptor owned by the list.
            unsafe { (*t).next = p };
        }
        tail.set(p);
    }

    /// Runs the end_io of every bio staged, then of every bio queued so far
    /// (the staged ones' among them: they end in `complete`), but not of
    /// those queued while this runs: they wait for the next turn, so a
    /// submit/complete cycle cannot starve the loop.
    fn run_deferred(&self) -> usize {
        if !self.staged_head.get().is_null() {
            self.run_staged();
        }
        let mut p = self.done_head.replace(std::ptr::null_mut());
        self.done_tail.set(std::ptr::null_mut());
        let mut n = 0;
        while !p.is_null() {
            // SAFETY: list members are live descriptors made by into_raw in
            // `append`; each is taken off exactly once.
            let next = unsafe { (*p).next };
            self.more.set(!next.is_null());
            // SAFETY: as above.
            unsafe { BioPtr::from_raw(p) }.endio();
            p = next;
            n += 1;
        }
        if self.pass_end_armed.get() {
            self.run_pass_end();
        }
        n
    }

    /// Runs the hooks [`Reactor::at_pass_end`] queued (and those they
    /// queue), each once.
    #[cold]
    fn run_pass_end(&self) {
        while self.pass_end_armed.replace(false) {
            let hooks = std::mem::take(&mut *self.pass_end.borrow_mut());
            for h in &hooks {
                h.pass_end();
            }
            // Given back with its capacity, so a pass allocates nothing,
            // unless a hook queued more meanwhile (they run next round).
            let mut q = self.pass_end.borrow_mut();
            if q.is_empty() {
                *q = hooks;
                q.clear();
            }
        }
    }

    /// The staged bios' end_ios, one after another (those staged while
    /// this runs too).
    #[inline(never)]
    fn run_staged(&self) {
        loop {
            let mut p = self.staged_head.replace(std::ptr::null_mut());
            self.staged_tail.set(std::ptr::null_mut());
            if p.is_null() {
                return;
            }
            while !p.is_null() {
                // SAFETY: as in run_deferred.
                let next = unsafe { (*p).next };
                // SAFETY: as in run_deferred.
                unsafe { BioPtr::from_raw(p) }.endio();
                p = next;
            }
        }
    }
}

/// A reactor. Create one on each I/O thread; it is not `Send`.
pub struct Reactor {
    core: Option<Box<ReactorCore>>,
}

impl Reactor {
    /// Creates a reactor with its own io_uring.
    pub fn new(config: ReactorConfig) -> io::Result<Reactor> {
        let ring = Ring::new(
            config.ring_entries,
            RingKind {
                sqe128: config.sqe128,
                ..RingKind::default()
            },
        )?;
        // SAFETY: plain syscall; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `efd` is a fresh descriptor we own.
        let eventfd = unsafe { OwnedFd::from_raw_fd(efd) };
        let gathers = ring.gathers();
        let core = Box::new(ReactorCore {
            id: NEXT_REACTOR_ID.fetch_add(1, Ordering::Relaxed) as usize,
            config,
            cache: UnsafeCell::new(Vec::with_capacity(config.cache_size)),
            stats: Cell::new(CacheStats::default()),
            outstanding: Cell::new(0),
            done_head: Cell::new(std::ptr::null_mut()),
            done_tail: Cell::new(std::ptr::null_mut()),
            staged_head: Cell::new(std::ptr::null_mut()),
            staged_tail: Cell::new(std::ptr::null_mut()),
            more: Cell::new(false),
            pass_end: RefCell::new(Vec::new()),
            pass_end_armed: Cell::new(false),
            ring: Rc::new(ring),
            extra_rings: RefCell::new(Vec::new()),
            pollers: RefCell::new(Vec::new()),
            has_pollers: Cell::new(false),
            work: WorkQueue::new(),
            locals: RefCell::new(HashMap::new()),
            buffers: RefCell::new(Vec::new()),
            mailbox: Arc::new(Mailbox {
                queue: Mutex::new(Vec::new()),
                pending: AtomicBool::new(false),
                closed: AtomicBool::new(false),
                eventfd,
            }),
            wake_buf: UnsafeCell::new(0),
            wake_armed: Cell::new(false),
            last_work: Cell::new(Instant::now()),
            idle_turns: Cell::new(0),
            idle_since: Cell::new(None),
            spin_window: Cell::new(Duration::ZERO),
            weigh: (config.mode == CompletionMode::Adaptive && config.weigh_spin)
                .then(|| spin::Weigh::new(0, gathers)),
        });
        Ok(Reactor { core: Some(core) })
    }

    #[inline]
    fn core(&self) -> &ReactorCore {
        match &self.core {
            Some(c) => c,
            None => unreachable!("reactor core is only taken in drop"),
        }
    }

    /// This reactor's id (unique in the process).
    pub fn id(&self) -> usize {
        self.core().id
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &ReactorConfig {
        &self.core().config
    }

    /// A handle other threads use to message this reactor.
    pub fn handle(&self) -> ReactorHandle {
        ReactorHandle {
            id: self.id(),
            mailbox: self.core().mailbox.clone(),
        }
    }

    /// Allocates an empty descriptor (from the cache when it has one).
    #[inline(always)]
    pub fn alloc_bio(&self) -> BioPtr {
        self.core().alloc_bio()
    }

    /// Descriptor-cache counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.core().stats.get()
    }

    /// Descriptors allocated and not yet freed.
    pub fn outstanding(&self) -> usize {
        self.core().outstanding.get()
    }

    /// The reactor's io_uring.
    pub fn ring(&self) -> &Ring {
        &self.core().ring
    }

    /// The reactor's io_uring, shared (for a channel to keep).
    pub fn ring_rc(&self) -> Rc<Ring> {
        self.core().ring.clone()
    }

    /// A ring of `kind` owned by this reactor (created on first use, then
    /// shared by every channel that asks for the same kind). Polled each turn.
    pub fn ring_of(&self, kind: RingKind) -> io::Result<Rc<Ring>> {
        if kind == RingKind::default() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the default ring is Reactor::ring",
            ));
        }
        let core = self.core();
        if let Some(r) = core.extra_rings.borrow().iter().find(|r| r.kind() == kind) {
            return Ok(r.clone());
        }
        let ring = Rc::new(Ring::new(core.config.ring_entries, kind)?);
        for (i, b) in core.buffers.borrow().iter().enumerate() {
            if let Some(b) = b {
                // SAFETY: a buffer registered with the reactor stays mapped
                // until it is unregistered (register_buffer's contract),
                // which empties the slot on every ring.
                let _ = unsafe { ring.register_buffer(i as u16, *b) };
            }
        }
        if !kind.iopoll {
            // Completions on this ring signal the mailbox eventfd, so a
            // sleeping reactor wakes for them (see `sleep`).
            ring.register_eventfd(core.mailbox.eventfd.as_raw_fd())?;
        }
        core.extra_rings.borrow_mut().push(ring.clone());
        Ok(ring)
    }

    /// Registers a memory region with the reactor's rings; a bio whose single
    /// segment lies inside it may set `buf_index` to the returned index.
    /// Returns None when the rings refuse it (I/O then simply isn't fixed);
    /// [`Reactor::try_register_buffer`] says why.
    ///
    /// # Safety
    /// As for [`Reactor::try_register_buffer`].
    pub unsafe fn register_buffer(&self, base: *mut u8, len: usize) -> Option<u16> {
        // SAFETY: forwarded from the caller.
        unsafe { self.try_register_buffer(base, len) }.ok()
    }

    /// Registers `len` bytes at `base` (at most [`MAX_REGISTERED_BUFFER`])
    /// with the reactor's rings, present and future, in the first free slot
    /// of its buffer table; the error says why the kernel refused (see
    /// [`Ring::register_buffer`]: the memlock limit, memory it cannot pin).
    ///
    /// # Safety
    /// The memory must stay mapped at these addresses (the same pages, not
    /// another mapping put in its place) until
    /// [`Reactor::unregister_buffer`] or the reactor is dropped: a fixed
    /// I/O reaches the pages pinned now.
    pub unsafe fn try_register_buffer(&self, base: *mut u8, len: usize) -> io::Result<u16> {
        if len == 0 || len > MAX_REGISTERED_BUFFER {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a registered buffer holds 1 to {MAX_REGISTERED_BUFFER} bytes, not {len}"),
            ));
        }
        let core = self.core();
        let iov = libc::iovec {
            iov_base: base.cast(),
            iov_len: len,
        };
        let mut bufs = core.buffers.borrow_mut();
        let index = bufs.iter().position(Option::is_none).unwrap_or(bufs.len());
        if index >= Bio::NO_BUF as usize {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                "the registered-buffer table is full",
            ));
        }
        let index = index as u16;
        // SAFETY: forwarded from the caller.
        unsafe { core.ring.register_buffer(index, iov) }?;
        for r in core.extra_rings.borrow().iter() {
            // SAFETY: forwarded from the caller. An extra ring that refuses
            // fails the bios that name the index (EFAULT): take it back.
            if let Err(e) = unsafe { r.register_buffer(index, iov) } {
                core.ring.unregister_buffer(index);
                for r in core.extra_rings.borrow().iter() {
                    r.unregister_buffer(index);
                }
                return Err(e);
            }
        }
        if index as usize == bufs.len() {
            bufs.push(Some(iov));
        } else {
            bufs[index as usize] = Some(iov);
        }
        Ok(index)
    }

    /// Empties slot `index` of the buffer table on every ring, for reuse.
    /// I/O in flight from the buffer completes normally (the kernel holds
    /// its pages until then); the caller must no longer hand out the index,
    /// and may unmap the memory once this returns.
    pub fn unregister_buffer(&self, index: u16) {
        let core = self.core();
        let mut bufs = core.buffers.borrow_mut();
        let Some(slot) = bufs.get_mut(index as usize) else {
            return;
        };
        if slot.take().is_none() {
            return;
        }
        core.ring.unregister_buffer(index);
        for r in core.extra_rings.borrow().iter() {
            r.unregister_buffer(index);
        }
    }

    /// Registers the region of `len` bytes at `base` in chunks of
    /// [`MAX_REGISTERED_BUFFER`] (io_uring's limit), from `base`: an I/O
    /// inside one chunk goes fixed, one that straddles two goes plain.
    /// Registration stops at the first chunk the kernel refuses (the
    /// reason repeats: the memlock limit); that chunk and the rest stay
    /// plain, and the error comes back with the region for the caller to
    /// report. Undo with [`Reactor::unregister_region`].
    ///
    /// # Safety
    /// As for [`Reactor::try_register_buffer`], for the whole region.
    pub unsafe fn register_region(
        &self,
        base: *mut u8,
        len: usize,
    ) -> (RegisteredRegion, Option<io::Error>) {
        // SAFETY: forwarded from the caller.
        unsafe { self.register_region_in(base, len, MAX_REGISTERED_BUFFER.trailing_zeros()) }
    }

    /// [`Reactor::register_region`] with chunks of `1 << shift` bytes.
    ///
    /// # Safety
    /// As for [`Reactor::register_region`].
    pub(crate) unsafe fn register_region_in(
        &self,
        base: *mut u8,
        len: usize,
        shift: u32,
    ) -> (RegisteredRegion, Option<io::Error>) {
        let n = len.div_ceil(1 << shift);
        let mut r = RegisteredRegion {
            base: base as usize,
            len,
            shift,
            chunks: vec![Bio::NO_BUF; n],
        };
        for c in 0..n {
            let off = c << shift;
            let clen = (len - off).min(1 << shift);
            // SAFETY: a part of the caller's region, under its contract.
            match unsafe { self.try_register_buffer(base.wrapping_add(off), clen) } {
                Ok(i) => r.chunks[c] = i,
                Err(e) => return (r, Some(e)),
            }
        }
        (r, None)
    }

    /// Empties the slots of `region`'s chunks (see
    /// [`Reactor::unregister_buffer`]); its lookups find nothing after.
    pub fn unregister_region(&self, region: &mut RegisteredRegion) {
        for c in region.chunks.iter_mut() {
            if *c != Bio::NO_BUF {
                self.unregister_buffer(*c);
                *c = Bio::NO_BUF;
            }
        }
    }

    /// READ_FIXED and WRITE_FIXED entries the reactor's rings made.
    pub fn fixed_ops(&self) -> u64 {
        let core = self.core();
        core.ring.fixed_ops()
            + core
                .extra_rings
                .borrow()
                .iter()
                .map(|r| r.fixed_ops())
                .sum::<u64>()
    }

    /// Runs `hook` once, when the reactor's current pass over deferred
    /// completions ends (called outside a pass: when the next one ends).
    /// An end_io given memory a device lent ([`BioFlags::MAY_LEND`]) may
    /// keep using it until then: a pass runs the end_io of every bio
    /// completed ([`BioPtr::complete`]) before it started, and nothing
    /// frees a device's memory while it runs.
    pub fn at_pass_end(&self, hook: Rc<dyn PassEnd>) {
        let core = self.core();
        core.pass_end.borrow_mut().push(hook);
        core.pass_end_armed.set(true);
    }

    /// Adds a poller, polled every turn until the reactor is dropped.
    pub fn add_poller(&self, p: Rc<dyn Poller>) {
        self.core().pollers.borrow_mut().push(p);
        self.core().has_pollers.set(true);
    }

    /// The reactor's queue of slow work.
    pub fn work_queue(&self) -> WorkQueue {
        self.core().work.clone()
    }

    /// Stores a reactor-local object under `key` (e.g. a device's channel, so
    /// that control messages can find it).
    pub fn set_local(&self, key: u64, v: Rc<dyn Any>) {
        self.core().locals.borrow_mut().insert(key, v);
    }

    /// The reactor-local object stored under `key`.
    pub fn local(&self, key: u64) -> Option<Rc<dyn Any>> {
        self.core().locals.borrow().get(&key).cloned()
    }

    /// Removes the reactor-local object under `key`.
    pub fn remove_local(&self, key: u64) -> Option<Rc<dyn Any>> {
        self.core().locals.borrow_mut().remove(&key)
    }

    /// One turn of the loop: messages, the rings' completions, queued
    /// completions, pollers, then the rings' new submissions. Returns how
    /// much work it did (0 means idle).
    pub fn poll_once(&self) -> usize {
        let t = self.turn();
        self.core().ring.submit();
        t.work
    }

    /// A turn without the main ring's submission, which the caller either
    /// makes alone or fuses with its wait (one `io_uring_enter` for both).
    /// Completions run before pollers, so a poller sees everything the
    /// turn's end_ios left for it (a requeue, a drained count) in that turn.
    fn turn(&self) -> Turn {
        let core = self.core();
        let mut work = core.ring.reap();
        // Consume the wake-up before looking at what it announces (messages,
        // SQPOLL completions): one that lands after this is seen by the
        // next sleep, not lost.
        if core.ring.woken.replace(false) {
            core.wake_armed.set(false);
            self.drain_eventfd();
        }
        if core.mailbox.pending.load(Ordering::Acquire) {
            work += self.run_messages();
        }
        // Only rings something waits on are entered (for an IOPOLL ring, the
        // enter is what polls the device). Completions first, so that the
        // I/O their end_ios issue goes down in this turn's enter.
        for r in core.extra_rings.borrow().iter() {
            if r.inflight() > 0 {
                work += r.reap();
                r.submit();
            }
        }
        work += core.run_deferred();
        let mut poller_work = core.work.run();
        if core.has_pollers.get() {
            for p in core.pollers.borrow().iter() {
                poller_work += p.poll();
            }
        }
        Turn {
            work: work + poller_work,
            poller_work,
        }
    }

    /// Runs turns until `done()` says stop. Between turns it submits what
    /// the turn queued and, when the completion mode allows and nothing is
    /// runnable, waits for a completion in the same system call: at QD1 an
    /// I/O costs one `io_uring_enter`, not a submit and then a wait.
    pub fn run_until(&self, mut done: impl FnMut() -> bool) {
        let core = self.core();
        loop {
            if done() {
                core.ring.submit();
                return;
            }
            let t = self.turn();
            // Decided before `done()` so that the turn whose work ends the
            // loop still counts for the modes' timing (it ends an idle gap).
            let sleep = match core.config.mode {
                CompletionMode::Interrupt => true,
                CompletionMode::Poll => false,
                CompletionMode::Hybrid => {
                    if t.work > 0 {
                        core.last_work.set(Instant::now());
                        false
                    } else {
                        core.last_work.get().elapsed() >= core.config.hybrid_spin
                    }
                }
                CompletionMode::Adaptive => core.adaptive_sleep(t.work > 0),
            };
            if done() {
                core.ring.submit();
                return;
            }
            // A poller that did work may have more: give it another turn.
            if !(sleep && t.poller_work == 0 && self.sleep()) {
                if sleep && t.work > 0 && core.config.mode == CompletionMode::Adaptive {
                    core.adaptive_busy();
                }
                core.ring.submit();
                if t.work == 0 {
                    if core.config.mode == CompletionMode::Adaptive && core.idle_turn_yields() {
                        // An idle spin gives the CPU to anything else that
                        // wants it: it is a bet on latency, not a claim on
                        // the core (the client may be waiting for this CPU).
                        // SAFETY: a plain syscall without arguments.
                        unsafe { libc::sched_yield() };
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
        }
    }

    /// Runs turns until no I/O is in flight and nothing is queued.
    pub fn drain(&self) {
        self.run_until(|| false_if_busy(self));
    }

    /// Submits and sleeps in the ring until a completion, a message or the
    /// earliest poller deadline; with polled I/O in flight, waits in the
    /// kernel while it polls for that I/O instead. Returns false, having
    /// done nothing, when something is runnable or must be spun on.
    fn sleep(&self) -> bool {
        let core = self.core();
        if !core.done_head.get().is_null()
            || !core.staged_head.get().is_null()
            || core.mailbox.pending.load(Ordering::Acquire)
        {
            return false;
        }
        let mut deadline: Option<Instant> = None;
        {
            let queued = core.work.items();
            for p in core.pollers.borrow().iter().chain(queued.iter()) {
                if p.must_spin() {
                    return false;
                }
                if let Some(d) = p.deadline() {
                    deadline = Some(deadline.map_or(d, |x| x.min(d)));
                }
            }
        }
        if !core.extra_rings.borrow().is_empty() {
            if let Some(slept) = self.wait_extra(deadline) {
                return slept;
            }
        }
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if timeout == Some(Duration::ZERO) {
            return false;
        }
        if !core.wake_armed.get() {
            // SAFETY: wake_buf lives in the boxed core, which outlives the
            // ring (the ring is a field of the same core and is dropped with it).
            unsafe {
                core.ring
                    .arm_wake(core.mailbox.eventfd.as_raw_fd(), core.wake_buf.get())
            };
            core.wake_armed.set(true);
        }
        // A message posted before the read was armed left the eventfd
        // readable, so the read completes at once and the wait returns.
        if core.weigh.as_ref().is_some_and(|w| w.gathers()) {
            core.ring
                .submit_and_wait_gathering(timeout, spin::GATHER_WAIT);
        } else {
            core.ring.submit_and_wait(timeout);
        }
        true
    }

    /// [`Reactor::sleep`]'s part for the extra rings: Some(false) to spin,
    /// Some(true) having waited in an IOPOLL ring, None to sleep in the
    /// reactor's ring. Apart, so a reactor without extra rings pays a length
    /// check for them.
    ///
    /// An IOPOLL ring completes only when polled. Other extra rings (SQPOLL)
    /// signal the mailbox eventfd when they post a completion, which wakes
    /// the reactor's sleep; overflowed ones are posted only by our next
    /// submit.
    #[inline(never)]
    fn wait_extra(&self, deadline: Option<Instant>) -> Option<bool> {
        let core = self.core();
        let mut polled: Option<Rc<Ring>> = None;
        for r in core.extra_rings.borrow().iter() {
            if r.inflight() == 0 {
                continue;
            }
            if r.cq_overflow() || (r.kind().iopoll && polled.is_some()) {
                return Some(false);
            }
            if r.kind().iopoll {
                polled = Some(r.clone());
            }
        }
        // Polled I/O in flight on one ring: wait in the kernel, which polls
        // the hardware queues of that ring's requests (each its own bio and
        // cookie there) until one completes, as fio --hipri does. A wait in
        // polling takes no timeout nor wake-up: with a deadline to keep,
        // spin instead. Anything else (a message, a socket) waits at most
        // for that completion.
        let r = polled?;
        if deadline.is_some() {
            return Some(false);
        }
        core.ring.submit();
        r.submit_and_wait(None);
        Some(true)
    }

    fn drain_eventfd(&self) {
        let mut v: u64 = 0;
        // SAFETY: reading 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe {
            libc::read(
                self.core().mailbox.eventfd.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                8,
            )
        };
    }

    fn run_messages(&self) -> usize {
        let core = self.core();
        let msgs: Vec<Msg> = {
            let mut q = match core.mailbox.queue.lock() {
                Ok(q) => q,
                Err(p) => p.into_inner(),
            };
            core.mailbox.pending.store(false, Ordering::Release);
            std::mem::take(&mut *q)
        };
        let n = msgs.len();
        for m in msgs {
            m(self);
        }
        n
    }

    /// Whether anything is in flight or queued on this reactor.
    pub fn busy(&self) -> bool {
        let core = self.core();
        !core.done_head.get().is_null()
            || !core.staged_head.get().is_null()
            || core.ring.inflight() > 0
            || core.extra_rings.borrow().iter().any(|r| r.inflight() > 0)
            || core
                .pollers
                .borrow()
                .iter()
                .any(|p| p.deadline().is_some() || p.must_spin())
            || core.work.any(|p| p.deadline().is_some() || p.must_spin())
    }
}

/// What a turn did.
struct Turn {
    /// Work of every kind, pollers included.
    work: usize,
    /// Work the pollers did.
    poller_work: usize,
}

fn false_if_busy(r: &Reactor) -> bool {
    !r.busy()
}

impl Drop for Reactor {
    fn drop(&mut self) {
        let Some(core) = &self.core else { return };
        {
            // Closed under the lock, so every send either sees it (and
            // returns false) or has queued its message before it...
            let _q = match core.mailbox.queue.lock() {
                Ok(q) => q,
                Err(p) => p.into_inner(),
            };
            core.mailbox.closed.store(true, Ordering::Release);
        }
        // ...and the messages accepted that way (send returned true) run.
        self.run_messages();
        // Finish what is in flight (bounded: a wedged device must not hang exit).
        let start = Instant::now();
        while self.busy() && start.elapsed() < Duration::from_secs(5) {
            if self.poll_once() == 0 {
                std::thread::yield_now();
            }
        }
        // Complete the armed wake-up read so the kernel is done with wake_buf.
        if core.wake_armed.get() {
            self.handle().wake();
            let start = Instant::now();
            while self.core().wake_armed.get() && start.elapsed() < Duration::from_secs(1) {
                self.poll_once();
            }
        }
        let still_busy = self.busy() || self.core().wake_armed.get();
        let core = self.core.take().expect("checked above");
        core.pollers.borrow_mut().clear();
        core.has_pollers.set(false);
        core.work.clear();
        core.locals.borrow_mut().clear();
        // SAFETY: the cache holds descriptors made by Box::new in alloc_bio.
        for p in unsafe { &mut *core.cache.get() }.drain(..) {
            // SAFETY: as above; each is freed once.
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
        if still_busy || core.outstanding.get() > 0 {
            // Bios (or the kernel) still point at the core: leaking it is
            // the only safe choice.
            Box::leak(core);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{next_window, CompletionMode, Reactor, ReactorConfig};
    use std::time::Duration;

    mod fixed {
        use crate::bio::{Bio, BioPtr, Op, Status};
        use crate::mmap::Mmap;
        use crate::reactor::{Reactor, ReactorConfig};
        use crate::ring::{RingFd, MAX_REGISTERED_BUFFER};
        use std::cell::Cell;
        use std::fs::File;
        use std::os::fd::AsRawFd;

        /// Anonymous memory the tests fill and read back.
        struct Mem(Mmap);

        impl Mem {
            fn new(len: usize) -> Mem {
                Mem(Mmap::anon(len).unwrap())
            }

            fn p(&self) -> *mut u8 {
                self.0.as_ptr()
            }

            fn len(&self) -> usize {
                self.0.len()
            }

            fn at(&self, off: usize) -> *mut u8 {
                assert!(off < self.len());
                self.p().wrapping_add(off)
            }

            fn fill(&self, off: usize, len: usize, v: u8) {
                assert!(off + len <= self.len());
                // SAFETY: inside the mapping (checked), no I/O in flight.
                unsafe { std::ptr::write_bytes(self.p().add(off), v, len) };
            }

            fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
                assert!(off + len <= self.len());
                // SAFETY: as in fill.
                unsafe { std::slice::from_raw_parts(self.p().add(off), len) }.to_vec()
            }
        }

        fn temp_file() -> File {
            let p = std::env::temp_dir().join(format!(
                "udm-fixed-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&p)
                .unwrap();
            std::fs::remove_file(&p).unwrap();
            f.set_len(1 << 20).unwrap();
            f
        }

        fn done(bio: BioPtr) {
            // SAFETY: private is the test's live Cell, kept until this runs.
            let c = unsafe { &*(bio.private() as *const Cell<Option<Status>>) };
            c.set(Some(bio.status()));
        }

        /// One bio of `len` bytes at `ptr`, naming buffer `index`, to byte
        /// `off` of `file`; its status.
        fn io(
            r: &Reactor,
            file: &File,
            op: Op,
            off: u64,
            ptr: *mut u8,
            len: usize,
            index: u16,
        ) -> Status {
            let st = Cell::new(None);
            let mut bio = r.alloc_bio();
            bio.op = op;
            bio.sector = off >> 9;
            // SAFETY: the caller's memory outlives the bio: we wait below.
            unsafe { bio.add_seg(ptr, len) };
            bio.buf_index = index;
            bio.set_end_io(done, (&st as *const Cell<Option<Status>>).cast_mut().cast());
            r.ring()
                .submit_bio(RingFd::Raw(file.as_raw_fd()), bio, 0, false, false);
            r.run_until(|| st.get().is_some());
            st.get().unwrap()
        }

        #[test]
        fn a_buffer_unregistered_is_refused_and_its_slot_serves_the_next() {
            let r = Reactor::new(ReactorConfig::default()).unwrap();
            let f = temp_file();
            let (a, b) = (Mem::new(1 << 16), Mem::new(1 << 16));
            // SAFETY: `a` and `b` outlive the reactor's use: unregistered
            // (or the reactor dropped) before they are unmapped.
            let ia = unsafe { r.try_register_buffer(a.p(), a.len()) }.unwrap();
            a.fill(0, 4096, 0xa1);
            assert_eq!(io(&r, &f, Op::Write, 0, a.at(0), 4096, ia), Status::Ok);
            assert_eq!(r.fixed_ops(), 1, "the write went fixed");
            // A segment outside the buffer that names it: the kernel refuses,
            // proof that the index is what the I/O used.
            assert_ne!(io(&r, &f, Op::Read, 0, b.at(0), 4096, ia), Status::Ok);
            r.unregister_buffer(ia);
            assert_ne!(
                io(&r, &f, Op::Read, 0, a.at(0), 4096, ia),
                Status::Ok,
                "a bio naming an emptied slot reaches no memory"
            );
            // Plain I/O of the same memory still works.
            assert_eq!(
                io(&r, &f, Op::Read, 0, a.at(4096), 4096, Bio::NO_BUF),
                Status::Ok
            );
            assert_eq!(a.bytes(4096, 4096), vec![0xa1; 4096]);
            // The freed slot is the next one handed out, now for `b`.
            // SAFETY: as above.
            let ib = unsafe { r.try_register_buffer(b.p(), b.len()) }.unwrap();
            assert_eq!(ib, ia, "the emptied slot is reused");
            let before = r.fixed_ops();
            assert_eq!(io(&r, &f, Op::Read, 0, b.at(8192), 4096, ib), Status::Ok);
            assert_eq!(b.bytes(8192, 4096), vec![0xa1; 4096]);
            assert_eq!(r.fixed_ops(), before + 1);
            assert_ne!(io(&r, &f, Op::Read, 0, a.at(0), 4096, ib), Status::Ok);
            // A ring made later gets the table as it is.
            let extra = r
                .ring_of(crate::RingKind {
                    sqpoll: true,
                    ..crate::RingKind::default()
                })
                .unwrap();
            let st = Cell::new(None);
            let mut bio = r.alloc_bio();
            bio.op = Op::Read;
            // SAFETY: `b` outlives the bio: we wait below.
            unsafe { bio.add_seg(b.at(0), 4096) };
            bio.buf_index = ib;
            bio.set_end_io(done, (&st as *const Cell<Option<Status>>).cast_mut().cast());
            extra.submit_bio(RingFd::Raw(f.as_raw_fd()), bio, 0, false, false);
            r.run_until(|| st.get().is_some());
            assert_eq!(st.get(), Some(Status::Ok));
            assert_eq!(extra.fixed_ops(), 1);
            assert_eq!(b.bytes(0, 4096), vec![0xa1; 4096]);
            r.unregister_buffer(ib);
        }

        #[test]
        fn a_region_is_registered_in_chunks_and_io_across_two_goes_plain() {
            let r = Reactor::new(ReactorConfig::default()).unwrap();
            let f = temp_file();
            // 64 KiB chunks over 200 KiB: three whole and a 8 KiB tail.
            let m = Mem::new(200 << 10);
            // SAFETY: unregistered below, before `m` is unmapped.
            let (mut reg, err) = unsafe { r.register_region_in(m.p(), m.len(), 16) };
            assert!(err.is_none(), "{err:?}");
            assert_eq!((reg.chunks(), reg.registered()), (4, 4));
            let idx: Vec<u16> = (0..4).map(|c| reg.index_of(m.at(c << 16), 4096)).collect();
            let mut distinct = idx.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 4, "a slot per chunk: {idx:?}");
            // Lookups: inside one chunk, its index; across two, outside the
            // region, or empty, none.
            assert_eq!(reg.index_of(m.at((1 << 16) - 4096), 4096), idx[0]);
            assert_eq!(reg.index_of(m.at((1 << 16) - 4096), 8192), Bio::NO_BUF);
            assert_eq!(reg.index_of(m.at(192 << 10), 8 << 10), idx[3]);
            assert_eq!(reg.index_of(m.at(192 << 10), 12 << 10), Bio::NO_BUF);
            assert_eq!(reg.index_of(m.p().wrapping_sub(4096), 4096), Bio::NO_BUF);
            assert_eq!(reg.index_of(m.at(0), 0), Bio::NO_BUF);
            // Each chunk is registered at its own place: a write from each
            // through its index lands, a read into each gets it back.
            for (c, &i) in idx.iter().enumerate() {
                let at = (c << 16) + 4096;
                m.fill(at, 4096, c as u8 + 1);
                let st = io(&r, &f, Op::Write, (c as u64) << 12, m.at(at), 4096, i);
                assert_eq!(st, Status::Ok, "chunk {c}");
            }
            assert_eq!(r.fixed_ops(), 4);
            for (c, &i) in idx.iter().enumerate() {
                let at = c << 16;
                let st = io(&r, &f, Op::Read, (c as u64) << 12, m.at(at), 4096, i);
                assert_eq!(st, Status::Ok, "chunk {c}");
                assert_eq!(m.bytes(at, 4096), vec![c as u8 + 1; 4096], "chunk {c}");
            }
            r.unregister_region(&mut reg);
            assert_eq!(reg.registered(), 0);
            assert_eq!(reg.index_of(m.at(0), 4096), Bio::NO_BUF);
            // The slots are free again: four more registrations fit in them.
            // SAFETY: as above.
            let (mut again, err) = unsafe { r.register_region_in(m.p(), m.len(), 16) };
            assert!(err.is_none());
            let mut now: Vec<u16> = (0..4).map(|c| again.index_of(m.at(c << 16), 1)).collect();
            now.sort();
            assert_eq!(now, distinct);
            r.unregister_region(&mut again);
        }

        #[test]
        fn a_clone_names_its_parents_buffer_only_with_its_parents_segments() {
            let r = Reactor::new(ReactorConfig::default()).unwrap();
            let (m, own) = (Mem::new(8192), Mem::new(4096));
            let mut p = r.alloc_bio();
            // SAFETY: none of these bios is submitted; `m` outlives them.
            unsafe { p.add_seg(m.at(0), 8192) };
            p.buf_index = 5;
            // A descriptor alone claims nothing (flakey gives its copy
            // memory of its own)...
            assert_eq!(p.alloc_clone().buf_index, Bio::NO_BUF);
            // ...the parent's segments bring the parent's buffer...
            let mut c = p.alloc_clone();
            c.add_segs_from(&p, 4096, 4096);
            assert_eq!(c.buf_index, 5);
            // ...and a bio with segments from elsewhere names none.
            let mut mixed = p.alloc_clone();
            // SAFETY: as above, for `own`.
            unsafe { mixed.add_seg(own.at(0), 4096) };
            mixed.add_segs_from(&p, 0, 4096);
            assert_eq!(mixed.buf_index, Bio::NO_BUF);
        }

        /// RLIMIT_MEMLOCK's soft limit, if small enough for a test to pass it
        /// (up to 64 MiB).
        fn memlock_limit() -> Option<usize> {
            let limit = crate::memlock::soft_limit().expect("getrlimit");
            limit.filter(|&l| l <= 64 << 20).map(|l| l as usize)
        }

        #[test]
        fn past_the_memlock_limit_the_kernel_refuses_and_io_goes_plain() {
            let Some(limit) = memlock_limit() else {
                eprintln!("skipped: RLIMIT_MEMLOCK is above 64 MiB or unlimited");
                return;
            };
            std::thread::spawn(move || {
                crate::memlock::drop_ipc_lock().expect("capset");
                let r = Reactor::new(ReactorConfig::default()).unwrap();
                let f = temp_file();
                let m = Mem::new((2 * limit).max(1 << 20));
                // SAFETY: refused, or unregistered below before `m` goes.
                let (mut reg, err) = unsafe { r.register_region(m.p(), m.len()) };
                let e = err.expect("registration past RLIMIT_MEMLOCK refused");
                assert_eq!(e.raw_os_error(), Some(libc::ENOMEM), "{e}");
                assert_eq!(reg.registered(), 0);
                let i = reg.index_of(m.at(0), 4096);
                assert_eq!(i, Bio::NO_BUF);
                m.fill(0, 4096, 7);
                assert_eq!(io(&r, &f, Op::Write, 0, m.at(0), 4096, i), Status::Ok);
                assert_eq!(io(&r, &f, Op::Read, 0, m.at(4096), 4096, i), Status::Ok);
                assert_eq!(m.bytes(4096, 4096), vec![7; 4096]);
                assert_eq!(r.fixed_ops(), 0);
                // Below the limit, the same thread registers.
                // SAFETY: unregistered below, before `m` goes.
                let (mut small, err) = unsafe { r.register_region(m.p(), 64 << 10) };
                assert!(err.is_none(), "{err:?}");
                assert_eq!(small.registered(), 1);
                r.unregister_region(&mut small);
                r.unregister_region(&mut reg);
            })
            .join()
            .unwrap();
        }

        #[test]
        fn io_uring_takes_at_most_1_gib_per_buffer_and_a_larger_region_is_split_there() {
            let r = Reactor::new(ReactorConfig::default()).unwrap();
            // Address space only: the refused registration pins nothing.
            let m = Mem::new(MAX_REGISTERED_BUFFER + (8 << 10));
            let whole = libc::iovec {
                iov_base: m.p().cast(),
                iov_len: m.len(),
            };
            // SAFETY: refused before anything is pinned (checked).
            let e = unsafe { r.ring().register_buffer(0, whole) }.unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
            // Ours says so without asking the kernel.
            // SAFETY: refused at once.
            assert!(unsafe { r.try_register_buffer(m.p(), m.len()) }.is_err());
            // Split: a GiB and the 8 KiB tail, each registered (huge pages
            // make pinning the GiB quick; it is given back at the end).
            // Advice only: without transparent huge pages it is refused,
            // and pinning is slower but works.
            let _ = m.0.advise(libc::MADV_HUGEPAGE);
            // SAFETY: unregistered below, before `m` is unmapped.
            let (mut reg, err) = unsafe { r.register_region(m.p(), m.len()) };
            assert!(err.is_none(), "{err:?}");
            assert_eq!((reg.chunks(), reg.registered()), (2, 2));
            let first = reg.index_of(m.at(0), 4096);
            let tail = reg.index_of(m.at(MAX_REGISTERED_BUFFER), 8192);
            assert!(first != Bio::NO_BUF && tail != Bio::NO_BUF && first != tail);
            assert_eq!(
                reg.index_of(m.at(MAX_REGISTERED_BUFFER - 4096), 4096),
                first
            );
            assert_eq!(
                reg.index_of(m.at(MAX_REGISTERED_BUFFER - 4096), 8192),
                Bio::NO_BUF,
                "across the GiB boundary: plain"
            );
            let f = temp_file();
            m.fill(MAX_REGISTERED_BUFFER, 4096, 0x5a);
            let st = io(
                &r,
                &f,
                Op::Write,
                0,
                m.at(MAX_REGISTERED_BUFFER),
                4096,
                tail,
            );
            assert_eq!(st, Status::Ok);
            let end = MAX_REGISTERED_BUFFER - 4096;
            assert_eq!(io(&r, &f, Op::Read, 0, m.at(end), 4096, first), Status::Ok);
            assert_eq!(m.bytes(end, 4096), vec![0x5a; 4096]);
            assert_eq!(r.fixed_ops(), 2);
            r.unregister_region(&mut reg);
        }
    }

    #[test]
    fn adaptive_mode_sleeps_right_after_work_while_its_window_is_closed() {
        let r = Reactor::new(ReactorConfig {
            mode: CompletionMode::Adaptive,
            ..ReactorConfig::default()
        })
        .unwrap();
        let core = r.core();
        // Closed (as at start): the turn with work sleeps at once, one
        // enter for its submission and the wait, and the idle gap starts.
        assert!(core.adaptive_sleep(true));
        assert!(core.idle_since.get().is_some());
        // Work was runnable, so it did not sleep after all: not idle.
        core.adaptive_busy();
        assert!(core.idle_since.get().is_none());
        // Open: a turn with work spins on, the gap starts at the idle turn.
        core.spin_window.set(50 * US);
        assert!(!core.adaptive_sleep(true));
        assert!(core.idle_since.get().is_none());
        assert!(!core.adaptive_sleep(false));
        assert!(core.idle_since.get().is_some());
    }

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn the_adaptive_window_follows_idle_gaps_as_haltpoll_does() {
        let max = 100 * US;
        // A short gap opens a closed window at a quarter of the cap, then
        // doubles it up to the cap.
        assert_eq!(next_window(Duration::ZERO, 30 * US, max), 25 * US);
        assert_eq!(next_window(25 * US, 30 * US, max), 50 * US);
        assert_eq!(next_window(80 * US, 90 * US, max), max);
        // A gap the window covered keeps it.
        assert_eq!(next_window(50 * US, 30 * US, max), 50 * US);
        // A gap beyond the cap halves it, and closes it below a quarter.
        assert_eq!(next_window(max, 5000 * US, max), 50 * US);
        assert_eq!(next_window(50 * US, 5000 * US, max), 25 * US);
        assert_eq!(next_window(25 * US, 5000 * US, max), Duration::ZERO);
        assert_eq!(next_window(Duration::ZERO, 5000 * US, max), Duration::ZERO);
    }
}
