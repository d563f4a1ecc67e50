//! The built-in targets, one file each.

pub mod error;
pub mod linear;
pub mod striped;
pub mod writecache;
pub mod zero;
