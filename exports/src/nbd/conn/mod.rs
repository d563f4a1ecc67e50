//! One NBD connection on one reactor: the handshake's bytes and the
//! transmission phase, with every socket operation on the reactor's io_uring.
//!
//! ```text
//!  recv ─▶ rbuf ─▶ Handshake::feed ─▶ hs_out ──────────────┐
//!            │                                             ▼
//!            └─▶ request header ─▶ Req ─▶ bios ─▶ end_io ─▶ ready ─▶ sendmsg
//!                     │ WRITE payload: recv straight into Req's buffer  (header iovec
//!                                                                        + data iovec)
//! ```
//!
//! - One recv is in flight per connection: into the receive buffer, or, for
//!   the rest of a WRITE's payload, straight into the request's I/O buffer
//!   (only payload bytes that arrived with the header are copied).
//! - Requests go to the device through the export front
//!   ([`crate::front`]): split at the device's `max_io_bytes`, FUA emulated
//!   with a flush where the device lacks it, and, for a client that did not
//!   negotiate block sizes, byte-granular requests served by read-modify-write;
//!   many are in flight at once.
//! - Replies go out in completion order. One sendmsg is in flight at a
//!   time; replies that complete meanwhile are batched into the next one, as
//!   iovecs pointing at each request's header and, for reads, its buffer:
//!   read data is never copied into a send buffer. A batch is first offered
//!   to the socket with a non-blocking sendmsg at the end of the turn; only
//!   what the socket buffer cannot take goes to the ring, which sends it as
//!   room appears.
//! - Large reads are not copied at all where the device can lend them: a
//!   READ of [`LEND_MIN`] bytes or more that fits one bio allows it
//!   ([`BioFlags::MAY_LEND`]); a RAM disk under linear or striped then
//!   points the bio at its own memory instead of copying into the request's
//!   buffer. Lent memory is valid only inside the end_io, so the reply is
//!   sent from there at once, and whatever the socket does not take (or a
//!   reply queued behind a send in flight) is copied into the request's
//!   buffer before the end_io returns: nothing refers to lent memory later.
//! - Requests and their buffers are recycled per connection, so steady state
//!   allocates nothing per request.
//! - A connection is freed only by the [`Worker`]'s poller, once no recv,
//!   send or bio refers to it.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_core::io_uring::{opcode, types};
use udm_core::{Channel, Poller, Reactor, RingOp};

use crate::front::{self, Front, FrontError, FrontOp, ReqFlags, Submitted};

use super::export::Export;
use super::handshake::{Handshake, Negotiated, Outcome, MAX_OPTION_DATA};
use super::proto::{self, Command, ExportInfo, Refusal, Request, TxParams};

mod send;

/// Receive buffer per connection: holds request headers, small payloads and
/// whole handshake options.
const RBUF_LEN: usize = 64 * 1024;
const _: () = assert!(RBUF_LEN > MAX_OPTION_DATA + proto::OPTION_HEADER_LEN);
/// Requests in flight per connection before the server stops reading.
const MAX_REQS: usize = 512;
/// READ/WRITE bytes in flight per connection before the server stops reading.
const MAX_INFLIGHT_BYTES: u64 = 128 << 20;
/// Request buffers up to this size are kept for reuse; larger ones are freed.
const KEEP_BUF: usize = 4 << 20;
/// iovecs per sendmsg (IOV_MAX).
const MAX_IOV: usize = 1024;
/// Bytes of a reply header (room for an error chunk with a short message).
const HDR_LEN: usize = 96;
/// Alignment of request buffers (O_DIRECT-friendly).
const BUF_ALIGN: usize = 4096;
/// Single-bio reads of at least this many bytes let the device lend its
/// memory. Below it, the copy costs less than the sendmsg of its own that
/// a lent reply takes (smaller replies leave batched at the end of the turn).
pub const LEND_MIN: u32 = 32 << 10;

