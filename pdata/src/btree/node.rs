//! A B-tree node as dm lays it out (`struct btree_node`): a 32-byte header
//! (checksum, flags, own location, entry count, capacity, value size), then
//! `max_entries` little-endian u64 keys, then `max_entries` values.

use crate::block::Block;
use crate::tm::{get32, get64, put32, put64};
use crate::{corrupt, Result, BLOCK_SIZE};

/// The header's size.
pub const HEADER: usize = 32;
/// Flag of an internal node (values are child block numbers).
pub const INTERNAL: u32 = 1;
/// Flag of a leaf.
pub const LEAF: u32 = 2;

/// The capacity dm gives a node of `value_size` values: as many entries as
/// fit, rounded down to a multiple of 3 (its rebalancing works in thirds).
pub fn max_entries(value_size: usize) -> u32 {
    let n = (BLOCK_SIZE - HEADER) / (8 + value_size);
    (3 * (n / 3)) as u32
}

/// Flags.
pub fn flags(b: &Block) -> u32 {
    get32(b, 4)
}
/// Entries in use.
pub fn nr(b: &Block) -> usize {
    get32(b, 16) as usize
}
/// Capacity.
pub fn max(b: &Block) -> usize {
    get32(b, 20) as usize
}
/// Value size.
pub fn value_size(b: &Block) -> usize {
    get32(b, 24) as usize
}
/// Whether it is a leaf.
pub fn is_leaf(b: &Block) -> bool {
    flags(b) & LEAF != 0
}
/// Sets the entry count.
pub fn set_nr(b: &mut Block, n: usize) {
    put32(b, 16, n as u32);
}

/// Initialises an empty node.
pub fn init(b: &mut Block, leaf: bool, value_size: usize) {
    b.fill(0);
    put32(b, 4, if leaf { LEAF } else { INTERNAL });
    put32(b, 16, 0);
    put32(b, 20, max_entries(value_size));
    put32(b, 24, value_size as u32);
}

/// Initialises an empty node with capacity `max`: a sibling made by a
/// split keeps the capacity of the node it came from, so that siblings can
/// always share their entries out (a tree another tool wrote may use a
/// capacity other than dm's).
pub fn init_like(b: &mut Block, leaf: bool, value_size: usize, max: usize) {
    init(b, leaf, value_size);
    put32(b, 20, max as u32);
}

/// Checks what the tree code relies on, so that a corrupt node is an error
/// rather than an out-of-bounds access: one kind flag, a capacity of three
/// or more that fits the block, a count within it, and the value size the tree expects
/// (8 for internal nodes, `leaf_value_size` for leaves).
pub fn check(b: &Block, at: u64, leaf_value_size: usize) -> Result<()> {
    let f = flags(b);
    if f != INTERNAL && f != LEAF {
        return Err(corrupt(at, format!("B-tree node flags {f:#x}")));
    }
    let vs = value_size(b);
    let want = if f == LEAF { leaf_value_size } else { 8 };
    if vs != want {
        return Err(corrupt(
            at,
            format!("B-tree node value size {vs}, expected {want}"),
        ));
    }
    let m = max(b);
    // Splitting needs three entries at least (dm gives every node of these
    // trees far more).
    if m < 3 || HEADER + m * (8 + vs) > BLOCK_SIZE {
        return Err(corrupt(at, format!("B-tree node capacity {m}")));
    }
    if nr(b) > m {
        return Err(corrupt(
            at,
            format!("B-tree node holds {} of {m} entries", nr(b)),
        ));
    }
    Ok(())
}

/// Key `i`.
pub fn key(b: &Block, i: usize) -> u64 {
    get64(b, HEADER + 8 * i)
}
/// Sets key `i`.
pub fn set_key(b: &mut Block, i: usize, k: u64) {
    put64(b, HEADER + 8 * i, k);
}
fn value_off(b: &Block, i: usize) -> usize {
    HEADER + 8 * max(b) + value_size(b) * i
}
/// Value `i`.
pub fn value(b: &Block, i: usize) -> &[u8] {
    let off = value_off(b, i);
    &b[off..off + value_size(b)]
}
/// Sets value `i`.
pub fn set_value(b: &mut Block, i: usize, v: &[u8]) {
    let off = value_off(b, i);
    let vs = value_size(b);
    b[off..off + vs].copy_from_slice(&v[..vs]);
}
/// Value `i` of an internal node: a child's block.
pub fn child(b: &Block, i: usize) -> u64 {
    get64(b, value_off(b, i))
}
/// Sets child `i`.
pub fn set_child(b: &mut Block, i: usize, c: u64) {
    let off = value_off(b, i);
    put64(b, off, c);
}

/// The index of the last key `<= k`, if any.
pub fn lower_bound(b: &Block, k: u64) -> Option<usize> {
    // Binary search for the first key > k.
    let (mut lo, mut hi) = (0, nr(b));
    while lo < hi {
        let mid = (lo + hi) / 2;
        if key(b, mid) <= k {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo.checked_sub(1)
}

/// Inserts `(k, v)` at `i`, shifting the entries after it (the node must
/// have room).
pub fn insert_at(b: &mut Block, i: usize, k: u64, v: &[u8]) {
    let n = nr(b);
    let vs = value_size(b);
    let ko = HEADER + 8 * i;
    b.copy_within(ko..HEADER + 8 * n, ko + 8);
    let vo = value_off(b, i);
    b.copy_within(vo..vo + vs * (n - i), vo + vs);
    set_nr(b, n + 1);
    set_key(b, i, k);
    set_value(b, i, v);
}

/// Removes entry `i`.
pub fn remove_at(b: &mut Block, i: usize) {
    let n = nr(b);
    let vs = value_size(b);
    let ko = HEADER + 8 * i;
    b.copy_within(ko + 8..HEADER + 8 * n, ko);
    let vo = value_off(b, i);
    b.copy_within(vo + vs..vo + vs * (n - i), vo);
    set_nr(b, n - 1);
}

/// Entries `[from, to)` of `b`, keys and values.
pub fn entries(b: &Block, from: usize, to: usize) -> (Vec<u64>, Vec<u8>) {
    let keys = (from..to).map(|i| key(b, i)).collect();
    let vs = value_size(b);
    let vo = value_off(b, from);
    (keys, b[vo..vo + vs * (to - from)].to_vec())
}

/// Sets `b`'s entries to `keys` and `values` (packed).
pub fn set_entries(b: &mut Block, keys: &[u64], values: &[u8]) {
    set_nr(b, keys.len());
    for (i, k) in keys.iter().enumerate() {
        set_key(b, i, *k);
    }
    let vo = value_off(b, 0);
    b[vo..vo + values.len()].copy_from_slice(values);
}
