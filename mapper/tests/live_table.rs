//! Live table changes: replace, load + suspend + resume, suspend with and
//! without flush, and fast-path toggling, while I/O runs on other threads.
//!
//! The load generator ([`Load`]) runs on its own reactor thread and keeps
//! [`SLOTS`] I/Os in flight. Each slot owns a disjoint stretch of the mapped
//! device and loops: write a random range with a fresh tag (every sector
//! carries its sector number and the tag), then read a random range back and
//! check each sector against what the slot last wrote there. At the end the
//! ram devices are read directly and every sector must be where the mapping
//! says, with the last tag written: nothing lost, nothing misdirected.

mod common;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use common::{
    as_dev, assert_sectors_eq, pattern, sector_pattern, submit_counted, wait_for, Counters,
    Devices, Done, InFlight, ReactorThread, Req, Rng, Tester, SECTOR, TIMEOUT,
};
use udm_core::{
    BioFlags, BlockDevice, ErrorKind, Op, Reactor, ReactorConfig, ReactorHandle, Status,
};
use udm_mapper::MappedDevice;

/// I/Os each load keeps in flight.
const SLOTS: usize = 16;

/// Sectors of every mapped device in these tests.
const SIZE: u64 = 1024;

/// Chunk size of the striped shapes (the longest I/O is three chunks).
const CHUNK: u64 = 8;

// ---------------------------------------------------------------------------
// The load generator
// ---------------------------------------------------------------------------

/// One in-flight slot of a load: its stretch of the device, what it last
/// wrote to each sector there (tag 0: zeroes), and its current I/O.
struct Slot {
    range: Range<u64>,
    tags: Vec<u64>,
    rng: Rng,
    next_tag: u64,
    write_next: bool,
    inflight: Option<InFlight>,
}

impl Slot {
    /// The next request: writes (sometimes discards, write-zeroes, FUA or
    /// PREFLUSH) alternate with reads (sometimes flushes).
    fn next_req(&mut self) -> Req {
        let r = &mut self.rng;
        let start = r.range(self.range.start, self.range.end - 1);
        let n = r.range(1, 3 * CHUNK).min(self.range.end - start);
        let segs = r.range(1, 3) as usize;
        let writing = self.write_next;
        self.write_next = !writing;
        if !writing {
            return if r.range(0, 19) == 0 {
                Req::flush()
            } else {
                Req::read(start, n).segs(segs)
            };
        }
        match r.range(0, 9) {
            0 => Req::discard(start, n),
            1 => Req::write_zeroes(start, n),
            k => {
                self.next_tag += 1;
                let flags = match k {
                    2 => BioFlags::FUA,
                    3 => BioFlags::PREFLUSH | BioFlags::FUA,
                    _ => BioFlags::NONE,
                };
                Req::write(start, pattern(self.next_tag, start, n))
                    .flags(flags)
                    .segs(segs)
            }
        }
    }

    /// Checks a completed request and records what a write left behind.
    fn complete(&mut self, d: Done) -> Result<(), String> {
        let what = format!(
            "{:?} of {} sectors at {}",
            d.req.op,
            d.req.sectors(),
            d.req.sector
        );
        if d.completions != 1 || d.sector != d.req.sector || d.depth != 0 {
            return Err(format!(
                "{what}: completed {} times, came back at sector {} with {} frames",
                d.completions, d.sector, d.depth
            ));
        }
        if d.status != Status::Ok {
            return Err(format!("{what}: failed with {:?}", d.status));
        }
        let r = d.req.sector..d.req.sector + d.req.sectors();
        let idx = |s: u64| (s - self.range.start) as usize;
        match d.req.op {
            Op::Write => {
                let tag = u64::from_le_bytes(d.req.data[8..16].try_into().expect("tag bytes"));
                for s in r {
                    self.tags[idx(s)] = tag;
                }
            }
            Op::Discard | Op::WriteZeroes => {
                for s in r {
                    self.tags[idx(s)] = 0;
                }
            }
            Op::Read => {
                for (i, s) in r.enumerate() {
                    let got = &d.data[i * SECTOR..(i + 1) * SECTOR];
                    let tag = self.tags[idx(s)];
                    let ok = if tag == 0 {
                        got.iter().all(|&b| b == 0)
                    } else {
                        got == sector_pattern(tag, s)
                    };
                    if !ok {
                        return Err(format!(
                            "{what}: sector {s} holds {}, expected {}",
                            common::describe(got),
                            if tag == 0 {
                                "zeroes".into()
                            } else {
                                format!("tag {tag:#x}")
                            }
                        ));
                    }
                }
            }
            Op::Flush => {}
        }
        Ok(())
    }
}

