//! `ram`: a memory-backed device, like brd.
//!
//! Spec: `ram:<size>[,prealloc]`. The device is one anonymous, lazily backed mapping
//! of its size (`MAP_NORESERVE`): the kernel gives a 4 KiB page, zeroed, on
//! its first write, as brd allocates its pages; a bitmap records which pages
//! were written, so reads of never-written space return zeroes without
//! touching (and so without backing) the mapping. A read that lets the
//! device lend ([`udm_core::BioFlags::MAY_LEND`]) gets a pointer into the
//! mapping instead, written or not: a never-written page reads as the
//! kernel's shared zero page there, which costs page tables but no memory.
//! The channel also gives direct access to the mapping
//! ([`udm_core::Channel::direct_access`]): a target that transforms the
//! data (crypt) reads or stores it there in one pass, with no bio.
//! Discard gives the pages it covers whole back to the kernel
//! (`MADV_DONTNEED`, as brd frees its pages): they read as zeroes, are
//! marked never written and count no more in [`RamDevice::allocated_bytes`].
//! The mapping stays, so a reader on another reactor that overlaps the
//! discard reads zeroes or the old bytes, as with any overlapping I/O,
//! never freed memory. The partial pages at a discard's ends, and
//! write-zeroes, are zeroed in place (pages stay allocated).
//!
//! Why a mapping rather than a heap page per 4 KiB: a first write then costs
//! one page fault, where `alloc_zeroed` of an aligned page cost glibc's
//! `memalign` (which takes twice the page from the heap: 256 MiB written
//! took 528 MB resident, now 266 MB), faults on both pages and a `memset`:
//! measured 2.2-2.5 µs against 6-12 µs per first write, which was most of
//! udm's cost in a 4 KiB random-write NBD run on a fresh RAM disk.
//! Transparent huge pages are turned off for a lazily backed mapping:
//! random first writes would each zero 2 MiB (6-10 µs per write measured).
//!
//! [`BlockDevice::block_status`] answers from the same bitmap: a page never
//! written (or discarded whole since) is a hole, a written one data
//! (zeroed pages stay data). It reads the bitmap only, so the write path
//! pays nothing for it.
//!
//! On a disk larger than the CPU's last-level cache, a read submitted
//! while other completions wait on the reactor (a turn's end_ios issuing
//! the next I/Os) is staged ([`udm_core::BioPtr::stage`]): the reads
//! staged in a turn are copied one after another at the start of the next
//! pass over completions, before its end_ios, as a queued batch's would
//! be, which is faster out of the caches (`copy_read`). A lone read
//! finds nothing waiting and is copied at once, and so is every read of a
//! disk that fits the cache, where staging only cost.
//!
//! On a disk larger than the last-level cache, a write flagged
//! [`udm_core::BioFlags::DONTCACHE`] (its data will not be read soon:
//! raid1's copy to the leg its region does not read from) is stored past
//! the caches where the CPU has AVX (`vmovntdq`): each whole, aligned page
//! of it, then an `sfence` before it completes. Such a store does not
//! first read the destination's lines in, nor evict what will be read;
//! what is not a whole page, every write without the flag, and every
//! write to a disk the cache holds (whose lines stay cached anyway) is
//! copied as usual.
//!
//! `prealloc` backs every page at creation, as a brd disk that has been
//! written over once: benchmarks then measure the data path, not
//! first-touch page faults. A preallocated disk asks for transparent huge
//! pages (`MADV_HUGEPAGE`, where the kernel's THP mode is `madvise` or
//! `always`): no write pays for zeroing them, and a 2 MiB page takes one
//! TLB entry where 512 pages of 4 KiB each take their own, which random
//! I/O over a disk larger than the TLB's reach missed on every copy
//! (docs/benchmarks.md, "The RAM disk on huge pages"). Without free huge
//! pages the kernel backs it with small ones, as before.

use std::any::Any;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_core::{
    check_bio, push_extent, Alloc, BioFlags, BioPtr, BlockDevice, Caps, Channel, Error, Extent,
    Limits, Mmap, Op, Reactor, Status, BLOCK_STATUS_MAX_EXTENTS, SECTOR_SHIFT,
};

