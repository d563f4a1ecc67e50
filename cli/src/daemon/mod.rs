//! `udm daemon`: devices and exports managed at runtime through a control
//! socket, as `dmsetup` manages the kernel's device-mapper.
//!
//! It starts empty (or from a `--config` file), serves the control socket
//! until SIGINT/SIGTERM, then stops its exports (requests in flight are
//! answered first), closes the control socket and flushes every device,
//! top of the stack first, and exits 0 (1 if a flush failed).

mod exports;
mod nbd;
mod running;
mod ublk;
mod vhost;

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use udm_control::{Config, Control, ControlServer, LimitsDef};
use udm_core::access::{dir_of, make_private_dir, parse_group, Access};
use udm_core::{BlockDevice, Error};
use udm_exports::limits::{self, Limits};
use udm_exports::nbd::server;

use crate::serve::{parse_limits, signal_pipe, CompletionArgs};
use running::Service;

const AFTER_HELP: &str = "\
The control socket: --control PATH, else $UDM_CONTROL, else
/run/udm/control as root, $XDG_RUNTIME_DIR/udm/control otherwise (mode
0600; a second daemon on it is refused, a stale one reclaimed). Every
other command finds the daemon the same way.

Access (docs/security.md): the control socket and the vhost-user-blk
sockets are mode 0600 (0660 and the group's with --socket-group), in
directories no other user can write, and only udm's user, root and the
group's members are served: each peer's credentials are checked too.

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
    /// NBD: close a connection that has not finished its handshake this
    /// many seconds after it was accepted; 0: never [default: 10, or the
    /// config's [limits]].
    #[arg(long, value_name = "SECS")]
    handshake_timeout: Option<String>,
    /// NBD: connections open at once, over all exports; more are closed at
    /// once [default: 1024, or the config's [limits]].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// NBD: bytes of READ and WRITE buffers in flight, over all exports
    /// (K, M, G; at least 64M) [default: 256M, or the config's [limits]].
    #[arg(long, value_name = "SIZE")]
    max_inflight: Option<String>,
    /// Serve Prometheus metrics over HTTP at ADDR: PORT or :PORT listens
    /// on 127.0.0.1; any other address must be written out (HOST:PORT,
    /// e.g. 0.0.0.0:9100; docs/stats.md).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// Admit the members of GROUP (a name or gid) to the control socket and
    /// the vhost-user-blk sockets, besides udm's user and root: the
    /// sockets become mode 0660, owned by the group.
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
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
    let (limits, limits_def) = resolve_limits(&a, config.as_ref())?;
    let access = Access {
        group: a.socket_group.as_deref().map(parse_group).transpose()?,
    };
    let metrics_addr = a
        .metrics
        .as_deref()
        .map(udm_control::metrics::parse_addr)
        .transpose()?;
    let path = udm_control::control_socket(a.control);
    make_private_dir(&dir_of(&path), access)?;
    let listener = udm_control::bind(&path, access)?;
    let ctl = Arc::new(Control::default());
    ctl.set_limits(limits_def);
    // One budget and connection cap for every export of the daemon.
    let pool = limits::Pool::new(&limits)?;
    let nbd = nbd::Nbd::new(a.reactors as usize, reactor, limits, pool.clone());
    // SIGHUP reads the NBD exports' TLS credentials again.
    crate::serve::reload_on_sighup(nbd.tls_reloader())?;
    let exports = exports::Exports::new()
        .with("nbd", Box::new(Service::new(nbd)))
        .with(
            "ublk",
            Box::new(Service::new(ublk::Ublk::new(reactor, pool.clone()))),
        )
        .with(
            "vhost-user-blk",
            Box::new(Service::new(vhost::Vhost::new(
                a.reactors as usize,
                reactor,
                pool,
                access,
            ))),
        );
    ctl.set_exports(Arc::new(exports));
    if let Some(c) = &config {
        if let Err(e) = c.apply_asking(&ctl, &mut ask_on_terminal) {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
    }
    let metrics = match metrics_addr {
        Some(addr) => {
            let m = udm_control::serve_metrics(addr, ctl.clone())?;
            println!("udm: metrics at http://{}/metrics", m.local_addr());
            Some(m)
        }
        None => None,
    };
    let server = ControlServer::start(listener, path.clone(), ctl.clone(), access)?;
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

/// The passphrase of a config's `luks:` device without a key file: asked
/// for on the daemon's terminal, as `udm create` asks; without a terminal
/// there is no one to ask.
fn ask_on_terminal(name: &str, spec: &str) -> Result<Option<udm_control::luks::Passphrase>, Error> {
    use std::io::IsTerminal;
    if !std::io::stdin().is_terminal() {
        return Err(Error::invalid(format!(
            "luks: no key-file, and no terminal to ask for the passphrase on: add key-file=PATH to the spec, start the daemon on a terminal, or leave the device out and `udm create {name} {spec}` (which asks)"
        )));
    }
    crate::cmds::dev::ask_passphrase(&format!("Enter passphrase for '{name}' ({spec}): ")).map(Some)
}

/// The NBD limits: each from its flag, else the config's `[limits]`, else
/// the default; and their record for `dump-config`.
fn resolve_limits(a: &DaemonArgs, config: Option<&Config>) -> Result<(Limits, LimitsDef), Error> {
    let defaults = LimitsDef {
        handshake_timeout: Some(limits::HANDSHAKE_TIMEOUT.as_secs()),
        max_connections: Some(limits::MAX_CONNECTIONS),
        max_inflight: Some(format!("{}M", limits::MAX_INFLIGHT >> 20)),
    };
    let over = |base: &LimitsDef, top: LimitsDef| LimitsDef {
        handshake_timeout: top.handshake_timeout.or(base.handshake_timeout),
        max_connections: top.max_connections.or(base.max_connections),
        max_inflight: top.max_inflight.or(base.max_inflight.clone()),
    };
    let check = |d: &LimitsDef| {
        parse_limits(
            &d.handshake_timeout.unwrap_or_default().to_string(),
            d.max_connections.unwrap_or_default(),
            d.max_inflight.as_deref().unwrap_or_default(),
        )
    };
    let mut def = defaults;
    if let Some(c) = config.filter(|c| !c.limits.is_empty()) {
        def = over(&def, c.limits.clone());
        // A bad value in the file is named by its place there.
        check(&def).map_err(|e| e.context(format!("{}: [limits]", c.limits_origin())))?;
    }
    let flags = LimitsDef {
        handshake_timeout: match &a.handshake_timeout {
            Some(s) => Some(s.parse().map_err(|_| {
                Error::invalid(format!(
                    "--handshake-timeout '{s}': expected seconds, 0 (none) to 86400"
                ))
            })?),
            None => None,
        },
        max_connections: a.max_connections,
        max_inflight: a.max_inflight.clone(),
    };
    let def = over(&def, flags);
    Ok((check(&def)?, def))
}

/// Tells systemd (Type=notify) that the daemon is ready, when it runs under
/// it (`$NOTIFY_SOCKET` set); nothing otherwise.
fn notify_ready() {
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        tracing::warn!("sd_notify: {e}");
    }
}
