//! NBD's `base:allocation` through `udm serve` with real clients: which
//! ranges hold data and which are holes, as `nbdinfo --map`, `qemu-img map`
//! and `nbdcopy` see them, and what a careless or hostile BLOCK_STATUS gets
//! (an error or a clamped reply, never a stall or a crash).
//!
//! The stack of most tests is 10 MiB: `r`'s first 4 MiB (a RAM disk), a
//! 4 MiB `zero` target, then `r`'s next 2 MiB; data is written at 0
//! (64 KiB), 1 MiB + 4 KiB (4 KiB) and 9 MiB (4 KiB, `r` at 5 MiB).

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};

use common::raw::{Raw, CMD_READ};
use common::{run, Serve};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 10 * MIB;
/// (offset, bytes, pattern byte) written by `write_data`.
const WRITES: [(u64, u64, u8); 3] = [
    (0, 64 << 10, 0xaa),
    (MIB + 4096, 4096, 0xbb),
    (9 * MIB, 4096, 0xcc),
];
/// `base:allocation` status values.
const DATA: u32 = 0;
const HOLE: u32 = 3; // NBD_STATE_HOLE | NBD_STATE_ZERO

/// The map every client must see of the stack after `write_data`:
/// (offset, length, status).
const MAP: [(u64, u64, u32); 6] = [
    (0, 65536, DATA),
    (65536, MIB + 4096 - 65536, HOLE),
    (MIB + 4096, 4096, DATA),
    // r's unwritten rest, the zero target and r's next unwritten MiB merge.
    (MIB + 8192, 8 * MIB - 8192, HOLE),
    (9 * MIB, 4096, DATA),
    (9 * MIB + 4096, MIB - 4096, HOLE),
];

fn serve_stack() -> Serve {
    let s = Serve::start(&[
        "--dev",
        "r=ram:8M",
        "--dev",
        "t=0 8192 linear r 0; 8192 8192 zero; 16384 4096 linear r 8192",
        "--export",
        "t",
    ]);
    let mut args = vec!["-f".to_string(), "raw".into()];
    for (off, len, pat) in WRITES {
        args.push("-c".into());
        args.push(format!("write -P {pat:#x} {off} {len}"));
    }
    args.push(s.uri("t"));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    run("qemu-io", &a);
    s
}

/// The image `write_data` makes, byte for byte.
fn expected_image() -> Vec<u8> {
    let mut img = vec![0u8; SIZE as usize];
    for (off, len, pat) in WRITES {
        img[off as usize..(off + len) as usize].fill(pat);
    }
    img
}

/// `nbdinfo --map`'s lines as (offset, length, status).
fn nbdinfo_map(uri: &str) -> Vec<(u64, u64, u32)> {
    run("nbdinfo", &["--map", uri])
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect()
}

#[test]
fn nbdinfo_map_shows_the_holes_of_ram_and_zero_exactly() {
    let s = serve_stack();
    assert_eq!(nbdinfo_map(&s.uri("t")), MAP.to_vec());
}

#[test]
fn qemu_img_map_agrees() {
    let s = serve_stack();
    let out = run(
        "qemu-img",
        &["map", "--output=json", "-f", "raw", &s.uri("t")],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let got: Vec<(u64, u64, u32)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let (zero, data) = (e["zero"].as_bool().unwrap(), e["data"].as_bool().unwrap());
            let status = match (zero, data) {
                (false, true) => DATA,
                (true, false) => HOLE,
                other => panic!("unexpected zero/data {other:?} in {out}"),
            };
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                status,
            )
        })
        .collect();
    assert_eq!(got, MAP.to_vec(), "{out}");
}

/// nbdcopy skips the holes: the copy is sparse (only the 72 KiB written
/// take blocks, as `du` counts them) and its bytes equal the device's
/// (`cmp`).
#[test]
fn nbdcopy_makes_a_sparse_copy_that_compares_equal() {
    let s = serve_stack();
    let copy = s.dir.path("copy.raw");
    let want = s.dir.path("want.raw");
    std::fs::write(&want, expected_image()).unwrap();
    run("nbdcopy", &[&s.uri("t"), copy.to_str().unwrap()]);
    run("cmp", &[want.to_str().unwrap(), copy.to_str().unwrap()]);
    let blocks = std::fs::metadata(&copy).unwrap().blocks() * 512;
    assert!(
        blocks <= 72 << 10,
        "the copy takes {blocks} bytes of blocks for 72 KiB of data"
    );
    let du = run("du", &["-k", copy.to_str().unwrap()]);
    assert!(du.starts_with("72\t") || du.starts_with("68\t"), "du: {du}");
    // And SEEK_DATA finds the data where the device has it.
    let f = std::fs::File::open(&copy).unwrap();
    // SAFETY: lseek on a descriptor we own.
    let next = unsafe { libc::lseek(f.as_raw_fd(), 65536, libc::SEEK_DATA) };
    assert_eq!(next as u64, MIB + 4096);
}

