//! The cache engine as a device, and its channel on each reactor: submit,
//! parking on commits, issuing the sub-I/Os the map path decides, and
//! accounting their completion.
//!
//! The target itself only remaps onto [`WcDev`], an internal block device
//! that *is* the cache. Making the engine a device gives it what a target's
//! `map` lacks: a hook on every reactor (`open`), where it opens that
//! reactor's channels to the origin and the cache and registers itself so
//! that the worker can complete bios parked on that reactor (a FLUSH or FUA
//! waiting for a commit). The mapper needs no change: flushes fan out to
//! the table's devices, so they reach the engine; the no-clone fast path
//! hands it the caller's bio, and the engine's own bios point into the
//! caller's buffers (no copies on the data path).
//!
//! All shared state is behind one mutex (as the kernel's `wc_lock`), held
//! only to decide; bios are submitted after it is dropped.

use std::any::Any;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use udm_core::{Bio, BioPtr, BlockDevice, Caps, Channel, Error, Limits, Op, Reactor, Status};

use super::discard::Discarder;
use super::entry::St;
use super::map::{
    map_read, map_write, Sub, CTX_ODD, K_CACHE_NEW, K_CACHE_READ, K_CACHE_WRITE, K_ORIGIN,
};
use super::state::Shared;

static NEXT_KEY: AtomicU64 = AtomicU64::new(0x7763_0000_0000);

/// The engine as a block device (see the module docs).
pub(crate) struct WcDev {
    name: String,
    pub shared: Arc<Shared>,
    key: u64,
}

