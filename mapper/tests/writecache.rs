//! The writecache target as users see it: reads and writes through the
//! cache, writeback to the origin, watermarks, the cleaner, restart from the
//! on-disk metadata, status and table lines, and the constructor's errors.

mod common;

use std::sync::Arc;

use common::*;
use udm_core::{BioFlags, BlockDevice, Op, Status};
use udm_mapper::MappedDevice;

/// Origin 8 MiB, cache 2 MiB: about 480 blocks of 4 KiB.
fn setup() -> Devices {
    let mut d = Devices::new();
    d.ram("origin", 16384);
    d.ram("cache", 4096);
    d
}

fn wc(d: &Devices, features: &str) -> Arc<MappedDevice> {
    d.mapped(
        "wc",
        &format!("0 16384 writecache s origin cache 4096 {features}"),
    )
}

/// The status line's numbers.
fn status(md: &MappedDevice) -> Vec<u64> {
    let l = md.table().status_lines().remove(0);
    l.split_whitespace()
        .skip(3)
        .map(|x| x.parse().expect("number"))
        .collect()
}

const ERR: usize = 0;
const BLOCKS: usize = 1;
const FREE: usize = 2;
const WB: usize = 3;
const READ_HITS: usize = 5;
const WRITES_AROUND: usize = 9;
const WRITES_BLOCKED: usize = 11;

#[test]
fn writes_are_read_back_from_the_cache_and_leave_the_origin_alone() {
    let d = setup();
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    let t = Tester::new();
    t.write(&dev, 64, pattern(1, 64, 128));
    assert_sectors_eq(&t.read(&dev, 64, 128), &pattern(1, 64, 128), "read back");
    let origin = d.get("origin");
    assert!(
        t.read(&origin, 64, 128).iter().all(|&b| b == 0),
        "origin untouched"
    );
    let s = status(&md);
    assert_eq!(s[ERR], 0);
    assert_eq!(s[READ_HITS], 16, "16 blocks read from the cache");
    assert_eq!(s[BLOCKS] - s[FREE], 16, "16 blocks used");
}

#[test]
fn a_read_spanning_hits_and_misses_is_split_and_completed_once() {
    let d = setup();
    let origin = d.get("origin");
    let t = Tester::new();
    t.write(&origin, 0, pattern(7, 0, 256));
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    // Cache blocks 2 and 5..7 (sectors 16..24, 40..56).
    t.write(&dev, 16, pattern(8, 16, 8));
    t.write(&dev, 40, pattern(8, 40, 16));
    let mut want = pattern(7, 0, 256);
    want[16 * SECTOR..24 * SECTOR].copy_from_slice(&pattern(8, 16, 8));
    want[40 * SECTOR..56 * SECTOR].copy_from_slice(&pattern(8, 40, 16));
    let got = t.run(&dev, Req::read(0, 256).segs(5));
    got.assert_returned_intact();
    assert_eq!(got.status, Status::Ok);
    assert_sectors_eq(&got.data, &want, "mixed read");
}

#[test]
fn overwrites_return_the_newest_data_before_and_after_commits() {
    let d = setup();
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    let t = Tester::new();
    t.write(&dev, 0, pattern(1, 0, 64));
    // Uncommitted: overwritten in place.
    t.write(&dev, 8, pattern(2, 8, 16));
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    // Committed: the new data goes to new blocks.
    t.write(&dev, 16, pattern(3, 16, 32));
    let mut want = pattern(1, 0, 64);
    want[8 * SECTOR..24 * SECTOR].copy_from_slice(&pattern(2, 8, 16));
    want[16 * SECTOR..48 * SECTOR].copy_from_slice(&pattern(3, 16, 32));
    assert_sectors_eq(&t.read(&dev, 0, 64), &want, "after overwrites");
    let s = status(&md);
    assert_eq!(s[7], 2, "write hits on uncommitted blocks");
    assert_eq!(s[8], 4, "write hits on committed blocks");
}

#[test]
fn flush_message_writes_everything_back_to_the_origin() {
    let d = setup();
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    let t = Tester::new();
    let mut rng = Rng::new(3);
    let mut want = vec![0u8; 16384 * SECTOR];
    for i in 0..100 {
        let s = rng.range(0, 16384 / 8 - 4) * 8;
        let n = rng.range(1, 4) * 8;
        let data = pattern(i, s, n);
        want[s as usize * SECTOR..(s + n) as usize * SECTOR].copy_from_slice(&data);
        t.write(&dev, s, data);
    }
    assert_eq!(md.message(0, &["flush"]).expect("flush"), "");
    let s = status(&md);
    assert_eq!(s[FREE], s[BLOCKS], "everything written back and freed");
    let origin = d.get("origin");
    assert_sectors_eq(&t.read_all(&origin), &want, "origin after flush");
    assert_sectors_eq(&t.read_all(&dev), &want, "device after flush");
}

