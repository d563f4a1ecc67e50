//! The daemon's vhost-user-blk exports: each `export add` starts a
//! vhost-user-blk server on its socket path (its own control thread and
//! one reactor per queue; `--queues` defaults to the daemon's
//! `--reactors`), and `export
//! remove` stops it: the queues stop once their requests in flight
//! complete, the frontend is disconnected and the socket removed.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;

use udm_control::{Devices, ExportInfo, ExportList, ExportService, ExportSpec, Holder};
use udm_core::{Error, ErrorKind, ReactorConfig};
use udm_exports::vhost::{Clients, Server, ServerConfig};

/// One export being served.
struct Running {
    info: ExportInfo,
    path: PathBuf,
    holder: Holder,
    clients: Clients,
    /// Written to stop the server.
    stop: UnixStream,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

/// The daemon's vhost-user-blk exports (an [`ExportService`]).
pub struct VhostExports {
    reactors: usize,
    reactor: ReactorConfig,
    running: Mutex<Vec<Running>>,
}

impl VhostExports {
    /// Exports of `reactors` queues unless told otherwise, each queue on
    /// its own reactor built as `reactor` says.
    pub fn new(reactors: usize, reactor: ReactorConfig) -> VhostExports {
        VhostExports {
            reactors: reactors.max(1),
            reactor,
            running: Mutex::new(Vec::new()),
        }
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
        let _ = ctl.release(&r.info.device, &r.holder);
        tracing::info!("export '{}' removed", r.info.name);
    }
}

impl ExportService for VhostExports {
    fn add(&self, ctl: &dyn Devices, spec: ExportSpec) -> Result<ExportInfo, Error> {
        let o = &spec.opts;
        let dispatch = o.direct_only("vhost-user-blk")?;
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
        let name = spec.name.clone().unwrap_or_else(|| spec.device.clone());
        let path = PathBuf::from(&spec.address);
        let mut running = self.running();
        if running.iter().any(|r| r.info.name == name) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("an export named '{name}' exists"),
            ));
        }
        if let Some(r) = running.iter().find(|r| r.path == path) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("{} is the socket of export '{}'", spec.address, r.info.name),
            ));
        }
        let dev = ctl.device(&spec.device).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("unknown device '{}'", spec.device),
            )
        })?;
        let holder = Holder::Export {
            name: name.clone(),
            protocol: "vhost-user-blk".into(),
        };
        ctl.hold(&spec.device, holder.clone())?;
        let started = (|| {
            let srv = Server::bind(
                dev,
                ServerConfig {
                    path: path.clone(),
                    queues,
                    reactors: 0,
                    reactor: self.reactor,
                    read_only: spec.read_only,
                },
            )?;
            let (stop_rd, stop) = UnixStream::pair().map_err(|e| Error::os("stop socket", e))?;
            let clients = srv.clients();
            let thread = std::thread::Builder::new()
                .name(format!("udm-exp-{name}"))
                .spawn(move || srv.run(stop_rd.as_raw_fd()))
                .map_err(|e| Error::os("spawning the export's thread", e))?;
            Ok::<_, Error>((stop, clients, thread))
        })();
        let (stop, clients, thread) = match started {
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
            dispatch,
        };
        tracing::info!(
            "export '{name}' of '{}' at {} (vhost-user-blk, {queues} queues)",
            info.device,
            info.uri
        );
        running.push(Running {
            info: info.clone(),
            path,
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
            if running[i].clients.get() > 0 && !force {
                return Err(Error::new(
                    ErrorKind::Busy,
                    "a frontend is connected (--force disconnects it once its requests finish)",
                ));
            }
            running.remove(i)
        };
        VhostExports::stop(ctl, r);
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
        for r in &all {
            let _ = (&r.stop).write_all(&[1]);
        }
        for r in all {
            VhostExports::stop(ctl, r);
        }
    }
}
