//! The rbd backend against a real one-node Ceph cluster (memstore OSD on
//! 127.0.0.1, started by `scripts/ceph-cluster.sh`): the conformance suite
//! over an image, over linear on an image and over striped on two images;
//! data written through udm read back with `rbd export`; create-time errors
//! that name their cause within a bounded time; a resize picked up by the
//! `resize` message; and I/O failing with EIO after the OSD timeout when the
//! OSD is gone, while another device on the same reactor keeps working.
//!
//! Skipped, saying so, only when the ceph binaries are missing.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

#[path = "conformance/checks.rs"]
mod checks;
#[path = "rbd/cluster.rs"]
mod cluster;
mod common;
#[path = "conformance/durability.rs"]
mod durability;
#[path = "conformance/harness.rs"]
#[allow(dead_code)]
mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_backends::{AlignedBuf, RamDevice, RbdDevice, RbdOpts};
use udm_core::{Alloc, BioFlags, BlockDevice, Caps, ErrorKind, Op, ReactorConfig, Status};

use checks::conformance;
use cluster::Ceph;
use common::Devices;
use harness::*;

fn rbd_caps() -> Caps {
    Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES | Caps::PERSISTENT | Caps::MERGE
}

fn rbd_expect(label: &'static str) -> Expect {
    Expect {
        // librbd skips the parts of a discard that do not cover whole
        // objects (rbd_skip_partial_discard): discard need not zero.
        discard_zeroes: false,
        ..Expect::data(label, rbd_caps())
    }
}

fn open(c: &Ceph, name: &str, dev: &str, extra: &str) -> Arc<dyn BlockDevice> {
    let o = RbdOpts::parse(&c.spec(name, extra)).unwrap();
    Arc::new(RbdDevice::open(dev, &o).unwrap_or_else(|e| panic!("open {name}: {e}")))
}

fn open_err(spec: &str) -> (String, Duration) {
    let t0 = Instant::now();
    let o = RbdOpts::parse(spec).unwrap();
    let e = match RbdDevice::open("x", &o) {
        Ok(_) => panic!("{spec}: opened"),
        Err(e) => e,
    };
    let e = e.to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    (e, t0.elapsed())
}

macro_rules! ceph {
    () => {
        match cluster::shared() {
            Some(c) => c,
            None => return,
        }
    };
}

#[test]
fn rbd_conforms() {
    let c = ceph!();
    conformance(
        || Fixture::plain(open(c, &c.image(DEV_BYTES), "rbd", "")),
        rbd_expect("rbd"),
    );
}

#[test]
fn linear_over_rbd_conforms() {
    let c = ceph!();
    conformance(
        || {
            let mut devs = Devices::new();
            devs.add(open(c, &c.image(DEV_BYTES), "img", ""));
            Fixture::plain(common::as_dev(
                &devs.mapped("lin", &format!("0 {} linear img 0", DEV_BYTES / 512)),
            ))
        },
        rbd_expect("linear over rbd"),
    );
}

#[test]
fn striped_over_two_images_conforms() {
    let c = ceph!();
    conformance(
        || {
            let mut devs = Devices::new();
            devs.add(open(c, &c.image(DEV_BYTES / 2), "a", ""));
            devs.add(open(c, &c.image(DEV_BYTES / 2), "b", ""));
            Fixture::plain(common::as_dev(&devs.mapped(
                "str",
                &format!("0 {} striped 2 128 a 0 b 0", DEV_BYTES / 512),
            )))
        },
        rbd_expect("striped over two rbd images"),
    );
}

#[test]
fn writecache_with_a_ram_cache_over_rbd_conforms() {
    let c = ceph!();
    conformance(
        || {
            let mut devs = Devices::new();
            devs.add(open(c, &c.image(DEV_BYTES), "origin", ""));
            devs.ram("cache", (8 << 20) / 512);
            Fixture::plain(common::as_dev(&devs.mapped(
                "wc",
                &format!("0 {} writecache s origin cache 4096 0", DEV_BYTES / 512),
            )))
        },
        // No MERGE: writes land in the RAM cache, and the writecache's own
        // writeback merges what goes to the image.
        Expect {
            lbs: 4096,
            ..Expect::data(
                "writecache over rbd",
                Caps::FLUSH | Caps::FUA | Caps::DISCARD,
            )
        },
    );
}

