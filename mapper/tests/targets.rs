//! The built-in targets and the mapper core, checked end to end through a
//! mapped device over real ram devices: where data lands, how I/O is split
//! and completed, which statuses come back, what the constructors reject and
//! what the table and status lines say.

mod common;

use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{
    as_dev, assert_sectors_eq, pattern, sector_pattern, Devices, Req, Rng, Tester, SECTOR,
};
use udm_core::{
    bio_status, check_bio, BioFlags, BioPtr, BlockDevice, Caps, Channel, Limits, Op, Reactor,
    Status,
};
use udm_mapper::MappedDevice;

/// Where dm's striped target puts target-relative sector `rel`: chunk `c`
/// of the range lives on stripe `c % stripes`, in row `c / stripes` of that
/// stripe's area (which starts at `offsets[stripe]`).
fn striped_place(rel: u64, stripes: u64, chunk: u64, offsets: &[u64]) -> (usize, u64) {
    let c = rel / chunk;
    let stripe = (c % stripes) as usize;
    let row = c / stripes;
    (stripe, offsets[stripe] + row * chunk + rel % chunk)
}

/// Total descriptors the tester's reactor has handed out so far.
fn allocations(t: &Tester) -> u64 {
    let s = t.reactor.cache_stats();
    s.hits + s.misses
}

// ---------------------------------------------------------------------------
// linear
// ---------------------------------------------------------------------------

/// A linear target sends sector `s` of its range to sector `offset + s` of
/// its device; the rest of the device is untouched.
#[test]
fn linear_writes_land_at_offset_on_the_device() {
    let mut devs = Devices::new();
    let ram = devs.ram("ram0", 256);
    let dev = as_dev(&devs.mapped("lin", "0 100 linear ram0 37"));
    let t = Tester::new();

    t.write(&dev, 0, pattern(1, 0, 100));
    t.write(&dev, 50, pattern(2, 50, 10));

    let mut expected = vec![0u8; 256 * SECTOR];
    let mut image = pattern(1, 0, 100);
    image[50 * SECTOR..60 * SECTOR].copy_from_slice(&pattern(2, 50, 10));
    expected[37 * SECTOR..137 * SECTOR].copy_from_slice(&image);
    assert_sectors_eq(
        &t.read_all(&ram),
        &expected,
        "ram0 after writes through linear",
    );
    assert_sectors_eq(
        &t.read(&dev, 45, 20),
        &image[45 * SECTOR..65 * SECTOR],
        "read back",
    );
}

/// A target's sectors are relative to its own start in the table: the
/// first sector of a linear line at table sector 16 goes to its offset.
#[test]
fn linear_maps_relative_to_its_start_in_the_table() {
    let mut devs = Devices::new();
    let ram = devs.ram("ram0", 64);
    let dev = as_dev(&devs.mapped("lin", "0 16 zero\n16 8 linear ram0 40"));
    let t = Tester::new();

    t.write(&dev, 16, pattern(7, 16, 8));

    let raw = t.read_all(&ram);
    assert_sectors_eq(
        &raw[40 * SECTOR..48 * SECTOR],
        &pattern(7, 16, 8),
        "ram0 40..48",
    );
    assert!(
        raw[..40 * SECTOR].iter().all(|&b| b == 0),
        "nothing before the offset is written"
    );
    assert!(
        raw[48 * SECTOR..].iter().all(|&b| b == 0),
        "nothing after the area is written"
    );
}

// ---------------------------------------------------------------------------
// striped
// ---------------------------------------------------------------------------

/// Writes a striped target's whole range through the mapped device with
/// I/Os of varied lengths that cross chunk and stripe boundaries, then
/// checks every sector of every stripe device against dm's formula, and
/// reads the range back with a different split. Stripe `i`'s area starts
/// at `step * i + 1` on its device: every stripe at the same offset with
/// `step` 0 (the fast path's shift-and-mask case), otherwise apart.
fn check_striped_placement(stripes: u64, chunk: u64, rows: u64, step: u64) {
    let width = chunk * rows;
    let len = stripes * width;
    let mut devs = Devices::new();
    // Offsets, and some room after each area, which must stay zero.
    let offsets: Vec<u64> = (0..stripes).map(|i| step * i + 1).collect();
    let rams: Vec<_> = (0..stripes)
        .map(|i| devs.ram(&format!("s{i}"), offsets[i as usize] + width + 5))
        .collect();
    let dests: Vec<String> = offsets
        .iter()
        .enumerate()
        .map(|(i, o)| format!("s{i} {o}"))
        .collect();
    let text = format!("0 {len} striped {stripes} {chunk} {}", dests.join(" "));
    let dev = as_dev(&devs.mapped("st", &text));
    let t = Tester::new();

    // Lengths that start and end off chunk boundaries, one chunk plus one,
    // and longer than a full stripe row.
    let lens = [
        1,
        chunk + 1,
        2,
        stripes * chunk + 3,
        chunk.saturating_sub(1).max(1),
        2 * chunk + 1,
    ];
    let mut s = 0;
    let mut i = 0;
    while s < len {
        let n = lens[i % lens.len()].min(len - s);
        let d = t.run(&dev, Req::write(s, pattern(5, s, n)).segs(1 + i % 3));
        assert_eq!(d.status, Status::Ok, "write {n} at {s} of {text}");
        d.assert_returned_intact();
        s += n;
        i += 1;
    }

    let mut expected: Vec<Vec<u8>> = rams
        .iter()
        .map(|r| vec![0u8; r.limits().sectors as usize * SECTOR])
        .collect();
    for rel in 0..len {
        let (stripe, sector) = striped_place(rel, stripes, chunk, &offsets);
        let at = sector as usize * SECTOR;
        expected[stripe][at..at + SECTOR].copy_from_slice(&sector_pattern(5, rel));
    }
    for (i, ram) in rams.iter().enumerate() {
        assert_sectors_eq(
            &t.read_all(ram),
            &expected[i],
            &format!("stripe device s{i} of {text}"),
        );
    }

    // Read back in pieces that straddle chunks differently from the writes.
    let mut s = 0;
    let mut step = chunk + 2;
    while s < len {
        let n = step.min(len - s);
        assert_sectors_eq(
            &t.read(&dev, s, n),
            &pattern(5, s, n),
            &format!("read {n} at {s}"),
        );
        s += n;
        step = step % (3 * chunk) + 1;
    }
}

