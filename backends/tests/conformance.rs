//! The conformance suite every backend must pass: [`conformance`] takes a
//! device factory and runs each check against a fresh device, on its own
//! reactor. It is run below against ram, null (with and without a delay),
//! and the file backend in each of its modes (O_DIRECT, buffered, SQPOLL,
//! registered buffers) on `/dev/shm` temp files; the file backend's open-time
//! errors have their own tests at the end.
//!
//! Every I/O is checked to complete exactly once, never inside `submit`, and
//! every wait is guarded by a watchdog, so a lost completion or wake-up fails
//! the test instead of hanging it.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

use std::cell::Cell;
use std::io::Write;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use udm_backends::{AlignedBuf, FileDevice, FileOpts, NullDevice, RamDevice};
use udm_core::{
    Bio, BioFlags, BioPtr, BlockDevice, Caps, Channel, CompletionMode, ErrorKind, Op, Reactor,
    ReactorConfig, ReactorHandle, Status, SECTOR_SIZE,
};

/// Size of every device under test.
const DEV_BYTES: u64 = 16 << 20;
/// Size of the registered buffer in fixed-buffer mode (holds the largest
/// single-segment I/O and both halves of the largest in-flight batch).
const FIXED_BYTES: usize = 4 << 20;
/// What a read buffer holds before the read: a read must overwrite it (or, on
/// null, leave it exactly as it is).
const POISON: u8 = 0xA5;
/// How long any single wait may take before the test fails.
const TIMEOUT: Duration = Duration::from_secs(30);
const SECTOR: usize = SECTOR_SIZE as usize;

// ---------------------------------------------------------------------------
// Temp files and the watchdog.

static TEMP_SEQ: AtomicUsize = AtomicUsize::new(0);
/// Live temp files, for `timed_out` to remove before it aborts.
static TEMP_LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A unique path under /dev/shm, removed (if it exists) on drop.
struct TempFile {
    path: String,
}

