//! One binary that runs anywhere: librbd and librados are loaded when the
//! first `rbd:` device is opened, so where they cannot be loaded, an rbd
//! spec fails with one line naming the library and its package (exit 2)
//! and everything else works.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

/// What `udm ARGS` prints and returns with the real librbd.so.1 replaced by
/// an unreadable file, in a mount namespace of its own (needs root and
/// librbd installed, as the suite's setup makes sure; skipped otherwise).
fn without_librbd(args: &str) -> Option<(i32, String, String)> {
    let lib = PathBuf::from("/usr/lib/x86_64-linux-gnu/librbd.so.1");
    let Ok(real) = std::fs::canonicalize(&lib) else {
        eprintln!("skipped: {} is not installed", lib.display());
        return None;
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root for unshare -m");
        return None;
    }
    let udm = env!("CARGO_BIN_EXE_udm");
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg(format!(
            "mount --bind /dev/null '{}' && exec '{udm}' {args}",
            real.display()
        ))
        .output()
        .unwrap();
    Some((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn the_binary_links_neither_librbd_nor_librados() {
    let out = Command::new("readelf")
        .args(["-d", env!("CARGO_BIN_EXE_udm")])
        .output()
        .unwrap();
    assert!(out.status.success());
    let dynamic = String::from_utf8_lossy(&out.stdout);
    assert!(
        !dynamic.contains("librbd") && !dynamic.contains("librados"),
        "udm links Ceph's libraries:\n{dynamic}"
    );
}

#[test]
fn an_rbd_spec_without_librbd_fails_with_one_line_naming_it() {
    let Some((code, _, err)) = without_librbd("bench --dev r=rbd:rbd/x --target r --runtime 1")
    else {
        return;
    };
    assert_eq!(code, 2, "stderr: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("librbd.so.1") && err.contains("librbd1 package"),
        "names the library and its package: {err}"
    );
}

#[test]
fn everything_else_runs_without_librbd() {
    let Some((code, out, err)) = without_librbd(
        "bench --dev r=ram:64M --dev 'l=0 131072 linear r 0' --target l --runtime 1",
    ) else {
        return;
    };
    assert_eq!(code, 0, "stderr: {err}");
    assert!(
        out.contains("IOPS") || out.contains("iops"),
        "a report: {out}"
    );
}
