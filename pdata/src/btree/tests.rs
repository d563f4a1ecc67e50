//! The B-tree against a `BTreeMap` model, its shape against dm's rules, and
//! copy-on-write against a held root.

use std::collections::BTreeMap;

use super::*;
use crate::block::MemIo;
use crate::space_map::SmRoot;
use crate::tm::{get64, put64};

const BLOCKS: u64 = 4096;

/// A minimal superblock for these tests: the metadata space map's root at
/// 16 and the tree's root at 144.
fn commit(tm: &mut Tm, root: u64) {
    tm.commit(0, |sm| {
        let mut b = crate::block::zeroed();
        b[16..144].copy_from_slice(sm);
        put64(&mut b, 144, root);
        b
    })
    .unwrap();
}

fn reopen(io: &MemIo) -> (Tm, u64) {
    let mut tm = Tm::new(
        Box::new(io.clone()),
        crate::space_map::metadata::MetadataSpaceMap::placeholder(),
    );
    let sb = tm.read(0, BlockKind::Superblock).unwrap();
    let root = SmRoot::decode(&sb[16..144]);
    let tree = get64(&sb, 144);
    let tm = Tm::open(Box::new(io.clone()), &root).unwrap();
    (tm, tree)
}

fn value(k: u64, gen: u64) -> [u8; 8] {
    (k * 1000 + gen).to_le_bytes()
}

/// Checks dm's rules for the tree at `b`: sorted keys within the parent's
/// bounds, a third full or more below the root, every leaf at one depth.
/// Returns the number of entries and the leaves' depth.
fn check_shape(tm: &mut Tm, b: u64, lo: u64, hi: Option<u64>, is_root: bool) -> (usize, usize) {
    let n = read_node(tm, b, 8).unwrap();
    let cnt = node::nr(&n);
    if !is_root {
        assert!(
            cnt >= node::max(&n) / 3,
            "node {b}: {cnt} of {} entries",
            node::max(&n)
        );
    }
    for i in 0..cnt {
        let k = node::key(&n, i);
        assert!(
            k >= lo && !matches!(hi, Some(h) if k >= h),
            "node {b}: key {k} out of [{lo}, {hi:?})"
        );
        if i > 0 {
            assert!(node::key(&n, i - 1) < k, "node {b}: keys out of order");
        }
    }
    if node::is_leaf(&n) {
        return (cnt, 0);
    }
    let mut total = 0;
    let mut depth = None;
    for i in 0..cnt {
        let next = if i + 1 < cnt {
            Some(node::key(&n, i + 1))
        } else {
            hi
        };
        let (c, d) = check_shape(tm, node::child(&n, i), node::key(&n, i), next, false);
        total += c;
        assert!(
            !matches!(depth, Some(x) if x != d),
            "node {b}: leaves at different depths"
        );
        depth = Some(d);
    }
    (total, depth.unwrap_or(0) + 1)
}

fn check_against(tm: &mut Tm, root: u64, model: &BTreeMap<u64, [u8; 8]>) {
    let mut seen = Vec::new();
    range(tm, root, 0, u64::MAX, 8, &mut |k, v| {
        seen.push((k, v.to_vec()));
        Ok(())
    })
    .unwrap();
    let want: Vec<_> = model.iter().map(|(k, v)| (*k, v.to_vec())).collect();
    assert_eq!(seen, want);
    let (cnt, _) = check_shape(tm, root, 0, None, true);
    assert_eq!(cnt, model.len());
}

/// Blocks the tree and the metadata space map reach, each once: after a
/// commit the space map counts exactly these.
fn reachable(tm: &mut Tm, root: u64) -> u64 {
    let mut n = 1; // the superblock
    nodes(tm, root, 8, &mut |_| n += 1).unwrap();
    let sb = tm.read(0, BlockKind::Superblock).unwrap();
    let sm = SmRoot::decode(&sb[16..144]);
    nodes(tm, sm.ref_count_root, 4, &mut |_| n += 1).unwrap();
    n + 1 + sm.nr_blocks.div_ceil(crate::space_map::ENTRIES_PER_BITMAP)
}

