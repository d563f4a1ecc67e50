//! The mapped device's per-reactor channel and its hot path.
//!
//! The no-clone fast path (seed 000): when every target opted in and the bio
//! lies inside one target and one `max_io_len` window and carries no
//! PREFLUSH, the caller's bio itself is remapped and passed down. Its
//! completion (end_io, private, ctx, sector) is saved in an inline frame of
//! the bio, so the path allocates nothing and copies nothing; `noclone_endio`
//! (table_io.rs) restores it. Everything else goes to [`crate::clone`].
//!
//! Which way a new bio goes is the channel's [`Plan`], made again whenever
//! the table, a suspend or the fast-path switch changes. A table of one
//! linear or one power-of-two striped target (seed 000's devices), or of
//! one block-mapped target (thin, [`crate::Target::block_map`]), has a plan
//! of its own that holds all its path reads and admits only bios that pass
//! the device's own check, so they go down unchecked
//! ([`Channel::submit_nocheck`]); other tables find their target and map by
//! its [`FastMap`].
//!
//! A read whose caller allows lending ([`BioFlags::MAY_LEND`]) keeps that
//! flag only through pure remaps (linear's offset, striped's sector), where
//! the device's memory is exactly the caller's data; a target's own `map`
//! and the clone path remove it.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use udm_core::{
    check_bio, Bio, BioFlags, BioPtr, Caps, Channel, Error, Op, Poller, Reactor, Status,
    SECTOR_SHIFT,
};

use crate::clone;
use crate::stats::Shard;
use crate::table::Table;
use crate::table_io::{block_map_endio, ChanState, FastMap, Stripes, TableIo, TargetIo};
use crate::target::{BlockMap, EndIoWhen, Map, MapCtx};
use crate::targets::thin::{Vol, MAPPED, SHARED};

/// What the channel does with a new bio, fixed whenever the table, the
/// suspension or the fast-path switch changes ([`MapperChannel::refresh`]),
/// so that the hot path reads one word to choose. The two one-target plans
/// are seed 000's case (a linear or striped device) with everything they
/// read in one place; the rest go through [`MapperChannel::map_in`].
#[derive(Clone, Copy)]
enum Plan {
    /// A table of one target remapped by an offset (linear), with no
    /// max_io_len.
    Offset(OffsetPlan),
    /// A table of one target the fast path stripes itself (striped).
    Stripes(StripesPlan),
    /// A table of one target remapped by an offset while its remap gate
    /// is set (flakey up, dust with no bad blocks), with no max_io_len.
    Gated(GatedPlan),
    /// A table of one block-mapped target (thin): a mapped block's bio is
    /// remapped by its cache.
    Blocks(BlocksPlan),
    /// Any other table: with `fast`, find the target and map by its
    /// [`FastMap`]; without (suspended, switched off, or a target did not
    /// opt in), the slow path.
    Other {
        /// Whether the fast path is on.
        fast: bool,
    },
}

/// What a one-target plan checks a bio against: the target's range and the
/// table's limits. Table::build stacked those limits from the devices' and
/// checked the target's areas against their sizes, and [`TableIo::plan`]
/// checked the remap keeps a bio aligned, so a bio admitted here passes its
/// device's own check, and goes down with [`Channel::submit_nocheck`].
/// The target starts at sector 0: a table covers `0..sectors` without gaps,
/// so its only target does.
#[derive(Clone, Copy)]
struct Window {
    /// The TableIo the plan was made from (the frame's private).
    tio: *const TableIo,
    len: u64,
    /// The table's logical block size in bytes, minus one.
    align: u64,
    max_bytes: u32,
    max_segs: u32,
}

