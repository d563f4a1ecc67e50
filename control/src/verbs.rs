//! [`Control`]: a registry shared between threads, and every dmsetup verb
//! on it as a method.
//!
//! Concurrency: changes (create, remove, load, suspend, resume, reload,
//! clear) run one at a time; reads (info, ls, table, status, deps) and
//! messages run beside them and each other, so a status poll is answered
//! while a long `message … flush` runs. The registry's lock is held to look
//! up, and to build and add a device (a create or load: a writecache's
//! constructor reads its metadata), never across a suspend's drain or a
//! message.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use udm_core::{BlockDevice, Error, ErrorKind};
use udm_mapper::MappedDevice;

use crate::registry::{Holder, Registry, RemoveMode};
use crate::report::{
    Deps, DeviceStatus, DeviceTable, Done, Info, List, MessageReply, Status, Tables, TargetInfo,
    TargetLines, Targets, Version,
};

/// The control protocol's version.
pub const PROTOCOL_VERSION: u32 = 1;

/// A device registry shared by the threads that act on it.
pub struct Control {
    reg: Mutex<Registry>,
    /// Held by a change, and by [`Control::close`] for good.
    changes: Mutex<()>,
    closing: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn mapped(d: &Arc<dyn BlockDevice>) -> &MappedDevice {
    match d.as_any().downcast_ref::<MappedDevice>() {
        Some(m) => m,
        None => unreachable!("Registry::mapped returns mapped devices only"),
    }
}

impl Default for Control {
    fn default() -> Control {
        Control::new(Registry::new())
    }
}

impl Control {
    /// Shares `reg`.
    pub fn new(reg: Registry) -> Control {
        Control {
            reg: Mutex::new(reg),
            changes: Mutex::new(()),
            closing: AtomicBool::new(false),
        }
    }

    /// A registry built from `NAME=SPEC` definitions, in order.
    pub fn build<S: AsRef<str>>(defs: &[S]) -> Result<Control, Error> {
        let c = Control::default();
        for d in defs {
            let d = d.as_ref();
            let Some((name, spec)) = d.split_once('=') else {
                return Err(Error::invalid(format!(
                    "--dev '{d}': expected NAME=SPEC (e.g. ram0=ram:1G)"
                )));
            };
            c.create(name.trim(), spec)?;
        }
        Ok(c)
    }

    /// The registry, locked (briefly: no I/O under it).
    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        lock(&self.reg)
    }

