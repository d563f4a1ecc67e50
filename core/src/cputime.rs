//! CPU time, for figures per CPU-second: the calling thread's for a
//! reactor weighing its spin ([`crate::ReactorConfig::weigh_spin`]), `udm
//! bench`'s job threads and the cipher's throughput test; the process's for
//! `auto` dispatch weighing queued against direct
//! ([`crate::dispatch::AutoTrial`]), whose direct reads on a file may run on
//! io_uring's worker threads.

use std::time::Duration;

/// The calling thread's CPU time so far: (user, system), from
/// `getrusage(RUSAGE_THREAD)`; zero if the kernel refuses.
pub fn thread_cpu() -> (Duration, Duration) {
    rusage(libc::RUSAGE_THREAD)
}

/// The process's CPU time so far, all its threads (io_uring's io-wq
/// workers included): (user, system), from `getrusage(RUSAGE_SELF)`; zero
/// if the kernel refuses.
pub fn process_cpu() -> (Duration, Duration) {
    rusage(libc::RUSAGE_SELF)
}

fn rusage(who: libc::c_int) -> (Duration, Duration) {
    // SAFETY: rusage is plain data, for which all zeroes is valid; the
    // kernel writes one into `ru`, which is live and ours.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut ru);
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

    #[test]
    fn the_process_cpu_clock_counts_another_threads_work() {
        let (u, s) = process_cpu();
        // A thread that works until its own clock shows 5 ms.
        std::thread::spawn(|| {
            let (u, s) = thread_cpu();
            while {
                let (u2, s2) = thread_cpu();
                u2 + s2 < u + s + Duration::from_millis(5)
            } {
                std::hint::spin_loop();
            }
        })
        .join()
        .unwrap();
        let (u2, s2) = process_cpu();
        assert!(u2 + s2 >= u + s + Duration::from_millis(5));
    }
}
