//! How control waits for reactors: a [`Waiter`] hands out one [`Guard`] per
//! reactor it messages, and returns once every guard is dropped (with the
//! first error any reported).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use udm_core::Error;

/// Locks `m`, whether or not a holder panicked (the data stays usable).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts the reactors a control operation waits for.
pub(crate) struct Waiter {
    inner: Arc<WaitInner>,
}

struct WaitInner {
    state: Mutex<(usize, Option<Error>)>,
    cv: Condvar,
}

/// One reactor's share of a control operation: dropping it reports done.
pub(crate) struct Guard(Arc<WaitInner>);

impl Guard {
    /// Reports an error (the first one wins) and done.
    pub fn fail(self, e: Error) {
        let mut s = lock(&self.0.state);
        if s.1.is_none() {
            s.1 = Some(e);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut s = lock(&self.0.state);
        s.0 -= 1;
        if s.0 == 0 {
            self.0.cv.notify_all();
        }
    }
}

impl Waiter {
    pub fn new() -> Waiter {
        Waiter {
            inner: Arc::new(WaitInner {
                state: Mutex::new((0, None)),
                cv: Condvar::new(),
            }),
        }
    }

    pub fn guard(&self) -> Guard {
        lock(&self.inner.state).0 += 1;
        Guard(self.inner.clone())
    }

    pub fn wait(self) -> Result<(), Error> {
        let mut s = lock(&self.inner.state);
        while s.0 > 0 {
            s = self.inner.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        match s.1.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
