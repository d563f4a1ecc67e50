//! `udm export add|remove|ls`: a daemon's exports, managed live.

use udm_control::report::Done;
use udm_control::{ExportInfo, ExportList, Op};
use udm_core::Error;

use super::CtlArgs;

/// `udm export`'s verbs.
#[derive(clap::Subcommand, Debug)]
pub enum ExportCmd {
    /// Serve a device.
    Add(AddArgs),
    /// Stop serving an export.
    Remove(RemoveArgs),
    /// The exports, with their clients.
    Ls(CtlArgs),
}

/// `udm export add`.
#[derive(clap::Args, Debug)]
pub struct AddArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Serve over NBD at unix:PATH, HOST:PORT, :PORT or PORT (a bare port
    /// listens on 127.0.0.1).
    #[arg(long, value_name = "ADDR", required = true)]
    nbd: String,
    /// The name clients ask for (default: the device's).
    #[arg(long, value_name = "NAME")]
    export_name: Option<String>,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// The device.
    device: String,
}

/// `udm export remove`.
#[derive(clap::Args, Debug)]
pub struct RemoveArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Even with clients connected: they are disconnected once their
    /// requests in flight are answered.
    #[arg(long)]
    force: bool,
    /// The export.
    name: String,
}

/// Runs `udm export …`.
pub fn main(cmd: ExportCmd) -> Result<i32, Error> {
    match cmd {
        ExportCmd::Add(a) => a.ctl.run::<ExportInfo>(Op::ExportAdd {
            device: a.device,
            protocol: "nbd".into(),
            address: a.nbd,
            name: a.export_name,
            read_only: a.read_only,
        }),
        ExportCmd::Remove(a) => a.ctl.run::<Done>(Op::ExportRemove {
            name: a.name,
            force: a.force,
        }),
        ExportCmd::Ls(a) => a.run::<ExportList>(Op::ExportLs {}),
    }
}
