//! dmsetup's verbs, each a call of `udm-control`.
//!
//! Every verb acts on a running daemon (`udm daemon`, or `udm serve`)
//! through its control socket: `--control PATH`, else `$UDM_CONTROL`, else
//! the default path ([`udm_control::default_socket`]). The read-only verbs
//! here (`table`, `status`, `message`) can instead act on a stack built in
//! this process from `--dev` specs (to check a stack: it is gone when the
//! command exits). Both ways run the same [`Op`] through `udm-control`'s
//! `execute` (in the daemon for a socket), so the output is the same.
//! [`dev`]: the verbs that change devices; [`export`]: exports.

pub mod dev;
pub mod export;

use std::fmt::Display;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use udm_control::report::{DeviceStatus, MessageReply, Status, Tables};
use udm_control::{execute, Client, Control, Op};
use udm_core::{Error, ErrorKind};

use crate::progress::{finish_bar, progress};

/// Where a command acts.
#[derive(clap::Args, Debug)]
pub struct OnArgs {
    /// The daemon's control socket (default: $UDM_CONTROL, else the
    /// daemon's default path).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Act instead on a stack built here: a device NAME=SPEC (repeatable).
    #[arg(long = "dev", value_name = "NAME=SPEC")]
    devs: Vec<String>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// Options of the verbs that act on a daemon only.
#[derive(clap::Args, Clone, Debug)]
pub struct CtlArgs {
    /// The daemon's control socket (default: $UDM_CONTROL, else the
    /// daemon's default path).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

impl CtlArgs {
    /// Runs `op` on the daemon and prints its result.
    fn run<T: DeserializeOwned + Serialize + Display>(&self, op: Op) -> Result<i32, Error> {
        let r: T = self.call(op)?;
        print(&r, self.json)
    }

    /// Runs `op` on the daemon.
    fn call<T: DeserializeOwned>(&self, op: Op) -> Result<T, Error> {
        Client::connect(&udm_control::control_socket(self.control.clone()))?.call_as(op)
    }
}

/// A running server's control socket, or a stack built in this process.
enum On {
    Control(PathBuf),
    Local(Arc<Control>),
}

impl On {
    fn new(a: &OnArgs) -> Result<On, Error> {
        match &a.control {
            Some(_) if !a.devs.is_empty() => Err(Error::invalid(
                "--control and --dev do not mix: --control acts on the devices of a running daemon",
            )),
            None if !a.devs.is_empty() => Ok(On::Local(Arc::new(Control::build(&a.devs)?))),
            p => Ok(On::Control(udm_control::control_socket(p.clone()))),
        }
    }

