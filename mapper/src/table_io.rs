//! One reactor's view of one table ([`TableIo`]): per target, everything
//! the hot path reads (its range, how the fast path maps it, channels to
//! its devices), the fast path's completions, and the state a channel
//! shares with its tables and control messages ([`ChanState`]).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

use udm_core::{
    BioPtr, BlockDevice, Channel, EndIo, Error, Poller, Reactor, Status, WorkQueue, SECTOR_SHIFT,
};

use crate::stats::Shard;
use crate::table::Table;
use crate::target::{EndIoWhen, Map, Target};
use crate::targets::thin::Vol;
use crate::waiter::Guard;

/// One target as a reactor sees it: everything the hot path reads, together.
pub(crate) struct TargetIo {
    pub begin: u64,
    pub len: u64,
    /// The fast path's window: the target's max_io_len, except 0 for a
    /// gated target (its windows matter only while its gate is clear, and
    /// then `map_gate_clear` checks them).
    pub max_io_len: u64,
    /// The target's max_io_len, where the slow path splits.
    pub split_len: u64,
    pub end_io: EndIoWhen,
    /// How the fast path maps a bio to this target.
    pub fast: FastMap,
    /// `target`'s address, resolved once: calling through it skips the
    /// Arc's data-offset arithmetic on every map.
    pub target_ptr: *const dyn Target,
    /// Owns what `target_ptr` points at.
    _target: Arc<dyn Target>,
    /// Channels to the target's devices, in [`Target::devices`] order.
    pub chans: Box<[Rc<dyn Channel>]>,
    /// Per device, its channel's address, resolved once (as `target_ptr`).
    pub devs: Box<[*const dyn Channel]>,
}

/// Power-of-two striping, as the fast path computes it (dm's
/// `stripe_map_sector` with shifts and masks).
#[derive(Clone, Copy)]
pub(crate) struct Stripes {
    /// log2 of the chunk, in sectors.
    pub cs: u32,
    /// log2 of the number of stripes.
    pub ss: u32,
    /// Number of stripes minus one.
    pub smask: u64,
    /// Chunk size minus one.
    pub cmask: u64,
    /// `!cmask`, kept rather than computed on every bio.
    pub rmask: u64,
    /// Where every stripe's area starts on its device: one offset, not one
    /// per stripe, so that the remapped sector does not wait for a load
    /// that waits for the stripe's index (at QD1 that chain is the I/O's
    /// latency: 2% of a 512-byte read from RAM).
    pub start: u64,
}

impl Stripes {
    /// The stripe (device index) target-relative sector `rel` lies on.
    #[inline(always)]
    pub fn dev(self, rel: u64) -> usize {
        ((rel >> self.cs) & self.smask) as usize
    }

    /// Where `rel` lies on its stripe's area: `rel`'s bits are
    /// `row | stripe | offset in chunk`, and dropping the stripe's leaves
    /// `row * chunk + offset` (dm's `stripe_map_sector`).
    #[inline(always)]
    pub fn dev_sector(self, rel: u64) -> u64 {
        ((rel >> self.ss) & self.rmask) | (rel & self.cmask)
    }
}

/// How the fast path maps a bio to a target: the cheaper the better.
#[derive(Clone, Copy)]
pub(crate) enum FastMap {
    /// A pure offset remap ([`Target::remap_offset`]): what to add to the
    /// target-relative sector, device 0's channel, and the target's
    /// [`Target::remap_gate`] (null for none): while the gate is clear the
    /// target's `map` runs instead. No call to the target otherwise. (Added to the relative sector, which the range check left in
    /// a register, not to the bio's: the device's sector is then ready a
    /// load earlier, and at QD1 the device waits for it.)
    Offset(u64, *const dyn Channel, *const AtomicBool),
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

    /// Sectors from `rel` to the next place the slow path splits: the
    /// target's end or its next max_io_len boundary.
    pub fn split_room(&self, rel: u64) -> u64 {
        let to_end = self.len - rel;
        match self.split_len {
            0 => to_end,
            m => to_end.min(m - rel % m),
        }
    }

