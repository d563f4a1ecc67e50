//! The entry point shared by the fuzz target (`fuzz/fuzz_targets/vhost_chain.rs`)
//! and the corpus regression test (`exports/tests/fuzz_corpus.rs`): guest
//! memory laid out from the input, a queue over it, and every chain the
//! avail ring names walked by virtio-queue and [`super::chain::parse`],
//! and walked again by its head with [`super::chain::walk`] and
//! [`super::chain::walk_mapped`] (the same descriptors).

use std::sync::atomic::{AtomicU64, Ordering};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::chain::{self, Seg};

/// Where the guest's memory starts (below it is outside).
const BASE: u64 = 0x1000;
/// Its size.
const LEN: usize = 0x10000;
const QSIZE: u16 = 16;
const DESC: u64 = BASE;
const AVAIL: u64 = BASE + 0x100;
const USED: u64 = BASE + 0x200;

/// Checked by the corpus test: chains the last input parsed whole.
pub static PARSED: AtomicU64 = AtomicU64::new(0);

/// Lays `data` over the guest's memory from its start (the descriptor
/// table, then the avail ring, whose index the input sets), walks every
/// available chain and checks that each data segment the walk maps lies
/// inside the memory. Panics only if the walk breaks that contract.
pub fn chains(data: &[u8]) {
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(BASE), LEN)]) else {
        return;
    };
    let n = data.len().min(LEN);
    if mem.write_slice(&data[..n], GuestAddress(BASE)).is_err() {
        return;
    }
    let Ok(mut q) = Queue::new(QSIZE) else {
        return;
    };
    q.set_size(QSIZE);
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_ready(true);
    let host = match mem.get_host_address(GuestAddress(BASE)) {
        Ok(p) => p as usize,
        Err(_) => return,
    };
    let map = |addr: u64, len: u32| {
        let s = mem.get_slice(GuestAddress(addr), len as usize).ok()?;
        Some(s.ptr_guard_mut().as_ptr())
    };
    let mut segs: Vec<Seg> = Vec::new();
    let mut parsed = 0;
    for _ in 0..QSIZE {
        let Some(c) = q.pop_descriptor_chain(&mem) else {
            break;
        };
        let head = c.head_index();
        let descs: Vec<chain::Desc> = c
            .map(|d| (d.addr().0, d.len(), d.is_write_only()))
            .collect();
        // The walk by head (inflight resubmission) sees the same chain.
        let again: Vec<chain::Desc> = chain::walk(&mem, DESC, QSIZE, head).collect();
        assert_eq!(descs, again, "the walk by head differs from virtio-queue's");
        // And so does the walk through mapped pointers (the queue's).
        let mapped: Vec<chain::Desc> = chain::walk_mapped(map, DESC, QSIZE, head).collect();
        assert_eq!(descs, mapped, "the mapped walk differs from virtio-queue's");
        if let Ok(p) = chain::parse(descs.into_iter(), map, &mut segs) {
            parsed += 1;
            let inside = |ptr: *mut u8, len: usize| {
                let a = ptr as usize;
                a >= host && a + len <= host + LEN
            };
            assert!(inside(p.status, 1), "status outside the guest's memory");
            for s in &segs {
                assert!(
                    inside(s.ptr, s.len as usize),
                    "segment outside the guest's memory"
                );
            }
        }
    }
    PARSED.store(parsed, Ordering::Relaxed);
}
