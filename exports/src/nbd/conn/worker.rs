//! A reactor's share of the NBD server: the connections placed on it, one
//! channel per export, and the end-of-turn poller that flushes replies and
//! frees finished connections.

use std::cell::{Cell, RefCell};
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_core::{Channel, Poller, Reactor};

use super::super::export::Export;
use super::super::proto::ExportInfo;
use super::Conn;

/// How long a stopping server waits for connections to finish their
/// requests (a client that stops reading replies would otherwise hold the
/// shutdown forever).
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// A reactor's share of the server: the export table, one channel per
/// export (opened on first use), the connections placed here. Registered
/// as a poller: each turn it flushes the replies of the connections that
/// changed, so replies completed in one turn leave in one sendmsg.
pub struct Worker {
    reactor: *const Reactor,
    pub(super) exports: Arc<Vec<Export>>,
    pub(super) infos: Vec<ExportInfo>,
    channels: RefCell<Vec<Option<Rc<dyn Channel>>>>,
    pub(super) conns: RefCell<Vec<*mut Conn>>,
    pub(super) dirty: RefCell<Vec<*mut Conn>>,
    scratch: RefCell<Vec<*mut Conn>>,
    stopping: Cell<bool>,
    /// When stopping, the moment connections still open are cut.
    cut_at: Cell<Option<Instant>>,
    /// The server's count of open connections (decremented here as
    /// connections are freed).
    clients: Arc<AtomicUsize>,
}

impl Worker {
    /// A worker for `reactor`, which must outlive it (the server keeps both
    /// on the reactor's thread and drops the worker first). `clients` is
    /// the server's count of open connections, each counted at accept.
    pub fn new(
        reactor: &Reactor,
        exports: Arc<Vec<Export>>,
        clients: Arc<AtomicUsize>,
    ) -> Rc<Worker> {
        let infos = exports.iter().map(|e| e.info.clone()).collect();
        let n = exports.len();
        Rc::new(Worker {
            reactor,
            exports,
            infos,
            channels: RefCell::new(vec![None; n]),
            conns: RefCell::new(Vec::new()),
            dirty: RefCell::new(Vec::new()),
            scratch: RefCell::new(Vec::new()),
            stopping: Cell::new(false),
            cut_at: Cell::new(None),
            clients,
        })
    }

    /// Connections currently placed on this reactor.
    pub fn connections(&self) -> usize {
        self.conns.borrow().len()
    }

    /// Whether [`Worker::stop`] was called.
    pub fn stopping(&self) -> bool {
        self.stopping.get()
    }

    /// Stops the worker: new connections are refused, connections still in
    /// the handshake are closed, connections in transmission stop reading
    /// and close once their in-flight requests are answered.
    pub fn stop(&self) {
        self.stopping.set(true);
        self.cut_at.set(Some(Instant::now() + STOP_GRACE));
        let conns = self.conns.borrow().clone();
        for c in conns {
            // SAFETY: a connection stays in `conns` until the poller frees it,
            // which cannot run while this method does (same thread).
            let conn = unsafe { &mut *c };
            conn.begin_close("server shutting down".into());
            conn.dirty();
        }
    }

    /// Drops the channels (before the reactor goes).
    pub fn release(&self) {
        self.channels
            .borrow_mut()
            .iter_mut()
            .for_each(|c| *c = None);
    }

    pub(super) fn reactor(&self) -> &Reactor {
        // SAFETY: `new`'s contract: the reactor outlives the worker.
        unsafe { &*self.reactor }
    }

    /// The channel of export `export` on this reactor, opened on first use.
    pub(super) fn channel(&self, export: usize) -> Result<Rc<dyn Channel>, String> {
        if let Some(Some(c)) = self.channels.borrow().get(export) {
            return Ok(c.clone());
        }
        let e = self.exports.get(export).ok_or("no such export")?;
        let c = e
            .dev
            .clone()
            .open(self.reactor())
            .map_err(|err| format!("opening '{}': {err}", e.info.name))?;
        self.channels.borrow_mut()[export] = Some(c.clone());
        Ok(c)
    }

    /// After the grace period, cuts every connection still open: pending
    /// sends and receives fail, requests in flight finish without replies.
    fn cut_stragglers(&self) {
        let Some(t) = self.cut_at.get() else { return };
        if Instant::now() < t {
            return;
        }
        self.cut_at.set(None);
        let conns = self.conns.borrow().clone();
        for c in conns {
            // SAFETY: as in stop().
            let conn = unsafe { &mut *c };
            tracing::warn!(
                "{}: still busy after {STOP_GRACE:?}; cutting it",
                conn.tag()
            );
            conn.write_dead = true;
            // SAFETY: plain syscall on the connection's own socket.
            unsafe { libc::shutdown(conn.fd.as_raw_fd(), libc::SHUT_RDWR) };
            conn.dirty();
        }
    }
}

impl Poller for Worker {
    fn poll(&self) -> usize {
        self.cut_stragglers();
        if self.dirty.borrow().is_empty() {
            return 0;
        }
        let mut batch = std::mem::take(&mut *self.scratch.borrow_mut());
        std::mem::swap(&mut batch, &mut *self.dirty.borrow_mut());
        for &c in &batch {
            // SAFETY: a connection in the dirty list is live: only this loop
            // frees connections, and only after taking them off the list.
            let conn = unsafe { &mut *c };
            conn.in_dirty = false;
            conn.unblock();
            conn.flush_sends();
            if conn.freeable() {
                self.conns.borrow_mut().retain(|&x| x != c);
                // SAFETY: made by Box::into_raw in `conn::start`; nothing
                // refers to it any more (no recv, send, request or list entry).
                let conn = unsafe { Box::from_raw(c) };
                conn.log_close();
                drop(conn);
                self.clients.fetch_sub(1, Ordering::Relaxed);
            }
        }
        batch.clear();
        *self.scratch.borrow_mut() = batch;
        // Reported as no work: the reactor gives a poller that did work
        // another turn before it sleeps, which here would cost an extra
        // io_uring_enter per reply (a submit, then the wait). Nothing is
        // lost by sleeping: a connection dirtied during the flush keeps
        // must_spin true, and bios it submitted are queued completions or
        // ring operations, both of which the reactor checks before waiting.
        0
    }

    fn must_spin(&self) -> bool {
        !self.dirty.borrow().is_empty()
    }

    fn deadline(&self) -> Option<Instant> {
        if self.conns.borrow().is_empty() {
            None
        } else {
            self.cut_at.get()
        }
    }
}
