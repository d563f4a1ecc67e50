//! The writecache's on-disk format and the rules that make it crash-safe.
//!
//! Layout of the cache device, from `start_sector` (all little-endian):
//!
//! ```text
//!   0      superblock (one 4 KiB block; the first 48 bytes are used)
//!   4096   entry array: one 16-byte entry per cache block, 256 per 4 KiB
//!          metadata block: { origin sector: u64, seq: u64 }; seq 0 = free
//!   …      data blocks, from the first block-size boundary after the array
//! ```
//!
//! Superblock: magic, version, block size, number of blocks, the sequence
//! count of the last completed commit, and a checksum of those fields.
//!
//! ## Commit protocol
//!
//! A commit publishes generation `G = committed + 1`: it writes the changed
//! metadata blocks, flushes the cache (and the origin), then writes the
//! superblock with `seq = G` and FUA. On load, entries whose seq is above
//! the superblock's are ignored (their commit never finished), and of
//! several entries for one origin sector the highest seq wins.
//!
//! A commit may tear: any subset of its metadata blocks may reach the disk
//! before the power goes, at 512-byte (so whole-entry) granularity. It is
//! safe because of what the engine lets a commit contain:
//!
//! 1. an entry gets its seq when its block is allocated, and that seq is
//!    the generation no commit has started on yet, so a torn commit's new
//!    entries are ignored on load; the commit of that generation waits for
//!    the block's data write to complete before it flushes, so a durable
//!    entry never points at data that was not written;
//! 2. a block whose entry is superseded (the sector was rewritten elsewhere)
//!    is marked free only in a commit *after* the one that made the new
//!    entry durable; a written-back block is marked free only after the
//!    origin was flushed and once no older entry for its sector is left on
//!    disk — so any subset of free markers leaves the newest durable data
//!    reachable;
//! 3. a freed block is reused only after the commit holding its free marker
//!    completed, so an entry on disk never points at data that is not its own;
//! 4. a discarded block is dropped as a written-back one is: only after the
//!    discard reached the origin (once no writeback of its range was in
//!    flight, so no older data lands on top of it) and the origin was
//!    flushed, and only once no older entry for its sector is left on disk.
//!    A torn commit then shows either the pre-discard data or the discarded
//!    origin, never anything older.
//!
//! And a write goes around the cache (the cleaner) only when no older entry
//! for its sector may still be on disk; otherwise it is cached, so that its
//! entry outranks the old one whichever markers a crash keeps.

use udm_core::Error;

/// Bytes of the superblock area (one page, so the entry array starts aligned).
pub const SB_BYTES: u64 = 4096;
/// Bytes per on-disk entry.
pub const ENTRY_BYTES: u64 = 16;
/// Bytes per metadata block (the unit of metadata writes).
pub const MBLOCK_BYTES: usize = 4096;
/// Entries per metadata block.
pub const ENTRIES_PER_MBLOCK: usize = MBLOCK_BYTES / ENTRY_BYTES as usize;

const MAGIC: u64 = u64::from_le_bytes(*b"udm-wc\0\x01");
const VERSION: u32 = 1;

/// Where things are on the cache device (byte offsets from `start_sector`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Cache block size in bytes.
    pub block_size: u32,
    /// Number of cache blocks.
    pub n_blocks: u32,
    /// Metadata blocks of the entry array.
    pub mblocks: u32,
    /// Byte offset of data block 0.
    pub data_start: u64,
}

impl Geometry {
    /// The largest cache that fits `bytes` with blocks of `block_size`.
    pub fn fit(bytes: u64, block_size: u32) -> Result<Geometry, Error> {
        let bs = block_size as u64;
        let avail = bytes.saturating_sub(SB_BYTES);
        // Each block costs its data plus its entry; round the array up.
        let mut n = avail / (bs + ENTRY_BYTES);
        n = n.min(u32::MAX as u64 - 1);
        loop {
            let g = Geometry::with_blocks(n as u32, block_size);
            if g.data_start + n * bs <= bytes || n == 0 {
                break;
            }
            n -= 1;
        }
        if n == 0 {
            return Err(Error::invalid(format!(
                "cache device too small: {bytes} bytes hold no {block_size}-byte block and its metadata"
            )));
        }
        Ok(Geometry::with_blocks(n as u32, block_size))
    }

    /// The geometry of a cache of `n` blocks of `block_size` bytes.
    pub fn with_blocks(n: u32, block_size: u32) -> Geometry {
        let bs = block_size as u64;
        let mblocks = (n as u64).div_ceil(ENTRIES_PER_MBLOCK as u64);
        let meta_end = SB_BYTES + mblocks * MBLOCK_BYTES as u64;
        Geometry {
            block_size,
            n_blocks: n,
            mblocks: mblocks as u32,
            data_start: meta_end.div_ceil(bs) * bs,
        }
    }

