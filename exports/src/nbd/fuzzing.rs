//! Entry points shared by the fuzz targets (`fuzz/`) and the corpus
//! regression test (`exports/tests/fuzz_corpus.rs`): the same bytes go
//! through the same parsers whether libFuzzer or `cargo test` runs them.

use super::handshake::{Handshake, Outcome, TlsMode};
use super::proto::{self, ExportInfo, TxParams};

fn exports() -> Vec<ExportInfo> {
    vec![
        ExportInfo {
            name: "lin".into(),
            description: "fuzz".into(),
            size: 1 << 30,
            flags: proto::FLAG_HAS_FLAGS | proto::FLAG_SEND_FLUSH | proto::FLAG_SEND_FUA,
            min_block: 512,
            pref_block: 4096,
            max_payload: 1 << 25,
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size: 4096,
            flags: proto::FLAG_HAS_FLAGS | proto::FLAG_READ_ONLY,
            min_block: 4096,
            pref_block: 4096,
            max_payload: 1 << 20,
        },
    ]
}

/// Runs `data` through a handshake: the first byte picks where the input
/// is split in two deliveries; whatever is left unconsumed after
/// `Continue` is kept and re-fed with the next delivery, as a connection
/// does. Panics only if the state machine breaks its own contract.
pub fn handshake(data: &[u8]) {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let exports = exports();
    let mut h = Handshake::new();
    let mut out = Vec::new();
    let cut = (split as usize * data.len()) / 256;
    let mut pending: Vec<u8> = Vec::new();
    for part in [&data[..cut], &data[cut..]] {
        pending.extend_from_slice(part);
        let (n, outcome) = h.feed(&pending, &exports, &mut out);
        assert!(n <= pending.len(), "consumed more than given");
        pending.drain(..n);
        if outcome != Outcome::Continue {
            return;
        }
    }
}

/// As [`handshake`], on a server that requires TLS: before STARTTLS no
/// reply may carry an export's name, size or context (only ACKs of
/// STARTTLS and ABORT, and errors); after it (the bytes that follow stand
/// for decrypted ones) negotiation goes on as without TLS. Panics if the
/// state machine leaks or breaks its contract.
pub fn handshake_tls(data: &[u8]) {
    let Some((&split, data)) = data.split_first() else {
        return;
    };
    let exports = exports();
    let mut h = Handshake::with_tls(TlsMode::Require);
    let mut out = Vec::new();
    let cut = (split as usize * data.len()) / 256;
    let mut pending: Vec<u8> = Vec::new();
    let mut plain = true;
    for part in [&data[..cut], &data[cut..]] {
        pending.extend_from_slice(part);
        loop {
            let (n, outcome) = h.feed(&pending, &exports, &mut out);
            assert!(n <= pending.len(), "consumed more than given");
            pending.drain(..n);
            if plain {
                assert_nothing_leaks(&out);
            }
            match outcome {
                Outcome::Continue => break,
                Outcome::StartTls => {
                    assert!(plain, "STARTTLS acknowledged twice");
                    plain = false;
                    out.clear();
                }
                Outcome::Transmission(_) => {
                    assert!(!plain, "transmission before TLS");
                    return;
                }
                Outcome::Close(_) => return,
            }
        }
    }
}

/// Every reply in `out` is an ACK or an error: nothing that names or
/// describes an export.
fn assert_nothing_leaks(out: &[u8]) {
    let mut at = 0;
    while at + 20 <= out.len() {
        let typ = u32::from_be_bytes([out[at + 12], out[at + 13], out[at + 14], out[at + 15]]);
        let len = u32::from_be_bytes([out[at + 16], out[at + 17], out[at + 18], out[at + 19]]);
        assert!(
            typ == proto::REP_ACK || typ & (1 << 31) != 0,
            "reply type {typ} before TLS"
        );
        at += 20 + len as usize;
    }
    assert_eq!(at, out.len(), "only whole option replies");
}

/// Parses and validates every 28-byte request header in `data` against
/// both a writable and a read-only export.
pub fn request(data: &[u8]) {
    let params = [
        TxParams {
            size: 1 << 30,
            flags: proto::FLAG_HAS_FLAGS
                | proto::FLAG_SEND_FLUSH
                | proto::FLAG_SEND_FUA
                | proto::FLAG_SEND_TRIM
                | proto::FLAG_SEND_WRITE_ZEROES
                | proto::FLAG_SEND_FAST_ZERO
                | proto::FLAG_SEND_CACHE,
            min_block: 512,
            max_payload: 1 << 25,
            block_status: true,
        },
        TxParams {
            size: 4096,
            flags: proto::FLAG_HAS_FLAGS | proto::FLAG_READ_ONLY,
            min_block: 4096,
            max_payload: 1 << 20,
            block_status: false,
        },
    ];
    for chunk in data.chunks(proto::REQUEST_LEN) {
        let Ok(r) = proto::parse_request(chunk) else {
            continue;
        };
        for p in &params {
            if let Ok(cmd) = proto::validate(&r, p) {
                // What validation lets through is inside the export.
                if !matches!(cmd, proto::Command::Disc | proto::Command::Flush) {
                    assert!(r.offset.saturating_add(r.len as u64) <= p.size);
                }
            }
        }
    }
    let _ = proto::parse_info_request(data);
    let _ = proto::parse_meta_request(data);
    let _ = proto::parse_export_name(data);
}
