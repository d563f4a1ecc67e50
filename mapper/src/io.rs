//! The mapped device's per-reactor channel and its hot path.
//!
//! The no-clone fast path (seed 000): when every target opted in and the bio
//! lies inside one target and one `max_io_len` window and carries no
//! PREFLUSH, the caller's bio itself is remapped and passed down. Its
//! completion (end_io, private, ctx, sector) is saved in an inline frame of
//! the bio, so the path allocates nothing and copies nothing; [`noclone_endio`]
//! restores it. Everything else goes to [`crate::clone`].
//!
//! Which way a new bio goes is the channel's [`Plan`], made again whenever
//! the table, a suspend or the fast-path switch changes. A table of one
//! linear or one power-of-two striped target (seed 000's devices) has a plan
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
use std::sync::Arc;

use udm_core::{
    check_bio, Bio, BioFlags, BioPtr, BlockDevice, Caps, Channel, EndIo, Error, Poller, Reactor,
    Status, WorkQueue, SECTOR_SHIFT,
};

use crate::clone;
use crate::device::Guard;
use crate::table::Table;
use crate::target::{EndIoWhen, Map, MapCtx, Target};

/// One target as a reactor sees it: everything the hot path reads, together.
pub(crate) struct TargetIo {
    pub begin: u64,
    pub len: u64,
    pub max_io_len: u64,
    pub end_io: EndIoWhen,
    /// How the fast path maps a bio to this target.
    fast: FastMap,
    /// `target`'s address, resolved once: calling through it skips the
    /// Arc's data-offset arithmetic on every map.
    target_ptr: *const dyn Target,
    /// Owns what `target_ptr` points at.
    _target: Arc<dyn Target>,
    /// Channels to the target's devices, in [`Target::devices`] order.
    pub chans: Box<[Rc<dyn Channel>]>,
    /// Per device, its channel's address, resolved once (as `target_ptr`).
    devs: Box<[*const dyn Channel]>,
}

/// Power-of-two striping, as the fast path computes it (dm's
/// `stripe_map_sector` with shifts and masks).
#[derive(Clone, Copy)]
struct Stripes {
    /// log2 of the chunk, in sectors.
    cs: u32,
    /// log2 of the number of stripes.
    ss: u32,
    /// Number of stripes minus one.
    smask: u64,
    /// Chunk size minus one.
    cmask: u64,
    /// `!cmask`, kept rather than computed on every bio.
    rmask: u64,
    /// Where every stripe's area starts on its device: one offset, not one
    /// per stripe, so that the remapped sector does not wait for a load
    /// that waits for the stripe's index (at QD1 that chain is the I/O's
    /// latency: 2% of a 512-byte read from RAM).
    start: u64,
}

impl Stripes {
    /// The stripe (device index) target-relative sector `rel` lies on.
    #[inline(always)]
    fn dev(self, rel: u64) -> usize {
        ((rel >> self.cs) & self.smask) as usize
    }

    /// Where `rel` lies on its stripe's area: `rel`'s bits are
    /// `row | stripe | offset in chunk`, and dropping the stripe's leaves
    /// `row * chunk + offset` (dm's `stripe_map_sector`).
    #[inline(always)]
    fn dev_sector(self, rel: u64) -> u64 {
        ((rel >> self.ss) & self.rmask) | (rel & self.cmask)
    }
}