const PAGE: usize = 4096;
const PAGE_SHIFT: u32 = 12;
/// What a never-written page reads as.
static ZEROES: [u8; PAGE] = [0; PAGE];

/// A RAM disk.
pub struct RamDevice {
    name: String,
    limits: Limits,
    mem: Mmap,
    /// One bit per page: written at least once.
    written: Box<[AtomicU64]>,
    allocated: AtomicU64,
    /// Larger than the last-level cache: reads are staged ([`copy_read`]).
    stage_reads: bool,
    /// Larger than the last-level cache, and the CPU streams stores
    /// ([`copy_page_nt`]): writes flagged `DONTCACHE` bypass the caches.
    /// A disk the cache holds keeps them there: its lines would stay
    /// cached anyway, and streaming them out cost in-cache random writes
    /// 12% and read-after-write 17% per CPU-second.
    nt_stores: bool,
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
        let len = usize::try_from(npages * PAGE as u64)
            .map_err(|_| Error::invalid(format!("ram: size {bytes} does not fit in memory")))?;
        let mem = Mmap::anon(len).map_err(|e| e.context("ram"))?;
        // Failure is harmless: the disk works, only first writes cost more.
        let _ = mem.advise(libc::MADV_NOHUGEPAGE);
        let big = len as u64 > last_level_cache();
        let written = (0..npages.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Ok(RamDevice {
            name: name.into(),
            limits: Limits::new(sectors),
            mem,
            written,
            allocated: AtomicU64::new(0),
            stage_reads: big,
            nt_stores: big && nt_stores(),
        })
    }

