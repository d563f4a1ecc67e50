//! raid1's I/O path: the array as a device, and its channel on each
//! reactor.
//!
//! As writecache's engine, the mirror is an internal block device that the
//! target remaps onto: its `open` gives the mirror a channel on every
//! reactor, holding that reactor's channels to the legs and what it parks.
//!
//! - A write (or discard, write-zeroes) enters its regions (see
//!   `Shared::enter`), then goes to every live leg: the caller's bio itself,
//!   remapped in place, to the first, and a clone pointing into its buffers
//!   to each other; the caller's bio completes when all have. A leg
//!   that fails is marked failed, and the bio waits for the superblock that
//!   says so before it completes, without an error as long as a leg took
//!   the write.
//!   With two legs, each region has a home leg (the legs take alternate
//!   regions): the caller's bio goes there, and the clone to the other leg
//!   is flagged `DONTCACHE` (it will not be read soon; the RAM disk then
//!   stores it past the caches).
//! - A read with two legs to choose from goes to its region's home leg,
//!   unless that leg has `HOME_MARGIN` more reads outstanding on this
//!   reactor than the other; otherwise to the readable leg with the fewest
//!   reads outstanding on this reactor (write-mostly legs only when no
//!   other can serve; the resync's source while its region may differ
//!   between legs). It is the
//!   caller's bio itself, remapped; on an error it is retried on the next
//!   leg and the worker rewrites the region on the leg that failed.
//! - A flush goes to every live leg.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_core::{
    check_bio, Bio, BioFlags, BioPtr, BlockDevice, Caps, Channel, Error, Limits, Op, Reactor,
    Status,
};

use super::state::{test, Counts, Shared};
use super::MAX_LEGS;

static NEXT_KEY: AtomicU64 = AtomicU64::new(0x7261_0000_0000);

/// The mirror as a block device (see the module docs).
pub(crate) struct RaidDev {
    name: String,
    pub shared: Arc<Shared>,
    key: u64,
}

impl RaidDev {
    pub fn new(shared: Arc<Shared>) -> RaidDev {
        let names: Vec<&str> = shared.cfg.legs.iter().map(|l| l.data.name()).collect();
        RaidDev {
            name: format!("raid1({})", names.join(",")),
            shared,
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
        }
    }
}

/// Capabilities every leg offers, as the mirror offers them.
pub(crate) fn stacked_caps(sh: &Shared) -> Caps {
    let mut caps = Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES | Caps::PERSISTENT;
    let mut ro = false;
    for l in &sh.cfg.legs {
        let c = l.data.caps();
        for k in [
            Caps::FLUSH,
            Caps::FUA,
            Caps::DISCARD,
            Caps::WRITE_ZEROES,
            Caps::PERSISTENT,
        ] {
            if !c.contains(k) {
                caps.remove(k);
            }
        }
        ro |= c.contains(Caps::READ_ONLY);
    }
    if ro {
        caps.insert(Caps::READ_ONLY);
    }
    caps
}

impl BlockDevice for RaidDev {
    fn name(&self) -> &str {
        &self.name
    }

    fn limits(&self) -> Limits {
        let mut l = Limits::new(self.shared.cfg.len);
        for leg in &self.shared.cfg.legs {
            l.stack(&leg.data.limits());
        }
        l.sectors = self.shared.cfg.len;
        l
    }

