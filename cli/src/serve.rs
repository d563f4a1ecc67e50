//! `udm serve`: builds the stack from `--dev` specs (or a `--config` file of
//! them) and serves devices over NBD (or one over vhost-user-blk) until
//! SIGINT/SIGTERM.
//!
//! On a signal it stops accepting, finishes the requests in flight, flushes
//! every device and exits 0.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;

use udm_control::{Control, ControlServer, Holder};
use udm_core::access::{parse_group, Access};
use udm_core::{BlockDevice, CompletionMode, Error, ReactorConfig};
use udm_exports::limits;
use udm_exports::nbd::{
    server, Export, Limits, Listen, Server, ServerConfig, Tls, TlsMode, TlsOptions,
};
use udm_exports::vhost;

const AFTER_HELP: &str = "\
Without --dev or --config: a 1 GiB RAM disk (ram0) with a linear device
over it (lin), exported as 'lin'.

NBD without TLS has no authentication: a TCP listener off loopback needs
--tls require (or --insecure). --tls-creds DIR holds QEMU's x509 layout
(ca-cert.pem, server-cert.pem, server-key.pem, optional ca-crl.pem), read
again on SIGHUP. TLS-PSK is not offered (rustls has none).";

/// `udm serve`'s options.
#[derive(clap::Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct ServeArgs {
    /// A device, as for 'udm bench' (repeatable).
    #[arg(long = "dev", value_name = "NAME=SPEC")]
    devs: Vec<String>,
    /// More --dev specs, one NAME=SPEC per line ('#' comments).
    #[arg(long = "config", value_name = "FILE")]
    configs: Vec<String>,
    /// Serve device NAME as export NAME, read-only with ':ro' (repeatable;
    /// default: the last device defined; the first export is the default
    /// export, name '').
    #[arg(long = "export", value_name = "NAME[:ro]")]
    exports: Vec<String>,
    /// unix:PATH, or HOST:PORT / :PORT / PORT for TCP (a bare port listens
    /// on 127.0.0.1); repeatable; default: a unix socket in the temporary
    /// directory, printed at start.
    #[arg(long = "listen", value_name = "ADDR")]
    listens: Vec<String>,
    /// Reactor threads serving connections.
    #[arg(long, default_value_t = 1)]
    reactors: u32,
    /// How requests go to each device: queued sorts and merges the
    /// requests of each receive (for a disk or a network backend), direct
    /// hands each on at once, stream hands each on at once unless it
    /// continues the one before (for RAM); auto picks per device from its
    /// report ('udm info').
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = ["auto", "direct", "queued", "stream"])]
    dispatch: String,
    /// Serve the export over vhost-user-blk (virtual machines) at this
    /// socket path instead of NBD (one export).
    #[arg(long, value_name = "PATH", conflicts_with_all = ["listens", "export_max_connections"])]
    vhost_user_blk: Option<PathBuf>,
    /// vhost-user-blk: queues, each on its own reactor [default:
    /// --reactors].
    #[arg(long, value_name = "N", requires = "vhost_user_blk")]
    queues: Option<u16>,
    /// The control socket (mode 0600) for 'udm status/table/message/reload
    /// --control PATH'; default: beside the first unix listen socket as
    /// <sock>.ctl, else $XDG_RUNTIME_DIR (or the temporary
    /// directory)/udm-<pid>.ctl; printed at start, removed at exit.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    #[command(flatten)]
    completion: CompletionArgs,
    /// Serve Prometheus metrics over HTTP at ADDR: PORT or :PORT listens
    /// on 127.0.0.1; any other address must be written out (HOST:PORT).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// Admit the members of GROUP (a name or gid) to the control socket and
    /// the vhost-user-blk socket, besides udm's user and root (mode 0660,
    /// owned by the group; docs/security.md).
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
    /// Close a connection that has not finished its handshake (entered
    /// transmission) this many seconds after it was accepted; 0: never.
    #[arg(long, value_name = "SECS", default_value = "10")]
    handshake_timeout: String,
    /// Connections open at once, server-wide; more are closed at once
    /// (lowered to fit RLIMIT_NOFILE, which is raised to its hard limit).
    #[arg(long, value_name = "N", default_value_t = udm_exports::limits::MAX_CONNECTIONS)]
    max_connections: usize,
    /// Connections in transmission on export NAME at once; a client over
    /// it is refused at NBD_OPT_GO (NBD_REP_ERR_POLICY) (repeatable).
    #[arg(long = "export-max-connections", value_name = "NAME=N")]
    export_max_connections: Vec<String>,
    /// Bytes of READ and WRITE buffers in flight, server-wide (K, M, G
    /// suffixes; at least 64M): half is shared equally between
    /// --max-connections, half lent to the connections that need more.
    #[arg(long, value_name = "SIZE", default_value = "256M")]
    max_inflight: String,
    /// Serve the exports as Linux block devices, /dev/ublkbN (ublk, one
    /// queue per CPU; docs/ublk.md), instead of over NBD.
    #[arg(long, conflicts_with_all = ["listens", "export_max_connections", "vhost_user_blk"])]
    ublk: bool,
    /// ublk: add the devices as udm's user's instead of root's
    /// (UBLK_F_UNPRIVILEGED_DEV; docs/ublk.md).
    #[arg(long, requires = "ublk")]
    unprivileged: bool,
    #[command(flatten)]
    tls: TlsArgs,
}

