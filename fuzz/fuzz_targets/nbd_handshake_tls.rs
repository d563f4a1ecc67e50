//! Feeds arbitrary bytes to the NBD option negotiation of a server that
//! requires TLS: before STARTTLS nothing about an export may leave; after
//! it, the bytes that follow stand for the decrypted stream.
#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_exports::nbd::fuzzing;

fuzz_target!(|data: &[u8]| fuzzing::handshake_tls(data));
