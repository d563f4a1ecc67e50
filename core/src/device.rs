//! The block-device contract every backend and mapped device implements.
//!
//! A [`BlockDevice`] is shared by all threads and describes itself as data:
//! [`Limits`] and [`Caps`]. I/O never goes through it directly: each reactor
//! opens its own [`Channel`] (SPDK's io_channel), so the hot path is a call on a
//! thread-local object and takes no lock.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;

use crate::bio::{Bio, BioPtr, Op, Status, SECTOR_SHIFT};
use crate::error::Error;
use crate::reactor::Reactor;

/// A device's limits, as the kernel's `queue_limits`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Size in 512-byte sectors.
    pub sectors: u64,
    /// Smallest addressable unit, in bytes: I/O offsets and lengths are multiples of it.
    pub logical_block_size: u32,
    /// Preferred minimum unit, in bytes.
    pub physical_block_size: u32,
    /// Largest I/O in bytes.
    pub max_io_bytes: u32,
    /// Most segments in one I/O.
    pub max_segments: u32,
    /// Optimal I/O size in bytes (0 for none), e.g. a stripe width.
    pub io_opt: u32,
}

impl Limits {
    /// The limits of a device of `sectors` that accepts anything well-formed.
    pub fn new(sectors: u64) -> Limits {
        Limits {
            sectors,
            logical_block_size: 512,
            physical_block_size: 512,
            max_io_bytes: 1 << 30,
            max_segments: 1024,
            io_opt: 0,
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.sectors << SECTOR_SHIFT
    }

    /// Stacks `lower`'s limits onto these, as `blk_stack_limits`: the stricter of each.
    pub fn stack(&mut self, lower: &Limits) {
        self.logical_block_size = self.logical_block_size.max(lower.logical_block_size);
        self.physical_block_size = self.physical_block_size.max(lower.physical_block_size);
        self.max_io_bytes = self.max_io_bytes.min(lower.max_io_bytes);
        self.max_segments = self.max_segments.min(lower.max_segments);
    }

    /// Checks that `bio` is well-formed for a device with these limits: inside
    /// the device, aligned to the logical block size, within the length and
    /// segment limits. Every device's submit runs this (or an equivalent) first.
    #[inline]
    pub fn check(&self, bio: &Bio) -> Result<(), Status> {
        if bio.op == Op::Flush {
            return Ok(());
        }
        let lbs = self.logical_block_size;
        let lbs_sectors = (lbs >> SECTOR_SHIFT) as u64;
        let len = bio.len();
        // A power-of-2 block size (every one seen) checks by masks, not
        // two divisions per bio.
        let aligned = if lbs.is_power_of_two() && lbs_sectors != 0 {
            len & (lbs - 1) == 0 && bio.sector & (lbs_sectors - 1) == 0
        } else {
            len.is_multiple_of(lbs) && bio.sector.is_multiple_of(lbs_sectors)
        };
        if len == 0
            || len > self.max_io_bytes
            || !aligned
            || bio.sector >= self.sectors
            || bio.sectors() > self.sectors - bio.sector
            || bio.segs().len() > self.max_segments as usize
        {
            return Err(Status::Inval);
        }
        Ok(())
    }
}

bitflags::bitflags! {
    /// What a device can do beyond reads and writes. Declared once, read by the
    /// mapper (to stack) and the exports (to advertise).
    #[derive(Clone, Copy, Default, PartialEq, Eq)]
    pub struct Caps: u16 {
        /// Has a volatile cache that FLUSH makes durable.
        const FLUSH = 1;
        /// Honours FUA on writes (without it, the stack emulates FUA with a flush).
        const FUA = 2;
        /// Accepts DISCARD.
        const DISCARD = 4;
        /// Accepts WRITE_ZEROES efficiently.
        const WRITE_ZEROES = 8;
        /// Completions can be polled for (io_uring IOPOLL on the device).
        const POLL = 16;
        /// Read-only.
        const READ_ONLY = 32;
        /// Data survives the process (a file or block device); RAM does not.
        const PERSISTENT = 64;
        /// Gains from merging adjacent requests into fewer, larger ones:
        /// each request costs far more than its bytes (a network round trip,
        /// a disk seek), so a queued dispatch that sorts and merges beats
        /// handing each request down as it comes (seed 004). RAM and null
        /// lack it; rbd has it; a mapped device has it if a device under it
        /// does.
        const MERGE = 128;
    }
}

impl Caps {
    /// Nothing beyond read and write.
    pub const NONE: Caps = Caps::empty();

