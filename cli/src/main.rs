//! `udm`: userspace device-mapper.
//!
//! ```text
//! udm bench [--dev NAME=SPEC]... [--target NAME] [options]   drive a device in process
//! udm serve [--dev NAME=SPEC]... [--export NAME] [--listen ADDR] [--control PATH]
//!                                                            serve devices over NBD
//! udm table   [--control PATH | --dev NAME=SPEC...] [DEVICE]...   tables and status
//! udm status  [--control PATH | --dev NAME=SPEC...] [DEVICE]...   dmsetup-style status
//! udm message [--control PATH | --dev NAME=SPEC...] DEVICE [SECTOR] MSG...
//! udm reload  --control PATH DEVICE 'TABLE'                  load + suspend + resume
//! ```

mod alloc;
mod args;
mod bench;
mod clock;
mod control;
mod message;
mod serve;
mod spec;

use std::process::ExitCode;

use args::Args;
use udm_core::Error;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

const USAGE: &str = "\
udm — a userspace device-mapper

usage:
  udm bench [--dev NAME=SPEC]... [--target NAME] [options]
  udm serve [--dev NAME=SPEC]... [--config FILE] [--export NAME[:ro]]... [--listen ADDR]...
            [--control PATH]
  udm table   [--control PATH | --dev NAME=SPEC...] [DEVICE]...
  udm status  [--control PATH | --dev NAME=SPEC...] [DEVICE]...
  udm message [--control PATH | --dev NAME=SPEC...] [--no-progress] DEVICE [SECTOR] MESSAGE...
  udm reload  --control PATH DEVICE 'TABLE'
  udm help

--control PATH acts on the devices of a running 'udm serve' through its
control socket (printed at its start); without it, table, status and
message act on a stack built in this process from --dev specs.

Devices (--dev NAME=SPEC, repeatable, later ones may use earlier ones):
  ram:<size>                          memory, allocated lazily (like brd)
  null:<size>[,delay=<us>]            completes without touching data (null_blk)
  file:<path>[,size=<size>][,buffered][,sqpoll][,iopoll][,ro]
                                      a file or block device through io_uring
  '<start> <len> <type> <args>;...'   a device-mapper table over earlier devices
                                      or paths; targets: linear, striped, zero,
                                      error, writecache

Without --dev, the built-in stack is used: ram0 and ram1 (1 GiB RAM disks),
lin (linear over ram0) and str (striped over ram0 and ram1).";

fn main() -> ExitCode {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    let cmd = if argv.is_empty() {
        "bench".to_string()
    } else {
        argv.remove(0)
    };
    let r = match cmd.as_str() {
        "bench" => {
            let a = Args::new("bench", argv);
            if a.wants_help() {
                println!("{}", bench::USAGE);
                Ok(0)
            } else {
                bench::main(a)
            }
        }
        "table" => message::table(Args::new("table", argv)),
        "serve" => {
            let a = Args::new("serve", argv);
            if a.wants_help() {
                println!("{}", serve::USAGE);
                Ok(0)
            } else {
                serve::main(a)
            }
        }
        "status" => message::status(Args::new("status", argv)),
        "message" => message::message(Args::new("message", argv)),
        "reload" => message::reload_cmd(Args::new("reload", argv)),
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(0)
        }
        "version" | "--version" => {
            println!("udm {}", env!("CARGO_PKG_VERSION"));
            Ok(0)
        }
        other => Err(Error::invalid(format!(
            "unknown command '{other}' (see 'udm help')"
        ))),
    };
    match r {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("udm: {e}");
            ExitCode::from(2)
        }
    }
}
