//! `udm daemon` driven as an administrator would: the dmsetup verbs from
//! the command line, exports added and removed live under fio, a restart
//! from `udm dump-config`, and a control socket under abuse.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use common::{run, TempDir};
use serde_json::Value;
use udm_control::{Client, Op};

#[test]
fn the_daemon_starts_empty_owns_its_socket_and_stops_clean() {
    let mut d = Daemon::start(&[]);
    let meta = std::fs::metadata(&d.ctl).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(
        std::fs::metadata(d.ctl.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    assert_eq!(d.ok(&["ls"]), "");
    // A second daemon on the same socket is refused.
    let (code, _, err) = d.udm(&["daemon"]);
    assert_eq!(code, 2);
    assert!(err.contains("another server is listening on it"), "{err}");
    assert_eq!(d.stop().code(), Some(0), "{}", d.log());
    assert!(!d.ctl.exists(), "the socket is removed at exit");
    // A verb without a daemon says so.
    let e = d.fails(&["ls"]);
    assert!(
        e.contains("control socket") && e.contains("udm daemon"),
        "{e}"
    );
}

/// Under systemd (Type=notify) the daemon says READY=1 once its config's
/// devices exist and its control socket accepts.
#[test]
fn readiness_is_notified_to_systemd() {
    let dir = TempDir::new("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(dir.path("notify")).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let cfg = dir.path("udm.toml");
    std::fs::write(&cfg, "[[device]]\nname = \"r\"\nspec = \"ram:1M\"\n").unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["daemon", "--config", cfg.to_str().unwrap()])
        .env("UDM_CONTROL", dir.path("control"))
        .env("NOTIFY_SOCKET", dir.path("notify"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _kill = common::KillOnDrop(Some(child));
    let mut b = [0u8; 256];
    let n = notify.recv(&mut b).unwrap();
    assert_eq!(String::from_utf8_lossy(&b[..n]).trim_end(), "READY=1");
    // Ready means ready: the config's device is there.
    let out = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["ls"])
        .env("UDM_CONTROL", dir.path("control"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("r\tram"));
}

#[test]
fn a_stale_socket_is_reclaimed() {
    let dir = TempDir::new("stale");
    std::fs::create_dir_all(dir.path("run")).unwrap();
    // A socket file nobody listens on, as a killed daemon leaves it.
    drop(std::os::unix::net::UnixListener::bind(dir.path("run/control")).unwrap());
    let d = Daemon::start_in(dir, &[]);
    d.ok(&["create", "r", "ram:1M"]);
    assert!(d.ok(&["ls"]).starts_with("r\tram"));
}

#[test]
fn dmsetup_verbs_manage_a_stack() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "ram0", "ram:64M"]);
    d.ok(&["create", "ram1", "ram:64M"]);
    d.ok(&["create", "lin", "--table", "0 131072 linear ram0 0"]);
    // The table on stdin, as dmsetup reads it.
    let mut c = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["create", "str"])
        .env("UDM_CONTROL", &d.ctl)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin
        .take()
        .unwrap()
        .write_all(b"0 131072 striped 2 128 ram0 0 ram1 0\n")
        .unwrap();
    assert!(c.wait().unwrap().success());
    assert_eq!(
        d.ok(&["ls", "--tree"]),
        "lin (mapped, 131072 sectors)\n └─ram0 (ram, 131072 sectors)\n\
         str (mapped, 131072 sectors)\n ├─ram0 (ram, 131072 sectors)\n └─ram1 (ram, 131072 sectors)\n"
    );
    assert_eq!(d.ok(&["deps", "str"]), "2 dependencies\t: (ram0) (ram1)\n");
    let info: Value = serde_json::from_str(&d.ok(&["info", "--json", "lin"])).unwrap();
    assert_eq!(info["sectors"], 131072);
    assert_eq!(info["holders"], serde_json::json!([]));

    // A busy remove is refused, naming the holder.
    let e = d.fails(&["remove", "ram0"]);
    assert!(
        e.contains("device 'ram0' is in use by the table of 'lin'"),
        "{e}"
    );

    // load / suspend / resume / clear, and the event counter moves on a swap.
    d.ok(&["load", "lin", "0 131072 linear ram1 0"]);
    assert_eq!(
        d.ok(&["table", "--inactive", "lin"]),
        "lin: 0 131072 linear ram1 0\n"
    );
    d.ok(&["suspend", "lin"]);
    assert!(d
        .ok(&["info", "lin"])
        .contains("State:             SUSPENDED"));
    let waiter = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["wait", "lin", "0"])
        .env("UDM_CONTROL", &d.ctl)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    d.ok(&["resume", "lin"]);
    let out = waiter.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "lin: event 1\n");
    assert!(d.ok(&["table", "lin"]).contains("linear ram1 0"));
    let (code, _, err) = d.udm(&["wait", "lin", "1", "--timeout", "0.1"]);
    assert_eq!(code, 1, "{err}");
    d.ok(&["load", "lin", "0 131072 zero"]);
    d.ok(&["clear", "lin"]);
    assert_eq!(d.ok(&["table", "--inactive", "lin"]), "");

    // Deferred: ram0 goes once str (its last holder) goes.
    d.ok(&["remove", "--deferred", "ram0"]);
    assert!(d
        .ok(&["info", "ram0"])
        .contains("Deferred remove:   pending"));
    d.ok(&["remove", "str"]);
    assert!(d.fails(&["info", "ram0"]).contains("unknown device 'ram0'"));

    // Force: lin fails its I/O (a table above still uses it), then goes.
    d.ok(&["create", "top", "--table", "0 131072 linear lin 0"]);
    d.ok(&["remove", "--force", "lin"]);
    assert!(d.fails(&["info", "lin"]).contains("unknown device"));
    assert_eq!(d.ok(&["remove", "--all"]), "top\nram1\n");
    assert_eq!(d.ok(&["ls"]), "");

    // Bad input: one line naming what is wrong.
    for (args, want) in [
        (&["create", "x", "disk:1G"][..], "unknown backend 'disk:'"),
        (
            &["create", "x", "--table", "0 8 frob"][..],
            "unknown target type 'frob'",
        ),
        (&["remove", "nope"][..], "unknown device 'nope'"),
        (&["resume", "nope"][..], "unknown device 'nope'"),
        (
            &["export", "add", "nope", "--nbd", "unix:/tmp/x"][..],
            "unknown device 'nope'",
        ),
    ] {
        let e = d.fails(args);
        assert!(e.contains(want), "{args:?}: {e}");
    }
}

