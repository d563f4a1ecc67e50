//! udm restarted under a running Linux guest (the test guest of
//! `scripts/guest/`, QEMU/TCG), and the guest rebooted, on one udm
//! vhost-user-blk export over udm's linear over a file.
//!
//! QEMU reconnects to the socket (`reconnect-ms`) and keeps the inflight
//! area udm made (INFLIGHT_SHMFD): udm is SIGKILLed twice while fio
//! writes in the guest, each time once its counters show fio's writes
//! going through it and requests in flight (half of them parked in a
//! delay target), started again on the same socket and file, and
//! resubmits what was in flight; fio ends with no error and no mismatch,
//! and the guest's kernel logged no I/O error.
//! Then the guest reboots (a machine reset: the device is reset, QEMU
//! drops the inflight area and asks for a new one) and, on its second
//! boot, reads back what the first wrote and writes and verifies again.
//! Last, the device grows (`udm reload` with a longer table): the guest
//! is told (a config-change message), sees the new size in
//! `/sys/block/vda/size` and writes and verifies past the old end; a
//! reload that shrinks it is refused.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::guest::Guest;
use common::{Serve, TempDir};
use serde_json::Value;

/// The disk: the file, with writes to its second half delayed by 10 ms,
/// so that requests complete out of the order the guest queued them in,
/// as on a real disk (a ring restarted at its used index would then lose
/// some and redo others), and so that while fio writes (its region spans
/// both halves), requests are parked in udm for a kill to leave in flight.
const TABLE: &str = "0 131072 linear f 0; 131072 131072 delay f 131072 0 f 131072 10";

const GUEST_SCRIPT: &str = r#"
FIO="fio --name=restart --filename=/dev/vda --direct=1 --ioengine=libaio --iodepth=16
     --rw=randwrite --bs=4k --offset=48m --size=32m --randseed=24 --verify=crc32c --verify_fatal=1"
io_errors() {
    if dmesg | grep -iE 'i/o error|blk_update_request|critical.*error'; then
        echo "GUEST_IO_ERRORS"
        exit 1
    fi
}
if [ "$(dd if=/dev/vda bs=512 skip=250000 count=1 2>/dev/null | head -c 10)" = udm-boot-1 ]; then
    echo "SECOND_BOOT vda: $(cat /sys/block/vda/size) sectors"
    $FIO --verify_only | grep -E 'err=|READ:'
    fio --name=again --filename=/dev/vda --direct=1 --ioengine=libaio --iodepth=16 \
        --rw=randwrite --bs=4k --offset=100m --size=16m --verify=crc32c --verify_fatal=1 \
        | grep -E 'err=|WRITE:|READ:'
    io_errors
    echo "SECOND_BOOT_OK"
    echo "RESIZE_READY"
    i=0
    while [ "$(cat /sys/block/vda/size)" = 262144 ]; do
        i=$((i + 1))
        [ $i -lt 60 ] || { echo "NO_RESIZE"; exit 1; }
        sleep 1
    done
    echo "RESIZED vda: $(cat /sys/block/vda/size) sectors"
    fio --name=grown --filename=/dev/vda --direct=1 --ioengine=libaio --iodepth=16 \
        --rw=randwrite --bs=4k --offset=128m --size=32m --verify=crc32c --verify_fatal=1 \
        | grep -E 'err=|WRITE:|READ:'
    io_errors
    echo "RESIZE_OK"
    exit 0
fi
echo "FIO_RUNNING"
$FIO | grep -E 'err=|WRITE:|READ:'
io_errors
echo "FIRST_BOOT_OK"
printf udm-boot-1 | dd of=/dev/vda bs=512 seek=250000 conv=fsync 2>/dev/null
reboot -f
"#;

/// Writes on `lin` that the udm behind `srv` must have completed before
/// it is killed: fio is in its write phase (8192 writes), and the guest
/// has resumed after a previous kill.
const WRITES_BEFORE_KILL: u64 = 1000;