impl Window {
    /// Where a bio the fast path may take lies in the target (its first
    /// sector and one past its last, target-relative): remappable
    /// ([`Bio::remappable`]), non-empty, inside the target, aligned, and
    /// within the table's length and segment limits.
    #[inline(always)]
    fn admit(&self, bio: &Bio) -> Option<(u64, u64)> {
        let rel = bio.sector;
        let end = rel.wrapping_add(bio.sectors());
        let len = bio.len();
        // `rel < end` rules out an empty bio and one that wraps.
        (bio.remappable()
            && rel < end
            && end <= self.len
            && ((bio.sector << SECTOR_SHIFT) | len as u64) & self.align == 0
            && len <= self.max_bytes
            && bio.nr_segs() <= self.max_segs as usize)
            .then_some((rel, end))
    }

    /// Saves the caller's completion in the bio's frame and counts the bio
    /// in flight on the table.
    #[inline(always)]
    fn push(&self, bio: &mut BioPtr) {
        // SAFETY: the plan is current (refresh runs on every switch), so
        // `tio` is `current`'s TableIo, which `current` keeps alive.
        let tio = unsafe { &*self.tio };
        // Cannot fail: admit() saw a free frame.
        let _ = bio.push_end_io_ctx(tio.endio, self.tio as *mut (), 0);
        tio.get();
    }
}

/// [`Plan::Offset`]: the target, and where it starts on its device.
#[derive(Clone, Copy)]
struct OffsetPlan {
    w: Window,
    start: u64,
    /// The target's device's channel (as [`FastMap::Offset`]'s).
    ch: *const dyn Channel,
}

/// [`Plan::Gated`]: linear's plan behind the target's remap gate.
#[derive(Clone, Copy)]
struct GatedPlan {
    o: OffsetPlan,
    /// [`crate::Target::remap_gate`]: set while the target passes I/O
    /// through unchanged.
    gate: *const AtomicBool,
    /// The target's end_io runs on every bio ([`EndIoWhen::Always`]): it
    /// may change read data (flakey corrupting once its gate closed), so
    /// no device below may lend its memory to the read.
    end_io_always: bool,
}

/// [`Plan::Blocks`]: the target's cache, this reactor's in-flight
/// counters in it, and its data device's channels by epoch (its devices 1
/// and 2, see [`BlockMap`]).
#[derive(Clone, Copy)]
struct BlocksPlan {
    w: Window,
    b: BlockMap,
    counts: *const [AtomicU64; 2],
    data: [*const dyn Channel; 2],
}

/// [`Plan::Stripes`]: the target, its geometry and its stripes.
#[derive(Clone, Copy)]
struct StripesPlan {
    w: Window,
    g: Stripes,
    /// The target's `devs`, one per stripe.
    devs: *const *const dyn Channel,
}

impl OffsetPlan {
    /// Linear's fast path in full: a bio inside the target is remapped and
    /// passed down; anything else goes to `submit_slow`.
    #[inline(always)]
    fn map(&self, mut bio: BioPtr, ch: &MapperChannel) {
        let Some((rel, _)) = self.w.admit(&bio) else {
            return ch.submit_slow(bio);
        };
        self.w.push(&mut bio);
        bio.sector = rel.wrapping_add(self.start);
        // SAFETY: `ch` is the current TableIo's channel to the device, and
        // the bio passes the device's check (see Window).
        unsafe { (*self.ch).submit_nocheck(bio) }
    }
}

impl GatedPlan {
    /// Linear's path while the gate is set; while it is clear, the general
    /// plan's (which calls the target's map). (Out of line, as striped's.)
    #[inline(never)]
    fn map(&self, mut bio: BioPtr, ch: &MapperChannel) {
        // SAFETY: `gate` points into the current table's target, which the
        // current TableIo keeps alive (the plan is remade on every switch).
        if unsafe { (*self.gate).load(Ordering::Relaxed) } {
            if self.end_io_always {
                bio.flags.remove(BioFlags::MAY_LEND);
            }
            self.o.map(bio, ch)
        } else {
            ch.map_targets(bio)
        }
    }
}

