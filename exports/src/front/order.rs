//! Ordering of read-modify-writes against the writes they overlap: which
//! requests must wait, and which waiting ones may go.

use super::{Front, Slot};

/// Whether `a` and `b` may not be in flight together: both change data,
/// one of them is a read-modify-write, and their blocks overlap.
fn conflict(a: &Slot, b: &Slot) -> bool {
    a.writer && b.writer && (a.rmw || b.rmw) && a.lo < b.hi && b.lo < a.hi
}

impl Front {
    /// Whether the new request in slot `idx` must wait: it conflicts with
    /// a request in flight or one already waiting (arrival order is kept).
    pub(super) fn must_wait(&self, idx: usize) -> bool {
        let slots = self.slots.borrow();
        let me = &slots[idx];
        slots
            .iter()
            .any(|(j, s)| j != idx && s.active && conflict(me, s))
            || self
                .waiting
                .borrow()
                .iter()
                .any(|&j| conflict(me, &slots[j]))
    }

    /// Starts, in arrival order, every waiting request that no longer
    /// conflicts with one in flight or one that arrived before it, and
    /// that gets its bounce buffer if it needs one. Once one is refused a
    /// bounce, no later one takes one in this pass (first come, first
    /// served), but those that need none still go.
    pub(super) fn release_waiters(&self) {
        let mut bounce_refused = false;
        loop {
            let next = {
                let slots = self.slots.borrow();
                let waiting = self.waiting.borrow();
                waiting.iter().enumerate().find_map(|(k, &w)| {
                    let me = &slots[w];
                    let held_back = bounce_refused && me.needs_bounce
                        || slots.iter().any(|(_, s)| s.active && conflict(me, s))
                        || waiting.iter().take(k).any(|&e| conflict(me, &slots[e]));
                    (!held_back).then_some((k, w, me.needs_bounce))
                })
            };
            let Some((k, idx, needs_bounce)) = next else {
                return;
            };
            if needs_bounce && !self.grab_bounce(idx) {
                bounce_refused = true;
                continue;
            }
            self.waiting.borrow_mut().remove(k);
            self.start(idx);
        }
    }
}