/// NBD over TLS: `udm serve`'s and `udm daemon`'s flags.
#[derive(clap::Args, Debug, Default)]
pub struct TlsArgs {
    /// NBD over TLS: off; on (at the client's choice); require (before
    /// STARTTLS every option but ABORT is refused, NBD_REP_ERR_TLS_REQD).
    #[arg(long = "tls", value_name = "MODE", default_value = "off", value_parser = ["off", "on", "require"])]
    pub mode: String,
    /// The x509 credentials' directory, QEMU's layout: ca-cert.pem,
    /// server-cert.pem, server-key.pem, optional ca-crl.pem; read again on
    /// SIGHUP (new connections get the new ones).
    #[arg(long = "tls-creds", value_name = "DIR")]
    pub creds: Option<PathBuf>,
    /// Require a client certificate signed by ca-cert.pem (and not in
    /// ca-crl.pem).
    #[arg(long = "tls-verify-peer")]
    pub verify_peer: bool,
    /// Admit only client certificates with these subject names, RFC 4514
    /// as `openssl x509 -noout -subject -nameopt RFC2253` prints them
    /// (e.g. 'CN=backup,O=Example'); implies --tls-verify-peer.
    #[arg(long = "tls-authz", value_name = "NAME", num_args = 1..)]
    pub authz: Vec<String>,
    /// Serve plaintext on TCP addresses other than loopback (refused
    /// without it: anyone who connects gets the disk).
    #[arg(long)]
    pub insecure: bool,
}

impl TlsArgs {
    /// The TLS the flags ask for, its credentials loaded (None: off).
    pub fn load(&self) -> Result<Option<Arc<Tls>>, Error> {
        let mode: TlsMode = self.mode.parse().map_err(Error::invalid)?;
        let creds = match (&self.creds, mode) {
            (None, TlsMode::Off) => {
                if self.verify_peer || !self.authz.is_empty() {
                    return Err(Error::invalid(
                        "--tls-verify-peer and --tls-authz need --tls on or --tls require",
                    ));
                }
                return Ok(None);
            }
            (Some(_), TlsMode::Off) => {
                return Err(Error::invalid(
                    "--tls-creds: give --tls require (or --tls on) to serve TLS",
                ))
            }
            (None, _) => {
                return Err(Error::invalid(format!(
                    "--tls {mode}: give --tls-creds DIR (ca-cert.pem, server-cert.pem, \
                     server-key.pem)"
                )))
            }
            (Some(c), _) => c.clone(),
        };
        Tls::load(TlsOptions {
            mode,
            creds,
            verify_peer: self.verify_peer,
            authz: self.authz.clone(),
        })
        .map(Some)
    }
}

