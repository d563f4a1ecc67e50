//! `udm serve` over TCP: a real client (fio's nbd engine, nbdinfo) on
//! `nbd://127.0.0.1:PORT/lin`, and a bare `--listen PORT` listening on
//! loopback only.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use common::{free_port, run, Serve};

const STACK: &[&str] = &[
    "--dev",
    "ram0=ram:32M",
    "--dev",
    "lin=0 65536 linear ram0 0",
    "--export",
    "lin",
];

/// The local addresses listening on TCP `port`, from /proc/net/tcp, each
/// once: the kernel builds that file a page at a time, so while other tests
/// open and close sockets a read can list one socket twice.
fn listeners_on(port: u16) -> Vec<Ipv4Addr> {
    let t = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let mut v: Vec<Ipv4Addr> = t
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (addr, p) = f.get(1)?.split_once(':')?;
            // State 0A is LISTEN.
            if f.get(3) != Some(&"0A") || u16::from_str_radix(p, 16).ok()? != port {
                return None;
            }
            // /proc prints the address as a host-order u32 (little endian here).
            let a = u32::from_str_radix(addr, 16).ok()?;
            Some(Ipv4Addr::from(a.swap_bytes()))
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

/// This machine's address on its default route, if it has one.
fn non_loopback_addr() -> Option<Ipv4Addr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?; // TEST-NET-1: no packet is sent
    match s.local_addr().ok()? {
        SocketAddr::V4(a) if !a.ip().is_loopback() && !a.ip().is_unspecified() => Some(*a.ip()),
        _ => None,
    }
}

#[test]
fn fio_and_nbdinfo_work_over_tcp_on_an_explicit_loopback_port() {
    let port = free_port();
    let d = common::TempDir::new("tcp");
    let ctl = d.path("ctl");
    let listen = format!("127.0.0.1:{port}");
    let mut args = STACK.to_vec();
    let ctl_s = ctl.to_str().unwrap();
    args.extend(["--listen", &listen, "--control", ctl_s]);
    let mut s = Serve::start_as_given(&args);
    let uri = format!("nbd://127.0.0.1:{port}/lin");
    assert!(s.out().contains(&format!("at {uri}\n")), "{}", s.out());

    let info = run("nbdinfo", &["--size", &uri]);
    assert_eq!(info.trim(), (32u64 << 20).to_string());
    let out = run(
        "fio",
        &[
            "--name=v",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=8M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ],
    );
    assert!(out.contains("err= 0"), "{out}");
    // 128 KiB reads are lent by the RAM disk and sent from their end_io;
    // TCP's socket buffer starts small, so parts of them are copied and
    // finish on the ring.
    let out = run(
        "fio",
        &[
            "--name=v",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=write",
            "--bs=128k",
            "--iodepth=8",
            "--offset=8M",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ],
    );
    assert!(out.contains("err= 0"), "{out}");
    assert!(s.log().contains("tcp 127.0.0.1:"), "{}", s.log());

    assert!(s.stop().success(), "{}", s.log());
    // Every connection has logged its close line by the time the server exits.
    assert!(
        s.log()
            .lines()
            .any(|l| l.contains("lent reads: ") && !l.contains("lent reads: 0 ")),
        "no lent reads:\n{}",
        s.log()
    );
    assert!(!ctl.exists());
}

#[test]
fn a_bare_port_listens_on_loopback_only() {
    let port = free_port();
    let p = port.to_string();
    let mut args = STACK.to_vec();
    args.extend(["--listen", &p]);
    let mut s = Serve::start_as_given(&args);
    let uri = format!("nbd://127.0.0.1:{port}/lin");
    assert!(s.out().contains(&format!("at {uri}\n")), "{}", s.out());
    assert_eq!(listeners_on(port), vec![Ipv4Addr::LOCALHOST]);
    run("nbdinfo", &["--size", &uri]);
    if let Some(ip) = non_loopback_addr() {
        let r = TcpStream::connect_timeout(&SocketAddr::from((ip, port)), Duration::from_secs(2));
        assert!(r.is_err(), "reachable on {ip}:{port}");
    }
    // Without a unix socket, the control socket goes to the runtime (or
    // temporary) directory, and away again at exit.
    let ctl = s.ctl();
    assert!(
        ctl.file_name().unwrap().to_string_lossy().ends_with(".ctl"),
        "{ctl:?}"
    );
    let ctl_s = ctl.to_str().unwrap().to_string();
    let (code, out, err) = common::udm(&["status", "--control", &ctl_s, "lin"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "lin: 0 65536 linear\n");
    assert!(s.stop().success(), "{}", s.log());
    assert!(!ctl.exists());
}
