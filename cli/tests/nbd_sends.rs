//! How replies leave: a batch is first offered to the socket with a direct
//! non-blocking sendmsg; only what a full socket buffer cannot take goes
//! through the ring. Each connection's close line counts both.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::io::Read;
use std::time::Duration;

use common::raw::{request_header, Raw, CMD_DISC, CMD_READ, CMD_WRITE};
use common::Serve;

/// A raw client in transmission on export `t`, with simple replies.
fn connect(srv: &Serve) -> Raw {
    let mut c = Raw::connect(srv, 1); // FIXED_NEWSTYLE
    c.go("t");
    c
}

/// Reads a simple reply's header; returns its cookie (error must be 0).
fn reply(c: &mut Raw) -> u64 {
    let (error, cookie) = c.simple_reply();
    assert_eq!(error, 0, "error");
    cookie
}

fn disconnect(mut c: Raw) {
    c.request(0, CMD_DISC, 0, 0, 0);
    let mut b = [0u8; 1];
    assert_eq!(c.s.read(&mut b).unwrap(), 0, "the server closes after DISC");
}

fn server() -> Serve {
    Serve::start(&[
        "--dev",
        "r=ram:64M",
        "--dev",
        "t=0 131072 linear r 0",
        "--export",
        "t",
    ])
}

/// The connection's close line.
fn close_line(log: &str) -> &str {
    close_line_of(log, 0)
}

/// The close line of the `n`th connection to close.
fn close_line_of(log: &str, n: usize) -> &str {
    log.lines()
        .filter(|l| l.contains("closed: client disconnected"))
        .nth(n)
        .unwrap_or_else(|| panic!("no close line {n}:\n{log}"))
}

/// The numbers of direct and ring sends in the connection's close line.
fn sends(log: &str) -> (u64, u64) {
    sends_of(close_line(log))
}

/// The numbers of direct and ring sends in a close line.
fn sends_of(line: &str) -> (u64, u64) {
    let rest = line.split("sends: ").nth(1).unwrap();
    let mut words = rest.split_whitespace();
    let direct = words.next().unwrap().parse().unwrap();
    assert_eq!(words.next(), Some("direct,"), "{line}");
    let ring = words.next().unwrap().parse().unwrap();
    (direct, ring)
}

/// The numbers of lent reads, and of those copied after all, in the
/// connection's close line.
fn lent(log: &str) -> (u64, u64) {
    lent_of(close_line(log))
}

