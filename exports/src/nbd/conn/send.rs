//! The send path of a connection: replies encoded into each request's
//! header, batched into one `sendmsg` of header and data iovecs, offered
//! to the socket directly first and to the ring for what it cannot take;
//! lent reads sent from their end_io.

use std::os::fd::AsRawFd;

use udm_core::io_uring::{opcode, types};

use super::super::proto::{self, Command};
use super::req::ReqId;
use super::{errno_str, Conn, MAX_IOV};
use crate::front::FrontError;
use udm_core::RingOp;

impl Conn {
    /// Encodes the request's reply and queues it for the next sendmsg.
    pub(super) fn reply(&mut self, id: ReqId) {
        let structured = self.tx.as_ref().is_some_and(|t| t.structured);
        let req = &self.reqs[id];
        let mut failure = req.refusal.map(|f| (f.error, f.msg));
        if let (None, Err(fe)) = (failure, req.result) {
            let e = match fe {
                FrontError::NotFast => proto::ENOTSUP,
                FrontError::NotSupported | FrontError::Invalid => proto::EINVAL,
                FrontError::NoSpace => proto::ENOSPC,
                FrontError::NoMemory => proto::ENOMEM,
                FrontError::Io => proto::EIO,
            };
            tracing::warn!(
                "{}: {:?} of {} bytes at {}: {}",
                self.tag(),
                req.cmd,
                req.len,
                req.offset,
                fe
            );
            failure = Some((e, "device error"));
        }
        if failure.is_none() && matches!(req.cmd, Command::BlockStatus { .. }) && req.len == 0 {
            failure = Some((proto::EINVAL, "zero-length block status"));
        }
        let req = &mut self.reqs[id];
        req.data_len = 0;
        let hdr = &mut req.bufs.hdr[..];
        req.hdr_len = match failure {
            Some((e, msg)) if structured => proto::encode_error_chunk(hdr, req.cookie, e, msg),
            Some((e, _)) => proto::encode_simple_reply(hdr, e, req.cookie),
            None => match req.cmd {
                Command::Read => {
                    req.data_len = req.len as usize;
                    if !structured {
                        proto::encode_simple_reply(hdr, 0, req.cookie)
                    } else if req.len == 0 {
                        proto::encode_none_chunk(hdr, req.cookie)
                    } else {
                        proto::encode_read_chunk(hdr, req.cookie, req.offset, req.len)
                    }
                }
                // The descriptors, encoded into the data buffer when the
                // request came (Conn::block_status), follow the header.
                Command::BlockStatus { .. } => {
                    req.data_len = req.descriptors as usize * proto::DESCRIPTOR_LEN;
                    proto::encode_block_status_header(
                        hdr,
                        req.cookie,
                        proto::META_BASE_ALLOCATION_ID,
                        req.descriptors,
                    )
                }
                _ => proto::encode_simple_reply(hdr, 0, req.cookie),
            },
        };
        self.ready.push_back(id);
        self.dirty();
    }

    /// Sends handshake bytes and queued replies in one sendmsg, unless one
    /// is in flight (its completion sends what queued up meanwhile).
    pub(super) fn flush_sends(&mut self) {
        if self.send_inflight {
            return;
        }
        if self.write_dead {
            self.hs_out.clear();
            while let Some(id) = self.ready.pop_front() {
                self.recycle(id);
            }
            return;
        }
        if self.tls_out() {
            self.flush_tls();
            return;
        }
        self.iov.clear();
        self.iov_at = 0;
        self.lent_iovs.clear();
        if !self.hs_out.is_empty() {
            std::mem::swap(&mut self.hs_out, &mut self.hs_sending);
            self.iov.push(libc::iovec {
                iov_base: self.hs_sending.as_mut_ptr().cast(),
                iov_len: self.hs_sending.len(),
            });
        }
        while self.iov.len() + 2 <= MAX_IOV {
            let Some(id) = self.ready.pop_front() else {
                break;
            };
            let req = &mut self.reqs[id];
            self.iov.push(libc::iovec {
                iov_base: req.hdr().cast(),
                iov_len: req.hdr_len,
            });
            if req.data_len > 0 {
                let data = if req.lent.is_null() {
                    req.data().cast_const()
                } else {
                    self.lent_iovs.push((self.iov.len(), id));
                    req.lent
                };
                self.iov.push(libc::iovec {
                    iov_base: data.cast_mut().cast(),
                    iov_len: req.data_len,
                });
            }
            self.sending.push(id);
        }
        if self.iov.is_empty() {
            return;
        }
        self.send_direct();
        if self.tls.is_some() && !self.send_inflight {
            // The STARTTLS ACK left: the session's records may follow.
            self.flush_sends();
        }
    }

