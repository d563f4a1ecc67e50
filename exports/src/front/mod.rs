//! The export front: what every export (NBD, and the next ones) calls to
//! turn a protocol request into bios on a device's channel.
//!
//! ```text
//!  export ──Request──▶ Front::submit ─┬─ aligned: split at max_io_bytes ──▶ bios
//!                                     ├─ sub-block read: bounce, copy out
//!                                     └─ sub-block write: read the edge blocks,
//!                                        patch, write back (read-modify-write)
//!  export ◀──Done {token, result}── end_io (+ a flush after, for FUA the
//!                                    device cannot do itself)
//! ```
//!
//! - Requests are split into bios of at most the device's `max_io_bytes`,
//!   one segment each.
//! - FUA is passed down where the device honours it; elsewhere a write
//!   with FUA is followed by a flush, and completes when the flush does.
//! - Offsets and lengths need not be multiples of the logical block size:
//!   a sub-block read goes through a bounce buffer; a sub-block write (or
//!   write-zeroes) reads the blocks it covers in part, patches them and
//!   writes them back. While one does, no other write to those blocks
//!   passes it: writes overlapping a read-modify-write wait for it, and it
//!   waits for the writes it overlaps, in arrival order. The aligned path
//!   pays one check of a counter for this. The ordering holds among the
//!   requests of one front (one reactor's); writes to one block through
//!   two reactors are ordered by their clients, as for any two writers.
//! - A discard is advisory: a sub-block one shrinks to the whole blocks it
//!   covers.
//! - Errors reach the export as [`FrontError`], which it maps to its wire codes.
//! - Dispatch ([`Dispatch`], seed 004): *direct* (the default) turns each
//!   request into bios as it arrives. *Queued* holds the aligned reads and
//!   writes of one batch until [`Front::unplug`] (the kernel's plug and
//!   `blk_finish_plug`), sorts them by offset and merges adjacent ones of
//!   the same op and flags into one bio of several segments, up to the
//!   device's `max_io_bytes` and `max_segments`; the merged bio's
//!   completion, error included, goes to each request in it. *Stream*
//!   holds a request only while the next one continues it (the kernel's
//!   plug merge, which looks at the last request only): a request that
//!   does not sends the run held before it, unsorted. Requests that need
//!   more (sub-block, larger than one bio, dataless, or held back by a
//!   read-modify-write) go as in direct mode. *Auto*, on a device that
//!   merging does not help, holds as stream does only a request that
//!   continues the one before while others are in flight; any other goes
//!   as in direct mode, at direct's cost. On a device that merging helps
//!   it is queued or direct, as its trial ([`AutoTrial`]) measures: the
//!   batch's end reads the clock, and past an epoch's end the trial may
//!   change the mode, after what was held has gone. An export calls
//!   `unplug` at the end of each batch it receives (one receive, one
//!   virtqueue kick); in direct mode it finds nothing held and returns.
//! - Bounce buffers are charged to the process's in-flight budget when
//!   the export gives one ([`Front::set_budget`]), as a connection's
//!   buffers are: a sub-block request that cannot get its bounce waits, in
//!   arrival order, until another's bounce is given back. The first bounce
//!   a front holds is always granted, so it makes progress. At most
//!   [`KEEP_BOUNCES`] buffers of up to [`KEEP_BOUNCE`] each are kept for
//!   reuse, outside the budget.
//! - An export may send an aligned read of one bio straight to the device
//!   with its own end_io ([`Front::read_direct`], vhost-user-blk's reads):
//!   nothing is ordered against a read, so it needs no slot, and the
//!   front only checks it and makes its bio.
//! - Steady state allocates nothing: request slots, bounce buffers and the
//!   plug list are recycled.

mod order;
mod plug;
mod report;

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use slab::Slab;
pub use udm_core::Dispatch;
use udm_core::{
    AlignedBuf, AutoTrial, BioFlags, BioPtr, BlockDevice, Caps, Channel, Op, Reactor, Status,
    SECTOR_SHIFT,
};

use crate::limits::Budget;
use plug::Plugged;
pub use report::{AutoCounts, AutoReport};

/// What a protocol request asks of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontOp {
    /// Read into the request's buffer.
    Read,
    /// Write the request's buffer.
    Write,
    /// Make completed writes durable.
    Flush,
    /// The range's data is no longer needed (advisory).
    Discard,
    /// Zero the range.
    WriteZeroes,
}

/// Flags of a protocol request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReqFlags {
    /// The write is durable when it completes.
    pub fua: bool,
    /// Write-zeroes must not unmap (NBD's NO_HOLE). Devices here zero by
    /// writing or by their own means; none punches holes for it.
    pub no_hole: bool,
    /// Write-zeroes must fail rather than be slow (NBD's FAST_ZERO).
    pub fast_zero: bool,
    /// A read may be served from memory the device lends (see
    /// [`BioFlags::MAY_LEND`]); [`Done::lent`] then holds the data.
    pub may_lend: bool,
}