/// The numbers of lent reads, and of those copied, in a close line.
fn lent_of(line: &str) -> (u64, u64) {
    let rest = line.split("lent reads: ").nth(1).unwrap();
    let mut words = rest.split_whitespace();
    let n = words.next().unwrap().parse().unwrap();
    let copied = words
        .next()
        .unwrap()
        .trim_start_matches('(')
        .parse()
        .unwrap();
    (n, copied)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn replies_to_a_client_that_waits_for_each_leave_by_direct_sendmsg_alone() {
    let s = server();
    let mut c = connect(&s);
    for i in 0..20u64 {
        let data = pattern(i, 4096);
        c.request(0, CMD_WRITE, i, i * 8192, 4096);
        c.send(&data);
        assert_eq!(reply(&mut c), i);
        c.request(0, CMD_READ, 100 + i, i * 8192, 4096);
        assert_eq!(reply(&mut c), 100 + i);
        assert_eq!(c.read(4096), data);
    }
    disconnect(c);
    let log = s.wait_log("closed: client disconnected", 1);
    // The handshake's replies and all 40 replies: an idle socket buffer
    // took every batch whole, so the ring sent nothing.
    let (direct, ring) = sends(&log);
    assert_eq!(ring, 0, "{log}");
    assert!(direct >= 40, "{log}");
}

/// Writes `n` blocks of `len` bytes (pattern `i` at block `i`), then asks
/// for all of them back at once (cookies 1000 + i) and leaves the replies
/// unread for a while, so the server meets a slow reader.
fn write_then_leave_reads_unread(c: &mut Raw, n: u64, len: usize) {
    for i in 0..n {
        c.request(0, CMD_WRITE, i, i * len as u64, len as u32);
        c.send(&pattern(i, len));
        assert_eq!(reply(c), i);
    }
    for i in 0..n {
        c.request(0, CMD_READ, 1000 + i, i * len as u64, len as u32);
    }
    std::thread::sleep(Duration::from_millis(200));
}

/// Reads the `n` replies [`write_then_leave_reads_unread`] asked for, in
/// whatever order they come: each exactly once, with its block's pattern.
fn read_back_unread(c: &mut Raw, n: u64, len: usize) {
    let mut seen = vec![false; n as usize];
    for _ in 0..n {
        let i = reply(c) - 1000;
        assert!(i < n && !seen[i as usize], "cookie {}", i + 1000);
        seen[i as usize] = true;
        assert!(c.read(len) == pattern(i, len), "read {i}: wrong data");
    }
}

#[test]
fn replies_larger_than_the_socket_buffer_finish_on_the_ring_intact() {
    let s = server();
    let mut c = connect(&s);
    const N: u64 = 16;
    const LEN: usize = 1 << 20;
    // 16 MiB of reads requested at once and not read for a while: the
    // direct sendmsg fills the socket buffer and stops part-way (or finds
    // it full), and the ring carries the rest as the client drains it.
    write_then_leave_reads_unread(&mut c, N, LEN);
    read_back_unread(&mut c, N, LEN);
    disconnect(c);
    let log = s.wait_log("closed: client disconnected", 1);
    let (direct, ring) = sends(&log);
    assert!(direct > 0 && ring > 0, "{log}");
}

#[test]
fn a_unix_client_behind_by_eight_128k_replies_does_not_push_sends_onto_the_ring() {
    // The server asks for a 1 MiB send buffer, which the kernel caps at
    // net.core.wmem_max: only meaningful where that allows it.
    let wmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/wmem_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if wmem_max < 1 << 20 {
        eprintln!("skipped: net.core.wmem_max is {wmem_max}");
        return;
    }
    let s = server();
    let mut c = connect(&s);
    const N: u64 = 8;
    const LEN: usize = 128 << 10;
    // fio's 128 KiB QD8 job, with the client slow to read: the default
    // 208 KiB buffer would fill after one and a half replies.
    write_then_leave_reads_unread(&mut c, N, LEN);
    read_back_unread(&mut c, N, LEN);
    disconnect(c);
    let log = s.wait_log("closed: client disconnected", 1);
    assert_eq!(sends(&log).1, 0, "{log}");
}

#[test]
fn reads_go_out_from_the_ram_disks_memory_without_a_copy() {
    let s = server();
    let mut c = connect(&s);
    // The RAM disk under linear lends every read that fits one bio: the
    // 128 KiB ones and the 4 KiB ones alike (checked by the counts).
    for i in 0..10u64 {
        let data = pattern(i, 128 << 10);
        c.request(0, CMD_WRITE, i, i << 17, 128 << 10);
        c.send(&data);
        assert_eq!(reply(&mut c), i);
        c.request(0, CMD_READ, 100 + i, i << 17, 128 << 10);
        assert_eq!(reply(&mut c), 100 + i);
        assert!(c.read(128 << 10) == data, "read {i}: wrong data");
        c.request(0, CMD_READ, 200 + i, (i << 17) + 4096, 4096);
        assert_eq!(reply(&mut c), 200 + i);
        assert!(
            c.read(4096) == data[4096..8192],
            "small read {i}: wrong data"
        );
    }
    // Never written: the RAM disk lends its (zero) memory too.
    c.request(0, CMD_READ, 300, 32 << 20, 64 << 10);
    assert_eq!(reply(&mut c), 300);
    assert!(
        c.read(64 << 10).iter().all(|&b| b == 0),
        "unwritten reads zero"
    );
    disconnect(c);
    let log = s.wait_log("closed: client disconnected", 1);
    assert_eq!(lent(&log), (21, 0), "{log}");
}

#[test]
fn lent_replies_completed_together_leave_in_one_sendmsg() {
    let s = server();
    // The handshake's own sends, counted on a connection that only shakes
    // hands.
    disconnect(connect(&s));
    let log = s.wait_log("closed: client disconnected", 1);
    let (hs_direct, hs_ring) = sends_of(close_line_of(&log, 0));
    // 32 reads in one write: one receive takes them all, the RAM disk lends
    // each, and their replies (on the wire, 130 KiB) complete in one pass
    // over completions, at whose end they leave together. Sent from each
    // read's completion, they would take 32 sendmsgs.
    let mut c = connect(&s);
    const N: u64 = 32;
    let mut burst = Vec::new();
    for i in 0..N {
        burst.extend(request_header(0, CMD_READ, i, i << 20, 4096));
    }
    c.send(&burst);
    let mut seen = vec![false; N as usize];
    for _ in 0..N {
        let i = reply(&mut c);
        assert!(i < N && !std::mem::replace(&mut seen[i as usize], true));
        assert!(c.read(4096).iter().all(|&b| b == 0), "read {i}: not zeroes");
    }
    disconnect(c);
    let log = s.wait_log("closed: client disconnected", 2);
    let line = close_line_of(&log, 1);
    let (direct, ring) = sends_of(line);
    assert_eq!(lent_of(line), (N, 0), "{log}");
    assert_eq!(ring, hs_ring, "{log}");
    // One sendmsg for the 32 replies; a second, were the burst split
    // across two receives.
    assert!(direct <= hs_direct + 2, "{log}");
}

#[test]
fn lent_reads_the_socket_cannot_take_at_once_are_copied_and_arrive_intact() {
    let s = server();
    let mut c = connect(&s);
    const N: u64 = 64;
    const LEN: usize = 128 << 10;
    // 8 MiB of lent reads left unread: the socket buffer fills, and every
    // reply it cannot take must be copied out of the lent memory before
    // the read's completion returns. Overwriting the blocks afterwards
    // must not change what the earlier reads return.
    write_then_leave_reads_unread(&mut c, N, LEN);
    for i in 0..N {
        c.request(0, CMD_WRITE, 2000 + i, i * LEN as u64, LEN as u32);
        c.send(&pattern(500 + i, LEN));
    }
    read_back_unread(&mut c, N, LEN);
    for _ in 0..N {
        assert!(reply(&mut c) >= 2000, "a write's reply");
    }
    disconnect(c);
    let log = s.wait_log("closed: client disconnected", 1);
    let (n, copied) = lent(&log);
    assert_eq!(n, N, "{log}");
    assert!(copied > 0 && copied < N, "{log}");
}