/// Chunk `c` of a striped range lives on stripe `c % n` at row `c / n`, for
/// power-of-two chunk sizes and stripe counts, with the stripes at
/// different offsets or all at one.
#[test]
fn striped_places_chunks_round_robin_power_of_two() {
    check_striped_placement(2, 8, 4, 3);
    check_striped_placement(4, 16, 2, 3);
    check_striped_placement(2, 8, 4, 0);
    check_striped_placement(4, 16, 2, 0);
}

/// The same placement rule holds when the chunk size or the stripe count
/// is not a power of two (dm allows both).
#[test]
fn striped_places_chunks_round_robin_non_power_of_two() {
    check_striped_placement(3, 6, 3, 3);
    check_striped_placement(5, 3, 2, 3);
    check_striped_placement(3, 8, 2, 3);
    check_striped_placement(2, 5, 3, 3);
    check_striped_placement(1, 7, 3, 3);
    check_striped_placement(3, 1, 4, 3);
}

/// Table `text`, named `st`, over `r0`, a 64-sector RAM device, and `bad`,
/// a device that fails every I/O: for the striped error tests.
fn over_a_failing_device(text: &str) -> Arc<MappedDevice> {
    let mut devs = Devices::new();
    devs.ram("r0", 64);
    let bad = devs.mapped("bad", "0 64 error");
    devs.add(as_dev(&bad));
    devs.mapped("st", text)
}

/// A stripe device that fails I/O is marked `D` in the status line (the
/// others stay `A`), and the `clear_errors` message resets the marks.
#[test]
fn striped_status_marks_a_failing_stripe_until_errors_are_cleared() {
    let md = over_a_failing_device("0 64 striped 2 8 r0 0 bad 0");
    let dev = as_dev(&md);
    let t = Tester::new();

    assert_eq!(
        t.run(&dev, Req::write(0, pattern(1, 0, 8))).status,
        Status::Ok
    );
    assert_eq!(
        md.table().status_lines(),
        vec!["0 64 striped 2 r0 bad 1 AA"]
    );
    // Chunk 1 is on stripe 1, the failing device.
    assert_eq!(
        t.run(&dev, Req::write(8, pattern(1, 8, 8))).status,
        Status::IoErr
    );
    assert_eq!(
        md.table().status_lines(),
        vec!["0 64 striped 2 r0 bad 1 AD"]
    );
    assert_eq!(md.message(0, &["clear_errors"]).expect("clear_errors"), "");
    assert_eq!(
        md.table().status_lines(),
        vec!["0 64 striped 2 r0 bad 1 AA"]
    );
    let e = md.message(0, &["bogus"]).unwrap_err().to_string();
    assert!(e.contains("unknown message 'bogus'"), "{e}");
}

/// The failing stripe is found from the bio's own place in the table, also
/// when the striped target does not start at sector 0: an error on the
/// table's second target marks that target's second stripe, not its first.
#[test]
fn striped_error_marks_the_right_stripe_of_a_later_target() {
    // Sector 16 of the table is the striped target's chunk 1 (of 8 sectors)
    // only if its start (8, itself a chunk's worth) is subtracted first;
    // otherwise it would be chunk 2, back on stripe 0.
    let md = over_a_failing_device("0 8 zero\n8 64 striped 2 8 r0 0 bad 0");
    let dev = as_dev(&md);
    let t = Tester::new();
    assert_eq!(
        t.run(&dev, Req::write(8, pattern(1, 8, 8))).status,
        Status::Ok
    );
    assert_eq!(
        t.run(&dev, Req::write(16, pattern(1, 16, 8))).status,
        Status::IoErr
    );
    assert_eq!(
        md.table().status_lines(),
        vec!["0 8 zero", "8 64 striped 2 r0 bad 1 AD"]
    );
}

/// Each bad striped argument is rejected with a message naming the
/// problem (and the table line).
#[test]
fn striped_constructor_errors_name_the_problem() {
    let mut devs = Devices::new();
    devs.ram("r0", 64);
    devs.ram("r1", 64);
    let cases: &[(&str, &[&str])] = &[
        (
            "0 16 striped 0 8",
            &["invalid stripe count '0'", "at least 1"],
        ),
        (
            "0 16 striped two 8 r0 0 r1 0",
            &["invalid stripe count 'two'"],
        ),
        (
            "0 16 striped 2 0 r0 0 r1 0",
            &["invalid chunk size '0'", "at least 1 sector"],
        ),
        (
            "0 15 striped 2 1 r0 0 r1 0",
            &["target length 15 not divisible by number of stripes 2"],
        ),
        (
            "0 20 striped 2 8 r0 0 r1 0",
            &["target length 20 not divisible by chunk size 8"],
        ),
        (
            "0 16 striped 2 8 r0 0",
            &["2 stripes need 4 destination arguments", "got 2"],
        ),
        (
            "0 16 striped 2 8 r0 0 r1 0 r0 8",
            &["2 stripes need 4 destination arguments", "got 6"],
        ),
        ("0 16 striped 2", &["not enough arguments"]),
        ("0 16 striped 2 8 r0 0 r9 0", &["no device 'r9'"]),
        ("0 16 striped 2 8 r0 x r1 0", &["invalid stripe offset 'x'"]),
        (
            "0 256 striped 2 8 r0 0 r1 0",
            &["device 'r0' is too small", "sectors 0..128", "it has 64"],
        ),
        (
            "0 64 striped 2 8 r0 0 r1 40",
            &["device 'r1' is too small", "sectors 40..72"],
        ),
    ];
    for (text, needles) in cases {
        let e = devs.table_err(text);
        assert!(
            e.contains("table line 1"),
            "'{text}': error does not name the line: {e}"
        );
        for n in *needles {
            assert!(e.contains(n), "'{text}': error should mention '{n}': {e}");
        }
    }
    // The line is counted: a bad second line says so.
    let e = devs.table_err("0 8 zero\n8 16 striped 2 0 r0 0 r1 0");
    assert!(e.contains("table line 2"), "{e}");
}

