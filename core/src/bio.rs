//! The I/O descriptor: udm's `struct bio`.
//!
//! A [`Bio`] describes one I/O: operation, start sector, length, the submitter's
//! buffers as scatter/gather [`Seg`]ments, flags, status and a completion
//! (`end_io` + `private`). It is owned through a [`BioPtr`], which is handed down
//! the stack on submit and handed back up through `end_io` on completion.
//!
//! Stacking without allocation: a layer that wants to see the completion pushes
//! its own `end_io` with [`BioPtr::push_end_io`], which saves the caller's
//! `end_io`, `private`, `ctx` and `sector` in an inline frame of the bio (the
//! seed's 4-field `dm_noclone`, but inside the descriptor, so no allocation at
//! all). Its end_io pops the frame with [`Bio::pop_end_io`] and calls the
//! restored completion with [`BioPtr::endio`].
//!
//! Descriptors come from, and return to, the per-reactor cache
//! ([`crate::Reactor::alloc_bio`]); a `BioPtr` never leaves its reactor's thread.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The reactor core a bio comes from and returns to (the kernel's
/// `bi_pool`), opaque here: only the reactor (reactor.rs) makes and reads
/// these pointers, so this file needs nothing from it.
pub(crate) enum Home {}

/// Sector size: all positions and lengths on the block interface are in 512-byte units.
pub const SECTOR_SHIFT: u32 = 9;
/// Bytes per sector.
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;

/// How many layers may stack their completions on one bio before the mapper
/// falls back to cloning (the seed's fallback when the small allocation fails).
pub const MAX_STACK: usize = 8;
const _: () = assert!(MAX_STACK.is_power_of_two());

/// Segments stored inline before the vector spills to the heap.
pub const INLINE_SEGS: usize = 4;

/// The operation a bio asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Read into the segments.
    Read = 0,
    /// Write from the segments.
    Write = 1,
    /// Make every completed write durable (an empty REQ_PREFLUSH bio).
    Flush = 2,
    /// The range's contents become unspecified; the device may free it.
    Discard = 3,
    /// The range reads back as zeroes afterwards.
    WriteZeroes = 4,
}

impl Op {
    /// Whether the op moves data through the segments.
    #[inline]
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }
    /// Whether the op changes the device's contents.
    #[inline]
    pub fn is_write(self) -> bool {
        matches!(self, Op::Write | Op::Discard | Op::WriteZeroes)
    }
    /// Lower-case name, as in status lines and logs.
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write-zeroes",
        }
    }
}

bitflags::bitflags! {
    /// Request flags, as the kernel's `REQ_*` bits that matter to a stack.
    #[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
    pub struct BioFlags: u8 {
        /// Flush the device's volatile cache before this I/O (REQ_PREFLUSH).
        const PREFLUSH = 1;
        /// This write is durable when it completes (REQ_FUA).
        const FUA = 2;
        /// Fail with [`Status::Again`] rather than block (REQ_NOWAIT).
        const NOWAIT = 4;
        /// Set by the submitter on a write: its data will not be read soon
        /// (Linux's `RWF_DONTCACHE`). A device whose store lands in the
        /// CPU's caches may write past them (the RAM disk: non-temporal
        /// stores), so that the write neither reads its destination's lines
        /// in nor evicts data that will be read. A hint: a device may
        /// ignore it, and a read of the data is correct either way.
        const DONTCACHE = 8;
        /// Fail rather than fall back to writing zero buffers (NBD's FAST_ZERO).
        const NOUNMAP_FAST = 16;
        /// Read only, set by the submitter: instead of copying the data into the
        /// bio's single segment, the device may point the segment at its own
        /// memory that holds the data ([`Bio::lend`]; SPDK's zcopy), valid until
        /// the reactor's pass over deferred completions that runs the
        /// submitter's end_io ends, and no longer: an end_io that keeps it
        /// (to send many replies in one `sendmsg`) lets go of it in a hook
        /// of [`crate::Reactor::at_pass_end`]. A layer that passes a
        /// bio down in place and needs the data in the caller's buffer when it
        /// completes (a target that transforms or caches it, a stand-in, a
        /// clone) removes this flag.
        const MAY_LEND = 32;
        /// Set by [`Bio::lend`] only: the segment points at the device's
        /// memory, not at the submitter's buffer, and must not be written.
        /// Clones never carry it (nor `MAY_LEND`).
        const LENT = 64;
    }
}

