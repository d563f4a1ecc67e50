//! Each device's report of whether merging adjacent requests helps it
//! (seed 004), and the dispatch `auto` picks from it: backends from their
//! nature, mapped devices from what they map to.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{as_dev, Devices};
use udm_backends::{FileDevice, FileOpts, NullDevice};
use udm_core::dispatch::AUTO_WEIGHED;
use udm_core::{merge_report, BlockDevice, Dispatch};

fn report(dev: &dyn BlockDevice) -> (bool, String) {
    merge_report(dev)
}

/// Whether `auto` on `dev` weighs queued against direct (where merging
/// helps it) rather than choosing per request; either way it stays `auto`.
fn weighed(dev: &dyn BlockDevice) -> bool {
    let (mode, why) = Dispatch::Auto.choose(dev);
    assert_eq!(mode, Dispatch::Auto, "{why}");
    why.ends_with(AUTO_WEIGHED)
}

/// A scratch file of 1 MiB under `dir`, removed when dropped.
struct Scratch(String);

impl Scratch {
    fn new(dir: &str, tag: &str) -> Scratch {
        Scratch(format!(
            "{dir}/udm-merge-report-{tag}-{}",
            std::process::id()
        ))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn file(name: &str, path: &str, buffered: bool) -> Arc<dyn BlockDevice> {
    let opts = FileOpts {
        buffered,
        size: Some(1 << 20),
        ..FileOpts::default()
    };
    Arc::new(FileDevice::open(name, path, opts).unwrap())
}

/// A directory on a disk (the one this checkout is on).
fn disk_dir() -> String {
    env!("CARGO_TARGET_TMPDIR").to_string()
}

#[test]
fn ram_and_null_do_not_gain_and_auto_streams_them() {
    let mut devs = Devices::new();
    let ram = devs.ram("ram0", 2048);
    assert_eq!(
        report(&*ram),
        (false, "RAM: a request costs only its copy".into())
    );
    let null = NullDevice::new("null0", 1 << 20, None).unwrap();
    assert_eq!(
        report(&null),
        (false, "null: a request costs nothing".into())
    );
    for d in [&*ram as &dyn BlockDevice, &null] {
        let (mode, why) = Dispatch::Auto.choose(d);
        assert_eq!(mode, Dispatch::Auto, "{}: chosen per request", d.name());
        assert!(why.starts_with("auto: merging does not help ("), "{why}");
        assert!(
            why.ends_with(
                "back-to-back requests merge while others are in flight, the rest go direct"
            ),
            "{why}"
        );
    }
}

#[test]
fn null_with_a_delay_per_request_gains_and_auto_queues() {
    let d = NullDevice::new("slow", 1 << 20, Some(Duration::from_micros(50))).unwrap();
    assert_eq!(
        report(&d),
        (true, "null with a delay of 50 µs per request".into())
    );
    assert_eq!(
        Dispatch::Auto.choose(&d),
        (
            Dispatch::Auto,
            "auto: merging helps (null with a delay of 50 µs per request); \
             queued, or direct where it measures faster"
                .into()
        )
    );
}

#[test]
fn an_o_direct_file_gains_on_a_disk_or_may_in_memory_but_buffered_does_not() {
    let on_disk = Scratch::new(&disk_dir(), "disk");
    let d = file("f0", &on_disk.0, false);
    assert_eq!(report(&*d), (true, "file on a disk, O_DIRECT".into()));
    assert!(weighed(&*d));

    let buffered = file("f1", &on_disk.0, true);
    assert_eq!(
        report(&*buffered),
        (false, "buffered: the page cache merges".into())
    );
    assert!(!weighed(&*buffered));

    let shm = Scratch::new("/dev/shm", "shm");
    // tmpfs takes O_DIRECT on kernels since 6.6; skip where it does not.
    match FileDevice::open(
        "f2",
        &shm.0,
        FileOpts {
            size: Some(1 << 20),
            ..FileOpts::default()
        },
    ) {
        Ok(d) => {
            // Merged requests go on fewer of io_uring's workers: which
            // wins depends on the host, so auto weighs them.
            assert_eq!(
                report(&d),
                (
                    true,
                    "file in memory (tmpfs), O_DIRECT: served by io_uring's workers".into()
                )
            );
            assert!(weighed(&d));
        }
        Err(e) => eprintln!("skipped: O_DIRECT on tmpfs: {e}"),
    }
}

#[test]
fn an_asked_for_mode_is_kept_whatever_the_device_reports() {
    let mut devs = Devices::new();
    let ram = devs.ram("ram0", 2048);
    assert_eq!(
        Dispatch::Queued.choose(&*ram),
        (Dispatch::Queued, "asked for".into())
    );
    let slow = NullDevice::new("slow", 1 << 20, Some(Duration::from_micros(50))).unwrap();
    assert_eq!(Dispatch::Direct.choose(&slow).0, Dispatch::Direct);
}

#[test]
fn a_mapped_device_gains_if_any_device_it_maps_to_does_and_names_it() {
    let on_disk = Scratch::new(&disk_dir(), "mapped");
    let mut devs = Devices::new();
    devs.ram("ram0", 2048);
    devs.add(file("disk0", &on_disk.0, false));

    let over_ram = as_dev(&devs.mapped("m0", "0 2048 linear ram0 0"));
    assert_eq!(
        report(&*over_ram),
        (
            false,
            "maps to ram0: RAM: a request costs only its copy".into()
        )
    );
    assert!(!weighed(&*over_ram));

    let mixed = as_dev(&devs.mapped("m1", "0 2048 linear ram0 0\n2048 2048 linear disk0 0"));
    assert_eq!(
        report(&*mixed),
        (true, "maps to disk0: file on a disk, O_DIRECT".into())
    );
    assert!(weighed(&*mixed));

    // Stacked: a device over m1 gains through it.
    devs.add(mixed);
    let top = as_dev(&devs.mapped("top", "0 4096 linear m1 0"));
    assert_eq!(
        report(&*top),
        (
            true,
            "maps to m1: maps to disk0: file on a disk, O_DIRECT".into()
        )
    );

    let zero = as_dev(&devs.mapped("z", "0 2048 zero"));
    assert_eq!(report(&*zero), (false, "maps to no device".into()));
}
