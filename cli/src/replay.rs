//! `udm log-replay`: replays a dm-log-writes log onto a device, as
//! xfstests' `replay-log` does; the replay itself is
//! `udm_mapper::targets::log_writes::replay`.

use std::process::Command;
use std::sync::Arc;

use udm_backends::{FileDevice, FileOpts};
use udm_control::{is_backend_spec, open_backend};
use udm_core::{BlockDevice, Error, ErrorKind};
use udm_mapper::targets::log_writes::replay::{self, Point, Stop};

/// Replay a dm-log-writes log (udm's log-writes target or Linux's) onto a
/// device, up to an entry count or a mark, optionally running a check
/// command at every flush point.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
LOG and TARGET are file paths (opened buffered) or backend specs
(file:PATH[,options], ram:SIZE, ...; see 'udm --help').

The check command runs through 'sh -c' after each flush entry is replayed
and the target flushed, with UDM_REPLAY_ENTRY (the entry's index) and
UDM_REPLAY_MARK (the last mark replayed, if any) in its environment. The
first check that exits non-zero stops the replay: udm exits 1.")]
pub struct ReplayArgs {
    /// The log device.
    #[arg(long, value_name = "LOG")]
    log: String,
    /// The device to replay onto.
    #[arg(long, value_name = "TARGET")]
    replay: String,
    /// Replay this many entries.
    #[arg(long, value_name = "N", conflicts_with = "end_mark")]
    limit: Option<u64>,
    /// Replay up to and including the mark called NAME.
    #[arg(long, value_name = "NAME")]
    end_mark: Option<String>,
    /// A command to run at every flush point.
    #[arg(long, value_name = "CMD")]
    check: Option<String>,
}

/// A device from a path or a backend spec.
fn open(what: &str, spec: &str) -> Result<Arc<dyn BlockDevice>, Error> {
    if is_backend_spec(spec) {
        return open_backend(what, spec).map_err(|e| e.context(format!("--{what}")));
    }
    let o = FileOpts {
        buffered: true,
        ..FileOpts::default()
    };
    FileDevice::open(spec, spec, o)
        .map(|d| Arc::new(d) as Arc<dyn BlockDevice>)
        .map_err(|e| e.context(format!("--{what} '{spec}'")))
}

/// Runs `udm log-replay`.
pub fn main(a: ReplayArgs) -> Result<i32, Error> {
    let log = open("log", &a.log)?;
    let target = open("replay", &a.replay)?;
    let stop = match (a.limit, a.end_mark) {
        (Some(n), _) => Stop::Limit(n),
        (None, Some(m)) => Stop::Mark(m),
        (None, None) => Stop::End,
    };
    let mut failed: Option<String> = None;
    let r = replay::replay(log, target, &stop, |p: &Point| {
        let Some(cmd) = &a.check else { return Ok(()) };
        let st = Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .env("UDM_REPLAY_ENTRY", p.entry.to_string())
            .env("UDM_REPLAY_MARK", p.last_mark.clone().unwrap_or_default())
            .status()
            .map_err(|e| Error::os(format!("running check '{cmd}'"), e))?;
        if st.success() {
            return Ok(());
        }
        let m = format!("check '{cmd}' failed after entry {} ({st})", p.entry);
        failed = Some(m.clone());
        Err(Error::new(ErrorKind::Io, m))
    });
    match r {
        Ok(s) => {
            println!(
                "replayed {} entries ({} writes, {} discards, {} flushes, {} marks); {} checks passed",
                s.entries, s.writes, s.discards, s.flushes, s.marks, s.checks
            );
            Ok(0)
        }
        Err(_) if failed.is_some() => {
            eprintln!("udm: log-replay: {}", failed.unwrap_or_default());
            Ok(1)
        }
        Err(e) => Err(e.context("log-replay")),
    }
}
