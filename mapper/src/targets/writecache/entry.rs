//! A cache block's in-memory entry: what the data path, the worker and the
//! streaming stores (stream.rs) share.

/// "No cache block".
pub(crate) const NONE: u32 = u32::MAX;

/// Where a cache block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum St {
    /// In the free extents.
    Free,
    /// Holds the newest data of its origin block.
    Live,
    /// Rewritten elsewhere (block `by`); still on disk until marked free.
    Superseded,
    /// Marked free in the image at generation `gen`; reusable once that is
    /// committed.
    FreePending,
    /// Free on disk, but I/O still pins it.
    Zombie,
}

/// A cache block's in-memory state.
///
/// `repr(C)` with every byte a field (no padding): the write path stores
/// new entries as words with streaming stores (`stream::entry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Entry {
    /// Generation its entry was (or will be) committed with: the one no
    /// commit had started on when the block was allocated (0 when free).
    pub seq: u64,
    /// Origin block index (the constructor bounds it to u32).
    pub ob: u32,
    /// Milliseconds since the engine started, when it was cached (max_age).
    pub born_ms: u32,
    pub prev: u32,
    pub next: u32,
    pub writes: u16,
    pub reads: u16,
    pub wb: bool,
    pub st: St,
    /// Always 0: makes the padding a field, so every byte is initialized.
    pub _pad: u16,
}

// Two per cache line: at 512-byte blocks the data path writes an entry per
// block, so its size is a share of the memory traffic beside the data's.
const _: () = assert!(std::mem::size_of::<Entry>() == 32);
// The fields tile the 32 bytes: no padding (see `Entry::to_words`).
const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(Entry, ob) == 8);
    assert!(offset_of!(Entry, born_ms) == 12);
    assert!(offset_of!(Entry, prev) == 16);
    assert!(offset_of!(Entry, next) == 20);
    assert!(offset_of!(Entry, writes) == 24);
    assert!(offset_of!(Entry, reads) == 26);
    assert!(offset_of!(Entry, wb) == 28);
    assert!(offset_of!(Entry, st) == 29);
    assert!(offset_of!(Entry, _pad) == 30);
};

impl Entry {
    /// A free block's entry; every block in the free extents has it.
    pub const FREE: Entry = Entry {
        ob: 0,
        seq: 0,
        born_ms: 0,
        prev: NONE,
        next: NONE,
        writes: 0,
        reads: 0,
        wb: false,
        st: St::Free,
        _pad: 0,
    };

    /// The entry's 32 bytes in memory, as words.
    #[inline(always)]
    pub fn to_words(self) -> [u64; 4] {
        // SAFETY: Entry is 32 bytes of fields with no padding (the
        // assertions above), each of which is plain data, so every byte
        // is initialized; any bytes are a valid [u64; 4].
        unsafe { std::mem::transmute::<Entry, [u64; 4]>(self) }
    }
}