    /// [`TargetIo::room`] when it takes no division (no max_io_len, or a
    /// power of two); `None` otherwise.
    #[inline]
    pub fn room_pow2(&self, rel: u64) -> Option<u64> {
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
    pub lbs_mask: u64,
    /// The fast path's completion, by the most any target wants its
    /// end_io (most tables: never, and completion skips the lookup;
    /// striped: only on error).
    pub endio: EndIo,
    /// Bios (parents, not clones) mapped through this table and not completed.
    pub inflight: Cell<u64>,
    /// The owning channel's state (for retries from completion context).
    pub state: Rc<ChanState>,
    /// This reactor's statistics for the device (as `state`'s).
    pub stats: Arc<Shard>,
    /// The reactor it is open on ([`Target::reactor_close`] gets it).
    reactor_id: usize,
    /// This reactor's in-flight counters ([`Vol::counts`]) in the cache
    /// of a one-target table's [`Target::block_map`], when they take plain
    /// updates: the block-mapped plan exists only then.
    pub block_counts: Option<*const [AtomicU64; 2]>,
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
                    max_io_len: if t.target.remap_gate().is_some() && t.remap_offset.is_some() {
                        0
                    } else {
                        t.max_io_len
                    },
                    split_len: t.max_io_len,
                    end_io: t.end_io,
                    fast: match (t.remap_offset, t.fast_stripes) {
                        (Some(o), _) => FastMap::Offset(
                            o,
                            Rc::as_ptr(&chans[0]),
                            t.target
                                .remap_gate()
                                .map_or(std::ptr::null(), |g| g as *const AtomicBool),
                        ),
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
        // Every channel opened: from here on the table is open on this
        // reactor, and closed (Drop) exactly once.
        for t in &table.targets {
            t.target.reactor_open(reactor);
        }
        // On this reactor's thread: its counters.
        let block_counts = match &table.targets[..] {
            // SAFETY: the target owns the cache and lives as long as this.
            [t] => t
                .target
                .block_map()
                .and_then(|b| unsafe { &*b.vol }.counts().map(|c| c as *const _)),
            _ => None,
        };
        Ok(TableIo {
            reactor_id: reactor.id(),
            block_counts,
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
            stats: state.stats.clone(),
            state,
        })
    }

    #[inline]
    pub fn get(&self) {
        self.inflight.set(self.inflight.get() + 1);
    }

    #[inline]
    pub fn put(&self) {
        self.inflight.set(self.inflight.get() - 1);
    }

    /// A bio mapped through this table completes: counted in the
    /// statistics, and out of `inflight`.
    #[inline(always)]
    pub fn done(&self, bio: &BioPtr) {
        self.stats.complete(bio.op, bio.len(), bio.status());
        self.put();
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

impl Drop for TableIo {
    /// The table is closed on this reactor: its last bio here completed
    /// (or none ran) and nothing maps through it any more.
    fn drop(&mut self) {
        for t in &self.table.targets {
            t.target.reactor_close(self.reactor_id);
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
    pub slow: Cell<bool>,
    /// The reactor's work queue, and the channel to queue on it.
    pub work: WorkQueue,
    pub me: RefCell<Weak<dyn Poller>>,
    pub suspended: Cell<bool>,
    pub fast_path: Cell<bool>,
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
    /// This reactor's statistics for the device.
    pub stats: Arc<Shard>,
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
    tio.done(&bio);
    bio.endio();
}

/// The completion of a bio the block-mapped plan remapped: out of its
/// epoch's count (the target's end_io for it), then as [`noclone_endio`].
pub(crate) fn block_map_endio(mut bio: BioPtr) {
    // SAFETY: pushed only by the block-mapped plan, with the TableIo as
    // private.
    let tio = unsafe { mapped_tio(&bio) };
    // That plan exists only where the TableIo has this reactor's counters
    // (a bio completes on the reactor that submitted it).
    if let Some(c) = tio.block_counts {
        // SAFETY: the table's target owns the cache they are in.
        Vol::exit_on(unsafe { &*c }, bio.ctx() as usize);
    }
    bio.pop_end_io();
    tio.done(&bio);
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
    tio.done(&bio);
    bio.endio();
}