/// Reads the TLS credentials again on each SIGHUP, from a thread of its
/// own; a failed reload keeps the credentials in force and says why.
pub(crate) fn reload_on_sighup(reload: impl Fn() + Send + 'static) -> Result<(), Error> {
    let (wr, rd) = UnixStream::pair().map_err(|e| Error::os("signal socket", e))?;
    signal_hook::low_level::pipe::register(signal_hook::consts::SIGHUP, wr)
        .map_err(|e| Error::os("handling SIGHUP", e))?;
    std::thread::Builder::new()
        .name("udm-sighup".into())
        .spawn(move || {
            let mut b = [0u8; 64];
            while matches!((&rd).read(&mut b), Ok(n) if n > 0) {
                reload();
            }
        })
        .map_err(|e| Error::os("spawning the SIGHUP thread", e))?;
    Ok(())
}

/// The built-in stack of `udm serve`.
pub const DEFAULT_DEVS: &[&str] = &["ram0=ram:1G", "lin=0 2097152 linear ram0 0"];

/// Reads `NAME=SPEC` lines from `path`: blank lines and `#` comments skipped.
pub fn read_config(path: &str) -> Result<Vec<String>, Error> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::os(format!("--config '{path}'"), e))?;
    Ok(parse_config(&text))
}

fn parse_config(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// Parses `NAME[:ro]`.
fn parse_export(s: &str) -> Result<(String, bool), Error> {
    let (name, ro) = match s.rsplit_once(':') {
        Some((n, "ro")) => (n, true),
        Some((n, "rw")) => (n, false),
        Some((_, flag)) => {
            return Err(Error::invalid(format!(
                "--export '{s}': unknown flag '{flag}' (known: ro, rw)"
            )))
        }
        None => (s, false),
    };
    if name.is_empty() {
        return Err(Error::invalid(format!("--export '{s}': empty device name")));
    }
    Ok((name.to_string(), ro))
}

/// The server's limits from `--handshake-timeout SECS`, `--max-connections
/// N` and `--max-inflight SIZE`.
pub(crate) fn parse_limits(hs: &str, max_conns: usize, inflight: &str) -> Result<Limits, Error> {
    let secs = hs
        .parse::<u64>()
        .ok()
        .filter(|&s| s <= 86_400)
        .ok_or_else(|| {
            Error::invalid(format!(
                "--handshake-timeout '{hs}': expected seconds, 0 (none) to 86400"
            ))
        })?;
    let max_inflight = limits::parse_size(inflight).ok_or_else(|| {
        Error::invalid(format!(
            "--max-inflight '{inflight}': expected a size such as 256M"
        ))
    })?;
    if max_inflight < limits::MIN_INFLIGHT {
        return Err(Error::invalid(format!(
            "--max-inflight '{inflight}': expected at least {} MiB (two of the largest requests)",
            limits::MIN_INFLIGHT >> 20
        )));
    }
    let l = Limits {
        handshake_timeout: (secs > 0).then(|| std::time::Duration::from_secs(secs)),
        max_connections: max_conns,
        max_inflight,
    };
    l.validate()?;
    Ok(l)
}

/// Parses `NAME=N` of `--export-max-connections`.
fn parse_export_cap(s: &str) -> Result<(String, usize), Error> {
    let bad = || {
        Error::invalid(format!(
            "--export-max-connections '{s}': expected NAME=N, N at least 1"
        ))
    };
    let (n, c) = s.split_once('=').ok_or_else(bad)?;
    let c = c.parse::<usize>().ok().filter(|&c| c > 0).ok_or_else(bad)?;
    if n.is_empty() {
        return Err(bad());
    }
    Ok((n.to_string(), c))
}

/// Runs `udm serve`.
pub fn main(a: ServeArgs) -> Result<i32, Error> {
    let ServeArgs {
        mut devs,
        configs,
        exports,
        listens,
        reactors,
        dispatch,
        vhost_user_blk,
        queues,
        control,
        completion,
        metrics,
        socket_group,
        handshake_timeout,
        max_connections,
        export_max_connections,
        max_inflight,
        ublk,
        unprivileged,
        tls,
    } = a;
    let tls_insecure = tls.insecure;
    let tls = tls.load()?;
    if tls.is_some() && (ublk || vhost_user_blk.is_some()) {
        return Err(Error::invalid(
            "--tls is for NBD: ublk and vhost-user-blk are local sockets and devices",
        ));
    }
    let limits = parse_limits(&handshake_timeout, max_connections, &max_inflight)?;
    let access = Access {
        group: socket_group.as_deref().map(parse_group).transpose()?,
    };
    let metrics = metrics
        .as_deref()
        .map(udm_control::metrics::parse_addr)
        .transpose()?;
    let export_caps = export_max_connections
        .iter()
        .map(|s| parse_export_cap(s))
        .collect::<Result<Vec<_>, _>>()?;
    let reactor = completion.config()?;
    if reactors == 0 || reactors > 64 {
        return Err(Error::invalid(format!(
            "--reactors {reactors}: expected 1 to 64"
        )));
    }
    // SIGINT and SIGTERM become readable on a socket that the accept loop
    // polls; handled before any thread starts (reactors, and the workers
    // some targets start when built), so no thread takes their default
    // action.
    let stop = signal_pipe()?;
    for c in &configs {
        devs.extend(read_config(c)?);
    }
    let builtin = devs.is_empty();
    if builtin {
        devs = DEFAULT_DEVS.iter().map(|s| s.to_string()).collect();
    }
    let stack = Arc::new(Control::build(&devs)?);
    let mut table = Vec::new();
    let wanted: Vec<(String, bool)> = if exports.is_empty() {
        match stack.devices().last() {
            Some(d) => vec![(d.name().to_string(), false)],
            None => return Err(Error::invalid("no devices to export")),
        }
    } else {
        exports
            .iter()
            .map(|e| parse_export(e))
            .collect::<Result<_, _>>()?
    };
    for (name, ro) in &wanted {
        let Some(dev) = stack.get(name) else {
            return Err(Error::invalid(format!(
                "--export '{name}': no such device (define it with --dev)"
            )));
        };
        if table.iter().any(|e: &Export| &e.info.name == name) {
            return Err(Error::invalid(format!("--export '{name}': exported twice")));
        }
        // The export holds its device: it cannot be removed under it.
        let protocol = match (&vhost_user_blk, ublk) {
            (_, true) => "ublk",
            (Some(_), false) => "vhost-user-blk",
            (None, false) => "nbd",
        };
        stack.hold(
            name,
            Holder::Export {
                name: name.clone(),
                protocol: protocol.into(),
            },
        )?;
        let mut e = Export::new(name, dev, *ro);
        e.set_dispatch(dispatch.parse()?);
        e.max_connections = export_caps
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|&(_, c)| c);
        table.push(e);
    }
    if let Some((n, _)) = export_caps
        .iter()
        .find(|(n, _)| !table.iter().any(|e| &e.info.name == n))
    {
        return Err(Error::invalid(format!(
            "--export-max-connections '{n}': no such export"
        )));
    }
    if ublk {
        let pool = limits::Pool::new(&limits)?;
        let ub = UblkServe {
            control,
            reactor,
            unprivileged,
            access,
        };
        return serve_ublk(stack, &table, &wanted, ub, &pool, stop);
    }
    if vhost_user_blk.is_some() && table.len() != 1 {
        return Err(Error::invalid(
            "--vhost-user-blk serves one device: give one --export",
        ));
    }
    let listen: Vec<Listen> = if let Some(p) = &vhost_user_blk {
        // Only for the control socket's default place, beside it.
        vec![Listen::Unix(p.clone())]
    } else if listens.is_empty() {
        let p = std::env::temp_dir().join(format!("udm-nbd-{}.sock", std::process::id()));
        vec![Listen::Unix(p)]
    } else {
        listens
            .iter()
            .map(|l| Listen::parse(l))
            .collect::<Result<_, _>>()?
    };

    let ctl_path = match control {
        Some(p) => p,
        None => udm_control::default_path(listen.iter().find_map(|l| match l {
            Listen::Unix(p) => Some(p.as_path()),
            Listen::Tcp(_) => None,
        })),
    };
    // Bound before any thread of ours starts: it sets the umask around bind.
    let ctl_listener = udm_control::bind(&ctl_path, access)?;
    let unlink = Unlink(ctl_path.clone());
    let srv = match vhost_user_blk {
        Some(path) => {
            let e = &table[0];
            let q = queues.unwrap_or(reactors as u16);
            let vs = vhost::Server::bind(
                e.dev.clone(),
                vhost::ServerConfig {
                    path,
                    queues: q,
                    reactors: 0,
                    reactor,
                    read_only: wanted[0].1,
                    budget: Some(limits::Pool::new(&limits)?.budget.clone()),
                    dispatch: e.dispatch,
                    access,
                },
            )?;
            println!(
                "udm: serving '{}' ({} bytes) over vhost-user-blk at {} ({q} queues, dispatch {} ({}))",
                e.info.name,
                e.info.size,
                vs.path().display(),
                e.dispatch,
                e.dispatch_why
            );
            Srv::Vhost(vs)
        }
        None => Srv::Nbd(Server::bind(
            table,
            ServerConfig {
                listen,
                reactors: reactors as usize,
                reactor,
                limits,
                pool: None,
                tls: tls.clone(),
                insecure: tls_insecure,
            },
        )?),
    };
    if let Some(t) = &tls {
        println!("udm: {}", t.describe());
        tracing::info!("nbd: {}", t.describe());
        let t = t.clone();
        reload_on_sighup(move || match t.reload() {
            Ok(()) => tracing::info!(
                "nbd: TLS credentials reloaded from {}",
                t.options().creds.display()
            ),
            Err(e) => tracing::error!("nbd: TLS credentials not reloaded (the old ones stay): {e}"),
        })?;
    }
    for e in srv.nbd_exports() {
        let i = &e.info;
        for l in srv.nbd_addresses() {
            let uri = match &l {
                Listen::Unix(p) => format!("nbd+unix:///{}?socket={}", i.name, p.display()),
                Listen::Tcp(a) if tls.is_some() => format!("nbds://{a}/{}", i.name),
                Listen::Tcp(a) => format!("nbd://{a}/{}", i.name),
            };
            println!(
                "udm: serving '{}' ({} bytes, block {}/{}/{}, flags {:#06x}, dispatch {} ({})) at {uri}",
                i.name,
                i.size,
                i.min_block,
                i.pref_block,
                i.max_payload,
                i.flags,
                e.dispatch,
                e.dispatch_why
            );
        }
    }
    let ctl = ControlServer::start(ctl_listener, ctl_path.clone(), stack.clone(), access)?;
    let metrics = match metrics {
        Some(addr) => {
            let m = udm_control::serve_metrics(addr, stack.clone())?;
            println!("udm: metrics at http://{}/metrics", m.local_addr());
            Some(m)
        }
        None => None,
    };
    // On a signal, the control socket closes first: no reload may leave a
    // device suspended, nor start, past this point, and a device a client
    // suspended resumes, so that the requests it holds finish. Then the
    // server stops.
    let (srv_stop, srv_stop_tx) = UnixStream::pair().map_err(|e| Error::os("stop socket", e))?;
    let wake = stop
        .0
        .try_clone()
        .map_err(|e| Error::os("signal socket", e))?;
    let watcher = std::thread::Builder::new()
        .name("udm-stop".into())
        .spawn(move || {
            let mut b = [0u8; 1];
            let _ = (&stop.1).read(&mut b);
            ctl.shutdown();
            let _ = (&srv_stop_tx).write_all(&b);
        })
        .map_err(|e| Error::os("spawning the stop thread", e))?;
    std::mem::forget(unlink); // the control server removes it now
    println!("udm: control socket at {}", ctl_path.display());
    let _ = std::io::stdout().flush();
    let r = srv.run(srv_stop.as_raw_fd());
    // Stopped by the watcher, or failed: either way the watcher finishes.
    let _ = (&wake).write_all(&[0]);
    let _ = watcher.join();
    drop(metrics);
    r?;
    let all: Vec<Arc<dyn BlockDevice>> = stack.devices();
    let failed = server::flush_all(&all)?;
    for (n, s) in &failed {
        tracing::error!("flush of '{n}' failed: {s}");
    }
    tracing::info!("stopped; {} devices flushed", all.len() - failed.len());
    Ok(if failed.is_empty() { 0 } else { 1 })
}

