//! What a process's exports grant their clients: a deadline for the
//! handshake, a cap on connections, and one memory budget for the request
//! buffers in flight, shared between connections and exports.
//!
//! The budget ([`Budget`]) has two parts. Half of it is divided equally
//! between the connections the server may hold (`max_connections`): each
//! connection is guaranteed that share, whatever the others do. The other
//! half is lent, first come, to connections that need more than their
//! share, and each borrower may take at most half of what the others leave
//! free, so that a few greedy connections never take all of it. A
//! connection that can get no space for its next request stops reading
//! until its own replies drain or the lent part has room again; it is never
//! closed for being slow.
//!
//! Bytes within a connection's share are counted on the connection only (no
//! shared state, no atomic): a client whose requests fit in its share, as a
//! QD1 client's do, touches the shared counter never.
//!
//! An export whose buffers are fixed for its lifetime (a ublk device's
//! per-tag buffers) reserves them from the lent part when it is added
//! ([`Budget::reserve`]): refused with an error naming the sizes if they
//! do not fit, and counted as lent for as long as the export lives, so
//! that connections borrow only what is left.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use udm_core::Error;

/// Default handshake deadline (QEMU's since CVE-2024-7409).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default server-wide connection cap.
pub const MAX_CONNECTIONS: usize = 1024;
/// Default budget for request buffers in flight, server-wide.
pub const MAX_INFLIGHT: u64 = 256 << 20;
/// Smallest budget accepted: its lent half must hold one request of the
/// largest payload advertised.
pub const MIN_INFLIGHT: u64 = 64 << 20;
/// Descriptors kept free for devices, the control socket and the server's
/// own files when the connection cap is fitted to RLIMIT_NOFILE.
pub const FD_RESERVE: u64 = 256;

/// The limits of one server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A connection not in transmission this long after accept is closed
    /// (None: no deadline).
    pub handshake_timeout: Option<Duration>,
    /// Connections open at once, server-wide (handshaking or not).
    pub max_connections: usize,
    /// Bytes of READ and WRITE buffers in flight, server-wide.
    pub max_inflight: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout: Some(HANDSHAKE_TIMEOUT),
            max_connections: MAX_CONNECTIONS,
            max_inflight: MAX_INFLIGHT,
        }
    }
}

impl Limits {
    /// Checks the values (one-line errors naming the flag).
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_connections == 0 {
            return Err(Error::invalid("--max-connections 0: expected at least 1"));
        }
        if self.max_inflight < MIN_INFLIGHT {
            return Err(Error::invalid(format!(
                "--max-inflight {}: expected at least {} MiB (two of the largest requests)",
                self.max_inflight,
                MIN_INFLIGHT >> 20
            )));
        }
        Ok(())
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard limit and returns the largest
/// connection cap that keeps [`FD_RESERVE`] descriptors (plus those open
/// now) free: each connection holds one descriptor.
pub fn fit_nofile() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a pointer to a live rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) != 0 {
            return MAX_CONNECTIONS as u64;
        }
        if rl.rlim_cur < rl.rlim_max {
            let want = libc::rlimit {
                rlim_cur: rl.rlim_max,
                rlim_max: rl.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                rl.rlim_cur = rl.rlim_max;
            }
        }
    }
    let open = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as u64)
        .unwrap_or(64);
    rl.rlim_cur.saturating_sub(open + FD_RESERVE).max(1)
}

/// The server-wide budget for request buffers; see the module docs.
#[derive(Debug)]
pub struct Budget {
    /// Bytes each connection may hold without borrowing.
    share: u64,
    /// Bytes lent beyond shares, at most.
    lendable: u64,
    /// Bytes lent now.
    lent: AtomicU64,
}

impl Budget {
    /// A budget of `total` bytes for at most `conns` connections.
    pub fn new(total: u64, conns: usize) -> Budget {
        let share = total / 2 / conns.max(1) as u64;
        Budget {
            share,
            lendable: total - share * conns.max(1) as u64,
            lent: AtomicU64::new(0),
        }
    }

