//! The thin-pool and thin targets as users see them: provisioning on first
//! write, zeroes where nothing was written, snapshots that keep their
//! blocks while the origin moves on, discards, external origins, running
//! out of space, status lines, messages and the constructors' one-line
//! errors.

mod common;

use std::sync::Arc;

use common::*;
use udm_core::{BioFlags, Status};
use udm_mapper::MappedDevice;

/// 64 KiB blocks (128 sectors).
const BS: u64 = 128;

struct Pool {
    d: Devices,
    pool: Arc<MappedDevice>,
}

/// A pool over a 1 MiB metadata RAM disk and a data RAM disk of `blocks`
/// blocks, with `features` (e.g. "1 skip_block_zeroing").
fn pool(blocks: u64, lwm: u64, features: &str) -> Pool {
    let mut d = Devices::new();
    d.ram("meta", 2048);
    d.ram("data", blocks * BS);
    let pool = d.mapped(
        "pool",
        &format!(
            "0 {} thin-pool meta data {BS} {lwm} {features}",
            blocks * BS
        ),
    );
    d.add(as_dev(&pool));
    Pool { d, pool }
}

impl Pool {
    fn msg(&self, m: &str) -> Result<String, String> {
        let argv: Vec<&str> = m.split_whitespace().collect();
        self.pool.message(0, &argv).map_err(|e| e.to_string())
    }

    #[track_caller]
    fn ok(&self, m: &str) {
        if let Err(e) = self.msg(m) {
            panic!("message '{m}' failed: {e}");
        }
    }

    fn thin(&self, name: &str, sectors: u64, args: &str) -> Arc<MappedDevice> {
        self.d.mapped(name, &format!("0 {sectors} thin {args}"))
    }

    fn status(&self) -> String {
        self.pool.table().status_lines().remove(0)
    }
}

fn thin_status(md: &MappedDevice) -> String {
    md.table().status_lines().remove(0)
}

#[test]
fn unwritten_blocks_read_as_zeroes_and_first_writes_provision() {
    let p = pool(64, 0, "");
    p.ok("create_thin 0");
    let t = p.thin("t", 16 * BS, "pool 0");
    let dev = as_dev(&t);
    let tr = Tester::new();
    assert!(tr.read(&dev, 0, 4 * BS).iter().all(|&b| b == 0));
    assert_eq!(thin_status(&t), format!("0 {} thin 0 -", 16 * BS));
    // A partial write: the rest of its block reads as zeroes.
    tr.write(&dev, BS + 8, pattern(1, BS + 8, 8));
    let got = tr.read(&dev, BS, BS);
    assert_sectors_eq(
        &got[8 * 512..16 * 512],
        &pattern(1, BS + 8, 8),
        "written part",
    );
    assert!(got[..8 * 512].iter().all(|&b| b == 0), "zeroed before");
    assert!(got[16 * 512..].iter().all(|&b| b == 0), "zeroed after");
    // Overwrites of the provisioned block and reads of it.
    tr.write(&dev, BS, pattern(2, BS, BS));
    assert_sectors_eq(&tr.read(&dev, BS, BS), &pattern(2, BS, BS), "overwrite");
    assert_eq!(
        thin_status(&t),
        format!("0 {} thin {BS} {}", 16 * BS, 2 * BS - 1)
    );
    assert!(p.status().contains(" 1/64 "), "{}", p.status());
}

#[test]
fn writes_across_blocks_and_many_in_flight_provision_each_block_once() {
    let p = pool(64, 0, "");
    p.ok("create_thin 1");
    let t = p.thin("t", 32 * BS, "pool 1");
    let dev = as_dev(&t);
    let tr = Tester::new();
    // 64 writes of 8 sectors, all in flight at once, 8 to each block.
    let reqs: Vec<Req> = (0..64u64)
        .map(|i| Req::write(i * 16, pattern(3, i * 16, 8)))
        .collect();
    for d in tr.run_all(&dev, reqs) {
        assert_eq!(d.status, Status::Ok);
    }
    for i in 0..64u64 {
        assert_sectors_eq(&tr.read(&dev, i * 16, 8), &pattern(3, i * 16, 8), "write");
    }
    assert!(
        p.status().contains(" 8/64 "),
        "8 blocks used: {}",
        p.status()
    );
    // One write crossing two blocks.
    tr.write(&dev, 10 * BS - 4, pattern(4, 10 * BS - 4, 8));
    assert_sectors_eq(
        &tr.read(&dev, 10 * BS - 4, 8),
        &pattern(4, 10 * BS - 4, 8),
        "across",
    );
}

/// The pool status's used data blocks.
fn used_data(p: &Pool) -> String {
    p.status()
        .split_whitespace()
        .nth(5)
        .unwrap_or("")
        .to_string()
}

