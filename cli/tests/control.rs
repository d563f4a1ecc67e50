//! The control socket of a running `udm serve`, driven as a user would:
//! `udm status/table/message/reload --control PATH`, raw JSON requests on a
//! UnixStream, and a reload while fio writes and verifies over NBD.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{run, udm, Serve};
use serde_json::{json, Value};

/// Past `common::WC_DEVS`: a linear device `lin` (64 MiB over ram0), and
/// both exported.
const LIN_AND_EXPORTS: [&str; 8] = [
    "--dev",
    "ram0=ram:64M",
    "--dev",
    "lin=0 131072 linear ram0 0",
    "--export",
    "wc",
    "--export",
    "lin",
];

/// The writecache `wc` and the linear `lin`, both exported.
fn stack() -> Vec<&'static str> {
    [&common::WC_DEVS[..], &LIN_AND_EXPORTS[..]].concat()
}

fn ctl_udm(s: &Serve, cmd: &str, rest: &[&str]) -> (i32, String, String) {
    let ctl = s.ctl();
    let mut a = vec![cmd, "--control", ctl.to_str().unwrap()];
    a.extend_from_slice(rest);
    udm(&a)
}

/// Sends raw request bytes on a new connection and reads `replies` reply
/// lines, parsed.
fn raw(ctl: &Path, bytes: &[u8], replies: usize) -> Vec<Value> {
    let s = UnixStream::connect(ctl).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    (&s).write_all(bytes).unwrap();
    let mut r = BufReader::new(&s);
    let mut out = Vec::new();
    while out.len() < replies {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap() == 0 {
            break;
        }
        out.push(serde_json::from_str(&l).unwrap());
    }
    out
}

/// A reply's error as (code, message), or ("ok", "").
fn outcome(v: &Value) -> (String, String) {
    match v.get("error") {
        Some(e) => (
            e["code"].as_str().unwrap().to_string(),
            e["message"].as_str().unwrap().to_string(),
        ),
        None => {
            assert!(v.get("ok").is_some(), "{v}");
            ("ok".into(), String::new())
        }
    }
}