/// A reactor's share of the server: the export table, one channel per
/// export (opened on first use), the connections placed here. Registered
/// as a poller: each turn it flushes the replies of the connections that
/// changed, so replies completed in one turn leave in one sendmsg.
pub struct Worker {
    reactor: *const Reactor,
    exports: Arc<Vec<Export>>,
    infos: Vec<ExportInfo>,
    channels: RefCell<Vec<Option<Rc<dyn Channel>>>>,
    conns: RefCell<Vec<*mut Conn>>,
    dirty: RefCell<Vec<*mut Conn>>,
    scratch: RefCell<Vec<*mut Conn>>,
    stopping: Cell<bool>,
    /// When stopping, the moment connections still open are cut.
    cut_at: Cell<Option<Instant>>,
}

/// How long a stopping server waits for connections to finish their
/// requests (a client that stops reading replies would otherwise hold the
/// shutdown forever).
pub const STOP_GRACE: Duration = Duration::from_secs(5);

impl Worker {
    /// A worker for `reactor`, which must outlive it (the server keeps both
    /// on the reactor's thread and drops the worker first).
    pub fn new(reactor: &Reactor, exports: Arc<Vec<Export>>) -> Rc<Worker> {
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

    fn reactor(&self) -> &Reactor {
        // SAFETY: `new`'s contract: the reactor outlives the worker.
        unsafe { &*self.reactor }
    }

    fn channel(&self, export: usize) -> Result<Rc<dyn Channel>, String> {
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
}

impl Worker {
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
                // SAFETY: made by Box::into_raw in `start`; nothing refers to
                // it any more (no recv, send, request or list entry).
                let conn = unsafe { Box::from_raw(c) };
                conn.log_close();
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
            None
        } else {
            self.cut_at.get()
        }
    }
}

/// Starts serving the accepted socket `fd` on `worker`'s reactor: sends the
/// greeting and waits for the client's flags.
pub fn start(worker: &Rc<Worker>, fd: OwnedFd, peer: String, id: u64) {
    let conn = Box::new(Conn {
        recv_op: ConnOp {
            op: RingOp {
                complete: recv_complete,
            },
            conn: std::ptr::null_mut(),
        },
        send_op: ConnOp {
            op: RingOp {
                complete: send_complete,
            },
            conn: std::ptr::null_mut(),
        },
        worker: worker.clone(),
        id,
        peer,
        fd,
        rbuf: vec![0u8; RBUF_LEN].into_boxed_slice(),
        rstart: 0,
        rend: 0,
        recv_inflight: false,
        payload: std::ptr::null_mut(),
        hs: Some(Box::new(Handshake::new())),
        hs_out: Vec::new(),
        hs_sending: Vec::new(),
        tx: None,
        free: Vec::new(),
        active: 0,
        inflight_bytes: 0,
        ready: VecDeque::new(),
        sending: Vec::new(),
        iov: Vec::new(),
        iov_at: 0,
        lent_iovs: Vec::new(),
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        msg: unsafe { std::mem::zeroed() },
        send_inflight: false,
        skip: 0,
        skip_req: std::ptr::null_mut(),
        disc: false,
        closing: None,
        write_dead: false,
        in_dirty: false,
        blocked: false,
        requests: 0,
        refused: 0,
        sends_direct: 0,
        sends_ring: 0,
        lent: 0,
        lent_copied: 0,
        export: None,
    });
    let p = Box::into_raw(conn);
    // SAFETY: just made; the box's address is stable until the poller frees it.
    let c = unsafe { &mut *p };
    c.recv_op.conn = p;
    c.send_op.conn = p;
    worker.conns.borrow_mut().push(p);
    if worker.stopping() {
        c.begin_close("server shutting down".into());
    } else {
        proto::put_greeting(&mut c.hs_out);
        c.arm_recv();
    }
    c.dirty();
}

