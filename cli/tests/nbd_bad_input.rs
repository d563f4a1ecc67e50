//! Bad input from raw sockets: every malformed, oversized, unknown or
//! forbidden thing a client can send gets the protocol's error reply (or,
//! where the spec says so, a closed connection) and a log line, and leaves
//! the server serving everyone else.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::time::Duration;

use common::raw::{Raw, CMD_DISC, CMD_READ, CMD_WRITE, IHAVEOPT, OPT_GO, REP_ACK};
use common::Serve;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_LIST: u32 = 3;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_SET_META_CONTEXT: u32 = 10;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;
const CMD_FLUSH: u16 = 3;
const CMD_BLOCK_STATUS: u16 = 7;
const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const SIZE: u64 = 8 << 20;

fn server() -> Serve {
    Serve::start(&[
        "--dev",
        "r=ram:8M",
        "--dev",
        "t=0 16384 linear r 0",
        "--export",
        "t",
        "--export",
        "r:ro",
    ])
}

/// A connection in transmission on export `t` with simple replies.
fn transmission(s: &Serve) -> Raw {
    let mut c = Raw::connect(s, 1);
    c.go("t");
    c
}

/// A connection in transmission whose client asked for the block sizes,
/// and so promised to respect them.
fn sized_transmission(s: &Serve) -> Raw {
    let mut c = Raw::connect(s, 1);
    c.go_asking("t", &[3]);
    c
}

#[test]
fn unknown_options_get_err_unsup_and_negotiation_goes_on() {
    let s = server();
    let mut c = Raw::connect(&s, 1);
    c.option(0xdead, b"whatever");
    assert_eq!(c.option_reply().1, REP_ERR_UNSUP);
    c.option(5, &[]); // STARTTLS: udm runs NOTLS
    assert_eq!(c.option_reply().1, REP_ERR_UNSUP);
    c.go("t");
    c.still_serves();
}

#[test]
fn oversized_options_are_skipped_with_err_too_big() {
    let s = server();
    let mut c = Raw::connect(&s, 1);
    c.option(OPT_GO, &vec![7u8; 1 << 20]);
    assert_eq!(c.option_reply().1, REP_ERR_TOO_BIG);
    c.go("t");
    c.still_serves();
}

#[test]
fn malformed_options_get_err_invalid() {
    let s = server();
    let mut c = Raw::connect(&s, 1);
    // GO whose name length points past the data.
    let mut d = 1000u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"t\0\0");
    c.option(OPT_GO, &d);
    assert_eq!(c.option_reply().1, REP_ERR_INVALID);
    // LIST takes no data.
    c.option(OPT_LIST, b"x");
    assert_eq!(c.option_reply().1, REP_ERR_INVALID);
    // STRUCTURED_REPLY takes no data.
    c.option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(c.option_reply().1, REP_ERR_INVALID);
    // Metadata contexts need structured replies first.
    let mut m = 1u32.to_be_bytes().to_vec();
    m.extend_from_slice(b"t");
    m.extend_from_slice(&0u32.to_be_bytes());
    c.option(OPT_SET_META_CONTEXT, &m);
    assert_eq!(c.option_reply().1, REP_ERR_INVALID);
    // A name that is not UTF-8.
    let mut d = 2u32.to_be_bytes().to_vec();
    d.extend_from_slice(&[0xff, 0xfe]);
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(OPT_GO, &d);
    assert_eq!(c.option_reply().1, REP_ERR_INVALID);
    // An unknown export.
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"nope");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(OPT_GO, &d);
    assert_eq!(c.option_reply().1, REP_ERR_UNKNOWN);
    c.go("t");
    c.still_serves();
}

#[test]
fn unknown_client_flags_bad_option_magic_and_unknown_export_name_close_the_connection() {
    let s = server();
    let mut c = Raw::connect(&s, 1 << 7);
    assert!(c.closed(), "unknown client flags");
    let mut c = Raw::connect(&s, 1);
    c.send(&[0u8; 16]);
    assert!(c.closed(), "bad option magic");
    let mut c = Raw::connect(&s, 1);
    c.option(OPT_EXPORT_NAME, b"nope");
    assert!(c.closed(), "EXPORT_NAME cannot be refused otherwise");
    let log = s.wait_log("closed: handshake", 3);
    assert!(log.contains("unknown client flags"), "{log}");
    assert!(log.contains("bad magic"), "{log}");
    assert!(log.contains("no export 'nope'"), "{log}");
    transmission(&s).still_serves();
}

#[test]
fn bad_requests_get_error_replies_and_the_connection_goes_on() {
    let s = server();
    let mut c = sized_transmission(&s);
    let cases: &[(u16, u16, u64, u32, u32, &str)] = &[
        (0, 99, 0, 512, EINVAL, "unknown command"),
        (1 << 9, CMD_READ, 0, 512, EINVAL, "unknown flag"),
        (4, CMD_READ, 0, 512, EINVAL, "DF without SEND_DF"),
        (0, CMD_READ, SIZE, 512, EINVAL, "read past the end"),
        (0, CMD_READ, u64::MAX - 100, 512, EINVAL, "offset overflow"),
        (0, CMD_READ, 100, 512, EINVAL, "misaligned offset"),
        (0, CMD_READ, 0, 100, EINVAL, "misaligned length"),
        (
            0,
            CMD_READ,
            0,
            (32 << 20) + 512,
            EINVAL,
            "above max payload",
        ),
        (0, CMD_FLUSH, 4096, 0, EINVAL, "flush with an offset"),
        (0, CMD_BLOCK_STATUS, 0, 512, EINVAL, "no metadata context"),
    ];
    for (i, &(flags, cmd, off, len, want, what)) in cases.iter().enumerate() {
        c.request(flags, cmd, i as u64, off, len);
        assert_eq!(c.simple_reply(), (want, i as u64), "{what}");
    }
    c.still_serves();
    let log = s.wait_log("refused command", cases.len());
    assert!(log.contains("unknown command"), "{log}");
}