/// Watermark writeback starts at `high_watermark` and writes back the
/// oldest blocks until `low_watermark` is reached, then stops: the newest
/// blocks stay cached (as dm's loop on `freelist_low_watermark`). A pass
/// that took every committed block would empty the cache instead.
#[test]
fn writeback_starts_above_the_high_watermark_and_stops_at_the_low() {
    let d = setup();
    let md = wc(&d, "4 high_watermark 20 low_watermark 10");
    let dev = as_dev(&md);
    let t = Tester::new();
    let n = status(&md)[BLOCKS];
    let low = n * 10 / 100;
    // Fill 40% of the cache, oldest first, and commit it: 10% a block a
    // write, below the high watermark, then the rest in one write, which
    // crosses it. (Crossed in small writes, the fill races the pass: a
    // worker that catches up with them ends its pass at the low watermark,
    // and the writes after that leave the cache between the watermarks,
    // where no pass starts; see the next test.)
    let blocks = n * 40 / 100;
    let below_high = n * 10 / 100;
    for b in 0..below_high {
        t.write(&dev, b * 8, pattern(5, b * 8, 8));
    }
    let rest = below_high * 8..blocks * 8;
    t.write(
        &dev,
        rest.start,
        pattern(5, rest.start, rest.end - rest.start),
    );
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    wait_for("writeback down to the low watermark", || {
        let s = status(&md);
        (s[BLOCKS] - s[FREE]) * 100 <= s[BLOCKS] * 10
    });
    // Settled: nothing under writeback, and no further pass empties it.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let s = status(&md);
    assert_eq!(s[WB], 0, "nothing under writeback: {s:?}");
    assert_eq!(
        s[BLOCKS] - s[FREE],
        low,
        "the low watermark's blocks stay: {s:?}"
    );
    let origin = d.get("origin");
    let o = t.read(&origin, 0, blocks * 8);
    let back: Vec<bool> = o.chunks(4096).map(|c| c.iter().any(|&b| b != 0)).collect();
    let oldest = (blocks - low) as usize;
    assert!(
        back[..oldest].iter().all(|&x| x),
        "the {oldest} oldest blocks went back"
    );
    assert!(
        back[oldest..].iter().all(|&x| !x),
        "the {low} newest blocks stayed in the cache only"
    );
    assert_sectors_eq(
        &t.read(&dev, 0, blocks * 8),
        &pattern(5, 0, blocks * 8),
        "data",
    );
}

/// A pass ends at the low watermark; the blocks written after it stay
/// cached while the cache stays below the high watermark, and crossing it
/// again starts the next pass (dm's hysteresis). The writes after the pass
/// are what a fill in small writes meets when the worker catches up with
/// it: here they wait for the pass to end instead of racing it.
#[test]
fn blocks_written_after_a_pass_stay_cached_until_the_high_watermark_again() {
    let d = setup();
    let md = wc(&d, "4 high_watermark 20 low_watermark 10");
    let dev = as_dev(&md);
    let t = Tester::new();
    let n = status(&md)[BLOCKS];
    let (low, mid) = (n * 10 / 100, n * 15 / 100);
    let used = || {
        let s = status(&md);
        s[BLOCKS] - s[FREE]
    };
    let origin = d.get("origin");
    // Which of the first `upto` origin blocks the origin holds.
    let went_back = |upto: u64| -> Vec<bool> {
        let o = t.read(&origin, 0, upto * 8);
        o.chunks(4096).map(|c| c.iter().any(|&b| b != 0)).collect()
    };
    // 30% in one write: over the high watermark, a pass to the low one.
    let a = n * 30 / 100;
    t.write(&dev, 0, pattern(7, 0, a * 8));
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    wait_for("the first pass to end", || used() <= low);
    assert_eq!(used(), low, "the first pass stopped at the low watermark");
    // The pass is over: a block a write up to 15%, between the watermarks.
    let b = a + (mid - low);
    for blk in a..b {
        t.write(&dev, blk * 8, pattern(7, blk * 8, 8));
    }
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let s = status(&md);
    assert_eq!(
        s[BLOCKS] - s[FREE],
        mid,
        "no pass below the high watermark: {s:?}"
    );
    assert_eq!(s[WB], 0, "nothing under writeback: {s:?}");
    let back = went_back(b);
    assert!(
        back[..(a - low) as usize].iter().all(|&x| x)
            && back[(a - low) as usize..].iter().all(|&x| !x),
        "only the first pass's blocks went back"
    );
    // Over the high watermark again (25%, in one write): the next pass
    // takes the oldest blocks, the first pass's newest among them.
    let c = b + n * 10 / 100;
    t.write(&dev, b * 8, pattern(7, b * 8, (c - b) * 8));
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    wait_for("the second pass to end", || used() <= low);
    assert_eq!(used(), low, "the second pass stopped at the low watermark");
    let back = went_back(c);
    let oldest = (c - low) as usize;
    assert!(
        back[..oldest].iter().all(|&x| x) && back[oldest..].iter().all(|&x| !x),
        "the {oldest} oldest blocks went back, the {low} newest stayed"
    );
    assert_sectors_eq(&t.read(&dev, 0, c * 8), &pattern(7, 0, c * 8), "data");
}