/// How the fast path maps a bio to a target: the cheaper the better.
#[derive(Clone, Copy)]
enum FastMap {
    /// A pure offset remap ([`Target::remap_offset`]): what to add to the
    /// target-relative sector, and device 0's channel. No call to the
    /// target. (Added to the relative sector, which the range check left in
    /// a register, not to the bio's: the device's sector is then ready a
    /// load earlier, and at QD1 the device waits for it.)
    Offset(u64, *const dyn Channel),
    /// [`Target::stripe_shifts`], every stripe at the same offset on its
    /// device (as in most striped tables): the geometry; the stripes'
    /// channels are the target's `devs`. No call to the target.
    Stripes(Stripes),
    /// A call to the target: [`Target::map_sector`] (true), which returns
    /// the device and sector, or [`Target::map`] (false), whose result is
    /// dispatched. (Three variants, not four: the match over them is
    /// compares, which put linear's case first, not a jump table.)
    Call(bool),
}

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
    /// Any other table: with `fast`, find the target and map by its
    /// [`FastMap`]; without (suspended, switched off, or a target did not
    /// opt in), the slow path. (Three variants, not four: the match over
    /// them is compares, not a jump table.)
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
#[derive(Clone, Copy)]
struct Window {
    /// The TableIo the plan was made from (the frame's private).
    tio: *const TableIo,
    begin: u64,
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
        let rel = bio.sector.wrapping_sub(self.begin);
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

impl TargetIo {
    /// The target.
    #[inline]
    pub fn target(&self) -> &dyn Target {
        // SAFETY: `target_ptr` is `Arc::as_ptr(&self._target)`, which this
        // struct owns and never replaces.
        unsafe { &*self.target_ptr }
    }

    /// Sectors from `rel` (target-relative) to the next split boundary.
    #[inline]
    pub fn room(&self, rel: u64) -> u64 {
        match self.room_pow2(rel) {
            Some(r) => r,
            None => (self.len - rel).min(self.max_io_len - rel % self.max_io_len),
        }
    }

    /// [`TargetIo::room`] when it takes no division (no max_io_len, or a
    /// power of two); `None` otherwise.
    #[inline]
    fn room_pow2(&self, rel: u64) -> Option<u64> {
        let to_end = self.len - rel;
        let m = self.max_io_len;
        if m == 0 {
            Some(to_end)
        } else if m.is_power_of_two() {
            Some(to_end.min(m - (rel & (m - 1))))
        } else {
            None
        }
    }
}

/// One reactor's view of one table: channels to each target's devices.
pub(crate) struct TableIo {
    pub table: Arc<Table>,
    pub targets: Box<[TargetIo]>,
    /// One channel per distinct device of the table (flush fan-out).
    pub flush_chans: Vec<Rc<dyn Channel>>,
    /// Logical block size in sectors, minus one: alignment mask.
    lbs_mask: u64,
    /// The fast path's completion, by the most any target wants its
    /// end_io (most tables: never, and completion skips the lookup;
    /// striped: only on error).
    endio: EndIo,
    /// Bios (parents, not clones) mapped through this table and not completed.
    pub inflight: Cell<u64>,
    /// The owning channel's state (for retries from completion context).
    pub state: Rc<ChanState>,
}

impl TableIo {
    pub fn open(
        table: Arc<Table>,
        reactor: &Reactor,
        state: Rc<ChanState>,
    ) -> Result<TableIo, Error> {
        let flush_chans = table
            .devices
            .iter()
            .map(|d: &Arc<dyn BlockDevice>| d.clone().open(reactor))
            .collect::<Result<Vec<_>, _>>()?;
        let targets = table
            .targets
            .iter()
            .map(|t| {
                let chans: Box<[Rc<dyn Channel>]> = t
                    .dev_index
                    .iter()
                    .map(|&i| flush_chans[i].clone())
                    .collect();
                TargetIo {
                    begin: t.begin,
                    len: t.len,
                    max_io_len: t.max_io_len,
                    end_io: t.end_io,
                    fast: match (t.remap_offset, t.fast_stripes) {
                        (Some(o), _) => FastMap::Offset(o, Rc::as_ptr(&chans[0])),
                        // Checked when the table was built (one device per
                        // stripe, whole rows, max_io_len the chunk, one
                        // start: see Table::build).
                        (None, Some((cs, ss, start))) => FastMap::Stripes(Stripes {
                            cs,
                            ss,
                            smask: (1 << ss) - 1,
                            cmask: (1 << cs) - 1,
                            rmask: !((1 << cs) - 1),
                            start,
                        }),
                        _ => FastMap::Call(t.sector_map),
                    },
                    devs: chans.iter().map(Rc::as_ptr).collect(),
                    target_ptr: Arc::as_ptr(&t.target),
                    _target: t.target.clone(),
                    chans,
                }
            })
            .collect();
        Ok(TableIo {
            endio: match table
                .targets
                .iter()
                .map(|t| t.end_io)
                .fold(EndIoWhen::Never, EndIoWhen::max)
            {
                EndIoWhen::Never => noclone_endio,
                EndIoWhen::OnError => noclone_endio_on_error,
                EndIoWhen::Always => noclone_endio_always,
            },
            lbs_mask: (table.limits.logical_block_size as u64 >> SECTOR_SHIFT) - 1,
            table,
            targets,
            flush_chans,
            inflight: Cell::new(0),
            state,
        })
    }

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
            begin: t.begin,
            len: t.len,
            align: lbs as u64 - 1,
            max_bytes: l.max_io_bytes,
            max_segs: l.max_segments,
        };
        // And the remapped sector must stay aligned: the device's start is.
        let aligned = |start: u64| start & self.lbs_mask == 0;
        match t.fast {
            FastMap::Offset(start, ch) if t.max_io_len == 0 && aligned(start) => {
                Plan::Offset(OffsetPlan { w, start, ch })
            }
            // Table::build checked the window is the chunk, a multiple of
            // the block size.
            FastMap::Stripes(g) if aligned(g.start) => Plan::Stripes(StripesPlan {
                w,
                g,
                devs: t.devs.as_ptr(),
            }),
            _ => general,
        }
    }

    #[inline]
    pub fn get(&self) {
        self.inflight.set(self.inflight.get() + 1);
    }

    #[inline]
    pub fn put(&self) {
        self.inflight.set(self.inflight.get() - 1);
    }

    /// Dispatches what target `ti`'s map returned. The device index goes into
    /// the upper half of the bio's context word, for the target's end_io.
    /// Returns the bio when the target asked for a retry.
    #[inline]
    pub fn dispatch(&self, ti: usize, m: Map) -> Option<BioPtr> {
        match m {
            Map::Remapped(bio, d) => {
                self.targets[ti].submit_to(ti, bio, d);
                None
            }
            Map::Submitted => None,
            Map::Kill(bio, s) => {
                bio.complete(s);
                None
            }
            Map::Requeue(bio) => Some(bio),
        }
    }
}

