//! Entry points shared by the fuzz targets (`fuzz/`) and the corpus
//! regression test (`mapper/tests/fuzz_corpus.rs`): the same bytes go
//! through the same code whether libFuzzer or `cargo test` runs them. Each
//! takes any input and panics only if udm breaks its own contract.

use crate::table::{parse, Registry, Table};
use crate::target::DeviceResolver;

/// Takes `data` (as text, invalid UTF-8 replaced) through the table
/// parser and, with the built-in targets and `resolver`'s devices, through
/// `Table::from_text`: either gives a table or an error. A table it gives
/// covers its lines without gaps, and its own table lines parse again.
/// Returns whether a table was built.
pub fn table(data: &[u8], resolver: &dyn DeviceResolver) -> bool {
    let text = String::from_utf8_lossy(data);
    let specs = parse(&text);
    let Ok(t) = Table::from_text(&text, &Registry::builtin(), resolver) else {
        return false;
    };
    let specs = specs.expect("a table that builds parses");
    assert_eq!(t.targets.len(), specs.len(), "one target per line");
    let mut next = 0;
    for (tt, s) in t.targets.iter().zip(&specs) {
        assert_eq!(
            (tt.begin, tt.len),
            (s.start, s.len),
            "targets in line order"
        );
        assert_eq!(tt.begin, next, "no gaps");
        next = tt.begin + tt.len;
        assert_eq!(t.find(tt.begin), t.find(next - 1), "a target finds itself");
    }
    assert_eq!(t.sectors(), next, "the table is as long as its lines");
    let again = parse(&t.table_lines().join("\n")).expect("table lines parse");
    assert_eq!(again.len(), specs.len());
    // Status lines of a fresh table, from every target.
    let _ = t.status_lines();
    true
}

/// Takes `data` through what a writecache does with the metadata it reads
/// as it starts: the superblock checked against the table's geometry, then
/// the in-memory state rebuilt from the entry array, which must then hold
/// the writecache's invariants. See `targets::writecache::fuzzing` for how
/// the bytes are laid out.
pub fn writecache_meta(data: &[u8]) {
    crate::targets::writecache::fuzz_load(data)
}

/// Takes `data` through a thin pool's metadata open, reads, a change and a
/// commit: see `targets::thin::metadata::fuzzing` for how the bytes make a metadata
/// device whose checksums hold. Returns whether the metadata opened.
pub fn thin_metadata(data: &[u8]) -> bool {
    crate::targets::thin::metadata::fuzzing::load(data)
}

/// A metadata device's first blocks as a [`thin_metadata`] input, for seeds.
pub fn thin_metadata_records(image: &[u8]) -> Vec<u8> {
    crate::targets::thin::metadata::fuzzing::records(image)
}

/// Assembles a raid1 array from metadata devices whose superblocks and
/// bitmaps come from `data`, through the table's constructor, and takes
/// it live for a few writes and reads: see `targets::raid::fuzzing` for
/// how the bytes are laid out (superblocks sealed with valid checksums
/// unless the input says not). The table either fails with a one-line
/// error or gives an array whose status reads as dm-raid's; nothing
/// panics or hangs. Returns whether the array assembled.
pub fn raid_meta(data: &[u8]) -> bool {
    crate::targets::raid::fuzzing::load(data)
}
