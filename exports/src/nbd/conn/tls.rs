//! A connection after STARTTLS: rustls between the socket and the NBD
//! paths.
//!
//! - Receive: the ring polls for readability; rustls reads the socket
//!   itself (no copy through a buffer of ours), decrypts each record in
//!   place, and its plaintext is read straight into where the plain path
//!   would have received it: the receive buffer, or the rest of a WRITE's
//!   payload in the request's buffer.
//! - Send: the replies queued at the end of a turn are handed to rustls
//!   in one vectored write, header and data slices pointing at each
//!   request's buffers, so that records are full (16 KiB) across replies;
//!   encrypting is the only pass over the data. rustls writes the records
//!   to the socket; when the socket is full the ring polls for room. At
//!   most [`TLS_OUT_LIMIT`] bytes of records wait for the socket: beyond
//!   it replies wait in their requests' buffers, still unencrypted.
//! - The STARTTLS ACK is the last plaintext: records go out only once it
//!   has left.
//! - A close after the last reply sends TLS's close_notify; a failed
//!   handshake sends rustls's alert (what the client prints) and closes.
//! - Kernel TLS: where the server has it ([`Tls::ktls`]), the handshake's
//!   reads stop at each record's end, so that when the handshake is over
//!   rustls holds no byte of a later record. The connection then gives its
//!   keys to the socket ([`ktls_install`]) and drops rustls: from there on
//!   it is a plaintext connection whose socket encrypts and decrypts, with
//!   the plaintext paths' properties (reads lent from the device, payloads
//!   received straight into their buffers).
//!
//! [`Tls::ktls`]: super::super::tls::Tls::ktls

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};

use udm_core::io_uring::{opcode, types};
use udm_core::RingOp;

use super::super::tls::{ktls_install, subject_name, TLS_OUT_LIMIT};
use super::{errno_str, Conn};

/// The TLS state of a connection.
pub(super) struct TlsConn {
    sess: rustls::ServerConnection,
    /// The STARTTLS ACK has left in plaintext: records may follow.
    started: bool,
    /// The handshake finished (and was logged).
    established: bool,
    /// close_notify (or a fatal alert) was queued.
    close_sent: bool,
    /// `tls_recv` is running (plaintext it delivers re-enters `arm_recv`).
    recv_busy: bool,
    /// Bytes of the reply at the head of `ready` already encrypted.
    head_off: usize,
    /// Where the client's stream is within its records, while the
    /// connection may still hand its record layer to the kernel.
    records: Option<Records>,
    /// The handshake is over and the kernel takes the records once the
    /// last of rustls's have left.
    handoff: bool,
}

/// Where a byte stream is within its TLS records (5-byte header, then the
/// body of the length the header gives).
#[derive(Default)]
struct Records {
    hdr: [u8; 5],
    hdr_len: usize,
    body_left: usize,
}

impl Records {
    /// Bytes up to the end of the current header or body.
    fn limit(&self) -> usize {
        if self.body_left > 0 {
            self.body_left
        } else {
            self.hdr.len() - self.hdr_len
        }
    }

    /// `bytes` went past.
    fn advance(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.body_left > 0 {
                let n = self.body_left.min(bytes.len());
                self.body_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (self.hdr.len() - self.hdr_len).min(bytes.len());
            self.hdr[self.hdr_len..self.hdr_len + n].copy_from_slice(&bytes[..n]);
            self.hdr_len += n;
            bytes = &bytes[n..];
            if self.hdr_len == self.hdr.len() {
                self.hdr_len = 0;
                self.body_left = u16::from_be_bytes([self.hdr[3], self.hdr[4]]) as usize;
            }
        }
    }

    /// The stream is between records.
    fn at_boundary(&self) -> bool {
        self.hdr_len == 0 && self.body_left == 0
    }
}

/// The socket, for rustls's reads and writes: never blocking (the ring
/// waits for readiness instead), never raising SIGPIPE. With `records`,
/// reads stop at the end of each record.
struct Sock<'a>(RawFd, Option<&'a mut Records>);

impl Read for Sock<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let len = match &self.1 {
            Some(r) => buf.len().min(r.limit()),
            None => buf.len(),
        };
        // SAFETY: recv into a live buffer of at least `len` bytes, on a
        // socket the connection keeps open.
        let n = unsafe { libc::recv(self.0, buf.as_mut_ptr().cast(), len, libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if let Some(r) = self.1.as_deref_mut() {
            r.advance(&buf[..n as usize]);
        }
        Ok(n as usize)
    }
}

impl Write for Sock<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is guaranteed ABI-compatible with iovec on unix.
        msg.msg_iov = bufs.as_ptr().cast_mut().cast();
        msg.msg_iovlen = bufs.len();
        // SAFETY: msg names the caller's live slices, which the kernel only
        // reads, before the call returns.
        let n = unsafe { libc::sendmsg(self.0, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
    )
}