#[test]
fn writes_crossing_the_high_watermark_start_writeback_so_later_writes_find_free_blocks() {
    // No flush, no FUA, and an autocommit timer far beyond the test's
    // timeout: only crossing the high watermark (50%) can start writeback.
    let d = setup();
    let md = wc(&d, "2 autocommit_time 600000");
    let dev = as_dev(&md);
    let t = Tester::new();
    let n = status(&md)[BLOCKS];
    let first = n * 70 / 100;
    // 30%, then 40% more: the first write wakes the worker (it starts the
    // autocommit clock) below the watermark, the second crosses it.
    let third = n * 30 / 100;
    t.write(&dev, 0, pattern(1, 0, third * 8));
    std::thread::sleep(std::time::Duration::from_millis(50));
    t.write(&dev, third * 8, pattern(1, third * 8, (first - third) * 8));
    wait_for("writeback down to the low watermark (45%)", || {
        let s = status(&md);
        (s[BLOCKS] - s[FREE]) * 100 <= s[BLOCKS] * 45
    });
    // The next 40% of the cache in new blocks: free blocks are there.
    let second = n * 40 / 100;
    t.write(&dev, first * 8, pattern(2, first * 8, second * 8));
    let s = status(&md);
    assert_eq!(s[WRITES_BLOCKED], 0, "no write waited for free blocks");
    assert_eq!(s[ERR], 0);
    let all = (first + second) * 8;
    let mut want = pattern(1, 0, first * 8);
    want.extend(pattern(2, first * 8, second * 8));
    assert_sectors_eq(&t.read(&dev, 0, all), &want, "device");
    let origin = d.get("origin");
    let o = t.read(&origin, 0, first * 8);
    let written_back = o.chunks(4096).filter(|c| c.iter().any(|&b| b != 0)).count() as u64;
    assert!(
        written_back >= first - n * 45 / 100,
        "the oldest blocks went back: {written_back} of {first}"
    );
}

#[test]
fn writeback_of_an_aged_cache_takes_origin_neighbours_along_in_large_writes() {
    // The origin is counted through a linear device. Batches are kept to
    // 32 blocks (writeback_jobs), as the oldest blocks of a large cache
    // are a small sample of it: each block picked brings its cached origin
    // neighbours with it, so the region goes back in a few large writes,
    // not one write per block.
    let mut d = Devices::new();
    d.ram("oram", 16384);
    d.ram("cache", 4096);
    let origin = d.mapped("origin", "0 16384 linear oram 0");
    d.add(as_dev(&origin));
    let md = wc(&d, "2 writeback_jobs 32");
    let dev = as_dev(&md);
    let t = Tester::new();
    let n = status(&md)[BLOCKS];
    // 60% of the cache: a region of the origin, one block a write, in a
    // random order (the list's oldest blocks are scattered over it).
    let region = n * 60 / 100;
    let mut order: Vec<u64> = (0..region).collect();
    let mut rng = Rng::new(27);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.range(0, i as u64 + 1) as usize);
    }
    let reqs = order
        .iter()
        .map(|&b| Req::write(b * 8, pattern(3, b * 8, 8)))
        .collect();
    for r in t.run_all(&dev, reqs) {
        assert_eq!(r.status, Status::Ok);
    }
    let before = origin.stats().snapshot().ios[Op::Write as usize];
    assert_eq!(md.message(0, &["flush"]).expect("flush"), "");
    let writes = origin.stats().snapshot().ios[Op::Write as usize] - before;
    assert!(
        writes <= region / 8,
        "{region} blocks went back in {writes} origin writes: neighbours were not taken along"
    );
    let od = as_dev(&origin);
    assert_sectors_eq(
        &t.read(&od, 0, region * 8),
        &pattern(3, 0, region * 8),
        "origin after writeback",
    );
}

#[test]
fn the_cleaner_drains_the_cache_and_then_writes_go_around_it() {
    let d = setup();
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    let t = Tester::new();
    t.write(&dev, 0, pattern(1, 0, 256));
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    md.message(0, &["cleaner"]).expect("cleaner");
    wait_for("the cleaner to drain", || {
        let s = status(&md);
        s[FREE] == s[BLOCKS]
    });
    t.write(&dev, 1024, pattern(2, 1024, 64));
    assert_eq!(status(&md)[WRITES_AROUND], 8);
    let origin = d.get("origin");
    assert_sectors_eq(&t.read(&origin, 0, 256), &pattern(1, 0, 256), "drained");
    assert_sectors_eq(&t.read(&origin, 1024, 64), &pattern(2, 1024, 64), "around");
    let tl = md.table().table_lines().remove(0);
    assert_eq!(tl, "0 16384 writecache s origin cache 4096 0");
}

#[test]
fn pause_writeback_holds_watermark_writeback_after_writes_around() {
    let d = setup();
    let md = wc(
        &d,
        "6 high_watermark 1 low_watermark 0 pause_writeback 60000",
    );
    let dev = as_dev(&md);
    let t = Tester::new();
    md.message(0, &["cleaner"]).expect("cleaner");
    // A write around the cache (the cleaner caches nothing new) ...
    t.write(&dev, 0, pattern(1, 0, 8));
    assert_eq!(status(&md)[WRITES_AROUND], 1);
    // ... does not pause a drain that was asked for: flush still works.
    assert_eq!(md.message(0, &["flush"]).expect("flush"), "");
}

