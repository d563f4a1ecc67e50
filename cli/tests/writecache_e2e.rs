//! End to end: `udm bench --verify` through a writecache device (with and
//! without coalescing, and with a cache small enough that writeback runs
//! during the run), `udm status` / `udm message` on it, and NBD TRIM.

mod common;

use common::{run, udm, Serve};

#[test]
fn bench_verify_through_writecache_finds_no_mismatches() {
    for (cache, feats, rw) in [
        ("ram:64M", "0", "randwrite"),
        ("ram:64M", "1 nocoalesce", "write"),
        // 8 MiB of cache for 32 MiB of data: writeback runs throughout.
        (
            "ram:8M",
            "4 high_watermark 30 low_watermark 10",
            "randwrite",
        ),
    ] {
        let table = format!("wc=0 65536 writecache s o c 4096 {feats}");
        let (code, out, err) = udm(&[
            "bench",
            "--dev",
            "o=ram:64M",
            "--dev",
            &format!("c={cache}"),
            "--dev",
            &table,
            "--target",
            "wc",
            "--rw",
            rw,
            "--bs",
            "64k",
            "--size",
            "32M",
            "--verify",
            "--json",
        ]);
        assert_eq!(code, 0, "{table} {rw}: {out}\n{err}");
        assert!(out.contains("\"mismatches\":0"), "{table}: {out}");
        assert!(out.contains("\"errors\":0"), "{table}: {out}");
    }
}

#[test]
fn status_and_message_commands_work_on_a_writecache_device() {
    let devs = common::WC_DEVS;
    let mut a = vec!["status"];
    a.extend_from_slice(&devs);
    a.push("wc");
    let (code, out, err) = udm(&a);
    assert_eq!(code, 0, "{err}");
    let f: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(&f[..4], &["wc:", "0", "32768", "writecache"], "{out}");
    assert_eq!(f.len(), 4 + 14, "{out}");
    let mut m = vec!["message"];
    m.extend_from_slice(&devs);
    m.extend_from_slice(&["wc", "flush"]);
    let (code, _, err) = udm(&m);
    assert_eq!(code, 0, "{err}");
    let mut bad = vec!["message"];
    bad.extend_from_slice(&devs);
    bad.extend_from_slice(&["wc", "0", "frobnicate"]);
    let (code, _, err) = udm(&bad);
    assert_eq!(code, 2);
    assert!(err.contains("unknown message 'frobnicate'"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// Exported over NBD, a writecache device over a RAM origin offers TRIM
/// (its discard is passed on to the origin), and a trim of cached data
/// reads back as the origin's discarded space.
#[test]
fn nbd_offers_trim_on_a_writecache_and_trimmed_data_is_gone() {
    let s = Serve::start(&[
        "--dev",
        "o=ram:16M",
        "--dev",
        "c=ram:4M",
        "--dev",
        "wc=0 32768 writecache s o c 4096 0",
        "--export",
        "wc",
    ]);
    let script = r#"
import nbd
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.connect_uri(URI)
assert h.can_trim()
h.pwrite(b"\xaa" * 65536, 0)
h.flush()
h.trim(32768, 16384)
assert h.pread(16384, 0) == b"\xaa" * 16384
assert h.pread(32768, 16384) == b"\0" * 32768
assert h.pread(16384, 49152) == b"\xaa" * 16384
h.shutdown()
print("trim ok")
"#
    .replace("URI", &format!("{:?}", s.uri("wc")));
    let out = run("nbdsh", &["-c", &script]);
    assert!(out.contains("trim ok"), "{out}");
}

/// The writecache over O_DIRECT files on the build's file system (which,
/// unlike tmpfs, insists on aligned buffers): 24 MiB through an 8 MiB
/// cache, so watermark writeback runs during the copy and stops at the low
/// watermark, leaving the newest blocks in the cache only; a clean stop
/// (which commits, and writes nothing back); a restart that loads those
/// blocks from the cache file's metadata; and every byte read back, the
/// blocks the origin lacks from the cache. The worker's metadata,
/// superblock and writeback buffers are aligned for this: with `Vec<u8>`
/// buffers the cache failed at format.
#[test]
fn a_writecache_on_o_direct_files_keeps_its_data_across_a_restart() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("wc-odirect-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (o, c, data, back) = (
        dir.join("origin.img"),
        dir.join("cache.img"),
        dir.join("data"),
        dir.join("back"),
    );
    std::fs::File::create(&o)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    std::fs::File::create(&c).unwrap().set_len(8 << 20).unwrap();
    common::random_file(&data, 24 << 20, 7);
    let devs = [
        "--dev".to_string(),
        format!("o=file:{}", o.display()),
        "--dev".to_string(),
        format!("c=file:{}", c.display()),
        "--dev".to_string(),
        "wc=0 65536 writecache s o c 4096 4 high_watermark 40 low_watermark 20".to_string(),
        "--export".to_string(),
        "wc".to_string(),
    ];
    let devs: Vec<&str> = devs.iter().map(String::as_str).collect();
    // The status line's numbers (error, blocks, free, under writeback,
    // reads, read hits, ...) and the line.
    let status = |s: &Serve| -> (Vec<u64>, String) {
        let (code, line, err) = udm(&["status", "--control", s.ctl().to_str().unwrap(), "wc"]);
        assert_eq!(code, 0, "{err}");
        let f = line
            .split_whitespace()
            .skip(4)
            .map(|x| x.parse().unwrap())
            .collect();
        (f, line)
    };
    let mut s = Serve::start(&devs);
    // 24 MiB is three times the cache: writeback runs during the copy.
    run("nbdcopy", &[data.to_str().unwrap(), &s.uri("wc")]);
    let (f, line) = status(&s);
    let low = f[1] * 20 / 100;
    assert!(s.stop().success(), "{}", s.log());
    // Writeback stopped at the low watermark, and the stop wrote nothing
    // back: at least the low watermark's blocks are in the cache only.
    // (Read before the restart, whose own writeback may copy blocks it
    // loaded above the low watermark.)
    let (a, orig) = (std::fs::read(&data).unwrap(), std::fs::read(&o).unwrap());
    let only_cached = a
        .chunks(4096)
        .zip(orig.chunks(4096))
        .filter(|(x, y)| x != y)
        .count() as u64;
    assert!(
        only_cached >= low,
        "{only_cached} blocks are in the cache only, fewer than the low watermark's {low}: {line}"
    );
    let s = Serve::start(&devs);
    let (f, line) = status(&s);
    assert_eq!(f[0], 0, "no error: {line}");
    assert!(
        f[2] < f[1],
        "cached blocks were loaded from the metadata: {line}"
    );
    run("nbdcopy", &[&s.uri("wc"), back.to_str().unwrap()]);
    let b = std::fs::read(&back).unwrap();
    assert!(
        a[..] == b[..24 << 20],
        "the data read back after the restart differs"
    );
    let (f, line) = status(&s);
    assert!(
        f[5] >= low,
        "the low watermark's blocks were read from the cache: {line}"
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
