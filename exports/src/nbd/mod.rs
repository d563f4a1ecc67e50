//! NBD export, per `doc/proto.md` of the NetworkBlockDevice project.
//!
//! ```text
//!   server.rs   listeners, export table, connection placement, shutdown
//!      │ fd via ReactorHandle::send
//!      ▼
//!   conn.rs     one connection on one reactor: recv/sendmsg on the reactor's
//!      │        io_uring, handshake bytes → handshake.rs, requests → bios
//!      ▼
//!   handshake.rs  option negotiation as a state machine over bytes
//!   proto.rs      wire constants, types, pure parse/encode (fuzzed)
//! ```
//!
//! NBD has no authentication or encryption here (no TLS): serve it on
//! trusted networks only (unix sockets and loopback by default).

pub mod conn;
pub mod fuzzing;
pub mod handshake;
pub mod proto;
pub mod server;

pub use handshake::{Handshake, Negotiated, Outcome};
pub use proto::ExportInfo;
pub use server::{Export, Listen, Server, ServerConfig};