impl TempFile {
    fn new(tag: &str) -> TempFile {
        let path = format!(
            "/dev/shm/udm-conformance-{}-{}-{tag}",
            std::process::id(),
            TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let _ = std::fs::remove_file(&path);
        TEMP_LIVE.lock().unwrap().push(path.clone());
        TempFile { path }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Ok(mut live) = TEMP_LIVE.lock() {
            live.retain(|p| *p != self.path);
        }
    }
}

/// Wakes a reactor (over and over) once an armed deadline has passed, so a
/// reactor asleep waiting for a completion that never comes returns to its
/// `run_until` check, which then fails the test. It never wakes the reactor
/// before the deadline, so it cannot hide a lost wake-up.
struct Watchdog {
    deadline: Arc<Mutex<Option<Instant>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    fn new(handle: ReactorHandle) -> Watchdog {
        let deadline = Arc::new(Mutex::new(None::<Instant>));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (deadline.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_millis(50));
                let due = d.lock().unwrap().is_some_and(|t| Instant::now() >= t);
                if due {
                    handle.wake();
                }
            }
        });
        Watchdog {
            deadline,
            stop,
            thread: Some(thread),
        }
    }

    fn arm(&self) -> Instant {
        let t = Instant::now() + TIMEOUT;
        *self.deadline.lock().unwrap() = Some(t);
        t
    }

    fn disarm(&self) {
        *self.deadline.lock().unwrap() = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// A wait timed out. I/O may still be in flight into buffers the unwinding
/// stack would free, so abort rather than panic (removing the temp files
/// first, since no destructor will).
/// (Written to stderr directly: the test harness does not capture that, and
/// would lose what it captured when the process aborts.)
fn timed_out(what: &str) -> ! {
    let _ = writeln!(std::io::stderr(), "TIMEOUT after {TIMEOUT:?}: {what}");
    if let Ok(live) = TEMP_LIVE.try_lock() {
        for p in live.iter() {
            let _ = std::fs::remove_file(p);
        }
    }
    std::process::abort();
}

// ---------------------------------------------------------------------------
// Completion records.

/// What the suite's end_io saw for one bio.
#[derive(Default)]
struct Done {
    calls: Cell<u32>,
    status: Cell<Option<Status>>,
    at: Cell<Option<Instant>>,
}

impl Done {
    fn status(&self) -> Status {
        self.status.get().expect("not completed")
    }
}

fn done_slots(n: usize) -> Box<[Done]> {
    (0..n).map(|_| Done::default()).collect()
}

fn record(bio: BioPtr) {
    // SAFETY: every bio this suite submits carries a pointer to a `Done` as
    // its private, and the submitter keeps that `Done` alive until it has seen
    // the completion (Harness::wait).
    let d = unsafe { &*(bio.private() as *const Done) };
    d.calls.set(d.calls.get() + 1);
    d.status.set(Some(bio.status()));
    d.at.set(Some(Instant::now()));
}

// ---------------------------------------------------------------------------
// Data patterns.

/// Deterministic, seed- and position-dependent bytes for `[dev_off, dev_off+len)`.
fn pattern(seed: u64, dev_off: u64, len: usize) -> Vec<u8> {
    assert!(dev_off.is_multiple_of(8) && len.is_multiple_of(8));
    let mut v = vec![0u8; len];
    for (i, w) in v.chunks_exact_mut(8).enumerate() {
        let x = (dev_off / 8 + i as u64)
            .wrapping_add(seed.wrapping_mul(0xD1B5_4A32_D192_ED03))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        w.copy_from_slice(&(x ^ (x >> 29) ^ seed).to_le_bytes());
    }
    v
}

#[track_caller]
fn assert_same(label: &str, what: &str, dev_off: u64, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{label}: {what}: length");
    if got != want {
        let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
        panic!(
            "{label}: {what}: data differs at device byte {} (sector {}): got {:#04x}, want {:#04x}",
            dev_off + i as u64,
            (dev_off + i as u64) / SECTOR_SIZE,
            got[i],
            want[i]
        );
    }
}

// ---------------------------------------------------------------------------
// The harness: one device, one reactor, one channel.

/// A device to test, as a factory makes it.
struct Fixture {
    dev: Arc<dyn BlockDevice>,
    /// Route single-segment I/O through a buffer registered with the reactor
    /// (`buf_index` set).
    fixed_buffers: bool,
    /// The backing file, for file devices (removed on drop).
    file: Option<TempFile>,
}

/// What a backend promises.
#[derive(Clone, Copy)]
struct Expect {
    label: &'static str,
    bytes: u64,
    /// Reads return what was written (false for null: data checks are
    /// skipped, and reads must leave buffers untouched instead).
    stores_data: bool,
    /// Discard leaves zeroes behind (as write-zeroes always must).
    discard_zeroes: bool,
    persistent: bool,
    /// Every I/O takes at least this long (null with delay=).
    min_latency: Option<Duration>,
}

struct Fixed {
    ptr: *mut u8,
    index: u16,
    _buf: AlignedBuf,
}

/// Field order is drop order: the channel goes first, the watchdog is
/// joined, then the reactor finishes and drops, and only then are the
/// registered buffer and the backing file released.
struct Harness {
    label: &'static str,
    ch: Rc<dyn Channel>,
    dev: Arc<dyn BlockDevice>,
    dog: Watchdog,
    reactor: Reactor,
    fixed: Option<Fixed>,
    file: Option<TempFile>,
}

impl Harness {
    fn new(label: &'static str, fx: Fixture, config: ReactorConfig) -> Harness {
        let reactor = Reactor::new(config).unwrap();
        let fixed = fx.fixed_buffers.then(|| {
            let mut buf = AlignedBuf::new(FIXED_BYTES);
            let ptr = buf.as_mut_ptr();
            // SAFETY: the buffer is owned by the harness, whose field order
            // drops it only after the reactor.
            let index = unsafe { reactor.register_buffer(ptr, FIXED_BYTES) }
                .unwrap_or_else(|| panic!("{label}: register_buffer refused"));
            Fixed {
                ptr,
                index,
                _buf: buf,
            }
        });
        let ch = fx.dev.clone().open(&reactor).unwrap();
        let dog = Watchdog::new(reactor.handle());
        Harness {
            label,
            ch,
            dev: fx.dev,
            dog,
            reactor,
            fixed,
            file: fx.file,
        }
    }

    fn sectors(&self) -> u64 {
        self.dev.limits().sectors
    }

    /// Submits `bio`, to complete into `done`; checks it did not complete
    /// inside the call.
    fn submit(&self, mut bio: BioPtr, done: &Done) {
        bio.set_end_io(record, done as *const Done as *mut ());
        self.ch.submit(bio);
        assert_eq!(
            done.calls.get(),
            0,
            "{}: a bio completed inside submit",
            self.label
        );
    }

    /// Runs the reactor until every one of `dones` has completed, then a few
    /// more turns, and checks each completed exactly once and no descriptor
    /// is left allocated.
    fn wait(&self, dones: &[Done]) {
        let deadline = self.dog.arm();
        self.reactor.run_until(|| {
            if Instant::now() > deadline {
                let n = dones.iter().filter(|d| d.calls.get() == 0).count();
                timed_out(&format!(
                    "{} ({:?} mode, ring_entries {}): {n} of {} I/Os",
                    self.label,
                    self.reactor.config().mode,
                    self.reactor.config().ring_entries,
                    dones.len()
                ));
            }
            dones.iter().all(|d| d.calls.get() > 0)
        });
        self.dog.disarm();
        for _ in 0..3 {
            self.reactor.poll_once();
        }
        for (i, d) in dones.iter().enumerate() {
            assert_eq!(
                d.calls.get(),
                1,
                "{}: I/O {i} completed {} times",
                self.label,
                d.calls.get()
            );
        }
        assert_eq!(
            self.reactor.outstanding(),
            0,
            "{}: descriptors left allocated after completion",
            self.label
        );
    }

    fn exec(&self, bio: BioPtr) -> Status {
        let done = Done::default();
        self.submit(bio, &done);
        self.wait(std::slice::from_ref(&done));
        done.status()
    }

    fn bio(&self, op: Op, flags: BioFlags, sector: u64) -> BioPtr {
        let mut bio = self.reactor.alloc_bio();
        bio.op = op;
        bio.flags = flags;
        bio.sector = sector;
        bio
    }

    /// A bio over `segs`, in order; checks the descriptor kept them all.
    fn rw_segs(&self, op: Op, flags: BioFlags, sector: u64, segs: &mut [&mut [u8]]) -> Status {
        let mut bio = self.bio(op, flags, sector);
        for s in segs.iter_mut() {
            // SAFETY: each slice is borrowed mutably for this whole call,
            // which waits for the bio to complete.
            unsafe { bio.add_seg(s.as_mut_ptr(), s.len()) };
        }
        assert_eq!(
            bio.segs().len(),
            segs.len(),
            "{}: segment count",
            self.label
        );
        for (i, (got, want)) in bio.segs().iter().zip(segs.iter()).enumerate() {
            assert!(
                std::ptr::eq(got.base, want.as_ptr()) && got.len == want.len(),
                "{}: segment {i} of {} not kept",
                self.label,
                segs.len()
            );
        }
        let total: usize = segs.iter().map(|s| s.len()).sum();
        assert_eq!(bio.len() as usize, total, "{}: bio length", self.label);
        self.exec(bio)
    }

    /// A single-segment I/O of `len` bytes whose buffer `prepare` fills
    /// first and `finish` reads afterwards; in fixed-buffer mode the buffer
    /// is the registered one (when `len` fits) and the bio says so.
    fn rw_one(
        &self,
        op: Op,
        flags: BioFlags,
        sector: u64,
        len: usize,
        prepare: impl FnOnce(&mut [u8]),
        finish: impl FnOnce(&[u8]),
    ) -> Status {
        let mut own;
        let (ptr, index) = match &self.fixed {
            Some(f) if len <= FIXED_BYTES => (f.ptr, f.index),
            _ => {
                own = AlignedBuf::new(len);
                (own.as_mut_ptr(), Bio::NO_BUF)
            }
        };
        // SAFETY: `ptr` is the start of at least `len` bytes owned by this
        // harness (the registered buffer) or by `own`, both live for this
        // call; nothing else uses them while no I/O is in flight.
        prepare(unsafe { std::slice::from_raw_parts_mut(ptr, len) });
        let mut bio = self.bio(op, flags, sector);
        // SAFETY: as above; `exec` waits for the bio to complete.
        unsafe { bio.add_seg(ptr, len) };
        bio.buf_index = index;
        let st = self.exec(bio);
        // SAFETY: as above; the I/O has completed.
        finish(unsafe { std::slice::from_raw_parts(ptr, len) });
        st
    }

    fn write_flags(&self, sector: u64, data: &[u8], flags: BioFlags) -> Status {
        self.rw_one(
            Op::Write,
            flags,
            sector,
            data.len(),
            |b| b.copy_from_slice(data),
            |_| {},
        )
    }

    fn write(&self, sector: u64, data: &[u8]) -> Status {
        self.write_flags(sector, data, BioFlags::NONE)
    }

    /// Reads into a poisoned buffer.
    fn read(&self, sector: u64, len: usize) -> (Status, Vec<u8>) {
        let mut out = Vec::new();
        let st = self.rw_one(
            Op::Read,
            BioFlags::NONE,
            sector,
            len,
            |b| b.fill(POISON),
            |b| out = b.to_vec(),
        );
        (st, out)
    }

    fn dataless(&self, op: Op, flags: BioFlags, sector: u64, len: u32) -> Status {
        let mut bio = self.bio(op, flags, sector);
        bio.set_dataless(op, sector, len);
        self.exec(bio)
    }
}

/// The expected contents of a device, kept alongside it.
struct Shadow {
    data: Vec<u8>,
    seed: u64,
}

impl Shadow {
    fn new(bytes: u64) -> Shadow {
        Shadow {
            data: vec![0; bytes as usize],
            seed: 1,
        }
    }

    /// A fresh pattern for `[sector, +len)`, recorded as written.
    fn next(&mut self, sector: u64, len: usize) -> Vec<u8> {
        self.seed += 1;
        let off = sector * SECTOR_SIZE;
        let p = pattern(self.seed, off, len);
        self.data[off as usize..off as usize + len].copy_from_slice(&p);
        p
    }

    fn zero(&mut self, sector: u64, len: usize) {
        let off = (sector * SECTOR_SIZE) as usize;
        self.data[off..off + len].fill(0);
    }

    fn range(&self, sector: u64, len: usize) -> &[u8] {
        let off = (sector * SECTOR_SIZE) as usize;
        &self.data[off..off + len]
    }
}

/// Reads `[sector, +len)` and checks it against the shadow (or, on a device
/// that stores nothing, that the buffer was left untouched).
#[track_caller]
fn verify(h: &Harness, e: &Expect, shadow: &Shadow, sector: u64, len: usize, what: &str) {
    let (st, got) = h.read(sector, len);
    assert_eq!(st, Status::Ok, "{}: {what}: read {sector}+{len}", e.label);
    if e.stores_data {
        let want = shadow.range(sector, len);
        assert_same(e.label, what, sector * SECTOR_SIZE, &got, want);
    } else {
        assert!(
            got.iter().all(|&b| b == POISON),
            "{}: {what}: a read of a device that stores nothing changed the buffer",
            e.label
        );
    }
}

/// Reads the whole device in 1 MiB pieces and checks it against the shadow;
/// for a file device, also checks the backing file holds the same bytes at
/// the same offsets.
fn verify_all(h: &Harness, e: &Expect, shadow: &Shadow, what: &str) {
    let chunk = 1 << 20;
    let bytes = e.bytes as usize;
    let mut pos = 0;
    while pos < bytes {
        let n = chunk.min(bytes - pos);
        verify(h, e, shadow, (pos / SECTOR) as u64, n, what);
        pos += n;
    }
    if let (Some(f), true) = (&h.file, e.stores_data) {
        let on_disk = std::fs::read(&f.path).unwrap();
        assert_same(
            e.label,
            &format!("{what} (backing file)"),
            0,
            &on_disk,
            &shadow.data,
        );
    }
}

// ---------------------------------------------------------------------------
// The suite.

/// Runs every check against fresh devices from `make`, which the suite calls
/// once per check (and once per reactor configuration for the in-flight one).
fn conformance(make: impl Fn() -> Fixture, e: Expect) {
    let t0 = Instant::now();
    let fresh = |config: ReactorConfig| Harness::new(e.label, make(), config);
    let dflt = ReactorConfig::default;

    check_limits_and_caps(&fresh(dflt()), &e);
    check_unwritten_reads(&fresh(dflt()), &e);
    check_patterns(&fresh(dflt()), &e);
    check_multi_segment(&fresh(dflt()), &e);
    check_discard_and_write_zeroes(&fresh(dflt()), &e);
    check_flush_fua_preflush(&fresh(dflt()), &e);
    check_invalid(&fresh(dflt()), &e);
    for mode in [
        CompletionMode::Interrupt,
        CompletionMode::Poll,
        CompletionMode::Hybrid,
        CompletionMode::Adaptive,
    ] {
        let config = ReactorConfig { mode, ..dflt() };
        check_in_flight(&fresh(config), &e, 128);
        // A ring much smaller than the batch: the SQ backlog fills and the
        // CQ overflows.
        let small = ReactorConfig {
            mode,
            ring_entries: 16,
            ..dflt()
        };
        check_in_flight(&fresh(small), &e, 256);
    }
    let h = fresh(dflt());
    if h.fixed.is_some() {
        check_fixed_buffer_is_used(&h, &e);
    }
    eprintln!("{}: conformance passed in {:?}", e.label, t0.elapsed());
}

fn check_limits_and_caps(h: &Harness, e: &Expect) {
    let l = h.dev.limits();
    let label = e.label;
    assert_eq!(l.bytes(), e.bytes, "{label}: size");
    assert_eq!(l.sectors, e.bytes / SECTOR_SIZE, "{label}: sectors");
    let lbs = l.logical_block_size;
    assert!(lbs >= 512 && lbs.is_power_of_two(), "{label}: lbs {lbs}");
    assert!(
        l.physical_block_size >= lbs && l.physical_block_size.is_power_of_two(),
        "{label}: pbs {}",
        l.physical_block_size
    );
    assert!(
        l.max_io_bytes >= lbs && l.max_io_bytes.is_multiple_of(lbs),
        "{label}: max_io_bytes {}",
        l.max_io_bytes
    );
    assert!(l.max_segments >= 1, "{label}: max_segments");
    assert!(l.io_opt.is_multiple_of(lbs), "{label}: io_opt {}", l.io_opt);
    assert!(
        (l.sectors * SECTOR_SIZE).is_multiple_of(lbs as u64),
        "{label}: size not a multiple of the logical block size"
    );

    let c = h.dev.caps();
    for (cap, name) in [
        (Caps::FLUSH, "FLUSH"),
        (Caps::FUA, "FUA"),
        (Caps::DISCARD, "DISCARD"),
        (Caps::WRITE_ZEROES, "WRITE_ZEROES"),
    ] {
        assert!(c.contains(cap), "{label}: caps {c:?} lack {name}");
    }
    assert!(!c.contains(Caps::READ_ONLY), "{label}: read-only");
    assert!(!c.contains(Caps::POLL), "{label}: claims POLL");
    assert_eq!(
        c.contains(Caps::PERSISTENT),
        e.persistent,
        "{label}: PERSISTENT in {c:?}"
    );
    for op in [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes] {
        assert!(c.supports(op), "{label}: does not support {}", op.name());
    }
    assert!(!h.dev.name().is_empty(), "{label}: no name");
    // The limits are stable.
    assert_eq!(h.dev.limits(), l, "{label}: limits changed");
    assert!(h.dev.caps() == c, "{label}: caps changed");
}

fn check_unwritten_reads(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let shadow = Shadow::new(e.bytes);
    for (sector, len) in [
        (0, 4096),
        (1, 512),
        (sectors / 2 + 3, 1 << 20),
        (sectors - 1, 512),
        (sectors - 128, 64 << 10),
    ] {
        verify(h, e, &shadow, sector, len, "read of never-written space");
    }
    // Multi-segment reads of never-written space too.
    let mut bufs: Vec<AlignedBuf> = [512, 4096, 1024, 512, 2048, 512]
        .iter()
        .map(|&n| AlignedBuf::new(n))
        .collect();
    for b in bufs.iter_mut() {
        b.as_mut_slice().fill(POISON);
    }
    let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let st = h.rw_segs(Op::Read, BioFlags::NONE, 100, &mut segs);
    assert_eq!(st, Status::Ok, "{}: multi-segment read", e.label);
    let want = if e.stores_data { 0 } else { POISON };
    for s in &segs {
        assert!(
            s.iter().all(|&b| b == want),
            "{}: multi-segment read of never-written space: expected {want:#04x}s",
            e.label
        );
    }
}

fn check_patterns(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let mut shadow = Shadow::new(e.bytes);
    let lens = [512usize, 1024, 1536, 4096, 4608, 65536 + 512, 1 << 20];
    let starts = [0u64, 1, 7, 8, 9, 63, 127, 1000, 4095, 8191, sectors / 2 + 3];
    for &len in &lens {
        let n = (len / SECTOR) as u64;
        // Aligned and unaligned starts, plus one ending exactly at the end.
        for sector in starts.iter().copied().chain([sectors - n]) {
            if sector + n > sectors {
                continue;
            }
            let data = shadow.next(sector, len);
            let st = h.write(sector, &data);
            assert_eq!(st, Status::Ok, "{}: write {sector}+{len}", e.label);
            verify(h, e, &shadow, sector, len, "read back");
        }
    }
    // Overlapping rewrites: the newest data wins, the rest stays.
    for (sector, len) in [(10u64, 8192usize), (14, 512), (12, 4096), (9, 1024)] {
        let data = shadow.next(sector, len);
        assert_eq!(h.write(sector, &data), Status::Ok, "{}: rewrite", e.label);
    }
    verify(h, e, &shadow, 0, 64 << 10, "after overlapping rewrites");
    // Reads at offsets and lengths other than the writes'.
    for (sector, len) in [(3u64, 2048usize), (62, 1536), (8190, 4096), (1001, 65536)] {
        verify(h, e, &shadow, sector, len, "read across writes");
    }
    verify_all(h, e, &shadow, "whole device after pattern writes");
}

fn check_multi_segment(h: &Harness, e: &Expect) {
    let mut shadow = Shadow::new(e.bytes);
    // Segment lengths in sectors: up to and past the inline capacity (4),
    // so the descriptor's segment vector spills to the heap.
    let layouts: [&[usize]; 8] = [
        &[1, 1],
        &[1, 2, 3],
        &[8, 8, 8, 8],
        &[1, 1, 1, 1, 1],
        &[8, 1, 2, 16, 1, 4],
        &[8, 1, 2, 16, 1, 4, 8, 3],
        &[1, 3, 1, 5, 1, 7, 1, 9, 1, 2, 1, 4, 1, 6, 1, 8, 2],
        &[128, 64, 32, 16, 8, 4, 2, 1, 1, 2, 4, 8, 16, 32, 64, 128],
    ];
    let mut sector = 64u64;
    for (li, layout) in layouts.iter().enumerate() {
        let total: usize = layout.iter().sum::<usize>() * SECTOR;
        let data = shadow.next(sector, total);

        // Multi-segment write, each segment its own allocation.
        let mut bufs: Vec<AlignedBuf> = layout
            .iter()
            .map(|&n| AlignedBuf::new(n * SECTOR))
            .collect();
        let mut pos = 0;
        for b in bufs.iter_mut() {
            let n = b.as_slice().len();
            b.as_mut_slice().copy_from_slice(&data[pos..pos + n]);
            pos += n;
        }
        let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let st = h.rw_segs(Op::Write, BioFlags::NONE, sector, &mut segs);
        assert_eq!(
            st,
            Status::Ok,
            "{}: {}-segment write",
            e.label,
            layout.len()
        );
        // Read back as one segment.
        verify(
            h,
            e,
            &shadow,
            sector,
            total,
            "single-segment read of a multi-segment write",
        );

        // Read back through a different multi-segment layout.
        let other = layouts[(li + 3) % layouts.len()];
        let mut rbufs = Vec::new();
        let mut left = total / SECTOR;
        for &n in other.iter().cycle() {
            if left == 0 {
                break;
            }
            let n = n.min(left);
            let mut b = AlignedBuf::new(n * SECTOR);
            b.as_mut_slice().fill(POISON);
            rbufs.push(b);
            left -= n;
        }
        let mut rsegs: Vec<&mut [u8]> = rbufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let st = h.rw_segs(Op::Read, BioFlags::NONE, sector, &mut rsegs);
        assert_eq!(st, Status::Ok, "{}: {}-segment read", e.label, rsegs.len());
        let got: Vec<u8> = rsegs.iter().flat_map(|s| s.iter().copied()).collect();
        if e.stores_data {
            assert_same(
                e.label,
                &format!(
                    "{}-segment read of a {}-segment write",
                    rsegs.len(),
                    layout.len()
                ),
                sector * SECTOR_SIZE,
                &got,
                &data,
            );
        } else {
            assert!(
                got.iter().all(|&b| b == POISON),
                "{}: null read touched data",
                e.label
            );
        }
        sector += (total / SECTOR) as u64 + 5;
    }

    // As many segments as the device allows in one bio.
    let max = (h.dev.limits().max_segments as usize).min(1024);
    let sector = h.sectors() / 2;
    let data = shadow.next(sector, max * SECTOR);
    let mut big = AlignedBuf::new(max * SECTOR * 2);
    // Every other sector of `big`: segments that are not contiguous.
    for (i, chunk) in data.chunks(SECTOR).enumerate() {
        big.as_mut_slice()[2 * i * SECTOR..(2 * i + 1) * SECTOR].copy_from_slice(chunk);
    }
    let mut segs: Vec<&mut [u8]> = big.as_mut_slice().chunks_mut(SECTOR).step_by(2).collect();
    assert_eq!(segs.len(), max);
    let st = h.rw_segs(Op::Write, BioFlags::NONE, sector, &mut segs);
    assert_eq!(
        st,
        Status::Ok,
        "{}: write of max_segments ({max}) segments",
        e.label
    );
    verify(
        h,
        e,
        &shadow,
        sector,
        max * SECTOR,
        "read of a max_segments write",
    );
    verify_all(h, e, &shadow, "whole device after multi-segment writes");
}

fn check_discard_and_write_zeroes(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let mut shadow = Shadow::new(e.bytes);
    // Fill the first 2 MiB and the last 256 KiB with data.
    for (sector, len) in [(0u64, 2usize << 20), (sectors - 512, 256 << 10)] {
        let data = shadow.next(sector, len);
        assert_eq!(h.write(sector, &data), Status::Ok, "{}: fill", e.label);
    }
    let cases: [(Op, u64, u32); 10] = [
        (Op::Discard, 8, 4096),               // page-aligned
        (Op::Discard, 3, 5 * 512),            // sector-granular, unaligned
        (Op::Discard, 1024, 256 << 10),       // large
        (Op::WriteZeroes, 40, 4096),          // page-aligned
        (Op::WriteZeroes, 51, 3 * 512),       // sector-granular, unaligned
        (Op::WriteZeroes, 2048, 512 << 10),   // large
        (Op::WriteZeroes, sectors - 1, 512),  // the last sector
        (Op::Discard, sectors - 20, 8 * 512), // near the end
        (Op::WriteZeroes, 8192, 4 << 20),     // never written
        (Op::Discard, 20000, 1 << 20),        // never written
    ];
    for (op, sector, len) in cases {
        let st = h.dataless(op, BioFlags::NONE, sector, len);
        assert_eq!(st, Status::Ok, "{}: {} {sector}+{len}", e.label, op.name());
        if op == Op::WriteZeroes || e.discard_zeroes {
            shadow.zero(sector, len as usize);
            // The range reads as zeroes, and its neighbours are intact.
            let from = sector.saturating_sub(16);
            let to = (sector + len as u64 / SECTOR_SIZE + 16).min(sectors);
            verify(
                h,
                e,
                &shadow,
                from,
                ((to - from) * SECTOR_SIZE) as usize,
                &format!("read after {} {sector}+{len}", op.name()),
            );
        }
    }
    // A zeroed or discarded range takes new data again.
    for sector in [8u64, 3, 40] {
        let data = shadow.next(sector, 4096);
        assert_eq!(h.write(sector, &data), Status::Ok, "{}: rewrite", e.label);
        verify(h, e, &shadow, sector, 4096, "rewrite after discard/zeroes");
    }
    if e.discard_zeroes {
        verify_all(h, e, &shadow, "whole device after discard and write-zeroes");
    }
}

fn check_flush_fua_preflush(h: &Harness, e: &Expect) {
    let mut shadow = Shadow::new(e.bytes);
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::NONE, 0, 0),
        Status::Ok,
        "{}: flush of an idle device",
        e.label
    );
    let data = shadow.next(0, 8192);
    assert_eq!(h.write(0, &data), Status::Ok);
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::NONE, 0, 0),
        Status::Ok,
        "{}: flush",
        e.label
    );
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::PREFLUSH, 0, 0),
        Status::Ok,
        "{}: flush with PREFLUSH",
        e.label
    );
    for (i, flags) in [
        BioFlags::FUA,
        BioFlags::PREFLUSH,
        BioFlags::PREFLUSH | BioFlags::FUA,
    ]
    .into_iter()
    .enumerate()
    {
        let sector = 100 + 50 * i as u64;
        let data = shadow.next(sector, 16 << 10);
        let st = h.write_flags(sector, &data, flags);
        assert_eq!(st, Status::Ok, "{}: write with {flags:?}", e.label);
        verify(
            h,
            e,
            &shadow,
            sector,
            16 << 10,
            &format!("read after a {flags:?} write"),
        );
        // The same flags on a multi-segment write.
        let sector = sector + 40;
        let data = shadow.next(sector, 6 * 1024);
        let mut bufs: Vec<AlignedBuf> = (0..6).map(|_| AlignedBuf::new(1024)).collect();
        for (b, d) in bufs.iter_mut().zip(data.chunks(1024)) {
            b.as_mut_slice().copy_from_slice(d);
        }
        let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let st = h.rw_segs(Op::Write, flags, sector, &mut segs);
        assert_eq!(
            st,
            Status::Ok,
            "{}: 6-segment write with {flags:?}",
            e.label
        );
        verify(
            h,
            e,
            &shadow,
            sector,
            6 * 1024,
            &format!("read after a 6-segment {flags:?} write"),
        );
    }

    // Many flushes and flagged writes in flight together.
    let n = 32;
    let mut bufs = AlignedBuf::new(n * 4096);
    let mut datas = Vec::new();
    for i in 0..n {
        let sector = 1000 + 8 * i as u64;
        let d = shadow.next(sector, 4096);
        bufs.as_mut_slice()[i * 4096..(i + 1) * 4096].copy_from_slice(&d);
        datas.push(sector);
    }
    let dones = done_slots(2 * n);
    let base = bufs.as_mut_ptr();
    for (i, &sector) in datas.iter().enumerate() {
        let flags = match i % 3 {
            0 => BioFlags::FUA,
            1 => BioFlags::PREFLUSH,
            _ => BioFlags::PREFLUSH | BioFlags::FUA,
        };
        let mut bio = h.bio(Op::Write, flags, sector);
        // SAFETY: a distinct 4 KiB slice of `bufs`, which lives until the
        // wait below has seen every bio complete.
        unsafe { bio.add_seg(base.add(i * 4096), 4096) };
        h.submit(bio, &dones[2 * i]);
        let mut f = h.bio(Op::Flush, BioFlags::NONE, 0);
        f.set_dataless(Op::Flush, 0, 0);
        h.submit(f, &dones[2 * i + 1]);
    }
    h.wait(&dones);
    for (i, d) in dones.iter().enumerate() {
        assert_eq!(
            d.status(),
            Status::Ok,
            "{}: in-flight write/flush {i}",
            e.label
        );
    }
    verify(
        h,
        e,
        &shadow,
        1000,
        n * 4096,
        "read after flagged writes in flight",
    );
}

