//! `ram`: a memory-backed device, like brd.
//!
//! Spec: `ram:<size>[,prealloc]`. Memory is allocated in 4 KiB pages on
//! first write (or all at once with `prealloc`);
//! reads of never-written space return zeroes. Discard and write-zeroes zero
//! the range (pages stay allocated: freeing one under a concurrent reader on
//! another reactor would need RCU, as brd uses, for little gain here).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::any::Any;
use std::rc::Rc;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

use udm_core::{
    check_bio, BioPtr, BlockDevice, Caps, Channel, Error, Limits, Op, Reactor, Status, SECTOR_SHIFT,
};

const PAGE: usize = 4096;
const PAGE_SHIFT: u32 = 12;

/// A RAM disk.
pub struct RamDevice {
    name: String,
    limits: Limits,
    pages: Box<[AtomicPtr<u8>]>,
    allocated: AtomicU64,
}

impl RamDevice {
    /// A RAM disk of `bytes` (rounded down to whole sectors; at least one).
    pub fn new(name: impl Into<String>, bytes: u64) -> Result<RamDevice, Error> {
        let sectors = bytes >> SECTOR_SHIFT;
        if sectors == 0 {
            return Err(Error::invalid(format!(
                "ram: size {bytes} is less than one sector"
            )));
        }
        let npages = bytes.div_ceil(PAGE as u64);
        let pages = (0..npages)
            .map(|_| AtomicPtr::new(std::ptr::null_mut()))
            .collect();
        Ok(RamDevice {
            name: name.into(),
            limits: Limits::new(sectors),
            pages,
            allocated: AtomicU64::new(0),
        })
    }

    /// Allocates every page now (`ram:<size>,prealloc`), as a brd disk
    /// that has been written over once: benchmarks then measure the data
    /// path, not first-touch page allocation, whose share depends on how
    /// much fresh space an access pattern reaches (a log-structured cache
    /// reaches all of it, random overwrites of a region only part).
    pub fn prealloc(&self) -> Result<(), Error> {
        for i in 0..self.pages.len() {
            if self.page(i, true).is_none() {
                return Err(Error::new(
                    udm_core::ErrorKind::Os,
                    format!("ram: out of memory preallocating '{}'", self.name),
                ));
            }
        }
        Ok(())
    }

    /// Bytes of memory allocated so far.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed) * PAGE as u64
    }

    fn layout() -> Layout {
        match Layout::from_size_align(PAGE, PAGE) {
            Ok(l) => l,
            Err(_) => unreachable!("4096/4096 is a valid layout"),
        }
    }

    /// The page at `idx`, allocating it (zeroed) if `create`.
    #[inline]
    fn page(&self, idx: usize, create: bool) -> Option<*mut u8> {
        let slot = &self.pages[idx];
        let p = slot.load(Ordering::Acquire);
        if !p.is_null() || !create {
            return (!p.is_null()).then_some(p);
        }
        // SAFETY: the layout has non-zero size.
        let fresh = unsafe { alloc_zeroed(Self::layout()) };
        if fresh.is_null() {
            return None;
        }
        match slot.compare_exchange(
            std::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                self.allocated.fetch_add(1, Ordering::Relaxed);
                Some(fresh)
            }
            Err(winner) => {
                // Another reactor installed the page first; use theirs.
                // SAFETY: `fresh` came from alloc_zeroed with this layout and
                // was never shared.
                unsafe { dealloc(fresh, Self::layout()) };
                Some(winner)
            }
        }
    }

    /// Serves `bio` synchronously; returns its status.
    fn rw(&self, bio: &mut BioPtr) -> Status {
        let mut pos = (bio.sector << SECTOR_SHIFT) as usize;
        let end = pos + bio.len() as usize;
        let mut off = 0usize;
        while pos < end {
            let idx = pos >> PAGE_SHIFT;
            let in_page = pos & (PAGE - 1);
            let n = (PAGE - in_page).min(end - pos);
            match bio.op {
                Op::Read => match self.page(idx, false) {
                    // SAFETY: pages are PAGE bytes, live until the device is
                    // dropped (never freed while shared), `in_page + n <= PAGE`.
                    // Bytes have no invalid values; a concurrent write to the
                    // same sectors from another reactor may tear the data, as
                    // overlapping I/O does on any block device.
                    Some(p) => bio.copy_in(off, unsafe {
                        std::slice::from_raw_parts(p.add(in_page), n)
                    }),
                    None => zero_part(bio, off, n),
                },
                Op::Write => match self.page(idx, true) {
                    // SAFETY: as above; the slice is only written through here.
                    Some(p) => bio.copy_out(off, unsafe {
                        std::slice::from_raw_parts_mut(p.add(in_page), n)
                    }),
                    None => return Status::NoMem,
                },
                Op::Discard | Op::WriteZeroes => {
                    if let Some(p) = self.page(idx, false) {
                        // SAFETY: as above.
                        unsafe { std::ptr::write_bytes(p.add(in_page), 0, n) };
                    }
                }
                Op::Flush => {}
            }
            pos += n;
            off += n;
        }
        Status::Ok
    }
}

fn zero_part(bio: &mut BioPtr, off: usize, n: usize) {
    const ZEROES: [u8; PAGE] = [0; PAGE];
    bio.copy_in(off, &ZEROES[..n]);
}

impl Drop for RamDevice {
    fn drop(&mut self) {
        for slot in self.pages.iter() {
            let p = slot.load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: allocated by alloc_zeroed with this layout; the
                // device (and so every channel) is going away.
                unsafe { dealloc(p, Self::layout()) };
            }
        }
    }
}

struct RamChannel {
    dev: Arc<RamDevice>,
}

impl BlockDevice for RamDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn caps(&self) -> Caps {
        // No volatile cache: FLUSH and FUA are trivially honoured.
        Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES
    }
    fn open(self: Arc<Self>, _reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        Ok(Rc::new(RamChannel { dev: self }))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Channel for RamChannel {
    #[inline]
    fn submit(&self, bio: BioPtr) {
        let dev = &*self.dev;
        let Some(mut bio) = check_bio(bio, &dev.limits, dev.caps()) else {
            return;
        };
        let s = dev.rw(&mut bio);
        bio.complete(s);
    }
}
