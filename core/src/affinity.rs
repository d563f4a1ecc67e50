//! The calling thread's CPU affinity: a thin safe layer over
//! `sched_getaffinity`/`sched_setaffinity`. Reactors care where they run:
//! a pinned reactor owns its CPU (SPDK's model), and one confined to a
//! single CPU shares it with the io-wq workers that complete its I/O (see
//! [`crate::Ring::submit_and_wait`]). Where data sits matters too:
//! [`last_level_cache`] tells the devices and targets whose copies choose
//! between cached and streamed stores how much the caches hold.

use std::io;

/// CPUs a `cpu_set_t` can name; higher numbers are refused.
pub const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

/// The CPUs the calling thread may run on, ascending.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data, for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live cpu_set_t of the size passed; the kernel
    // writes at most that many bytes.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET only reads the set, at indices below CPU_SETSIZE.
    Ok((0..MAX_CPUS)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Lets the calling thread (and the threads it starts from now on) run on
/// `cpus` only. A CPU number of [`MAX_CPUS`] or more is refused (EINVAL).
pub fn set_allowed_cpus(cpus: &[usize]) -> io::Result<()> {
    if cpus.iter().any(|&c| c >= MAX_CPUS) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c` < CPU_SETSIZE (checked above), so CPU_SET writes
        // inside the set.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a live cpu_set_t of the size passed; the call reads it
    // and changes only this thread's affinity.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The size in bytes of the last-level cache of the CPU the process
/// started on, read once from sysfs (glibc's `_SC_LEVEL3_CACHE_SIZE`
/// reports 384 MiB for a 32 MiB L3 on an AMD EPYC guest); `None` where
/// sysfs says nothing.
pub fn last_level_cache() -> Option<u64> {
    static LLC: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *LLC.get_or_init(|| {
        let index = |i: u32| -> Option<(u32, u64)> {
            let d = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
            let level = std::fs::read_to_string(format!("{d}/level")).ok()?;
            let size = std::fs::read_to_string(format!("{d}/size")).ok()?;
            let size = size.trim();
            let (n, unit) = match size.strip_suffix('K') {
                Some(n) => (n, 1u64 << 10),
                None => match size.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (size, 1),
                },
            };
            Some((level.trim().parse().ok()?, n.parse::<u64>().ok()? * unit))
        };
        (0..16).filter_map(index).max().map(|(_, bytes)| bytes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_runs_where_it_is_allowed_to() {
        std::thread::spawn(|| {
            let all = allowed_cpus().unwrap();
            assert!(!all.is_empty());
            set_allowed_cpus(&all[..1]).unwrap();
            assert_eq!(allowed_cpus().unwrap(), all[..1]);
            // SAFETY: sched_getcpu takes no arguments.
            assert_eq!(unsafe { libc::sched_getcpu() }, all[0] as i32);
            let e = set_allowed_cpus(&[MAX_CPUS]).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        })
        .join()
        .unwrap();
    }
}
