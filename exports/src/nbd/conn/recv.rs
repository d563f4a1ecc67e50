//! The receive path of a connection: one recv in flight, the handshake fed
//! from the receive buffer, request headers validated and their payloads
//! received, and each request handed to the export front.

use std::os::fd::AsRawFd;

use udm_core::io_uring::{opcode, types};
use udm_core::{RingOp, SECTOR_SHIFT, SECTOR_SIZE};

use crate::front::{self, Front, FrontOp, ReqFlags, Submitted};

use super::super::handshake::{Admit, Negotiated, Outcome};
use super::super::proto::{self, Command, Request, TxParams};
use super::super::tls::TLS_BUFFERS;
use super::req::ReqId;
use super::{
    errno_str, req_done, Conn, Tx, MAX_DESCRIPTORS, MAX_INFLIGHT_BYTES, MAX_REQS, RBUF_LEN,
};

impl Conn {
    /// Where the next received bytes go: the receive buffer's free end
    /// (compacted first), or the rest of the payload of the WRITE being
    /// received. None (and the connection closing) when the receive buffer
    /// is full, which only a protocol error leads to.
    pub(super) fn recv_target(&mut self) -> Option<(*mut u8, usize, i32)> {
        match self.payload {
            None => {
                if self.rstart > 0 {
                    self.rbuf.copy_within(self.rstart..self.rend, 0);
                    self.rend -= self.rstart;
                    self.rstart = 0;
                }
                let len = RBUF_LEN - self.rend;
                if len == 0 {
                    self.begin_close("protocol error: receive buffer full".into());
                    return None;
                }
                // SAFETY: rend <= RBUF_LEN, so the pointer is inside or one
                // past rbuf.
                Some((unsafe { self.rbuf.as_mut_ptr().add(self.rend) }, len, 0))
            }
            Some(id) => {
                let r = &mut self.reqs[id];
                let left = r.len as usize - r.received;
                // SAFETY: received < len, and the buffer holds len bytes
                // (data_for in `request`).
                Some((unsafe { r.data().add(r.received) }, left, libc::MSG_WAITALL))
            }
        }
    }

    /// Posts the connection's recv, unless one is in flight or reading
    /// stopped (closing, blocked on limits, or after NBD_CMD_DISC).
    pub(super) fn arm_recv(&mut self) {
        if self.recv_inflight || self.closing.is_some() || self.blocked || self.disc {
            return;
        }
        if self.tls.is_some() {
            self.tls_recv();
            return;
        }
        let Some((ptr, len, flags)) = self.recv_target() else {
            return;
        };
        let e = opcode::Recv::new(types::Fd(self.fd.as_raw_fd()), ptr, len as u32)
            .flags(flags)
            .build();
        self.recv_inflight = true;
        let op: *mut RingOp = &mut self.recv_op.op;
        // SAFETY: the recv writes into rbuf or the payload request's data
        // buffer: both are heap memory of this connection, which is freed
        // only after this recv completes (freeable() needs !recv_inflight),
        // and neither is touched until then (rbuf is only read and
        // compacted in on_recv; the payload request is not recycled while
        // it is `payload`, and its buffer is not resized).
        unsafe { self.worker.reactor().ring().push_op(e, op) };
    }

