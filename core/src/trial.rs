//! A trial of two ways of doing one thing, decided by measuring both: the
//! reactor's spin against sleeping at once ([`crate::reactor`]'s adaptive
//! mode) and `auto` dispatch's queued against direct ([`crate::dispatch`]).
//!
//! Time runs in epochs, each done one way and scored by what it served
//! per second and what it cost per I/O. Most epochs go the way that scored
//! better; every few epochs one tries the other, less often while the tries
//! keep agreeing (from [`Way::FIRST_EVERY`] epochs between two tries,
//! doubling up to [`Way::MAX_EVERY`]; a try that lost by [`Way::CLEAR`] or
//! more, which costs most and tells least, quadruples the spacing, up to
//! [`Way::MAX_EVERY_CLEAR`]). The better way's score is a running
//! average (a quarter for the newest epoch); a try is scored on its own
//! epoch, and a try that would change the way runs a second epoch first,
//! the change made only if the two epochs' average still calls for it:
//! one epoch that noise made look better (a preemption in the other way's
//! last epoch, a burst of the host's other work) does not move the trial.
//! A rate that moves by more than [`Way::CHANGE`] from the better
//! way's average is another workload: the average starts over from it and
//! the other way is tried soon. An epoch that served fewer than
//! [`Way::MIN_IOS`] judges nothing and starts the trial over from
//! [`Way::FIRST`].
//!
//! The trial is the decisions alone, fed with measurements, so a test can
//! give it any workload's; the caller reads the clocks.

use std::fmt::Debug;
use std::time::Duration;

/// The two ways a trial weighs, and its rules.
pub(crate) trait Way: Copy + Eq + Debug {
    /// The way a trial starts from, and starts over from.
    const FIRST: Self;
    /// The way it tries against [`Way::FIRST`].
    const SECOND: Self;
    /// An epoch that served fewer I/Os judges nothing.
    const MIN_IOS: u64;
    /// Epochs of the better way between two tries of the other, at first
    /// and at most.
    const FIRST_EVERY: u32;
    const MAX_EVERY: u32;
    /// Epochs of [`Way::FIRST`] before the first try of a new trial
    /// (doubling from there while the tries agree, as the spacing does).
    const FIRST_TRY: u32 = Self::FIRST_EVERY;
    /// A try whose rate was this many times lower, or its cost per I/O
    /// this many times higher, lost clearly (never, by default).
    const CLEAR: f64 = f64::INFINITY;
    /// Epochs of the better way between two tries at most while they lose
    /// clearly.
    const MAX_EVERY_CLEAR: u32 = Self::MAX_EVERY;
    /// A rate that moves by more than this factor from the better way's
    /// average is another workload.
    const CHANGE: f64;
    /// The better way, from [`Way::FIRST`]'s score and [`Way::SECOND`]'s,
    /// with `best` the way that scored better so far (for a hysteresis).
    fn verdict(first: Score, second: Score, best: Self) -> Self;
}

/// What an epoch measured.
#[derive(Clone, Copy, Debug)]
pub struct Epoch {
    /// Its length.
    pub wall: Duration,
    /// The CPU time it cost (whose CPU is the caller's choice).
    pub cpu: Duration,
    /// I/Os it served (bios, requests).
    pub ios: u64,
}

/// An epoch's score.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Score {
    /// I/Os per second.
    pub rate: f64,
    /// CPU nanoseconds per I/O.
    pub cost: f64,
}

/// The trial of two ways.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Trial<W: Way> {
    /// The way that scored better.
    best: W,
    /// The current epoch's way.
    now: W,
    /// Each way's score: the last try's, or the running average of the
    /// epochs that went the better way.
    first: Option<Score>,
    second: Option<Score>,
    /// Epochs of `best` between two tries.
    every: u32,
    /// Epochs of `best` since the last try.
    since: u32,
    /// The current epoch is a try's second, which confirms or refutes its
    /// first.
    confirming: bool,
}

impl<W: Way> Trial<W> {
    pub(crate) fn new() -> Trial<W> {
        Trial {
            best: W::FIRST,
            now: W::FIRST,
            first: None,
            second: None,
            every: W::FIRST_TRY,
            since: 0,
            confirming: false,
        }
    }

    /// The current epoch's way.
    pub(crate) fn way(&self) -> W {
        self.now
    }

    /// The way that scored better so far.
    pub(crate) fn best(&self) -> W {
        self.best
    }

    /// Whether the current epoch repeats a try that called for a change,
    /// before the change is made.
    pub(crate) fn confirming(&self) -> bool {
        self.confirming
    }

    /// Ends the current epoch with what it measured; returns the next
    /// epoch's way.
    pub(crate) fn end_epoch(&mut self, e: Epoch) -> W {
        if e.ios < W::MIN_IOS || e.wall.is_zero() {
            *self = Trial::new();
            return self.now;
        }
        let s = Score {
            rate: e.ios as f64 / e.wall.as_secs_f64(),
            cost: e.cpu.as_nanos() as f64 / e.ios as f64,
        };
        let slot = if self.now == W::FIRST {
            &mut self.first
        } else {
            &mut self.second
        };
        let before = *slot;
        let weight = if self.now == self.best {
            4.0
        } else if self.confirming {
            2.0
        } else {
            1.0
        };
        *slot = Some(match before {
            Some(b) if weight > 1.0 => Score {
                rate: b.rate + (s.rate - b.rate) / weight,
                cost: b.cost + (s.cost - b.cost) / weight,
            },
            _ => s,
        });
        if self.now != self.best {
            // A try ended: compare, and space the next try out while the
            // answer stays the same.
            let best = match (self.first, self.second) {
                (Some(f), Some(s)) => W::verdict(f, s, self.best),
                _ => W::FIRST,
            };
            if best != self.best && !self.confirming {
                // It calls for a change: one more epoch the same way first.
                self.confirming = true;
                return self.now;
            }
            self.confirming = false;
            self.every = if best != self.best {
                W::FIRST_EVERY
            } else if self.lost_clearly() {
                (self.every * 4).min(W::MAX_EVERY_CLEAR.max(W::MAX_EVERY))
            } else {
                (self.every * 2).min(W::MAX_EVERY)
            };
            self.best = best;
            self.since = 0;
        } else {
            self.since += 1;
            if before.is_some_and(|b| s.rate > b.rate * W::CHANGE || s.rate * W::CHANGE < b.rate) {
                // Another workload: the average is the old one's.
                *slot = Some(s);
                self.every = W::FIRST_EVERY;
                self.since = self.every;
            }
        }
        self.now = if self.since < self.every {
            self.best
        } else if self.best == W::FIRST {
            W::SECOND
        } else {
            W::FIRST
        };
        self.now
    }

    /// Whether the try just scored lost to the better way by
    /// [`Way::CLEAR`] or more, in rate or in cost per I/O.
    fn lost_clearly(&self) -> bool {
        let (best, tried) = if self.best == W::FIRST {
            (self.first, self.second)
        } else {
            (self.second, self.first)
        };
        match (best, tried) {
            (Some(b), Some(t)) => b.rate >= W::CLEAR * t.rate || t.cost >= W::CLEAR * b.cost,
            _ => false,
        }
    }
}
