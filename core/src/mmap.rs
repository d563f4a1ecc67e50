//! [`Mmap`]: a memory mapping that udm owns and unmaps once, when dropped.
//!
//! The RAM disk's memory, a ublk queue's buffers and the kernel's descriptor
//! array it shares with the driver, and the tests' guest memory are all
//! mappings made here. The type hands out the mapping's address and
//! nothing else: the bytes are reached through raw pointers, because the
//! kernel, another process or another reactor may change them at any time,
//! and whoever reads or writes them synchronises that as the protocol in
//! use says.

use std::os::fd::RawFd;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A mapping of `len` bytes made by `mmap(2)` at an address the kernel
/// chose, unmapped when dropped. Never empty.
#[derive(Debug)]
pub struct Mmap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an Mmap owns its mapping: nothing else unmaps it, and dropping it
// on another thread unmaps it there as well as here. It gives out only the
// address; every access to the bytes goes through raw pointers, so keeping
// concurrent accesses apart is the users' job, as for any memory shared
// with the kernel or another process.
unsafe impl Send for Mmap {}
// SAFETY: as above; `&Mmap` allows nothing but reading the address and
// length and giving the kernel advice about the pages.
unsafe impl Sync for Mmap {}

impl Mmap {
    /// `len` bytes of anonymous memory: private, read-write, zero until
    /// written, and not charged to swap up front (`MAP_NORESERVE`): the
    /// kernel backs a page at its first write.
    pub fn anon(len: usize) -> Result<Mmap> {
        Mmap::map(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }

    /// `len` bytes of what `fd` maps from byte `off` on, with `mmap(2)`'s
    /// protection (`PROT_*`) and flags (`MAP_SHARED` or `MAP_PRIVATE`, and
    /// any others, e.g. `MAP_POPULATE`). `MAP_FIXED` is refused: the kernel
    /// chooses the address, so no existing mapping is replaced.
    pub fn fd(fd: RawFd, off: u64, len: usize, prot: i32, flags: i32) -> Result<Mmap> {
        let off = libc::off_t::try_from(off)
            .map_err(|_| Error::invalid(format!("mmap: offset {off} is out of range")))?;
        Mmap::map(len, prot, flags, fd, off)
    }

    fn map(len: usize, prot: i32, flags: i32, fd: RawFd, off: libc::off_t) -> Result<Mmap> {
        if len == 0 {
            return Err(Error::invalid("mmap: a mapping needs at least one byte"));
        }
        if flags & libc::MAP_FIXED != 0 {
            return Err(Error::invalid(
                "mmap: MAP_FIXED would replace whatever is mapped there",
            ));
        }
        // SAFETY: without MAP_FIXED the kernel places the mapping where
        // nothing is mapped, so no memory of ours changes; a bad descriptor,
        // offset or length only makes the call fail, which is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, off) };
        if p == libc::MAP_FAILED {
            return Err(Error::os(
                format!("mapping {len} bytes"),
                std::io::Error::last_os_error(),
            ));
        }
        match NonNull::new(p.cast::<u8>()) {
            Some(ptr) => Ok(Mmap { ptr, len }),
            // Only with an mmap_min_addr of 0: unreachable in practice, but
            // a null mapping is not one we can hand out.
            None => {
                // SAFETY: the mapping just made, not yet given to anyone.
                unsafe { libc::munmap(p, len) };
                Err(Error::new(
                    crate::ErrorKind::Os,
                    "mmap: the kernel mapped address 0",
                ))
            }
        }
    }

    /// The first byte. Valid for [`len`](Mmap::len) bytes while the Mmap
    /// lives; what may be read or written there, and when, is the
    /// protection's and the users' business.
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes mapped.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Advice about the whole mapping (`madvise(2)`, `MADV_*`), e.g.
    /// `MADV_NOHUGEPAGE`, or `MADV_POPULATE_WRITE` to back every page now.
    /// Advice that throws the bytes away (`MADV_DONTNEED`, `MADV_FREE`,
    /// `MADV_REMOVE`, ...) is refused: only the users' writes change them
    /// (a user that means to zero whole pages calls [`Mmap::discard`]).
    pub fn advise(&self, advice: i32) -> Result<()> {
        if DISCARDS.contains(&advice) {
            return Err(Error::invalid(format!(
                "madvise({advice}) would discard the mapping's bytes"
            )));
        }
        // SAFETY: the range is exactly this live mapping, and the advice
        // left (discarding advice is refused above) changes at most which
        // pages are backed and how, never the bytes or the address space.
        if unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, advice) } != 0 {
            return Err(Error::os(
                format!("madvise({advice}) of {} bytes", self.len),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

impl Mmap {
    /// Gives the memory of the `len` bytes from `off` back to the kernel
    /// (`MADV_DONTNEED`): they read as zeroes afterwards, in a private
    /// anonymous mapping ([`Mmap::anon`]), and take memory again only when
    /// written. `off` and `len` must be multiples of the system's page size
    /// and inside the mapping (else an `Invalid` error, and nothing
    /// changes). What a RAM disk's discard does with whole pages.
    ///
    /// # Safety
    /// This is a write of zeroes to the range (for an anonymous mapping; a
    /// shared mapping of a file reads the file again): the caller must be
    /// entitled to change those bytes now, as for any store through
    /// [`Mmap::as_ptr`], and nothing may hold a Rust reference into them.
    pub unsafe fn discard(&self, off: usize, len: usize) -> Result<()> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        if !off.is_multiple_of(page)
            || !len.is_multiple_of(page)
            || off.checked_add(len).is_none_or(|e| e > self.len)
        {
            return Err(Error::invalid(format!(
                "discard of {len} bytes at {off}: not whole pages of {page} bytes inside the \
                 mapping of {}",
                self.len
            )));
        }
        if len == 0 {
            return Ok(());
        }
        // SAFETY: whole pages inside this live mapping; changing their bytes
        // to zero is the caller's to allow (see # Safety).
        let rc =
            unsafe { libc::madvise(self.ptr.as_ptr().add(off).cast(), len, libc::MADV_DONTNEED) };
        if rc != 0 {
            return Err(Error::os(
                format!("madvise(MADV_DONTNEED) of {len} bytes at {off}"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// The advice after which the pages read differently (zero, or poisoned).
const DISCARDS: [i32; 5] = [
    libc::MADV_DONTNEED,
    libc::MADV_DONTNEED_LOCKED,
    libc::MADV_FREE,
    libc::MADV_REMOVE,
    libc::MADV_HWPOISON,
];

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned, and only here are
        // they unmapped; whoever took the address with `as_ptr` stops using
        // it before the Mmap goes (the owners keep the Mmap as long as any
        // I/O or peer uses the memory).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::Mmap;
    use crate::ErrorKind;
    use std::fs::File;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::{AsRawFd, FromRawFd};

    fn memfd(name: &std::ffi::CStr) -> File {
        // SAFETY: a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor that only this File owns.
        unsafe { File::from_raw_fd(fd) }
    }

    #[test]
    fn anonymous_memory_reads_zero_and_keeps_what_is_written() {
        let m = Mmap::anon(3 * 4096 + 1).unwrap();
        assert_eq!(m.len(), 3 * 4096 + 1);
        assert!(!m.is_empty());
        assert_eq!(m.as_ptr() as usize % 4096, 0, "page-aligned");
        // SAFETY: inside the live, read-write mapping; nothing else uses it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) };
        assert!(bytes.iter().all(|&b| b == 0));
        bytes[4096..8192].fill(0x5a);
        bytes[3 * 4096] = 7;
        // SAFETY: as above.
        let again = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert!(again[4096..8192].iter().all(|&b| b == 0x5a));
        assert_eq!((again[4095], again[8192], again[3 * 4096]), (0, 0, 7));
    }

    #[test]
    fn a_zero_or_impossible_length_is_an_error_not_a_panic() {
        let e = Mmap::anon(0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid);
        assert_eq!(e.to_string(), "mmap: a mapping needs at least one byte");
        let e = Mmap::anon(usize::MAX).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Os, "{e}");
        assert!(e
            .to_string()
            .starts_with("mapping 18446744073709551615 bytes: "));
        let f = memfd(c"udm-mmap-bad");
        let e = Mmap::fd(
            f.as_raw_fd(),
            u64::MAX,
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("mmap: offset {} is out of range", u64::MAX)
        );
        let e = Mmap::fd(-1, 0, 4096, libc::PROT_READ, libc::MAP_SHARED).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Os, "a bad descriptor: {e}");
        let fixed = libc::MAP_SHARED | libc::MAP_FIXED;
        let e = Mmap::fd(f.as_raw_fd(), 0, 4096, libc::PROT_READ, fixed).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
    }

    #[test]
    fn a_shared_mapping_of_a_file_sees_its_writes_and_the_file_sees_the_mappings() {
        let mut f = memfd(c"udm-mmap-shared");
        f.set_len(2 * 4096).unwrap();
        f.write_all(b"from the file").unwrap();
        let flags = libc::MAP_SHARED | libc::MAP_POPULATE;
        let m = Mmap::fd(f.as_raw_fd(), 4096, 4096, libc::PROT_READ, flags).unwrap();
        f.seek(SeekFrom::Start(4096)).unwrap();
        f.write_all(b"page two").unwrap();
        // SAFETY: inside the live mapping, read only.
        let seen = unsafe { std::slice::from_raw_parts(m.as_ptr(), 8) };
        assert_eq!(seen, b"page two", "the offset is honoured");

        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let w = Mmap::fd(f.as_raw_fd(), 0, 4096, rw, libc::MAP_SHARED).unwrap();
        // SAFETY: inside the live read-write mapping; nothing else writes.
        unsafe { std::ptr::copy_nonoverlapping(b"mapped".as_ptr(), w.as_ptr(), 6) };
        let mut got = [0u8; 13];
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"mappedhe file");
    }

    #[test]
    fn advice_is_taken_and_advice_that_discards_or_is_unknown_is_an_error() {
        let m = Mmap::anon(1 << 20).unwrap();
        m.advise(libc::MADV_NOHUGEPAGE).unwrap();
        // SAFETY: inside the live read-write mapping; nothing else uses it.
        unsafe { m.as_ptr().write(9) };
        let e = m.advise(libc::MADV_DONTNEED).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid);
        assert_eq!(
            e.to_string(),
            "madvise(4) would discard the mapping's bytes"
        );
        // SAFETY: as above.
        assert_eq!(unsafe { m.as_ptr().read() }, 9, "the byte is kept");
        let e = m.advise(-1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Os);
        assert!(
            e.to_string().starts_with("madvise(-1) of 1048576 bytes: "),
            "{e}"
        );
    }

    #[test]
    fn discarded_pages_read_zero_and_the_rest_is_kept() {
        let m = Mmap::anon(4 * 4096).unwrap();
        // SAFETY: inside the live read-write mapping; nothing else uses it.
        unsafe { std::ptr::write_bytes(m.as_ptr(), 0x77, 4 * 4096) };
        // SAFETY: nothing relies on the bytes; no references into them.
        unsafe {
            m.discard(4096, 2 * 4096).unwrap();
            // Not whole pages inside the mapping: refused, nothing changes.
            for (off, len) in [
                (100, 4096),
                (0, 100),
                (4096, 4 * 4096),
                (usize::MAX - 4095, 4096),
            ] {
                assert_eq!(m.discard(off, len).unwrap_err().kind(), ErrorKind::Invalid);
            }
        }
        // SAFETY: as above, read only.
        let b = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert!(b[..4096].iter().all(|&x| x == 0x77));
        assert!(b[4096..3 * 4096].iter().all(|&x| x == 0));
        assert!(b[3 * 4096..].iter().all(|&x| x == 0x77));
    }

    #[test]
    fn dropping_unmaps() {
        // A memfd's name shows in /proc/self/maps, so only this mapping
        // is looked for, whatever the other tests map meanwhile.
        let f = memfd(c"udm-mmap-drop-test");
        f.set_len(4096).unwrap();
        let mapped = || {
            std::fs::read_to_string("/proc/self/maps")
                .unwrap()
                .contains("/memfd:udm-mmap-drop-test")
        };
        let m = Mmap::fd(f.as_raw_fd(), 0, 4096, libc::PROT_READ, libc::MAP_SHARED).unwrap();
        assert!(mapped());
        let moved = std::thread::spawn(move || m).join().unwrap();
        assert!(mapped(), "moving it to another thread and back keeps it");
        drop(moved);
        assert!(!mapped());
    }
}
