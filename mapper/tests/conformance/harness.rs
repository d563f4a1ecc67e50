//! The conformance suite's harness: one device on one reactor with one
//! channel, a watchdog so that a lost completion fails instead of hanging,
//! completion records, and the shadow copy reads are checked against.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_backends::{AlignedBuf, Power, PowerCut};
pub use udm_core::testing::TempFile;
use udm_core::testing::{self, Watchdog};
use udm_core::{
    Bio, BioFlags, BioPtr, BlockDevice, Caps, Channel, Op, Reactor, ReactorConfig, Status,
    SECTOR_SIZE,
};

/// Size of every device under test.
pub const DEV_BYTES: u64 = 16 << 20;
/// Size of the registered buffer in fixed-buffer mode (holds the largest
/// single-segment I/O and both halves of the largest in-flight batch).
pub const FIXED_BYTES: usize = 4 << 20;
/// What a read buffer holds before the read: a read must overwrite it (or, on
/// a device that stores nothing, leave it exactly as it is).
pub const POISON: u8 = 0xA5;
/// How long any single wait may take before the test fails.
pub const TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes per sector, as a `usize`.
pub const SECTOR: usize = SECTOR_SIZE as usize;

// ---------------------------------------------------------------------------
// Temp files and timeouts.

/// A wait timed out: aborts (see [`testing::timed_out`], which removes the
/// temp files first).
fn timed_out(what: &str) -> ! {
    testing::timed_out(what, TIMEOUT)
}

// ---------------------------------------------------------------------------
// Completion records.

/// What the suite's end_io saw for one bio.
#[derive(Default)]
pub struct Done {
    pub calls: Cell<u32>,
    pub status: Cell<Option<Status>>,
    pub at: Cell<Option<Instant>>,
}

impl Done {
    pub fn status(&self) -> Status {
        self.status.get().expect("not completed")
    }
}

