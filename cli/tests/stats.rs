//! I/O statistics of a running `udm serve`: Prometheus metrics scraped over
//! HTTP while fio (nbd engine) drives an exported linear device, and
//! `udm stats` with `--histogram`, `--clear` and `--json`.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{udm, Serve};
use serde_json::Value;

/// A 64 MiB RAM disk under a linear device, exported, with metrics on any
/// free loopback port.
const STACK: [&str; 8] = [
    "--dev",
    "ram0=ram:64M",
    "--dev",
    "lin=0 131072 linear ram0 0",
    "--export",
    "lin",
    "--metrics",
    "127.0.0.1:0",
];

fn ctl_udm(s: &Serve, cmd: &str, rest: &[&str]) -> (i32, String, String) {
    let ctl = s.ctl();
    let mut a = vec![cmd, "--control", ctl.to_str().unwrap()];
    a.extend_from_slice(rest);
    udm(&a)
}

/// The metrics address the server announced.
fn metrics_addr(s: &Serve) -> String {
    let out = s.out();
    out.lines()
        .find_map(|l| l.strip_prefix("udm: metrics at http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics address announced: {out}"))
        .to_string()
}

/// GET /metrics over HTTP: the body.
fn scrape(addr: &str) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: udm\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    c.read_to_string(&mut r).unwrap();
    let (head, body) = r.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    body.to_string()
}

/// The value of the sample `series` (name and labels, as printed).
fn sample(body: &str, series: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series} in:\n{body}"))
        .parse()
        .unwrap()
}

