//! vhost-user-blk exports through the daemon, with libblkio's
//! `virtio-blk-vhost-user` driver as the frontend (a real client that puts
//! virtio requests in shared memory as a guest's driver does), and a raw
//! socket client that sends what no frontend should.

// Test support: a failed setup step is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use common::daemon::Daemon;

const BUF: usize = 1 << 20;

/// A libblkio client with one shared buffer of 1 MiB.
struct Client {
    _b: Blkio,
    queues: Vec<Blkioq>,
    region: MemoryRegion,
}

impl Client {
    fn connect(path: &Path, queues: i32) -> Client {
        let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
        b.set_str("path", path.to_str().unwrap()).unwrap();
        b.connect().unwrap();
        b.set_i32("num-queues", queues).unwrap();
        let q = b.start().unwrap().queues;
        let region = b.alloc_mem_region(BUF).unwrap();
        b.map_mem_region(&region).unwrap();
        Client {
            _b: b,
            queues: q,
            region,
        }
    }

    fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is BUF bytes mapped for the client's life; the
        // server writes it only during a request, which `run` waits for.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, BUF) }
    }

    fn run(&mut self, q: usize, read: bool, off: u64, len: usize) -> i32 {
        let p = self.region.addr as *mut u8;
        let q = &mut self.queues[q];
        if read {
            q.read(off, p, len, 0, ReqFlags::empty());
        } else {
            q.write(off, p, len, 0, ReqFlags::empty());
        }
        let mut c = [MaybeUninit::<Completion>::uninit()];
        assert_eq!(q.do_io(&mut c, 1, None, None).unwrap(), 1);
        // SAFETY: do_io filled the first completion.
        unsafe { c[0].assume_init_read() }.ret
    }
}

/// The export's line in `udm export ls`.
fn ls_line(d: &Daemon, name: &str) -> String {
    d.ok(&["export", "ls"])
        .lines()
        .find(|l| l.starts_with(&format!("{name}\t")))
        .unwrap_or_default()
        .to_string()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes 64 KiB on queue 1, reads them back on queue 0.
fn write_and_read_back(c: &mut Client, off: u64, seed: u8) {
    let data: Vec<u8> = (0..65536).map(|i| (i as u8) ^ seed).collect();
    c.buf()[..65536].copy_from_slice(&data);
    assert_eq!(c.run(1, false, off, 65536), 0);
    c.buf()[..65536].fill(0);
    assert_eq!(c.run(0, true, off, 65536), 0);
    assert!(c.buf()[..65536] == data[..]);
}

#[test]
fn export_add_serves_a_frontend_ls_shows_it_and_remove_takes_the_socket_away() {
    let d = Daemon::start(&[]);
    let sock = d.dir.path("r.vhost");
    let s = sock.to_str().unwrap();
    d.ok(&["create", "r", "ram:64M"]);
    d.ok(&["export", "add", "r", "--vhost-user-blk", s, "--queues", "2"]);
    let line = ls_line(&d, "r");
    assert!(
        line.contains("vhost-user-blk") && line.contains(s),
        "{line}"
    );
    assert!(line.ends_with("0 clients"), "{line}");
    let mut c = Client::connect(&sock, 2);
    write_and_read_back(&mut c, 1 << 20, 3);
    assert!(ls_line(&d, "r").ends_with("1 clients"));
    // Not while a frontend is connected, unless forced.
    let err = d.fails(&["export", "remove", "r"]);
    assert!(err.contains("frontend is connected"), "{err}");
    drop(c);
    wait_for("the frontend leaves", || {
        ls_line(&d, "r").ends_with("0 clients")
    });
    d.ok(&["export", "remove", "r"]);
    assert!(!sock.exists());
    assert_eq!(ls_line(&d, "r"), "");
    // The device is free again.
    d.ok(&["remove", "r"]);
}

#[test]
fn remove_force_and_daemon_stop_disconnect_the_frontend() {
    let mut d = Daemon::start(&[]);
    let (a, b) = (d.dir.path("a.vhost"), d.dir.path("b.vhost"));
    d.ok(&["create", "r", "ram:16M"]);
    d.ok(&["create", "q", "ram:16M"]);
    d.ok(&[
        "export",
        "add",
        "r",
        "--vhost-user-blk",
        a.to_str().unwrap(),
        "--queues",
        "2",
    ]);
    d.ok(&[
        "export",
        "add",
        "q",
        "--vhost-user-blk",
        b.to_str().unwrap(),
        "--queues",
        "2",
    ]);
    let mut c = Client::connect(&a, 2);
    write_and_read_back(&mut c, 0, 1);
    d.ok(&["export", "remove", "--force", "r"]);
    assert!(!a.exists());
    let mut c2 = Client::connect(&b, 2);
    write_and_read_back(&mut c2, 0, 2);
    assert!(d.stop().success(), "{}", d.log());
    assert!(!b.exists(), "the daemon's stop removes the socket");
    drop((c, c2));
}

#[test]
fn a_config_file_entry_starts_a_vhost_user_blk_export() {
    let dir = common::TempDir::new("vhost-config");
    let cfg = dir.path("udm.toml");
    let sock = dir.path("r.vhost");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"r\"\nspec = \"ram:16M\"\n\n\
             [[export]]\ndevice = \"r\"\nvhost_user_blk = \"{}\"\nqueues = 2\n",
            sock.display()
        ),
    )
    .unwrap();
    let d = Daemon::start_in(dir, &["--config", cfg.to_str().unwrap()]);
    let mut c = Client::connect(&sock, 2);
    write_and_read_back(&mut c, 8192, 4);
    drop(c);
    let dump = d.ok(&["dump-config"]);
    assert!(
        dump.contains("vhost_user_blk") && dump.contains("queues = 2"),
        "{dump}"
    );
}

