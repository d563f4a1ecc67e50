//! Direct, queued and stream dispatch (seed 004) through real NBD clients:
//! data written through a queued or streaming front reads back (fio's
//! crc32c verify, nbdcopy round trip), a sequential stream reaches the
//! device as fewer, merged bios, `auto` picks per device from its report, and `udm info` and the
//! config file say which mode each export uses and why.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use common::daemon::Daemon;
use common::{random_file, run, udm, Serve, TempDir};

fn fio(uri: &str, rw: &str, bs: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "--name=v".to_string(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        format!("--rw={rw}"),
        format!("--bs={bs}"),
        "--iodepth=32".into(),
        "--size=8M".into(),
        "--verify=crc32c".into(),
        "--do_verify=1".into(),
        "--verify_fatal=1".into(),
        "--verify_state_save=0".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("fio", &a);
    assert!(out.contains("err= 0"), "fio reported errors:\n{out}");
    out
}

/// `udm stats NAME`'s `Writes:` count on a `udm serve`.
fn writes(s: &Serve, dev: &str) -> u64 {
    let ctl = s.ctl();
    let (code, text, err) = udm(&["stats", dev, "--control", ctl.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    text.lines()
        .find_map(|l| l.strip_prefix("Writes:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no Writes line: {text}"))
}

#[test]
fn fio_verifies_data_written_and_read_through_queued_and_stream_dispatch() {
    for mode in ["queued", "stream"] {
        verify_through(mode);
    }
}

fn verify_through(mode: &str) {
    let dir = TempDir::new(mode);
    let f = dir.path("img");
    let file = format!("d=file:{},size=32M", f.display());
    let s = Serve::start(&[
        "--dev",
        "r=ram:32M",
        "--dev",
        "t=0 32768 linear r 8192",
        "--dev",
        &file,
        "--export",
        "t",
        "--export",
        "d",
        "--dispatch",
        mode,
    ]);
    for export in ["t", "d"] {
        let uri = s.uri(export);
        fio(&uri, "write", "4k", &[]);
        fio(&uri, "randwrite", "4k", &["--offset=8M"]);
        fio(&uri, "readwrite", "8k", &["--offset=4M", "--size=4M"]);
        // Mixed sizes, so merged bios hold segments of different lengths.
        fio(
            &uri,
            "randwrite",
            "4k",
            &["--bsrange=4k-64k", "--offset=2M", "--size=2M"],
        );
    }
    assert!(!s.log().contains("refused command"), "{}", s.log());
}

#[test]
fn nbdcopy_round_trips_an_image_through_queued_dispatch() {
    let dir = TempDir::new("queued-copy");
    let src = dir.path("src");
    random_file(&src, 8 << 20, 4);
    let s = Serve::start(&["--dev", "t=ram:8M", "--dispatch", "queued"]);
    let uri = s.uri("t");
    run("nbdcopy", &[src.to_str().unwrap(), &uri]);
    let back = dir.path("back");
    run("nbdcopy", &[&uri, back.to_str().unwrap()]);
    assert!(
        std::fs::read(&src).unwrap() == std::fs::read(&back).unwrap(),
        "the image read back differs"
    );
}

#[test]
fn queued_and_stream_dispatch_merge_a_sequential_stream_into_fewer_bios_and_direct_does_not() {
    for (mode, merged) in [("queued", true), ("stream", true), ("direct", false)] {
        let s = Serve::start(&[
            "--dev",
            "r=ram:16M",
            "--dev",
            "lin=0 32768 linear r 0",
            "--dispatch",
            mode,
        ]);
        run(
            "fio",
            &[
                "--name=seq",
                "--ioengine=nbd",
                &format!("--uri={}", s.uri("lin")),
                "--rw=write",
                "--bs=4k",
                "--iodepth=32",
                "--iodepth_batch_submit=32",
                "--size=8M",
            ],
        );
        let n = writes(&s, "lin");
        eprintln!("{mode}: {n} bios for 2048 requests");
        if merged {
            assert!(
                n < 2048,
                "{mode}: 2048 writes of 4 KiB reached lin as {n} bios"
            );
        } else {
            assert_eq!(n, 2048, "{mode}");
        }
    }
}

#[test]
fn auto_picks_each_exports_mode_from_its_devices_report() {
    let dir = TempDir::new("auto");
    let f = dir.path("img");
    let file = format!("d=file:{},size=4M", f.display());
    let s = Serve::start(&[
        "--dev",
        "r=ram:4M",
        "--dev",
        &file,
        "--dev",
        "slow=null:4M,delay=100",
        "--export",
        "r",
        "--export",
        "d",
        "--export",
        "slow",
    ]);
    let out = s.out();
    let line = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("udm: serving '{name}'")))
            .unwrap_or_else(|| panic!("no line for {name}: {out}"))
            .to_string()
    };
    assert!(
        line("r").contains(
            "dispatch auto (auto: merging does not help (RAM: a request costs only its copy); back-to-back requests merge while others are in flight, the rest go direct)"
        ),
        "{out}"
    );
    assert!(
        line("d").contains("dispatch auto (auto: merging helps (file on a disk, O_DIRECT); queued, or direct where it measures faster)"),
        "{out}"
    );
    assert!(
        line("slow").contains("dispatch auto (auto: merging helps (null with a delay"),
        "{out}"
    );
    let ctl = s.ctl();
    let (code, info, err) = udm(&["info", "d", "--control", ctl.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        info.contains("Merging helps:     yes (file on a disk, O_DIRECT)\n"),
        "{info}"
    );
}

#[test]
fn a_bad_dispatch_is_refused_by_name() {
    let (code, _, err) = udm(&["serve", "--dispatch", "fast"]);
    assert_eq!(code, 2);
    assert!(err.contains("'fast'") && err.contains("queued"), "{err}");
}

#[test]
fn export_add_takes_a_dispatch_and_info_and_dump_config_show_it() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "r", "ram:4M"]);
    d.ok(&["create", "lin", "--table", "0 8192 linear r 0"]);
    let a = d.dir.path("a.sock");
    let b = d.dir.path("b.sock");
    d.ok(&[
        "export",
        "add",
        "lin",
        "--nbd",
        &format!("unix:{}", a.display()),
        "--dispatch",
        "queued",
    ]);
    d.ok(&[
        "export",
        "add",
        "r",
        "--nbd",
        &format!("unix:{}", b.display()),
    ]);
    let info = d.ok(&["info", "lin"]);
    assert!(
        info.contains("Merging helps:     no (maps to r: RAM: a request costs only its copy)\n"),
        "{info}"
    );
    assert!(
        info.contains("Export dispatch:   lin (nbd): queued (asked for)"),
        "{info}"
    );
    let info = d.ok(&["info", "r"]);
    assert!(
        info.contains("Export dispatch:   r (nbd): auto (auto: merging does not help (RAM: a request costs only its copy); back-to-back requests merge while others are in flight, the rest go direct)"),
        "{info}"
    );
    // The data goes through either way.
    fio(
        &format!("nbd+unix:///lin?socket={}", a.display()),
        "randwrite",
        "4k",
        &["--size=2M"],
    );
    // dump-config keeps what was asked (and only that: auto stays unsaid).
    let dump = d.ok(&["dump-config"]);
    assert_eq!(dump.matches("dispatch = \"queued\"").count(), 1, "{dump}");
    assert!(!dump.contains("dispatch = \"auto\""), "{dump}");
    let bad = d.fails(&[
        "export",
        "add",
        "r",
        "--nbd",
        "unix:/tmp/x.sock",
        "--dispatch",
        "fast",
    ]);
    assert!(bad.contains("'fast'"), "{bad}");
}

