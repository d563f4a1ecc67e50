//! Adaptive mode's weighing of the spin ([`super::ReactorConfig::weigh_spin`]):
//! whether spinning across the idle gaps is worth its CPU, decided by
//! trying both ways of waiting and comparing what each cost and served.
//!
//! The haltpoll window ([`super::next_window`]) decides from the gaps'
//! lengths alone, and a gap's length does not say what a spin across it
//! buys. A request-reply client (QD1) waits for each reply, so a reactor
//! that sleeps adds a wakeup to every request and the client's throughput
//! drops by half: the spin pays. A client with many requests in flight
//! (QD32) keeps sending while the reactor sleeps, so a sleep gathers a
//! batch and costs it nothing in throughput, while a spin across the short
//! gaps between its bursts serves the same requests a few at a time and
//! is most of the reactor's CPU: the spin does not pay. The gaps are short
//! in both, and shorter at QD32.
//!
//! So the reactor measures: time runs in epochs of about [`EPOCH`], each
//! waiting one way ([`Wait::Spin`]: the haltpoll window; [`Wait::Sleep`]:
//! sleep at once, as interrupt mode does), each scored by the bios it
//! served per second and the reactor thread's CPU time per bio. Most
//! epochs wait the way that scored better; every few epochs one tries the
//! other way, less often while the tries keep agreeing. Sleeping wins only
//! when it keeps [`KEEP_RATE`] of the spin's throughput and costs at most
//! [`SAVE_COST`] of its CPU per bio: a client that waits on each reply
//! keeps its spin.

use std::cell::Cell;
use std::time::{Duration, Instant};

use crate::trial::{Epoch, Score, Trial, Way};

/// How long an epoch runs (it ends at the first idle turn after that):
/// a few scheduler slices, so that one preemption does not decide it.
pub(crate) const EPOCH: Duration = Duration::from_millis(8);
/// Sleeping at once is chosen only if it keeps this share of the
/// throughput spinning had...
const KEEP_RATE: f64 = 0.85;
/// ...and costs at most this share of the spin's CPU per bio.
const SAVE_COST: f64 = 0.9;

/// How an adaptive reactor waits during an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Spin across gaps the haltpoll window covers.
    Spin,
    /// Sleep as soon as there is nothing to run.
    Sleep,
}

impl Way for Wait {
    const FIRST: Wait = Wait::Spin;
    const SECOND: Wait = Wait::Sleep;
    /// An idle reactor, or one whose client is sparse (whose long gaps
    /// close the spin window anyway). The weighing starts over from
    /// spinning, which a new request-reply client needs first.
    const MIN_IOS: u64 = 64;
    const FIRST_EVERY: u32 = 8;
    const MAX_EVERY: u32 = 64;
    /// A QD1 client after a QD32 one moves the rate 5-10x; a loaded host's
    /// scheduling moves single epochs by up to 2x.
    const CHANGE: f64 = 3.0;

    fn verdict(spin: Score, sleep: Score, _: Wait) -> Wait {
        if sleep.rate >= KEEP_RATE * spin.rate && sleep.cost <= SAVE_COST * spin.cost {
            Wait::Sleep
        } else {
            Wait::Spin
        }
    }
}

/// A reactor's running trial: the epoch's start and the decisions.
pub(crate) struct Weigh {
    trial: Cell<Trial<Wait>>,
    /// When the epoch started: wall clock, thread CPU time, bios so far.
    start: Cell<(Instant, Duration, u64)>,
    /// When the epoch may end.
    end: Cell<Instant>,
    /// Whether this epoch sleeps at once (read on every adaptive turn).
    at_once: Cell<bool>,
}

impl Weigh {
    pub(crate) fn new(bios: u64) -> Weigh {
        let now = Instant::now();
        Weigh {
            trial: Cell::new(Trial::new()),
            start: Cell::new((now, thread_cpu(), bios)),
            end: Cell::new(now + EPOCH),
            at_once: Cell::new(false),
        }
    }

    /// Whether the current epoch sleeps as soon as there is nothing to run.
    #[inline]
    pub(crate) fn sleeps_at_once(&self) -> bool {
        self.at_once.get()
    }

    /// At the start of an idle gap (`now`), with `bios` allocated so far:
    /// ends the epoch if it has run its time.
    #[inline]
    pub(crate) fn at_idle(&self, now: Instant, bios: impl FnOnce() -> u64) {
        if now >= self.end.get() {
            self.end_epoch(now, bios());
        }
    }

    #[cold]
    #[inline(never)]
    fn end_epoch(&self, now: Instant, bios: u64) {
        let cpu = thread_cpu();
        let (t0, c0, b0) = self.start.get();
        let mut trial = self.trial.get();
        let wait = trial.end_epoch(Epoch {
            wall: now.saturating_duration_since(t0),
            cpu: cpu.saturating_sub(c0),
            ios: bios.wrapping_sub(b0),
        });
        self.trial.set(trial);
        self.at_once.set(wait == Wait::Sleep);
        self.start.set((now, cpu, bios));
        self.end.set(now + EPOCH);
    }
}