    fn caps(&self) -> Caps {
        stacked_caps(&self.shared)
    }

    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        if let Some(ch) = reactor
            .local(self.key)
            .and_then(|c| c.downcast::<RaidChannel>().ok())
        {
            return Ok(ch);
        }
        let mut legs = Vec::new();
        for l in &self.shared.cfg.legs {
            legs.push(l.data.clone().open(reactor)?);
        }
        // Every entry a leg's channel (the ones past the last leg are never
        // used), so that an index masked to MAX_LEGS needs no bounds check.
        let leg_ch = std::array::from_fn(|i| Rc::as_ptr(&legs[i.min(legs.len() - 1)]));
        let (limits, caps) = (self.limits(), self.caps());
        // A bio that passes the mirror's check passes every leg's (see
        // `RaidChannel::nocheck`): the mirror's limits stack the legs',
        // its capabilities are those every leg has, and it is read-only
        // if any leg is. Its block size is the largest of the legs', so
        // it is a multiple of each where each is a power of two.
        let nocheck = self.shared.cfg.legs.iter().all(|l| {
            let lbs = l.data.limits().logical_block_size;
            lbs != 0 && limits.logical_block_size.is_multiple_of(lbs)
        });
        let ch = Rc::new(RaidChannel {
            sh: self.shared.clone(),
            legs,
            leg_ch,
            limits,
            caps,
            nocheck,
            outstanding: std::array::from_fn(|_| Cell::new(0)),
            rr: Cell::new(0),
            flip: Cell::new(false),
            writers: self.shared.new_counts(),
            parked: RefCell::new(Vec::new()),
            sb_wait: RefCell::new(Vec::new()),
        });
        reactor.set_local(self.key, ch.clone());
        let mut chans = self.shared.chans.lock().unwrap_or_else(|p| p.into_inner());
        chans.retain(|(h, _)| !h.is_closed());
        chans.push((reactor.handle(), self.key));
        drop(chans);
        // A channel opens when the table is live on a reactor: the worker
        // may start writing metadata and resyncing.
        super::activate(&self.shared);
        Ok(ch)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The mirror's channel on one reactor.
pub(crate) struct RaidChannel {
    sh: Arc<Shared>,
    legs: Vec<Rc<dyn Channel>>,
    /// `legs` as the pointers the I/O path calls through (one load each,
    /// not the `Rc`'s two and its offset).
    leg_ch: [*const dyn Channel; MAX_LEGS],
    /// The mirror's limits and capabilities, which `submit` checks a bio
    /// against.
    limits: Limits,
    caps: Caps,
    /// Whether a bio that passes the mirror's check goes to the legs
    /// without theirs ([`Channel::submit_nocheck`]): the mirror keeps a
    /// bio's sectors, and every leg is at least as long as the mirror.
    nocheck: bool,
    /// Reads outstanding per leg on this reactor.
    outstanding: [Cell<u32>; MAX_LEGS],
    /// Where the next read's search for the least busy leg starts.
    rr: Cell<usize>,
    /// The same when two legs may serve (which of the two next).
    flip: Cell<bool>,
    /// This reactor's writes in flight per region.
    writers: Counts,
    /// Writes waiting for a region's mark or the resync barrier.
    parked: RefCell<Vec<BioPtr>>,
    /// Writes that saw a leg fail, waiting for the superblock generation
    /// that records it.
    sb_wait: RefCell<Vec<(u64, BioPtr)>>,
}

/// Context bits of a caller's bio while its clones are out: the legs that
/// failed (low bits), and whether any leg succeeded.
const SOME_OK: u64 = 1 << 63;

impl Channel for RaidChannel {
    /// Checks `bio` against the mirror, so that a bio no leg would take
    /// fails here, without failing a leg.
    fn submit(&self, bio: BioPtr) {
        if let Some(bio) = check_bio(bio, &self.limits, self.caps) {
            // SAFETY: just checked.
            unsafe { self.submit_nocheck(bio) }
        }
    }

    /// The mapper's fast path checked `bio` against the table, whose
    /// limits stack the mirror's.
    #[inline]
    unsafe fn submit_nocheck(&self, bio: BioPtr) {
        if bio.op == Op::Read {
            return self.read(bio);
        }
        self.submit_other(bio)
    }
}

impl RaidChannel {
    /// Anything but a read (out of line: the read path stays lean).
    #[inline(never)]
    fn submit_other(&self, bio: BioPtr) {
        match bio.op {
            Op::Write | Op::Discard | Op::WriteZeroes => self.write(bio),
            _ => self.fan_out(bio),
        }
    }

    /// Retries parked writes; completes those whose superblock is written.
    pub fn kick(&self) {
        let parked: Vec<BioPtr> = std::mem::take(&mut *self.parked.borrow_mut());
        for bio in parked {
            self.write(bio);
        }
        let done = self.sh.lock().sb_done;
        let ready: Vec<(u64, BioPtr)> = {
            let mut w = self.sb_wait.borrow_mut();
            if w.is_empty() {
                return;
            }
            let (ready, wait) = std::mem::take(&mut *w)
                .into_iter()
                .partition(|(g, _)| *g <= done);
            *w = wait;
            ready
        };
        let dead = self.sh.meta_dead.load(Ordering::Acquire);
        for (_, mut bio) in ready {
            let s = if dead { Status::IoErr } else { bio.status() };
            bio.pop_end_io();
            bio.complete(s);
        }
    }

    /// Leg `i`'s count of reads outstanding.
    #[inline(always)]
    fn out(&self, i: usize) -> &Cell<u32> {
        &self.outstanding[i & (MAX_LEGS - 1)]
    }

