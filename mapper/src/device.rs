//! A mapped device (dm's `mapped_device`) and its control path.
//!
//! Table changes follow dm: [`MappedDevice::load`] stages a table in the
//! inactive slot, [`MappedDevice::suspend`] holds new I/O and waits for
//! in-flight I/O to drain (optionally flushing), [`MappedDevice::resume`]
//! makes the staged table live and releases held I/O. [`MappedDevice::replace`]
//! swaps the live table while I/O runs: I/O in flight finishes on the table
//! it started on, and new I/O sees the new one.
//!
//! Control never locks the data path: it messages every reactor that has a
//! channel to the device (SPDK's `for_each_channel`) and waits for each to
//! answer by dropping a guard (`waiter.rs`).

use std::any::Any;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use udm_core::{
    BioPtr, BlockDevice, Caps, Channel, Error, ErrorKind, Extent, Limits, Op, Reactor,
    ReactorHandle,
};

use crate::io::MapperChannel;
use crate::stats::DevStats;
use crate::table::Table;
use crate::waiter::{lock, Guard, Waiter};

static NEXT_KEY: AtomicU64 = AtomicU64::new(1 << 40);

struct Control {
    live: Arc<Table>,
    inactive: Option<Arc<Table>>,
    suspended: bool,
    fast_path: bool,
    reactors: Vec<ReactorHandle>,
}

/// A device whose I/O is mapped through a table of targets.
pub struct MappedDevice {
    name: String,
    /// Key of this device's channel in each reactor's locals.
    key: u64,
    ctl: Mutex<Control>,
    stats: DevStats,
}

impl MappedDevice {
    /// A device called `name` with `table` live: its targets are resumed
    /// (dm's create is a load and a resume), so that background work such as
    /// a mirror's resync starts now rather than at the first I/O.
    pub fn new(name: impl Into<String>, table: Table) -> Arc<MappedDevice> {
        for t in &table.targets {
            t.target.resume();
        }
        Arc::new(MappedDevice {
            name: name.into(),
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            ctl: Mutex::new(Control {
                live: Arc::new(table),
                inactive: None,
                suspended: false,
                fast_path: true,
                reactors: Vec::new(),
            }),
            stats: DevStats::default(),
        })
    }

    /// The live table.
    pub fn table(&self) -> Arc<Table> {
        lock(&self.ctl).live.clone()
    }

    /// Whether the device is suspended.
    pub fn is_suspended(&self) -> bool {
        lock(&self.ctl).suspended
    }

    /// Stages `table`; it goes live at the next [`MappedDevice::resume`].
    pub fn load(&self, table: Table) {
        lock(&self.ctl).inactive = Some(Arc::new(table));
    }

    /// Turns the no-clone fast path on or off (to compare the two).
    pub fn set_fast_path(&self, on: bool) -> Result<(), Error> {
        let handles = {
            let mut c = lock(&self.ctl);
            c.fast_path = on;
            c.reactors.clone()
        };
        self.for_each_channel(&handles, move |_, ch, _g| ch.set_fast_path(on))
    }