impl BioFlags {
    /// No flags.
    pub const NONE: BioFlags = BioFlags::empty();
}

impl fmt::Debug for BioFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::PREFLUSH, "PREFLUSH"),
            (Self::FUA, "FUA"),
            (Self::NOWAIT, "NOWAIT"),
            (Self::DONTCACHE, "DONTCACHE"),
            (Self::NOUNMAP_FAST, "NOUNMAP_FAST"),
            (Self::MAY_LEND, "MAY_LEND"),
            (Self::LENT, "LENT"),
        ];
        let set: Vec<_> = names
            .iter()
            .filter(|(b, _)| self.contains(*b))
            .map(|(_, n)| *n)
            .collect();
        write!(
            f,
            "{}",
            if set.is_empty() {
                "-".into()
            } else {
                set.join("|")
            }
        )
    }
}

/// Completion status, as the kernel's `blk_status_t`. Mapped to errno or a
/// protocol error only at the edges ([`Status::errno`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum Status {
    /// Success.
    #[default]
    Ok = 0,
    /// A device error (EIO).
    IoErr,
    /// The device does not support the operation (EOPNOTSUPP).
    NotSupp,
    /// The bio is malformed for this device: out of range, misaligned or too long (EINVAL).
    Inval,
    /// No space left (ENOSPC).
    NoSpace,
    /// Try again later; returned to NOWAIT bios (EAGAIN).
    Again,
    /// Out of memory (ENOMEM).
    NoMem,
}

impl Status {
    /// Whether this is [`Status::Ok`].
    #[inline]
    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }
    /// The positive errno this status stands for (0 for Ok).
    pub fn errno(self) -> i32 {
        match self {
            Status::Ok => 0,
            Status::IoErr => libc::EIO,
            Status::NotSupp => libc::EOPNOTSUPP,
            Status::Inval => libc::EINVAL,
            Status::NoSpace => libc::ENOSPC,
            Status::Again => libc::EAGAIN,
            Status::NoMem => libc::ENOMEM,
        }
    }
    /// The status for a positive errno.
    pub fn from_errno(e: i32) -> Status {
        match e {
            0 => Status::Ok,
            libc::EOPNOTSUPP | libc::ENOTTY | libc::ENOSYS => Status::NotSupp,
            libc::EINVAL | libc::EFBIG | libc::EOVERFLOW => Status::Inval,
            libc::ENOSPC | libc::EDQUOT => Status::NoSpace,
            libc::EAGAIN => Status::Again,
            libc::ENOMEM => Status::NoMem,
            _ => Status::IoErr,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Status::Ok => "ok",
            Status::IoErr => "I/O error",
            Status::NotSupp => "operation not supported",
            Status::Inval => "invalid request",
            Status::NoSpace => "no space left",
            Status::Again => "try again",
            Status::NoMem => "out of memory",
        };
        f.write_str(s)
    }
}

/// One scatter/gather segment: a pointer into the submitter's memory and a length.
/// Layout-compatible with `struct iovec`, so a bio's segments go to `readv`/`writev`
/// as they are.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Seg {
    /// Start of the segment.
    pub base: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

// The io_uring layer hands `&[Seg]` to the kernel as `&[iovec]`.
const _: () = assert!(std::mem::size_of::<Seg>() == std::mem::size_of::<libc::iovec>());
const _: () = assert!(std::mem::align_of::<Seg>() == std::mem::align_of::<libc::iovec>());

