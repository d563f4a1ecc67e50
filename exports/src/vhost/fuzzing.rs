//! The entry point shared by the fuzz target (`fuzz/fuzz_targets/vhost_chain.rs`)
//! and the corpus regression test (`exports/tests/fuzz_corpus.rs`): guest
//! memory laid out from the input, a queue over it, and every chain the
//! avail ring names walked by virtio-queue and [`super::chain::parse`],
//! and walked again by its head with [`super::chain::walk`] and
//! [`super::chain::walk_mapped`], descriptor by descriptor and through
//! the table mapped whole (the same descriptors); the one-pass parse
//! checked against [`reference_parse`], the plain reading of the spec.

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

/// Lays `data` over the guest's memory from its start (the descriptor
/// table, then the avail ring, whose index the input sets), walks every
/// available chain and checks that each data segment the walk maps lies
/// inside the memory. Panics only if the walk breaks that contract.
/// Returns how many chains were parsed whole (the corpus test checks it).
pub fn chains(data: &[u8]) -> u64 {
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(BASE), LEN)]) else {
        return 0;
    };
    let n = data.len().min(LEN);
    if mem.write_slice(&data[..n], GuestAddress(BASE)).is_err() {
        return 0;
    }
    let Ok(mut q) = Queue::new(QSIZE) else {
        return 0;
    };
    q.set_size(QSIZE);
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_ready(true);
    let host = match mem.get_host_address(GuestAddress(BASE)) {
        Ok(p) => p as usize,
        Err(_) => return 0,
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
        // And so does the walk through mapped pointers (the queue's), each
        // descriptor looked up, or the table mapped whole.
        let none = std::ptr::null();
        let mapped: Vec<chain::Desc> = chain::walk_mapped(map, DESC, none, QSIZE, head).collect();
        assert_eq!(descs, mapped, "the mapped walk differs from virtio-queue's");
        let table = map(DESC, 16 * u32::from(QSIZE)).map_or(none, |p| p.cast_const());
        let whole: Vec<chain::Desc> = chain::walk_mapped(map, DESC, table, QSIZE, head).collect();
        assert_eq!(descs, whole, "the walk of the mapped table differs");
        let got = chain::parse(descs.iter().copied(), map, &mut segs);
        let want = reference_parse(&descs, map);
        assert_eq!(
            got.map(|p| (p, p.data(&segs).to_vec())),
            want,
            "the one-pass parse differs from the reference"
        );
        // The walk and parse in one loop (the queue's), with and without
        // the table mapped whole.
        for host in [none, table] {
            let mut s2 = Vec::new();
            let fused = chain::parse_chain(map, DESC, host, QSIZE, head, &mut s2);
            assert_eq!(
                fused.map(|p| (p, p.data(&s2).to_vec())),
                want,
                "the fused walk and parse differs from the reference"
            );
        }
        if let Ok(p) = got {
            parsed += 1;
            let inside = |ptr: *mut u8, len: usize| {
                let a = ptr as usize;
                a >= host && a + len <= host + LEN
            };
            assert!(inside(p.status, 1), "status outside the guest's memory");
            for s in p.data(&segs) {
                assert!(
                    inside(s.ptr, s.len as usize),
                    "segment outside the guest's memory"
                );
            }
        }
    }
    parsed
}

/// The reading of a chain that [`chain::parse`] must agree with, step by
/// step as the spec says it: every descriptor mapped in order (readable
/// before writable), the header the first 16 readable bytes, the status
/// the last writable byte, the data what lies between, of one direction.
pub fn reference_parse(
    descs: &[chain::Desc],
    map: impl Fn(u64, u32) -> Option<*mut u8>,
) -> Result<(chain::Parsed, Vec<Seg>), chain::BadChain> {
    use chain::BadChain;
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN};
    let mut segs = Vec::new();
    let mut seen_write = false;
    for (n, &(addr, len, writable)) in descs.iter().enumerate() {
        if n >= chain::MAX_DESCS {
            return Err(BadChain::TooLong);
        }
        if writable {
            seen_write = true;
        } else if seen_write {
            return Err(BadChain::ReadAfterWrite);
        }
        if len == 0 {
            continue;
        }
        let ptr = map(addr, len).ok_or(BadChain::Unmapped { addr, len })?;
        segs.push(Seg { ptr, len, writable });
    }
    let mut hdr = [0u8; chain::HEADER_LEN];
    let mut got = 0;
    let mut first = 0;
    while got < chain::HEADER_LEN {
        let Some(s) = segs.get_mut(first) else {
            return Err(BadChain::ShortHeader);
        };
        if s.writable {
            return Err(BadChain::ShortHeader);
        }
        let n = (chain::HEADER_LEN - got).min(s.len as usize);
        // SAFETY: `map` vouched for s.len bytes at s.ptr, n <= s.len.
        unsafe { std::ptr::copy_nonoverlapping(s.ptr, hdr[got..].as_mut_ptr(), n) };
        got += n;
        if n == s.len as usize {
            first += 1;
        } else {
            // SAFETY: n < s.len: still inside the segment.
            s.ptr = unsafe { s.ptr.add(n) };
            s.len -= n as u32;
        }
    }
    let n = segs.len();
    let status = match segs.last_mut() {
        Some(s) if s.writable && n > first => {
            s.len -= 1;
            // SAFETY: the segment had len >= 1 bytes; this is its last.
            let p = unsafe { s.ptr.add(s.len as usize) };
            if s.len == 0 {
                segs.pop();
            }
            p
        }
        _ => return Err(BadChain::NoStatus),
    };
    let data = segs.split_off(first);
    let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let sector = u64::from_le_bytes([
        hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
    ]);
    let want_write = kind == VIRTIO_BLK_T_IN || kind == VIRTIO_BLK_T_GET_ID;
    let layout_ok = if kind == VIRTIO_BLK_T_FLUSH {
        data.is_empty()
    } else {
        data.iter().all(|s| s.writable == want_write)
    };
    let data_len = data.iter().map(|s| s.len as u64).sum();
    let parsed = chain::Parsed {
        kind,
        sector,
        status,
        layout_ok,
        data_len,
        first,
        end: first + data.len(),
    };
    Ok((parsed, data))
}