fn check_invalid(h: &Harness, e: &Expect) {
    let sectors = h.sectors();
    let l = h.dev.limits();
    let lbs = l.logical_block_size as usize;
    let shadow = Shadow::new(e.bytes);
    let label = e.label;
    let inval = |st: Status, what: &str| {
        assert_eq!(
            st,
            Status::Inval,
            "{label}: {what} must complete with Inval"
        );
    };
    let mut buf = AlignedBuf::new(64 << 10);
    buf.as_mut_slice().fill(0x3C);
    let b = buf.as_mut_slice();

    for op in [Op::Read, Op::Write] {
        let name = op.name();
        // Out of range.
        inval(
            h.rw_segs(op, BioFlags::NONE, sectors, &mut [&mut b[..512]]),
            &format!("{name} at the end"),
        );
        inval(
            h.rw_segs(op, BioFlags::NONE, sectors - 1, &mut [&mut b[..1024]]),
            &format!("{name} straddling the end"),
        );
        {
            let (x, y) = b.split_at_mut(4096);
            inval(
                h.rw_segs(
                    op,
                    BioFlags::NONE,
                    sectors - 8,
                    &mut [&mut x[..2048], &mut y[..4096]],
                ),
                &format!("multi-segment {name} straddling the end"),
            );
        }
        for far in [sectors + 1000, u64::MAX >> 9, u64::MAX - 1, u64::MAX] {
            inval(
                h.rw_segs(op, BioFlags::NONE, far, &mut [&mut b[..512]]),
                &format!("{name} at sector {far}"),
            );
        }
        // Misaligned lengths.
        inval(
            h.rw_segs(op, BioFlags::NONE, 0, &mut [&mut b[..100]]),
            &format!("100-byte {name}"),
        );
        inval(
            h.rw_segs(op, BioFlags::NONE, 0, &mut [&mut b[..lbs + 1]]),
            &format!("lbs+1-byte {name}"),
        );
        {
            let (x, y) = b.split_at_mut(1024);
            inval(
                h.rw_segs(op, BioFlags::NONE, 0, &mut [&mut x[..512], &mut y[..100]]),
                &format!("multi-segment {name} of 612 bytes"),
            );
        }
        // Zero length.
        inval(
            h.exec(h.bio(op, BioFlags::NONE, 0)),
            &format!("zero-length {name}"),
        );
        inval(
            h.exec(h.bio(op, BioFlags::FUA, 8)),
            &format!("zero-length FUA {name}"),
        );
        // Misaligned start, when the logical block is bigger than a sector.
        if lbs > SECTOR {
            inval(
                h.rw_segs(op, BioFlags::NONE, 1, &mut [&mut b[..lbs]]),
                &format!("{name} at a misaligned sector"),
            );
        }
    }
    // Flagged writes are checked the same way.
    inval(
        h.rw_segs(Op::Write, BioFlags::PREFLUSH, sectors, &mut [&mut b[..512]]),
        "PREFLUSH write past the end",
    );
    inval(
        h.rw_segs(Op::Write, BioFlags::FUA, sectors - 1, &mut [&mut b[..4096]]),
        "FUA write straddling the end",
    );
    for op in [Op::Discard, Op::WriteZeroes] {
        let name = op.name();
        inval(
            h.dataless(op, BioFlags::NONE, 0, 0),
            &format!("zero-length {name}"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, 0, 100),
            &format!("100-byte {name}"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, sectors, 512),
            &format!("{name} at the end"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, sectors - 1, 1024),
            &format!("{name} straddling the end"),
        );
        inval(
            h.dataless(op, BioFlags::NONE, u64::MAX, 512),
            &format!("{name} at sector u64::MAX"),
        );
    }
    // Too long for the device's limits, and too many segments.
    let max_io = l.max_io_bytes as u64;
    if max_io + lbs as u64 <= e.bytes {
        let mut big = AlignedBuf::new(max_io as usize + lbs);
        inval(
            h.rw_segs(Op::Write, BioFlags::NONE, 0, &mut [big.as_mut_slice()]),
            "write longer than max_io_bytes",
        );
        let st = h.rw_segs(
            Op::Read,
            BioFlags::NONE,
            0,
            &mut [&mut big.as_mut_slice()[..max_io as usize]],
        );
        assert_eq!(st, Status::Ok, "{label}: read of exactly max_io_bytes");
    }
    let max_segs = l.max_segments as usize;
    if max_segs < 4096 && (max_segs as u64 + 1) * SECTOR_SIZE <= e.bytes {
        let mut many = AlignedBuf::new((max_segs + 1) * SECTOR);
        let mut segs: Vec<&mut [u8]> = many.as_mut_slice().chunks_mut(SECTOR).collect();
        inval(
            h.rw_segs(Op::Write, BioFlags::NONE, 0, &mut segs),
            "write of max_segments + 1 segments",
        );
    }
    // A refused write must not have written anything: the device still reads
    // as never written (the buffer held 0x3C bytes).
    verify(
        h,
        e,
        &shadow,
        0,
        64 << 10,
        "start of the device after refused writes",
    );
    verify(
        h,
        e,
        &shadow,
        sectors - 64,
        32 << 10,
        "end of the device after refused writes",
    );
}

