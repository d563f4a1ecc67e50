//! The NBD server: listeners, the export table, placing connections on
//! reactors, and shutdown.
//!
//! The thread that calls [`Server::run`] accepts (on every listener, with
//! `poll(2)`, off the data path) and hands each socket to the next reactor
//! thread through its [`ReactorHandle`](udm_core::ReactorHandle) mailbox; from then on the
//! connection lives on that reactor. When `stop_fd` becomes readable (a
//! signalfd for SIGINT/SIGTERM, or an eventfd), the server stops
//! accepting, lets every reactor finish the requests in flight, joins them,
//! and returns; [`flush_all`] then flushes the devices.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_core::{
    BlockDevice, Error, Op, PoolConfig, Reactor, ReactorConfig, ReactorPool, Status, StopToken,
};

use super::conn::{self, Worker};
pub use super::export::{Export, MAX_PAYLOAD};
use super::handshake::TlsMode;
use super::limits::{Counts, Shared};
use super::tls::Tls;
use crate::limits::{Limits, Pool};

/// SO_SNDBUF asked for on accepted unix sockets (the kernel caps it at
/// net.core.wmem_max and doubles it for overhead). The default, 208 KiB,
/// holds less than two 128 KiB read replies: at QD8 the server's sendmsg
/// keeps finding the buffer full, its send waits on the ring for room, and
/// every recv of the client wakes the server again to send a little more,
/// a cross-CPU wakeup each time the two run apart. With room for the replies
/// in flight, a batch leaves in one direct sendmsg and the server sleeps
/// until the next request. TCP sockets keep the kernel's autotuning (a
/// fixed SO_SNDBUF would turn it off). The memory is only used while the
/// client is behind in reading.
const UNIX_SNDBUF: libc::c_int = 1 << 20;

/// Reactor-local key under which each reactor keeps its [`Worker`].
const WORKER_KEY: u64 = 0x4e42_4400_0000_0000;

/// Where to listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket at this path.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl Listen {
    /// Parses `unix:PATH`, `HOST:PORT`, `:PORT` or `PORT` (the last two on
    /// loopback: the network is opt-in).
    pub fn parse(s: &str) -> Result<Listen, Error> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(Error::invalid(format!("--listen '{s}': empty socket path")));
            }
            return Ok(Listen::Unix(PathBuf::from(p)));
        }
        let port_only = s.strip_prefix(':').unwrap_or(s);
        if let Ok(port) = port_only.parse::<u16>() {
            return Ok(Listen::Tcp(SocketAddr::from(([127, 0, 0, 1], port))));
        }
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(Listen::Tcp(a));
        }
        use std::net::ToSocketAddrs;
        match s.to_socket_addrs().map(|mut a| a.next()) {
            Ok(Some(a)) => Ok(Listen::Tcp(a)),
            _ => Err(Error::invalid(format!(
                "--listen '{s}': expected unix:PATH, HOST:PORT, :PORT or PORT"
            ))),
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
            Listen::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// How to run the server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Where to listen (at least one).
    pub listen: Vec<Listen>,
    /// Reactor threads serving connections.
    pub reactors: usize,
    /// How each reactor is built.
    pub reactor: ReactorConfig,
    /// Handshake deadline, connection cap, buffer budget.
    pub limits: Limits,
    /// The pool the server shares the cap and budget of (a daemon's, for
    /// all its exports); None: its own, under `limits`.
    pub pool: Option<Arc<Pool>>,
    /// TLS, if offered (loaded credentials and the mode).
    pub tls: Option<Arc<Tls>>,
    /// Serve plaintext on TCP addresses other than loopback (refused
    /// otherwise: see [`check_plaintext`]).
    pub insecure: bool,
}