    /// Holds new I/O and waits until every I/O in flight has completed; with
    /// `flush`, then flushes every device so that all completed writes are
    /// durable. Must not be called from a reactor thread.
    pub fn suspend(&self, flush: bool) -> Result<(), Error> {
        let handles = {
            let mut c = lock(&self.ctl);
            if c.suspended {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!("device '{}' is already suspended", self.name),
                ));
            }
            c.suspended = true;
            c.reactors.clone()
        };
        for t in &self.table().targets {
            t.target.presuspend();
        }
        self.for_each_channel(&handles, |_, ch, g| {
            ch.set_suspended(true);
            // The channel's slow work drops the guard once nothing is in flight.
            *ch.state.drain.borrow_mut() = Some(g);
            ch.state.kick();
        })?;
        if flush {
            let waiter = Waiter::new();
            let g = waiter.guard();
            let key = self.key;
            match handles.iter().find(|h| !h.is_closed()) {
                // If the reactor closes meanwhile, the message and guard drop.
                Some(h) => {
                    h.send(move |r| flush_on(r, key, g));
                }
                None => drop(g),
            }
            waiter.wait()?;
        }
        for t in &self.table().targets {
            t.target.postsuspend()?;
        }
        Ok(())
    }

    /// Makes a staged table live (if one was loaded) and releases held I/O.
    pub fn resume(&self) -> Result<(), Error> {
        let (handles, table) = {
            let mut c = lock(&self.ctl);
            let table = c.inactive.take();
            if let Some(t) = &table {
                c.live = t.clone();
            }
            c.suspended = false;
            (c.reactors.clone(), table)
        };
        for t in &self.table().targets {
            t.target.resume();
        }
        self.for_each_channel(&handles, move |r, ch, g| {
            if let Some(t) = &table {
                if let Err(e) = switch(r, ch, t.clone()) {
                    g.fail(e);
                }
            }
            ch.set_suspended(false);
            ch.kick();
        })
    }

    /// Swaps the live table while I/O runs. When this returns, every reactor
    /// maps new I/O through `table`.
    pub fn replace(&self, table: Table) -> Result<(), Error> {
        let table = Arc::new(table);
        let handles = {
            let mut c = lock(&self.ctl);
            c.live = table.clone();
            c.reactors.clone()
        };
        self.for_each_channel(&handles, move |r, ch, g| {
            if let Err(e) = switch(r, ch, table.clone()) {
                g.fail(e);
            }
        })
    }

    /// Sends a message to the target holding `sector`; `stats …` is the
    /// device's own (see `MappedDevice::stats_message`).
    pub fn message(&self, sector: u64, argv: &[&str]) -> Result<String, Error> {
        if argv.first() == Some(&"stats") {
            return self.stats_message(&argv[1..]);
        }
        self.table().message(sector, argv)
    }

    /// `stats histogram on|off` (latency timing) and `stats clear`.
    fn stats_message(&self, argv: &[&str]) -> Result<String, Error> {
        match argv {
            ["histogram", on @ ("on" | "off")] => {
                self.set_histogram(*on == "on")?;
                Ok(String::new())
            }
            ["clear"] => {
                self.stats.clear();
                Ok(String::new())
            }
            _ => Err(Error::invalid(format!(
                "message 'stats {}': expected 'stats histogram on|off' or 'stats clear'",
                argv.join(" ")
            ))),
        }
    }

    /// The device's I/O statistics.
    pub fn stats(&self) -> &DevStats {
        &self.stats
    }

    /// Turns latency timing (the statistics' histograms) on or off.
    pub fn set_histogram(&self, on: bool) -> Result<(), Error> {
        let handles = {
            let c = lock(&self.ctl);
            self.stats.set_histogram_flag(on);
            c.reactors.clone()
        };
        self.for_each_channel(&handles, move |_, ch, _g| ch.set_timed(on))
    }

    /// I/Os in flight, over every reactor (asked of each).
    pub fn inflight(&self) -> Result<u64, Error> {
        let handles = lock(&self.ctl).reactors.clone();
        let n = Arc::new(AtomicU64::new(0));
        let m = n.clone();
        self.for_each_channel(&handles, move |_, ch, _g| {
            m.fetch_add(ch.inflight(), Ordering::Relaxed);
        })?;
        Ok(n.load(Ordering::Relaxed))
    }

    /// Runs `f` on every reactor's channel to this device and waits for all.
    fn for_each_channel(
        &self,
        handles: &[ReactorHandle],
        f: impl Fn(&Reactor, &MapperChannel, Guard) + Send + Sync + 'static,
    ) -> Result<(), Error> {
        let waiter = Waiter::new();
        let f = Arc::new(f);
        let key = self.key;
        for h in handles {
            let g = waiter.guard();
            let f = f.clone();
            // A closed reactor drops the message, and with it the guard.
            h.send(move |r| match channel_of(r, key) {
                Some(ch) => f(r, &ch, g),
                None => drop(g),
            });
        }
        waiter.wait()
    }
}

