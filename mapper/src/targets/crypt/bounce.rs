//! Bounce buffers for encrypted writes: a pool per reactor thread.
//!
//! A write is encrypted into memory of the target's own (the caller's
//! plaintext must stay as it is), which goes down in its place. The buffers
//! come from a free list per thread (each reactor is one thread, and a bio
//! completes on the reactor that submitted it, so a buffer always returns
//! to the list it came from), in power-of-two sizes from 4 KiB to
//! [`MAX_BOUNCE`]: once the lists hold what the queue depth needs, a write
//! allocates nothing. What a thread keeps is bounded by [`KEEP_BYTES`];
//! beyond that, returned buffers are freed.
//!
//! Buffers are aligned to 4096 bytes (any logical block size, O_DIRECT)
//! and are not zeroed on reuse: every byte of one is overwritten with
//! ciphertext before it goes down, and only ciphertext is ever in them.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::cell::RefCell;
use std::ptr::NonNull;

/// The smallest buffer (a page: also the largest crypt sector).
const MIN_SHIFT: u32 = 12;
/// The largest write the target sends down in one piece: it splits I/O at
/// this size ([`super::MAX_IO_SECTORS`]).
pub const MAX_BOUNCE: usize = 1 << 20;
const CLASSES: usize = (MAX_BOUNCE.trailing_zeros() - MIN_SHIFT + 1) as usize;
/// Bytes of free buffers one thread keeps for reuse.
pub const KEEP_BYTES: usize = 32 << 20;
const ALIGN: usize = 4096;

/// A buffer taken from the pool: its start and size class.
pub struct Bounce {
    /// The buffer's first byte.
    pub ptr: NonNull<u8>,
    /// Its size class (the buffer holds `4096 << class` bytes).
    pub class: u8,
}

#[derive(Default)]
struct Pool {
    free: [Vec<NonNull<u8>>; CLASSES],
    kept: usize,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

fn layout(class: usize) -> Layout {
    // Sizes are powers of two from 4 KiB to 1 MiB, aligned to 4 KiB: valid.
    Layout::from_size_align(1 << (MIN_SHIFT as usize + class), ALIGN)
        .unwrap_or_else(|_| unreachable!("bounce size classes are valid layouts"))
}

/// A buffer of at least `len` bytes (at most [`MAX_BOUNCE`]).
pub fn take(len: usize) -> Bounce {
    debug_assert!(len <= MAX_BOUNCE);
    let class = len
        .max(1 << MIN_SHIFT)
        .next_power_of_two()
        .trailing_zeros()
        .saturating_sub(MIN_SHIFT) as usize;
    let reused = POOL
        .try_with(|p| {
            let mut p = p.borrow_mut();
            let b = p.free[class].pop();
            if b.is_some() {
                p.kept -= layout(class).size();
            }
            b
        })
        .ok()
        .flatten();
    let ptr = reused.unwrap_or_else(|| {
        let l = layout(class);
        // SAFETY: the layout's size is non-zero.
        NonNull::new(unsafe { alloc(l) }).unwrap_or_else(|| handle_alloc_error(l))
    });
    Bounce {
        ptr,
        class: class as u8,
    }
}

/// Returns a buffer from [`take`] (on the thread that took it).
pub fn give(b: Bounce) {
    let class = b.class as usize;
    let size = layout(class).size();
    let kept = POOL
        .try_with(|p| {
            let mut p = p.borrow_mut();
            if p.kept + size > KEEP_BYTES {
                return false;
            }
            p.kept += size;
            p.free[class].push(b.ptr);
            true
        })
        .unwrap_or(false);
    if !kept {
        // SAFETY: allocated in `take` with this class's layout, and given
        // back once.
        unsafe { dealloc(b.ptr.as_ptr(), layout(class)) };
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for (class, list) in self.free.iter_mut().enumerate() {
            for p in list.drain(..) {
                // SAFETY: every pointer on a list came from `take` with its
                // class's layout and is on one list once.
                unsafe { dealloc(p.as_ptr(), layout(class)) };
            }
        }
    }
}

/// Bytes of free buffers this thread keeps (for tests).
#[cfg(test)]
pub fn kept() -> usize {
    POOL.with(|p| p.borrow().kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_by_size_class_and_aligned() {
        let a = take(4096 * 3);
        assert_eq!(a.class, 2);
        assert_eq!(a.ptr.as_ptr() as usize % 4096, 0);
        let p = a.ptr;
        give(a);
        assert_eq!(kept(), 16384);
        let b = take(16384);
        assert_eq!(b.ptr, p, "the same buffer comes back");
        assert_eq!(kept(), 0);
        give(b);
        let c = take(512);
        assert_eq!(c.class, 0);
        give(c);
    }
}
