//! The thin pool's metadata in Linux's format, checked by Linux's tools
//! (thin-provisioning-tools: `thin_check`, `thin_dump`, `thin_restore`):
//! what udm writes passes `thin_check` at every commit and `thin_dump`
//! lists exactly udm's mappings; what the tools write, udm reads and
//! changes; corrupt metadata and needs_check are one-line errors; a power
//! cut at any I/O of a commit leaves the last commit (or the one being
//! made) and clean metadata.
//!
//! The tool tests skip, saying so, where `thin_check` is not installed
//! (scripts/setup.sh installs it).
#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::path::PathBuf;
use std::process::Command;

use udm_core::testing::TempFile;
use udm_mapper::targets::thin::metadata::{is_no_space, Lookup, ThinMetadata};
use udm_pdata::block::{BlockIo, FileIo, MemIo};

const BLOCK: u64 = 4096;
const DATA_BLOCK_SECTORS: u32 = 128;

fn tool(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/usr/local/sbin"]
        .iter()
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.exists())
}

/// The tools, or `None` after saying why the test skips.
fn tools(test: &str) -> Option<()> {
    if tool("thin_check").is_some() && tool("thin_dump").is_some() && tool("thin_restore").is_some()
    {
        return Some(());
    }
    eprintln!("{test}: skipped: thin_check/thin_dump/thin_restore not installed (apt install thin-provisioning-tools)");
    None
}

fn run(name: &str, args: &[&str]) -> (bool, String) {
    let path = tool(name).unwrap_or_else(|| panic!("{name} not installed"));
    let out = Command::new(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {name}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn thin_check(path: &str, when: &str) {
    let (ok, out) = run("thin_check", &[path]);
    assert!(ok, "thin_check failed {when}:\n{out}");
    // Counts too high are leaks, which thin_check reports but passes.
    for word in ["leak", "differ", "error"] {
        assert!(
            !out.to_lowercase().contains(word),
            "thin_check {when} says {word}:\n{out}"
        );
    }
}

/// Devices and their mappings: dev → (virtual block → data block).
type Mappings = BTreeMap<u32, BTreeMap<u64, u64>>;

fn attr(line: &str, name: &str) -> u64 {
    let key = format!(" {name}=\"");
    let at = line
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} in {line}"))
        + key.len();
    let end = line[at..]
        .find('"')
        .unwrap_or_else(|| panic!("unterminated {name} in {line}"));
    line[at..at + end]
        .parse()
        .unwrap_or_else(|e| panic!("{name} in {line}: {e}"))
}

/// `thin_dump`'s XML as mappings, with each device's mapped_blocks.
fn parse_dump(xml: &str) -> (Mappings, BTreeMap<u32, u64>) {
    let mut m = Mappings::new();
    let mut counts = BTreeMap::new();
    let mut dev = None;
    for line in xml.lines().map(str::trim) {
        if line.starts_with("<device ") {
            let d = attr(line, "dev_id") as u32;
            m.insert(d, BTreeMap::new());
            counts.insert(d, attr(line, "mapped_blocks"));
            dev = Some(d);
        } else if line.starts_with("<single_mapping ") {
            let d = dev.expect("mapping outside a device");
            m.entry(d)
                .or_default()
                .insert(attr(line, "origin_block"), attr(line, "data_block"));
        } else if line.starts_with("<range_mapping ") {
            let d = dev.expect("mapping outside a device");
            let (o, b, n) = (
                attr(line, "origin_begin"),
                attr(line, "data_begin"),
                attr(line, "length"),
            );
            let e = m.entry(d).or_default();
            for i in 0..n {
                e.insert(o + i, b + i);
            }
        }
    }
    (m, counts)
}

fn thin_dump(path: &str) -> (Mappings, BTreeMap<u32, u64>) {
    let (ok, out) = run("thin_dump", &[path]);
    assert!(ok, "thin_dump failed:\n{out}");
    parse_dump(&out)
}

/// What udm reports: every device's mapped ranges, expanded.
fn udm_mappings(md: &mut ThinMetadata) -> Mappings {
    let mut m = Mappings::new();
    for dev in md.devices() {
        let e = m.entry(dev).or_default();
        for (v, b, n) in md.mapped_ranges(dev, 0, u64::MAX).unwrap() {
            for i in 0..n {
                e.insert(v + i, b + i);
            }
        }
    }
    m
}

fn metadata_file(tag: &str, blocks: u64) -> TempFile {
    let f = TempFile::new(tag);
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&f.path)
        .unwrap();
    file.set_len(blocks * BLOCK).unwrap();
    f
}

