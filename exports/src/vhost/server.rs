//! The vhost-user-blk server of one export: the listening socket (only
//! udm's user, root and the [`Access`] group may connect: the socket's
//! mode says so and each frontend's credentials are checked), the
//! control thread that speaks the vhost-user protocol with one frontend
//! at a time (and accepts the next when it goes: a frontend may
//! reconnect), and the reactors that run the queues. Between messages
//! (every 200 ms at most) the control thread looks at the device's size:
//! when it grew, the reactors take the new end, the configuration space
//! reports it and the frontend gets a config-change message.

use std::io;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use udm_core::access::Access;
use udm_core::{
    BlockDevice, Dispatch, Error, PoolConfig, Reactor, ReactorConfig, ReactorPool, StopToken,
};
use vhost::vhost_user::message::{FrontendReq, VhostUserProtocolFeatures};
use vhost::vhost_user::{BackendReqHandler, Error as VuError};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::config::{BlkConfig, Shared};
use super::control::{is_refusal, Device};
use super::queue::{on_worker, Worker, WORKER_KEY};
use crate::front::AutoReport;
use crate::limits::Budget;

/// How often the server looks whether the device grew.
const SIZE_CHECK: Duration = Duration::from_millis(200);

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
    /// Where the bounce buffers of sub-block requests are charged (the
    /// process's in-flight budget; None: nowhere).
    pub budget: Option<Arc<Budget>>,
    /// How requests go to the device (`Auto`: from its report); a queued
    /// front is unplugged at the end of each kick's batch.
    pub dispatch: Dispatch,
    /// Who may connect: the socket's mode and group, and the frontends
    /// whose credentials are accepted (others are disconnected at once).
    pub access: Access,
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
    /// Binds the socket at `cfg.path`, mode 0600 (0660 with a group, see
    /// [`Access::bind`]; its directory must be one no one else can write).
    /// A stale socket there is replaced; any other file is left alone and
    /// bind fails.
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
        let listener = cfg
            .access
            .bind(p, &format!("vhost-user-blk socket '{}'", p.display()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::os("listener", e))?;
        let shared = Arc::new(Shared {
            cfg: BlkConfig::new(&*dev, cfg.queues, cfg.read_only),
            writeback: AtomicBool::new(dev.caps().contains(udm_core::Caps::FLUSH)),
            queues: cfg.queues,
            capacity: AtomicU64::new(dev.limits().sectors),
            dispatch: cfg.dispatch,
            auto: Arc::default(),
            clients: AtomicUsize::new(0),
            budget: cfg.budget.clone(),
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

    /// What the queues' trials of auto dispatch run and ran (where the
    /// device reports that merging helps it), kept up to date while it runs.
    pub fn auto_report(&self) -> Arc<AutoReport> {
        self.shared.auto.clone()
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
                Ready::Timeout => {
                    self.grown(&handles);
                    continue;
                }
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
            match self.cfg.access.check(&sock) {
                Ok(p) => tracing::info!("vhost: {at}: frontend connected ({p})"),
                Err(e) => {
                    // Before a single message: it sees the connection close.
                    tracing::warn!("vhost: {at}: refused a frontend: {e}");
                    drop(sock);
                    continue;
                }
            }
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
        // To look at the next message before the vhost crate reads it.
        let peek = match sock.try_clone() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("vhost: {at}: {e}; disconnecting the frontend");
                return stop_readable(stop_fd);
            }
        };
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
                    .spawn(move || loop {
                        match wait2(done_rd.as_raw_fd(), stop_fd) {
                            Ready::Stop => {
                                let _ = conn.shutdown(std::net::Shutdown::Both);
                                break;
                            }
                            Ready::Fd => break,
                            Ready::Timeout => {}
                        }
                    })
                    .ok();
                (t, Some(done))
            }
            None => (None, None),
        };
        let stopped = loop {
            match wait2(fd, stop_fd) {
                Ready::Stop => break true,
                Ready::Timeout => {
                    if self.grown(handles) {
                        let mut d = dev.lock().unwrap_or_else(|p| p.into_inner());
                        if d.config_changed() {
                            tracing::info!("vhost: {at}: config-change notification sent");
                        }
                    }
                    continue;
                }
                Ready::Fd => {}
            }
            match take_backend_channel(&peek, &dev) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!("vhost: {at}: frontend: {e}; disconnecting it");
                    break false;
                }
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