/// A striped table advertises one full stripe row (chunk × stripes) as its
/// optimal I/O size, and a mapped device is exactly as big as its table.
#[test]
fn striped_advertises_a_full_row_as_optimal_io() {
    let mut devs = Devices::new();
    devs.ram("r0", 64);
    devs.ram("r1", 64);
    devs.ram("r2", 64);
    let md = devs.mapped("st", "0 96 striped 3 16 r0 0 r1 0 r2 0\n96 8 zero");
    let l = md.limits();
    assert_eq!(l.sectors, 104);
    assert_eq!(l.io_opt, 3 * 16 * 512);
}

// ---------------------------------------------------------------------------
// splitting across targets
// ---------------------------------------------------------------------------

/// One I/O across five targets (linear, zero, striped, linear on another
/// device) is split at every boundary, each piece lands where its target
/// maps it, and the caller's bio completes exactly once, with its sector.
#[test]
fn io_spanning_several_targets_is_split_and_completes_once() {
    let mut devs = Devices::new();
    let r0 = devs.ram("r0", 128);
    let r1 = devs.ram("r1", 64);
    let text = "0 8 linear r0 0
                8 8 linear r1 16
                16 8 zero
                24 16 striped 2 4 r0 8 r1 0
                40 8 linear r0 100";
    let dev = as_dev(&devs.mapped("multi", text));
    let t = Tester::new();

    let data = pattern(3, 2, 44);
    let d = t.run(&dev, Req::write(2, data.clone()).segs(3));
    assert_eq!(d.status, Status::Ok);
    d.assert_returned_intact();

    // Where each mapped sector 2..46 should be.
    let mut e0 = vec![0u8; 128 * SECTOR];
    let mut e1 = vec![0u8; 64 * SECTOR];
    let put = |img: &mut Vec<u8>, at: u64, s: u64| {
        let a = at as usize * SECTOR;
        img[a..a + SECTOR].copy_from_slice(&sector_pattern(3, s));
    };
    for s in 2..46 {
        match s {
            0..=7 => put(&mut e0, s, s),
            8..=15 => put(&mut e1, 16 + s - 8, s),
            16..=23 => {} // zero: dropped
            24..=39 => {
                let (stripe, at) = striped_place(s - 24, 2, 4, &[8, 0]);
                put(if stripe == 0 { &mut e0 } else { &mut e1 }, at, s)
            }
            _ => put(&mut e0, 100 + s - 40, s),
        }
    }
    assert_sectors_eq(&t.read_all(&r0), &e0, "r0");
    assert_sectors_eq(&t.read_all(&r1), &e1, "r1");

    // And one read across the same span returns it, zeroes in the zero target.
    let mut expected = data;
    expected[14 * SECTOR..22 * SECTOR].fill(0);
    let d = t.run(&dev, Req::read(2, 44).segs(4));
    assert_eq!(d.status, Status::Ok);
    d.assert_returned_intact();
    assert_sectors_eq(&d.data, &expected, "read across targets");
}

/// The fast path remaps the caller's own bio: an I/O inside one target
/// (and one chunk) allocates no descriptor besides the caller's. The clone
/// path allocates one clone per piece.
#[test]
fn fast_path_allocates_nothing_and_clone_path_one_clone_per_piece() {
    let mut devs = Devices::new();
    devs.ram("r0", 128);
    devs.ram("r1", 128);
    let text = "0 32 linear r0 0\n32 64 striped 2 8 r0 32 r1 0";
    let fast = as_dev(&devs.mapped("fast", text));
    let slow_md = devs.mapped("slow", text);
    slow_md
        .set_fast_path(false)
        .expect("set_fast_path before any I/O");
    let slow = as_dev(&slow_md);
    let t = Tester::new();

    let cost = |dev: &Arc<dyn BlockDevice>, req: Req| {
        let before = allocations(&t);
        let d = t.run(dev, req);
        assert_eq!(d.status, Status::Ok);
        d.assert_returned_intact();
        allocations(&t) - before
    };
    // Inside the linear target, inside one chunk of the striped one.
    assert_eq!(cost(&fast, Req::write(4, pattern(1, 4, 8))), 1);
    assert_eq!(cost(&fast, Req::read(40, 8)), 1);
    assert_eq!(cost(&slow, Req::write(4, pattern(1, 4, 8))), 2);
    assert_eq!(cost(&slow, Req::read(40, 8)), 2);
    // Across the target boundary and two chunk boundaries: 3 pieces.
    assert_eq!(cost(&fast, Req::write(28, pattern(1, 28, 20))), 4);
    assert_eq!(cost(&slow, Req::write(28, pattern(1, 28, 20))), 4);
    // Every descriptor went back.
    assert_eq!(t.reactor.outstanding(), 0);
}

// ---------------------------------------------------------------------------
// error and zero
// ---------------------------------------------------------------------------

/// Every read, write, discard and write-zeroes to an error target completes
/// with an I/O error (exactly once, with its own sector).
#[test]
fn error_target_fails_every_io_with_ioerr() {
    let devs = Devices::new();
    let dev = as_dev(&devs.mapped("err", "0 64 error"));
    let t = Tester::new();
    for req in [
        Req::read(0, 8),
        Req::write(10, pattern(1, 10, 4)),
        Req::discard(0, 64),
        Req::write_zeroes(63, 1),
    ] {
        let d = t.run(&dev, req.clone());
        assert_eq!(d.status, Status::IoErr, "{req:?}");
        d.assert_returned_intact();
    }
}