    /// Backs every page now (`ram:<size>,prealloc`), as a brd disk that has
    /// been written over once: benchmarks then measure the data path, not
    /// first-touch page faults, whose share depends on how much fresh space
    /// an access pattern reaches (a log-structured cache reaches all of it,
    /// random overwrites of a region only part).
    pub fn prealloc(&self) -> Result<(), Error> {
        // Before the pages are backed, so that they are backed huge.
        // Failure (a kernel without THP) is harmless: small pages.
        let _ = self.mem.advise(libc::MADV_HUGEPAGE);
        if let Err(e) = self.mem.advise(libc::MADV_POPULATE_WRITE) {
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e.context(format_args!("ram: preallocating '{}'", self.name)));
            }
            // Kernels before 5.14: touch each page (the store keeps it zero).
            for off in (0..self.mem.len()).step_by(PAGE) {
                // SAFETY: `off` lies inside the mapping; no I/O runs yet.
                unsafe { std::ptr::write_volatile(self.mem.as_ptr().add(off), 0) };
            }
        }
        for w in self.written.iter() {
            w.store(u64::MAX, Ordering::Release);
        }
        self.allocated
            .store((self.mem.len() / PAGE) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Bytes of memory allocated so far (pages written at least once).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed) * PAGE as u64
    }

    /// The page at `idx` if it was written (or, with `create`, marking it
    /// written: the kernel backs it at the first store).
    #[inline]
    fn page(&self, idx: usize, create: bool) -> Option<*mut u8> {
        let (word, bit) = (&self.written[idx / 64], 1u64 << (idx % 64));
        if word.load(Ordering::Acquire) & bit == 0 {
            if !create {
                return None;
            }
            if word.fetch_or(bit, Ordering::AcqRel) & bit == 0 {
                self.allocated.fetch_add(1, Ordering::Relaxed);
            }
        }
        // SAFETY: idx < npages (bios are checked against the device's size),
        // so the page lies inside the mapping.
        Some(unsafe { self.mem.as_ptr().add(idx << PAGE_SHIFT) })
    }

    /// Whether page `idx` was written.
    fn written(&self, idx: usize) -> bool {
        self.written[idx / 64].load(Ordering::Acquire) & (1 << (idx % 64)) != 0
    }

    /// The first page from `from` (below `limit`) whose written bit is not
    /// `written`, or `limit`: a word at a time.
    fn next_change(&self, from: usize, written: bool, limit: usize) -> usize {
        let mut i = from;
        while i < limit {
            let w = self.written[i / 64].load(Ordering::Acquire);
            let differ = if written { !w } else { w } >> (i % 64);
            if differ != 0 {
                return (i + differ.trailing_zeros() as usize).min(limit);
            }
            i = (i / 64 + 1) * 64;
        }
        limit
    }

    /// Serves `bio` synchronously; returns its status.
    fn rw(&self, bio: &mut BioPtr) -> Status {
        let mut pos = (bio.sector << SECTOR_SHIFT) as usize;
        let end = pos + bio.len() as usize;
        // A read that allows it is lent (`lend` does nothing otherwise).
        // SAFETY: [pos, end) lies inside the mapping (bios are checked
        // against the device's size), which lives as long as the device;
        // the bio completes by `complete` (submit_nocheck), and the device
        // outlives the pass that runs its end_io: what holds it (a table,
        // an export) lets go only outside a pass (a mapped device frees a
        // retired table in its poller). Never-written
        // pages read as zeroes there too (the kernel maps its zero page), and
        // only writes, discards and write-zeroes, which overlap the read if
        // they change its bytes, store into it.
        if unsafe { bio.lend(self.mem.as_ptr().add(pos)) } {
            return Status::Ok;
        }
        let op = bio.op;
        if matches!(op, Op::Read | Op::Write) {
            // Segment by segment, page by page: a merged bio (a segment per
            // request) is walked once, where copying at a byte offset of the
            // bio rescans its segments for every page (a 32-segment bio of
            // 4 KiB reads cost 75 instructions per segment more than 32 bios).
            debug_assert!(!bio.flags.contains(BioFlags::LENT));
            let nt = op == Op::Write && bio.flags.contains(BioFlags::DONTCACHE) && self.nt_stores;
            let mut streamed = false;
            for s in bio.segs() {
                let mut done = 0;
                while done < s.len {
                    let idx = pos >> PAGE_SHIFT;
                    let in_page = pos & (PAGE - 1);
                    let n = (PAGE - in_page).min(s.len - done);
                    // SAFETY: `done + n <= s.len`: inside the segment, which
                    // add_seg's contract keeps valid (writable for a read,
                    // readable for a write) and unaliased until completion.
                    let buf = unsafe { s.base.add(done) };
                    let Some(p) = self.page(idx, op == Op::Write) else {
                        if op == Op::Write {
                            return Status::NoMem;
                        }
                        // A page never written reads as zeroes, copied as
                        // before this walk. black_box keeps LLVM from
                        // turning the copy into a memset, whose `rep stosb`
                        // callgrind counts per byte (4 KiB: 3,700 more
                        // instructions, hiding every other cost of such
                        // reads).
                        let zeroes = std::hint::black_box(ZEROES.as_ptr());
                        // SAFETY: as above; ZEROES holds PAGE >= n bytes.
                        unsafe { std::ptr::copy_nonoverlapping(zeroes, buf, n) };
                        pos += n;
                        done += n;
                        continue;
                    };
                    // SAFETY: pages are PAGE bytes inside the mapping, which
                    // lives as long as the device; `in_page + n <= PAGE`; the
                    // segment and the mapping are distinct memory. Bytes have
                    // no invalid values; a concurrent write to the same
                    // sectors from another reactor may tear the data, as
                    // overlapping I/O does on any block device.
                    unsafe {
                        if op == Op::Read {
                            std::ptr::copy_nonoverlapping(p.add(in_page), buf, n);
                        } else if nt && n == PAGE {
                            // A whole page: `in_page` is 0, so `p` is
                            // page-aligned; `nt` says the CPU has AVX.
                            copy_page_nt(buf, p);
                            streamed = true;
                        } else {
                            std::ptr::copy_nonoverlapping(buf, p.add(in_page), n);
                        }
                    }
                    pos += n;
                    done += n;
                }
            }
            if streamed {
                // Streamed stores are weakly ordered: make them visible
                // before the completion, as any other store.
                sfence();
            }
            return Status::Ok;
        }
        match op {
            // Kept out of the read and write walk above, which must not
            // pay for it.
            Op::Discard => self.discard(pos, end),
            Op::WriteZeroes => {
                self.zero(pos, end);
                Status::Ok
            }
            _ => Status::Ok,
        }
    }
}