/// A load running on its own reactor thread over `region` of a device.
struct Load {
    region: Range<u64>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    errors: Arc<Mutex<Vec<String>>>,
    handle: ReactorHandle,
    join: Option<JoinHandle<Vec<u64>>>,
}

impl Load {
    /// Starts [`SLOTS`] I/O loops over `region` of `dev`, seeded with `seed`.
    fn start(dev: &Arc<dyn BlockDevice>, region: Range<u64>, seed: u64) -> Load {
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let (dev, c, st, errs, reg) = (
            dev.clone(),
            counters.clone(),
            stop.clone(),
            errors.clone(),
            region.clone(),
        );
        let join = std::thread::Builder::new()
            .name(format!("load-{}", region.start))
            .spawn(move || run_load(dev, reg, seed, c, st, errs, tx))
            .expect("spawn load thread");
        let handle = rx.recv().expect("load reactor started");
        Load {
            region,
            counters,
            stop,
            errors,
            handle,
            join: Some(join),
        }
    }

    /// Completions so far.
    fn completed(&self) -> u64 {
        self.counters.completed.load(Ordering::SeqCst)
    }

    /// Waits until `n` more I/Os have completed.
    #[track_caller]
    fn wait_progress(&self, n: u64) {
        let target = self.completed() + n;
        wait_for("load progress", || self.completed() >= target);
    }

    /// Stops the load, waits for its I/O, checks it saw no errors, and
    /// returns the tag last written to each sector of its region.
    #[track_caller]
    fn finish(mut self) -> Vec<u64> {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.wake();
        let tags = self
            .join
            .take()
            .expect("joined once")
            .join()
            .expect("load thread panicked");
        let errors = self.errors.lock().expect("errors lock");
        assert!(
            errors.is_empty(),
            "load over {:?} saw errors:\n{}",
            self.region,
            errors.join("\n")
        );
        assert!(self.completed() > 0, "the load did some I/O");
        tags
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        // Only reached without `finish` when a test is failing: stop the
        // thread but do not wait (its I/O may be held by a suspend).
        self.stop.store(true, Ordering::SeqCst);
        self.handle.wake();
    }
}

fn run_load(
    dev: Arc<dyn BlockDevice>,
    region: Range<u64>,
    seed: u64,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    errors: Arc<Mutex<Vec<String>>>,
    started: mpsc::Sender<ReactorHandle>,
) -> Vec<u64> {
    let reactor = Reactor::new(ReactorConfig::default()).expect("reactor");
    let ch = dev.open(&reactor).expect("open channel");
    started.send(reactor.handle()).expect("report start");
    let per = (region.end - region.start) / SLOTS as u64;
    let mut slots: Vec<Slot> = (0..SLOTS as u64)
        .map(|i| {
            let lo = region.start + i * per;
            Slot {
                range: lo..lo + per,
                tags: vec![0; per as usize],
                rng: Rng::new(seed ^ (i << 32)),
                next_tag: (seed << 40) | (i << 32),
                write_next: true,
                inflight: None,
            }
        })
        .collect();
    reactor.run_until(|| {
        let stopping = stop.load(Ordering::SeqCst);
        let mut idle = true;
        for s in slots.iter_mut() {
            match &s.inflight {
                Some(f) if !f.is_done() => {
                    idle = false;
                    continue;
                }
                Some(_) => {
                    let d = s.inflight.take().expect("checked").finish();
                    if let Err(e) = s.complete(d) {
                        let mut errs = errors.lock().expect("errors lock");
                        if errs.len() < 20 {
                            errs.push(e);
                        }
                    }
                }
                None => {}
            }
            if !stopping {
                let req = s.next_req();
                s.inflight = Some(submit_counted(&reactor, &*ch, req, Some(counters.clone())));
                idle = false;
            }
        }
        stopping && idle
    });
    slots.into_iter().flat_map(|s| s.tags).collect()
}

