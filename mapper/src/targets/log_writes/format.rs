//! dm-log-writes' on-disk format (Linux `drivers/md/dm-log-writes.c`, read
//! by xfstests' `replay-log`), all little-endian:
//!
//! ```text
//!   block 0          super: magic, version, nr_entries, sectorsize
//!   block 1          entry 0: sector, nr_sectors, flags, data_len [mark name]
//!   block 2..2+n     entry 0's data (n = nr_sectors; none for a discard or mark)
//!   ...              entry 1, its data, ...
//! ```
//!
//! A block is `sectorsize` bytes (the logged device's logical block size);
//! `sector` and `nr_sectors` count such blocks. The super's `nr_entries` is
//! rewritten after each FUA or mark entry.

use udm_core::{Error, ErrorKind};

/// `WRITE_LOG_MAGIC`.
pub const MAGIC: u64 = 0x006a_7366_7773_6872;
/// `WRITE_LOG_VERSION`.
pub const VERSION: u64 = 1;
/// The entry followed a flush (an empty flush is an entry of its own).
pub const FLUSH: u64 = 1 << 0;
/// A FUA write.
pub const FUA: u64 = 1 << 1;
/// A discard: no data follows.
pub const DISCARD: u64 = 1 << 2;
/// A mark: its name follows the entry header, in the same block.
pub const MARK: u64 = 1 << 3;
/// A metadata write (REQ_META); udm never sets it.
pub const METADATA: u64 = 1 << 4;

/// Size of the entry header.
pub const ENTRY_BYTES: usize = 32;

/// The super block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Super {
    /// Entries in the log.
    pub nr_entries: u64,
    /// Bytes per block.
    pub sectorsize: u32,
}

impl Super {
    /// Encodes into the start of `out` (at least 28 bytes).
    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&VERSION.to_le_bytes());
        out[16..24].copy_from_slice(&self.nr_entries.to_le_bytes());
        out[24..28].copy_from_slice(&self.sectorsize.to_le_bytes());
    }

    /// Decodes and checks a super block.
    pub fn decode(b: &[u8]) -> Result<Super, Error> {
        let bad = |m: String| Error::new(ErrorKind::Invalid, format!("log super block: {m}"));
        if b.len() < 28 {
            return Err(bad("short read".into()));
        }
        let magic = le64(&b[0..8]);
        if magic != MAGIC {
            return Err(bad(format!(
                "bad magic {magic:#x} (expected {MAGIC:#x}): not a dm-log-writes log"
            )));
        }
        let version = le64(&b[8..16]);
        if version != VERSION {
            return Err(bad(format!("unsupported version {version}")));
        }
        let sectorsize = u32::from_le_bytes([b[24], b[25], b[26], b[27]]);
        if sectorsize < 512 || !sectorsize.is_power_of_two() || sectorsize > 65536 {
            return Err(bad(format!("invalid sectorsize {sectorsize}")));
        }
        Ok(Super {
            nr_entries: le64(&b[16..24]),
            sectorsize,
        })
    }
}

/// One entry's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// First block written.
    pub sector: u64,
    /// Blocks written (or discarded).
    pub nr_sectors: u64,
    /// [`FLUSH`], [`FUA`], [`DISCARD`], [`MARK`], [`METADATA`].
    pub flags: u64,
    /// A mark's name length; 0 otherwise.
    pub data_len: u64,
}

impl Entry {
    /// Encodes into the start of `out` (at least [`ENTRY_BYTES`]).
    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.sector.to_le_bytes());
        out[8..16].copy_from_slice(&self.nr_sectors.to_le_bytes());
        out[16..24].copy_from_slice(&self.flags.to_le_bytes());
        out[24..32].copy_from_slice(&self.data_len.to_le_bytes());
    }

    /// Decodes an entry header (the caller checks it against the log).
    pub fn decode(b: &[u8]) -> Entry {
        Entry {
            sector: le64(&b[0..8]),
            nr_sectors: le64(&b[8..16]),
            flags: le64(&b[16..24]),
            data_len: le64(&b[24..32]),
        }
    }

    /// Blocks of data that follow the header in the log.
    pub fn data_blocks(&self) -> u64 {
        if self.flags & (DISCARD | MARK) != 0 {
            0
        } else {
            self.nr_sectors
        }
    }
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}
