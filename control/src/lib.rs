//! udm's control library: what `dmsetup` does for the kernel's
//! device-mapper, for udm's devices, usable from any program.
//!
//! - [`Registry`]: devices by name, created from backend specs
//!   ([`open_backend`]) or dm tables, removed at runtime; each knows its
//!   [`Holder`]s (tables and exports) and a held device cannot be removed;
//!   target types may claim devices exclusively (`TargetType::exclusive_args`).
//! - [`Control`]: a registry shared between threads, with every dmsetup
//!   verb as a method returning a typed result from [`report`] (serde
//!   serializable, displayed as dmsetup-like text).
//! - The control protocol ([`proto`]): newline-delimited JSON requests and
//!   replies, served on a unix socket by [`ControlServer`] and spoken by
//!   [`Client`]; [`execute`] runs a decoded request on a [`Control`].
//!
//! Exports depend on this crate, not the other way: an export registers
//! itself as a [`Holder`] of the device it serves.

#![deny(missing_docs)]

mod backend;
mod client;
mod config;
mod dispatch;
mod exports;
pub mod luks;
pub mod metrics;
mod paths;
pub mod proto;
mod registry;
pub mod report;
mod server;
mod size;
pub mod stats;
mod verbs;

pub use backend::{backend_kind, is_backend_spec, open_backend, open_path, KINDS};
pub use client::{request, Client};
pub use config::{Config, DeviceDef, ExportDef};
pub use dispatch::execute;
pub use exports::{
    Devices, ExportInfo, ExportList, ExportOpts, ExportService, ExportSpec, LimitsDef,
};
pub use metrics::{serve_metrics, MetricsServer};
pub use paths::{control_socket, default_socket, CONTROL_ENV};
pub use proto::{decode, Op, Reply, Request};
pub use registry::{Entry, Holder, Registry, RemoveMode};
pub use server::{bind, default_path, ControlServer, IDLE, MAX_CONNS};
pub use size::parse_size;
pub use verbs::{Control, PROTOCOL_VERSION};