/// Into a fresh RAM disk, nbdcopy of a sparse image writes only its data
/// (its holes become zeroing requests on pages never written, which stay
/// holes), and a trim gives whole pages back: the map shows both.
#[test]
fn nbdcopy_into_ram_keeps_the_holes_and_trim_makes_more() {
    let s = serve_stack();
    let img = s.dir.path("sparse.raw");
    let f = std::fs::File::create(&img).unwrap();
    f.set_len(8 * MIB).unwrap();
    f.write_all_at(&[0x11; 8192], 2 * MIB).unwrap();
    drop(f);
    let dst = Serve::start(&["--dev", "d=ram:8M", "--export", "d"]);
    run("nbdcopy", &[img.to_str().unwrap(), &dst.uri("d")]);
    assert_eq!(
        nbdinfo_map(&dst.uri("d")),
        vec![
            (0, 2 * MIB, HOLE),
            (2 * MIB, 8192, DATA),
            (2 * MIB + 8192, 6 * MIB - 8192, HOLE)
        ]
    );
    // Trim of the stack's first 64 KiB and of part of a page: the whole
    // pages become holes, the partial page stays data (zeroed).
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "discard 0 64k",
            "-c",
            "discard 1052672 2048",
            &s.uri("t"),
        ],
    );
    let mut want = MAP.to_vec();
    want.drain(..2);
    want.insert(0, (0, MIB + 4096, HOLE));
    assert_eq!(nbdinfo_map(&s.uri("t")), want);
}

/// A file backend reports its holes by SEEK_DATA/SEEK_HOLE; a map of 3072
/// alternating extents takes several replies of at most 1024 descriptors,
/// which nbdinfo asks for in turn.
#[test]
fn a_fragmented_sparse_file_is_mapped_in_bounded_replies() {
    let dir = common::TempDir::new("frag");
    let img = dir.path("img");
    let f = std::fs::File::create(&img).unwrap();
    let blocks = 3072u64;
    f.set_len(blocks * 4096).unwrap();
    for b in (0..blocks).step_by(2) {
        f.write_all_at(&[0x5a; 4096], b * 4096).unwrap();
    }
    drop(f);
    let spec = format!("t=file:{},buffered", img.display());
    let s = Serve::start(&["--dev", &spec, "--export", "t"]);
    let map = nbdinfo_map(&s.uri("t"));
    assert_eq!(map.len(), blocks as usize);
    for (i, &(off, len, st)) in map.iter().enumerate() {
        let want = if i % 2 == 0 { DATA } else { HOLE };
        assert_eq!((off, len, st), (i as u64 * 4096, 4096, want));
    }
    // One request for all of it: a prefix of at most 1024 descriptors.
    let mut c = Client::connect(&s, "t", false);
    let (n, sum) = c.block_status_ok(0, 0, (blocks * 4096) as u32);
    assert!(n <= 1024 && n > 0, "{n} descriptors");
    assert!(sum < blocks * 4096, "a prefix: {sum}");
}

/// Careless and hostile BLOCK_STATUS requests get the spec's EINVAL (zero
/// length, beyond the end, an offset that overflows) or a clamped reply
/// (the largest length over a 4 TiB device is one descriptor, REQ_ONE one
/// descriptor, an unaligned range its exact bytes), and the connection
/// goes on serving.
#[test]
fn hostile_block_status_requests_get_errors_or_clamped_replies() {
    // A 4 TiB device: a RAM disk's first MiB, then zero.
    let s = Serve::start(&[
        "--dev",
        "r=ram:1M",
        "--dev",
        "t=0 2048 linear r 0; 2048 8589932544 zero",
        "--export",
        "t",
    ]);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 1 4096 4096", &s.uri("t")],
    );
    let size = 4u64 << 40;
    // Without block sizes, any byte range is valid.
    let mut c = Client::connect(&s, "t", false);
    assert_eq!(c.block_status_err(0, 0, 0), EINVAL, "zero length");
    assert_eq!(
        c.block_status_err(0, size - 512, 1024),
        EINVAL,
        "past the end"
    );
    assert_eq!(c.block_status_err(0, size, 1), EINVAL, "at the end");
    assert_eq!(
        c.block_status_err(0, u64::MAX - 10, 100),
        EINVAL,
        "overflow"
    );
    let max = u32::MAX;
    assert_eq!(c.block_status(0, MIB, max), vec![(max, HOLE)]);
    assert_eq!(
        c.block_status(0, 0, max)[..3],
        [(4096, HOLE), (4096, DATA), (max - 8192, HOLE)]
    );
    assert_eq!(c.block_status(REQ_ONE, 0, max), vec![(4096, HOLE)]);
    assert_eq!(
        c.block_status(0, 4000, 4200),
        vec![(96, HOLE), (4096, DATA), (8, HOLE)]
    );
    assert_eq!(c.block_status(0, 5000, 1), vec![(1, DATA)]);
    c.still_reads();
    // With block sizes negotiated, an unaligned range is EINVAL.
    let mut c = Client::connect(&s, "t", true);
    assert_eq!(c.block_status_err(0, 100, 512), EINVAL);
    assert_eq!(c.block_status(0, 0, 8192), vec![(4096, HOLE), (4096, DATA)]);
    c.still_reads();
    // A client that did not select base:allocation may not ask.
    let mut c = Raw::connect(&s, 1);
    c.option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().1, REP_ACK);
    c.go("t");
    c.request(0, CMD_BLOCK_STATUS, 9, 0, 512);
    let (ty, cookie, data) = read_chunk(&mut c);
    assert_eq!((ty, cookie), (REPLY_TYPE_ERROR, 9));
    assert_eq!(be32(&data[0..4]), EINVAL);
    assert!(!s.log().contains("panicked"), "{}", s.log());
}