    /// Offers the batch to the socket with a plain non-blocking sendmsg and
    /// hands only what it did not take to the ring. On an idle socket (QD1,
    /// and most batches) that is all of it: the reply leaves in this turn,
    /// with no SQE, no CQE and no second io_uring_enter to reap the send's
    /// completion before the reactor can sleep; the client is woken while
    /// the server goes straight to its wait. Ordering is kept because this
    /// runs only when no ring send is in flight (flush_sends' guard).
    pub(super) fn send_direct(&mut self) {
        self.point_msg();
        // SAFETY: msg names iov[iov_at..], whose buffers (hs_sending, the
        // headers and buffers of the `sending` requests, or memory lent for
        // a read, which is valid because a batch holds lent iovecs only
        // while settle_lent runs in that read's pass over completions) are
        // live; the kernel copies from them before the call returns.
        let n = unsafe {
            libc::sendmsg(
                self.fd.as_raw_fd(),
                &self.msg,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                // A full socket buffer (or a signal): the ring waits for room.
                Some(libc::EAGAIN) | Some(libc::EINTR) => self.push_send(),
                Some(e) => self.send_failed(format!("send: {}", errno_str(-e))),
                None => self.push_send(),
            }
            return;
        }
        self.stats.sends_direct += 1;
        // A partial send (the socket buffer filled up): the rest through
        // the ring, which sends it as room appears.
        if !self.advance_sent(n as usize) {
            self.push_send();
        }
    }

    /// Replies to a read whose data the device lent: queued like any
    /// reply, with its iovec to point at the lent memory, and this
    /// connection handed to the worker, which settles it when the pass
    /// over completions ends ([`Conn::settle_lent`]): the replies of one
    /// pass leave in one sendmsg, lent or not.
    pub(super) fn hold_lent(&mut self, id: ReqId, lent: *const u8) {
        self.stats.lent += 1;
        self.reqs[id].lent = lent;
        self.reply(id);
        if !self.lent_held {
            self.lent_held = true;
            let p: *mut Conn = self;
            super::Worker::hold_lent(&self.worker, p);
        }
    }

    /// At the end of the pass over completions, while lent memory is still
    /// valid: sends the queued replies, and copies into its request's
    /// buffer whatever still needs lent data afterwards (the part of the
    /// batch the socket did not take, which `push_send` copied already, and
    /// replies queued behind a send in flight or beyond the batch's
    /// iovecs), so that nothing refers to lent memory after the pass.
    pub(super) fn settle_lent(&mut self) {
        self.lent_held = false;
        self.flush_sends();
        for &id in &self.ready {
            let req = &mut self.reqs[id];
            if !req.lent.is_null() {
                // SAFETY: lent data of data_len bytes (valid until the pass
                // ends, which it has not) and the request's own buffer,
                // which holds len >= data_len bytes; distinct memory.
                unsafe { std::ptr::copy_nonoverlapping(req.lent, req.data(), req.data_len) };
                req.lent = std::ptr::null();
                self.stats.lent_copied += 1;
            }
        }
    }