    /// The device called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        self.registry().get(name)
    }

    /// Every device, in creation order.
    pub fn devices(&self) -> Vec<Arc<dyn BlockDevice>> {
        let r = self.registry();
        r.entries().iter().map(|e| e.device().clone()).collect()
    }

    /// Registers `holder` on device `name` (see [`Registry::hold`]).
    pub fn hold(&self, name: &str, holder: Holder) -> Result<(), Error> {
        self.registry().hold(name, holder)
    }

    /// Releases `holder` from device `name`.
    pub fn release(&self, name: &str, holder: &Holder) -> Result<(), Error> {
        self.registry().release(name, holder)
    }

    /// Takes the change lock, unless closing.
    fn change(&self) -> Result<MutexGuard<'_, ()>, Error> {
        let g = lock(&self.changes);
        if self.closing.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Busy, "shutting down"));
        }
        Ok(g)
    }

    /// Refuses every change from now on, waits for one in progress (so
    /// that no reload is cut short), then resumes every device left
    /// suspended (on its live table), so that the I/O it holds completes
    /// and a shutdown can drain and flush it.
    pub fn close(&self) {
        self.closing.store(true, Ordering::Release);
        drop(lock(&self.changes));
        for d in self.devices() {
            if let Some(m) = d.as_any().downcast_ref::<MappedDevice>() {
                if m.is_suspended() {
                    if let Err(e) = m.resume() {
                        tracing::error!("resuming '{}' at close: {e}", d.name());
                    }
                }
            }
        }
    }

    /// Whether [`Control::close`] was called.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// `create NAME SPEC`: a backend (`ram:1G`, …) or a mapped device
    /// (table text).
    pub fn create(&self, name: &str, spec: &str) -> Result<Info, Error> {
        let _g = self.change()?;
        let mut r = self.registry();
        r.create(name, spec)
            .map_err(|e| e.context(format!("device '{name}'")))?;
        info_of(&r, name)
    }

    /// `remove NAME`: refused (Busy, naming the holder) while it is held.
    pub fn remove(&self, name: &str, mode: RemoveMode) -> Result<Done, Error> {
        let _g = self.change()?;
        let dev = self.registry().remove(name, mode)?;
        drop(dev); // outside the registry's lock: a backend may join workers
        Ok(Done {})
    }

    /// `load NAME TABLE`: stages an inactive table.
    pub fn load(&self, name: &str, table: &str) -> Result<Done, Error> {
        let _g = self.change()?;
        self.registry()
            .load(name, table)
            .map_err(|e| e.context(format!("load '{name}'")))?;
        Ok(Done {})
    }

    /// `clear NAME`: drops the inactive table.
    pub fn clear(&self, name: &str) -> Result<Done, Error> {
        let _g = self.change()?;
        let mut r = self.registry();
        r.mapped(name)?;
        r.clear(name)?;
        Ok(Done {})
    }

    /// `suspend NAME`: holds new I/O and waits for I/O in flight; with
    /// `flush`, then flushes the devices below.
    pub fn suspend(&self, name: &str, flush: bool) -> Result<Done, Error> {
        let _g = self.change()?;
        let d = self.registry().mapped(name)?;
        mapped(&d)
            .suspend(flush)
            .map_err(|e| e.context(format!("suspend '{name}'")))?;
        Ok(Done {})
    }

    /// `resume NAME`: makes the inactive table live, if one is loaded
    /// (suspending first if needed), and releases held I/O.
    pub fn resume(&self, name: &str) -> Result<Done, Error> {
        let _g = self.change()?;
        self.resume_locked(name)
    }

    fn resume_locked(&self, name: &str) -> Result<Done, Error> {
        let ctx = |e: Error| e.context(format!("resume '{name}'"));
        let d = self.registry().mapped(name)?;
        let m = mapped(&d);
        let has_inactive = self.registry().entry(name)?.inactive_lines().is_some();
        if has_inactive && !m.is_suspended() {
            if let Err(e) = m.suspend(true) {
                if m.is_suspended() {
                    m.resume().map_err(ctx)?;
                }
                return Err(ctx(e.context("suspend")));
            }
        }
        // Taken only now: until it is live, the inactive table holds its
        // devices in the registry.
        if let Some(t) = self.registry().take_inactive(name)? {
            m.load(t);
        }
        m.resume().map_err(ctx)?;
        Ok(Done {})
    }

    /// `reload NAME TABLE`: load + suspend + resume. Refused before the
    /// device is touched: see [`Registry::load`].
    pub fn reload(&self, name: &str, table: &str) -> Result<Done, Error> {
        let _g = self.change()?;
        self.registry()
            .load(name, table)
            .map_err(|e| e.context(format!("reload '{name}'")))?;
        self.resume_locked(name)
            .map_err(|e| e.context(format!("reload '{name}'")))
    }

    /// `message NAME SECTOR ARGV…`: sent to the target holding SECTOR.
    pub fn message(&self, name: &str, sector: u64, argv: &[&str]) -> Result<MessageReply, Error> {
        let d = self.registry().mapped(name)?;
        let reply = mapped(&d)
            .message(sector, argv)
            .map_err(|e| e.context(format!("device '{name}'")))?;
        Ok(MessageReply { reply })
    }

    /// `info NAME`.
    pub fn info(&self, name: &str) -> Result<Info, Error> {
        info_of(&self.registry(), name)
    }

    /// `ls`.
    pub fn ls(&self) -> List {
        let r = self.registry();
        let devices = r
            .entries()
            .iter()
            .filter_map(|e| info_of(&r, e.name()).ok())
            .collect();
        List { devices }
    }

    /// `deps NAME`.
    pub fn deps(&self, name: &str) -> Result<Deps, Error> {
        Ok(Deps {
            name: name.to_string(),
            deps: self.registry().deps(name)?,
        })
    }

    /// The entries named (all when `names` is empty), or an error naming
    /// the first unknown one: (name, device, inactive lines).
    fn select(&self, names: &[String]) -> Result<Vec<Selected>, Error> {
        let r = self.registry();
        for n in names {
            r.entry(n)?;
        }
        Ok(r.entries()
            .iter()
            .filter(|e| names.is_empty() || names.iter().any(|n| n == e.name()))
            .map(|e| Selected {
                name: e.name().to_string(),
                dev: e.device().clone(),
                inactive: e.inactive_lines().map(<[String]>::to_vec),
            })
            .collect())
    }

    /// `status [NAME…]`: the status lines of the mapped devices named.
    pub fn status(&self, names: &[String]) -> Result<Status, Error> {
        let devices = self
            .select(names)?
            .into_iter()
            .filter_map(|s| {
                let m = s.dev.as_any().downcast_ref::<MappedDevice>()?;
                Some(DeviceStatus {
                    name: s.name,
                    lines: m.table().status_lines(),
                })
            })
            .collect();
        Ok(Status { devices })
    }

    /// `table [NAME…]`: size, capabilities, and table and status lines.
    pub fn table(&self, names: &[String]) -> Result<Tables, Error> {
        let devices = self
            .select(names)?
            .into_iter()
            .map(|s| {
                let l = s.dev.limits();
                let m = s.dev.as_any().downcast_ref::<MappedDevice>();
                let targets = match m {
                    Some(m) => {
                        let t = m.table();
                        t.table_lines()
                            .into_iter()
                            .zip(t.status_lines())
                            .map(|(table, status)| TargetLines { table, status })
                            .collect()
                    }
                    None => Vec::new(),
                };
                DeviceTable {
                    name: s.name,
                    sectors: l.sectors,
                    logical_block_size: l.logical_block_size,
                    max_io_bytes: l.max_io_bytes,
                    caps: format!("{:?}", s.dev.caps()),
                    suspended: m.is_some_and(|m| m.is_suspended()),
                    targets,
                    inactive: s.inactive,
                }
            })
            .collect();
        Ok(Tables { devices })
    }

    /// `targets`: the target types tables may use.
    pub fn targets(&self) -> Targets {
        let r = self.registry();
        let t = r.targets();
        let targets = t
            .types()
            .into_iter()
            .map(|tt| TargetInfo {
                name: tt.name.to_string(),
                version: tt.version,
                summary: tt.summary.to_string(),
                usage: tt.usage.to_string(),
                min_args: tt.min_args,
                max_args: tt.max_args,
                splits: tt.splits,
                exclusive_args: tt.exclusive_args.to_vec(),
            })
            .collect();
        Targets { targets }
    }

    /// `version`.
    pub fn version(&self) -> Version {
        Version {
            udm: env!("CARGO_PKG_VERSION").to_string(),
            protocol: PROTOCOL_VERSION,
        }
    }
}