/// A ring operation of a connection: the op, then a way back to it.
#[repr(C)]
struct ConnOp {
    op: RingOp,
    conn: *mut Conn,
}

/// What the transmission phase needs, fixed at GO/EXPORT_NAME.
struct Tx {
    /// The connection's front to the export's device.
    front: Rc<Front>,
    params: TxParams,
    structured: bool,
}

/// One request, from header to reply. Recycled per connection.
struct Req {
    conn: *mut Conn,
    cookie: u64,
    cmd: Command,
    offset: u64,
    len: u32,
    buf: *mut u8,
    cap: usize,
    received: usize,
    /// Submitted to the front and not finished yet.
    pending: bool,
    result: Result<(), FrontError>,
    refusal: Option<Refusal>,
    counted: u64,
    hdr: [u8; HDR_LEN],
    hdr_len: usize,
    data_len: usize,
    /// The read's data lent by the device (null: it is in `buf`). Set only
    /// while the bio's end_io runs; see [`Conn::send_lent`].
    lent: *const u8,
}

impl Req {
    fn ensure_buf(&mut self, len: usize) {
        if self.cap >= len {
            return;
        }
        self.free_buf();
        let cap = len.div_ceil(BUF_ALIGN) * BUF_ALIGN;
        let Ok(layout) = std::alloc::Layout::from_size_align(cap, BUF_ALIGN) else {
            return;
        };
        // SAFETY: cap > 0 (len > cap >= 0 brought us here).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        self.buf = p;
        self.cap = cap;
    }

    fn free_buf(&mut self) {
        if self.cap == 0 {
            return;
        }
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.cap, BUF_ALIGN) {
            // SAFETY: allocated in ensure_buf with this very layout; no bio,
            // recv or send uses it (the request is being recycled or grown).
            unsafe { std::alloc::dealloc(self.buf, layout) };
        }
        self.buf = std::ptr::null_mut();
        self.cap = 0;
    }
}

impl Drop for Req {
    fn drop(&mut self) {
        self.free_buf();
    }
}

/// One connection. See the module docs.
pub struct Conn {
    recv_op: ConnOp,
    send_op: ConnOp,
    worker: Rc<Worker>,
    id: u64,
    peer: String,
    fd: OwnedFd,
    rbuf: Box<[u8]>,
    rstart: usize,
    rend: usize,
    recv_inflight: bool,
    /// The WRITE whose payload the pending recv lands in (null: the recv
    /// lands in `rbuf`).
    payload: *mut Req,
    hs: Option<Box<Handshake>>,
    hs_out: Vec<u8>,
    hs_sending: Vec<u8>,
    tx: Option<Tx>,
    free: Vec<*mut Req>,
    active: usize,
    inflight_bytes: u64,
    ready: VecDeque<*mut Req>,
    sending: Vec<*mut Req>,
    iov: Vec<libc::iovec>,
    iov_at: usize,
    /// The batch's iovecs that point at lent memory, with their requests.
    lent_iovs: Vec<(usize, *mut Req)>,
    msg: libc::msghdr,
    send_inflight: bool,
    /// Payload bytes of a refused WRITE still to be read and dropped.
    skip: u64,
    skip_req: *mut Req,
    disc: bool,
    closing: Option<String>,
    write_dead: bool,
    in_dirty: bool,
    blocked: bool,
    requests: u64,
    refused: u64,
    /// Batches the socket took whole or in part from a direct sendmsg.
    sends_direct: u64,
    /// Sends handed to the ring (the socket was full, or a batch's rest).
    sends_ring: u64,
    /// Reads served from memory the device lent, and those of them that
    /// had to be copied after all (in part or whole: the socket was full).
    lent: u64,
    lent_copied: u64,
    export: Option<String>,
}

fn errno_str(res: i32) -> String {
    std::io::Error::from_raw_os_error(-res).to_string()
}

