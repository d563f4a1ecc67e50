//! End to end: `udm bench --verify` through a writecache device (with and
//! without coalescing, and with a cache small enough that writeback runs
//! during the run), and `udm status` / `udm message` on it.

mod common;

use common::udm;

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
    let devs = [
        "--dev",
        "o=ram:16M",
        "--dev",
        "c=ram:4M",
        "--dev",
        "wc=0 32768 writecache s o c 4096 2 high_watermark 60",
    ];
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
