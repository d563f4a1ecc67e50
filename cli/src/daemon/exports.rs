//! The daemon's exports: one [`ExportService`] per protocol behind one
//! that routes `export add` by the spec's protocol and keeps export names
//! unique across protocols.

use udm_control::{Devices, ExportInfo, ExportList, ExportService, ExportSpec};
use udm_core::{Error, ErrorKind};

/// Every protocol's exports (the daemon's [`ExportService`]).
pub struct Exports {
    services: Vec<(&'static str, Box<dyn ExportService>)>,
}

impl Exports {
    /// No protocol yet.
    pub fn new() -> Exports {
        Exports {
            services: Vec::new(),
        }
    }

    /// Serves `protocol`'s exports with `service`.
    pub fn with(mut self, protocol: &'static str, service: Box<dyn ExportService>) -> Exports {
        self.services.push((protocol, service));
        self
    }

    fn known(&self) -> String {
        let v: Vec<&str> = self.services.iter().map(|(p, _)| *p).collect();
        v.join(", ")
    }
}

impl ExportService for Exports {
    fn add(&self, devs: &dyn Devices, spec: ExportSpec) -> Result<ExportInfo, Error> {
        let Some((_, svc)) = self.services.iter().find(|(p, _)| *p == spec.protocol) else {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "unknown export protocol '{}' (known: {})",
                    spec.protocol,
                    self.known()
                ),
            ));
        };
        let name = spec.name.as_deref().unwrap_or(&spec.device);
        if let Some(e) = self.list().exports.iter().find(|e| e.name == name) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("an export named '{name}' exists ({})", e.protocol),
            ));
        }
        svc.add(devs, spec)
    }

    fn remove(&self, devs: &dyn Devices, name: &str, force: bool) -> Result<(), Error> {
        for (_, svc) in &self.services {
            if svc.list().exports.iter().any(|e| e.name == name) {
                return svc.remove(devs, name, force);
            }
        }
        Err(Error::new(
            ErrorKind::NotFound,
            format!("unknown export '{name}'"),
        ))
    }

    fn list(&self) -> ExportList {
        let exports = self
            .services
            .iter()
            .flat_map(|(_, svc)| svc.list().exports)
            .collect();
        ExportList { exports }
    }

    fn stop_all(&self, devs: &dyn Devices) {
        for (_, svc) in &self.services {
            svc.stop_all(devs);
        }
    }
}