#[test]
fn first_writes_on_the_reactors_map_each_block_once_and_snapshots_see_them() {
    let p = pool(256, 0, "1 skip_block_zeroing");
    p.ok("create_thin 0");
    let t = p.thin("t", 64 * BS, "pool 0");
    let dev = as_dev(&t);
    let tr = Tester::new();
    // Rounds of 4 KiB writes, each round all in flight at once, four to
    // each of 16 fresh blocks: the first round finds no reserve yet (the
    // worker provisions), later rounds provision on the reactor.
    let at = |round: u64, i: u64| (round * 16 + i / 4) * BS + (i % 4) * 8;
    for round in 0..4u64 {
        let reqs: Vec<Req> = (0..64u64)
            .map(|i| Req::write(at(round, i), pattern(10 + round, at(round, i), 8)))
            .collect();
        for d in tr.run_all(&dev, reqs) {
            assert_eq!(d.status, Status::Ok);
        }
    }
    for round in 0..4u64 {
        for i in 0..64u64 {
            let s = at(round, i);
            assert_sectors_eq(&tr.read(&dev, s, 8), &pattern(10 + round, s, 8), "write");
        }
    }
    // Blocks reserved for the reactor and not used are not counted.
    assert_eq!(used_data(&p), "64/256", "{}", p.status());
    // A snapshot holds every write completed before it; a write to the
    // origin then breaks sharing.
    p.ok("create_snap 1 0");
    let s = p.thin("s", 64 * BS, "pool 1");
    tr.write(&dev, 0, pattern(20, 0, 8));
    assert_sectors_eq(&tr.read(&dev, 0, 8), &pattern(20, 0, 8), "origin");
    assert_sectors_eq(&tr.read(&as_dev(&s), 0, 8), &pattern(10, 0, 8), "snap");
    // And first writes after it provision again.
    tr.write(&dev, 63 * BS, pattern(21, 63 * BS, 8));
    assert_sectors_eq(
        &tr.read(&dev, 63 * BS, 8),
        &pattern(21, 63 * BS, 8),
        "after",
    );
    assert_eq!(used_data(&p), "66/256", "{}", p.status());
}

#[test]
fn a_snapshot_keeps_its_blocks_while_the_origin_is_overwritten() {
    let p = pool(64, 0, "");
    p.ok("create_thin 0");
    let o = p.thin("o", 8 * BS, "pool 0");
    let od = as_dev(&o);
    let tr = Tester::new();
    tr.write(&od, 0, pattern(1, 0, 4 * BS));
    p.ok("create_snap 1 0");
    let s = p.thin("s", 8 * BS, "pool 1");
    let sd = as_dev(&s);
    // Overwrite part of a shared block on the origin: the origin sees the
    // new data over the old, the snapshot the old.
    tr.write(&od, 8, pattern(2, 8, 8));
    let mut want = pattern(1, 0, BS);
    want[8 * 512..16 * 512].copy_from_slice(&pattern(2, 8, 8));
    assert_sectors_eq(&tr.read(&od, 0, BS), &want, "origin");
    assert_sectors_eq(&tr.read(&sd, 0, 4 * BS), &pattern(1, 0, 4 * BS), "snap");
    // A snapshot of the snapshot, written too.
    p.ok("create_snap 2 1");
    tr.write(&sd, BS, pattern(3, BS, BS));
    let s2 = p.thin("s2", 8 * BS, "pool 2");
    assert_sectors_eq(
        &tr.read(&as_dev(&s2), 0, 4 * BS),
        &pattern(1, 0, 4 * BS),
        "snap of snap",
    );
    assert_sectors_eq(&tr.read(&sd, BS, BS), &pattern(3, BS, BS), "snap written");
    // 4 shared + 1 origin copy + 1 snapshot copy.
    assert!(p.status().contains(" 6/64 "), "{}", p.status());
}

#[test]
fn discards_unmap_whole_blocks_and_free_them() {
    let p = pool(64, 0, "");
    p.ok("create_thin 0");
    let t = p.thin("t", 8 * BS, "pool 0");
    let dev = as_dev(&t);
    let tr = Tester::new();
    tr.write(&dev, 0, pattern(1, 0, 4 * BS));
    assert!(p.status().contains(" 4/64 "), "{}", p.status());
    // Blocks 1 and 2 whole, and half of block 3, which stays mapped: that
    // half is passed down to the data device (a RAM disk, which then
    // reads zeroes there), the rest of the block is kept.
    let d = tr.run(&dev, Req::discard(BS, 2 * BS + BS / 2));
    assert_eq!(d.status, Status::Ok);
    assert!(p.status().contains(" 2/64 "), "{}", p.status());
    assert!(tr.read(&dev, BS, 2 * BS + BS / 2).iter().all(|&b| b == 0));
    assert_sectors_eq(
        &tr.read(&dev, 3 * BS + BS / 2, BS / 2),
        &pattern(1, 3 * BS + BS / 2, BS / 2),
        "kept",
    );
    assert_eq!(
        thin_status(&t),
        format!("0 {} thin {} {}", 8 * BS, 2 * BS, 4 * BS - 1)
    );
}