const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_SET_META_CONTEXT: u32 = 10;
const REP_ACK: u32 = 1;
const REP_META_CONTEXT: u32 = 4;
const INFO_BLOCK_SIZE: u16 = 3;
const CMD_BLOCK_STATUS: u16 = 7;
const REQ_ONE: u16 = 1 << 3;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
const REPLY_FLAG_DONE: u16 = 1;
const EINVAL: u32 = 22;

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b.try_into().unwrap())
}

/// Reads one structured reply chunk: (type, cookie, payload); every reply
/// here is a single chunk, so it carries the DONE flag.
fn read_chunk(c: &mut Raw) -> (u16, u64, Vec<u8>) {
    let h = c.read(20);
    assert_eq!(be32(&h[0..4]), 0x668e_33ef, "structured reply magic");
    let flags = u16::from_be_bytes([h[4], h[5]]);
    assert_eq!(flags & REPLY_FLAG_DONE, REPLY_FLAG_DONE);
    let ty = u16::from_be_bytes([h[6], h[7]]);
    let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
    let len = be32(&h[16..20]) as usize;
    (ty, cookie, c.read(len))
}

/// A raw client with structured replies and `base:allocation` selected.
struct Client {
    raw: Raw,
    ctx: u32,
    cookie: u64,
}

impl Client {
    fn connect(s: &Serve, export: &str, block_sizes: bool) -> Client {
        let mut raw = Raw::connect(s, 1);
        raw.option(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(raw.option_reply().1, REP_ACK);
        let q = b"base:allocation";
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q);
        raw.option(OPT_SET_META_CONTEXT, &d);
        let (opt, ty, data) = raw.option_reply();
        assert_eq!((opt, ty), (OPT_SET_META_CONTEXT, REP_META_CONTEXT));
        assert_eq!(&data[4..], q);
        let ctx = be32(&data[0..4]);
        assert_eq!(raw.option_reply().1, REP_ACK);
        if block_sizes {
            raw.go_asking(export, &[INFO_BLOCK_SIZE]);
        } else {
            raw.go(export);
        }
        Client {
            raw,
            ctx,
            cookie: 0,
        }
    }

    fn send(&mut self, flags: u16, offset: u64, len: u32) -> u64 {
        self.cookie += 1;
        self.raw
            .request(flags, CMD_BLOCK_STATUS, self.cookie, offset, len);
        self.cookie
    }

    /// A successful BLOCK_STATUS: its descriptors (length, status), whose
    /// lengths never exceed the request's.
    fn block_status(&mut self, flags: u16, offset: u64, len: u32) -> Vec<(u32, u32)> {
        let cookie = self.send(flags, offset, len);
        let (ty, got, data) = read_chunk(&mut self.raw);
        assert_eq!((ty, got), (REPLY_TYPE_BLOCK_STATUS, cookie), "{data:?}");
        assert_eq!(be32(&data[0..4]), self.ctx);
        let d: Vec<(u32, u32)> = data[4..]
            .chunks_exact(8)
            .map(|c| (be32(&c[0..4]), be32(&c[4..8])))
            .collect();
        assert!(!d.is_empty() && d.iter().all(|&(l, _)| l > 0), "{d:?}");
        let sum: u64 = d.iter().map(|&(l, _)| l as u64).sum();
        assert!(sum <= len as u64, "{sum} > {len}");
        d
    }

    /// (descriptors, bytes described) of a successful BLOCK_STATUS.
    fn block_status_ok(&mut self, flags: u16, offset: u64, len: u32) -> (usize, u64) {
        let d = self.block_status(flags, offset, len);
        (d.len(), d.iter().map(|&(l, _)| l as u64).sum())
    }

    /// The NBD error of a failed BLOCK_STATUS.
    fn block_status_err(&mut self, flags: u16, offset: u64, len: u32) -> u32 {
        let cookie = self.send(flags, offset, len);
        let (ty, got, data) = read_chunk(&mut self.raw);
        assert_eq!((ty, got), (REPLY_TYPE_ERROR, cookie), "{data:?}");
        be32(&data[0..4])
    }

    /// A 512-byte read still succeeds on the connection.
    fn still_reads(&mut self) {
        self.cookie += 1;
        self.raw.request(0, CMD_READ, self.cookie, 0, 512);
        let (ty, cookie, data) = read_chunk(&mut self.raw);
        assert_eq!(cookie, self.cookie);
        match ty {
            REPLY_TYPE_OFFSET_DATA => assert_eq!(data.len(), 8 + 512),
            REPLY_TYPE_NONE => {}
            other => panic!("read reply of type {other}"),
        }
    }
}
