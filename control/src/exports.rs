//! Exports as the control plane sees them: what `export add` asks for,
//! what `export ls` reports, and the [`ExportService`] a daemon plugs into
//! its [`crate::Control`] to serve them. The control library knows no
//! protocol: the service (the daemon, which links the exports) does.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use udm_core::{BlockDevice, Dispatch, Error};

use crate::registry::Holder;

/// `export add`'s arguments.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSpec {
    /// The device to serve.
    pub device: String,
    /// The protocol: `nbd`, `vhost-user-blk` or `ublk`.
    pub protocol: String,
    /// Where it listens: for NBD `unix:PATH`, `HOST:PORT`, `:PORT` or
    /// `PORT`; for vhost-user-blk the socket's path; empty for ublk.
    #[serde(default)]
    pub address: String,
    /// The name clients ask for (default: the device's name).
    #[serde(default)]
    pub name: Option<String>,
    /// Refuse writes.
    #[serde(default)]
    pub read_only: bool,
    /// What only some protocols take.
    #[serde(default, skip_serializing_if = "ExportOpts::is_empty")]
    pub opts: ExportOpts,
}

/// Options of an export that only some protocols take; a protocol given
/// one it does not take refuses the export, naming it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportOpts {
    /// Queues (vhost-user-blk: default one per reactor; ublk: one thread
    /// each, default one per CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<u32>,
    /// Requests each queue holds (ublk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
    /// The device number N of `/dev/ublkbN` (ublk; default: the next free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u32>,
    /// Re-attach the device a udm that died left behind (ublk).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recover: bool,
    /// Add the device as one of udm's user instead of root's (ublk's
    /// `UBLK_F_UNPRIVILEGED_DEV`; docs/ublk.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unprivileged: bool,
    /// How requests go to the device: `auto` (the default: from the
    /// device's report), `direct` or `queued` ([`Dispatch`]). Every
    /// protocol takes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<String>,
    /// NBD over TLS: `off`, `on` (the client's choice) or `require`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<String>,
    /// The TLS credentials' directory (NBD; QEMU's x509 layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_creds: Option<String>,
    /// Require a client certificate signed by the CA (NBD).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls_verify_peer: bool,
    /// Admit only client certificates with these subject names (NBD).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_authz: Vec<String>,
    /// Serve plaintext on a TCP address off loopback (NBD).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
}

impl ExportOpts {
    /// The NBD-only options set, as the command line spells them (for
    /// another protocol's "does not take" error).
    pub fn nbd_names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.tls.is_some() {
            v.push("--tls");
        }
        if self.tls_creds.is_some() {
            v.push("--tls-creds");
        }
        if self.tls_verify_peer {
            v.push("--tls-verify-peer");
        }
        if !self.tls_authz.is_empty() {
            v.push("--tls-authz");
        }
        if self.insecure {
            v.push("--insecure");
        }
        v
    }

    /// No option set.
    pub fn is_empty(&self) -> bool {
        *self == ExportOpts::default()
    }

    /// The dispatch asked for (`auto` when none), or an error naming
    /// the bad value.
    pub fn dispatch(&self) -> Result<Dispatch, Error> {
        self.dispatch
            .as_deref()
            .map_or(Ok(Dispatch::Auto), str::parse)
    }

    /// The names of the options set that only some protocols take, as the
    /// command line spells them (for a protocol's "does not take" error;
    /// `--dispatch`, which every protocol takes, is not among them).
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.queues.is_some() {
            v.push("--queues");
        }
        if self.depth.is_some() {
            v.push("--depth");
        }
        if self.id.is_some() {
            v.push("--id");
        }
        if self.recover {
            v.push("--recover");
        }
        if self.unprivileged {
            v.push("--unprivileged");
        }
        v
    }
}

/// One export, as `export ls` reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportInfo {
    /// The export's name (what clients ask for).
    pub name: String,
    /// The device it serves.
    pub device: String,
    /// `nbd`, `vhost-user-blk` or `ublk`.
    pub protocol: String,
    /// Where it listens, as given.
    pub address: String,
    /// A URI a client can use (a device path for ublk).
    pub uri: String,
    /// Writes refused.
    pub read_only: bool,
    /// Clients connected now.
    pub clients: usize,
    /// The protocol's options, as given.
    #[serde(default, skip_serializing_if = "ExportOpts::is_empty")]
    pub opts: ExportOpts,
    /// The dispatch in use and why, e.g. `queued (auto: merging helps
    /// (file on a disk, O_DIRECT))`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub dispatch: String,
    /// NBD over TLS: what clients are asked for and where the records are
    /// made, e.g. `TLS require with DIR (no client certificates); records
    /// in the kernel (kTLS; rustls for the handshake)`. Empty without TLS.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tls: String,
}

impl fmt::Display for ExportInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}\t{}\t{}\t{}{}\t{} clients",
            self.name,
            self.device,
            self.protocol,
            self.uri,
            if self.read_only { "\tread-only" } else { "" },
            self.clients
        )?;
        if !self.tls.is_empty() {
            write!(f, "\t{}", self.tls)?;
        }
        Ok(())
    }
}

/// `export ls`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportList {
    /// The exports, in the order they were added.
    pub exports: Vec<ExportInfo>,
}

impl fmt::Display for ExportList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self.exports.iter().map(|e| e.to_string()).collect();
        f.write_str(&lines.join("\n"))
    }
}

/// What an [`ExportService`] needs of the device registry: devices by
/// name, and holds on them.
pub trait Devices {
    /// The device called `name`.
    fn device(&self, name: &str) -> Option<Arc<dyn BlockDevice>>;
    /// Registers `holder` on device `name`: it cannot be removed until
    /// released.
    fn hold(&self, name: &str, holder: Holder) -> Result<(), Error>;
    /// Releases `holder`'s hold on device `name`.
    fn release(&self, name: &str, holder: &Holder) -> Result<(), Error>;
}

/// What serves exports for a [`crate::Control`] (set with
/// [`crate::Control::set_exports`]). Each export holds its device
/// ([`Holder::Export`]) from `add` until it is removed.
pub trait ExportService: Send + Sync {
    /// Starts serving `spec`.
    fn add(&self, devs: &dyn Devices, spec: ExportSpec) -> Result<ExportInfo, Error>;
    /// Stops the export `name`: refused (Busy) while clients are connected
    /// unless `force`, which disconnects them in order once their requests
    /// in flight complete.
    fn remove(&self, devs: &dyn Devices, name: &str, force: bool) -> Result<(), Error>;
    /// The exports.
    fn list(&self) -> ExportList;
    /// Stops every export (the daemon's shutdown), as a forced remove.
    fn stop_all(&self, devs: &dyn Devices);
}

/// The limits of a daemon's NBD exports, all of them together (the
/// `[limits]` table; `udm daemon`'s flags of the same names override it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsDef {
    /// Seconds a connection may take to finish its handshake; 0: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handshake_timeout: Option<u64>,
    /// Connections open at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Bytes of request buffers in flight (a size such as `256M`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_inflight: Option<String>,
}

impl LimitsDef {
    /// Nothing set.
    pub fn is_empty(&self) -> bool {
        *self == LimitsDef::default()
    }
}
