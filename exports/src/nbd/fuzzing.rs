//! Entry points shared by the fuzz targets (`fuzz/`) and the corpus
//! regression test (`exports/tests/fuzz_corpus.rs`): the same bytes go
//! through the same parsers whether libFuzzer or `cargo test` runs them.

use super::handshake::{Handshake, Outcome};
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