/// Starts two loads (two reactors), each over half of the device.
fn start_loads(dev: &Arc<dyn BlockDevice>, seed: u64) -> [Load; 2] {
    let loads = [
        Load::start(dev, 0..SIZE / 2, seed),
        Load::start(dev, SIZE / 2..SIZE, seed + 1),
    ];
    for l in &loads {
        l.wait_progress(4 * SLOTS as u64);
    }
    loads
}

/// Finishes both loads; the tag of every sector of the device.
fn finish_loads(loads: [Load; 2]) -> Vec<u64> {
    loads.into_iter().flat_map(Load::finish).collect()
}

// ---------------------------------------------------------------------------
// Table shapes that map the same sectors to the same places
// ---------------------------------------------------------------------------

/// Equivalent tables over a set of ram devices: different shapes, one
/// mapping, given by `place`.
struct Family {
    devs: Devices,
    rams: Vec<Arc<dyn BlockDevice>>,
    shapes: Vec<String>,
    place: fn(u64) -> (usize, u64),
}

impl Family {
    /// One ram device, mapped 1:1 by one linear line, by several linear
    /// lines of uneven lengths, and by a one-stripe striped line.
    fn one_device() -> Family {
        let mut devs = Devices::new();
        let rams = vec![devs.ram("ram0", SIZE)];
        let shapes = vec![
            format!("0 {SIZE} linear ram0 0"),
            "0 100 linear ram0 0\n100 300 linear ram0 100\n400 24 linear ram0 400\n424 600 linear ram0 424"
                .to_string(),
            format!("0 {SIZE} striped 1 {CHUNK} ram0 0"),
        ];
        Family {
            devs,
            rams,
            shapes,
            place: |s| (0, s),
        }
    }

    /// Two ram devices, chunks alternating between them: as one striped
    /// line, as one linear line per chunk, and as two striped lines.
    fn two_devices() -> Family {
        let mut devs = Devices::new();
        let rams = vec![devs.ram("ram0", SIZE / 2), devs.ram("ram1", SIZE / 2)];
        let per_chunk: Vec<String> = (0..SIZE / CHUNK)
            .map(|c| {
                format!(
                    "{} {CHUNK} linear ram{} {}",
                    c * CHUNK,
                    c % 2,
                    (c / 2) * CHUNK
                )
            })
            .collect();
        let half = SIZE / 2;
        let shapes = vec![
            format!("0 {SIZE} striped 2 {CHUNK} ram0 0 ram1 0"),
            per_chunk.join("\n"),
            format!(
                "0 {half} striped 2 {CHUNK} ram0 0 ram1 0\n{half} {half} striped 2 {CHUNK} ram0 {q} ram1 {q}",
                q = half / 2
            ),
        ];
        Family {
            devs,
            rams,
            shapes,
            place: |s| {
                let c = s / CHUNK;
                ((c % 2) as usize, (c / 2) * CHUNK + s % CHUNK)
            },
        }
    }

    /// A mapped device with the first shape live.
    fn device(&self) -> Arc<MappedDevice> {
        self.devs.mapped("live", &self.shapes[0])
    }

