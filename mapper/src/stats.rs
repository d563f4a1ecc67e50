//! A mapped device's I/O statistics (dm-stats' counters and `--histogram`).
//!
//! Each reactor's channel to a device counts into its own [`Shard`]: one
//! writer per shard, so a count is a relaxed load and store (no locked
//! read-modify-write), and nothing on the I/O path locks or allocates. A
//! reader sums every shard ([`DevStats::snapshot`]); a count it reads may lag
//! the reactor by the I/Os completing at that instant, never more.
//!
//! Counted on completion, by operation: I/Os and bytes. Errors are counted
//! on completion with a status other than OK. Latency (submit to completion)
//! is measured only while the device's histograms are switched on
//! (`DevStats::set_histogram_flag`): timing costs two clock reads per I/O.
//!
//! Latency buckets are log-linear, as HdrHistogram's and dm-stats'
//! `--histogram`: [`SUB`] buckets per power of two from 1 µs, up to
//! 2^[`OCTAVES`] µs (about 134 s), with one bucket below 1 µs and one above.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use udm_core::{Op, Status};

/// Operations counted apart, indexed by [`Op`] as `u8`: read, write, flush,
/// discard, write-zeroes.
pub const OPS: usize = 5;
/// Sub-buckets per power of two.
pub const SUB: usize = 4;
/// Powers of two covered from 1 µs.
pub const OCTAVES: usize = 27;
/// Buckets per histogram: below 1 µs, the log-linear ones, and overflow.
pub const BUCKETS: usize = 1 + OCTAVES * SUB + 1;

/// The histogram bucket of a latency in nanoseconds.
#[inline]
pub fn bucket(ns: u64) -> usize {
    // In quarter microseconds: the first log-linear bucket is [4, 5).
    let q = ns / 250;
    if q < 4 {
        return 0;
    }
    let k = 63 - q.leading_zeros() as usize; // floor(log2 q) >= 2
    let i = 1 + (k - 2) * SUB + ((q >> (k - 2)) & (SUB as u64 - 1)) as usize;
    i.min(BUCKETS - 1)
}

/// The exclusive upper bound of bucket `i` in nanoseconds (`None` for the
/// overflow bucket, which has none).
pub fn bucket_upper_ns(i: usize) -> Option<u64> {
    if i == 0 {
        return Some(1000);
    }
    if i >= BUCKETS - 1 {
        return None;
    }
    let k = (i - 1) / SUB;
    let sub = ((i - 1) % SUB) as u64;
    Some(250 * (1u64 << k) * (SUB as u64 + sub + 1))
}