    /// Sends `bio`, which passed the mirror's check, to leg `i`.
    #[inline(always)]
    fn to_leg(&self, i: usize, bio: BioPtr) {
        let ch = self.leg_ch[i & (MAX_LEGS - 1)];
        if self.nocheck {
            // SAFETY: `ch` is `legs[i]`'s, which this channel holds; the
            // bio passed the mirror's check, which implies the leg's (see
            // `nocheck`); the mirror does not move it (a clone has its
            // parent's sector and segments).
            unsafe { (*ch).submit_nocheck(bio) }
        } else {
            // SAFETY: as above, `ch` is alive.
            unsafe { (*ch).submit(bio) }
        }
    }

    fn pick(&self, tried: u64, source_only: bool) -> Option<usize> {
        let r = self.sh.readable() & !tried;
        if r == 0 {
            return None;
        }
        if source_only {
            if let Some(s) = self.sh.source() {
                if r & (1 << s) != 0 {
                    return Some(s);
                }
            }
        }
        let normal = r & !self.sh.cfg.write_mostly;
        let m = if normal != 0 { normal } else { r };
        let a = m.trailing_zeros() as usize;
        let rest = m & (m - 1);
        if rest == 0 {
            return Some(a);
        }
        if rest & (rest - 1) == 0 {
            // Two legs to choose from (the common case), without the loop.
            let b = rest.trailing_zeros() as usize;
            let (oa, ob) = (self.out(a).get(), self.out(b).get());
            if oa != ob {
                return Some(if oa < ob { a } else { b });
            }
            let t = self.flip.get();
            self.flip.set(!t);
            return Some(if t { b } else { a });
        }
        // Least outstanding; ties go round-robin, so that a queue depth of
        // one still reads every leg.
        let n = self.legs.len();
        let start = self.rr.get();
        self.rr.set(if start + 1 >= n { 0 } else { start + 1 });
        let mut best = None;
        let mut least = u32::MAX;
        for k in 0..n {
            let i = if start + k >= n {
                start + k - n
            } else {
                start + k
            };
            if m & (1 << i) == 0 {
                continue;
            }
            let o = self.out(i).get();
            if o < least {
                least = o;
                best = Some(i);
            }
        }
        best
    }

    /// A read: in the common case (see [`Shared::paths`]) the home leg of
    /// its region (see [`home_pair`]), which holds the cached copy of the
    /// region's recent writes, unless it has [`HOME_MARGIN`] reads more
    /// outstanding on this reactor than the other leg; without a look at
    /// the masks.
    #[inline(always)]
    fn read(&self, bio: BioPtr) {
        let p = self.sh.read_pair.load(Ordering::Acquire);
        if p == 0 || !bio.can_push() {
            return self.read_any(bio);
        }
        let (home, other) = home_pair(p, bio.sector >> self.sh.cfg.region_shift);
        let leg = if self.out(home).get() < self.out(other).get() + HOME_MARGIN {
            home
        } else {
            other
        };
        let me = self as *const RaidChannel as *mut ();
        let mut bio = bio;
        // Cannot fail: a frame is free.
        let _ = bio.push_end_io_ctx(read_done, me, leg as u64);
        self.out(leg).set(self.out(leg).get() + 1);
        self.to_leg(leg, bio);
    }

    /// A read in any state of the array.
    #[inline(never)]
    fn read_any(&self, bio: BioPtr) {
        let sh = &*self.sh;
        let mut source_only = false;
        if sh.any_unsynced.load(Ordering::Acquire) {
            let (r0, r1) = sh.regions(bio.sector, bio.sectors());
            source_only = (r0..=r1).any(|r| test(&sh.unsynced, r));
        }
        let Some(leg) = self.pick(0, source_only) else {
            return bio.complete(Status::IoErr);
        };
        let me = self as *const RaidChannel as *mut ();
        let mut bio = bio.make_room();
        if !bio.push_end_io_ctx(read_done, me, leg as u64) {
            return bio.complete(Status::NoMem);
        }
        self.out(leg).set(self.out(leg).get() + 1);
        self.to_leg(leg, bio);
    }