impl RamDevice {
    /// Discards bytes `pos..end`: the pages inside it whole go back to the
    /// kernel and are marked never written; the partial pages at its ends
    /// are zeroed (so are the whole ones, should the kernel refuse). Kept
    /// out of `rw`, whose reads and writes must not pay for it.
    #[cold]
    #[inline(never)]
    fn discard(&self, pos: usize, end: usize) -> Status {
        let (first, last) = (pos.div_ceil(PAGE), end / PAGE);
        if first < last {
            // SAFETY: whole pages inside the mapping (the bio was checked
            // against the device's size), whose bytes this discard may zero;
            // a read or write overlapping it is overlapping I/O, which gets
            // either bytes, as on any device; nothing holds a reference into
            // the mapping (only raw pointers, used within one I/O).
            if unsafe { self.mem.discard(first * PAGE, (last - first) * PAGE) }.is_ok() {
                let freed = self.clear_written(first, last);
                self.allocated.fetch_sub(freed, Ordering::Relaxed);
                self.zero(pos, first * PAGE);
                self.zero(last * PAGE, end);
                return Status::Ok;
            }
        }
        self.zero(pos, end);
        Status::Ok
    }

    /// Zeroes bytes `pos..end` in the pages that were written.
    fn zero(&self, mut pos: usize, end: usize) {
        while pos < end {
            let in_page = pos & (PAGE - 1);
            let n = (PAGE - in_page).min(end - pos);
            if let Some(p) = self.page(pos >> PAGE_SHIFT, false) {
                // SAFETY: inside the page, which lies inside the mapping;
                // `in_page + n <= PAGE`.
                unsafe { std::ptr::write_bytes(p.add(in_page), 0, n) };
            }
            pos += n;
        }
    }

    /// Marks pages `first..last` never written; returns how many were.
    fn clear_written(&self, first: usize, last: usize) -> u64 {
        let mut cleared = 0;
        let mut i = first;
        while i < last {
            let (word, bit) = (i / 64, i % 64);
            let n = (64 - bit).min(last - i);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            let old = self.written[word].fetch_and(!mask, Ordering::AcqRel);
            cleared += (old & mask).count_ones() as u64;
            i += n;
        }
        cleared
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
    fn merge_reason(&self) -> String {
        "RAM: a request costs only its copy".into()
    }
    /// Pages never written are holes, written ones data, from the bitmap
    /// (a page is 8 sectors: a range's first and last extents are cut to
    /// it). At most [`BLOCK_STATUS_MAX_EXTENTS`] extents per call.
    fn block_status(&self, sector: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        const PAGE_SECTORS: u64 = (PAGE >> SECTOR_SHIFT) as u64;
        let end = sector
            .checked_add(sectors)
            .filter(|&e| e <= self.limits.sectors)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "ram: block status of {sectors} sectors at {sector} is beyond the device"
                ))
            })?;
        let limit = end.div_ceil(PAGE_SECTORS) as usize;
        let mut pos = sector;
        for _ in 0..BLOCK_STATUS_MAX_EXTENTS {
            if pos >= end {
                break;
            }
            let idx = (pos / PAGE_SECTORS) as usize;
            let written = self.written(idx);
            let next = self.next_change(idx + 1, written, limit) as u64 * PAGE_SECTORS;
            let run_end = next.min(end);
            push_extent(
                out,
                Extent {
                    sectors: run_end - pos,
                    alloc: if written { Alloc::Data } else { Alloc::Hole },
                },
            );
            pos = run_end;
        }
        Ok(())
    }
    fn open(self: Arc<Self>, _reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        Ok(Rc::new(RamChannel { dev: self }))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Whether this CPU has the streaming stores [`copy_page_nt`] uses.
fn nt_stores() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Copies a page from `src` to `dst` with non-temporal stores, which go
/// to memory past the caches (weakly ordered: [`sfence`] before the data
/// is published).
///
/// # Safety
/// `src` is readable and `dst` writable for [`PAGE`] bytes, the two do not
/// overlap, `dst` is 32-byte aligned, and the CPU has AVX ([`nt_stores`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn copy_page_nt(src: *const u8, dst: *mut u8) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    const STEP: usize = 8;
    let (s, d) = (src.cast::<__m256i>(), dst.cast::<__m256i>());
    // Eight 32-byte vectors (four cache lines) per step, all loaded before
    // they are stored, so that the loads of a step overlap and the loop's
    // own instructions are few (LLVM gives each streamed store an address
    // of its own).
    for i in (0..PAGE / 32).step_by(STEP) {
        // SAFETY: per the contract, vectors i..i + STEP <= PAGE / 32 lie
        // inside both; loads are unaligned, stores to the aligned `dst`.
        unsafe {
            let v: [__m256i; STEP] = std::array::from_fn(|k| _mm256_loadu_si256(s.add(i + k)));
            for (k, x) in v.into_iter().enumerate() {
                _mm256_stream_si256(d.add(i + k), x);
            }
        }
    }
}

