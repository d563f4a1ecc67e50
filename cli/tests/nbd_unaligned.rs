//! NBD requests at any byte offset and length, from a client that did not
//! negotiate block sizes (libnbd with `set_request_block_size(False)` and
//! alignment checks off): the export front serves them by read-modify-write,
//! in arrival order against overlapping writes. A client that did negotiate
//! block sizes and sends them anyway gets EINVAL, as the spec asks.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use common::{run, Serve};

/// Runs against URI: byte-granular writes and reads checked against a model,
/// then 96 overlapping writes in flight at once (sub-block and aligned,
/// pipelined on one connection), each read-modify-write landing in the
/// order sent against the writes it overlaps.
const BYTES_SCRIPT: &str = r#"
import nbd, random
h.set_strict_mode(h.get_strict_mode() & ~nbd.STRICT_ALIGN)
h.set_request_block_size(False)
h.connect_uri(URI)
span = 256 << 10
model = bytearray(h.pread(span, 0))
h.pwrite(b"hello", 3)
model[3:8] = b"hello"
assert h.pread(1000, 1) == bytes(model[1:1001])
assert h.pread(1, 7) == b"o"
rng = random.Random(SEED)
for i in range(400):
    off = rng.randrange(0, span - 9000)
    n = rng.randrange(1, 9000)
    if rng.random() < 0.5:
        data = rng.randbytes(n)
        h.pwrite(data, off, flags=nbd.CMD_FLAG_FUA if i % 7 == 0 else 0)
        model[off:off + n] = data
    else:
        got = h.pread(n, off)
        assert got == bytes(model[off:off + n]), (i, off, n)
    if i % 50 == 0:
        h.flush()
# Overlapping writes in flight at once, some sub-block, some aligned. The
# front orders every read-modify-write against the writes it overlaps;
# two aligned writes in flight together are ordered by nobody (as in the
# kernel, and as NBD allows), so the aligned ones here never overlap each
# other: each takes its own 4 KiB block of the first 32.
cookies = []
aligned = list(range(32))
rng.shuffle(aligned)
for i in range(96):
    if i % 3 == 0:
        off, n = aligned.pop() * 4096, 4096
    else:
        off, n = rng.randrange(0, 32 * 4096 - 6000), rng.randrange(1, 6000)
    data = rng.randbytes(n)
    buf = nbd.Buffer.from_bytearray(bytearray(data))
    cookies.append(h.aio_pwrite(buf, off))
    model[off:off + n] = data
while h.aio_in_flight() > 0:
    h.poll(-1)
for c in cookies:
    assert h.aio_command_completed(c)
assert h.pread(span, 0) == bytes(model), "overlapping writes landed out of order"
if h.can_zero():
    h.zero(10, 4097)
    model[4097:4107] = bytes(10)
    assert h.pread(40, 4090) == bytes(model[4090:4130])
h.shutdown()
print("bytes ok")
"#;

/// A client that asked for block sizes and then sends a sub-block request.
const SIZED_SCRIPT: &str = r#"
import nbd
h.set_strict_mode(h.get_strict_mode() & ~nbd.STRICT_ALIGN)
h.connect_uri(URI)
assert h.get_block_size(nbd.SIZE_MINIMUM) == MINBLOCK, h.get_block_size(nbd.SIZE_MINIMUM)
for f in (lambda: h.pread(100, 1), lambda: h.pwrite(b"x" * 5, 3)):
    try:
        f()
        assert False, "an unaligned request after block-size negotiation succeeded"
    except nbd.Error as e:
        assert e.errno == "EINVAL", e
assert len(h.pread(MINBLOCK, 0)) == MINBLOCK
h.shutdown()
print("sized ok")
"#;

/// Export `t`: a writecache with 4 KiB blocks over RAM devices.
const WRITECACHE_4K: &[&str] = &[
    "--dev",
    "o=ram:16M",
    "--dev",
    "c=ram:8M",
    "--dev",
    "t=0 32768 writecache s o c 4096 0",
];

fn script(s: &Serve, text: &str, seed: u64, min_block: u32) -> String {
    text.replace("URI", &format!("{:?}", s.uri("t")))
        .replace("SEED", &seed.to_string())
        .replace("MINBLOCK", &min_block.to_string())
}

#[test]
fn byte_granular_requests_on_512_byte_blocks() {
    let s = Serve::start(&["--dev", "r=ram:8M", "--dev", "t=0 16384 linear r 0"]);
    let out = run("nbdsh", &["-c", &script(&s, BYTES_SCRIPT, 1, 512)]);
    assert!(out.contains("bytes ok"), "{out}");
}

#[test]
fn byte_granular_requests_on_4k_blocks_through_a_writecache() {
    let s = Serve::start(WRITECACHE_4K);
    let out = run("nbdsh", &["-c", &script(&s, BYTES_SCRIPT, 2, 4096)]);
    assert!(out.contains("bytes ok"), "{out}");
}

#[test]
fn a_client_that_negotiated_block_sizes_gets_einval_for_unaligned_requests() {
    let s = Serve::start(WRITECACHE_4K);
    let out = run("nbdsh", &["-c", &script(&s, SIZED_SCRIPT, 0, 4096)]);
    assert!(out.contains("sized ok"), "{out}");
}
