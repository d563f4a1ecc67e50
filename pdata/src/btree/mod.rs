//! Copy-on-write B-trees in dm's format (dm-btree.c, dm-btree-remove.c):
//! u64 keys, fixed-size values, every change made in shadows of the nodes
//! on its path (through the [`Tm`]) so that a committed root keeps reading
//! its old values.
//!
//! Nodes hold between a third of their capacity and all of it (the root
//! excepted), all leaves are at one depth, and an internal node's key `i`
//! is at most the first key below child `i`: `thin_check` checks all
//! three. Insertion splits full nodes on the way down; removal merges or
//! redistributes a child before descending into it when it is down to a
//! third, so neither ever walks back up.
//!
//! Values may reference other blocks (data blocks, subtrees): a
//! [`ValueType`] says how to add and drop their references, which the tree
//! does when a shared leaf is copied and when a tree is deleted. Removing
//! or replacing a value hands the old one back to the caller, who drops its
//! reference (or not, when the reference moves elsewhere).

pub mod node;

use std::sync::Arc;

use crate::block::Block;
use crate::checksum::BlockKind;
use crate::tm::Tm;
use crate::{corrupt, Result};

/// How a tree's leaf values reference other blocks.
pub trait ValueType {
    /// The value's size on disk.
    fn size(&self) -> usize;
    /// `value` gains a reference (a shared leaf was copied).
    fn inc(&mut self, tm: &mut Tm, value: &[u8]) -> Result<()>;
    /// `value` loses a reference (its leaf was deleted).
    fn dec(&mut self, tm: &mut Tm, value: &[u8]) -> Result<()>;
}

/// Values that reference nothing, of the given size.
pub struct NoRefs(pub usize);

impl ValueType for NoRefs {
    fn size(&self) -> usize {
        self.0
    }
    fn inc(&mut self, _: &mut Tm, _: &[u8]) -> Result<()> {
        Ok(())
    }
    fn dec(&mut self, _: &mut Tm, _: &[u8]) -> Result<()> {
        Ok(())
    }
}

/// Deeper than any tree of this format (252-way nodes).
const MAX_DEPTH: usize = 16;

fn too_deep(root: u64) -> crate::Error {
    corrupt(root, "B-tree deeper than 16 levels (a cycle?)")
}

/// Node `b`, checked for a tree whose leaves hold `vs`-byte values.
pub fn read_node(tm: &mut Tm, b: u64, vs: usize) -> Result<Arc<Block>> {
    let n = tm.read(b, BlockKind::Node)?;
    node::check(&n, b, vs)?;
    Ok(n)
}

/// A new empty tree (one empty leaf) for `vs`-byte values.
pub fn empty(tm: &mut Tm, vs: usize) -> Result<u64> {
    let b = tm.new_block(BlockKind::Node)?;
    node::init(tm.get_mut(b)?, true, vs);
    Ok(b)
}

fn inc_children(tm: &mut Tm, vt: &mut dyn ValueType, b: u64) -> Result<()> {
    let n = read_node(tm, b, vt.size())?;
    for i in 0..node::nr(&n) {
        if node::is_leaf(&n) {
            vt.inc(tm, node::value(&n, i))?;
        } else {
            tm.inc(node::child(&n, i))?;
        }
    }
    Ok(())
}

/// Shadows node `b` (checked first), adding references for its children
/// when it was shared.
fn shadow(tm: &mut Tm, vt: &mut dyn ValueType, b: u64) -> Result<u64> {
    read_node(tm, b, vt.size())?;
    let (s, inc) = tm.shadow(b, BlockKind::Node)?;
    if inc {
        inc_children(tm, vt, s)?;
    }
    Ok(s)
}

/// Shadows child `i` of `parent` (a shadow itself) and points the parent at it.
fn shadow_child(tm: &mut Tm, vt: &mut dyn ValueType, parent: u64, i: usize) -> Result<u64> {
    let c = node::child(&*tm.read(parent, BlockKind::Node)?, i);
    let s = shadow(tm, vt, c)?;
    if s != c {
        node::set_child(tm.get_mut(parent)?, i, s);
    }
    Ok(s)
}

