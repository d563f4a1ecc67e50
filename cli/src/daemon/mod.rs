//! `udm daemon`: devices and exports managed at runtime through a control
//! socket, as `dmsetup` manages the kernel's device-mapper.
//!
//! It starts empty (or from a `--config` file), serves the control socket
//! until SIGINT/SIGTERM, then stops its exports (requests in flight are
//! answered first), closes the control socket and flushes every device,
//! top of the stack first, and exits 0 (1 if a flush failed).

mod exports;
mod nbd;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use udm_control::{Config, Control, ControlServer};
use udm_core::{BlockDevice, Error};
use udm_exports::nbd::server;

use crate::serve::{parse_limits, signal_pipe, CompletionArgs};

const AFTER_HELP: &str = "\
The control socket: --control PATH, else $UDM_CONTROL, else
/run/udm/control as root, $XDG_RUNTIME_DIR/udm/control otherwise (mode
0600; a second daemon on it is refused, a stale one reclaimed). Every
other command finds the daemon the same way.

Example:
  udm daemon &
  udm create ram0 ram:1G
  udm create lin --table '0 2097152 linear ram0 0'
  udm export add lin --nbd unix:/tmp/lin.sock
  nbdinfo 'nbd+unix:///lin?socket=/tmp/lin.sock'
  udm dump-config > udm.toml      # 'udm daemon --config udm.toml' recreates it";

/// `udm daemon`'s options.
#[derive(clap::Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct DaemonArgs {
    /// The control socket (see below).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Create the devices and exports of this file (TOML, as 'udm
    /// dump-config' prints) before serving.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Reactor threads per export.
    #[arg(long, default_value_t = 1)]
    reactors: u32,
    #[command(flatten)]
    completion: CompletionArgs,
    /// Per export: close a connection that has not finished its handshake
    /// this many seconds after it was accepted; 0: never.
    #[arg(long, value_name = "SECS", default_value = "10")]
    handshake_timeout: String,
    /// Per export: connections open at once; more are closed at once.
    #[arg(long, value_name = "N", default_value_t = udm_exports::nbd::limits::MAX_CONNECTIONS)]
    max_connections: usize,
    /// Per export: bytes of READ and WRITE buffers in flight (K, M, G; at
    /// least 64M).
    #[arg(long, value_name = "SIZE", default_value = "256M")]
    max_inflight: String,
    /// Serve Prometheus metrics over HTTP at ADDR (e.g. 127.0.0.1:9100;
    /// docs/stats.md).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

/// Runs `udm daemon`.
pub fn main(a: DaemonArgs) -> Result<i32, Error> {
    let reactor = a.completion.config()?;
    if a.reactors == 0 || a.reactors > 64 {
        return Err(Error::invalid(format!(
            "--reactors {}: expected 1 to 64",
            a.reactors
        )));
    }
    // Before any thread starts, so that none takes a signal's default action.
    let stop = signal_pipe()?;
    let config = match &a.config {
        Some(p) => Some(Config::read(p)?),
        None => None,
    };
    let path = udm_control::control_socket(a.control);
    make_parent(&path)?;
    let listener = udm_control::bind(&path)?;
    let ctl = Arc::new(Control::default());
    let limits = parse_limits(&a.handshake_timeout, a.max_connections, &a.max_inflight)?;
    let exports = exports::Exports::new().with(
        "nbd",
        Box::new(nbd::NbdExports::new(a.reactors as usize, reactor, limits)),
    );
    ctl.set_exports(Arc::new(exports));
    if let Some(c) = &config {
        if let Err(e) = c.apply(&ctl) {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
    }
    let metrics = match a.metrics {
        Some(addr) => {
            let m = udm_control::serve_metrics(addr, ctl.clone())?;
            println!("udm: metrics at http://{}/metrics", m.local_addr());
            Some(m)
        }
        None => None,
    };
    let server = ControlServer::start(listener, path.clone(), ctl.clone())?;
    println!("udm: daemon ready; control socket at {}", path.display());
    let _ = std::io::stdout().flush();
    notify_ready();
    let mut b = [0u8; 1];
    let _ = (&stop.1).read(&mut b);
    tracing::info!("daemon: stopping: exports first, then the control socket");
    ctl.stop_exports();
    server.shutdown();
    drop(metrics);
    // Top of the stack first: a cache's flush writes back to the devices
    // below before they are flushed themselves.
    let devs: Vec<Arc<dyn BlockDevice>> = ctl.devices().into_iter().rev().collect();
    let mut failed = 0;
    for d in &devs {
        for (n, s) in server::flush_all(std::slice::from_ref(d))? {
            tracing::error!("flush of '{n}' failed: {s}");
            failed += 1;
        }
    }
    tracing::info!("daemon: stopped; {} devices flushed", devs.len() - failed);
    Ok(if failed == 0 { 0 } else { 1 })
}

/// Makes the socket's directory (mode 0700) if it does not exist.
fn make_parent(path: &Path) -> Result<(), Error> {
    let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| Error::os(format!("control socket directory '{}'", dir.display()), e))
}

/// Tells systemd (Type=notify) that the daemon is ready, when it runs under
/// it (`$NOTIFY_SOCKET` set); nothing otherwise.
fn notify_ready() {
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        tracing::warn!("sd_notify: {e}");
    }
}
