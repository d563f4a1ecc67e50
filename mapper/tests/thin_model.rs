//! The thin targets against a model: random writes, discards, snapshots
//! of snapshots, deletes and table reloads on a pool, every volume's
//! content checked against an in-memory copy of what it should hold; and
//! a pool that runs out of space holds writes until its data device grows.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use udm_core::{BlockDevice, Status};
use udm_mapper::MappedDevice;

/// 64 KiB blocks.
const BS: u64 = 128;
/// Each volume: 16 blocks (1 MiB).
const VOL: u64 = 16 * BS;

struct Vol {
    md: Arc<MappedDevice>,
    model: Vec<u8>,
    /// The volume's own reactor.
    rt: ReactorThread,
}

fn thin(d: &Devices, id: u32) -> Arc<MappedDevice> {
    d.mapped(&format!("t{id}"), &format!("0 {VOL} thin pool {id}"))
}

/// `thin_check` over the metadata device's bytes (read through `rt`
/// while no I/O is in flight and the pool has just committed), where the
/// tool is installed; returns whether it ran.
fn thin_check(rt: &ReactorThread, meta: &Arc<dyn BlockDevice>, when: &str) -> bool {
    let Some(tool) = [
        "/usr/sbin/thin_check",
        "/sbin/thin_check",
        "/usr/bin/thin_check",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists()) else {
        return false;
    };
    let file = udm_core::testing::TempFile::new("thin-model-meta");
    std::fs::write(&file.path, rt.read(meta, 0, meta.limits().sectors))
        .expect("write the metadata copy");
    let out = std::process::Command::new(tool)
        .arg(&file.path)
        .output()
        .expect("run thin_check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "thin_check failed {when}:\n{text}");
    for word in ["leak", "differ", "error"] {
        assert!(
            !text.to_lowercase().contains(word),
            "thin_check {when}: {word}:\n{text}"
        );
    }
    true
}

fn msg(pool: &MappedDevice, m: &str) -> Result<String, String> {
    let argv: Vec<&str> = m.split_whitespace().collect();
    pool.message(0, &argv).map_err(|e| e.to_string())
}

#[track_caller]
fn check(id: u32, v: &Vol) {
    let got = v.rt.read(&as_dev(&v.md), 0, VOL);
    assert_sectors_eq(&got, &v.model, &format!("volume {id}"));
}

#[test]
fn random_writes_discards_snapshots_deletes_and_reloads_match_the_model() {
    let mut d = Devices::new();
    d.ram("meta", 4096);
    // Room for every volume's blocks at once, and more.
    d.ram("data", 512 * BS);
    let pool = d.mapped(
        "pool",
        &format!("0 {} thin-pool meta data {BS} 0", 512 * BS),
    );
    d.add(as_dev(&pool));
    let mut rng = Rng::new(38);
    let mut vols: BTreeMap<u32, Vol> = BTreeMap::new();
    let mut next_id = 0u32;
    let mut checks = 0u32;
    msg(&pool, "create_thin 0").unwrap();
    vols.insert(
        0,
        Vol {
            md: thin(&d, 0),
            model: vec![0; (VOL * 512) as usize],
            rt: ReactorThread::spawn("thin-model-0"),
        },
    );
    next_id += 1;
    for step in 0..400u64 {
        let ids: Vec<u32> = vols.keys().copied().collect();
        let id = ids[rng.range(0, ids.len() as u64 - 1) as usize];
        match rng.range(0, 99) {
            // Writes of 1 sector to 2.5 blocks anywhere, many partial.
            0..=59 => {
                let n = rng.range(1, 5 * BS / 2);
                let s = rng.range(0, VOL - n);
                let data = pattern(step, s, n);
                let v = vols.get_mut(&id).unwrap();
                v.rt.write(&as_dev(&v.md), s, data.clone());
                v.model[(s * 512) as usize..((s + n) * 512) as usize].copy_from_slice(&data);
            }
            // Discards of whole blocks (a partial block's content after a
            // discard is unspecified).
            60..=69 => {
                let b = rng.range(0, 15);
                let n = rng.range(1, 16 - b);
                let v = vols.get_mut(&id).unwrap();
                let r = v.rt.run(&as_dev(&v.md), Req::discard(b * BS, n * BS));
                assert_eq!(r.status, Status::Ok);
                v.model[(b * BS * 512) as usize..((b + n) * BS * 512) as usize].fill(0);
            }
            // A snapshot (of a snapshot, often).
            70..=79 if vols.len() < 8 => {
                let new = next_id;
                next_id += 1;
                msg(&pool, &format!("create_snap {new} {id}")).unwrap();
                let model = vols[&id].model.clone();
                vols.insert(
                    new,
                    Vol {
                        md: thin(&d, new),
                        model,
                        rt: ReactorThread::spawn(&format!("thin-model-{new}")),
                    },
                );
            }
            // Delete: refused while open, done once closed.
            80..=84 if vols.len() > 1 => {
                let e = msg(&pool, &format!("delete {id}")).unwrap_err();
                assert!(e.contains("is open"), "{e}");
                let v = vols.remove(&id).unwrap();
                check(id, &v);
                // Removing the device is enough (its reactor lets go of
                // the table), whether or not the reactor goes on.
                if step % 2 == 0 {
                    drop(v);
                } else {
                    drop(v.md);
                }
                msg(&pool, &format!("delete {id}")).unwrap();
            }
            // Reload the volume's table while it is open.
            85..=89 => {
                let v = &vols[&id];
                v.md.replace(d.table(&format!("0 {VOL} thin pool {id}")))
                    .unwrap();
            }
            // A flush (a commit) now and then, and the committed
            // metadata checked by Linux's tools.
            90..=94 => {
                let v = &vols[&id];
                assert_eq!(v.rt.run(&as_dev(&v.md), Req::flush()).status, Status::Ok);
                checks += thin_check(&v.rt, &d.get("meta"), &format!("at step {step}")) as u32;
            }
            _ => check(id, &vols[&id]),
        }
    }
    for (id, v) in &vols {
        check(*id, v);
        let st = v.md.table().status_lines().remove(0);
        let mapped_sectors: u64 = st.split_whitespace().nth(3).unwrap().parse().unwrap();
        assert_eq!(mapped_sectors % BS, 0, "{st}");
    }
    let v = vols.values().next().unwrap();
    assert_eq!(v.rt.run(&as_dev(&v.md), Req::flush()).status, Status::Ok);
    checks += thin_check(&v.rt, &d.get("meta"), "at the end") as u32;
    eprintln!("thin_check ran {checks} times");
    // Every block in use is some volume's: the pool counts no more than
    // the volumes map.
    let used: u64 = pool.table().status_lines()[0]
        .split_whitespace()
        .nth(5)
        .and_then(|u| u.split('/').next())
        .unwrap()
        .parse()
        .unwrap();
    let mapped: u64 = vols
        .values()
        .map(|v| {
            let st = v.md.table().status_lines().remove(0);
            st.split_whitespace()
                .nth(3)
                .unwrap()
                .parse::<u64>()
                .unwrap()
                / BS
        })
        .sum();
    assert!(used <= mapped, "{used} blocks used, volumes map {mapped}");
}

#[test]
fn held_writes_resume_when_the_data_device_grows() {
    let mut d = Devices::new();
    d.ram("meta", 4096);
    d.ram("big", 16 * BS);
    // The data device: a linear over the first 4 blocks of 'big', grown later.
    let data = d.mapped("data", &format!("0 {} linear big 0", 4 * BS));
    d.add(as_dev(&data));
    let line = |blocks: u64| format!("0 {} thin-pool meta data {BS} 1", blocks * BS);
    let pool = d.mapped("pool", &line(4));
    d.add(as_dev(&pool));
    msg(&pool, "create_thin 0").unwrap();
    let t = as_dev(&thin(&d, 0));
    let rt = ReactorThread::spawn("thin-grow");
    for b in 0..4 {
        rt.write(&t, b * BS, pattern(1, b * BS, BS));
    }
    let events = pool.table().events();
    assert!(events >= 1, "low water mark crossed");
    // The fifth block's write waits: the pool is out of data space.
    let held = rt.submit(&t, Req::write(4 * BS, pattern(2, 4 * BS, 8)));
    assert!(
        held.recv_timeout(Duration::from_millis(200)).is_err(),
        "write held"
    );
    let st = pool.table().status_lines().remove(0);
    assert!(st.contains(" out_of_data_space "), "{st}");
    assert!(
        pool.table().events() > events,
        "out of space raised an event"
    );
    // Grow the data device, then reload the pool over it: the write goes on.
    data.replace(d.table(&format!("0 {} linear big 0", 16 * BS)))
        .unwrap();
    pool.load(d.table(&line(16)));
    pool.suspend(false).unwrap();
    pool.resume().unwrap();
    let done = held.recv_timeout(TIMEOUT).expect("held write completes");
    assert_eq!(done.status, Status::Ok);
    let st = pool.table().status_lines().remove(0);
    assert!(st.contains(" 5/16 ") && st.contains(" rw "), "{st}");
    assert_sectors_eq(
        &rt.read(&t, 4 * BS, 8),
        &pattern(2, 4 * BS, 8),
        "held write",
    );
    assert_sectors_eq(&rt.read(&t, 0, BS), &pattern(1, 0, BS), "block 0");
}

#[test]
fn the_pool_outlives_its_device_while_volumes_use_it() {
    let mut d = Devices::new();
    d.ram("meta", 4096);
    d.ram("data", 16 * BS);
    let pool = d.mapped("pool", &format!("0 {} thin-pool meta data {BS} 0", 16 * BS));
    d.add(as_dev(&pool));
    msg(&pool, "create_thin 0").unwrap();
    let t: Arc<dyn BlockDevice> = as_dev(&thin(&d, 0));
    drop(pool);
    let rt = ReactorThread::spawn("thin-outlive");
    rt.write(&t, 0, pattern(3, 0, 16));
    assert_sectors_eq(
        &rt.read(&t, 0, 16),
        &pattern(3, 0, 16),
        "after the pool device",
    );
}

#[test]
fn a_pool_made_again_over_its_devices_finds_its_volumes_and_refuses_corrupt_metadata() {
    let mut d = Devices::new();
    let meta = d.ram("meta", 4096);
    d.ram("data", 64 * BS);
    let line = format!("0 {} thin-pool meta data {BS} 0", 64 * BS);
    {
        let pool = d.mapped("pool", &line);
        let mut d = d.clone();
        d.add(as_dev(&pool));
        msg(&pool, "create_thin 7").unwrap();
        msg(&pool, "set_transaction_id 0 3").unwrap();
        let rt = ReactorThread::spawn("thin-first");
        let t = as_dev(&thin(&d, 7));
        rt.write(&t, 5, pattern(4, 5, 300));
        assert_eq!(rt.run(&t, Req::flush()).status, Status::Ok);
        msg(&pool, "create_snap 8 7").unwrap();
    }
    // Every device and reactor of the first pool is gone: the metadata
    // device alone knows the volumes.
    let pool = d.mapped("pool", &line);
    d.add(as_dev(&pool));
    let st = pool.table().status_lines().remove(0);
    assert!(st.contains(" thin-pool 3 "), "transaction id kept: {st}");
    let rt = ReactorThread::spawn("thin-second");
    for id in [7, 8] {
        let t = as_dev(&thin(&d, id));
        assert_sectors_eq(
            &rt.read(&t, 5, 300),
            &pattern(4, 5, 300),
            &format!("volume {id}"),
        );
    }
    drop((pool, rt, d));
    // A flipped byte in the superblock: a one-line error, no pool.
    let mut sb = ReactorThread::spawn("thin-corrupt").read(&meta, 0, 8);
    sb[100] ^= 0xff;
    ReactorThread::spawn("thin-corrupt2").write(&meta, 0, sb);
    let mut d = Devices::new();
    d.add(meta);
    d.ram("data", 64 * BS);
    let e = d.table_err(&line);
    assert!(e.contains("metadata") && !e.contains('\n'), "{e}");
}

#[test]
fn a_read_only_pool_fails_every_write_and_a_reload_makes_it_writable_again() {
    let mut d = Devices::new();
    d.ram("meta", 4096);
    d.ram("data", 16 * BS);
    let line = |f: &str| format!("0 {} thin-pool meta data {BS} 0 {f}", 16 * BS);
    let pool = d.mapped("pool", &line("0"));
    d.add(as_dev(&pool));
    msg(&pool, "create_thin 0").unwrap();
    let t = as_dev(&thin(&d, 0));
    let rt = ReactorThread::spawn("thin-ro");
    rt.write(&t, 0, pattern(1, 0, BS));
    let reload = |f: &str| {
        pool.load(d.table(&line(f)));
        pool.suspend(false).unwrap();
        pool.resume().unwrap();
    };
    reload("1 read_only");
    let st = pool.table().status_lines().remove(0);
    assert!(st.contains(" ro "), "{st}");
    // Provisioned or not, a write fails; reads go on.
    for s in [0, 3 * BS] {
        let r = rt.run(&t, Req::write(s, pattern(2, s, 8)));
        assert_eq!(r.status, Status::IoErr, "write at {s}");
    }
    assert_sectors_eq(&rt.read(&t, 0, BS), &pattern(1, 0, BS), "read");
    assert!(msg(&pool, "create_thin 1")
        .unwrap_err()
        .contains("read-only"));
    reload("0");
    rt.write(&t, 0, pattern(3, 0, 8));
    assert_sectors_eq(&rt.read(&t, 0, 8), &pattern(3, 0, 8), "written again");
}

/// Blocks freed by discards while the other volume's I/O runs on another
/// reactor, and taken again by the first: no write ever lands in a block
/// after it left the volume that wrote it.
#[test]
fn discards_under_concurrent_io_never_let_a_late_write_land_in_a_reused_block() {
    let mut d = Devices::new();
    d.ram("meta", 4096);
    // Tight: blocks freed by discards are soon reused.
    d.ram("data", 12 * BS);
    let pool = d.mapped(
        "pool",
        &format!(
            "0 {} thin-pool meta data {BS} 0 1 skip_block_zeroing",
            12 * BS
        ),
    );
    d.add(as_dev(&pool));
    msg(&pool, "create_thin 1").unwrap();
    msg(&pool, "create_thin 2").unwrap();
    let a = as_dev(&thin(&d, 1));
    let b = as_dev(&thin(&d, 2));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Volume 1: bursts of writes over blocks 0..4, all in flight at once,
    // then discards of them, over and over.
    let churn = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let rt = ReactorThread::spawn("thin-churn");
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round += 1;
                let rx: Vec<_> = (0..32u64)
                    .map(|i| {
                        let s = (i % 4) * BS + (i / 4) * 8;
                        rt.submit(&a, Req::write(s, pattern(round, s, 8)))
                    })
                    .collect();
                let dx = rt.submit(&a, Req::discard(0, 4 * BS));
                for r in rx {
                    assert_eq!(r.recv_timeout(TIMEOUT).expect("write").status, Status::Ok);
                }
                assert_eq!(
                    dx.recv_timeout(TIMEOUT).expect("discard").status,
                    Status::Ok
                );
                let _ = rt.run(&a, Req::flush());
            }
        })
    };
    // Volume 2: writes its blocks (taking blocks volume 1 freed), flushes,
    // and reads them back: they must hold what it wrote.
    let rt = ReactorThread::spawn("thin-victim");
    for round in 0..60u64 {
        let tag = 1_000_000 + round;
        for blk in 0..4u64 {
            rt.write(&b, blk * BS, pattern(tag, blk * BS, BS));
        }
        assert_eq!(rt.run(&b, Req::flush()).status, Status::Ok);
        for blk in 0..4u64 {
            let got = rt.read(&b, blk * BS, BS);
            assert_sectors_eq(
                &got,
                &pattern(tag, blk * BS, BS),
                &format!("round {round} block {blk}"),
            );
        }
        let r = rt.run(&b, Req::discard(0, 4 * BS));
        assert_eq!(r.status, Status::Ok);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churn.join().expect("churn thread");
}