/// An I/O spanning a linear and an error target completes with the error
/// (the first error any piece saw), while the linear piece of a write still
/// reached its device.
#[test]
fn io_spanning_linear_and_error_fails_but_the_linear_piece_is_written() {
    for (text, lin_start, ram_off) in [
        ("0 16 linear r0 0\n16 16 error", 0u64, 0u64),
        ("0 16 error\n16 16 linear r0 8", 16, 8),
    ] {
        let mut devs = Devices::new();
        let ram = devs.ram("r0", 64);
        let dev = as_dev(&devs.mapped("mix", text));
        let t = Tester::new();

        let d = t.run(&dev, Req::write(4, pattern(9, 4, 24)).segs(2));
        assert_eq!(d.status, Status::IoErr, "write across {text:?}");
        d.assert_returned_intact();
        let d = t.run(&dev, Req::read(4, 24));
        assert_eq!(d.status, Status::IoErr, "read across {text:?}");
        d.assert_returned_intact();

        // The linear piece of 4..28 is its intersection with lin_start..+16.
        let (lo, hi) = (lin_start.max(4), (lin_start + 16).min(28));
        let raw = t.read_all(&ram);
        let at = (ram_off + lo - lin_start) as usize * SECTOR;
        let n = (hi - lo) as usize * SECTOR;
        assert_sectors_eq(
            &raw[at..at + n],
            &pattern(9, lo, hi - lo),
            &format!("linear piece of {text:?}"),
        );
        assert!(
            raw[..at].iter().chain(&raw[at + n..]).all(|&b| b == 0),
            "nothing else on r0 is written ({text:?})"
        );
        // The linear part alone still reads fine.
        assert_sectors_eq(
            &t.read(&dev, lo, hi - lo),
            &pattern(9, lo, hi - lo),
            "linear part",
        );
    }
}

/// A zero target reads as zeroes and swallows writes, discards and
/// write-zeroes without touching any device.
#[test]
fn zero_target_reads_zeroes_and_discards_writes() {
    let mut devs = Devices::new();
    let ram = devs.ram("r0", 32);
    let dev = as_dev(&devs.mapped("z", "0 8 linear r0 0\n8 64 zero"));
    let t = Tester::new();

    for req in [
        Req::write(8, pattern(4, 8, 64)),
        Req::discard(20, 10),
        Req::write_zeroes(8, 64),
        Req::write(0, pattern(4, 0, 16)),
    ] {
        let d = t.run(&dev, req.clone());
        assert_eq!(d.status, Status::Ok, "{req:?}");
        d.assert_returned_intact();
    }
    // The read buffer starts out poisoned, so zeroes here were written by the target.
    assert!(
        t.read(&dev, 8, 64).iter().all(|&b| b == 0),
        "zero target reads zeroes"
    );
    let raw = t.read_all(&ram);
    assert_sectors_eq(&raw[..8 * SECTOR], &pattern(4, 0, 8), "linear part");
    assert!(
        raw[8 * SECTOR..].iter().all(|&b| b == 0),
        "zero part reached no device"
    );
}

// ---------------------------------------------------------------------------
// flush, PREFLUSH and FUA
// ---------------------------------------------------------------------------

/// An empty flush to a table over two ram devices completes Ok, once, and
/// is sent once to each distinct device (however many targets use it).
#[test]
fn flush_goes_once_to_each_device_and_completes_ok() {
    let mut devs = Devices::new();
    devs.ram("r0", 64);
    devs.ram("r1", 64);
    let t = Tester::new();
    for (fast, text) in [
        (
            true,
            "0 16 linear r0 0\n16 16 linear r1 0\n32 16 linear r0 16",
        ),
        (
            false,
            "0 16 linear r0 0\n16 16 linear r1 0\n32 16 linear r0 16",
        ),
        (true, "0 64 striped 2 8 r0 0 r1 0"),
    ] {
        let md = devs.mapped("fl", text);
        md.set_fast_path(fast).expect("before any I/O");
        let dev = as_dev(&md);
        let before = allocations(&t);
        let d = t.run(&dev, Req::flush());
        assert_eq!(d.status, Status::Ok, "flush of {text:?}");
        d.assert_returned_intact();
        assert_eq!(
            allocations(&t) - before,
            1 + 2,
            "the flush and one clone per device"
        );
    }
    // A table with no devices has nothing to flush.
    let dev = as_dev(&devs.mapped("none", "0 8 zero"));
    assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
}

/// Writes flagged PREFLUSH|FUA (or either alone) complete Ok with their
/// data in place, inside one target and across targets.
#[test]
fn preflush_and_fua_writes_complete_with_data_in_place() {
    let mut devs = Devices::new();
    let r0 = devs.ram("r0", 32);
    let r1 = devs.ram("r1", 32);
    let dev = as_dev(&devs.mapped("f", "0 32 linear r0 0\n32 32 linear r1 0"));
    let t = Tester::new();

    let flags = [
        BioFlags::PREFLUSH | BioFlags::FUA,
        BioFlags::FUA,
        BioFlags::PREFLUSH,
        BioFlags::PREFLUSH | BioFlags::FUA,
    ];
    let spans = [(2u64, 8u64), (12, 8), (40, 8), (24, 16)];
    for (i, (&f, &(s, n))) in flags.iter().zip(&spans).enumerate() {
        let d = t.run(&dev, Req::write(s, pattern(i as u64 + 1, s, n)).flags(f));
        assert_eq!(d.status, Status::Ok, "{f:?} write of {n} at {s}");
        d.assert_returned_intact();
    }
    let mut image = vec![0u8; 64 * SECTOR];
    for (i, &(s, n)) in spans.iter().enumerate() {
        let a = s as usize * SECTOR;
        image[a..a + n as usize * SECTOR].copy_from_slice(&pattern(i as u64 + 1, s, n));
    }
    assert_sectors_eq(&t.read_all(&r0), &image[..32 * SECTOR], "r0");
    assert_sectors_eq(&t.read_all(&r1), &image[32 * SECTOR..], "r1");
}

