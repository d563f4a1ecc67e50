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
        let n = vhost_fuzzing::chains(&data);
        if name == "seed-read" {
            // The well-formed seed's chain is parsed whole.
            assert_eq!(n, 1, "{name}");
        }
    }
}

/// Chains built at random over the fuzz target's layout (descriptor table
/// at the memory's start, avail ring at +0x100, indirect tables and data
/// after), each walked and parsed as the target does: the walks agree with
/// virtio-queue's and the one-pass parse with the reference, whatever the
/// lengths, flags, links, loops and addresses outside memory.
#[test]
fn random_chains_walk_and_parse_as_the_reference_does() {
    // xorshift64*: a fixed sequence, so a failure reproduces.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move |n: u64| {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    };
    const BASE: u64 = 0x1000;
    const LENS: [u32; 10] = [0, 1, 7, 8, 16, 17, 512, 4096, 32, 0x20000];
    let mut parsed = 0;
    for _ in 0..20_000 {
        let mut data = vec![0u8; 0x1000];
        // 16 direct descriptors, and 16 in an indirect area at +0x300.
        for d in 0..32u64 {
            let at = if d < 16 {
                d * 16
            } else {
                0x300 + (d - 16) * 16
            };
            let addr = match rnd(8) {
                0 => rnd(u64::MAX),
                1 => BASE + 0x10000 - rnd(64),
                2 => BASE + 0x300 + rnd(4) * 16,
                _ => BASE + 0x1000 + rnd(0xe000),
            };
            let len = if rnd(4) == 0 {
                rnd(u64::from(u32::MAX)) as u32
            } else {
                LENS[rnd(LENS.len() as u64) as usize]
            };
            let mut flags = 0u16;
            if rnd(3) != 0 {
                flags |= 1; // NEXT
            }
            if rnd(2) == 0 {
                flags |= 2; // WRITE
            }
            if rnd(10) == 0 {
                flags |= 4; // INDIRECT
            }
            let next = if rnd(4) == 0 { rnd(20) } else { (d + 1) % 16 } as u16;
            let at = at as usize;
            data[at..at + 8].copy_from_slice(&addr.to_le_bytes());
            data[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
            data[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
            data[at + 14..at + 16].copy_from_slice(&next.to_le_bytes());
        }
        // Sometimes a well-formed read or write head: header, data, status.
        if rnd(3) == 0 {
            let h = rnd(16) as usize * 16;
            let put =
                |data: &mut Vec<u8>, at: usize, addr: u64, len: u32, flags: u16, next: u16| {
                    data[at..at + 8].copy_from_slice(&addr.to_le_bytes());
                    data[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
                    data[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
                    data[at + 14..at + 16].copy_from_slice(&next.to_le_bytes());
                };
            let (n1, n2) = (((h / 16 + 1) % 16) as u16, ((h / 16 + 2) % 16) as u16);
            let dir = if rnd(2) == 0 { 2 } else { 0 };
            put(&mut data, h, BASE + 0x800, 16, 1, n1);
            put(
                &mut data,
                n1 as usize * 16,
                BASE + 0x2000,
                4096,
                1 | dir,
                n2,
            );
            put(&mut data, n2 as usize * 16, BASE + 0x900, 1, 2, 0);
            data[0x800..0x804].copy_from_slice(&(rnd(3) as u32).to_le_bytes());
        }
        // The avail ring: index 1-16, random heads (some past the table).
        let avail = 0x100;
        let n = 1 + rnd(16) as u16;
        data[avail + 2..avail + 4].copy_from_slice(&n.to_le_bytes());
        for i in 0..16 {
            let head = rnd(18) as u16;
            data[avail + 4 + 2 * i..avail + 6 + 2 * i].copy_from_slice(&head.to_le_bytes());
        }
        parsed += vhost_fuzzing::chains(&data);
    }
    // The generator makes requests, not only broken chains.
    assert!(parsed > 1000, "only {parsed} chains parsed whole");
}
