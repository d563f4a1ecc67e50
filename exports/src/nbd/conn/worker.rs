//! A reactor's share of the NBD server: the connections placed on it, one
//! channel per export, and the end-of-turn poller that flushes replies and
//! frees finished connections.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_core::{Channel, PassEnd, Poller, Reactor};

use super::super::export::Export;
use super::super::limits::Shared;
use super::super::proto::ExportInfo;
use super::Conn;

/// How long a stopping server waits for connections to finish their
/// requests (a client that stops reading replies would otherwise hold the
/// shutdown forever).
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// How often connections waiting for room in the server-wide budget try
/// again (room freed on another reactor wakes nobody here).
const BUDGET_RETRY: Duration = Duration::from_millis(5);

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
    /// Connections given lent data in the pass over completions running
    /// now, settled when it ends.
    lent: RefCell<Vec<*mut Conn>>,
    stopping: Cell<bool>,
    /// When stopping, the moment connections still open are cut.
    cut_at: Cell<Option<Instant>>,
    /// The server's limits and counts.
    pub(super) shared: Arc<Shared>,
    /// Handshake deadlines, in accept order (one timeout for all): the
    /// moment, and the connection's id.
    hs_deadlines: RefCell<VecDeque<(Instant, u64)>>,
    /// When connections blocked on the server-wide budget try again.
    budget_retry: Cell<Option<Instant>>,
}

impl Worker {
    /// A worker for `reactor`, which must outlive it (the server keeps both
    /// on the reactor's thread and drops the worker first).
    pub fn new(reactor: &Reactor, exports: Arc<Vec<Export>>, shared: Arc<Shared>) -> Rc<Worker> {
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
            lent: RefCell::new(Vec::new()),
            stopping: Cell::new(false),
            cut_at: Cell::new(None),
            shared,
            hs_deadlines: RefCell::new(VecDeque::new()),
            budget_retry: Cell::new(None),
        })
    }

    /// Connection `c` holds replies pointing at lent memory: settled when
    /// the reactor's pass over completions ends.
    pub(super) fn hold_lent(me: &Rc<Worker>, c: *mut Conn) {
        let mut lent = me.lent.borrow_mut();
        if lent.is_empty() {
            me.reactor().at_pass_end(me.clone());
        }
        lent.push(c);
    }

    /// Starts the handshake deadline of connection `id`.
    pub(super) fn handshake_started(&self, id: u64) {
        if let Some(t) = self.shared.pool.handshake_timeout {
            self.hs_deadlines
                .borrow_mut()
                .push_back((Instant::now() + t, id));
        }
    }

    /// Connection `id` entered transmission: its deadline no longer holds.
    pub(super) fn handshake_done(&self, id: u64) {
        self.hs_deadlines.borrow_mut().retain(|&(_, x)| x != id);
    }

    /// A connection here waits for room in the server-wide budget.
    pub(super) fn wait_budget(&self) {
        if self.budget_retry.get().is_none() {
            self.budget_retry.set(Some(Instant::now() + BUDGET_RETRY));
        }
    }

    /// Closes connections whose handshake deadline passed.
    fn expire_handshakes(&self) {
        let now = Instant::now();
        loop {
            let id = match self.hs_deadlines.borrow().front() {
                Some(&(t, id)) if t <= now => id,
                _ => return,
            };
            self.hs_deadlines.borrow_mut().pop_front();
            let conns = self.conns.borrow().clone();
            for c in conns {
                // SAFETY: as in stop().
                let conn = unsafe { &mut *c };
                if conn.id == id && conn.hs.is_some() && conn.closing.is_none() {
                    let t = self.shared.pool.handshake_timeout.unwrap_or_default();
                    conn.abort(format!(
                        "handshake not finished within {}s",
                        t.as_secs_f64()
                    ));
                }
            }
        }
    }

    /// Lets connections blocked on the budget try again.
    fn retry_budget(&self) {
        match self.budget_retry.get() {
            Some(t) if Instant::now() >= t => {}
            _ => return,
        }
        self.budget_retry.set(None);
        let conns = self.conns.borrow().clone();
        for c in conns {
            // SAFETY: as in stop().
            let conn = unsafe { &mut *c };
            if conn.blocked {
                conn.dirty();
            }
        }
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

    /// A connection is freed: it leaves the server's counts.
    fn forget(&self, conn: &Conn) {
        self.shared.counts.open.fetch_sub(1, Ordering::AcqRel);
        self.shared.pool.leave();
        if let Some(i) = conn.admitted {
            self.shared.counts.leave(i);
        }
    }
}

impl PassEnd for Worker {
    /// Sends (or copies) every reply that points at lent memory, while it
    /// is valid.
    fn pass_end(&self) {
        let batch = std::mem::take(&mut *self.lent.borrow_mut());
        for &c in &batch {
            // SAFETY: a connection with a held reply has a request active,
            // so the poller, which alone frees connections (and does not
            // run during a pass), has not freed it.
            unsafe { &mut *c }.settle_lent();
        }
        let mut lent = self.lent.borrow_mut();
        if lent.is_empty() {
            *lent = batch;
            lent.clear();
        }
    }
}

impl Poller for Worker {
    fn poll(&self) -> usize {
        self.cut_stragglers();
        if !self.hs_deadlines.borrow().is_empty() {
            self.expire_handshakes();
        }
        if self.budget_retry.get().is_some() {
            self.retry_budget();
        }
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
                let mut conn = unsafe { Box::from_raw(c) };
                conn.release_tls();
                conn.log_close();
                self.forget(&conn);
                drop(conn);
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
            return None;
        }
        let hs = self.hs_deadlines.borrow().front().map(|&(t, _)| t);
        [self.cut_at.get(), hs, self.budget_retry.get()]
            .into_iter()
            .flatten()
            .min()
    }
}
