//! The thin-pool and thin targets (dm-thin): the pool's metadata in Linux's format.

pub mod metadata;
