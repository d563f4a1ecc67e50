//! Shared helpers for the mapper's integration tests.
//!
//! - [`Devices`]: named ram devices that table text can refer to, and tables
//!   and mapped devices built over them;
//! - [`Req`] / [`Done`]: one I/O request and what came back (status, data,
//!   how often its completion ran, the sector it came back with);
//! - [`Tester`]: a reactor on the test thread with synchronous helpers
//!   (submit, then turn the reactor until the completion has run);
//! - [`ReactorThread`]: a reactor on its own thread that runs I/O for the
//!   test thread, so that the test thread can call the mapped device's
//!   control methods (which must not run on a reactor doing its I/O);
//! - [`pattern`] and [`Rng`]: verifiable sector contents and a small PRNG.
//!
//! Everything runs on real [`RamDevice`]s: no mocks.

// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use udm_backends::RamDevice;
use udm_core::{
    BioFlags, BioPtr, BlockDevice, Channel, Error, ErrorKind, Op, Reactor, ReactorConfig,
    ReactorHandle, Status,
};
use udm_mapper::{MappedDevice, Registry, Table};

/// Bytes per sector, as a `usize` for buffer arithmetic.
pub const SECTOR: usize = 512;

/// How long any single wait in these tests may take before it is a failure
/// (generous: debug builds on a loaded machine).
pub const TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------
// Devices and tables
// ---------------------------------------------------------------------------

/// Named devices that table lines can refer to.
#[derive(Clone, Default)]
pub struct Devices {
    map: HashMap<String, Arc<dyn BlockDevice>>,
}

impl Devices {
    /// No devices yet.
    pub fn new() -> Devices {
        Devices::default()
    }

    /// Adds a ram device called `name` of `sectors` sectors and returns it.
    pub fn ram(&mut self, name: &str, sectors: u64) -> Arc<dyn BlockDevice> {
        let dev: Arc<dyn BlockDevice> =
            Arc::new(RamDevice::new(name, sectors * SECTOR as u64).expect("ram device"));
        self.map.insert(name.to_string(), dev.clone());
        dev
    }

    /// Makes `dev` available to tables under its own name.
    pub fn add(&mut self, dev: Arc<dyn BlockDevice>) {
        self.map.insert(dev.name().to_string(), dev);
    }

    /// The device called `name`.
    pub fn get(&self, name: &str) -> Arc<dyn BlockDevice> {
        match self.map.get(name) {
            Some(d) => d.clone(),
            None => panic!("test bug: no device '{name}'"),
        }
    }

    /// Builds `text` (dmsetup table syntax) over these devices.
    pub fn try_table(&self, text: &str) -> Result<Table, Error> {
        self.try_table_in(&Registry::builtin(), text)
    }