fn recv_complete(op: *mut RingOp, res: i32, _flags: u32) {
    // SAFETY: `op` is the recv_op of a live connection (push_op's contract:
    // the connection is freed only once no recv is in flight); ConnOp is
    // repr(C) with the RingOp first.
    let p = unsafe { (*(op as *mut ConnOp)).conn };
    // SAFETY: as above; no other reference to the connection is live while
    // a completion runs (the reactor runs one callback at a time).
    let c = unsafe { &mut *p };
    c.recv_inflight = false;
    c.on_recv(res);
    c.dirty();
}

fn send_complete(op: *mut RingOp, res: i32, _flags: u32) {
    // SAFETY: as in recv_complete, for send_op.
    let p = unsafe { (*(op as *mut ConnOp)).conn };
    // SAFETY: as in recv_complete.
    let c = unsafe { &mut *p };
    c.send_inflight = false;
    c.on_sent(res);
    c.dirty();
}

/// The front's completion of a request: `ctx` is the request.
fn req_done(ctx: *mut (), done: front::Done<'_>) {
    let r = ctx.cast::<Req>();
    // SAFETY: ctx is a request of a live connection: a connection is not
    // freed while it has active requests, and a request is not recycled
    // while the front holds it (pending).
    let req = unsafe { &mut *r };
    req.pending = false;
    req.result = done.result;
    // SAFETY: the request's connection is live (see above).
    let c = unsafe { &mut *req.conn };
    // Lent memory is valid only until this function returns
    // (BioFlags::MAY_LEND's contract): the reply goes out from here.
    match done.lent {
        Some(lent) if req.result.is_ok() => c.send_lent(r, lent.as_ptr()),
        _ => c.reply(r),
    }
}

impl Conn {
    fn tag(&self) -> String {
        format!("nbd: connection {} ({})", self.id, self.peer)
    }

    /// Puts the connection on its worker's list for the end of the turn
    /// (flush replies, resume reading, free when done).
    fn dirty(&mut self) {
        if !self.in_dirty {
            self.in_dirty = true;
            let p: *mut Conn = self;
            self.worker.dirty.borrow_mut().push(p);
        }
    }

    fn log_close(&self) {
        let export = self.export.as_deref().unwrap_or("-");
        tracing::info!(
            "{}: export '{}': {} requests ({} refused); sends: {} direct, {} on the ring; \
             lent reads: {} ({} copied); closed: {}",
            self.tag(),
            export,
            self.requests,
            self.refused,
            self.sends_direct,
            self.sends_ring,
            self.lent,
            self.lent_copied,
            self.closing.as_deref().unwrap_or("?")
        );
    }