/// Waits until the udm behind `srv` has completed WRITES_BEFORE_KILL
/// writes on `lin` and has requests in flight (`udm stats`), then SIGKILLs
/// it at once; returns what it saw, for the log.
fn kill_with_requests_in_flight(srv: &mut Serve) -> String {
    let ctl = srv.ctl();
    let t0 = Instant::now();
    loop {
        let (rc, out, err) =
            common::udm(&["stats", "--control", ctl.to_str().unwrap(), "lin", "--json"]);
        assert_eq!(rc, 0, "udm stats: {err}\n{}", srv.log());
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        let (writes, in_flight) = (
            v["writes"].as_u64().unwrap(),
            v["in_flight"].as_u64().unwrap(),
        );
        if writes >= WRITES_BEFORE_KILL && in_flight > 0 {
            let mut c = srv.child.take().unwrap();
            c.kill().unwrap();
            c.wait().unwrap();
            return format!("killed after {writes} writes with {in_flight} in flight");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "fio's writes never went through udm with requests in flight: {v}\n{}",
            srv.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn udm_restarted_under_fio_loses_nothing_the_disk_survives_a_guest_reboot_and_a_grow_is_seen() {
    let dir = TempDir::new("vhost-restart");
    let img = dir.path("disk.img");
    let sock = dir.path("vda.vhost");
    let console = dir.path("console.log");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    let file_dev = format!("f=file:{}", img.display());
    let lin = format!("lin={TABLE}");
    let args = [
        "--dev",
        &file_dev,
        "--dev",
        "r=ram:32M",
        "--dev",
        &lin,
        "--vhost-user-blk",
        sock.to_str().unwrap(),
        "--queues",
        "2",
    ];
    let mut srv = Serve::start_as_given(&args);
    let mut guest = Guest::new(&dir, GUEST_SCRIPT)
        .mem("512M")
        .console_log(&console)
        .reboot()
        .timeout(200)
        .qemu_args(format!(
            "-chardev socket,id=c0,path={},reconnect-ms=200 \
             -device vhost-user-blk-pci,chardev=c0,num-queues=2",
            sock.display()
        ))
        .spawn();
    let mut logs = String::new();
    let running = guest.wait_console("FIO_RUNNING");
    if running {
        for _ in 0..2 {
            let how = kill_with_requests_in_flight(&mut srv);
            logs += &format!("--- udm ({how}):\n{}", srv.log());
            std::thread::sleep(Duration::from_millis(500));
            srv = Serve::start_as_given(&args);
        }
    }
    // Grown by 32 MiB of RAM while the guest runs.
    let resized = running && guest.wait_console("RESIZE_READY");
    if resized {
        let ctl = srv.ctl();
        let reload = |table: &str| {
            common::udm(&["reload", "--control", ctl.to_str().unwrap(), "lin", table])
        };
        let (rc, out, err) = reload(&format!("{TABLE}; 262144 65536 linear r 0"));
        assert_eq!(rc, 0, "udm reload: {out}{err}");
        // A shrink is refused, with the reason.
        let (rc, _, err) = reload(TABLE);
        assert!(rc != 0 && err.contains("may grow, not shrink"), "{err}");
    }
    let (ok, text) = guest.wait();
    logs += &format!("--- udm:\n{}", srv.log());
    assert!(running, "the guest never started fio:\n{text}\n{logs}");
    assert!(ok, "the guest's test failed:\n{text}\n{logs}");
    assert!(text.contains("FIRST_BOOT_OK"), "{text}");
    assert!(text.contains("SECOND_BOOT_OK"), "{text}");
    assert!(
        resized,
        "the guest never got to the resize:\n{text}\n{logs}"
    );
    assert!(text.contains("RESIZED vda: 327680 sectors"), "{text}");
    assert!(text.contains("RESIZE_OK"), "{text}");
    assert!(logs.contains("config-change notification sent"), "{logs}");
    assert!(!text.contains("GUEST_IO_ERRORS"), "{text}");
    // Each udm served QEMU, and each was killed with requests in flight
    // (by its counters): a later udm took them again.
    assert_eq!(logs.matches("frontend connected").count(), 3, "{logs}");
    assert!(logs.contains("resubmitting"), "{logs}");
}
