//! `udm bench`: an in-process load generator (fio / t/io_uring / bdevperf).

mod job;
mod pattern;

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use udm_core::{
    affinity, merge_report, BlockDevice, CompletionMode, Dispatch, Error, PoolConfig, Reactor,
    ReactorConfig, ReactorPool, StopToken, SECTOR_SHIFT,
};
use udm_mapper::MappedDevice;

use serde::Serialize;
use udm_control::{parse_size, Control};

use job::{run_job, JobCfg, JobOutput, JobResult, Pattern};

/// The built-in stack: 1 GiB RAM disks ram0 and ram1, linear over ram0 and
/// striped over both.
pub const DEFAULT_DEVS: &[&str] = &[
    "ram0=ram:1G",
    "ram1=ram:1G",
    "lin=0 2097152 linear ram0 0",
    "str=0 2097152 striped 2 128 ram0 0 ram1 0",
];

const AFTER_HELP: &str = "\
Without --dev, uses the built-in stack (ram0, ram1: 1 GiB RAM disks; lin:
linear over ram0; str: striped over both). Without --target, compares ram0,
lin and str on 4 KiB random reads at QD32.";

/// `udm bench`'s options.
#[derive(clap::Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct BenchArgs {
    /// A device (repeatable; later ones may use earlier ones).
    #[arg(long = "dev", value_name = "NAME=SPEC", value_parser = in_order)]
    devs: Vec<InOrder>,
    /// A message to a device made by an earlier --dev, sent before the
    /// next --dev is made (repeatable, in order with them): e.g. --dev
    /// 'pool=0 2097152 thin-pool meta data 128 0' --message 'pool 0
    /// create_thin 0' --dev 't=0 2097152 thin pool 0'. SECTOR defaults
    /// to 0.
    #[arg(long = "message", value_name = "DEV [SECTOR] WORDS...", value_parser = in_order)]
    messages: Vec<InOrder>,
    /// Device to drive; several, comma-separated (NAME,NAME...), spread
    /// the jobs over them: job i drives the (i mod N)-th, over the same
    /// region of each (--jobs a multiple of N).
    #[arg(long, value_name = "NAME[,NAME...]")]
    target: Option<String>,
    /// read|write|rw|randread|randwrite|randrw.
    #[arg(long, value_name = "MODE", default_value = "randread")]
    rw: String,
    /// Percent reads in rw/randrw.
    #[arg(long, value_name = "N", default_value_t = 50)]
    rwmixread: u32,
    /// Block size.
    #[arg(long, value_name = "SIZE", default_value = "4k")]
    bs: String,
    /// I/Os in flight per job.
    #[arg(long, value_name = "N", default_value_t = 32)]
    iodepth: u32,
    /// Jobs (each a reactor on its own thread).
    #[arg(long, value_name = "N", default_value_t = 1)]
    jobs: u32,
    /// Time-based run length in seconds [default: 5].
    #[arg(long, value_name = "SECS")]
    runtime: Option<String>,
    /// Region to cover (all jobs together; one pass when given without
    /// --runtime; random passes cover every block once, as fio's random
    /// map does, each pass in a new order) [default: whole device].
    #[arg(long, value_name = "SIZE")]
    size: Option<String>,
    /// Write the region first, unmeasured.
    #[arg(long)]
    prefill: bool,
    /// Write a pattern over the region, read it back, compare.
    #[arg(long)]
    verify: bool,
    /// Busy-poll completions (default: sleep when idle).
    #[arg(long)]
    poll: bool,
    /// Spin briefly, then sleep.
    #[arg(long)]
    hybrid: bool,
    /// Spin while recent idle gaps were short, else sleep.
    #[arg(long)]
    adaptive: bool,
    /// Force the mapper's clone path.
    #[arg(long)]
    no_fast_path: bool,
    /// Disable the descriptor cache.
    #[arg(long)]
    no_cache: bool,
    /// Pin job i to the i-th CPU of LIST (e.g. 0,1); the bench's other
    /// threads (devices' workers) then keep off those CPUs while any other
    /// is allowed.
    #[arg(long, value_name = "LIST")]
    cpus: Option<String>,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
    /// How I/Os go to the device: direct submits each as issued; queued
    /// holds each batch (what one reactor turn's completions issue), sorts
    /// it and merges adjacent I/Os into multi-segment bios; stream holds an
    /// I/O only while the next continues it; auto picks from the device's
    /// report ('udm info': merging helps).
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = ["auto", "direct", "queued", "stream"])]
    dispatch: String,
}

