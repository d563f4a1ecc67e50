//! The `raid` target (raid1): the table line and its errors, the status
//! line, mirroring, a leg failing under writes and reads, read repair over
//! a dust leg, rebuild onto an empty leg, check and repair, and reassembly
//! from the metadata.

mod common;

use std::sync::Arc;

use common::*;
use udm_core::{BlockDevice, Status};
use udm_mapper::MappedDevice;

const LEG: u64 = 8192; // 4 MiB legs
const META: u64 = 64; // 32 KiB metadata

/// Two legs with metadata: m0 d0 m1 d1.
fn two_legs() -> Devices {
    let mut devs = Devices::new();
    for n in ["m0", "d0", "m1", "d1"] {
        devs.ram(n, if n.starts_with('m') { META } else { LEG });
    }
    devs
}

fn line(params: &str, legs: &str) -> String {
    let n = params.split_whitespace().count() + 1;
    format!("0 {LEG} raid raid1 {n} 0 {params} 2 {legs}")
}

/// A mirror (nosync, regions of 1024 sectors) over `devs`' legs whose leg
/// 1 data device is `l1`, a linear mapping of d1 that a test can switch to
/// `error`: returns `l1` and the mirror.
fn mirror_with_leg1_switchable(devs: &mut Devices) -> (Arc<MappedDevice>, Arc<MappedDevice>) {
    let l1 = devs.mapped("l1", &format!("0 {LEG} linear d1 0"));
    devs.add(as_dev(&l1));
    let md = devs.mapped("r", &line("nosync region_size 1024", "m0 d0 m1 l1"));
    (l1, md)
}

fn status(md: &Arc<MappedDevice>) -> String {
    md.table().status_lines()[0].clone()
}

fn wait_idle(md: &Arc<MappedDevice>, health: &str) {
    wait_for(&format!("status '{health}' and idle"), || {
        let s = status(md);
        s.contains(&format!(" {health} {LEG}/{LEG} idle "))
    });
}

fn raw(t: &ReactorThread, d: &Arc<dyn BlockDevice>) -> Vec<u8> {
    t.read(d, 0, LEG)
}

#[test]
fn bad_table_lines_are_one_line_errors() {
    let mut devs = two_legs();
    devs.ram("small", LEG / 2);
    let cases = [
        (line("region_size 1000", "m0 d0 m1 d1"), "power of two"),
        (line("rebuild 2", "m0 d0 m1 d1"), "no such leg"),
        (line("", "m0 d0 m1 small"), "different sizes"),
        (line("", "m0 d0 m1 d0"), "named twice"),
        (line("", "m0 d0 m0 d1"), "named twice"),
        (
            format!("0 {LEG} raid raid5 1 0 2 m0 d0 m1 d1"),
            "not supported",
        ),
        (
            format!("0 {LEG} raid raid1 3 0 nosync 2 m0 d0 m1 d1"),
            "#raid_devs",
        ),
        (
            format!("0 {LEG} raid raid1 9 0 nosync 2 m0 d0 m1 d1"),
            "#raid_params",
        ),
        (format!("0 {LEG} raid raid1 1 0 2 m0 d0 m1"), "#raid_devs"),
        (line("sync nosync", "m0 d0 m1 d1"), "exclude"),
        (line("bogus", "m0 d0 m1 d1"), "unknown parameter"),
    ];
    for (l, want) in cases {
        let e = devs.table_err(&l);
        assert!(e.contains(want), "{l}: got '{e}', wanted '{want}'");
        assert!(!e.contains('\n'), "{l}: multi-line error '{e}'");
    }
}

#[test]
fn writes_reach_both_legs_and_status_and_table_read_as_dm_raid() {
    let devs = two_legs();
    let l = line("nosync region_size 1024", "m0 d0 m1 d1");
    let md = devs.mapped("r", &l);
    let dev = as_dev(&md);
    let t = ReactorThread::spawn("raid");
    for i in 0..20u64 {
        t.write(
            &dev,
            i * 371 % (LEG - 16),
            pattern(i + 1, i * 371 % (LEG - 16), 16),
        );
    }
    assert!(
        raw(&t, &devs.get("d0")) == raw(&t, &devs.get("d1")),
        "legs differ"
    );
    assert_eq!(t.read(&dev, 371, 16), pattern(2, 371, 16));
    assert_eq!(
        status(&md),
        format!("0 {LEG} raid raid1 2 AA {LEG}/{LEG} idle 0 0 -")
    );
    assert_eq!(md.table().table_lines()[0], l);
}