#[test]
fn a_config_file_export_takes_a_dispatch_and_a_bad_one_names_it() {
    let dir = TempDir::new("dispatch-config");
    let cfg = dir.path("udm.toml");
    let sock = dir.path("a.sock");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"a\"\nspec = \"ram:1M\"\n\n\
             [[export]]\ndevice = \"a\"\nnbd = \"unix:{}\"\ndispatch = \"queued\"\n",
            sock.display()
        ),
    )
    .unwrap();
    let d = Daemon::start_in(dir, &["--config", cfg.to_str().unwrap()]);
    assert!(
        d.ok(&["info", "a"])
            .contains("Export dispatch:   a (nbd): queued (asked for)"),
        "{}",
        d.log()
    );
    drop(d);
    let dir = TempDir::new("dispatch-config-bad");
    let cfg = dir.path("udm.toml");
    std::fs::write(
        &cfg,
        "[[device]]\nname = \"a\"\nspec = \"ram:1M\"\n\n\
         [[export]]\ndevice = \"a\"\nnbd = \"unix:/tmp/never.sock\"\ndispatch = \"sorted\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["daemon", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("dispatch 'sorted': expected auto, direct, queued or stream"),
        "{err}"
    );
}

/// vhost-user-blk exports take a dispatch as NBD's do: queued when asked,
/// and `auto` from the device's report; `udm info` says which and why.
/// (ublk's, which needs a kernel with ublk, is tested in the guest:
/// scripts/guest/scenarios/ublk.sh.)
#[test]
fn vhost_exports_take_queued_dispatch_and_auto_follows_the_device() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "r", "ram:4M"]);
    d.ok(&["create", "slow", "null:4M,delay=100"]);
    let a = d.dir.path("r.vhost");
    let b = d.dir.path("slow.vhost");
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    d.ok(&[
        "export",
        "add",
        "r",
        "--vhost-user-blk",
        a,
        "--dispatch",
        "queued",
    ]);
    d.ok(&["export", "add", "slow", "--vhost-user-blk", b]);
    let info = d.ok(&["info", "r"]);
    assert!(
        info.contains("Export dispatch:   r (vhost-user-blk): queued (asked for)"),
        "{info}"
    );
    let info = d.ok(&["info", "slow"]);
    assert!(
        info.contains("Export dispatch:   slow (vhost-user-blk): auto (auto: merging helps (null with a delay"),
        "{info}"
    );
}