const NULL_SEG: Seg = Seg {
    base: std::ptr::null_mut(),
    len: 0,
};

/// Segments, inline up to [`INLINE_SEGS`], spilling to a heap vector (whose
/// capacity the cached descriptor keeps) beyond that.
struct SegVec {
    n: u32,
    inline: [Seg; INLINE_SEGS],
    heap: Vec<Seg>,
}

impl SegVec {
    const fn new() -> SegVec {
        SegVec {
            n: 0,
            inline: [NULL_SEG; INLINE_SEGS],
            heap: Vec::new(),
        }
    }
    #[inline]
    fn as_slice(&self) -> &[Seg] {
        if self.n as usize <= INLINE_SEGS {
            &self.inline[..self.n as usize]
        } else {
            &self.heap
        }
    }
    #[inline(always)]
    fn push(&mut self, s: Seg) {
        let n = self.n as usize;
        if n < INLINE_SEGS {
            self.inline[n] = s;
            self.n += 1;
        } else {
            self.push_heap(s);
        }
    }
    /// [`SegVec::push`] past the inline segments (moved to the heap).
    #[cold]
    #[inline(never)]
    fn push_heap(&mut self, s: Seg) {
        if self.n as usize == INLINE_SEGS {
            self.heap.clear();
            self.heap.extend_from_slice(&self.inline);
        }
        self.heap.push(s);
        self.n += 1;
    }
    #[inline]
    fn clear(&mut self) {
        self.n = 0;
    }
}

/// A completion function. It receives the bio back, owned.
pub type EndIo = fn(BioPtr);

fn no_end_io(bio: BioPtr) {
    // A bio completed without anyone asking: just recycle it.
    drop(bio);
}

/// A saved completion frame (the seed's `dm_noclone`, kept inline).
#[derive(Clone, Copy)]
struct Frame {
    end_io: EndIo,
    private: *mut (),
    ctx: u64,
    sector: u64,
}

const EMPTY_FRAME: Frame = Frame {
    end_io: no_end_io,
    private: std::ptr::null_mut(),
    ctx: 0,
    sector: 0,
};

/// Bytes of per-I/O data the core reserves in every descriptor for the target
/// that maps a clone (dm's `per_io_data_size`).
pub const PER_IO_DATA: usize = 32;

/// An I/O descriptor. See the module docs.
///
/// `repr(C)`, hot fields first: what every layer reads and a frame saves,
/// the op, flags and depth, and the cache's links share the first cache
/// line. (`ctx` sits between `end_io` and `private`, not in `Frame`'s
/// order, so that saving a frame copies 8-byte words: a 16-byte copy of
/// `end_io` and `private`, which the submitter has just stored one by one,
/// could not be forwarded from the store buffer.)
#[repr(C)]
pub struct Bio {
    end_io: EndIo,
    ctx: u64,
    private: *mut (),
    /// Start, in 512-byte sectors.
    pub sector: u64,
    len: u32,
    /// The operation.
    pub op: Op,
    /// Request flags.
    pub flags: BioFlags,
    status: Status,
    depth: u8,
    /// Index of the registered buffer that holds the (single) segment, or
    /// [`Bio::NO_BUF`]; lets the io_uring layer use fixed-buffer reads and writes.
    pub buf_index: u16,
    /// Outstanding children while this bio is split on a clone path; owned by the
    /// layer that split it.
    pub pending: u32,
    pub(crate) next: *mut Bio,
    /// Set by the reactor core that allocated the bio, to itself.
    pub(crate) home: *const Home,
    segs: SegVec,
    frames: [Frame; MAX_STACK],
    /// Per-I/O data for the target that maps this bio as a clone (dm's
    /// `dm_per_bio_data`), [`PER_IO_DATA`] bytes.
    pub per_io: [u64; PER_IO_DATA / 8],
}