    /// Checks every sector of every ram device: a mapped sector `s` with
    /// tag `t` must be at `place(s)` holding `sector_pattern(t, s)`; all else
    /// must be zeroes.
    #[track_caller]
    fn check_placement(&self, tags: &[u64]) {
        let t = Tester::new();
        let mut expected: Vec<Vec<u8>> = self
            .rams
            .iter()
            .map(|r| vec![0u8; r.limits().sectors as usize * SECTOR])
            .collect();
        for (s, &tag) in tags.iter().enumerate() {
            if tag != 0 {
                let (d, at) = (self.place)(s as u64);
                let at = at as usize * SECTOR;
                expected[d][at..at + SECTOR].copy_from_slice(&sector_pattern(tag, s as u64));
            }
        }
        for (ram, exp) in self.rams.iter().zip(&expected) {
            assert_sectors_eq(&t.read_all(ram), exp, &format!("ram device {}", ram.name()));
        }
    }

    /// The ram devices' whole content.
    fn snapshot(&self) -> Vec<Vec<u8>> {
        let t = Tester::new();
        self.rams.iter().map(|r| t.read_all(r)).collect()
    }
}

// ---------------------------------------------------------------------------
// replace
// ---------------------------------------------------------------------------

/// Swaps the live table `swaps` times among the family's shapes while two
/// reactors keep I/O in flight, letting each table serve I/O before the
/// next swap; then checks nothing was lost or misdirected.
fn replace_under_load(f: &Family, swaps: usize, seed: u64) {
    let md = f.device();
    let dev = as_dev(&md);
    let loads = start_loads(&dev, seed);
    for i in 1..=swaps {
        let text = &f.shapes[i % f.shapes.len()];
        md.replace(f.devs.table(text)).expect("replace");
        for l in &loads {
            l.wait_progress(8);
        }
    }
    let tags = finish_loads(loads);
    f.check_placement(&tags);
    let last = f.devs.table(&f.shapes[swaps % f.shapes.len()]);
    assert_eq!(
        md.table().table_lines(),
        last.table_lines(),
        "the last table is live"
    );
}

/// Replacing the live table 200 times under load, between one linear line,
/// several linear lines and a one-stripe striped line over the same device,
/// loses no write and misdirects none.
#[test]
fn replace_under_load_between_linear_shapes_keeps_every_sector_in_place() {
    replace_under_load(&Family::one_device(), 200, 1);
}

/// Replacing the live table 200 times under load, between a striped line,
/// one linear line per chunk, and two striped lines that map the same
/// chunks to the same places, loses no write and misdirects none.
#[test]
fn replace_under_load_between_striped_and_per_chunk_linear_keeps_every_sector_in_place() {
    replace_under_load(&Family::two_devices(), 200, 3);
}

// ---------------------------------------------------------------------------
// suspend and resume
// ---------------------------------------------------------------------------

/// After suspend(false) returns no I/O is in flight: completions stop and
/// the devices stop changing, while every slot's next I/O has been
/// submitted and is held (not failed). After resume() the held I/O
/// completes and the data is intact.
#[test]
fn suspend_drains_in_flight_io_and_holds_new_io_until_resume() {
    let f = Family::two_devices();
    let md = f.device();
    let dev = as_dev(&md);
    let loads = start_loads(&dev, 5);
    for round in 0..5 {
        md.suspend(false).expect("suspend");
        assert!(md.is_suspended());
        let done: Vec<u64> = loads.iter().map(Load::completed).collect();
        // Each slot resubmits when its last I/O completes: all of them are held.
        for l in &loads {
            wait_for("every slot's next I/O to be submitted", || {
                l.counters.outstanding() == SLOTS as u64
            });
        }
        let before = f.snapshot();
        std::thread::sleep(Duration::from_millis(50));
        for (l, &d) in loads.iter().zip(&done) {
            assert_eq!(
                l.completed(),
                d,
                "round {round}: an I/O completed while suspended"
            );
            assert_eq!(
                l.counters.outstanding(),
                SLOTS as u64,
                "round {round}: held I/O"
            );
        }
        assert!(
            f.snapshot() == before,
            "round {round}: a device changed while suspended"
        );

        md.resume().expect("resume");
        assert!(!md.is_suspended());
        for (l, &d) in loads.iter().zip(&done) {
            wait_for("held I/O to complete after resume", || {
                l.completed() >= d + SLOTS as u64
            });
            l.wait_progress(32);
        }
    }
    f.check_placement(&finish_loads(loads));
}