/// `n` writes in flight at once, then `n` reads, then a mix of both with
/// flushes; all complete exactly once, and the reads see the writes.
fn check_in_flight(h: &Harness, e: &Expect, n: usize) {
    const BS: usize = 4096;
    let label = e.label;
    let mode = h.reactor.config().mode;
    let mut shadow = Shadow::new(e.bytes);
    let mut own = AlignedBuf::new(2 * n * BS);
    let (base, index) = match &h.fixed {
        Some(f) => {
            assert!(2 * n * BS <= FIXED_BYTES);
            (f.ptr, f.index)
        }
        None => (own.as_mut_ptr(), Bio::NO_BUF),
    };
    // Block i lives at sector i * 24: spread out, with gaps.
    let sector_of = |i: usize| (i * 24) as u64;
    assert!(sector_of(n) < h.sectors());
    // SAFETY: `base` points at 2 * n * BS bytes owned by `own` or by the
    // harness's registered buffer, live for this whole function; no I/O is
    // in flight between the phases below, where these slices are used.
    let region = |k: usize| unsafe { std::slice::from_raw_parts_mut(base.add(k * BS), BS) };
    let submit_block = |op: Op, i: usize, k: usize, done: &Done| {
        let mut bio = h.bio(op, BioFlags::NONE, sector_of(i));
        // SAFETY: slot k of the region above; the caller waits for the bio
        // before the region is touched again or released.
        unsafe { bio.add_seg(base.add(k * BS), BS) };
        bio.buf_index = index;
        h.submit(bio, done);
    };
    let check_latency = |dones: &[Done], t: Instant| {
        if let Some(min) = e.min_latency {
            for d in dones {
                let took = d.at.get().unwrap() - t;
                assert!(
                    took >= min,
                    "{label}: an I/O took {took:?}, less than the delay {min:?}"
                );
            }
        }
    };

    // n writes at once.
    for i in 0..n {
        let d = shadow.next(sector_of(i), BS);
        region(i).copy_from_slice(&d);
    }
    let dones = done_slots(n);
    let t = Instant::now();
    for (i, d) in dones.iter().enumerate() {
        submit_block(Op::Write, i, i, d);
    }
    assert!(
        dones.iter().all(|d| d.calls.get() == 0),
        "{label}: completions ran before the reactor turned"
    );
    h.wait(&dones);
    check_latency(&dones, t);
    for (i, d) in dones.iter().enumerate() {
        assert_eq!(
            d.status(),
            Status::Ok,
            "{label} ({mode:?}, {n} in flight): write {i}"
        );
    }

    // n reads at once, into the other half.
    for i in 0..n {
        region(n + i).fill(POISON);
    }
    let dones = done_slots(n);
    let t = Instant::now();
    for (i, d) in dones.iter().enumerate() {
        submit_block(Op::Read, i, n + i, d);
    }
    h.wait(&dones);
    check_latency(&dones, t);
    for (i, d) in dones.iter().enumerate() {
        assert_eq!(
            d.status(),
            Status::Ok,
            "{label} ({mode:?}, {n} in flight): read {i}"
        );
        let got = region(n + i);
        if e.stores_data {
            assert_same(
                label,
                "in-flight read",
                sector_of(i) * SECTOR_SIZE,
                got,
                shadow.range(sector_of(i), BS),
            );
        } else {
            assert!(
                got.iter().all(|&b| b == POISON),
                "{label}: null read touched data"
            );
        }
    }

    // Reads of the first half and writes of the second half together, with
    // a flush every 16.
    let half = n / 2;
    for i in half..n {
        let d = shadow.next(sector_of(i), BS);
        region(i).copy_from_slice(&d);
    }
    for i in 0..half {
        region(n + i).fill(POISON);
    }
    let flushes = n.div_ceil(16);
    let dones = done_slots(n + flushes);
    for i in 0..n {
        if i < half {
            submit_block(Op::Read, i, n + i, &dones[i]);
        } else {
            submit_block(Op::Write, i, i, &dones[i]);
        }
        if i % 16 == 0 {
            let mut f = h.bio(Op::Flush, BioFlags::NONE, 0);
            f.set_dataless(Op::Flush, 0, 0);
            h.submit(f, &dones[n + i / 16]);
        }
    }
    h.wait(&dones);
    for (i, d) in dones.iter().enumerate() {
        assert_eq!(d.status(), Status::Ok, "{label} ({mode:?}): mixed I/O {i}");
    }
    for i in 0..half {
        let got = region(n + i);
        if e.stores_data {
            assert_same(
                label,
                "mixed read",
                sector_of(i) * SECTOR_SIZE,
                got,
                shadow.range(sector_of(i), BS),
            );
        }
    }
    for i in half..n {
        verify(
            h,
            e,
            &shadow,
            sector_of(i),
            BS,
            "read after mixed in-flight writes",
        );
    }
    assert!(!h.reactor.busy(), "{label}: reactor still busy");
    drop(own);
}