#[test]
fn a_new_array_resyncs_from_the_first_leg() {
    let devs = two_legs();
    let t = ReactorThread::spawn("raid");
    let d0 = devs.get("d0");
    t.write(&d0, 100, pattern(7, 100, 8));
    let md = devs.mapped("r", &line("region_size 1024", "m0 d0 m1 d1"));
    let _ch = t.read(&as_dev(&md), 0, 8);
    wait_idle(&md, "AA");
    assert!(raw(&t, &d0) == raw(&t, &devs.get("d1")), "legs differ");
}

#[test]
fn a_new_array_resyncs_once_live_without_any_io() {
    let devs = two_legs();
    let t = ReactorThread::spawn("raid");
    let d0 = devs.get("d0");
    t.write(&d0, 100, pattern(7, 100, 8));
    let md = devs.mapped("r", &line("region_size 1024", "m0 d0 m1 d1"));
    // No I/O reaches the array: the worker starts when the table goes live.
    wait_idle(&md, "AA");
    assert!(raw(&t, &d0) == raw(&t, &devs.get("d1")), "legs differ");
}

#[test]
fn a_failing_leg_is_dropped_without_an_error_and_raises_an_event() {
    let mut devs = two_legs();
    let (l1, md) = mirror_with_leg1_switchable(&mut devs);
    let dev = as_dev(&md);
    let t = ReactorThread::spawn("raid");
    t.write(&dev, 0, pattern(1, 0, 64));
    let ev = md.table().events();
    l1.replace(devs.table(&format!("0 {LEG} error"))).unwrap();
    // Writes and reads go on, without errors.
    for i in 0..50u64 {
        let s = i * 64;
        let d = t.run(&dev, Req::write(s, pattern(100 + i, s, 64)));
        assert_eq!(d.status, Status::Ok, "write {i}");
        assert_eq!(t.read(&dev, s, 64), pattern(100 + i, s, 64));
    }
    assert!(status(&md).contains(" AD "), "{}", status(&md));
    assert!(md.table().events() > ev);
}

#[test]
fn reads_go_to_the_regions_home_leg_and_to_the_other_once_it_failed() {
    let mut devs = two_legs();
    // Regions of 1024 sectors: leg 0 is region 0's home, leg 1 region 1's.
    let (l1, md) = mirror_with_leg1_switchable(&mut devs);
    let dev = as_dev(&md);
    let t = ReactorThread::spawn("raid");
    let (d0, d1) = (devs.get("d0"), devs.get("d1"));
    t.write(&dev, 0, pattern(1, 0, 64));
    t.write(&dev, 1024, pattern(2, 1024, 64));
    // Each write reached both legs, the home leg's copy and the other's
    // (sent DONTCACHE) alike.
    for d in [&d0, &d1] {
        assert_eq!(t.read(d, 0, 64), pattern(1, 0, 64));
        assert_eq!(t.read(d, 1024, 64), pattern(2, 1024, 64));
    }
    // Behind the mirror's back, the copy off each region's home leg
    // changes: reads, one at a time, see only the home leg's.
    t.write(&d1, 0, pattern(9, 0, 64));
    t.write(&d0, 1024, pattern(9, 1024, 64));
    for _ in 0..8 {
        assert_eq!(
            t.read(&dev, 0, 64),
            pattern(1, 0, 64),
            "region 0 from leg 0"
        );
        assert_eq!(
            t.read(&dev, 1024, 64),
            pattern(2, 1024, 64),
            "region 1 from leg 1"
        );
    }
    // Leg 1 fails under a write: region 1 is read from leg 0 from then on.
    l1.replace(devs.table(&format!("0 {LEG} error"))).unwrap();
    let d = t.run(&dev, Req::write(1024, pattern(3, 1024, 64)));
    assert_eq!(d.status, Status::Ok);
    assert!(status(&md).contains(" AD "), "{}", status(&md));
    for _ in 0..4 {
        assert_eq!(t.read(&dev, 1024, 64), pattern(3, 1024, 64));
        assert_eq!(t.read(&dev, 0, 64), pattern(1, 0, 64));
    }
    assert_eq!(t.read(&d0, 1024, 64), pattern(3, 1024, 64));
}

