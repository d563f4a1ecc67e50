//! What the daemon's protocol services share: each is a [`Service`] of
//! its [`Protocol`], which starts exports; the service keeps the ones
//! running, their names unique, finds them by name for `export remove`,
//! lists them for `export ls` and stops them all at the daemon's stop.
//! And, for the servers that run on a thread of their own (NBD,
//! vhost-user-blk), how that thread is stopped.

use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use udm_control::{Devices, ExportInfo, ExportList, ExportService, ExportSpec, Holder};
use udm_core::{BlockDevice, Error, ErrorKind};
use udm_exports::front::AutoReport;

/// One export a service runs.
pub(super) trait Served {
    /// What `export ls` shows (but the clients).
    fn info(&self) -> &ExportInfo;
    /// Its clients now.
    fn clients(&self) -> usize;
    /// The dispatch in use and why, as the info says it, and what auto
    /// dispatch's trials run now and ran so far, where they run.
    fn dispatch(&self) -> String {
        self.info().dispatch.clone()
    }
    /// Why a remove without force is refused while it has `n` clients.
    fn busy(&self, n: usize) -> String;
    /// Starts to stop, without waiting: at the daemon's stop, every export
    /// is asked first, then each is waited for, so that they drain together.
    fn begin_stop(&self) {}
    /// Stops it, waits for it, and releases its device.
    fn stop(self, devs: &dyn Devices);
}

/// How one protocol starts an export; its [`Service`] does the rest.
pub(super) trait Protocol: Send + Sync {
    /// One export while it runs.
    type Export: Served + Send;

    /// Starts `spec` as export `name` (a name no export in `running` has),
    /// or says why not, having released what it took. `running` stays
    /// locked until the export joins it, so that two adds cannot both
    /// claim an address.
    fn start(
        &self,
        devs: &dyn Devices,
        spec: ExportSpec,
        name: String,
        running: &[Self::Export],
    ) -> Result<Self::Export, Error>;
}

/// One protocol's exports, started by `P` (an [`ExportService`]).
pub(super) struct Service<P: Protocol> {
    protocol: P,
    running: Mutex<Vec<P::Export>>,
}

impl<P: Protocol> Service<P> {
    /// No export yet.
    pub(super) fn new(protocol: P) -> Service<P> {
        Service {
            protocol,
            running: Mutex::new(Vec::new()),
        }
    }

    /// The running exports, locked (`add` holds them while it starts one).
    fn lock(&self) -> MutexGuard<'_, Vec<P::Export>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<P: Protocol> ExportService for Service<P> {
    /// Refuses a second export of the name (checked under the lock held
    /// while the protocol starts it, so two adds cannot both pass).
    fn add(&self, devs: &dyn Devices, spec: ExportSpec) -> Result<ExportInfo, Error> {
        let name = spec.name.clone().unwrap_or_else(|| spec.device.clone());
        let mut running = self.lock();
        if running.iter().any(|r| r.info().name == name) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("an export named '{name}' exists"),
            ));
        }
        let export = self.protocol.start(devs, spec, name, &running)?;
        let info = export.info().clone();
        running.push(export);
        Ok(info)
    }

    /// Refused while the export has clients, unless `force`.
    fn remove(&self, devs: &dyn Devices, name: &str, force: bool) -> Result<(), Error> {
        let r = {
            let mut list = self.lock();
            let Some(i) = list.iter().position(|r| r.info().name == name) else {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("unknown export '{name}'"),
                ));
            };
            let n = list[i].clients();
            if n > 0 && !force {
                return Err(Error::new(ErrorKind::Busy, list[i].busy(n)));
            }
            list.remove(i)
        };
        r.stop(devs);
        Ok(())
    }

    fn list(&self) -> ExportList {
        let exports = self
            .lock()
            .iter()
            .map(|r| ExportInfo {
                clients: r.clients(),
                dispatch: r.dispatch(),
                ..r.info().clone()
            })
            .collect();
        ExportList { exports }
    }

    /// Asks each export to stop, then waits for each, so that they drain
    /// together.
    fn stop_all(&self, devs: &dyn Devices) {
        let all: Vec<P::Export> = self.lock().drain(..).collect();
        for r in &all {
            r.begin_stop();
        }
        for r in all {
            r.stop(devs);
        }
    }
}

/// `device`, held by export `name` of `protocol` (so that it cannot be
/// removed under the export) until the export releases it with the
/// holder returned.
pub(super) fn hold_device(
    devs: &dyn Devices,
    device: &str,
    name: &str,
    protocol: &str,
) -> Result<(Arc<dyn BlockDevice>, Holder), Error> {
    let dev = devs
        .device(device)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("unknown device '{device}'")))?;
    let holder = Holder::Export {
        name: name.into(),
        protocol: protocol.into(),
    };
    devs.hold(device, holder.clone())?;
    Ok((dev, holder))
}

/// A server running on a thread of its own until a byte arrives on its
/// stop socket.
pub(super) struct ServerThread {
    stop: UnixStream,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

impl ServerThread {
    /// Runs `run` on a thread named `name`, passing it the stop socket's
    /// end to watch.
    pub(super) fn spawn(
        name: String,
        run: impl FnOnce(RawFd) -> Result<(), Error> + Send + 'static,
    ) -> Result<ServerThread, Error> {
        let (stop_rd, stop) = UnixStream::pair().map_err(|e| Error::os("stop socket", e))?;
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || run(stop_rd.as_raw_fd()))
            .map_err(|e| Error::os("spawning the export's thread", e))?;
        Ok(ServerThread {
            stop,
            thread: Some(thread),
        })
    }

    /// Tells the server to stop (it stops accepting, then drains).
    pub(super) fn signal(&self) {
        let _ = (&self.stop).write_all(&[1]);
    }

    /// Tells the server to stop and waits for it; `name` is the export's,
    /// for the log.
    pub(super) fn join(mut self, name: &str) {
        self.signal();
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("export '{name}': {e}"),
                Err(_) => tracing::error!("export '{name}': its server panicked"),
            }
        }
    }
}

/// `dispatch` (the info's), followed by what `auto`'s trials over the
/// export's `what` (connections, queues) run now and ran.
pub(super) fn with_trial(dispatch: &str, auto: &AutoReport, what: &str) -> String {
    match auto.describe(what) {
        Some(t) => format!("{dispatch}; {t}"),
        None => dispatch.to_string(),
    }
}
