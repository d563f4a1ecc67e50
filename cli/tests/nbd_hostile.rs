//! Hostile and careless NBD clients against a real `udm serve`: sockets
//! that never negotiate, a client stalled inside an option, more clients
//! than the caps allow, and readers that pipeline the largest READs and
//! never read the replies. Each test asserts what the server does to them
//! and that a fresh client (libnbd's nbdsh) still writes and reads
//! correctly beside or after them.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::raw::{Raw, CMD_READ, CMD_WRITE, IHAVEOPT, OPT_GO};
use common::{run, Serve};

/// NBD_REP_ERR_POLICY.
const REP_ERR_POLICY: u32 = (1 << 31) + 2;

/// A fresh libnbd client writes a pattern at `off` and reads it back.
fn fresh_client_writes_and_reads(s: &Serve, off: u64) {
    let script = format!(
        "buf = bytes((i * 7 + {off}) % 251 for i in range(65536))\n\
         h.pwrite(buf, {off}, nbd.CMD_FLAG_FUA)\n\
         assert h.pread(65536, {off}) == buf\n\
         assert h.pread(4096, {off} + 4096) == buf[4096:8192]\n\
         print('ok')"
    );
    let out = run("nbdsh", &["-u", &s.uri("lin"), "-c", &script]);
    assert!(out.contains("ok"), "{out}");
}

/// Whether the server closed `s` (EOF or reset) within `within`, reading
/// and dropping whatever it sent first (the greeting).
fn closed_within(s: &mut UnixStream, within: Duration) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let t0 = Instant::now();
    let mut b = [0u8; 256];
    while t0.elapsed() < within {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

fn server(extra: &[&str]) -> Serve {
    let mut a = vec![
        "--dev",
        "ram0=ram:64M",
        "--dev",
        "lin=0 131072 linear ram0 0",
    ];
    a.extend_from_slice(extra);
    Serve::start(&a)
}

#[test]
fn sockets_that_never_negotiate_are_closed_at_the_handshake_deadline() {
    let s = server(&["--handshake-timeout", "1"]);
    let mut idle: Vec<UnixStream> = (0..20)
        .map(|_| UnixStream::connect(&s.sock).unwrap())
        .collect();
    // A client that negotiated in time is not subject to the deadline.
    let mut good = Raw::connect(&s, 3);
    good.go("lin");
    let t0 = Instant::now();
    for c in &mut idle {
        assert!(
            closed_within(c, Duration::from_secs(5)),
            "an idle socket outlived the 1 s deadline"
        );
    }
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(500),
        "closed too early: {took:?}"
    );
    let log = s.wait_log("handshake not finished within 1s", 20);
    assert_eq!(log.matches("handshake not finished").count(), 20, "{log}");
    std::thread::sleep(Duration::from_millis(300));
    good.still_serves();
    fresh_client_writes_and_reads(&s, 1 << 20);
}

#[test]
fn a_client_stalled_inside_an_option_is_closed_at_the_deadline() {
    let s = server(&["--handshake-timeout", "1"]);
    // An option announcing 4 GiB of data, 100 bytes of which arrive.
    let mut big = Raw::connect(&s, 3);
    let mut m = IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&OPT_GO.to_be_bytes());
    m.extend_from_slice(&u32::MAX.to_be_bytes());
    m.extend_from_slice(&[0u8; 100]);
    big.send(&m);
    // A GO announcing 64 bytes, 10 of which arrive.
    let mut small = Raw::connect(&s, 3);
    let mut m = IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&OPT_GO.to_be_bytes());
    m.extend_from_slice(&64u32.to_be_bytes());
    m.extend_from_slice(&[0u8; 10]);
    small.send(&m);
    // One that sent its flags and nothing else.
    let mut quiet = Raw::connect(&s, 3);
    for c in [&mut big.s, &mut small.s, &mut quiet.s] {
        assert!(closed_within(c, Duration::from_secs(5)));
    }
    s.wait_log("handshake not finished within 1s", 3);
    fresh_client_writes_and_reads(&s, 2 << 20);
}

