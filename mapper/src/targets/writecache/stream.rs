//! Streaming (non-temporal) stores for the write path's per-block metadata.
//!
//! Why: at small cache blocks a write's metadata is a tenth of its bytes
//! (a 32-byte entry and a 16-byte image entry per 512-byte block), and an
//! ordinary store first reads its cache line from memory (a read for
//! ownership), so that metadata costs twice its size in memory traffic on
//! the thread that also copies the data. A new run fills whole lines that
//! nobody reads soon (the worker reads the image at commit; entries wait
//! for writeback), so streaming them skips the read.
//!
//! Streaming stores are weakly ordered, and Rust makes touching their
//! memory before the storing thread's `sfence` undefined behaviour: the
//! store functions are `unsafe`, and [`Fence`] (a guard that fences when
//! dropped, unwinding included) is how callers keep the contract. Other
//! architectures get plain stores and a no-op fence.

use super::entry::Entry;

/// Writes `e` to `dst` with streaming stores.
///
/// # Safety
/// This thread must [`fence`] before `dst` is accessed again, by any thread.
#[inline(always)]
pub(crate) unsafe fn entry(dst: &mut Entry, e: Entry) {
    #[cfg(target_arch = "x86_64")]
    {
        let w = e.to_words();
        let p = dst as *mut Entry as *mut i64;
        // SAFETY: `p` comes from `&mut Entry`, so it is valid for writes of
        // the entry's 32 bytes and 8-byte aligned (Entry holds a u64);
        // `to_words` is the entry's exact in-memory bytes (repr(C), no
        // padding: see Entry), so `dst` holds `e` once fenced, which the
        // caller guarantees happens before any access. SSE2 (and so movnti)
        // is part of x86_64.
        unsafe {
            for (i, &v) in w.iter().enumerate() {
                std::arch::x86_64::_mm_stream_si64(p.add(i), v as i64);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        *dst = e;
    }
}

/// Writes the 16 bytes `v` (two little-endian words) to `dst` with
/// streaming stores when `dst` is 8-byte aligned (an image block always
/// is), with plain stores otherwise.
///
/// # Safety
/// As [`entry`]: this thread must [`fence`] before `dst` is accessed again.
#[inline(always)]
pub(crate) unsafe fn bytes16(dst: &mut [u8; 16], v: [u8; 16]) {
    #[cfg(target_arch = "x86_64")]
    {
        let p = dst.as_mut_ptr() as *mut i64;
        if p.is_aligned() {
            let lo = i64::from_ne_bytes([v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]]);
            let hi = i64::from_ne_bytes([v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]]);
            // SAFETY: `p` comes from `&mut [u8; 16]`, valid for 16 bytes of
            // writes, and was just checked to be 8-byte aligned; any bytes
            // are a valid [u8; 16]; the caller fences before any access.
            unsafe {
                std::arch::x86_64::_mm_stream_si64(p, lo);
                std::arch::x86_64::_mm_stream_si64(p.add(1), hi);
            }
            return;
        }
    }
    *dst = v;
}

/// Orders every streaming store before it ahead of every later access (as
/// the release of the lock that publishes them).
#[inline(always)]
pub(crate) fn fence() {
    // SAFETY: sfence has no operands and no preconditions; SSE is part of
    // x86_64.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Fences when dropped: held across a batch of streaming stores, it
/// fences before the batch's memory can be touched, on unwinding too.
pub(crate) struct Fence;

impl Drop for Fence {
    #[inline(always)]
    fn drop(&mut self) {
        fence();
    }
}

#[cfg(test)]
mod tests {
    use super::super::entry::St;
    use super::*;

    #[test]
    fn a_streamed_entry_reads_back_as_written() {
        let e = Entry {
            ob: 0x0102_0304,
            seq: 0x1122_3344_5566_7788,
            born_ms: 77,
            prev: 5,
            next: 7,
            writes: 3,
            reads: 0xfffe,
            wb: true,
            st: St::Superseded,
            ..Entry::FREE
        };
        let mut v = [Entry::FREE; 4];
        // SAFETY: fenced before `v` is read.
        unsafe { entry(&mut v[1], e) };
        fence();
        assert_eq!(v[1], e);
        assert_eq!(v[0], Entry::FREE);
        assert_eq!(v[2], Entry::FREE);
    }

    #[test]
    fn streamed_bytes_read_back_aligned_or_not() {
        let mut buf = [[0u8; 16]; 3];
        let v: [u8; 16] = std::array::from_fn(|i| i as u8 + 1);
        for d in buf.iter_mut() {
            // SAFETY: fenced before `buf` is read.
            unsafe { bytes16(d, v) };
        }
        fence();
        assert!(buf.iter().all(|d| *d == v));
        // An odd address takes the plain path.
        let mut raw = [0u8; 40];
        let at = (raw.as_ptr() as usize).next_multiple_of(8) + 1 - raw.as_ptr() as usize;
        let d: &mut [u8; 16] = (&mut raw[at..at + 16]).try_into().unwrap();
        // SAFETY: fenced before `raw` is read.
        unsafe { bytes16(d, v) };
        fence();
        assert_eq!(raw[at..at + 16], v);
    }
}
