//! Every file of the fuzz corpora (`fuzz/corpus/table/`, `fuzz/corpus/thin_metadata/`,
//! `fuzz/corpus/writecache_meta/`, `fuzz/corpus/raid_meta/`) through the same entry points the fuzz
//! targets call: inputs that once crashed stay fixed, checked by plain
//! `cargo test` without nightly or libFuzzer.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

use std::collections::HashMap;
use std::sync::Arc;

use udm_backends::RamDevice;
use udm_core::fuzz_corpus::corpus;
use udm_core::{BlockDevice, Error};
use udm_mapper::fuzzing;

/// The devices the `table` fuzz target resolves, fresh for each input.
fn devices() -> HashMap<&'static str, Arc<dyn BlockDevice>> {
    [("r0", 64 << 10), ("r1", 64 << 10), ("r2", 1 << 20)]
        .into_iter()
        .map(|(name, bytes)| {
            let d: Arc<dyn BlockDevice> = Arc::new(RamDevice::new(name, bytes).unwrap());
            (name, d)
        })
        .collect()
}

/// Every table seed runs clean, and the valid ones (named so) build.
#[test]
fn the_table_corpus_runs_clean() {
    let valid = [
        "linear",
        "linear_two",
        "striped_pow2",
        "striped_three",
        "zero_error_semicolon",
        "comments_blank",
        "writecache",
        "writecache_features",
        "writecache_shared_cache",
    ];
    let seeds = corpus("table").unwrap();
    assert!(seeds.len() >= 10, "the table corpus has its seeds");
    for (name, data) in seeds {
        let devs = devices();
        let resolve = |name: &str| -> Result<Arc<dyn BlockDevice>, Error> {
            devs.get(name)
                .cloned()
                .ok_or_else(|| Error::invalid(format!("no device '{name}'")))
        };
        let built = fuzzing::table(&data, &resolve);
        if valid.contains(&name.as_str()) {
            assert!(built, "seed '{name}' builds a table");
        }
    }
}

#[test]
fn the_writecache_metadata_corpus_runs_clean() {
    for (_name, data) in corpus("writecache_meta").unwrap() {
        fuzzing::writecache_meta(&data);
    }
}

/// The thin metadata seeds: metadata devices of the fuzz target's size in
/// its record form, made by udm (see `write_thin_metadata_seeds`).
fn thin_metadata_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use udm_mapper::targets::thin::metadata::ThinMetadata;
    use udm_pdata::block::MemIo;
    let make = |name: &'static str, f: &dyn Fn(&mut ThinMetadata)| {
        let io = MemIo::new(64);
        let mut md = ThinMetadata::open_or_format(Box::new(io.clone()), 128, 1000, false).unwrap();
        f(&mut md);
        md.commit().unwrap();
        (name, fuzzing::thin_metadata_records(&io.image()))
    };
    let map = |md: &mut ThinMetadata, dev: u32, n: u64| {
        for v in 0..n {
            let b = md.alloc_data_block().unwrap();
            md.insert(dev, v * 3, b).unwrap();
        }
    };
    vec![
        make("fresh", &|_| {}),
        make("thin_and_snapshot", &|md| {
            md.create_thin(0).unwrap();
            map(md, 0, 20);
            md.create_snap(1, 0).unwrap();
            md.commit().unwrap();
            let b = md.alloc_data_block().unwrap();
            md.insert(1, 3, b).unwrap();
        }),
        make("two_level_tree", &|md| {
            md.create_thin(5).unwrap();
            map(md, 5, 600);
        }),
        make("held_root", &|md| {
            md.create_thin(0).unwrap();
            map(md, 0, 10);
            md.reserve_metadata_snap().unwrap();
            md.remove(0, 3).unwrap();
        }),
        make("shared_thrice", &|md| {
            md.create_thin(0).unwrap();
            map(md, 0, 5);
            md.create_snap(1, 0).unwrap();
            md.create_snap(2, 0).unwrap();
            md.create_snap(3, 1).unwrap();
        }),
    ]
}