pub fn done_slots(n: usize) -> Box<[Done]> {
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
pub fn pattern(seed: u64, dev_off: u64, len: usize) -> Vec<u8> {
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
pub fn assert_same(label: &str, what: &str, dev_off: u64, got: &[u8], want: &[u8]) {
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
pub struct Fixture {
    pub dev: Arc<dyn BlockDevice>,
    /// Route single-segment I/O through a buffer registered with the reactor
    /// (`buf_index` set).
    pub fixed_buffers: bool,
    /// A file that holds exactly the device's bytes at the same offsets
    /// (the file backend's): checked against the shadow (removed on drop).
    pub backing: Option<TempFile>,
    /// Whatever else must live as long as the device (other temp files).
    pub keep: Vec<TempFile>,
    /// For devices over powercut wrappers: the supply, the wrappers, and
    /// how to build the device again over them after a cut.
    pub power: Option<PowerRig>,
}

impl Fixture {
    /// A device with nothing attached.
    pub fn plain(dev: Arc<dyn BlockDevice>) -> Fixture {
        Fixture {
            dev,
            fixed_buffers: false,
            backing: None,
            keep: Vec::new(),
            power: None,
        }
    }
}

/// The powercut wrappers under a device.
pub struct PowerRig {
    pub power: Arc<Power>,
    pub cuts: Vec<Arc<PowerCut>>,
    /// Builds the device under test again over the same wrappers (for a
    /// target: a new table over them, which loads what survived).
    pub reopen: Box<dyn Fn() -> Arc<dyn BlockDevice>>,
    /// The device keeps no write the power cut caught before a flush
    /// (a bare wrapper: nothing else can have made it durable).
    pub loses_unflushed: bool,
}

/// What a read of a device returns.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Reads {
    /// What was last written (never-written space reads as zeroes).
    Data,
    /// Nothing: the buffer is left as it was (null).
    Untouched,
    /// Zeroes, whatever was written (the zero target).
    Zeroes,
    /// Every valid I/O fails with IoErr (the error target).
    Fail,
}

/// What a device promises.
#[derive(Clone, Copy)]
pub struct Expect {
    pub label: &'static str,
    pub bytes: u64,
    pub reads: Reads,
    /// Exactly these caps.
    pub caps: Caps,
    /// The logical block size.
    pub lbs: u32,
    /// Discard leaves zeroes behind (as write-zeroes always must).
    pub discard_zeroes: bool,
    /// Every I/O takes at least this long (null with delay=).
    pub min_latency: Option<Duration>,
}

impl Expect {
    /// A device of [`DEV_BYTES`] that stores data, with 512-byte blocks.
    pub fn data(label: &'static str, caps: Caps) -> Expect {
        Expect {
            label,
            bytes: DEV_BYTES,
            reads: Reads::Data,
            caps,
            lbs: 512,
            discard_zeroes: true,
            min_latency: None,
        }
    }

    /// The status a valid I/O completes with.
    pub fn ok(&self) -> Status {
        if self.reads == Reads::Fail {
            Status::IoErr
        } else {
            Status::Ok
        }
    }

    /// The logical block size in sectors.
    pub fn lbs_sectors(&self) -> u64 {
        (self.lbs as usize / SECTOR) as u64
    }

    /// Whether an I/O at `sector` of `len` bytes is aligned to the
    /// logical block size.
    pub fn aligned(&self, sector: u64, len: usize) -> bool {
        sector.is_multiple_of(self.lbs_sectors()) && len.is_multiple_of(self.lbs as usize)
    }

    /// The status a well-formed `op` completes with: NotSupp for an op the
    /// caps leave out. A flush has no data to fail on: it succeeds even on
    /// the error target (dm sends its error target no flushes either).
    pub fn status_of(&self, op: Op) -> Status {
        if !self.caps.supports(op) {
            Status::NotSupp
        } else if op == Op::Flush {
            Status::Ok
        } else {
            self.ok()
        }
    }
}

pub struct Fixed {
    pub ptr: *mut u8,
    pub index: u16,
    _buf: AlignedBuf,
}

/// Field order is drop order: the channel goes first, the watchdog is
/// joined, then the reactor finishes and drops, and only then are the
/// registered buffer and the backing file released.
pub struct Harness {
    pub label: &'static str,
    pub ch: Rc<dyn Channel>,
    pub dev: Arc<dyn BlockDevice>,
    dog: Watchdog,
    pub reactor: Reactor,
    pub fixed: Option<Fixed>,
    pub backing: Option<TempFile>,
    _keep: Vec<TempFile>,
}

impl Harness {
    /// The device of `fx` opened on a new reactor configured by `config`;
    /// returns its power rig apart (the durability check drops the harness
    /// and keeps the rig).
    pub fn with_rig(
        label: &'static str,
        fx: Fixture,
        config: ReactorConfig,
    ) -> (Harness, Option<PowerRig>) {
        let power = fx.power;
        let fx = Fixture { power: None, ..fx };
        (Harness::new(label, fx, config), power)
    }

    pub fn new(label: &'static str, fx: Fixture, config: ReactorConfig) -> Harness {
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
        let dog = Watchdog::new(reactor.handle(), TIMEOUT);
        Harness {
            label,
            ch,
            dev: fx.dev,
            dog,
            reactor,
            fixed,
            backing: fx.backing,
            _keep: fx.keep,
        }
    }

    pub fn sectors(&self) -> u64 {
        self.dev.limits().sectors
    }

    /// Submits `bio`, to complete into `done`; checks it did not complete
    /// inside the call.
    pub fn submit(&self, mut bio: BioPtr, done: &Done) {
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
    pub fn wait(&self, dones: &[Done]) {
        let waited = self
            .dog
            .try_run_until(&self.reactor, || dones.iter().all(|d| d.calls.get() > 0));
        if waited.is_err() {
            let n = dones.iter().filter(|d| d.calls.get() == 0).count();
            timed_out(&format!(
                "{} ({:?} mode, ring_entries {}): {n} of {} I/Os",
                self.label,
                self.reactor.config().mode,
                self.reactor.config().ring_entries,
                dones.len()
            ));
        }
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

    pub fn exec(&self, bio: BioPtr) -> Status {
        let done = Done::default();
        self.submit(bio, &done);
        self.wait(std::slice::from_ref(&done));
        done.status()
    }

    pub fn bio(&self, op: Op, flags: BioFlags, sector: u64) -> BioPtr {
        let mut bio = self.reactor.alloc_bio();
        bio.op = op;
        bio.flags = flags;
        bio.sector = sector;
        bio
    }

    /// A bio over `segs`, in order; checks the descriptor kept them all.
    pub fn rw_segs(&self, op: Op, flags: BioFlags, sector: u64, segs: &mut [&mut [u8]]) -> Status {
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
    pub fn rw_one(
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

    pub fn write_flags(&self, sector: u64, data: &[u8], flags: BioFlags) -> Status {
        self.rw_one(
            Op::Write,
            flags,
            sector,
            data.len(),
            |b| b.copy_from_slice(data),
            |_| {},
        )
    }

    pub fn write(&self, sector: u64, data: &[u8]) -> Status {
        self.write_flags(sector, data, BioFlags::NONE)
    }

    /// Reads into a poisoned buffer.
    pub fn read(&self, sector: u64, len: usize) -> (Status, Vec<u8>) {
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

    pub fn dataless(&self, op: Op, flags: BioFlags, sector: u64, len: u32) -> Status {
        let mut bio = self.bio(op, flags, sector);
        bio.set_dataless(op, sector, len);
        self.exec(bio)
    }
}

/// The expected contents of a device, kept alongside it.
pub struct Shadow {
    pub data: Vec<u8>,
    seed: u64,
}

impl Shadow {
    pub fn new(bytes: u64) -> Shadow {
        Shadow {
            data: vec![0; bytes as usize],
            seed: 1,
        }
    }

    /// A fresh pattern for `[sector, +len)`, recorded as written.
    pub fn next(&mut self, sector: u64, len: usize) -> Vec<u8> {
        self.seed += 1;
        let off = sector * SECTOR_SIZE;
        let p = pattern(self.seed, off, len);
        self.data[off as usize..off as usize + len].copy_from_slice(&p);
        p
    }

    pub fn zero(&mut self, sector: u64, len: usize) {
        let off = (sector * SECTOR_SIZE) as usize;
        self.data[off..off + len].fill(0);
    }

    pub fn range(&self, sector: u64, len: usize) -> &[u8] {
        let off = (sector * SECTOR_SIZE) as usize;
        &self.data[off..off + len]
    }
}

/// Checks what a read of `[sector, +len)` returned against the shadow (or
/// against what the device's reads promise instead).
#[track_caller]
pub fn check_read(e: &Expect, shadow: &Shadow, sector: u64, got: &[u8], what: &str) {
    match e.reads {
        Reads::Data => assert_same(
            e.label,
            what,
            sector * SECTOR_SIZE,
            got,
            shadow.range(sector, got.len()),
        ),
        Reads::Zeroes => assert!(
            got.iter().all(|&b| b == 0),
            "{}: {what}: a read of a device that reads zeroes returned other data",
            e.label
        ),
        Reads::Untouched => assert!(
            got.iter().all(|&b| b == POISON),
            "{}: {what}: a read of a device that stores nothing changed the buffer",
            e.label
        ),
        // Whatever a failed read left in the buffer is not data.
        Reads::Fail => {}
    }
}

/// Reads `[sector, +len)` and checks it (see [`check_read`]).
#[track_caller]
pub fn verify(h: &Harness, e: &Expect, shadow: &Shadow, sector: u64, len: usize, what: &str) {
    let (st, got) = h.read(sector, len);
    assert_eq!(st, e.ok(), "{}: {what}: read {sector}+{len}", e.label);
    check_read(e, shadow, sector, &got, what);
}

/// Reads the whole device in 1 MiB pieces and checks it against the shadow;
/// for a device with a backing file, also checks the file holds the same
/// bytes at the same offsets.
pub fn verify_all(h: &Harness, e: &Expect, shadow: &Shadow, what: &str) {
    let chunk = 1 << 20;
    let bytes = e.bytes as usize;
    let mut pos = 0;
    while pos < bytes {
        let n = chunk.min(bytes - pos);
        verify(h, e, shadow, (pos / SECTOR) as u64, n, what);
        pos += n;
    }
    if let (Some(f), Reads::Data) = (&h.backing, e.reads) {
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
