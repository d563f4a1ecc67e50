//! Feeds arbitrary bytes to a writecache's metadata load: the superblock
//! checked against the table's geometry, the state rebuilt from the entry
//! array and its invariants checked (see `udm_mapper::fuzzing`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_mapper::fuzzing;

fuzz_target!(|data: &[u8]| fuzzing::writecache_meta(data));