/// Adds `n` to a counter only this thread writes: a relaxed load and
/// store (readers see the old or the new value, never a torn one).
#[inline(always)]
fn bump(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// I/Os and bytes of one operation.
#[derive(Default)]
#[repr(C)]
struct OpCount {
    ios: AtomicU64,
    bytes: AtomicU64,
}

/// One operation's latency histogram.
struct Hist {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for Hist {
    fn default() -> Hist {
        Hist {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

/// One reactor's counts for one device; written by that reactor only.
pub struct Shard {
    ops: [OpCount; OPS],
    /// Completions with an error status. (Counted on a branch not taken
    /// on the fast path: a per-status array indexed by every completion
    /// costs the index arithmetic on each.)
    errors: AtomicU64,
    hist: [Hist; OPS],
    /// Where [`Shard::now_ns`] counts from.
    epoch: Instant,
}

impl Default for Shard {
    fn default() -> Shard {
        Shard {
            ops: Default::default(),
            errors: AtomicU64::new(0),
            hist: Default::default(),
            epoch: Instant::now(),
        }
    }
}

impl Shard {
    /// Nanoseconds since the shard was made (the monotonic clock; vDSO).
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Counts a completed I/O: `op`, `bytes`, and its status. Called on
    /// the shard's reactor only.
    #[inline(always)]
    pub fn complete(&self, op: Op, bytes: u32, status: Status) {
        let c = &self.ops[op as usize];
        bump(&c.ios, 1);
        bump(&c.bytes, bytes as u64);
        if status != Status::Ok {
            bump(&self.errors, 1);
        }
    }

    /// Records a latency of `ns` for `op`. Called on the shard's reactor only.
    #[inline]
    pub fn latency(&self, op: Op, ns: u64) {
        let h = &self.hist[op as usize];
        bump(&h.buckets[bucket(ns)], 1);
        bump(&h.sum_ns, ns);
    }

    fn add_to(&self, s: &mut Snapshot) {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (i, c) in self.ops.iter().enumerate() {
            s.ios[i] = s.ios[i].wrapping_add(r(&c.ios));
            s.bytes[i] = s.bytes[i].wrapping_add(r(&c.bytes));
        }
        s.errors = s.errors.wrapping_add(r(&self.errors));
        for (o, h) in self.hist.iter().enumerate() {
            for (b, v) in h.buckets.iter().enumerate() {
                s.hist[o][b] = s.hist[o][b].wrapping_add(r(v));
            }
            s.sum_ns[o] = s.sum_ns[o].wrapping_add(r(&h.sum_ns));
        }
    }
}

/// A device's counts at one moment, summed over its reactors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Completed I/Os per operation (index: `Op as usize`).
    pub ios: [u64; OPS],
    /// Bytes of the completed I/Os per operation.
    pub bytes: [u64; OPS],
    /// Completions with an error status.
    pub errors: u64,
    /// Latency histograms per operation ([`bucket`]); all zero while timing
    /// is off.
    pub hist: [[u64; BUCKETS]; OPS],
    /// Sum of the timed latencies per operation, in nanoseconds.
    pub sum_ns: [u64; OPS],
}

impl Default for Snapshot {
    fn default() -> Snapshot {
        Snapshot {
            ios: [0; OPS],
            bytes: [0; OPS],
            errors: 0,
            hist: [[0; BUCKETS]; OPS],
            sum_ns: [0; OPS],
        }
    }
}

impl Snapshot {
    /// The counts since `base` (an earlier snapshot of the same device).
    pub fn since(&self, base: &Snapshot) -> Snapshot {
        let mut s = self.clone();
        for o in 0..OPS {
            s.ios[o] = s.ios[o].wrapping_sub(base.ios[o]);
            s.bytes[o] = s.bytes[o].wrapping_sub(base.bytes[o]);
            s.sum_ns[o] = s.sum_ns[o].wrapping_sub(base.sum_ns[o]);
            for b in 0..BUCKETS {
                s.hist[o][b] = s.hist[o][b].wrapping_sub(base.hist[o][b]);
            }
        }
        s.errors = s.errors.wrapping_sub(base.errors);
        s
    }
}

/// A device's statistics: its reactors' shards, the baseline of the last
/// clear, and whether latency is timed.
#[derive(Default)]
pub struct DevStats {
    shards: Mutex<Vec<Arc<Shard>>>,
    base: Mutex<Snapshot>,
    histogram: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DevStats {
    /// A new shard for a reactor's channel (counted from now on).
    pub(crate) fn shard(&self) -> Arc<Shard> {
        let s = Arc::new(Shard::default());
        lock(&self.shards).push(s.clone());
        s
    }

    /// Whether latency is timed.
    pub fn histogram(&self) -> bool {
        self.histogram.load(Ordering::Relaxed)
    }

    pub(crate) fn set_histogram_flag(&self, on: bool) {
        self.histogram.store(on, Ordering::Relaxed);
    }

    /// Every count since the device was created (monotonic: what metrics
    /// export).
    pub fn total(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for sh in lock(&self.shards).iter() {
            sh.add_to(&mut s);
        }
        s
    }

    /// The counts since the last [`DevStats::clear`] (or creation).
    pub fn snapshot(&self) -> Snapshot {
        let base = lock(&self.base).clone();
        self.total().since(&base)
    }

    /// Starts [`DevStats::snapshot`]'s counts again from zero. The totals
    /// ([`DevStats::total`]) are not reset.
    pub fn clear(&self) {
        let t = self.total();
        *lock(&self.base) = t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_four_per_power_of_two_from_one_microsecond() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(999), 0);
        assert_eq!(bucket(1000), 1);
        assert_eq!(bucket(1249), 1);
        assert_eq!(bucket(1250), 2);
        assert_eq!(bucket(1500), 3);
        assert_eq!(bucket(1750), 4);
        assert_eq!(bucket(1999), 4);
        assert_eq!(bucket(2000), 5);
        assert_eq!(bucket(2499), 5);
        assert_eq!(bucket(2500), 6);
        assert_eq!(bucket(4000), 9);
        // 100 ms: 2^16 µs = 65.5 ms <= 100 ms < 2^17 µs; sub-bucket 1
        // ([81.9 ms, 98.3 ms)) or 2 ([98.3, 114.7)).
        assert_eq!(bucket(100_000_000), 1 + 16 * SUB + 2);
        // 100 s is inside; 2^27 µs and beyond overflow.
        assert!(bucket(100_000_000_000) < BUCKETS - 1);
        assert_eq!(bucket(134_217_728_000), BUCKETS - 1);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn every_latency_lies_below_its_buckets_upper_bound_and_at_or_above_the_previous() {
        let mut ns = 1;
        while ns < 200_000_000_000u64 {
            for v in [ns - 1, ns, ns + 1] {
                let b = bucket(v);
                if let Some(u) = bucket_upper_ns(b) {
                    assert!(v < u, "{v} ns in bucket {b} below {u}");
                }
                if b > 0 {
                    let l = bucket_upper_ns(b - 1).unwrap();
                    assert!(v >= l, "{v} ns in bucket {b} at or above {l}");
                }
            }
            ns = ns * 9 / 7 + 1;
        }
        // The bounds grow by a quarter of the octave's base.
        assert_eq!(bucket_upper_ns(1), Some(1250));
        assert_eq!(bucket_upper_ns(4), Some(2000));
        assert_eq!(bucket_upper_ns(5), Some(2500));
        assert_eq!(bucket_upper_ns(BUCKETS - 1), None);
    }

    #[test]
    fn shards_sum_and_clear_starts_the_snapshot_again() {
        let d = DevStats::default();
        let (a, b) = (d.shard(), d.shard());
        a.complete(Op::Read, 4096, Status::Ok);
        b.complete(Op::Read, 512, Status::Ok);
        b.complete(Op::Write, 1024, Status::IoErr);
        a.latency(Op::Read, 1100);
        let s = d.snapshot();
        assert_eq!(s.ios[Op::Read as usize], 2);
        assert_eq!(s.bytes[Op::Read as usize], 4608);
        assert_eq!(s.ios[Op::Write as usize], 1);
        assert_eq!(s.errors, 1);
        assert_eq!(s.hist[Op::Read as usize][1], 1);
        d.clear();
        assert_eq!(d.snapshot(), Snapshot::default());
        a.complete(Op::Flush, 0, Status::Ok);
        assert_eq!(d.snapshot().ios[Op::Flush as usize], 1);
        assert_eq!(d.total().ios[Op::Read as usize], 2);
    }
}