    /// Whether the device supports `op` at all.
    pub fn supports(self, op: Op) -> bool {
        match op {
            Op::Read | Op::Write | Op::Flush => true,
            Op::Discard => self.contains(Caps::DISCARD),
            Op::WriteZeroes => self.contains(Caps::WRITE_ZEROES),
        }
    }
}

impl fmt::Debug for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Caps::FLUSH, "flush"),
            (Caps::FUA, "fua"),
            (Caps::DISCARD, "discard"),
            (Caps::WRITE_ZEROES, "write_zeroes"),
            (Caps::POLL, "poll"),
            (Caps::READ_ONLY, "ro"),
            (Caps::PERSISTENT, "persistent"),
            (Caps::MERGE, "merge"),
        ];
        let set: Vec<_> = names
            .iter()
            .filter(|(c, _)| self.contains(*c))
            .map(|(_, n)| *n)
            .collect();
        write!(f, "{}", set.join(","))
    }
}

/// What a range of a device holds, as NBD's `base:allocation` context and
/// `SEEK_DATA`/`SEEK_HOLE` tell it. [`Alloc::Data`] is always a correct
/// answer (it promises nothing about the bytes); the others let a client
/// skip reading zeroes and keep its copy sparse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alloc {
    /// Allocated; may hold anything.
    Data,
    /// Allocated, and reads as zeroes.
    Zero,
    /// Not allocated, and reads as zeroes (a write may need to allocate).
    Hole,
}

/// A run of sectors of one [`Alloc`] kind, as [`BlockDevice::block_status`]
/// reports them: extents follow each other from the sector asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length in 512-byte sectors (never 0).
    pub sectors: u64,
    /// What the run holds.
    pub alloc: Alloc,
}

/// The most extents a [`BlockDevice::block_status`] call needs to append:
/// an implementation may stop once it has appended this many (or once its
/// own work for the call is bounded otherwise), leaving the rest of the
/// range for the next call. It bounds the time one query holds a reactor
/// and the size of an NBD reply, whatever range a client asks for.
pub const BLOCK_STATUS_MAX_EXTENTS: usize = 1024;

/// Appends `e` to `out`, merged into the last extent if that is of the same
/// kind: how every [`BlockDevice::block_status`] keeps its list short.
pub fn push_extent(out: &mut Vec<Extent>, e: Extent) {
    if e.sectors == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) if last.alloc == e.alloc => last.sectors += e.sectors,
        _ => out.push(e),
    }
}

/// A block device. Shared by every reactor; I/O goes through [`BlockDevice::open`]'s channels.
pub trait BlockDevice: Send + Sync + 'static {
    /// The device's name (as given on the command line).
    fn name(&self) -> &str;
    /// Size, block sizes and I/O limits.
    fn limits(&self) -> Limits;
    /// What the device supports beyond read and write.
    fn caps(&self) -> Caps;
    /// Opens this reactor's channel to the device. Called on the reactor's
    /// thread; the channel may keep the device alive.
    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error>;
    /// For downcasting (e.g. to a mapped device, to load a table).
    fn as_any(&self) -> &dyn Any;
    /// Handles a message (`udm message DEV 0 ARGV…` on a backend); the
    /// default takes none.
    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        Err(Error::invalid(format!(
            "not a mapped device (it has no table) and takes no messages (got '{}')",
            argv.join(" ")
        )))
    }
    /// One line describing what lies behind a backend (e.g. an RBD image's
    /// size, features and cache mode), for `udm info`; None by default.
    fn describe(&self) -> Option<String> {
        None
    }
    /// Appends to `out` what the `sectors` from `sector` on hold, as
    /// extents following each other from `sector` (see [`push_extent`] to
    /// merge neighbours of one kind). The caller asks only inside the
    /// device (`sector + sectors <= limits().sectors`, `sectors > 0`).
    ///
    /// The extents appended cover a non-empty prefix of the range: the
    /// whole of it, or less when the device bounds its work (at most
    /// [`BLOCK_STATUS_MAX_EXTENTS`] extents appended, a bounded number of
    /// system calls); a caller that wants the rest asks again from where
    /// they end. Never more than the range. Implementations append with
    /// [`push_extent`], so the first extent may merge into one already in
    /// `out`: what a call covered is the growth of the sum of `out`'s
    /// lengths.
    ///
    /// Off the I/O path and synchronous: called from a reactor (NBD's
    /// BLOCK_STATUS) or a control thread, so it must not block for long
    /// (a device whose answer takes a network round trip keeps the
    /// default). The answer is a snapshot: I/O in flight may change it.
    /// The default reports everything as [`Alloc::Data`], which is always
    /// correct.
    fn block_status(&self, sector: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let _ = sector;
        push_extent(
            out,
            Extent {
                sectors,
                alloc: Alloc::Data,
            },
        );
        Ok(())
    }
    /// Why merging adjacent requests helps this device or not, in a few
    /// words ("file on a disk, O_DIRECT"), for `udm info` and `--dispatch
    /// auto`; whether it does is [`Caps::MERGE`]. The default says only
    /// what the capability says.
    fn merge_reason(&self) -> String {
        if self.caps().contains(Caps::MERGE) {
            "each request costs more than its bytes".into()
        } else {
            "a request costs little beyond its bytes".into()
        }
    }
}