impl Drop for MappedDevice {
    /// The device is gone: each reactor lets go of its channel (its
    /// reactor-local reference), so that the channel and its tables (and
    /// their targets: a pool's volume, a writecache's worker) go as soon
    /// as nothing else holds them, not when the reactor ends. A submitter
    /// that still holds the channel keeps it, and its I/O, alive.
    fn drop(&mut self) {
        let key = self.key;
        for h in &lock(&self.ctl).reactors {
            // A closed reactor took its locals with it.
            h.send(move |r| {
                r.remove_local(key);
            });
        }
    }
}

fn channel_of(r: &Reactor, key: u64) -> Option<Rc<MapperChannel>> {
    r.local(key)?.downcast::<MapperChannel>().ok()
}

fn switch(r: &Reactor, ch: &MapperChannel, table: Arc<Table>) -> Result<(), Error> {
    if Arc::ptr_eq(&ch.current().table, &table) {
        return Ok(());
    }
    let tio = ch.open_table(table, r)?;
    ch.switch(tio);
    Ok(())
}

/// Flushes every device of the live table from reactor `r` (a suspend's flush).
fn flush_on(r: &Reactor, key: u64, g: Guard) {
    let Some(ch) = channel_of(r, key) else {
        return drop(g);
    };
    let tio = ch.current();
    let mut bio = r.alloc_bio();
    bio.set_dataless(Op::Flush, 0, 0);
    let g = Box::new(g);
    bio.set_end_io(suspend_flush_done, Box::into_raw(g).cast());
    // Straight to the table: the channel itself holds I/O while suspended.
    crate::clone::submit(&tio, bio);
}

fn suspend_flush_done(bio: BioPtr) {
    // SAFETY: private is the Box<Guard> leaked in flush_on, taken back once.
    let g = unsafe { Box::from_raw(bio.private() as *mut Guard) };
    if !bio.status().is_ok() {
        g.fail(Error::new(
            ErrorKind::Io,
            format!("flush before suspend failed: {}", bio.status()),
        ));
    }
}

impl BlockDevice for MappedDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn limits(&self) -> Limits {
        lock(&self.ctl).live.limits
    }

    fn caps(&self) -> Caps {
        lock(&self.ctl).live.caps
    }

    /// From what the live table maps to: merging helps if it helps any
    /// device under it (those are named), else it helps none (all named).
    fn merge_reason(&self) -> String {
        let t = self.table();
        if t.devices.is_empty() {
            return "maps to no device".into();
        }
        let helps = t.caps.contains(Caps::MERGE);
        let mut seen = Vec::new();
        for d in &t.devices {
            if d.caps().contains(Caps::MERGE) == helps && !seen.iter().any(|(n, _)| n == d.name()) {
                seen.push((d.name().to_string(), d.merge_reason()));
            }
        }
        let parts: Vec<String> = seen.iter().map(|(n, w)| format!("{n}: {w}")).collect();
        format!("maps to {}", parts.join("; "))
    }

    /// The live table's answer ([`Table::block_status`]): a snapshot, as a
    /// reload may swap the table right after.
    fn block_status(&self, sector: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        self.table().block_status(sector, sectors, out)
    }

    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        if let Some(ch) = channel_of(reactor, self.key) {
            return Ok(ch);
        }
        let mut c = lock(&self.ctl);
        let ch = MapperChannel::open(
            c.live.clone(),
            reactor,
            c.suspended,
            c.fast_path,
            self.stats.shard(),
            self.stats.histogram(),
        )
        .map_err(|e| e.context(format!("device '{}'", self.name)))?;
        reactor.set_local(self.key, ch.clone());
        c.reactors.retain(|h| !h.is_closed());
        c.reactors.push(reactor.handle());
        Ok(ch)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