fn open_file(path: &str) -> Box<dyn BlockIo> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    Box::new(FileIo::new(file).unwrap())
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Data blocks referenced by the model, with their reference counts.
fn data_refs(m: &Mappings) -> BTreeMap<u64, u64> {
    let mut r = BTreeMap::new();
    for maps in m.values() {
        for b in maps.values() {
            *r.entry(*b).or_default() += 1;
        }
    }
    r
}

/// One random step against the model: thins, snapshots (of snapshots),
/// deletes, mappings made, replaced, removed one by one and by range.
fn step(md: &mut ThinMetadata, model: &mut Mappings, rng: &mut Rng, next_dev: &mut u32) {
    let devs: Vec<u32> = model.keys().copied().collect();
    let r = rng.below(1000);
    if devs.is_empty() || r < 5 {
        md.create_thin(*next_dev).unwrap();
        model.insert(*next_dev, BTreeMap::new());
        *next_dev += 1;
        return;
    }
    let dev = devs[rng.below(devs.len() as u64) as usize];
    if r < 12 {
        md.create_snap(*next_dev, dev).unwrap();
        let copy = model[&dev].clone();
        model.insert(*next_dev, copy);
        *next_dev += 1;
    } else if r < 15 && devs.len() > 1 {
        md.delete_thin(dev).unwrap();
        model.remove(&dev);
    } else if r < 700 {
        let v = rng.below(3000);
        let b = match md.alloc_data_block() {
            Ok(b) => b,
            Err(e) if is_no_space(&e) => return,
            Err(e) => panic!("alloc: {e}"),
        };
        md.insert(dev, v, b).unwrap();
        model.get_mut(&dev).unwrap().insert(v, b);
    } else if r < 950 {
        let v = rng.below(3000);
        md.remove(dev, v).unwrap();
        model.get_mut(&dev).unwrap().remove(&v);
    } else {
        let b = rng.below(3000);
        let e = b + rng.below(200);
        let n = md.remove_range(dev, b, e).unwrap();
        let m = model.get_mut(&dev).unwrap();
        let before = m.len();
        m.retain(|k, _| !(b..e).contains(k));
        assert_eq!(n, (before - m.len()) as u64);
    }
}

fn check_model(md: &mut ThinMetadata, model: &Mappings, when: &str) {
    check_model_holding(md, model, &Mappings::new(), when);
}

/// As [`check_model`], with `held` also holding data blocks (a metadata
/// snapshot's mappings).
fn check_model_holding(md: &mut ThinMetadata, model: &Mappings, held: &Mappings, when: &str) {
    assert_eq!(udm_mappings(md), *model, "udm's mappings {when}");
    for (dev, maps) in model {
        assert_eq!(
            md.mapped_blocks(*dev).unwrap(),
            maps.len() as u64,
            "dev {dev} {when}"
        );
        assert_eq!(
            md.highest_mapped(*dev).unwrap(),
            maps.keys().last().copied(),
            "dev {dev} {when}"
        );
    }
    let mut in_use = data_refs(model);
    in_use.extend(data_refs(held));
    assert_eq!(
        md.data_usage().0,
        in_use.len() as u64,
        "data blocks in use {when}"
    );
}

#[test]
fn what_udm_writes_passes_thin_check_at_every_commit_and_thin_dump_lists_its_mappings() {
    if tools("udm_writes").is_none() {
        return;
    }
    let f = metadata_file("thin-md", 2048);
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 20_000, false)
            .unwrap();
    thin_check(&f.path, "after format");
    let mut model = Mappings::new();
    let mut rng = Rng(0x5eed_0038);
    let mut next_dev = 0;
    for commit in 0..30 {
        for _ in 0..400 {
            step(&mut md, &mut model, &mut rng, &mut next_dev);
        }
        md.commit().unwrap();
        let when = format!("at commit {commit}");
        thin_check(&f.path, &when);
        check_model(&mut md, &model, &when);
        let (dumped, counts) = thin_dump(&f.path);
        assert_eq!(dumped, model, "thin_dump {when}");
        for (dev, n) in counts {
            assert_eq!(
                n,
                model[&dev].len() as u64,
                "thin_dump's mapped_blocks of dev {dev} {when}"
            );
        }
    }
    // Reopened, it reads the same.
    drop(md);
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 20_000, false)
            .unwrap();
    check_model(&mut md, &model, "after reopening");
}