/// Splits a bio's context word into (target index, device index).
#[inline]
pub(crate) fn ctx_target_dev(ctx: u64) -> (usize, usize) {
    ((ctx & 0xffff_ffff) as usize, (ctx >> 32) as usize)
}

/// State shared by a channel and its control messages.
pub(crate) struct ChanState {
    /// Whether the channel has slow work (retries, retired tables, a drain
    /// waiter), and so sits on the reactor's work queue; see [`ChanState::kick`].
    slow: Cell<bool>,
    /// The reactor's work queue, and the channel to queue on it.
    work: WorkQueue,
    me: RefCell<Weak<dyn Poller>>,
    suspended: Cell<bool>,
    fast_path: Cell<bool>,
    /// Bios that arrived while suspended; resubmitted on resume.
    pub deferred: RefCell<VecDeque<BioPtr>>,
    /// Bios a target asked to retry, as submitted to this channel.
    pub requeue: RefCell<VecDeque<BioPtr>>,
    /// Clones a target asked to retry (remapped through their parent's table).
    pub requeue_clones: RefCell<VecDeque<BioPtr>>,
    /// Tables replaced while they had I/O in flight, freed once idle.
    pub retired: RefCell<Vec<Rc<TableIo>>>,
    /// Held while a suspend waits for in-flight I/O to drain.
    pub drain: RefCell<Option<Guard>>,
}

impl ChanState {
    /// Notes slow work for the channel: it is polled on the reactor's next
    /// turns until none is left. Nothing on the hot path polls it.
    pub fn kick(&self) {
        if !self.slow.replace(true) {
            if let Some(me) = self.me.borrow().upgrade() {
                self.work.queue(me);
            }
        }
    }
}

