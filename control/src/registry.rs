//! The device registry: devices by name, created and removed at runtime,
//! each knowing its holders (the tables and exports that use it) and the
//! exclusive claims on it.
//!
//! A table may use only devices created before the device it belongs to
//! (or paths), so no table can map onto its own device or onto a device
//! stacked over it: the registry's devices always form a DAG in creation
//! order. The holders a table makes are read from the tables themselves
//! (live and inactive), so a reload or a remove cannot leave a stale hold;
//! the holders that exports and other users make are registered with
//! [`Registry::hold`] and [`Registry::release`].

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use udm_core::{BlockDevice, Error, ErrorKind};
use udm_mapper::{MappedDevice, Table};

use crate::backend::{backend_kind, is_backend_spec, open_backend, open_path};
use crate::luks::{LuksSpec, Passphrase};
use udm_backends::{FileDevice, FileOpts};

/// Something that uses a device and keeps it from being removed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Holder {
    /// The live or inactive table of the mapped device `device`.
    Table {
        /// The mapped device whose table uses it.
        device: String,
    },
    /// An export serving it.
    Export {
        /// The export's name.
        name: String,
        /// The export's protocol (`nbd`, …).
        protocol: String,
    },
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Table { device } => write!(f, "the table of '{device}'"),
            Holder::Export { name, protocol } => write!(f, "the {protocol} export '{name}'"),
        }
    }
}

/// How a device is removed (dmsetup remove's options).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoveMode {
    /// Refused while the device has holders.
    #[default]
    Normal,
    /// Removed even while held: a mapped device's table is first replaced
    /// by one that fails every I/O with EIO (as `dmsetup remove --force`),
    /// so what still holds it sees errors, never a hang.
    Force,
    /// Removed now if nothing holds it, else marked and removed when its
    /// last holder goes.
    Deferred,
}

/// A table staged by `load`, made live by `resume`.
struct Inactive {
    table: Table,
    lines: Vec<String>,
}

/// One registered device.
pub struct Entry {
    name: String,
    dev: Arc<dyn BlockDevice>,
    spec: String,
    holds: Vec<Holder>,
    inactive: Option<Inactive>,
    /// Table swaps and removals-by-force so far (target events are added
    /// by [`Entry::event_nr`]).
    events: u64,
    /// Removed when its last holder goes.
    deferred: bool,
}

impl Entry {
    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The device.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }
    /// The spec it was created from: a backend spec, or the table as
    /// [`Table::table_lines`] prints it (crypt keys hidden).
    pub fn spec(&self) -> &str {
        &self.spec
    }
    /// `ram`, `null`, `file` or `mapped`.
    pub fn kind(&self) -> &str {
        backend_kind(&self.spec).unwrap_or("mapped")
    }
    /// The device as a mapped device, if it has a table.
    pub fn mapped(&self) -> Option<&MappedDevice> {
        self.dev.as_any().downcast_ref::<MappedDevice>()
    }
    /// The inactive table's lines, if one is loaded (keys hidden).
    pub fn inactive_lines(&self) -> Option<&[String]> {
        self.inactive.as_ref().map(|i| i.lines.as_slice())
    }
    /// The inactive table's lines with their keys shown, if one is loaded.
    pub fn inactive_lines_with_keys(&self) -> Option<Vec<String>> {
        self.inactive
            .as_ref()
            .map(|i| i.table.table_lines_with_keys())
    }
    /// The device's event counter (dm's `event_nr`): table swaps, and the
    /// events its live table's targets raised.
    pub fn event_nr(&self) -> u64 {
        self.events + self.mapped().map_or(0, |m| m.table().events())
    }
    /// Whether a deferred remove is pending.
    pub fn deferred_remove(&self) -> bool {
        self.deferred
    }
}

/// Devices by name, in creation order.
pub struct Registry {
    entries: Vec<Entry>,
    targets: udm_mapper::Registry,
}