/// The value under `key`.
pub fn lookup(tm: &mut Tm, root: u64, key: u64, vs: usize) -> Result<Option<Vec<u8>>> {
    lookup_with(tm, root, key, vs, <[u8]>::to_vec)
}

/// `f` of the value under `key`, without copying it out (the lookup of a
/// mapping on every I/O).
pub fn lookup_with<R>(
    tm: &mut Tm,
    root: u64,
    key: u64,
    vs: usize,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<Option<R>> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = read_node(tm, b, vs)?;
        let Some(i) = node::lower_bound(&n, key) else {
            return Ok(None);
        };
        if node::is_leaf(&n) {
            return Ok((node::key(&n, i) == key).then(|| f(node::value(&n, i))));
        }
        b = node::child(&n, i);
    }
    Err(too_deep(root))
}

/// The first entry with a key `>= key`. Visits at most as many nodes as
/// the device has blocks (see [`range`]).
pub fn lookup_next(tm: &mut Tm, root: u64, key: u64, vs: usize) -> Result<Option<(u64, Vec<u8>)>> {
    fn go(
        tm: &mut Tm,
        b: u64,
        key: u64,
        vs: usize,
        depth: usize,
        budget: &mut u64,
    ) -> Result<Option<(u64, Vec<u8>)>> {
        if depth >= MAX_DEPTH {
            return Err(too_deep(b));
        }
        if *budget == 0 {
            return Err(corrupt(
                b,
                "B-tree has more nodes than the device has blocks",
            ));
        }
        *budget -= 1;
        let n = read_node(tm, b, vs)?;
        let start = node::lower_bound(&n, key).unwrap_or(0);
        for i in start..node::nr(&n) {
            if node::is_leaf(&n) {
                if node::key(&n, i) >= key {
                    return Ok(Some((node::key(&n, i), node::value(&n, i).to_vec())));
                }
            } else if let Some(r) = go(tm, node::child(&n, i), key, vs, depth + 1, budget)? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }
    let mut budget = tm.device_blocks();
    go(tm, root, key, vs, 0, &mut budget)
}

/// The entry with the highest key.
pub fn last(tm: &mut Tm, root: u64, vs: usize) -> Result<Option<(u64, Vec<u8>)>> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = read_node(tm, b, vs)?;
        let Some(i) = node::nr(&n).checked_sub(1) else {
            return Ok(None);
        };
        if node::is_leaf(&n) {
            return Ok(Some((node::key(&n, i), node::value(&n, i).to_vec())));
        }
        b = node::child(&n, i);
    }
    Err(too_deep(root))
}

/// Calls `f` with each entry whose key is in `[begin, end)`, in key order.
/// Visits at most as many nodes as the device has blocks, so that a
/// corrupt tree whose nodes share children cannot keep it walking.
pub fn range(
    tm: &mut Tm,
    root: u64,
    begin: u64,
    end: u64,
    vs: usize,
    f: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    struct Walk<'a> {
        budget: u64,
        begin: u64,
        end: u64,
        vs: usize,
        f: &'a mut dyn FnMut(u64, &[u8]) -> Result<()>,
    }
    fn go(tm: &mut Tm, w: &mut Walk, b: u64, depth: usize) -> Result<()> {
        if depth >= MAX_DEPTH {
            return Err(too_deep(b));
        }
        if w.budget == 0 {
            return Err(corrupt(
                b,
                "B-tree has more nodes than the device has blocks",
            ));
        }
        w.budget -= 1;
        let n = read_node(tm, b, w.vs)?;
        let start = node::lower_bound(&n, w.begin).unwrap_or(0);
        for i in start..node::nr(&n) {
            let k = node::key(&n, i);
            if k >= w.end {
                break;
            }
            if node::is_leaf(&n) {
                if k >= w.begin {
                    (w.f)(k, node::value(&n, i))?;
                }
            } else {
                go(tm, w, node::child(&n, i), depth + 1)?;
            }
        }
        Ok(())
    }
    let mut w = Walk {
        budget: tm.device_blocks(),
        begin,
        end,
        vs,
        f,
    };
    go(tm, &mut w, root, 0)
}