/// The server `udm serve` runs.
enum Srv {
    Nbd(Server),
    Vhost(vhost::Server),
}

impl Srv {
    fn nbd_exports(&self) -> &[Export] {
        match self {
            Srv::Nbd(s) => s.exports(),
            Srv::Vhost(_) => &[],
        }
    }

    fn nbd_addresses(&self) -> Vec<Listen> {
        match self {
            Srv::Nbd(s) => s.addresses(),
            Srv::Vhost(_) => Vec::new(),
        }
    }

    fn run(self, stop_fd: std::os::fd::RawFd) -> Result<(), Error> {
        match self {
            Srv::Nbd(s) => s.run(stop_fd),
            Srv::Vhost(s) => s.run(stop_fd),
        }
    }
}

/// How `udm serve --ublk` serves.
struct UblkServe {
    control: Option<PathBuf>,
    reactor: ReactorConfig,
    unprivileged: bool,
    access: Access,
}

/// `udm serve --ublk`: each export as `/dev/ublkbN` until SIGINT or
/// SIGTERM, then the devices are deleted and flushed.
fn serve_ublk(
    stack: Arc<Control>,
    table: &[Export],
    wanted: &[(String, bool)],
    ub: UblkServe,
    pool: &limits::Pool,
    stop: (UnixStream, UnixStream),
) -> Result<i32, Error> {
    use udm_exports::ublk::{UblkConfig, UblkDevice};
    let UblkServe {
        control,
        reactor,
        unprivileged,
        access,
    } = ub;
    let ctl_path = control.unwrap_or_else(|| udm_control::default_path(None));
    let ctl_listener = udm_control::bind(&ctl_path, access)?;
    let unlink = Unlink(ctl_path.clone());
    let mut devs = Vec::new();
    // `table` holds the exports of `wanted`, in order.
    for (e, (_, ro)) in table.iter().zip(wanted) {
        let cfg = UblkConfig {
            id: None,
            queues: None,
            depth: None,
            read_only: *ro,
            recover: false,
            unprivileged,
            reactor,
            dispatch: e.dispatch,
        };
        let d = UblkDevice::start(e.dev.clone(), cfg, &pool.budget)?;
        println!(
            "udm: serving '{}' ({} bytes, dispatch {} ({})) at {}",
            e.info.name,
            e.info.size,
            e.dispatch,
            e.dispatch_why,
            d.path().display()
        );
        devs.push(d);
    }
    let ctl = ControlServer::start(ctl_listener, ctl_path.clone(), stack.clone(), access)?;
    std::mem::forget(unlink); // the control server removes it now
    println!("udm: control socket at {}", ctl_path.display());
    let _ = std::io::stdout().flush();
    let mut b = [0u8; 1];
    let _ = (&stop.1).read(&mut b);
    ctl.shutdown();
    for d in devs {
        if let Err(e) = d.stop() {
            tracing::warn!("{e}");
        }
    }
    let all: Vec<Arc<dyn BlockDevice>> = stack.devices();
    let failed = server::flush_all(&all)?;
    for (n, s) in &failed {
        tracing::error!("flush of '{n}' failed: {s}");
    }
    tracing::info!(
        "ublk: stopped; {} devices flushed",
        all.len() - failed.len()
    );
    Ok(if failed.is_empty() { 0 } else { 1 })
}