#[test]
fn a_read_error_is_served_by_the_other_leg_and_repaired() {
    let mut devs = two_legs();
    let dust = devs.mapped("dust1", &format!("0 {LEG} dust d1 0 512"));
    devs.add(as_dev(&dust));
    let md = devs.mapped("r", &line("nosync region_size 1024", "m0 d0 m1 dust1"));
    let dev = as_dev(&md);
    let t = ReactorThread::spawn("raid");
    // Region 1 (sectors 1024..2048), whose home leg is the dust one.
    t.write(&dev, 1024, pattern(5, 1024, 256));
    for b in [3, 40, 41, 200] {
        dust.message(0, &["addbadblock", &(1024 + b).to_string()])
            .unwrap();
    }
    dust.message(0, &["enable"]).unwrap();
    // Reads go to the region's home leg: every bad block is met.
    for _ in 0..8 {
        assert_eq!(t.read(&dev, 1024, 256), pattern(5, 1024, 256));
    }
    wait_for("read repair to rewrite the bad blocks", || {
        dust.message(0, &["countbadblocks"])
            .unwrap()
            .contains(": 0 ")
    });
    assert!(status(&md).contains(" AA "), "{}", status(&md));
}

#[test]
fn rebuild_copies_onto_an_empty_leg_under_writes_and_check_finds_nothing() {
    let mut devs = two_legs();
    let t = ReactorThread::spawn("raid");
    {
        let md = devs.mapped("r", &line("nosync region_size 1024", "m0 d0 m1 d1"));
        let dev = as_dev(&md);
        for i in 0..64u64 {
            t.write(&dev, i * 128, pattern(i + 1, i * 128, 128));
        }
    }
    // Leg 1 replaced by empty devices, rebuilt.
    devs.ram("m2", META);
    devs.ram("d2", LEG);
    let md = devs.mapped("r", &line("rebuild 1 region_size 1024", "m0 d0 m2 d2"));
    let dev = as_dev(&md);
    for i in 0..64u64 {
        t.write(&dev, i * 128 + 8, pattern(1000 + i, i * 128 + 8, 8));
    }
    wait_idle(&md, "AA");
    assert!(
        raw(&t, &devs.get("d0")) == raw(&t, &devs.get("d2")),
        "legs differ"
    );
    md.message(0, &["check"]).unwrap();
    wait_for("check to finish", || status(&md).ends_with(" idle 0 0 -"));
    // A sector changed behind the array's back: check counts, repair fixes.
    t.write(&devs.get("d2"), 77, vec![0xee; 512]);
    md.message(0, &["check"]).unwrap();
    wait_for("check to count", || status(&md).ends_with(" idle 1 0 -"));
    md.message(0, &["repair"]).unwrap();
    wait_for("repair", || status(&md).contains(" idle "));
    assert!(
        raw(&t, &devs.get("d0")) == raw(&t, &devs.get("d2")),
        "legs differ"
    );
}

