//! `udm export add|remove|ls`: a daemon's exports, managed live.

use udm_control::report::Done;
use udm_control::{ExportInfo, ExportList, ExportOpts, ExportSpec, Op};
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
#[command(group(clap::ArgGroup::new("protocol").required(true).args(["nbd", "vhost_user_blk", "ublk"])))]
pub struct AddArgs {
    #[command(flatten)]
    ctl: CtlArgs,
    /// Serve over NBD at unix:PATH, HOST:PORT, :PORT or PORT (a bare port
    /// listens on 127.0.0.1).
    #[arg(long, value_name = "ADDR")]
    nbd: Option<String>,
    /// Serve over vhost-user-blk (virtual machines) at this socket path.
    #[arg(long, value_name = "PATH")]
    vhost_user_blk: Option<String>,
    /// Serve as a Linux block device, /dev/ublkbN.
    #[arg(long)]
    ublk: bool,
    /// The name clients ask for (default: the device's).
    #[arg(long, value_name = "NAME")]
    export_name: Option<String>,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Queues (vhost-user-blk: default one per reactor; ublk: one thread
    /// each, default one per CPU).
    #[arg(long, value_name = "N")]
    queues: Option<u32>,
    /// Requests each queue holds (ublk; default 64).
    #[arg(long, value_name = "D")]
    depth: Option<u32>,
    /// The N of /dev/ublkbN (ublk; default: the next free).
    #[arg(long, value_name = "N")]
    id: Option<u32>,
    /// Re-attach the device a udm that died left behind (ublk).
    #[arg(long)]
    recover: bool,
    /// Add the device as one of the daemon's user instead of root's (ublk:
    /// UBLK_F_UNPRIVILEGED_DEV, for a daemon without CAP_SYS_ADMIN; no
    /// crash recovery; docs/ublk.md).
    #[arg(long)]
    unprivileged: bool,
    /// How requests go to the device: queued sorts and merges each batch
    /// (for a disk or a network backend), direct hands each on at once,
    /// stream hands each on at once unless it continues the one before
    /// (for RAM); auto picks from the device's report ('udm info').
    #[arg(long, value_name = "MODE", value_parser = ["auto", "direct", "queued", "stream"])]
    dispatch: Option<String>,
    #[command(flatten)]
    tls: crate::serve::TlsArgs,
    /// The device.
    device: String,
}

impl AddArgs {
    fn spec(self) -> ExportSpec {
        let (protocol, address) = match (self.nbd, self.vhost_user_blk) {
            (Some(a), _) => ("nbd", a),
            (None, Some(p)) => ("vhost-user-blk", p),
            (None, None) => ("ublk", String::new()),
        };
        ExportSpec {
            device: self.device,
            protocol: protocol.into(),
            address,
            name: self.export_name,
            read_only: self.read_only,
            opts: ExportOpts {
                queues: self.queues,
                depth: self.depth,
                id: self.id,
                recover: self.recover,
                unprivileged: self.unprivileged,
                dispatch: self.dispatch,
                tls: (self.tls.mode != "off").then_some(self.tls.mode),
                tls_creds: self.tls.creds.map(|p| p.display().to_string()),
                tls_verify_peer: self.tls.verify_peer,
                tls_authz: self.tls.authz,
                insecure: self.tls.insecure,
            },
        }
    }
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
        ExportCmd::Add(a) => {
            let ctl = a.ctl.clone();
            ctl.run::<ExportInfo>(Op::ExportAdd(a.spec()))
        }
        ExportCmd::Remove(a) => a.ctl.run::<Done>(Op::ExportRemove {
            name: a.name,
            force: a.force,
        }),
        ExportCmd::Ls(a) => a.run::<ExportList>(Op::ExportLs {}),
    }
}