#[test]
fn a_partial_discard_reaches_the_data_device_only_with_passdown() {
    for (features, passed) in [("", true), ("1 no_discard_passdown", false)] {
        let p = pool(64, 0, features);
        p.ok("create_thin 0");
        let t = p.thin("t", 8 * BS, "pool 0");
        let dev = as_dev(&t);
        let tr = Tester::new();
        tr.write(&dev, 0, pattern(1, 0, 2 * BS));
        // Half of block 1, from its second quarter: the block stays.
        let d = tr.run(&dev, Req::discard(BS + BS / 4, BS / 2));
        assert_eq!(d.status, Status::Ok);
        assert!(p.status().contains(" 2/64 "), "{features}: {}", p.status());
        let got = tr.read(&dev, BS, BS);
        let q = (BS / 4 * 512) as usize;
        let want = pattern(1, BS, BS);
        assert_sectors_eq(&got[..q], &want[..q], "before the discard");
        assert_sectors_eq(&got[3 * q..], &want[3 * q..], "after the discard");
        if passed {
            assert!(
                got[q..3 * q].iter().all(|&b| b == 0),
                "{features}: passed down"
            );
        } else {
            assert_sectors_eq(&got[q..3 * q], &want[q..3 * q], "not passed down");
        }
        // The other block is untouched either way.
        assert_sectors_eq(&tr.read(&dev, 0, BS), &pattern(1, 0, BS), "block 0");
    }
}

#[test]
fn an_external_origin_is_read_where_nothing_was_written() {
    let mut p = pool(64, 0, "");
    let base = p.d.ram("base", 3 * BS + 64);
    let tr = Tester::new();
    tr.write(&base, 0, pattern(9, 0, 3 * BS + 64));
    p.ok("create_thin 0");
    let t = p.thin("t", 8 * BS, "pool 0 base");
    let dev = as_dev(&t);
    assert_sectors_eq(&tr.read(&dev, 0, 2 * BS), &pattern(9, 0, 2 * BS), "origin");
    // A read across the origin's end: zeroes past it.
    let got = tr.read(&dev, 3 * BS, BS);
    assert_sectors_eq(&got[..64 * 512], &pattern(9, 3 * BS, 64), "origin tail");
    assert!(got[64 * 512..].iter().all(|&b| b == 0));
    // A partial write copies the rest of the block from the origin.
    tr.write(&dev, BS + 4, pattern(5, BS + 4, 4));
    let mut want = pattern(9, BS, BS);
    want[4 * 512..8 * 512].copy_from_slice(&pattern(5, BS + 4, 4));
    assert_sectors_eq(&tr.read(&dev, BS, BS), &want, "copied block");
    assert_sectors_eq(
        &tr.read(&base, BS, BS),
        &pattern(9, BS, BS),
        "base untouched",
    );
}

#[test]
fn flush_and_fua_writes_complete() {
    let p = pool(64, 0, "");
    p.ok("create_thin 0");
    let t = p.thin("t", 8 * BS, "pool 0");
    let dev = as_dev(&t);
    let tr = Tester::new();
    let d = tr.run(&dev, Req::write(0, pattern(1, 0, 8)).flags(BioFlags::FUA));
    assert_eq!(d.status, Status::Ok);
    assert_eq!(tr.run(&dev, Req::flush()).status, Status::Ok);
    let d = tr.run(
        &dev,
        Req::write(BS, pattern(1, BS, 8)).flags(BioFlags::PREFLUSH | BioFlags::FUA),
    );
    assert_eq!(d.status, Status::Ok);
    assert_sectors_eq(&tr.read(&dev, 0, 8), &pattern(1, 0, 8), "fua write");
}

#[test]
fn a_full_pool_fails_writes_with_error_if_no_space_and_raises_events() {
    let p = pool(4, 1, "1 error_if_no_space");
    p.ok("create_thin 0");
    let t = p.thin("t", 8 * BS, "pool 0");
    let dev = as_dev(&t);
    let tr = Tester::new();
    let ev0 = p.pool.table().events();
    tr.write(&dev, 0, pattern(1, 0, 3 * BS));
    assert!(p.pool.table().events() > ev0, "low water mark event");
    tr.write(&dev, 3 * BS, pattern(1, 3 * BS, BS));
    let d = tr.run(&dev, Req::write(4 * BS, pattern(1, 4 * BS, 8)));
    assert_eq!(d.status, Status::NoSpace);
    assert!(p.status().contains("out_of_data_space"), "{}", p.status());
    // Provisioned blocks still take overwrites.
    tr.write(&dev, 0, pattern(2, 0, 8));
}