#[test]
fn udm_serve_serves_one_device_over_vhost_user_blk_until_sigterm() {
    let dir = common::TempDir::new("vhost-serve");
    let sock = dir.path("lin.vhost");
    let mut srv = common::Serve::start_as_given(&[
        "--vhost-user-blk",
        sock.to_str().unwrap(),
        "--queues",
        "2",
    ]);
    assert!(
        srv.out().contains("over vhost-user-blk at"),
        "{}",
        srv.out()
    );
    let mut c = Client::connect(&sock, 2);
    write_and_read_back(&mut c, 1 << 29, 6);
    drop(c);
    let mut child = srv.child.take().unwrap();
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success(), "{}", srv.log());
    assert!(!sock.exists());
}

#[test]
fn udm_serve_over_vhost_user_blk_takes_queued_dispatch_and_says_so() {
    let dir = common::TempDir::new("vhost-serve-queued");
    let sock = dir.path("r.vhost");
    let srv = common::Serve::start_as_given(&[
        "--dev",
        "r=ram:4M",
        "--vhost-user-blk",
        sock.to_str().unwrap(),
        "--queues",
        "2",
        "--dispatch",
        "queued",
    ]);
    assert!(
        srv.out().contains("dispatch queued (asked for)"),
        "{}",
        srv.out()
    );
    let mut c = Client::connect(&sock, 2);
    write_and_read_back(&mut c, 8192, 7);
}

#[test]
fn a_vhost_user_blk_export_refuses_options_it_does_not_take() {
    let d = Daemon::start(&[]);
    let sock = d.dir.path("r.vhost");
    let s = sock.to_str().unwrap();
    d.ok(&["create", "r", "ram:1M"]);
    let err = d.fails(&["export", "add", "r", "--vhost-user-blk", s, "--depth", "8"]);
    assert!(err.contains("takes no --depth"), "{err}");
    let err = d.fails(&["export", "add", "r", "--vhost-user-blk", s, "--queues", "0"]);
    assert!(err.contains("--queues 0"), "{err}");
    assert!(!sock.exists());
}

// ---------------------------------------------------------------------------
// A frontend that sends what it should not.

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_VRING_NUM: u32 = 8;
const GET_VRING_BASE: u32 = 11;
const SET_VRING_KICK: u32 = 12;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const VERSION: u32 = 1;
const NEED_REPLY: u32 = 8;
const REPLY_ACK: u64 = 1 << 3;
const NOFD: u64 = 1 << 8;

struct Raw(UnixStream);

impl Raw {
    fn connect(path: &Path) -> Raw {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw(s)
    }

    fn send(&mut self, req: u32, flags: u32, body: &[u8]) {
        let mut m = Vec::new();
        m.extend_from_slice(&req.to_le_bytes());
        m.extend_from_slice(&(flags | VERSION).to_le_bytes());
        m.extend_from_slice(&(body.len() as u32).to_le_bytes());
        m.extend_from_slice(body);
        self.0
            .write_all(&m)
            .unwrap_or_else(|e| panic!("sending request {req}: {e}"));
    }