    /// Builds `text` with the target types of `reg`.
    pub fn try_table_in(&self, reg: &Registry, text: &str) -> Result<Table, Error> {
        let resolve = |name: &str| -> Result<Arc<dyn BlockDevice>, Error> {
            self.map
                .get(name)
                .cloned()
                .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("no device '{name}'")))
        };
        Table::from_text(text, reg, &resolve)
    }

    /// Builds `text`, which the test expects to be valid.
    pub fn table(&self, text: &str) -> Table {
        match self.try_table(text) {
            Ok(t) => t,
            Err(e) => panic!("table should build: {e}\n{text}"),
        }
    }

    /// The error message building `text` gives (which must fail).
    pub fn table_err(&self, text: &str) -> String {
        match self.try_table(text) {
            Ok(_) => panic!("table should be rejected:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    /// A mapped device called `name` with `text` live.
    pub fn mapped(&self, name: &str, text: &str) -> Arc<MappedDevice> {
        MappedDevice::new(name, self.table(text))
    }
}

/// A mapped device as a plain block device.
pub fn as_dev(md: &Arc<MappedDevice>) -> Arc<dyn BlockDevice> {
    md.clone()
}

// ---------------------------------------------------------------------------
// Verifiable contents
// ---------------------------------------------------------------------------

/// A small deterministic PRNG (splitmix64), for test data and load streams.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// A value in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// The content of one sector written with tag `tag` at (logical) sector
/// `sector`: the sector number and the tag in the first 16 bytes, so that a
/// misplaced or stale sector says where it was meant to be, then bytes
/// derived from both.
pub fn sector_pattern(tag: u64, sector: u64) -> [u8; SECTOR] {
    let mut out = [0u8; SECTOR];
    out[..8].copy_from_slice(&sector.to_le_bytes());
    out[8..16].copy_from_slice(&tag.to_le_bytes());
    let mut rng = Rng::new(tag.rotate_left(32) ^ sector ^ 0x5eed);
    for word in out[16..].chunks_mut(8) {
        word.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    out
}

/// [`sector_pattern`] for `sectors` sectors from `sector`.
pub fn pattern(tag: u64, sector: u64, sectors: u64) -> Vec<u8> {
    (sector..sector + sectors)
        .flat_map(|s| sector_pattern(tag, s))
        .collect()
}

/// Describes a sector's content for failure messages: "zeroes", or the
/// (sector, tag) a [`sector_pattern`] carries.
pub fn describe(sector: &[u8]) -> String {
    if sector.iter().all(|&b| b == 0) {
        return "zeroes".into();
    }
    let s = u64::from_le_bytes(sector[..8].try_into().expect("8 bytes"));
    let t = u64::from_le_bytes(sector[8..16].try_into().expect("8 bytes"));
    format!("data tagged (sector {s}, tag {t:#x})")
}

/// Asserts two buffers are equal, naming the first sector that differs.
#[track_caller]
pub fn assert_sectors_eq(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    for (i, (a, e)) in actual
        .chunks(SECTOR)
        .zip(expected.chunks(SECTOR))
        .enumerate()
    {
        assert!(
            a == e,
            "{what}: sector {i} of the buffer holds {} but should hold {}",
            describe(a),
            describe(e)
        );
    }
}

// ---------------------------------------------------------------------------
// Requests and completions
// ---------------------------------------------------------------------------

/// One I/O request.
#[derive(Clone, Debug)]
pub struct Req {
    /// The operation.
    pub op: Op,
    /// Start sector.
    pub sector: u64,
    /// Length in bytes.
    pub len: u32,
    /// Request flags.
    pub flags: BioFlags,
    /// For writes: the data.
    pub data: Vec<u8>,
    /// How many segments the buffer is split into (reads and writes).
    pub segs: usize,
}

impl Req {
    /// A read of `sectors` sectors from `sector`.
    pub fn read(sector: u64, sectors: u64) -> Req {
        Req::bytes(Op::Read, sector, (sectors as usize * SECTOR) as u32)
    }
    /// A write of `data` at `sector`.
    pub fn write(sector: u64, data: Vec<u8>) -> Req {
        Req {
            len: data.len() as u32,
            data,
            ..Req::bytes(Op::Write, sector, 0)
        }
    }
    /// A discard of `sectors` sectors from `sector`.
    pub fn discard(sector: u64, sectors: u64) -> Req {
        Req::bytes(Op::Discard, sector, (sectors as usize * SECTOR) as u32)
    }
    /// A write-zeroes of `sectors` sectors from `sector`.
    pub fn write_zeroes(sector: u64, sectors: u64) -> Req {
        Req::bytes(Op::WriteZeroes, sector, (sectors as usize * SECTOR) as u32)
    }
    /// An empty flush.
    pub fn flush() -> Req {
        Req::bytes(Op::Flush, 0, 0)
    }
    /// `op` of `len` bytes at `sector` (any length, aligned or not; for
    /// writes the data is zeroes).
    pub fn bytes(op: Op, sector: u64, len: u32) -> Req {
        Req {
            op,
            sector,
            len,
            flags: BioFlags::NONE,
            data: if op == Op::Write {
                vec![0; len as usize]
            } else {
                Vec::new()
            },
            segs: 1,
        }
    }
    /// The same request with `flags`.
    pub fn flags(mut self, flags: BioFlags) -> Req {
        self.flags = flags;
        self
    }
    /// The same request with its buffer split into `n` segments.
    pub fn segs(mut self, n: usize) -> Req {
        self.segs = n.max(1);
        self
    }
    /// Length in whole sectors.
    pub fn sectors(&self) -> u64 {
        self.len as u64 / SECTOR as u64
    }
}

/// What came back from one request.
#[derive(Clone, Debug)]
pub struct Done {
    /// The request.
    pub req: Req,
    /// Its completion status.
    pub status: Status,
    /// For reads: the data read.
    pub data: Vec<u8>,
    /// How many times its completion ran (must be exactly 1).
    pub completions: u32,
    /// The bio's sector when its completion ran (must be the submitted one).
    pub sector: u64,
    /// Completion frames still on the bio when it came back (must be 0).
    pub depth: usize,
    /// Whether a device lent its memory for the read ([`BioFlags::LENT`]);
    /// `data` is then what that memory held when the completion ran.
    pub lent: bool,
}

impl Done {
    /// Asserts the stack handed the bio back as it was given: completed
    /// exactly once, with its own sector and no frames left on it.
    #[track_caller]
    pub fn assert_returned_intact(&self) {
        assert_eq!(
            self.completions, 1,
            "{:?}: completion ran {} times",
            self.req, self.completions
        );
        assert_eq!(
            self.sector, self.req.sector,
            "{:?}: came back with another sector",
            self.req
        );
        assert_eq!(
            self.depth, 0,
            "{:?}: came back with completion frames on it",
            self.req
        );
    }
}

/// What a completion records; shared with the end_io through the bio's
/// private pointer.
#[derive(Default)]
struct Slot {
    completions: Cell<u32>,
    status: Cell<Status>,
    sector: Cell<u64>,
    depth: Cell<usize>,
    /// A lent read's data, copied while the completion ran (the only time
    /// the lent memory may be read).
    lent: RefCell<Option<Vec<u8>>>,
    /// Counts completions for a whole load (see [`Counters`]).
    counters: Option<Arc<Counters>>,
}

/// Submission and completion counts of a stream of I/O, readable from any
/// thread. Completions are counted inside the completion itself, so they are
/// exact at any moment the reactor's thread is between turns.
#[derive(Default, Debug)]
pub struct Counters {
    /// Bios handed to the device.
    pub submitted: AtomicU64,
    /// Completions that have run.
    pub completed: AtomicU64,
}

impl Counters {
    /// Bios submitted and not yet completed.
    pub fn outstanding(&self) -> u64 {
        // Read completions first: submitted only grows, so this never underflows.
        let c = self.completed.load(Ordering::SeqCst);
        self.submitted.load(Ordering::SeqCst) - c
    }
}

fn slot_end_io(bio: BioPtr) {
    // SAFETY: `private` points at the `Slot` inside an `Rc` that the
    // `InFlight` owning this request keeps alive until it has seen this
    // completion (and leaks if dropped before it); `Slot` is only accessed
    // through shared references and `Cell`s, on this reactor's thread.
    let slot = unsafe { &*(bio.private() as *const Slot) };
    slot.completions.set(slot.completions.get() + 1);
    slot.status.set(bio.status());
    slot.sector.set(bio.sector);
    slot.depth.set(bio.depth());
    if bio.flags.contains(BioFlags::LENT) {
        let s = bio.segs()[0];
        // SAFETY: a lent segment is readable until this end_io returns
        // (BioFlags::MAY_LEND's contract), and holds the bio's data.
        let data = unsafe { std::slice::from_raw_parts(s.base, s.len) };
        *slot.lent.borrow_mut() = Some(data.to_vec());
    }
    if let Some(c) = &slot.counters {
        c.completed.fetch_add(1, Ordering::SeqCst);
    }
    drop(bio);
}

/// A submitted request: owns the bio's buffer until the completion ran.
pub struct InFlight {
    req: Req,
    slot: Rc<Slot>,
    buf: Vec<u8>,
}

impl InFlight {
    /// Whether the completion has run.
    pub fn is_done(&self) -> bool {
        self.slot.completions.get() > 0
    }

    /// The result. Call only once [`InFlight::is_done`].
    pub fn finish(mut self) -> Done {
        assert!(self.is_done(), "finish before completion");
        let lent = self.slot.lent.borrow_mut().take();
        let was_lent = lent.is_some();
        let data = match (self.req.op, lent) {
            (Op::Read, Some(d)) => d,
            (Op::Read, None) => std::mem::take(&mut self.buf),
            _ => Vec::new(),
        };
        Done {
            req: self.req.clone(),
            status: self.slot.status.get(),
            data,
            completions: self.slot.completions.get(),
            sector: self.slot.sector.get(),
            depth: self.slot.depth.get(),
            lent: was_lent,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.is_done() {
            // Dropped before completion (a failing test unwinding): the bio
            // still points at the buffer and the slot, so leak both rather
            // than let a later completion touch freed memory.
            std::mem::forget(std::mem::take(&mut self.buf));
            std::mem::forget(self.slot.clone());
        }
    }
}

/// Byte offsets and lengths of `n` segments covering `len` bytes, of uneven
/// sizes not aligned to sectors (so splits land mid-segment).
fn seg_bounds(len: usize, n: usize) -> Vec<(usize, usize)> {
    let n = n.clamp(1, len.max(1));
    let mut out = Vec::with_capacity(n);
    let mut off = 0;
    for i in 0..n {
        let end = if i + 1 == n {
            len
        } else {
            // Uneven cut points: 1/3, then halves of what is left, …, nudged
            // off sector boundaries.
            (off + (len - off) / (n - i + 1) + 7).min(len)
        };
        if end > off {
            out.push((off, end - off));
        }
        off = end;
    }
    out
}

/// Submits `req` on `ch` (a channel of `reactor`). The returned [`InFlight`]
/// must be kept until it is done.
pub fn submit(reactor: &Reactor, ch: &dyn Channel, req: Req) -> InFlight {
    submit_counted(reactor, ch, req, None)
}

/// [`submit`], counting the submission and the completion in `counters`.
pub fn submit_counted(
    reactor: &Reactor,
    ch: &dyn Channel,
    req: Req,
    counters: Option<Arc<Counters>>,
) -> InFlight {
    let len = req.len as usize;
    let mut buf = match req.op {
        Op::Write => {
            assert_eq!(req.data.len(), len, "write data must match the length");
            req.data.clone()
        }
        // Poison, so a read that returns without filling is visible.
        Op::Read => vec![0xa5; len],
        _ => Vec::new(),
    };
    if let Some(c) = &counters {
        c.submitted.fetch_add(1, Ordering::SeqCst);
    }
    let slot = Rc::new(Slot {
        counters,
        ..Slot::default()
    });
    let mut bio = reactor.alloc_bio();
    bio.flags = req.flags;
    if req.op.has_data() {
        bio.op = req.op;
        bio.sector = req.sector;
        let base = buf.as_mut_ptr();
        for (off, n) in seg_bounds(len, req.segs) {
            // SAFETY: `off + n <= buf.len()`. The buffer is owned by the
            // returned `InFlight`, which neither reads nor frees it before the
            // completion has run (and leaks it if dropped earlier); moving a
            // `Vec` does not move its heap buffer.
            unsafe { bio.add_seg(base.add(off), n) };
        }
    } else {
        bio.set_dataless(req.op, req.sector, req.len);
    }
    bio.set_end_io(slot_end_io, Rc::as_ptr(&slot) as *mut ());
    ch.submit(bio);
    InFlight { req, slot, buf }
}

// ---------------------------------------------------------------------------
// A reactor on the test thread
// ---------------------------------------------------------------------------

/// A reactor on the test thread, for synchronous I/O. Control methods of a
/// mapped device this tester has opened must not be called from the test
/// thread afterwards (they would wait for this reactor, which only turns
/// inside these helpers): configure devices before their first I/O.
pub struct Tester {
    /// The reactor.
    pub reactor: Reactor,
}

impl Tester {
    /// A tester with a default reactor.
    pub fn new() -> Tester {
        Tester {
            reactor: Reactor::new(ReactorConfig::default()).expect("reactor"),
        }
    }

    /// Opens this reactor's channel to `dev`.
    pub fn open(&self, dev: &Arc<dyn BlockDevice>) -> Rc<dyn Channel> {
        dev.clone().open(&self.reactor).expect("open channel")
    }

    /// Turns the reactor until every request in `reqs` has completed.
    pub fn wait_all(&self, reqs: &[InFlight]) {
        let start = Instant::now();
        while !reqs.iter().all(InFlight::is_done) {
            if self.reactor.poll_once() == 0 {
                std::thread::yield_now();
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "I/O did not complete within {TIMEOUT:?}"
            );
        }
        // A few more turns, so that a second completion would be seen.
        for _ in 0..3 {
            self.reactor.poll_once();
        }
    }

    /// Submits all of `reqs` at once, then waits for all of them.
    pub fn run_all(&self, dev: &Arc<dyn BlockDevice>, reqs: Vec<Req>) -> Vec<Done> {
        let ch = self.open(dev);
        let f: Vec<InFlight> = reqs
            .into_iter()
            .map(|r| submit(&self.reactor, &*ch, r))
            .collect();
        self.wait_all(&f);
        f.into_iter().map(InFlight::finish).collect()
    }

    /// Runs one request to completion.
    pub fn run(&self, dev: &Arc<dyn BlockDevice>, req: Req) -> Done {
        let mut d = self.run_all(dev, vec![req]);
        d.pop().expect("one result")
    }

    /// Reads `sectors` from `sector`, which must succeed.
    #[track_caller]
    pub fn read(&self, dev: &Arc<dyn BlockDevice>, sector: u64, sectors: u64) -> Vec<u8> {
        let d = self.run(dev, Req::read(sector, sectors));
        assert_eq!(
            d.status,
            Status::Ok,
            "read {sectors} sectors at {sector} of '{}'",
            dev.name()
        );
        d.assert_returned_intact();
        d.data
    }

    /// Writes `data` at `sector`, which must succeed.
    #[track_caller]
    pub fn write(&self, dev: &Arc<dyn BlockDevice>, sector: u64, data: Vec<u8>) {
        let n = data.len() / SECTOR;
        let d = self.run(dev, Req::write(sector, data));
        assert_eq!(
            d.status,
            Status::Ok,
            "write {n} sectors at {sector} of '{}'",
            dev.name()
        );
        d.assert_returned_intact();
    }

    /// The whole content of `dev`.
    pub fn read_all(&self, dev: &Arc<dyn BlockDevice>) -> Vec<u8> {
        self.read(dev, 0, dev.limits().sectors)
    }
}

impl Default for Tester {
    fn default() -> Tester {
        Tester::new()
    }
}

// ---------------------------------------------------------------------------
// A reactor on its own thread
// ---------------------------------------------------------------------------

type Pending = RefCell<Vec<(InFlight, Sender<Done>)>>;

/// Key of the pending-request list in the thread's reactor locals.
const PENDING_KEY: u64 = 0x7e57_0000_0001;

/// A reactor running on its own thread. The test thread hands it requests
/// (and arbitrary jobs) through the reactor's mailbox, and stays free to
/// call a mapped device's control methods.
pub struct ReactorThread {
    handle: ReactorHandle,
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

impl ReactorThread {
    /// Starts the thread and its reactor.
    pub fn spawn(name: &str) -> ReactorThread {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let st = stop.clone();
        let join = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let reactor = Reactor::new(ReactorConfig::default()).expect("reactor");
                let pending: Rc<Pending> = Rc::new(RefCell::new(Vec::new()));
                reactor.set_local(PENDING_KEY, pending.clone());
                tx.send(reactor.handle()).expect("send handle");
                reactor.run_until(|| {
                    let mut p = pending.borrow_mut();
                    let mut i = 0;
                    while i < p.len() {
                        if p[i].0.is_done() {
                            let (f, reply) = p.swap_remove(i);
                            // The test may have stopped waiting; that is fine.
                            let _ = reply.send(f.finish());
                        } else {
                            i += 1;
                        }
                    }
                    st.load(Ordering::SeqCst) && p.is_empty()
                });
            })
            .expect("spawn reactor thread");
        let handle = rx.recv().expect("reactor handle");
        ReactorThread {
            handle,
            stop,
            join: Some(join),
        }
    }

    /// Runs `f` on the reactor's thread.
    pub fn exec(&self, f: impl FnOnce(&Reactor) + Send + 'static) {
        assert!(self.handle.send(f), "reactor thread is gone");
    }

    /// Submits `req` to `dev` from the reactor's thread; the result arrives
    /// on the returned receiver once the I/O has completed.
    pub fn submit(&self, dev: &Arc<dyn BlockDevice>, req: Req) -> Receiver<Done> {
        let (tx, rx) = mpsc::channel();
        let dev = dev.clone();
        self.exec(move |r| {
            let ch = dev.open(r).expect("open channel");
            let f = submit(r, &*ch, req);
            let pending = r
                .local(PENDING_KEY)
                .and_then(|p| p.downcast::<Pending>().ok())
                .expect("pending list");
            pending.borrow_mut().push((f, tx));
        });
        rx
    }

    /// Runs `req` on `dev` and waits for the result.
    pub fn run(&self, dev: &Arc<dyn BlockDevice>, req: Req) -> Done {
        match self.submit(dev, req).recv_timeout(TIMEOUT) {
            Ok(d) => d,
            Err(e) => panic!("I/O on the reactor thread did not complete: {e}"),
        }
    }

    /// Reads `sectors` from `sector`, which must succeed.
    #[track_caller]
    pub fn read(&self, dev: &Arc<dyn BlockDevice>, sector: u64, sectors: u64) -> Vec<u8> {
        let d = self.run(dev, Req::read(sector, sectors));
        assert_eq!(
            d.status,
            Status::Ok,
            "read {sectors} sectors at {sector} of '{}'",
            dev.name()
        );
        d.assert_returned_intact();
        d.data
    }

    /// Writes `data` at `sector`, which must succeed.
    #[track_caller]
    pub fn write(&self, dev: &Arc<dyn BlockDevice>, sector: u64, data: Vec<u8>) {
        let n = data.len() / SECTOR;
        let d = self.run(dev, Req::write(sector, data));
        assert_eq!(
            d.status,
            Status::Ok,
            "write {n} sectors at {sector} of '{}'",
            dev.name()
        );
        d.assert_returned_intact();
    }
}

impl Drop for ReactorThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.wake();
        if let Some(j) = self.join.take() {
            // Do not turn a failing test's panic into an abort.
            if j.join().is_err() && !std::thread::panicking() {
                panic!("reactor thread panicked");
            }
        }
    }
}

/// Polls `cond` until it holds, failing after [`TIMEOUT`].
#[track_caller]
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
