//! `udm serve` with real NBD clients: fio (nbd engine, crc32c verify),
//! qemu-img, qemu-io, nbdinfo, nbdcopy and nbdsh, over unix sockets.
//! The tools come from scripts/setup.sh.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use common::{random_file, run, Serve};

/// Every target type udm has that stores data, plus the backends, each
/// exported as `t` (16 MiB).
const STACKS: &[(&str, &[&str])] = &[
    ("ram", &["--dev", "t=ram:16M"]),
    (
        "linear",
        &["--dev", "r=ram:32M", "--dev", "t=0 32768 linear r 8192"],
    ),
    (
        "striped",
        &[
            "--dev",
            "a=ram:8M",
            "--dev",
            "b=ram:8M",
            "--dev",
            "t=0 32768 striped 2 8 a 0 b 0",
        ],
    ),
    (
        "linear-over-two",
        &[
            "--dev",
            "a=ram:8M",
            "--dev",
            "b=ram:8M",
            "--dev",
            "t=0 16384 linear a 0; 16384 16384 linear b 0",
        ],
    ),
    (
        // A cache a quarter of the origin: writeback runs during the job.
        "writecache",
        &[
            "--dev",
            "o=ram:16M",
            "--dev",
            "c=ram:4M",
            "--dev",
            "t=0 32768 writecache s o c 4096 4 high_watermark 30 low_watermark 20",
        ],
    ),
];

fn fio(uri: &str, rw: &str, bs: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "--name=v".to_string(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        format!("--rw={rw}"),
        format!("--bs={bs}"),
        "--iodepth=16".into(),
        "--size=8M".into(),
        "--verify=crc32c".into(),
        "--do_verify=1".into(),
        "--verify_fatal=1".into(),
        // No verify state file dropped in the working directory.
        "--verify_state_save=0".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("fio", &a);
    assert!(out.contains("err= 0"), "fio reported errors:\n{out}");
    out
}

#[test]
fn fio_verifies_random_and_sequential_writes_over_every_target_type() {
    for (what, args) in STACKS {
        let mut args = args.to_vec();
        args.extend(["--export", "t"]);
        let s = Serve::start(&args);
        fio(&s.uri("t"), "randwrite", "4k", &[]);
        fio(&s.uri("t"), "write", "64k", &["--offset=4M"]);
        fio(
            &s.uri("t"),
            "randwrite",
            "4k",
            &["--offset=8M", "--size=4M"],
        );
        let log = s.log();
        assert!(!log.contains("refused command"), "{what}: {log}");
    }
}

/// Reactors that spin (`--poll`) or spin then sleep (`--hybrid USEC`)
/// serve the same data as sleeping ones.
#[test]
fn poll_and_hybrid_reactors_serve_verified_io() {
    for mode in [&["--hybrid", "50"][..], &["--poll"][..]] {
        let mut args = vec!["--dev", "t=ram:16M"];
        args.extend_from_slice(mode);
        let s = Serve::start(&args);
        fio(&s.uri("t"), "randwrite", "4k", &["--iodepth=1"]);
        fio(&s.uri("t"), "write", "64k", &[]);
    }
}

#[test]
fn fio_verifies_over_a_file_backend() {
    let dir = common::TempDir::new("file");
    let f = dir.path("img");
    let spec = format!("t=file:{},size=16M", f.display());
    let s = Serve::start(&["--dev", &spec, "--export", "t"]);
    fio(&s.uri("t"), "randwrite", "4k", &[]);
    fio(&s.uri("t"), "write", "128k", &[]);
}

#[test]
fn two_clients_at_once_on_one_export() {
    let s = Serve::start(&["--dev", "t=ram:16M", "--reactors", "2"]);
    let uri = s.uri("t");
    let u2 = uri.clone();
    let a = std::thread::spawn(move || fio(&u2, "randwrite", "4k", &["--offset=0", "--size=6M"]));
    fio(&uri, "randwrite", "8k", &["--offset=8M", "--size=6M"]);
    a.join().unwrap();
}

#[test]
fn qemu_img_copies_a_random_image_in_and_compares_it() {
    let s = Serve::start(&["--dev", "r=ram:8M", "--dev", "t=0 16384 linear r 0"]);
    let img = s.dir.path("img.raw");
    random_file(&img, 8 << 20, 42);
    let img = img.to_str().unwrap();
    run(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", img, &s.uri("t")],
    );
    let out = run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img, &s.uri("t")],
    );
    assert!(out.contains("identical"), "{out}");
}

