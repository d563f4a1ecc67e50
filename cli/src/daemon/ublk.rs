//! The daemon's ublk exports: each `export add --ublk` adds a
//! `/dev/ublkbN` served by queue threads of its own; `export remove`
//! stops and deletes it (refused while a process holds it open, unless
//! forced); the daemon's stop deletes them all.

use std::sync::Arc;

use udm_control::{Devices, ExportInfo, ExportSpec, Holder};
use udm_core::{Error, ErrorKind, ReactorConfig};
use udm_exports::limits::Pool;
use udm_exports::ublk::{UblkConfig, UblkDevice};

use super::running::{hold_device, with_trial, Protocol, Served};

/// One export being served.
pub(super) struct UblkExport {
    info: ExportInfo,
    holder: Holder,
    dev: UblkDevice,
}

impl Served for UblkExport {
    fn info(&self) -> &ExportInfo {
        &self.info
    }

    /// The processes holding the device open.
    fn clients(&self) -> usize {
        self.dev.openers()
    }

    fn dispatch(&self) -> String {
        with_trial(&self.info.dispatch, &self.dev.auto_report(), "queues")
    }

    fn busy(&self, n: usize) -> String {
        format!(
            "{} is open (held by {n}; --force removes it anyway, failing their I/O)",
            self.info.uri
        )
    }

    fn stop(self, devs: &dyn Devices) {
        let name = &self.info.name;
        if let Err(e) = self.dev.stop() {
            tracing::warn!("export '{name}': {e}");
        }
        let _ = devs.release(&self.info.device, &self.holder);
        tracing::info!("export '{name}' removed");
    }
}

/// The daemon's ublk exports (the [`Protocol`] of its ublk
/// [`Service`](super::running::Service)).
pub struct Ublk {
    reactor: ReactorConfig,
    /// The daemon's pool: each device's buffers are reserved from it.
    pool: Arc<Pool>,
}

impl Ublk {
    /// Exports whose queues' reactors are built as `reactor` says, their
    /// buffers reserved from `pool`.
    pub fn new(reactor: ReactorConfig, pool: Arc<Pool>) -> Ublk {
        Ublk { reactor, pool }
    }
}

impl Protocol for Ublk {
    type Export = UblkExport;

    fn start(
        &self,
        ctl: &dyn Devices,
        spec: ExportSpec,
        name: String,
        running: &[UblkExport],
    ) -> Result<UblkExport, Error> {
        if !spec.address.is_empty() {
            return Err(Error::invalid(format!(
                "a ublk export takes no address (got '{}')",
                spec.address
            )));
        }
        let dispatch = spec.opts.dispatch()?;
        if !spec.opts.nbd_names().is_empty() {
            return Err(Error::invalid(format!(
                "a ublk export takes no {}",
                spec.opts.nbd_names().join(", ")
            )));
        }
        if let Some(r) = running.iter().find(|r| Some(r.dev.id()) == spec.opts.id) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("/dev/ublkb{} is export '{}'", r.dev.id(), r.info.name),
            ));
        }
        let (dev, holder) = hold_device(ctl, &spec.device, &name, "ublk")?;
        let (dispatch, why) = dispatch.choose(&*dev);
        let cfg = UblkConfig {
            id: spec.opts.id,
            queues: spec.opts.queues,
            depth: spec.opts.depth,
            read_only: spec.read_only,
            recover: spec.opts.recover,
            unprivileged: spec.opts.unprivileged,
            reactor: self.reactor,
            dispatch,
        };
        let dev = match UblkDevice::start(dev, cfg, &self.pool.budget) {
            Ok(d) => d,
            Err(e) => {
                let _ = ctl.release(&spec.device, &holder);
                return Err(e);
            }
        };
        let info = ExportInfo {
            name: name.clone(),
            device: spec.device,
            protocol: spec.protocol,
            address: spec.address,
            uri: dev.path().display().to_string(),
            read_only: spec.read_only,
            clients: 0,
            // The id the kernel gave, so that dump-config recreates (or,
            // with recover, re-attaches) the same /dev/ublkbN.
            opts: udm_control::ExportOpts {
                id: Some(dev.id()),
                ..spec.opts
            },
            dispatch: format!("{dispatch} ({why})"),
            tls: String::new(),
        };
        tracing::info!("export '{name}' of '{}' at {}", info.device, info.uri);
        Ok(UblkExport { info, holder, dev })
    }
}
