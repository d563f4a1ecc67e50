//! `udm stats NAME [--histogram] [--clear] [--json] [--control PATH]`: a
//! mapped device's I/O statistics from a running daemon or server (see
//! docs/stats.md); the control socket is found as for every verb.

use std::path::PathBuf;

use udm_control::stats::DeviceStats;
use udm_control::{Client, Op};
use udm_core::{Error, ErrorKind};

/// `udm stats`.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// The mapped device.
    name: String,
    /// With the latency histograms (timed while
    /// 'udm message NAME 0 stats histogram on' is in effect).
    #[arg(long)]
    histogram: bool,
    /// Start the counts again from zero after printing them.
    #[arg(long)]
    clear: bool,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// The daemon's control socket (default: $UDM_CONTROL, else the
    /// daemon's default path).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
}

/// Runs `udm stats`.
pub fn main(a: StatsArgs) -> Result<i32, Error> {
    let path = udm_control::control_socket(a.control);
    let r: DeviceStats = Client::connect(&path)?.call_as(Op::Stats {
        name: a.name,
        histogram: a.histogram,
        clear: a.clear,
    })?;
    if a.json {
        let s = serde_json::to_string(&r)
            .map_err(|e| Error::new(ErrorKind::Io, format!("encoding JSON: {e}")))?;
        println!("{s}");
    } else {
        println!("{r}");
    }
    Ok(0)
}