/// Writes the thin metadata seeds into the committed corpus:
/// `cargo test -p udm-mapper --test fuzz_corpus -- --ignored write_thin`.
#[test]
#[ignore]
fn write_thin_metadata_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/thin_metadata");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, data) in thin_metadata_seeds() {
        std::fs::write(dir.join(name), data).unwrap();
    }
}

#[test]
fn the_thin_metadata_corpus_runs_clean() {
    let seeds = corpus("thin_metadata").unwrap();
    assert!(seeds.len() >= 5, "the thin metadata corpus has its seeds");
    for (name, data) in seeds {
        let opened = fuzzing::thin_metadata(&data);
        // udm's own seeds open; what the fuzzer adds may not.
        if thin_metadata_seeds().iter().any(|(n, _)| *n == name) {
            assert!(opened, "seed {name} opens");
        }
    }
    // The seeds as made now open (the form has not drifted).
    for (name, data) in thin_metadata_seeds() {
        assert!(
            fuzzing::thin_metadata(&data),
            "seed {name} as made now opens"
        );
    }
}

/// A few thousand random mutations of the thin seeds (bytes flipped, set
/// to 0 or 0xff, ranges copied over others) on stable Rust: the fuzz
/// target's contract, no panic, without libFuzzer. `UDM_THIN_MUTATIONS=N`
/// runs N per seed.
#[test]
fn thin_metadata_mutations_do_not_panic() {
    let per_seed: u64 = std::env::var("UDM_THIN_MUTATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    let mut rng = 0x7417_3e7a_u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for (_name, seed) in thin_metadata_seeds() {
        // Where each record's block starts, to aim at the header fields
        // (entry count, capacity, value size) and the first keys.
        let mut starts = Vec::new();
        let mut at = 0;
        while at + 3 <= seed.len() {
            starts.push(at + 3);
            at += 3 + u16::from_le_bytes([seed[at + 1], seed[at + 2]]) as usize;
        }
        for _ in 0..per_seed {
            let mut d = seed.clone();
            for _ in 0..1 + next() % 4 {
                let i = (next() % d.len() as u64) as usize;
                match next() % 5 {
                    4 => {
                        // The superblock (record 0) a third of the time.
                        let r = if next() % 3 == 0 {
                            0
                        } else {
                            next() % starts.len() as u64
                        };
                        let base = starts[r as usize];
                        // Node header fields and first keys; the superblock's
                        // space map roots, tree roots and sizes.
                        const FIELDS: [usize; 16] = [
                            16, 20, 24, 32, 40, 56, 64, 72, 80, 88, 192, 200, 208, 216, 320, 344,
                        ];
                        const VALUES: [u32; 16] = [
                            0,
                            1,
                            2,
                            3,
                            4,
                            5,
                            10,
                            63,
                            64,
                            84,
                            126,
                            252,
                            254,
                            336,
                            16320,
                            u32::MAX,
                        ];
                        let field = FIELDS[(next() % 16) as usize];
                        let v = VALUES[(next() % 16) as usize];
                        if base + field + 4 <= d.len() {
                            d[base + field..base + field + 4].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    0 => d[i] ^= 1 << (next() % 8),
                    1 => d[i] = 0,
                    2 => d[i] = 0xff,
                    _ => {
                        let j = (next() % d.len() as u64) as usize;
                        let n = ((next() % 16) as usize).min(d.len() - i.max(j));
                        d.copy_within(j..j + n, i);
                    }
                }
            }
            fuzzing::thin_metadata(&d);
        }
    }
}

/// A raid_meta leg: its mode byte (see `udm_mapper::targets::raid`'s
/// fuzzing module: 0 a superblock of the array, 3 the version as given,
/// 4 blank, 5 unsealed, 6 no metadata device, 7 failing I/O; bits 3-7 keep
/// the identity, role, legs, region shift or length as given), the
/// superblock's fields by their on-disk offset, and the bitmap's first
/// bytes.
fn raid_leg(mode: u8, fields: &[(usize, u64)], bitmap: &[u8]) -> Vec<u8> {
    let mut sb = [0u8; 80];
    for &(at, v) in fields {
        // The 4-byte fields: version, legs, role, region shift.
        let n = if [8, 12, 32, 36].contains(&at) { 4 } else { 8 };
        sb[at..at + n].copy_from_slice(&v.to_le_bytes()[..n]);
    }
    let mut out = vec![mode];
    out.extend_from_slice(&sb);
    out.push(bitmap.len() as u8);
    out.extend_from_slice(bitmap);
    out
}

/// Superblock field offsets (docs/design/raid1-metadata.md).
const MAGIC: usize = 0;
const VERSION: usize = 8;
const UUID: usize = 16;
const ROLE: usize = 32;
const LEN: usize = 40;
const EVENTS: usize = 48;
const FAILED: usize = 56;
const RECOVERING: usize = 64;
const OFFSET: usize = 72;

/// The raid_meta seeds: a header (legs, table parameters, leg indexes,
/// length, I/O, identity: see the fuzzing module) and each leg's record;
/// whether the array must assemble.
fn raid_meta_seeds() -> Vec<(&'static str, bool, Vec<u8>)> {
    let seed = |name, ok, head: [u8; 6], legs: &[Vec<u8>]| {
        let mut d = head.to_vec();
        legs.iter().for_each(|l| d.extend_from_slice(l));
        (name, ok, d)
    };
    // 2 legs, region_size 128, 1024 sectors (8 regions), two writes.
    let two = [0x00, 0x03, 0x00, 0x07, 0x12, 0x5a];
    let three = [0x01, 0x03, 0x00, 0x07, 0x13, 0x5a];
    let at = |events| [(EVENTS, events)];
    let magic = u64::from_le_bytes(*b"udmraid1");
    vec![
        seed(
            "fresh_legs",
            true,
            two,
            &[raid_leg(4, &[], &[]), raid_leg(4, &[], &[])],
        ),
        seed(
            "no_metadata_nosync",
            true,
            [0x00, 0x0b, 0x00, 0x07, 0x12, 0],
            &[raid_leg(6, &[], &[]), raid_leg(6, &[], &[])],
        ),
        seed(
            "matching_superblocks",
            true,
            two,
            &[raid_leg(0, &at(5), &[0x81]), raid_leg(0, &at(5), &[0x02])],
        ),
        seed(
            "three_legs_check",
            true,
            [0x51, 0x03, 0x00, 0x07, 0x13, 0x5a],
            &[
                raid_leg(0, &at(9), &[]),
                raid_leg(0, &at(9), &[]),
                raid_leg(0, &at(8), &[0xff]),
            ],
        ),
        seed(
            "one_failed_leg",
            true,
            two,
            &[
                raid_leg(0, &[(EVENTS, 7), (FAILED, 2)], &[]),
                raid_leg(0, &at(6), &[]),
            ],
        ),
        seed(
            "recovering_with_offset",
            true,
            three,
            &[
                raid_leg(0, &[(EVENTS, 4), (RECOVERING, 4), (OFFSET, 3)], &[]),
                raid_leg(0, &[(EVENTS, 4), (RECOVERING, 4), (OFFSET, 3)], &[]),
                raid_leg(0, &[(EVENTS, 4), (RECOVERING, 4), (OFFSET, 3)], &[]),
            ],
        ),
        seed(
            "blank_leg_joins",
            true,
            two,
            &[raid_leg(0, &at(3), &[]), raid_leg(4, &[], &[])],
        ),
        seed(
            "unreadable_leg",
            true,
            two,
            &[raid_leg(0, &at(3), &[]), raid_leg(7, &at(3), &[])],
        ),
        seed(
            "bad_checksum",
            true,
            two,
            &[
                raid_leg(0, &at(3), &[]),
                raid_leg(5, &[(MAGIC, magic), (VERSION, 1), (EVENTS, 3)], &[]),
            ],
        ),
        seed(
            "wrong_version",
            true,
            two,
            &[raid_leg(0, &at(3), &[]), raid_leg(3, &[(VERSION, 2)], &[])],
        ),
        seed(
            "rebuild_and_write_mostly",
            true,
            [0x00, 0x63, 0x01, 0x07, 0x12, 0x5a],
            &[raid_leg(0, &at(2), &[]), raid_leg(0, &at(2), &[])],
        ),
        seed(
            "mismatched_uuid",
            false,
            two,
            &[
                raid_leg(0, &at(3), &[]),
                raid_leg(0x08, &[(EVENTS, 3), (UUID, 9)], &[]),
            ],
        ),
        seed(
            "swapped_roles",
            false,
            two,
            &[
                raid_leg(0, &at(3), &[]),
                raid_leg(0x10, &[(EVENTS, 3), (ROLE, 0)], &[]),
            ],
        ),
        seed(
            "huge_array",
            false,
            two,
            &[
                raid_leg(0x80, &[(EVENTS, 3), (LEN, u64::MAX)], &[]),
                raid_leg(0x80, &[(EVENTS, 3), (LEN, u64::MAX)], &[]),
            ],
        ),
        seed(
            "metadata_too_small",
            false,
            [0x02, 0x03, 0x00, 0x07, 0x12, 0x5a],
            &[raid_leg(4, &[], &[]), raid_leg(4, &[], &[])],
        ),
    ]
}

/// Writes the raid_meta seeds into the committed corpus:
/// `cargo test -p udm-mapper --test fuzz_corpus -- --ignored write_raid`.
#[test]
#[ignore]
fn write_raid_meta_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/raid_meta");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, _, data) in raid_meta_seeds() {
        std::fs::write(dir.join(name), data).unwrap();
    }
}