#[test]
fn a_clean_restart_finds_the_committed_data() {
    let d = setup();
    let t = Tester::new();
    {
        let md = wc(&d, "0");
        let dev = as_dev(&md);
        t.write(&dev, 0, pattern(1, 0, 512));
        t.write(&dev, 100 * 8, pattern(2, 800, 8));
        assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
        t.write(&dev, 200 * 8, pattern(3, 1600, 8).clone());
        // FUA: durable on completion, no flush needed.
        let d2 = t.run(
            &dev,
            Req::write(300 * 8, pattern(4, 2400, 8)).flags(BioFlags::FUA),
        );
        assert_eq!(d2.status, Status::Ok);
    }
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    assert_sectors_eq(&t.read(&dev, 0, 512), &pattern(1, 0, 512), "flushed");
    assert_sectors_eq(&t.read(&dev, 800, 8), &pattern(2, 800, 8), "flushed");
    assert_sectors_eq(&t.read(&dev, 2400, 8), &pattern(4, 2400, 8), "fua");
    let s = status(&md);
    assert!(
        s[BLOCKS] - s[FREE] >= 66,
        "entries rebuilt from metadata: {s:?}"
    );
}

#[test]
fn suspend_commits_and_flush_on_suspend_writes_back() {
    let d = setup();
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    let rt = ReactorThread::spawn("wc-suspend");
    rt.write(&dev, 0, pattern(1, 0, 64));
    md.message(0, &["flush_on_suspend"]).expect("message");
    md.suspend(false).expect("suspend");
    let s = status(&md);
    assert_eq!(s[FREE], s[BLOCKS], "written back on suspend");
    md.resume().expect("resume");
    let origin = d.get("origin");
    assert_sectors_eq(&rt.read(&origin, 0, 64), &pattern(1, 0, 64), "origin");
}

#[test]
fn clear_stats_zeroes_the_counters_and_unknown_messages_are_named() {
    let d = setup();
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    let t = Tester::new();
    t.write(&dev, 0, pattern(1, 0, 8));
    assert!(status(&md)[6] > 0);
    md.message(0, &["clear_stats"]).expect("clear_stats");
    assert!(status(&md)[4..].iter().all(|&x| x == 0));
    let e = md.message(0, &["frobnicate"]).unwrap_err().to_string();
    assert!(e.contains("unknown message 'frobnicate'"), "{e}");
}

#[test]
fn status_and_table_lines_follow_dm() {
    let d = setup();
    let md = wc(&d, "5 high_watermark 60 low_watermark 40 nocoalesce");
    let sl = md.table().status_lines().remove(0);
    let f: Vec<&str> = sl.split_whitespace().collect();
    assert_eq!(&f[..3], &["0", "16384", "writecache"]);
    assert_eq!(f.len(), 3 + 14, "{sl}");
    assert_eq!(f[3], "0", "no error");
    assert_eq!(f[4], f[5], "all blocks free");
    assert_eq!(
        md.table().table_lines().remove(0),
        "0 16384 writecache s origin cache 4096 5 high_watermark 60 low_watermark 40 nocoalesce"
    );
}

#[test]
fn bad_arguments_are_rejected_with_one_line_naming_them() {
    let d = setup();
    let e = |args: &str| d.table_err(&format!("0 16384 writecache {args}"));
    let cases = [
        ("s origin cache 4096", "not enough arguments"),
        ("p origin cache 4096 0", "mode 'p'"),
        ("x origin cache 4096 0", "invalid mode 'x'"),
        ("s nope cache 4096 0", "no device 'nope'"),
        ("s origin cache 3000 0", "invalid block size '3000'"),
        ("s origin cache 131072 0", "invalid block size '131072'"),
        (
            "s origin cache 4096 z",
            "invalid number of feature arguments 'z'",
        ),
        (
            "s origin cache 4096 2 cleaner",
            "number of feature arguments is 2 but 1 follow",
        ),
        (
            "s origin cache 4096 2 high_watermark 101",
            "invalid high_watermark '101'",
        ),
        (
            "s origin cache 4096 2 low_watermark x",
            "invalid low_watermark 'x'",
        ),
        (
            "s origin cache 4096 4 high_watermark 10 low_watermark 20",
            "low_watermark 20 is above",
        ),
        (
            "s origin cache 4096 1 autocommit_time",
            "feature 'autocommit_time' needs a value",
        ),
        (
            "s origin cache 4096 2 autocommit_blocks 0",
            "invalid autocommit_blocks '0'",
        ),
        (
            "s origin cache 4096 2 start_sector 99999",
            "invalid start_sector '99999'",
        ),
        ("s origin cache 4096 1 turbo", "unknown feature 'turbo'"),
        ("s origin cache 4096 2 max_age 0", "invalid max_age '0'"),
    ];
    for (args, want) in cases {
        let msg = e(args);
        assert!(msg.contains(want), "{args}: {msg}");
        assert!(!msg.contains('\n'), "one line: {msg}");
        assert!(msg.contains("writecache"), "names the target: {msg}");
    }
    assert!(d
        .table_err("0 20000 writecache s origin cache 4096 0")
        .contains("origin 'origin' is too small"));
    assert!(d
        .table_err("0 16380 writecache s origin cache 4096 0")
        .contains("not a multiple of the block size"));
    // 2^32 blocks of 512 bytes: origin block numbers are 32-bit.
    assert!(d
        .table_err("0 4294967296 writecache s origin cache 512 0")
        .contains("too large: at most 4294967295 blocks"));
}

#[test]
fn a_cache_formatted_with_another_block_size_is_refused() {
    let d = setup();
    drop(wc(&d, "0"));
    let e = d.table_err("0 16384 writecache s origin cache 8192 0");
    assert!(
        e.contains("block size 8192 does not match the cache's (4096)"),
        "{e}"
    );
}