#[test]
fn data_written_through_udm_reads_back_with_rbd_export() {
    let c = ceph!();
    let name = c.image(DEV_BYTES);
    let h = Harness::new(
        "rbd export",
        Fixture::plain(open(c, &name, "rbd", "")),
        ReactorConfig::default(),
    );
    let mut shadow = vec![0u8; DEV_BYTES as usize];
    for (i, (sector, len)) in [
        (0u64, 4096usize),
        (8191, 512),
        (20000, 1 << 20),
        (32760, 4096),
    ]
    .into_iter()
    .enumerate()
    {
        let data = pattern(i as u64 + 1, sector * 512, len);
        assert_eq!(h.write(sector, &data), Status::Ok);
        shadow[(sector * 512) as usize..][..len].copy_from_slice(&data);
    }
    assert_eq!(h.dataless(Op::Flush, BioFlags::NONE, 0, 0), Status::Ok);
    let out = format!("{}/export-{name}", c.dir);
    c.rbd(&["export", &format!("rbd/{name}"), &out]);
    let got = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    assert_eq!(got.len(), shadow.len());
    assert!(got == shadow, "rbd export differs from what udm wrote");
}

/// Block status comes from the object map, in whole objects: the objects
/// written are data, the others holes (the image has fast-diff, Ceph's
/// default); a range inside an object is cut to it.
#[test]
fn block_status_reports_the_objects_written_and_holes_elsewhere() {
    let c = ceph!();
    let name = c.image(32 << 20); // 8 objects of 4 MiB (8192 sectors)
    let h = Harness::new(
        "rbd block status",
        Fixture::plain(open(c, &name, "rbd", "")),
        ReactorConfig::default(),
    );
    let map = |sector, sectors| {
        let mut out = Vec::new();
        h.dev.block_status(sector, sectors, &mut out).unwrap();
        out.iter().map(|e| (e.sectors, e.alloc)).collect::<Vec<_>>()
    };
    assert_eq!(map(0, 65536), vec![(65536, Alloc::Hole)]);
    // 4 KiB inside object 2, and object 5's last 4 KiB.
    assert_eq!(h.write(2 * 8192 + 100, &pattern(1, 0, 4096)), Status::Ok);
    assert_eq!(h.write(6 * 8192 - 8, &pattern(2, 0, 4096)), Status::Ok);
    assert_eq!(h.dataless(Op::Flush, BioFlags::NONE, 0, 0), Status::Ok);
    assert_eq!(
        map(0, 65536),
        vec![
            (16384, Alloc::Hole),
            (8192, Alloc::Data),
            (16384, Alloc::Hole),
            (8192, Alloc::Data),
            (16384, Alloc::Hole),
        ]
    );
    assert_eq!(map(2 * 8192 + 100, 100), vec![(100, Alloc::Data)]);
    assert_eq!(map(16000, 400), vec![(384, Alloc::Hole), (16, Alloc::Data)]);
    let mut out = Vec::new();
    assert!(
        h.dev.block_status(65000, 1000, &mut out).is_err(),
        "past the end"
    );
}

#[test]
fn create_errors_name_the_cause_in_bounded_time() {
    let c = ceph!();
    let name = c.image(1 << 20);
    let (e, _) = open_err(&c.spec("nosuch", ""));
    assert!(e.contains("image 'rbd/nosuch' does not exist"), "{e}");
    let (e, _) = open_err(&format!("nopool/{name},conf={}", c.conf));
    assert!(e.contains("pool 'nopool' does not exist"), "{e}");
    let (e, _) = open_err(&format!("rbd/{name}@nosnap,conf={}", c.conf));
    assert!(e.contains("snapshot 'nosnap' of image 'rbd/"), "{e}");
    let (e, _) = open_err(&c.spec(&name, ",conf=/nonexistent/ceph.conf"));
    assert!(
        e.contains("cannot read ceph config '/nonexistent/ceph.conf'"),
        "{e}"
    );

    // A wrong key: the same cluster, a keyring with another secret.
    let conf = std::fs::read_to_string(&c.conf).unwrap();
    let bad_keyring = format!("{}/bad.keyring", c.dir);
    std::fs::write(
        &bad_keyring,
        "[client.admin]\n\tkey = AQBUDWtpAAAAABAAn8Q7S9R3jMGuj1KHOFu1zA==\n",
    )
    .unwrap();
    let bad_conf = format!("{}/bad-key.conf", c.dir);
    let keyring_line = conf
        .lines()
        .find(|l| l.starts_with("keyring"))
        .unwrap()
        .to_string();
    std::fs::write(
        &bad_conf,
        conf.replace(&keyring_line, &format!("keyring = {bad_keyring}")),
    )
    .unwrap();
    let (e, t) = open_err(&format!("rbd/{name},conf={bad_conf},timeout=5"));
    assert!(e.contains("authentication as client.admin failed"), "{e}");
    assert!(t < Duration::from_secs(10), "{t:?}");

    // No cluster: a monitor address nobody listens on.
    let mon_line = conf
        .lines()
        .find(|l| l.starts_with("mon host"))
        .unwrap()
        .to_string();
    let dead_conf = format!("{}/dead.conf", c.dir);
    std::fs::write(
        &dead_conf,
        conf.replace(&mon_line, "mon host = 127.0.0.1:9"),
    )
    .unwrap();
    let (e, t) = open_err(&format!("rbd/{name},conf={dead_conf},timeout=2"));
    assert!(e.contains("no monitor answered within 2 s"), "{e}");
    assert!(t < Duration::from_secs(8), "{t:?}");
}

