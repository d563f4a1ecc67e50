//! One NBD connection on one reactor: the handshake's bytes and the
//! transmission phase, with every socket operation on the reactor's io_uring.
//!
//! ```text
//!  recv ─▶ rbuf ─▶ Handshake::feed ─▶ hs_out ──────────────┐
//!            │                                             ▼
//!            └─▶ request header ─▶ Req ─▶ front ─▶ done ─▶ ready ─▶ sendmsg
//!                     │ WRITE payload: recv straight into Req's buffer  (header iovec
//!                                                                        + data iovec)
//! ```
//!
//! - `worker`: the reactor's share of the server, which flushes replies
//!   at the end of each turn and frees finished connections.
//! - `recv`: the receive path: one recv in flight per connection, into
//!   the receive buffer, or, for the rest of a WRITE's payload, straight
//!   into the request's buffer (only payload bytes that arrived with the
//!   header are copied); headers validated and handed to the export front
//!   ([`crate::front`]), which splits at the device's `max_io_bytes`,
//!   emulates FUA with a flush where the device lacks it, and serves
//!   byte-granular requests by read-modify-write for a client that did not
//!   negotiate block sizes. Many requests are in flight at once.
//! - `send`: replies in completion order. One sendmsg is in flight at a
//!   time; replies that complete meanwhile are batched into the next one,
//!   as iovecs pointing at each request's header and, for reads, its
//!   buffer: read data is never copied into a send buffer. A batch is
//!   first offered to the socket with a non-blocking sendmsg at the end of
//!   the turn; only what the socket buffer cannot take goes to the ring,
//!   which sends it as room appears.
//! - Reads are not copied at all where the device can lend them: a READ
//!   that fits one bio allows it ([`udm_core::BioFlags::MAY_LEND`]); a RAM
//!   disk under linear or striped then points the bio at its own memory
//!   instead of copying into the request's buffer, and the reply's iovec
//!   points there too. Lent memory is valid until the reactor's pass over
//!   completions ends, so the worker settles every connection given lent
//!   data at that moment ([`udm_core::Reactor::at_pass_end`]): its replies
//!   go out in one sendmsg, and whatever the socket does not take (or a
//!   reply queued behind a send in flight) is copied into the request's
//!   buffer: nothing refers to lent memory later.
//! - `req`: requests live in a slab and are named by key; their buffers
//!   are recycled, so steady state allocates nothing per request.
//! - `tls`: after STARTTLS, the same paths through rustls: plaintext is
//!   decrypted into the receive buffer (or a WRITE's buffer), replies are
//!   encrypted from their requests' buffers into full 16 KiB records, and
//!   the ring only waits for the socket to be readable or writable.
//! - A connection is freed only by the [`Worker`]'s poller, once no recv,
//!   send or request refers to it.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;

use std::sync::Arc;

use udm_core::{BlockDevice, Extent, RingOp};

use crate::front::{self, Front};

use super::handshake::{Handshake, TlsMode};
use super::proto::{self, TxParams};

mod recv;
mod req;
mod send;
mod tls;
mod worker;

use req::{ReqId, Reqs};
pub use worker::{Worker, STOP_GRACE};

/// Receive buffer per connection: holds request headers, small payloads and
/// whole handshake options.
const RBUF_LEN: usize = 64 * 1024;
const _: () = assert!(RBUF_LEN > super::handshake::MAX_OPTION_DATA + proto::OPTION_HEADER_LEN);
/// Requests in flight per connection before the server stops reading.
const MAX_REQS: usize = 512;
/// READ/WRITE bytes in flight per connection before the server stops reading.
const MAX_INFLIGHT_BYTES: u64 = 128 << 20;
/// `base:allocation` descriptors per BLOCK_STATUS reply at most (8 KiB of
/// them): a client asking about a larger or more fragmented range gets a
/// prefix and asks again from its end, as the spec allows.
const MAX_DESCRIPTORS: usize = udm_core::BLOCK_STATUS_MAX_EXTENTS;
/// iovecs per sendmsg (IOV_MAX).
const MAX_IOV: usize = 1024;

