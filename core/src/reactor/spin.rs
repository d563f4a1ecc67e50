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

/// Whether a way of waiting that scored `cheaper` beats the one that
/// scored `base`: [`KEEP_RATE`] of its throughput at [`SAVE_COST`] of its
/// CPU per bio or less.
fn saves(base: Score, cheaper: Score) -> bool {
    cheaper.rate >= KEEP_RATE * base.rate && cheaper.cost <= SAVE_COST * base.cost
}

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
        if saves(spin, sleep) {
            Wait::Sleep
        } else {
            Wait::Spin
        }
    }
}

/// How long a gathering sleep ([`Gather::Gather`]) goes on waiting, once a
/// completion has come, for more to come with it.
pub(crate) const GATHER_WAIT: Duration = Duration::from_micros(50);

/// How the sleeps of a sleeping epoch wait.
///
/// A sleeping reactor wakes for the first completion, and a client that
/// keeps many requests in flight costs a wakeup, a receive and a send per
/// request or two. Gathering goes on waiting for up to [`GATHER_WAIT`]
/// once a completion has come: the requests sent meanwhile come in one
/// receive and leave in one send, and the client, answered in batches,
/// wakes less too. A client with few requests in flight waits that long
/// for each answer instead, so gathering is weighed like the spin: tried
/// every few sleeping epochs and kept only where it scores better.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gather {
    /// Wake for the first completion.
    Plain,
    /// Wait up to [`GATHER_WAIT`] for more once one has come.
    Gather,
}

impl Way for Gather {
    const FIRST: Gather = Gather::Plain;
    const SECOND: Gather = Gather::Gather;
    const MIN_IOS: u64 = 64;
    /// Tried on the second sleeping epoch: sleeping epochs are rare until
    /// sleeping wins, and a deep queue's sleeps win by gathering.
    const FIRST_TRY: u32 = 1;
    const FIRST_EVERY: u32 = 8;
    const MAX_EVERY: u32 = 64;
    /// A few requests in flight lose two thirds of their rate gathering:
    /// such tries are spaced out further (an epoch in 256 at most).
    const CLEAR: f64 = 2.0;
    const MAX_EVERY_CLEAR: u32 = 256;
    const CHANGE: f64 = 3.0;

    fn verdict(plain: Score, gather: Score, _: Gather) -> Gather {
        if saves(plain, gather) {
            Gather::Gather
        } else {
            Gather::Plain
        }
    }
}

/// The two decisions of a weighed reactor: spin or sleep ([`Wait`]), and
/// whether a sleeping epoch's sleeps gather ([`Gather`]), a second trial
/// that runs on sleeping epochs alone. Sleeping is weighed against the
/// spin the way it sleeps best; so that one way's tries do not blur the
/// other trial's scores:
/// - a try of sleeping sleeps the way the second trial says, and counts
///   for both (a deep queue's first sleeps win by gathering);
/// - the epoch that confirms such a try sleeps as the try did, and counts
///   for the first trial alone;
/// - once sleeping won, the second trial's tries count for it alone, the
///   first trial waiting meanwhile.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    wait: Trial<Wait>,
    gather: Trial<Gather>,
    /// The ring takes a minimum wait (else sleeps never gather).
    can_gather: bool,
    /// Whether the current epoch's sleeps gather.
    gathering: bool,
}

impl Choice {
    pub(crate) fn new(can_gather: bool) -> Choice {
        Choice {
            wait: Trial::new(),
            gather: Trial::new(),
            can_gather,
            gathering: false,
        }
    }

    /// Whether the current epoch's sleeps gather.
    pub(crate) fn gathers(&self) -> bool {
        self.gathering
    }

    /// Ends the current epoch with what it measured; returns how the next
    /// one waits.
    pub(crate) fn end_epoch(&mut self, e: Epoch) -> Wait {
        let alone = !self.can_gather || self.wait.way() == Wait::Spin || self.wait.confirming();
        let next = if alone {
            self.wait.end_epoch(e)
        } else if self.wait.best() == Wait::Sleep && self.gather.way() != self.gather.best() {
            self.gather.end_epoch(e);
            self.wait.way()
        } else {
            self.gather.end_epoch(e);
            self.wait.end_epoch(e)
        };
        self.gathering = self.can_gather
            && next == Wait::Sleep
            && if self.wait.confirming() {
                self.gathering
            } else {
                self.gather.way() == Gather::Gather
            };
        next
    }
}