impl Bio {
    /// `buf_index` when the data is not in a registered buffer.
    pub const NO_BUF: u16 = u16::MAX;

    pub(crate) fn new(home: *const Home) -> Bio {
        Bio {
            op: Op::Read,
            flags: BioFlags::NONE,
            status: Status::Ok,
            depth: 0,
            buf_index: Bio::NO_BUF,
            len: 0,
            sector: 0,
            end_io: no_end_io,
            private: std::ptr::null_mut(),
            ctx: 0,
            pending: 0,
            segs: SegVec::new(),
            frames: [EMPTY_FRAME; MAX_STACK],
            per_io: [0; PER_IO_DATA / 8],
            next: std::ptr::null_mut(),
            home,
        }
    }

    /// Resets a recycled descriptor to an empty read of nothing.
    #[inline]
    pub(crate) fn reset(&mut self) {
        self.op = Op::Read;
        self.flags = BioFlags::NONE;
        self.status = Status::Ok;
        self.depth = 0;
        self.buf_index = Bio::NO_BUF;
        self.len = 0;
        self.sector = 0;
        self.end_io = no_end_io;
        self.private = std::ptr::null_mut();
        self.ctx = 0;
        self.pending = 0;
        self.segs.clear();
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> u32 {
        self.len
    }
    /// Whether the bio covers no bytes (a flush).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Length in sectors.
    #[inline]
    pub fn sectors(&self) -> u64 {
        (self.len >> SECTOR_SHIFT) as u64
    }
    /// One past the last sector.
    #[inline]
    pub fn end_sector(&self) -> u64 {
        self.sector + self.sectors()
    }
    /// The completion status (meaningful once completed).
    #[inline]
    pub fn status(&self) -> Status {
        self.status
    }
    /// Sets the status.
    #[inline]
    pub fn set_status(&mut self, s: Status) {
        self.status = s;
    }
    /// How many segments the bio has (`segs().len()`, without the slice).
    #[inline]
    pub fn nr_segs(&self) -> usize {
        self.segs.n as usize
    }
    /// The scatter/gather segments.
    #[inline]
    pub fn segs(&self) -> &[Seg] {
        self.segs.as_slice()
    }
    /// The submitter's private pointer for the current completion.
    #[inline]
    pub fn private(&self) -> *mut () {
        self.private
    }
    /// A word of context for the current completion's owner (dm keeps the
    /// target here on the no-clone path).
    #[inline]
    pub fn ctx(&self) -> u64 {
        self.ctx
    }
    /// Sets the context word.
    #[inline]
    pub fn set_ctx(&mut self, ctx: u64) {
        self.ctx = ctx;
    }
    /// How many completion frames are saved.
    #[inline]
    pub fn depth(&self) -> usize {
        self.depth as usize
    }
    /// Whether another frame fits ([`BioPtr::push_end_io`] would succeed).
    #[inline]
    pub fn can_push(&self) -> bool {
        (self.depth as usize) < MAX_STACK
    }

    /// Whether a layer may remap this bio in place and see its completion: a
    /// read or a write, without PREFLUSH, with a free frame
    /// ([`BioPtr::push_end_io`] succeeds).
    #[inline(always)]
    pub fn remappable(&self) -> bool {
        // Three byte loads, not one load of the four adjacent bytes: the
        // submitter has just stored `op` alone, and a wider load of a
        // narrower recent store cannot be forwarded from the store buffer
        // (it waits for the store to commit; that cost striped 512 B reads
        // 4%).
        (self.op as u8) <= Op::Write as u8
            && !self.flags.contains(BioFlags::PREFLUSH)
            && self.can_push()
    }

    /// Sets the completion the submitter wants.
    #[inline]
    pub fn set_end_io(&mut self, end_io: EndIo, private: *mut ()) {
        self.end_io = end_io;
        self.private = private;
    }

    /// Sets up a data-less op (flush, discard, write-zeroes) of `len` bytes.
    #[inline]
    pub fn set_dataless(&mut self, op: Op, sector: u64, len: u32) {
        debug_assert!(!op.has_data());
        self.op = op;
        self.sector = sector;
        self.len = len;
        self.segs.clear();
    }

    /// Appends a segment; the bio's length grows by `len`.
    ///
    /// # Safety
    /// `base..base+len` must be valid for reads and (for reads into it) writes
    /// from now until the bio completes, and nothing else may access it for a
    /// write in that time. The bio does not own the memory.
    #[inline]
    pub unsafe fn add_seg(&mut self, base: *mut u8, len: usize) {
        debug_assert!(len <= u32::MAX as usize);
        self.segs.push(Seg { base, len });
        self.len += len as u32;
    }

    /// Whether the device may lend its memory instead of copying the data
    /// in: a read whose submitter allows it ([`BioFlags::MAY_LEND`]) with a
    /// single segment.
    #[inline]
    pub fn may_lend(&self) -> bool {
        self.op == Op::Read && self.flags.contains(BioFlags::MAY_LEND) && self.segs.n == 1
    }

    /// Serves a read by lending: the bio's one segment now points at `data`
    /// (the bio's length in bytes), and [`BioFlags::LENT`] says so. Returns
    /// false, changing nothing, unless [`Bio::may_lend`].
    ///
    /// A lent segment is read-only: no layer may write through it (a target
    /// whose end_io changes read data must not keep `MAY_LEND`).
    ///
    /// # Safety
    /// `data..data+len()` must hold the bio's data, stay valid for reads
    /// until the end of the reactor's pass over deferred completions that
    /// runs the submitter's end_io (so the device completes the bio with
    /// [`BioPtr::complete`], whose end_io runs in such a pass, and frees
    /// nothing it lends while a pass runs), and not be written meanwhile
    /// but by I/O that overlaps this read (which may tear it, as it may tear
    /// a copy).
    #[inline]
    pub unsafe fn lend(&mut self, data: *const u8) -> bool {
        if !self.may_lend() {
            return false;
        }
        self.segs.inline[0].base = data.cast_mut();
        self.flags.insert(BioFlags::LENT);
        // The segment left the submitter's registered buffer.
        self.buf_index = Bio::NO_BUF;
        true
    }

    /// Appends the part `[offset, offset+len)` of `src`'s data (the clone path:
    /// a child bio points into its parent's buffers; nothing is copied).
    /// The bio's `buf_index` becomes `src`'s when these are its first
    /// segments (they lie in the same registered buffer), and
    /// [`Bio::NO_BUF`] when it already had segments from elsewhere.
    pub fn add_segs_from(&mut self, src: &Bio, mut offset: usize, mut len: usize) {
        self.buf_index = if self.segs.n == 0 || self.buf_index == src.buf_index {
            src.buf_index
        } else {
            Bio::NO_BUF
        };
        for s in src.segs() {
            if len == 0 {
                break;
            }
            if offset >= s.len {
                offset -= s.len;
                continue;
            }
            let take = (s.len - offset).min(len);
            // SAFETY: `s` is a segment of `src`, valid until `src` completes
            // (add_seg's contract); the child's range lies inside it, and the
            // clone path completes every child before completing `src`.
            unsafe { self.add_seg(s.base.add(offset), take) };
            offset = 0;
            len -= take;
        }
        debug_assert_eq!(len, 0, "source bio shorter than the requested range");
    }

    /// Copies `buf.len()` bytes of the bio's data, from byte `offset` of the bio,
    /// into `buf` (a device serving a write).
    pub fn copy_out(&self, mut offset: usize, mut buf: &mut [u8]) {
        for s in self.segs() {
            if buf.is_empty() {
                break;
            }
            if offset >= s.len {
                offset -= s.len;
                continue;
            }
            let take = (s.len - offset).min(buf.len());
            // SAFETY: add_seg's contract makes the segment readable until
            // completion; `offset + take <= s.len`, and `buf` is a distinct
            // Rust borrow, so the ranges cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(s.base.add(offset), buf.as_mut_ptr(), take) };
            buf = &mut buf[take..];
            offset = 0;
        }
    }

    /// Copies `buf` into the bio's data from byte `offset` of the bio (a device
    /// serving a read). A shared borrow is enough: the bytes written are the
    /// segments' (the submitter's buffers), not the bio's own fields.
    pub fn copy_in(&self, mut offset: usize, mut buf: &[u8]) {
        debug_assert!(
            !self.flags.contains(BioFlags::LENT),
            "copy_in on a lent (read-only) segment"
        );
        for s in self.segs() {
            if buf.is_empty() {
                break;
            }
            if offset >= s.len {
                offset -= s.len;
                continue;
            }
            let take = (s.len - offset).min(buf.len());
            // SAFETY: add_seg's contract makes the segment writable and unaliased
            // until completion; `offset + take <= s.len`.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), s.base.add(offset), take) };
            buf = &buf[take..];
            offset = 0;
        }
    }

    /// Fills the bio's data with zeroes (a read of unwritten or zero space).
    pub fn zero_fill(&mut self) {
        for s in self.segs() {
            // SAFETY: as in copy_in: the segment is writable until completion.
            unsafe { std::ptr::write_bytes(s.base, 0, s.len) };
        }
    }

    /// The sector saved by the last [`BioPtr::push_end_io`]: where the bio
    /// was before the layer that pushed remapped it (an end_io that needs
    /// the mapping, on a rare path, recomputes it from this rather than
    /// every bio storing it). `None` with no frame saved.
    #[inline]
    pub fn pushed_sector(&self) -> Option<u64> {
        let d = (self.depth as usize).checked_sub(1)?;
        self.frames.get(d).map(|f| f.sector)
    }

    /// Restores the completion saved by the last [`BioPtr::push_end_io`]:
    /// end_io, private, ctx and the sector as it was when pushed.
    #[inline]
    pub fn pop_end_io(&mut self) {
        debug_assert!(self.depth > 0, "pop_end_io without a saved frame");
        self.depth -= 1;
        // The mask keeps the index in range without a bounds check (depth
        // is below MAX_STACK, a power of two, whenever a frame is saved).
        let f = self.frames[self.depth as usize & (MAX_STACK - 1)];
        self.end_io = f.end_io;
        self.private = f.private;
        self.ctx = f.ctx;
        self.sector = f.sector;
    }
}

impl fmt::Debug for Bio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bio")
            .field("op", &self.op)
            .field("sector", &self.sector)
            .field("len", &self.len)
            .field("flags", &self.flags)
            .field("status", &self.status)
            .field("segs", &self.segs.n)
            .field("depth", &self.depth)
            .finish()
    }
}