impl BlocksPlan {
    /// Thin's fast path in full: a read, or a write without FUA, inside
    /// one block its cache says is mapped (and, for a write, unshared) is
    /// counted in flight, remapped and passed down; anything else goes to
    /// the target's `map` by the general plan (which splits, provisions,
    /// breaks sharing, zeroes and commits for FUA). (Out of line, as
    /// striped's.)
    #[inline(never)]
    fn map(&self, mut bio: BioPtr, ch: &MapperChannel) {
        let shift = self.b.shift;
        let Some((rel, _)) = self.w.admit(&bio).filter(|&(rel, end)| {
            (rel ^ (end - 1)) >> shift == 0 && !bio.flags.contains(BioFlags::FUA)
        }) else {
            return ch.map_targets(bio);
        };
        // SAFETY: the target that gave the BlockMap owns the cache, and the
        // current TableIo (the plan is remade on every switch) owns it.
        let vol = unsafe { &*self.b.vol };
        // SAFETY: this reactor's counters in `vol` (TableIo::open, on this
        // thread), which the bio's completion, also on this thread, updates.
        let counts = unsafe { &*self.counts };
        // Counted before the cache is read (see `Vol::enter`).
        let e = vol.enter_on(counts);
        let ent = vol.get(rel >> shift);
        if ent & MAPPED == 0
            || (bio.op != Op::Read && ent & SHARED != 0)
            || ent >> 2 >= self.b.data_blocks
        {
            Vol::exit_on(counts, e);
            return ch.map_targets(bio);
        }
        // Cannot fail: admit() saw a free frame. The context word is the
        // epoch, for `block_map_endio`.
        let _ = bio.push_end_io_ctx(block_map_endio, self.w.tio as *mut (), e as u64);
        // SAFETY: as in Window::push.
        unsafe { &*self.w.tio }.get();
        // Not a pure remap for as long as the caller may hold lent memory:
        // the count, which keeps the block from being reused, ends at
        // completion.
        bio.flags.remove(BioFlags::MAY_LEND);
        bio.sector = (ent >> 2 << shift) | (rel & ((1 << shift) - 1));
        // SAFETY: `data` are the current TableIo's channels to the data
        // device, and the bio passes its check: admitted by the window
        // (Window: the table's limits are the data device's, and its block
        // size a multiple of the device's), inside one block, and that
        // block inside the data device's area.
        unsafe { (*self.data[e & 1]).submit_nocheck(bio) }
    }
}

impl StripesPlan {
    /// Striped's fast path in full: a bio inside one chunk of the target
    /// goes to its stripe; anything else goes to `submit_slow`. (Out of
    /// line: inlined, its registers would cost linear's path six saves.)
    #[inline(never)]
    fn map(&self, mut bio: BioPtr, ch: &MapperChannel) {
        let g = self.g;
        // Inside one chunk: the first and last sectors share their row and
        // stripe bits.
        let Some((rel, _)) = self
            .w
            .admit(&bio)
            .filter(|&(rel, end)| (rel ^ (end - 1)) & g.rmask == 0)
        else {
            return ch.submit_slow(bio);
        };
        self.w.push(&mut bio);
        bio.sector = g.start + g.dev_sector(rel);
        // SAFETY: `dev` masks with `smask`, and `devs` has `smask + 1`
        // entries, one per stripe (Table::build trusts the shifts only
        // then), owned by the current TableIo.
        let dch = unsafe { *self.devs.add(g.dev(rel)) };
        // The device index is not stored for end_io: `target_end_io`
        // recomputes it from the saved sector, on the rare bio that needs it.
        // SAFETY: `dch` is the current TableIo's channel to the stripe's
        // device, and the bio passes the device's check (see Window).
        unsafe { (*dch).submit_nocheck(bio) }
    }
}

