//! The vhost-user-blk server of one export: the listening socket, the
//! control thread that speaks the vhost-user protocol with one frontend
//! at a time (and accepts the next when it goes: a frontend may
//! reconnect), and the reactors that run the queues.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use udm_core::{
    BlockDevice, Dispatch, Error, PoolConfig, Reactor, ReactorConfig, ReactorPool, StopToken,
};
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use super::config::{BlkConfig, Shared};
use super::control::{is_refusal, Device};
use super::queue::{Worker, WORKER_KEY};

/// How to run a server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The socket's path.
    pub path: PathBuf,
    /// Queues offered to the driver (at least 1).
    pub queues: u16,
    /// Reactor threads running the queues (0: one per queue); queue `i`
    /// runs on reactor `i % reactors`.
    pub reactors: usize,
    /// How each reactor is built.
    pub reactor: ReactorConfig,
    /// Refuse writes (also when the device is read-only).
    pub read_only: bool,
    /// How requests go to the device (`Auto`: from its report); a queued
    /// front is unplugged at the end of each kick's batch.
    pub dispatch: Dispatch,
}

/// The count of connected frontends (0 or 1), readable from any thread.
#[derive(Clone)]
pub struct Clients(Arc<Shared>);

impl Clients {
    /// Frontends connected now.
    pub fn get(&self) -> usize {
        self.0.clients.load(Ordering::Relaxed)
    }
}

/// A bound server, ready to [`Server::run`].
pub struct Server {
    listener: UnixListener,
    path: PathBuf,
    dev: Arc<dyn BlockDevice>,
    shared: Arc<Shared>,
    cfg: ServerConfig,
}