impl Default for Registry {
    fn default() -> Registry {
        Registry::new()
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

fn not_found(name: &str) -> Error {
    Error::new(ErrorKind::NotFound, format!("unknown device '{name}'"))
}

impl Registry {
    /// An empty registry with the built-in target types.
    pub fn new() -> Registry {
        Registry::with_targets(udm_mapper::Registry::builtin())
    }

    /// An empty registry with the target types of `targets`.
    pub fn with_targets(targets: udm_mapper::Registry) -> Registry {
        Registry {
            entries: Vec::new(),
            targets,
        }
    }

    /// The target types tables may use.
    pub fn targets(&self) -> &udm_mapper::Registry {
        &self.targets
    }

    /// Creates device `name` from `spec`: a backend spec (`ram:1G`, …) or
    /// table text (lines separated by newlines or `;`) over devices created
    /// before it or paths.
    pub fn create(&mut self, name: &str, spec: &str) -> Result<Arc<dyn BlockDevice>, Error> {
        self.create_with(name, spec, None)
    }

    /// [`Registry::create`], with the passphrase of a `luks:` spec that
    /// has no `key-file` (it is refused with any other spec).
    pub fn create_with(
        &mut self,
        name: &str,
        spec: &str,
        pass: Option<&Passphrase>,
    ) -> Result<Arc<dyn BlockDevice>, Error> {
        if !valid_name(name) {
            return Err(Error::invalid(format!(
                "invalid device name '{name}' (letters, digits, _ - . only)"
            )));
        }
        if self.get(name).is_some() {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("device '{name}' already exists"),
            ));
        }
        let spec = spec.trim();
        let (dev, spec) = if let Some(rest) = spec.strip_prefix("luks:") {
            (self.open_luks(name, rest, pass)?, spec.to_string())
        } else if pass.is_some() {
            return Err(Error::invalid("a passphrase goes with a luks: spec only"));
        } else if is_backend_spec(spec) {
            (open_backend(name, spec)?, spec.to_string())
        } else {
            let table = self.build_table(None, name, spec)?;
            // Kept as the table prints, so that a crypt key given in the
            // text is not kept here too.
            let text = table.table_lines().join("\n");
            (MappedDevice::new(name, table) as Arc<dyn BlockDevice>, text)
        };
        self.entries.push(Entry {
            name: name.to_string(),
            dev: dev.clone(),
            spec,
            holds: Vec::new(),
            inactive: None,
            events: 0,
            deferred: false,
        });
        Ok(dev)
    }