/// A bio that claims the registered buffer but whose segment lies outside
/// it must fail: proof that fixed-buffer I/O is really used.
fn check_fixed_buffer_is_used(h: &Harness, e: &Expect) {
    let f = h.fixed.as_ref().unwrap();
    let mut outside = AlignedBuf::new(4096);
    for op in [Op::Write, Op::Read] {
        let mut bio = h.bio(op, BioFlags::NONE, 0);
        // SAFETY: `outside` lives until exec has waited for the bio.
        unsafe { bio.add_seg(outside.as_mut_ptr(), 4096) };
        bio.buf_index = f.index;
        let st = h.exec(bio);
        assert_ne!(
            st,
            Status::Ok,
            "{}: a {} claiming registered buffer {} from outside it succeeded: fixed buffers are not used",
            e.label,
            op.name(),
            f.index
        );
    }
}

// ---------------------------------------------------------------------------
// The backends.

fn ram_expect(label: &'static str) -> Expect {
    Expect {
        label,
        bytes: DEV_BYTES,
        stores_data: true,
        discard_zeroes: true,
        persistent: false,
        min_latency: None,
    }
}

fn null_expect(label: &'static str, delay: Option<Duration>) -> Expect {
    Expect {
        label,
        bytes: DEV_BYTES,
        stores_data: false,
        discard_zeroes: false,
        persistent: false,
        min_latency: delay,
    }
}