impl WcDev {
    pub fn new(shared: Arc<Shared>) -> WcDev {
        WcDev {
            name: format!(
                "writecache({},{})",
                shared.cfg.origin.name(),
                shared.cfg.cache.name()
            ),
            shared,
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl BlockDevice for WcDev {
    fn name(&self) -> &str {
        &self.name
    }

    fn limits(&self) -> Limits {
        let c = &self.shared.cfg;
        let mut l = Limits::new(c.len);
        l.stack(&c.origin.limits());
        l.stack(&c.cache.limits());
        // dm-writecache: the logical block size is the cache block size.
        l.logical_block_size = l.logical_block_size.max(c.block_size);
        l.physical_block_size = l.physical_block_size.max(c.block_size);
        l.sectors = c.len;
        l
    }

    fn caps(&self) -> Caps {
        let c = &self.shared.cfg;
        let mut caps = Caps::FLUSH | Caps::FUA;
        let (o, k) = (c.origin.caps(), c.cache.caps());
        if o.contains(Caps::DISCARD) {
            // Passed on to the origin, cached blocks of the range dropped.
            caps.insert(Caps::DISCARD);
        }
        if o.contains(Caps::PERSISTENT) && k.contains(Caps::PERSISTENT) {
            caps.insert(Caps::PERSISTENT);
        }
        if o.contains(Caps::READ_ONLY) || k.contains(Caps::READ_ONLY) {
            caps.insert(Caps::READ_ONLY);
        }
        caps
    }

    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        if let Some(ch) = reactor
            .local(self.key)
            .and_then(|c| c.downcast::<WcChannel>().ok())
        {
            return Ok(ch);
        }
        let c = &self.shared.cfg;
        let origin = c.origin.clone().open(reactor)?;
        let ch = Rc::new(WcChannel {
            shared: self.shared.clone(),
            discards: Discarder::new(self.shared.clone(), origin.clone()),
            origin,
            cache: c.cache.clone().open(reactor)?,
            parked: RefCell::new(Vec::new()),
            space_wait: RefCell::new(Vec::new()),
            read_wait: RefCell::new(Vec::new()),
            subs: RefCell::new(Vec::new()),
        });
        reactor.set_local(self.key, ch.clone());
        let mut chans = self.shared.chans.lock().unwrap_or_else(|p| p.into_inner());
        chans.retain(|(h, _)| !h.is_closed());
        chans.push((reactor.handle(), self.key));
        Ok(ch)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A parked bio: a FLUSH or a FUA write waiting for generation `gen` to
/// commit. `framed` says whether the engine pushed a frame on it.
struct Parked {
    gen: u64,
    bio: BioPtr,
    framed: bool,
}

/// The engine's channel on one reactor.
pub(crate) struct WcChannel {
    shared: Arc<Shared>,
    origin: Rc<dyn Channel>,
    cache: Rc<dyn Channel>,
    parked: RefCell<Vec<Parked>>,
    /// Writes waiting for free blocks (their context word says where to
    /// resume).
    space_wait: RefCell<Vec<BioPtr>>,
    /// Reads waiting for the first write of a block they overlap.
    read_wait: RefCell<Vec<BioPtr>>,
    /// Discards on this reactor (and those waiting to go on).
    discards: Discarder,
    /// Scratch list of sub-I/Os (reused: no allocation per bio).
    subs: RefCell<Vec<Sub>>,
}

impl Channel for WcChannel {
    fn submit(&self, mut bio: BioPtr) {
        // Cache blocks are reused for other sectors once a read releases
        // them, before its caller's end_io runs: never lend them. (The
        // mapper already removes the flag before a target's map.)
        bio.flags.remove(udm_core::BioFlags::MAY_LEND);
        match bio.op {
            Op::Flush => self.park_until_committed(bio, false, true),
            Op::Read | Op::Write => {
                let bs = self.shared.cfg.bs_sectors();
                if !bio.sector.is_multiple_of(bs)
                    || !bio.sectors().is_multiple_of(bs)
                    || bio.sectors() == 0
                {
                    return bio.complete(Status::Inval);
                }
                let me = self as *const WcChannel as *mut ();
                // Stacked deeper than a bio has frames: a stand-in carries it.
                let mut bio = bio.make_room();
                if !bio.push_end_io(parent_done, me) {
                    // make_room left a free frame.
                    return bio.complete(Status::NoMem);
                }
                bio.set_status(Status::Ok);
                bio.pending = 1;
                bio.set_ctx(0);
                self.map(bio);
            }
            Op::Discard => self.discards.discard(bio),
            _ => bio.complete(Status::NotSupp),
        }
    }
}

impl WcChannel {
    /// Parks `bio` until a commit covering everything acknowledged so far
    /// is durable (a FLUSH; a FUA write that completed) and asks the worker
    /// for that commit.
    fn park_until_committed(&self, bio: BioPtr, framed: bool, flush: bool) {
        let gen = {
            let mut st = self.shared.lock();
            if flush {
                st.stats.flushes += 1;
            }
            let g = st.pending_gen;
            st.commit_wanted = st.commit_wanted.max(g);
            g
        };
        self.park(Parked { gen, bio, framed });
        self.shared.poke();
    }

    fn park(&self, p: Parked) {
        self.parked.borrow_mut().push(p);
        // The commit may have completed between taking the generation and
        // parking: look again so the bio is not left waiting.
        self.kick();
    }

    /// Releases parked bios whose generation is committed, and retries
    /// writes that waited for space.
    pub fn kick(&self) {
        let (committed, error) = {
            let st = self.shared.lock();
            (st.committed, st.error)
        };
        let ready: Vec<Parked> = {
            let mut p = self.parked.borrow_mut();
            if p.is_empty() {
                Vec::new()
            } else {
                let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut *p)
                    .into_iter()
                    .partition(|x| x.gen <= committed || error != 0);
                *p = wait;
                ready
            }
        };
        for Parked {
            mut bio, framed, ..
        } in ready
        {
            let s = if error != 0 && bio.status().is_ok() {
                Status::IoErr
            } else {
                bio.status()
            };
            if framed {
                bio.pop_end_io();
            }
            bio.complete(s);
        }
        self.discards.kick();
        let reads: Vec<BioPtr> = std::mem::take(&mut *self.read_wait.borrow_mut());
        if !reads.is_empty() {
            self.shared.lock().read_waiters -= reads.len() as u64;
            for bio in reads {
                self.map(bio);
            }
        }
        let waiting: Vec<BioPtr> = std::mem::take(&mut *self.space_wait.borrow_mut());
        if !waiting.is_empty() {
            self.shared.lock().space_waiters -= waiting.len() as u64;
            for bio in waiting {
                // map fails them if the cache has failed meanwhile.
                self.map(bio);
            }
        }
    }

    /// Maps the caller's bio (from the block in its context word on) into
    /// sub-I/Os, under the lock, then issues them without it.
    fn map(&self, mut bio: BioPtr) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let ob0 = bio.sector / bs;
        let nblk = bio.sectors() / bs;
        let mut from = bio.ctx();
        let mut subs = self.subs.borrow_mut();
        subs.clear();
        let mut blocked = false;
        let mut read_held = false;
        let mut poke = false;
        {
            let mut st = sh.lock();
            if st.error != 0 {
                // A failed cache fails all I/O (as dm-writecache does).
                bio.set_status(Status::IoErr);
                from = nblk;
            } else if bio.op == Op::Read {
                if map_read(&mut st, ob0, nblk, &mut subs) {
                    from = nblk;
                } else {
                    read_held = true;
                    st.read_waiters += 1;
                }
            } else {
                let now = sh.now_ms();
                let was_clean = st.dirty_since.is_none();
                from = map_write(sh, &mut st, ob0, nblk, from, now, &mut subs);
                // The first change since a commit starts the autocommit
                // clock: the worker may be asleep with no deadline, so it
                // must hear of it; as it must of a full autocommit.
                //
                // Crossing the high watermark starts writeback now, while
                // the cache still has free blocks (dm-writecache queues
                // its writeback work from the map path): a worker left
                // asleep until the autocommit timer or a full cache makes
                // foreground writes wait on the origin.
                poke = (was_clean && st.dirty_since.is_some())
                    || st.uncommitted >= sh.cfg.autocommit_blocks
                    || (!st.wb_active && sh.above_high_watermark(&st));
                if from < nblk {
                    blocked = true;
                    st.stats.writes_blocked_on_freelist += 1;
                    st.space_waiters += 1;
                }
            }
        }
        if poke {
            sh.poke();
        }
        if subs.len() == 1
            && !read_held
            && !blocked
            && bio.pending == 1
            && !bio.flags.contains(udm_core::BioFlags::FUA)
            && !bio.flags.contains(udm_core::BioFlags::PREFLUSH)
            && bio.status().is_ok()
            && subs[0].off == 0
            && subs[0].n == nblk
        {
            // One piece covering the whole bio (a hit in one cache run, a
            // miss, a write to one extent): remap the caller's bio itself,
            // as a linear target would, instead of cloning it. Its frame
            // (pushed in submit) brings it back to `parent_done`, which
            // reads what to account from the context word.
            let sub = subs[0];
            subs.clear();
            drop(subs);
            bio.set_ctx(sub.ctx());
            if sub.kind == K_ORIGIN {
                bio.sector = sub.block * bs;
                self.origin.submit(bio);
            } else {
                bio.sector = sh.cache_sector(sub.block as u32);
                self.cache.submit(bio);
            }
            return;
        }
        bio.pending += subs.len() as u32;
        bio.set_ctx(from);
        let p = bio.into_raw();
        // SAFETY: `p` came from into_raw above; the parent stays alive while
        // its pending count (held by this function and by each sub) is
        // non-zero, and subs only complete on a later reactor turn.
        let parent = unsafe { &*p };
        let bsz = sh.cfg.block_size as u64;
        for s in subs.iter() {
            let mut c = parent.alloc_clone();
            c.flags = udm_core::BioFlags::NONE;
            c.add_segs_from(parent, (s.off * bsz) as usize, (s.n * bsz) as usize);
            c.set_end_io(sub_done, p.cast());
            c.set_ctx(s.ctx());
            match s.kind {
                K_ORIGIN => {
                    c.sector = s.block * bs;
                    self.origin.submit(c);
                }
                _ => {
                    c.sector = sh.cache_sector(s.block as u32);
                    self.cache.submit(c);
                }
            }
        }
        subs.clear();
        drop(subs);
        // SAFETY: as above; we still hold one pending count.
        let bio = unsafe { BioPtr::from_raw(p) };
        if read_held {
            // Retried by `kick` once a first write completes (`account`
            // sees read_waiters, counted under the lock above).
            self.read_wait.borrow_mut().push(bio);
        } else if blocked {
            self.space_wait.borrow_mut().push(bio);
            sh.poke();
        } else {
            self.put(bio, false);
        }
    }

    /// Drops one pending count of the caller's bio; the last one finishes it.
    fn put(&self, mut bio: BioPtr, in_completion: bool) {
        bio.pending -= 1;
        if bio.pending > 0 {
            let _ = bio.into_raw();
            return;
        }
        let s = bio.status();
        if bio.op == Op::Write && bio.flags.contains(udm_core::BioFlags::FUA) && s.is_ok() {
            // FUA: durable before it is acknowledged.
            return self.park_until_committed(bio, true, false);
        }
        bio.pop_end_io();
        if in_completion {
            bio.endio();
        } else {
            bio.complete(s);
        }
    }
}

/// A sub-I/O completed: account it under the lock, then drop its parent's
/// pending count.
fn sub_done(c: BioPtr) {
    let p = c.private() as *mut Bio;
    // SAFETY: a sub's private is its parent, alive while the sub is pending
    // (put drops the count only below).
    let parent = unsafe { &mut *p };
    // SAFETY: the parent's private is the WcChannel that pushed its frame,
    // kept alive by its table while I/O is in flight.
    let ch = unsafe { &*(parent.private() as *const WcChannel) };
    let sh = &*ch.shared;
    let (status, ctx) = (c.status(), c.ctx());
    let n = c.len() / sh.cfg.block_size;
    drop(c);
    account(sh, ctx, n, status, parent.op);
    if !status.is_ok() && parent.status().is_ok() {
        parent.set_status(status);
    }
    // SAFETY: we hold one of the parent's pending counts; it is ours again.
    let bio = unsafe { BioPtr::from_raw(p) };
    ch.put(bio, true);
}

/// Accounts a completed piece (its context word `ctx`, `n` blocks) of a
/// caller's `op`: unpins, marks first writes done, counts drained writes
/// for a waiting commit, wakes whoever waits on any of that.
fn account(sh: &Shared, ctx: u64, n: u32, status: Status, op: Op) {
    let kind = ctx >> 56;
    let block = ctx as u32;
    if kind == K_ORIGIN {
        if op == Op::Write {
            sh.lock().last_origin_write = Some(Instant::now());
        }
        return;
    }
    let mut st = sh.lock();
    let mut freed = false;
    let mut wake_readers = false;
    if kind == K_CACHE_NEW {
        // A first write: its entries were published when it was mapped;
        // only the bits say it is done (no pins were taken).
        st.set_unwritten(block, n, false);
        wake_readers = st.read_waiters > 0;
    } else {
        // One tight pass over the run's entries.
        let mut zombies = false;
        let run = &mut st.entries[block as usize..(block + n) as usize];
        if kind == K_CACHE_WRITE {
            for e in run {
                e.writes -= 1;
                zombies |= e.st == St::Zombie;
            }
        } else {
            for e in run {
                e.reads -= 1;
                zombies |= e.st == St::Zombie;
            }
        }
        if zombies {
            for b in block..block + n {
                freed |= st.unpinned(b);
            }
        }
    }
    let mut drained = false;
    if kind != K_CACHE_READ {
        let odd = (ctx & CTX_ODD != 0) as usize;
        st.inflight_writes[odd] -= 1;
        drained = st.inflight_writes[odd] == 0 && st.barrier != 0 && st.barrier & 1 == odd as u64;
    }
    if !status.is_ok() {
        st.error = Status::IoErr.errno();
    }
    let kick = (freed && st.space_waiters > 0) || !status.is_ok() || wake_readers;
    drop(st);
    if drained || !status.is_ok() {
        sh.poke();
    }
    if kick {
        sh.kick_all();
    }
}

/// End_io pushed on callers' bios: reached when the engine remapped the
/// caller's bio itself (one piece, see `map`); the context word says what
/// the piece was. (Bios the engine split complete through `put`, which pops
/// the frame first.)
fn parent_done(mut bio: BioPtr) {
    // SAFETY: the private of the engine's frame is the WcChannel that pushed
    // it, kept alive by its table while I/O is in flight.
    let ch = unsafe { &*(bio.private() as *const WcChannel) };
    let n = bio.len() / ch.shared.cfg.block_size;
    account(&ch.shared, bio.ctx(), n, bio.status(), bio.op);
    bio.pop_end_io();
    bio.endio();
}

/// Reaching the channels is the channel's business: the worker and
/// completions only hold the shared state.
impl Shared {
    /// Tells every reactor's channel to release what waits on a commit or
    /// on free space.
    pub fn kick_all(&self) {
        let chans = self.chans.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (h, key) in chans {
            h.send(move |r| {
                if let Some(ch) = r.local(key).and_then(|c| c.downcast::<WcChannel>().ok()) {
                    ch.kick();
                }
            });
        }
        self.cv.notify_all();
    }
}
