//! Every file of the fuzz corpus (`fuzz/corpus/<target>/`) through the same
//! entry points the fuzz targets call: crashes the fuzzer found once stay
//! fixed, checked by plain `cargo test` without nightly or libFuzzer.

#![allow(clippy::unwrap_used)]

use udm_core::fuzz_corpus::corpus;
use udm_exports::nbd::fuzzing;
use udm_exports::vhost::fuzzing as vhost_fuzzing;

#[test]
fn the_handshake_corpus_runs_clean() {
    let inputs = corpus("nbd_handshake").unwrap();
    assert!(!inputs.is_empty(), "the handshake corpus has its seeds");
    for (_name, data) in inputs {
        fuzzing::handshake(&data);
    }
}

#[test]
fn the_tls_required_handshake_corpus_runs_clean() {
    let inputs = corpus("nbd_handshake_tls").unwrap();
    assert!(!inputs.is_empty(), "the TLS handshake corpus has its seeds");
    for (_name, data) in inputs {
        fuzzing::handshake_tls(&data);
    }
    // The handshake corpus too, through the TLS-required parser.
    for (_name, data) in corpus("nbd_handshake").unwrap() {
        fuzzing::handshake_tls(&data);
    }
}

#[test]
fn the_request_corpus_runs_clean() {
    let inputs = corpus("nbd_request").unwrap();
    assert!(!inputs.is_empty(), "the request corpus has its seeds");
    for (_name, data) in inputs {
        fuzzing::request(&data);
    }
}

#[test]
fn the_vhost_chain_corpus_runs_clean() {
    let inputs = corpus("vhost_chain").unwrap();
    assert!(!inputs.is_empty(), "the vhost chain corpus has its seeds");
    for (name, data) in inputs {
        vhost_fuzzing::chains(&data);
        if name == "seed-read" {
            // The well-formed seed's chain is parsed whole.
            let n = vhost_fuzzing::PARSED.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(n, 1, "{name}");
        }
    }
}