#[test]
fn random_inserts_and_removes_match_a_model_across_commits_and_reopens() {
    let io = MemIo::new(BLOCKS);
    let mut tm = Tm::format(Box::new(io.clone()), BLOCKS).unwrap();
    let mut root = empty(&mut tm, 8).unwrap();
    let mut model = BTreeMap::new();
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for step in 0..30_000u64 {
        let r = next();
        // Keys clustered so that runs fill, split and empty whole leaves.
        let k = (r >> 8) % 4000;
        let v = value(k, step);
        if r % 100 < 55 {
            let (nr, old) = insert(&mut tm, &mut NoRefs(8), root, k, &v).unwrap();
            root = nr;
            assert_eq!(old, model.insert(k, v).map(|o| o.to_vec()));
        } else if r % 100 < 97 {
            let (nr, old) = remove(&mut tm, &mut NoRefs(8), root, k).unwrap();
            root = nr;
            assert_eq!(old, model.remove(&k).map(|o| o.to_vec()));
        } else {
            let (b, e) = (k, k + r % 300);
            let (nr, gone) = remove_range(&mut tm, &mut NoRefs(8), root, b, e).unwrap();
            root = nr;
            let want: Vec<_> = model.range(b..e).map(|(_, v)| v.to_vec()).collect();
            assert_eq!(gone, want);
            model.retain(|k, _| !(b..e).contains(k));
        }
        if step % 3000 == 2999 {
            check_against(&mut tm, root, &model);
            commit(&mut tm, root);
            assert_eq!(
                tm.sm.counts.nr_allocated(),
                reachable(&mut tm, root),
                "at step {step}"
            );
            if step % 6000 == 5999 {
                let (t, r) = reopen(&io);
                tm = t;
                assert_eq!(r, root);
                check_against(&mut tm, root, &model);
            }
        }
        if step % 997 == 0 {
            for k in [0, 1, k, 3999] {
                let got = lookup(&mut tm, root, k, 8).unwrap();
                assert_eq!(got, model.get(&k).map(|v| v.to_vec()));
            }
        }
    }
    // Emptying the tree leaves one empty leaf.
    let keys: Vec<u64> = model.keys().copied().collect();
    for k in keys {
        root = remove(&mut tm, &mut NoRefs(8), root, k).unwrap().0;
    }
    model.clear();
    check_against(&mut tm, root, &model);
    commit(&mut tm, root);
    assert_eq!(tm.sm.counts.nr_allocated(), reachable(&mut tm, root));
}

#[test]
fn a_held_root_keeps_reading_its_values_after_shadowed_changes() {
    let io = MemIo::new(BLOCKS);
    let mut tm = Tm::format(Box::new(io.clone()), BLOCKS).unwrap();
    let mut root = empty(&mut tm, 8).unwrap();
    let mut model = BTreeMap::new();
    for k in 0..2000 {
        root = insert(&mut tm, &mut NoRefs(8), root, k, &value(k, 0))
            .unwrap()
            .0;
        model.insert(k, value(k, 0));
    }
    commit(&mut tm, root);
    let before = tm.sm.counts.nr_allocated();
    // Hold the root, as a snapshot does: its nodes are now shared.
    let held = root;
    tm.inc(held).unwrap();
    let mut changed = model.clone();
    for k in (0..2000).step_by(3) {
        root = insert(&mut tm, &mut NoRefs(8), root, k, &value(k, 1))
            .unwrap()
            .0;
        changed.insert(k, value(k, 1));
    }
    for k in (1..2000).step_by(7) {
        root = remove(&mut tm, &mut NoRefs(8), root, k).unwrap().0;
        changed.remove(&k);
    }
    assert_ne!(root, held);
    commit(&mut tm, root);
    check_against(&mut tm, held, &model);
    check_against(&mut tm, root, &changed);
    // Dropping the held tree frees what only it used.
    del(&mut tm, &mut NoRefs(8), held).unwrap();
    commit(&mut tm, root);
    check_against(&mut tm, root, &changed);
    assert_eq!(tm.sm.counts.nr_allocated(), reachable(&mut tm, root));
    assert!(tm.sm.counts.nr_allocated() <= before + 2);
}

