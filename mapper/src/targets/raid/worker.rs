//! raid1's worker (md's raid1d and bitmap daemon): a thread with its own
//! reactor and channels to every leg's metadata and data devices. It loads
//! the metadata when the target is constructed, then writes it (the marks
//! writes wait for, the superblock when legs fail or a rebuild ends, the
//! lazy clearing of idle regions), and runs the resync engine (resync.rs).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use udm_core::{AlignedBuf, BioFlags, Channel, Error, Op, Poller, Reactor, ReactorConfig, Status};

use super::metadata::{
    assemble, bitmap_bytes, LegMeta, Super, BITMAP_OFFSET, BITS_PER_BLOCK, BM_BLOCK,
};
use super::resync::Job;
use super::state::{self, Action, Shared};

/// What an I/O's completion runs, with the buffer handed back.
type Done = Box<dyn FnOnce(Status, AlignedBuf)>;

/// A continuation told the legs that failed (or were written), run once.
type Then = Rc<RefCell<Option<Box<dyn FnOnce(u64)>>>>;

struct IoCtx {
    buf: AlignedBuf,
    done: Done,
}

fn io_done(bio: udm_core::BioPtr) {
    // SAFETY: private is the Box<IoCtx> leaked in `Worker::io`, taken back once.
    let ctx = unsafe { Box::from_raw(bio.private() as *mut IoCtx) };
    let s = bio.status();
    drop(bio);
    let IoCtx { buf, done } = *ctx;
    done(s, buf);
}

/// The worker's state; it lives on its reactor's thread only.
pub(crate) struct Worker {
    pub sh: Arc<Shared>,
    reactor: *const Reactor,
    pub data: Vec<Rc<dyn Channel>>,
    meta: Vec<Option<Rc<dyn Channel>>>,
    /// I/Os in flight (the thread ends once none is left).
    pub inflight: Cell<u64>,
    /// The bitmap as on disk, or as being written (bit per region).
    image: RefCell<Vec<u64>>,
    /// A metadata write (or a clearing pass) is running.
    meta_busy: Cell<bool>,
    /// The whole metadata has been written since activation.
    formatted: Cell<bool>,
    next_daemon: Cell<Instant>,
    /// The resync engine's current job.
    pub job: RefCell<Option<Job>>,
    /// When the rate limit lets the next job start.
    pub not_before: Cell<Option<Instant>>,
    /// Bytes resynced since `rate_t0` (for the rate limit).
    pub rate_bytes: Cell<u64>,
    pub rate_t0: Cell<Instant>,
    /// Chunk buffers handed back, reused.
    pub bufs: RefCell<Vec<AlignedBuf>>,
    /// When the rebuild may record its next checkpoint, and whether one is
    /// being recorded.
    pub next_checkpoint: Cell<Instant>,
    pub checkpointing: Cell<bool>,
}

impl Worker {
    fn reactor(&self) -> &Reactor {
        // SAFETY: the worker lives inside `run`, on the reactor's thread,
        // and `run` drains all of its I/O before the reactor is dropped.
        unsafe { &*self.reactor }
    }

    /// Issues one I/O on `ch` with `buf` as its data (moved in, handed
    /// back to `done`); a data-less op when `op` has none.
    pub fn io(
        self: &Rc<Self>,
        ch: &Rc<dyn Channel>,
        op: Op,
        sector: u64,
        mut buf: AlignedBuf,
        done: impl FnOnce(Status, AlignedBuf) + 'static,
    ) {
        let mut bio = self.reactor().alloc_bio();
        if op.has_data() {
            bio.op = op;
            bio.sector = sector;
            // SAFETY: the buffer moves into the IoCtx below, which keeps it
            // (its heap block does not move) until io_done runs.
            unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
        } else {
            bio.set_dataless(op, sector, 0);
        }
        bio.flags = BioFlags::NONE;
        self.inflight.set(self.inflight.get() + 1);
        let me = self.clone();
        let ctx = Box::new(IoCtx {
            buf,
            done: Box::new(move |s, b| {
                me.inflight.set(me.inflight.get() - 1);
                done(s, b)
            }),
        });
        bio.set_end_io(io_done, Box::into_raw(ctx).cast());
        ch.submit(bio);
    }

