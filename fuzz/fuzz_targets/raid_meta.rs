//! Feeds arbitrary bytes to raid1's assembly: metadata devices whose
//! superblocks (sealed with valid checksums unless the input says not) and
//! bitmaps come from the input, a table line over them, then a few writes
//! and reads of the live array (see `udm_mapper::fuzzing::raid_meta`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_mapper::fuzzing;

fuzz_target!(|data: &[u8]| {
    fuzzing::raid_meta(data);
});