/// A mapped device's channel on one reactor.
pub struct MapperChannel {
    /// What new bios take: the current table's plan ([`TableIo::plan`])
    /// when not suspended and the fast path is on, else the slow path.
    plan: Cell<Plan>,
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
        });
        let tio = Rc::new(TableIo::open(table, reactor, state.clone())?);
        let ch = MapperChannel {
            plan: Cell::new(Plan::Other { fast: false }),
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
        self.plan.set(if !st.suspended.get() && st.fast_path.get() {
            self.tio().plan(self.cur.get())
        } else {
            Plan::Other { fast: false }
        });
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
    /// The no-clone fast path (see [`MapperChannel::map_in`]). Every call in
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
            Plan::Other { fast: true } => self.map_targets(bio),
            Plan::Other { fast: false } => self.submit_slow(bio),
        }
    }
}

impl MapperChannel {
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
                    return match t.fast {
                        FastMap::Offset(start, ch) => {
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

/// The fast path for a [`Target::map_sector`] target `t` (index `ti`).
#[inline(never)]
fn map_sector(t: &TargetIo, ti: usize, mut bio: BioPtr) {
    let (d, sector) = t.target().map_sector(bio.sector);
    bio.sector = sector;
    t.submit_to(ti, bio, d)
}

impl TargetIo {
    /// Submits a bio this target remapped to its device `d`.
    #[inline]
    pub(crate) fn submit_to(&self, ti: usize, mut bio: BioPtr, d: usize) {
        match self.devs.get(d) {
            Some(&ch) => {
                if d != 0 {
                    bio.set_ctx(ti as u64 | (d as u64) << 32);
                }
                // SAFETY: `devs[d]` is `Rc::as_ptr(&self.chans[d])`, and
                // `chans` is owned by this struct and never changed.
                unsafe { (*ch).submit(bio) }
            }
            None => bad_device(bio),
        }
    }
}

/// A target remapped to a device it does not have: a target bug, failed
/// rather than trusted.
#[cold]
fn bad_device(bio: BioPtr) {
    bio.complete(Status::IoErr)
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

/// The TableIo a fast-path bio was mapped through.
///
/// # Safety
/// `bio` carries the fast path's frame: its private is that TableIo.
#[inline(always)]
unsafe fn mapped_tio<'a>(bio: &BioPtr) -> &'a TableIo {
    // SAFETY: per the caller, the fast path set private to the TableIo it
    // mapped through, which stays alive (as current or retired) while its
    // inflight count, which includes this bio, is non-zero.
    unsafe { &*(bio.private() as *const TableIo) }
}

/// The fast path's completion on a table whose targets want no end_io:
/// the caller's completion restored from the frame (sector included). One
/// of three, chosen per table ([`TableIo::endio`]), so that none tests
/// what the table wants.
fn noclone_endio(mut bio: BioPtr) {
    // SAFETY: this end_io is only ever pushed by `map_in`, with the
    // TableIo as private.
    let tio = unsafe { mapped_tio(&bio) };
    bio.pop_end_io();
    tio.put();
    bio.endio();
}

/// [`noclone_endio`] when a target of the table wants its end_io on error
/// (striped counts errors per device).
fn noclone_endio_on_error(bio: BioPtr) {
    // SAFETY: as in noclone_endio.
    let tio = unsafe { mapped_tio(&bio) };
    if !bio.status().is_ok() {
        return target_end_io(tio, bio);
    }
    noclone_endio(bio)
}

/// [`noclone_endio`] when a target of the table wants its end_io always.
fn noclone_endio_always(bio: BioPtr) {
    // SAFETY: as in noclone_endio.
    target_end_io(unsafe { mapped_tio(&bio) }, bio)
}

/// The fast path's completion when a target of the table may want its
/// end_io: runs the mapping target's, if it wants one for this outcome,
/// then completes. Out of line: most bios never need it, and the
/// `noclone_endio`s stay frameless.
#[inline(never)]
fn target_end_io(tio: &TableIo, mut bio: BioPtr) {
    let (ti, mut dev) = ctx_target_dev(bio.ctx());
    let t = &tio.targets[ti];
    if let (FastMap::Stripes(g), Some(s)) = (t.fast, bio.pushed_sector()) {
        // The fast path did not store it (see map_in).
        dev = g.dev(s.wrapping_sub(t.begin));
    }
    if t.end_io.applies(bio.status().is_ok()) {
        t.target().end_io(&mut bio, dev);
    }
    bio.pop_end_io();
    tio.put();
    bio.endio();
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