    /// Writes `len` bytes at `data` to `ch` at `sector`.
    ///
    /// # Safety
    /// `data..data + len` stays valid and unchanged until `done` runs.
    pub unsafe fn write_at(
        self: &Rc<Self>,
        ch: &Rc<dyn Channel>,
        sector: u64,
        data: *mut u8,
        len: usize,
        done: impl FnOnce(Status) + 'static,
    ) {
        let mut bio = self.reactor().alloc_bio();
        bio.op = Op::Write;
        bio.sector = sector;
        // SAFETY: the caller keeps the range valid until `done` runs.
        unsafe { bio.add_seg(data, len) };
        self.inflight.set(self.inflight.get() + 1);
        let me = self.clone();
        let ctx = Box::new(IoCtx {
            buf: AlignedBuf::default(),
            done: Box::new(move |s, _| {
                me.inflight.set(me.inflight.get() - 1);
                done(s)
            }),
        });
        bio.set_end_io(io_done, Box::into_raw(ctx).cast());
        ch.submit(bio);
    }

    /// A buffer of `len` bytes (reused when one of that size is free).
    pub fn buf(&self, len: usize) -> AlignedBuf {
        let mut b = self.bufs.borrow_mut();
        match b.iter().position(|x| x.len() == len) {
            Some(i) => b.swap_remove(i),
            None => AlignedBuf::new(len),
        }
    }

    pub fn give_back(&self, b: AlignedBuf) {
        let mut v = self.bufs.borrow_mut();
        if v.len() < 64 {
            v.push(b);
        }
    }

