//! Every file of the fuzz corpus (`fuzz/corpus/<target>/`) through the same
//! entry points the fuzz targets call: crashes the fuzzer found once stay
//! fixed, checked by plain `cargo test` without nightly or libFuzzer.

#![allow(clippy::unwrap_used)] // helpers too: allow-unwrap-in-tests only covers #[test] fns

use std::path::PathBuf;

use udm_exports::nbd::fuzzing;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus {}", dir.display());
    files
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

#[test]
fn the_handshake_corpus_runs_clean() {
    for (_path, data) in corpus("nbd_handshake") {
        fuzzing::handshake(&data);
    }
}

#[test]
fn the_request_corpus_runs_clean() {
    for (_path, data) in corpus("nbd_request") {
        fuzzing::request(&data);
    }
}
