//! The daemon's NBD exports: each `export add` starts an NBD server of one
//! export on its own address (its own accept thread and reactors), and
//! `export remove` stops it: no new connections, the requests in flight
//! finish and are answered, then the connections close.

use std::sync::{Arc, Mutex, Weak};

use udm_control::{Devices, ExportInfo, ExportSpec, Holder};
use udm_core::{Error, ErrorKind, ReactorConfig};

use udm_exports::front::AutoReport;
use udm_exports::limits::{Limits, Pool};
use udm_exports::nbd::{Clients, Export, Listen, Server, ServerConfig, Tls};

use super::running::{hold_device, with_trial, Protocol, Served, ServerThread};

/// One export being served.
pub(super) struct NbdExport {
    info: ExportInfo,
    /// The address bound (a TCP port 0 resolved).
    bound: Listen,
    holder: Holder,
    clients: Clients,
    /// What the connections' trials of auto dispatch run and ran.
    auto: Arc<AutoReport>,
    server: ServerThread,
}

impl Served for NbdExport {
    fn info(&self) -> &ExportInfo {
        &self.info
    }

    fn clients(&self) -> usize {
        self.clients.get()
    }

    fn dispatch(&self) -> String {
        with_trial(&self.info.dispatch, &self.auto, "connections")
    }

    fn busy(&self, n: usize) -> String {
        format!("{n} clients connected (--force disconnects them once their requests finish)")
    }

    // Each server first stops accepting, then all drain together.
    fn begin_stop(&self) {
        self.server.signal();
    }

    fn stop(self, devs: &dyn Devices) {
        self.server.join(&self.info.name);
        // The device may be gone already (removed by force).
        let _ = devs.release(&self.info.device, &self.holder);
        tracing::info!("export '{}' removed", self.info.name);
    }
}

/// The daemon's NBD exports (the [`Protocol`] of its NBD
/// [`Service`](super::running::Service)).
pub struct Nbd {
    reactors: usize,
    reactor: ReactorConfig,
    limits: Limits,
    /// The connection cap and buffer budget all the exports share.
    pool: Arc<Pool>,
    /// The TLS of the exports that have it, for a reload.
    tls: Arc<Mutex<Vec<Weak<Tls>>>>,
}

impl Nbd {
    /// Exports served by `reactors` reactors each, built as `reactor` says,
    /// all the servers together under `limits` (one connection cap, one
    /// buffer budget).
    pub fn new(reactors: usize, reactor: ReactorConfig, limits: Limits, pool: Arc<Pool>) -> Nbd {
        Nbd {
            reactors,
            reactor,
            pool,
            limits,
            tls: Arc::default(),
        }
    }

    /// Reads again the TLS credentials of every export that has TLS (what
    /// SIGHUP does): new connections get them.
    pub fn tls_reloader(&self) -> impl Fn() + Send + 'static {
        let list = self.tls.clone();
        move || {
            let mut l = list.lock().unwrap_or_else(|p| p.into_inner());
            l.retain(|w| w.strong_count() > 0);
            for t in l.iter().filter_map(Weak::upgrade) {
                let dir = t.options().creds.display().to_string();
                match t.reload() {
                    Ok(()) => tracing::info!("nbd: TLS credentials reloaded from {dir}"),
                    Err(e) => {
                        tracing::error!(
                            "nbd: TLS credentials not reloaded (the old ones stay): {e}"
                        )
                    }
                }
            }
        }
    }
}

fn uri(name: &str, l: &Listen, tls: bool) -> String {
    match (l, tls) {
        (Listen::Unix(p), false) => format!("nbd+unix:///{name}?socket={}", p.display()),
        (Listen::Unix(p), true) => format!("nbds+unix:///{name}?socket={}", p.display()),
        (Listen::Tcp(a), false) => format!("nbd://{a}/{name}"),
        (Listen::Tcp(a), true) => format!("nbds://{a}/{name}"),
    }
}

impl Protocol for Nbd {
    type Export = NbdExport;

    fn start(
        &self,
        ctl: &dyn Devices,
        spec: ExportSpec,
        name: String,
        running: &[NbdExport],
    ) -> Result<NbdExport, Error> {
        if !spec.opts.names().is_empty() {
            return Err(Error::invalid(format!(
                "an NBD export takes no {}",
                spec.opts.names().join(", ")
            )));
        }
        let listen = Listen::parse(&spec.address)?;
        let o = &spec.opts;
        // A relative credentials' path is the client's, which the daemon
        // cannot resolve: refused rather than read from the daemon's cwd.
        if let Some(c) = o.tls_creds.as_deref().filter(|c| !c.starts_with('/')) {
            return Err(Error::invalid(format!(
                "--tls-creds '{c}': give an absolute path"
            )));
        }
        let tls = crate::serve::TlsArgs {
            mode: o.tls.clone().unwrap_or_else(|| "off".into()),
            creds: o.tls_creds.as_ref().map(Into::into),
            verify_peer: o.tls_verify_peer,
            authz: o.tls_authz.clone(),
            insecure: o.insecure,
        }
        .load()?;
        if let Some(t) = &tls {
            self.tls
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Arc::downgrade(t));
        }
        if let Some(r) = running.iter().find(|r| r.bound == listen) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "{} is the address of export '{}'",
                    spec.address, r.info.name
                ),
            ));
        }
        let dispatch = spec.opts.dispatch()?;
        let (dev, holder) = hold_device(ctl, &spec.device, &name, "nbd")?;
        let mut export = Export::new(&name, dev, spec.read_only);
        export.set_dispatch(dispatch);
        let dispatch = format!("{} ({})", export.dispatch, export.dispatch_why);
        let auto = export.auto.clone();
        let started = (|| {
            let srv = Server::bind(
                vec![export],
                ServerConfig {
                    listen: vec![listen],
                    reactors: self.reactors,
                    reactor: self.reactor,
                    limits: self.limits.clone(),
                    pool: Some(self.pool.clone()),
                    tls: tls.clone(),
                    insecure: spec.opts.insecure,
                },
            )?;
            let bound = srv
                .addresses()
                .into_iter()
                .next()
                .ok_or_else(|| Error::new(ErrorKind::Io, "the server bound no address"))?;
            let clients = srv.clients();
            let server = ServerThread::spawn(format!("udm-exp-{name}"), move |stop| srv.run(stop))?;
            Ok::<_, Error>((bound, clients, server))
        })();
        let (bound, clients, server) = match started {
            Ok(s) => s,
            Err(e) => {
                let _ = ctl.release(&spec.device, &holder);
                return Err(e);
            }
        };
        let info = ExportInfo {
            name: name.clone(),
            device: spec.device,
            protocol: spec.protocol,
            address: spec.address,
            uri: uri(&name, &bound, tls.is_some()),
            read_only: spec.read_only,
            clients: 0,
            opts: spec.opts,
            dispatch,
            tls: tls.as_ref().map(|t| t.describe()).unwrap_or_default(),
        };
        tracing::info!("export '{name}' of '{}' at {}", info.device, info.uri);
        Ok(NbdExport {
            info,
            bound,
            holder,
            clients,
            auto,
            server,
        })
    }
}
