//! End to end: the `udm` binary, as a user runs it. `udm bench --verify`
//! writes a pattern through each target over each backend, reads it back and
//! compares; bad command lines fail with one line naming the bad token.

mod common;

use common::udm;
use udm_core::testing::TempFile;

/// The backend specs every target is verified over (two devices each).
fn backends(tag: &str) -> Vec<(String, [String; 2], Vec<TempFile>)> {
    let mut v = vec![(
        "ram".to_string(),
        ["ram:64M".to_string(), "ram:64M".to_string()],
        Vec::new(),
    )];
    for (kind, opt) in [("direct", ""), ("buffered", ",buffered")] {
        let a = TempFile::new(&format!("{tag}-{kind}-a"));
        let b = TempFile::new(&format!("{tag}-{kind}-b"));
        v.push((
            format!("file-{kind}"),
            [
                format!("file:{},size=64M{opt}", a.path),
                format!("file:{},size=64M{opt}", b.path),
            ],
            vec![a, b],
        ));
    }
    v
}

/// Target tables over devices `a` and `b` (64 MiB = 131072 sectors each).
const TABLES: &[(&str, &str)] = &[
    ("linear", "0 65536 linear a 4096"),
    ("striped", "0 131072 striped 2 16 a 0 b 0"),
    ("striped3", "0 98280 striped 3 24 a 0 b 0 a 65536"),
    (
        "multi",
        "0 16384 linear b 100000; 16384 32768 striped 2 8 a 0 b 8192; 49152 8192 linear a 90000",
    ),
];

fn verify(backend: &str, devs: &[String; 2], name: &str, table: &str, extra: &[&str]) {
    let a = format!("a={}", devs[0]);
    let b = format!("b={}", devs[1]);
    let t = format!("t={table}");
    let mut args = vec![
        "bench", "--dev", &a, "--dev", &b, "--dev", &t, "--target", "t",
    ];
    args.extend_from_slice(&["--verify", "--json", "--jobs", "2", "--iodepth", "8"]);
    args.extend_from_slice(extra);
    let (code, out, err) = udm(&args);
    assert_eq!(
        code, 0,
        "{name} over {backend} {extra:?}: exit {code}\nstdout: {out}\nstderr: {err}"
    );
    assert!(
        out.contains("\"mismatches\":0"),
        "{name} over {backend}: {out}"
    );
    assert!(out.contains("\"errors\":0"), "{name} over {backend}: {out}");
    assert!(
        !out.contains("\"verified_blocks\":0,"),
        "nothing verified: {out}"
    );
}

/// Every target over every backend: random 4 KiB writes then reads, on the
/// fast path and on the clone path, and 64 KiB sequential I/O that crosses
/// chunk and target boundaries (split into clones).
#[test]
fn verify_passes_on_every_target_over_every_backend() {
    for (backend, devs, _files) in backends("verify") {
        for (name, table) in TABLES {
            verify(
                &backend,
                &devs,
                name,
                table,
                &["--rw", "randwrite", "--bs", "4k"],
            );
            verify(
                &backend,
                &devs,
                name,
                table,
                &["--rw", "randwrite", "--bs", "4k", "--no-fast-path"],
            );
            verify(
                &backend,
                &devs,
                name,
                table,
                &["--rw", "write", "--bs", "64k"],
            );
        }
        // The backend itself, with no mapper in between.
        let a = format!("a={}", devs[0]);
        let (code, out, err) = udm(&[
            "bench",
            "--dev",
            &a,
            "--target",
            "a",
            "--verify",
            "--json",
            "--rw",
            "randwrite",
        ]);
        assert_eq!(code, 0, "raw {backend}: {out} {err}");
        assert!(out.contains("\"mismatches\":0"));
    }
}