    /// Flushes every device in `chans` (by index in `self.data` when
    /// `data`, else the metadata devices), then runs `then` with the mask
    /// of legs whose flush failed.
    pub fn flush_legs(self: &Rc<Self>, data: bool, legs: u64, then: impl FnOnce(u64) + 'static) {
        let then: Then = Rc::new(RefCell::new(Some(Box::new(then))));
        let left = Rc::new(Cell::new(1u32));
        let bad = Rc::new(Cell::new(0u64));
        let finish = {
            let (then, left, bad) = (then.clone(), left.clone(), bad.clone());
            move || {
                left.set(left.get() - 1);
                if left.get() == 0 {
                    if let Some(f) = then.borrow_mut().take() {
                        f(bad.get());
                    }
                }
            }
        };
        let finish = Rc::new(finish);
        let mut m = legs;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            let ch = if data {
                Some(self.data[i].clone())
            } else {
                self.meta[i].clone()
            };
            let Some(ch) = ch else { continue };
            left.set(left.get() + 1);
            let (f, bad) = (finish.clone(), bad.clone());
            self.io(&ch, Op::Flush, 0, AlignedBuf::default(), move |s, _| {
                if !s.is_ok() {
                    bad.set(bad.get() | 1 << i);
                }
                f();
            });
        }
        finish();
    }

    /// Looks at the state and starts what is due.
    pub fn step(self: &Rc<Self>) {
        let sh = &*self.sh;
        if sh.stop.load(Ordering::Acquire) || !sh.lock().active {
            return;
        }
        if !self.meta_busy.get() {
            let (marks, sb) = {
                let st = sh.lock();
                (st.mark_wanted, st.sb_wanted > st.sb_done)
            };
            if !self.formatted.get() || marks || sb {
                self.write_meta();
            } else if Instant::now() >= self.next_daemon.get()
                && !sh.retired.load(Ordering::Acquire)
            {
                self.next_daemon.set(Instant::now() + sh.cfg.daemon_sleep);
                self.clear_idle();
            }
        }
        if self.formatted.get() {
            self.resync_step();
        }
    }

    /// Writes what metadata is due: the whole of it once after activation,
    /// else the bitmap blocks of regions marked since, and the superblock
    /// when asked; then a flush of each metadata device. Marks become
    /// durable (writes waiting for them go on) when that is done.
    fn write_meta(self: &Rc<Self>) {
        let sh = &*self.sh;
        let full = !self.formatted.get();
        let (marks, gen, sb) = {
            let mut st = sh.lock();
            let words = st.want_mark.len();
            let marks = std::mem::replace(&mut st.want_mark, vec![0; words]);
            st.mark_wanted = false;
            let gen = st.sb_wanted;
            let sb = full || gen > st.sb_done;
            if sb {
                st.events += 1;
            }
            let failed = sh.failed.load(Ordering::Acquire);
            let sbv = Super {
                uuid: st.uuid,
                nlegs: sh.cfg.legs.len() as u32,
                role: 0,
                region_shift: sh.cfg.region_shift,
                array_sectors: sh.cfg.len,
                events: st.events,
                failed,
                recovering: sh.all_legs() & !sh.insync.load(Ordering::Acquire) & !failed,
                recovery_offset: st.recovery_offset,
            };
            (marks, gen, sb.then_some(sbv))
        };
        let mut blocks: Vec<u64> = Vec::new();
        {
            let mut img = self.image.borrow_mut();
            for (w, (i, m)) in img.iter_mut().zip(marks.iter().enumerate()) {
                if *m & !*w != 0 {
                    let b = (i as u64 * 64) / BITS_PER_BLOCK;
                    if blocks.last() != Some(&b) {
                        blocks.push(b);
                    }
                }
                *w |= *m;
            }
        }
        if full {
            blocks = (0..bitmap_bytes(sh.cfg.nregions) / BM_BLOCK as u64).collect();
        }
        self.meta_busy.set(true);
        let me = self.clone();
        let wrote_sb = sb.is_some();
        self.write_blocks(&blocks, sb, move |took| {
            if took == 0 && me.sh.cfg.legs.iter().any(|l| l.meta.is_some()) {
                // No leg holds the marks or the superblock: what waits for
                // them must fail (a write acknowledged now could be lost
                // to a resync from a stale leg after a crash).
                tracing::error!("raid1: no leg's metadata can be written, writes fail");
                me.sh.meta_dead.store(true, Ordering::Release);
                me.sh.paths();
            }
            // The marks are durable on every leg that took them.
            for (i, m) in marks.iter().enumerate() {
                let mut m = *m;
                while m != 0 {
                    let b = m.trailing_zeros() as u64;
                    m &= m - 1;
                    state::set(&me.sh.ondisk, i as u64 * 64 + b);
                }
            }
            {
                let mut st = me.sh.lock();
                if wrote_sb {
                    st.sb_done = st.sb_done.max(gen);
                }
            }
            me.formatted.set(true);
            me.meta_busy.set(false);
            me.sh.kick_all();
            me.step();
        });
    }

    /// Writes bitmap blocks `blocks` (from the image) and, if given, the
    /// superblock to every live leg's metadata device, then flushes them;
    /// a leg whose metadata fails is failed. `then` gets the legs written.
    fn write_blocks(
        self: &Rc<Self>,
        blocks: &[u64],
        sb: Option<Super>,
        then: impl FnOnce(u64) + 'static,
    ) {
        let sh = &*self.sh;
        let live = sh.live();
        let mut legs = 0u64;
        let left = Rc::new(Cell::new(1u32));
        let bad = Rc::new(Cell::new(0u64));
        let then: Then = Rc::new(RefCell::new(Some(Box::new(then))));
        let me = self.clone();
        let written = Rc::new(Cell::new(0u64));
        let finish = {
            let (left, bad, then, written) =
                (left.clone(), bad.clone(), then.clone(), written.clone());
            Rc::new(move || {
                left.set(left.get() - 1);
                if left.get() != 0 {
                    return;
                }
                let me2 = me.clone();
                let (bad2, then2) = (bad.clone(), then.clone());
                let ok = written.get() & !bad.get();
                me.flush_legs(false, ok, move |fb| {
                    let failed = bad2.get() | fb;
                    if failed != 0 {
                        me2.sh.fail_legs(failed);
                    }
                    if let Some(f) = then2.borrow_mut().take() {
                        f(ok & !fb);
                    }
                });
            })
        };
        let img = self.image.borrow();
        for i in 0..sh.cfg.legs.len() {
            if live & (1 << i) == 0 {
                continue;
            }
            let Some(ch) = self.meta[i].clone() else {
                continue;
            };
            legs |= 1 << i;
            if let Some(s) = &sb {
                let mut b = AlignedBuf::new(BM_BLOCK);
                let mut s = s.clone();
                s.role = i as u32;
                s.encode(b.as_mut_slice());
                left.set(left.get() + 1);
                let (f, bad) = (finish.clone(), bad.clone());
                self.io(&ch, Op::Write, 0, b, move |st, _| {
                    if !st.is_ok() {
                        bad.set(bad.get() | 1 << i);
                    }
                    f();
                });
            }
            for &blk in blocks {
                let mut b = AlignedBuf::new(BM_BLOCK);
                let words = BM_BLOCK / 8;
                let w0 = blk as usize * words;
                for (k, w) in img.iter().skip(w0).take(words).enumerate() {
                    b.as_mut_slice()[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
                }
                let sector = (BITMAP_OFFSET + blk * BM_BLOCK as u64) >> 9;
                left.set(left.get() + 1);
                let (f, bad) = (finish.clone(), bad.clone());
                self.io(&ch, Op::Write, sector, b, move |st, _| {
                    if !st.is_ok() {
                        bad.set(bad.get() | 1 << i);
                    }
                    f();
                });
            }
        }
        drop(img);
        written.set(legs);
        finish();
    }

    /// The bitmap daemon: clears the bits of regions with no write in
    /// flight and none since the last pass, after a flush of the data legs
    /// makes their writes durable.
    fn clear_idle(self: &Rc<Self>) {
        let sh = &*self.sh;
        if sh.cfg.legs.iter().all(|l| l.meta.is_none()) {
            return;
        }
        let barrier = sh.barrier.load(Ordering::SeqCst);
        let mut cands: Vec<u64> = Vec::new();
        {
            let img = self.image.borrow();
            for (i, &w) in img.iter().enumerate() {
                let mut m = w;
                while m != 0 {
                    let r = i as u64 * 64 + m.trailing_zeros() as u64;
                    m &= m - 1;
                    let (wi, bit) = ((r / 64) as usize, 1u64 << (r % 64));
                    if sh.touched[wi].fetch_and(!bit, Ordering::Relaxed) & bit != 0 {
                        continue;
                    }
                    if r == barrier || state::test(&sh.unsynced, r) || sh.writing(r) {
                        continue;
                    }
                    state::clear(&sh.ondisk, r);
                    if sh.writing(r) {
                        // A write saw the bit before it went: keep it.
                        state::set(&sh.ondisk, r);
                        continue;
                    }
                    cands.push(r);
                }
            }
        }
        if cands.is_empty() {
            return;
        }
        self.meta_busy.set(true);
        let me = self.clone();
        self.flush_legs(true, sh.live(), move |bad| {
            if bad != 0 {
                me.sh.fail_legs(bad);
            }
            let mut blocks = Vec::new();
            {
                let mut img = me.image.borrow_mut();
                for &r in &cands {
                    img[(r / 64) as usize] &= !(1 << (r % 64));
                    let b = r / BITS_PER_BLOCK;
                    if blocks.last() != Some(&b) {
                        blocks.push(b);
                    }
                }
            }
            let me2 = me.clone();
            me.write_blocks(&blocks, None, move |_| {
                me2.meta_busy.set(false);
                me2.step();
            });
        });
    }

    fn next_deadline(&self) -> Option<Instant> {
        if !self.sh.lock().active {
            return None;
        }
        let mut d = self.next_daemon.get();
        if let Some(t) = self.not_before.get() {
            d = d.min(t);
        }
        if let Some(t) = self.job.borrow().as_ref().and_then(|j| j.recheck()) {
            d = d.min(t);
        }
        Some(d)
    }
}