struct Selected {
    name: String,
    dev: Arc<dyn BlockDevice>,
    inactive: Option<Vec<String>>,
}

fn info_of(r: &Registry, name: &str) -> Result<Info, Error> {
    let e = r.entry(name)?;
    let l = e.device().limits();
    Ok(Info {
        name: name.to_string(),
        kind: e.kind().to_string(),
        sectors: l.sectors,
        logical_block_size: l.logical_block_size,
        max_io_bytes: l.max_io_bytes,
        caps: format!("{:?}", e.device().caps()),
        suspended: e.mapped().is_some_and(|m| m.is_suspended()),
        inactive_table: e.inactive_lines().is_some(),
        holders: r.holders(name),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack() -> Control {
        Control::build(&["ram0=ram:1M", "ram1=ram:1M", "lin=0 2048 linear ram0 0"]).unwrap()
    }

    #[test]
    fn load_then_resume_swaps_the_table_and_clear_drops_it() {
        let c = stack();
        c.load("lin", "0 2048 linear ram1 0").unwrap();
        let t = c.table(&["lin".into()]).unwrap();
        assert_eq!(t.devices[0].targets[0].table, "0 2048 linear ram0 0");
        assert_eq!(
            t.devices[0].inactive.as_deref(),
            Some(&["0 2048 linear ram1 0".to_string()][..])
        );
        assert!(c.info("lin").unwrap().inactive_table);
        c.resume("lin").unwrap();
        let t = c.table(&["lin".into()]).unwrap();
        assert_eq!(t.devices[0].targets[0].table, "0 2048 linear ram1 0");
        assert_eq!(t.devices[0].inactive, None);
        // ram0 is free now; ram1 is held by the live table.
        c.remove("ram0", RemoveMode::Normal).unwrap();
        assert!(c.remove("ram1", RemoveMode::Normal).is_err());
        c.load("lin", "0 2048 zero").unwrap();
        c.clear("lin").unwrap();
        assert!(!c.info("lin").unwrap().inactive_table);
    }

    #[test]
    fn suspend_holds_io_until_resume() {
        let c = stack();
        c.suspend("lin", true).unwrap();
        assert!(c.info("lin").unwrap().suspended);
        assert!(c.table(&[]).unwrap().to_string().contains(", suspended"));
        let e = c.suspend("lin", true).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Busy);
        c.resume("lin").unwrap();
        assert!(!c.info("lin").unwrap().suspended);
        assert!(c.suspend("ram0", false).is_err());
    }

    #[test]
    fn reload_keeps_the_table_rules_and_names_the_device() {
        let c = stack();
        c.reload("lin", "0 1024 linear ram0 0; 1024 1024 zero")
            .unwrap();
        let s = c.status(&[]).unwrap().to_string();
        assert_eq!(s, "lin: 0 1024 linear\nlin: 1024 1024 zero");
        let e = c.reload("lin", "0 8 zero").err().unwrap().to_string();
        assert!(
            e.starts_with("reload 'lin': the new table has 8 sectors"),
            "{e}"
        );
        let e = c.reload("lin", "0 2048 frob").err().unwrap().to_string();
        assert!(e.contains("unknown target type 'frob'"), "{e}");
    }

    #[test]
    fn reads_name_unknown_devices_and_list_the_rest() {
        let c = stack();
        let e = c.status(&["nope".into()]).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(e.to_string(), "unknown device 'nope'");
        assert_eq!(c.ls().devices.len(), 3);
        assert_eq!(
            c.deps("lin").unwrap().to_string(),
            "1 dependencies\t: (ram0)"
        );
        let t = c.targets();
        assert!(t.targets.iter().any(|t| t.name == "writecache"));
        assert_eq!(c.version().protocol, PROTOCOL_VERSION);
        let e = c.message("lin", 0, &["flush"]).err().unwrap().to_string();
        assert!(e.starts_with("device 'lin': "), "{e}");
    }

    #[test]
    fn build_takes_name_spec_pairs_and_names_the_bad_one() {
        let err = |defs: &[&str]| Control::build(defs).err().unwrap().to_string();
        assert!(err(&["ram0"]).contains("--dev 'ram0': expected NAME=SPEC"));
        assert!(err(&["a=ram:1G", "a=ram:1G"]).contains("device 'a': device 'a' already exists"));
        assert!(err(&["a=disk:1G"]).contains("unknown backend 'disk:'"));
        assert!(err(&["r=ram:4k", "l=0 16 linear r 0"]).starts_with("device 'l': "));
    }

    #[test]
    fn close_waits_for_a_change_in_progress() {
        let c = Arc::new(stack());
        let (tx, rx) = std::sync::mpsc::channel();
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            let g = c2.change().unwrap();
            tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(g);
        });
        rx.recv().unwrap();
        let t0 = std::time::Instant::now();
        c.close();
        assert!(t0.elapsed() >= std::time::Duration::from_millis(150));
        t.join().unwrap();
        assert_eq!(
            c.reload("lin", "0 2048 zero").unwrap_err().kind(),
            ErrorKind::Busy
        );
    }

    #[test]
    fn after_close_changes_are_refused_and_reads_go_on() {
        let c = stack();
        c.suspend("lin", false).unwrap();
        c.close();
        assert!(!c.info("lin").unwrap().suspended, "close resumes");
        let e = c.create("x", "ram:1M").err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert!(c.status(&[]).is_ok());
    }
}