    /// The share each connection is guaranteed.
    pub fn share(&self) -> u64 {
        self.share
    }

    /// Bytes lent now.
    pub fn lent(&self) -> u64 {
        self.lent.load(Ordering::Relaxed)
    }

    /// Whether a connection holding `held` bytes may take `len` more; what
    /// lies beyond its share is borrowed when granted.
    #[inline]
    pub fn take(&self, held: u64, len: u64) -> bool {
        let after = (held + len).saturating_sub(self.share);
        if after == 0 {
            return true;
        }
        let own = held.saturating_sub(self.share);
        let more = after - own;
        let mut cur = self.lent.load(Ordering::Relaxed);
        loop {
            // At most half of what the others leave: own + more <= (lendable
            // - (cur - own)) / 2.
            if own + 2 * more + cur > self.lendable {
                return false;
            }
            match self.lent.compare_exchange_weak(
                cur,
                cur + more,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(x) => cur = x,
            }
        }
    }

    /// Charges `len` more to a holder of `held` bytes whatever is free:
    /// for the one buffer a holder must get to make progress.
    pub fn force(&self, held: u64, len: u64) {
        let before = held.saturating_sub(self.share);
        let after = (held + len).saturating_sub(self.share);
        self.lent.fetch_add(after - before, Ordering::Relaxed);
    }

    /// A connection holding `held` bytes gives `len` of them back.
    #[inline]
    pub fn give(&self, held: u64, len: u64) {
        let before = held.saturating_sub(self.share);
        let after = (held - len).saturating_sub(self.share);
        if before > after {
            self.lent.fetch_sub(before - after, Ordering::Relaxed);
        }
    }
}

impl Budget {
    /// Bytes the lent part holds in all.
    pub fn lendable(&self) -> u64 {
        self.lendable
    }

    /// Reserves `len` bytes of the lent part until the [`Reservation`] is
    /// dropped; `what` names the holder in the error when they do not fit.
    pub fn reserve(self: &Arc<Self>, len: u64, what: &str) -> Result<Reservation, Error> {
        let mut cur = self.lent.load(Ordering::Relaxed);
        loop {
            if cur + len > self.lendable {
                return Err(Error::new(
                    udm_core::ErrorKind::Busy,
                    format!(
                        "{what}: its buffers ({}) do not fit in the in-flight budget \
                         ({} free of the {} lent to exports and connections): \
                         ask for less, or raise --max-inflight",
                        mib(len),
                        mib(self.lendable - cur.min(self.lendable)),
                        mib(self.lendable),
                    ),
                ));
            }
            match self.lent.compare_exchange_weak(
                cur,
                cur + len,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Ok(Reservation {
                        budget: self.clone(),
                        len,
                    })
                }
                Err(x) => cur = x,
            }
        }
    }
}

fn mib(n: u64) -> String {
    if n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    }
}

/// Bytes held from a [`Budget`] for an export's lifetime; given back when
/// dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    len: u64,
}

impl Reservation {
    /// The bytes reserved.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing is reserved.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.lent.fetch_sub(self.len, Ordering::Relaxed);
    }
}

/// What every server of a process shares (one [`Pool`] per `udm serve`,
/// one for all of a daemon's exports): the connection cap and the buffer
/// budget, so that many exports cannot add up to more than one allows.
#[derive(Debug)]
pub struct Pool {
    /// Connections open on any server of the pool.
    pub open: AtomicUsize,
    /// The buffer budget.
    pub budget: Arc<Budget>,
    /// The connection cap in force: [`Limits::max_connections`], lowered
    /// to what RLIMIT_NOFILE leaves.
    pub max_connections: usize,
    /// The handshake deadline.
    pub handshake_timeout: Option<Duration>,
}