// ---------------------------------------------------------------------------
// malformed bios
// ---------------------------------------------------------------------------

/// Bios that start at or past the end, or run past it, complete with
/// Status::Inval and change nothing.
#[test]
fn out_of_range_bios_are_invalid() {
    let mut devs = Devices::new();
    let ram = devs.ram("r0", 128);
    let dev = as_dev(&devs.mapped("o", "0 32 linear r0 0\n32 32 linear r0 64"));
    let t = Tester::new();
    for req in [
        Req::read(64, 1),
        Req::read(60, 8),
        Req::write(63, pattern(1, 63, 2)),
        Req::write(1 << 40, pattern(1, 0, 1)),
        Req::discard(0, 65),
        Req::write_zeroes(u64::MAX - 1, 1),
    ] {
        let d = t.run(&dev, req.clone());
        assert_eq!(d.status, Status::Inval, "{req:?}");
        d.assert_returned_intact();
    }
    assert!(
        t.read_all(&ram).iter().all(|&b| b == 0),
        "no invalid bio wrote anything"
    );
}

/// Bios whose length is not a whole number of logical blocks (or zero)
/// complete with Status::Inval.
#[test]
fn misaligned_and_empty_bios_are_invalid() {
    let mut devs = Devices::new();
    let ram = devs.ram("r0", 64);
    let dev = as_dev(&devs.mapped("m", "0 64 linear r0 0"));
    let t = Tester::new();
    for req in [
        Req::bytes(Op::Read, 0, 100),
        Req::bytes(Op::Write, 0, 513),
        Req::bytes(Op::Write, 8, 511),
        Req::bytes(Op::Discard, 0, 1000),
        Req::bytes(Op::Read, 0, 0),
        Req::bytes(Op::Write, 0, 0),
    ] {
        let d = t.run(&dev, req.clone());
        assert_eq!(d.status, Status::Inval, "{:?} of {} bytes", req.op, req.len);
        d.assert_returned_intact();
    }
    assert!(t.read_all(&ram).iter().all(|&b| b == 0));
}

/// A RAM device with the limits and capabilities a test gives it. Bios that
/// reach it through `submit_nocheck` are counted, and checked anyway: one
/// that breaks the limits is counted as bad and failed, never served.
struct Strict {
    name: &'static str,
    ram: Arc<dyn BlockDevice>,
    limits: Limits,
    caps: Caps,
    unchecked: Arc<AtomicU64>,
    bad: Arc<AtomicU64>,
}

struct StrictChannel {
    ch: Rc<dyn Channel>,
    limits: Limits,
    caps: Caps,
    unchecked: Arc<AtomicU64>,
    bad: Arc<AtomicU64>,
}