    /// Byte offset of metadata block `m`.
    pub fn mblock_offset(&self, m: u32) -> u64 {
        SB_BYTES + m as u64 * MBLOCK_BYTES as u64
    }

    /// Byte offset of data block `b`.
    pub fn block_offset(&self, b: u32) -> u64 {
        self.data_start + b as u64 * self.block_size as u64
    }
}

/// The superblock's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Super {
    /// Cache block size in bytes.
    pub block_size: u32,
    /// Number of cache blocks.
    pub n_blocks: u32,
    /// Generation of the last completed commit.
    pub seq: u64,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Super {
    /// Encodes into the first bytes of `out` (at least 40 bytes).
    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        out[16..20].copy_from_slice(&self.n_blocks.to_le_bytes());
        out[20..24].copy_from_slice(&0u32.to_le_bytes());
        out[24..32].copy_from_slice(&self.seq.to_le_bytes());
        let sum = fnv1a(&out[0..32]);
        out[32..40].copy_from_slice(&sum.to_le_bytes());
    }

    /// Decodes a superblock: `Ok(None)` when there is none (no magic: a new
    /// cache, to be formatted), an error when it is damaged or foreign.
    pub fn decode(b: &[u8]) -> Result<Option<Super>, Error> {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
        if b.len() < 40 || u64_at(0) != MAGIC {
            return Ok(None);
        }
        if u64_at(32) != fnv1a(&b[0..32]) {
            return Err(Error::invalid("writecache: superblock checksum mismatch"));
        }
        if u32_at(8) != VERSION {
            return Err(Error::invalid(format!(
                "writecache: unsupported metadata version {}",
                u32_at(8)
            )));
        }
        let seq = u64_at(24);
        if seq == u64::MAX {
            // The next commit's generation would not fit.
            return Err(Error::invalid(
                "writecache: superblock generation out of range",
            ));
        }
        Ok(Some(Super {
            block_size: u32_at(12),
            n_blocks: u32_at(16),
            seq,
        }))
    }
}

/// One on-disk entry: which origin sector a cache block holds, and the
/// generation it was written in (0: the block is free).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskEntry {
    /// Origin sector of the block's data.
    pub sector: u64,
    /// Generation; 0 for a free block.
    pub seq: u64,
}

impl DiskEntry {
    /// A free block's entry.
    pub const FREE: DiskEntry = DiskEntry { sector: 0, seq: 0 };

    /// The 16 bytes on disk.
    #[inline]
    pub fn to_bytes(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[0..8].copy_from_slice(&self.sector.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out
    }

    /// Encodes into 16 bytes.
    pub fn encode(&self, out: &mut [u8]) {
        out[..16].copy_from_slice(&self.to_bytes());
    }

    /// Decodes 16 bytes.
    pub fn decode(b: &[u8]) -> DiskEntry {
        DiskEntry {
            sector: u64::from_le_bytes(b[0..8].try_into().unwrap_or([0; 8])),
            seq: u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_fits_data_and_metadata() {
        for bs in [512u32, 4096, 65536] {
            let bytes = 64 << 20;
            let g = Geometry::fit(bytes, bs).unwrap();
            assert!(g.data_start + g.n_blocks as u64 * bs as u64 <= bytes);
            assert!(g.mblocks as usize * ENTRIES_PER_MBLOCK >= g.n_blocks as usize);
            assert_eq!(g.data_start % bs as u64, 0);
            assert!(g.data_start >= SB_BYTES + g.mblocks as u64 * 4096);
            // Nearly all of the device is data.
            assert!(
                g.n_blocks as u64 * bs as u64 > bytes * 9 / 10,
                "bs {bs}: {g:?}"
            );
        }
        assert!(Geometry::fit(4096, 4096).is_err());
    }

    #[test]
    fn superblock_round_trips_and_detects_damage() {
        let s = Super {
            block_size: 4096,
            n_blocks: 1234,
            seq: 99,
        };
        let mut b = vec![0u8; 512];
        s.encode(&mut b);
        assert_eq!(Super::decode(&b).unwrap(), Some(s));
        assert_eq!(
            Super::decode(&[0u8; 512]).unwrap(),
            None,
            "zeroes: unformatted"
        );
        b[25] ^= 1;
        assert!(Super::decode(&b)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
    }

    #[test]
    fn entries_round_trip_and_zero_is_free() {
        let e = DiskEntry { sector: 8, seq: 3 };
        let mut b = [0u8; 16];
        e.encode(&mut b);
        assert_eq!(DiskEntry::decode(&b), e);
        assert_eq!(DiskEntry::decode(&[0u8; 16]), DiskEntry::FREE);
    }
}
