//! raid1's on-disk metadata: a superblock and a write-intent bitmap on each
//! leg's metadata device (format in `docs/design/raid1-metadata.md`), and
//! how the array is assembled from what the legs hold.
//!
//! The superblock fits one 512-byte sector, so a power cut leaves it old or
//! new, never torn. The bitmap starts at byte 4096, one bit per region, and
//! is written in 4 KiB blocks; a set bit means "writes to this region may
//! have reached some legs and not others", so a torn bitmap block can only
//! leave bits set that the next resync clears: never unsafe.

use udm_core::Error;

/// "udmraid1", little-endian.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"udmraid1");
/// The format's version.
pub(crate) const VERSION: u32 = 1;
/// Bytes of the superblock (one sector).
pub(crate) const SB_BYTES: usize = 512;
/// Byte offset of the bitmap on the metadata device.
pub(crate) const BITMAP_OFFSET: u64 = 4096;
/// The unit the bitmap is written in.
pub(crate) const BM_BLOCK: usize = 4096;
/// Bits in one bitmap block.
pub(crate) const BITS_PER_BLOCK: u64 = (BM_BLOCK * 8) as u64;
/// The highest events count assembly takes: every superblock write adds
/// one, and the count must keep growing (the highest is the freshest), so
/// a count past this (2^63, which no array reaches) is damaged metadata.
pub(crate) const MAX_EVENTS: u64 = 1 << 63;

/// One leg's superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Super {
    /// The array's identity, the same on every leg.
    pub uuid: [u8; 16],
    /// Legs in the array.
    pub nlegs: u32,
    /// This leg's index.
    pub role: u32,
    /// log2 of the region size in sectors.
    pub region_shift: u32,
    /// The array's length in sectors.
    pub array_sectors: u64,
    /// Bumped at every superblock write: the highest is the freshest.
    pub events: u64,
    /// Legs failed (bit per leg).
    pub failed: u64,
    /// Legs being rebuilt (bit per leg): not in sync.
    pub recovering: u64,
    /// The rebuild's checkpoint (md's `recovery_offset`): the regions
    /// below it are copied onto the legs being rebuilt, and durable there.
    pub recovery_offset: u64,
}

fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Seals a superblock's first [`SB_BYTES`]: its checksum over the bytes
/// before it, in its last 8.
pub(crate) fn seal(sb: &mut [u8]) {
    let sum = fnv1a(&sb[0..SB_BYTES - 8]);
    sb[SB_BYTES - 8..SB_BYTES].copy_from_slice(&sum.to_le_bytes());
}

impl Super {
    /// Encodes into the first [`SB_BYTES`] of `out` (the rest zeroed).
    pub fn encode(&self, out: &mut [u8]) {
        let o = &mut out[..SB_BYTES];
        o.fill(0);
        o[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        o[8..12].copy_from_slice(&VERSION.to_le_bytes());
        o[12..16].copy_from_slice(&self.nlegs.to_le_bytes());
        o[16..32].copy_from_slice(&self.uuid);
        o[32..36].copy_from_slice(&self.role.to_le_bytes());
        o[36..40].copy_from_slice(&self.region_shift.to_le_bytes());
        o[40..48].copy_from_slice(&self.array_sectors.to_le_bytes());
        o[48..56].copy_from_slice(&self.events.to_le_bytes());
        o[56..64].copy_from_slice(&self.failed.to_le_bytes());
        o[64..72].copy_from_slice(&self.recovering.to_le_bytes());
        o[72..80].copy_from_slice(&self.recovery_offset.to_le_bytes());
        seal(o);
    }

    /// Decodes a superblock: `Ok(None)` when there is none (no magic: a
    /// new leg), an error when it is damaged or of another version.
    pub fn decode(b: &[u8]) -> Result<Option<Super>, Error> {
        if b.len() < SB_BYTES {
            return Ok(None);
        }
        let u64_at = |o: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(w)
        };
        let u32_at = |o: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&b[o..o + 4]);
            u32::from_le_bytes(w)
        };
        if u64_at(0) != MAGIC {
            return Ok(None);
        }
        if u64_at(SB_BYTES - 8) != fnv1a(&b[0..SB_BYTES - 8]) {
            return Err(Error::invalid("superblock checksum mismatch"));
        }
        if u32_at(8) != VERSION {
            return Err(Error::invalid(format!(
                "unsupported metadata version {}",
                u32_at(8)
            )));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        Ok(Some(Super {
            nlegs: u32_at(12),
            uuid,
            role: u32_at(32),
            region_shift: u32_at(36),
            array_sectors: u64_at(40),
            events: u64_at(48),
            failed: u64_at(56),
            recovering: u64_at(64),
            recovery_offset: u64_at(72),
        }))
    }
}