/// The plain copy where the CPU has no streaming stores (never called:
/// [`nt_stores`] is false there).
///
/// # Safety
/// As the x86_64 version's.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_page_nt(src: *const u8, dst: *mut u8) {
    // SAFETY: per the contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, PAGE) }
}

/// Orders streamed stores before the stores that follow (the completion).
#[inline]
fn sfence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64's baseline; sfence has no operands.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// The size of the CPU's last-level cache in bytes; 0, so that a disk's
/// reads are staged, where unknown.
fn last_level_cache() -> u64 {
    udm_core::affinity::last_level_cache().unwrap_or(0)
}

/// The end_io of a read [`RamChannel::submit_nocheck`] staged: copies it
/// and completes it to its submitter, whose end_io runs later in the same
/// pass. The reads staged in one turn are so copied one after another,
/// with no end_io between them: out of the caches (a disk larger than
/// them, read at random), a copy's misses overlap the next copy's in the
/// CPU's out-of-order window, where the end_io's work between two copies
/// keeps them apart (docs/benchmarks.md, "The RAM disk's reads, copied
/// back to back"). Writes are not staged: copies into the disk gained
/// nothing from it.
fn copy_read(mut bio: BioPtr) {
    // SAFETY: private is the device the channel submitted through
    // (Arc::as_ptr); the channel, which holds an Arc to it, outlives its
    // bios, as every channel does.
    let dev = unsafe { &*(bio.private() as *const RamDevice) };
    bio.pop_end_io();
    let s = dev.rw(&mut bio);
    // Not endio(): the submitter's end_io would run between this copy and
    // the next staged one.
    bio.complete(s);
}

impl Channel for RamChannel {
    #[inline]
    fn submit(&self, bio: BioPtr) {
        let dev = &*self.dev;
        if let Some(bio) = check_bio(bio, &dev.limits, dev.caps()) {
            // SAFETY: just checked.
            unsafe { self.submit_nocheck(bio) }
        }
    }

    /// A read submitted while other completions wait on the reactor is
    /// staged, on a disk larger than the last-level cache, to be copied
    /// with the others staged: see [`copy_read`]. Anything else is served
    /// now.
    #[inline]
    unsafe fn submit_nocheck(&self, mut bio: BioPtr) {
        // Per the caller, the bio lies inside the device, which is what
        // `rw` needs of it (now or in copy_read: it does not change).
        // A lone read finds nothing waiting and pays only these tests.
        let dev = &*self.dev;
        if bio.op == Op::Read && dev.stage_reads && bio.completions_waiting() && !bio.may_lend() {
            let me = Arc::as_ptr(&self.dev).cast_mut().cast();
            if bio.push_end_io(copy_read, me) {
                return bio.stage();
            }
        }
        let s = dev.rw(&mut bio);
        bio.complete(s);
    }

    /// The mapping itself: a range inside the device is contiguous there.
    /// A store marks its pages written (the kernel backs each at its first
    /// store, as for a write); a read of never-written pages finds the
    /// kernel's zero page, as a lent read does.
    #[inline]
    fn direct_access(&self, sector: u64, len: usize, write: bool) -> Option<NonNull<u8>> {
        let dev = &*self.dev;
        let end = sector.checked_add((len as u64).div_ceil(1 << SECTOR_SHIFT))?;
        if len == 0 || end > dev.limits.sectors {
            return None;
        }
        let pos = (sector << SECTOR_SHIFT) as usize;
        if write {
            for idx in pos >> PAGE_SHIFT..=(pos + len - 1) >> PAGE_SHIFT {
                dev.page(idx, true);
            }
        }
        // SAFETY: `pos + len` lies inside the device, so inside the mapping.
        NonNull::new(unsafe { dev.mem.as_ptr().add(pos) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use udm_core::{CompletionMode, ReactorConfig};

    /// Whether the kernel may back the mapping holding `addr` with huge
    /// pages (`THPeligible` in /proc/self/smaps), None if no mapping does.
    fn thp_eligible(addr: *const u8) -> Option<bool> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let addr = addr as usize;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(v) = line.strip_prefix("THPeligible:") {
                    return Some(v.trim() == "1");
                }
            }
        }
        None
    }