#[test]
fn an_interrupted_rebuild_goes_on_from_its_checkpoint() {
    let devs = two_legs();
    let t = ReactorThread::spawn("raid");
    let (d0, d1) = (devs.get("d0"), devs.get("d1"));
    t.write(&d0, 0, pattern(9, 0, LEG));
    // The superblock's magic and checkpoint (docs/design/raid1-metadata.md).
    let sb = || t.read(&devs.get("m0"), 0, 1);
    let checkpoint = || u64::from_le_bytes(sb()[72..80].try_into().unwrap());
    {
        let _md = devs.mapped("r", &line("nosync region_size 1024", "m0 d0 m1 d1"));
        wait_for("the superblock", || sb()[..8] == *b"udmraid1");
    }
    {
        // Leg 1 rebuilt at 1 MiB/s: 8 regions of 512 KiB in about 4 s.
        let l = line(
            "rebuild 1 max_recovery_rate 1024 region_size 1024",
            "m0 d0 m1 d1",
        );
        let md = devs.mapped("r", &l);
        wait_for("a checkpoint", || checkpoint() > 0);
        assert!(status(&md).contains(" Aa "), "{}", status(&md));
        // The array goes away here, mid-rebuild, as in a kill.
    }
    let at = checkpoint();
    assert!(at < LEG / 1024, "the rebuild finished before the restart");
    // A sector below the checkpoint changed behind the array's back: a
    // rebuild that goes on from the checkpoint does not copy it again.
    t.write(&d1, 10, vec![0x77; 512]);
    let md = devs.mapped("r", &line("region_size 1024", "m0 d0 m1 d1"));
    wait_idle(&md, "AA");
    assert_eq!(
        t.read(&d1, 10, 1),
        vec![0x77; 512],
        "rebuilt from the start"
    );
    let from = (at * 1024 * 512) as usize;
    assert!(
        raw(&t, &d0)[from..] == raw(&t, &d1)[from..],
        "legs differ past the checkpoint"
    );
}

#[test]
fn dirty_regions_after_a_restart_are_resynced() {
    let devs = two_legs();
    let t = ReactorThread::spawn("raid");
    let l = line("nosync region_size 1024 daemon_sleep 100000", "m0 d0 m1 d1");
    {
        let md = devs.mapped("r", &l);
        t.write(&as_dev(&md), 2048, pattern(3, 2048, 8));
    }
    // Leg 1 diverges inside the region still marked dirty; a region
    // never written stays as it is.
    t.write(&devs.get("d1"), 2050, vec![0x55; 512]);
    t.write(&devs.get("d1"), 6000, vec![0x66; 512]);
    let md = devs.mapped(
        "r",
        &line("region_size 1024 daemon_sleep 100000", "m0 d0 m1 d1"),
    );
    let _ = t.read(&as_dev(&md), 0, 8);
    wait_idle(&md, "AA");
    assert!(
        t.read(&devs.get("d1"), 2048, 8) == pattern(3, 2048, 8),
        "dirty region not resynced"
    );
    assert!(
        t.read(&devs.get("d1"), 6000, 1) == vec![0x66; 512],
        "clean region resynced"
    );
}

/// The resync rate at the default `max_recovery_rate` (no limit): a new
/// 1 GiB array between RAM legs (`sync`), timed until idle. A benchmark,
/// run by `scripts/bench/raid-resync.sh`:
/// `cargo test --release -p udm-mapper --test raid -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark (1 GiB legs): scripts/bench/raid-resync.sh"]
fn resync_rate_between_ram_legs() {
    const GIB: u64 = 1 << 21;
    let mut devs = Devices::new();
    devs.ram("m0", 64);
    devs.ram("m1", 64);
    devs.ram("d0", GIB);
    devs.ram("d1", GIB);
    let t = ReactorThread::spawn("raid");
    // Touch every page of both legs first, so that page faults of the RAM
    // disks are not what is timed.
    let d0 = devs.get("d0");
    let d1 = devs.get("d1");
    for s in (0..GIB).step_by(2048) {
        t.write(&d0, s, vec![1; 1 << 20]);
        t.write(&d1, s, vec![2; 1 << 20]);
    }
    let md = devs.mapped("r", &format!("0 {GIB} raid raid1 2 0 sync 2 m0 d0 m1 d1"));
    let t0 = std::time::Instant::now();
    let _ = t.read(&as_dev(&md), 0, 8);
    wait_for("the resync", || {
        status(&md).contains(&format!(" AA {GIB}/{GIB} idle "))
    });
    let s = t0.elapsed().as_secs_f64();
    println!(
        "resync of 1 GiB: {:.3} s, {:.2} GB/s",
        s,
        (GIB * 512) as f64 / s / 1e9
    );
    assert!(
        t.read(&d1, GIB - 8, 8) == vec![1; 4096],
        "leg 1 not resynced"
    );
}
