//! dm's block checksums: CRC32C of a block after its first four bytes (the
//! checksum field), inverted, then xored with a constant per kind of block
//! so that a block of one kind never validates as another.

use crate::BLOCK_SIZE;

/// What a metadata block holds; each kind has its own checksum xor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// A superblock (dm-thin's, or its metadata-snapshot copy).
    Superblock,
    /// A B-tree node.
    Node,
    /// A space map bitmap.
    Bitmap,
    /// The metadata space map's index block.
    Index,
}

impl BlockKind {
    /// The xor that dm applies to this kind's checksum.
    pub fn xor(self) -> u32 {
        match self {
            BlockKind::Superblock => 160774,
            BlockKind::Node => 121107,
            BlockKind::Bitmap => 240779,
            BlockKind::Index => 160478,
        }
    }
}

/// dm's checksum of `data` (the block after its checksum field) for `kind`.
///
/// dm computes `crc32c(~0, data) ^ xor` with the kernel's crc32c, which
/// does not invert its result; the `crc32c` crate's does, hence `!`.
pub fn checksum(data: &[u8], kind: BlockKind) -> u32 {
    !crc32c::crc32c(data) ^ kind.xor()
}

/// Writes `block`'s checksum field for `kind`.
pub fn seal(block: &mut [u8; BLOCK_SIZE], kind: BlockKind) {
    let c = checksum(&block[4..], kind);
    block[..4].copy_from_slice(&c.to_le_bytes());
}

/// Whether `block`'s checksum field matches its contents for `kind`.
pub fn verify(block: &[u8; BLOCK_SIZE], kind: BlockKind) -> bool {
    let stored = u32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    stored == checksum(&block[4..], kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_block_verifies_only_as_its_own_kind() {
        let mut b = [7u8; BLOCK_SIZE];
        seal(&mut b, BlockKind::Node);
        assert!(verify(&b, BlockKind::Node));
        assert!(!verify(&b, BlockKind::Bitmap));
        b[100] ^= 1;
        assert!(!verify(&b, BlockKind::Node));
    }

    #[test]
    fn the_checksum_is_the_kernels() {
        // The kernel's crc32c(~0, "123456789") without final inversion is
        // !0xe3069283 (the standard CRC-32C check value).
        assert_eq!(
            checksum(b"123456789", BlockKind::Node),
            0xe3069283 ^ !0 ^ 121107
        );
    }
}