/// A reactor's running trial: the epoch's start and the decisions.
pub(crate) struct Weigh {
    choice: Cell<Choice>,
    /// When the epoch started: wall clock, thread CPU time, bios so far.
    start: Cell<(Instant, Duration, u64)>,
    /// When the epoch may end.
    end: Cell<Instant>,
    /// Whether this epoch sleeps at once (read on every adaptive turn).
    at_once: Cell<bool>,
    /// Whether this epoch's sleeps gather (read on every sleep).
    gathers: Cell<bool>,
}

impl Weigh {
    /// `can_gather`: the reactor's ring takes a minimum wait.
    pub(crate) fn new(bios: u64, can_gather: bool) -> Weigh {
        let now = Instant::now();
        Weigh {
            choice: Cell::new(Choice::new(can_gather)),
            start: Cell::new((now, thread_cpu(), bios)),
            end: Cell::new(now + EPOCH),
            at_once: Cell::new(false),
            gathers: Cell::new(false),
        }
    }

    /// Whether the current epoch's sleeps gather ([`Gather`]).
    #[inline]
    pub(crate) fn gathers(&self) -> bool {
        self.gathers.get()
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
        let mut choice = self.choice.get();
        let wait = choice.end_epoch(Epoch {
            wall: now.saturating_duration_since(t0),
            cpu: cpu.saturating_sub(c0),
            ios: bios.wrapping_sub(b0),
        });
        self.choice.set(choice);
        self.at_once.set(wait == Wait::Sleep);
        self.gathers.set(choice.gathers());
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

    /// Runs `n` epochs of a workload that scores `spin` spinning, `plain`
    /// sleeping and `gather` sleeping with gathering waits; returns each
    /// epoch's (wait, gathered).
    fn run_choice(
        c: &mut Choice,
        n: usize,
        spin: (f64, f64),
        plain: (f64, f64),
        gather: (f64, f64),
    ) -> Vec<(Wait, bool)> {
        (0..n)
            .map(|_| {
                let now = (c.wait.way(), c.gathers());
                assert!(!now.1 || now.0 == Wait::Sleep);
                let (k, us) = match now {
                    (Wait::Spin, _) => spin,
                    (Wait::Sleep, false) => plain,
                    (Wait::Sleep, true) => gather,
                };
                c.end_epoch(epoch(k, us));
                now
            })
            .collect()
    }

    fn gathered(epochs: &[(Wait, bool)]) -> f64 {
        epochs.iter().filter(|e| e.1).count() as f64 / epochs.len() as f64
    }

    // NBD at QD32 on the slower-memory boot (docs/benchmarks.md): the
    // spin, sleeping at once, and sleeping with gathering waits.
    const QD32: [(f64, f64); 3] = [(87.0, 11.3), (70.0, 10.3), (102.0, 4.2)];

    #[test]
    fn a_deep_queue_sleeps_and_gathers_its_requests() {
        let mut c = Choice::new(true);
        let e = run_choice(&mut c, 1000, QD32[0], QD32[1], QD32[2]);
        // Found at the second try of sleeping (the first sleeps plainly).
        let first = e.iter().position(|x| x.1).unwrap();
        assert!(first <= 8 + 16 + 1, "{first}: {:?}", &e[..40]);
        assert!(gathered(&e[200..]) > 0.95, "{:?}", &e[..200]);
        // Plain sleeping and the spin are still tried now and then.
        assert!(e[200..].contains(&(Wait::Sleep, false)));
        assert!(e[200..].iter().any(|&x| x.0 == Wait::Spin));
    }

    #[test]
    fn a_few_requests_in_flight_sleep_without_gathering() {
        // QD4: gathering waits for requests that do not come (a third of
        // the rate); tries of it lose clearly and are spaced out.
        let mut c = Choice::new(true);
        let e = run_choice(&mut c, 2000, (100.0, 10.0), (94.0, 8.3), (28.0, 11.0));
        assert!(e[100..].iter().filter(|x| x.0 == Wait::Sleep).count() > 1700);
        let tries = e[1000..].iter().filter(|x| x.1).count();
        assert!(
            tries <= 1000 / Gather::MAX_EVERY as usize + 1,
            "{tries} tries"
        );
    }

    #[test]
    fn a_request_reply_client_keeps_its_spin_whatever_gathering_scores() {
        let mut c = Choice::new(true);
        let e = run_choice(&mut c, 1000, (43.6, 22.6), (20.1, 19.3), (13.0, 24.0));
        assert!(e.iter().filter(|x| x.0 == Wait::Spin).count() > 970);
        assert!(gathered(&e) < 0.01);
    }

    #[test]
    fn without_a_minimum_wait_sleeps_never_gather() {
        let mut c = Choice::new(false);
        let e = run_choice(&mut c, 1000, QD32[0], QD32[1], QD32[2]);
        assert_eq!(gathered(&e), 0.0);
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
