//! Inflight I/O tracking (vhost-user INFLIGHT_SHMFD), the split-ring layout
//! of QEMU's `docs/interop/vhost-user.rst` and libvhost-user: a shared
//! memory file that outlives udm (the frontend keeps it and hands it to
//! the next udm after a crash), one region per queue:
//!
//! ```text
//!   header (16 bytes)  features u64 | version u16 | desc_num u16
//!                      | last_batch_head u16 | used_idx u16
//!   desc[desc_num]     inflight u8 | padding [u8; 5] | next u16 | counter u64
//!   (region padded to 64 bytes)
//! ```
//!
//! A head is marked inflight (with a counter: the order it was taken in)
//! when it is popped from the avail ring. Its completion is recorded in
//! the order that makes a crash between any two steps recoverable:
//! `last_batch_head = head`, the used element and the used ring's index
//! (virtio-queue's `add_used`), then `inflight = 0` and `used_idx =` the
//! new index. On the next start, a `used_idx` that differs from the used
//! ring's means the crash came after the used ring's index and before the
//! mark was cleared: `last_batch_head` is cleared then. What is still
//! marked was taken and not answered: it is resubmitted, in counter order,
//! before any new request, and the ring resumes at `used_idx + inflight`.
//!
//! Every value read back from the file is the frontend's to write: it is
//! bounded here before it is used (heads past the ring are ignored).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use vhost::vhost_user::message::VhostUserInflight;
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

/// The layout's version (libvhost-user's INFLIGHT_VERSION).
const VERSION: u16 = 1;
/// Each queue's region is padded to this.
const ALIGN: u64 = 64;
const HEADER_LEN: u64 = 16;
const DESC_LEN: u64 = 16;

const H_VERSION: usize = 8;
const H_DESC_NUM: usize = 10;
const H_LAST_BATCH_HEAD: usize = 12;
const H_USED_IDX: usize = 14;
const D_INFLIGHT: usize = 0;
const D_COUNTER: usize = 8;

/// Bytes of one queue's region for rings of `queue_size` entries.
pub fn queue_region_len(queue_size: u16) -> u64 {
    (HEADER_LEN + DESC_LEN * queue_size as u64).div_ceil(ALIGN) * ALIGN
}

/// Checks a frontend's `num_queues` and `queue_size` against the queues
/// offered and the largest ring; the region's total length.
pub fn check(info: &VhostUserInflight, queues: u16, max_size: u16) -> Result<u64, String> {
    let (n, qs) = (info.num_queues, info.queue_size);
    if n == 0 || n > queues {
        return Err(format!(
            "inflight area for {n} queues: between 1 and the {queues} offered"
        ));
    }
    if qs == 0 || qs > max_size {
        return Err(format!(
            "inflight area for rings of {qs} entries: between 1 and {max_size}"
        ));
    }
    Ok(queue_region_len(qs) * n as u64)
}