    /// A write (or discard, write-zeroes): in the common case (see
    /// [`Shared::paths`]) to two legs without a look at the masks.
    fn write(&self, bio: BioPtr) {
        let sh = &*self.sh;
        let p = sh.write_pair.load(Ordering::Acquire);
        if p == 0 {
            return self.write_any(bio);
        }
        let (r0, r1) = sh.regions(bio.sector, bio.sectors());
        if !sh.enter(&self.writers, r0, r1) {
            self.parked.borrow_mut().push(bio);
            return;
        }
        let (home, other) = home_pair(p, r0);
        self.fan_out_pair(bio, home, other);
    }

    /// A write in any state of the array.
    #[inline(never)]
    fn write_any(&self, bio: BioPtr) {
        let sh = &*self.sh;
        if sh.meta_dead.load(Ordering::Acquire) {
            return bio.complete(Status::IoErr);
        }
        let (r0, r1) = sh.regions(bio.sector, bio.sectors());
        if !sh.enter(&self.writers, r0, r1) {
            self.parked.borrow_mut().push(bio);
            return;
        }
        self.fan_out(bio);
    }

    /// Sends `bio` to every live leg (a write that entered its regions, or
    /// a flush): the bio itself, remapped in place, to the first, and a
    /// clone pointing into its buffers to each other. The first clone (the
    /// leader) counts the completions in its `per_io` (see [`L_PARENT`]),
    /// so that the fan-out allocates nothing but the clones.
    fn fan_out(&self, bio: BioPtr) {
        let live = self.sh.live();
        let me = self as *const RaidChannel as *mut ();
        let mut bio = bio.make_room();
        if live == 0 {
            self.exit(&bio);
            return bio.complete(Status::IoErr);
        }
        let first = live.trailing_zeros() as usize;
        let mut others = live & (live - 1);
        if others == 0 {
            // make_room left a free frame.
            let _ = bio.push_end_io_ctx(first_done, me, SOLO | first as u64);
            return self.to_leg(first, bio);
        }
        // Two legs (one clone) without a popcount.
        let n = if others & (others - 1) == 0 {
            1
        } else {
            others.count_ones() as u64
        };
        let mut leader: *mut Bio = std::ptr::null_mut();
        while others != 0 {
            let i = others.trailing_zeros() as usize;
            others &= others - 1;
            let mut c = leg_clone(&bio);
            if leader.is_null() {
                // Every completion to come: the clones' and the bio's own.
                c.per_io = [0, (n + 1) | (first as u64) << 32, 0, me as u64];
                c.set_end_io(leader_done, me);
                leader = &mut *c;
            } else {
                c.set_end_io(clone_done, leader.cast());
            }
            c.set_ctx(i as u64);
            self.to_leg(i, c);
        }
        // make_room left a free frame.
        let _ = bio.push_end_io_ctx(first_done, me, leader as u64);
        self.to_leg(first, bio);
    }

    /// [`RaidChannel::fan_out`] to two live legs, `a` (the region's home,
    /// which reads prefer) and `b`: the bio itself to `a`, and a clone (the
    /// leader) to `b`, flagged [`BioFlags::DONTCACHE`]: reads of the region
    /// go to `a` while it is not much busier, so `b`'s copy will not be
    /// read soon and need not take the caches.
    #[inline(always)]
    fn fan_out_pair(&self, bio: BioPtr, a: usize, b: usize) {
        let me = self as *const RaidChannel as *mut ();
        let mut bio = bio.make_room();
        let mut c = leg_clone(&bio);
        c.flags.insert(BioFlags::DONTCACHE);
        // Two completions: the clone's and the bio's own.
        c.per_io = [0, 2 | (a as u64) << 32, 0, me as u64];
        c.set_end_io(leader_done, me);
        c.set_ctx(b as u64);
        let leader: *mut Bio = &mut *c;
        self.to_leg(b, c);
        // make_room left a free frame.
        let _ = bio.push_end_io_ctx(first_done, me, leader as u64);
        self.to_leg(a, bio);
    }

    /// Counts `bio`'s regions out of this reactor's writers (a flush has
    /// none).
    #[inline(always)]
    fn exit(&self, bio: &Bio) {
        if bio.op != Op::Flush {
            let (r0, r1) = self.sh.regions(bio.sector, bio.sectors());
            self.sh.exit(&self.writers, r0, r1);
        }
    }

    /// Every leg is done with a fanned-out `bio` (our frame on top):
    /// `bits` says which legs failed and whether any succeeded.
    #[inline]
    fn done(&self, mut bio: BioPtr, bits: u64) {
        if bits == SOME_OK {
            // Every leg took it (the common case).
            self.exit(&bio);
            bio.pop_end_io();
            bio.set_status(Status::Ok);
            return bio.endio();
        }
        self.done_any(bio, bits)
    }