    /// Before the rest of a batch goes to the ring, which sends it later:
    /// the unsent part of each lent reply is copied into its request's
    /// buffer, and its iovec points there.
    pub(super) fn unlend_rest(&mut self) {
        for &(i, id) in &self.lent_iovs {
            let req = &mut self.reqs[id];
            if i < self.iov_at {
                req.lent = std::ptr::null(); // sent whole
                continue;
            }
            let v = &mut self.iov[i];
            // Bytes of this reply already sent (advance_sent moves the base).
            let done = v.iov_base as usize - req.lent as usize;
            // SAFETY: [done, done + iov_len) lies in the reply's data_len
            // bytes, in the lent memory (valid: settle_lent runs in its pass)
            // and in the request's buffer alike; distinct memory.
            unsafe {
                let buf = req.data().add(done);
                std::ptr::copy_nonoverlapping(req.lent.add(done), buf, v.iov_len);
                v.iov_base = buf.cast();
            }
            req.lent = std::ptr::null();
            self.stats.lent_copied += 1;
        }
        self.lent_iovs.clear();
    }

    pub(super) fn point_msg(&mut self) {
        self.msg.msg_iov = self.iov[self.iov_at..].as_mut_ptr();
        self.msg.msg_iovlen = self.iov.len() - self.iov_at;
    }

    pub(super) fn push_send(&mut self) {
        // The ring sends later, after the pass whose lent memory this
        // batch may hold ended.
        self.unlend_rest();
        self.point_msg();
        self.stats.sends_ring += 1;
        // MSG_WAITALL: the ring retries a short send itself. Kernel TLS
        // refuses the flag (EOPNOTSUPP): there on_sent sends the rest.
        let flags = if self.ktls {
            libc::MSG_NOSIGNAL
        } else {
            libc::MSG_NOSIGNAL | libc::MSG_WAITALL
        };
        let e = opcode::SendMsg::new(types::Fd(self.fd.as_raw_fd()), &self.msg)
            .flags(flags as u32)
            .build();
        self.send_inflight = true;
        let op: *mut RingOp = &mut self.send_op.op;
        // SAFETY: the msghdr, the iovec array and every buffer it names
        // (hs_sending, the headers and data buffers of the requests in
        // `sending`, heap memory that a growing request slab does not move)
        // belong to this connection and are neither moved nor freed until
        // the send completes: the iov vector is only modified in
        // flush_sends/on_sent while no send is in flight, `sending` requests
        // are recycled after it, and the connection is not freed while
        // send_inflight. No iovec points at lent memory: unlend_rest above
        // repointed every one.
        unsafe { self.worker.reactor().ring().push_op(e, op) };
    }

    pub(super) fn on_sent(&mut self, res: i32) {
        if res <= 0 {
            self.send_failed(if res == 0 {
                "send: no progress".to_string()
            } else {
                format!("send: {}", errno_str(res))
            });
            return;
        }
        if !self.advance_sent(res as usize) {
            // A short send: the rest, from where it stopped.
            self.push_send();
        }
    }

    /// Accounts for `n` bytes of the batch sent. Returns true when the
    /// batch is done (its requests are recycled); otherwise the iovecs now
    /// start at the first byte not yet sent.
    pub(super) fn advance_sent(&mut self, n: usize) -> bool {
        let mut left = n;
        while left > 0 && self.iov_at < self.iov.len() {
            let v = &mut self.iov[self.iov_at];
            if left >= v.iov_len {
                left -= v.iov_len;
                self.iov_at += 1;
            } else {
                // SAFETY: left < iov_len: still inside the same buffer.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(left) }.cast();
                v.iov_len -= left;
                left = 0;
            }
        }
        if self.iov_at < self.iov.len() {
            return false;
        }
        self.hs_sending.clear();
        while let Some(id) = self.sending.pop() {
            self.recycle(id);
        }
        true
    }

    /// The socket can no longer be written: the batch is dropped and the
    /// connection closes.
    pub(super) fn send_failed(&mut self, why: String) {
        self.write_dead = true;
        self.hs_sending.clear();
        while let Some(id) = self.sending.pop() {
            self.recycle(id);
        }
        self.begin_close(why);
        // SAFETY: plain syscall on our own socket; wakes a pending recv.
        unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
    }
}
