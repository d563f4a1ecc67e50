//! The calling thread's CPU time, for figures per CPU-second: a reactor
//! weighing its spin ([`crate::ReactorConfig::weigh_spin`]), `udm bench`'s
//! job threads, the cipher's throughput test.

use std::time::Duration;

/// The calling thread's CPU time so far: (user, system), from
/// `getrusage(RUSAGE_THREAD)`; zero if the kernel refuses.
pub fn thread_cpu() -> (Duration, Duration) {
    // SAFETY: rusage is plain data, for which all zeroes is valid; the
    // kernel writes one into `ru`, which is live and ours.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn the_thread_cpu_clock_runs_while_the_thread_works() {
        let (u, s) = thread_cpu();
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(5) {
            std::hint::spin_loop();
        }
        let (u2, s2) = thread_cpu();
        assert!(u2 + s2 > u + s);
    }
}