/// The zero target stores nothing: verify must notice and fail.
#[test]
fn verify_detects_that_zero_stores_nothing() {
    let (code, out, _) = udm(&[
        "bench",
        "--dev",
        "z=0 8192 zero",
        "--target",
        "z",
        "--verify",
        "--size",
        "1M",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("reads back as zeroes"), "{out}");
}

/// The error target fails every I/O: the bench reports it and exits 1.
#[test]
fn error_target_fails_every_io() {
    let (code, out, _) = udm(&[
        "bench",
        "--dev",
        "e=0 8192 error",
        "--target",
        "e",
        "--runtime",
        "0.2",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("I/O error"), "{out}");
}

/// The null backend completes everything, through linear too, with zero
/// allocations per I/O on the fast path.
#[test]
fn null_backend_through_linear_allocates_nothing_per_io() {
    let (code, out, err) = udm(&[
        "bench",
        "--dev",
        "n=null:1G",
        "--dev",
        "l=0 2097152 linear n 0",
        "--target",
        "l",
        "--runtime",
        "0.5",
        "--json",
    ]);
    assert_eq!(code, 0, "{out} {err}");
    assert!(out.contains("\"errors\":0"), "{out}");
    let allocs: f64 = out
        .split("\"allocs_per_io\":")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .expect("allocs_per_io in JSON");
    // Warm-up fills the descriptor cache (iodepth allocations); after that, none.
    assert!(allocs < 0.001, "allocs per I/O: {allocs}");
}

/// Bad specs, tables and options: exit 2 and one line naming the offender.
#[test]
fn bad_input_gets_one_line_naming_what_is_wrong() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["bench", "--dev", "r=ram:1Q", "--target", "r"],
            "invalid size '1Q'",
        ),
        (
            &["bench", "--dev", "l=0 8 linear nowhere 0", "--target", "l"],
            "unknown device 'nowhere'",
        ),
        (
            &[
                "bench",
                "--dev",
                "r=ram:1M",
                "--dev",
                "s=0 2048 striped 2 0 r 0 r 1024",
                "--target",
                "s",
            ],
            "invalid chunk size '0'",
        ),
        (
            &[
                "bench",
                "--dev",
                "r=ram:1M",
                "--dev",
                "m=0 8 mirror r",
                "--target",
                "m",
            ],
            "unknown target type 'mirror'",
        ),
        (&["bench", "--frobnicate"], "unknown option '--frobnicate'"),
        (&["bench", "--rw", "sideways"], "--rw 'sideways'"),
        (&["bench", "--bs", "1000"], "--bs 1000"),
        (
            &["bench", "--dev", "r=ram:1M", "--target", "nope"],
            "--target 'nope'",
        ),
        (&["frob"], "unknown command 'frob'"),
        (
            &["bench", "--cpus", "0,x"],
            "--cpus '0,x': 'x' is not a CPU number",
        ),
        (
            &[
                "bench",
                "--dev",
                "f=file:/nonexistent/udm.img",
                "--target",
                "f",
            ],
            "file '/nonexistent/udm.img'",
        ),
    ];
    for (args, want) in cases {
        let (code, out, err) = udm(args);
        assert_eq!(code, 2, "{args:?}: {out} {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: want '{want}' in: {err}");
    }
}

/// `udm table --dev …` prints dmsetup-style table and status lines of a
/// stack built in process.
#[test]
fn table_prints_dmsetup_lines() {
    let (code, out, _) = udm(&[
        "table",
        "--dev",
        "ram0=ram:1G",
        "--dev",
        "ram1=ram:1G",
        "--dev",
        "lin=0 2097152 linear ram0 0",
        "--dev",
        "str=0 2097152 striped 2 128 ram0 0 ram1 0",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("table:  0 2097152 linear ram0 0"), "{out}");
    assert!(
        out.contains("table:  0 2097152 striped 2 128 ram0 0 ram1 0"),
        "{out}"
    );
    assert!(
        out.contains("status: 0 2097152 striped 2 ram0 ram1 1 AA"),
        "{out}"
    );
}

/// Pinned jobs own their CPUs: a device's worker thread (here the
/// writecache's) runs on the others.
#[test]
fn with_cpus_the_devices_workers_keep_off_the_jobs_cpus() {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    if n < 2 {
        eprintln!("skipped: one CPU, nowhere else to put the worker");
        return;
    }
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_udm"))
        .args([
            "bench",
            "--dev",
            "o=ram:64M",
            "--dev",
            "c=ram:16M",
            "--dev",
            "wc=0 131072 writecache s o c 4096 0",
            "--target",
            "wc",
            "--rw",
            "randread",
            "--runtime",
            "2",
            "--cpus",
            "0",
            "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run udm");
    let child = common::KillOnDrop(Some(child));
    let pid = child.0.as_ref().expect("running").id();
    let allowed = |comm: &str| -> Option<String> {
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))
            .ok()?
            .flatten()
        {
            let c = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if c.trim() == comm {
                let st = std::fs::read_to_string(t.path().join("status")).ok()?;
                return st
                    .lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .map(|v| v.trim().to_string());
            }
        }
        None
    };
    let t0 = std::time::Instant::now();
    let (job, worker) = loop {
        if let (Some(j), Some(w)) = (allowed("udm-job0"), allowed("writecache")) {
            break (j, w);
        }
        assert!(t0.elapsed().as_secs() < 20, "no job or worker thread seen");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = child.wait_with_output();
    assert_eq!(job, "0", "{out}");
    assert!(
        !worker.split(',').any(|r| r.split('-').next() == Some("0")),
        "the worker may run on the job's CPU 0: {worker}"
    );
    assert!(out.contains("\"errors\":0"), "{out}");
}

/// `--cpus` pins jobs round-robin; two jobs on one CPU still finish.
#[test]
fn jobs_pinned_with_cpus_run() {
    let (code, out, err) = udm(&[
        "bench", "--dev", "r=ram:8M", "--target", "r", "--jobs", "2", "--cpus", "0", "--size",
        "4M", "--verify", "--json",
    ]);
    assert_eq!(code, 0, "{out} {err}");
    assert!(out.contains("\"mismatches\":0"), "{out}");
}

/// Queued, stream and auto dispatch (seed 004): batches of sequential and
/// random I/O, merged into multi-segment bios that the targets then split
/// at chunk and target boundaries, verify on every target over every
/// backend.
#[test]
fn queued_stream_and_auto_dispatch_verify_on_every_target_over_every_backend() {
    for (backend, devs, _files) in backends("queued") {
        for (name, table) in TABLES {
            for (rw, mode) in [
                ("write", "queued"),
                ("randwrite", "queued"),
                ("write", "stream"),
                ("randwrite", "stream"),
                ("write", "auto"),
                ("randwrite", "auto"),
            ] {
                verify(
                    &backend,
                    &devs,
                    name,
                    table,
                    &["--rw", rw, "--bs", "4k", "--dispatch", mode],
                );
            }
        }
    }
}

fn json_field<'a>(out: &'a str, key: &str) -> &'a str {
    out.split(&format!("\"{key}\":"))
        .nth(1)
        .and_then(|s| s.split([',', '}']).next())
        .unwrap_or_else(|| panic!("no {key} in {out}"))
}

