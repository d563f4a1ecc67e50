//! The daemon's vhost-user-blk exports: each `export add` starts a
//! vhost-user-blk server on its socket path (its own control thread and
//! one reactor per queue; `--queues` defaults to the daemon's
//! `--reactors`), and `export
//! remove` stops it: the queues stop once their requests in flight
//! complete, the frontend is disconnected and the socket removed.

use std::path::PathBuf;
use std::sync::Arc;

use udm_control::{Devices, ExportInfo, ExportSpec, Holder};
use udm_core::access::Access;
use udm_core::{Error, ErrorKind, ReactorConfig};
use udm_exports::front::AutoReport;
use udm_exports::limits::Pool;
use udm_exports::vhost::{Clients, Server, ServerConfig};

use super::running::{hold_device, with_trial, Protocol, Served, ServerThread};

/// One export being served.
pub(super) struct VhostExport {
    info: ExportInfo,
    path: PathBuf,
    holder: Holder,
    clients: Clients,
    /// What the queues' trials of auto dispatch run and ran.
    auto: Arc<AutoReport>,
    server: ServerThread,
}

impl Served for VhostExport {
    fn info(&self) -> &ExportInfo {
        &self.info
    }

    fn clients(&self) -> usize {
        self.clients.get()
    }

    fn dispatch(&self) -> String {
        with_trial(&self.info.dispatch, &self.auto, "queues")
    }

    fn busy(&self, _: usize) -> String {
        "a frontend is connected (--force disconnects it once its requests finish)".into()
    }

    fn begin_stop(&self) {
        self.server.signal();
    }

    fn stop(self, devs: &dyn Devices) {
        self.server.join(&self.info.name);
        let _ = devs.release(&self.info.device, &self.holder);
        tracing::info!("export '{}' removed", self.info.name);
    }
}

/// The daemon's vhost-user-blk exports (the [`Protocol`] of its
/// vhost-user-blk [`Service`](super::running::Service)).
pub struct Vhost {
    reactors: usize,
    reactor: ReactorConfig,
    /// The daemon's pool: bounce buffers are charged to its budget.
    pool: Arc<Pool>,
    /// Who may connect to the sockets.
    access: Access,
}

impl Vhost {
    /// Exports of `reactors` queues unless told otherwise, each queue on
    /// its own reactor built as `reactor` says, drawing on `pool`, their
    /// sockets open to whom `access` admits.
    pub fn new(reactors: usize, reactor: ReactorConfig, pool: Arc<Pool>, access: Access) -> Vhost {
        Vhost {
            reactors: reactors.max(1),
            reactor,
            pool,
            access,
        }
    }
}

impl Protocol for Vhost {
    type Export = VhostExport;

    fn start(
        &self,
        ctl: &dyn Devices,
        spec: ExportSpec,
        name: String,
        running: &[VhostExport],
    ) -> Result<VhostExport, Error> {
        let o = &spec.opts;
        let dispatch = o.dispatch()?;
        let mut refused = Vec::new();
        if o.depth.is_some() {
            refused.push("--depth");
        }
        if o.id.is_some() {
            refused.push("--id");
        }
        if o.recover {
            refused.push("--recover");
        }
        if o.unprivileged {
            refused.push("--unprivileged");
        }
        refused.extend(o.nbd_names());
        if !refused.is_empty() {
            return Err(Error::invalid(format!(
                "a vhost-user-blk export takes no {}",
                refused.join(", ")
            )));
        }
        let queues = match o.queues {
            None => self.reactors as u16,
            Some(q @ 1..=256) => q as u16,
            Some(q) => return Err(Error::invalid(format!("--queues {q}: expected 1 to 256"))),
        };
        if spec.address.is_empty() {
            return Err(Error::invalid("vhost-user-blk: no socket path"));
        }
        let path = PathBuf::from(&spec.address);
        if let Some(r) = running.iter().find(|r| r.path == path) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("{} is the socket of export '{}'", spec.address, r.info.name),
            ));
        }
        let (dev, holder) = hold_device(ctl, &spec.device, &name, "vhost-user-blk")?;
        let (dispatch, why) = dispatch.choose(&*dev);
        let started = (|| {
            let srv = Server::bind(
                dev,
                ServerConfig {
                    path: path.clone(),
                    queues,
                    reactors: 0,
                    reactor: self.reactor,
                    read_only: spec.read_only,
                    budget: Some(self.pool.budget.clone()),
                    dispatch,
                    access: self.access,
                },
            )?;
            let clients = srv.clients();
            let auto = srv.auto_report();
            let server = ServerThread::spawn(format!("udm-exp-{name}"), move |stop| srv.run(stop))?;
            Ok::<_, Error>((clients, auto, server))
        })();
        let (clients, auto, server) = match started {
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
            address: spec.address.clone(),
            uri: spec.address,
            read_only: spec.read_only,
            clients: 0,
            opts: spec.opts,
            dispatch: format!("{dispatch} ({why})"),
            tls: String::new(),
        };
        tracing::info!(
            "export '{name}' of '{}' at {} (vhost-user-blk, {queues} queues)",
            info.device,
            info.uri
        );
        Ok(VhostExport {
            info,
            path,
            holder,
            clients,
            auto,
            server,
        })
    }
}