/// A bio submitted while the device is suspended waits (neither completed
/// nor failed, nothing written) until resume(), then completes normally. A
/// NOWAIT bio is not held: it fails at once with Status::Again.
#[test]
fn io_submitted_while_suspended_waits_for_resume() {
    let mut devs = Devices::new();
    let ram = devs.ram("r0", 32);
    let md = devs.mapped("s", "0 32 linear r0 0");
    let dev = as_dev(&md);
    let rt = ReactorThread::spawn("io");
    let t = Tester::new();
    rt.write(&dev, 0, pattern(1, 0, 8));

    md.suspend(false).expect("suspend");
    let rx = rt.submit(&dev, Req::write(8, pattern(2, 8, 8)));
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "a write completed while the device was suspended"
    );
    assert!(
        t.read(&ram, 8, 8).iter().all(|&b| b == 0),
        "the held write reached the device"
    );
    let d = rt.run(&dev, Req::read(0, 8).flags(BioFlags::NOWAIT));
    assert_eq!(d.status, Status::Again, "NOWAIT while suspended");
    d.assert_returned_intact();

    md.resume().expect("resume");
    let d = rx
        .recv_timeout(TIMEOUT)
        .expect("held write completes after resume");
    assert_eq!(d.status, Status::Ok);
    d.assert_returned_intact();
    assert_sectors_eq(
        &t.read(&ram, 0, 16),
        &pattern(1, 0, 8)
            .into_iter()
            .chain(pattern(2, 8, 8))
            .collect::<Vec<_>>(),
        "r0",
    );
}

/// load() only stages a table: I/O keeps going through the live one until
/// suspend + resume, after which all I/O (and the device's size and table
/// lines) follow the new one. A resume with nothing staged keeps the table.
#[test]
fn load_then_suspend_resume_switches_the_table() {
    let mut devs = Devices::new();
    let r0 = devs.ram("r0", 64);
    let r1 = devs.ram("r1", 64);
    let md = devs.mapped("l", "0 32 linear r0 0");
    let dev = as_dev(&md);
    let rt = ReactorThread::spawn("io");
    let t = Tester::new();
    rt.write(&dev, 0, pattern(1, 0, 32));

    md.load(devs.table("0 48 linear r1 16"));
    assert_eq!(
        md.table().table_lines(),
        vec!["0 32 linear r0 0"],
        "load does not go live"
    );
    assert_sectors_eq(
        &rt.read(&dev, 0, 32),
        &pattern(1, 0, 32),
        "still through r0",
    );
    rt.write(&dev, 0, pattern(2, 0, 4));

    md.suspend(false).expect("suspend");
    md.resume().expect("resume");
    assert_eq!(md.table().table_lines(), vec!["0 48 linear r1 16"]);
    assert_eq!(
        md.limits().sectors,
        48,
        "the device has the new table's size"
    );
    assert!(
        rt.read(&dev, 0, 48).iter().all(|&b| b == 0),
        "reads now come from r1 16..64"
    );
    rt.write(&dev, 40, pattern(3, 40, 8));
    assert_sectors_eq(&t.read(&r1, 56, 8), &pattern(3, 40, 8), "r1 56..64");

    let mut r0_image = pattern(1, 0, 32);
    r0_image[..4 * SECTOR].copy_from_slice(&pattern(2, 0, 4));
    assert_sectors_eq(
        &t.read(&r0, 0, 32),
        &r0_image,
        "r0 keeps what the old table wrote",
    );

    md.suspend(false).expect("suspend");
    md.resume().expect("resume");
    assert_eq!(
        md.table().table_lines(),
        vec!["0 48 linear r1 16"],
        "nothing staged: same table"
    );
}

