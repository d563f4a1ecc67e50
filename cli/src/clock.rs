//! A cheap clock for per-I/O latency: the TSC where it is invariant (as fio's
//! `clocksource=cpu`), calibrated against the monotonic clock; the monotonic
//! clock elsewhere.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

struct Cal {
    base: Instant,
    /// ns = ticks * mult >> 32
    mult: u64,
    tsc: bool,
}

static CAL: OnceLock<Cal> = OnceLock::new();

fn cal() -> &'static Cal {
    CAL.get_or_init(|| {
        let base = Instant::now();
        #[cfg(target_arch = "x86_64")]
        {
            let invariant = std::fs::read_to_string("/proc/cpuinfo")
                .map(|s| s.contains("constant_tsc") && s.contains("nonstop_tsc"))
                .unwrap_or(false);
            if invariant {
                let t0 = ticks_raw();
                let i0 = Instant::now();
                std::thread::sleep(Duration::from_millis(20));
                let t1 = ticks_raw();
                let ns = i0.elapsed().as_nanos() as u64;
                let dt = t1.saturating_sub(t0).max(1);
                return Cal {
                    base,
                    mult: ((ns as u128) << 32)
                        .checked_div(dt as u128)
                        .unwrap_or(1 << 32) as u64,
                    tsc: true,
                };
            }
        }
        Cal {
            base,
            mult: 1 << 32,
            tsc: false,
        }
    })
}

#[inline]
fn ticks_raw() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86_64.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Calibrates the clock (call once before timing anything).
pub fn init() {
    let _ = cal();
}

/// Current time in clock ticks.
#[inline]
pub fn now() -> u64 {
    let c = cal();
    if c.tsc {
        ticks_raw()
    } else {
        c.base.elapsed().as_nanos() as u64
    }
}

/// Converts a tick interval to nanoseconds.
#[inline]
pub fn to_ns(ticks: u64) -> u64 {
    ((ticks as u128 * cal().mult as u128) >> 32) as u64
}

/// Ticks in `d`.
pub fn ticks_in(d: Duration) -> u64 {
    let ns = d.as_nanos();
    ((ns << 32) / cal().mult.max(1) as u128) as u64
}
