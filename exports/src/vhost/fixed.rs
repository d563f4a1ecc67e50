//! The guest's memory registered with a reactor's io_uring, so that a
//! backend on that ring reads and writes guest buffers with READ_FIXED /
//! WRITE_FIXED: no page pinning per I/O.
//!
//! Each reactor that runs queues registers each memory region once, in
//! chunks of 1 GiB (io_uring's limit), on its own thread, when a queue
//! starts or the memory table changes; a region kept from one table to
//! the next keeps its registration. A [`Guest`] is one table as a reactor
//! sees it: the mapped memory and the registration of each of its regions.
//! The queues hold the current one and every request holds the one its
//! buffers came from, so a region's registration goes (its slots emptied)
//! when no table in use holds it any more, after the last request that
//! used it completed; the registration holds the region's mapping, so
//! the addresses it covers stay mapped to the pages the kernel pinned.
//!
//! When the kernel refuses (RLIMIT_MEMLOCK for a udm without
//! CAP_IPC_LOCK, memory it cannot pin), the reactor says why once, stops
//! trying for this export, and the I/O goes through plain reads and
//! writes. `UDM_VHOST_FIXED_BUFFERS=0` in udm's environment turns
//! registration off.

use std::cell::{Cell, RefCell};
use std::ops::Deref;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use udm_core::{Bio, Reactor, RegisteredRegion};

use super::memory::{Memory, Region};

/// The environment variable that turns registration off (`0`).
pub const FIXED_BUFFERS_ENV: &str = "UDM_VHOST_FIXED_BUFFERS";

/// Whether guest memory is registered (not turned off in the environment).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(FIXED_BUFFERS_ENV).map_or(true, |v| v != "0"))
}

/// One region registered with one reactor's rings.
struct Fixed {
    reg: RegisteredRegion,
    reactor: *const Reactor,
    /// Keeps the region mapped while registered (dropped after `drop`
    /// below has emptied the slots).
    region: Region,
}

impl Drop for Fixed {
    fn drop(&mut self) {
        // SAFETY: the registry's contract: the reactor outlives every
        // Guest its worker hands out (queues and requests are freed before
        // the worker is released, and the worker before the reactor).
        unsafe { (*self.reactor).unregister_region(&mut self.reg) };
    }
}

/// One memory table as a reactor sees it: the mapping, and what of it is
/// registered with the reactor's rings.
pub struct Guest {
    mem: Arc<Memory>,
    fixed: Vec<Rc<Fixed>>,
}

impl Deref for Guest {
    type Target = Memory;
    fn deref(&self) -> &Memory {
        &self.mem
    }
}

impl Guest {
    /// The registered buffer that holds `len` bytes at `ptr` (a buffer of
    /// this table, mapped by [`Memory::map`]), or [`Bio::NO_BUF`].
    #[inline]
    pub fn buf_index(&self, ptr: *const u8, len: u32) -> u16 {
        for f in &self.fixed {
            let i = f.reg.index_of(ptr, len as usize);
            if i != Bio::NO_BUF {
                return i;
            }
        }
        Bio::NO_BUF
    }

    /// The table it is.
    pub fn memory(&self) -> &Arc<Memory> {
        &self.mem
    }
}

/// A reactor's registrations of one export's guest memory.
pub struct Registry {
    reactor: *const Reactor,
    /// Regions registered and in use, by their mapping.
    regions: RefCell<Vec<Weak<Fixed>>>,
    /// The last table handed out, while in use.
    current: RefCell<Weak<Guest>>,
    /// The kernel refused once: no more tries for this export.
    refused: Cell<bool>,
}

/// Whether a refusal was logged in this process.
static REFUSAL_LOGGED: AtomicBool = AtomicBool::new(false);

impl Registry {
    /// A registry for `reactor`, which must outlive every [`Guest`] it
    /// hands out (the worker that owns it frees its queues, and their
    /// requests, before the reactor goes).
    pub fn new(reactor: *const Reactor) -> Registry {
        Registry {
            reactor,
            regions: RefCell::new(Vec::new()),
            current: RefCell::new(Weak::new()),
            refused: Cell::new(!enabled()),
        }
    }

    /// `mem` as this reactor sees it: the current [`Guest`] when it is that
    /// table, else a new one whose regions are registered (those of the
    /// last table kept as they are).
    pub fn guest(&self, mem: Arc<Memory>) -> Rc<Guest> {
        if let Some(g) = self.current.borrow().upgrade() {
            if Arc::ptr_eq(&g.mem, &mem) {
                return g;
            }
        }
        let mut fixed = Vec::with_capacity(mem.regions().len());
        {
            let mut regions = self.regions.borrow_mut();
            regions.retain(|w| w.strong_count() > 0);
            for r in mem.regions() {
                let kept = regions
                    .iter()
                    .filter_map(Weak::upgrade)
                    .find(|f| f.region.same_mapping(r));
                if let Some(f) = kept {
                    fixed.push(f);
                } else if let Some(f) = self.register(r) {
                    regions.push(Rc::downgrade(&f));
                    fixed.push(f);
                }
            }
        }
        let g = Rc::new(Guest { mem, fixed });
        *self.current.borrow_mut() = Rc::downgrade(&g);
        g
    }

    fn register(&self, r: &Region) -> Option<Rc<Fixed>> {
        if self.refused.get() {
            return None;
        }
        let (base, len) = r.host_range();
        // SAFETY: the reactor is alive (new's contract). The region stays
        // mapped at these addresses while registered: the Fixed made here
        // holds its mapping and empties the slots (on drop) before it
        // lets go of it.
        let (reg, err) = unsafe { (*self.reactor).register_region(base, len) };
        if let Some(e) = err {
            self.refused.set(true);
            if !REFUSAL_LOGGED.swap(true, Ordering::Relaxed) {
                tracing::info!(
                    "vhost: guest memory is not registered with io_uring ({e}); \
                     its I/O goes through plain reads and writes"
                );
            }
        }
        if reg.registered() == 0 {
            return None;
        }
        tracing::debug!(
            "vhost: memory region {:#x}+{:#x}: {} of {} chunks registered",
            r.gpa,
            r.len,
            reg.registered(),
            reg.chunks()
        );
        Some(Rc::new(Fixed {
            reg,
            reactor: self.reactor,
            region: r.clone(),
        }))
    }
}