/// Bytes of the bitmap of `nregions` regions, in whole blocks.
pub(crate) fn bitmap_bytes(nregions: u64) -> u64 {
    nregions.div_ceil(BITS_PER_BLOCK) * BM_BLOCK as u64
}

/// Bytes a metadata device needs for `nregions` regions.
pub(crate) fn meta_bytes(nregions: u64) -> u64 {
    BITMAP_OFFSET + bitmap_bytes(nregions)
}

/// What one leg's metadata device held when the array was assembled.
pub(crate) enum LegMeta {
    /// The leg has no metadata device (`-`).
    None,
    /// Reading it failed.
    Unreadable,
    /// No superblock: a new leg.
    Blank,
    /// A superblock, and the bitmap as words (bit r of word r/64).
    Found(Super, Vec<u64>),
}

/// The array as its legs' metadata describe it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Assembly {
    /// The array's identity (new if no leg had one).
    pub uuid: [u8; 16],
    /// The highest events count seen.
    pub events: u64,
    /// Legs failed: as the freshest superblock says, and those whose
    /// metadata could not be read.
    pub failed: u64,
    /// Legs that must be rebuilt: as the freshest superblock says, and new
    /// (blank) legs of an existing array.
    pub recovering: u64,
    /// Where their rebuild goes on from (region index): the freshest
    /// superblock's checkpoint, or 0 when a blank leg joins them.
    pub recovery_offset: u64,
    /// Regions dirty on any leg (the union: a safe superset).
    pub dirty: Vec<u64>,
    /// No leg had a superblock: the array is new.
    pub fresh: bool,
}