#[test]
fn the_cache_device_is_not_a_free_for_all_after_a_restart() {
    // Rewrite the same blocks many times across commits and restarts: the
    // newest version always wins.
    let d = setup();
    let t = Tester::new();
    for round in 0..5u64 {
        let md = wc(&d, "2 autocommit_blocks 3");
        let dev = as_dev(&md);
        for k in 0..10u64 {
            t.write(&dev, k * 8, pattern(round * 100 + k, k * 8, 8));
        }
        assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
        for k in 0..10u64 {
            assert_sectors_eq(
                &t.read(&dev, k * 8, 8),
                &pattern(round * 100 + k, k * 8, 8),
                "before restart",
            );
        }
        drop(md);
        let md = wc(&d, "0");
        let dev: Arc<dyn BlockDevice> = as_dev(&md);
        for k in 0..10u64 {
            assert_sectors_eq(
                &t.read(&dev, k * 8, 8),
                &pattern(round * 100 + k, k * 8, 8),
                "after restart",
            );
        }
    }
}

/// A device in front of a RAM disk whose channel on one reactor can hold
/// writes back (they wait, unsubmitted, until released): a cache write
/// stays in flight for as long as a test needs.
struct GateDevice {
    /// Named "cache" for the tables below.
    inner: Arc<dyn BlockDevice>,
    key: u64,
}

struct GateChannel {
    inner: std::rc::Rc<dyn udm_core::Channel>,
    hold: std::cell::Cell<bool>,
    held: std::cell::RefCell<Vec<udm_core::BioPtr>>,
}

impl GateChannel {
    /// This reactor's gate channel for `gate` (opened by the stack above it).
    fn of(gate: &GateDevice, r: &udm_core::Reactor) -> std::rc::Rc<GateChannel> {
        r.local(gate.key)
            .and_then(|c| c.downcast::<GateChannel>().ok())
            .expect("the gate was opened on this reactor")
    }

    /// Submits what was held and stops holding.
    fn release(&self) {
        self.hold.set(false);
        for bio in std::mem::take(&mut *self.held.borrow_mut()) {
            self.inner.submit(bio);
        }
    }
}

impl udm_core::Channel for GateChannel {
    fn submit(&self, bio: udm_core::BioPtr) {
        if self.hold.get() && bio.op == udm_core::Op::Write {
            self.held.borrow_mut().push(bio);
        } else {
            self.inner.submit(bio);
        }
    }
}