    /// Opens a `luks:` spec (see [`crate::luks`]): unlocks the volume on
    /// its device (a udm device or a path) and maps a crypt table over its
    /// data segment. The passphrase is `pass` or the spec's key file, not
    /// both. The table's text, which holds the volume key, is built here
    /// and wiped once the target has the key.
    fn open_luks(
        &self,
        name: &str,
        rest: &str,
        pass: Option<&Passphrase>,
    ) -> Result<Arc<dyn BlockDevice>, Error> {
        let s = LuksSpec::parse(rest)?;
        if pass.is_some() && s.key_file.is_some() {
            return Err(Error::invalid(
                "luks: a passphrase came with the request and the spec names a key file: give one",
            ));
        }
        let dev: Arc<dyn BlockDevice> = if s.dev.starts_with('/') || s.dev.starts_with("./") {
            let o = FileOpts {
                read_only: s.ro,
                ..FileOpts::default()
            };
            Arc::new(FileDevice::open(s.dev.as_str(), &s.dev, o)?)
        } else if s.ro {
            return Err(Error::invalid(format!(
                "luks: 'ro' applies to a path; '{}' is a udm device",
                s.dev
            )));
        } else {
            self.get(&s.dev).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "luks: unknown device '{}' (create it first, or give a path)",
                        s.dev
                    ),
                )
            })?
        };
        let vol = {
            let from_file;
            let pass = match pass {
                Some(p) => p.as_bytes(),
                None => {
                    from_file = s.passphrase()?;
                    &from_file[..]
                }
            };
            let reader = crate::luks::Reader::new(&dev)?;
            crate::luks::unlock(&reader, pass, s.keyslot)?
        };
        let args = vol.crypt_args(dev.name());
        let mut spec = udm_mapper::TargetSpec {
            start: 0,
            len: vol.sectors,
            ty: "crypt".into(),
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        drop(args);
        let resolve = |n: &str| -> Result<Arc<dyn BlockDevice>, Error> {
            if n == dev.name() {
                Ok(dev.clone())
            } else {
                Err(Error::invalid(format!("luks: unexpected device '{n}'")))
            }
        };
        let table = Table::build(std::slice::from_ref(&spec), &self.targets, &resolve);
        spec.args.iter_mut().for_each(zeroize::Zeroize::zeroize);
        Ok(MappedDevice::new(name, table.map_err(|e| e.context("luks"))?) as Arc<dyn BlockDevice>)
    }

    /// Builds table `text` for device `name`: for an existing device
    /// (`Some(position)`) it may use only devices created before it; for a
    /// new one, any device. Exclusive claims are checked against every
    /// table, live or inactive, including the device's own.
    fn build_table(&self, pos: Option<usize>, name: &str, text: &str) -> Result<Table, Error> {
        let mut specs = udm_mapper::parse(text)?;
        let mut claimed: Vec<&str> = Vec::new();
        for s in &specs {
            let Some(tt) = self.targets.get(&s.ty) else {
                continue; // Table::build names it
            };
            for &i in tt.exclusive_args {
                let Some(dev) = s.args.get(i) else { continue };
                if let Some(user) = self.claimed_by(dev) {
                    return Err(Error::new(
                        ErrorKind::Busy,
                        format!(
                            "device '{dev}' is in use by the live {} of '{user}' (claimed exclusively)",
                            s.ty
                        ),
                    ));
                }
                if claimed.contains(&dev.as_str()) {
                    return Err(Error::new(
                        ErrorKind::Busy,
                        format!("device '{dev}' is claimed twice by this table"),
                    ));
                }
                claimed.push(dev);
            }
        }
        let below = &self.entries[..pos.unwrap_or(self.entries.len())];
        let resolve = |n: &str| -> Result<Arc<dyn BlockDevice>, Error> {
            if let Some(e) = below.iter().find(|e| e.name == n) {
                return Ok(e.dev.clone());
            }
            if self.get(n).is_some() {
                return Err(Error::invalid(format!(
                    "device '{n}' is '{name}' itself or defined after it: a table may use only devices defined before it"
                )));
            }
            match open_path(n) {
                Some(r) => r,
                None => Err(Error::new(
                    ErrorKind::NotFound,
                    format!("unknown device '{n}' (create it first, or give a path)"),
                )),
            }
        };
        let table = Table::build(&specs, &self.targets, &resolve);
        // The arguments may hold a crypt key, which the target now keeps
        // on locked pages: wipe udm's copy of the text.
        for s in &mut specs {
            s.args.iter_mut().for_each(zeroize::Zeroize::zeroize);
        }
        table
    }

    /// The mapped device whose live or inactive table claims `dev`
    /// exclusively, if any.
    pub fn claimed_by(&self, dev: &str) -> Option<&str> {
        self.entries.iter().find_map(|e| {
            let live = e.mapped().map(|m| m.table().table_lines());
            let claims = |lines: &[String]| {
                lines.iter().any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let Some(tt) = f.get(2).and_then(|t| self.targets.get(t)) else {
                        return false;
                    };
                    tt.exclusive_args
                        .iter()
                        .any(|&i| f.get(3 + i) == Some(&dev))
                })
            };
            let held =
                live.as_deref().is_some_and(claims) || e.inactive_lines().is_some_and(claims);
            held.then_some(e.name.as_str())
        })
    }

    /// Removes device `name`, as `mode` says; returns it unless the remove
    /// was deferred. Normal: refused (Busy, naming the holder) while it has
    /// holders. Deferred: marked, and removed by [`Registry::reap`] once
    /// nothing holds it. Force: removed whatever holds it; the caller has
    /// made a held mapped device fail its I/O first (see
    /// [`Registry::error_table`]).
    pub fn remove(
        &mut self,
        name: &str,
        mode: RemoveMode,
    ) -> Result<Option<Arc<dyn BlockDevice>>, Error> {
        let pos = self.position(name)?;
        let holder = self.holders(name).into_iter().next();
        match (mode, holder) {
            (RemoveMode::Normal, Some(h)) => Err(Error::new(
                ErrorKind::Busy,
                format!("device '{name}' is in use by {h}"),
            )),
            (RemoveMode::Deferred, Some(_)) => {
                self.entries[pos].deferred = true;
                Ok(None)
            }
            _ => Ok(Some(self.entries.remove(pos).dev)),
        }
    }

    /// Removes every device whose deferred remove is due (nothing holds it
    /// any more), top of the stack first; returns them, to be dropped
    /// outside the registry's lock.
    pub fn reap(&mut self) -> Vec<Arc<dyn BlockDevice>> {
        let mut gone = Vec::new();
        while let Some(pos) = self
            .entries
            .iter()
            .rposition(|e| e.deferred && self.holders(&e.name).is_empty())
        {
            gone.push(self.entries.remove(pos).dev);
        }
        gone
    }

    /// A table of the size of mapped device `name` that fails every I/O
    /// (one `error` target), for a remove by force.
    pub fn error_table(&self, name: &str) -> Result<Table, Error> {
        let sectors = self.mapped(name)?.limits().sectors;
        let specs = udm_mapper::parse(&format!("0 {sectors} error"))?;
        let none = |n: &str| -> Result<Arc<dyn BlockDevice>, Error> {
            Err(Error::invalid(format!("unexpected device '{n}'")))
        };
        Table::build(&specs, &self.targets, &none)
    }

    /// Counts an event on device `name` (a table swapped in).
    pub fn event(&mut self, name: &str) {
        if let Ok(pos) = self.position(name) {
            self.entries[pos].events += 1;
        }
    }

    fn position(&self, name: &str) -> Result<usize, Error> {
        self.entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| not_found(name))
    }

    /// The entry of device `name`.
    pub fn entry(&self, name: &str) -> Result<&Entry, Error> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| not_found(name))
    }

    /// The device called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .map(|e| e.dev.clone())
    }

    /// Every device, in creation order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The devices `name`'s tables (live and inactive) use, registered ones
    /// by name and others (paths) by their device name.
    pub fn deps(&self, name: &str) -> Result<Vec<String>, Error> {
        let e = self.entry(name)?;
        let mut out: Vec<String> = Vec::new();
        let mut add = |d: &Arc<dyn BlockDevice>| {
            let n = d.name().to_string();
            if !out.contains(&n) {
                out.push(n);
            }
        };
        if let Some(m) = e.mapped() {
            m.table().devices.iter().for_each(&mut add);
        }
        if let Some(i) = &e.inactive {
            i.table.devices.iter().for_each(&mut add);
        }
        Ok(out)
    }

    /// What holds device `name`: the tables (live or inactive) that use it,
    /// then the holders registered with [`Registry::hold`].
    pub fn holders(&self, name: &str) -> Vec<Holder> {
        let Some(dev) = self.get(name) else {
            return Vec::new();
        };
        let uses = |t: &Table| t.devices.iter().any(|d| Arc::ptr_eq(d, &dev));
        let mut out: Vec<Holder> = self
            .entries
            .iter()
            .filter(|e| {
                e.mapped().is_some_and(|m| uses(&m.table()))
                    || e.inactive.as_ref().is_some_and(|i| uses(&i.table))
            })
            .map(|e| Holder::Table {
                device: e.name.clone(),
            })
            .collect();
        if let Ok(e) = self.entry(name) {
            out.extend(e.holds.iter().cloned());
        }
        out
    }

    /// Registers `holder` as a user of device `name` (an export, say): the
    /// device cannot be removed until it is released.
    pub fn hold(&mut self, name: &str, holder: Holder) -> Result<(), Error> {
        let pos = self.position(name)?;
        self.entries[pos].holds.push(holder);
        Ok(())
    }

    /// Releases one hold of `holder` on device `name`.
    pub fn release(&mut self, name: &str, holder: &Holder) -> Result<(), Error> {
        let pos = self.position(name)?;
        let holds = &mut self.entries[pos].holds;
        match holds.iter().position(|h| h == holder) {
            Some(i) => {
                holds.remove(i);
                Ok(())
            }
            None => Err(Error::new(
                ErrorKind::NotFound,
                format!("device '{name}' is not held by {holder}"),
            )),
        }
    }

    /// The mapped device `name`, or an error saying it has no table.
    pub fn mapped(&self, name: &str) -> Result<Arc<dyn BlockDevice>, Error> {
        let e = self.entry(name)?;
        if e.mapped().is_none() {
            return Err(Error::invalid(format!(
                "device '{name}' is not a mapped device (it has no table)"
            )));
        }
        Ok(e.dev.clone())
    }

    /// Builds `text` as the inactive table of mapped device `name`
    /// (replacing one already loaded). Refused: a table that shrinks the
    /// device, changes its logical block size or lowers its max I/O size
    /// (clients that are connected were told those; a larger size is
    /// harmless to them, and a vhost-user-blk export tells its guest), one
    /// that uses the device itself or a device created after it, and one
    /// claiming a device another table claims.
    pub fn load(&mut self, name: &str, text: &str) -> Result<(), Error> {
        let dev = self.mapped(name)?;
        let pos = self.position(name)?;
        let table = self.build_table(Some(pos), name, text)?;
        let (old, new) = (dev.limits(), table.limits);
        if new.sectors < old.sectors {
            return Err(Error::invalid(format!(
                "the new table has {} sectors, the device {}: a live device may grow, not shrink",
                new.sectors, old.sectors
            )));
        }
        if new.logical_block_size != old.logical_block_size {
            return Err(Error::invalid(format!(
                "the new table's logical block size is {}, the device's {}: it must not change",
                new.logical_block_size, old.logical_block_size
            )));
        }
        if new.max_io_bytes < old.max_io_bytes {
            return Err(Error::invalid(format!(
                "the new table's max I/O size is {} bytes, the device's {}: it must not shrink",
                new.max_io_bytes, old.max_io_bytes
            )));
        }
        let lines = table.table_lines();
        self.entries[pos].inactive = Some(Inactive { table, lines });
        Ok(())
    }

    /// Takes the inactive table of device `name`, if one is loaded.
    pub fn take_inactive(&mut self, name: &str) -> Result<Option<Table>, Error> {
        let pos = self.position(name)?;
        Ok(self.entries[pos].inactive.take().map(|i| i.table))
    }

    /// Drops the inactive table of device `name`; whether there was one.
    pub fn clear(&mut self, name: &str) -> Result<bool, Error> {
        Ok(self.take_inactive(name)?.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(defs: &[(&str, &str)]) -> Registry {
        let mut r = Registry::new();
        for (n, s) in defs {
            r.create(n, s).unwrap();
        }
        r
    }

    #[test]
    fn devices_are_created_in_order_and_tables_use_earlier_ones() {
        let r = reg(&[
            ("ram0", "ram:1G"),
            ("ram1", "ram:1G"),
            ("lin", "0 2097152 linear ram0 0"),
            ("str", "0 2097152 striped 2 128 ram0 0 ram1 0"),
        ]);
        assert_eq!(r.entries().len(), 4);
        assert_eq!(r.get("lin").unwrap().limits().sectors, 2097152);
        assert_eq!(r.get("str").unwrap().limits().io_opt, 2 * 128 * 512);
        assert_eq!(r.entry("ram0").unwrap().kind(), "ram");
        assert_eq!(r.entry("lin").unwrap().kind(), "mapped");
        assert_eq!(r.deps("str").unwrap(), vec!["ram0", "ram1"]);
    }

    #[test]
    fn bad_creates_name_the_offending_token_and_leave_nothing() {
        let mut r = reg(&[("a", "ram:1M")]);
        let mut err = |n: &str, s: &str| r.create(n, s).err().unwrap().to_string();
        assert!(err("r@m", "ram:1G").contains("invalid device name 'r@m'"));
        assert!(err("a", "ram:1G").contains("already exists"));
        assert!(err("l", "0 8 linear nope 0").contains("unknown device 'nope'"));
        assert!(err("l", "0 16 linear a 4090").contains("too small"));
        assert!(err("l", "0 8 linear a zz").contains("invalid device sector 'zz'"));
        assert!(err("m", "0 8 mirror a").contains("unknown target type 'mirror'"));
        assert_eq!(r.entries().len(), 1);
    }

    #[test]
    fn a_held_device_cannot_be_removed_and_names_its_holder() {
        let mut r = reg(&[("a", "ram:1M"), ("l", "0 2048 linear a 0")]);
        let e = r.remove("a", RemoveMode::Normal).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert!(e.to_string().contains("in use by the table of 'l'"), "{e}");
        let nbd = Holder::Export {
            name: "l".into(),
            protocol: "nbd".into(),
        };
        r.hold("l", nbd.clone()).unwrap();
        let e = r.remove("l", RemoveMode::Normal).err().unwrap();
        assert!(e.to_string().contains("the nbd export 'l'"), "{e}");
        r.release("l", &nbd).unwrap();
        assert!(r.release("l", &nbd).is_err());
        r.remove("l", RemoveMode::Normal).unwrap();
        r.remove("a", RemoveMode::Normal).unwrap();
        assert!(r.entries().is_empty());
        assert_eq!(
            r.remove("a", RemoveMode::Normal).err().unwrap().kind(),
            ErrorKind::NotFound
        );
    }

    #[test]
    fn an_inactive_table_holds_its_devices_until_cleared() {
        let mut r = reg(&[("a", "ram:1M"), ("b", "ram:1M"), ("l", "0 2048 linear a 0")]);
        r.load("l", "0 2048 linear b 0").unwrap();
        assert_eq!(r.holders("b"), vec![Holder::Table { device: "l".into() }]);
        assert_eq!(r.deps("l").unwrap(), vec!["a", "b"]);
        assert!(r.clear("l").unwrap());
        assert!(!r.clear("l").unwrap());
        assert!(r.holders("b").is_empty());
    }

    #[test]
    fn a_loaded_table_may_use_only_devices_created_before_its_device() {
        let mut r = reg(&[
            ("a", "ram:1M"),
            ("l", "0 2048 linear a 0"),
            ("top", "0 2048 linear l 0"),
        ]);
        r.load("l", "0 1024 linear a 0; 1024 1024 zero").unwrap();
        for bad in ["0 2048 linear l 0", "0 2048 linear top 0"] {
            let e = r.load("l", bad).err().unwrap().to_string();
            assert!(e.contains("defined after it"), "{bad}: {e}");
        }
        let e = r.load("l", "0 1024 zero").err().unwrap().to_string();
        assert!(e.contains("may grow, not shrink"), "{e}");
        r.load("l", "0 2048 linear a 0; 2048 2048 zero").unwrap();
        let e = r.load("a", "0 2048 zero").err().unwrap().to_string();
        assert!(e.contains("not a mapped device"), "{e}");
        let e = r.load("nope", "0 8 zero").err().unwrap().to_string();
        assert!(e.contains("unknown device 'nope'"), "{e}");
    }

    #[test]
    fn a_cache_device_is_claimed_by_one_writecache() {
        let mut r = reg(&[
            ("o", "ram:16M"),
            ("o2", "ram:16M"),
            ("c", "ram:4M"),
            ("wc", "0 32768 writecache s o c 4096 0"),
        ]);
        assert_eq!(r.claimed_by("c"), Some("wc"));
        assert_eq!(r.claimed_by("o"), None);
        let e = r
            .create("wc2", "0 32768 writecache s o2 c 4096 0")
            .err()
            .unwrap();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert!(
            e.to_string()
                .contains("device 'c' is in use by the live writecache of 'wc'"),
            "{e}"
        );
        // Its own reload too: two cache engines must not share the cache.
        let e = r
            .load("wc", "0 32768 writecache s o c 4096 0")
            .err()
            .unwrap();
        assert_eq!(e.kind(), ErrorKind::Busy);
    }
}
