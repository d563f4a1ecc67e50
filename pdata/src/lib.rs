//! Persistent data in the format of Linux's `drivers/md/persistent-data/`:
//! 4 KiB metadata blocks with CRC32C checksums, copy-on-write B-trees, the
//! disk and metadata space maps (reference counts) and a transaction
//! manager that shadows blocks and commits them before the superblock.
//!
//! It knows nothing of thin provisioning: the thin target's metadata
//! (`udm_mapper::targets::thin::metadata`) says what its trees hold, as
//! `dm-thin-metadata.c` does over the kernel's layer, so that other targets
//! (cache, era) can use the same layer later.
//!
//! Everything read from a metadata device is external input: a block whose
//! checksum, location or layout is wrong is an [`Error`] of kind
//! [`ErrorKind::Invalid`](udm_core::ErrorKind::Invalid), never a panic.

pub mod block;
pub mod btree;
pub mod checksum;
pub mod space_map;
pub mod tm;

pub use udm_core::Error;

/// Shorthand for this crate's results.
pub type Result<T> = std::result::Result<T, Error>;

/// The size of a metadata block, as dm's persistent data uses (8 sectors).
pub const BLOCK_SIZE: usize = 4096;

/// An error for a space map with no free block left: carries `ENOSPC`, so
/// that [`is_no_space`] (or `raw_os_error() == Some(libc::ENOSPC)`) tells it
/// apart from corruption and I/O errors.
pub fn no_space(what: &str) -> Error {
    Error::os(
        format!("{what}: out of space"),
        std::io::Error::from_raw_os_error(libc::ENOSPC),
    )
}

/// Whether `e` says that a space map ran out of free blocks.
pub fn is_no_space(e: &Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC)
}

/// An error for a metadata block that does not decode.
pub(crate) fn corrupt(block: u64, what: impl std::fmt::Display) -> Error {
    Error::invalid(format!("metadata block {block}: {what}"))
}
