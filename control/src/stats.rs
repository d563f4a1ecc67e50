//! `stats NAME [--histogram] [--clear]`: a mapped device's I/O statistics
//! (dm-stats' counters and latency histogram), as a verb and its report.

use std::fmt;

use serde::{Deserialize, Serialize};
use udm_core::{Error, Op};
use udm_mapper::stats::{bucket_upper_ns, Snapshot, BUCKETS};
use udm_mapper::MappedDevice;

use crate::verbs::Control;

/// The operations the statistics count apart, in `Op` order.
pub const OP_NAMES: [&str; 5] = ["read", "write", "flush", "discard", "write_zeroes"];

/// One histogram bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Exclusive upper bound in nanoseconds (`None`: the overflow bucket).
    pub le_ns: Option<u64>,
    /// I/Os in it.
    pub count: u64,
}

/// One operation's latency histogram: its non-empty buckets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpHistogram {
    /// `read`, `write`, `flush`, `discard` or `write_zeroes`.
    pub op: String,
    /// Timed I/Os.
    pub count: u64,
    /// Their latencies' sum, in nanoseconds.
    pub sum_ns: u64,
    /// The non-empty buckets, in order (log-linear: 4 per power of two
    /// from 1 µs).
    pub buckets: Vec<Bucket>,
}

/// A mapped device's statistics (since creation or the last clear).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStats {
    /// The device.
    pub name: String,
    /// Completed reads.
    pub reads: u64,
    /// Reads merged (udm merges none: always 0, as dm-stats reports it).
    pub read_merges: u64,
    /// Sectors read.
    pub read_sectors: u64,
    /// Completed writes.
    pub writes: u64,
    /// Writes merged (always 0).
    pub write_merges: u64,
    /// Sectors written.
    pub write_sectors: u64,
    /// Completed discards.
    pub discards: u64,
    /// Sectors discarded.
    pub discard_sectors: u64,
    /// Completed write-zeroes.
    pub write_zeroes: u64,
    /// Sectors zeroed.
    pub write_zeroes_sectors: u64,
    /// Completed flushes.
    pub flushes: u64,
    /// I/Os in flight now.
    pub in_flight: u64,
    /// Completions with an error.
    pub errors: u64,
    /// Whether latency is timed (`message NAME 0 stats histogram on`).
    pub histogram_on: bool,
    /// Latency histograms, when asked for (`--histogram`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub histogram: Option<Vec<OpHistogram>>,
}

fn us(ns: u64) -> String {
    if ns >= 1_000_000_000 {
        format!("{}s", ns as f64 / 1e9)
    } else if ns >= 1_000_000 {
        format!("{}ms", ns as f64 / 1e6)
    } else {
        format!("{}us", ns as f64 / 1e3)
    }
}

impl fmt::Display for DeviceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Name:              {}", self.name)?;
        writeln!(
            f,
            "Reads:             {} (merged {}, sectors {})",
            self.reads, self.read_merges, self.read_sectors
        )?;
        writeln!(
            f,
            "Writes:            {} (merged {}, sectors {})",
            self.writes, self.write_merges, self.write_sectors
        )?;
        writeln!(
            f,
            "Discards:          {} (sectors {})",
            self.discards, self.discard_sectors
        )?;
        writeln!(
            f,
            "Write zeroes:      {} (sectors {})",
            self.write_zeroes, self.write_zeroes_sectors
        )?;
        writeln!(f, "Flushes:           {}", self.flushes)?;
        writeln!(f, "In flight:         {}", self.in_flight)?;
        writeln!(f, "Errors:            {}", self.errors)?;
        write!(
            f,
            "Latency timing:    {}",
            if self.histogram_on { "on" } else { "off" }
        )?;
        for h in self.histogram.iter().flatten() {
            if h.count == 0 {
                continue;
            }
            write!(
                f,
                "\n{} latency: {} I/Os, mean {}",
                h.op,
                h.count,
                us(h.sum_ns / h.count)
            )?;
            let mut lower = 0;
            for b in &h.buckets {
                // An empty bucket is listed only for its bound.
                match b.le_ns.filter(|_| b.count != 0) {
                    Some(u) => write!(f, "\n  [{}, {}): {}", us(lower), us(u), b.count)?,
                    None if b.le_ns.is_none() => {
                        write!(f, "\n  [{}, inf): {}", us(lower), b.count)?
                    }
                    None => {}
                }
                lower = b.le_ns.unwrap_or(lower);
            }
        }
        Ok(())
    }
}