    /// Starts closing: no more reading; in-flight requests still finish
    /// and, while the socket can be written, get their replies.
    fn begin_close(&mut self, why: String) {
        if self.closing.is_none() {
            self.closing = Some(why);
        }
        if self.recv_inflight {
            // Wakes the pending recv with 0 bytes.
            // SAFETY: plain syscall on our own socket.
            unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RD) };
        }
    }

    fn freeable(&self) -> bool {
        self.closing.is_some()
            && !self.recv_inflight
            && !self.send_inflight
            && self.active == 0
            && (self.hs_out.is_empty() || self.write_dead)
    }

    fn arm_recv(&mut self) {
        if self.recv_inflight || self.closing.is_some() || self.blocked || self.disc {
            return;
        }
        let (ptr, len, flags) = if self.payload.is_null() {
            if self.rstart > 0 {
                self.rbuf.copy_within(self.rstart..self.rend, 0);
                self.rend -= self.rstart;
                self.rstart = 0;
            }
            let len = RBUF_LEN - self.rend;
            if len == 0 {
                self.begin_close("protocol error: receive buffer full".into());
                return;
            }
            // SAFETY: rend <= RBUF_LEN, so the pointer is inside or one past rbuf.
            (unsafe { self.rbuf.as_mut_ptr().add(self.rend) }, len, 0)
        } else {
            // SAFETY: `payload` is an active request whose buffer holds `len` bytes.
            let r = unsafe { &*self.payload };
            (
                // SAFETY: received < len <= cap.
                unsafe { r.buf.add(r.received) },
                r.len as usize - r.received,
                libc::MSG_WAITALL,
            )
        };
        let e = opcode::Recv::new(types::Fd(self.fd.as_raw_fd()), ptr, len as u32)
            .flags(flags)
            .build();
        self.recv_inflight = true;
        let op: *mut RingOp = &mut self.recv_op.op;
        // SAFETY: the recv writes into rbuf or the payload request's buffer:
        // both belong to this connection, which is freed only after this
        // recv completes (freeable() needs !recv_inflight), and neither is
        // touched until then (rbuf is only read/compacted in on_recv; the
        // payload request is not recycled while it is `payload`).
        unsafe { self.worker.reactor().ring().push_op(e, op) };
    }

    fn on_recv(&mut self, res: i32) {
        if res <= 0 {
            let mut why = if res == 0 {
                "client closed the connection".to_string()
            } else {
                format!("recv: {}", errno_str(res))
            };
            if self.drop_partial() {
                why.push_str(" mid-payload");
            } else if self.rend > self.rstart && self.closing.is_none() {
                why.push_str(" mid-request");
            }
            self.begin_close(why);
            return;
        }
        if self.closing.is_some() {
            // begin_close's shutdown wakes a MSG_WAITALL recv with the part
            // of a payload received so far: that request can never be
            // submitted, so it goes now (else `active` never drops to 0 and
            // the connection is never freed, hanging a stop).
            self.drop_partial();
            return;
        }
        let n = res as usize;
        if !self.payload.is_null() {
            let r = self.payload;
            // SAFETY: `payload` is an active request of this connection.
            let req = unsafe { &mut *r };
            req.received += n;
            if req.received < req.len as usize {
                self.arm_recv();
                return;
            }
            self.payload = std::ptr::null_mut();
            self.submit(r);
        } else {
            self.rend += n;
        }
        self.process();
        self.arm_recv();
    }

    /// Releases a WRITE whose payload was still arriving (or a refused one
    /// whose payload was being skipped). Returns whether there was one.
    fn drop_partial(&mut self) -> bool {
        if !self.payload.is_null() {
            let r = std::mem::replace(&mut self.payload, std::ptr::null_mut());
            self.recycle(r);
            true
        } else if !self.skip_req.is_null() {
            let r = std::mem::replace(&mut self.skip_req, std::ptr::null_mut());
            self.skip = 0;
            self.recycle(r);
            true
        } else {
            false
        }
    }

    /// Parses whatever complete messages the receive buffer holds.
    fn process(&mut self) {
        loop {
            if self.closing.is_some() || self.disc || !self.payload.is_null() {
                return;
            }
            if let Some(hs) = self.hs.as_mut() {
                let (n, outcome) = hs.feed(
                    &self.rbuf[self.rstart..self.rend],
                    &self.worker.infos,
                    &mut self.hs_out,
                );
                self.rstart += n;
                match outcome {
                    Outcome::Continue => return,
                    Outcome::Transmission(neg) => {
                        self.hs = None;
                        self.enter_tx(neg);
                        continue;
                    }
                    Outcome::Close(why) => {
                        self.hs = None;
                        self.begin_close(format!("handshake: {why}"));
                        return;
                    }
                }
            }
            let avail = self.rend - self.rstart;
            if self.skip > 0 {
                let n = (avail as u64).min(self.skip);
                self.rstart += n as usize;
                self.skip -= n;
                if self.skip > 0 {
                    return;
                }
                let r = std::mem::replace(&mut self.skip_req, std::ptr::null_mut());
                self.reply(r);
                continue;
            }
            if avail < proto::REQUEST_LEN {
                return;
            }
            if self.active >= MAX_REQS || self.inflight_bytes >= MAX_INFLIGHT_BYTES {
                self.blocked = true;
                return;
            }
            let hdr = match proto::parse_request(&self.rbuf[self.rstart..self.rend]) {
                Ok(h) => h,
                Err(e) => {
                    // Without the magic the stream cannot be resynchronised:
                    // the spec's hard disconnect.
                    tracing::warn!("{}: request: {e}; disconnecting", self.tag());
                    self.begin_close(format!("protocol error: request {e}"));
                    return;
                }
            };
            self.rstart += proto::REQUEST_LEN;
            self.request(hdr);
        }
    }

    /// Resumes reading once requests in flight fell below the limits.
    fn unblock(&mut self) {
        if self.blocked
            && self.active < MAX_REQS
            && self.inflight_bytes < MAX_INFLIGHT_BYTES
            && self.closing.is_none()
        {
            self.blocked = false;
            self.process();
            self.arm_recv();
        }
    }

    fn enter_tx(&mut self, neg: Negotiated) {
        let Some(e) = self.worker.exports.get(neg.export) else {
            self.begin_close("handshake: no such export".into());
            return;
        };
        let chan = match self.worker.channel(neg.export) {
            Ok(c) => c,
            Err(why) => {
                tracing::warn!("{}: {why}", self.tag());
                self.begin_close(why);
                return;
            }
        };
        // SAFETY: the connection lives on this reactor and is freed by its
        // worker's poller, so the reactor outlives the front, which is used
        // on this thread only.
        let front = unsafe { Front::new(self.worker.reactor(), &*e.dev, chan) };
        self.export = Some(e.info.name.clone());
        self.tx = Some(Tx {
            front,
            params: TxParams {
                size: e.info.size,
                flags: e.info.flags,
                // A client that did not ask for block sizes may send any
                // byte range: the front serves it by read-modify-write.
                min_block: if neg.block_sizes { e.info.min_block } else { 1 },
                max_payload: e.info.max_payload,
                block_status: neg.block_status,
            },
            structured: neg.structured,
        });
    }

    fn alloc_req(&mut self, h: &Request, cmd: Command) -> *mut Req {
        let r = match self.free.pop() {
            Some(r) => r,
            None => Box::into_raw(Box::new(Req {
                conn: self,
                cookie: 0,
                cmd: Command::Flush,
                offset: 0,
                len: 0,
                buf: std::ptr::null_mut(),
                cap: 0,
                received: 0,
                pending: false,
                result: Ok(()),
                refusal: None,
                counted: 0,
                hdr: [0; HDR_LEN],
                hdr_len: 0,
                data_len: 0,
                lent: std::ptr::null(),
            })),
        };
        // SAFETY: a request from the free list or just made, owned by us.
        let req = unsafe { &mut *r };
        req.cookie = h.cookie;
        req.cmd = cmd;
        req.offset = h.offset;
        req.len = h.len;
        req.received = 0;
        req.pending = false;
        req.result = Ok(());
        req.refusal = None;
        req.counted = 0;
        req.hdr_len = 0;
        req.data_len = 0;
        req.lent = std::ptr::null();
        self.active += 1;
        r
    }

    fn recycle(&mut self, r: *mut Req) {
        // SAFETY: an active request of this connection with nothing pending.
        let req = unsafe { &mut *r };
        self.inflight_bytes -= req.counted;
        self.active -= 1;
        req.lent = std::ptr::null();
        if req.cap > KEEP_BUF {
            req.free_buf();
        }
        self.free.push(r);
    }

    /// Handles one request header (the payload, if any, follows in rbuf).
    fn request(&mut self, h: Request) {
        self.requests += 1;
        let Some(tx) = self.tx.as_ref() else { return };
        let cmd = match proto::validate(&h, &tx.params) {
            Ok(c) => c,
            Err(refusal) => {
                self.refused += 1;
                tracing::warn!(
                    "{}: refused command {} (flags {:#x}, offset {}, length {}): {}",
                    self.tag(),
                    h.cmd,
                    h.flags,
                    h.offset,
                    h.len,
                    refusal.msg
                );
                let r = self.alloc_req(&h, Command::Cache);
                // SAFETY: just allocated, ours.
                unsafe { (*r).refusal = Some(refusal) };
                if h.payload_len() > 0 {
                    // Read and drop the payload, then reply: the client
                    // stays in step and no memory is spent on it.
                    self.skip = h.payload_len() as u64;
                    self.skip_req = r;
                } else {
                    self.reply(r);
                }
                return;
            }
        };
        if cmd == Command::Disc {
            // No reply; in-flight requests still finish and are answered.
            self.disc = true;
            self.begin_close("client disconnected (NBD_CMD_DISC)".into());
            return;
        }
        let r = self.alloc_req(&h, cmd);
        // SAFETY: just allocated, ours.
        let req = unsafe { &mut *r };
        match cmd {
            Command::Read | Command::Write { .. } => {
                req.ensure_buf(h.len as usize);
                req.counted = h.len as u64;
                self.inflight_bytes += req.counted;
            }
            _ => {}
        }
        if let Command::Write { .. } = cmd {
            let avail = self.rend - self.rstart;
            let n = avail.min(h.len as usize);
            if n > 0 {
                // SAFETY: the buffer holds len >= n bytes, rbuf holds `avail`
                // bytes from rstart; distinct allocations.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.rbuf.as_ptr().add(self.rstart), req.buf, n)
                };
            }
            self.rstart += n;
            req.received = n;
            if n < h.len as usize {
                // The rest of the payload goes straight into the buffer.
                self.payload = r;
                return;
            }
        }
        match cmd {
            Command::Cache | Command::BlockStatus { .. } => self.reply(r),
            _ => self.submit(r),
        }
    }

    /// Hands the request to the front.
    fn submit(&mut self, r: *mut Req) {
        let Some(tx) = self.tx.as_ref() else { return };
        // SAFETY: an active request of this connection.
        let req = unsafe { &mut *r };
        let none = ReqFlags::default();
        let (op, flags) = match req.cmd {
            Command::Read => (
                FrontOp::Read,
                ReqFlags {
                    may_lend: req.len >= LEND_MIN,
                    ..none
                },
            ),
            Command::Write { fua } => (FrontOp::Write, ReqFlags { fua, ..none }),
            Command::Trim { fua } => (FrontOp::Discard, ReqFlags { fua, ..none }),
            Command::WriteZeroes { fua, fast } => (
                FrontOp::WriteZeroes,
                ReqFlags {
                    fua,
                    fast_zero: fast,
                    ..none
                },
            ),
            Command::Flush => (FrontOp::Flush, none),
            Command::Cache | Command::BlockStatus { .. } | Command::Disc => {
                self.reply(r);
                return;
            }
        };
        let fr = front::Request {
            op,
            offset: req.offset,
            len: req.len,
            flags,
            buf: req.buf,
            token: req.cookie,
            done: req_done,
            ctx: r.cast(),
        };
        req.pending = true;
        // SAFETY: for reads and writes, `buf` holds `len` bytes (ensure_buf
        // in `request`), and the connection leaves it alone until the
        // request is recycled, after the front finished it and the reply
        // was sent.
        match unsafe { tx.front.submit(fr) } {
            Submitted::Later => {}
            Submitted::Now(result) => {
                req.pending = false;
                req.result = result;
                self.reply(r);
            }
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        for r in self.free.drain(..) {
            // SAFETY: free-list requests were made by Box::into_raw and are
            // not referenced by anything else.
            drop(unsafe { Box::from_raw(r) });
        }
    }
}