/// Refuses a TCP listener off loopback that would carry plaintext (no TLS,
/// or TLS at the client's choice) unless `insecure`: one line naming TLS
/// and the way out. Unix sockets and loopback are served plaintext freely.
pub fn check_plaintext(listen: &[Listen], tls: TlsMode, insecure: bool) -> Result<(), Error> {
    if insecure || tls == TlsMode::Require {
        return Ok(());
    }
    for l in listen {
        if let Listen::Tcp(a) = l {
            if !a.ip().is_loopback() {
                let what = match tls {
                    TlsMode::Off => "without TLS",
                    _ => "with TLS optional (--tls on)",
                };
                return Err(Error::invalid(format!(
                    "nbd: refusing to listen on {a} (not loopback) {what}: anyone who \
                     connects gets the disk; give --tls require --tls-creds DIR, or \
                     --insecure to serve plaintext anyway"
                )));
            }
        }
    }
    Ok(())
}

enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    fn fd(&self) -> RawFd {
        match self {
            Listener::Unix(l, _) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A bound server, ready to [`Server::run`].
pub struct Server {
    exports: Arc<Vec<Export>>,
    /// The limits in force and the counts and budget under them.
    shared: Arc<Shared>,
    listeners: Vec<(Listener, Listen)>,
    cfg: ServerConfig,
}

/// The count of a server's open connections, readable from any thread.
#[derive(Clone)]
pub struct Clients(Arc<Shared>);

impl Clients {
    /// Connections accepted and not yet closed.
    pub fn get(&self) -> usize {
        self.0.counts.open.load(Ordering::Relaxed)
    }
}

impl Server {
    /// Binds every listener (so that the caller can announce them).
    pub fn bind(exports: Vec<Export>, cfg: ServerConfig) -> Result<Server, Error> {
        if exports.is_empty() {
            return Err(Error::invalid("nothing to export"));
        }
        let mode = cfg.tls.as_ref().map_or(TlsMode::Off, |t| t.options().mode);
        check_plaintext(&cfg.listen, mode, cfg.insecure)?;
        let pool = match &cfg.pool {
            Some(p) => p.clone(),
            None => Pool::new(&cfg.limits)?,
        };
        let shared = Arc::new(Shared {
            counts: Counts::new(exports.iter().map(|e| e.max_connections).collect()),
            pool,
            tls: cfg.tls.clone(),
        });
        let mut listeners = Vec::new();
        for l in &cfg.listen {
            let bound = match l {
                Listen::Unix(p) => {
                    // A stale socket from an earlier run is replaced; any
                    // other file is left alone (bind then fails).
                    if std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket()) {
                        let _ = std::fs::remove_file(p);
                    }
                    // 0600 from its first instant, in a directory no one
                    // else can write (docs/security.md): connecting takes
                    // write permission on the file.
                    let u = udm_core::access::Access::default()
                        .bind(p, &format!("listen on unix:{}", p.display()))?;
                    Listener::Unix(u, p.clone())
                }
                Listen::Tcp(a) => Listener::Tcp(
                    TcpListener::bind(a).map_err(|e| Error::os(format!("listen on {a}"), e))?,
                ),
            };
            let actual = match &bound {
                Listener::Tcp(t) => t.local_addr().map(Listen::Tcp).unwrap_or(l.clone()),
                Listener::Unix(..) => l.clone(),
            };
            set_nonblocking(bound.fd());
            listeners.push((bound, actual));
        }
        if listeners.is_empty() {
            return Err(Error::invalid("no --listen address"));
        }
        Ok(Server {
            exports: Arc::new(exports),
            shared,
            listeners,
            cfg,
        })
    }

    /// The addresses bound (TCP port 0 resolved to the real port).
    pub fn addresses(&self) -> Vec<Listen> {
        self.listeners.iter().map(|(_, a)| a.clone()).collect()
    }

    /// The count of connections open now, kept up to date while the
    /// server runs (from accept until the connection is freed).
    pub fn clients(&self) -> Clients {
        Clients(self.shared.clone())
    }

    /// The export table.
    pub fn exports(&self) -> &[Export] {
        &self.exports
    }

    /// Serves until `stop_fd` is readable, then stops accepting, finishes
    /// the requests in flight and returns.
    pub fn run(self, stop_fd: RawFd) -> Result<(), Error> {
        let shared = self.shared.clone();
        let max_conns = shared.pool.max_connections;
        let exports = self.exports.clone();
        let sh = shared.clone();
        let pool = ReactorPool::start(
            &PoolConfig::new("udm-nbd-", self.cfg.reactors, self.cfg.reactor),
            move |_, r: &Reactor, _: &StopToken| reactor_main(r, exports.clone(), sh.clone()),
        )?;
        let mut refused = RateLog::default();
        let mut failed = RateLog::default();
        let handles = pool.handles();
        let next_id = AtomicU64::new(1);
        let mut pfds: Vec<libc::pollfd> = self
            .listeners
            .iter()
            .map(|(l, _)| libc::pollfd {
                fd: l.fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        pfds.push(libc::pollfd {
            fd: stop_fd,
            events: libc::POLLIN,
            revents: 0,
        });
        let mut rr = 0usize;
        'accept: loop {
            // SAFETY: pfds is a live array of pollfd of the length given.
            let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            if pfds[pfds.len() - 1].revents != 0 {
                let mut b = [0u8; 128];
                // SAFETY: reads into a live local buffer of its size.
                unsafe { libc::read(stop_fd, b.as_mut_ptr().cast(), b.len()) };
                break 'accept;
            }
            for (i, (l, addr)) in self.listeners.iter().enumerate() {
                if pfds[i].revents == 0 {
                    continue;
                }
                // Accept what is pending on this listener (a bounded batch:
                // the stop signal is looked at between batches).
                for _ in 0..ACCEPT_BATCH {
                    let (fd, peer) = match accept(l) {
                        Accepted::Socket(fd, peer) => (fd, peer),
                        Accepted::Empty => break,
                        Accepted::Failed(e) => {
                            failed.note(|n, secs| {
                                tracing::warn!(
                                    "nbd: accept on {addr}: {e} ({n} failures in {secs:.1}s)"
                                )
                            });
                            // Out of descriptors or similar: back off a
                            // little rather than spin on a listener that
                            // stays readable.
                            std::thread::sleep(Duration::from_millis(10));
                            break;
                        }
                    };
                    // Over the cap: closed at once, before the greeting.
                    if !shared.pool.enter() {
                        drop(fd);
                        refused.note(|n, secs| {
                            tracing::warn!(
                                "nbd: at the cap of {max_conns} connections: {n} refused \
                                 in {secs:.1}s (last: {peer})"
                            )
                        });
                        continue;
                    }
                    shared.counts.open.fetch_add(1, Ordering::AcqRel);
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let h = &handles[rr % handles.len()];
                    rr += 1;
                    let sent = h.send(move |r: &Reactor| {
                        if let Some(w) = worker_of(r) {
                            conn::start(&w, fd, peer, id);
                        }
                    });
                    if !sent {
                        shared.counts.open.fetch_sub(1, Ordering::AcqRel);
                        shared.pool.leave();
                        tracing::warn!("nbd: reactor {} is gone; connection dropped", h.id());
                    }
                }
            }
        }
        tracing::info!("nbd: shutting down: no new connections; finishing requests in flight");
        drop(self.listeners);
        // Each worker finishes its connections' requests, then its reactor
        // loop ends.
        pool.broadcast(|r: &Reactor| {
            if let Some(w) = worker_of(r) {
                w.stop();
            }
        });
        for r in pool.join() {
            if let Err(e) = r {
                tracing::warn!("nbd: {e}");
            }
        }
        Ok(())
    }
}

fn set_nonblocking(fd: RawFd) {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
}

/// Accepts taken from one listener before the stop signal is checked again.
const ACCEPT_BATCH: usize = 256;

/// A log line at most once a second, with a count of what happened since
/// the last one.
#[derive(Default)]
struct RateLog {
    last: Option<Instant>,
    count: u64,
}

impl RateLog {
    /// Counts one event; calls `log(count, seconds)` when a second passed
    /// since the last line (or there was none).
    fn note(&mut self, log: impl FnOnce(u64, f64)) {
        self.count += 1;
        let now = Instant::now();
        let secs = match self.last {
            Some(t) if now.duration_since(t) < Duration::from_secs(1) => return,
            Some(t) => now.duration_since(t).as_secs_f64(),
            None => 0.0,
        };
        log(self.count, secs);
        self.count = 0;
        self.last = Some(now);
    }
}

enum Accepted {
    Socket(OwnedFd, String),
    Empty,
    Failed(io::Error),
}

fn accept(l: &Listener) -> Accepted {
    let addr = match l {
        Listener::Unix(_, p) => format!("unix:{}", p.display()),
        Listener::Tcp(_) => String::new(),
    };
    loop {
        // SAFETY: accept4 on our listening socket, no address wanted.
        let fd = unsafe {
            libc::accept4(
                l.fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::ECONNABORTED) => continue,
                Some(libc::EAGAIN) => return Accepted::Empty,
                _ => return Accepted::Failed(e),
            }
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let peer = match l {
            Listener::Unix(..) => {
                set_int_opt(&fd, libc::SOL_SOCKET, libc::SO_SNDBUF, UNIX_SNDBUF);
                addr
            }
            Listener::Tcp(_) => {
                set_int_opt(&fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
                peer_of(&fd)
            }
        };
        return Accepted::Socket(fd, peer);
    }
}

fn peer_of(fd: &OwnedFd) -> String {
    let s = std::mem::ManuallyDrop::new(
        // SAFETY: borrowed for the call only; ManuallyDrop keeps it open.
        unsafe { std::net::TcpStream::from_raw_fd(fd.as_raw_fd()) },
    );
    match s.peer_addr() {
        Ok(a) => format!("tcp {a}"),
        Err(_) => "tcp".into(),
    }
}

fn worker_of(r: &Reactor) -> Option<Rc<Worker>> {
    r.local(WORKER_KEY)?.downcast::<Worker>().ok()
}

/// A reactor's life in the server: its worker serves the connections
/// placed on it until the worker is stopped and they are all closed.
fn reactor_main(reactor: &Reactor, exports: Arc<Vec<Export>>, shared: Arc<Shared>) {
    let worker = Worker::new(reactor, exports, shared);
    reactor.add_poller(worker.clone());
    reactor.set_local(WORKER_KEY, worker.clone());
    reactor.run_until(|| worker.stopping() && worker.connections() == 0);
    worker.release();
    reactor.remove_local(WORKER_KEY);
    drop(worker);
    reactor.drain();
}

/// Flushes every device in `devs` (on a reactor of the calling thread).
/// Returns the devices whose flush failed, with the status.
pub fn flush_all(devs: &[Arc<dyn BlockDevice>]) -> Result<Vec<(String, Status)>, Error> {
    use std::cell::RefCell;
    let reactor = Reactor::new(ReactorConfig::default()).map_err(|e| Error::os("reactor", e))?;
    let results: Rc<FlushResults> = Rc::new(RefCell::new(Vec::new()));
    let mut chans = Vec::new();
    for (i, d) in devs.iter().enumerate() {
        results.borrow_mut().push((d.name().to_string(), None));
        let chan = d.clone().open(&reactor)?;
        let mut bio = reactor.alloc_bio();
        bio.set_dataless(Op::Flush, 0, 0);
        bio.set_ctx(i as u64);
        let p = Rc::into_raw(results.clone()) as *mut ();
        bio.set_end_io(flush_end_io, p);
        chan.submit(bio);
        chans.push(chan);
    }
    reactor.run_until(|| results.borrow().iter().all(|(_, s)| s.is_some()));
    drop(chans);
    let out = results
        .borrow()
        .iter()
        .filter_map(|(n, s)| match s {
            Some(s) if !s.is_ok() => Some((n.clone(), *s)),
            _ => None,
        })
        .collect();
    Ok(out)
}

type FlushResults = std::cell::RefCell<Vec<(String, Option<Status>)>>;

fn flush_end_io(bio: udm_core::BioPtr) {
    // SAFETY: private was made by Rc::into_raw in flush_all, once per bio.
    let results = unsafe { Rc::from_raw(bio.private() as *const FlushResults) };
    let i = bio.ctx() as usize;
    let status = bio.status();
    if let Some(e) = results.borrow_mut().get_mut(i) {
        e.1 = Some(status);
    };
}

/// Sets an int-valued socket option. Best effort: a socket that refuses it
/// still works, only with the kernel's default.
fn set_int_opt(fd: &OwnedFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) {
    // SAFETY: setsockopt on a descriptor `fd` keeps open, with a pointer to
    // a live c_int and its exact size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}