impl TableIo {
    /// The plan for new bios on this table, when the fast path is on.
    /// `tio` is this TableIo's address in its Rc.
    fn plan(&self, tio: *const TableIo) -> Plan {
        let table = &self.table;
        if !table.no_clone {
            return Plan::Other { fast: false };
        }
        let general = Plan::Other { fast: true };
        let [t] = &self.targets[..] else {
            return general;
        };
        debug_assert_eq!(t.begin, 0, "a table's only target starts at 0");
        let l = &table.limits;
        let lbs = l.logical_block_size;
        // The one-target plans pass bios down unchecked, so only where
        // their own checks imply the device's: writes allowed everywhere
        // (a read-only device refuses them), and the table's block size a
        // multiple of every device's.
        if table.caps.contains(Caps::READ_ONLY)
            || !lbs.is_power_of_two()
            || !table
                .devices
                .iter()
                .all(|d| lbs.is_multiple_of(d.limits().logical_block_size))
        {
            return general;
        }
        let w = Window {
            tio,
            len: t.len,
            align: lbs as u64 - 1,
            max_bytes: l.max_io_bytes,
            max_segs: l.max_segments,
        };
        // And the remapped sector must stay aligned: the device's start is.
        let aligned = |start: u64| start & self.lbs_mask == 0;
        match t.fast {
            // A gated target (flakey, dust) has a plan of its own, so that
            // linear's pays nothing for gates.
            FastMap::Offset(start, ch, gate) if t.max_io_len == 0 && aligned(start) => {
                let o = OffsetPlan { w, start, ch };
                if gate.is_null() {
                    Plan::Offset(o)
                } else {
                    Plan::Gated(GatedPlan {
                        o,
                        gate,
                        end_io_always: t.end_io == EndIoWhen::Always,
                    })
                }
            }
            // Table::build checked the window is the chunk, a multiple of
            // the block size.
            FastMap::Stripes(g) if aligned(g.start) => Plan::Stripes(StripesPlan {
                w,
                g,
                devs: t.devs.as_ptr(),
            }),
            FastMap::Call(false) => match (t.target().block_map(), self.block_counts) {
                // The target splits at its blocks, and lists the data
                // device as its devices 1 and 2.
                (Some(b), Some(counts)) if t.max_io_len == 1 << b.shift && t.devs.len() == 3 => {
                    Plan::Blocks(BlocksPlan {
                        w,
                        b,
                        counts,
                        data: [t.devs[1], t.devs[2]],
                    })
                }
                _ => general,
            },
            _ => general,
        }
    }
}

/// A mapped device's channel on one reactor.
pub struct MapperChannel {
    /// What new bios take: the current table's plan ([`TableIo::plan`])
    /// when not suspended and the fast path is on, else the slow path.
    /// While latency is timed it is the slow path's, whose entry
    /// ([`MapperChannel::submit_other`]) times the bio and follows `inner`:
    /// timing costs the untimed path nothing (a fourth plan would turn the
    /// match into a jump table).
    plan: Cell<Plan>,
    /// The plan itself, whether or not timed.
    inner: Cell<Plan>,
    /// Whether latency is timed.
    timed: Cell<bool>,
    /// `current`'s address, so the hot path reads a pointer, not a RefCell.
    cur: Cell<*const TableIo>,
    current: RefCell<Rc<TableIo>>,
    pub(crate) state: Rc<ChanState>,
}

impl MapperChannel {
    pub(crate) fn open(
        table: Arc<Table>,
        reactor: &Reactor,
        suspended: bool,
        fast_path: bool,
        stats: Arc<Shard>,
        timed: bool,
    ) -> Result<Rc<MapperChannel>, Error> {
        let me: Weak<MapperChannel> = Weak::new();
        let state = Rc::new(ChanState {
            slow: Cell::new(false),
            work: reactor.work_queue(),
            me: RefCell::new(me),
            suspended: Cell::new(suspended),
            fast_path: Cell::new(fast_path),
            deferred: RefCell::new(VecDeque::new()),
            requeue: RefCell::new(VecDeque::new()),
            requeue_clones: RefCell::new(VecDeque::new()),
            retired: RefCell::new(Vec::new()),
            drain: RefCell::new(None),
            stats,
        });
        let tio = Rc::new(TableIo::open(table, reactor, state.clone())?);
        let ch = MapperChannel {
            plan: Cell::new(Plan::Other { fast: false }),
            inner: Cell::new(Plan::Other { fast: false }),
            timed: Cell::new(timed),
            cur: Cell::new(Rc::as_ptr(&tio)),
            current: RefCell::new(tio),
            state,
        };
        ch.refresh();
        let ch = Rc::new(ch);
        let me: Weak<dyn Poller> = Rc::downgrade(&ch) as Weak<dyn Poller>;
        *ch.state.me.borrow_mut() = me;
        Ok(ch)
    }

