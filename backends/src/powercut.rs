//! `powercut`: a fault-injecting wrapper that can lose power.
//!
//! Wraps any [`BlockDevice`] and keeps, beside it, what a real disk with a
//! volatile write cache would have *durably*: a write becomes durable when a
//! FLUSH that was submitted after it completed, or, with FUA, when it
//! completes itself. [`Power::cut`] turns the power off (from then on
//! every I/O fails, atomically for every device sharing the same
//! [`Power`]); [`PowerCut::restore`] then rewrites the inner device with
//! what survived: the durable contents, and — when asked to tear — for each
//! sector touched by a write that was not durable, any one of the versions
//! written there since (writes inside the window may persist in any order,
//! each sector on its own). [`Power::on`] turns the power back on.
//!
//! Test-sized: it keeps a copy of the whole device in memory. The inner
//! device must hold `contents` when wrapped (a fresh RAM disk holds zeroes)
//! and must apply writes in submission order (a RAM disk does).

use std::any::Any;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard};

use udm_core::{
    BioFlags, BioPtr, BlockDevice, Caps, Channel, Error, ErrorKind, Limits, Op, Reactor, Status,
};

const SECTOR: usize = 512;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A power supply shared by several devices, so that they lose power at
/// the same instant.
#[derive(Default)]
pub struct Power {
    off: Mutex<bool>,
}

impl Power {
    /// A supply, switched on.
    pub fn new() -> Arc<Power> {
        Arc::new(Power::default())
    }

    /// Cuts the power: every I/O submitted from now on fails.
    pub fn cut(&self) {
        *lock(&self.off) = true;
    }

    /// Switches the power back on.
    pub fn on(&self) {
        *lock(&self.off) = false;
    }
}

struct Pending {
    id: u64,
    sector: u64,
    data: Vec<u8>,
    completed: bool,
}

#[derive(Default)]
struct State {
    durable: Vec<u8>,
    /// Writes not yet durable, in submission order.
    window: Vec<Pending>,
    /// For sectors written durably: the id of the newest such write (an
    /// older write made durable later must not overwrite it).
    durable_id: HashMap<u64, u64>,
    next_id: u64,
    flushes: HashMap<u64, Vec<u64>>,
}

impl State {
    fn make_durable(&mut self, id: u64) {
        let Some(i) = self.window.iter().position(|p| p.id == id) else {
            return;
        };
        let p = self.window.remove(i);
        for (k, chunk) in p.data.chunks(SECTOR).enumerate() {
            let s = p.sector + k as u64;
            let newest = self.durable_id.entry(s).or_insert(0);
            if *newest <= id {
                *newest = id;
                let o = s as usize * SECTOR;
                self.durable[o..o + chunk.len()].copy_from_slice(chunk);
            }
        }
    }
}

/// A device that can lose power (see the module docs).
pub struct PowerCut {
    name: String,
    inner: Arc<dyn BlockDevice>,
    power: Arc<Power>,
    st: Mutex<State>,
}

impl PowerCut {
    /// Wraps `inner`, which holds `contents` now (its whole size), on `power`.
    pub fn new(
        name: impl Into<String>,
        inner: Arc<dyn BlockDevice>,
        contents: Vec<u8>,
        power: Arc<Power>,
    ) -> Result<PowerCut, Error> {
        if contents.len() as u64 != inner.limits().bytes() {
            return Err(Error::invalid(format!(
                "powercut: {} bytes of contents for a device of {}",
                contents.len(),
                inner.limits().bytes()
            )));
        }
        Ok(PowerCut {
            name: name.into(),
            inner,
            power,
            st: Mutex::new(State {
                durable: contents,
                next_id: 1,
                ..State::default()
            }),
        })
    }

    /// After [`Power::cut`]: decides what survived (with `tear`, sector by
    /// sector among the versions written since the last durable one, using
    /// `rng`), makes that the durable state, and writes it to the inner
    /// device through `reactor`. Run it with the power off and no I/O in
    /// flight on this device.
    pub fn restore(
        &self,
        reactor: &Reactor,
        tear: bool,
        rng: &mut dyn FnMut() -> u64,
    ) -> Result<(), Error> {
        let image = {
            let mut st = lock(&self.st);
            let window = std::mem::take(&mut st.window);
            st.flushes.clear();
            if tear {
                // Candidates per sector: the durable value, then every newer
                // version in the window.
                let mut cands: HashMap<u64, Vec<&[u8]>> = HashMap::new();
                for p in &window {
                    for (k, chunk) in p.data.chunks(SECTOR).enumerate() {
                        let s = p.sector + k as u64;
                        if st.durable_id.get(&s).is_some_and(|&d| d > p.id) {
                            continue;
                        }
                        cands.entry(s).or_default().push(chunk);
                    }
                }
                let mut keys: Vec<u64> = cands.keys().copied().collect();
                keys.sort_unstable();
                for s in keys {
                    let c = &cands[&s];
                    let pick = (rng() % (c.len() as u64 + 1)) as usize;
                    if pick > 0 {
                        let o = s as usize * SECTOR;
                        let v = c[pick - 1].to_vec();
                        st.durable[o..o + SECTOR].copy_from_slice(&v);
                    }
                }
            }
            st.durable_id.clear();
            st.durable.clone()
        };
        let ch = self.inner.clone().open(reactor)?;
        let done = Rc::new(std::cell::Cell::new(None));
        let mut buf = image;
        let mut bio = reactor.alloc_bio();
        bio.op = Op::Write;
        bio.sector = 0;
        // SAFETY: `buf` lives until after the loop below has seen the
        // completion; nothing else touches it meanwhile.
        unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
        bio.set_end_io(restore_done, Rc::as_ptr(&done) as *mut ());
        ch.submit(bio);
        reactor.run_until(|| done.get().is_some());
        drop(buf);
        match done.get() {
            Some(Status::Ok) => Ok(()),
            s => Err(Error::new(
                ErrorKind::Io,
                format!("powercut '{}': restoring failed: {s:?}", self.name),
            )),
        }
    }

