//! The committed fuzz corpora (`fuzz/corpus/<target>/` in the workspace),
//! for the replay tests each crate runs with plain `cargo test`: inputs the
//! fuzzer kept, or that once crashed, stay covered without nightly or
//! libFuzzer.

use std::path::PathBuf;

/// The inputs of fuzz target `target`, as (file name, bytes), sorted by
/// name. An error names the corpus folder or file that could not be read.
pub fn corpus(target: &str) -> Result<Vec<(String, Vec<u8>)>, String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for e in entries {
        let path = e.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        out.push((name.unwrap_or_default(), bytes));
    }
    out.sort();
    Ok(out)
}
