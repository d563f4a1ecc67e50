//! [`AlignedBuf`]: heap memory that any device can do I/O to.
//!
//! O_DIRECT on a real file system or block device wants the buffer (not
//! only the offset and length) aligned to the logical block size; a
//! `Vec<u8>`'s heap block is aligned to 16 bytes. Whoever owns the buffers
//! of its own I/O (the writecache's metadata and writeback, the bench)
//! allocates them here, aligned to [`AlignedBuf::ALIGN`], the largest
//! logical block size a device has.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// Zeroed heap bytes aligned to [`AlignedBuf::ALIGN`], with a length that
/// can shrink and grow as a `Vec<u8>`'s (growth past the capacity moves the
/// bytes to a new block).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes allocated (0: nothing is, and `ptr` is dangling).
    cap: usize,
}

// SAFETY: an AlignedBuf owns its bytes exclusively, as a Vec<u8> does; it
// shares no state with anything else.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// The alignment of every buffer: the largest logical block size.
    pub const ALIGN: usize = 4096;

    /// `len` zeroed bytes.
    pub fn new(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::default();
        b.resize(len);
        b
    }

    fn layout(cap: usize) -> Layout {
        match Layout::from_size_align(cap, Self::ALIGN) {
            Ok(l) => l,
            // Only a size near usize::MAX fails; Vec panics there too.
            Err(_) => panic!("AlignedBuf: {cap} bytes is too large"),
        }
    }

    /// Sets the length to `len`. Shrinking keeps the bytes; bytes beyond
    /// any earlier length are zero (growth past the capacity reallocates).
    pub fn resize(&mut self, len: usize) {
        if len > self.cap {
            let layout = Self::layout(len);
            // SAFETY: the layout's size is non-zero (len > cap >= 0).
            let p = unsafe { alloc_zeroed(layout) };
            let Some(p) = NonNull::new(p) else {
                handle_alloc_error(layout)
            };
            if self.cap > 0 {
                // SAFETY: both blocks are live, distinct and at least
                // `self.len` bytes long; the old one was allocated with
                // `layout(self.cap)`.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), p.as_ptr(), self.len);
                    dealloc(self.ptr.as_ptr(), Self::layout(self.cap));
                }
            }
            self.ptr = p;
            self.cap = len;
        } else if len > self.len {
            // Bytes between the length and the capacity may hold data from
            // before a shrink: growth reads as zeroes, as Vec::resize's.
            let old = self.len;
            self.as_mut_slice_cap()[old..len].fill(0);
        }
        self.len = len;
    }

    fn as_mut_slice_cap(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `cap` initialised bytes (zeroed at
        // allocation) that we own; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start (dangling, but aligned, when nothing is allocated).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The start, for I/O into the buffer.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len <= cap` initialised bytes we own
        // (or `len` is 0 and `ptr` is dangling but aligned).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Default for AlignedBuf {
    /// An empty buffer; nothing is allocated.
    fn default() -> AlignedBuf {
        AlignedBuf {
            // Aligned as the allocated blocks are.
            ptr: NonNull::<Page>::dangling().cast(),
            len: 0,
            cap: 0,
        }
    }
}

/// A type with the buffers' alignment, for an aligned dangling pointer.
#[repr(align(4096))]
struct Page;
const _: () = assert!(std::mem::align_of::<Page>() == AlignedBuf::ALIGN);

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated in `resize` with exactly this layout.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) };
        }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_resize_as_a_vec() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.as_ptr() as usize % AlignedBuf::ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
        b[4999] = 7;
        b.resize(100);
        assert_eq!(b.len(), 100);
        b[99] = 9;
        // Growing within the capacity zeroes what the shrink hid...
        b.resize(5000);
        assert_eq!((b[99], b[4999]), (9, 0));
        // ...and past it keeps the bytes in a new aligned block.
        b.resize(20000);
        assert_eq!(b.as_ptr() as usize % AlignedBuf::ALIGN, 0);
        assert_eq!((b[99], b[19999]), (9, 0));
        let e = AlignedBuf::default();
        assert!(e.is_empty());
        assert_eq!(e.as_ptr() as usize % AlignedBuf::ALIGN, 0);
    }
}