#[test]
fn a_random_run_with_aborts_and_metadata_snapshots_stays_clean() {
    let have_tools = tools("aborts").is_some();
    let f = metadata_file("thin-abort", 4096);
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 30_000, false)
            .unwrap();
    let mut model = Mappings::new();
    let mut committed = model.clone();
    let mut held: Option<Mappings> = None;
    let mut rng = Rng(0xab0_47ed);
    let mut next_dev = 0;
    for round in 0..40 {
        for _ in 0..rng.below(700) {
            step(&mut md, &mut model, &mut rng, &mut next_dev);
        }
        if rng.below(100) < 20 {
            md.abort().unwrap();
            model = committed.clone();
        } else {
            md.commit().unwrap();
            committed = model.clone();
        }
        if round % 5 == 4 {
            if held.is_some() {
                md.release_metadata_snap().unwrap();
                held = None;
            } else {
                // Reserving commits first: what it holds is the model now.
                md.reserve_metadata_snap().unwrap();
                committed = model.clone();
                held = Some(model.clone());
            }
        }
        let when = format!("at round {round}");
        let none = Mappings::new();
        check_model_holding(&mut md, &model, held.as_ref().unwrap_or(&none), &when);
        if have_tools {
            thin_check(&f.path, &when);
            assert_eq!(thin_dump(&f.path).0, model, "thin_dump {when}");
            if let Some(h) = &held {
                let (ok, out) = run("thin_dump", &["-m", &f.path]);
                assert!(ok, "thin_dump -m {when}:\n{out}");
                assert_eq!(parse_dump(&out).0, *h, "thin_dump -m {when}");
            }
        }
    }
}

#[test]
fn lookup_says_shared_for_blocks_mapped_before_a_snapshot() {
    let mut md =
        ThinMetadata::open_or_format(Box::new(MemIo::new(256)), DATA_BLOCK_SECTORS, 100, false)
            .unwrap();
    md.create_thin(1).unwrap();
    let b0 = md.alloc_data_block().unwrap();
    md.insert(1, 0, b0).unwrap();
    assert_eq!(
        md.lookup(1, 0).unwrap(),
        Some(Lookup {
            block: b0,
            shared: false
        })
    );
    md.create_snap(2, 1).unwrap();
    assert_eq!(
        md.lookup(1, 0).unwrap(),
        Some(Lookup {
            block: b0,
            shared: true
        })
    );
    assert_eq!(
        md.lookup(2, 0).unwrap(),
        Some(Lookup {
            block: b0,
            shared: true
        })
    );
    // Breaking sharing: the origin's new block is its own.
    let b1 = md.alloc_data_block().unwrap();
    md.insert(1, 0, b1).unwrap();
    assert_eq!(
        md.lookup(1, 0).unwrap(),
        Some(Lookup {
            block: b1,
            shared: false
        })
    );
    assert_eq!(
        md.lookup(2, 0).unwrap(),
        Some(Lookup {
            block: b0,
            shared: true
        })
    );
    assert_eq!(md.lookup(2, 1).unwrap(), None);
    assert_eq!(md.data_usage(), (2, 100));
    md.delete_thin(2).unwrap();
    assert_eq!(md.data_usage(), (1, 100));
    // Errors: a dev id in use, a missing origin, a missing device.
    assert!(md
        .create_thin(1)
        .unwrap_err()
        .to_string()
        .contains("already exists"));
    assert!(md
        .create_snap(3, 9)
        .unwrap_err()
        .to_string()
        .contains("9 does not exist"));
    assert!(md.lookup(9, 0).is_err());
    // Out of data space is told apart.
    for _ in 0..99 {
        md.alloc_data_block().unwrap();
    }
    let e = md.alloc_data_block().unwrap_err();
    assert!(is_no_space(&e), "{e}");
    md.commit().unwrap();
}

#[test]
fn a_commit_with_nothing_changed_writes_nothing() {
    let io = MemIo::new(256);
    let mut md =
        ThinMetadata::open_or_format(Box::new(io.clone()), DATA_BLOCK_SECTORS, 100, false).unwrap();
    md.create_thin(1).unwrap();
    md.commit().unwrap();
    let ios = io.state().ios;
    md.commit().unwrap();
    md.lookup(1, 0).unwrap();
    md.commit().unwrap();
    assert_eq!(
        io.state().ios,
        ios,
        "an idle pool's periodic commit does no I/O"
    );
    let b = md.alloc_data_block().unwrap();
    md.insert(1, 0, b).unwrap();
    md.commit().unwrap();
    assert!(io.state().ios > ios);
}