#[test]
fn connections_over_the_server_cap_are_closed_before_the_greeting() {
    let mut s = server(&["--max-connections", "4", "--handshake-timeout", "30"]);
    let idle: Vec<Raw> = (0..4).map(|_| Raw::connect(&s, 3)).collect();
    // The kernel completes the connect; the server closes it unread.
    let mut over = UnixStream::connect(&s.sock).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 18];
    assert!(
        matches!(over.read(&mut b), Ok(0) | Err(_)),
        "a connection over the cap got bytes: {b:?}"
    );
    s.wait_log("at the cap of 4 connections", 1);
    // A freed place is taken at once.
    drop(idle);
    let t0 = Instant::now();
    loop {
        let mut c = UnixStream::connect(&s.sock).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if c.read(&mut b).is_ok_and(|n| n > 0) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no place freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    fresh_client_writes_and_reads(&s, 3 << 20);
    // At its cap, the server still stops at once on SIGTERM.
    let _full: Vec<Raw> = (0..4).map(|_| Raw::connect(&s, 3)).collect();
    let t0 = Instant::now();
    assert!(s.stop().success());
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[test]
fn an_export_at_its_cap_refuses_go_with_err_policy() {
    let s = server(&["--export-max-connections", "lin=1"]);
    let mut first = Raw::connect(&s, 3);
    first.go("lin");
    let mut second = Raw::connect(&s, 3);
    let mut d = 3u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"lin");
    d.extend_from_slice(&0u16.to_be_bytes());
    second.option(OPT_GO, &d);
    let (opt, ty, _) = second.option_reply();
    assert_eq!((opt, ty), (OPT_GO, REP_ERR_POLICY));
    // Negotiation goes on; once the first leaves, GO succeeds.
    first.still_serves();
    drop(first);
    let t0 = Instant::now();
    loop {
        second.option(OPT_GO, &d);
        let (_, ty, data) = second.option_reply();
        if ty == REP_ERR_POLICY {
            assert!(t0.elapsed() < Duration::from_secs(5), "cap never freed");
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        // NBD_REP_INFO items, then ACK.
        let mut ty = ty;
        let _ = data;
        while ty != 1 {
            ty = second.option_reply().1;
        }
        break;
    }
    second.still_serves();
}

/// The server's resident memory, in bytes.
fn rss(pid: u32) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = st
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb << 10
}