fn file_expect(label: &'static str) -> Expect {
    Expect {
        label,
        bytes: DEV_BYTES,
        stores_data: true,
        discard_zeroes: true,
        persistent: true,
        min_latency: None,
    }
}

fn file_fixture(label: &'static str, opts: FileOpts, fixed_buffers: bool) -> Fixture {
    let file = TempFile::new(label);
    let opts = FileOpts {
        size: Some(DEV_BYTES),
        ..opts
    };
    let dev = FileDevice::open(label, &file.path, opts)
        .unwrap_or_else(|err| panic!("{label}: open {}: {err}", file.path));
    assert_eq!(dev.path(), file.path);
    Fixture {
        dev: Arc::new(dev),
        fixed_buffers,
        file: Some(file),
    }
}

#[test]
fn ram_conforms() {
    conformance(
        || Fixture {
            dev: Arc::new(RamDevice::new("ram", DEV_BYTES).unwrap()),
            fixed_buffers: false,
            file: None,
        },
        ram_expect("ram"),
    );
}

#[test]
fn null_conforms() {
    conformance(
        || Fixture {
            dev: Arc::new(NullDevice::new("null", DEV_BYTES, None).unwrap()),
            fixed_buffers: false,
            file: None,
        },
        null_expect("null", None),
    );
}