#[test]
fn a_corrupt_node_is_an_error_not_a_panic() {
    let io = MemIo::new(BLOCKS);
    let mut tm = Tm::format(Box::new(io.clone()), BLOCKS).unwrap();
    let mut root = empty(&mut tm, 8).unwrap();
    for k in 0..1000 {
        root = insert(&mut tm, &mut NoRefs(8), root, k, &value(k, 0))
            .unwrap()
            .0;
    }
    commit(&mut tm, root);
    // A node whose count exceeds its capacity, properly checksummed.
    let mut raw = tm.read_raw(root).unwrap();
    crate::tm::put32(&mut raw, 16, 10_000);
    crate::checksum::seal(&mut raw, BlockKind::Node);
    let mut w = io.clone();
    crate::block::BlockIo::write(&mut w, root, &raw).unwrap();
    let (mut tm, root) = reopen(&io);
    let e = lookup(&mut tm, root, 5, 8).unwrap_err();
    assert!(e.to_string().contains("entries"), "{e}");
    // A flipped byte fails the checksum.
    raw[200] ^= 0xff;
    crate::block::BlockIo::write(&mut w, root, &raw).unwrap();
    let (mut tm, root) = reopen(&io);
    let e = lookup(&mut tm, root, 5, 8).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
}

/// Rough costs, for the record: `cargo test -p udm-pdata --release --
/// --ignored --nocapture btree_costs`.
#[test]
#[ignore]
fn btree_costs() {
    let n = 1_000_000u64;
    let io = MemIo::new(65536);
    let mut tm = Tm::format(Box::new(io.clone()), 65536).unwrap();
    let mut root = empty(&mut tm, 8).unwrap();
    let t = std::time::Instant::now();
    for k in 0..n {
        root = insert(&mut tm, &mut NoRefs(8), root, k, &value(k, 0))
            .unwrap()
            .0;
    }
    let ins = t.elapsed();
    commit(&mut tm, root);
    let t = std::time::Instant::now();
    let mut hits = 0;
    for k in 0..n {
        let key = k.wrapping_mul(0x9e37_79b9) % n;
        hits += usize::from(
            lookup_with(&mut tm, root, key, 8, |_| ())
                .unwrap()
                .is_some(),
        );
    }
    let look = t.elapsed();
    assert_eq!(hits, n as usize);
    eprintln!(
        "{n} sequential inserts: {:?}/op; {n} random lookups: {:?}/op",
        ins / n as u32,
        look / n as u32
    );
}

#[test]
fn a_node_too_small_to_split_is_refused_before_an_insert_splits_it() {
    let io = MemIo::new(BLOCKS);
    let mut tm = Tm::format(Box::new(io.clone()), BLOCKS).unwrap();
    let mut root = empty(&mut tm, 8).unwrap();
    root = insert(&mut tm, &mut NoRefs(8), root, 1, &value(1, 0))
        .unwrap()
        .0;
    commit(&mut tm, root);
    // A full leaf of capacity 1, checksummed: splitting it would leave a
    // half with no entries.
    let mut raw = tm.read_raw(root).unwrap();
    crate::tm::put32(&mut raw, 20, 1);
    crate::checksum::seal(&mut raw, BlockKind::Node);
    crate::block::BlockIo::write(&mut io.clone(), root, &raw).unwrap();
    let (mut tm, root) = reopen(&io);
    let e = insert(&mut tm, &mut NoRefs(8), root, 2, &value(2, 0)).unwrap_err();
    assert!(e.to_string().contains("capacity 1"), "{e}");
}
