//! `udm`: userspace device-mapper, a thin shell over `udm-control`.
//!
//! ```text
//! udm bench [--dev NAME=SPEC]... [--target NAME] [options]   drive a device in process
//! udm serve [--dev NAME=SPEC]... [--export NAME] [--listen ADDR]   a fixed stack over NBD
//! udm daemon [--config FILE]                                 devices and exports at runtime
//! udm create | remove | load | suspend | resume | reload | clear | wait   (dmsetup's verbs)
//! udm ls | info | deps | table | status | message | dump-config
//! udm export add | remove | ls
//! udm log-replay --log LOG --replay TARGET [--limit N | --end-mark NAME] [--check CMD]
//! udm targets | udm version | udm completions SHELL
//! ```
//!
//! Verbs find the daemon at --control PATH, else $UDM_CONTROL, else its
//! default socket.

// The doc comments of the clap types are the `--help` text, written as
// help reads (`[,ro]`, `<sock>.ctl`), not as rustdoc's markdown.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

mod alloc;
mod bench;
mod clock;
mod cmds;
mod daemon;
mod progress;
mod replay;
mod serve;
mod stats;

use std::process::ExitCode;

use clap::error::{ContextKind, ContextValue, ErrorKind as ClapKind};
use clap::{CommandFactory, Parser, Subcommand};
use udm_core::Error;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

const AFTER_HELP: &str = "\
--control PATH acts on the devices of a running 'udm serve' through its
control socket (printed at its start); without it, table, status and
message act on a stack built in this process from --dev specs.

Devices (--dev NAME=SPEC, repeatable, later ones may use earlier ones):
  ram:<size>[,prealloc]               memory, allocated lazily (like brd)
  null:<size>[,delay=<us>]            completes without touching data (null_blk)
  file:<path>[,size=<size>][,buffered][,direct][,sqpoll][,iopoll][,ro]
                                      a file or block device through io_uring
  rbd:<pool>/<image>[@<snap>][,conf=<path>][,id=<client>][,ro]
                                      a Ceph RBD image through librbd
  luks:<device or path>[,key-file=<path>][,keyslot=<n>][,ro]
                                      a LUKS1/LUKS2 volume, as a crypt table
  '<start> <len> <type> <args>;...'   a device-mapper table over earlier devices
                                      or paths (see 'udm targets')

Without --dev, the built-in stack is used: ram0 and ram1 (1 GiB RAM disks),
lin (linear over ram0) and str (striped over ram0 and ram1).
Logs go to stderr; RUST_LOG sets their level (default: info).";

/// udm — a userspace device-mapper.
#[derive(Parser)]
#[command(name = "udm", version, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Drive a device in process: IOPS, latency, CPU and allocations per I/O.
    Bench(bench::BenchArgs),
    /// Export a fixed stack over NBD, vhost-user-blk or ublk, with a control socket, until SIGINT/SIGTERM.
    Serve(serve::ServeArgs),
    /// Run the daemon: devices and exports created and removed at runtime.
    Daemon(daemon::DaemonArgs),
    /// Create a device: a backend (SPEC) or a mapped device (--table).
    Create(cmds::dev::CreateArgs),
    /// Remove a device (refused while held, unless --force or --deferred).
    Remove(cmds::dev::RemoveArgs),
    /// Stage an inactive table on a mapped device (live at 'resume').
    Load(cmds::dev::LoadArgs),
    /// Hold a mapped device's new I/O and wait for what is in flight.
    Suspend(cmds::dev::SuspendArgs),
    /// Swap in the inactive table, if any, and release held I/O.
    Resume(cmds::dev::NameArgs),
    /// Load + suspend + resume a new table.
    Reload(cmds::dev::LoadArgs),
    /// Drop a mapped device's inactive table.
    Clear(cmds::dev::NameArgs),
    /// The devices (--tree: as a stack).
    Ls(cmds::dev::LsArgs),
    /// One device: size, state, tables, holders, event number.
    Info(cmds::dev::NameArgs),
    /// The devices a mapped device's tables use.
    Deps(cmds::dev::NameArgs),
    /// Wait until a device's event counter passes EVENT_NR.
    Wait(cmds::dev::WaitArgs),
    /// Each device's size and caps, with its table and status lines.
    Table(cmds::TableArgs),
    /// dmsetup-style status lines of mapped devices.
    Status(cmds::StatusArgs),
    /// Send a message to a target (writecache: flush, clear_stats, …).
    Message(cmds::MessageArgs),
    /// Add, remove and list a daemon's exports.
    #[command(subcommand)]
    Export(cmds::export::ExportCmd),
    /// Print the daemon's devices and exports as a config file.
    DumpConfig(cmds::dev::DumpConfigArgs),
    /// Replay a dm-log-writes log onto a device, checking at flush points.
    LogReplay(replay::ReplayArgs),
    /// A mapped device's I/O statistics (and latency histograms).
    Stats(stats::StatsArgs),
    /// The target types tables may use.
    Targets(cmds::JsonArgs),
    /// udm's version and its control protocol's.
    Version(cmds::JsonArgs),
    /// Print a shell completion script.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// A clap error as one line (`udm: …`), as every other error.