#[test]
fn abort_goes_back_to_the_last_commit() {
    let io = MemIo::new(256);
    let mut md =
        ThinMetadata::open_or_format(Box::new(io.clone()), DATA_BLOCK_SECTORS, 100, false).unwrap();
    md.create_thin(1).unwrap();
    let b = md.alloc_data_block().unwrap();
    md.insert(1, 5, b).unwrap();
    md.set_transaction_id(0, 7).unwrap();
    md.commit().unwrap();
    md.create_thin(2).unwrap();
    md.remove(1, 5).unwrap();
    md.set_transaction_id(7, 8).unwrap();
    md.abort().unwrap();
    assert!(!md.device_exists(2));
    assert_eq!(md.lookup(1, 5).unwrap().map(|l| l.block), Some(b));
    assert_eq!(md.transaction_id(), 7);
    assert!(md.set_transaction_id(8, 9).is_err());
    md.check_counts().unwrap();
    {
        // A pool that gives up on its metadata marks it and aborts: it
        // comes back read-only, the last commit readable.
        let io = MemIo::new(256);
        let mut md =
            ThinMetadata::open_or_format(Box::new(io.clone()), DATA_BLOCK_SECTORS, 100, false)
                .unwrap();
        md.create_thin(1).unwrap();
        md.commit().unwrap();
        md.create_thin(2).unwrap();
        md.set_needs_check().unwrap();
        md.abort().unwrap();
        assert!(md.needs_check());
        assert_eq!(md.devices(), vec![1]);
        let e = md.create_thin(3).unwrap_err().to_string();
        assert!(e.contains("read-only"), "{e}");
    }
    // The count check sees a data block allocated and never mapped.
    let leaked = md.alloc_data_block().unwrap();
    md.commit().unwrap();
    let e = md.check_counts().unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "data block {leaked} is counted 1 times, referenced 0"
        )),
        "{e}"
    );
}

#[test]
fn a_metadata_snapshot_keeps_the_trees_it_saw_until_released() {
    let have_tools = tools("metadata_snap").is_some();
    let f = metadata_file("thin-msnap", 2048);
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 20_000, false)
            .unwrap();
    let mut model = Mappings::new();
    let mut rng = Rng(0x3e7a_da7a);
    let mut next_dev = 0;
    for _ in 0..1500 {
        step(&mut md, &mut model, &mut rng, &mut next_dev);
    }
    md.commit().unwrap();
    let before = md.metadata_usage().0;
    md.reserve_metadata_snap().unwrap();
    let held = md.held_root().expect("a held root");
    let seen = model.clone();
    let e = md.reserve_metadata_snap().unwrap_err().to_string();
    assert!(e.contains("already held"), "{e}");
    for commit in 0..3 {
        for _ in 0..800 {
            step(&mut md, &mut model, &mut rng, &mut next_dev);
        }
        md.commit().unwrap();
        let when = format!("at commit {commit} with a metadata snapshot held");
        check_model_holding(&mut md, &model, &seen, &when);
        assert_eq!(md.held_root(), Some(held));
        if have_tools {
            thin_check(&f.path, &when);
            assert_eq!(thin_dump(&f.path).0, model, "{when}");
            let (ok, out) = run("thin_dump", &["-m", &f.path]);
            assert!(ok, "thin_dump -m {when}:\n{out}");
            assert_eq!(parse_dump(&out).0, seen, "thin_dump -m {when}");
        }
    }
    md.release_metadata_snap().unwrap();
    assert_eq!(md.held_root(), None);
    check_model(&mut md, &model, "after releasing the snapshot");
    if have_tools {
        thin_check(&f.path, "after releasing the snapshot");
    }
    assert!(md.release_metadata_snap().is_err());
    // Everything only the snapshot held is free again: deleting every
    // device gives back all the data and all but the empty trees' blocks.
    for dev in md.devices() {
        md.delete_thin(dev).unwrap();
    }
    md.commit().unwrap();
    md.check_counts().unwrap();
    assert_eq!(md.data_usage().0, 0);
    assert!(
        md.metadata_usage().0 < before,
        "{:?} vs {before}",
        md.metadata_usage()
    );
}