#[test]
fn qemu_io_reads_back_what_it_wrote() {
    let s = Serve::start(&["--dev", "t=ram:8M"]);
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xab 4096 64k",
            "-c",
            "read -P 0xab 4096 64k",
            "-c",
            "read -P 0 0 4096",
            "-c",
            "flush",
            &s.uri("t"),
        ],
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(out.contains("read 65536/65536 bytes"), "{out}");
}

#[test]
fn nbdinfo_shows_size_flags_and_block_sizes() {
    let s = Serve::start(&[
        "--dev",
        "a=ram:8M",
        "--dev",
        "b=ram:8M",
        "--dev",
        "t=0 32768 striped 2 128 a 0 b 0",
        "--export",
        "t",
        "--export",
        "a:ro",
    ]);
    let out = run("nbdinfo", &["--json", &s.uri("t")]);
    for want in [
        "\"export-size\": 16777216",
        "\"block_size_minimum\": 512",
        // A stripe width of 2 x 64 KiB is the preferred size.
        "\"block_size_preferred\": 131072",
        "\"block_size_maximum\": 33554432",
        "\"can_multi_conn\": true",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_fast_zero\": true",
        "\"can_cache\": true",
        "\"is_read_only\": false",
    ] {
        assert!(out.contains(want), "missing {want} in:\n{out}");
    }
    let ro = run("nbdinfo", &["--json", &s.uri("a")]);
    assert!(ro.contains("\"is_read_only\": true"), "{ro}");
    assert!(ro.contains("\"can_trim\": false"), "{ro}");
    let list = run("nbdinfo", &["--list", &s.uri("")]);
    assert!(
        list.contains("export=\"t\"") && list.contains("export=\"a\""),
        "{list}"
    );
}

#[test]
fn nbdcopy_round_trips_an_image() {
    let s = Serve::start(&["--dev", "t=ram:8M"]);
    let img = s.dir.path("in.raw");
    let back = s.dir.path("out.raw");
    random_file(&img, 8 << 20, 7);
    run("nbdcopy", &[img.to_str().unwrap(), &s.uri("t")]);
    run("nbdcopy", &[&s.uri("t"), back.to_str().unwrap()]);
    assert!(std::fs::read(&img).unwrap() == std::fs::read(&back).unwrap());
}

/// TRIM, WRITE_ZEROES (with and without FAST_ZERO), FUA, CACHE and
/// BLOCK_STATUS through libnbd.
const NBDSH_SCRIPT: &str = r#"
import nbd
h.set_request_structured_replies(True)
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.set_uri_allow_local_file(True)
h.connect_uri(URI)
assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
assert h.get_size() == 8 * 1024 * 1024
h.pwrite(b"\xaa" * 65536, 0, nbd.CMD_FLAG_FUA)
assert h.pread(65536, 0) == b"\xaa" * 65536
h.zero(4096, 4096)
assert h.pread(4096, 4096) == b"\0" * 4096
h.zero(4096, 8192, nbd.CMD_FLAG_FAST_ZERO)
assert h.pread(4096, 8192) == b"\0" * 4096
h.zero(4096, 12288, nbd.CMD_FLAG_NO_HOLE | nbd.CMD_FLAG_FUA)
h.trim(8192, 32768)
h.cache(65536, 0)
h.flush()
seen = []
def cb(metacontext, offset, entries, err):
    seen.append((metacontext, offset, list(entries)))
    return 0
h.block_status(65536, 0, cb)
assert seen[0][0] == nbd.CONTEXT_BASE_ALLOCATION, seen
assert sum(seen[0][2][0::2]) >= 65536, seen
seen.clear()
h.block_status(65536, 0, cb, nbd.CMD_FLAG_REQ_ONE)
assert len(seen[0][2]) == 2, seen
# A read past the end fails with EINVAL and the connection goes on.
try:
    h.pread(4096, 8 * 1024 * 1024)
    assert False, "read past the end succeeded"