/// Runs fio with verification against `uri`; returns its output.
fn fio_verify(uri: &str, seconds: f32) -> Child {
    Command::new("fio")
        .args([
            "--name=v",
            "--verify_state_save=0",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            &format!("--rate_iops={}", (4096.0 / seconds) as u32),
            "--verify=crc32c",
            "--verify_backlog=128",
            "--do_verify=1",
            "--verify_fatal=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio (installed by scripts/setup.sh)")
}

#[test]
fn exports_come_and_go_while_fio_verifies_through_one() {
    let d = Daemon::start(&[]);
    let sock = d.dir.path("lin.sock");
    d.ok(&["create", "ram0", "ram:64M"]);
    d.ok(&["create", "lin", "--table", "0 32768 linear ram0 0"]);
    let addr = format!("unix:{}", sock.display());
    let out = d.ok(&["export", "add", "lin", "--nbd", &addr]);
    let uri = format!("nbd+unix:///lin?socket={}", sock.display());
    assert!(out.contains(&uri), "{out}");
    let mut fio = common::KillOnDrop(Some(fio_verify(&uri, 3.0)));
    // The export in use cannot go from under fio unless forced: checked
    // once fio is connected, whatever the machine's speed.
    let t0 = Instant::now();
    loop {
        let ls: Value = serde_json::from_str(&d.ok(&["export", "ls", "--json"])).unwrap();
        if ls["exports"][0]["clients"] == 1 {
            break;
        }
        assert!(fio.running(), "fio ended before it connected");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "fio never connected: {ls}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = d.fails(&["export", "remove", "lin"]);
    assert!(e.contains("1 clients connected"), "{e}");
    let e = d.fails(&["remove", "lin"]);
    assert!(e.contains("in use by the nbd export 'lin'"), "{e}");
    // Beside and above the exported device, devices come and go, a table
    // is reloaded, and a second export is added and removed: for as long
    // as fio runs, and three times at least.
    let deadline = t0 + Duration::from_secs(120);
    let (rounds, beside_fio) = fio.rounds_while_running(3, deadline, |_| {
        d.ok(&["create", "side", "--table", "0 32768 linear ram0 32768"]);
        d.ok(&["create", "above", "--table", "0 32768 linear lin 0"]);
        let a2 = format!("unix:{}", d.dir.path("side.sock").display());
        d.ok(&["export", "add", "side", "--nbd", &a2]);
        d.ok(&[
            "reload",
            "side",
            "0 16384 linear ram0 32768\n16384 16384 zero",
        ]);
        d.ok(&["export", "remove", "side"]);
        d.ok(&["remove", "above"]);
        d.ok(&["remove", "side"]);
    });
    let out = fio.wait_with_output();
    assert!(
        out.contains("err= 0"),
        "fio failed after {rounds} rounds:\n{out}"
    );
    assert!(
        beside_fio >= 1,
        "no round ran whole while fio ran ({rounds} rounds)"
    );
    // Idle now: removed without force; then the device is free.
    let t0 = Instant::now();
    while d.udm(&["export", "remove", "lin"]).0 != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "fio's connection never closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!sock.exists(), "the listen socket goes with the export");
    d.ok(&["remove", "lin"]);
}

#[test]
fn a_forced_export_remove_under_load_never_hangs() {
    let d = Daemon::start(&[]);
    let sock = d.dir.path("x.sock");
    d.ok(&["create", "r", "ram:64M"]);
    d.ok(&[
        "export",
        "add",
        "r",
        "--nbd",
        &format!("unix:{}", sock.display()),
    ]);
    let uri = format!("nbd+unix:///r?socket={}", sock.display());
    let fio = common::KillOnDrop(Some(
        Command::new("fio")
            .args([
                "--name=l",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=randrw",
                "--bs=64k",
                "--iodepth=32",
                "--size=64M",
                "--time_based",
                "--runtime=30",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let t0 = Instant::now();
    while !d.ok(&["export", "ls"]).contains("1 clients") {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    d.ok(&["export", "remove", "--force", "r"]);
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    let out = fio.wait_with_output();
    assert!(!out.is_empty());
    // The device is free and the daemon well.
    d.ok(&["remove", "r"]);
    assert_eq!(d.ok(&["ls"]), "");
}

/// Files used by the daemon, their bytes and tables kept across restarts.
#[test]
fn dump_config_then_restart_recreates_the_stack_and_its_data() {
    let dir = TempDir::new("restart");
    let img0 = dir.path("a.img");
    let img1 = dir.path("b.img");
    let sock = dir.path("nbd.sock");
    let cfg = dir.path("udm.toml");
    let dir_path = dir.dir().to_path_buf();
    let mut d = Daemon::start_in(dir, &[]);
    d.ok(&["create", "a", &format!("file:{},size=16M", img0.display())]);
    d.ok(&["create", "b", &format!("file:{},size=16M", img1.display())]);
    d.ok(&["create", "s", "--table", "0 65536 striped 2 8 a 0 b 0"]);
    d.ok(&[
        "reload",
        "s",
        "0 32768 striped 2 8 a 0 b 0\n32768 16384 linear b 16384\n49152 16384 linear a 16384",
    ]);
    d.ok(&[
        "export",
        "add",
        "s",
        "--nbd",
        &format!("unix:{}", sock.display()),
    ]);
    let uri = format!("nbd+unix:///s?socket={}", sock.display());
    let data = dir_path.join("data");
    common::random_file(&data, 8 << 20, 7);
    run("nbdcopy", &[data.to_str().unwrap(), &uri]);
    let tree = d.ok(&["ls", "--tree"]);
    let tables = d.ok(&["table"]);
    std::fs::write(&cfg, d.ok(&["dump-config"])).unwrap();
    assert_eq!(d.stop().code(), Some(0), "{}", d.log());
    let dir = TempDir::adopt(dir_path.clone());
    std::mem::forget(d); // its TempDir is `dir` now
    let d = Daemon::start_in(dir, &["--config", cfg.to_str().unwrap()]);
    assert_eq!(d.ok(&["ls", "--tree"]), tree);
    assert_eq!(d.ok(&["table"]), tables);
    let back = dir_path.join("back");
    run("nbdcopy", &[&uri, back.to_str().unwrap()]);
    let want = std::fs::read(&data).unwrap();
    let got = std::fs::read(&back).unwrap();
    assert!(
        got[..want.len()] == want[..],
        "data differs after the restart"
    );
}

#[test]
fn a_config_error_names_the_line_and_leaves_nothing() {
    let dir = TempDir::new("badcfg");
    let cfg = dir.path("udm.toml");
    std::fs::write(
        &cfg,
        "[[device]]\nname = \"r\"\nspec = \"ram:1M\"\n\n[[device]]\nname = \"l\"\ntable = \"0 4096 linear r 0\"\n",
    )
    .unwrap();
    let err = common::daemon::refused_config(&cfg, &dir.path("control"));
    assert!(
        err.contains("line 5: device 'l'") && err.contains("too small"),
        "{err}"
    );
    assert!(!dir.path("control").exists());
}

/// Counts of the daemon's open descriptors and threads, and its RSS (KiB).
fn usage(pid: u32) -> (usize, usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |k: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    (fds, field("Threads:") as usize, field("VmRSS:"))
}

#[test]
fn a_thousand_create_remove_cycles_leave_fds_threads_and_rss_flat() {
    let d = Daemon::start(&[]);
    let mut c = Client::connect(&d.ctl).unwrap();
    let cycle = |c: &mut Client, i: usize| {
        c.call(Op::Create {
            name: "r".into(),
            spec: "ram:4M".into(),
            passphrase: None,
        })
        .unwrap();
        c.call(Op::Create {
            name: "l".into(),
            spec: format!("0 {} linear r 0", 8 * (1 + i % 1000)),
            passphrase: None,
        })
        .unwrap();
        c.call(Op::Remove {
            name: "l".into(),
            mode: Default::default(),
        })
        .unwrap();
        c.call(Op::Remove {
            name: "r".into(),
            mode: Default::default(),
        })
        .unwrap();
    };
    for i in 0..100 {
        cycle(&mut c, i);
    }
    let before = usage(d.pid());
    for i in 0..1000 {
        cycle(&mut c, i);
    }
    let after = usage(d.pid());
    assert_eq!(after.0, before.0, "descriptors: {before:?} -> {after:?}");
    assert_eq!(after.1, before.1, "threads: {before:?} -> {after:?}");
    assert!(
        after.2 <= before.2 + 2048,
        "RSS KiB: {before:?} -> {after:?}"
    );
}

#[test]
fn a_control_socket_under_abuse_answers_errors_and_keeps_serving() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "r", "ram:1M"]);
    let ask = |bytes: &[u8]| -> Option<Value> {
        let s = UnixStream::connect(&d.ctl).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = (&s).write_all(bytes);
        let mut l = String::new();
        BufReader::new(&s).read_line(&mut l).ok()?;
        serde_json::from_str(&l).ok()
    };
    let code = |v: Option<Value>| v.unwrap()["error"]["code"].as_str().unwrap().to_string();
    assert_eq!(code(ask(b"garbage\n")), "invalid");
    assert_eq!(
        code(ask(b"{\"v\":1,\"id\":1,\"op\":\"frob\"}\n")),
        "invalid"
    );
    let mut big = vec![b'x'; 10 << 20];
    big.push(b'\n');
    assert_eq!(code(ask(&big)), "invalid");
    // Half a line, then gone.
    drop({
        let s = UnixStream::connect(&d.ctl).unwrap();
        (&s).write_all(b"{\"v\":1,\"op\":").unwrap();
        s
    });
    // 100 clients at once: each gets an answer (a result or 'busy').
    let threads: Vec<_> = (0..100)
        .map(|_| {
            let p = d.ctl.clone();
            std::thread::spawn(move || {
                let s = UnixStream::connect(&p).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                // A client over the cap is answered 'busy' and closed at
                // once, maybe before its request is written: then the write
                // fails (EPIPE) and the answer is still there to read.
                let _ = (&s).write_all(b"{\"v\":1,\"id\":2,\"op\":\"ls\"}\n");
                let mut l = String::new();
                BufReader::new(&s).read_line(&mut l).unwrap();
                let v: Value = serde_json::from_str(&l).unwrap();
                v.get("ok").is_some() || v["error"]["code"] == "busy"
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap());
    }
    assert!(d.ok(&["ls"]).starts_with("r\tram"));
}

/// Whether a new connection to `sock` is greeted (NBD's first bytes) or
/// closed unread, as a connection over a cap is.
fn greeted(sock: &std::path::Path) -> bool {
    let mut c = UnixStream::connect(sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 8];
    matches!(std::io::Read::read(&mut c, &mut b), Ok(8)) && &b == b"NBDMAGIC"
}

#[test]
fn all_nbd_exports_share_one_connection_cap_set_in_the_config() {
    let dir = TempDir::new("limits");
    let cfg = dir.path("udm.toml");
    let (a, b) = (dir.path("a.sock"), dir.path("b.sock"));
    std::fs::write(
        &cfg,
        format!(
            "[limits]\nmax_connections = 2\nhandshake_timeout = 30\n\n\
             [[device]]\nname = \"a\"\nspec = \"ram:1M\"\n\n\
             [[device]]\nname = \"b\"\nspec = \"ram:1M\"\n\n\
             [[export]]\ndevice = \"a\"\nnbd = \"unix:{}\"\n\n\
             [[export]]\ndevice = \"b\"\nnbd = \"unix:{}\"\n",
            a.display(),
            b.display()
        ),
    )
    .unwrap();
    let d = Daemon::start_in(dir, &["--config", cfg.to_str().unwrap()]);
    // Two idle clients, one on each export, fill the daemon's cap: a third
    // is closed before the greeting whichever export it asks for.
    let mut held = Vec::new();
    for s in [&a, &b] {
        let mut c = UnixStream::connect(s).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut g = [0u8; 8];
        std::io::Read::read_exact(&mut c, &mut g).unwrap();
        held.push(c);
    }
    assert!(!greeted(&a) && !greeted(&b), "{}", d.log());
    assert!(
        d.log().contains("at the cap of 2 connections"),
        "{}",
        d.log()
    );
    drop(held);
    let t0 = Instant::now();
    while !greeted(&b) {
        assert!(t0.elapsed() < Duration::from_secs(5), "no place freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    // dump-config keeps the limits in force.
    let dump = d.ok(&["dump-config"]);
    assert!(
        dump.contains("[limits]") && dump.contains("max_connections = 2"),
        "{dump}"
    );
    assert!(dump.contains("handshake_timeout = 30"), "{dump}");
}

#[test]
fn a_flag_overrides_the_config_limits_and_a_bad_limit_names_its_line() {
    let dir = TempDir::new("limits-flag");
    let cfg = dir.path("udm.toml");
    std::fs::write(&cfg, "[limits]\nmax_connections = 2\n").unwrap();
    let d = Daemon::start_in(
        dir,
        &["--config", cfg.to_str().unwrap(), "--max-connections", "7"],
    );
    let dump = d.ok(&["dump-config"]);
    assert!(dump.contains("max_connections = 7"), "{dump}");
    drop(d);

    let dir = TempDir::new("limits-bad");
    let cfg = dir.path("udm.toml");
    std::fs::write(&cfg, "# limits\n\n[limits]\nmax_inflight = \"1M\"\n").unwrap();
    let err = common::daemon::refused_config(&cfg, &dir.path("control"));
    assert!(
        err.contains("line 3: [limits]") && err.contains("max-inflight '1M'"),
        "{err}"
    );
    // An export entry names exactly one protocol.
    std::fs::write(
        &cfg,
        "[[device]]\nname = \"r\"\nspec = \"ram:1M\"\n\n[[export]]\ndevice = \"r\"\n",
    )
    .unwrap();
    let err = common::daemon::refused_config(&cfg, &dir.path("control"));
    assert!(
        err.contains("line 5") && err.contains("exactly one of nbd, vhost_user_blk, ublk"),
        "{err}"
    );
}

#[test]
fn export_add_names_an_unknown_protocol_option() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "r", "ram:1M"]);
    let sock = d.dir.path("r.sock");
    let err = d.fails(&[
        "export",
        "add",
        "r",
        "--nbd",
        &format!("unix:{}", sock.display()),
        "--queues",
        "2",
    ]);
    assert!(err.contains("an NBD export takes no --queues"), "{err}");
    let err = d.fails(&["export", "add", "r"]);
    assert!(err.contains("--nbd") || err.contains("required"), "{err}");
}

/// A thin pool and its volumes through the daemon's verbs: messages make
/// and delete volumes, status follows dm, a volume in use is not deleted.
#[test]
fn thin_pools_and_volumes_through_the_verbs() {
    let d = Daemon::start(&[]);
    d.ok(&["create", "meta", "ram:8M"]);
    d.ok(&["create", "data", "ram:64M"]);
    d.ok(&[
        "create",
        "pool",
        "--table",
        "0 131072 thin-pool meta data 128 64",
    ]);
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.ok(&["create", "vol", "--table", "0 262144 thin pool 0"]);
    d.ok(&["message", "pool", "0", "create_snap", "1", "0"]);
    d.ok(&["create", "snap", "--table", "0 262144 thin pool 1"]);
    assert_eq!(
        d.ok(&["status", "vol"]),
        "vol: 0 262144 thin 0 -\n",
        "nothing mapped yet"
    );
    let st = d.ok(&["status", "pool"]);
    assert!(
        st.starts_with("pool: 0 131072 thin-pool 0 ")
            && st.contains(" 0/1024 - rw discard_passdown queue_if_no_space - "),
        "{st}"
    );
    let t = d.ok(&["table", "snap"]);
    assert!(t.contains("table:  0 262144 thin pool 1"), "{t}");
    let e = d.fails(&["message", "pool", "0", "delete", "1"]);
    assert!(e.contains("dev id 1 is open"), "{e}");
    let e = d.fails(&["message", "pool", "0", "create_thin", "0"]);
    assert!(e.contains("dev id 0 is in use"), "{e}");
    d.ok(&["remove", "snap"]);
    d.ok(&["message", "pool", "0", "delete", "1"]);
    d.ok(&["message", "pool", "0", "set_transaction_id", "0", "1"]);
    assert!(d
        .ok(&["status", "pool"])
        .starts_with("pool: 0 131072 thin-pool 1 "));
    let e = d.fails(&["create", "t2", "--table", "0 8 thin pool 9"]);
    assert!(e.contains("dev id 9 does not exist"), "{e}");
    assert_eq!(d.ok(&["remove", "--all"]), "vol\npool\ndata\nmeta\n");
}

/// A thin pool over files, a volume and a snapshot of it written apart:
/// `udm dump-config` carries the pool and both volumes, a daemon started
/// from it opens the pool without formatting it again and reads the same
/// bytes through each, and the metadata passes `thin_check`.
#[test]
fn dump_config_then_restart_reopens_a_thin_pool_and_its_volumes() {
    let dir = TempDir::new("thin-restart");
    let (meta, data) = (dir.path("meta.img"), dir.path("data.img"));
    let cfg = dir.path("udm.toml");
    let dir_path = dir.dir().to_path_buf();
    let mut d = Daemon::start_in(dir, &[]);
    d.ok(&["create", "m", &format!("file:{},size=8M", meta.display())]);
    d.ok(&["create", "d", &format!("file:{},size=64M", data.display())]);
    d.ok(&["create", "pool", "--table", "0 131072 thin-pool m d 128 0"]);
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.ok(&["create", "v", "--table", "0 65536 thin pool 0"]);
    let uri = |name: &str| {
        let sock = dir_path.join(format!("{name}.sock"));
        d.ok(&[
            "export",
            "add",
            name,
            "--nbd",
            &format!("unix:{}", sock.display()),
        ]);
        format!("nbd+unix:///{name}?socket={}", sock.display())
    };
    let (a, b) = (dir_path.join("a"), dir_path.join("b"));
    common::random_file(&a, 4 << 20, 1);
    common::random_file(&b, 1 << 20, 2);
    let v = uri("v");
    run("nbdcopy", &[a.to_str().unwrap(), &v]);
    d.ok(&["export", "remove", "v"]);
    d.ok(&["suspend", "v"]);
    d.ok(&["message", "pool", "0", "create_snap", "1", "0"]);
    d.ok(&["resume", "v"]);
    d.ok(&["create", "s", "--table", "0 65536 thin pool 1"]);
    let s = uri("s");
    run("nbdcopy", &[b.to_str().unwrap(), &s]);
    d.ok(&["export", "remove", "s"]);
    let dump = d.ok(&["dump-config"]);
    assert!(
        dump.contains("thin-pool m d 128 0") && dump.contains("thin pool 1"),
        "{dump}"
    );
    std::fs::write(&cfg, &dump).unwrap();
    let status = d.ok(&["status", "pool"]);
    assert_eq!(d.stop().code(), Some(0), "{}", d.log());
    let out = std::process::Command::new("thin_check").arg(&meta).output();
    if let Ok(out) = out {
        assert!(
            out.status.success(),
            "thin_check: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let dir = TempDir::adopt(dir_path.clone());
    std::mem::forget(d); // its TempDir is `dir` now
    let d = Daemon::start_in(dir, &["--config", cfg.to_str().unwrap()]);
    // Not formatted again: the same blocks in use.
    assert_eq!(d.ok(&["status", "pool"]), status);
    for (name, want) in [
        ("v", vec![(&a, 0usize)]),
        ("s", vec![(&b, 0), (&a, 1 << 20)]),
    ] {
        let sock = dir_path.join(format!("{name}2.sock"));
        d.ok(&[
            "export",
            "add",
            name,
            "--nbd",
            &format!("unix:{}", sock.display()),
        ]);
        let back = dir_path.join(format!("{name}.back"));
        run(
            "nbdcopy",
            &[
                &format!("nbd+unix:///{name}?socket={}", sock.display()),
                back.to_str().unwrap(),
            ],
        );
        let got = std::fs::read(&back).unwrap();
        for (file, from) in want {
            let want = std::fs::read(file).unwrap();
            assert!(
                got[from..want.len()] == want[from..],
                "{name}: {} differs after the restart",
                file.display()
            );
        }
    }
}