#[test]
fn the_data_and_metadata_devices_grow_and_never_shrink() {
    let have_tools = tools("resize").is_some();
    let f = metadata_file("thin-grow", 1024);
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 1000, false).unwrap();
    md.create_thin(0).unwrap();
    let mut v = 0;
    let mut model = Mappings::from([(0, BTreeMap::new())]);
    let mut map_all = |md: &mut ThinMetadata, model: &mut Mappings| loop {
        match md.alloc_data_block() {
            Ok(b) => {
                md.insert(0, v, b).unwrap();
                model.get_mut(&0).unwrap().insert(v, b);
                v += 1;
            }
            Err(e) if is_no_space(&e) => break,
            Err(e) => panic!("{e}"),
        }
    };
    map_all(&mut md, &mut model);
    assert_eq!(md.data_usage(), (1000, 1000));
    // Across two bitmaps' boundaries (16320 blocks each).
    md.resize_data_dev(40_000).unwrap();
    assert!(md.resize_data_dev(39_999).is_err());
    map_all(&mut md, &mut model);
    assert_eq!(md.data_usage(), (40_000, 40_000));
    md.commit().unwrap();
    check_model(&mut md, &model, "after growing the data device");
    drop(md);
    // The metadata device grows under the pool; the pool grows into it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f.path)
        .unwrap()
        .set_len(20_000 * BLOCK)
        .unwrap();
    let e = ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 39_000, false)
        .err()
        .unwrap();
    assert!(e.to_string().contains("cannot shrink"), "{e}");
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 40_000, false)
            .unwrap();
    assert_eq!(md.metadata_usage().1, 1024);
    md.resize_metadata_dev(20_000).unwrap();
    assert!(md.resize_metadata_dev(100).is_err());
    assert!(md.resize_metadata_dev(20_001).is_err());
    md.resize_data_dev(100_000).unwrap();
    map_all(&mut md, &mut model);
    md.commit().unwrap();
    check_model(&mut md, &model, "after growing both");
    assert_eq!(md.metadata_usage().1, 20_000);
    if have_tools {
        thin_check(&f.path, "after growing both");
        assert_eq!(thin_dump(&f.path).0, model);
    }
    drop(md);
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 100_000, false)
            .unwrap();
    assert_eq!(md.metadata_usage().1, 20_000);
    check_model(&mut md, &model, "reopened");
}

#[test]
fn what_thin_restore_writes_udm_reads_and_changes_and_thin_check_still_passes() {
    if tools("thin_restore").is_none() {
        return;
    }
    // Linux's tools write the metadata, from XML this test makes: two
    // devices, one with a snapshot sharing part of it.
    let mut model = Mappings::new();
    let mut rng = Rng(0x0b5e_55ed);
    let nr_data = 50_000u64;
    let mut next_data = 0u64;
    let mut xml = format!(
        "<superblock uuid=\"\" time=\"1\" transaction=\"3\" flags=\"0\" version=\"2\" data_block_size=\"{DATA_BLOCK_SECTORS}\" nr_data_blocks=\"{nr_data}\">\n"
    );
    let mut origin = BTreeMap::new();
    for v in (0..4000u64).filter(|_| rng.below(3) != 0) {
        origin.insert(v, next_data);
        next_data += 1;
    }
    let mut snap = origin.clone();
    for v in (0..4000u64).step_by(7) {
        snap.insert(v, next_data);
        next_data += 1;
    }
    model.insert(1, origin);
    model.insert(2, snap);
    for (dev, maps) in &model {
        xml += &format!(
            "  <device dev_id=\"{dev}\" mapped_blocks=\"{}\" transaction=\"0\" creation_time=\"0\" snap_time=\"1\">\n",
            maps.len()
        );
        for (v, b) in maps {
            let time = u64::from(*b >= 4000 - 4000 / 3 && *dev == 2);
            xml += &format!(
                "    <single_mapping origin_block=\"{v}\" data_block=\"{b}\" time=\"{time}\"/>\n"
            );
        }
        xml += "  </device>\n";
    }
    xml += "</superblock>\n";
    let x = TempFile::new("thin-xml");
    std::fs::write(&x.path, &xml).unwrap();
    let f = metadata_file("thin-restored", 4096);
    let (ok, out) = run("thin_restore", &["-i", &x.path, "-o", &f.path]);
    assert!(ok, "thin_restore failed:\n{out}");
    thin_check(&f.path, "after thin_restore");

    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, nr_data, false)
            .unwrap();
    assert_eq!(md.transaction_id(), 3);
    for (dev, maps) in &model {
        for (v, b) in maps {
            assert_eq!(
                md.lookup(*dev, *v).unwrap().map(|l| l.block),
                Some(*b),
                "dev {dev} block {v}"
            );
        }
        assert_eq!(md.lookup(*dev, 4001).unwrap(), None);
    }
    check_model(&mut md, &model, "as thin_restore wrote it");
    // Changes on top, committed: thin_check still passes, thin_dump agrees.
    let mut next_dev = 3;
    for commit in 0..5 {
        for _ in 0..500 {
            step(&mut md, &mut model, &mut rng, &mut next_dev);
        }
        md.commit().unwrap();
        let when = format!("at commit {commit} over thin_restore's metadata");
        thin_check(&f.path, &when);
        assert_eq!(thin_dump(&f.path).0, model, "{when}");
    }
}