    /// [`RaidChannel::done`] when a leg failed.
    #[inline(never)]
    fn done_any(&self, mut bio: BioPtr, bits: u64) {
        let failed = bits & !SOME_OK;
        bio.set_status(if bits & SOME_OK != 0 {
            Status::Ok
        } else {
            Status::IoErr
        });
        self.exit(&bio);
        if failed != 0 {
            let gen = self.sh.fail_legs(failed);
            if bits & SOME_OK != 0 {
                // Acknowledged only once the superblock says which legs
                // hold this write (kick releases it).
                self.sb_wait.borrow_mut().push((gen, bio));
                return;
            }
        }
        let s = bio.status();
        bio.pop_end_io();
        bio.set_status(s);
        bio.endio();
    }
}

/// How many reads more than the other leg a region's home leg may have
/// outstanding on a reactor before a read goes to the other leg: enough
/// that a queue's reads of recent writes stay on the cached copy, few
/// enough that a slow or busy leg sheds its load.
const HOME_MARGIN: u32 = 8;

/// The two legs of `pair` (a [`Shared::read_pair`] or
/// [`Shared::write_pair`] word) as region `r`'s home leg, which its reads
/// prefer and its writes reach through the caches, and the other: the
/// legs take alternate regions, so that each serves half the reads.
#[inline(always)]
fn home_pair(pair: u64, r: u64) -> (usize, usize) {
    let (a, b) = ((pair & 0xff) as usize, ((pair >> 8) & 0xff) as usize);
    if r & 1 == 0 {
        (a, b)
    } else {
        (b, a)
    }
}

/// A clone of `bio` for another leg of a fan-out: the same sectors, and
/// the same data (the caller's buffer) or the same dataless operation.
#[inline(always)]
fn leg_clone(bio: &BioPtr) -> BioPtr {
    let mut c = bio.alloc_clone();
    if bio.op.has_data() {
        if let [seg] = bio.segs() {
            // SAFETY: the clone points into the caller's buffer, valid
            // until the caller's bio completes, which is after every clone
            // has (the leader's count).
            unsafe { c.add_seg(seg.base, seg.len) };
            c.buf_index = bio.buf_index;
        } else {
            c.add_segs_from(bio, 0, bio.len() as usize);
        }
        c.sector = bio.sector;
    } else {
        c.set_dataless(bio.op, bio.sector, bio.len());
    }
    c
}

/// A fan-out's count, in its leader clone's `per_io`: the caller's bio once
/// its own leg is done (null before), kept there until the last completion.
const L_PARENT: usize = 0;
/// Completions still to come (low 32 bits) and the caller's bio's leg (high).
const L_LEFT: usize = 1;
/// Legs that failed, and [`SOME_OK`] once one succeeded.
const L_BITS: usize = 2;
/// The channel (`*const RaidChannel`).
const L_CHAN: usize = 3;

/// The caller's bio's context when no clone is out (one live leg): this
/// flag and the leg.
const SOLO: u64 = 1 << 63;

/// Counts one completion of a fan-out whose leader is `leader`, on `leg`;
/// `parent` is the caller's bio when it is the one completing. On the last
/// completion, frees the leader and finishes the caller's bio.
///
/// # Safety
/// `leader` is a fan-out's leader clone, alive (in flight, or given up with
/// `into_raw` by `leader_done`) until its count drops to zero here, and
/// its `per_io` touched by nothing but this fan-out's completions (the
/// legs below never look at the `per_io` of a bio they did not allocate).
#[inline(always)]
unsafe fn count(leader: *mut Bio, leg: usize, ok: bool, parent: Option<BioPtr>) {
    // SAFETY: see the function's contract; the reactor runs one
    // completion at a time, so no other reference to the leader is in use.
    let l = unsafe { &mut (*leader).per_io };
    l[L_BITS] |= if ok { SOME_OK } else { 1 << leg };
    l[L_LEFT] -= 1;
    if l[L_LEFT] as u32 != 0 {
        if let Some(p) = parent {
            l[L_PARENT] = p.into_raw() as u64;
        }
        return;
    }
    // SAFETY: as above; this was the last completion.
    unsafe { finish(leader, parent) }
}

/// The last completion of a fan-out whose leader is `leader` (see
/// [`count`]): frees the leader and finishes the caller's bio.
///
/// # Safety
/// As [`count`]'s, and the leader's count is zero.
#[inline(never)]
unsafe fn finish(leader: *mut Bio, parent: Option<BioPtr>) {
    // SAFETY: see the function's contract.
    let l = unsafe { &mut (*leader).per_io };
    let ch = l[L_CHAN] as *const RaidChannel;
    let bits = l[L_BITS];
    let parent = match parent {
        Some(p) => p,
        // SAFETY: the caller's bio completed before (it is counted) and
        // was given up into L_PARENT, taken back only here, once.
        None => unsafe { BioPtr::from_raw(l[L_PARENT] as *mut Bio) },
    };
    // SAFETY: the leader completed before, or is completing (the caller
    // gave it up); nothing refers to it past this point.
    drop(unsafe { BioPtr::from_raw(leader) });
    // SAFETY: the channel pushed the caller's bio's frame and is kept
    // alive by its table while I/O is in flight.
    unsafe { &*ch }.done(parent, bits);
}

/// The caller's bio completed on its leg (the first live one).
fn first_done(bio: BioPtr) {
    let ctx = bio.ctx();
    let ok = bio.status().is_ok();
    if ctx & SOLO != 0 {
        // SAFETY: the private of the frame pushed in `fan_out` is the
        // RaidChannel, kept alive by its table while I/O is in flight.
        let ch = unsafe { &*(bio.private() as *const RaidChannel) };
        let leg = (ctx & 0xff) as usize;
        return ch.done(bio, if ok { SOME_OK } else { 1 << leg });
    }
    let leader = ctx as *mut Bio;
    // SAFETY: the leader's count includes this completion, so it is alive.
    let leg = (unsafe { (*leader).per_io[L_LEFT] } >> 32) as usize;
    // SAFETY: as above.
    unsafe { count(leader, leg, ok, Some(bio)) };
}

/// The leader clone completed on its leg: it stays allocated (given up)
/// while the fan-out's other completions come.
fn leader_done(c: BioPtr) {
    let (leg, ok) = (c.ctx() as usize, c.status().is_ok());
    let leader = c.into_raw();
    // SAFETY: the leader is alive (given up just above) and counts this
    // completion.
    unsafe { count(leader, leg, ok, None) };
}

/// Another clone completed on its leg.
fn clone_done(c: BioPtr) {
    let (leg, ok) = (c.ctx() as usize, c.status().is_ok());
    let leader = c.private() as *mut Bio;
    drop(c);
    // SAFETY: a clone's private is its leader, whose count includes this
    // completion, so it is alive.
    unsafe { count(leader, leg, ok, None) };
}

/// A read completed on a leg: done, or retried on another one.
fn read_done(mut bio: BioPtr) {
    // SAFETY: the private of the frame pushed in `read` is the RaidChannel,
    // kept alive by its table while I/O is in flight.
    let ch = unsafe { &*(bio.private() as *const RaidChannel) };
    let ctx = bio.ctx();
    let leg = (ctx & 0xff) as usize;
    ch.out(leg).set(ch.out(leg).get() - 1);
    // Read on the first leg tried, without an error: done.
    if ctx >> 8 == 0 && bio.status().is_ok() {
        bio.pop_end_io();
        return bio.endio();
    }
    read_retry(ch, bio, leg, (ctx >> 8) | (1 << leg));
}

/// A read that failed on a leg, or succeeded after failing on others: read
/// repair, or the next leg.
#[inline(never)]
fn read_retry(ch: &RaidChannel, mut bio: BioPtr, leg: usize, tried: u64) {
    let sh = &*ch.sh;
    if bio.status().is_ok() {
        let bad = tried & !(1 << leg);
        if bad != 0 {
            // Read repair: the worker rewrites the region on the legs
            // that failed, from a leg that reads.
            let sector = bio.pushed_sector().unwrap_or(bio.sector);
            let (r0, r1) = sh.regions(sector, bio.sectors());
            let mut st = sh.lock();
            for r in r0..=r1 {
                st.repairs.push((r, bad));
            }
            drop(st);
            sh.poke();
        }
        bio.pop_end_io();
        return bio.endio();
    }
    match ch.pick(tried, false) {
        Some(next) => {
            if let Some(s) = bio.pushed_sector() {
                bio.sector = s;
            }
            bio.set_status(Status::Ok);
            bio.set_ctx((tried << 8) | next as u64);
            ch.out(next).set(ch.out(next).get() + 1);
            ch.to_leg(next, bio);
        }
        None => {
            bio.pop_end_io();
            bio.endio();
        }
    }
}