/// The report of `snap` for device `name`.
pub(crate) fn report(
    name: &str,
    snap: &Snapshot,
    in_flight: u64,
    histogram_on: bool,
    histogram: bool,
) -> DeviceStats {
    let sectors = |op: Op| snap.bytes[op as usize] >> 9;
    let ios = |op: Op| snap.ios[op as usize];
    DeviceStats {
        name: name.to_string(),
        reads: ios(Op::Read),
        read_merges: 0,
        read_sectors: sectors(Op::Read),
        writes: ios(Op::Write),
        write_merges: 0,
        write_sectors: sectors(Op::Write),
        discards: ios(Op::Discard),
        discard_sectors: sectors(Op::Discard),
        write_zeroes: ios(Op::WriteZeroes),
        write_zeroes_sectors: sectors(Op::WriteZeroes),
        flushes: ios(Op::Flush),
        in_flight,
        errors: snap.errors,
        histogram_on,
        histogram: histogram.then(|| {
            OP_NAMES
                .iter()
                .enumerate()
                .map(|(o, name)| {
                    let mut lower_empty = Vec::new();
                    let mut buckets = Vec::new();
                    for (b, &count) in snap.hist[o].iter().enumerate().take(BUCKETS) {
                        // A bucket's lower bound is the previous one's
                        // upper: keep the empty bucket before a full one.
                        if count != 0 {
                            buckets.append(&mut lower_empty);
                            buckets.push(Bucket {
                                le_ns: bucket_upper_ns(b),
                                count,
                            });
                        } else {
                            lower_empty.clear();
                            if b + 1 < BUCKETS && snap.hist[o][b + 1] != 0 {
                                lower_empty.push(Bucket {
                                    le_ns: bucket_upper_ns(b),
                                    count: 0,
                                });
                            }
                        }
                    }
                    OpHistogram {
                        op: name.to_string(),
                        count: snap.hist[o].iter().sum(),
                        sum_ns: snap.sum_ns[o],
                        buckets,
                    }
                })
                .collect()
        }),
    }
}

/// The mapped device behind `d`.
pub(crate) fn as_mapped(d: &dyn udm_core::BlockDevice) -> Option<&MappedDevice> {
    d.as_any().downcast_ref::<MappedDevice>()
}

impl Control {
    /// `stats NAME [--histogram] [--clear]`: the counts since the device's
    /// creation or its last clear; with `histogram`, its latency
    /// histograms; with `clear`, its counts start again from zero after
    /// this report (as `dmsetup stats print --clear`).
    pub fn stats(&self, name: &str, histogram: bool, clear: bool) -> Result<DeviceStats, Error> {
        let d = self.registry().mapped(name)?;
        let Some(m) = as_mapped(&*d) else {
            return Err(Error::invalid(format!("'{name}' is not a mapped device")));
        };
        let st = m.stats();
        let snap = st.snapshot();
        if clear {
            st.clear();
        }
        let in_flight = m
            .inflight()
            .map_err(|e| e.context(format!("device '{name}'")))?;
        Ok(report(name, &snap, in_flight, st.histogram(), histogram))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_an_idle_device_are_zero_and_histograms_list_only_filled_buckets() {
        let c = Control::default();
        c.create("r", "ram:1M").unwrap();
        c.create("l", "0 2048 linear r 0").unwrap();
        let s = c.stats("l", true, false).unwrap();
        assert_eq!((s.reads, s.writes, s.errors, s.in_flight), (0, 0, 0, 0));
        assert!(s.histogram.unwrap().iter().all(|h| h.buckets.is_empty()));
        let e = c.stats("r", false, false).unwrap_err();
        assert!(e.to_string().contains("'r'"), "{e}");
        assert!(c.stats("nope", false, false).is_err());

        let mut snap = Snapshot::default();
        snap.hist[0][3] = 2; // [1.5 µs, 1.75 µs)
        snap.sum_ns[0] = 3200;
        let r = report("l", &snap, 0, true, true);
        let h = &r.histogram.as_ref().unwrap()[0];
        assert_eq!(
            h.buckets,
            vec![
                Bucket {
                    le_ns: Some(1500),
                    count: 0
                },
                Bucket {
                    le_ns: Some(1750),
                    count: 2
                }
            ]
        );
        let text = r.to_string();
        assert!(text.contains("read latency: 2 I/Os, mean 1.6us"), "{text}");
        assert!(text.contains("[1.5us, 1.75us): 2"), "{text}");
    }
}