/// Why a request failed, in terms every export can map to its wire codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontError {
    /// The device failed the I/O.
    Io,
    /// The request is malformed for the device (range, alignment, size).
    Invalid,
    /// No space left on the device.
    NoSpace,
    /// Out of memory.
    NoMemory,
    /// A fast write-zeroes could not be done fast.
    NotFast,
    /// The device does not support the operation.
    NotSupported,
}

impl FrontError {
    /// The error a bio's failure `st` gives a request with `flags`.
    pub fn from_status(st: Status, flags: ReqFlags) -> FrontError {
        match st {
            Status::NotSupp if flags.fast_zero => FrontError::NotFast,
            Status::NotSupp => FrontError::NotSupported,
            Status::Inval => FrontError::Invalid,
            Status::NoSpace => FrontError::NoSpace,
            Status::NoMem => FrontError::NoMemory,
            Status::Ok | Status::IoErr | Status::Again => FrontError::Io,
        }
    }
}

impl fmt::Display for FrontError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FrontError::Io => "I/O error",
            FrontError::Invalid => "invalid request",
            FrontError::NoSpace => "no space left",
            FrontError::NoMemory => "out of memory",
            FrontError::NotFast => "cannot zero fast",
            FrontError::NotSupported => "not supported",
        })
    }
}

/// A finished request, as handed to its [`DoneFn`].
pub struct Done<'a> {
    /// The request's token.
    pub token: u64,
    /// How it ended.
    pub result: Result<(), FrontError>,
    /// For a read with [`ReqFlags::may_lend`]: the data, in memory the
    /// device lent (None: the data is in the request's buffer). Valid until
    /// the reactor's pass over completions ends, no longer: a [`DoneFn`]
    /// that keeps a pointer to it past its return lets go of it in a hook
    /// of [`udm_core::Reactor::at_pass_end`].
    pub lent: Option<&'a [u8]>,
}

/// Called once per request submitted that [`Front::submit`] did not finish
/// at once, on the reactor's thread, from a bio's end_io: `ctx` and the
/// [`Done`] are the request's.
pub type DoneFn = fn(ctx: *mut (), done: Done<'_>);

/// A protocol request, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// What to do.
    pub op: FrontOp,
    /// Byte offset on the device.
    pub offset: u64,
    /// Byte length.
    pub len: u32,
    /// Flags.
    pub flags: ReqFlags,
    /// For reads and writes: `len` bytes of data (any alignment).
    pub buf: *mut u8,
    /// The registered buffer (see [`udm_core::Reactor::register_buffer`])
    /// that holds all of `buf`, or [`udm_core::Bio::NO_BUF`]: the bios
    /// that carry `buf` itself (not a bounce) name it.
    pub buf_index: u16,
    /// Handed back in [`Done::token`].
    pub token: u64,
    /// Called when the request is finished.
    pub done: DoneFn,
    /// Handed back to `done`.
    pub ctx: *mut (),
}

/// How a request goes on from [`Front::submit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// In flight: its [`DoneFn`] will be called.
    Later,
    /// Finished already (nothing to do, or refused): its [`DoneFn`] will
    /// not be called.
    Now(Result<(), FrontError>),
}

/// Bounce buffers up to this size are kept for reuse.
pub const KEEP_BOUNCE: usize = 256 << 10;
/// Bounce buffers kept for reuse, per front (1 MiB at most).
pub const KEEP_BOUNCES: usize = 4;
/// The largest range a sub-block request may cover (its bounce buffer).
pub const MAX_BOUNCE: u64 = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Bios straight from (or into) the request's buffer, or dataless.
    Direct,
    /// A sub-block read: the covering blocks into the bounce buffer.
    BounceRead,
    /// A sub-block write: the edge blocks into the bounce buffer.
    RmwRead,
    /// A sub-block write: the patched blocks out of the bounce buffer.
    RmwWrite,
    /// The flush after a write whose FUA the device cannot do.
    PostFlush,
}

/// One request in flight.
struct Slot {
    req: Request,
    phase: Phase,
    /// The byte range of whole blocks the request covers.
    lo: u64,
    hi: u64,
    /// It changes data in [lo, hi).
    writer: bool,
    /// It is a read-modify-write (ordered against every writer).
    rmw: bool,
    /// Submitted (false: waiting for an overlapping write).
    active: bool,
    pending: u32,
    status: Status,
    bounce: AlignedBuf,
    /// A sub-block request whose bounce buffer is not granted yet.
    needs_bounce: bool,
    /// The next request in the same merged bio ([`NO_SLOT`]: none).
    next: usize,
}

/// No slot: the end of a merged bio's chain.
const NO_SLOT: usize = usize::MAX;