    /// Makes the plan again; called whenever what it depends on changes.
    fn refresh(&self) {
        let st = &self.state;
        let plan = if !st.suspended.get() && st.fast_path.get() {
            self.tio().plan(self.cur.get())
        } else {
            Plan::Other { fast: false }
        };
        self.inner.set(plan);
        self.plan.set(if self.timed.get() {
            Plan::Other { fast: false }
        } else {
            plan
        });
    }

    /// Times (or, with false, stops timing) each new bio's latency into
    /// the statistics' histograms.
    pub(crate) fn set_timed(&self, on: bool) {
        self.timed.set(on);
        self.refresh();
    }

    /// Holds (or, with false, releases the hold on) new I/O.
    pub(crate) fn set_suspended(&self, on: bool) {
        self.state.suspended.set(on);
        self.refresh();
    }

    /// Turns the fast path on or off.
    pub(crate) fn set_fast_path(&self, on: bool) {
        self.state.fast_path.set(on);
        self.refresh();
    }

    /// Opens this reactor's channels for `table` with this channel's state.
    pub(crate) fn open_table(
        &self,
        table: Arc<Table>,
        reactor: &Reactor,
    ) -> Result<TableIo, Error> {
        TableIo::open(table, reactor, self.state.clone())
    }

    #[inline]
    fn tio(&self) -> &TableIo {
        // SAFETY: `cur` always equals the address of `current`'s TableIo,
        // which `current` keeps alive; it changes only in `switch`, which runs
        // from a reactor message, never while a submit holds this reference.
        unsafe { &*self.cur.get() }
    }

    pub(crate) fn current(&self) -> Rc<TableIo> {
        self.current.borrow().clone()
    }

    /// Makes `tio` the table new I/O maps through. The old one finishes the
    /// I/O it has in flight and is freed when idle.
    pub(crate) fn switch(&self, tio: TableIo) {
        let tio = Rc::new(tio);
        self.cur.set(Rc::as_ptr(&tio));
        let old = self.current.replace(tio);
        self.refresh();
        if old.inflight.get() > 0 {
            self.state.retired.borrow_mut().push(old);
            self.state.kick();
        }
    }

    /// Total I/O in flight on this reactor, over the live and retired tables.
    pub(crate) fn inflight(&self) -> u64 {
        self.tio().inflight.get()
            + self
                .state
                .retired
                .borrow()
                .iter()
                .map(|t| t.inflight.get())
                .sum::<u64>()
    }

    /// Resubmits bios held while suspended.
    pub(crate) fn kick(&self) {
        let held: VecDeque<BioPtr> = std::mem::take(&mut *self.state.deferred.borrow_mut());
        for bio in held {
            self.submit(bio);
        }
    }
}

impl Channel for MapperChannel {
    /// The no-clone fast path (see `MapperChannel::map_in`). Every call in
    /// it is a tail call, so it runs without a stack frame: a linear remap
    /// costs a few dozen instructions.
    #[inline]
    fn submit(&self, bio: BioPtr) {
        // Read in place, not copied out of the Cell: each plan loads only
        // the fields it uses.
        // SAFETY: the plan changes only in `refresh`, which runs from the
        // control messages (switch, suspend, the fast-path switch) a reactor
        // runs between submits, never inside one: nothing below a submit
        // turns the reactor.
        match unsafe { &*self.plan.as_ptr() } {
            Plan::Offset(p) => p.map(bio, self),
            Plan::Stripes(p) => p.map(bio, self),
            Plan::Gated(p) => p.map(bio, self),
            Plan::Blocks(p) => p.map(bio, self),
            Plan::Other { fast: true } => self.map_targets(bio),
            Plan::Other { fast: false } => self.submit_other(bio),
        }
    }
}

