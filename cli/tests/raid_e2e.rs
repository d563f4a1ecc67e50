//! End to end: fio writing and verifying over NBD through a raid1 device
//! while one of its legs fails (reloaded to `error` mid-run; a `flakey`
//! leg going down), while a `dust` leg fails reads (read repair), and
//! while a new leg is rebuilt; then `check` and a byte comparison of the
//! legs (qemu-img compare over their own exports).

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{run, udm, KillOnDrop, Serve};

/// 64 MiB legs.
const LEN: u64 = 131072;

fn ctl(s: &Serve, cmd: &str, rest: &[&str]) -> String {
    let c = s.ctl();
    let mut a = vec![cmd, "--control", c.to_str().unwrap()];
    a.extend_from_slice(rest);
    let (code, out, err) = udm(&a);
    assert_eq!(code, 0, "udm {cmd} {rest:?}: {err}");
    out
}

fn status(s: &Serve) -> String {
    ctl(s, "status", &["r"])
}

fn wait_status(s: &Serve, what: &str) -> String {
    let t0 = Instant::now();
    loop {
        let st = status(s);
        if st.contains(what) {
            return st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "waiting for '{what}': {st}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// fio: random 4k writes with verification interleaved, then everything
/// read back and checked; rate-limited so that it runs about 2 s.
fn fio(s: &Serve, extra: &[&str]) -> KillOnDrop {
    let mut a = vec![
        "--name=v".to_string(),
        "--verify_state_save=0".into(),
        "--ioengine=nbd".into(),
        format!("--uri={}", s.uri("r")),
        "--rw=randwrite".into(),
        "--bs=4k".into(),
        "--iodepth=32".into(),
        "--size=32M".into(),
        "--rate_iops=4000".into(),
        "--verify=crc32c".into(),
        "--verify_backlog=256".into(),
        "--do_verify=1".into(),
        "--verify_fatal=1".into(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    let c = Command::new("fio")
        .args(&a)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio (installed by scripts/setup.sh)");
    KillOnDrop(Some(c))
}

fn fio_ok(f: KillOnDrop) {
    let out = f.wait_with_output();
    assert!(out.contains("err= 0"), "fio failed:\n{out}");
    assert!(!out.contains("verify: bad"), "fio found mismatches:\n{out}");
}

fn raid(params: &str, legs: &str) -> String {
    let n = params.split_whitespace().count() + 1;
    format!("r=0 {LEN} raid raid1 {n} 0 {params} 2 {legs}")
}

#[test]
fn a_leg_reloaded_to_error_mid_run_costs_fio_nothing_then_a_rebuild_under_load_matches() {
    let table = raid("nosync region_size 2048", "m0 d0 m1 l1");
    let s = Serve::start(&[
        "--dev",
        "m0=ram:1M",
        "--dev",
        "d0=ram:64M",
        "--dev",
        "m1=ram:1M",
        "--dev",
        "d1=ram:64M",
        "--dev",
        &format!("l1=0 {LEN} linear d1 0"),
        "--dev",
        "m2=ram:1M",
        "--dev",
        "d2=ram:64M",
        "--dev",
        &table,
        "--export",
        "r",
        "--export",
        "d0",
        "--export",
        "d2",
    ]);
    assert!(status(&s).contains(" AA "), "{}", status(&s));
    let f = fio(&s, &[]);
    std::thread::sleep(Duration::from_millis(500));
    ctl(&s, "reload", &["l1", &format!("0 {LEN} error")]);
    fio_ok(f);
    let st = status(&s);
    assert!(st.contains(" AD "), "{st}");
    // The failure raised an event: `udm wait` from event 0 returns.
    ctl(&s, "wait", &["--timeout", "30", "r", "0"]);

    // Leg 1 replaced by empty devices and rebuilt while fio writes.
    let f = fio(&s, &["--offset=16M"]);
    std::thread::sleep(Duration::from_millis(300));
    let new = raid("rebuild 1 region_size 2048", "m0 d0 m2 d2");
    ctl(&s, "reload", &["r", new.trim_start_matches("r=")]);
    fio_ok(f);
    wait_status(&s, &format!(" AA {LEN}/{LEN} idle "));
    ctl(&s, "message", &["r", "0", "check"]);
    std::thread::sleep(Duration::from_millis(50));
    let st = wait_status(&s, &format!(" AA {LEN}/{LEN} idle "));
    assert!(st.contains(" idle 0 0 -"), "check found mismatches: {st}");
    let out = run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &s.uri("d0"),
            &s.uri("d2"),
        ],
    );
    assert!(out.contains("identical"), "{out}");
}

#[test]
fn a_flakey_leg_going_down_costs_fio_nothing() {
    let table = raid("nosync", "m0 d0 m1 l1");
    let s = Serve::start(&[
        "--dev",
        "m0=ram:1M",
        "--dev",
        "d0=ram:64M",
        "--dev",
        "m1=ram:1M",
        "--dev",
        "d1=ram:64M",
        "--dev",
        &format!("l1=0 {LEN} flakey d1 0 1 5"),
        "--dev",
        &table,
        "--export",
        "r",
    ]);
    fio_ok(fio(&s, &[]));
    let st = status(&s);
    assert!(st.contains(" AD "), "the flakey leg never failed: {st}");
}

#[test]
fn reads_of_bad_blocks_on_a_dust_leg_are_served_and_repaired() {
    let table = raid("nosync write_mostly 0", "m0 d0 m1 l1");
    let s = Serve::start(&[
        "--dev",
        "m0=ram:1M",
        "--dev",
        "d0=ram:64M",
        "--dev",
        "m1=ram:1M",
        "--dev",
        "d1=ram:64M",
        "--dev",
        &format!("l1=0 {LEN} dust d1 0 4096"),
        "--dev",
        &table,
        "--export",
        "r",
    ]);
    let job = ["--rw=write", "--bs=64k", "--size=16M", "--iodepth=8"];
    let w = fio(&s, &job);
    fio_ok(w);
    for b in [1, 2, 3, 100, 1000, 2047, 3000] {
        ctl(&s, "message", &["l1", "0", "addbadblock", &b.to_string()]);
    }
    ctl(&s, "message", &["l1", "0", "enable"]);
    // Leg 0 is write-mostly: reads go to the dust leg, and to leg 0 only
    // when it fails them.
    let mut j = job.to_vec();
    j.push("--verify_only");
    fio_ok(fio(&s, &j));
    let t0 = Instant::now();
    loop {
        let out = ctl(&s, "message", &["l1", "0", "countbadblocks"]);
        if out.contains(": 0 ") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not repaired: {out}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = status(&s);
    assert!(st.contains(" AA "), "a read error failed the leg: {st}");
}