/// Removes the control socket if start-up fails after binding it.
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A socket pair whose second end becomes readable when SIGINT or SIGTERM
/// arrives (signal-hook writes a byte to the first from the handler); the
/// first end can also be written to, to wake the reader.
pub(crate) fn signal_pipe() -> Result<(UnixStream, UnixStream), Error> {
    let (wr, rd) = UnixStream::pair().map_err(|e| Error::os("signal socket", e))?;
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let w = wr.try_clone().map_err(|e| Error::os("signal socket", e))?;
        signal_hook::low_level::pipe::register(sig, w)
            .map_err(|e| Error::os(format!("handling signal {sig}"), e))?;
    }
    Ok((wr, rd))
}

/// How idle reactors wait: `udm serve`'s and `udm daemon`'s flags.
#[derive(clap::Args, Debug)]
pub struct CompletionArgs {
    /// An idle reactor spins only while the gaps between its bursts of work
    /// have lately been short (haltpoll's rule, at most USEC microseconds
    /// per gap), else it sleeps in io_uring_enter. Without any of these
    /// flags: the same with USEC 100, the spin also weighed against
    /// sleeping at once by trial (kept only where it pays in throughput).
    #[arg(long, value_name = "USEC")]
    adaptive: Option<String>,
    /// Reactors always sleep in io_uring_enter when idle.
    #[arg(long)]
    interrupt: bool,
    /// Reactors spin USEC microseconds after their last work, then sleep.
    #[arg(long, value_name = "USEC")]
    hybrid: Option<String>,
    /// Reactors busy-poll (a spinning core each, lowest latency).
    #[arg(long)]
    poll: bool,
}

