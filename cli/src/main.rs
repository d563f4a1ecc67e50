//! `udm`: userspace device-mapper.
//!
//! ```text
//! udm bench [--dev NAME=SPEC]... [--target NAME] [options]   drive a device in process
//! udm table [--dev NAME=SPEC]...                             print tables and status
//! udm serve [--dev NAME=SPEC]... [--export NAME] [--listen ADDR]  serve devices over NBD
//! udm status [--dev NAME=SPEC]... [DEVICE]                   dmsetup-style status lines
//! udm message [--dev NAME=SPEC]... DEVICE [SECTOR] MSG...    send a target a message
//! ```

mod alloc;
mod args;
mod bench;
mod clock;
mod message;
mod serve;
mod spec;

use std::process::ExitCode;

use args::Args;
use udm_core::Error;
use udm_mapper::MappedDevice;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

const USAGE: &str = "\
udm — a userspace device-mapper

usage:
  udm bench [--dev NAME=SPEC]... [--target NAME] [options]
  udm table [--dev NAME=SPEC]...
  udm serve [--dev NAME=SPEC]... [--config FILE] [--export NAME[:ro]]... [--listen ADDR]...
  udm status [--dev NAME=SPEC]... [DEVICE]
  udm message [--dev NAME=SPEC]... DEVICE [SECTOR] MESSAGE...
  udm help

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
        "table" => table(Args::new("table", argv)),
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

/// `udm table`: builds the stack and prints, for each device, its size and
/// capabilities, and for mapped devices `dmsetup table` and `status` lines.
fn table(mut a: Args) -> Result<i32, Error> {
    let devs = a.many("--dev");
    a.finish()?;
    let stack = if devs.is_empty() {
        spec::Stack::build(spec::DEFAULT_DEVS)?
    } else {
        spec::Stack::build(&devs)?
    };
    for d in stack.devices() {
        let l = d.limits();
        println!(
            "{}: {} sectors, lbs {}, max io {}, caps {:?}",
            d.name(),
            l.sectors,
            l.logical_block_size,
            l.max_io_bytes,
            d.caps()
        );
        if let Some(m) = d.as_any().downcast_ref::<MappedDevice>() {
            let t = m.table();
            for (tl, sl) in t.table_lines().iter().zip(t.status_lines()) {
                println!("  table:  {tl}");
                println!("  status: {sl}");
            }
        }
    }
    Ok(0)
}