    /// Bytes written and not yet durable (for tests of the wrapper).
    pub fn volatile_writes(&self) -> usize {
        lock(&self.st).window.len()
    }
}

fn restore_done(bio: BioPtr) {
    // SAFETY: private is the Rc'd cell `restore` keeps alive until it has
    // seen this completion.
    let cell = unsafe { &*(bio.private() as *const std::cell::Cell<Option<Status>>) };
    cell.set(Some(bio.status()));
}

struct PcChannel {
    dev: Arc<PowerCut>,
    inner: Rc<dyn Channel>,
}

impl BlockDevice for PowerCut {
    fn name(&self) -> &str {
        &self.name
    }
    fn limits(&self) -> Limits {
        self.inner.limits()
    }
    fn caps(&self) -> Caps {
        self.inner.caps()
    }
    fn merge_reason(&self) -> String {
        self.inner.merge_reason()
    }
    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        let inner = self.inner.clone().open(reactor)?;
        Ok(Rc::new(PcChannel { dev: self, inner }))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Channel for PcChannel {
    fn submit(&self, bio: BioPtr) {
        let dev = &*self.dev;
        // Writes and flushes push a frame; past the frame limit a stand-in
        // carries the bio.
        let mut bio = bio.make_room();
        // Held while the bio goes down, so that a cut is atomic for every
        // device on this supply.
        let off = lock(&dev.power.off);
        if *off {
            drop(off);
            return bio.complete(Status::IoErr);
        }
        let me = Arc::as_ptr(&self.dev) as *mut ();
        match bio.op {
            Op::Write | Op::Discard | Op::WriteZeroes => {
                // A discard is kept as a write of zeroes, which is what the
                // RAM and file devices it wraps make of one: it can be lost
                // (or torn) like a write until a flush covers it.
                let mut data = vec![0u8; bio.len() as usize];
                if bio.op == Op::Write {
                    bio.copy_out(0, &mut data);
                }
                let id = {
                    let mut st = lock(&dev.st);
                    let id = st.next_id;
                    st.next_id += 1;
                    if bio.flags.contains(BioFlags::PREFLUSH) {
                        // The write's preflush covers what completed before
                        // it, as a flush would.
                        let covered = completed_writes(&st);
                        st.flushes.insert(id, covered);
                    }
                    st.window.push(Pending {
                        id,
                        sector: bio.sector,
                        data,
                        completed: false,
                    });
                    id
                };
                if !bio.push_end_io(write_done, me) {
                    // make_room left a free frame.
                    return bio.complete(Status::NoMem);
                }
                bio.set_ctx(id);
                self.inner.submit(bio);
            }
            Op::Flush => {
                let id = {
                    let mut st = lock(&dev.st);
                    let covered = completed_writes(&st);
                    let id = st.next_id;
                    st.next_id += 1;
                    st.flushes.insert(id, covered);
                    id
                };
                if !bio.push_end_io(flush_done, me) {
                    // make_room left a free frame.
                    return bio.complete(Status::NoMem);
                }
                bio.set_ctx(id);
                if bio.flags.contains(BioFlags::PREFLUSH) {
                    bio.flags.remove(BioFlags::PREFLUSH);
                }
                self.inner.submit(bio);
            }
            _ => self.inner.submit(bio),
        }
        drop(off);
    }
}

/// The writes a flush submitted now covers: those completed.
fn completed_writes(st: &State) -> Vec<u64> {
    st.window
        .iter()
        .filter(|p| p.completed)
        .map(|p| p.id)
        .collect()
}

fn write_done(mut bio: BioPtr) {
    // SAFETY: private is the PowerCut the channel submitted through; its
    // channel (which holds an Arc to it) outlives the bio.
    let dev = unsafe { &*(bio.private() as *const PowerCut) };
    let id = bio.ctx();
    let mut st = lock(&dev.st);
    let preflushed = st.flushes.remove(&id).unwrap_or_default();
    if bio.status().is_ok() {
        for w in preflushed {
            st.make_durable(w);
        }
        if let Some(p) = st.window.iter_mut().find(|p| p.id == id) {
            p.completed = true;
        }
        if bio.flags.contains(BioFlags::FUA) {
            st.make_durable(id);
        }
    }
    // Not held into the completion, which may submit to this device again.
    drop(st);
    bio.pop_end_io();
    bio.endio();
}

fn flush_done(mut bio: BioPtr) {
    // SAFETY: as in write_done.
    let dev = unsafe { &*(bio.private() as *const PowerCut) };
    let id = bio.ctx();
    {
        let mut st = lock(&dev.st);
        let covered = st.flushes.remove(&id).unwrap_or_default();
        if bio.status().is_ok() {
            for w in covered {
                st.make_durable(w);
            }
        }
    }
    bio.pop_end_io();
    bio.endio();
}
