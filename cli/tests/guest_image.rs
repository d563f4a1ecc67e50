//! The guest image's cache (`scripts/guest/build.sh`) tolerates company: a
//! build killed halfway leaves nothing that passes for an image, and
//! several builds started at once on an empty cache make one good image.

#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::TempDir;

fn build(cache: &Path) -> Command {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/guest/build.sh");
    let mut cmd = Command::new(script);
    cmd.env("GUEST_DIR", cache)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a kill takes its children (apt-get,
        // dpkg, gzip) too, as a killed test run's would be.
        .process_group(0);
    cmd
}

fn wait(child: Child) -> (bool, String) {
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_killed_build_is_rebuilt_and_three_builds_at_once_make_one_image() {
    let dir = TempDir::new("guest-image");
    let cache = dir.path("cache");

    // A build killed halfway: nothing passes for an image.
    let child = build(&cache).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(4));
    // SAFETY: kill(2) on the build's process group, which the test made.
    let rc = unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    assert_eq!(rc, 0);
    let _ = wait(child);
    assert!(
        !cache.join("base.version").exists(),
        "a build killed after 4 s left base.version behind"
    );

    // Three at once on what it left: all succeed, one image.
    let kids: Vec<Child> = (0..3).map(|_| build(&cache).spawn().unwrap()).collect();
    let outs: Vec<(bool, String)> = kids.into_iter().map(wait).collect();
    for (i, (ok, text)) in outs.iter().enumerate() {
        assert!(ok, "build {i} failed:\n{text}");
    }
    let built = outs
        .iter()
        .filter(|(_, t)| t.contains("initramfs, kernel"))
        .count();
    assert_eq!(built, 1, "one build makes the image, the others find it");
    for f in ["base.cpio.gz", "vmlinuz", "busybox", "base.version"] {
        assert!(cache.join(f).is_file(), "{f} missing");
    }
    let gz = Command::new("gzip")
        .arg("-t")
        .arg(cache.join("base.cpio.gz"))
        .status()
        .unwrap();
    assert!(gz.success(), "base.cpio.gz is not a whole gzip file");
    let leftovers: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("build."))
        .collect();
    assert!(
        leftovers.is_empty(),
        "build directories left: {leftovers:?}"
    );
}