    pub(super) fn on_recv(&mut self, res: i32) {
        if res <= 0 {
            let mut why = if res == 0 {
                "client closed the connection".to_string()
            } else if res == -libc::EIO && self.ktls {
                // Kernel TLS hands a record that is not data to a recv
                // without room for its type as EIO.
                "TLS: the client sent an alert (close_notify) or a key update".to_string()
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
            // submitted, so it goes now (else it stays active and the
            // connection is never freed, hanging a stop).
            self.drop_partial();
            return;
        }
        let n = res as usize;
        if let Some(id) = self.payload {
            let req = &mut self.reqs[id];
            req.received += n;
            if req.received < req.len as usize {
                self.arm_recv();
                return;
            }
            self.payload = None;
            self.submit(id);
        } else {
            self.rend += n;
        }
        self.process();
        self.unplug();
        self.arm_recv();
    }

    /// The requests of one receive are all in: the front submits what it
    /// holds (queued dispatch; nothing in direct).
    fn unplug(&self) {
        if let Some(tx) = self.tx.as_ref() {
            tx.front.unplug();
        }
    }

    /// Releases a WRITE whose payload was still arriving (or a refused one
    /// whose payload was being skipped). Returns whether there was one.
    pub(super) fn drop_partial(&mut self) -> bool {
        if let Some(id) = self.payload.take() {
            self.recycle(id);
            true
        } else if let Some(id) = self.skip_req.take() {
            self.skip = 0;
            self.recycle(id);
            true
        } else {
            false
        }
    }

    /// Parses whatever complete messages the receive buffer holds.
    fn process(&mut self) {
        loop {
            if self.closing.is_some() || self.disc || self.payload.is_some() {
                return;
            }
            if let Some(hs) = self.hs.as_mut() {
                let counts = &self.worker.shared.counts;
                let budget = &self.worker.shared.pool.budget;
                let held = self.inflight_bytes;
                let mut admitted = None;
                let mut tls_grant = 0;
                let (n, outcome) = hs.feed_admitting(
                    &self.rbuf[self.rstart..self.rend],
                    &self.worker.infos,
                    &mut |a| match a {
                        Admit::Export(i) => {
                            let ok = counts.admit(i);
                            if ok {
                                admitted = Some(i);
                            }
                            ok
                        }
                        Admit::Tls => {
                            let ok = budget.take(held, TLS_BUFFERS);
                            if ok {
                                tls_grant = TLS_BUFFERS;
                            }
                            ok
                        }
                    },
                    &mut self.hs_out,
                );
                if admitted.is_some() {
                    self.admitted = admitted;
                }
                self.inflight_bytes += tls_grant;
                self.tls_grant += tls_grant;
                self.rstart += n;
                match outcome {
                    Outcome::Continue => return,
                    Outcome::StartTls => {
                        if let Err(why) = self.start_tls() {
                            self.hs = None;
                            self.begin_close(format!("handshake: {why}"));
                            return;
                        }
                        continue;
                    }
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
                if let Some(id) = self.skip_req.take() {
                    self.reply(id);
                }
                continue;
            }
            if avail < proto::REQUEST_LEN {
                return;
            }
            if self.reqs.active() >= MAX_REQS || self.inflight_bytes >= MAX_INFLIGHT_BYTES {
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
            // READ and WRITE buffers come from the server-wide budget: with
            // no room, the header stays unread (and the connection stops
            // reading) until replies drain or the budget has room.
            let grant = match hdr.cmd {
                proto::CMD_READ | proto::CMD_WRITE => hdr.len as u64,
                // The reply's descriptors, at most this many bytes.
                proto::CMD_BLOCK_STATUS => (MAX_DESCRIPTORS * proto::DESCRIPTOR_LEN) as u64,
                _ => 0,
            };
            if grant > 0 {
                if !self
                    .worker
                    .shared
                    .pool
                    .budget
                    .take(self.inflight_bytes, grant)
                {
                    self.blocked = true;
                    self.worker.wait_budget();
                    return;
                }
                self.inflight_bytes += grant;
            }
            self.rstart += proto::REQUEST_LEN;
            self.request(hdr, grant);
        }
    }

    /// Resumes reading once requests in flight fell below the limits.
    pub(super) fn unblock(&mut self) {
        if self.blocked
            && self.reqs.active() < MAX_REQS
            && self.inflight_bytes < MAX_INFLIGHT_BYTES
            && self.closing.is_none()
        {
            self.blocked = false;
            self.process();
            self.unplug();
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
        front.set_report(e.auto.clone());
        front.set_dispatch(e.dispatch);
        front.set_budget(self.worker.shared.pool.budget.clone());
        self.export = Some(e.info.name.clone());
        self.worker.handshake_done(self.id);
        self.tx = Some(Tx {
            dev: e.dev.clone(),
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

    /// Handles one request header (the payload, if any, follows in rbuf).
    /// `grant`: bytes of the budget taken for it, which its request counts
    /// (or which go back at once when it makes none).
    fn request(&mut self, h: Request, grant: u64) {
        self.stats.requests += 1;
        let Some(tx) = self.tx.as_ref() else {
            self.ungrant(grant);
            return;
        };
        let cmd = match proto::validate(&h, &tx.params) {
            Ok(c) => c,
            Err(refusal) => {
                self.stats.refused += 1;
                tracing::warn!(
                    "{}: refused command {} (flags {:#x}, offset {}, length {}): {}",
                    self.tag(),
                    h.cmd,
                    h.flags,
                    h.offset,
                    h.len,
                    refusal.msg
                );
                let id = self.reqs.alloc(&h, Command::Cache);
                self.reqs[id].refusal = Some(refusal);
                self.reqs[id].counted = grant;
                if h.payload_len() > 0 {
                    // Read and drop the payload, then reply: the client
                    // stays in step and no memory is spent on it.
                    self.skip = h.payload_len() as u64;
                    self.skip_req = Some(id);
                } else {
                    self.reply(id);
                }
                return;
            }
        };
        if cmd == Command::Disc {
            // No reply; in-flight requests still finish and are answered.
            self.disc = true;
            self.ungrant(grant);
            self.begin_close("client disconnected (NBD_CMD_DISC)".into());
            return;
        }
        let id = self.reqs.alloc(&h, cmd);
        let req = &mut self.reqs[id];
        req.counted = grant;
        if let Command::Read | Command::Write { .. } = cmd {
            let buf = req.data_for(h.len as usize);
            if let Command::Write { .. } = cmd {
                let avail = self.rend - self.rstart;
                let n = avail.min(h.len as usize);
                // SAFETY: the buffer holds len >= n bytes (data_for), rbuf
                // holds `avail` >= n bytes from rstart; distinct allocations.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.rbuf.as_ptr().add(self.rstart), buf, n)
                };
                self.rstart += n;
                req.received = n;
                if n < h.len as usize {
                    // The rest of the payload goes straight into the buffer.
                    self.payload = Some(id);
                    return;
                }
            }
        }
        match cmd {
            Command::Cache => self.reply(id),
            Command::BlockStatus { req_one } => {
                self.block_status(id, req_one);
                self.reply(id);
            }
            _ => self.submit(id),
        }
    }

    /// Answers a BLOCK_STATUS from the device, here on the reactor: a
    /// device's answer is bounded work (a bitmap walk, a table walk, a few
    /// `lseek`s; one whose answer takes a network round trip reports data
    /// without asking), and the reply at most [`MAX_DESCRIPTORS`]
    /// descriptors, a prefix of the range that the client asks again past.
    /// A device error is logged and the range reported as data, which the
    /// spec allows for an error that is not the client's. Encodes the
    /// descriptors into the request's data buffer for `reply`.
    fn block_status(&mut self, id: ReqId, req_one: bool) {
        let Some(tx) = self.tx.as_ref() else { return };
        let (offset, len) = (self.reqs[id].offset, self.reqs[id].len);
        if len == 0 {
            return; // reply() refuses it (EINVAL)
        }
        // Inside the export (validated), so inside the device.
        let first = offset >> SECTOR_SHIFT;
        let end = (offset + len as u64).div_ceil(SECTOR_SIZE);
        self.extents.clear();
        if let Err(e) = tx.dev.block_status(first, end - first, &mut self.extents) {
            tracing::warn!(
                "{}: block status of {len} bytes at {offset}: {e}; reporting data",
                self.tag()
            );
            self.extents.clear();
        }
        let max = if req_one { 1 } else { MAX_DESCRIPTORS };
        proto::allocation_descriptors(offset, len, &self.extents, max, &mut self.descriptors);
        let n = self.descriptors.len();
        let req = &mut self.reqs[id];
        let buf = req.data_for(n * proto::DESCRIPTOR_LEN);
        // SAFETY: data_for made the buffer hold at least n descriptors; it
        // is the request's own and nothing else uses it before the reply.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buf, n * proto::DESCRIPTOR_LEN) };
        for (d, &(len, flags)) in bytes
            .chunks_exact_mut(proto::DESCRIPTOR_LEN)
            .zip(&self.descriptors)
        {
            proto::put_descriptor(d, len, flags);
        }
        req.descriptors = n as u32;
    }

    /// Hands the request to the front.
    fn submit(&mut self, id: ReqId) {
        let conn: *mut Conn = self;
        let Some(tx) = self.tx.as_ref() else { return };
        let req = &mut self.reqs[id];
        let none = ReqFlags::default();
        let (op, flags) = match req.cmd {
            Command::Read => (
                FrontOp::Read,
                ReqFlags {
                    // Under TLS the reply is encrypted from the request's
                    // buffer whenever the socket has room: lent memory,
                    // valid only until the pass over completions ends,
                    // would not do.
                    may_lend: self.tls.is_none(),
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
                self.reply(id);
                return;
            }
        };
        let fr = front::Request {
            op,
            offset: req.offset,
            len: req.len,
            flags,
            buf: req.data(),
            buf_index: udm_core::Bio::NO_BUF,
            token: id as u64,
            done: req_done,
            ctx: conn.cast(),
        };
        // SAFETY: for reads and writes, the data buffer holds `len` bytes
        // (data_for in `request`), and the connection neither touches nor
        // resizes it until the request is recycled, after the front
        // finished it and the reply was sent. `ctx` is this connection,
        // which outlives the request (see req_done).
        match unsafe { tx.front.submit(fr) } {
            Submitted::Later => {}
            Submitted::Now(result) => {
                req.result = result;
                self.reply(id);
            }
        }
    }
}