#[test]
fn status_and_table_lines_follow_dm() {
    let p = pool(64, 10, "2 skip_block_zeroing no_discard_passdown");
    assert_eq!(
        p.status(),
        format!(
            "0 {} thin-pool 0 9/256 0/64 - rw no_discard_passdown queue_if_no_space - 64",
            64 * BS
        )
    );
    assert_eq!(
        p.pool.table().table_lines(),
        vec![format!(
            "0 {} thin-pool meta data {BS} 10 2 skip_block_zeroing no_discard_passdown",
            64 * BS
        )]
    );
    p.ok("set_transaction_id 0 5");
    assert!(p
        .status()
        .starts_with(&format!("0 {} thin-pool 5 ", 64 * BS)));
    p.ok("reserve_metadata_snap");
    assert!(
        !p.status().contains(" - rw"),
        "held root shown: {}",
        p.status()
    );
    p.ok("release_metadata_snap");
    p.ok("create_thin 3");
    let t = p.thin("t", 8 * BS, "pool 3");
    assert_eq!(
        t.table().table_lines(),
        vec![format!("0 {} thin pool 3", 8 * BS)]
    );
}

#[test]
fn bad_tables_and_messages_are_one_line_errors() {
    let p = pool(64, 0, "");
    let e =
        p.d.table_err(&format!("0 {} thin-pool meta data 100 0", 64 * BS));
    assert!(e.contains("invalid data block size '100'"), "{e}");
    let e = p.d.table_err("0 128 thin-pool meta data 256 0 1 bogus");
    assert!(e.contains("unknown feature 'bogus'"), "{e}");
    let e = p.d.table_err("0 128 thin-pool meta data 128 0 2 read_only");
    assert!(e.contains("number of features is 2 but 1 follow"), "{e}");
    let mut d = p.d.clone();
    d.ram("tiny", 8);
    d.ram("data2", 1024);
    let e = d.table_err("0 1024 thin-pool tiny data2 128 0");
    assert!(e.contains("metadata device 'tiny' is too small"), "{e}");
    p.ok("create_thin 1");
    assert!(p
        .msg("create_thin 1")
        .unwrap_err()
        .contains("dev id 1 is in use"));
    assert!(p
        .msg("create_snap 2 7")
        .unwrap_err()
        .contains("origin dev id 7 does not exist"));
    assert!(p
        .msg("create_thin 99999999")
        .unwrap_err()
        .contains("invalid dev id"));
    assert!(p
        .msg("set_transaction_id 3 4")
        .unwrap_err()
        .contains("transaction id"));
    assert!(p
        .msg("frobnicate")
        .unwrap_err()
        .contains("unknown message 'frobnicate'"));
    let e = p.d.table_err("0 128 thin pool 5");
    assert!(e.contains("dev id 5 does not exist"), "{e}");
    let e = p.d.table_err("0 128 thin data 1");
    assert!(e.contains("'data' is not a thin-pool device"), "{e}");
    let t = p.thin("t", 8 * BS, "pool 1");
    assert!(p.msg("delete 1").unwrap_err().contains("dev id 1 is open"));
    drop(t);
    p.ok("delete 1");
    assert!(p.msg("delete 1").unwrap_err().contains("does not exist"));
    for e in [
        p.msg("create_thin 1 2").unwrap_err(),
        p.d.table_err("0 128 thin-pool meta data 4096 x"),
    ] {
        assert!(!e.contains('\n'), "one line: {e}");
    }
}

#[test]
fn block_status_reports_unprovisioned_blocks_as_holes() {
    use udm_core::{Alloc, Extent};
    let p = pool(64, 0, "");
    p.ok("create_thin 0");
    let t = p.thin("t", 8 * BS, "pool 0");
    let dev = as_dev(&t);
    let tr = Tester::new();
    tr.write(&dev, 2 * BS + 3, pattern(1, 2 * BS + 3, 1));
    drop(tr);
    // A new table over the volume loads its mappings from the metadata.
    let t2 = p.thin("t2", 8 * BS, "pool 0");
    for d in [dev, as_dev(&t2)] {
        let mut out = Vec::new();
        d.block_status(0, 8 * BS, &mut out).unwrap();
        assert_eq!(
            out,
            vec![
                Extent {
                    sectors: 2 * BS,
                    alloc: Alloc::Hole
                },
                Extent {
                    sectors: BS,
                    alloc: Alloc::Data
                },
                Extent {
                    sectors: 5 * BS,
                    alloc: Alloc::Hole
                },
            ],
            "{}",
            d.name()
        );
    }
}
