//! What the scripts make once and keep (`scripts/once.sh`: benchmark
//! images, and the like) tolerates company: a making killed halfway
//! leaves nothing that passes for the result and is made again by the
//! next run, several runs started at once on nothing make it once, and a
//! making that fails leaves nothing.

#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::TempDir;

/// `once DEST sh -c MAKE` in a shell of its own process group.
fn once(dest: &Path, make: &str) -> Command {
    let lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/once.sh");
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(r#"set -euo pipefail; . "$1"; once "$2" sh -c "$3""#)
        .arg("once")
        .arg(lib)
        .arg(dest)
        .arg(make)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // So that a kill takes the making (sh, sleep) too, as a killed
        // run's would be.
        .process_group(0);
    cmd
}

fn wait(child: Child) -> (bool, String) {
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Names in `dir` other than `keep`.
fn others(dir: &Path, keep: &[&str]) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect()
}

#[test]
fn a_killed_making_is_made_again_and_three_at_once_make_it_once() {
    let dir = TempDir::new("once");
    let dest = dir.path("img");
    let count = dir.path("count");
    // Half of it, then a wait for the kill.
    let half = format!(
        "printf half > \"$OUT\"; touch {}; sleep 60",
        dir.path("started").display()
    );
    let child = once(&dest, &half).spawn().unwrap();
    let t0 = Instant::now();
    while !dir.path("started").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the making never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on the process group the test made.
    let rc = unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    assert_eq!(rc, 0);
    let _ = wait(child);
    assert!(!dest.exists(), "a killed making left its result in place");

    // Three at once on what it left: all succeed, one makes it, whole.
    let make = format!(
        "echo made >> {}; sleep 1; printf whole > \"$OUT\"",
        count.display()
    );
    let kids: Vec<Child> = (0..3)
        .map(|_| once(&dest, &make).spawn().unwrap())
        .collect();
    for (i, (ok, text)) in kids.into_iter().map(wait).enumerate() {
        assert!(ok, "run {i} failed:\n{text}");
    }
    assert_eq!(std::fs::read_to_string(&count).unwrap(), "made\n");
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), "whole");
    assert_eq!(
        others(&dir.path(""), &["img", "img.lock", "count", "started"]),
        Vec::<String>::new(),
        "the killed making's part is removed"
    );

    // Made: the next run does nothing.
    let (ok, text) = wait(once(&dest, "exit 1").spawn().unwrap());
    assert!(ok, "{text}");
}

#[test]
fn a_making_that_fails_leaves_nothing_and_fails() {
    let dir = TempDir::new("once-fails");
    let dest = dir.path("img");
    let (ok, _) = wait(
        once(&dest, "printf part > \"$OUT\"; exit 3")
            .spawn()
            .unwrap(),
    );
    assert!(!ok, "a failed making succeeded");
    assert!(!dest.exists());
    let (ok, text) = wait(once(&dest, "true").spawn().unwrap());
    assert!(!ok && text.contains("made no"), "{text}");
    assert_eq!(others(&dir.path(""), &["img.lock"]), Vec::<String>::new());
}