/// The front of one device on one reactor. See the module docs.
pub struct Front {
    reactor: *const Reactor,
    chan: Rc<dyn Channel>,
    lbs: u32,
    /// lbs - 1 when lbs is a power of 2 (alignment by a mask), else 0.
    lbs_mask: u64,
    max_bio: u32,
    /// The device's size in bytes (grows: [`Front::grow`]).
    size: Cell<u64>,
    /// Where the reads [`Front::read_direct`] admits pass the device's
    /// own check too (its size when the front was made; a device does not
    /// shrink), so they go down unchecked; 0 where the front's tests do
    /// not imply the device's (see [`Front::new`]).
    checked_end: u64,
    fua_native: bool,
    flush_after_fua: bool,
    slots: RefCell<Slab<Slot>>,
    bounces: RefCell<Vec<AlignedBuf>>,
    /// Where bounce buffers are charged (unset: nowhere).
    budget: OnceCell<Arc<Budget>>,
    /// Bytes of bounce buffers the slots hold, charged to `budget`.
    bounce_held: Cell<u64>,
    /// Read-modify-writes in the slots (active or waiting): while 0, an
    /// aligned write has nothing to be ordered against.
    rmws: Cell<usize>,
    /// Slots waiting for an overlapping write, in arrival order.
    waiting: RefCell<VecDeque<usize>>,
    /// Direct, queued or stream: in the last two, aligned reads and writes
    /// are held in `plug` until [`Front::unplug`].
    mode: Cell<Dispatch>,
    /// Stream and auto dispatch: where the last aligned request ended; in
    /// auto dispatch [`plug::STREAMING`] while a sequential run is held.
    next_off: Cell<u64>,
    /// The device reports that merging helps it ([`Caps::MERGE`]).
    merge_helps: bool,
    /// Auto dispatch on a device that merging helps: the trial of queued
    /// against direct, whose mode `mode` holds ([`Front::unplug`] feeds it).
    trial: Cell<Option<AutoTrial>>,
    /// Where the trial's mode and epochs are reported (unset: nowhere).
    report: OnceCell<Arc<AutoReport>>,
    /// Requests taken so far (what the trial counts per epoch: in a
    /// closed loop, as many as complete).
    taken: Cell<u64>,
    /// Most segments in one bio (the device's `max_segments`).
    max_segs: usize,
    plug: RefCell<Vec<Plugged>>,
}

impl Front {
    /// The front of `dev`, whose channel on `reactor` is `chan`.
    ///
    /// # Safety
    /// `reactor` must outlive the front, which is used on its thread only.
    pub unsafe fn new(
        reactor: &Reactor,
        dev: &dyn BlockDevice,
        chan: Rc<dyn Channel>,
    ) -> Rc<Front> {
        let l = dev.limits();
        let caps = dev.caps();
        let lbs = l.logical_block_size.max(512);
        Rc::new(Front {
            reactor,
            chan,
            lbs,
            lbs_mask: if lbs.is_power_of_two() {
                u64::from(lbs) - 1
            } else {
                0
            },
            max_bio: (l.max_io_bytes.min(1 << 30) / lbs * lbs).max(lbs),
            size: Cell::new(l.bytes()),
            // A read aligned to a power-of-2 block size of at least a
            // sector, of at most max_bio <= max_io_bytes bytes in one
            // segment, ending by the device's end, passes `Limits::check`;
            // every device supports reads, read-only or not.
            checked_end: if l.logical_block_size.is_power_of_two()
                && l.logical_block_size >= 512
                && (l.max_io_bytes.min(1 << 30) / lbs * lbs).max(lbs) <= l.max_io_bytes
                && l.max_segments >= 1
            {
                l.bytes()
            } else {
                0
            },
            fua_native: caps.contains(Caps::FUA),
            flush_after_fua: caps.contains(Caps::FLUSH),
            slots: RefCell::new(Slab::new()),
            bounces: RefCell::new(Vec::new()),
            budget: OnceCell::new(),
            bounce_held: Cell::new(0),
            rmws: Cell::new(0),
            waiting: RefCell::new(VecDeque::new()),
            mode: Cell::new(Dispatch::Direct),
            next_off: Cell::new(plug::NOWHERE),
            merge_helps: caps.contains(Caps::MERGE),
            trial: Cell::new(None),
            report: OnceCell::new(),
            taken: Cell::new(0),
            max_segs: l.max_segments.max(1) as usize,
            plug: RefCell::new(Vec::new()),
        })
    }

    /// Sets how requests go to the device (direct until set): `Auto`, where
    /// the device reports that merging helps it, queues or goes direct as
    /// its trial measures ([`AutoTrial`], starting queued), and chooses per
    /// request elsewhere (see [`Front::dispatch`]). Requests held go at
    /// once when the mode changes.
    pub fn set_dispatch(&self, mode: Dispatch) {
        if self.trial.take().is_some() {
            self.reported(Some(self.mode.get()), None);
        }
        self.unplug();
        let mode = match mode {
            Dispatch::Auto if self.merge_helps => {
                let t = AutoTrial::new(Instant::now(), self.taken.get());
                self.trial.set(Some(t));
                self.reported(None, Some(t.mode()));
                t.mode()
            }
            m => m,
        };
        self.set_mode(mode);
    }

