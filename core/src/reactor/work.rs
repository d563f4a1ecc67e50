//! The reactor's pollers: what it polls on every turn, and its queue of
//! slow work.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

/// Something the reactor polls each turn: a device channel that completes
/// I/O outside the ring (timers, a dedicated polled ring).
pub trait Poller {
    /// Completes what is ready; returns how many.
    fn poll(&self) -> usize;
    /// Whether it has work that only polling will finish (the reactor must
    /// not sleep while this is true).
    fn must_spin(&self) -> bool {
        false
    }
    /// The next time it needs polling (the reactor sleeps no longer than that).
    fn deadline(&self) -> Option<Instant> {
        None
    }
    /// For a poller queued on a [`WorkQueue`]: whether it still has work.
    /// It leaves the queue after a turn on which this is false.
    fn pending(&self) -> bool {
        true
    }
}

/// Something that runs once the reactor's current pass over deferred
/// completions ends ([`Reactor::at_pass_end`](super::Reactor::at_pass_end)):
/// a submitter that kept memory a device lent to its bios
/// ([`crate::BioFlags::MAY_LEND`]) past their end_ios lets go of it here,
/// while it is still valid.
pub trait PassEnd {
    /// The pass ended.
    fn pass_end(&self);
}

/// A reactor's queue of slow work (the kernel's `queue_work` on the local
/// CPU). A poller added with [`Reactor::add_poller`](super::Reactor::add_poller) is called on every
/// turn, which costs each I/O of a QD1 loop a call; one queued here is
/// called only from the turn after it was queued until its
/// [`Poller::pending`] turns false, so a device whose slow path (retries,
/// draining for a suspend) is idle costs the loop nothing.
#[derive(Clone)]
pub struct WorkQueue(Rc<WorkInner>);

struct WorkInner {
    /// Whether `items` is non-empty: the one load an idle turn pays.
    queued: Cell<bool>,
    items: RefCell<Vec<Rc<dyn Poller>>>,
    /// The other of the two vectors a turn moves the pollers between, kept
    /// with its capacity so a turn allocates nothing.
    spare: RefCell<Vec<Rc<dyn Poller>>>,
}

impl WorkQueue {
    pub(super) fn new() -> WorkQueue {
        WorkQueue(Rc::new(WorkInner {
            queued: Cell::new(false),
            items: RefCell::new(Vec::new()),
            spare: RefCell::new(Vec::new()),
        }))
    }

    /// Polls `p` on the reactor's turns until it is no longer pending. The
    /// caller queues a poller once (not again while it is queued).
    pub fn queue(&self, p: Rc<dyn Poller>) {
        self.0.items.borrow_mut().push(p);
        self.0.queued.set(true);
    }

    /// Polls everything queued; keeps what is still pending.
    #[inline]
    pub(super) fn run(&self) -> usize {
        if !self.0.queued.get() {
            return 0;
        }
        self.run_queued()
    }

    /// Pollers may queue work (themselves included) while they run.
    #[cold]
    fn run_queued(&self) -> usize {
        let mut items = std::mem::take(&mut *self.0.items.borrow_mut());
        let mut keep = std::mem::take(&mut *self.0.spare.borrow_mut());
        let mut work = 0;
        for p in items.drain(..) {
            work += p.poll();
            if p.pending() {
                keep.push(p);
            }
        }
        let mut q = self.0.items.borrow_mut();
        // Whatever was queued while they ran goes after those kept.
        keep.append(&mut q);
        std::mem::swap(&mut *q, &mut keep);
        self.0.queued.set(!q.is_empty());
        *self.0.spare.borrow_mut() = items;
        work
    }

    pub(super) fn any(&self, f: impl Fn(&dyn Poller) -> bool) -> bool {
        self.0.queued.get() && self.0.items.borrow().iter().any(|p| f(&**p))
    }

    /// What is queued now.
    pub(super) fn items(&self) -> std::cell::Ref<'_, Vec<Rc<dyn Poller>>> {
        self.0.items.borrow()
    }

    pub(super) fn clear(&self) {
        self.0.items.borrow_mut().clear();
        self.0.spare.borrow_mut().clear();
        self.0.queued.set(false);
    }
}