#[test]
fn a_grown_image_is_picked_up_by_the_resize_message() {
    let c = ceph!();
    let name = c.image(8 << 20);
    let dev = open(c, &name, "rbd", "");
    assert_eq!(dev.limits().sectors, 16384);
    let info = dev.describe().unwrap();
    assert!(info.contains("object size 4194304"), "{info}");
    assert!(info.contains("layering"), "{info}");
    assert!(info.contains("cache "), "{info}");
    c.rbd(&["resize", "--size", "16M", &format!("rbd/{name}")]);
    assert_eq!(dev.message(&["resize"]).unwrap(), "32768");
    assert_eq!(dev.limits().sectors, 32768);
    let h = Harness::new("rbd resize", Fixture::plain(dev), ReactorConfig::default());
    let data = pattern(7, 30000 * 512, 4096);
    assert_eq!(h.write(30000, &data), Status::Ok);
    assert_eq!(h.read(30000, 4096), (Status::Ok, data));
    assert_eq!(h.read(32768, 4096).0, Status::Inval);
    c.rbd(&[
        "resize",
        "--size",
        "8M",
        "--allow-shrink",
        &format!("rbd/{name}"),
    ]);
    let e = h.dev.message(&["resize"]).unwrap_err();
    assert!(e.to_string().contains("shrank"), "{e}");
    assert!(h.dev.message(&["bogus"]).is_err());
}

#[test]
fn a_stopped_osd_fails_io_with_eio_after_the_timeout_and_the_reactor_lives() {
    if !cluster::available() {
        eprintln!("SKIPPED: ceph binaries missing");
        return;
    }
    // Its own cluster: this one loses its OSD.
    let c = cluster::start(1);
    let name = c.image(DEV_BYTES);
    let h = Harness::new(
        "rbd osd down",
        Fixture::plain(open(&c, &name, "rbd", ",timeout=3")),
        ReactorConfig::default(),
    );
    let data = pattern(3, 0, 4096);
    assert_eq!(h.write(0, &data), Status::Ok);
    // Another device on the same reactor.
    let ram: Arc<dyn BlockDevice> = Arc::new(RamDevice::new("ram", 1 << 20).unwrap());
    let ram_ch = ram.open(&h.reactor).unwrap();

    c.stop_osd();
    let t0 = Instant::now();
    let mut buf = AlignedBuf::new(4096);
    let mut rbuf = AlignedBuf::new(4096);
    let rbd_done = Done::default();
    let mut bio = h.bio(Op::Write, BioFlags::NONE, 8);
    // SAFETY: `buf` outlives the wait below.
    unsafe { bio.add_seg(buf.as_mut_ptr(), 4096) };
    h.submit(bio, &rbd_done);
    let ram_done = Done::default();
    let mut bio = h.bio(Op::Read, BioFlags::NONE, 0);
    // SAFETY: `rbuf` outlives the wait below.
    unsafe { bio.add_seg(rbuf.as_mut_ptr(), 4096) };
    bio.set_end_io(ram_end, &ram_done as *const Done as *mut ());
    ram_ch.submit(bio);
    h.wait(std::slice::from_ref(&rbd_done));
    let t = t0.elapsed();
    assert_eq!(ram_done.calls.get(), 1, "the ram device's I/O completed");
    assert!(
        ram_done.at.get().unwrap() < rbd_done.at.get().unwrap(),
        "the ram I/O did not wait for the rbd one"
    );
    assert_eq!(rbd_done.status(), Status::IoErr);
    assert!(
        t >= Duration::from_secs(2) && t < Duration::from_secs(15),
        "{t:?}"
    );
    eprintln!("rbd: write with the OSD down failed with EIO after {t:?}");
    drop(ram_ch);
    drop(h);
    let _ = std::process::Command::new(format!(
        "{}/../scripts/ceph-cluster.sh",
        env!("CARGO_MANIFEST_DIR")
    ))
    .args(["stop", &c.dir])
    .status();
}

fn ram_end(bio: udm_core::BioPtr) {
    // SAFETY: the private is the test's `Done`, alive until it is checked.
    let d = unsafe { &*(bio.private() as *const Done) };
    d.calls.set(d.calls.get() + 1);
    d.status.set(Some(bio.status()));
    d.at.set(Some(Instant::now()));
}

#[test]
fn errors_are_kinds_a_caller_can_act_on() {
    let c = ceph!();
    let o = RbdOpts::parse(&c.spec("missing-image", "")).unwrap();
    let e = RbdDevice::open("x", &o).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::NotFound);
}