struct WorkerPoller(Rc<Worker>);

impl Poller for WorkerPoller {
    fn poll(&self) -> usize {
        let w = &self.0;
        let due = self.deadline().is_some_and(|d| d <= Instant::now());
        if w.sh.poked.swap(false, Ordering::AcqRel) || due {
            w.step();
            return 1;
        }
        0
    }

    fn deadline(&self) -> Option<Instant> {
        if self.0.sh.stop.load(Ordering::Acquire) {
            return None;
        }
        self.0.next_deadline()
    }
}

/// Starts the worker thread; returns once the metadata is loaded and the
/// array assembled, or with the error that prevented it.
pub(crate) fn start(sh: Arc<Shared>) -> Result<std::thread::JoinHandle<()>, Error> {
    crate::targets::start_worker("raid1", "raid", move |tx| run(sh, tx))
}

/// Reads each leg's superblock and bitmap.
fn load(w: &Rc<Worker>, out: Rc<RefCell<Vec<Option<LegMeta>>>>) {
    let n = w.sh.cfg.legs.len();
    let bm = bitmap_bytes(w.sh.cfg.nregions) as usize;
    for i in 0..n {
        let Some(ch) = w.meta[i].clone() else {
            out.borrow_mut()[i] = Some(LegMeta::None);
            continue;
        };
        let (w2, out2, ch2) = (w.clone(), out.clone(), ch.clone());
        w.io(&ch, Op::Read, 0, AlignedBuf::new(BM_BLOCK), move |s, b| {
            let sb = if s.is_ok() {
                Super::decode(b.as_slice())
            } else {
                Ok(None)
            };
            match (s.is_ok(), sb) {
                (false, _) => out2.borrow_mut()[i] = Some(LegMeta::Unreadable),
                (true, Err(_)) => out2.borrow_mut()[i] = Some(LegMeta::Unreadable),
                (true, Ok(None)) => out2.borrow_mut()[i] = Some(LegMeta::Blank),
                (true, Ok(Some(sb))) => {
                    let out3 = out2.clone();
                    w2.io(
                        &ch2,
                        Op::Read,
                        BITMAP_OFFSET >> 9,
                        AlignedBuf::new(bm),
                        move |s, b| {
                            out3.borrow_mut()[i] = Some(if s.is_ok() {
                                let words = b
                                    .as_slice()
                                    .chunks_exact(8)
                                    .map(|c| {
                                        let mut x = [0u8; 8];
                                        x.copy_from_slice(c);
                                        u64::from_le_bytes(x)
                                    })
                                    .collect();
                                LegMeta::Found(sb, words)
                            } else {
                                LegMeta::Unreadable
                            });
                        },
                    );
                }
            }
        });
    }
}