/// Worst case stated in docs/nbd.md: the budget plus 64 MiB.
#[test]
fn slow_readers_and_stalled_writers_stay_within_the_budget() {
    const MIB: u64 = 1 << 20;
    let budget = 256 * MIB;
    let s = Serve::start(&[
        "--dev",
        "ram0=ram:64M",
        "--dev",
        "lin=0 131072 linear ram0 0",
        "--max-inflight",
        "256M",
    ]);
    let pid = s.child.as_ref().unwrap().id();
    // Every page of the device resident first (its 64 MiB count in the
    // bound), so that the growth measured is buffers.
    fresh_client_writes_and_reads(&s, 0);
    run(
        "nbdsh",
        &[
            "-u",
            &s.uri("lin"),
            "-c",
            "h.pwrite(b'\\x5a' * (32 << 20), 0)\nh.pwrite(b'\\xa5' * (32 << 20), 32 << 20)",
        ],
    );
    let base = rss(pid);
    // The server logs a close when it has torn the connection down, after
    // the client saw it go: wait for the three so far (Serve::start's probe,
    // the fresh client's, nbdsh's) so that a late line is not taken below
    // for a hostile client closed for being slow.
    let closes = s.wait_log("closed:", 3).matches("closed:").count();
    // 16 readers pipelining 32 MiB READs (8 each: twice the per-connection
    // bound), never reading a reply.
    let mut hostile: Vec<Raw> = (0..16)
        .map(|i| {
            let mut r = Raw::connect(&s, 3);
            r.go("lin");
            for k in 0..8u64 {
                r.request(0, CMD_READ, i * 100 + k, (k % 2) * 32 * MIB, 32 << 20);
            }
            r
        })
        .collect();
    // 4 writers announcing 32 MiB WRITEs and sending 64 KiB of each (what
    // a socket buffer takes while the server does not read).
    for i in 0..4u64 {
        let mut w = Raw::connect(&s, 3);
        w.go("lin");
        w.request(0, CMD_WRITE, 9000 + i, 0, 32 << 20);
        w.send(&vec![0x77u8; 64 << 10]);
        hostile.push(w);
    }
    // Let the server take all it will.
    let mut peak = 0;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        peak = peak.max(rss(pid));
        std::thread::sleep(Duration::from_millis(50));
    }
    // A well-behaved client beside them still reads and writes.
    let t1 = Instant::now();
    fresh_client_writes_and_reads(&s, 40 << 20);
    let mut good = Raw::connect(&s, 3);
    good.go("lin");
    for k in 0..64u64 {
        good.request(0, CMD_READ, k, k * 4096, 4096);
        assert_eq!(good.simple_reply(), (0, k));
        assert_eq!(good.read(4096), vec![0x5a; 4096]);
    }
    good.request(0, CMD_READ, 77, 32 * MIB, 1 << 20);
    assert_eq!(good.simple_reply(), (0, 77));
    assert_eq!(good.read(1 << 20), vec![0xa5; 1 << 20]);
    let served = t1.elapsed();
    peak = peak.max(rss(pid));
    eprintln!(
        "rss: {} MiB before the hostile clients, peak {} MiB; good client served in {served:?}",
        base >> 20,
        peak >> 20
    );
    assert!(
        peak < budget + 64 * MIB,
        "server RSS {} MiB with 16 slow readers: over budget + 64 MiB",
        peak >> 20
    );
    assert!(served < Duration::from_secs(10), "{served:?}");
    // None of them was closed for being slow: the one close since they
    // came is the fresh client's.
    s.wait_log("closed:", closes + 1);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        s.log().matches("closed:").count(),
        closes + 1,
        "{}",
        s.log()
    );
    drop(hostile);
    s.wait_log("closed:", 20);
    fresh_client_writes_and_reads(&s, 48 << 20);
}

/// With few descriptors (hard RLIMIT_NOFILE 320), the cap is lowered to
/// leave the reserve free: a flood of idle sockets is refused at the cap,
/// accept never fails for want of descriptors, and once the flood's
/// sockets reach the deadline a fresh client gets in.
#[test]
fn the_cap_fits_the_descriptor_limit() {
    let dir = common::TempDir::new("nofile");
    let sock = dir.path("nbd.sock");
    let err = dir.path("stderr");
    let out = dir.path("stdout");
    let child = std::process::Command::new("prlimit")
        .args(["--nofile=320:320", "--", env!("CARGO_BIN_EXE_udm"), "serve"])
        .args([
            "--dev",
            "ram0=ram:64M",
            "--dev",
            "lin=0 131072 linear ram0 0",
        ])
        .args(["--handshake-timeout", "1", "--listen"])
        .arg(format!("unix:{}", sock.display()))
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let _kill = common::KillOnDrop(Some(child));
    common::wait_file(&out, "control socket at", 1, Duration::from_secs(10));
    let flood: Vec<UnixStream> = (0..300)
        .filter_map(|_| UnixStream::connect(&sock).ok())
        .collect();
    // The flood may wait in the listen backlog before the server accepts
    // past its cap: wait for the refusal rather than for a fixed time.
    let log = common::wait_file(&err, "refused", 1, Duration::from_secs(20));
    assert!(log.contains("RLIMIT_NOFILE"), "the cap was lowered: {log}");
    assert!(!log.contains("accept on"), "accept failed: {log}");
    // Past the deadline the flood's sockets are gone and a client gets in.
    let t0 = Instant::now();
    loop {
        let ok = std::panic::catch_unwind(|| {
            let uri = format!("nbd+unix:///lin?socket={}", sock.display());
            run(
                "nbdsh",
                &["-u", &uri, "-c", "assert len(h.pread(4096, 0)) == 4096"],
            );
        });
        if ok.is_ok() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no client got in");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(flood);
}
