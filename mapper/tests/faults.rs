//! The fault targets (flakey, delay, dust, log-writes) end to end through a
//! mapped device over real ram devices: flakey's cycle on an injected clock
//! and each of its features, delay's added latency and ordering, dust's
//! bad-block life cycle through messages, and log-writes' log replayed to
//! the same bytes at every mark.

mod common;

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{as_dev, pattern, submit, Devices, InFlight, ReactorThread, Req, Rng, Tester, SECTOR};
use udm_core::{BioFlags, BlockDevice, Error, Status};
use udm_mapper::targets::flakey::{self, ManualClock};
use udm_mapper::targets::log_writes::replay::{self, Stop};
use udm_mapper::{MappedDevice, Registry};

// ---------------------------------------------------------------------------
// flakey
// ---------------------------------------------------------------------------

thread_local! {
    /// The clock the test's flakey targets read (set per test thread).
    static CLOCK: RefCell<Option<Arc<ManualClock>>> = const { RefCell::new(None) };
}

fn flakey_on_test_clock(
    ctx: &udm_mapper::CtrCtx<'_>,
    argv: &[&str],
) -> Result<Box<dyn udm_mapper::Target>, Error> {
    let clock = CLOCK.with(|c| c.borrow().clone()).expect("test clock set");
    flakey::ctr_with_clock(ctx, argv, clock)
}

/// A flakey device over ram `r` (64 sectors, filled with pattern 1), with
/// `args` after the device and offset, on a fresh manual clock.
fn flakey(
    args: &str,
) -> (
    Arc<ManualClock>,
    Arc<dyn BlockDevice>,
    Arc<dyn BlockDevice>,
    Tester,
) {
    let clock = Arc::new(ManualClock::new());
    CLOCK.with(|c| *c.borrow_mut() = Some(clock.clone()));
    let mut reg = Registry::builtin();
    reg.register(udm_mapper::TargetType {
        ctr: flakey_on_test_clock,
        ..flakey::FLAKEY
    });
    let mut devs = Devices::new();
    let ram = devs.ram("r", 64);
    let t = Tester::new();
    t.write(&ram, 0, pattern(1, 0, 64));
    let table = devs
        .try_table_in(&reg, &format!("0 64 flakey r 0 {args}"))
        .expect("table");
    let md = MappedDevice::new("fl", table);
    (clock, as_dev(&md), ram, t)
}

fn status(t: &Tester, dev: &Arc<dyn BlockDevice>, req: Req) -> Status {
    let d = t.run(dev, req);
    d.assert_returned_intact();
    d.status
}

/// Up for `up` seconds, then down for `down`, in a cycle from construction:
/// without features, every read and write fails while down.
#[test]
fn flakey_cycles_between_up_and_down_on_the_clock() {
    let (clock, dev, ram, t) = flakey("2 3");
    let cycle = |t: &Tester| {
        (
            status(t, &dev, Req::read(0, 8)),
            status(t, &dev, Req::write(8, pattern(2, 8, 8))),
        )
    };
    assert_eq!(cycle(&t), (Status::Ok, Status::Ok), "up at 0 s");
    clock.advance_ms(1999);
    assert_eq!(cycle(&t), (Status::Ok, Status::Ok), "up at 1.999 s");
    clock.advance_ms(1);
    assert_eq!(cycle(&t), (Status::IoErr, Status::IoErr), "down at 2 s");
    clock.advance_ms(2999);
    assert_eq!(cycle(&t), (Status::IoErr, Status::IoErr), "down at 4.999 s");
    clock.advance_ms(1);
    assert_eq!(cycle(&t), (Status::Ok, Status::Ok), "up again at 5 s");
    // Many cycles later, the phase is the same.
    clock.advance_ms(5 * 1000 * 100 + 2500);
    assert_eq!(cycle(&t), (Status::IoErr, Status::IoErr), "down at 507.5 s");
    // Only the up-time writes landed.
    assert_eq!(t.read(&ram, 8, 8), pattern(2, 8, 8));
}

#[test]
fn flakey_drop_writes_acknowledges_and_drops_while_reads_pass() {
    let (clock, dev, ram, t) = flakey("1 10 1 drop_writes");
    clock.advance_ms(1000);
    assert_eq!(
        status(&t, &dev, Req::write(0, pattern(9, 0, 8))),
        Status::Ok
    );
    assert_eq!(t.read(&ram, 0, 8), pattern(1, 0, 8), "dropped");
    assert_eq!(t.read(&dev, 0, 8), pattern(1, 0, 8), "reads pass");
    clock.advance_ms(10_000);
    let _ = clock;
}