/// Auto takes the device's report: RAM per request, a per-request delay
/// weighed (queued against direct);
/// and queued, stream and auto dispatch allocate nothing per I/O once warm.
#[test]
fn bench_dispatch_auto_follows_the_device_and_queued_and_stream_allocate_nothing_per_io() {
    let run = |dev: &str, extra: &[&str]| {
        let mut a = vec![
            "bench",
            "--dev",
            dev,
            "--target",
            "d",
            "--runtime",
            "0.5",
            "--json",
        ];
        a.extend_from_slice(extra);
        let (code, out, err) = udm(&a);
        assert_eq!(code, 0, "{out} {err}");
        assert_eq!(json_field(&out, "errors"), "0", "{out}");
        out
    };
    let out = run("d=ram:64M", &[]);
    assert_eq!(json_field(&out, "dispatch"), "\"auto\"", "{out}");
    assert_eq!(json_field(&out, "dispatch_auto"), "null", "{out}");
    // A per-request delay: auto weighs queued against direct, and says
    // how many epochs ran each way.
    let out = run("d=null:64M,delay=20", &["--rw", "write", "--iodepth", "8"]);
    assert_eq!(json_field(&out, "dispatch"), "\"auto\"", "{out}");
    let epochs = |mode: &str| -> u64 {
        let key = format!("{mode}_epochs");
        json_field(&out, &key).parse().unwrap()
    };
    assert!(epochs("queued") + epochs("direct") > 0, "{out}");
    // At iodepth 1 nothing is in flight to merge with: direct, unweighed.
    let out = run("d=null:64M,delay=20", &["--rw", "write", "--iodepth", "1"]);
    assert_eq!(json_field(&out, "dispatch_auto"), "null", "{out}");
    for mode in ["queued", "stream", "auto"] {
        let out = run("d=null:1G", &["--rw", "write", "--dispatch", mode]);
        assert_eq!(json_field(&out, "dispatch"), format!("\"{mode}\""), "{out}");
        let allocs: f64 = json_field(&out, "allocs_per_io").parse().unwrap();
        assert!(allocs < 0.001, "{mode}: allocs per I/O: {allocs}");
    }
    let (code, _, err) = udm(&["bench", "--dispatch", "sorted"]);
    assert_eq!(code, 2);
    assert!(err.contains("'sorted'"), "{err}");
}