/// Every node of the tree at `root` (internal and leaves), each once per
/// path to it, bounded as [`range`] is.
pub fn nodes(tm: &mut Tm, root: u64, vs: usize, f: &mut dyn FnMut(u64)) -> Result<()> {
    let mut budget = tm.device_blocks();
    let mut stack = vec![(root, 0usize)];
    while let Some((b, depth)) = stack.pop() {
        if depth >= MAX_DEPTH {
            return Err(too_deep(b));
        }
        if budget == 0 {
            return Err(corrupt(
                b,
                "B-tree has more nodes than the device has blocks",
            ));
        }
        budget -= 1;
        f(b);
        let n = read_node(tm, b, vs)?;
        if !node::is_leaf(&n) {
            for i in 0..node::nr(&n) {
                stack.push((node::child(&n, i), depth + 1));
            }
        }
    }
    Ok(())
}

/// References counted per block, by [`count_refs`].
pub type RefCounts = std::collections::HashMap<u64, u32>;

/// What [`count_refs`] calls with each leaf value, to count what it references.
pub type LeafRefs<'a> = dyn FnMut(&mut Tm, &mut RefCounts, &[u8]) -> Result<()> + 'a;

/// Counts references as a space map should hold them: one for `root`
/// from whoever holds it, and, the first time a node is reached, one for
/// each of its children; `leaf` gets each leaf value of a node reached for
/// the first time (to count what the values reference). Bounded as
/// [`range`] is.
pub fn count_refs(
    tm: &mut Tm,
    root: u64,
    vs: usize,
    counts: &mut RefCounts,
    leaf: &mut LeafRefs,
) -> Result<()> {
    let mut budget = tm.device_blocks();
    let mut stack = vec![(root, 0usize)];
    while let Some((b, depth)) = stack.pop() {
        if depth >= MAX_DEPTH {
            return Err(too_deep(b));
        }
        let c = counts.entry(b).or_insert(0);
        *c += 1;
        if *c > 1 {
            continue;
        }
        if budget == 0 {
            return Err(corrupt(
                b,
                "B-tree has more nodes than the device has blocks",
            ));
        }
        budget -= 1;
        let n = read_node(tm, b, vs)?;
        for i in 0..node::nr(&n) {
            if node::is_leaf(&n) {
                leaf(tm, counts, node::value(&n, i))?;
            } else {
                stack.push((node::child(&n, i), depth + 1));
            }
        }
    }
    Ok(())
}

/// Moves the full root's entries into two new children, so that the root
/// keeps its block (dm's `btree_split_beneath`).
fn split_beneath(tm: &mut Tm, root: u64) -> Result<()> {
    let n = tm.read(root, BlockKind::Node)?;
    let (cnt, leaf, vs, max) = (
        node::nr(&n),
        node::is_leaf(&n),
        node::value_size(&n),
        node::max(&n),
    );
    let mid = cnt / 2;
    let (lk, lv) = node::entries(&n, 0, mid);
    let (rk, rv) = node::entries(&n, mid, cnt);
    drop(n);
    let mut keys = Vec::with_capacity(2);
    let mut vals = Vec::with_capacity(16);
    for (k, v) in [(lk, lv), (rk, rv)] {
        let c = tm.new_block(BlockKind::Node)?;
        let blk = tm.get_mut(c)?;
        node::init_like(blk, leaf, vs, max);
        node::set_entries(blk, &k, &v);
        keys.push(k[0]);
        vals.extend_from_slice(&c.to_le_bytes());
    }
    let blk = tm.get_mut(root)?;
    node::init(blk, false, 8);
    node::set_entries(blk, &keys, &vals);
    Ok(())
}

