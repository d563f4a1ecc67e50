//! `null`: completes I/O without touching data, like null_blk.
//!
//! Spec: `null:<size>[,delay=<µs>]`. Reads leave the buffer as it was. With a
//! delay, each I/O completes that long after submission (from a per-reactor
//! FIFO, so the reactor sleeps until the next one is due, not spins).

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_core::{
    check_bio, BioPtr, BlockDevice, Caps, Channel, Error, Limits, Poller, Reactor, Status,
    SECTOR_SHIFT,
};

/// A null device.
pub struct NullDevice {
    name: String,
    limits: Limits,
    delay: Option<Duration>,
}

impl NullDevice {
    /// A null device of `bytes`, completing each I/O after `delay` if given.
    pub fn new(
        name: impl Into<String>,
        bytes: u64,
        delay: Option<Duration>,
    ) -> Result<NullDevice, Error> {
        let sectors = bytes >> SECTOR_SHIFT;
        if sectors == 0 {
            return Err(Error::invalid(format!(
                "null: size {bytes} is less than one sector"
            )));
        }
        Ok(NullDevice {
            name: name.into(),
            limits: Limits::new(sectors),
            delay: delay.filter(|d| !d.is_zero()),
        })
    }
}

impl BlockDevice for NullDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn caps(&self) -> Caps {
        let caps = Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES;
        // A delay is paid per request, whatever its size: fewer, larger
        // requests pay it fewer times.
        if self.delay.is_some() {
            caps | Caps::MERGE
        } else {
            caps
        }
    }
    fn merge_reason(&self) -> String {
        match self.delay {
            Some(d) => format!("null with a delay of {} µs per request", d.as_micros()),
            None => "null: a request costs nothing".into(),
        }
    }
    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        match self.delay {
            None => Ok(Rc::new(NullChannel {
                limits: self.limits,
                caps: self.caps(),
            })),
            Some(delay) => {
                let ch = Rc::new(DelayChannel {
                    limits: self.limits,
                    caps: self.caps(),
                    delay,
                    queue: RefCell::new(VecDeque::new()),
                });
                reactor.add_poller(ch.clone());
                Ok(ch)
            }
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct NullChannel {
    limits: Limits,
    caps: Caps,
}

impl Channel for NullChannel {
    #[inline]
    fn submit(&self, bio: BioPtr) {
        if let Some(bio) = check_bio(bio, &self.limits, self.caps) {
            bio.complete(Status::Ok);
        }
    }

    #[inline]
    unsafe fn submit_nocheck(&self, bio: BioPtr) {
        bio.complete(Status::Ok);
    }
}

struct DelayChannel {
    limits: Limits,
    caps: Caps,
    delay: Duration,
    /// (due, bio), in submission order, which is also due order.
    queue: RefCell<VecDeque<(Instant, BioPtr)>>,
}

impl Channel for DelayChannel {
    fn submit(&self, bio: BioPtr) {
        if let Some(bio) = check_bio(bio, &self.limits, self.caps) {
            let due = Instant::now() + self.delay;
            self.queue.borrow_mut().push_back((due, bio));
        }
    }
}

impl Poller for DelayChannel {
    fn poll(&self) -> usize {
        let now = Instant::now();
        let mut n = 0;
        loop {
            let due = {
                let q = self.queue.borrow();
                matches!(q.front(), Some((d, _)) if *d <= now)
            };
            if !due {
                return n;
            }
            if let Some((_, bio)) = self.queue.borrow_mut().pop_front() {
                bio.complete(Status::Ok);
                n += 1;
            }
        }
    }
    fn deadline(&self) -> Option<Instant> {
        self.queue.borrow().front().map(|(d, _)| *d)
    }
}