/// Makes the shared file for `len` bytes: a memfd, zeroed, sealed so that
/// no one can shrink it under a mapping (which would make its pages
/// fault) or grow it.
pub fn create(len: u64) -> Result<File, String> {
    let name = c"udm-vhost-inflight";
    // SAFETY: name is a NUL-terminated string that lives across the call.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(format!(
            "memfd_create for the inflight area: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nothing
    // else: the File takes it over and closes it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)
        .map_err(|e| format!("sizing the inflight area to {len} bytes: {e}"))?;
    let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor this function owns; no pointers.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(format!(
            "sealing the inflight area: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(file)
}

/// The mapped inflight file of one frontend.
pub struct InflightMap {
    region: MmapRegion,
    num_queues: u16,
    queue_size: u16,
}

impl InflightMap {
    /// Maps the file the frontend gave with SET_INFLIGHT_FD. Refused: sizes
    /// out of range, an area larger than the file, and a file that may be
    /// shrunk under the mapping (not sealed against it, as [`create`]
    /// makes it: a mapping past the end of a file faults).
    pub fn map(
        file: File,
        info: &VhostUserInflight,
        queues: u16,
        max_size: u16,
    ) -> Result<InflightMap, String> {
        let need = check(info, queues, max_size)?;
        if info.mmap_size < need {
            return Err(format!(
                "inflight area of {} bytes for {} queues of {}: {need} needed",
                info.mmap_size, info.num_queues, info.queue_size
            ));
        }
        // SAFETY: fcntl on a descriptor the caller handed over; no pointers.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("inflight area: its file is not sealed against shrinking".into());
        }
        let flen = file
            .metadata()
            .map_err(|e| format!("inflight area: {e}"))?
            .len();
        if info
            .mmap_offset
            .checked_add(need)
            .is_none_or(|end| end > flen)
        {
            return Err(format!(
                "inflight area at {}+{need} past its file's {flen} bytes",
                info.mmap_offset
            ));
        }
        let len = usize::try_from(need).map_err(|_| "inflight area too large".to_string())?;
        let region = MmapRegion::from_file(FileOffset::new(file, info.mmap_offset), len)
            .map_err(|e| format!("mapping the inflight area: {e}"))?;
        let m = InflightMap {
            region,
            num_queues: info.num_queues,
            queue_size: info.queue_size,
        };
        // As libvhost-user: each queue's desc_num is the size given.
        for q in 0..m.num_queues {
            m.store(m.base(q) + H_DESC_NUM, m.queue_size, Ordering::Relaxed);
        }
        Ok(m)
    }

    fn base(&self, q: u16) -> usize {
        (queue_region_len(self.queue_size) * q as u64) as usize
    }

    // Offsets are in bounds (the region is as long as `check` says) and
    // aligned (regions are 64-byte aligned, fields naturally): the
    // accesses cannot fail; a failure would only skip the store.
    fn store<T: vm_memory::AtomicAccess>(&self, off: usize, v: T, o: Ordering) {
        let _ = self.region.as_volatile_slice().store(v, off, o);
    }

    fn load<T: vm_memory::AtomicAccess + Default>(&self, off: usize, o: Ordering) -> T {
        self.region
            .as_volatile_slice()
            .load(off, o)
            .unwrap_or_default()
    }

    /// Queue `index`'s tracking, for a ring of `ring_size` entries; an error
    /// when the area has no room for it.
    pub fn queue(self: &Arc<Self>, index: u16, ring_size: u16) -> Result<QueueInflight, String> {
        if index >= self.num_queues {
            return Err(format!(
                "queue {index}: the inflight area has {} queues",
                self.num_queues
            ));
        }
        if ring_size > self.queue_size {
            return Err(format!(
                "queue {index}: ring of {ring_size} entries, the inflight area's of {}",
                self.queue_size
            ));
        }
        Ok(QueueInflight {
            map: self.clone(),
            base: self.base(index),
            size: ring_size,
            counter: 0,
        })
    }
}

/// One queue's inflight tracking, owned by the queue on its reactor.
pub struct QueueInflight {
    map: Arc<InflightMap>,
    base: usize,
    /// The ring's size: heads at or past it are not tracked.
    size: u16,
    /// The next head's counter.
    counter: u64,
}

impl QueueInflight {
    fn desc(&self, head: u16) -> usize {
        self.base + (HEADER_LEN + DESC_LEN * head as u64) as usize
    }

    /// Reads the area as the queue starts, with the used ring's index
    /// `used_idx`. A new area (version 0) is stamped and nothing is to be
    /// done: None. Otherwise (a udm before this one used it), the heads
    /// taken and not answered, oldest first, to resubmit before anything
    /// else; the ring resumes at `used_idx` plus their count.
    pub fn recover(&mut self, used_idx: u16) -> Option<Vec<u16>> {
        let m = &*self.map;
        if m.load::<u16>(self.base + H_VERSION, Ordering::Acquire) == 0 {
            m.store(self.base + H_USED_IDX, used_idx, Ordering::Relaxed);
            m.store(self.base + H_VERSION, VERSION, Ordering::Release);
            return None;
        }
        if m.load::<u16>(self.base + H_USED_IDX, Ordering::Acquire) != used_idx {
            // Put on the used ring, mark not cleared yet.
            let head: u16 = m.load(self.base + H_LAST_BATCH_HEAD, Ordering::Relaxed);
            if head < self.size {
                m.store(self.desc(head) + D_INFLIGHT, 0u8, Ordering::Release);
            }
            fence(Ordering::SeqCst);
            m.store(self.base + H_USED_IDX, used_idx, Ordering::Release);
        }
        let mut heads: Vec<(u64, u16)> = (0..self.size)
            .filter(|&h| m.load::<u8>(self.desc(h) + D_INFLIGHT, Ordering::Acquire) == 1)
            .map(|h| {
                (
                    m.load::<u64>(self.desc(h) + D_COUNTER, Ordering::Relaxed),
                    h,
                )
            })
            .collect();
        heads.sort_unstable();
        self.counter = heads.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        Some(heads.into_iter().map(|(_, h)| h).collect())
    }

    /// Head `head` was taken from the avail ring.
    #[inline]
    pub fn taken(&mut self, head: u16) {
        if head >= self.size {
            return;
        }
        let d = self.desc(head);
        self.map
            .store(d + D_COUNTER, self.counter, Ordering::Relaxed);
        self.map.store(d + D_INFLIGHT, 1u8, Ordering::Release);
        self.counter = self.counter.wrapping_add(1);
    }

    /// Head `head` is about to be put on the used ring.
    #[inline]
    pub fn putting(&self, head: u16) {
        self.map
            .store(self.base + H_LAST_BATCH_HEAD, head, Ordering::Release);
    }

    /// Head `head` is on the used ring, whose index is now `used_idx`.
    #[inline]
    pub fn put(&self, head: u16, used_idx: u16) {
        if head < self.size {
            self.map
                .store(self.desc(head) + D_INFLIGHT, 0u8, Ordering::Release);
        }
        fence(Ordering::SeqCst);
        self.map
            .store(self.base + H_USED_IDX, used_idx, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn area(queues: u16, size: u16) -> Arc<InflightMap> {
        let len = check(&VhostUserInflight::new(0, 0, queues, size), 4, 1024).unwrap();
        let f = create(len).unwrap();
        let info = VhostUserInflight::new(len, 0, queues, size);
        Arc::new(InflightMap::map(f, &info, 4, 1024).unwrap())
    }

    #[test]
    fn each_queue_region_is_a_header_and_a_slot_per_descriptor_padded_to_64_bytes() {
        assert_eq!(queue_region_len(128), 16 + 16 * 128 + 48);
        assert_eq!(queue_region_len(256), 4160);
        assert_eq!(queue_region_len(1), 64);
    }

    #[test]
    fn a_new_area_has_nothing_to_resubmit_and_a_used_one_gives_heads_oldest_first() {
        let m = area(2, 8);
        let mut q = m.queue(1, 8).unwrap();
        assert_eq!(q.recover(0), None);
        for h in [5, 2, 7, 0] {
            q.taken(h);
        }
        // 2 answered; 7 put on the used ring (index 2) but the crash came
        // before its mark was cleared.
        q.putting(2);
        q.put(2, 1);
        q.putting(7);
        // The other queue's area is apart.
        let mut other = m.queue(0, 8).unwrap();
        assert_eq!(other.recover(0), None);
        other.taken(3);
        let mut again = m.queue(1, 8).unwrap();
        assert_eq!(again.recover(2), Some(vec![5, 0]));
        // New heads count on from the newest resubmitted.
        again.taken(4);
        let mut third = m.queue(1, 8).unwrap();
        assert_eq!(third.recover(2), Some(vec![5, 0, 4]));
    }

    #[test]
    fn a_frontend_gets_a_clear_error_for_sizes_out_of_range_or_an_unsealed_file() {
        let e = check(&VhostUserInflight::new(0, 0, 5, 128), 4, 1024).unwrap_err();
        assert!(e.contains("5 queues"), "{e}");
        let e = check(&VhostUserInflight::new(0, 0, 1, 2048), 4, 1024).unwrap_err();
        assert!(e.contains("2048 entries"), "{e}");
        let f = create(4096).unwrap();
        let e = InflightMap::map(f, &VhostUserInflight::new(64, 0, 1, 128), 4, 1024)
            .err()
            .unwrap();
        assert!(e.contains("2112 needed"), "{e}");
        let f = create(4096).unwrap();
        let e = InflightMap::map(f, &VhostUserInflight::new(4096, 4096, 1, 128), 4, 1024)
            .err()
            .unwrap();
        assert!(e.contains("past its file"), "{e}");
        let dir = std::env::temp_dir().join(format!("udm-inflight-{}", std::process::id()));
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&dir)
            .unwrap();
        let _ = std::fs::remove_file(&dir);
        f.set_len(4096).unwrap();
        let e = InflightMap::map(f, &VhostUserInflight::new(4096, 0, 1, 128), 4, 1024)
            .err()
            .unwrap();
        assert!(e.contains("not sealed"), "{e}");
        let m = area(1, 8);
        assert!(m.queue(1, 8).is_err());
        assert!(m.queue(0, 16).is_err());
    }
}