/// Moves the upper half of full node `b` into a new right sibling; returns
/// it and its first key.
fn split(tm: &mut Tm, b: u64) -> Result<(u64, u64)> {
    let n = tm.read(b, BlockKind::Node)?;
    let (cnt, leaf, vs, max) = (
        node::nr(&n),
        node::is_leaf(&n),
        node::value_size(&n),
        node::max(&n),
    );
    let mid = cnt / 2;
    let (rk, rv) = node::entries(&n, mid, cnt);
    drop(n);
    let r = tm.new_block(BlockKind::Node)?;
    let blk = tm.get_mut(r)?;
    node::init_like(blk, leaf, vs, max);
    node::set_entries(blk, &rk, &rv);
    node::set_nr(tm.get_mut(b)?, mid);
    Ok((r, rk[0]))
}

/// Sets `key` to `value`; returns the new root and the value replaced, if
/// any, whose reference the caller drops (or keeps, when it moves).
pub fn insert(
    tm: &mut Tm,
    vt: &mut dyn ValueType,
    root: u64,
    key: u64,
    value: &[u8],
) -> Result<(u64, Option<Vec<u8>>)> {
    let root = shadow(tm, vt, root)?;
    let full = {
        let n = tm.read(root, BlockKind::Node)?;
        node::nr(&n) >= node::max(&n)
    };
    if full {
        split_beneath(tm, root)?;
    }
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let n = tm.read(b, BlockKind::Node)?;
        let at = node::lower_bound(&n, key);
        if node::is_leaf(&n) {
            drop(n);
            let blk = tm.get_mut(b)?;
            match at {
                Some(i) if node::key(blk, i) == key => {
                    let old = node::value(blk, i).to_vec();
                    node::set_value(blk, i, value);
                    return Ok((root, Some(old)));
                }
                Some(i) => node::insert_at(blk, i + 1, key, value),
                None => node::insert_at(blk, 0, key, value),
            }
            return Ok((root, None));
        }
        drop(n);
        let i = match at {
            Some(i) => i,
            None => {
                // A new lowest key: the first child's bound moves down to it.
                node::set_key(tm.get_mut(b)?, 0, key);
                0
            }
        };
        let c = shadow_child(tm, vt, b, i)?;
        let full = {
            let n = tm.read(c, BlockKind::Node)?;
            node::nr(&n) >= node::max(&n)
        };
        if full {
            // The parent has room: it was split before we came down.
            let (r, rkey) = split(tm, c)?;
            node::insert_at(tm.get_mut(b)?, i + 1, rkey, &r.to_le_bytes());
            b = if key >= rkey { r } else { c };
        } else {
            b = c;
        }
    }
    Err(too_deep(root))
}

/// Merges or evens out children `l` and `l + 1` of `parent` (both shadows):
/// merged when they fit in one node, else split half and half.
fn rebalance(tm: &mut Tm, parent: u64, l: usize) -> Result<()> {
    let p = tm.read(parent, BlockKind::Node)?;
    let (lb, rb) = (node::child(&p, l), node::child(&p, l + 1));
    drop(p);
    let ln = tm.read(lb, BlockKind::Node)?;
    let rn = tm.read(rb, BlockKind::Node)?;
    // Same kind, value size and capacity, so that their entries fit
    // either node whichever way they are shared out.
    if node::is_leaf(&ln) != node::is_leaf(&rn)
        || node::value_size(&ln) != node::value_size(&rn)
        || node::max(&ln) != node::max(&rn)
    {
        return Err(corrupt(parent, "B-tree siblings of different kinds"));
    }
    let vs = node::value_size(&ln);
    let max = node::max(&ln);
    let (mut keys, mut vals) = node::entries(&ln, 0, node::nr(&ln));
    let (rk, rv) = node::entries(&rn, 0, node::nr(&rn));
    drop((ln, rn));
    keys.extend_from_slice(&rk);
    vals.extend_from_slice(&rv);
    if keys.len() <= max {
        node::set_entries(tm.get_mut(lb)?, &keys, &vals);
        node::remove_at(tm.get_mut(parent)?, l + 1);
        // The right node's children now hang under the left one: only the
        // node itself loses its reference.
        tm.dec(rb)?;
    } else {
        let t = keys.len() / 2;
        node::set_entries(tm.get_mut(lb)?, &keys[..t], &vals[..t * vs]);
        node::set_entries(tm.get_mut(rb)?, &keys[t..], &vals[t * vs..]);
        node::set_key(tm.get_mut(parent)?, l + 1, keys[t]);
    }
    Ok(())
}