/// A new array's identity: the time and the process, hashed.
fn new_uuid() -> [u8; 16] {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let x = t ^ ((std::process::id() as u128) << 64);
    let mut h = [0u8; 16];
    let mut a: u64 = 0x9e37_79b9_7f4a_7c15 ^ x as u64;
    let mut b: u64 = 0xbf58_476d_1ce4_e5b9 ^ (x >> 64) as u64;
    for _ in 0..4 {
        a = (a ^ (a >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        b = (b ^ (b >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb) ^ a;
    }
    h[..8].copy_from_slice(&a.to_le_bytes());
    h[8..].copy_from_slice(&b.to_le_bytes());
    h
}

/// Applies the assembled metadata and the table's options to the state.
fn apply(w: &Worker, legs: &[LegMeta]) -> Result<(), Error> {
    let sh = &*w.sh;
    let cfg = &sh.cfg;
    let a = assemble(legs, cfg.region_shift, cfg.len, new_uuid())?;
    let all = sh.all_legs();
    let unreadable = legs
        .iter()
        .enumerate()
        .filter(|(_, l)| matches!(l, LegMeta::Unreadable))
        .fold(0u64, |m, (i, _)| m | 1 << i);
    // A leg the metadata calls failed is taken back and rebuilt in full
    // (as dm-raid does on a reload); one whose metadata cannot be read
    // stays failed.
    let recovering = (a.recovering | a.failed | cfg.rebuild) & all & !unreadable;
    // A rebuild goes on from its checkpoint when the legs to rebuild are
    // those it was rebuilding (no leg added since: a blank one, one taken
    // back), unless the table names legs to rebuild: as dm-raid's
    // `rebuild`, that starts from the beginning (their data may be new).
    let recovery_offset = if recovering != 0 && recovering == a.recovering && cfg.rebuild == 0 {
        a.recovery_offset
    } else {
        0
    };
    sh.failed.store(unreadable, Ordering::Release);
    sh.insync
        .store(all & !recovering & !unreadable, Ordering::Release);
    let no_meta = cfg.legs.iter().all(|l| l.meta.is_none());
    let n = cfg.nregions;
    let full = cfg.sync || (!cfg.nosync && (a.fresh || no_meta));
    let mut any = false;
    for r in 0..n {
        let dirty = a.dirty[(r / 64) as usize] & (1 << (r % 64)) != 0;
        if full || (dirty && !cfg.nosync) {
            state::set(&sh.unsynced, r);
            any = true;
        }
        if no_meta {
            // Nothing to mark: writes never wait.
            state::set(&sh.ondisk, r);
        }
    }
    sh.any_unsynced.store(any, Ordering::Release);
    sh.paths();
    // Regions to resync stay dirty on disk until they are: a crash before
    // then resyncs them again (an interrupted initial resync included).
    let mut image = a.dirty.clone();
    for (i, w) in image.iter_mut().enumerate() {
        *w |= sh.unsynced[i].load(Ordering::Acquire);
    }
    *w.image.borrow_mut() = image;
    let mut st = sh.lock();
    st.uuid = a.uuid;
    st.events = a.events;
    st.action = Action::Idle;
    st.recovery_offset = recovery_offset;
    Ok(())
}

fn run(sh: Arc<Shared>, tx: mpsc::Sender<Result<(), Error>>) {
    // UDM_RAID_WORKER_POLL=1 makes the worker spin instead of sleeping in
    // io_uring_enter: valgrind holds its big lock across that call, so a
    // sleeping worker would stop every other thread under callgrind
    // (scripts/bench/raid-instr.sh sets it and counts the other threads).
    let mut rc = ReactorConfig::default();
    if std::env::var_os("UDM_RAID_WORKER_POLL").is_some_and(|v| v == "1") {
        rc.mode = udm_core::CompletionMode::Poll;
    }
    let reactor = match Reactor::new(rc) {
        Ok(r) => r,
        Err(e) => {
            let _ = tx.send(Err(Error::os("raid: creating the worker's reactor", e)));
            return;
        }
    };
    let mut data = Vec::new();
    let mut meta = Vec::new();
    for l in &sh.cfg.legs {
        match l.data.clone().open(&reactor) {
            Ok(c) => data.push(c),
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        }
        match l.meta.as_ref().map(|m| m.clone().open(&reactor)) {
            None => meta.push(None),
            Some(Ok(c)) => meta.push(Some(c)),
            Some(Err(e)) => {
                let _ = tx.send(Err(e));
                return;
            }
        }
    }
    let _ = sh.worker.set(reactor.handle());
    let n = sh.cfg.legs.len();
    let w = Rc::new(Worker {
        sh: sh.clone(),
        reactor: &reactor as *const Reactor,
        data,
        meta,
        inflight: Cell::new(0),
        image: RefCell::new(vec![0; sh.cfg.nregions.div_ceil(64) as usize]),
        meta_busy: Cell::new(false),
        formatted: Cell::new(false),
        next_daemon: Cell::new(Instant::now() + sh.cfg.daemon_sleep),
        job: RefCell::new(None),
        not_before: Cell::new(None),
        rate_bytes: Cell::new(0),
        rate_t0: Cell::new(Instant::now()),
        bufs: RefCell::new(Vec::new()),
        next_checkpoint: Cell::new(Instant::now()),
        checkpointing: Cell::new(false),
    });
    let found: Rc<RefCell<Vec<Option<LegMeta>>>> =
        Rc::new(RefCell::new((0..n).map(|_| None).collect()));
    load(&w, found.clone());
    reactor.run_until(|| w.inflight.get() == 0);
    let legs: Vec<LegMeta> = found
        .borrow_mut()
        .drain(..)
        .map(|l| l.unwrap_or(LegMeta::Unreadable))
        .collect();
    if let Err(e) = apply(&w, &legs) {
        let _ = tx.send(Err(e.context("raid")));
        return;
    }
    let _ = tx.send(Ok(()));
    reactor.add_poller(Rc::new(WorkerPoller(w.clone())));
    sh.poke();
    reactor.run_until(|| sh.stop.load(Ordering::Acquire) && w.inflight.get() == 0);
    // Every callback (which dereferences the reactor) has run.
}