    /// Reports the trial of auto dispatch to `report` from now on: the
    /// mode it runs and the epochs it ran (once; later calls are ignored).
    pub fn set_report(&self, report: Arc<AutoReport>) {
        if self.report.set(report).is_ok() && self.trial.get().is_some() {
            self.reported(None, Some(self.mode.get()));
        }
    }

    /// The trial left mode `was` for `mode` (None: no trial).
    fn reported(&self, was: Option<Dispatch>, mode: Option<Dispatch>) {
        if let Some(r) = self.report.get() {
            r.moved(was, mode);
        }
    }

    fn set_mode(&self, mode: Dispatch) {
        self.unplug();
        self.next_off.set(plug::NOWHERE);
        self.mode.set(mode);
    }

    /// At a batch's end (`now`), weighing queued against direct: ends the
    /// trial's epoch if it has run its time, and takes the mode it chose.
    #[cold]
    fn weigh(&self, now: Instant) {
        let Some(mut t) = self.trial.get() else {
            return;
        };
        if now < t.end() {
            return;
        }
        let (q0, d0) = t.epochs();
        let mode = t.end_epoch_at(now, self.taken.get());
        self.trial.set(Some(t));
        if let Some(r) = self.report.get() {
            let (q, d) = t.epochs();
            r.ran(q - q0, d - d0);
        }
        let was = self.mode.get();
        if mode != was {
            self.reported(Some(was), Some(mode));
            self.set_mode(mode);
        }
    }

    /// Auto dispatch weighing queued against direct: the epochs that ran
    /// queued and direct so far (None in any other dispatch).
    pub fn auto_epochs(&self) -> Option<(u64, u64)> {
        self.trial.get().map(|t| t.epochs())
    }

    /// Charges bounce buffers to `budget` from now on (once; later calls
    /// are ignored).
    pub fn set_budget(&self, budget: Arc<Budget>) {
        let _ = self.budget.set(budget);
    }

    /// Bytes of bounce buffers the front's requests hold now.
    pub fn bounce_bytes(&self) -> u64 {
        self.bounce_held.get()
    }

    /// The dispatch in use: `Direct`, `Queued`, `Stream`, or `Auto` on a
    /// device that merging does not help: an aligned read or write that
    /// continues the one before while other requests of the front are in
    /// flight is held as in stream mode; a lone one, or one that does not
    /// continue, goes on direct's path (a test and a store more than
    /// direct), sending first what is held. Auto on a device that merging
    /// helps is `Queued` or `Direct`, as its trial chose for the epoch
    /// ([`Front::auto_epochs`]).
    pub fn dispatch(&self) -> Dispatch {
        self.mode.get()
    }

    /// The device grew to `bytes`: requests up to there are taken from now
    /// on (a smaller size is ignored: a device does not shrink under its
    /// exports).
    pub fn grow(&self, bytes: u64) {
        if bytes > self.size.get() {
            self.size.set(bytes);
        }
    }

    /// The device's logical block size: requests aligned to it take the
    /// direct path.
    pub fn block_size(&self) -> u32 {
        self.lbs
    }

    /// The largest bio the front sends (the device's `max_io_bytes`, in
    /// whole blocks).
    pub fn max_bio(&self) -> u32 {
        self.max_bio
    }

    /// Requests in flight (waiting ones included).
    pub fn in_flight(&self) -> usize {
        self.slots.borrow().len()
    }

    fn reactor(&self) -> &Reactor {
        // SAFETY: `new`'s contract: the reactor outlives the front.
        unsafe { &*self.reactor }
    }