/// Removes `key`; returns the new root and the removed value, whose
/// reference the caller drops.
pub fn remove(
    tm: &mut Tm,
    vt: &mut dyn ValueType,
    root: u64,
    key: u64,
) -> Result<(u64, Option<Vec<u8>>)> {
    let mut root = shadow(tm, vt, root)?;
    let mut b = root;
    let mut out = None;
    let mut depth = 0;
    loop {
        depth += 1;
        if depth > MAX_DEPTH {
            return Err(too_deep(root));
        }
        let n = tm.read(b, BlockKind::Node)?;
        let at = node::lower_bound(&n, key);
        if node::is_leaf(&n) {
            if let Some(i) = at.filter(|&i| node::key(&n, i) == key) {
                out = Some(node::value(&n, i).to_vec());
                drop(n);
                node::remove_at(tm.get_mut(b)?, i);
            }
            break;
        }
        let cnt = node::nr(&n);
        drop(n);
        let Some(i) = at else { break };
        let c = shadow_child(tm, vt, b, i)?;
        let (cnr, cmax) = {
            let n = tm.read(c, BlockKind::Node)?;
            (node::nr(&n), node::max(&n))
        };
        if cnr > cmax / 3 || cnt < 2 {
            b = c;
            continue;
        }
        // Down to a third: take from or merge with a sibling first, so that
        // the child stays at a third or more after losing an entry.
        let l = if i + 1 < cnt { i } else { i - 1 };
        let s = if l == i { i + 1 } else { l };
        shadow_child(tm, vt, b, s)?;
        rebalance(tm, b, l)?;
        let n = tm.read(b, BlockKind::Node)?;
        let i = node::lower_bound(&n, key).unwrap_or(0);
        b = node::child(&n, i);
    }
    // A root left with one child gives way to it.
    loop {
        let n = tm.read(root, BlockKind::Node)?;
        if node::is_leaf(&n) || node::nr(&n) != 1 {
            break;
        }
        let c = node::child(&n, 0);
        drop(n);
        tm.dec(root)?;
        root = c;
    }
    Ok((root, out))
}

/// Removes every key in `[begin, end)`; returns the new root and the
/// removed values (in key order), whose references the caller drops.
pub fn remove_range(
    tm: &mut Tm,
    vt: &mut dyn ValueType,
    mut root: u64,
    begin: u64,
    end: u64,
) -> Result<(u64, Vec<Vec<u8>>)> {
    let mut out = Vec::new();
    let mut at = begin;
    while at < end {
        let Some((k, _)) = lookup_next(tm, root, at, vt.size())? else {
            break;
        };
        if k >= end {
            break;
        }
        let (r, v) = remove(tm, vt, root, k)?;
        root = r;
        out.extend(v);
        match k.checked_add(1) {
            Some(n) => at = n,
            None => break,
        }
    }
    Ok((root, out))
}

/// Drops a reference to the tree at `root`: a node referenced elsewhere
/// loses one reference, a node referenced only here is freed after its
/// children (or its values) lose theirs (dm's `dm_btree_del`).
pub fn del(tm: &mut Tm, vt: &mut dyn ValueType, root: u64) -> Result<()> {
    fn go(tm: &mut Tm, vt: &mut dyn ValueType, b: u64, depth: usize) -> Result<()> {
        if depth >= MAX_DEPTH {
            return Err(too_deep(b));
        }
        if tm.count(b)? > 1 {
            tm.dec(b)?;
            return Ok(());
        }
        let n = read_node(tm, b, vt.size())?;
        for i in 0..node::nr(&n) {
            if node::is_leaf(&n) {
                vt.dec(tm, node::value(&n, i))?;
            } else {
                go(tm, vt, node::child(&n, i), depth + 1)?;
            }
        }
        tm.dec(b)?;
        Ok(())
    }
    go(tm, vt, root, 0)
}

#[cfg(test)]
mod tests;