impl MapperChannel {
    /// The slow path's entry from [`Channel::submit`]: the timed path while
    /// latency is timed, else the slow path.
    #[cold]
    fn submit_other(&self, bio: BioPtr) {
        if self.timed.get() {
            return self.submit_timed(bio);
        }
        self.submit_slow(bio)
    }

    /// Timing: saves the submit time in a frame of the bio (when
    /// one is free; else the bio goes untimed), then the inner plan.
    #[inline(never)]
    fn submit_timed(&self, mut bio: BioPtr) {
        if bio.can_push() {
            let st = &self.state.stats;
            let now = st.now_ns();
            let _ = bio.push_end_io_ctx(timed_endio, Arc::as_ptr(st) as *mut (), now);
        }
        // SAFETY: as in submit: `inner` changes only in `refresh`.
        match unsafe { &*self.inner.as_ptr() } {
            Plan::Offset(p) => p.map(bio, self),
            Plan::Stripes(p) => p.map(bio, self),
            Plan::Gated(p) => p.map(bio, self),
            Plan::Blocks(p) => p.map(bio, self),
            Plan::Other { fast: true } => self.map_targets(bio),
            Plan::Other { fast: false } => self.submit_slow(bio),
        }
    }
    /// The fast path on a table of [`Plan::Other`] (with `fast`).
    #[inline(never)]
    fn map_targets(&self, bio: BioPtr) {
        let tio = self.tio();
        if tio.targets.len() == 1 {
            self.map_in::<false>(tio, 0, bio)
        } else {
            self.map_search(tio, bio)
        }
    }

    /// The fast path's body for target `ti`: when it takes the bio (see the
    /// module docs), pushes the completion frame and remaps; anything else
    /// goes to `submit_slow`. `DIV`: the target's max_io_len window is not a
    /// power of two, so finding the bio's place in it takes a division.
    #[inline(always)]
    fn map_in<const DIV: bool>(&self, tio: &TableIo, ti: usize, mut bio: BioPtr) {
        // Read or write, no PREFLUSH, a free frame. (The plan says the
        // fast path is on.)
        if bio.remappable() {
            let t = &tio.targets[ti];
            let rel = bio.sector.wrapping_sub(t.begin);
            let n = bio.sectors();
            // Inside the target, non-empty, aligned...
            if rel < t.len && n != 0 && (bio.sector | n) & tio.lbs_mask == 0 {
                // ...and inside one max_io_len window.
                let room = if DIV {
                    t.room(rel)
                } else {
                    match t.room_pow2(rel) {
                        Some(r) => r,
                        None => return self.map_div(tio, ti, bio),
                    }
                };
                if n <= room {
                    // Cannot fail: can_push() held above. The context word is
                    // the target index, for end_io and for a target that
                    // completes the bio in map; dispatch adds the device.
                    let _ =
                        bio.push_end_io_ctx(tio.endio, tio as *const TableIo as *mut (), ti as u64);
                    tio.get();
                    // A target whose end_io runs on every bio may change
                    // read data there: nothing below may lend to it.
                    if t.end_io == EndIoWhen::Always {
                        bio.flags.remove(BioFlags::MAY_LEND);
                    }
                    return match t.fast {
                        FastMap::Offset(start, ch, gate) => {
                            // SAFETY: a non-null gate points into the
                            // target, which `t` keeps alive.
                            if !gate.is_null() && !unsafe { (*gate).load(Ordering::Relaxed) } {
                                return self.map_gate_clear(tio, ti, rel, bio);
                            }
                            bio.sector = rel.wrapping_add(start);
                            // SAFETY: `ch` is `Rc::as_ptr(&t.chans[0])`, which
                            // `t` owns and never changes.
                            unsafe { (*ch).submit(bio) }
                        }
                        FastMap::Stripes(g) => {
                            let d = g.dev(rel);
                            // SAFETY: `dev` masks with `smask`, and `devs`
                            // has `smask + 1` entries: one per stripe
                            // (Table::build trusts the shifts only then).
                            let ch = unsafe { *t.devs.get_unchecked(d) };
                            bio.sector = g.start + g.dev_sector(rel);
                            // The device index is not stored for end_io:
                            // `target_end_io` recomputes it from the saved
                            // sector, on the rare bio that needs it.
                            // SAFETY: `devs[d]` is `Rc::as_ptr(&t.chans[d])`,
                            // which `t` owns and never changes.
                            unsafe { (*ch).submit(bio) }
                        }
                        FastMap::Call(true) => {
                            bio.sector = rel;
                            map_sector(t, ti, bio)
                        }
                        FastMap::Call(false) => {
                            bio.sector = rel;
                            self.map_fast(tio, ti, bio)
                        }
                    };
                }
            }
        }
        self.submit_slow(bio)
    }

