//! A counting global allocator: `udm bench` reports allocations per I/O.
//!
//! Counts are per thread (a const-initialised thread-local, so counting
//! itself never allocates), so the main thread's printing does not pollute
//! a job's figure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The allocator: the system's, counting.
pub struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every method forwards to `System` with the same arguments, which
// upholds GlobalAlloc's contract; the counter is a thread-local Cell that
// needs no allocation to reach.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump();
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[inline]
fn bump() {
    // try_with: during thread teardown the slot may be gone; skip counting then.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

/// Allocations made by the calling thread so far.
pub fn thread_allocs() -> u64 {
    ALLOCS.try_with(|c| c.get()).unwrap_or(0)
}
