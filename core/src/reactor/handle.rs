//! How other threads reach a reactor: a mailbox of messages and an
//! eventfd that wakes it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::Reactor;

pub(super) type Msg = Box<dyn FnOnce(&Reactor) + Send>;

pub(super) struct Mailbox {
    pub(super) queue: Mutex<Vec<Msg>>,
    pub(super) pending: AtomicBool,
    pub(super) closed: AtomicBool,
    pub(super) eventfd: OwnedFd,
}

/// A `Send` handle to a reactor: posts messages to it and wakes it.
#[derive(Clone)]
pub struct ReactorHandle {
    pub(super) id: usize,
    pub(super) mailbox: Arc<Mailbox>,
}

impl ReactorHandle {
    /// The reactor's id.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Runs `f` on the reactor's thread at its next turn. Returns false (and
    /// drops `f`) if the reactor is gone.
    pub fn send(&self, f: impl FnOnce(&Reactor) + Send + 'static) -> bool {
        {
            let mut q = match self.mailbox.queue.lock() {
                Ok(q) => q,
                Err(p) => p.into_inner(),
            };
            if self.mailbox.closed.load(Ordering::Acquire) {
                return false;
            }
            q.push(Box::new(f));
            self.mailbox.pending.store(true, Ordering::Release);
        }
        self.wake();
        true
    }

    /// Wakes the reactor if it sleeps.
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a live u64 to our own eventfd.
        unsafe {
            libc::write(
                self.mailbox.eventfd.as_raw_fd(),
                (&one as *const u64).cast(),
                8,
            )
        };
    }

    /// Whether the reactor has stopped.
    pub fn is_closed(&self) -> bool {
        self.mailbox.closed.load(Ordering::Acquire)
    }
}
