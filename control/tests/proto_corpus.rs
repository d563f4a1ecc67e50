//! Replays the committed fuzz corpus of the control protocol's decoder
//! (fuzz/corpus/control_proto) with the fuzz target's checks.

#![allow(clippy::unwrap_used)]

use udm_control::{decode, Op, Reply};
use udm_core::fuzz_corpus::corpus;

/// The fuzz target's property, for one input.
fn check(data: &[u8]) -> bool {
    match decode(data) {
        Ok(req) => {
            let line = req.to_line().unwrap();
            let again = decode(line.trim_end().as_bytes()).unwrap();
            assert_eq!(again, req);
            true
        }
        Err((id, e)) => {
            let line = Reply::from_result(id, Err(e)).to_line();
            assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
            false
        }
    }
}

#[test]
fn the_committed_corpus_decodes_without_panics() {
    let inputs = corpus("control_proto").unwrap();
    let n = inputs.len();
    let ok = inputs.iter().filter(|(_, data)| check(data)).count();
    assert!(n >= 12, "{n} corpus files");
    // Both sides are covered: requests that decode and ones that do not.
    assert!(ok >= 6 && ok < n, "{ok} of {n} decoded");
}

#[test]
fn named_corpus_entries_decode_as_their_names_say() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/control_proto");
    let read = |n: &str| std::fs::read(dir.join(n)).unwrap();
    assert_eq!(decode(&read("version")).unwrap().op, Op::Version {});
    let r = decode(&read("reload_two_lines")).unwrap();
    assert!(matches!(r.op, Op::Reload { ref table, .. } if table.lines().count() == 2));
    assert_eq!(decode(&read("max_id_unicode")).unwrap().id, Some(u64::MAX));
    for bad in [
        "bad_version",
        "unknown_op",
        "unknown_arg",
        "not_json",
        "not_utf8",
    ] {
        assert!(decode(&read(bad)).is_err(), "{bad}");
    }
}