/// The number before `what` in `text` (`… 12 epochs queued …`).
fn count_before(text: &str, what: &str) -> u64 {
    let i = text
        .find(what)
        .unwrap_or_else(|| panic!("no '{what}' in {text}"));
    text[..i]
        .split_whitespace()
        .last()
        .and_then(|n| n.trim_start_matches('(').parse().ok())
        .unwrap_or_else(|| panic!("no count before '{what}' in {text}"))
}

/// `udm info DEV`'s `Export dispatch:` line.
fn dispatch_line(d: &Daemon, dev: &str) -> String {
    let info = d.ok(&["info", dev]);
    info.lines()
        .find(|l| l.starts_with("Export dispatch:"))
        .unwrap_or_else(|| panic!("{info}"))
        .to_string()
}

/// The epochs a trial line says were run, queued and direct.
fn epochs_ran(line: &str) -> u64 {
    count_before(line, "epochs queued") + count_before(line, "direct)")
}

/// `udm info` says what auto's trial of queued against direct runs now,
/// on how many of the export's connections, and the epochs it ran each
/// way; `export ls --json` carries the same line; a connection that closed
/// no longer counts, its epochs do.
#[test]
fn info_shows_what_auto_dispatch_trial_runs_and_ran() {
    let d = Daemon::start(&[]);
    // A null device with a delay reports that merging helps it: auto
    // weighs queued against direct there.
    d.ok(&["create", "slow", "null:64M,delay=20"]);
    let sock = d.dir.path("slow.sock");
    d.ok(&[
        "export",
        "add",
        "slow",
        "--nbd",
        &format!("unix:{}", sock.display()),
    ]);
    let info = d.ok(&["info", "slow"]);
    assert!(
        info.contains(
            "Export dispatch:   slow (nbd): auto (auto: merging helps (null with a delay"
        ) && !info.contains("trial:"),
        "before any connection, no trial: {info}"
    );
    let mut fio = std::process::Command::new("fio")
        .args([
            "--name=t",
            "--ioengine=nbd",
            &format!("--uri=nbd+unix:///slow?socket={}", sock.display()),
            "--rw=randread",
            "--bs=4k",
            "--iodepth=32",
            "--time_based",
            "--runtime=4",
            "--size=64M",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("fio");
    // Epochs are 8 ms: after 2 s the trial has run many, and fio has 2 s left.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let line = dispatch_line(&d, "slow");
    assert!(
        line.contains("; trial: queued on 1 of 1 connections (")
            || line.contains("; trial: direct on 1 of 1 connections ("),
        "{line}"
    );
    let ran = epochs_ran(&line);
    assert!(ran >= 10, "{line}");
    let ls = d.ok(&["export", "ls", "--json"]);
    assert!(ls.contains("trial: "), "{ls}");
    assert!(fio.wait().unwrap().success());
    let line = dispatch_line(&d, "slow");
    assert!(line.contains("; trial: no connections now ("), "{line}");
    assert!(epochs_ran(&line) >= ran, "{line}");
}