/// Starts serving the accepted socket `fd` on `worker`'s reactor: sends the
/// greeting and waits for the client's flags.
pub fn start(worker: &Rc<Worker>, fd: OwnedFd, peer: String, id: u64) {
    let conn = Box::new(Conn {
        recv_op: ConnOp::new(recv_complete),
        send_op: ConnOp::new(send_complete),
        worker: worker.clone(),
        id,
        peer,
        fd,
        rbuf: vec![0u8; RBUF_LEN].into_boxed_slice(),
        rstart: 0,
        rend: 0,
        recv_inflight: false,
        payload: None,
        hs: Some(Box::new(Handshake::with_tls(
            worker
                .shared
                .tls
                .as_ref()
                .map_or(TlsMode::Off, |t| t.options().mode),
        ))),
        hs_out: Vec::new(),
        hs_sending: Vec::new(),
        tx: None,
        reqs: Reqs::default(),
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
        skip_req: None,
        disc: false,
        closing: None,
        write_dead: false,
        in_dirty: false,
        lent_held: false,
        blocked: false,
        stats: Stats::default(),
        export: None,
        admitted: None,
        extents: Vec::new(),
        descriptors: Vec::new(),
        tls: None,
        tls_grant: 0,
        ktls: false,
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
        worker.handshake_started(id);
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

impl ConnOp {
    fn new(complete: fn(*mut RingOp, i32, u32)) -> ConnOp {
        ConnOp {
            op: RingOp { complete },
            conn: std::ptr::null_mut(),
        }
    }
}

/// What the transmission phase needs, fixed at GO/EXPORT_NAME.
struct Tx {
    /// The export's device (asked for BLOCK_STATUS).
    dev: Arc<dyn BlockDevice>,
    /// The connection's front to the export's device.
    front: Rc<Front>,
    params: TxParams,
    structured: bool,
}

/// Counters for the connection's closing log line.
#[derive(Default)]
struct Stats {
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
    /// The WRITE whose payload the pending recv lands in (None: the recv
    /// lands in `rbuf`).
    payload: Option<ReqId>,
    hs: Option<Box<Handshake>>,
    hs_out: Vec<u8>,
    hs_sending: Vec<u8>,
    tx: Option<Tx>,
    reqs: Reqs,
    inflight_bytes: u64,
    /// Replied requests waiting for the next sendmsg.
    ready: VecDeque<ReqId>,
    /// The requests of the sendmsg in flight (or being offered).
    sending: Vec<ReqId>,
    iov: Vec<libc::iovec>,
    iov_at: usize,
    /// The batch's iovecs that point at lent memory, with their requests.
    lent_iovs: Vec<(usize, ReqId)>,
    msg: libc::msghdr,
    send_inflight: bool,
    /// Payload bytes of a refused WRITE still to be read and dropped.
    skip: u64,
    /// The refused WRITE whose payload is being skipped.
    skip_req: Option<ReqId>,
    disc: bool,
    closing: Option<String>,
    write_dead: bool,
    in_dirty: bool,
    /// On the worker's list of connections given lent data this pass.
    lent_held: bool,
    blocked: bool,
    stats: Stats,
    export: Option<String>,
    /// The export whose connection count this connection is in.
    admitted: Option<usize>,
    /// BLOCK_STATUS scratch: the device's extents and the descriptors made
    /// of them (kept, so that answering allocates nothing in steady state).
    extents: Vec<Extent>,
    descriptors: Vec<(u32, u32)>,
    /// The TLS session, from STARTTLS on.
    tls: Option<Box<tls::TlsConn>>,
    /// The socket carries TLS records itself (kernel TLS): the connection
    /// runs the plaintext paths.
    ktls: bool,
    /// Bytes of the in-flight budget held for the TLS buffers.
    tls_grant: u64,
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
    if c.tls.is_some() {
        // A poll for readability: rustls reads the socket itself.
        c.on_readable(res);
    } else {
        c.on_recv(res);
    }
    c.dirty();
}

fn send_complete(op: *mut RingOp, res: i32, _flags: u32) {
    // SAFETY: as in recv_complete, for send_op.
    let p = unsafe { (*(op as *mut ConnOp)).conn };
    // SAFETY: as in recv_complete.
    let c = unsafe { &mut *p };
    c.send_inflight = false;
    if c.tls_sending() {
        // A poll for writability: rustls writes the socket itself.
        c.on_writable(res);
    } else {
        c.on_sent(res);
    }
    c.dirty();
}

/// The front's completion of a request: `ctx` is the connection, the
/// token the request's key.
fn req_done(ctx: *mut (), done: front::Done<'_>) {
    // SAFETY: ctx is the connection that submitted the request, live: a
    // connection is not freed while it has active requests, and a request
    // the front holds is active. The front calls this from a bio's end_io,
    // when no other reference to the connection is live.
    let c = unsafe { &mut *ctx.cast::<Conn>() };
    let id = done.token as ReqId;
    c.reqs[id].result = done.result;
    // Lent memory is valid until the pass over completions ends
    // (BioFlags::MAY_LEND's contract): the worker settles the reply then.
    match done.lent {
        Some(lent) if done.result.is_ok() => c.hold_lent(id, lent.as_ptr()),
        _ => c.reply(id),
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
        let s = &self.stats;
        tracing::info!(
            "{}: export '{}': {} requests ({} refused); sends: {} direct, {} on the ring; \
             lent reads: {} ({} copied); closed: {}",
            self.tag(),
            export,
            s.requests,
            s.refused,
            s.sends_direct,
            s.sends_ring,
            s.lent,
            s.lent_copied,
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

    /// Closes at once: the socket is shut both ways, replies not yet sent
    /// are dropped (for a client that neither finished its handshake nor
    /// reads).
    fn abort(&mut self, why: String) {
        self.begin_close(why);
        self.write_dead = true;
        // SAFETY: plain syscall on our own socket; wakes a pending recv/send.
        unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
        self.dirty();
    }

    fn freeable(&self) -> bool {
        self.closing.is_some()
            && !self.recv_inflight
            && !self.send_inflight
            && self.reqs.active() == 0
            && ((self.hs_out.is_empty() && self.tls_drained()) || self.write_dead)
    }

    /// Ends request `id`: its bytes leave the in-flight budget.
    fn recycle(&mut self, id: ReqId) {
        let n = self.reqs.recycle(id);
        self.ungrant(n);
    }

    /// Gives `n` bytes of the connection's in-flight buffers back.
    fn ungrant(&mut self, n: u64) {
        if n > 0 {
            self.worker.shared.pool.budget.give(self.inflight_bytes, n);
            self.inflight_bytes -= n;
        }
    }
}
