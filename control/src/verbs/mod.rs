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
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use udm_core::{merge_report, BlockDevice, Error, ErrorKind};
use udm_mapper::MappedDevice;

use crate::exports::LimitsDef;
use crate::exports::{Devices, ExportInfo, ExportList, ExportService, ExportSpec};
use crate::registry::{Holder, Registry, RemoveMode};
use crate::report::{
    Deps, DeviceStatus, DeviceTable, Done, Event, Info, List, MessageReply, Removed, Status,
    Tables, TargetInfo, TargetLines, Targets, Version,
};

/// The control protocol's version.
pub const PROTOCOL_VERSION: u32 = 1;

/// A device registry shared by the threads that act on it.
pub struct Control {
    reg: Mutex<Registry>,
    /// Signalled, with `reg`, when an event counter moves or a device goes.
    events: Condvar,
    /// What serves exports, in a daemon.
    exports: Mutex<Option<Arc<dyn ExportService>>>,
    /// The exports' limits in force, for `dump-config`.
    limits: Mutex<LimitsDef>,
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
            events: Condvar::new(),
            exports: Mutex::new(None),
            limits: Mutex::new(LimitsDef::default()),
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

    /// Releases `holder` from device `name`; a deferred remove that was
    /// waiting for it happens now.
    pub fn release(&self, name: &str, holder: &Holder) -> Result<(), Error> {
        let gone = {
            let mut r = self.registry();
            r.release(name, holder)?;
            r.reap()
        };
        self.gone(gone);
        Ok(())
    }

    /// Drops removed devices outside the registry's lock (a backend may
    /// join workers) and wakes waiters, whose device may be among them.
    fn gone(&self, devs: Vec<Arc<dyn BlockDevice>>) {
        let any = !devs.is_empty();
        drop(devs);
        if any {
            self.events.notify_all();
        }
    }

    /// Plugs in what serves exports (the daemon's NBD servers).
    pub fn set_exports(&self, service: Arc<dyn ExportService>) {
        *lock(&self.exports) = Some(service);
    }

    /// Records the limits the exports run under (what `dump-config`
    /// writes in `[limits]`).
    pub fn set_limits(&self, limits: LimitsDef) {
        *lock(&self.limits) = limits;
    }

    /// The limits recorded by [`Control::set_limits`].
    pub fn limits(&self) -> LimitsDef {
        lock(&self.limits).clone()
    }

