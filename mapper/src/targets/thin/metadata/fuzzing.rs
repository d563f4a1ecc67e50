//! Thin pool metadata from arbitrary bytes (for
//! [`crate::fuzzing::thin_metadata`]), in a compact form the fuzzer can
//! mutate past the checksums: the blocks of a small metadata device as
//! records, each sealed with a valid checksum and location before the
//! metadata is opened, so that mutations reach the decoders behind them.

use udm_pdata::block::{zeroed, BlockIo, MemIo};
use udm_pdata::checksum::{self, BlockKind};
use udm_pdata::BLOCK_SIZE;

use super::ThinMetadata;

/// Blocks of the fuzzed metadata device.
pub const BLOCKS: u64 = 64;

/// The kind a record's byte 7 selects for blocks other than block 0 (the
/// superblock): byte 7 is the top byte of a node's flags (0 in a valid
/// node), and in a bitmap or index block, part of a field nothing reads.
fn kind_of(marker: u8) -> BlockKind {
    match marker % 4 {
        0 => BlockKind::Node,
        1 => BlockKind::Bitmap,
        2 => BlockKind::Index,
        _ => BlockKind::Superblock,
    }
}

/// `data` is records of a block number (u8, taken modulo [`BLOCKS`]), a
/// length (u16 little-endian, at most 4096) and that many bytes: the
/// block's first bytes, the rest zero. Each block gets its location and
/// the checksum of its kind (block 0 a superblock, others by their byte 7,
/// see [`kind_of`]); then the pool opens it with the block size and data
/// device size its superblock states, reads every device's mappings, makes
/// a change and commits, and checks its counts. Errors are fine; a panic
/// is a bug. Returns whether the metadata opened.
pub fn load(data: &[u8]) -> bool {
    let mut io = MemIo::new(BLOCKS);
    let mut rest = data;
    let mut sb = zeroed();
    while let [nr, l0, l1, tail @ ..] = rest {
        let nr = u64::from(*nr) % BLOCKS;
        let len = (u16::from_le_bytes([*l0, *l1]) as usize)
            .min(BLOCK_SIZE)
            .min(tail.len());
        let mut b = zeroed();
        b[..len].copy_from_slice(&tail[..len]);
        rest = &tail[len..];
        let kind = if nr == 0 {
            BlockKind::Superblock
        } else {
            kind_of(b[7])
        };
        b[8..16].copy_from_slice(&nr.to_le_bytes());
        checksum::seal(&mut b, kind);
        if nr == 0 {
            sb = b.clone();
        }
        if io.write(nr, &b).is_err() {
            return false;
        }
    }
    let dbs = u32::from_le_bytes([sb[336], sb[337], sb[338], sb[339]]);
    let nr_data = u64::from_le_bytes(sb[64..72].try_into().unwrap_or_default());
    // A data device size out of all proportion to the metadata would only
    // cost the fuzzer time: the format refuses nothing for it.
    let nr_data = nr_data.min(1 << 20);
    let Ok(mut md) = ThinMetadata::open_or_format(Box::new(io), dbs, nr_data, false) else {
        return false;
    };
    for dev in md.devices() {
        let _ = md.mapped_ranges(dev, 0, u64::MAX);
        let _ = md.highest_mapped(dev);
        let _ = md.lookup(dev, 0);
        let _ = md.mapped_blocks(dev);
    }
    let _ = md.data_usage();
    let _ = md.metadata_usage();
    let change = (|| {
        let dev = md.devices().first().copied().unwrap_or(0);
        if !md.device_exists(dev) {
            md.create_thin(dev)?;
        }
        let b = md.alloc_data_block()?;
        md.insert(dev, 1, b)?;
        md.remove(dev, 0)?;
        md.create_snap(MAX_SNAP, dev)?;
        md.delete_thin(MAX_SNAP)?;
        md.commit()
    })();
    if change.is_ok() && md.data_usage().1 <= 1 << 16 {
        let _ = md.check_counts();
    } else {
        let _ = md.abort();
    }
    true
}

/// The dev id the fuzzed change snapshots to.
const MAX_SNAP: u32 = super::MAX_DEV_ID;

/// `image` (a metadata device's first blocks) in [`load`]'s record form:
/// each block that is not all zeroes, trailing zeroes cut, marked with its
/// kind (found by its checksum). For writing seeds.
pub fn records(image: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for (nr, chunk) in image.chunks(BLOCK_SIZE).enumerate().take(BLOCKS as usize) {
        let Ok(b) = <&[u8; BLOCK_SIZE]>::try_from(chunk) else {
            break;
        };
        let Some(end) = b.iter().rposition(|&x| x != 0) else {
            continue;
        };
        let mut b = *b;
        if nr != 0 {
            let marker = [
                BlockKind::Node,
                BlockKind::Bitmap,
                BlockKind::Index,
                BlockKind::Superblock,
            ]
            .iter()
            .position(|k| checksum::verify(&b, *k));
            let Some(m) = marker else { continue };
            b[7] = m as u8;
        }
        let len = (end + 1).max(16);
        out.push(nr as u8);
        out.extend_from_slice(&(len as u16).to_le_bytes());
        out.extend_from_slice(&b[..len]);
    }
    out
}