#[test]
fn refused_writes_have_their_payload_skipped() {
    let s = server();
    let mut c = transmission(&s);
    // Past the end: ENOSPC, and the 4 KiB payload must not be taken for requests.
    c.request(0, CMD_WRITE, 1, SIZE, 4096);
    c.send(&[0x25; 4096]);
    assert_eq!(c.simple_reply(), (ENOSPC, 1));
    // Above the maximum payload: EINVAL after the whole payload was read.
    let len = (32u32 << 20) + 4096;
    c.request(0, CMD_WRITE, 2, 0, len);
    let chunk = vec![0x25u8; 1 << 20];
    let mut left = len as usize;
    while left > 0 {
        let n = left.min(chunk.len());
        c.send(&chunk[..n]);
        left -= n;
    }
    assert_eq!(c.simple_reply(), (EINVAL, 2));
    c.still_serves();
}

#[test]
fn writes_to_a_read_only_export_get_eperm() {
    let s = server();
    let mut c = Raw::connect(&s, 1);
    let flags = c.go("r");
    assert_ne!(flags & 2, 0, "READ_ONLY advertised");
    c.request(0, CMD_WRITE, 9, 0, 512);
    c.send(&[1u8; 512]);
    assert_eq!(c.simple_reply(), (EPERM, 9));
    c.request(0, 6, 10, 0, 512); // WRITE_ZEROES
    assert_eq!(c.simple_reply(), (EPERM, 10));
    c.request(0, 4, 11, 0, 512); // TRIM
    assert_eq!(c.simple_reply(), (EPERM, 11));
    c.still_serves();
}

#[test]
fn structured_replies_carry_errors_as_error_chunks() {
    let s = server();
    let mut c = Raw::connect(&s, 1);
    c.option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().1, REP_ACK);
    c.go("t");
    c.request(0, CMD_READ, 5, SIZE, 512);
    let h = c.read(20);
    assert_eq!(&h[..4], &0x668e_33efu32.to_be_bytes());
    assert_eq!(u16::from_be_bytes([h[4], h[5]]), 1, "DONE");
    assert_eq!(
        u16::from_be_bytes([h[6], h[7]]),
        (1 << 15) + 1,
        "ERROR chunk"
    );
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let p = c.read(len);
    assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), EINVAL);
    // A good read: one OFFSET_DATA chunk with DONE.
    c.request(0, CMD_READ, 6, 4096, 512);
    let h = c.read(20);
    assert_eq!(u16::from_be_bytes([h[6], h[7]]), 1, "OFFSET_DATA");
    let p = c.read(u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize);
    assert_eq!(u64::from_be_bytes(p[..8].try_into().unwrap()), 4096);
    assert_eq!(p.len(), 8 + 512);
}

#[test]
fn a_bad_request_magic_closes_the_connection() {
    let s = server();
    let mut c = transmission(&s);
    c.send(&[0u8; 28]);
    assert!(c.closed());
    s.wait_log("request: bad magic", 1);
    transmission(&s).still_serves();
}

#[test]
fn clients_that_vanish_mid_request_or_mid_payload_affect_nobody_else() {
    let s = server();
    let mut other = transmission(&s);
    // Half a header.
    let mut c = transmission(&s);
    c.send(&0x2560_9513u32.to_be_bytes());
    drop(c);
    // A write header and half its payload.
    let mut c = transmission(&s);
    c.request(0, CMD_WRITE, 1, 0, 65536);
    c.send(&[3u8; 30000]);
    drop(c);
    // A handshake cut in the middle of an option.
    let mut c = Raw::connect(&s, 1);
    c.send(&IHAVEOPT.to_be_bytes());
    drop(c);
    let log = s.wait_log("closed: client closed the connection", 3);
    assert!(log.contains("mid-request"), "{log}");
    assert!(log.contains("mid-payload"), "{log}");
    other.still_serves();
    // The half-written payload was never submitted: block 0 still reads as before.
    other.request(0, CMD_READ, 2, 0, 512);
    assert_eq!(other.simple_reply(), (0, 2));
    assert_eq!(other.read(512), vec![0u8; 512]);
    other.request(0, CMD_DISC, 3, 0, 0);
    assert!(other.closed());
}

#[test]
fn a_refused_write_cut_mid_payload_leaves_nothing_behind() {
    let mut s = server();
    let mut c = transmission(&s);
    c.request(0, CMD_WRITE, 1, SIZE, 65536);
    c.send(&[3u8; 1000]);
    drop(c);
    s.wait_log("mid-payload", 1);
    // The connection was freed: shutdown does not wait for it.
    assert_eq!(s.stop().code(), Some(0));
}

#[test]
fn sigterm_with_idle_and_half_sent_clients_still_exits_zero_promptly() {
    let mut s = server();
    let _idle_handshake = Raw::connect(&s, 1);
    let mut idle = transmission(&s);
    idle.still_serves();
    let mut half = transmission(&s);
    half.request(0, CMD_WRITE, 1, 0, 65536);
    half.send(&[3u8; 1000]);
    let t0 = std::time::Instant::now();
    assert_eq!(s.stop().code(), Some(0), "{}", s.log());
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert!(idle.closed());
    let log = s.log();
    assert!(log.contains("server shutting down"), "{log}");
}
