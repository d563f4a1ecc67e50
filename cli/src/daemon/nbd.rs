//! The daemon's NBD exports: each `export add` starts an NBD server of one
//! export on its own address (its own accept thread and reactors), and
//! `export remove` stops it: no new connections, the requests in flight
//! finish and are answered, then the connections close.

use std::sync::Arc;

use udm_control::{Devices, ExportInfo, ExportList, ExportService, ExportSpec, Holder};
use udm_core::{Error, ErrorKind, ReactorConfig};

use udm_exports::limits::{Limits, Pool};
use udm_exports::nbd::{Clients, Export, Listen, Server, ServerConfig};

use super::running::{hold_device, Running, Served, ServerThread};

/// One export being served.
struct NbdExport {
    info: ExportInfo,
    /// The address bound (a TCP port 0 resolved).
    bound: Listen,
    holder: Holder,
    clients: Clients,
    server: ServerThread,
}

impl Served for NbdExport {
    fn info(&self) -> &ExportInfo {
        &self.info
    }

    fn clients(&self) -> usize {
        self.clients.get()
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

/// The daemon's NBD exports (an [`ExportService`]).
pub struct NbdExports {
    reactors: usize,
    reactor: ReactorConfig,
    limits: Limits,
    /// The connection cap and buffer budget all the exports share.
    pool: Arc<Pool>,
    running: Running<NbdExport>,
}

impl NbdExports {
    /// Exports served by `reactors` reactors each, built as `reactor` says,
    /// all the servers together under `limits` (one connection cap, one
    /// buffer budget).
    pub fn new(
        reactors: usize,
        reactor: ReactorConfig,
        limits: Limits,
        pool: Arc<Pool>,
    ) -> NbdExports {
        NbdExports {
            reactors,
            reactor,
            pool,
            limits,
            running: Running::new(),
        }
    }
}

fn uri(name: &str, l: &Listen) -> String {
    match l {
        Listen::Unix(p) => format!("nbd+unix:///{name}?socket={}", p.display()),
        Listen::Tcp(a) => format!("nbd://{a}/{name}"),
    }
}

impl ExportService for NbdExports {
    fn add(&self, ctl: &dyn Devices, spec: ExportSpec) -> Result<ExportInfo, Error> {
        if !spec.opts.names().is_empty() {
            return Err(Error::invalid(format!(
                "an NBD export takes no {}",
                spec.opts.names().join(", ")
            )));
        }
        let name = spec.name.clone().unwrap_or_else(|| spec.device.clone());
        let listen = Listen::parse(&spec.address)?;
        let mut running = self.running.lock();
        Running::<NbdExport>::check_name(&running, &name)?;
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
        let started = (|| {
            let srv = Server::bind(
                vec![export],
                ServerConfig {
                    listen: vec![listen],
                    reactors: self.reactors,
                    reactor: self.reactor,
                    limits: self.limits.clone(),
                    pool: Some(self.pool.clone()),
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
            uri: uri(&name, &bound),
            read_only: spec.read_only,
            clients: 0,
            opts: spec.opts,
            dispatch,
        };
        tracing::info!("export '{name}' of '{}' at {}", info.device, info.uri);
        running.push(NbdExport {
            info: info.clone(),
            bound,
            holder,
            clients,
            server,
        });
        Ok(info)
    }

    fn remove(&self, ctl: &dyn Devices, name: &str, force: bool) -> Result<(), Error> {
        self.running.remove(ctl, name, force)
    }

    fn list(&self) -> ExportList {
        self.running.list()
    }

    fn stop_all(&self, ctl: &dyn Devices) {
        self.running.stop_all(ctl)
    }
}
