//! Feeds arbitrary bytes to a thin pool's metadata: small metadata devices
//! whose blocks get valid checksums, opened, read, changed and committed
//! (see `udm_mapper::fuzzing::thin_metadata`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_mapper::fuzzing;

fuzz_target!(|data: &[u8]| {
    fuzzing::thin_metadata(data);
});