    /// A reply's u64 body.
    fn reply_u64(&mut self, req: u32) -> u64 {
        let mut h = [0u8; 20];
        self.0
            .read_exact(&mut h)
            .unwrap_or_else(|e| panic!("reply to {req}: {e}"));
        assert_eq!(u32::from_le_bytes(h[0..4].try_into().unwrap()), req);
        assert_eq!(u32::from_le_bytes(h[8..12].try_into().unwrap()), 8);
        u64::from_le_bytes(h[12..20].try_into().unwrap())
    }

    /// The server closed the connection (EOF, or a reset).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }

    fn negotiate_reply_ack(&mut self) {
        self.send(GET_FEATURES, 0, &[]);
        let f = self.reply_u64(GET_FEATURES);
        self.send(SET_FEATURES, 0, &f.to_le_bytes());
        self.send(GET_PROTOCOL_FEATURES, 0, &[]);
        let p = self.reply_u64(GET_PROTOCOL_FEATURES);
        assert!(p & REPLY_ACK != 0);
        self.send(SET_PROTOCOL_FEATURES, 0, &REPLY_ACK.to_le_bytes());
    }
}

fn vring_state(index: u32, num: u32) -> Vec<u8> {
    [index.to_le_bytes(), num.to_le_bytes()].concat()
}

#[test]
fn a_frontend_that_breaks_the_protocol_is_refused_and_the_export_serves_the_next() {
    let d = Daemon::start(&[]);
    let sock = d.dir.path("r.vhost");
    d.ok(&["create", "r", "ram:16M"]);
    d.ok(&[
        "export",
        "add",
        "r",
        "--vhost-user-blk",
        sock.to_str().unwrap(),
        "--queues",
        "2",
    ]);

    // Requests out of place get an error reply and the connection goes on.
    let mut raw = Raw::connect(&sock);
    raw.negotiate_reply_ack();
    // A kick before any memory table, without an eventfd.
    raw.send(SET_VRING_KICK, NEED_REPLY, &NOFD.to_le_bytes());
    assert_ne!(raw.reply_u64(SET_VRING_KICK), 0);
    // A queue past the two offered, a size not a power of two.
    raw.send(SET_VRING_NUM, NEED_REPLY, &vring_state(5, 128));
    assert_ne!(raw.reply_u64(SET_VRING_NUM), 0);
    raw.send(SET_VRING_NUM, NEED_REPLY, &vring_state(0, 100));
    assert_ne!(raw.reply_u64(SET_VRING_NUM), 0);
    raw.send(SET_VRING_NUM, NEED_REPLY, &vring_state(0, 128));
    assert_eq!(raw.reply_u64(SET_VRING_NUM), 0);
    // A request that must be answered with a value cannot be refused by
    // status: the frontend is disconnected.
    raw.send(GET_VRING_BASE, 0, &vring_state(9, 0));
    assert!(raw.closed());

    // Unknown requests, a body shorter than its header says, a huge size,
    // garbage: each ends the connection.
    let cases: [&[u8]; 4] = [
        &[0x0f, 0x27, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        &[2, 0, 0, 0, 1, 0, 0, 0, 4, 0, 0, 0, 1, 2, 3, 4],
        &[2, 0, 0, 0, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
        &[0xde, 0xad, 0xbe, 0xef, 0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0],
    ];
    for m in cases {
        let mut raw = Raw::connect(&sock);
        raw.0.write_all(m).unwrap();
        assert!(raw.closed(), "{m:?}: {}", d.log());
    }

    // A frontend that sends half a message and goes: the next one is
    // served.
    let mut half = Raw::connect(&sock);
    half.0.write_all(&[1, 0, 0]).unwrap();
    drop(half);

    let mut c = Client::connect(&sock, 2);
    write_and_read_back(&mut c, 4096, 9);
    drop(c);
    assert!(
        d.log().contains("queue index 5 past the 2 queues offered"),
        "{}",
        d.log()
    );

    // One that sends half a message and waits does not hold up a forced
    // remove: it is cut.
    let mut half = Raw::connect(&sock);
    half.0.write_all(&[1, 0, 0]).unwrap();
    wait_for("the frontend is counted", || {
        ls_line(&d, "r").ends_with("1 clients")
    });
    let t0 = Instant::now();
    d.ok(&["export", "remove", "--force", "r"]);
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(half.closed());
    assert!(!sock.exists());
}