impl Server {
    /// Whether the device grew since the driver was told its size; if so
    /// the reactors take requests up to the new end from now on and the
    /// configuration space says it (the caller tells the driver).
    fn grown(&self, handles: &[udm_core::ReactorHandle]) -> bool {
        let now = self.dev.limits().sectors;
        if now <= self.shared.capacity.load(Ordering::Relaxed) {
            return false;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let mut waits = 0;
        for h in handles {
            let tx = tx.clone();
            if on_worker(h, move |w| {
                w.grow(now << 9);
                let _ = tx.send(());
            }) {
                waits += 1;
            }
        }
        for _ in 0..waits {
            let _ = rx.recv_timeout(Duration::from_secs(5));
        }
        self.shared.capacity.store(now, Ordering::Relaxed);
        tracing::info!(
            "vhost: {}: the device grew to {now} sectors",
            self.path.display()
        );
        true
    }
}

/// If the next message is SET_BACKEND_REQ_FD, takes it (header, its
/// socket) and hands the socket to the device, answering if asked: the
/// vhost crate would wrap the socket in its `Backend`, which cannot send
/// config-change messages. Ok(true) when it was taken.
fn take_backend_channel(sock: &UnixStream, dev: &Mutex<Device>) -> Result<bool, String> {
    let mut hdr = [0u8; 12];
    // SAFETY: peeks at most 12 bytes into a live 12-byte buffer.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            hdr.as_mut_ptr().cast(),
            hdr.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    let word = |i: usize| u32::from_le_bytes([hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]]);
    let (req, flags, size) = (word(0), word(4), word(8));
    if n != 12 || req != FrontendReq::SET_BACKEND_REQ_FD as u32 {
        return Ok(false);
    }
    if size != 0 {
        return Err(format!("SET_BACKEND_REQ_FD with a {size}-byte body"));
    }
    let mut d = dev.lock().unwrap_or_else(|p| p.into_inner());
    if !d.acked(VhostUserProtocolFeatures::BACKEND_REQ) {
        return Err("SET_BACKEND_REQ_FD without the BACKEND_REQ protocol feature".into());
    }
    let (got, file) = sock
        .recv_with_fd(&mut hdr)
        .map_err(|e| format!("SET_BACKEND_REQ_FD: {e}"))?;
    let file = match (got, file) {
        (12, Some(f)) if f.metadata().is_ok_and(|m| m.file_type().is_socket()) => f,
        _ => return Err("SET_BACKEND_REQ_FD without a socket".into()),
    };
    d.set_backend_channel(UnixStream::from(OwnedFd::from(file)));
    if flags & 0x8 != 0 && d.acked(VhostUserProtocolFeatures::REPLY_ACK) {
        // The reply: version 1 | REPLY, a u64 status of 0.
        let mut r = [0u8; 20];
        r[..4].copy_from_slice(&req.to_le_bytes());
        r[4..8].copy_from_slice(&(0x1u32 | 0x4).to_le_bytes());
        r[8..12].copy_from_slice(&8u32.to_le_bytes());
        (&*sock)
            .write_all(&r)
            .map_err(|e| format!("answering SET_BACKEND_REQ_FD: {e}"))?;
    }
    Ok(true)
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
    /// Neither within [`SIZE_CHECK`].
    Timeout,
}

/// Waits until `fd` or `stop` is readable (stop wins), at most
/// [`SIZE_CHECK`].
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
        let n = unsafe { libc::poll(p.as_mut_ptr(), 2, SIZE_CHECK.as_millis() as i32) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        if n < 0 || p[1].revents != 0 {
            return Ready::Stop;
        }
        if n == 0 {
            return Ready::Timeout;
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