#[test]
fn flakey_error_writes_fails_writes_while_reads_pass() {
    let (_clock, dev, ram, t) = flakey("0 10 1 error_writes");
    assert_eq!(
        status(&t, &dev, Req::write(0, pattern(9, 0, 8))),
        Status::IoErr
    );
    assert_eq!(status(&t, &dev, Req::discard(0, 8)), Status::IoErr);
    assert_eq!(t.read(&ram, 0, 8), pattern(1, 0, 8));
    assert_eq!(t.read(&dev, 0, 8), pattern(1, 0, 8));
}

#[test]
fn flakey_error_reads_fails_reads_while_writes_pass() {
    let (_clock, dev, ram, t) = flakey("0 10 1 error_reads");
    assert_eq!(status(&t, &dev, Req::read(0, 8)), Status::IoErr);
    assert_eq!(
        status(&t, &dev, Req::write(0, pattern(9, 0, 8))),
        Status::Ok
    );
    assert_eq!(t.read(&ram, 0, 8), pattern(9, 0, 8));
}

#[test]
fn flakey_corrupt_bio_byte_on_reads_changes_the_nth_byte_read() {
    let (clock, dev, ram, t) = flakey("1 1 5 corrupt_bio_byte 32 r 1 0");
    assert_eq!(t.read(&dev, 0, 8), pattern(1, 0, 8), "up: intact");
    clock.advance_ms(1000);
    let got = t.read(&dev, 0, 8);
    let mut want = pattern(1, 0, 8);
    want[31] = 1;
    assert_eq!(got, want, "byte 32 (index 31) is 1, nothing else changed");
    assert_eq!(t.read(&ram, 0, 8), pattern(1, 0, 8), "device untouched");
    // Writes pass intact.
    assert_eq!(
        status(&t, &dev, Req::write(8, pattern(3, 8, 8))),
        Status::Ok
    );
    assert_eq!(t.read(&ram, 8, 8), pattern(3, 8, 8));
}

#[test]
fn flakey_corrupt_bio_byte_on_writes_lands_a_corrupted_copy() {
    let (_clock, dev, ram, t) = flakey("0 1 5 corrupt_bio_byte 224 w 0 0");
    let data = pattern(4, 0, 8);
    let ch = t.open(&dev);
    let f = submit(&t.reactor, &*ch, Req::write(0, data.clone()));
    t.wait_all(std::slice::from_ref(&f));
    assert_eq!(f.finish().status, Status::Ok);
    let mut want = data.clone();
    want[223] = 0;
    assert_ne!(data[223], 0, "test data must differ at the byte");
    assert_eq!(t.read(&ram, 0, 8), want, "byte 224 written as 0");
    // Reads are not corrupted.
    assert_eq!(t.read(&dev, 0, 8), want);
}

#[test]
fn flakey_random_corruption_changes_one_byte_at_most_per_bio() {
    let (_clock, dev, ram, t) =
        flakey("0 1 4 random_read_corrupt 1000000000 random_write_corrupt 1000000000");
    let mut changed = 0;
    for i in 0..16u64 {
        let got = t.read(&dev, 0, 8);
        let diff = got
            .iter()
            .zip(pattern(1, 0, 8))
            .filter(|(a, b)| **a != *b)
            .count();
        assert!(diff <= 1, "read {i}: {diff} bytes differ");
        changed += diff;
    }
    assert!(
        changed >= 8,
        "probability 1: most reads corrupted ({changed}/16)"
    );
    let data = pattern(5, 8, 8);
    assert_eq!(status(&t, &dev, Req::write(8, data.clone())), Status::Ok);
    let diff = t
        .read(&ram, 8, 8)
        .iter()
        .zip(&data)
        .filter(|(a, b)| *a != *b)
        .count();
    assert!(diff <= 1, "write: {diff} bytes differ");
}