/// The owned handle of a [`Bio`]. Dropping it returns the descriptor to its
/// reactor's cache. Not `Send`: a bio completes on the reactor that allocated it.
pub struct BioPtr {
    pub(crate) ptr: NonNull<Bio>,
    _not_send: PhantomData<*mut Bio>,
}

impl BioPtr {
    /// Wraps a descriptor pointer.
    ///
    /// # Safety
    /// `ptr` must come from [`BioPtr::into_raw`] and not have been wrapped since.
    #[inline]
    pub unsafe fn from_raw(ptr: *mut Bio) -> BioPtr {
        BioPtr {
            // SAFETY: into_raw only hands out non-null pointers; the caller
            // promises `ptr` is one of them.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            _not_send: PhantomData,
        }
    }

    #[inline]
    pub(crate) fn from_box(b: Box<Bio>) -> BioPtr {
        BioPtr {
            ptr: NonNull::from(Box::leak(b)),
            _not_send: PhantomData,
        }
    }

    #[inline]
    pub(crate) fn from_nonnull(ptr: NonNull<Bio>) -> BioPtr {
        BioPtr {
            ptr,
            _not_send: PhantomData,
        }
    }

    /// Gives up ownership, for handing the bio through a `u64` (io_uring's
    /// user_data) or a `*mut ()` (a child's private pointer).
    #[inline]
    pub fn into_raw(self) -> *mut Bio {
        let p = self.ptr.as_ptr();
        std::mem::forget(self);
        p
    }