impl Server {
    /// Binds the socket at `cfg.path` (a stale socket there is replaced;
    /// any other file is left alone and bind fails).
    pub fn bind(dev: Arc<dyn BlockDevice>, cfg: ServerConfig) -> Result<Server, Error> {
        if cfg.queues == 0 || cfg.queues > 256 {
            return Err(Error::invalid(format!(
                "--queues {}: between 1 and 256",
                cfg.queues
            )));
        }
        let p = &cfg.path;
        if std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket()) {
            let _ = std::fs::remove_file(p);
        }
        let listener = UnixListener::bind(p)
            .map_err(|e| Error::os(format!("listen on {}", p.display()), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::os("listener", e))?;
        let shared = Arc::new(Shared {
            cfg: BlkConfig::new(&*dev, cfg.queues, cfg.read_only),
            writeback: AtomicBool::new(dev.caps().contains(udm_core::Caps::FLUSH)),
            queues: cfg.queues,
            dispatch: cfg.dispatch,
            clients: AtomicUsize::new(0),
        });
        Ok(Server {
            listener,
            path: cfg.path.clone(),
            dev,
            shared,
            cfg,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The count of connected frontends, kept up to date while it runs.
    pub fn clients(&self) -> Clients {
        Clients(self.shared.clone())
    }

    /// Serves frontends, one at a time, until `stop_fd` is readable; then
    /// stops the queues (their requests in flight complete), disconnects
    /// the frontend, removes the socket and returns.
    pub fn run(self, stop_fd: RawFd) -> Result<(), Error> {
        let n = match self.cfg.reactors {
            0 => self.cfg.queues as usize,
            r => r.min(self.cfg.queues as usize),
        };
        let dev = self.dev.clone();
        let sh = self.shared.clone();
        let pool = ReactorPool::start(
            &PoolConfig::new("udm-vhost-", n, self.cfg.reactor),
            move |_, r: &Reactor, stop: &StopToken| reactor_main(r, dev.clone(), sh.clone(), stop),
        )?;
        let handles = pool.handles().to_vec();
        let res = self.serve(stop_fd, handles);
        pool.stop();
        for r in pool.join() {
            if let Err(e) = r {
                tracing::warn!("vhost: {e}");
            }
        }
        let _ = std::fs::remove_file(&self.path);
        res
    }

    fn serve(&self, stop_fd: RawFd, handles: Vec<udm_core::ReactorHandle>) -> Result<(), Error> {
        let at = self.path.display();
        loop {
            match wait2(self.listener.as_raw_fd(), stop_fd) {
                Ready::Stop => return Ok(()),
                Ready::Fd => {}
            }
            let sock = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("vhost: accept on {at}: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            tracing::info!("vhost: {at}: frontend connected");
            self.shared.clients.store(1, Ordering::Relaxed);
            let stopped = self.converse(sock, stop_fd, &handles);
            self.shared.clients.store(0, Ordering::Relaxed);
            if stopped {
                return Ok(());
            }
        }
    }

    /// Talks with one frontend until it goes (false) or the server is
    /// stopped (true); then stops its queues. A watcher thread shuts the
    /// connection down when the server is stopped, so a frontend that
    /// stops in the middle of a message cannot hold the stop up.
    fn converse(
        &self,
        sock: UnixStream,
        stop_fd: RawFd,
        handles: &[udm_core::ReactorHandle],
    ) -> bool {
        let at = self.path.display();
        let _ = sock.set_nonblocking(false);
        let fd = sock.as_raw_fd();
        let watch = sock.try_clone().ok().zip(UnixStream::pair().ok());
        let dev = Arc::new(Mutex::new(Device::new(
            self.shared.clone(),
            handles.to_vec(),
        )));
        let mut h = BackendReqHandler::from_stream(sock, dev.clone());
        let (watcher, done) = match watch {
            Some((conn, (done_rd, done))) => {
                let t = std::thread::Builder::new()
                    .name("udm-vhost-watch".into())
                    .spawn(move || {
                        if let Ready::Stop = wait2(done_rd.as_raw_fd(), stop_fd) {
                            let _ = conn.shutdown(std::net::Shutdown::Both);
                        }
                    })
                    .ok();
                (t, Some(done))
            }
            None => (None, None),
        };
        let stopped = loop {
            if let Ready::Stop = wait2(fd, stop_fd) {
                break true;
            }
            match h.handle_request() {
                Ok(()) => {}
                // Refused and answered (logged by the device).
                Err(e) if is_refusal(&e) => {}
                Err(VuError::Disconnected) | Err(VuError::PartialMessage) => {
                    tracing::info!("vhost: {at}: frontend disconnected");
                    break false;
                }
                Err(e) => {
                    tracing::warn!("vhost: {at}: frontend: {e}; disconnecting it");
                    break false;
                }
            }
        };
        // Ends the watcher (its end of the pair sees EOF).
        drop(done);
        if let Some(t) = watcher {
            let _ = t.join();
        }
        dev.lock().unwrap_or_else(|p| p.into_inner()).disconnect();
        stopped || stop_readable(stop_fd)
    }
}

/// Whether the stop descriptor is readable now.
fn stop_readable(stop: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd: stop,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd; no wait.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

enum Ready {
    Fd,
    Stop,
}

/// Waits until `fd` or `stop` is readable (stop wins).
fn wait2(fd: RawFd, stop: RawFd) -> Ready {
    let mut p = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: stop,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: p is a live array of two pollfd.
        let n = unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        if n < 0 || p[1].revents != 0 {
            return Ready::Stop;
        }
        return Ready::Fd;
    }
}

fn reactor_main(
    reactor: &Reactor,
    dev: Arc<dyn BlockDevice>,
    shared: Arc<Shared>,
    stop: &StopToken,
) {
    let worker = Worker::new(reactor, dev, shared);
    reactor.add_poller(worker.clone());
    reactor.set_local(WORKER_KEY, worker.clone());
    reactor.run_until(|| stop.is_stopped() && worker.queues() == 0);
    worker.release();
    reactor.remove_local(WORKER_KEY);
    drop(worker);
    reactor.drain();
}