#[test]
fn null_with_delay_conforms() {
    let delay = Duration::from_micros(300);
    conformance(
        move || Fixture {
            dev: Arc::new(NullDevice::new("null-delay", DEV_BYTES, Some(delay)).unwrap()),
            fixed_buffers: false,
            file: None,
        },
        null_expect("null delay=300", Some(delay)),
    );
}

#[test]
fn file_direct_conforms() {
    conformance(
        || file_fixture("file-direct", FileOpts::default(), false),
        file_expect("file (O_DIRECT)"),
    );
}

#[test]
fn file_buffered_conforms() {
    let opts = FileOpts {
        buffered: true,
        ..FileOpts::default()
    };
    conformance(
        || file_fixture("file-buffered", opts.clone(), false),
        file_expect("file,buffered"),
    );
}

#[test]
fn file_sqpoll_conforms() {
    let opts = FileOpts {
        sqpoll: true,
        ..FileOpts::default()
    };
    conformance(
        || file_fixture("file-sqpoll", opts.clone(), false),
        file_expect("file,sqpoll"),
    );
}

#[test]
fn file_registered_buffers_conform() {
    conformance(
        || file_fixture("file-fixed", FileOpts::default(), true),
        file_expect("file + registered buffers"),
    );
}

#[test]
fn file_sqpoll_registered_buffers_conform() {
    let opts = FileOpts {
        sqpoll: true,
        ..FileOpts::default()
    };
    conformance(
        || file_fixture("file-sqpoll-fixed", opts.clone(), true),
        file_expect("file,sqpoll + registered buffers"),
    );
}

// ---------------------------------------------------------------------------
// Backend-specific behaviour.

#[test]
fn ram_allocates_only_on_write() {
    let dev = Arc::new(RamDevice::new("ram", DEV_BYTES).unwrap());
    let h = Harness::new(
        "ram alloc",
        Fixture {
            dev: dev.clone(),
            fixed_buffers: false,
            file: None,
        },
        ReactorConfig::default(),
    );
    let (st, got) = h.read(0, 1 << 20);
    assert_eq!(st, Status::Ok);
    assert!(got.iter().all(|&b| b == 0));
    assert_eq!(
        h.dataless(Op::WriteZeroes, BioFlags::NONE, 0, 1 << 20),
        Status::Ok
    );
    assert_eq!(
        h.dataless(Op::Discard, BioFlags::NONE, 0, 1 << 20),
        Status::Ok
    );
    assert_eq!(
        dev.allocated_bytes(),
        0,
        "reads, discards and zeroes allocated memory"
    );
    assert_eq!(h.write(9, &[1u8; 512]), Status::Ok);
    assert_eq!(dev.allocated_bytes(), 4096, "one sector written: one page");
    assert_eq!(h.write(7, &[2u8; 1024]), Status::Ok);
    assert_eq!(
        dev.allocated_bytes(),
        8192,
        "a write across a page boundary: two pages"
    );
}

#[test]
fn ram_and_null_refuse_sizes_under_a_sector() {
    assert_eq!(
        RamDevice::new("r", 511).err().unwrap().kind(),
        ErrorKind::Invalid
    );
    assert_eq!(
        NullDevice::new("n", 0, None).err().unwrap().kind(),
        ErrorKind::Invalid
    );
    // Sizes round down to whole sectors.
    assert_eq!(RamDevice::new("r", 1000).unwrap().limits().sectors, 1);
    assert_eq!(
        NullDevice::new("n", 4097, None).unwrap().limits().sectors,
        8
    );
}

#[test]
fn null_reads_leave_buffers_untouched_after_writes() {
    let h = Harness::new(
        "null untouched",
        Fixture {
            dev: Arc::new(NullDevice::new("null", DEV_BYTES, None).unwrap()),
            fixed_buffers: false,
            file: None,
        },
        ReactorConfig::default(),
    );
    assert_eq!(h.write(0, &pattern(7, 0, 8192)), Status::Ok);
    let mut bufs: Vec<AlignedBuf> = (0..6).map(|_| AlignedBuf::new(1024)).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        b.as_mut_slice().fill(i as u8 + 1);
    }
    let mut segs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    assert_eq!(
        h.rw_segs(Op::Read, BioFlags::NONE, 0, &mut segs),
        Status::Ok
    );
    for (i, s) in segs.iter().enumerate() {
        assert!(
            s.iter().all(|&b| b == i as u8 + 1),
            "null read changed segment {i}"
        );
    }
}