/// The calling thread's CPU time, user and system.
fn thread_cpu() -> Duration {
    let (user, system) = crate::cputime::thread_cpu();
    user + system
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An epoch of [`EPOCH`] that served `kiops` thousand bios per second
    /// at `us` microseconds of the reactor's CPU per bio.
    fn epoch(kiops: f64, us: f64) -> Epoch {
        let bios = (kiops * 1e3 * EPOCH.as_secs_f64()) as u64;
        Epoch {
            wall: EPOCH,
            cpu: Duration::from_nanos((us * 1e3) as u64 * bios),
            ios: bios,
        }
    }

    /// Runs `n` epochs of a workload that scores `spin` while spinning and
    /// `sleep` while sleeping at once; returns the waits chosen.
    fn run(t: &mut Trial<Wait>, n: usize, spin: (f64, f64), sleep: (f64, f64)) -> Vec<Wait> {
        (0..n)
            .map(|_| {
                let (k, us) = match t.way() {
                    Wait::Spin => spin,
                    Wait::Sleep => sleep,
                };
                t.end_epoch(epoch(k, us))
            })
            .collect()
    }

    fn share(waits: &[Wait], w: Wait) -> f64 {
        waits.iter().filter(|&&x| x == w).count() as f64 / waits.len() as f64
    }

    // The figures below are NBD's and vhost-user-blk's on a quiet host
    // (docs/benchmarks.md): thousands of I/Os per second, and CPU µs per
    // I/O, spinning (the haltpoll window) and sleeping (interrupt mode).

    #[test]
    fn a_request_reply_client_keeps_the_spin_that_doubles_its_throughput() {
        // NBD at QD1: sleeping is cheaper per I/O (19.3 against 22.6 µs)
        // but halves the client's rate: the spin stays.
        let mut t = Trial::<Wait>::new();
        let waits = run(&mut t, 1000, (43.6, 22.6), (20.1, 19.3));
        assert!(share(&waits, Wait::Spin) > 0.97, "{waits:?}");
        // And tries sleeping ever less often: once in Wait::MAX_EVERY epochs.
        let last = &waits[800..];
        let tries = last.iter().filter(|&&w| w == Wait::Sleep).count();
        assert!(
            tries <= last.len() / Wait::MAX_EVERY as usize + 1,
            "{tries} tries"
        );
    }

    #[test]
    fn a_deep_queue_whose_client_keeps_sending_sleeps_between_bursts() {
        // NBD at QD32: sleeping keeps 94% of the rate at 78% of the CPU
        // per I/O, so the reactor sleeps, trying the spin now and then.
        let mut t = Trial::<Wait>::new();
        let waits = run(&mut t, 1000, (205.6, 4.75), (192.9, 3.69));
        assert!(share(&waits[100..], Wait::Sleep) > 0.97, "{waits:?}");
        assert!(waits[..20].contains(&Wait::Sleep));
    }

    #[test]
    fn a_spin_that_serves_more_for_less_is_kept() {
        // vhost-user-blk at QD32 and QD1: sleeping costs throughput and
        // CPU per I/O (kicks and wakeups): the spin stays.
        for (spin, sleep) in [
            ((1860.0, 0.53), (630.0, 0.64)),
            ((81.0, 12.2), (24.0, 15.8)),
        ] {
            let mut t = Trial::<Wait>::new();
            let waits = run(&mut t, 500, spin, sleep);
            assert!(share(&waits, Wait::Spin) > 0.95, "{spin:?}: {waits:?}");
        }
    }

    #[test]
    fn sleeping_that_saves_little_cpu_or_costs_throughput_loses() {
        // 5% less CPU per bio is not worth waking for: within the noise.
        let mut t = Trial::<Wait>::new();
        let waits = run(&mut t, 300, (100.0, 5.0), (100.0, 4.75));
        assert!(share(&waits, Wait::Spin) > 0.95);
        // Half the CPU, but 20% of the throughput gone: too much.
        let mut t = Trial::<Wait>::new();
        let waits = run(&mut t, 300, (100.0, 5.0), (80.0, 2.5));
        assert!(share(&waits, Wait::Spin) > 0.95);
    }

    #[test]
    fn a_new_request_reply_client_is_spun_for_soon_after_a_deep_queue() {
        // QD32, then QD1 on the same reactor: the rate falls by half in
        // the sleeping epochs, which brings the next try of the spin
        // forward, and the spin wins it.
        let mut t = Trial::<Wait>::new();
        run(&mut t, 500, (205.6, 4.75), (192.9, 3.69));
        assert_eq!(t.way(), Wait::Sleep);
        let waits = run(&mut t, 30, (43.6, 22.6), (20.1, 19.3));
        let first_spin = waits.iter().position(|&w| w == Wait::Spin).unwrap();
        assert!(first_spin <= 2, "{waits:?}");
        // Then only the tries sleep: two in the last 20 epochs (the first
        // FIRST_EVERY after the change, the next twice that later).
        assert!(share(&waits[10..], Wait::Spin) >= 0.9, "{waits:?}");
    }

    #[test]
    fn an_idle_or_sparse_epoch_starts_the_weighing_over_from_the_spin() {
        let mut t = Trial::<Wait>::new();
        run(&mut t, 500, (205.6, 4.75), (192.9, 3.69));
        assert_eq!(t.way(), Wait::Sleep);
        // A client that left: 2 ms with a handful of bios.
        assert_eq!(
            t.end_epoch(Epoch {
                wall: EPOCH,
                cpu: Duration::from_micros(30),
                ios: 3,
            }),
            Wait::Spin
        );
        // The next deep-queue client is weighed afresh: sleeping is tried
        // within Wait::FIRST_EVERY epochs.
        let waits = run(
            &mut t,
            Wait::FIRST_EVERY as usize + 1,
            (205.6, 4.75),
            (192.9, 3.69),
        );
        assert!(waits.contains(&Wait::Sleep), "{waits:?}");
    }
}