except nbd.Error as e:
    assert e.errno == "EINVAL", e
assert h.pread(512, 0) == b"\xaa" * 512
h.shutdown()
print("nbdsh ok")
"#;

#[test]
fn nbdsh_exercises_trim_zero_fast_zero_fua_cache_and_block_status() {
    let s = Serve::start(&["--dev", "r=ram:8M", "--dev", "t=0 16384 linear r 0"]);
    let script = NBDSH_SCRIPT.replace("URI", &format!("{:?}", s.uri("t")));
    let out = run("nbdsh", &["-c", &script]);
    assert!(out.contains("nbdsh ok"), "{out}");
    s.wait_log("closed: client disconnected (NBD_CMD_DISC)", 1);
}

#[test]
fn zero_and_error_targets_read_zeroes_and_fail_with_eio() {
    let s = Serve::start(&[
        "--dev",
        "z=0 8192 zero",
        "--dev",
        "e=0 8192 error",
        "--export",
        "z",
        "--export",
        "e",
    ]);
    let script = format!(
        r#"
import nbd
h.connect_uri({z:?})
assert h.pread(4096, 0) == b"\0" * 4096
h.pwrite(b"x" * 512, 0)
h.shutdown()
g = nbd.NBD()
g.connect_uri({e:?})
try:
    g.pread(512, 0)
    assert False
except nbd.Error as err:
    assert err.errno == "EIO", err
print("ok")
"#,
        z = s.uri("z"),
        e = s.uri("e")
    );
    let out = run("nbdsh", &["-c", &script]);
    assert!(out.contains("ok"), "{out}");
}

#[test]
fn sigterm_finishes_flushes_and_exits_zero() {
    let mut s = Serve::start(&["--dev", "t=ram:8M"]);
    fio(&s.uri("t"), "randwrite", "4k", &["--size=2M"]);
    let sock = s.sock.clone();
    let st = s.stop();
    assert_eq!(st.code(), Some(0), "{}", s.log());
    assert!(!sock.exists(), "the socket file is removed");
    let log = s.log();
    assert!(log.contains("devices flushed"), "{log}");
}

#[test]
fn a_config_file_holds_the_dev_specs() {
    let dir = common::TempDir::new("cfg");
    let cfg = dir.path("stack.conf");
    std::fs::write(
        &cfg,
        "# two RAM disks and a stripe\na=ram:4M\nb=ram:4M\nt=0 16384 striped 2 8 a 0 b 0\n",
    )
    .unwrap();
    let s = Serve::start(&["--config", cfg.to_str().unwrap()]);
    let out = run("nbdinfo", &["--size", &s.uri("t")]);
    assert_eq!(out.trim(), "8388608");
}

/// The server's resident memory, in KiB.
fn rss_kib(s: &Serve) -> u64 {
    let pid = s.child.as_ref().unwrap().id();
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    st.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn a_ram_disk_grows_by_the_pages_written_and_no_more() {
    let s = Serve::start(&[
        "--dev",
        "r=ram:256M",
        "--dev",
        "t=0 524288 linear r 0",
        "--export",
        "t",
    ]);
    let before = rss_kib(&s);
    // Every other 4 KiB page of 64 MiB: 32 MiB of pages, none adjacent.
    run(
        "fio",
        &[
            "--name=w",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("t")),
            "--rw=write:4k",
            "--bs=4k",
            "--size=64M",
            "--iodepth=16",
        ],
    );
    // Reads of never-written space take no memory either.
    run(
        "fio",
        &[
            "--name=r",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("t")),
            "--rw=read",
            "--bs=1M",
            "--offset=128M",
            "--size=64M",
        ],
    );
    let grew = rss_kib(&s) - before;
    // 32 MiB of data plus slack for connection buffers; a heap page per
    // 4 KiB from memalign took twice the data.
    assert!(
        (32 << 10..(32 << 10) + (8 << 10)).contains(&grew),
        "grew by {grew} KiB for 32768 KiB written"
    );
}
