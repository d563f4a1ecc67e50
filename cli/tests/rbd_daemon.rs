//! The rbd backend in a real `udm daemon` against a real one-node Ceph
//! cluster: created from the command line, stacked under linear, exported
//! over NBD and verified by fio; `udm info` shows the image; `udm message
//! DEV 0 resize` picks up an `rbd resize`; create-time errors are one line;
//! and with the OSD stopped, I/O through the export fails with EIO after
//! the timeout while the daemon answers and its other devices keep working.
//! Skipped, saying so, only when the ceph binaries are missing.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

#[path = "../../mapper/tests/rbd/cluster.rs"]
#[allow(dead_code)]
mod cluster;
mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::Daemon;

fn fio(uri: &str, args: &[&str]) -> Command {
    let mut c = Command::new("fio");
    c.args([
        "--name=v",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--bs=4k",
        "--verify_state_save=0",
    ])
    .args(args)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

#[test]
fn rbd_in_the_daemon_exported_verified_resized_and_failing_cleanly() {
    if !cluster::available() {
        eprintln!("SKIPPED: ceph binaries missing (scripts/setup.sh installs ceph-mon ceph-osd ceph-common)");
        return;
    }
    let c = cluster::start(5);
    let img = c.image(32 << 20);
    let mut d = Daemon::start(&[]);
    d.ok(&[
        "create",
        "r",
        &format!("rbd:{}", c.spec(&img, ",timeout=3")),
    ]);
    d.ok(&["create", "m", "ram:16M"]);
    d.ok(&["create", "lin", "--table", "0 65536 linear r 0"]);
    let info = d.ok(&["info", "r"]);
    assert!(
        info.contains(&format!(
            "Backend:           rbd rbd/{img} size 33554432 object size 4194304"
        )),
        "{info}"
    );
    assert!(info.contains("merge"), "{info}");
    assert!(d.ok(&["info", "lin"]).contains("merge"));

    // fio --verify through NBD over linear over rbd.
    let sock = d.dir.path("lin.sock");
    d.ok(&[
        "export",
        "add",
        "lin",
        "--nbd",
        &format!("unix:{}", sock.display()),
    ]);
    let uri = format!("nbd+unix:///lin?socket={}", sock.display());
    let out = fio(
        &uri,
        &[
            "--rw=randwrite",
            "--iodepth=16",
            "--size=8M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "fio verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Resize.
    c.rbd(&["resize", "--size", "64M", &format!("rbd/{img}")]);
    assert_eq!(d.ok(&["message", "r", "0", "resize"]).trim(), "131072");
    assert!(d.ok(&["info", "r"]).contains("Sectors:           131072"));

    // Create-time errors: one line naming the cause.
    let e = d.fails(&["create", "bad", &format!("rbd:{}", c.spec("nosuch", ""))]);
    assert!(e.contains("image 'rbd/nosuch' does not exist"), "{e}");

    // The OSD goes: I/O through the export fails (EIO after the 3 s
    // timeout); the daemon answers meanwhile and the ram device works.
    let msock = d.dir.path("m.sock");
    d.ok(&[
        "export",
        "add",
        "m",
        "--nbd",
        &format!("unix:{}", msock.display()),
    ]);
    let muri = format!("nbd+unix:///m?socket={}", msock.display());
    c.stop_osd();
    let t0 = Instant::now();
    let failing = fio(
        &uri,
        &["--rw=write", "--size=64k", "--offset=16M", "--fsync=1"],
    )
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t1 = Instant::now();
    assert!(d.ok(&["ls"]).contains("lin"));
    let out = fio(
        &muri,
        &[
            "--rw=randwrite",
            "--size=1M",
            "--verify=crc32c",
            "--do_verify=1",
        ],
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "ram export under a dead OSD");
    assert!(
        t1.elapsed() < Duration::from_secs(3),
        "other devices stalled: {:?}",
        t1.elapsed()
    );
    let out = failing.wait_with_output().unwrap();
    let t = t0.elapsed();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success(),
        "fio succeeded with the OSD down: {text}"
    );
    assert!(text.contains("Input/output error"), "{text}");
    assert!(t < Duration::from_secs(20), "{t:?}");
    eprintln!("rbd: fio through NBD failed with EIO {t:?} after the OSD stopped");
    assert!(d.alive(), "the daemon died");
    assert!(d.ok(&["info", "m"]).contains("ACTIVE"));
    d.ok(&["export", "remove", "m"]);
    drop(d);
    let _ = Command::new(format!(
        "{}/../scripts/ceph-cluster.sh",
        env!("CARGO_MANIFEST_DIR")
    ))
    .args(["stop", &c.dir])
    .status();
}
