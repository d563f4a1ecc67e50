//! Feeds arbitrary bytes to the NBD request parser and validator.
#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_exports::nbd::fuzzing;

fuzz_target!(|data: &[u8]| fuzzing::request(data));
