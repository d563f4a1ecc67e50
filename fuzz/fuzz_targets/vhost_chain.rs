//! Feeds arbitrary guest memory (descriptor table and avail ring) to the
//! vhost-user-blk export's descriptor-chain walk.
#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_exports::vhost::fuzzing;

fuzz_target!(|data: &[u8]| {
    fuzzing::chains(data);
});