#[test]
fn corrupt_metadata_and_needs_check_are_one_line_errors() {
    let io = MemIo::new(512);
    let mut md =
        ThinMetadata::open_or_format(Box::new(io.clone()), DATA_BLOCK_SECTORS, 1000, false)
            .unwrap();
    md.create_thin(0).unwrap();
    for v in 0..600 {
        let b = md.alloc_data_block().unwrap();
        md.insert(0, v, b).unwrap();
    }
    md.commit().unwrap();
    drop(md);
    let reopen = |io: &MemIo, ro: bool| {
        ThinMetadata::open_or_format(Box::new(io.clone()), DATA_BLOCK_SECTORS, 1000, ro)
    };
    let one_line = |e: udm_core::Error, has: &str| {
        let s = e.to_string();
        assert!(
            !s.contains('\n') && s.contains(has),
            "{s:?} should say {has:?} on one line"
        );
    };
    // A block size other than the metadata's.
    let e = ThinMetadata::open_or_format(Box::new(io.clone()), 256, 1000, false)
        .err()
        .unwrap();
    one_line(e, "data block size 128 sectors differs");
    // Each byte of the superblock's first 512 flipped in turn: refused or,
    // for the bytes no check covers... every byte is under the checksum.
    let sb = io.image()[..BLOCK as usize].to_vec();
    for i in (0..512).step_by(7) {
        let mut bad = sb.clone();
        bad[i] ^= 0x40;
        io.clone()
            .write(0, bad.as_slice().try_into().unwrap())
            .unwrap();
        let e = reopen(&io, false)
            .err()
            .unwrap_or_else(|| panic!("byte {i} flipped was accepted"));
        one_line(e, "thin metadata");
    }
    io.clone()
        .write(0, sb.as_slice().try_into().unwrap())
        .unwrap();
    let md = reopen(&io, false).unwrap();
    assert_eq!(md.mapped_blocks(0).unwrap(), 600);
    drop(md);
    // A byte flipped in each block but the superblock, in turn: opening and
    // reading every mapping gives a one-line error or the same mappings,
    // never a panic.
    let image = io.image();
    let used: Vec<u64> = (1..512)
        .filter(|b| image[*b as usize * 4096..][..4096].iter().any(|&x| x != 0))
        .collect();
    let mut refused = 0;
    for b in &used {
        let blk = &image[*b as usize * 4096..][..4096];
        let mut bad: [u8; 4096] = blk.try_into().unwrap();
        bad[100] ^= 1;
        io.clone().write(*b, &bad).unwrap();
        let r = reopen(&io, false).and_then(|mut md| {
            for v in 0..600 {
                assert!(md.lookup(0, v)?.is_some());
            }
            Ok(())
        });
        if let Err(e) = r {
            one_line(e, "metadata block");
            refused += 1;
        }
        io.clone().write(*b, blk.try_into().unwrap()).unwrap();
    }
    // Blocks written before the last commit and since freed hold stale
    // bytes that nothing reads; every other one is refused.
    assert!(
        refused > used.len() / 2,
        "{refused} of blocks {used:?} refused"
    );
    // needs_check: refused unless read-only, where reads work and changes do not.
    let mut md = reopen(&io, false).unwrap();
    md.set_needs_check().unwrap();
    assert!(md.needs_check());
    drop(md);
    one_line(reopen(&io, false).err().unwrap(), "needs_check");
    let mut md = reopen(&io, true).unwrap();
    assert!(md.needs_check());
    assert!(md.lookup(0, 5).unwrap().is_some());
    one_line(md.create_thin(1).unwrap_err(), "read-only");
    drop(md);
    // Linux's tools clear the flag once the metadata checks clean.
    if tools("needs_check").is_some() {
        let f = TempFile::new("thin-needs-check");
        std::fs::write(&f.path, io.image()).unwrap();
        let (ok, out) = run("thin_check", &["--clear-needs-check-flag", &f.path]);
        assert!(ok, "thin_check --clear-needs-check-flag:\n{out}");
        let mut md =
            ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 1000, false)
                .unwrap();
        assert!(!md.needs_check());
        md.create_thin(1).unwrap();
        md.commit().unwrap();
        thin_check(&f.path, "after the flag was cleared");
    }
    // Bad table arguments.
    let e = ThinMetadata::open_or_format(Box::new(MemIo::new(64)), 100, 10, false)
        .err()
        .unwrap();
    one_line(e, "not a multiple of 128");
    let e = ThinMetadata::open_or_format(Box::new(MemIo::new(4)), 128, 10, false)
        .err()
        .unwrap();
    one_line(e, "too small");
}

