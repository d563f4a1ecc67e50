//! Every file of the fuzz corpora (`fuzz/corpus/table/`,
//! `fuzz/corpus/writecache_meta/`) through the same entry points the fuzz
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