    /// A gated target whose gate is clear: its `map` runs, on a bio inside
    /// one of its max_io_len windows (which the fast path's room check,
    /// seeing none for a gated target, did not look at); a bio that
    /// crosses one leaves the fast path to be split.
    #[cold]
    #[inline(never)]
    fn map_gate_clear(&self, tio: &TableIo, ti: usize, rel: u64, mut bio: BioPtr) {
        if bio.sectors() > tio.targets[ti].split_room(rel) {
            bio.pop_end_io();
            tio.put();
            return self.submit_slow(bio);
        }
        bio.sector = rel;
        self.map_fast(tio, ti, bio)
    }

    /// The fast path on a table of several targets: the lookup (a binary
    /// search) lives here so that `submit` itself needs no frame.
    #[inline(never)]
    fn map_search(&self, tio: &TableIo, bio: BioPtr) {
        let ti = tio.table.find(bio.sector);
        self.map_in::<false>(tio, ti, bio)
    }

    /// The fast path for a target whose max_io_len is not a power of two.
    #[inline(never)]
    fn map_div(&self, tio: &TableIo, ti: usize, bio: BioPtr) {
        self.map_in::<true>(tio, ti, bio)
    }

    /// The fast path for a target that maps itself in full: its `map`, then
    /// what that returned.
    #[inline(never)]
    fn map_fast(&self, tio: &TableIo, ti: usize, mut bio: BioPtr) {
        // The fast path's admission checks sectors, not bytes, length or
        // segments: a remap leaves those to the device below, but a target
        // that maps itself may complete the bio or change its status, so
        // the table's limits are checked here (the frame is pushed: the
        // completion unwinds it, as for a bio the target kills).
        if let Err(s) = tio.table.limits.check(&bio) {
            return bio.complete(s);
        }
        let t = &tio.targets[ti];
        // Only a pure remap (offset or sector) may let a device below lend
        // its memory to the caller: a target that maps itself may cache,
        // move or transform the data (writecache reuses its blocks).
        bio.flags.remove(BioFlags::MAY_LEND);
        match t.target().map(bio, &MapCtx { devs: &t.chans }) {
            Map::Remapped(bio, d) => t.submit_to(ti, bio, d),
            m => {
                if let Some(b) = tio.dispatch(ti, m) {
                    self.requeue(tio, b);
                }
            }
        }
    }
}