    /// Starts `req`. A zero-length request, or a sub-block discard that
    /// covers no whole block, finishes at once, as does one outside the
    /// device.
    ///
    /// # Safety
    /// For a read or write, `req.buf` must hold `req.len` bytes, and they
    /// must stay valid and untouched by the caller until the request is
    /// finished (its [`DoneFn`] is called).
    pub unsafe fn submit(self: &Rc<Self>, req: Request) -> Submitted {
        self.taken.set(self.taken.get().wrapping_add(1));
        if req.op == FrontOp::Flush {
            let idx = self.insert(req, 0, 0, false, false);
            self.start_flush(idx);
            return Submitted::Later;
        }
        if req.len == 0 {
            return Submitted::Now(Ok(()));
        }
        let end = req.offset.checked_add(req.len as u64);
        if end.is_none_or(|e| e > self.size.get()) {
            return Submitted::Now(Err(FrontError::Invalid));
        }
        let end = req.offset + req.len as u64;
        let b = self.lbs as u64;
        let aligned = if self.lbs_mask != 0 {
            (req.offset | end) & self.lbs_mask == 0
        } else {
            req.offset.is_multiple_of(b) && end.is_multiple_of(b)
        };
        let writer = req.op != FrontOp::Read;
        if aligned {
            if writer && self.rmws.get() > 0 {
                let idx = self.insert(req, req.offset, end, writer, false);
                if self.must_wait(idx) {
                    self.wait(idx);
                } else if self.mode.get() == Dispatch::Direct || !self.hold(idx, req) {
                    self.start(idx);
                }
                return Submitted::Later;
            }
            let op = match req.op {
                FrontOp::Read => Op::Read,
                FrontOp::Write => Op::Write,
                _ => {
                    let idx = self.insert(req, req.offset, end, writer, false);
                    if self.mode.get() == Dispatch::Direct || !self.hold(idx, req) {
                        self.start(idx);
                    }
                    return Submitted::Later;
                }
            };
            // An aligned read or write with nothing to be ordered against:
            // its slot made active, its bios counted, at once (what
            // `start` and `split` would read back from it). A request
            // `hold` keeps sets its own count.
            let n = if req.len <= self.max_bio {
                1
            } else {
                req.len.div_ceil(self.max_bio)
            };
            let idx = self.insert_active(req, end, writer, n);
            if self.mode.get() == Dispatch::Direct || !self.hold(idx, req) {
                let mut flags = self.write_flags(req);
                if req.flags.may_lend && op == Op::Read && req.len <= self.max_bio {
                    flags.insert(BioFlags::MAY_LEND);
                }
                self.send_bios(idx, op, req.offset, req.len, req.buf, flags, req.buf_index);
            }
            return Submitted::Later;
        }
        let (lo, hi) = (req.offset / b * b, end.div_ceil(b) * b);
        match req.op {
            FrontOp::Discard => {
                let (lo, hi) = (req.offset.div_ceil(b) * b, end / b * b);
                if lo >= hi {
                    return Submitted::Now(Ok(()));
                }
                let idx = self.insert(req, lo, hi, true, false);
                if self.rmws.get() > 0 && self.must_wait(idx) {
                    self.wait(idx);
                } else {
                    self.start(idx);
                }
                return Submitted::Later;
            }
            FrontOp::WriteZeroes if req.flags.fast_zero => {
                return Submitted::Now(Err(FrontError::NotFast));
            }
            _ => {}
        }
        if hi - lo > MAX_BOUNCE {
            return Submitted::Now(Err(FrontError::Invalid));
        }
        let idx = self.insert(req, lo, hi, writer, writer);
        self.with_slot(idx, |s| s.needs_bounce = true);
        if writer {
            self.rmws.set(self.rmws.get() + 1);
        }
        // A write waiting for another takes no bounce while it waits.
        if writer && self.must_wait(idx) || !self.grab_bounce(idx) {
            self.wait(idx);
            return Submitted::Later;
        }
        self.start(idx);
        Submitted::Later
    }