/// Inputs the raid_meta fuzzer found crashing udm (kept in the corpus
/// under these names), and whether each assembles now.
const RAID_META_CRASHES: [(&str, bool); 1] = [
    // A superblock's events count of u64::MAX: the next superblock write
    // overflowed it (refused at assembly since).
    ("crash_events_u64_max", false),
];

/// Every raid_meta seed runs clean; udm's own seeds named valid assemble,
/// the others fail with a one-line error, and the seeds as made now do the
/// same (the form has not drifted).
#[test]
fn the_raid_metadata_corpus_runs_clean() {
    // A panic on the array's worker thread ends only that thread (the
    // fuzzer aborts on it): count them.
    static WORKER_PANICS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some("raid1") {
            WORKER_PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        prev(info)
    }));
    let seeds = corpus("raid_meta").unwrap();
    assert!(seeds.len() >= 8, "the raid metadata corpus has its seeds");
    let made = raid_meta_seeds();
    let expected = made
        .iter()
        .map(|(n, ok, _)| (*n, *ok))
        .chain(RAID_META_CRASHES);
    let expected: HashMap<&str, bool> = expected.collect();
    for (name, data) in &seeds {
        let assembled = fuzzing::raid_meta(data);
        if let Some(&ok) = expected.get(name.as_str()) {
            assert_eq!(assembled, ok, "seed {name} assembles: {ok}");
        }
    }
    for (name, _) in RAID_META_CRASHES {
        assert!(
            seeds.iter().any(|(n, _)| n == name),
            "crash input {name} is in the corpus"
        );
    }
    for (name, ok, data) in made {
        assert_eq!(
            fuzzing::raid_meta(&data),
            ok,
            "seed {name} as made now assembles: {ok}"
        );
    }
    assert_eq!(
        WORKER_PANICS.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no worker thread panicked"
    );
}
