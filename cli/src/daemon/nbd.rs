//! The daemon's NBD exports: each `export add` starts an NBD server of one
//! export on its own address (its own accept thread and reactors), and
//! `export remove` stops it: no new connections, the requests in flight
//! finish and are answered, then the connections close.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;

use std::sync::Arc;
use udm_control::{Devices, ExportInfo, ExportList, ExportService, ExportSpec, Holder};
use udm_core::{Error, ErrorKind, ReactorConfig};

use udm_exports::nbd::limits::{Limits, Pool};
use udm_exports::nbd::{Clients, Export, Listen, Server, ServerConfig};

/// One export being served.
struct Running {
    info: ExportInfo,
    /// The address bound (a TCP port 0 resolved).
    bound: Listen,
    holder: Holder,
    clients: Clients,
    /// Written to stop the server.
    stop: UnixStream,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

/// The daemon's NBD exports (an [`ExportService`]).
pub struct NbdExports {
    reactors: usize,
    reactor: ReactorConfig,
    limits: Limits,
    /// The connection cap and buffer budget all the exports share.
    pool: Arc<Pool>,
    running: Mutex<Vec<Running>>,
}

impl NbdExports {
    /// Exports served by `reactors` reactors each, built as `reactor` says,
    /// all the servers together under `limits` (one connection cap, one
    /// buffer budget).
    pub fn new(
        reactors: usize,
        reactor: ReactorConfig,
        limits: Limits,
    ) -> Result<NbdExports, Error> {
        Ok(NbdExports {
            reactors,
            reactor,
            pool: Pool::new(&limits)?,
            limits,
            running: Mutex::new(Vec::new()),
        })
    }

    fn running(&self) -> MutexGuard<'_, Vec<Running>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops `r`'s server and waits for it, then releases its device.
    fn stop(ctl: &dyn Devices, mut r: Running) {
        let _ = (&r.stop).write_all(&[1]);
        if let Some(t) = r.thread.take() {
            match t.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("export '{}': {e}", r.info.name),
                Err(_) => tracing::error!("export '{}': its server panicked", r.info.name),
            }
        }
        // The device may be gone already (removed by force).
        let _ = ctl.release(&r.info.device, &r.holder);
        tracing::info!("export '{}' removed", r.info.name);
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
        let mut running = self.running();
        if running.iter().any(|r| r.info.name == name) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("an export named '{name}' exists"),
            ));
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
        let dev = ctl.device(&spec.device).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("unknown device '{}'", spec.device),
            )
        })?;
        let mut export = Export::new(&name, dev, spec.read_only);
        export.set_dispatch(dispatch);
        let dispatch = format!("{} ({})", export.dispatch, export.dispatch_why);
        let holder = Holder::Export {
            name: name.clone(),
            protocol: "nbd".into(),
        };
        ctl.hold(&spec.device, holder.clone())?;
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
            let (stop_rd, stop) = UnixStream::pair().map_err(|e| Error::os("stop socket", e))?;
            let clients = srv.clients();
            let thread = std::thread::Builder::new()
                .name(format!("udm-exp-{name}"))
                .spawn(move || srv.run(stop_rd.as_raw_fd()))
                .map_err(|e| Error::os("spawning the export's thread", e))?;
            Ok::<_, Error>((bound, stop, clients, thread))
        })();
        let (bound, stop, clients, thread) = match started {
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
        running.push(Running {
            info: info.clone(),
            bound,
            holder,
            clients,
            stop,
            thread: Some(thread),
        });
        Ok(info)
    }

    fn remove(&self, ctl: &dyn Devices, name: &str, force: bool) -> Result<(), Error> {
        let r = {
            let mut running = self.running();
            let Some(i) = running.iter().position(|r| r.info.name == name) else {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("unknown export '{name}'"),
                ));
            };
            let n = running[i].clients.get();
            if n > 0 && !force {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!("{n} clients connected (--force disconnects them once their requests finish)"),
                ));
            }
            running.remove(i)
        };
        NbdExports::stop(ctl, r);
        Ok(())
    }

    fn list(&self) -> ExportList {
        let exports = self
            .running()
            .iter()
            .map(|r| ExportInfo {
                clients: r.clients.get(),
                ..r.info.clone()
            })
            .collect();
        ExportList { exports }
    }

    fn stop_all(&self, ctl: &dyn Devices) {
        let all: Vec<Running> = self.running().drain(..).collect();
        // Each server first stops accepting, then all drain together.
        for r in &all {
            let _ = (&r.stop).write_all(&[1]);
        }
        for r in all {
            NbdExports::stop(ctl, r);
        }
    }
}