/// One crash trial's run: random steps and commits from `seed`, the
/// power cut (if `cut` says when, in I/Os from the start of the last
/// commit, and which unflushed writes survive) in the last commit. Returns
/// the model as last committed, the model of the last commit, whether the
/// cut came, and how many I/Os the last commit made (or had made).
fn crash_run(io: &MemIo, seed: u64, cut: Option<(u64, u64)>) -> (Mappings, Mappings, bool, u64) {
    let mut rng = Rng(seed);
    let mut md =
        ThinMetadata::open_or_format(Box::new(io.clone()), DATA_BLOCK_SECTORS, 5000, false)
            .unwrap();
    let mut model = Mappings::new();
    let mut committed = model.clone();
    let mut next_dev = 0;
    let commits = 1 + rng.below(4);
    let mut ios = 0;
    for c in 0..commits {
        for _ in 0..rng.below(600) {
            step(&mut md, &mut model, &mut rng, &mut next_dev);
        }
        let last = c + 1 == commits;
        let before = io.state().ios;
        if let (true, Some((after, keep))) = (last, cut) {
            let mut st = io.state();
            st.cut_after = Some(after);
            st.keep_on_cut = keep;
        }
        let r = md.commit();
        ios = io.state().ios - before;
        match r {
            Ok(()) => committed = model.clone(),
            Err(_) => return (committed, model, true, ios),
        }
    }
    (committed, model, false, ios)
}

