//! The locked-memory limit that io_uring charges registered buffers to
//! (RLIMIT_MEMLOCK, unless the thread has CAP_IPC_LOCK), so that tests can
//! run a privileged process under it as an unprivileged udm would.

use std::io;

/// RLIMIT_MEMLOCK's soft limit in bytes; None when unlimited.
pub fn soft_limit() -> io::Result<Option<u64>> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the live rlimit it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut l) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((l.rlim_cur != libc::RLIM_INFINITY).then_some(l.rlim_cur))
}

/// Drops CAP_IPC_LOCK from the calling thread's effective set, so that
/// RLIMIT_MEMLOCK applies to it and to the threads it starts afterwards
/// (capabilities are per thread and inherited).
pub fn drop_ipc_lock() -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    // _LINUX_CAPABILITY_VERSION_3: two Data elements (64 capabilities).
    const V3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut h = Header {
        version: V3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget fills a version-3 header's two-element array for this
    // thread (pid 0); both live for the call.
    if unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    d[0].effective &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and the two-element array, both live.
    if unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