impl CompletionArgs {
    /// The reactors' configuration the flags choose.
    pub fn config(&self) -> Result<ReactorConfig, Error> {
        completion_mode(
            self.poll,
            self.interrupt,
            self.hybrid.as_deref(),
            self.adaptive.as_deref(),
        )
    }
}

/// The adaptive spin cap `udm serve` uses unless told otherwise. A QD1
/// client's gap, as a sleeping server sees it, is the client's turn plus the
/// server's own wakeup (20–35 µs each on a VM): 50 µs measured too tight
/// (the window rarely opened), 100 as good as 200 (cpuidle-haltpoll's).
const ADAPTIVE_DEFAULT_US: u64 = 100;

/// The reactors' completion mode from `--poll`, `--interrupt`,
/// `--hybrid USEC` and `--adaptive USEC`; without any, adaptive with its
/// spin weighed against sleeping ([`ReactorConfig::weigh_spin`]).
fn completion_mode(
    poll: bool,
    interrupt: bool,
    hybrid: Option<&str>,
    adaptive: Option<&str>,
) -> Result<ReactorConfig, Error> {
    let chosen = [poll, interrupt, hybrid.is_some(), adaptive.is_some()];
    if chosen.iter().filter(|&&c| c).count() > 1 {
        return Err(Error::invalid(
            "--poll, --interrupt, --hybrid and --adaptive: choose one",
        ));
    }
    let usec = |flag: &str, us: &str| {
        us.parse::<u64>()
            .ok()
            .filter(|&n| (1..=1_000_000).contains(&n))
            .map(std::time::Duration::from_micros)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{flag} '{us}': expected microseconds, 1 to 1000000"
                ))
            })
    };
    let mut cfg = ReactorConfig::default();
    if poll {
        cfg.mode = CompletionMode::Poll;
    } else if interrupt {
        cfg.mode = CompletionMode::Interrupt;
    } else if let Some(us) = hybrid {
        cfg.mode = CompletionMode::Hybrid;
        cfg.hybrid_spin = usec("--hybrid", us)?;
    } else {
        cfg.mode = CompletionMode::Adaptive;
        cfg.hybrid_spin = match adaptive {
            Some(us) => usec("--adaptive", us)?,
            None => {
                cfg.weigh_spin = true;
                std::time::Duration::from_micros(ADAPTIVE_DEFAULT_US)
            }
        };
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_files_hold_one_spec_per_line_with_comments() {
        let c = "# the stack\nram0=ram:64M\n\n  lin=0 131072 linear ram0 0  # over ram0\n";
        assert_eq!(
            parse_config(c),
            vec!["ram0=ram:64M", "lin=0 131072 linear ram0 0"]
        );
    }

    #[test]
    fn exports_take_an_optional_ro_flag() {
        assert_eq!(parse_export("lin").unwrap(), ("lin".into(), false));
        assert_eq!(parse_export("lin:ro").unwrap(), ("lin".into(), true));
        assert!(parse_export("lin:xx")
            .unwrap_err()
            .to_string()
            .contains("unknown flag 'xx'"));
    }

    #[test]
    fn limits_flags_are_checked_with_one_line_errors() {
        let l = parse_limits("10", 1024, "256M").unwrap();
        assert_eq!(l, Limits::default());
        assert_eq!(parse_limits("0", 8, "1G").unwrap().handshake_timeout, None);
        let err = |r: Result<Limits, Error>| r.unwrap_err().to_string();
        assert!(err(parse_limits("x", 8, "1G")).contains("--handshake-timeout 'x'"));
        assert!(err(parse_limits("5", 0, "1G")).contains("--max-connections 0"));
        assert!(err(parse_limits("5", 8, "lots")).contains("--max-inflight 'lots'"));
        assert!(err(parse_limits("5", 8, "1M"))
            .contains("--max-inflight '1M': expected at least 64 MiB"));
        assert_eq!(parse_export_cap("lin=4").unwrap(), ("lin".into(), 4));
        for bad in ["lin", "lin=0", "=3", "lin=x"] {
            assert!(parse_export_cap(bad)
                .unwrap_err()
                .to_string()
                .contains("expected NAME=N"));
        }
    }

    #[test]
    fn listen_addresses_default_to_loopback() {
        assert_eq!(
            Listen::parse("10809").unwrap(),
            Listen::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert_eq!(
            Listen::parse(":10809").unwrap(),
            Listen::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert_eq!(
            Listen::parse("0.0.0.0:1").unwrap(),
            Listen::Tcp("0.0.0.0:1".parse().unwrap())
        );
        assert_eq!(
            Listen::parse("unix:/tmp/s").unwrap(),
            Listen::Unix("/tmp/s".into())
        );
        assert!(Listen::parse("nonsense:::").is_err());
    }

    #[test]
    fn completion_modes_follow_the_flags_and_default_to_adaptive() {
        use std::time::Duration;
        use udm_core::CompletionMode;
        let d = super::completion_mode(false, false, None, None).unwrap();
        assert_eq!(d.mode, CompletionMode::Adaptive);
        assert_eq!(d.hybrid_spin, Duration::from_micros(100));
        assert!(d.weigh_spin);
        // --adaptive USEC is the haltpoll window alone.
        let a = super::completion_mode(false, false, None, Some("200")).unwrap();
        assert_eq!(a.mode, CompletionMode::Adaptive);
        assert_eq!(a.hybrid_spin, Duration::from_micros(200));
        assert!(!a.weigh_spin);
        assert_eq!(
            super::completion_mode(false, true, None, None)
                .unwrap()
                .mode,
            CompletionMode::Interrupt
        );
        assert_eq!(
            super::completion_mode(true, false, None, None)
                .unwrap()
                .mode,
            CompletionMode::Poll
        );
        let h = super::completion_mode(false, false, Some("50"), None).unwrap();
        assert_eq!(h.mode, CompletionMode::Hybrid);
        assert_eq!(h.hybrid_spin, Duration::from_micros(50));
        let err = |r: Result<_, Error>| r.unwrap_err().to_string();
        assert!(err(super::completion_mode(false, false, Some("0"), None)).contains("--hybrid '0'"));
        assert!(
            err(super::completion_mode(false, false, None, Some("x"))).contains("--adaptive 'x'")
        );
        assert!(err(super::completion_mode(true, false, Some("5"), None)).contains("choose one"));
        assert!(err(super::completion_mode(false, true, None, Some("5"))).contains("choose one"));
    }
}