    /// Sends an aligned read of at most one bio straight to the device
    /// and returns true: the bio (its status the read's, its `ctx` and
    /// its `private` the caller's) ends in `end_io`, and the front keeps no
    /// slot for it. Nothing here is ordered against a read (a
    /// read-modify-write waits for writes only), so a slot would only be
    /// written and read back. False when the read needs the front
    /// ([`Front::submit`]): sub-block, larger than one bio, outside the
    /// device, a block size not a power of 2, or a read that queued or
    /// stream dispatch would hold, or auto would (one that starts where
    /// the last ended or follows a held run, or while requests are held).
    /// The reads it sends
    /// are not among the requests in flight that auto's hold counts: a
    /// run of reads that continue one another is held from its second
    /// follower on.
    ///
    /// # Safety
    /// As [`Front::submit`]'s for a read of `len` bytes into `buf`;
    /// `private` must be what `end_io` expects, and stay so until it is
    /// called.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub unsafe fn read_direct(
        &self,
        offset: u64,
        len: u32,
        buf: *mut u8,
        buf_index: u16,
        end_io: udm_core::EndIo,
        private: *mut (),
        ctx: u64,
    ) -> bool {
        let end = offset.wrapping_add(u64::from(len));
        if len == 0
            || len > self.max_bio
            || self.lbs_mask == 0
            || (offset | end) & self.lbs_mask != 0
            || end < offset
            || end > self.size.get()
        {
            return false;
        }
        match self.mode.get() {
            Dispatch::Direct => {}
            Dispatch::Auto => {
                // As `hold`: a read that continues the last, or follows a
                // held run (a stream's jump), goes by `submit` to be held.
                let last = self.next_off.get();
                if last == offset || last == plug::STREAMING || !self.plug.borrow().is_empty() {
                    return false;
                }
                self.next_off.set(end);
            }
            _ => return false,
        }
        self.taken.set(self.taken.get().wrapping_add(1));
        let mut bio = self.reactor().alloc_bio();
        bio.op = Op::Read;
        bio.sector = offset >> SECTOR_SHIFT;
        // SAFETY: the caller's: `len` writable bytes at `buf`, untouched
        // until `end_io` is called.
        unsafe { bio.add_seg(buf, len as usize) };
        bio.buf_index = buf_index;
        bio.flags = BioFlags::NONE;
        bio.set_ctx(ctx);
        bio.set_end_io(end_io, private);
        if end <= self.checked_end {
            // SAFETY: the tests above and `checked_end`'s (Front::new)
            // are `check_bio`'s for this one-segment read.
            unsafe { self.chan.submit_nocheck(bio) };
        } else {
            self.chan.submit(bio);
        }
        true
    }

    /// Gives slot `idx` its bounce buffer if the budget grants it (or it
    /// is the only one the front would hold); false: it must wait.
    fn grab_bounce(&self, idx: usize) -> bool {
        let len = self.with_slot(idx, |s| s.hi - s.lo);
        let held = self.bounce_held.get();
        if let Some(b) = self.budget.get() {
            if !b.take(held, len) {
                if held > 0 {
                    return false;
                }
                b.force(held, len);
            }
        }
        self.bounce_held.set(held + len);
        let mut buf = self.bounces.borrow_mut().pop().unwrap_or_default();
        buf.resize(len as usize);
        self.with_slot(idx, |s| {
            s.bounce = buf;
            s.needs_bounce = false;
        });
        true
    }

    /// Takes a slot for `req` (and a reference to the front, given back
    /// when the request finishes, so the front outlives its bios).
    fn insert(self: &Rc<Self>, req: Request, lo: u64, hi: u64, writer: bool, rmw: bool) -> usize {
        std::mem::forget(self.clone());
        self.slots.borrow_mut().insert(Slot {
            req,
            phase: Phase::Direct,
            lo,
            hi,
            writer,
            rmw,
            active: false,
            pending: 0,
            status: Status::Ok,
            bounce: AlignedBuf::default(),
            needs_bounce: false,
            next: NO_SLOT,
        })
    }

    /// [`Front::insert`] for an aligned request that starts now: active,
    /// with `pending` bios.
    #[inline]
    fn insert_active(self: &Rc<Self>, req: Request, hi: u64, writer: bool, pending: u32) -> usize {
        std::mem::forget(self.clone());
        self.slots.borrow_mut().insert(Slot {
            req,
            phase: Phase::Direct,
            lo: req.offset,
            hi,
            writer,
            rmw: false,
            active: true,
            pending,
            status: Status::Ok,
            bounce: AlignedBuf::default(),
            needs_bounce: false,
            next: NO_SLOT,
        })
    }

    fn with_slot<T>(&self, idx: usize, f: impl FnOnce(&mut Slot) -> T) -> T {
        let mut slots = self.slots.borrow_mut();
        f(&mut slots[idx])
    }

    fn wait(&self, idx: usize) {
        self.waiting.borrow_mut().push_back(idx);
    }

    /// Submits a request that may go (its first phase).
    fn start(&self, idx: usize) {
        let (req, lo, hi, rmw) = self.with_slot(idx, |s| {
            s.active = true;
            (s.req, s.lo, s.hi, s.rmw)
        });
        let b = self.lbs as u64;
        let end = req.offset + req.len as u64;
        if rmw {
            // Only the blocks the write covers in part are read.
            let head = !req.offset.is_multiple_of(b);
            // The tail block, unless it is the head block already read.
            let tail = !(end.is_multiple_of(b) || head && hi - lo == b);
            let base = self.with_slot(idx, |s| {
                s.phase = Phase::RmwRead;
                s.pending = head as u32 + tail as u32;
                s.bounce.as_mut_ptr()
            });
            if head {
                self.submit_bios(idx, Op::Read, lo, self.lbs, base, BioFlags::NONE);
            }
            if tail {
                // SAFETY: hi - b - lo < hi - lo, the bounce's length.
                let p = unsafe { base.add((hi - b - lo) as usize) };
                self.submit_bios(idx, Op::Read, hi - b, self.lbs, p, BioFlags::NONE);
            }
            return;
        }
        let (op, buf) = match req.op {
            FrontOp::Read if lo != req.offset || hi != end => {
                let base = self.with_slot(idx, |s| {
                    s.phase = Phase::BounceRead;
                    s.bounce.as_mut_ptr()
                });
                self.split(idx, Op::Read, lo, (hi - lo) as u32, base, BioFlags::NONE);
                return;
            }
            FrontOp::Read => (Op::Read, req.buf),
            FrontOp::Write => (Op::Write, req.buf),
            FrontOp::Discard => (Op::Discard, std::ptr::null_mut()),
            FrontOp::WriteZeroes => (Op::WriteZeroes, std::ptr::null_mut()),
            FrontOp::Flush => return self.start_flush(idx),
        };
        let mut flags = self.write_flags(req);
        if req.flags.may_lend && op == Op::Read && hi - lo <= self.max_bio as u64 {
            flags.insert(BioFlags::MAY_LEND);
        }
        self.split(idx, op, lo, (hi - lo) as u32, buf, flags);
    }

    /// The flags every bio of a write-like `req` carries.
    fn write_flags(&self, req: Request) -> BioFlags {
        let mut f = BioFlags::NONE;
        if req.op == FrontOp::Read {
            return f;
        }
        if req.flags.fua && self.fua_native {
            f.insert(BioFlags::FUA);
        }
        if req.flags.fast_zero {
            f.insert(BioFlags::NOUNMAP_FAST);
        }
        f
    }

    fn start_flush(&self, idx: usize) {
        self.with_slot(idx, |s| {
            s.active = true;
            s.pending = 1;
        });
        let mut bio = self.reactor().alloc_bio();
        bio.set_dataless(Op::Flush, 0, 0);
        self.send(idx, bio);
    }

    /// Submits [off, off+len) as bios of at most max_bio bytes, counting
    /// them all as pending first (a device may complete one inline).
    fn split(&self, idx: usize, op: Op, off: u64, len: u32, buf: *mut u8, flags: BioFlags) {
        let n = len.div_ceil(self.max_bio);
        self.with_slot(idx, |s| s.pending = n);
        self.submit_bios(idx, op, off, len, buf, flags);
    }

    /// Submits the bios of one range (pending already counts them).
    fn submit_bios(&self, idx: usize, op: Op, off: u64, len: u32, buf: *mut u8, flags: BioFlags) {
        let buf_index = self.with_slot(idx, |s| {
            if buf == s.req.buf {
                s.req.buf_index
            } else {
                udm_core::Bio::NO_BUF
            }
        });
        self.send_bios(idx, op, off, len, buf, flags, buf_index);
    }

    /// [`Front::submit_bios`] with the registered buffer `buf` lies in
    /// (or [`udm_core::Bio::NO_BUF`]) known.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn send_bios(
        &self,
        idx: usize,
        op: Op,
        off: u64,
        len: u32,
        buf: *mut u8,
        flags: BioFlags,
        buf_index: u16,
    ) {
        let step = self.max_bio;
        let mut done = 0;
        while done < len {
            let n = step.min(len - done);
            let mut bio = self.reactor().alloc_bio();
            let sector = (off + done as u64) >> SECTOR_SHIFT;
            if op.has_data() {
                bio.op = op;
                bio.sector = sector;
                // SAFETY: [done, done + n) lies in the `len` bytes at `buf`:
                // the request's buffer (submit's contract) or the slot's
                // bounce buffer, which stays allocated until the slot is
                // freed, after every bio completed.
                unsafe { bio.add_seg(buf.add(done as usize), n as usize) };
                bio.buf_index = buf_index;
            } else {
                bio.set_dataless(op, sector, n);
            }
            bio.flags = flags;
            self.send(idx, bio);
            done += n;
        }
    }

    fn send(&self, idx: usize, mut bio: BioPtr) {
        bio.set_ctx(idx as u64);
        bio.set_end_io(front_end_io, (self as *const Front).cast_mut().cast());
        self.chan.submit(bio);
    }

    /// A bio of slot `idx` ended with `st`; `lent` is the data it lent.
    fn bio_done(&self, idx: usize, st: Status, lent: Option<&[u8]>) {
        let (phase, status, fua_write) = {
            let mut slots = self.slots.borrow_mut();
            let s = &mut slots[idx];
            if !st.is_ok() && s.status.is_ok() {
                s.status = st;
            }
            s.pending -= 1;
            if s.pending > 0 {
                return;
            }
            let fua_write = s.req.flags.fua && s.req.op != FrontOp::Read;
            // The common end, at once: bios straight from the request's
            // buffer, no flush to follow, nothing that waiting requests
            // wait for (a write-like one lets them go: `finish`).
            if s.phase == Phase::Direct
                && !(fua_write && !self.fua_native && self.flush_after_fua && s.status.is_ok())
                && !s.rmw
                && s.bounce.is_empty()
                && (!s.writer || self.waiting.borrow().is_empty())
            {
                let (req, status) = (s.req, s.status);
                slots.remove(idx);
                drop(slots);
                return self.finish_plain(req, status, lent);
            }
            (s.phase, s.status, fua_write)
        };
        let ok = status.is_ok();
        let post_flush = ok && fua_write && !self.fua_native && self.flush_after_fua;
        match phase {
            Phase::RmwRead if ok => return self.rmw_write(idx),
            Phase::BounceRead if ok => self.with_slot(idx, |s| {
                let req = s.req;
                let at = (req.offset - s.lo) as usize;
                // SAFETY: the bounce holds [lo, hi) ⊇ the request's range,
                // whose buffer holds len bytes (submit's contract); the two
                // are distinct allocations.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.bounce.as_ptr().add(at),
                        req.buf,
                        req.len as usize,
                    )
                };
            }),
            Phase::Direct | Phase::RmwWrite if post_flush => {
                self.with_slot(idx, |s| s.phase = Phase::PostFlush);
                return self.start_flush(idx);
            }
            _ => {}
        }
        self.finish(idx, lent);
    }

    /// A read-modify-write's edge blocks are in: patch and write back.
    fn rmw_write(&self, idx: usize) {
        let (req, lo, hi, base) = self.with_slot(idx, |s| {
            s.phase = Phase::RmwWrite;
            let at = (s.req.offset - s.lo) as usize;
            let len = s.req.len as usize;
            let dst = &mut s.bounce.as_mut_slice()[at..at + len];
            if s.req.op == FrontOp::Write {
                // SAFETY: the request's buffer holds len bytes (submit's
                // contract), distinct from the bounce buffer.
                dst.copy_from_slice(unsafe { std::slice::from_raw_parts(s.req.buf, len) });
            } else {
                dst.fill(0);
            }
            (s.req, s.lo, s.hi, s.bounce.as_mut_ptr())
        });
        let mut flags = self.write_flags(req);
        flags.remove(BioFlags::NOUNMAP_FAST);
        self.split(idx, Op::Write, lo, (hi - lo) as u32, base, flags);
    }

    /// Hands the result of `req`, whose slot is freed already, to the
    /// export ([`Front::finish`] for a request that held no bounce buffer
    /// and no waiting request back).
    #[inline]
    fn finish_plain(&self, req: Request, status: Status, lent: Option<&[u8]>) {
        let result = if status.is_ok() {
            Ok(())
        } else {
            Err(FrontError::from_status(status, req.flags))
        };
        let lent = lent.filter(|l| l.as_ptr() != req.buf.cast_const());
        (req.done)(
            req.ctx,
            Done {
                token: req.token,
                result,
                lent,
            },
        );
        // SAFETY: the reference `insert` took for this request; the caller's
        // own (`front_end_io` holds none) keeps the front alive if others
        // remain, and nothing touches `self` after this.
        unsafe { Rc::decrement_strong_count(self as *const Front) };
    }

    /// Frees the slot, hands the result to the export, and lets waiting
    /// writes go that this one held back.
    fn finish(&self, idx: usize, lent: Option<&[u8]>) {
        let s = self.slots.borrow_mut().remove(idx);
        let result = if s.status.is_ok() {
            Ok(())
        } else {
            Err(FrontError::from_status(s.status, s.req.flags))
        };
        if s.rmw {
            self.rmws.set(self.rmws.get() - 1);
        }
        let bounced = s.hi - s.lo;
        let had_bounce = !s.bounce.is_empty();
        if had_bounce {
            let held = self.bounce_held.get();
            if let Some(b) = self.budget.get() {
                b.give(held, bounced);
            }
            self.bounce_held.set(held - bounced);
            if s.bounce.len() <= KEEP_BOUNCE {
                let mut pool = self.bounces.borrow_mut();
                if pool.len() < KEEP_BOUNCES {
                    pool.push(s.bounce);
                }
            }
        }
        if (s.writer || had_bounce) && !self.waiting.borrow().is_empty() {
            self.release_waiters();
        }
        let lent = lent.filter(|l| l.as_ptr() != s.req.buf.cast_const());
        (s.req.done)(
            s.req.ctx,
            Done {
                token: s.req.token,
                result,
                lent,
            },
        );
        // SAFETY: the reference `insert` took for this request; the caller's
        // own (`front_end_io` holds none) keeps the front alive if others
        // remain, and nothing touches `self` after this.
        unsafe { Rc::decrement_strong_count(self as *const Front) };
    }
}

/// The end_io of every bio a front sends: private is the front, ctx the slot.
fn front_end_io(bio: BioPtr) {
    // SAFETY: private is the front that sent the bio, kept alive by the
    // reference its request holds until `finish`.
    let front = unsafe { &*(bio.private() as *const Front) };
    let idx = bio.ctx() as usize;
    let st = bio.status();
    let lent_seg = match bio.segs().first() {
        Some(s) if bio.flags.contains(BioFlags::LENT) => Some((s.base, s.len)),
        _ => None,
    };
    drop(bio);
    // SAFETY: lent memory stays valid until this end_io's pass over
    // completions ends (BioFlags::MAY_LEND's contract); the slice does not
    // leave this call (Done::lent says how long a pointer into it may live).
    let lent = lent_seg.map(|(p, n)| unsafe { std::slice::from_raw_parts(p.cast_const(), n) });
    front.bio_done(idx, st, lent);
}

impl Drop for Front {
    /// A front that goes (its connection closed, its queue stopped) no
    /// longer counts in its export's report.
    fn drop(&mut self) {
        if self.trial.get().is_some() {
            self.reported(Some(self.mode.get()), None);
        }
    }
}

#[cfg(test)]
mod tests;