#[test]
fn a_power_cut_at_any_io_of_a_commit_leaves_the_last_commit_or_the_next() {
    let have_tools = tools("power_cut").is_some();
    let trials: u64 = std::env::var("UDM_THIN_CUT_TRIALS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let img = TempFile::new("thin-cut");
    // Cuts inside a commit that changed something, by what survived: the
    // last commit, or the one being made.
    let mut outcomes = [0u64; 2];
    for trial in 0..trials {
        let seed = 0x9e37_79b9_7f4a_7c15 ^ ((trial + 1) * 0x1000_0001);
        // A dry run counts the last commit's I/Os (writes and flushes), so
        // that the cut falls at any of them, the superblock's included.
        let (_, _, _, ios) = crash_run(&MemIo::new(1024), seed, None);
        if ios == 0 {
            // Nothing changed since the commit before: nothing to cut.
            continue;
        }
        let mut rng = Rng(seed ^ 0xc0ffee);
        let (at, keep) = (rng.below(ios), rng.next());
        let io = MemIo::new(1024);
        let (committed, model, cut, _) = crash_run(&io, seed, Some((at, keep)));
        assert!(cut, "trial {trial}: the cut at I/O {at} of {ios} came");
        io.state().restore();
        let when = format!("trial {trial}, cut at I/O {at} of {ios}");
        let mut md =
            ThinMetadata::open_or_format(Box::new(io.clone()), DATA_BLOCK_SECTORS, 5000, false)
                .unwrap_or_else(|e| panic!("{when}: reopening: {e}"));
        md.check_counts().unwrap_or_else(|e| panic!("{when}: {e}"));
        let got = udm_mappings(&mut md);
        assert!(
            got == committed || got == model,
            "{when}: the metadata is neither the last commit nor the next"
        );
        if model != committed {
            outcomes[usize::from(got == model)] += 1;
        }
        if have_tools && trial % 10 == 0 {
            std::fs::write(&img.path, io.image()).unwrap();
            thin_check(&img.path, &when);
        }
    }
    eprintln!(
        "cuts inside a commit: {} left the last commit, {} the next",
        outcomes[0], outcomes[1]
    );
    if trials >= 100 {
        assert!(
            outcomes[0] > 0 && outcomes[1] > 0,
            "both outcomes happen: {outcomes:?}"
        );
    }
}

#[test]
fn running_out_of_metadata_refuses_changes_and_keeps_what_was_done_committable() {
    let have_tools = tools("metadata_full").is_some();
    let f = metadata_file("thin-mdfull", 160);
    let mut md =
        ThinMetadata::open_or_format(open_file(&f.path), DATA_BLOCK_SECTORS, 100_000, false)
            .unwrap();
    md.create_thin(0).unwrap();
    let mut model = Mappings::from([(0, BTreeMap::new())]);
    // Scattered mappings fill the metadata device until it refuses one.
    let key = |v: u64| v * 1009 % 1_000_003;
    let mut v = 0u64;
    let e = loop {
        let b = md.alloc_data_block().unwrap();
        match md.insert(0, key(v), b) {
            Ok(()) => {
                model.get_mut(&0).unwrap().insert(key(v), b);
                v += 1;
            }
            Err(e) => {
                // The block the refused mapping would have taken goes back.
                md.release_data_block(b).unwrap();
                break e;
            }
        }
        if v.is_multiple_of(500) {
            md.commit().unwrap();
        }
    };
    assert!(is_no_space(&e), "{e}");
    assert!(v > 1000, "{v} mappings fit");
    assert!(md.metadata_free() < 32, "{}", md.metadata_free());
    let e = md.create_thin(1).unwrap_err();
    assert!(is_no_space(&e), "{e}");
    // Nothing was left half-done: all that fit commits, within the reserve.
    md.commit().unwrap();
    check_model(&mut md, &model, "with the metadata device full");
    // A snapshot shares every leaf. With the device full again, and then
    // a few blocks more than a change needs, all of the snapshot still
    // unmaps: each leaf is copied before it changes, but the copies merged
    // away are blocks of this transaction, free for the next copy at once.
    md.create_snap(1, 0).unwrap();
    model.insert(1, model[&0].clone());
    md.commit().unwrap();
    loop {
        let b = md.alloc_data_block().unwrap();
        if md.insert(0, key(v), b).is_err() {
            md.release_data_block(b).unwrap();
            break;
        }
        model.get_mut(&0).unwrap().insert(key(v), b);
        v += 1;
    }
    let mut blocks = md.metadata_usage().1;
    while md.metadata_free() < 30 {
        blocks += 1;
        OpenOptions::new()
            .write(true)
            .open(&f.path)
            .unwrap()
            .set_len(blocks * BLOCK)
            .unwrap();
        md.resize_metadata_dev(blocks).unwrap();
    }
    let n = md.remove_range(1, 0, u64::MAX).unwrap();
    assert_eq!(n, model[&1].len() as u64);
    model.get_mut(&1).unwrap().clear();
    md.commit().unwrap();
    check_model(&mut md, &model, "after unmapping a snapshot of a full pool");
    if have_tools {
        thin_check(&f.path, "after unmapping a snapshot of a full pool");
    }
    md.delete_thin(1).unwrap();
    model.remove(&1);
    md.commit().unwrap();
    if have_tools {
        thin_check(&f.path, "with the metadata device full");
    }
    // Unmapping takes metadata space too (copy-on-write): it goes as far as
    // the space freed by the commit lets it, and a bigger metadata device
    // lets it finish, as in dm.
    let before = md.mapped_blocks(0).unwrap();
    let removed = match md.remove_range(0, 0, 500_000) {
        Ok(n) => n,
        Err(e) => {
            assert!(is_no_space(&e), "{e}");
            before - md.mapped_blocks(0).unwrap()
        }
    };
    md.commit().unwrap();
    // What it removed, if it stopped part of the way, is gone for good and
    // the rest is intact.
    let now = udm_mappings(&mut md);
    let low = now[&0].range(..500_000).count() as u64;
    assert_eq!(md.mapped_blocks(0).unwrap(), now[&0].len() as u64);
    assert_eq!(before - removed, now[&0].len() as u64);
    let mut kept = model[&0].clone();
    kept.retain(|k, _| *k >= 500_000 || now[&0].contains_key(k));
    assert_eq!(now[&0], kept, "{low} low blocks left");
    md.check_counts().unwrap();
    if have_tools {
        thin_check(&f.path, "after unmapping part of the way");
    }
    OpenOptions::new()
        .write(true)
        .open(&f.path)
        .unwrap()
        .set_len(400 * BLOCK)
        .unwrap();
    md.resize_metadata_dev(400).unwrap();
    md.remove_range(0, 0, 500_000).unwrap();
    model.get_mut(&0).unwrap().retain(|k, _| *k >= 500_000);
    md.commit().unwrap();
    assert!(md.metadata_free() > 32, "{}", md.metadata_free());
    md.create_thin(1).unwrap();
    model.insert(1, BTreeMap::new());
    md.commit().unwrap();
    check_model(&mut md, &model, "after unmapping half");
    if have_tools {
        thin_check(&f.path, "after unmapping half");
    }
}