fn one_line(e: &clap::Error, sub: Option<&str>) -> String {
    let arg = match e
        .get(ContextKind::InvalidArg)
        .or_else(|| e.get(ContextKind::InvalidSubcommand))
    {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    let see = match sub {
        Some(s) => format!("udm {s} --help"),
        None => "udm --help".to_string(),
    };
    match e.kind() {
        ClapKind::UnknownArgument => format!("unknown option '{arg}' (see '{see}')"),
        ClapKind::InvalidSubcommand => format!("unknown command '{arg}' (see 'udm --help')"),
        _ => {
            // The first paragraph of clap's message, on one line.
            let text = e.render().to_string();
            let first: Vec<&str> = text
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            let first = first.join(" ");
            format!(
                "{} (see '{see}')",
                first.strip_prefix("error: ").unwrap_or(&first)
            )
        }
    }
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .with_ansi(false)
        .try_init();
}

fn run(cmd: Cmd) -> Result<i32, Error> {
    match cmd {
        Cmd::Bench(a) => bench::main(a),
        Cmd::Serve(a) => serve::main(a),
        Cmd::Daemon(a) => daemon::main(a),
        Cmd::Create(a) => cmds::dev::create(a),
        Cmd::Remove(a) => cmds::dev::remove(a),
        Cmd::Load(a) => cmds::dev::load(a),
        Cmd::Suspend(a) => cmds::dev::suspend(a),
        Cmd::Resume(a) => cmds::dev::resume(a),
        Cmd::Reload(a) => cmds::dev::reload(a),
        Cmd::Clear(a) => cmds::dev::clear(a),
        Cmd::Ls(a) => cmds::dev::ls(a),
        Cmd::Info(a) => cmds::dev::info(a),
        Cmd::Deps(a) => cmds::dev::deps(a),
        Cmd::Wait(a) => cmds::dev::wait(a),
        Cmd::Table(a) => cmds::table(a),
        Cmd::Status(a) => cmds::status(a),
        Cmd::Message(a) => cmds::message(a),
        Cmd::Export(c) => cmds::export::main(c),
        Cmd::DumpConfig(a) => cmds::dev::dump_config(a),
        Cmd::LogReplay(a) => replay::main(a),
        Cmd::Stats(a) => stats::main(a),
        Cmd::Targets(a) => cmds::targets(a),
        Cmd::Version(a) => cmds::version(a),
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "udm", &mut std::io::stdout());
            Ok(0)
        }
    }
}

fn main() -> ExitCode {
    let mut argv: Vec<String> = std::env::args().collect();
    if argv.len() == 1 {
        argv.push("bench".into()); // bare `udm`: the default bench
    }
    let cli = match Cli::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => match e.kind() {
            ClapKind::DisplayHelp
            | ClapKind::DisplayVersion
            | ClapKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
            _ => {
                let sub = argv
                    .get(1)
                    .filter(|s| Cli::command().find_subcommand(s.as_str()).is_some())
                    .map(String::as_str);
                eprintln!("udm: {}", one_line(&e, sub));
                return ExitCode::from(2);
            }
        },
    };
    init_logs();
    match run(cli.cmd) {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("udm: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parse_errors_are_one_line_naming_the_offender() {
        let e = Cli::try_parse_from(["udm", "bench", "--frob"])
            .err()
            .unwrap();
        assert_eq!(
            one_line(&e, Some("bench")),
            "unknown option '--frob' (see 'udm bench --help')"
        );
        let e = Cli::try_parse_from(["udm", "frob"]).err().unwrap();
        assert!(one_line(&e, None).starts_with("unknown command 'frob'"));
        let e = Cli::try_parse_from(["udm", "bench", "--iodepth", "x"])
            .err()
            .unwrap();
        let l = one_line(&e, Some("bench"));
        assert!(l.contains("'x'") && !l.contains('\n'), "{l}");
    }
}
