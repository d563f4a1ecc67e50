//! NBD export, per `doc/proto.md` of the NetworkBlockDevice project.
//!
//! ```text
//!   server.rs   listeners, connection placement, shutdown (export.rs: what
//!               each export advertises)
//!      │ fd via ReactorHandle::send
//!      ▼
//!   conn/       one connection on one reactor: recv on the reactor's io_uring,
//!      │        handshake bytes → handshake.rs, requests → the export front
//!      │        (crate::front); send.rs: replies batched into one sendmsg
//!      ▼
//!   handshake.rs  option negotiation as a state machine over bytes
//!   limits.rs     handshake deadline, connection caps, the buffer budget
//!   proto.rs      wire constants, types, pure parse/encode (fuzzed)
//!   tls.rs        TLS credentials (x509, reloadable), client checks
//! ```
//!
//! Without TLS, NBD has no authentication or encryption: a TCP listener
//! off loopback refuses to start without TLS unless told it is meant
//! ([`ServerConfig::insecure`]).

pub mod conn;
pub mod export;
pub mod fuzzing;
pub mod handshake;
pub mod limits;
pub mod proto;
pub mod server;
pub mod tls;

pub use crate::limits::Limits;
pub use handshake::{Admit, Handshake, Negotiated, Outcome, TlsMode};
pub use proto::ExportInfo;
pub use server::{Clients, Export, Listen, Server, ServerConfig};
pub use tls::{Tls, TlsOptions};