#[test]
fn file_missing_path_without_size_is_an_error_naming_the_path() {
    let f = TempFile::new("missing");
    for opts in [
        FileOpts::default(),
        FileOpts {
            buffered: true,
            ..FileOpts::default()
        },
    ] {
        let err = FileDevice::open("f", &f.path, opts)
            .err()
            .expect("opening a missing file must fail");
        let msg = err.to_string();
        assert!(msg.contains(&f.path), "error does not name the path: {msg}");
        assert!(
            matches!(err.kind(), ErrorKind::NotFound | ErrorKind::Os),
            "kind {:?}: {msg}",
            err.kind()
        );
        assert!(
            !std::path::Path::new(&f.path).exists(),
            "a file was created without size="
        );
    }
    // A missing directory, even with size=.
    let path = format!("{}-dir/x", f.path);
    let err = FileDevice::open(
        "f",
        &path,
        FileOpts {
            size: Some(1 << 20),
            ..FileOpts::default()
        },
    )
    .err()
    .expect("a file in a missing directory must fail");
    assert!(err.to_string().contains(&path), "{err}");
}

#[test]
fn file_empty_without_size_is_an_error() {
    let f = TempFile::new("empty");
    std::fs::write(&f.path, b"").unwrap();
    let err = FileDevice::open("f", &f.path, FileOpts::default())
        .err()
        .expect("an empty file must fail");
    let msg = err.to_string();
    assert!(msg.contains(&f.path) && msg.contains("size"), "{msg}");
    assert_eq!(err.kind(), ErrorKind::Invalid);
}

#[test]
fn file_iopoll_is_refused_clearly() {
    let f = TempFile::new("iopoll");
    for sqpoll in [false, true] {
        let opts = FileOpts {
            iopoll: true,
            sqpoll,
            size: Some(1 << 20),
            ..FileOpts::default()
        };
        let t = Instant::now();
        let err = FileDevice::open("f", &f.path, opts)
            .err()
            .expect("iopoll on /dev/shm must fail");
        let msg = err.to_string();
        assert!(
            msg.contains("does not support polled I/O"),
            "sqpoll={sqpoll}: {msg}"
        );
        assert!(msg.contains(&f.path), "sqpoll={sqpoll}: {msg}");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "sqpoll={sqpoll}: {msg}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the iopoll probe took {:?}",
            t.elapsed()
        );
    }
    // iopoll needs O_DIRECT.
    let err = FileDevice::open(
        "f",
        &f.path,
        FileOpts {
            iopoll: true,
            buffered: true,
            ..FileOpts::default()
        },
    )
    .err()
    .expect("iopoll with buffered must fail");
    assert!(err.to_string().contains("O_DIRECT"), "{err}");
    assert_eq!(err.kind(), ErrorKind::Invalid);
}

#[test]
fn file_created_with_size_has_that_size() {
    for (size, sectors) in [(3u64 << 20, 6144u64), (1 << 30, 2 << 20), (1000, 1)] {
        let f = TempFile::new("create");
        let dev = FileDevice::open(
            "f",
            &f.path,
            FileOpts {
                size: Some(size),
                ..FileOpts::default()
            },
        )
        .unwrap();
        assert_eq!(
            std::fs::metadata(&f.path).unwrap().len(),
            size,
            "file length"
        );
        assert_eq!(
            dev.limits().sectors,
            sectors,
            "device sectors for size {size}"
        );
        // Reopening without size= finds the same size.
        drop(dev);
        let dev = FileDevice::open("f", &f.path, FileOpts::default()).unwrap();
        assert_eq!(dev.limits().sectors, sectors, "reopened without size");
    }
    // A size smaller than an existing file uses only that much of it.
    let f = TempFile::new("shrink");
    std::fs::write(&f.path, vec![7u8; 1 << 20]).unwrap();
    let dev = FileDevice::open(
        "f",
        &f.path,
        FileOpts {
            size: Some(64 << 10),
            ..FileOpts::default()
        },
    )
    .unwrap();
    assert_eq!(dev.limits().bytes(), 64 << 10);
    assert_eq!(
        std::fs::metadata(&f.path).unwrap().len(),
        1 << 20,
        "file truncated"
    );
}

#[test]
fn file_read_only_refuses_writes_and_reads_data() {
    let f = TempFile::new("ro");
    let data = pattern(42, 0, 64 << 10);
    std::fs::write(&f.path, &data).unwrap();
    let dev = FileDevice::open(
        "ro",
        &f.path,
        FileOpts {
            read_only: true,
            ..FileOpts::default()
        },
    )
    .unwrap();
    assert!(dev.caps().contains(Caps::READ_ONLY));
    let h = Harness::new(
        "file,ro",
        Fixture {
            dev: Arc::new(dev),
            fixed_buffers: false,
            file: None,
        },
        ReactorConfig::default(),
    );
    let (st, got) = h.read(0, 64 << 10);
    assert_eq!(st, Status::Ok);
    assert_same("file,ro", "read", 0, &got, &data);
    assert_eq!(
        h.write(0, &[0u8; 512]),
        Status::Inval,
        "write to a read-only file"
    );
    assert_eq!(
        h.dataless(Op::Discard, BioFlags::NONE, 0, 512),
        Status::Inval
    );
    assert_eq!(
        h.dataless(Op::WriteZeroes, BioFlags::NONE, 0, 512),
        Status::Inval
    );
    assert_eq!(
        h.dataless(Op::Flush, BioFlags::NONE, 0, 0),
        Status::Ok,
        "flush of a read-only file"
    );
    assert_eq!(std::fs::read(&f.path).unwrap(), data, "the file changed");
}

#[test]
fn file_data_persists_across_reopen() {
    let f = TempFile::new("persist");
    let opts = FileOpts {
        size: Some(1 << 20),
        ..FileOpts::default()
    };
    let data = pattern(9, 4096, 8192);
    {
        let h = Harness::new(
            "persist",
            Fixture {
                dev: Arc::new(FileDevice::open("p", &f.path, opts.clone()).unwrap()),
                fixed_buffers: false,
                file: None,
            },
            ReactorConfig::default(),
        );
        assert_eq!(h.write_flags(8, &data, BioFlags::FUA), Status::Ok);
    }
    let h = Harness::new(
        "persist",
        Fixture {
            dev: Arc::new(FileDevice::open("p", &f.path, opts).unwrap()),
            fixed_buffers: false,
            file: None,
        },
        ReactorConfig::default(),
    );
    let (st, got) = h.read(8, 8192);
    assert_eq!(st, Status::Ok);
    assert_same("persist", "after reopen", 4096, &got, &data);
}