    /// Saves the current completion (end_io, private, ctx, sector) in an inline
    /// frame and installs a new one, with ctx 0. Returns false, changing nothing,
    /// when the stack is full; callers then take their clone path.
    #[inline]
    #[must_use]
    pub fn push_end_io(&mut self, end_io: EndIo, private: *mut ()) -> bool {
        self.push_end_io_ctx(end_io, private, 0)
    }

    /// [`BioPtr::push_end_io`] with the new context word set to `ctx`.
    #[inline]
    #[must_use]
    pub fn push_end_io_ctx(&mut self, end_io: EndIo, private: *mut (), ctx: u64) -> bool {
        let b = &mut **self;
        let d = b.depth as usize;
        if d >= MAX_STACK {
            return false;
        }
        b.frames[d] = Frame {
            end_io: b.end_io,
            private: b.private,
            ctx: b.ctx,
            sector: b.sector,
        };
        b.depth += 1;
        b.end_io = end_io;
        b.private = private;
        b.ctx = ctx;
        true
    }

    /// This bio, if another frame fits; otherwise a fresh descriptor that
    /// stands in for it (same op, flags, range and buffers) and completes it
    /// with the stand-in's status. For layers that push a frame: a stack
    /// deeper than [`MAX_STACK`] then costs one descriptor per extra layer
    /// instead of failing (dm's clone fallback).
    ///
    /// The test is inline and the stand-in out of line, so that callers
    /// on a hot path pay only the test.
    #[inline]
    pub fn make_room(self) -> BioPtr {
        if self.can_push() {
            return self;
        }
        self.stand_in()
    }