impl Conn {
    /// STARTTLS was acknowledged: the session starts with the credentials
    /// in force now. Bytes the client sent after STARTTLS without waiting
    /// for the ACK are its first records.
    pub(super) fn start_tls(&mut self) -> Result<(), String> {
        let Some(tls) = self.worker.shared.tls.clone() else {
            return Err("STARTTLS on a server without TLS".into());
        };
        let mut sess =
            rustls::ServerConnection::new(tls.config()).map_err(|e| format!("TLS: {e}"))?;
        sess.set_buffer_limit(Some(TLS_OUT_LIMIT));
        let mut records = tls.ktls().then(Records::default);
        if self.rstart < self.rend {
            if let Some(r) = records.as_mut() {
                r.advance(&self.rbuf[self.rstart..self.rend]);
            }
            let mut early = &self.rbuf[self.rstart..self.rend];
            while !early.is_empty() {
                match sess.read_tls(&mut early) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => return Err(format!("TLS: {e}")),
                }
            }
            self.rstart = self.rend;
            sess.process_new_packets()
                .map_err(|e| format!("TLS: {e}"))?;
        }
        self.tls = Some(Box::new(TlsConn {
            sess,
            started: false,
            established: false,
            close_sent: false,
            recv_busy: false,
            head_off: 0,
            records,
            handoff: false,
        }));
        Ok(())
    }

    /// Whether the send op in flight (or the next) is a poll for room
    /// (records) rather than a plaintext sendmsg.
    pub(super) fn tls_sending(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.started)
    }

    /// No records wait for the socket.
    pub(super) fn tls_drained(&self) -> bool {
        self.tls.as_ref().is_none_or(|t| !t.sess.wants_write())
    }

    /// The connection is being freed: its TLS buffers leave the budget.
    pub(super) fn release_tls(&mut self) {
        let g = std::mem::take(&mut self.tls_grant);
        self.ungrant(g);
    }

    /// Whether sends go through TLS now; flips (once) when the plaintext
    /// before it, the STARTTLS ACK last, has left.
    pub(super) fn tls_out(&mut self) -> bool {
        let plain_left = !self.hs_out.is_empty();
        match self.tls.as_deref_mut() {
            None => false,
            Some(t) if t.started => true,
            Some(t) if !plain_left => {
                t.started = true;
                true
            }
            Some(_) => false,
        }
    }

    /// Delivers plaintext to the receive path until rustls has none and
    /// the socket nothing more, then polls for readability.
    pub(super) fn tls_recv(&mut self) {
        match self.tls.as_deref_mut() {
            Some(t) if !t.recv_busy => t.recv_busy = true,
            _ => return,
        }
        self.tls_recv_loop();
        if let Some(t) = self.tls.as_deref_mut() {
            t.recv_busy = false;
        }
    }

    fn tls_recv_loop(&mut self) {
        let fd = self.fd.as_raw_fd();
        loop {
            if self.recv_inflight || self.closing.is_some() || self.blocked || self.disc {
                return;
            }
            let Some((ptr, len, _)) = self.recv_target() else {
                return;
            };
            let Some(t) = self.tls.as_deref_mut() else {
                return;
            };
            // SAFETY: recv_target names `len` bytes inside rbuf or the
            // payload request's buffer, which nothing else refers to now.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
            match t.sess.reader().read(dst) {
                // The client's close_notify.
                Ok(0) => {
                    self.on_recv(0);
                    return;
                }
                Ok(n) => {
                    self.on_recv(n as i32);
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    self.tls_failed(format!("TLS: {e}"));
                    return;
                }
            }
            if t.handoff {
                // flush_tls hands over once rustls's last records left.
                return;
            }
            // No plaintext left: records from the socket.
            match t.sess.read_tls(&mut Sock(fd, t.records.as_mut())) {
                Ok(0) => {
                    self.on_recv(0);
                    return;
                }
                Ok(_) => {
                    let plaintext = match t.sess.process_new_packets() {
                        Ok(st) => st.plaintext_bytes_to_read(),
                        Err(e) => {
                            self.tls_failed(format!("TLS: {e}"));
                            return;
                        }
                    };
                    if t.sess.wants_write() {
                        self.dirty();
                    }
                    self.tls_established();
                    if self.ktls_due(plaintext) {
                        return;
                    }
                }
                Err(e) if would_block(&e) => {
                    self.poll(libc::POLLIN, false);
                    return;
                }
                Err(e) => {
                    self.recv_failed(format!("recv: {e}"));
                    return;
                }
            }
        }
    }

    /// Logs the session once its handshake is over.
    fn tls_established(&mut self) {
        let Some(t) = self.tls.as_deref_mut() else {
            return;
        };
        if t.established || t.sess.is_handshaking() {
            return;
        }
        t.established = true;
        let version = t
            .sess
            .protocol_version()
            .map_or("?".into(), |v| format!("{v:?}"));
        let suite = t
            .sess
            .negotiated_cipher_suite()
            .map_or("?".into(), |s| format!("{:?}", s.suite()));
        let client = match t.sess.peer_certificates().and_then(|c| c.first()) {
            Some(c) => subject_name(c).unwrap_or_else(|e| e),
            None => "no client certificate".into(),
        };
        tracing::info!("{}: TLS {version} {suite} ({client})", self.tag());
    }

    /// Once the handshake is over, whether the kernel can take the record
    /// layer: the stream is between records and nothing rustls decrypted
    /// waits to be read. Decided once; returns whether the connection
    /// handed over now (and its receive path runs in plaintext).
    fn ktls_due(&mut self, plaintext: usize) -> bool {
        let ready = self.hs_out.is_empty() && self.ready.is_empty();
        let Some(t) = self.tls.as_deref_mut() else {
            return false;
        };
        let Some(r) = t.records.as_ref() else {
            return false;
        };
        if t.sess.is_handshaking() {
            return false;
        }
        if !(r.at_boundary() && plaintext == 0 && ready) {
            t.records = None;
            tracing::info!(
                "{}: TLS records stay in userspace (data arrived with the handshake's end)",
                self.tag()
            );
            return false;
        }
        t.handoff = true;
        if t.sess.wants_write() || self.send_inflight {
            self.dirty();
            return false;
        }
        self.ktls_handoff();
        true
    }

    /// Gives the session's keys to the socket and drops rustls; the
    /// connection goes on as a plaintext one. On failure it closes: the
    /// keys have left rustls.
    fn ktls_handoff(&mut self) {
        let Some(t) = self.tls.take() else {
            return;
        };
        let fd = self.fd.as_raw_fd();
        let TlsConn { sess, .. } = *t;
        let r = match sess.protocol_version() {
            Some(v) => sess
                .dangerous_extract_secrets()
                .map_err(|e| e.to_string())
                .and_then(|s| ktls_install(fd, v, s)),
            None => Err("no protocol version".into()),
        };
        self.release_tls();
        match r {
            Ok(()) => {
                self.ktls = true;
                tracing::info!("{}: TLS records in the kernel (kTLS)", self.tag());
                self.arm_recv();
            }
            Err(why) => self.abort(format!("kernel TLS: {why}")),
        }
    }

    /// The session failed (a bad record, a certificate refused): rustls's
    /// alert goes out, then the connection closes.
    fn tls_failed(&mut self, why: String) {
        tracing::warn!("{}: {why}", self.tag());
        if let Some(t) = self.tls.as_deref_mut() {
            t.close_sent = true;
        }
        self.recv_failed(why);
        self.dirty();
    }

    /// Reading ended: a payload half received is dropped, the connection
    /// closes.
    fn recv_failed(&mut self, why: String) {
        self.drop_partial();
        self.begin_close(why);
    }

    /// The ring's poll for readability completed.
    pub(super) fn on_readable(&mut self, res: i32) {
        if self.closing.is_some() {
            self.drop_partial();
            return;
        }
        if res < 0 {
            self.recv_failed(format!("poll: {}", errno_str(res)));
            return;
        }
        self.arm_recv();
    }

    /// The ring's poll for room completed (the flush at the end of the turn
    /// writes).
    pub(super) fn on_writable(&mut self, res: i32) {
        if res < 0 {
            self.send_failed(format!("poll: {}", errno_str(res)));
        }
    }

    /// Polls the socket for `events` on the ring: with the recv op
    /// (readable) or the send op (`out`: writable).
    fn poll(&mut self, events: i16, out: bool) {
        let e = opcode::PollAdd::new(types::Fd(self.fd.as_raw_fd()), events as u32).build();
        let op: *mut RingOp = if out {
            self.send_inflight = true;
            self.stats.sends_ring += 1;
            &mut self.send_op.op
        } else {
            self.recv_inflight = true;
            &mut self.recv_op.op
        };
        // SAFETY: a poll touches no memory of ours; the op lives in the
        // connection, which is freed only once it completed (freeable()
        // needs !recv_inflight and !send_inflight).
        unsafe { self.worker.reactor().ring().push_op(e, op) };
    }

    /// Encrypts the handshake replies and the queued replies, writes the
    /// records while the socket takes them, and polls for room when it
    /// does not. Called when no poll for room is in flight.
    pub(super) fn flush_tls(&mut self) {
        let fd = self.fd.as_raw_fd();
        loop {
            // Plaintext into records, as much as the outgoing limit takes.
            let mut taken = 0;
            let mut finished = 0;
            let mut failed = None;
            {
                let Some(t) = self.tls.as_deref_mut() else {
                    return;
                };
                if !self.hs_out.is_empty() || !self.ready.is_empty() {
                    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(16);
                    let mut bytes = 0;
                    if !self.hs_out.is_empty() {
                        bytes += self.hs_out.len();
                        slices.push(IoSlice::new(&self.hs_out));
                    }
                    let mut skip = t.head_off;
                    for &id in &self.ready {
                        if bytes >= TLS_OUT_LIMIT || slices.len() + 2 > super::MAX_IOV {
                            break;
                        }
                        let req = &self.reqs[id];
                        debug_assert!(req.lent.is_null(), "no lending under TLS");
                        let parts = [&req.bufs.hdr[..req.hdr_len], &req.bufs.data[..req.data_len]];
                        for p in parts {
                            let s = skip.min(p.len());
                            skip -= s;
                            if s < p.len() {
                                bytes += p.len() - s;
                                slices.push(IoSlice::new(&p[s..]));
                            }
                        }
                    }
                    let r = t.sess.writer().write_vectored(&slices);
                    drop(slices);
                    match r {
                        Ok(n) => taken = n,
                        Err(e) => failed = Some(format!("TLS: {e}")),
                    }
                    // Account for what was taken: handshake bytes first,
                    // then replies from the head.
                    let mut left = taken;
                    let hs = left.min(self.hs_out.len());
                    self.hs_out.drain(..hs);
                    left -= hs;
                    let mut off = t.head_off + left;
                    for &id in &self.ready {
                        let req = &self.reqs[id];
                        let whole = req.hdr_len + req.data_len;
                        if off < whole {
                            break;
                        }
                        off -= whole;
                        finished += 1;
                    }
                    t.head_off = off;
                }
            }
            if let Some(why) = failed {
                self.send_failed(why);
                return;
            }
            for _ in 0..finished {
                if let Some(id) = self.ready.pop_front() {
                    self.recycle(id);
                }
            }
            // After the last reply of a closing connection: close_notify.
            if self.closing.is_some()
                && self.hs_out.is_empty()
                && self.ready.is_empty()
                && self.reqs.active() == 0
            {
                if let Some(t) = self.tls.as_deref_mut() {
                    if !t.close_sent && !t.sess.is_handshaking() {
                        t.close_sent = true;
                        t.sess.send_close_notify();
                    }
                }
            }
            // Records to the socket.
            let Some(t) = self.tls.as_deref_mut() else {
                return;
            };
            let mut wrote = false;
            while t.sess.wants_write() {
                match t.sess.write_tls(&mut Sock(fd, None)) {
                    Ok(0) => {
                        self.send_failed("send: no progress".into());
                        return;
                    }
                    Ok(_) => {
                        wrote = true;
                        self.stats.sends_direct += 1;
                    }
                    Err(e) if would_block(&e) => {
                        self.poll(libc::POLLOUT, true);
                        return;
                    }
                    Err(e) => {
                        self.send_failed(format!("send: {e}"));
                        return;
                    }
                }
            }
            if t.handoff {
                self.ktls_handoff();
                return;
            }
            let more = !self.hs_out.is_empty() || !self.ready.is_empty();
            // Done, or nothing moved (plaintext waits for the handshake).
            if !more || (taken == 0 && !wrote) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Records;

    /// A record: header (type 23, TLS 1.2 on the wire) and `len` bytes.
    fn record(len: usize) -> Vec<u8> {
        let mut r = vec![23, 3, 3, (len >> 8) as u8, len as u8];
        r.resize(5 + len, 0xab);
        r
    }

    #[test]
    fn reads_stop_at_each_header_and_body_end() {
        let mut r = Records::default();
        assert!(r.at_boundary());
        assert_eq!(r.limit(), 5);
        let rec = record(300);
        r.advance(&rec[..3]);
        assert!(!r.at_boundary());
        assert_eq!(r.limit(), 2, "the rest of the header");
        r.advance(&rec[3..5]);
        assert_eq!(r.limit(), 300, "the body");
        r.advance(&rec[5..100]);
        assert_eq!(r.limit(), 205);
        r.advance(&rec[100..]);
        assert!(r.at_boundary());
    }

    #[test]
    fn many_records_in_one_slice_are_followed_through() {
        let mut r = Records::default();
        let mut bytes = record(0);
        bytes.extend(record(16384 + 256));
        bytes.extend(record(7));
        r.advance(&bytes);
        assert!(r.at_boundary());
        bytes.extend(record(9));
        let mut r = Records::default();
        r.advance(&bytes[..bytes.len() - 1]);
        assert!(!r.at_boundary());
        assert_eq!(r.limit(), 1);
    }
}