fn fio(uri: &str, extra: &[&str]) -> common::KillOnDrop {
    let c = Command::new("fio")
        .args([
            "--name=stats",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--output-format=json",
            "--size=64M",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio (installed by scripts/setup.sh)");
    common::KillOnDrop(Some(c))
}

/// fio's JSON report: (reads, read bytes, writes, written bytes).
fn fio_counts(out: &str) -> (u64, u64, u64, u64) {
    let json = &out[out.find('{').unwrap_or_else(|| panic!("fio: {out}"))..];
    let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {out}"));
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{out}");
    let n = |d: &str, k: &str| job[d][k].as_u64().unwrap();
    (
        n("read", "total_ios"),
        n("read", "io_bytes"),
        n("write", "total_ios"),
        n("write", "io_bytes"),
    )
}

fn within_1pct(got: u64, want: u64) -> bool {
    got.abs_diff(want) * 100 <= want
}

#[test]
fn metrics_scraped_over_http_during_a_fio_run_show_fios_io_counts() {
    let s = Serve::start(&STACK);
    let addr = metrics_addr(&s);
    let (code, _, err) = ctl_udm(&s, "message", &["lin", "0", "stats", "histogram", "on"]);
    assert_eq!(code, 0, "{err}");
    let before = scrape(&addr);
    assert!(
        before.contains("# TYPE udm_reads_total counter"),
        "{before}"
    );
    assert!(
        before.contains("# TYPE udm_latency_seconds histogram"),
        "{before}"
    );
    assert_eq!(sample(&before, "udm_reads_total{device=\"lin\"}"), 0);

    // 12000 random 4 KiB I/Os (of the 16384 blocks), 70% reads,
    // rate-limited to run ~1.5 s.
    let mut f = fio(
        &s.uri("lin"),
        &[
            "--rw=randrw",
            "--rwmixread=70",
            "--bs=4k",
            "--iodepth=8",
            "--number_ios=12000",
            "--rate_iops=8000",
        ],
    );
    // Scraped until fio exits (however late a loaded host starts it): the
    // counts only grow, and some scrape lands inside the ~1.5 s run. The
    // bound only detects a hang.
    let (mut last, mut during) = (0, 0);
    let t0 = Instant::now();
    while f.running() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "fio did not finish"
        );
        let b = scrape(&addr);
        let n = sample(&b, "udm_reads_total{device=\"lin\"}")
            + sample(&b, "udm_writes_total{device=\"lin\"}");
        assert!(n >= last, "the I/O count went back: {last} -> {n}");
        if n > 0 && n < 12000 {
            during += 1;
        }
        last = n;
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = f.wait_with_output();
    let (reads, read_bytes, writes, write_bytes) = fio_counts(&out);
    assert!(during > 0, "no scrape saw the run in progress");
    assert_eq!(reads + writes, 12000, "fio ran {reads} + {writes} I/Os");

    let b = scrape(&addr);
    for (series, want) in [
        ("udm_reads_total{device=\"lin\"}", reads),
        ("udm_read_bytes_total{device=\"lin\"}", read_bytes),
        ("udm_writes_total{device=\"lin\"}", writes),
        ("udm_write_bytes_total{device=\"lin\"}", write_bytes),
        (
            "udm_latency_seconds_count{device=\"lin\",op=\"read\"}",
            reads,
        ),
        (
            "udm_latency_seconds_count{device=\"lin\",op=\"write\"}",
            writes,
        ),
    ] {
        let got = sample(&b, series);
        assert!(within_1pct(got, want), "{series} {got}, fio: {want}\n{b}");
    }
    assert_eq!(sample(&b, "udm_errors_total{device=\"lin\"}"), 0);
    assert_eq!(sample(&b, "udm_inflight{device=\"lin\"}"), 0);
    // Cumulative buckets: +Inf holds every timed read.
    assert_eq!(
        sample(
            &b,
            "udm_latency_seconds_bucket{device=\"lin\",op=\"read\",le=\"+Inf\"}"
        ),
        sample(&b, "udm_latency_seconds_count{device=\"lin\",op=\"read\"}")
    );
}

#[test]
fn udm_stats_prints_the_counts_and_clear_starts_them_again() {
    // Direct dispatch: one bio per request, so the device's counts are
    // fio's (auto would merge the sequential writes).
    let mut args = STACK[..6].to_vec();
    args.extend(["--dispatch", "direct"]);
    let s = Serve::start(&args);
    let out = fio(
        &s.uri("lin"),
        &["--rw=write", "--bs=4k", "--iodepth=4", "--number_ios=100"],
    )
    .wait_with_output();
    let (_, _, writes, _) = fio_counts(&out);
    assert_eq!(writes, 100);

    let (code, text, err) = ctl_udm(&s, "stats", &["lin"]);
    assert_eq!(code, 0, "{err}");
    assert!(text.starts_with("Name:              lin\n"), "{text}");
    assert!(
        text.contains("Writes:            100 (merged 0, sectors 800)\n"),
        "{text}"
    );
    assert!(
        text.contains("Reads:             0 (merged 0, sectors 0)\n"),
        "{text}"
    );
    assert!(text.contains("Errors:            0\n"), "{text}");
    assert!(text.contains("Latency timing:    off"), "{text}");

    // Timing on: the histogram shows the next writes, and --clear prints
    // the counts, then starts them again.
    let (code, _, err) = ctl_udm(&s, "message", &["lin", "0", "stats", "histogram", "on"]);
    assert_eq!(code, 0, "{err}");
    fio(
        &s.uri("lin"),
        &["--rw=write", "--bs=4k", "--iodepth=4", "--number_ios=50"],
    )
    .wait_with_output();
    let (code, json, err) = ctl_udm(&s, "stats", &["lin", "--histogram", "--clear", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["writes"], 150, "{v}");
    assert_eq!(v["write_sectors"], 1200, "{v}");
    assert_eq!(v["histogram_on"], true, "{v}");
    let w = &v["histogram"][1];
    assert_eq!(w["op"], "write", "{v}");
    assert_eq!(w["count"], 50, "{v}");
    let in_buckets: u64 = w["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["count"].as_u64().unwrap())
        .sum();
    assert_eq!(in_buckets, 50, "{v}");

    let (_, text, _) = ctl_udm(&s, "stats", &["lin", "--histogram"]);
    assert!(
        text.contains("Writes:            0 (merged 0, sectors 0)\n"),
        "{text}"
    );
    assert!(!text.contains("write latency"), "{text}");

    // Bad input: one line, exit 2.
    for (args, want) in [
        (vec!["nope"], "unknown device 'nope'"),
        (vec!["ram0"], "'ram0'"),
    ] {
        let (code, _, err) = ctl_udm(&s, "stats", &args);
        assert_eq!(code, 2, "{args:?}");
        assert!(err.contains(want) && err.lines().count() == 1, "{err}");
    }
    let (code, _, err) = udm(&["stats", "lin", "--control", "/nonexistent/ctl"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("is 'udm daemon' or 'udm serve' running?"),
        "{err}"
    );
    let (code, _, err) = ctl_udm(&s, "message", &["lin", "0", "stats", "frob"]);
    assert_eq!(code, 2);
    assert!(err.contains("expected 'stats histogram on|off'"), "{err}");
}
