//! What one export's fronts tell of `auto` dispatch's trial, for `udm
//! info` and `export ls`: the mode each front's trial runs now and the
//! epochs run each way so far, summed over the export's fronts (one per
//! connection or queue).
//!
//! A front writes here only where its trial ends an epoch or changes the
//! mode (the cold path, once in [`udm_core::dispatch`]'s epoch of a few
//! milliseconds), with relaxed atomics: the figures are a report, not a
//! synchronisation, and a reader may see one epoch's counts before the
//! mode they led to.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use udm_core::Dispatch;

/// Shared by one export's fronts ([`super::Front::set_report`]).
#[derive(Debug, Default)]
pub struct AutoReport {
    /// Epochs run queued, and direct, by every front so far.
    epochs: [AtomicU64; 2],
    /// Fronts whose trial runs queued, and direct, now.
    fronts: [AtomicUsize; 2],
}

/// A snapshot of an [`AutoReport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AutoCounts {
    /// Fronts running queued now.
    pub queued_now: usize,
    /// Fronts running direct now.
    pub direct_now: usize,
    /// Epochs run queued so far.
    pub queued_epochs: u64,
    /// Epochs run direct so far.
    pub direct_epochs: u64,
}

/// The slot of a trial's mode: queued 0, direct 1 (a trial runs no other).
fn slot(mode: Dispatch) -> usize {
    usize::from(mode != Dispatch::Queued)
}

impl AutoReport {
    /// A front's trial started in, or moved to, `mode` (from `was`).
    pub(super) fn moved(&self, was: Option<Dispatch>, mode: Option<Dispatch>) {
        if let Some(w) = was {
            self.fronts[slot(w)].fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(m) = mode {
            self.fronts[slot(m)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A front's trial ran `queued` more epochs queued and `direct` more
    /// direct.
    pub(super) fn ran(&self, queued: u64, direct: u64) {
        if queued > 0 {
            self.epochs[0].fetch_add(queued, Ordering::Relaxed);
        }
        if direct > 0 {
            self.epochs[1].fetch_add(direct, Ordering::Relaxed);
        }
    }

    /// The figures now.
    pub fn counts(&self) -> AutoCounts {
        AutoCounts {
            queued_now: self.fronts[0].load(Ordering::Relaxed),
            direct_now: self.fronts[1].load(Ordering::Relaxed),
            queued_epochs: self.epochs[0].load(Ordering::Relaxed),
            direct_epochs: self.epochs[1].load(Ordering::Relaxed),
        }
    }

    /// One line for a status: `trial: queued on 2 of 2 connections (1,204
    /// epochs queued, 37 direct)`, with `what` naming the fronts
    /// (`connections`, `queues`); None before any front ran a trial.
    pub fn describe(&self, what: &str) -> Option<String> {
        let c = self.counts();
        let fronts = c.queued_now + c.direct_now;
        if fronts == 0 && c.queued_epochs + c.direct_epochs == 0 {
            return None;
        }
        let now = match (c.queued_now, c.direct_now) {
            (0, 0) => format!("no {what} now"),
            (q, 0) => format!("queued on {q} of {fronts} {what}"),
            (0, d) => format!("direct on {d} of {fronts} {what}"),
            (q, d) => format!("queued on {q}, direct on {d} of {fronts} {what}"),
        };
        Some(format!(
            "trial: {now} ({} epochs queued, {} direct)",
            c.queued_epochs, c.direct_epochs
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_no_front_has_tried_reports_nothing() {
        assert_eq!(AutoReport::default().describe("queues"), None);
    }

    #[test]
    fn fronts_that_move_are_counted_where_they_are_now() {
        let r = AutoReport::default();
        r.moved(None, Some(Dispatch::Queued));
        r.moved(None, Some(Dispatch::Queued));
        r.ran(5, 0);
        r.moved(Some(Dispatch::Queued), Some(Dispatch::Direct));
        r.ran(0, 2);
        assert_eq!(
            r.describe("connections").as_deref(),
            Some("trial: queued on 1, direct on 1 of 2 connections (5 epochs queued, 2 direct)")
        );
        r.moved(Some(Dispatch::Direct), None);
        assert_eq!(
            r.describe("connections").as_deref(),
            Some("trial: queued on 1 of 1 connections (5 epochs queued, 2 direct)")
        );
        r.moved(Some(Dispatch::Queued), None);
        assert_eq!(
            r.describe("queues").as_deref(),
            Some("trial: no queues now (5 epochs queued, 2 direct)")
        );
    }
}