    fn call<T: DeserializeOwned>(&self, op: Op) -> Result<T, Error> {
        match self {
            On::Control(p) => Client::connect(p)?.call_as(op),
            On::Local(c) => serde_json::from_value(execute(c, op)?)
                .map_err(|e| Error::new(ErrorKind::Io, format!("unexpected result: {e}"))),
        }
    }
}

/// Prints `r` as JSON or as text (nothing for an empty text).
fn print<T: Serialize + Display>(r: &T, json: bool) -> Result<i32, Error> {
    if json {
        let s = serde_json::to_string(r)
            .map_err(|e| Error::new(ErrorKind::Io, format!("encoding JSON: {e}")))?;
        println!("{s}");
    } else {
        let s = r.to_string();
        if !s.is_empty() {
            println!("{s}");
        }
    }
    Ok(0)
}

/// `udm status`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    on: OnArgs,
    /// Devices to report (default: every mapped device).
    devices: Vec<String>,
}

/// `udm status [--control PATH | --dev …] [DEVICE]...`
pub fn status(a: StatusArgs) -> Result<i32, Error> {
    let r: Status = On::new(&a.on)?.call(Op::Status { names: a.devices })?;
    print(&r, a.on.json)
}

/// `udm table`.
#[derive(clap::Args, Debug)]
pub struct TableArgs {
    #[command(flatten)]
    on: OnArgs,
    /// The inactive tables (loaded, not yet resumed) instead.
    #[arg(long)]
    inactive: bool,
    /// Print crypt keys in hex (`dmsetup table --showkeys`); without it a
    /// key given in hex is printed as `-`.
    #[arg(long)]
    show_keys: bool,
    /// Devices to report (default: every device).
    devices: Vec<String>,
}

/// `udm table [--control PATH | --dev …] [--inactive] [--show-keys] [DEVICE]...`
pub fn table(a: TableArgs) -> Result<i32, Error> {
    let r: Tables = On::new(&a.on)?.call(Op::Table {
        names: a.devices,
        show_keys: a.show_keys,
    })?;
    if !a.inactive {
        return print(&r, a.on.json);
    }
    let inactive = Status {
        devices: r
            .devices
            .into_iter()
            .filter_map(|d| {
                Some(DeviceStatus {
                    name: d.name,
                    lines: d.inactive?,
                })
            })
            .collect(),
    };
    print(&inactive, a.on.json)
}

/// `udm message`.
#[derive(clap::Args, Debug)]
pub struct MessageArgs {
    #[command(flatten)]
    on: OnArgs,
    /// No progress bar, even on a terminal.
    #[arg(long)]
    no_progress: bool,
    /// The device.
    device: String,
    /// [SECTOR] MESSAGE...: the target holding SECTOR (default 0) gets the
    /// message's words.
    #[arg(value_name = "WORDS")]
    words: Vec<String>,
}

/// `udm message [--control PATH | --dev …] DEVICE [SECTOR] MESSAGE...`: sends
/// the message to the target holding SECTOR (default 0) and prints the
/// reply. A long one (writecache's `flush`) draws a progress bar on stderr
/// when it is a terminal, from the target's status, read while the message
/// runs (in process, or over a second control connection).
pub fn message(a: MessageArgs) -> Result<i32, Error> {
    let mut words = a.words;
    if words.is_empty() {
        return Err(Error::invalid(
            "message: expected DEVICE [SECTOR] MESSAGE... (e.g. 'udm message --control PATH wc flush')",
        ));
    }
    let sector = match words[0].parse::<u64>() {
        Ok(s) if words.len() > 1 => {
            words.remove(0);
            s
        }
        _ => 0,
    };
    let on = On::new(&a.on)?;
    let bar = !a.no_progress && std::io::stderr().is_terminal();
    let done = Arc::new(AtomicBool::new(false));
    let name = a.device;
    let drawer = bar.then(|| {
        let done = done.clone();
        let name = name.clone();
        let src = match &on {
            On::Control(p) => On::Control(p.clone()),
            On::Local(c) => On::Local(c.clone()),
        };
        std::thread::spawn(move || {
            // Over a second connection: the first one waits for the reply.
            let mut client = None;
            progress(&done, || {
                let op = Op::Status {
                    names: vec![name.clone()],
                };
                let s: Status = match &src {
                    On::Local(c) => serde_json::from_value(execute(c, op).ok()?).ok()?,
                    On::Control(p) => {
                        if client.is_none() {
                            client = Client::connect(p).ok();
                        }
                        client.as_mut()?.call_as(op).ok()?
                    }
                };
                s.devices.into_iter().next()?.lines.into_iter().next()
            })
        })
    });
    let r: Result<MessageReply, Error> = on.call(Op::Message {
        name,
        sector,
        argv: words,
    });
    finish_bar(&done, drawer);
    print(&r?, a.on.json)
}

/// Options of commands that only print.
#[derive(clap::Args, Debug)]
pub struct JsonArgs {
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// `udm targets`: the target types, with their versions.
pub fn targets(a: JsonArgs) -> Result<i32, Error> {
    print(&Control::default().targets(), a.json)
}

/// `udm version`.
pub fn version(a: JsonArgs) -> Result<i32, Error> {
    print(&Control::default().version(), a.json)
}
