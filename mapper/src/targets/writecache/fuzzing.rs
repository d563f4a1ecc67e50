//! The metadata a writecache loads, from arbitrary bytes (for
//! [`crate::fuzzing::writecache_meta`]).

use udm_core::SECTOR_SHIFT;

use super::entry::{St, NONE};
use super::load::{check_super, rebuild};
use super::meta::{Geometry, Super, MBLOCK_BYTES, SB_BYTES};
use super::state::State;

/// Bytes before the metadata image: mode, cache blocks (u16), origin
/// blocks (u16).
const HEADER: usize = 5;

/// `data` is a header, then the cache's first bytes: the superblock
/// (`SB_BYTES`) and the entry array, zero-padded to the geometry's size.
/// The header's first byte: bit 0 set makes the superblock one of this
/// geometry with the input's generation and a valid checksum (so that the
/// fuzzer reaches the rebuild); bits 1-3 the block size (512 << k). Then
/// the number of cache blocks (1 + n % 4096) and of origin blocks
/// (1 + n % 8192), little-endian u16 each.
pub(crate) fn fuzz_load(data: &[u8]) {
    let Some((head, image)) = data.split_first_chunk::<HEADER>() else {
        return;
    };
    let [mode, c0, c1, o0, o1] = *head;
    let bs = 512u32 << ((mode >> 1) & 7);
    let n_blocks = 1 + u16::from_le_bytes([c0, c1]) as u32 % 4096;
    let origin_blocks = 1 + u16::from_le_bytes([o0, o1]) as u64 % 8192;
    let g = Geometry::with_blocks(n_blocks, bs);
    let sb_len = SB_BYTES as usize;
    let mut sb = vec![0u8; sb_len];
    let n = image.len().min(sb_len);
    sb[..n].copy_from_slice(&image[..n]);
    if mode & 1 != 0 {
        let seq = u64::from_le_bytes(sb[24..32].try_into().unwrap_or([0; 8]));
        Super {
            block_size: bs,
            n_blocks,
            seq,
        }
        .encode(&mut sb);
    }
    let Ok(Some(s)) = check_super(&g, &sb) else {
        return;
    };
    let mut entries = vec![0u8; g.mblocks as usize * MBLOCK_BYTES];
    let rest = image.get(sb_len..).unwrap_or(&[]);
    let n = rest.len().min(entries.len());
    entries[..n].copy_from_slice(&rest[..n]);

    let bss = (bs >> SECTOR_SHIFT) as u64;
    let mut st = State::new(&g, origin_blocks);
    rebuild(&mut st, s.seq, &entries, bss, origin_blocks);

    // What the rest of the cache relies on after a load.
    assert_eq!(st.committed, s.seq);
    assert!(st.pending_gen > st.committed, "the next commit is newer");
    assert!(
        st.image_is_consistent(0, g.mblocks as usize, bss),
        "the image says what the entries do"
    );
    let mut live = 0u64;
    for (ob, &b) in st.map.iter().enumerate() {
        if b == NONE {
            continue;
        }
        let e = &st.entries[b as usize];
        assert_eq!(e.st, St::Live, "origin block {ob} maps to a live block");
        assert_eq!(e.ob as usize, ob, "block {b} caches origin block {ob}");
        assert!(e.seq != 0 && e.seq <= s.seq, "block {b} was committed");
        live += 1;
    }
    assert_eq!(live, st.live, "every live block is mapped");
    assert_eq!(
        st.free.free_blocks() + live,
        n_blocks as u64,
        "every block is live or free"
    );
    // The writeback order: every live block once, oldest first.
    let (mut b, mut seen, mut seq) = (st.lru_head, 0u64, 0u64);
    while b != NONE {
        let e = &st.entries[b as usize];
        assert!(e.seq >= seq, "the list is oldest first");
        seq = e.seq;
        seen += 1;
        assert!(seen <= live, "the list has no cycle");
        b = e.next;
    }
    assert_eq!(seen, live, "the list holds every live block");
}