/// Assembles the array from its legs' metadata, given the table's
/// geometry; an error names a leg whose metadata belongs elsewhere.
pub(crate) fn assemble(
    legs: &[LegMeta],
    region_shift: u32,
    array_sectors: u64,
    new_uuid: [u8; 16],
) -> Result<Assembly, Error> {
    let nregions = array_sectors.div_ceil(1 << region_shift);
    let words = nregions.div_ceil(64) as usize;
    let mut a = Assembly {
        uuid: new_uuid,
        events: 0,
        failed: 0,
        recovering: 0,
        recovery_offset: 0,
        dirty: vec![0; words],
        fresh: true,
    };
    let mut best: Option<&Super> = None;
    for (i, l) in legs.iter().enumerate() {
        let LegMeta::Found(sb, _) = l else { continue };
        if let Some(b) = best {
            if sb.uuid != b.uuid {
                return Err(Error::invalid(format!(
                    "leg {i}'s metadata belongs to another array"
                )));
            }
        }
        if sb.nlegs as usize != legs.len() {
            return Err(Error::invalid(format!(
                "leg {i}'s metadata is of an array of {} legs, the table has {}",
                sb.nlegs,
                legs.len()
            )));
        }
        if sb.role as usize != i {
            return Err(Error::invalid(format!(
                "leg {i}'s metadata is that of leg {}",
                sb.role
            )));
        }
        if sb.region_shift != region_shift {
            return Err(Error::invalid(format!(
                "region_size {} differs from the metadata's {} (leg {i})",
                1u64 << region_shift,
                1u64 << sb.region_shift.min(63)
            )));
        }
        if sb.array_sectors != array_sectors {
            return Err(Error::invalid(format!(
                "the table's length {array_sectors} differs from the metadata's {} (leg {i})",
                sb.array_sectors
            )));
        }
        if sb.events > MAX_EVENTS {
            return Err(Error::invalid(format!(
                "leg {i}'s metadata has an events count of {}, past the {MAX_EVENTS} an array can reach",
                sb.events
            )));
        }
        if best.is_none_or(|b| sb.events > b.events) {
            best = Some(sb);
        }
    }
    if let Some(b) = best {
        a.fresh = false;
        a.uuid = b.uuid;
        a.events = b.events;
        a.failed = b.failed;
        a.recovering = b.recovering;
        a.recovery_offset = b.recovery_offset.min(nregions);
    }
    for (i, l) in legs.iter().enumerate() {
        match l {
            LegMeta::Found(_, bm) => {
                for (d, s) in a.dirty.iter_mut().zip(bm) {
                    *d |= s;
                }
            }
            LegMeta::Unreadable => a.failed |= 1 << i,
            LegMeta::Blank if !a.fresh => {
                a.recovering |= 1 << i;
                a.recovery_offset = 0;
            }
            _ => {}
        }
    }
    // Bits past the last region are noise on a blank-then-formatted leg.
    if !nregions.is_multiple_of(64) {
        if let Some(last) = a.dirty.last_mut() {
            *last &= (1u64 << (nregions % 64)) - 1;
        }
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb(role: u32, events: u64) -> Super {
        Super {
            uuid: [7; 16],
            nlegs: 2,
            role,
            region_shift: 10,
            array_sectors: 1 << 20,
            events,
            failed: 0,
            recovering: 0,
            recovery_offset: 0,
        }
    }

    #[test]
    fn superblock_round_trips_and_detects_damage() {
        let s = sb(1, 9);
        let mut b = vec![0u8; SB_BYTES];
        s.encode(&mut b);
        assert_eq!(Super::decode(&b).unwrap(), Some(s));
        b[50] ^= 1;
        assert!(Super::decode(&b)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
        assert_eq!(Super::decode(&[0u8; SB_BYTES]).unwrap(), None);
    }

    #[test]
    fn assembly_takes_the_freshest_superblock_and_the_union_of_bitmaps() {
        let mut a = sb(0, 5);
        a.failed = 0;
        let mut b = sb(1, 6);
        b.failed = 1;
        let legs = [
            LegMeta::Found(a, vec![1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            LegMeta::Found(b, vec![2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
        ];
        let r = assemble(&legs, 10, 1 << 20, [0; 16]).unwrap();
        assert_eq!((r.events, r.failed, r.fresh), (6, 1, false));
        assert_eq!(r.dirty[0], 3);
    }

    #[test]
    fn a_blank_leg_of_an_existing_array_is_rebuilt_and_a_new_array_is_fresh() {
        let legs = [LegMeta::Found(sb(0, 1), vec![0; 16]), LegMeta::Blank];
        let r = assemble(&legs, 10, 1 << 20, [0; 16]).unwrap();
        assert_eq!(r.recovering, 2);
        let r = assemble(&[LegMeta::Blank, LegMeta::None], 10, 1 << 20, [3; 16]).unwrap();
        assert!(r.fresh);
        assert_eq!(r.uuid, [3; 16]);
    }

    #[test]
    fn foreign_or_swapped_legs_are_refused() {
        let mut other = sb(1, 1);
        other.uuid = [9; 16];
        let legs = [
            LegMeta::Found(sb(0, 1), vec![]),
            LegMeta::Found(other, vec![]),
        ];
        assert!(assemble(&legs, 10, 1 << 20, [0; 16])
            .unwrap_err()
            .to_string()
            .contains("another array"));
        let legs = [LegMeta::Found(sb(1, 1), vec![]), LegMeta::Blank];
        assert!(assemble(&legs, 10, 1 << 20, [0; 16])
            .unwrap_err()
            .to_string()
            .contains("that of leg 1"));
    }

    #[test]
    fn an_events_count_that_cannot_grow_is_refused() {
        let legs = [LegMeta::Found(sb(0, MAX_EVENTS), vec![]), LegMeta::Blank];
        assert_eq!(
            assemble(&legs, 10, 1 << 20, [0; 16]).unwrap().events,
            MAX_EVENTS
        );
        let legs = [
            LegMeta::Found(sb(0, 1), vec![]),
            LegMeta::Found(sb(1, u64::MAX), vec![]),
        ];
        let e = assemble(&legs, 10, 1 << 20, [0; 16])
            .unwrap_err()
            .to_string();
        assert!(e.contains("leg 1") && e.contains("events count"), "{e}");
    }
}
