//! The guest's memory as the frontend shares it: each region a file
//! descriptor mapped here (`MAP_SHARED`), known by its guest-physical
//! address and by its address in the frontend's process (vring addresses
//! come in the latter).

use std::fs::File;
use std::sync::Arc;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

/// One mapped region.
#[derive(Clone)]
pub struct Region {
    /// Guest-physical address of its start.
    pub gpa: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Its address in the frontend's process.
    pub user_addr: u64,
    /// Where it is mapped here (the mapping's address, kept at hand for
    /// [`Memory::map`]: one load instead of two through the mapping).
    host: usize,
    mapping: Arc<GuestRegionMmap>,
}

impl Region {
    /// Maps `len` bytes of `file` from `offset`, at guest address `gpa`.
    pub fn map(
        file: File,
        offset: u64,
        gpa: u64,
        len: u64,
        user_addr: u64,
    ) -> Result<Region, String> {
        if len == 0 || gpa.checked_add(len).is_none() || user_addr.checked_add(len).is_none() {
            return Err(format!(
                "memory region {gpa:#x}+{len:#x}: empty or wraps around"
            ));
        }
        let size = usize::try_from(len).map_err(|_| "memory region too large".to_string())?;
        let m = MmapRegion::from_file(FileOffset::new(file, offset), size).map_err(|e| {
            format!("mapping memory region {gpa:#x}+{len:#x} at offset {offset:#x}: {e}")
        })?;
        let mapping = GuestRegionMmap::new(m, GuestAddress(gpa))
            .ok_or_else(|| format!("memory region {gpa:#x}+{len:#x} wraps around"))?;
        let host = mapping.as_ptr() as usize;
        Ok(Region {
            gpa,
            len,
            user_addr,
            host,
            mapping: Arc::new(mapping),
        })
    }

    fn host(&self) -> *mut u8 {
        self.host as *mut u8
    }

    /// Where it is mapped here, and its length.
    pub fn host_range(&self) -> (*mut u8, usize) {
        (self.host(), self.len as usize)
    }

    /// Whether `other` is this very mapping (a region kept from one
    /// memory table to the next), not just the same addresses.
    pub fn same_mapping(&self, other: &Region) -> bool {
        Arc::ptr_eq(&self.mapping, &other.mapping)
    }
}

/// The guest's memory: its regions, for the queues (shared, immutable; a
/// change makes a new one).
pub struct Memory {
    /// For virtio-queue's ring accesses.
    pub guest: GuestMemoryMmap,
    regions: Vec<Region>,
}

impl Memory {
    /// The memory of `regions`; refused if two overlap.
    pub fn new(regions: Vec<Region>) -> Result<Memory, String> {
        // `map`'s one test per region needs each to end by u64::MAX.
        if let Some(r) = regions.iter().find(|r| r.gpa.checked_add(r.len).is_none()) {
            return Err(format!(
                "memory region {:#x}+{:#x} wraps around",
                r.gpa, r.len
            ));
        }
        let guest =
            GuestMemoryMmap::from_arc_regions(regions.iter().map(|r| r.mapping.clone()).collect())
                .map_err(|e| format!("guest memory regions: {e}"))?;
        Ok(Memory { guest, regions })
    }

    /// The regions.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Where `len` bytes at guest address `gpa` are mapped here, if they
    /// lie whole inside one region.
    #[inline]
    pub fn map(&self, gpa: u64, len: u32) -> Option<*mut u8> {
        map_in(&self.regions, gpa, len)
    }

    /// The guest address of the frontend's address `va`.
    pub fn gpa_of(&self, va: u64) -> Option<u64> {
        self.regions.iter().find_map(|r| {
            let off = va.checked_sub(r.user_addr)?;
            (off < r.len).then_some(r.gpa + off)
        })
    }
}

/// [`Memory::map`] over `regions` (a memory's [`Memory::regions`], as
/// it made them), for a caller that maps range after range with the
/// slice at hand.
#[inline]
pub(super) fn map_in(regions: &[Region], gpa: u64, len: u32) -> Option<*mut u8> {
    for r in regions {
        // Below the region, `off` wraps past its length: a region ends by
        // u64::MAX (`Region::map`, `Memory::new`), so one test covers both.
        let off = gpa.wrapping_sub(r.gpa);
        if off < r.len && len as u64 <= r.len - off {
            // SAFETY: off < r.len, the mapping's length.
            return Some(unsafe { r.host().add(off as usize) });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(gpa: u64, len: u64) -> Region {
        let f = tempfile_of(len);
        Region::map(f, 0, gpa, len, 0x7000_0000 + gpa).unwrap()
    }

    fn tempfile_of(len: u64) -> File {
        // SAFETY: plain syscall with a NUL-terminated name; checked below.
        let fd = unsafe { libc::memfd_create(c"udm-memory-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor owned by nothing else.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }

    /// A lookup finds the one region that holds the range whole; a range
    /// across two regions, or outside all, is refused.
    #[test]
    fn a_range_maps_in_the_region_that_holds_it_whole() {
        let (a, b) = (region(0x1000, 0x2000), region(0x3000, 0x1000));
        let (ha, hb) = (a.host_range().0, b.host_range().0);
        let m = Memory::new(vec![a, b]).unwrap();
        assert_eq!(m.map(0x1010, 16), Some(ha.wrapping_add(0x10)));
        assert_eq!(m.map(0x3ff0, 16), Some(hb.wrapping_add(0xff0)));
        assert_eq!(m.map(0x2ff8, 16), None, "across the two");
        assert_eq!(m.map(0x3ff8, 16), None, "past the end");
        assert_eq!(m.map(0xff8, 16), None, "before the start");
        assert_eq!(m.map(u64::MAX - 4, 16), None, "wrapping");
        assert_eq!(m.map(0x2ff0, 16), Some(ha.wrapping_add(0x1ff0)));
    }
}