/// load() + suspend() + resume() 50 times under load, cycling among
/// equivalent shapes, loses no write and misdirects none.
#[test]
fn load_suspend_resume_cycles_under_load_keep_every_sector_in_place() {
    let f = Family::two_devices();
    let md = f.device();
    let dev = as_dev(&md);
    let loads = start_loads(&dev, 7);
    for i in 1..=50 {
        md.load(f.devs.table(&f.shapes[i % f.shapes.len()]));
        md.suspend(i % 2 == 0).expect("suspend");
        md.resume().expect("resume");
        for l in &loads {
            l.wait_progress(8);
        }
    }
    f.check_placement(&finish_loads(loads));
}

/// When replace() returns, new I/O on every reactor maps through the new
/// table (and the device reports the new table and size).
#[test]
fn replace_takes_effect_for_new_io_when_it_returns() {
    let mut devs = Devices::new();
    let r0 = devs.ram("r0", 32);
    let r1 = devs.ram("r1", 64);
    let md = devs.mapped("rp", "0 32 linear r0 0");
    let dev = as_dev(&md);
    let (a, b) = (ReactorThread::spawn("io-a"), ReactorThread::spawn("io-b"));
    let t = Tester::new();
    a.write(&dev, 0, pattern(1, 0, 8));
    b.write(&dev, 8, pattern(1, 8, 8));

    md.replace(devs.table("0 64 linear r1 0")).expect("replace");
    assert_eq!(md.table().table_lines(), vec!["0 64 linear r1 0"]);
    assert_eq!(md.limits().sectors, 64);
    a.write(&dev, 0, pattern(2, 0, 8));
    b.write(&dev, 56, pattern(2, 56, 8));
    assert_sectors_eq(
        &t.read(&r1, 0, 8),
        &pattern(2, 0, 8),
        "r1 0..8 from reactor a",
    );
    assert_sectors_eq(
        &t.read(&r1, 56, 8),
        &pattern(2, 56, 8),
        "r1 56..64 from reactor b",
    );
    assert_sectors_eq(
        &t.read(&r0, 0, 16),
        &pattern(1, 0, 16),
        "r0 keeps only the old writes",
    );
}

/// A table replaced while suspended is the one held I/O goes through
/// when the device resumes.
#[test]
fn replace_while_suspended_maps_held_io_through_the_new_table() {
    let mut devs = Devices::new();
    let r0 = devs.ram("r0", 32);
    let r1 = devs.ram("r1", 32);
    let md = devs.mapped("rs", "0 32 linear r0 0");
    let dev = as_dev(&md);
    let rt = ReactorThread::spawn("io");
    let t = Tester::new();
    rt.write(&dev, 0, pattern(1, 0, 1));

    md.suspend(false).expect("suspend");
    let rx = rt.submit(&dev, Req::write(0, pattern(2, 0, 8)));
    md.replace(devs.table("0 32 linear r1 0")).expect("replace");
    md.resume().expect("resume");
    assert_eq!(
        rx.recv_timeout(TIMEOUT).expect("completes").status,
        Status::Ok
    );
    assert_sectors_eq(&t.read(&r1, 0, 8), &pattern(2, 0, 8), "r1");
    assert_sectors_eq(
        &t.read(&r0, 0, 1),
        &pattern(1, 0, 1),
        "r0 untouched by the held write",
    );
}

/// suspend(true) drains in-flight I/O, flushes every device and returns
/// Ok, also with zero and error targets in the table; I/O resumes after.
#[test]
fn suspend_with_flush_drains_flushes_and_returns_ok() {
    let f = Family::two_devices();
    let md = f.device();
    let dev = as_dev(&md);
    let loads = start_loads(&dev, 9);
    for _ in 0..20 {
        md.suspend(true).expect("suspend with flush");
        let done: Vec<u64> = loads.iter().map(Load::completed).collect();
        std::thread::sleep(Duration::from_millis(5));
        for (l, &d) in loads.iter().zip(&done) {
            assert_eq!(l.completed(), d, "an I/O completed while suspended");
        }
        md.resume().expect("resume");
        for l in &loads {
            l.wait_progress(8);
        }
    }
    f.check_placement(&finish_loads(loads));

    let mut devs = Devices::new();
    devs.ram("r0", 16);
    let md = devs.mapped("mixed", "0 8 zero\n8 8 error\n16 16 linear r0 0");
    let rt = ReactorThread::spawn("io");
    rt.write(&as_dev(&md), 16, pattern(1, 16, 16));
    md.suspend(true)
        .expect("suspend with flush over zero/error/linear");
    md.resume().expect("resume");
    assert_sectors_eq(
        &rt.read(&as_dev(&md), 16, 16),
        &pattern(1, 16, 16),
        "after resume",
    );
}

