//! `udm export add --ublk`: on this host (whose kernel may lack ublk) the
//! errors a user meets before any device exists; in the test guest
//! (`scripts/guest.sh ublk`, QEMU/TCG with the Debian 6.12 kernel) the
//! block device itself, with fio and a filesystem on it.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::daemon::Daemon;

#[test]
fn on_a_kernel_without_ublk_export_add_says_so_in_one_line_and_exits_2() {
    if Path::new("/dev/ublk-control").exists() {
        eprintln!("skipped: this kernel has ublk (the guest test covers it)");
        return;
    }
    let d = Daemon::start(&[]);
    d.ok(&["create", "r", "ram:16M"]);
    let (code, _, err) = d.udm(&["export", "add", "r", "--ublk"]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("ublk not available in this kernel"), "{err}");
    // Nothing was left behind: no export, and the device is free again.
    assert_eq!(d.ok(&["export", "ls"]), "");
    d.ok(&["remove", "r"]);
}

#[test]
fn on_a_kernel_without_ublk_serve_says_so_in_one_line_and_exits_2() {
    if Path::new("/dev/ublk-control").exists() {
        eprintln!("skipped: this kernel has ublk (the guest test covers it)");
        return;
    }
    let dir = common::TempDir::new("serve-ublk");
    let ctl = dir.path("ctl");
    let (code, _, err) = common::udm(&[
        "serve",
        "--dev",
        "r=ram:16M",
        "--ublk",
        "--control",
        ctl.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("ublk not available in this kernel"), "{err}");
    // The control socket bound before the failure is gone.
    assert!(!ctl.exists());
}

#[test]
fn bad_ublk_options_are_refused_naming_the_option() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "r", "ram:16M"]);
    let cpus = std::thread::available_parallelism().unwrap().get();
    let many = (cpus + 1).to_string();
    for (args, want) in [
        (&["--queues", many.as_str()][..], "--queues"),
        (&["--queues", "0"][..], "--queues 0"),
        (&["--depth", "0"][..], "--depth 0"),
        (&["--depth", "4097"][..], "--depth 4097"),
        (&["--recover"][..], "--recover needs --id"),
        (
            &["--recover", "--id", "0", "--unprivileged"][..],
            "--recover: an unprivileged ublk device has no crash recovery",
        ),
    ] {
        let mut a = vec!["export", "add", "r", "--ublk"];
        a.extend_from_slice(args);
        let err = d.fails(&a);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // Only ublk devices have an owner to choose.
    let s = d.dir.path("v.sock");
    let err = d.fails(&[
        "export",
        "add",
        "r",
        "--vhost-user-blk",
        s.to_str().unwrap(),
        "--unprivileged",
    ]);
    assert!(err.contains("takes no --unprivileged"), "{err}");
    let err = d.fails(&["export", "add", "nope", "--ublk"]);
    assert!(err.contains("unknown device 'nope'"), "{err}");
    assert_eq!(d.ok(&["export", "ls"]), "");
}

/// The short guest scenarios, in one boot: `ublk` (fio --verify through
/// /dev/ublkb0 over linear and striped RAM devices, ext4 on it with a copy
/// and fsck, discard, removal refused while the device is open) and
/// `recovery` (udm killed with SIGKILL under fio and under a mounted
/// filesystem, restarted with --recover: fio verifies every block, fsck
/// passes, synced data survives). Every check prints a `RESULT` line; the
/// script exits 0 only when all passed.
#[test]
fn in_the_guest_ublk_serves_fio_ext4_and_discard_and_recovers_from_sigkill() {
    let text = common::guest::run_scenarios(
        &["ublk", "recovery"],
        &[
            "ublk_fio_linear",
            "ublk_fsck",
            "ublk_queued_merges",
            "ublk_stream_merges",
            "ublk_stream_fio_verify",
            "recover_fio_verified_after_kill",
        ],
    );
    assert!(!text.contains("=FAIL"), "{text}");
}