    #[test]
    fn a_preallocated_disk_asks_for_huge_pages_and_a_lazy_one_does_not() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !mode.contains("[always]") && !mode.contains("[madvise]") {
            eprintln!("skipped: transparent huge pages are off here ({mode:?})");
            return;
        }
        let lazy = RamDevice::new("lazy", 8 << 20).unwrap();
        let pre = RamDevice::new("pre", 8 << 20).unwrap();
        pre.prealloc().unwrap();
        // Lazy first writes would each zero 2 MiB: small pages only.
        assert_eq!(thp_eligible(lazy.mem.as_ptr()), Some(false));
        assert_eq!(thp_eligible(pre.mem.as_ptr()), Some(true));
        assert_eq!(pre.allocated_bytes(), 8 << 20);
    }

    /// The reads' end_ios: which ran, and whether every read left to the
    /// next turn had been copied when each did.
    struct Seen {
        bufs: Vec<Vec<u8>>,
        ended: RefCell<Vec<(u64, bool)>>,
    }

    impl Seen {
        fn copied(&self, i: usize) -> bool {
            self.bufs[i].iter().all(|&b| b == i as u8 + 1)
        }
    }

    fn ended(bio: BioPtr) {
        // SAFETY: private is the test's `Seen`, alive until every read ended.
        let seen = unsafe { &*(bio.private() as *const Seen) };
        assert_eq!(bio.status(), Status::Ok);
        let all = (1..seen.bufs.len()).all(|i| seen.copied(i));
        seen.ended.borrow_mut().push((bio.ctx(), all));
    }

    /// Four reads of four pages of `dev`, submitted one after another,
    /// then a reactor turn: whether each was copied at submission, and what
    /// the end_ios saw (in the order they ran).
    fn four_reads(dev: Arc<RamDevice>) -> (Vec<bool>, Vec<(u64, bool)>) {
        for i in 0..4u8 {
            let p = RamChannel { dev: dev.clone() }
                .direct_access(u64::from(i) * 8, PAGE, true)
                .unwrap();
            // SAFETY: a page of the disk, stored to by nothing else.
            unsafe { std::ptr::write_bytes(p.as_ptr(), i + 1, PAGE) };
        }
        let reactor = Reactor::new(ReactorConfig {
            mode: CompletionMode::Poll,
            ..ReactorConfig::default()
        })
        .unwrap();
        let chan = dev.open(&reactor).unwrap();
        let mut seen = Box::new(Seen {
            bufs: vec![vec![0u8; PAGE]; 4],
            ended: RefCell::new(Vec::new()),
        });
        let bases: Vec<*mut u8> = seen.bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let private = (&*seen as *const Seen).cast_mut().cast();
        let mut at_once = vec![];
        for (i, &base) in bases.iter().enumerate() {
            let mut bio = reactor.alloc_bio();
            bio.op = Op::Read;
            bio.sector = i as u64 * 8;
            // SAFETY: the buffer is PAGE bytes, kept (and not touched but by
            // reads) until every read ended.
            unsafe { bio.add_seg(base, PAGE) };
            bio.set_ctx(i as u64);
            bio.set_end_io(ended, private);
            chan.submit(bio);
            at_once.push(seen.copied(i));
        }
        reactor.poll_once();
        let ended = std::mem::take(&mut *seen.ended.borrow_mut());
        drop(chan);
        (at_once, ended)
    }

    fn write_done(bio: BioPtr) {
        // SAFETY: private is the test's status cell, alive until the
        // reactor turn that runs this end_io returns.
        let st = unsafe { &*(bio.private() as *const Cell<Option<Status>>) };
        st.set(Some(bio.status()));
    }

    /// Writes `src` at `sector` of `chan` in one bio of `segs` equal
    /// segments, with `flags`, and waits for it.
    fn write(
        reactor: &Reactor,
        chan: &dyn Channel,
        sector: u64,
        src: &[u8],
        segs: usize,
        flags: BioFlags,
    ) {
        let st = Cell::new(None);
        let mut bio = reactor.alloc_bio();
        bio.op = Op::Write;
        bio.sector = sector;
        bio.flags = flags;
        for part in src.chunks(src.len() / segs) {
            // SAFETY: `src` outlives the bio, which completes below; a
            // write only reads its segments.
            unsafe { bio.add_seg(part.as_ptr().cast_mut(), part.len()) };
        }
        bio.set_end_io(
            write_done,
            (&st as *const Cell<Option<Status>>).cast_mut().cast(),
        );
        chan.submit(bio);
        while st.get().is_none() {
            reactor.poll_once();
        }
        assert_eq!(st.get(), Some(Status::Ok));
    }

    /// A write flagged `DONTCACHE` (streamed past the caches where the CPU
    /// can, for its whole aligned pages) stores the same bytes as a plain
    /// one: whole pages, a write that starts and ends inside pages, a
    /// sector, several segments, and a source that is not aligned.
    #[test]
    fn dontcache_writes_store_the_same_bytes_as_plain_writes() {
        let reactor = Reactor::new(ReactorConfig {
            mode: CompletionMode::Poll,
            ..ReactorConfig::default()
        })
        .unwrap();
        let size = 64 << 10;
        let plain = Arc::new(RamDevice::new("plain", size).unwrap());
        // A disk this small stays in the cache: streamed as a large one.
        let mut nt = RamDevice::new("nt", size).unwrap();
        nt.nt_stores = nt_stores();
        if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("avx") {
            assert!(nt.nt_stores, "an AVX CPU streams DONTCACHE writes");
        }
        let nt = Arc::new(nt);
        let (cp, cn) = (
            plain.clone().open(&reactor).unwrap(),
            nt.clone().open(&reactor).unwrap(),
        );
        // (sector, bytes, segments, offset of the source in its buffer)
        let writes = [
            (0, 4096, 1, 0),
            (9, 8192, 1, 0),
            (24, 512, 1, 0),
            (32, 12288, 3, 1),
            (57, 16384, 2, 7),
            (120, 4096, 1, 0),
        ];
        let mut buf = vec![0u8; 16384 + 8];
        for (k, &(sector, len, segs, off)) in writes.iter().enumerate() {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (i * 7 + k * 31 + 1) as u8;
            }
            let src = &buf[off..off + len];
            write(&reactor, &*cp, sector, src, segs, BioFlags::NONE);
            write(&reactor, &*cn, sector, src, segs, BioFlags::DONTCACHE);
        }
        // SAFETY: both mappings are `size` bytes; no I/O is in flight.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(plain.mem.as_ptr(), size as usize),
                std::slice::from_raw_parts(nt.mem.as_ptr(), size as usize),
            )
        };
        assert!(a.iter().any(|&x| x != 0), "the writes landed");
        let first = a.iter().zip(b).position(|(x, y)| x != y);
        assert_eq!(first, None, "first byte that differs");
    }

    /// On a disk larger than the last-level cache, a read with nothing else
    /// waiting on the reactor is copied at once; reads submitted while
    /// completions wait are staged, and copied in the next turn, all of
    /// them before any end_io of that turn runs. A disk that fits the
    /// cache copies every read at once.
    #[test]
    fn reads_submitted_while_completions_wait_are_copied_together_before_any_end_io() {
        let llc = last_level_cache();
        let big = Arc::new(RamDevice::new("big", (llc.max(1 << 20)) * 2).unwrap());
        let (at_once, ended) = four_reads(big);
        assert_eq!(
            at_once,
            [true, false, false, false],
            "only the first copied"
        );
        assert_eq!(
            ended,
            [(0, true), (1, true), (2, true), (3, true)],
            "every end_io in one turn, after every copy"
        );
        if llc > 1 << 20 {
            let small = Arc::new(RamDevice::new("small", 1 << 20).unwrap());
            let (at_once, ended) = four_reads(small);
            assert_eq!(at_once, [true; 4], "a disk in the cache: no staging");
            assert_eq!(ended.len(), 4);
        }
    }
}