/// Suspending a suspended device fails with a Busy error naming the device
/// and changes nothing: one resume() releases it, and it can be suspended
/// again.
#[test]
fn suspending_twice_is_an_error() {
    let mut devs = Devices::new();
    devs.ram("r0", 16);
    let md = devs.mapped("twice", "0 16 linear r0 0");
    let dev = as_dev(&md);
    let rt = ReactorThread::spawn("io");
    rt.write(&dev, 0, pattern(1, 0, 16));

    md.suspend(false).expect("first suspend");
    let e = md.suspend(false).expect_err("second suspend must fail");
    assert_eq!(e.kind(), ErrorKind::Busy);
    assert!(
        e.to_string().contains("'twice' is already suspended"),
        "{e}"
    );
    let e = md
        .suspend(true)
        .expect_err("suspend with flush must fail too");
    assert_eq!(e.kind(), ErrorKind::Busy);
    assert!(md.is_suspended());

    md.resume().expect("resume");
    assert!(!md.is_suspended());
    assert_sectors_eq(
        &rt.read(&dev, 0, 16),
        &pattern(1, 0, 16),
        "I/O flows after one resume",
    );
    md.suspend(false).expect("suspend again after resume");
    md.resume().expect("resume again");
}

// ---------------------------------------------------------------------------
// fast path toggling
// ---------------------------------------------------------------------------

/// Turning the no-clone fast path off and on 200 times while I/O runs
/// keeps every read correct and every sector in place.
#[test]
fn toggling_the_fast_path_under_load_keeps_data_correct() {
    let f = Family::two_devices();
    let md = f.device();
    let dev = as_dev(&md);
    let loads = start_loads(&dev, 11);
    for i in 0..200 {
        md.set_fast_path(i % 2 == 1).expect("set_fast_path");
        for l in &loads {
            l.wait_progress(4);
        }
    }
    f.check_placement(&finish_loads(loads));
}

/// A control operation never waits for a reactor that has gone away, even
/// when its message was queued while the reactor was still there but no
/// longer turning (a reactor thread shutting down).
#[test]
fn control_does_not_wait_for_a_reactor_that_went_away() {
    let mut devs = Devices::new();
    devs.ram("r0", 16);
    let md = devs.mapped("gone", "0 16 linear r0 0");
    let dev = as_dev(&md);
    let (opened_tx, opened_rx) = mpsc::channel();
    let (drop_tx, drop_rx) = mpsc::channel::<()>();
    let io = std::thread::spawn(move || {
        let reactor = Reactor::new(ReactorConfig::default()).expect("reactor");
        let _ch = dev.open(&reactor).expect("open");
        opened_tx.send(()).expect("report open");
        // Stop turning, then go away when told.
        let _ = drop_rx.recv();
    });
    opened_rx.recv().expect("reactor opened the device");

    let (done_tx, done_rx) = mpsc::channel();
    let ctl = md.clone();
    std::thread::spawn(move || {
        let _ = done_tx.send(ctl.suspend(false).map_err(|e| e.to_string()));
    });
    // The suspend's message is now queued on a reactor that does not turn.
    std::thread::sleep(Duration::from_millis(100));
    drop_tx.send(()).expect("tell the reactor to go");
    io.join().expect("reactor thread");
    let r = done_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("suspend returns once the reactor is gone");
    assert_eq!(r, Ok(()));
    md.resume().expect("resume");
}
