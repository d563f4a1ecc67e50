//! The built-in targets, one file (or folder) each.

pub mod crypt;
pub mod delay;
pub mod dust;
pub mod error;
pub mod flakey;
pub mod linear;
pub mod log_writes;
pub mod raid;
pub mod striped;
pub mod thin;
pub mod writecache;
pub mod zero;