impl Pool {
    /// A pool under `lim` (checked), its connection cap fitted to the
    /// descriptor limit (raised to its hard value first).
    pub fn new(lim: &Limits) -> Result<Arc<Pool>, Error> {
        lim.validate()?;
        let fit = fit_nofile();
        let max_conns = (lim.max_connections as u64).min(fit) as usize;
        if max_conns < lim.max_connections {
            tracing::warn!(
                "nbd: at most {max_conns} connections (not {}): RLIMIT_NOFILE leaves no \
                 more descriptors with {FD_RESERVE} in reserve",
                lim.max_connections,
            );
        }
        Ok(Arc::new(Pool {
            open: AtomicUsize::new(0),
            budget: Arc::new(Budget::new(lim.max_inflight, max_conns)),
            max_connections: max_conns,
            handshake_timeout: lim.handshake_timeout,
        }))
    }

    /// Takes a connection slot unless the pool is at its cap.
    pub fn enter(&self) -> bool {
        if self.open.fetch_add(1, Ordering::AcqRel) >= self.max_connections {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Gives back a slot [`Pool::enter`] took.
    pub fn leave(&self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Parses a size: bytes, or with a K, M, G or T suffix (binary; an
/// optional trailing 'iB' or 'B').
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return None,
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    num.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_its_share_a_connection_never_touches_the_lent_part() {
        let b = Budget::new(256 << 20, 1024);
        assert_eq!(b.share(), 128 << 10);
        for _ in 0..32 {
            assert!(b.take(0, 4096));
        }
        assert!(b.take(64 << 10, 64 << 10));
        assert_eq!(b.lent(), 0);
    }

    #[test]
    fn a_borrower_takes_at_most_half_of_what_the_others_leave() {
        let b = Budget::new(256 << 20, 1024);
        let m = 32u64 << 20;
        let s = b.share();
        // Lendable: 128 MiB. First connection: 32, then 64; not 96.
        assert!(b.take(0, m));
        assert!(b.take(m, m));
        assert!(!b.take(2 * m, m));
        // A second one gets 32 (64 + 64 + 0 <= 128); a third nothing big.
        assert!(b.take(0, m));
        assert!(!b.take(0, m));
        // ... but small requests still fit in its share, and a 1 MiB one
        // in the lent rest.
        assert!(b.take(0, s));
        assert!(b.take(0, 1 << 20));
        // Giving back lets the next one in.
        b.give(2 * m, 2 * m);
        assert!(b.take(0, m));
    }

    #[test]
    fn the_lent_part_never_exceeds_half_the_budget_plus_rounding() {
        let b = Budget::new(64 << 20, 16);
        let mut held = [0u64; 16];
        for _ in 0..100 {
            for h in held.iter_mut() {
                if b.take(*h, 1 << 20) {
                    *h += 1 << 20;
                }
            }
        }
        let total: u64 = held.iter().sum();
        assert!(total <= 64 << 20, "{total}");
        for h in held.iter().rev() {
            b.give(*h, *h);
        }
        assert_eq!(b.lent(), 0);
    }

    #[test]
    fn a_reservation_is_lent_until_dropped_and_refused_past_what_is_free() {
        let b = Arc::new(Budget::new(256 << 20, 1024));
        assert_eq!(b.lendable(), 128 << 20);
        let r = b.reserve(96 << 20, "export 'a'").unwrap();
        assert_eq!((r.len(), b.lent()), (96 << 20, 96 << 20));
        let e = b.reserve(64 << 20, "export 'b'").unwrap_err().to_string();
        assert!(
            e.contains("export 'b': its buffers (64 MiB) do not fit")
                && e.contains("(32 MiB free of the 128 MiB"),
            "{e}"
        );
        // Connections borrow only from what the reservation leaves.
        assert!(!b.take(0, 32 << 20));
        assert!(b.take(0, 8 << 20));
        b.give(8 << 20, 8 << 20);
        drop(r);
        assert_eq!(b.lent(), 0);
        assert!(b.reserve(64 << 20, "export 'b'").is_ok());
    }

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("256M"), Some(256 << 20));
        assert_eq!(parse_size("256MiB"), Some(256 << 20));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("12X"), None);
        assert_eq!(parse_size(""), None);
    }
}
