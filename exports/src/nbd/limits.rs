//! The NBD server's own connection counts: per-export caps, beside the
//! process-wide [`Pool`] every server shares.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::limits::Pool;

/// Connection counts shared by the accept thread and the reactors.
#[derive(Debug)]
pub struct Counts {
    /// Connections accepted and not yet freed.
    pub open: AtomicUsize,
    /// Per export: connections in transmission on it (or admitted to it).
    pub per_export: Vec<AtomicUsize>,
    /// Per export: its cap, if any.
    pub export_caps: Vec<Option<usize>>,
}

impl Counts {
    /// Counts for exports with these caps.
    pub fn new(export_caps: Vec<Option<usize>>) -> Counts {
        Counts {
            open: AtomicUsize::new(0),
            per_export: export_caps.iter().map(|_| AtomicUsize::new(0)).collect(),
            export_caps,
        }
    }

    /// Admits one more connection to export `i` unless it is at its cap.
    pub fn admit(&self, i: usize) -> bool {
        let Some(n) = self.per_export.get(i) else {
            return false;
        };
        let cap = self.export_caps.get(i).copied().flatten();
        let prev = n.fetch_add(1, Ordering::AcqRel);
        if cap.is_some_and(|c| prev >= c) {
            n.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// A connection admitted to export `i` closed.
    pub fn leave(&self, i: usize) {
        if let Some(n) = self.per_export.get(i) {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What the accept thread and every reactor of one server share.
#[derive(Debug)]
pub struct Shared {
    /// The server's own connection counts.
    pub counts: Counts,
    /// What the server shares with the others of its process.
    pub pool: Arc<Pool>,
    /// The server's TLS, if it offers it.
    pub tls: Option<Arc<super::tls::Tls>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_caps_admit_up_to_the_cap() {
        let c = Counts::new(vec![Some(2), None]);
        assert!(c.admit(0) && c.admit(0));
        assert!(!c.admit(0));
        c.leave(0);
        assert!(c.admit(0));
        assert!((0..100).all(|_| c.admit(1)));
        assert!(!c.admit(7));
    }
}