/// Auto dispatch on devices that merging does not help (RAM, a buffered
/// file on tmpfs) sends a sequential job's batches as queued does, one bio
/// for the 32 I/Os of each, also across the wraps from the region's end to
/// its start (a 1 MiB region wraps every 256 I/Os): the jump's first I/O is
/// held with the run that follows it, not sent alone (which on the file
/// split every later batch in two for good). Random I/O goes direct, one
/// bio per I/O.
#[test]
fn auto_merges_a_sequential_job_across_its_wraps_as_queued_does_and_sends_random_io_direct() {
    let file = TempFile::new("auto-wrap");
    let file_dev = format!("d=file:{},size=1M,buffered", file.path);
    // I/Os per bio: the bench takes a fresh bio for each one it sends.
    let per_bio = |dev: &str, rw: &str, mode: &str| -> f64 {
        let (code, out, err) = udm(&[
            "bench",
            "--dev",
            dev,
            "--target",
            "d",
            "--rw",
            rw,
            "--bs",
            "4k",
            "--iodepth",
            "32",
            "--runtime",
            "0.3",
            "--dispatch",
            mode,
            "--json",
        ]);
        assert_eq!(code, 0, "{out} {err}");
        assert_eq!(json_field(&out, "errors"), "0", "{out}");
        let num = |k: &str| json_field(&out, k).parse::<f64>().unwrap();
        let ios = num("ios");
        assert!(
            ios > 1024.0,
            "{dev} {rw} {mode}: too few I/Os to wrap: {out}"
        );
        ios / (num("cache_hits") + num("cache_misses"))
    };
    for dev in ["d=ram:1M", file_dev.as_str()] {
        for rw in ["read", "write"] {
            let queued = per_bio(dev, rw, "queued");
            let auto = per_bio(dev, rw, "auto");
            assert!(
                queued > 31.0 && auto > 31.0,
                "{dev} {rw}: I/Os per bio: auto {auto:.2}, queued {queued:.2}"
            );
        }
    }
    let random = per_bio("d=ram:64M", "randread", "auto");
    assert!(random < 1.01, "random reads: {random:.3} I/Os per bio");
}

/// `--message` builds a thin pool and volumes between `--dev`s, in order:
/// a volume, a snapshot of it, and the snapshot verified.
#[test]
fn messages_build_thin_volumes_between_devices() {
    let (code, out, err) = udm(&[
        "bench",
        "--dev",
        "meta=ram:8M",
        "--dev",
        "data=ram:64M",
        "--dev",
        "pool=0 131072 thin-pool meta data 128 0",
        "--message",
        "pool 0 create_thin 0",
        "--dev",
        "t=0 65536 thin pool 0",
        "--message",
        "pool create_snap 1 0",
        "--dev",
        "s=0 65536 thin pool 1",
        "--target",
        "s",
        "--verify",
        "--json",
        "--iodepth",
        "8",
    ]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("\"mismatches\":0"), "{out}");
    // A message before the device it needs fails, naming it.
    let (code, _, err) = udm(&[
        "bench",
        "--dev",
        "meta=ram:8M",
        "--message",
        "pool 0 create_thin 0",
        "--dev",
        "data=ram:64M",
        "--target",
        "data",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--message 'pool 0 create_thin 0'"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `--target A,B` spreads the jobs over the devices, job i on the (i mod
/// N)-th, each device's jobs over the same region of it (the smallest
/// device's size): here two thin volumes of one pool, both verified whole.
#[test]
fn several_targets_spread_the_jobs_over_them() {
    let pool = [
        "bench",
        "--dev",
        "meta=ram:8M",
        "--dev",
        "data=ram:64M",
        "--dev",
        "pool=0 131072 thin-pool meta data 128 0",
        "--message",
        "pool 0 create_thin 0",
        "--dev",
        "t0=0 65536 thin pool 0",
        "--message",
        "pool 0 create_thin 1",
        "--dev",
        "t1=0 32768 thin pool 1",
    ];
    let mut args = pool.to_vec();
    args.extend(["--target", "t0,t1", "--jobs", "2", "--verify", "--json"]);
    let (code, out, err) = udm(&args);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("\"mismatches\":0"), "{out}");
    // 16 MiB (t1's size) of 4 KiB blocks on each volume.
    assert_eq!(json_field(&out, "verified_blocks"), "8192", "{out}");
    // Jobs that do not divide among the devices, and a device that does
    // not exist: one line naming it.
    for (extra, want) in [
        (&["--target", "t0,t1", "--jobs", "3"][..], "--jobs 3"),
        (&["--target", "t0,nope"][..], "--target 'nope'"),
    ] {
        let mut args = pool.to_vec();
        args.extend(extra);
        let (code, _, err) = udm(&args);
        assert_ne!(code, 0);
        assert!(err.contains(want), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}