#[test]
fn flakey_table_line_and_errors_are_as_dm() {
    let (_c, _dev, _ram, _t) = flakey("1 1");
    let mut devs = Devices::new();
    devs.ram("r", 64);
    let t = devs.table("0 64 flakey r 0 1 2 5 corrupt_bio_byte 32 r 1 0");
    assert_eq!(
        t.table_lines(),
        ["0 64 flakey r 0 1 2 5 corrupt_bio_byte 32 r 1 0"]
    );
    let t = devs.table("0 64 flakey r 0 1 2 2 error_reads drop_writes");
    assert_eq!(
        t.table_lines(),
        ["0 64 flakey r 0 1 2 2 drop_writes error_reads"]
    );
    assert_eq!(
        devs.table("0 64 flakey r 0 1 2").table_lines(),
        ["0 64 flakey r 0 1 2 0"]
    );
    for (line, want) in [
        ("r 0 0 0", "total (up + down) interval is zero"),
        ("r 0 x 1", "invalid up interval 'x'"),
        ("r 0 1 1 1 bogus", "unrecognised feature 'bogus'"),
        ("r 0 1 1 2 drop_writes error_writes", "conflicts"),
        ("r 0 1 1 2 drop_writes drop_writes", "duplicated"),
        ("r 0 1 1 1 corrupt_bio_byte", "requires"),
        ("r 0 1 1 5 corrupt_bio_byte 1 x 1 0", "direction 'x'"),
        (
            "r 0 1 1 5 corrupt_bio_byte 1 r 256 0",
            "invalid corrupt value '256'",
        ),
        (
            "r 0 1 1 3 drop_writes random_write_corrupt 5",
            "incompatible",
        ),
        (
            "r 0 1 1 2 random_read_corrupt 1000000001",
            "random read corrupt",
        ),
        (
            "r 0 1 1 3 error_reads",
            "3 feature arguments announced, 1 given",
        ),
        ("r 0 1", "not enough arguments"),
    ] {
        let e = devs.table_err(&format!("0 64 flakey {line}"));
        assert!(e.contains(want), "'{line}': {e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
}

// ---------------------------------------------------------------------------
// dust
// ---------------------------------------------------------------------------

fn msg(md: &MappedDevice, m: &str) -> Result<String, Error> {
    let argv: Vec<&str> = m.split_whitespace().collect();
    md.message(0, &argv)
}

#[test]
fn dust_bad_block_life_cycle_through_messages() {
    let mut devs = Devices::new();
    let ram = devs.ram("r", 64);
    let t = Tester::new();
    t.write(&ram, 0, pattern(1, 0, 64));
    // 4 KiB blocks: 8 sectors each.
    let md = devs.mapped("du", "0 64 dust r 0 4096");
    let dev = as_dev(&md);
    assert_eq!(md.table().status_lines(), ["0 64 dust r bypass verbose"]);
    assert_eq!(
        msg(&md, "countbadblocks").unwrap(),
        "countbadblocks: 0 badblock(s) found"
    );
    assert_eq!(
        msg(&md, "listbadblocks").unwrap(),
        "No blocks in badblocklist"
    );
    msg(&md, "addbadblock 1").unwrap();
    msg(&md, "addbadblock 3").unwrap();
    assert!(msg(&md, "addbadblock 1")
        .unwrap_err()
        .to_string()
        .contains("already in badblocklist"));
    // Disabled: bad blocks read fine.
    assert_eq!(t.read(&dev, 8, 8), pattern(1, 8, 8));
    msg(&md, "enable").unwrap();
    assert_eq!(
        md.table().status_lines(),
        ["0 64 dust r fail_read_on_bad_block verbose"]
    );
    assert_eq!(status(&t, &dev, Req::read(8, 8)), Status::IoErr);
    assert_eq!(
        status(&t, &dev, Req::read(12, 1)),
        Status::IoErr,
        "any sector of the block"
    );
    // A read across blocks 0..2 fails (its block-1 part), block 0 and 2 alone pass.
    assert_eq!(status(&t, &dev, Req::read(0, 24)), Status::IoErr);
    assert_eq!(t.read(&dev, 0, 8), pattern(1, 0, 8));
    assert_eq!(t.read(&dev, 16, 8), pattern(1, 16, 8));
    assert_eq!(
        msg(&md, "queryblock 1").unwrap(),
        "dust_query_block: block 1 found in badblocklist"
    );
    assert_eq!(msg(&md, "listbadblocks").unwrap(), "1\n3");
    assert_eq!(
        msg(&md, "countbadblocks").unwrap(),
        "countbadblocks: 2 badblock(s) found"
    );
    // A write to a bad block succeeds and clears it.
    t.write(&dev, 8, pattern(2, 8, 8));
    assert_eq!(
        msg(&md, "queryblock 1").unwrap(),
        "dust_query_block: block 1 not found in badblocklist"
    );
    assert_eq!(t.read(&dev, 8, 8), pattern(2, 8, 8));
    // removebadblock, then a missing one is an error.
    msg(&md, "removebadblock 3").unwrap();
    assert!(msg(&md, "removebadblock 3")
        .unwrap_err()
        .to_string()
        .contains("not found"));
    // A write failure count: that many writes fail first.
    msg(&md, "addbadblock 5 2").unwrap();
    for _ in 0..2 {
        assert_eq!(
            status(&t, &dev, Req::write(40, pattern(3, 40, 8))),
            Status::IoErr
        );
    }
    assert_eq!(status(&t, &dev, Req::read(40, 8)), Status::IoErr);
    t.write(&dev, 40, pattern(3, 40, 8));
    assert_eq!(t.read(&dev, 40, 8), pattern(3, 40, 8));
    // clearbadblocks, disable, quiet.
    msg(&md, "addbadblock 6").unwrap();
    assert_eq!(
        msg(&md, "clearbadblocks").unwrap(),
        "dust_clear_badblocks: badblocks cleared"
    );
    assert_eq!(
        msg(&md, "clearbadblocks").unwrap(),
        "dust_clear_badblocks: no badblocks found"
    );
    msg(&md, "addbadblock 6").unwrap();
    msg(&md, "disable").unwrap();
    assert_eq!(t.read(&dev, 48, 8), pattern(1, 48, 8));
    msg(&md, "quiet").unwrap();
    assert_eq!(md.table().status_lines(), ["0 64 dust r bypass quiet"]);
    assert_eq!(md.table().table_lines(), ["0 64 dust r 0 4096"]);
    for (m, want) in [
        ("addbadblock x", "invalid block 'x'"),
        ("addbadblock 9", "out of range"),
        ("addbadblock 1 256", "invalid write fail count '256'"),
        ("frobnicate", "unknown message 'frobnicate'"),
    ] {
        let e = msg(&md, m).unwrap_err().to_string();
        assert!(e.contains(want), "'{m}': {e}");
    }
    for (line, want) in [
        ("r 0 100", "at least 512"),
        ("r 0 1536", "power of 2"),
        ("r 0 x", "invalid block size 'x'"),
        ("r x 512", "invalid device offset sector 'x'"),
    ] {
        let e = devs.table_err(&format!("0 64 dust {line}"));
        assert!(e.contains(want), "'{line}': {e}");
    }
}

// ---------------------------------------------------------------------------
// delay
// ---------------------------------------------------------------------------

/// The asked delay: large against scheduling noise on a loaded 2-core host.
const DELAY_MS: u64 = 30;

/// Runs `total` requests made by `req(i)` at queue depth `qd`; returns each
/// one's latency, in submission order, and checks that they completed in
/// submission order.
fn run_at_depth(
    t: &Tester,
    dev: &Arc<dyn BlockDevice>,
    qd: usize,
    total: usize,
    req: impl Fn(usize) -> Req,
) -> Vec<Duration> {
    let ch = t.open(dev);
    let mut inflight: Vec<(usize, Instant, InFlight)> = Vec::new();
    let mut lat = vec![Duration::ZERO; total];
    let mut next = 0;
    let mut completed = 0;
    let start = Instant::now();
    while completed < total {
        while inflight.len() < qd && next < total {
            inflight.push((next, Instant::now(), submit(&t.reactor, &*ch, req(next))));
            next += 1;
        }
        t.reactor
            .run_until(|| inflight.iter().any(|(_, _, f)| f.is_done()));
        let now = Instant::now();
        let mut i = 0;
        while i < inflight.len() {
            if inflight[i].2.is_done() {
                let (n, at, f) = inflight.remove(i);
                // In order: nothing submitted before it is still in flight.
                assert!(
                    inflight.iter().all(|(m, _, _)| *m > n),
                    "request {n} completed before an earlier one"
                );
                let d = f.finish();
                assert_eq!(d.status, Status::Ok, "request {n}");
                lat[n] = now - at;
                completed += 1;
            } else {
                i += 1;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "delay test stuck"
        );
    }
    lat
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn delay_adds_its_latency_at_qd1_and_qd32_and_keeps_order() {
    let mut devs = Devices::new();
    devs.ram("r", 4096);
    let md = devs.mapped("dl", &format!("0 4096 delay r 0 {DELAY_MS}"));
    let dev = as_dev(&md);
    let t = Tester::new();
    let want = Duration::from_millis(DELAY_MS);
    // Never early; late by a scheduler's lag at most, well short of a
    // second delay.
    let within = |p: Duration, what: &str| {
        let lo = want.mul_f64(0.9);
        let hi = want.mul_f64(1.5);
        assert!(
            p >= lo && p <= hi,
            "{what}: p50 {p:?} not within -10%..+50% of {want:?}"
        );
    };
    let qd1 = run_at_depth(&t, &dev, 1, 15, |i| Req::read((i as u64 * 8) % 4096, 8));
    within(p50(qd1), "reads at QD1");
    let qd32 = run_at_depth(&t, &dev, 32, 96, |i| {
        Req::write((i as u64 * 8) % 4096, pattern(i as u64, 0, 8))
    });
    within(p50(qd32), "writes at QD32");
    // No bio is held once all completed.
    assert_eq!(md.table().status_lines(), ["0 4096 delay 0 0"]);
}

#[test]
fn delay_of_zero_is_a_pass_through_and_lines_are_as_dm() {
    let mut devs = Devices::new();
    let r = devs.ram("r", 64);
    let w = devs.ram("w", 128);
    let md = devs.mapped("dl0", "0 64 delay r 0 0 w 64 0");
    let dev = as_dev(&md);
    let t = Tester::new();
    t.write(&dev, 0, pattern(7, 0, 8));
    assert_eq!(
        t.read(&w, 64, 8),
        pattern(7, 0, 8),
        "writes go to the write device"
    );
    assert_eq!(
        t.read(&dev, 0, 8),
        vec![0; 8 * SECTOR],
        "reads from the read device"
    );
    let _ = r;
    assert_eq!(md.table().table_lines(), ["0 64 delay r 0 0 w 64 0"]);
    assert_eq!(md.table().status_lines(), ["0 64 delay 0 0"]);
    let t9 = devs.table("0 64 delay r 0 1 w 0 2 r 0 3");
    assert_eq!(t9.table_lines(), ["0 64 delay r 0 1 w 0 2 r 0 3"]);
    assert_eq!(t9.status_lines(), ["0 64 delay 0 0 0"]);
    for (line, want) in [
        ("r 0 1 w", "expected exactly 3, 6 or 9"),
        ("r 0 x", "invalid delay 'x'"),
        ("r x 1", "invalid offset 'x'"),
        ("r 32 1", "too small"),
    ] {
        let e = devs.table_err(&format!("0 64 delay {line}"));
        assert!(e.contains(want), "'{line}': {e}");
    }
}

/// A suspend lets held bios go at once rather than waiting out the delay.
#[test]
fn delay_suspend_flushes_held_io() {
    let mut devs = Devices::new();
    devs.ram("r", 64);
    let md = devs.mapped("dls", "0 64 delay r 0 1 r 0 10000");
    let dev = as_dev(&md);
    let rt = ReactorThread::spawn("delay-io");
    let rx = rt.submit(&dev, Req::write(0, pattern(8, 0, 8)));
    // Wait until the write is held.
    let t0 = Instant::now();
    while md.table().status_lines() != ["0 64 delay 0 1"] {
        assert!(t0.elapsed() < Duration::from_secs(10), "write never held");
        std::thread::sleep(Duration::from_millis(1));
    }
    let t1 = Instant::now();
    md.suspend(false).expect("suspend");
    let d = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("write released");
    assert_eq!(d.status, Status::Ok);
    assert!(
        t1.elapsed() < Duration::from_secs(5),
        "suspend waited out the delay"
    );
    md.resume().expect("resume");
    assert_eq!(rt.read(&dev, 0, 8), pattern(8, 0, 8));
}

// ---------------------------------------------------------------------------
// log-writes
// ---------------------------------------------------------------------------

/// Writes, discards, write-zeroes and FUA writes through log-writes, a flush
/// and a mark after each round; replaying the log to each mark onto a fresh
/// device gives the bytes the device held at that mark.
#[test]
fn log_writes_replays_to_the_same_bytes_at_every_mark() {
    const SECTORS: u64 = 2048;
    let mut devs = Devices::new();
    let data = devs.ram("data", SECTORS);
    let log = devs.ram("log", 64 * 1024);
    let md = devs.mapped("lw", &format!("0 {SECTORS} log-writes data log"));
    let dev = as_dev(&md);
    let t = Tester::new();
    let mut rng = Rng::new(26);
    let mut snaps = Vec::new();
    for round in 0..6u64 {
        let mut reqs = Vec::new();
        for _ in 0..12 {
            let n = rng.range(1, 32);
            let s = rng.range(0, 1024 - n);
            reqs.push(match rng.range(0, 8) {
                0 => Req::discard(s, n),
                1 => Req::write_zeroes(s, n),
                _ => Req::write(s, pattern(rng.next_u64(), s, n)),
            });
        }
        // FUA writes in an area of their own (they are logged as they
        // complete, ahead of earlier unflushed writes, as in dm).
        let s = 1024 + round * 16;
        reqs.push(Req::write(s, pattern(round, s, 8)).flags(BioFlags::FUA));
        // One at a time: overlapping writes in flight have no defined order.
        for r in reqs {
            assert_eq!(status(&t, &dev, r), Status::Ok);
        }
        assert_eq!(status(&t, &dev, Req::flush()), Status::Ok);
        msg(&md, &format!("mark m{round}")).expect("mark");
        snaps.push(t.read_all(&data));
    }
    let st = md.table().status_lines();
    assert!(
        st[0].starts_with(&format!("0 {SECTORS} log-writes ")),
        "{st:?}"
    );
    assert!(!st[0].contains("logging_disabled"), "{st:?}");
    let sup = replay::read_super(&log).expect("super");
    assert_eq!(sup.sectorsize, 512);
    assert!(sup.nr_entries > 6 * 13, "{sup:?}");
    let logdev: Arc<dyn BlockDevice> = log.clone();
    for (i, want) in snaps.iter().enumerate() {
        let mut rd = Devices::new();
        let target = rd.ram("replay", SECTORS);
        let mut flushes = 0;
        let s = replay::replay(
            logdev.clone(),
            target.clone(),
            &Stop::Mark(format!("m{i}")),
            |p| {
                assert!(p.flags & udm_mapper::targets::log_writes::format::FLUSH != 0);
                flushes += 1;
                Ok(())
            },
        )
        .expect("replay");
        assert_eq!(s.marks as usize, i + 1);
        assert_eq!(flushes, i + 1, "one flush per round");
        common::assert_sectors_eq(&t.read_all(&target), want, &format!("replay to m{i}"));
    }
    // A mark that is not there, and a limit.
    let mut rd = Devices::new();
    let target = rd.ram("replay", SECTORS);
    let e = replay::replay(
        logdev.clone(),
        target.clone(),
        &Stop::Mark("nope".into()),
        |_| Ok(()),
    )
    .unwrap_err();
    assert!(e.to_string().contains("mark 'nope' not found"), "{e}");
    let s = replay::replay(logdev, target, &Stop::Limit(3), |_| Ok(())).expect("limit");
    assert_eq!(s.entries, 3);
    // Destroying the target logs the end mark (the tester's reactor holds
    // the device's channel, and so the table, until it goes).
    drop(dev);
    drop(md);
    drop(t);
    let sup2 = replay::read_super(&log).expect("super");
    assert_eq!(sup2.nr_entries, sup.nr_entries + 1, "end mark");
    assert_eq!(
        msg_err_on_bad_message(&devs),
        "log-writes: unknown message 'frob' (known: mark <name>)"
    );
}

fn msg_err_on_bad_message(devs: &Devices) -> String {
    let md = devs.mapped("lw2", "0 64 log-writes data log");
    msg(&md, "frob").expect_err("unknown message").to_string()
}

#[test]
fn fault_targets_are_registered_with_their_grammar() {
    let reg = Registry::builtin();
    for name in ["flakey", "delay", "dust", "log-writes"] {
        let t = reg.get(name).unwrap_or_else(|| panic!("{name} registered"));
        assert!(!t.usage.is_empty() && !t.summary.is_empty());
    }
}
