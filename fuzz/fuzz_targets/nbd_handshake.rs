//! Feeds arbitrary bytes to the NBD option negotiation, split at an
//! arbitrary point (as two recvs would), and checks it never panics and
//! never claims to consume more than it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_exports::nbd::fuzzing;

fuzz_target!(|data: &[u8]| fuzzing::handshake(data));