impl BlockDevice for Strict {
    fn name(&self) -> &str {
        self.name
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn caps(&self) -> Caps {
        self.caps
    }
    fn open(self: Arc<Self>, r: &Reactor) -> Result<Rc<dyn Channel>, udm_core::Error> {
        Ok(Rc::new(StrictChannel {
            ch: self.ram.clone().open(r)?,
            limits: self.limits,
            caps: self.caps,
            unchecked: self.unchecked.clone(),
            bad: self.bad.clone(),
        }))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Channel for StrictChannel {
    fn submit(&self, bio: BioPtr) {
        if let Some(bio) = check_bio(bio, &self.limits, self.caps) {
            self.ch.submit(bio);
        }
    }
    unsafe fn submit_nocheck(&self, bio: BioPtr) {
        self.unchecked.fetch_add(1, Ordering::Relaxed);
        if bio_status(&bio, &self.limits, self.caps).is_err() {
            self.bad.fetch_add(1, Ordering::Relaxed);
        }
        self.submit(bio)
    }
}

/// Two strict devices, s0 and s1, of 128 sectors with 4 KiB blocks, at
/// most 8 KiB and 2 segments per bio; read-only with `read_only`. Returns
/// them with their (unchecked, bad) counters.
fn strict_devices(read_only: bool) -> (Devices, Arc<AtomicU64>, Arc<AtomicU64>) {
    let mut devs = Devices::new();
    let (unchecked, bad) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    for name in ["s0", "s1"] {
        let ram = devs.ram(&format!("{name}-ram"), 128);
        let mut limits = ram.limits();
        limits.logical_block_size = 4096;
        limits.physical_block_size = 4096;
        limits.max_io_bytes = 8192;
        limits.max_segments = 2;
        let mut caps = ram.caps();
        if read_only {
            caps.insert(Caps::READ_ONLY);
        }
        devs.add(Arc::new(Strict {
            name,
            ram,
            limits,
            caps,
            unchecked: unchecked.clone(),
            bad: bad.clone(),
        }));
    }
    (devs, unchecked, bad)
}

/// A table of one linear or striped target passes the bios it maps down
/// unchecked (`Channel::submit_nocheck`), so its own checks must cover the
/// device's: a bio that breaks the device's block size, length or segment
/// limits, or lies outside the target, is failed with Inval by the mapper
/// and never reaches the device unchecked. Valid bios are served, and
/// through the unchecked entry.
#[test]
fn one_target_tables_pass_down_unchecked_only_what_the_device_accepts() {
    for text in ["0 64 linear s0 16", "0 64 striped 2 8 s0 16 s1 16"] {
        let (devs, unchecked, bad) = strict_devices(false);
        let dev = as_dev(&devs.mapped("m", text));
        let t = Tester::new();
        for req in [
            Req::write(0, pattern(1, 0, 8)),
            Req::read(0, 8),
            Req::write(56, pattern(2, 56, 8)),
            Req::bytes(Op::Read, 8, 4096).segs(2),
            // Two chunks of the striped target: split, then served.
            Req::bytes(Op::Read, 16, 8192),
        ] {
            let d = t.run(&dev, req.clone());
            assert_eq!(d.status, Status::Ok, "{text}: {req:?}");
        }
        assert!(
            unchecked.load(Ordering::Relaxed) >= 4,
            "{text}: the one-target plan was not used"
        );
        for req in [
            Req::bytes(Op::Read, 0, 512),
            Req::bytes(Op::Write, 0, 4096 + 512),
            Req::bytes(Op::Read, 1, 4096),
            Req::bytes(Op::Read, 0, 16384),
            Req::bytes(Op::Read, 0, 8192).segs(3),
            Req::bytes(Op::Read, 0, 0),
            Req::read(64, 8),
            Req::read(56, 16),
            Req::bytes(Op::Read, u64::MAX - 7, 4096),
        ] {
            let d = t.run(&dev, req.clone());
            assert_eq!(d.status, Status::Inval, "{text}: {req:?}");
            d.assert_returned_intact();
        }
        assert_eq!(
            bad.load(Ordering::Relaxed),
            0,
            "{text}: bad bios passed down"
        );
    }
}

/// Where the table's checks would not cover the device's, the bios go down
/// checked: a read-only device (writes must be refused by the device's
/// rule) and a device offset off the block size (the remapped bio would be
/// misaligned).
#[test]
fn tables_whose_checks_do_not_cover_the_device_pass_nothing_down_unchecked() {
    let (devs, unchecked, bad) = strict_devices(true);
    let dev = as_dev(&devs.mapped("ro", "0 64 linear s0 16"));
    let t = Tester::new();
    assert_eq!(t.run(&dev, Req::read(0, 8)).status, Status::Ok);
    let d = t.run(&dev, Req::write(0, pattern(1, 0, 8)));
    assert_eq!(d.status, Status::Inval);
    d.assert_returned_intact();

    let (devs, unchecked2, bad2) = strict_devices(false);
    let dev = as_dev(&devs.mapped("off", "0 64 linear s0 4"));
    let d = t.run(&dev, Req::read(0, 8));
    assert_eq!(d.status, Status::Inval, "sector 4 of a 4 KiB-block device");
    d.assert_returned_intact();
    for (u, b) in [(unchecked, bad), (unchecked2, bad2)] {
        assert_eq!(u.load(Ordering::Relaxed), 0);
        assert_eq!(b.load(Ordering::Relaxed), 0);
    }
}

// ---------------------------------------------------------------------------
// fast path versus clone path
// ---------------------------------------------------------------------------

/// The no-clone fast path and the clone path give the same statuses, the
/// same read data and the same device contents for the same I/O stream.
#[test]
fn fast_path_and_clone_path_give_identical_results() {
    let text = |p: &str| {
        format!(
            "0 24 linear {p}0 8
             24 48 striped 3 4 {p}1 0 {p}2 0 {p}0 40
             72 8 zero
             80 8 error
             88 40 linear {p}2 100"
        )
    };
    let mut devs = Devices::new();
    let mut rams = Vec::new();
    for p in ["a", "b"] {
        rams.push(
            (0..3)
                .map(|i| devs.ram(&format!("{p}{i}"), 160))
                .collect::<Vec<_>>(),
        );
    }
    let fast = as_dev(&devs.mapped("fast", &text("a")));
    let slow_md = devs.mapped("slow", &text("b"));
    slow_md.set_fast_path(false).expect("before any I/O");
    let slow = as_dev(&slow_md);
    let size = fast.limits().sectors;
    let t = Tester::new();

    let mut rng = Rng::new(42);
    for i in 0..400u64 {
        let start = rng.range(0, size - 1);
        let n = rng.range(1, 20).min(size - start);
        let req = match rng.range(0, 9) {
            0..=3 => Req::read(start, n),
            4..=6 => Req::write(start, pattern(i, start, n)),
            7 => Req::discard(start, n),
            8 => Req::write_zeroes(start, n),
            _ => Req::flush(),
        }
        .segs(rng.range(1, 3) as usize);
        let a = t.run(&fast, req.clone());
        let b = t.run(&slow, req.clone());
        a.assert_returned_intact();
        b.assert_returned_intact();
        assert_eq!(a.status, b.status, "{req:?}");
        if a.status == Status::Ok {
            assert_sectors_eq(&a.data, &b.data, &format!("data of {req:?}"));
        }
    }
    for (ra, rb) in rams[0].iter().zip(&rams[1]) {
        assert_sectors_eq(
            &t.read_all(ra),
            &t.read_all(rb),
            &format!("{} vs {}", ra.name(), rb.name()),
        );
    }
}

// ---------------------------------------------------------------------------
// table and status lines
// ---------------------------------------------------------------------------

/// `table_lines` prints each target as `dmsetup table` does (start, length,
/// type, constructor arguments), `status_lines` as `dmsetup status` does,
/// and the table lines build the same table again.
#[test]
fn table_and_status_lines_look_like_dmsetup() {
    let mut devs = Devices::new();
    devs.ram("r0", 256);
    devs.ram("r1", 256);
    let text = "0 32 linear r0 8\n32 64 striped 2 16 r0 100 r1 0\n96 8 zero\n104 8 error";
    let md = devs.mapped("show", text);
    let table = md.table();
    assert_eq!(
        table.table_lines(),
        vec![
            "0 32 linear r0 8",
            "32 64 striped 2 16 r0 100 r1 0",
            "96 8 zero",
            "104 8 error"
        ]
    );
    assert_eq!(
        table.status_lines(),
        vec![
            "0 32 linear",
            "32 64 striped 2 r0 r1 1 AA",
            "96 8 zero",
            "104 8 error"
        ]
    );
    let again = devs.table(&table.table_lines().join("\n"));
    assert_eq!(again.table_lines(), table.table_lines());
    // Whitespace, `;` separators and comments in the input do not show.
    let messy = devs.table(
        "0 32   linear r0 8 # comment\n; 32 64 striped 2 16 r0 100 r1 0;96 8 zero\n104 8 error",
    );
    assert_eq!(messy.table_lines(), table.table_lines());
}

/// A mapped device can itself be a table's device: linear over a mapped
/// device maps twice and lands where both tables say.
#[test]
fn a_mapped_device_stacks_on_another() {
    let mut devs = Devices::new();
    let ram = devs.ram("r0", 64);
    let lower: Arc<MappedDevice> = devs.mapped("lower", "0 32 linear r0 16");
    devs.add(as_dev(&lower));
    let dev = as_dev(&devs.mapped("upper", "0 8 linear lower 20"));
    let t = Tester::new();
    t.write(&dev, 0, pattern(6, 0, 8));
    let raw = t.read_all(&ram);
    assert_sectors_eq(
        &raw[36 * SECTOR..44 * SECTOR],
        &pattern(6, 0, 8),
        "r0 36..44",
    );
    assert_eq!(t.reactor.outstanding(), 0);
}

/// Mapped devices stack deeper than a bio has completion frames
/// ([`udm_core::bio::MAX_STACK`]): past that depth the mapper falls back
/// to cloning, and I/O still lands where every table says.
#[test]
fn stacks_deeper_than_the_frame_limit_still_map_correctly() {
    for fast in [true, false] {
        let mut devs = Devices::new();
        let ram = devs.ram("r0", 64);
        // Each level maps sector s to s + 1 of the level below (and is one
        // sector shorter).
        let mut below = "r0".to_string();
        let levels = udm_core::bio::MAX_STACK + 3;
        let mut top = None;
        for k in 0..levels {
            let name = format!("level{k}");
            let md = devs.mapped(&name, &format!("0 {} linear {below} 1", 48 - k));
            md.set_fast_path(fast).expect("before any I/O");
            devs.add(as_dev(&md));
            below = name;
            top = Some(md);
        }
        let dev = as_dev(&top.expect("levels > 0"));
        let t = Tester::new();
        let d = t.run(&dev, Req::write(0, pattern(1, 0, 8)));
        assert_eq!(
            d.status,
            Status::Ok,
            "write through {levels} levels (fast path {fast})"
        );
        d.assert_returned_intact();
        let at = levels * SECTOR;
        assert_sectors_eq(
            &t.read_all(&ram)[at..at + 8 * SECTOR],
            &pattern(1, 0, 8),
            "r0",
        );
        assert_sectors_eq(&t.read(&dev, 0, 8), &pattern(1, 0, 8), "read back");
        assert_eq!(t.run(&dev, Req::flush()).status, Status::Ok);
        assert_eq!(t.reactor.outstanding(), 0);
    }
}

// ---------------------------------------------------------------------------
// Map::Requeue
// ---------------------------------------------------------------------------

/// `busy <dev>`: linear at offset 0, but every map call that finds the
/// shared counter odd asks for a retry, like a target out of a resource.
struct Busy {
    devs: [udm_mapper::DevArea; 1],
    calls: Arc<std::sync::atomic::AtomicU64>,
}

static BUSY_CALLS: std::sync::OnceLock<Arc<std::sync::atomic::AtomicU64>> =
    std::sync::OnceLock::new();

fn busy_ctr(
    ctx: &udm_mapper::CtrCtx<'_>,
    argv: &[&str],
) -> Result<Box<dyn udm_mapper::Target>, udm_core::Error> {
    let dev = ctx.get_device(argv[0])?;
    Ok(Box::new(Busy {
        devs: [udm_mapper::DevArea {
            dev,
            start: 0,
            len: ctx.len,
        }],
        calls: BUSY_CALLS.get_or_init(Default::default).clone(),
    }))
}

impl udm_mapper::Target for Busy {
    fn map(&self, bio: udm_core::BioPtr, _ctx: &udm_mapper::MapCtx<'_>) -> udm_mapper::Map {
        let n = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n % 2 == 1 {
            return udm_mapper::Map::Requeue(bio);
        }
        udm_mapper::Map::Remapped(bio, 0)
    }
    fn devices(&self) -> &[udm_mapper::DevArea] {
        &self.devs
    }
    fn status(&self, _ty: udm_mapper::StatusType, _out: &mut String) {}
    fn no_clone(&self) -> bool {
        true
    }
}

/// A bio whose target asks for a retry is mapped again on a later reactor
/// turn (from the channel's slow work, which nothing else polls), on the
/// fast path and on the clone path (a split across two targets) alike, and
/// completes once with its data where it belongs.
#[test]
fn requeued_bios_are_mapped_again_and_complete_once() {
    let mut devs = Devices::new();
    devs.ram("ram0", 256);
    let mut reg = udm_mapper::Registry::builtin();
    reg.register(udm_mapper::TargetType {
        name: "busy",
        version: [1, 0, 0],
        summary: "remaps, after asking for a retry every other time",
        usage: "<dev>",
        min_args: 1,
        max_args: Some(1),
        splits: false,
        exclusive_args: &[],
        ctr: busy_ctr,
    });
    let resolve = |name: &str| Ok(devs.get(name));
    let table = udm_mapper::Table::from_text("0 128 busy ram0\n128 128 busy ram0", &reg, &resolve)
        .expect("table");
    let md = MappedDevice::new("busy", table);
    let dev = as_dev(&md);
    let t = Tester::new();
    let calls = BUSY_CALLS.get_or_init(Default::default);
    for (sector, sectors) in [(8, 8), (120, 16)] {
        let before = calls.load(std::sync::atomic::Ordering::Relaxed);
        t.write(&dev, sector, pattern(7, sector, sectors));
        let got = t.read(&dev, sector, sectors);
        assert_sectors_eq(&got, &pattern(7, sector, sectors), "after requeues");
        let maps = calls.load(std::sync::atomic::Ordering::Relaxed) - before;
        assert!(maps > 2, "some maps were retried ({maps} map calls)");
    }
}

// ---------------------------------------------------------------------------
// Lending (BioFlags::MAY_LEND)
// ---------------------------------------------------------------------------

/// A read that allows lending reaches a RAM disk's own memory through pure
/// remaps (linear, striped: the fast path moves the caller's bio) and comes
/// back with the right data either way; anywhere the data must land in the
/// caller's buffer (a clone across targets, a target that maps itself, a
/// read split into several segments) nothing is lent.
#[test]
fn lending_passes_pure_remaps_only_and_reads_the_same_data() {
    let mut devs = Devices::new();
    for r in ["ram0", "ram1", "ram2", "ram3", "ram4"] {
        devs.ram(r, 2048);
    }
    let lin = as_dev(&devs.mapped("lin", "0 1024 linear ram0 37"));
    let str2 = as_dev(&devs.mapped("str", "0 2048 striped 2 8 ram1 0 ram2 0"));
    let two = as_dev(&devs.mapped("two", "0 512 linear ram3 0; 512 512 linear ram4 0"));
    let zero = as_dev(&devs.mapped("z", "0 1024 zero"));
    let t = Tester::new();
    t.write(&lin, 0, pattern(1, 0, 512));
    t.write(&str2, 1024, pattern(2, 1024, 64));
    t.write(&two, 0, pattern(3, 0, 1024));

    let lend = |dev: &Arc<dyn BlockDevice>, req: Req| {
        let d = t.run(dev, req.flags(BioFlags::MAY_LEND));
        d.assert_returned_intact();
        assert_eq!(d.status, Status::Ok, "{:?}", d.req);
        d
    };
    // Pure remaps: lent, and the lent memory holds the data.
    let d = lend(&lin, Req::read(100, 64));
    assert!(d.lent, "linear over RAM lends");
    assert_sectors_eq(&d.data, &pattern(1, 100, 64), "lent through linear");
    let d = lend(&str2, Req::read(1024 + 8, 8));
    assert!(d.lent, "striped over RAM lends within a chunk");
    assert_sectors_eq(&d.data, &pattern(2, 1032, 8), "lent through striped");
    // A never-written range lends zeroes.
    let d = lend(&lin, Req::read(1000, 16));
    assert!(
        d.lent && d.data.iter().all(|&b| b == 0),
        "unwritten reads zero"
    );

    // Not lent: the clone path (striped across a chunk, two targets), a
    // target's own map (zero), several segments.
    for (dev, req, what) in [
        (&str2, Req::read(1024, 64), "striped across chunks"),
        (&two, Req::read(500, 24), "across two targets"),
        (&lin, Req::read(100, 64).segs(3), "three segments"),
    ] {
        let d = lend(dev, req);
        assert!(!d.lent, "{what}: lent");
        let want = match what {
            "striped across chunks" => pattern(2, 1024, 64),
            "across two targets" => pattern(3, 500, 24),
            _ => pattern(1, 100, 64),
        };
        assert_sectors_eq(&d.data, &want, what);
    }
    let d = lend(&zero, Req::read(0, 16));
    assert!(!d.lent && d.data.iter().all(|&b| b == 0), "zero target");
    // The clone path with the fast path off: the same read, not lent.
    let md = devs.mapped("lin2", "0 1024 linear ram0 37");
    md.set_fast_path(false).expect("fast path off");
    let d = lend(&as_dev(&md), Req::read(100, 64));
    assert!(!d.lent, "clone path lent");
    assert_sectors_eq(&d.data, &pattern(1, 100, 64), "clone path");
}

/// A target whose end_io runs on every read may change the data there
/// (flakey corrupting reads once its up interval ended): a read under it
/// is never lent, or the corruption would land in the RAM disk itself.
/// While up, flakey passes reads through unchanged (remapped in place);
/// without a read feature its end_io never runs, and reads are lent.
#[test]
fn a_target_that_may_change_read_data_in_its_end_io_is_never_lent_to() {
    let mut devs = Devices::new();
    for r in ["ram0", "ram1", "ram2", "ram3"] {
        devs.ram(r, 1024);
    }
    let corrupting = "60 1 5 corrupt_bio_byte 32 r 1 0";
    let fl = as_dev(&devs.mapped("fl", &format!("0 1024 flakey ram0 0 {corrupting}")));
    let plain = as_dev(&devs.mapped("flp", "0 1024 flakey ram1 0 60 1"));
    let mixed = as_dev(&devs.mapped(
        "mix",
        &format!("0 512 linear ram2 0; 512 512 flakey ram3 0 {corrupting}"),
    ));
    let t = Tester::new();
    for (i, dev) in [&fl, &plain, &mixed].into_iter().enumerate() {
        t.write(dev, 0, pattern(i as u64 + 1, 0, 1024));
    }
    for (dev, seed, sector, lent, what) in [
        (&fl, 1, 100, false, "flakey corrupting reads, one target"),
        (&plain, 2, 100, true, "flakey without read features"),
        (
            &mixed,
            3,
            600,
            false,
            "flakey corrupting reads, beside linear",
        ),
        (&mixed, 3, 100, true, "the linear beside it"),
    ] {
        let d = t.run(dev, Req::read(sector, 16).flags(BioFlags::MAY_LEND));
        d.assert_returned_intact();
        assert_eq!(d.status, Status::Ok, "{what}");
        assert_eq!(d.lent, lent, "{what}: lent");
        assert_sectors_eq(&d.data, &pattern(seed, sector, 16), what);
    }
}