/// One reactor's path to a device: the hot path.
pub trait Channel {
    /// Submits `bio`; the device takes ownership and completes it exactly once,
    /// through its end_io, never from inside this call (see [`BioPtr::complete`]).
    fn submit(&self, bio: BioPtr);

    /// Submits a bio whose caller has already checked it against this
    /// device's limits and capabilities, so the device skips its own check
    /// (the kernel's `submit_bio_noacct_nocheck`). The mapper's fast path
    /// uses it for a bio it remapped inside a target that the table checked
    /// against the device when it was built. The default checks anyway.
    ///
    /// # Safety
    /// `bio` must pass [`check_bio`] with this device's limits and
    /// capabilities: a device may address its memory by the bio's sector and
    /// length without another check.
    unsafe fn submit_nocheck(&self, bio: BioPtr) {
        self.submit(bio)
    }

    /// The device's own memory that holds the `len` bytes from `sector`,
    /// for a caller that reads (`write` false) or stores (`write` true) the
    /// data there itself instead of submitting a bio (the kernel's
    /// `dax_direct_access`; a RAM disk's pages): a target that transforms
    /// data (crypt) then makes one pass over it, where a bio would add the
    /// device's copy. None, the default, for a device that keeps its data
    /// elsewhere, for a range not inside the device, and with `write` for
    /// a read-only device.
    ///
    /// The memory stays valid while the device lives (a channel keeps it
    /// alive). Bytes stored there are stored as a completed write's are
    /// (such a device has no volatile cache to flush); with `write` the
    /// range counts as written (not a hole) from this call on. Accesses
    /// that overlap I/O in flight to the same sectors may tear, as
    /// overlapping I/O does on any device.
    fn direct_access(&self, sector: u64, len: usize, write: bool) -> Option<NonNull<u8>> {
        let _ = (sector, len, write);
        None
    }
}

/// Why `bio` may not go to a device with `limits` and `caps`: `Inval` if it
/// breaks the limits or writes a read-only device, `NotSupp` if it names an
/// op the device lacks. The rule [`check_bio`] applies.
#[inline]
pub fn bio_status(bio: &Bio, limits: &Limits, caps: Caps) -> Result<(), Status> {
    limits.check(bio)?;
    if !caps.supports(bio.op) {
        return Err(Status::NotSupp);
    }
    if bio.op.is_write() && caps.contains(Caps::READ_ONLY) {
        return Err(Status::Inval);
    }
    Ok(())
}

/// Completes `bio` with the status [`bio_status`] gives if it may not go to
/// a device with `limits` and `caps`; the common entry check of every
/// device's submit. Returns the bio back when it is fine.
#[inline]
pub fn check_bio(bio: BioPtr, limits: &Limits, caps: Caps) -> Option<BioPtr> {
    match bio_status(&bio, limits, caps) {
        Ok(()) => Some(bio),
        Err(s) => {
            bio.complete(s);
            None
        }
    }
}