    fn export_service(&self) -> Result<Arc<dyn ExportService>, Error> {
        lock(&self.exports).clone().ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                "exports are managed by 'udm daemon' (this server has a fixed set)",
            )
        })
    }

    /// `export add`: serves a device.
    pub fn export_add(&self, spec: ExportSpec) -> Result<ExportInfo, Error> {
        let _g = self.change()?;
        let what = format!("export of '{}'", spec.device);
        self.export_service()?
            .add(self, spec)
            .map_err(|e| e.context(what))
    }

    /// `export remove NAME`: see [`ExportService::remove`]. A deferred
    /// remove of the device that was waiting for it happens now.
    pub fn export_remove(&self, name: &str, force: bool) -> Result<Done, Error> {
        let _g = self.change()?;
        self.export_service()?
            .remove(self, name, force)
            .map_err(|e| e.context(format!("export '{name}'")))?;
        Ok(Done {})
    }

    /// `export ls`.
    pub fn export_ls(&self) -> Result<ExportList, Error> {
        Ok(self.export_service()?.list())
    }

    /// Stops every export (a daemon's shutdown).
    pub fn stop_exports(&self) {
        let s = lock(&self.exports).clone();
        if let Some(s) = s {
            s.stop_all(self);
        }
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
        self.events.notify_all(); // waiters give up
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
        self.create_with(name, spec, None)
    }

    /// `create NAME luks:…` with the passphrase from the request (see
    /// [`Registry::create_with`]).
    pub fn create_with(
        &self,
        name: &str,
        spec: &str,
        pass: Option<&crate::luks::Passphrase>,
    ) -> Result<Info, Error> {
        let _g = self.change()?;
        let mut r = self.registry();
        r.create_with(name, spec, pass)
            .map_err(|e| e.context(format!("device '{name}'")))?;
        info_of(&r, name)
    }

    /// `remove NAME`: refused (Busy, naming the holder) while it is held,
    /// unless by force or deferred (see [`RemoveMode`]). A force remove of
    /// a held backend is refused: only a mapped device's I/O can be made
    /// to fail.
    pub fn remove(&self, name: &str, mode: RemoveMode) -> Result<Done, Error> {
        let _g = self.change()?;
        self.remove_locked(name, mode)?;
        Ok(Done {})
    }

    fn remove_locked(&self, name: &str, mode: RemoveMode) -> Result<(), Error> {
        let ctx = |e: Error| e.context(format!("remove '{name}'"));
        if mode == RemoveMode::Force {
            let (held, error_table) = {
                let r = self.registry();
                let e = r.entry(name)?;
                let held = !r.holders(name).is_empty();
                let t = match (held, e.mapped().is_some()) {
                    (true, true) => Some(r.error_table(name).map_err(ctx)?),
                    _ => None,
                };
                (held, t)
            };
            match error_table {
                Some(t) => {
                    let d = self.registry().mapped(name)?;
                    let m = mapped(&d);
                    // Drain what is in flight on the old table, then every
                    // new I/O fails: the holders see EIO, never a hang.
                    if !m.is_suspended() {
                        m.suspend(false).map_err(ctx)?;
                    }
                    m.load(t);
                    m.resume().map_err(ctx)?;
                    self.registry().event(name);
                }
                None if held => {
                    return Err(ctx(Error::new(
                        ErrorKind::Busy,
                        format!(
                            "'{name}' is a backend in use by {}: only a mapped device's I/O can be failed; remove its holders first",
                            self.registry().holders(name)[0]
                        ),
                    )))
                }
                None => {}
            }
        }
        let gone = {
            let mut r = self.registry();
            let dev = r.remove(name, mode)?;
            let mut gone = r.reap();
            gone.extend(dev);
            gone
        };
        self.gone(gone);
        Ok(())
    }

    /// `remove --all`: every device, top of the stack first, as `mode`
    /// says. Stops at the first that cannot go (naming it and its holder);
    /// those removed before it stay removed.
    pub fn remove_all(&self, mode: RemoveMode) -> Result<Removed, Error> {
        let _g = self.change()?;
        let names: Vec<String> = {
            let r = self.registry();
            r.entries()
                .iter()
                .rev()
                .map(|e| e.name().to_string())
                .collect()
        };
        let mut removed = Vec::new();
        for n in names {
            if self.registry().entry(&n).is_err() {
                continue; // reaped with a deferred remove
            }
            self.remove_locked(&n, mode).map_err(|e| {
                if removed.is_empty() {
                    e
                } else {
                    e.context(format!("after removing {}", removed.join(", ")))
                }
            })?;
            removed.push(n);
        }
        Ok(Removed { removed })
    }

    /// `wait NAME EVENT_NR`: returns once the device's event counter
    /// passes `event_nr` (at once if it has), or after `timeout` with
    /// a TimedOut error; an error if the device is removed meanwhile.
    pub fn wait(
        &self,
        name: &str,
        event_nr: u64,
        timeout: Option<Duration>,
    ) -> Result<Event, Error> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut r = self.registry();
        loop {
            let now = r.entry(name)?.event_nr();
            if now > event_nr {
                return Ok(Event {
                    name: name.to_string(),
                    event_nr: now,
                });
            }
            if self.is_closing() {
                return Err(Error::new(ErrorKind::Busy, "shutting down"));
            }
            // Target events are counted by the targets, not signalled:
            // look again every so often.
            let mut step = Duration::from_millis(100);
            if let Some(d) = deadline {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::new(
                        ErrorKind::TimedOut,
                        format!(
                            "wait '{name}': still at event {now} (waited for more than {event_nr})"
                        ),
                    ));
                }
                step = step.min(left);
            }
            r = self
                .events
                .wait_timeout(r, step)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
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
        let gone = {
            let mut r = self.registry();
            r.mapped(name)?;
            r.clear(name)?;
            r.reap()
        };
        self.gone(gone);
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
        let swapped = match self.registry().take_inactive(name)? {
            Some(t) => {
                m.load(t);
                true
            }
            None => false,
        };
        m.resume().map_err(ctx)?;
        if swapped {
            let gone = {
                let mut r = self.registry();
                r.event(name);
                r.reap()
            };
            self.events.notify_all();
            self.gone(gone);
        }
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
        let backend = {
            let r = self.registry();
            let e = r.entry(name)?;
            e.mapped().is_none().then(|| e.device().clone())
        };
        if let Some(dev) = backend {
            // A backend's messages (e.g. rbd's `resize`).
            let reply = dev
                .message(argv)
                .map_err(|e| e.context(format!("device '{name}'")))?;
            return Ok(MessageReply { reply });
        }
        let d = self.registry().mapped(name)?;
        let reply = mapped(&d)
            .message(sector, argv)
            .map_err(|e| e.context(format!("device '{name}'")))?;
        Ok(MessageReply { reply })
    }

    /// `info NAME`.
    pub fn info(&self, name: &str) -> Result<Info, Error> {
        let mut info = info_of(&self.registry(), name)?;
        let service = lock(&self.exports).clone();
        if let Some(s) = service {
            info.exports = s
                .list()
                .exports
                .into_iter()
                .filter(|e| e.device == name && !e.dispatch.is_empty())
                .map(|e| format!("{} ({}): {}", e.name, e.protocol, e.dispatch))
                .collect();
        }
        Ok(info)
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
        self.select_shown(names, false)
    }

    /// [`Control::select`], with the inactive tables' keys shown when
    /// `show_keys`.
    fn select_shown(&self, names: &[String], show_keys: bool) -> Result<Vec<Selected>, Error> {
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
                inactive: if show_keys {
                    e.inactive_lines_with_keys()
                } else {
                    e.inactive_lines().map(<[String]>::to_vec)
                },
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

    /// `table [NAME…]`: size, capabilities, and table and status lines,
    /// with keys (crypt's) hidden.
    pub fn table(&self, names: &[String]) -> Result<Tables, Error> {
        self.table_shown(names, false)
    }

    /// `table [--show-keys] [NAME…]`: [`Control::table`], with the keys in
    /// the table lines shown when `show_keys` (`dmsetup table --showkeys`).
    pub fn table_shown(&self, names: &[String], show_keys: bool) -> Result<Tables, Error> {
        let devices = self
            .select_shown(names, show_keys)?
            .into_iter()
            .map(|s| {
                let l = s.dev.limits();
                let m = s.dev.as_any().downcast_ref::<MappedDevice>();
                let targets = match m {
                    Some(m) => {
                        let t = m.table();
                        let lines = if show_keys {
                            t.table_lines_with_keys()
                        } else {
                            t.table_lines()
                        };
                        lines
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

impl Devices for Control {
    fn device(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        self.get(name)
    }
    fn hold(&self, name: &str, holder: Holder) -> Result<(), Error> {
        Control::hold(self, name, holder)
    }
    fn release(&self, name: &str, holder: &Holder) -> Result<(), Error> {
        Control::release(self, name, holder)
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
        deps: r.deps(name)?,
        event_nr: e.event_nr(),
        deferred_remove: e.deferred_remove(),
        backend: e.device().describe(),
        merging: {
            let (helps, why) = merge_report(&**e.device());
            format!("{} ({why})", if helps { "yes" } else { "no" })
        },
        exports: Vec::new(),
    })
}

#[cfg(test)]
mod tests;