/// A timed bio completes: its latency goes into the histogram of its
/// operation, then the caller's completion runs.
fn timed_endio(mut bio: BioPtr) {
    // SAFETY: pushed by `submit_timed` with the channel's shard, which the
    // channel's state holds; the submitter keeps the channel open while its
    // bio is in flight.
    let st = unsafe { &*(bio.private() as *const Shard) };
    st.latency(bio.op, st.now_ns().saturating_sub(bio.ctx()));
    bio.pop_end_io();
    bio.endio();
}

/// The fast path for a [`crate::Target::map_sector`] target `t` (index `ti`).
#[inline(never)]
fn map_sector(t: &TargetIo, ti: usize, mut bio: BioPtr) {
    let (d, sector) = t.target().map_sector(bio.sector);
    bio.sector = sector;
    t.submit_to(ti, bio, d)
}

impl MapperChannel {
    /// Everything but the fast path: held while suspended, checked against
    /// the table's limits and capabilities, then cloned.
    #[cold]
    fn submit_slow(&self, bio: BioPtr) {
        if self.state.suspended.get() {
            return self.hold(bio);
        }
        let tio = self.tio();
        let Some(bio) = check_bio(bio, &tio.table.limits, tio.table.caps) else {
            return;
        };
        clone::submit(tio, bio)
    }

    /// A fast-path bio the target wants retried: undo the remap and keep it
    /// for the next turn, when it is submitted again from scratch.
    #[cold]
    fn requeue(&self, tio: &TableIo, mut bio: BioPtr) {
        bio.pop_end_io();
        tio.put();
        self.state.requeue.borrow_mut().push_back(bio);
        self.state.kick();
    }

    #[cold]
    fn hold(&self, bio: BioPtr) {
        if bio.flags.contains(BioFlags::NOWAIT) {
            return bio.complete(Status::Again);
        }
        self.state.deferred.borrow_mut().push_back(bio);
    }
}

impl Drop for MapperChannel {
    /// Retired tables hold the channel's state, which holds them: let go of
    /// the idle ones here, so that they are freed (and closed on this
    /// reactor, see [`crate::Target::reactor_close`]) with the channel. One
    /// still in use (a bio that never completed) stays, as its bio's frame
    /// points at it.
    fn drop(&mut self) {
        self.state
            .retired
            .borrow_mut()
            .retain(|t| t.inflight.get() > 0);
    }
}

impl Poller for MapperChannel {
    /// Slow work, once per reactor turn while there is some (the channel is
    /// on the reactor's work queue only then): retries, freeing retired
    /// tables, and telling a waiting suspend that I/O has drained.
    fn poll(&self) -> usize {
        if !self.state.slow.get() {
            return 0;
        }
        self.poll_slow()
    }

    fn pending(&self) -> bool {
        self.state.slow.get()
    }
}

impl MapperChannel {
    #[cold]
    fn poll_slow(&self) -> usize {
        let mut work = 0;
        if !self.state.suspended.get() {
            if !self.state.requeue.borrow().is_empty() {
                let q: VecDeque<BioPtr> = std::mem::take(&mut *self.state.requeue.borrow_mut());
                work += q.len();
                for bio in q {
                    self.submit(bio);
                }
            }
            if !self.state.requeue_clones.borrow().is_empty() {
                let q: VecDeque<BioPtr> =
                    std::mem::take(&mut *self.state.requeue_clones.borrow_mut());
                work += q.len();
                for bio in q {
                    clone::remap_clone(bio);
                }
            }
        }
        if !self.state.retired.borrow().is_empty() {
            self.state
                .retired
                .borrow_mut()
                .retain(|t| t.inflight.get() > 0);
        }
        if self.state.drain.borrow().is_some() && self.inflight() == 0 {
            // Dropping the guard tells the suspender this reactor is drained.
            drop(self.state.drain.borrow_mut().take());
            work += 1;
        }
        let st = &self.state;
        st.slow.set(
            !st.requeue.borrow().is_empty()
                || !st.requeue_clones.borrow().is_empty()
                || !st.retired.borrow().is_empty()
                || st.drain.borrow().is_some(),
        );
        work
    }
}