#[test]
fn status_table_and_message_act_on_the_running_server() {
    let mut s = Serve::start(&stack());
    let ctl = s.ctl();
    // Announced beside the NBD socket, mode 0600.
    assert_eq!(ctl, s.dir.path("nbd.sock.ctl"), "{}", s.out());
    let m = std::fs::symlink_metadata(&ctl).unwrap();
    assert!(m.file_type().is_socket());
    assert_eq!(m.permissions().mode() & 0o777, 0o600);

    // status: dmsetup's lines, for every mapped device or the ones named.
    let (code, out, err) = ctl_udm(&s, "status", &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    let (code, out, err) = ctl_udm(&s, "status", &["wc"]);
    assert_eq!(code, 0, "{err}");
    let f: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(&f[..4], &["wc:", "0", "32768", "writecache"], "{out}");
    assert_eq!(f.len(), 4 + 14, "{out}");

    // Writes through NBD show in the server's counters: the stack is the
    // server's, not one built by the command.
    run(
        "nbdsh",
        &[
            "-u",
            &s.uri("wc"),
            "-c",
            "h.pwrite(b'x' * 65536, 0); h.flush()",
        ],
    );
    let (_, out, _) = ctl_udm(&s, "status", &["wc"]);
    let writes: u64 = out.split_whitespace().nth(10).unwrap().parse().unwrap();
    assert_eq!(writes, 16, "16 blocks written: {out}");

    // table: size, caps, table and status lines.
    let (code, out, err) = ctl_udm(&s, "table", &["lin"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("lin: 131072 sectors, lbs 512"), "{out}");
    assert!(out.contains("  table:  0 131072 linear ram0 0"), "{out}");

    // --json prints the protocol's result.
    let (code, out, err) = ctl_udm(&s, "status", &["--json", "lin"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        json!({"devices": [{"name": "lin", "lines": ["0 131072 linear"]}]})
    );

    // An exported device is held by its export: removing it is refused.
    let r = raw(
        &ctl,
        b"{\"v\":1,\"id\":1,\"op\":\"remove\",\"args\":{\"name\":\"lin\"}}\n",
        1,
    );
    assert_eq!(
        outcome(&r[0]),
        (
            "busy".into(),
            "device 'lin' is in use by the nbd export 'lin'".into()
        )
    );

    // message: clear_stats zeroes the counters; flush empties the cache.
    let (code, _, err) = ctl_udm(&s, "message", &["wc", "clear_stats"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = ctl_udm(&s, "message", &["--no-progress", "wc", "0", "flush"]);
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = ctl_udm(&s, "status", &["wc"]);
    let f: Vec<u64> = out
        .split_whitespace()
        .skip(4)
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(f[1], f[2], "every block free after flush: {out}");
    assert_eq!(f[6], 0, "writes counter cleared: {out}");

    // Errors: one line, exit 2, naming what is wrong.
    for (args, want) in [
        (
            &["wc", "0", "frobnicate"][..],
            "unknown message 'frobnicate'",
        ),
        (&["nope", "flush"][..], "unknown device 'nope'"),
        (&["ram0", "flush"][..], "not a mapped device"),
    ] {
        let (code, _, err) = ctl_udm(&s, "message", args);
        assert_eq!(code, 2, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let (code, _, err) = ctl_udm(&s, "status", &["nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown device 'nope'"), "{err}");
    let (code, _, err) = udm(&["status", "--control", "/nonexistent/ctl"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("is 'udm daemon' or 'udm serve' running?"),
        "{err}"
    );
    let (code, _, err) = udm(&["status", "--control", "x", "--dev", "a=ram:1M"]);
    assert_eq!(code, 2);
    assert!(err.contains("--control and --dev do not mix"), "{err}");

    // A device a client left suspended does not keep the server from
    // stopping: it resumes, drains and is flushed.
    let r = raw(
        &ctl,
        b"{\"v\":1,\"id\":1,\"op\":\"suspend\",\"args\":{\"name\":\"lin\"}}\n",
        1,
    );
    assert_eq!(outcome(&r[0]).0, "ok", "{:?}", r[0]);
    let (_, out, _) = ctl_udm(&s, "table", &["lin"]);
    assert!(out.contains(", suspended"), "{out}");

    // The socket file goes with the server.
    assert!(s.stop().success(), "{}", s.log());
    assert!(!ctl.exists(), "control socket left behind");
}

#[test]
fn control_socket_path_can_be_chosen_and_a_live_one_is_not_stolen() {
    let d = common::TempDir::new("ctl");
    let p = d.path("my.ctl");
    let ps = p.to_str().unwrap();
    let mut s = Serve::start(&["--dev", "r=ram:1M", "--control", ps]);
    assert_eq!(s.ctl(), p);
    // A second server asking for the same control socket fails at once,
    // and leaves the first one's socket alone.
    let (code, _, err) = udm(&[
        "serve",
        "--dev",
        "r=ram:1M",
        "--control",
        ps,
        "--listen",
        &format!("unix:{}", d.path("other.sock").display()),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("another server is listening on it"), "{err}");
    let (code, _, err) = ctl_udm(&s, "status", &[]);
    assert_eq!(code, 0, "{err}");
    assert!(s.stop().success());
    assert!(!p.exists());
    // A stale socket from a server that died is replaced.
    drop(std::os::unix::net::UnixListener::bind(&p).unwrap());
    assert!(p.exists());
    let s = Serve::start(&["--dev", "r=ram:1M", "--control", ps]);
    let (code, _, err) = ctl_udm(&s, "status", &[]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn bad_requests_get_one_line_errors_and_other_clients_are_unaffected() {
    let s = Serve::start(&stack());
    let ctl = s.ctl();
    // A client that sends half a request and stalls holds only itself.
    let stalled = UnixStream::connect(&ctl).unwrap();
    (&stalled)
        .write_all(b"{\"v\":1,\"id\":5,\"op\":\"sta")
        .unwrap();

    let req = |id: u64, op: &str, args: Value| json!({"v": 1, "id": id, "op": op, "args": args});
    let mut bytes = Vec::new();
    for l in [
        json!({"v": 1, "id": 1, "op": "bogus"}),
        req(2, "status", json!({"names": ["nope"]})),
        req(3, "message", json!({"name": "wc"})),
        req(
            4,
            "message",
            json!({"name": "wc", "sector": "x", "argv": ["flush"]}),
        ),
        req(5, "reload", json!({"name": "lin"})),
        req(6, "reload", json!({"name": "lin", "table": "0 8 frob"})),
        json!({"v": 2, "id": 7, "op": "version"}),
        req(8, "remove", json!({"name": "ram0"})),
        req(9, "version", json!({})),
        req(10, "status", json!({"names": ["wc"]})),
    ] {
        bytes.extend_from_slice(l.to_string().as_bytes());
        bytes.push(b'\n');
    }
    // Not JSON at all, an empty line, and not UTF-8, in the middle.
    bytes.extend_from_slice(b"status wc\n\n\xff\xfe\n");
    bytes.extend_from_slice(req(11, "ls", json!({})).to_string().as_bytes());
    bytes.push(b'\n');
    let r = raw(&ctl, &bytes, 14);
    let want: [(Option<u64>, &str, &str); 14] = [
        (
            Some(1),
            "invalid",
            "unknown op 'bogus' (known: version, ls,",
        ),
        (Some(2), "not_found", "unknown device 'nope'"),
        (
            Some(3),
            "invalid",
            "message: invalid arguments: missing field `argv`",
        ),
        (
            Some(4),
            "invalid",
            "message: invalid arguments: invalid type: string \"x\"",
        ),
        (
            Some(5),
            "invalid",
            "reload: invalid arguments: missing field `table`",
        ),
        (
            Some(6),
            "invalid",
            "reload 'lin': table line 1: unknown target type 'frob'",
        ),
        (
            Some(7),
            "unsupported",
            "protocol version 2 is not supported",
        ),
        (
            Some(8),
            "busy",
            "device 'ram0' is in use by the table of 'lin'",
        ),
        (Some(9), "ok", ""),
        (Some(10), "ok", ""),
        (None, "invalid", "request is not JSON"),
        (None, "invalid", "empty request"),
        (None, "invalid", "request is not UTF-8"),
        (Some(11), "ok", ""),
    ];
    assert_eq!(r.len(), want.len(), "{r:#?}");
    for (got, (id, code, msg)) in r.iter().zip(want) {
        assert_eq!(got["v"], 1, "{got}");
        assert_eq!(got["id"].as_u64(), id, "{got}");
        let (c, m) = outcome(got);
        assert_eq!(c, code, "{got}");
        assert!(m.starts_with(msg), "got {m:?}, want {msg:?}");
    }
    assert_eq!(r[8]["ok"]["protocol"], 1);
    assert_eq!(r[9]["ok"]["devices"][0]["name"], "wc");
    let lines = r[9]["ok"]["devices"][0]["lines"][0].as_str().unwrap();
    assert!(lines.starts_with("0 32768 writecache"), "{lines}");
    let names: Vec<&str> = r[13]["ok"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["o", "c", "wc", "ram0", "lin"]);

    // An overlong line: one error, then the server closes the connection.
    let mut long = vec![b'x'; 70 << 10];
    long.push(b'\n');
    let c = UnixStream::connect(&ctl).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = (&c).write_all(&long);
    let mut got = String::new();
    let _ = (&c).read_to_string(&mut got);
    assert_eq!(got.lines().count(), 1, "{got}");
    let v: Value = serde_json::from_str(&got).unwrap();
    assert_eq!(
        outcome(&v),
        (
            "invalid".into(),
            "request line longer than 65536 bytes".into()
        )
    );

    // A client that leaves mid-request and one that leaves mid-reply.
    drop(UnixStream::connect(&ctl).unwrap());
    {
        let c = UnixStream::connect(&ctl).unwrap();
        let t = "{\"v\":1,\"id\":1,\"op\":\"table\"}\n";
        (&c).write_all(t.repeat(3).as_bytes()).unwrap();
    }

    // The stalled client finishes its request later and gets its answer.
    (&stalled)
        .write_all(b"tus\",\"args\":{\"names\":[\"lin\"]}}\n")
        .unwrap();
    stalled
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut r = BufReader::new(&stalled);
    let mut l = String::new();
    r.read_line(&mut l).unwrap();
    assert_eq!(
        l,
        "{\"v\":1,\"id\":5,\"ok\":{\"devices\":[{\"name\":\"lin\",\"lines\":[\"0 131072 linear\"]}]}}\n"
    );

    // Still serving, NBD too, and nothing panicked.
    let (code, _, err) = ctl_udm(&s, "status", &["lin"]);
    assert_eq!(code, 0, "{err}");
    run("nbdinfo", &["--size", &s.uri("lin")]);
    assert!(!s.log().contains("panicked"), "{}", s.log());
}

/// Opens a pseudo-terminal: (master, slave).
fn pty() -> (OwnedFd, OwnedFd) {
    let (mut m, mut sl) = (0, 0);
    // SAFETY: openpty writes two fds; null name/termios/winsize are allowed.
    let r = unsafe {
        libc::openpty(
            &mut m,
            &mut sl,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both fds were just opened and are owned only here.
    unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(sl)) }
}

#[test]
fn a_long_flush_draws_progress_on_a_terminal_while_status_polls_the_server() {
    // The origin takes 1 ms per write and writeback runs 4 blocks at a
    // time, so writing back 2048 scattered blocks takes about half a second.
    let s = Serve::start(&[
        "--dev",
        "o=null:64M,delay=1000",
        "--dev",
        "c=ram:32M",
        "--dev",
        "wc=0 131072 writecache s o c 4096 6 high_watermark 95 low_watermark 90 writeback_jobs 4",
    ]);
    // Every other 4 KiB block of 16 MiB: nothing merges on the way back.
    run(
        "fio",
        &[
            "--name=fill",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("wc")),
            "--rw=write:4k",
            "--bs=4k",
            "--size=16M",
            "--iodepth=16",
        ],
    );
    let (_, before, _) = ctl_udm(&s, "status", &["wc"]);
    let f: Vec<u64> = before
        .split_whitespace()
        .skip(4)
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(f[1] - f[2] >= 2048, "cache holds the writes: {before}");

    let (master, slave) = pty();
    let ctl = s.ctl();
    let mut child = Command::new(env!("CARGO_BIN_EXE_udm"))
        .args(["message", "--control", ctl.to_str().unwrap(), "wc", "flush"])
        .stdout(Stdio::piped())
        .stderr(Stdio::from(slave))
        .spawn()
        .unwrap();
    let reader = std::thread::spawn(move || {
        let mut f = std::fs::File::from(master);
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        // Ends with EIO once the child, the slave's last holder, exits.
        while let Ok(n) = f.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&all).into_owned()
    });
    // Meanwhile another client's status requests are answered at once.
    let t0 = Instant::now();
    let mut polls = 0;
    while child.try_wait().unwrap().is_none() {
        let t = Instant::now();
        let (code, out, err) = ctl_udm(&s, "status", &["wc"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with("wc: 0 131072 writecache"), "{out}");
        assert!(t.elapsed() < Duration::from_secs(2), "status stalled");
        polls += 1;
        assert!(t0.elapsed() < Duration::from_secs(30), "flush hangs");
    }
    let st = child.wait().unwrap();
    let tty = reader.join().unwrap();
    assert!(st.success(), "{tty}");
    assert!(polls >= 2, "the flush ran long enough to poll ({polls})");
    assert!(tty.contains("blocks dirty"), "no progress bar: {tty:?}");
    assert!(
        tty.contains(&format!("[{}] 100%", "#".repeat(40))),
        "{tty:?}"
    );
    let (_, after, _) = ctl_udm(&s, "status", &["wc"]);
    let f: Vec<u64> = after
        .split_whitespace()
        .skip(4)
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(f[1], f[2], "flush emptied the cache: {after}");

    // Not a terminal: no bar (stderr stays clean for logs).
    let (code, _, err) = ctl_udm(&s, "message", &["wc", "flush"]);
    assert_eq!(code, 0);
    assert_eq!(err, "");
}

#[test]
fn reload_swaps_tables_under_live_nbd_io_and_loses_nothing() {
    let s = Serve::start(&stack());
    let one = "0 131072 linear ram0 0";
    let two = "0 40000 linear ram0 0\n40000 91072 linear ram0 40000";
    // fio writes 32 MiB at random with verification interleaved
    // (verify_backlog), rate-limited so that it runs ~2 s, then reads
    // everything back and checks it.
    let fio = Command::new("fio")
        .args([
            "--name=v",
            "--verify_state_save=0",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("lin")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--size=32M",
            "--rate_iops=8000",
            "--verify=crc32c",
            "--verify_backlog=256",
            "--do_verify=1",
            "--verify_fatal=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio (installed by scripts/setup.sh)");
    let mut fio = common::KillOnDrop(Some(fio));
    // Reloads for as long as fio runs, and ten at least; however slow the
    // machine, some of them land while fio's I/O is in flight.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (reloads, beside_fio) = fio.rounds_while_running(10, deadline, |i| {
        let t = if i % 2 == 0 { two } else { one };
        let (code, out, err) = ctl_udm(&s, "reload", &["lin", t]);
        assert_eq!(code, 0, "reload {i}: {err}");
        assert_eq!(out, "");
        std::thread::sleep(Duration::from_millis(50));
    });
    let out = fio.wait_with_output();
    assert!(
        out.contains("err= 0"),
        "fio failed after {reloads} reloads:\n{out}"
    );
    assert!(
        beside_fio >= 1,
        "no reload ran while fio ran ({reloads} reloads)"
    );
    // The last table is live.
    let (_, out, _) = ctl_udm(&s, "table", &["lin"]);
    let tables = out.matches("  table:  ").count();
    assert_eq!(tables, if reloads % 2 == 1 { 2 } else { 1 }, "{out}");

    // Refused before anything changes, with the reason.
    for (dev, table, want) in [
        (
            "lin",
            "0 65536 linear ram0 0",
            "a live device may grow, not shrink",
        ),
        (
            "lin",
            "0 131072 linear lin 0",
            "a table may use only devices defined before it",
        ),
        ("lin", "0 131072 linear ram0", "linear"),
        (
            "wc",
            "0 32768 writecache s o c 4096 0",
            "device 'c' is in use by the live writecache of 'wc'",
        ),
        ("wc", "0 16384 linear o 0", "16384 sectors"),
        ("ram0", "0 131072 zero", "not a mapped device"),
    ] {
        let (code, _, err) = ctl_udm(&s, "reload", &[dev, table]);
        assert_eq!(code, 2, "{table}");
        assert!(err.contains(want), "{table}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // reload changes a running daemon's device: no in-process form.
    let (code, _, err) = udm(&["reload", "--dev", "a=ram:1M", "a", "0 8 zero"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown option '--dev'"), "{err}");
    let (_, out, _) = ctl_udm(&s, "table", &["lin"]);
    assert!(!out.contains("suspended"), "{out}");
    // And the data is still there through the reloaded table.
    run("nbdinfo", &["--size", &s.uri("lin")]);
}