    /// [`BioPtr::make_room`]'s stand-in for a bio whose stack is full.
    #[cold]
    #[inline(never)]
    fn stand_in(self) -> BioPtr {
        // alloc_clone removes MAY_LEND: memory lent to the stand-in would
        // not reach this bio's buffer.
        let mut s = self.alloc_clone();
        if self.op.has_data() {
            s.add_segs_from(&self, 0, self.len() as usize);
        } else {
            s.set_dataless(self.op, 0, self.len());
        }
        s.sector = self.sector;
        s.set_end_io(stand_in_endio, self.into_raw().cast());
        s
    }

    /// Calls the bio's end_io now (the kernel's `bio_endio`). Only for code that
    /// runs from a completion (a reactor reaping, or another end_io): a device's
    /// `submit` must use [`BioPtr::complete`] so that completion never recurses
    /// into the submitter.
    #[inline]
    pub fn endio(self) {
        let f = self.end_io;
        f(self)
    }
}

fn stand_in_endio(s: BioPtr) {
    // SAFETY: a stand-in's private is the bio it stands for, given up with
    // into_raw in `make_room` and taken back only here, once. It stayed
    // untouched (so its buffers stayed valid) while the stand-in ran.
    let mut bio = unsafe { BioPtr::from_raw(s.private().cast()) };
    bio.set_status(s.status());
    drop(s);
    bio.endio();
}

impl Deref for BioPtr {
    type Target = Bio;
    #[inline]
    fn deref(&self) -> &Bio {
        // SAFETY: a BioPtr uniquely owns a live descriptor.
        unsafe { self.ptr.as_ref() }
    }
}

impl DerefMut for BioPtr {
    #[inline]
    fn deref_mut(&mut self) -> &mut Bio {
        // SAFETY: a BioPtr uniquely owns a live descriptor.
        unsafe { self.ptr.as_mut() }
    }
}

impl fmt::Debug for BioPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}