/// A --dev or --message value and its place on the command line: clap
/// calls the value parser as it meets each value, in order, so a counter
/// there orders the two options' values among each other (which two
/// separate lists would lose).
#[derive(Clone, Debug)]
struct InOrder {
    seq: u64,
    value: String,
}

fn in_order(s: &str) -> Result<InOrder, String> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    Ok(InOrder {
        seq: SEQ.fetch_add(1, Ordering::Relaxed),
        value: s.to_string(),
    })
}

/// One step of building the stack: make a device, or send a message.
enum Step<'a> {
    Dev(&'a str),
    Message(&'a str),
}

/// Makes the devices and sends the messages, in command-line order.
fn build_stack(devs: &[InOrder], messages: &[InOrder]) -> Result<Control, Error> {
    let mut steps: Vec<(u64, Step<'_>)> = devs
        .iter()
        .map(|d| (d.seq, Step::Dev(&d.value)))
        .chain(messages.iter().map(|m| (m.seq, Step::Message(&m.value))))
        .collect();
    steps.sort_by_key(|(seq, _)| *seq);
    let c = Control::default();
    for (_, step) in steps {
        match step {
            Step::Dev(d) => {
                let Some((name, spec)) = d.split_once('=') else {
                    return Err(Error::invalid(format!(
                        "--dev '{d}': expected NAME=SPEC (e.g. ram0=ram:1G)"
                    )));
                };
                c.create(name.trim(), spec)?;
            }
            Step::Message(m) => send_message(&c, m)?,
        }
    }
    Ok(c)
}

/// Sends `--message 'DEV [SECTOR] WORDS...'`.
fn send_message(c: &Control, m: &str) -> Result<(), Error> {
    let words: Vec<&str> = m.split_whitespace().collect();
    let (dev, rest) = match words.split_first() {
        Some((d, r)) => (*d, r),
        None => {
            return Err(Error::invalid(
                "--message '': expected DEV [SECTOR] WORDS...",
            ))
        }
    };
    let numbered = rest
        .split_first()
        .and_then(|(s, r)| Some((s.parse::<u64>().ok()?, r)));
    let (sector, argv) = numbered.unwrap_or((0, rest));
    if argv.is_empty() {
        return Err(Error::invalid(format!(
            "--message '{m}': expected DEV [SECTOR] WORDS... (no words to send)"
        )));
    }
    c.message(dev, sector, argv)
        .map_err(|e| e.context(format!("--message '{m}'")))?;
    Ok(())
}

/// Everything one run needs.
struct BenchCfg {
    target: String,
    rw: Pattern,
    mix_read: u32,
    bs: u32,
    iodepth: u32,
    jobs: u32,
    runtime: Option<Duration>,
    size: Option<u64>,
    prefill: bool,
    verify: bool,
    mode: CompletionMode,
    fast_path: bool,
    cache: bool,
    json: bool,
    /// CPUs to pin jobs to, round-robin; empty: not pinned.
    cpus: Vec<usize>,
    /// Dispatch asked for.
    dispatch: Dispatch,
}

/// Runs `udm bench`.
pub fn main(args: BenchArgs) -> Result<i32, Error> {
    let (devs, messages) = (args.devs, args.messages);
    let target = args.target;
    let rw = Pattern::parse(&args.rw).ok_or_else(|| {
        Error::invalid(format!(
            "--rw '{}': expected read, write, rw, randread, randwrite or randrw",
            args.rw
        ))
    })?;
    let mix_read = args.rwmixread;
    if mix_read > 100 {
        return Err(Error::invalid(format!(
            "--rwmixread {mix_read}: must be 0..100"
        )));
    }
    let bs = parse_size(&args.bs).map_err(|e| e.context("--bs"))?;
    let runtime = match &args.runtime {
        Some(s) => Some(parse_secs(s)?),
        None => None,
    };
    let size = match &args.size {
        Some(s) => Some(parse_size(s).map_err(|e| e.context("--size"))?),
        None => None,
    };
    let cfg = BenchCfg {
        target: String::new(),
        rw,
        mix_read,
        bs: bs.try_into().unwrap_or(u32::MAX),
        iodepth: args.iodepth,
        jobs: args.jobs,
        runtime: if size.is_some() && runtime.is_none() {
            None
        } else {
            Some(runtime.unwrap_or(Duration::from_secs(5)))
        },
        size,
        prefill: args.prefill,
        verify: args.verify,
        mode: if args.poll {
            CompletionMode::Poll
        } else if args.hybrid {
            CompletionMode::Hybrid
        } else if args.adaptive {
            CompletionMode::Adaptive
        } else {
            CompletionMode::Interrupt
        },
        fast_path: !args.no_fast_path,
        cache: !args.no_cache,
        json: args.json,
        cpus: match &args.cpus {
            Some(s) => parse_cpus(s)?,
            None => Vec::new(),
        },
        dispatch: args.dispatch.parse()?,
    };
    if cfg.iodepth == 0 || cfg.jobs == 0 {
        return Err(Error::invalid("--iodepth and --jobs must be at least 1"));
    }
    if cfg.bs == 0 || !cfg.bs.is_multiple_of(512) || cfg.bs > 64 << 20 {
        return Err(Error::invalid(format!(
            "--bs {bs}: must be a multiple of 512 bytes, at most 64 MiB"
        )));
    }

    // Before the devices exist: the threads they start inherit it.
    keep_off(&cfg.cpus)?;
    if devs.is_empty() && !messages.is_empty() {
        return Err(Error::invalid(
            "--message needs the devices it is sent to (--dev)",
        ));
    }
    let stack = if devs.is_empty() {
        Control::build(DEFAULT_DEVS)?
    } else {
        build_stack(&devs, &messages)?
    };
    match target {
        Some(t) => {
            let devs = t
                .split(',')
                .map(|n| {
                    stack
                        .get(n)
                        .ok_or_else(|| Error::invalid(format!("--target '{n}': no such device")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            if !(cfg.jobs as usize).is_multiple_of(devs.len()) {
                return Err(Error::invalid(format!(
                    "--jobs {}: must be a multiple of the {} devices of --target",
                    cfg.jobs,
                    devs.len()
                )));
            }
            let r = run(&devs, BenchCfg { target: t, ..cfg })?;
            Ok(if r.ok() { 0 } else { 1 })
        }
        None if devs.is_empty() => default_suite(&stack, cfg),
        None => Err(Error::invalid("--target NAME is required with --dev")),
    }
}

fn parse_secs(s: &str) -> Result<Duration, Error> {
    let t = s.strip_suffix('s').unwrap_or(s);
    match t.parse::<f64>() {
        Ok(v) if v > 0.0 && v < 1e6 => Ok(Duration::from_secs_f64(v)),
        _ => Err(Error::invalid(format!(
            "--runtime '{s}': expected seconds, e.g. 5 or 0.5"
        ))),
    }
}

/// The main job on the built-in default: raw RAM, linear and striped.
fn default_suite(stack: &Control, base: BenchCfg) -> Result<i32, Error> {
    let mut rows = Vec::new();
    for name in ["ram0", "lin", "str"] {
        let Some(dev) = stack.get(name) else { continue };
        let cfg = BenchCfg {
            target: name.to_string(),
            runtime: Some(base.runtime.unwrap_or(Duration::from_secs(2))),
            json: false,
            cpus: base.cpus.clone(),
            ..base
        };
        let r = run(&[dev], cfg)?;
        rows.push((name, r.iops));
    }
    if let Some(&(_, raw)) = rows.first() {
        println!(
            "\nsummary ({} {} QD{}):",
            base.rw.name(),
            human_bytes(base.bs as u64),
            base.iodepth
        );
        for (name, iops) in &rows {
            println!(
                "  {name:<6} {:>10} IOPS  {:.3}x raw",
                human_count(*iops),
                iops / raw
            );
        }
    }
    Ok(0)
}

/// `udm bench --json`: one run's report.
#[derive(Serialize)]
struct BenchJson<'a> {
    target: &'a str,
    rw: &'a str,
    bs: u32,
    iodepth: u32,
    jobs: u32,
    fast_path: bool,
    cache: bool,
    mode: &'a str,
    dispatch: &'a str,
    dispatch_why: &'a str,
    /// Auto dispatch weighing queued against direct (a device that merging
    /// helps): what it chose over the run; null elsewhere.
    dispatch_auto: Option<AutoJson>,
    runtime_s: f64,
    ios: u64,
    reads: u64,
    writes: u64,
    bytes: u64,
    iops: f64,
    mib_per_s: f64,
    lat_us: Latency,
    allocs_per_io: f64,
    cache_hits: u64,
    cache_misses: u64,
    cpu_user_s: f64,
    cpu_sys_s: f64,
    errors: u64,
    first_error: Option<&'a str>,
    verified_blocks: u64,
    mismatches: u64,
    first_mismatch: Option<&'a str>,
}

/// What auto dispatch chose over a run, summed over its jobs: the trial's
/// epochs in each mode, and the mode the first job ended in.
#[derive(Serialize)]
struct AutoJson {
    queued_epochs: u64,
    direct_epochs: u64,
    last: &'static str,
}

/// Latency percentiles in microseconds.
#[derive(Serialize)]
struct Latency {
    mean: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
}

/// Aggregated results.
struct Report {
    iops: f64,
    errors: u64,
    mismatches: u64,
}

impl Report {
    fn ok(&self) -> bool {
        self.errors == 0 && self.mismatches == 0
    }
}

/// Runs the jobs, job i on `devs[i % devs.len()]` (which divides the
/// number of jobs), each device's jobs over the same region of it.
fn run(devs: &[Arc<dyn BlockDevice>], cfg: BenchCfg) -> Result<Report, Error> {
    let dev = &devs[0];
    // Without --size: the whole of the smallest device.
    let region = cfg
        .size
        .unwrap_or_else(|| devs.iter().map(|d| d.limits().bytes()).min().unwrap_or(0));
    for d in devs {
        let limits = d.limits();
        if let Some(m) = d.as_any().downcast_ref::<MappedDevice>() {
            m.set_fast_path(cfg.fast_path)?;
        }
        if !cfg.bs.is_multiple_of(limits.logical_block_size) {
            return Err(Error::invalid(format!(
                "--bs {}: not a multiple of '{}''s logical block size {}",
                cfg.bs,
                d.name(),
                limits.logical_block_size
            )));
        }
        let dev_bytes = limits.bytes();
        if region > dev_bytes {
            return Err(Error::invalid(format!(
                "--size {region}: larger than '{}' ({dev_bytes} bytes)",
                d.name()
            )));
        }
    }
    let per_dev_jobs = cfg.jobs as u64 / devs.len() as u64;
    let per_job_blocks = region / cfg.bs as u64 / per_dev_jobs;
    if per_job_blocks == 0 {
        return Err(Error::invalid(format!(
            "region of {region} bytes is too small for {} jobs of --bs {}",
            cfg.jobs, cfg.bs
        )));
    }
    let (dispatch, dispatch_why) = cfg.dispatch.choose(&**dev);
    crate::clock::init();
    let reactor = ReactorConfig {
        mode: cfg.mode,
        cache_size: if cfg.cache {
            udm_core::DEFAULT_CACHE_SIZE
        } else {
            0
        },
        ..ReactorConfig::default()
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5eed);
    let ready = Arc::new(Barrier::new(cfg.jobs as usize + 1));
    let progress: Vec<Arc<AtomicU64>> =
        (0..cfg.jobs).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let jobs: Vec<JobCfg> = (0..cfg.jobs)
        .map(|j| JobCfg {
            rw: cfg.rw,
            mix_read: cfg.mix_read,
            bs: cfg.bs,
            iodepth: cfg.iodepth,
            region_start: ((j as u64 / devs.len() as u64) * per_job_blocks * cfg.bs as u64)
                >> SECTOR_SHIFT,
            region_blocks: per_job_blocks,
            runtime: if cfg.verify { None } else { cfg.runtime },
            prefill: cfg.prefill,
            verify: cfg.verify,
            seed: seed.wrapping_add(j as u64 * 0x9e37_79b9),
            dispatch,
            // At iodepth 1 nothing is in flight to merge with: auto is
            // direct there, as where merging does not help.
            weigh: dispatch == Dispatch::Auto && cfg.iodepth > 1 && merge_report(&**dev).0,
        })
        .collect();
    let pool_cfg = PoolConfig {
        cpus: cfg.cpus.clone(),
        ..PoolConfig::new("udm-job", cfg.jobs as usize, reactor)
    };
    let (job_devs, job_ready, job_progress) = (devs.to_vec(), ready.clone(), progress.clone());
    let pool = ReactorPool::start(&pool_cfg, move |j, r: &Reactor, _: &StopToken| {
        let out = run_job(
            r,
            job_devs[j % job_devs.len()].clone(),
            jobs[j].clone(),
            job_ready.clone(),
            job_progress[j].clone(),
        );
        if out.result.is_err() {
            // Setup failed before the barrier: release the others.
            job_ready.wait();
        }
        out
    })
    .map_err(|e| e.context("job setup"))?;
    ready.wait();
    let start = Instant::now();
    let show = std::io::stderr().is_terminal() && !cfg.json;
    let mut last = (start, 0u64);
    while !pool.is_finished() {
        std::thread::sleep(Duration::from_millis(100));
        if show && last.0.elapsed() >= Duration::from_secs(1) {
            let total: u64 = progress.iter().map(|p| p.load(Ordering::Relaxed)).sum();
            let rate = (total - last.1) as f64 / last.0.elapsed().as_secs_f64();
            eprint!(
                "\r[{:>5.1}s] {}: {} IOPS, {}/s   ",
                start.elapsed().as_secs_f64(),
                cfg.target,
                human_count(rate),
                human_bytes((rate * cfg.bs as f64) as u64)
            );
            let _ = std::io::stderr().flush();
            last = (Instant::now(), total);
        }
    }
    if show {
        eprint!("\r\x1b[K");
    }
    let mut results = Vec::new();
    for out in pool.join() {
        // The buffer goes only now, after its reactor.
        let JobOutput { result, buf } = out?;
        results.push(result?);
        drop(buf);
    }
    Ok(report(&cfg, dev, &results, (dispatch, &dispatch_why)))
}

fn report(
    cfg: &BenchCfg,
    dev: &Arc<dyn BlockDevice>,
    rs: &[JobResult],
    (dispatch, why): (Dispatch, &str),
) -> Report {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
        .unwrap_or_else(|_| unreachable!("constant bounds are valid"));
    let (mut ios, mut reads, mut writes, mut bytes, mut errors, mut allocs) = (0, 0, 0, 0, 0, 0);
    let (mut verified, mut mismatches) = (0, 0);
    let (mut usr, mut sys) = (Duration::ZERO, Duration::ZERO);
    let (mut hits, mut misses) = (0u64, 0u64);
    let mut elapsed = Duration::ZERO;
    let mut first_error = None;
    let mut first_mismatch = None;
    let mut weighed: Option<AutoJson> = None;
    for r in rs {
        if let Some(((q, d), last)) = r.weighed {
            let w = weighed.get_or_insert(AutoJson {
                queued_epochs: 0,
                direct_epochs: 0,
                last: last.name(),
            });
            w.queued_epochs += q;
            w.direct_epochs += d;
        }
        let _ = hist.add(&r.hist);
        ios += r.ios;
        reads += r.reads;
        writes += r.writes;
        bytes += r.bytes;
        errors += r.errors;
        allocs += r.allocs;
        verified += r.verified;
        mismatches += r.mismatches;
        usr += r.cpu.0;
        sys += r.cpu.1;
        hits += r.cache.hits;
        misses += r.cache.misses;
        elapsed = elapsed.max(r.elapsed);
        if first_error.is_none() {
            first_error = r.first_error.clone();
        }
        if first_mismatch.is_none() {
            first_mismatch = r.first_mismatch.clone();
        }
    }
    let secs = elapsed.as_secs_f64().max(1e-9);
    let iops = ios as f64 / secs;
    let mibs = bytes as f64 / secs / (1 << 20) as f64;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let mean = hist.mean() / 1000.0;
    let allocs_per_io = if ios == 0 {
        0.0
    } else {
        allocs as f64 / ios as f64
    };
    let mode = match cfg.mode {
        CompletionMode::Interrupt => "interrupt",
        CompletionMode::Poll => "poll",
        CompletionMode::Hybrid => "hybrid",
        CompletionMode::Adaptive => "adaptive",
    };
    if cfg.json {
        let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
        let j = BenchJson {
            target: &cfg.target,
            rw: cfg.rw.name(),
            bs: cfg.bs,
            iodepth: cfg.iodepth,
            jobs: cfg.jobs,
            fast_path: cfg.fast_path,
            cache: cfg.cache,
            mode,
            dispatch: dispatch.name(),
            dispatch_why: why,
            dispatch_auto: weighed,
            runtime_s: r3(secs),
            ios,
            reads,
            writes,
            bytes,
            iops: (iops * 10.0).round() / 10.0,
            mib_per_s: (mibs * 100.0).round() / 100.0,
            lat_us: Latency {
                mean: r3(mean),
                p50: r3(us(0.5)),
                p99: r3(us(0.99)),
                p999: r3(us(0.999)),
                max: r3(hist.max() as f64 / 1000.0),
            },
            allocs_per_io: (allocs_per_io * 1e6).round() / 1e6,
            cache_hits: hits,
            cache_misses: misses,
            cpu_user_s: r3(usr.as_secs_f64()),
            cpu_sys_s: r3(sys.as_secs_f64()),
            errors,
            first_error: first_error.as_deref(),
            verified_blocks: verified,
            mismatches,
            first_mismatch: first_mismatch.as_deref(),
        };
        match serde_json::to_string(&j) {
            Ok(s) => println!("{s}"),
            Err(e) => tracing::error!("encoding the bench report: {e}"),
        }
    } else {
        println!(
            "{}: rw={} bs={} iodepth={} jobs={} fast-path={} cache={} mode={mode}{} dispatch={dispatch} ({why})",
            cfg.target,
            cfg.rw.name(),
            human_bytes(cfg.bs as u64),
            cfg.iodepth,
            cfg.jobs,
            on(cfg.fast_path),
            on(cfg.cache),
            if cfg.verify { " verify" } else { "" }
        );
        println!(
            "  {}: IOPS={}, BW={}/s ({} in {secs:.2}s; {reads} reads, {writes} writes)",
            dev.name(),
            human_count(iops),
            human_bytes((mibs * (1 << 20) as f64) as u64),
            human_bytes(bytes),
        );
        println!(
            "    lat (usec): mean={mean:.2}, p50={:.2}, p99={:.2}, p99.9={:.2}, max={:.2}",
            us(0.5),
            us(0.99),
            us(0.999),
            hist.max() as f64 / 1000.0
        );
        println!(
            "    cpu: usr={:.1}%, sys={:.1}% (of one core, summed over jobs)",
            usr.as_secs_f64() / secs * 100.0,
            sys.as_secs_f64() / secs * 100.0
        );
        println!(
            "    descriptors: allocs/io={allocs_per_io:.4}, cache hits={hits}, misses={misses}"
        );
        if let Some(w) = &weighed {
            println!(
                "    dispatch: auto ran {} epochs queued, {} direct; ended {}",
                w.queued_epochs, w.direct_epochs, w.last
            );
        }
        if cfg.verify {
            println!("    verify: {verified} blocks checked, {mismatches} mismatches");
        }
        if let Some(e) = &first_error {
            println!("    errors: {errors} I/Os failed; first: {e}");
        }
        if let Some(m) = &first_mismatch {
            println!("    verify failed: {m}");
        }
    }
    Report {
        iops,
        errors,
        mismatches,
    }
}

fn on(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// 1234567 → "1.23M".
pub fn human_count(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Bytes in binary units.
pub fn human_bytes(v: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = v as f64;
    let mut u = 0;
    while x >= 1024.0 && u < units.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v}B")
    } else if x.fract() == 0.0 {
        format!("{x:.0}{}", units[u])
    } else {
        format!("{x:.1}{}", units[u])
    }
}

/// Parses `--cpus`: comma-separated CPU numbers.
fn parse_cpus(s: &str) -> Result<Vec<usize>, Error> {
    s.split(',')
        .map(|c| {
            c.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n < affinity::MAX_CPUS)
                .ok_or_else(|| Error::invalid(format!("--cpus '{s}': '{c}' is not a CPU number")))
        })
        .collect()
}

/// Keeps the calling thread, and the threads it starts from now on, off
/// `cpus` (the jobs' CPUs), if any other CPU is allowed: pinned jobs own
/// their CPUs, as SPDK's reactors own theirs. A device's worker (the
/// writecache's commits and writeback) that the scheduler put on a job's
/// CPU took its time from the data path: forced there, the 512 B row of
/// seed 001's table went from 0.94 to 0.91x raw.
fn keep_off(cpus: &[usize]) -> Result<(), Error> {
    if cpus.is_empty() {
        return Ok(());
    }
    // Unknown: nothing to narrow, leave it to the scheduler.
    let Ok(mut others) = affinity::allowed_cpus() else {
        return Ok(());
    };
    others.retain(|c| !cpus.contains(c));
    if others.is_empty() {
        return Ok(());
    }
    affinity::set_allowed_cpus(&others)
        .map_err(|e| Error::os("--cpus: keeping the other threads off the jobs' CPUs", e))
}