impl BlockDevice for GateDevice {
    fn name(&self) -> &str {
        "cache"
    }
    fn limits(&self) -> udm_core::Limits {
        self.inner.limits()
    }
    fn caps(&self) -> udm_core::Caps {
        self.inner.caps()
    }
    fn open(
        self: Arc<Self>,
        r: &udm_core::Reactor,
    ) -> Result<std::rc::Rc<dyn udm_core::Channel>, udm_core::Error> {
        if let Some(c) = r
            .local(self.key)
            .and_then(|c| c.downcast::<GateChannel>().ok())
        {
            return Ok(c);
        }
        let c = std::rc::Rc::new(GateChannel {
            inner: self.inner.clone().open(r)?,
            hold: std::cell::Cell::new(false),
            held: std::cell::RefCell::new(Vec::new()),
        });
        r.set_local(self.key, c.clone());
        Ok(c)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[test]
fn a_read_during_a_blocks_first_write_returns_old_or_new_data_never_the_blocks_previous_contents() {
    let mut d = Devices::new();
    d.ram("origin", 16384);
    let raw: Arc<dyn BlockDevice> =
        Arc::new(udm_backends::RamDevice::new("raw", 4096 * 512).unwrap());
    let t = Tester::new();
    // Junk in every cache data block, as a reused block holds another
    // sector's data; the origin holds the old data.
    t.write(&raw, 0, pattern(66, 0, 4096));
    let old = pattern(1, 0, 64);
    t.write(&d.get("origin"), 0, old.clone());
    let gate = Arc::new(GateDevice {
        inner: raw,
        key: 0x6761_7465_0000_0001,
    });
    d.add(gate.clone());
    let md = d.mapped("wc", "0 16384 writecache s origin cache 4096 0");
    let dev = as_dev(&md);
    let ch = t.open(&dev);
    let g = GateChannel::of(&gate, &t.reactor);
    g.hold.set(true);
    let new = pattern(2, 8, 16);
    let f = vec![
        submit(&t.reactor, &*ch, Req::write(8, new.clone())),
        submit(&t.reactor, &*ch, Req::read(0, 32)),
    ];
    for _ in 0..20 {
        t.reactor.poll_once();
    }
    assert!(!f[0].is_done(), "the cache write is held in flight");
    g.release();
    t.wait_all(&f);
    let mut f = f.into_iter().map(InFlight::finish);
    assert_eq!(f.next().map(|w| w.status), Some(Status::Ok));
    let r = f.next().expect("the read");
    assert_eq!(r.status, Status::Ok);
    for s in 0..32usize {
        let got = &r.data[s * SECTOR..(s + 1) * SECTOR];
        let o = &old[s * SECTOR..(s + 1) * SECTOR];
        let is_new = (8..24).contains(&s) && got == &new[(s - 8) * SECTOR..(s - 7) * SECTOR];
        assert!(
            got == o || is_new,
            "sector {s}: neither the old nor the new data but {}",
            describe(got)
        );
    }
}

/// A writecache stacked under and over more layers than a bio has
/// completion frames ([`udm_core::bio::MAX_STACK`]): at every depth, in
/// particular the one where the bio reaches the engine with its frames all
/// used, I/O goes through (a stand-in descriptor carries it, as on the
/// mapper's clone path), data reads back, and writeback puts it on the
/// origin at the offsets every linear layer adds.
#[test]
fn a_writecache_stacked_deeper_than_the_frame_limit_still_verifies() {
    let max = udm_core::bio::MAX_STACK;
    for above in 0..=max + 2 {
        let mut devs = Devices::new();
        let r0 = devs.ram("r0", 16384 + 8);
        devs.ram("cache", 4096);
        // Under the cache: a linear that shifts by one block.
        let under = devs.mapped("under", "0 16384 linear r0 8");
        devs.add(as_dev(&under));
        let wcd = devs.mapped("wc", "0 16384 writecache s under cache 4096 0");
        devs.add(as_dev(&wcd));
        // Over it: `above` linears, each a block shorter and shifted by one.
        let mut below = "wc".to_string();
        let mut top = wcd.clone();
        for k in 0..above {
            let name = format!("over{k}");
            let md = devs.mapped(&name, &format!("0 {} linear {below} 8", 16376 - 8 * k));
            devs.add(as_dev(&md));
            below = name;
            top = md;
        }
        let dev = as_dev(&top);
        let t = Tester::new();
        let data = pattern(above as u64, 0, 64);
        let w = t.run(&dev, Req::write(0, data.clone()).segs(3));
        assert_eq!(
            w.status,
            Status::Ok,
            "write through {above} layers over the cache"
        );
        w.assert_returned_intact();
        assert_sectors_eq(&t.read(&dev, 0, 64), &data, "read back through the stack");
        assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok, "flush");
        assert_eq!(wcd.message(0, &["flush"]).expect("flush message"), "");
        let at = (8 + 8 * above) * SECTOR;
        assert_sectors_eq(
            &t.read_all(&r0)[at..at + 64 * SECTOR],
            &data,
            &format!("origin after writeback ({above} layers above)"),
        );
        assert_eq!(t.reactor.outstanding(), 0);
    }
}

/// A write over blocks whose first write is still in flight, completing
/// after it: it lands on top, and both read back, before and after a
/// flush and a restart.
#[test]
fn a_write_over_a_blocks_first_write_in_flight_lands_on_top() {
    let mut d = Devices::new();
    d.ram("origin", 16384);
    let raw: Arc<dyn BlockDevice> =
        Arc::new(udm_backends::RamDevice::new("raw", 4096 * 512).unwrap());
    let gate = Arc::new(GateDevice {
        inner: raw,
        key: 0x6761_7465_0000_0002,
    });
    d.add(gate.clone());
    let table = "0 16384 writecache s origin cache 4096 0";
    let t = Tester::new();
    let md = d.mapped("wc", table);
    let dev = as_dev(&md);
    let ch = t.open(&dev);
    let g = GateChannel::of(&gate, &t.reactor);
    g.hold.set(true);
    let a = pattern(1, 8, 16);
    let b = pattern(2, 16, 16);
    let f = vec![
        submit(&t.reactor, &*ch, Req::write(8, a.clone())),
        submit(&t.reactor, &*ch, Req::write(16, b.clone())),
    ];
    for _ in 0..20 {
        t.reactor.poll_once();
    }
    assert!(!f[0].is_done(), "the first write is held in flight");
    g.release();
    t.wait_all(&f);
    for r in f.into_iter().map(InFlight::finish) {
        assert_eq!(r.status, Status::Ok);
    }
    let mut want = a.clone();
    want.truncate(8 * SECTOR);
    want.extend_from_slice(&b);
    assert_sectors_eq(&t.read(&dev, 8, 24), &want, "the later write on top");
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    drop(ch);
    drop(dev);
    drop(md);
    let md = d.mapped("wc", table);
    assert_sectors_eq(&t.read(&as_dev(&md), 8, 24), &want, "after a restart");
}

/// A device in front of another, under another name, that reports other
/// capabilities or logical block size: a device without DISCARD, a 4Kn SSD.
struct Shaped {
    dev: Arc<dyn BlockDevice>,
    name: &'static str,
    no_caps: udm_core::Caps,
    lbs: Option<u32>,
    /// A smaller max I/O, enforced: longer bios fail with EINVAL, as
    /// a real device's would.
    max_io: Option<u32>,
}

/// A channel that refuses bios longer than `max` bytes.
struct Capped {
    ch: std::rc::Rc<dyn udm_core::Channel>,
    max: u32,
}

impl udm_core::Channel for Capped {
    fn submit(&self, bio: udm_core::BioPtr) {
        if bio.len() > self.max {
            bio.complete(Status::Inval);
        } else {
            self.ch.submit(bio);
        }
    }
}

impl Shaped {
    fn new(dev: Arc<dyn BlockDevice>, name: &'static str) -> Shaped {
        Shaped {
            dev,
            name,
            no_caps: udm_core::Caps::NONE,
            lbs: None,
            max_io: None,
        }
    }
}

impl BlockDevice for Shaped {
    fn name(&self) -> &str {
        self.name
    }
    fn limits(&self) -> udm_core::Limits {
        let mut l = self.dev.limits();
        if let Some(lbs) = self.lbs {
            l.logical_block_size = lbs;
        }
        if let Some(m) = self.max_io {
            l.max_io_bytes = m;
        }
        l
    }
    fn caps(&self) -> udm_core::Caps {
        let mut c = self.dev.caps();
        c.remove(self.no_caps);
        c
    }
    fn open(
        self: Arc<Self>,
        r: &udm_core::Reactor,
    ) -> Result<std::rc::Rc<dyn udm_core::Channel>, udm_core::Error> {
        let ch = self.dev.clone().open(r)?;
        Ok(match self.max_io {
            Some(max) => std::rc::Rc::new(Capped { ch, max }),
            None => ch,
        })
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// DISCARD drops the cached blocks of its range — committed, uncommitted
/// and just overwritten ones (whose older copies must be freed on disk
/// first) — and reaches the origin: the range then reads back as the
/// origin's discarded space (zeroes on RAM), also after a flush and a
/// restart (no dropped entry comes back), and the blocks are free again.
#[test]
fn discard_drops_cached_blocks_and_passes_on_to_the_origin() {
    let d = setup();
    let t = Tester::new();
    let origin = d.get("origin");
    t.write(&origin, 0, pattern(9, 0, 256));
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    assert!(dev.caps().contains(udm_core::Caps::DISCARD));
    t.write(&dev, 0, pattern(1, 0, 64));
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    // Blocks 2..4 overwritten after the commit (their old copies are
    // superseded, not yet free on disk), 16..24 never committed.
    t.write(&dev, 16, pattern(2, 16, 16));
    t.write(&dev, 128, pattern(3, 128, 64));
    let r = t.run(&dev, Req::discard(0, 192));
    assert_eq!(r.status, Status::Ok);
    let mut want = vec![0u8; 192 * SECTOR];
    want.extend_from_slice(&pattern(9, 192, 64));
    assert_sectors_eq(&t.read(&dev, 0, 256), &want, "discarded range");
    assert!(
        t.read(&origin, 0, 192).iter().all(|&b| b == 0),
        "the origin was discarded"
    );
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    let s = status(&md);
    assert_eq!(s[13], 24, "discards counted in blocks");
    // Released by the commits the flushes ran.
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    let s = status(&md);
    assert_eq!(s[FREE], s[BLOCKS], "every dropped block is free again");
    drop(dev);
    drop(md);
    let md = wc(&d, "0");
    assert_sectors_eq(&t.read(&as_dev(&md), 0, 256), &want, "after a restart");
    // Writes after the discard are cached again and win.
    let dev = as_dev(&md);
    t.write(&dev, 8, pattern(4, 8, 8));
    want[8 * SECTOR..16 * SECTOR].copy_from_slice(&pattern(4, 8, 8));
    assert_sectors_eq(&t.read(&dev, 0, 256), &want, "written after");
}

/// Discard is advertised (and so exported as NBD TRIM) only when the
/// origin takes it; otherwise it is refused, not half done.
#[test]
fn discard_is_offered_only_when_the_origin_takes_it() {
    let mut d = Devices::new();
    let ram: Arc<dyn BlockDevice> =
        Arc::new(udm_backends::RamDevice::new("origin-ram", 16384 * 512).unwrap());
    d.add(Arc::new(Shaped {
        no_caps: udm_core::Caps::DISCARD,
        ..Shaped::new(ram, "origin")
    }));
    d.ram("cache", 4096);
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    assert!(!dev.caps().contains(udm_core::Caps::DISCARD));
    let t = Tester::new();
    t.write(&dev, 0, pattern(1, 0, 8));
    assert_eq!(t.run(&dev, Req::discard(0, 8)).status, Status::NotSupp);
    assert_sectors_eq(&t.read(&dev, 0, 8), &pattern(1, 0, 8), "still cached");
}

/// A writecache never lets a device lend it memory for a caller's read: its
/// cache blocks are reused for other sectors, so the data must be in the
/// caller's buffer when the read completes, hit, miss or both.
#[test]
fn reads_through_the_cache_are_never_lent() {
    let d = setup();
    let t = Tester::new();
    t.write(&d.get("origin"), 0, pattern(7, 0, 256));
    let md = wc(&d, "0");
    let dev = as_dev(&md);
    t.write(&dev, 64, pattern(8, 64, 64));
    let mut want = pattern(7, 0, 256);
    want[64 * SECTOR..128 * SECTOR].copy_from_slice(&pattern(8, 64, 64));
    for (s, n) in [(64, 64), (0, 64), (32, 128)] {
        let got = t.run(&dev, Req::read(s, n).flags(BioFlags::MAY_LEND));
        got.assert_returned_intact();
        assert_eq!(got.status, Status::Ok);
        assert!(!got.lent, "read of {n} at {s} was lent");
        let (a, b) = (s as usize * SECTOR, (s + n) as usize * SECTOR);
        assert_sectors_eq(&got.data, &want[a..b], "read through the cache");
    }
}

/// As dm-writecache: a cache block smaller than either device's logical
/// block, or metadata that does not start on one of the cache's, could
/// not be written, so the table is refused, naming the device; 4 KiB
/// blocks on a 4Kn cache work.
#[test]
fn blocks_smaller_than_a_devices_logical_block_are_refused() {
    let mut d = setup();
    for (dev, name) in [("cache", "cache4k"), ("origin", "origin4k")] {
        d.add(Arc::new(Shaped {
            lbs: Some(4096),
            ..Shaped::new(d.get(dev), name)
        }));
    }
    let e = d.table_err("0 16384 writecache s origin cache4k 512 0");
    assert!(
        e.contains("block size 512 is smaller than the logical block size of the cache 'cache4k' (4096 bytes)"),
        "{e}"
    );
    let e = d.table_err("0 16384 writecache s origin4k cache 2048 0");
    assert!(e.contains("of the origin 'origin4k' (4096 bytes)"), "{e}");
    let e = d.table_err("0 16384 writecache s origin cache4k 4096 2 start_sector 4");
    assert!(
        e.contains("invalid start_sector '4': not a multiple of the cache 'cache4k''s logical block size (8 sectors)"),
        "{e}"
    );
    let md = d.mapped(
        "wc",
        "0 16384 writecache s origin4k cache4k 4096 2 start_sector 8",
    );
    let dev = as_dev(&md);
    let t = Tester::new();
    t.write(&dev, 64, pattern(9, 64, 16));
    assert_sectors_eq(&t.read(&dev, 64, 16), &pattern(9, 64, 16), "4Kn cache");
}

/// The metadata goes out in I/Os the cache device takes: a cache whose
/// largest I/O is 64 KiB, with an entry array seven times that (512-byte
/// blocks), formats, caches, commits and loads again.
#[test]
fn a_cache_that_takes_only_small_ios_is_formatted_and_loaded_in_pieces() {
    let mut d = setup();
    let ram: Arc<dyn BlockDevice> =
        Arc::new(udm_backends::RamDevice::new("small-ram", 32768 * 512).unwrap());
    d.add(Arc::new(Shaped {
        max_io: Some(64 << 10),
        ..Shaped::new(ram, "small")
    }));
    let table = "0 16384 writecache s origin small 512 0";
    let md = d.mapped("wc", table);
    let dev = as_dev(&md);
    let s = status(&md);
    assert!(s[BLOCKS] * 16 > 7 * (64 << 10), "the array spans many I/Os");
    assert_eq!(dev.limits().max_io_bytes, 64 << 10, "stacked");
    let t = Tester::new();
    for s in (100..400).step_by(128) {
        let n = 128.min(400 - s);
        t.write(&dev, s, pattern(5, s, n));
    }
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
    drop(dev);
    drop(md);
    let md = d.mapped("wc", table);
    assert_eq!(status(&md)[BLOCKS] - status(&md)[FREE], 300, "loaded");
    let dev = as_dev(&md);
    for s in (100..400).step_by(128) {
        let n = 128.min(400 - s);
        assert_sectors_eq(&t.read(&dev, s, n), &pattern(5, s, n), "after a restart");
    }
}

/// A write and a discard of one block in flight together leave the block
/// with the write's data or with the discard's (zeroes on RAM), never the
/// data from before the write: here the block's older copy is taken for
/// writeback (watermark) while the discard is at the slow origin, the
/// write supersedes it meanwhile, and that older copy lands on the origin
/// after the discard — which must then not drop the newer copy from the
/// cache.
#[test]
fn a_write_racing_a_discard_never_brings_back_the_data_before_it() {
    use std::time::{Duration, Instant};
    let mut d = Devices::new();
    d.ram("origin", 16384);
    d.ram("cache", 4096);
    // Writes, discards and flushes reach the origin 600 ms late.
    let slow = d.mapped("slow", "0 16384 delay origin 0 0 origin 0 600");
    d.add(as_dev(&slow));
    // Writeback starts above 6 of the 509 blocks and keeps the newest 5.
    let md = d.mapped(
        "wc",
        "0 16384 writecache s slow cache 4096 4 high_watermark 1 low_watermark 1",
    );
    let dev = as_dev(&md);
    let t = Tester::new();
    let (old, new) = (pattern(1, 0, 8), pattern(2, 0, 8));
    t.write(&dev, 0, old.clone());
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok, "committed");
    let ch = t.open(&dev);
    let discard = submit(&t.reactor, &*ch, Req::discard(0, 8));
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(100) {
        t.reactor.poll_once();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(status(&md)[WB], 0, "nothing under writeback yet");
    // Past the high watermark: writeback takes the oldest committed
    // block, block 0's.
    t.write(&dev, 64, pattern(3, 64, 64));
    while status(&md)[WB] == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "writeback never took the block: {:?}",
            status(&md)
        );
        t.reactor.poll_once();
        std::thread::sleep(Duration::from_millis(1));
    }
    let write = submit(&t.reactor, &*ch, Req::write(0, new.clone()));
    let f = vec![discard, write];
    t.wait_all(&f);
    for r in f.into_iter().map(InFlight::finish) {
        assert_eq!(r.status, Status::Ok);
    }
    let got = t.read(&dev, 0, 8);
    assert!(
        got == new || got.iter().all(|&b| b == 0),
        "block 0 holds {} after a write and a discard in flight together",
        if got == old {
            "the data from before the write".to_string()
        } else {
            describe(&got)
        }
    );
}
