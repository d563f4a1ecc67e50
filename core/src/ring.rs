//! The io_uring layer: a thin safe wrapper that turns bios into SQEs and CQEs
//! back into completions. This is the only place where pointers to a bio's
//! memory are handed to the kernel.
//!
//! Ownership: an operation takes the [`BioPtr`] and keeps it (as `user_data`)
//! until its CQE arrives, so the descriptor and — by [`Bio::add_seg`]'s
//! contract — the memory its segments point at outlive the kernel's use.
//! Submission is batched: SQEs accumulate until the reactor's next turn calls
//! [`Ring::submit`], one `io_uring_enter` for the whole batch.
//!
//! A ring set up with [`RingKind::sqe128`] has 128-byte SQEs, which
//! URING_CMDs carrying 80 bytes of command need (ublk's); every other
//! entry goes into it as well, widened.

use std::cell::{Cell, UnsafeCell};
use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use crate::bio::{Bio, BioPtr, Op, Status, SECTOR_SHIFT};

/// Expands an opcode builder once per kind of fd (the crate seals the fd trait).
macro_rules! with_fd {
    ($fd:expr, $f:ident, $body:block) => {
        match $fd {
            RingFd::Raw(raw) => {
                let $f = types::Fd(raw);
                $body
            }
            RingFd::Fixed(i) => {
                let $f = types::Fixed(i);
                $body
            }
        }
    };
}

/// `user_data` of entries whose completion nobody waits for.
const TAG_IGNORE: u64 = 0;
/// `user_data` of the reactor's wake-up read.
pub(crate) const TAG_WAKE: u64 = 1;
/// Low bits of a `user_data` that carries a [`RingOp`] pointer. Bios and ops
/// are at least 8-aligned, so a bio pointer has its low three bits clear and
/// an op pointer is told apart by this tag; 0 and 1 are never pointers.
const TAG_OP: u64 = 2;
/// Mask of the tag bits below an 8-aligned pointer.
const TAG_MASK: u64 = 7;

/// A generic operation on the ring, for callers that are not bios (sockets,
/// timers, eventfds …).
///
/// Embed it as the **first field** of a `#[repr(C)]` struct of your own and
/// pass a pointer to it to [`Ring::push_op`]; when a CQE for the entry
/// arrives, the ring calls `complete(op, res, flags)` on the reactor's
/// thread, where `op` is the pointer you pushed (cast it back to your
/// struct), `res` the CQE's result (a negative errno on failure) and `flags`
/// its flags. A multishot entry (`IORING_CQE_F_MORE` in `flags`) calls
/// `complete` once per CQE; the op counts as in flight until the last one
/// (the CQE without `F_MORE`).
#[repr(C)]
#[derive(Debug)]
pub struct RingOp {
    /// Called once per CQE of the op.
    pub complete: fn(op: *mut RingOp, res: i32, flags: u32),
}

impl RingOp {
    /// The `user_data` [`Ring::push_op`] gives `op`'s entries, for an
    /// `AsyncCancel` of them.
    pub fn user_data(op: *const RingOp) -> u64 {
        op as u64 | TAG_OP
    }
}

// Ops are tagged in the low bits of user_data: they must be 8-aligned.
const _: () = assert!(std::mem::align_of::<RingOp>() >= 8);

/// Whether a CQE's flags say more CQEs of the same (multishot) entry follow.
#[inline]
pub fn cqe_more(flags: u32) -> bool {
    io_uring::cqueue::more(flags)
}

/// How a ring is set up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RingKind {
    /// A kernel thread polls the SQ (IORING_SETUP_SQPOLL): no syscall to submit.
    pub sqpoll: bool,
    /// Completions are polled from the device (IORING_SETUP_IOPOLL): needs
    /// O_DIRECT and a device with poll queues.
    pub iopoll: bool,
    /// 128-byte SQEs (IORING_SETUP_SQE128), for [`Ring::push_op128`].
    pub sqe128: bool,
}

/// A sleeping reactor confined to one CPU waits for a quarter of its bios
/// in flight, at most this many, before it wakes (see
/// [`Ring::submit_and_wait`]).
const WAIT_BATCH_MAX: u32 = 8;

/// The longest a wait for a batch may last when fewer completions come: a
/// bio may need this very reactor to complete (a device served by this
/// process through the kernel: a udm export attached as /dev/nbd0 and used
/// as a backend here), and a message or a socket's request must still run.
const WAIT_BATCH_CAP: Duration = Duration::from_millis(10);
/// Completions a gathering wait ([`Ring::submit_and_wait_gathering`])
/// returns at once for, before its minimum wait is up.
pub const GATHER_WANT: usize = 64;
/// The overall limit of a gathering wait that has no deadline.
const GATHER_TIMEOUT: Duration = Duration::from_secs(1);

/// Size of the registered file table (sparse, filled on demand).
const REGISTERED_SLOTS: u32 = 64;

/// Size of the registered buffer table (sparse, filled on demand): room
/// for a guest's memory in 1 GiB chunks on every reactor, twice over while
/// a new memory table replaces the old one. An empty slot costs the kernel
/// one pointer.
pub const BUFFER_SLOTS: u32 = 256;

/// The largest buffer io_uring registers as one (its limit: larger ones
/// are refused with EFAULT).
pub const MAX_REGISTERED_BUFFER: usize = 1 << 30;

/// A file as an SQE names it: a registered index when it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingFd {
    /// A plain descriptor.
    Raw(RawFd),
    /// An index in the ring's registered-file table.
    Fixed(u32),
}

/// The io_uring itself, with the SQE size it was set up with.
enum Uring {
    Sqe64(IoUring),
    Sqe128(IoUring<squeue::Entry128>),
}

/// An entry waiting in the backlog.
enum Sqe {
    Sqe64(squeue::Entry),
    Sqe128(squeue::Entry128),
}

impl Uring {
    fn submitter(&self) -> io_uring::Submitter<'_> {
        match self {
            Uring::Sqe64(r) => r.submitter(),
            Uring::Sqe128(r) => r.submitter(),
        }
    }

    /// SQ length, capacity, and the CQ-overflow and task-run flags.
    ///
    /// # Safety
    /// No other borrow of the SQ may be live (see `Ring::ring`).
    unsafe fn sq_state(&self) -> (usize, usize, bool, bool) {
        macro_rules! state {
            ($r:expr) => {{
                // SAFETY: forwarded from the caller; the borrow ends here.
                let sq = unsafe { $r.submission_shared() };
                (sq.len(), sq.capacity(), sq.cq_overflow(), sq.taskrun())
            }};
        }
        match self {
            Uring::Sqe64(r) => state!(r),
            Uring::Sqe128(r) => state!(r),
        }
    }

    /// Pushes one 64-byte entry; false when the SQ is full.
    ///
    /// # Safety
    /// As for [`Uring::push`].
    #[inline]
    unsafe fn push_one(&self, e: &squeue::Entry) -> bool {
        match self {
            // SAFETY: forwarded from the caller.
            Uring::Sqe64(r) => unsafe { r.submission_shared().push(e).is_ok() },
            Uring::Sqe128(r) => {
                let wide = squeue::Entry128::from(e.clone());
                // SAFETY: forwarded from the caller.
                unsafe { r.submission_shared().push(&wide).is_ok() }
            }
        }
    }

    /// Whether the kernel took the SINGLE_ISSUER/DEFER_TASKRUN flags.
    #[cfg(test)]
    fn single_issuer(&self) -> bool {
        match self {
            Uring::Sqe64(r) => r.params().is_setup_single_issuer(),
            Uring::Sqe128(r) => r.params().is_setup_single_issuer(),
        }
    }

    /// Pushes `entries` into the SQ, all or none. Returns false when there
    /// is no room for them all.
    ///
    /// # Safety
    /// No other borrow of the SQ may be live, and every pointer in the
    /// entries must stay valid until their CQEs are reaped. A 128-byte
    /// entry needs a 128-byte ring ([`Ring::push_op128`] checks).
    #[inline]
    unsafe fn push(&self, entries: &[&Sqe]) -> bool {
        match self {
            Uring::Sqe64(r) => {
                // SAFETY: forwarded from the caller.
                let mut sq = unsafe { r.submission_shared() };
                if sq.capacity() - sq.len() < entries.len() {
                    return false;
                }
                for e in entries {
                    let Sqe::Sqe64(e) = e else {
                        unreachable!("a 128-byte entry on a 64-byte ring")
                    };
                    // SAFETY: room was checked; the caller vouches for
                    // the entry's pointers.
                    let _ = unsafe { sq.push(e) };
                }
                true
            }
            Uring::Sqe128(r) => {
                // SAFETY: forwarded from the caller.
                let mut sq = unsafe { r.submission_shared() };
                if sq.capacity() - sq.len() < entries.len() {
                    return false;
                }
                for e in entries {
                    let wide = match e {
                        Sqe::Sqe64(e) => squeue::Entry128::from(e.clone()),
                        Sqe::Sqe128(e) => e.clone(),
                    };
                    // SAFETY: as above.
                    let _ = unsafe { sq.push(&wide) };
                }
                true
            }
        }
    }
}

/// One io_uring with bio-level operations. Not `Send`: owned by a reactor.
pub struct Ring {
    ring: UnsafeCell<Uring>,
    kind: RingKind,
    /// Operations submitted or queued whose CQE has not arrived.
    inflight: Cell<u32>,
    /// Bios among them: device I/O, which normally completes without the
    /// reactor's help (a socket's receive may never), so a wait may gather it.
    bios: Cell<u32>,
    /// The most bio completions a wait gathers before it wakes (1: wake for each).
    wait_batch: u32,
    /// Entries the SQ had no room for: pushed, in order, on the next submit.
    /// The flag marks an entry linked to the one after it: the two enter the
    /// SQ together, since a link cut at a submission boundary is no link.
    backlog: UnsafeCell<VecDeque<(Sqe, bool)>>,
    next_file: Cell<u32>,
    fixed_buffers: Cell<bool>,
    /// READ_FIXED and WRITE_FIXED entries made (see [`Ring::fixed_ops`]).
    fixed_ops: Cell<u64>,
    pub(crate) woken: Cell<bool>,
    /// The kernel takes a minimum wait (`min_wait_usec`, Linux 6.12): see
    /// [`Ring::submit_and_wait_gathering`].
    min_wait: bool,
}

impl Ring {
    /// Sets up a ring with `entries` SQ slots (the CQ gets twice that).
    pub fn new(entries: u32, kind: RingKind) -> io::Result<Ring> {
        // Kernels before 6.1 lack these flags: plain task work then.
        let ring = if kind.sqe128 {
            Uring::Sqe128(build(entries, kind, true).or_else(|_| build(entries, kind, false))?)
        } else {
            Uring::Sqe64(build(entries, kind, true).or_else(|_| build(entries, kind, false))?)
        };
        // Sparse tables, filled on demand; an old kernel without them just
        // means plain fds and buffers.
        let sub = ring.submitter();
        let _ = sub.register_files_sparse(REGISTERED_SLOTS);
        let fixed_buffers = sub.register_buffers_sparse(BUFFER_SLOTS).is_ok();
        // Only a kernel that says so takes the field: an older one may
        // ignore it, and a wait for GATHER_WANT would then be a long one.
        let min_wait = match &ring {
            Uring::Sqe64(r) => r.params().is_feature_min_timeout(),
            Uring::Sqe128(r) => r.params().is_feature_min_timeout(),
        };
        Ok(Ring {
            ring: UnsafeCell::new(ring),
            kind,
            inflight: Cell::new(0),
            bios: Cell::new(0),
            wait_batch: if confined_to_one_cpu() {
                WAIT_BATCH_MAX
            } else {
                1
            },
            backlog: UnsafeCell::new(VecDeque::new()),
            next_file: Cell::new(0),
            fixed_buffers: Cell::new(fixed_buffers),
            fixed_ops: Cell::new(0),
            woken: Cell::new(false),
            min_wait,
        })
    }

    #[inline]
    fn ring(&self) -> &Uring {
        // SAFETY: the ring is only reached through &self on its own thread
        // (Ring is !Sync); no &mut to it outlives the methods below, and none
        // of them call out to other code while holding one.
        unsafe { &*self.ring.get() }
    }

    /// How the ring was set up.
    pub fn kind(&self) -> RingKind {
        self.kind
    }

    /// Operations in flight.
    pub fn inflight(&self) -> u32 {
        self.inflight.get()
    }

    /// Registers `fd` in the ring's file table; falls back to the raw fd when
    /// the table is full or unsupported.
    pub fn register_file(&self, fd: RawFd) -> RingFd {
        let slot = self.next_file.get();
        if slot < REGISTERED_SLOTS {
            if let Ok(1) = self.ring().submitter().register_files_update(slot, &[fd]) {
                self.next_file.set(slot + 1);
                return RingFd::Fixed(slot);
            }
        }
        RingFd::Raw(fd)
    }

    /// Has the kernel signal the eventfd `fd` whenever a completion is posted
    /// (IORING_REGISTER_EVENTFD), so a thread sleeping elsewhere wakes for it.
    pub fn register_eventfd(&self, fd: RawFd) -> io::Result<()> {
        self.ring().submitter().register_eventfd(fd)
    }

    /// Registers `buf` at `index` of the buffer table (replacing what was
    /// there), so bios whose single segment lies inside it and that carry
    /// `index` use READ_FIXED/WRITE_FIXED. The kernel pins the pages and,
    /// for a process without CAP_IPC_LOCK, charges them to its
    /// RLIMIT_MEMLOCK; when it refuses (ENOMEM past the limit, EFAULT past
    /// [`MAX_REGISTERED_BUFFER`] or for memory it cannot pin), the error
    /// says why and the ring goes on with plain reads and writes.
    ///
    /// # Safety
    /// Until the slot is emptied ([`Ring::unregister_buffer`]) or replaced,
    /// or the ring is dropped, the memory must stay mapped at these
    /// addresses: a fixed I/O reaches the pages pinned now, not whatever a
    /// later mapping at the same addresses holds.
    pub unsafe fn register_buffer(&self, index: u16, buf: libc::iovec) -> io::Result<()> {
        if !self.fixed_buffers.get() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "this kernel has no sparse registered-buffer table",
            ));
        }
        if index as u32 >= BUFFER_SLOTS {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("the {BUFFER_SLOTS} registered-buffer slots are taken"),
            ));
        }
        // SAFETY: the caller keeps the memory mapped while it is registered.
        unsafe {
            self.ring()
                .submitter()
                .register_buffers_update(index as u32, &[buf], None)
        }
    }

    /// Empties slot `index` of the buffer table. Fixed I/O already in flight
    /// keeps the kernel's reference to the old pages until it completes; a
    /// later bio that still names `index` fails (EFAULT), it reaches no
    /// memory.
    pub fn unregister_buffer(&self, index: u16) {
        if !self.fixed_buffers.get() || index as u32 >= BUFFER_SLOTS {
            return;
        }
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        // SAFETY: an empty iovec names no memory: the slot is cleared.
        let _ = unsafe {
            self.ring()
                .submitter()
                .register_buffers_update(index as u32, &[empty], None)
        };
    }

    /// READ_FIXED and WRITE_FIXED entries this ring made (bios that named
    /// a registered buffer).
    pub fn fixed_ops(&self) -> u64 {
        self.fixed_ops.get()
    }

    /// Queues `e`, spilling to the backlog when the SQ is full. Inlined
    /// into every caller: it is the hot path of every bio.
    ///
    /// # Safety
    /// Every pointer in `e` must stay valid until its CQE is reaped.
    #[inline(always)]
    unsafe fn push(&self, e: squeue::Entry) {
        // SAFETY: single-threaded, not re-entered; the borrow ends at once.
        let backlogged = unsafe { !(*self.backlog.get()).is_empty() };
        // SAFETY: see `ring()`; the SQ borrow ends in `push_one`, and the
        // caller guarantees the entry's pointers.
        let sq_full = backlogged || unsafe { !self.ring().push_one(&e) };
        if sq_full {
            // Behind earlier backlogged entries, to keep submission order.
            // SAFETY: single-threaded, not re-entered.
            unsafe { (*self.backlog.get()).push_back((Sqe::Sqe64(e), false)) };
        }
        self.inflight.set(self.inflight.get() + 1);
    }

    /// Queues `first` linked to `second` (IO_LINK set on `first` by the
    /// caller): both enter the same submission, or neither does yet.
    ///
    /// # Safety
    /// As for [`Ring::push`], for both entries.
    unsafe fn push_linked(&self, first: squeue::Entry, second: squeue::Entry) {
        // SAFETY: single-threaded, not re-entered.
        let backlog = unsafe { &mut *self.backlog.get() };
        let (first, second) = (Sqe::Sqe64(first), Sqe::Sqe64(second));
        // SAFETY: see `ring()`; the SQ borrow ends in `push`. The caller
        // guarantees both entries' pointers.
        let pushed = backlog.is_empty() && unsafe { self.ring().push(&[&first, &second]) };
        if !pushed {
            backlog.push_back((first, true));
            backlog.push_back((second, false));
        }
        self.inflight.set(self.inflight.get() + 2);
    }

    /// Queues `entry` as the generic operation `op`: its CQEs call
    /// `(*op).complete` (see [`RingOp`]). The entry's `user_data` is
    /// overwritten. The op counts in [`Ring::inflight`] until its final CQE,
    /// so a reactor does not consider itself idle while the op is pending.
    ///
    /// # Safety
    /// `op` must point to a live [`RingOp`] (the first field of the caller's
    /// `#[repr(C)]` struct), and `op` and every buffer, iovec and msghdr the
    /// entry names must stay valid (and, for buffers the kernel writes,
    /// unaliased) until the final CQE of the entry has been reaped, i.e.
    /// until `complete` was called with `flags` lacking `IORING_CQE_F_MORE`.
    #[inline]
    pub unsafe fn push_op(&self, entry: squeue::Entry, op: *mut RingOp) {
        debug_assert!(op as u64 & TAG_MASK == 0, "RingOp must be 8-aligned");
        let e = entry.user_data(op as u64 | TAG_OP);
        // SAFETY: forwarded from the caller: the op and the entry's memory
        // stay valid until the final CQE.
        unsafe { self.push(e) };
    }

    /// Queues the 128-byte `entry` (a URING_CMD with 80 bytes of command,
    /// `opcode::UringCmd80`) as the generic operation `op`, as
    /// [`Ring::push_op`] does. Fails (InvalidInput) on a ring set up
    /// without [`RingKind::sqe128`].
    ///
    /// # Safety
    /// As for [`Ring::push_op`].
    pub unsafe fn push_op128(&self, entry: squeue::Entry128, op: *mut RingOp) -> io::Result<()> {
        if !self.kind.sqe128 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a 128-byte entry on a ring without 128-byte SQEs",
            ));
        }
        debug_assert!(op as u64 & TAG_MASK == 0, "RingOp must be 8-aligned");
        let e = Sqe::Sqe128(entry.user_data(op as u64 | TAG_OP));
        // SAFETY: single-threaded, not re-entered.
        let backlog = unsafe { &mut *self.backlog.get() };
        // SAFETY: see `ring()`; the SQ borrow ends in `push`. The ring has
        // 128-byte SQEs (checked above), and the caller keeps the op and
        // the entry's memory valid until the final CQE.
        if !(backlog.is_empty() && unsafe { self.ring().push(&[&e]) }) {
            backlog.push_back((e, false));
        }
        self.inflight.set(self.inflight.get() + 1);
        Ok(())
    }

    /// Submits `bio` (read, write, flush, discard or write-zeroes) against the
    /// file `fd`, at the bio's sector plus `base` bytes. `fua` turns a write
    /// into a durable one (RWF_DSYNC); `block_device` picks the discard
    /// and zeroing mechanism: a block device zeroes with ZERO_RANGE (the
    /// kernel's zeroout, which falls back to writing zeroes); a regular file
    /// punches a hole for both, as the kernel's loop driver does, since not
    /// every filesystem has ZERO_RANGE (tmpfs does not).
    pub fn submit_bio(&self, fd: RingFd, bio: BioPtr, base: u64, fua: bool, block_device: bool) {
        let e = self.bio_entry(fd, bio, base, fua, block_device);
        // SAFETY: the entry points at the bio's segments (or at the segment
        // array inside the descriptor, for readv/writev); we own the bio via
        // user_data until the CQE, and add_seg's contract keeps the segments'
        // memory valid until the bio completes.
        unsafe { self.push(e) };
    }

    /// Builds the SQE for `bio`, which it then owns through `user_data`.
    #[inline]
    fn bio_entry(
        &self,
        fd: RingFd,
        bio: BioPtr,
        base: u64,
        fua: bool,
        block_device: bool,
    ) -> squeue::Entry {
        let off = base + (bio.sector << SECTOR_SHIFT);
        let len = bio.len();
        let segs = bio.segs();
        let e = match bio.op {
            Op::Read | Op::Write => {
                let write = bio.op == Op::Write;
                let rw_flags = if write && fua { libc::RWF_DSYNC } else { 0 };
                let fixed = bio.buf_index != Bio::NO_BUF && segs.len() == 1 && !self.kind.iopoll;
                if fixed {
                    self.fixed_ops.set(self.fixed_ops.get() + 1);
                }
                match (write, segs.len(), fixed) {
                    (false, 1, true) => with_fd!(fd, f, {
                        opcode::ReadFixed::new(f, segs[0].base, len, bio.buf_index)
                            .offset(off)
                            .build()
                    }),
                    (true, 1, true) => with_fd!(fd, f, {
                        opcode::WriteFixed::new(f, segs[0].base, len, bio.buf_index)
                            .offset(off)
                            .rw_flags(rw_flags)
                            .build()
                    }),
                    (false, 1, false) => with_fd!(fd, f, {
                        opcode::Read::new(f, segs[0].base, len).offset(off).build()
                    }),
                    (true, 1, false) => with_fd!(fd, f, {
                        opcode::Write::new(f, segs[0].base, len)
                            .offset(off)
                            .rw_flags(rw_flags)
                            .build()
                    }),
                    (false, n, _) => with_fd!(fd, f, {
                        opcode::Readv::new(f, segs.as_ptr().cast(), n as u32)
                            .offset(off)
                            .build()
                    }),
                    (true, n, _) => with_fd!(fd, f, {
                        opcode::Writev::new(f, segs.as_ptr().cast(), n as u32)
                            .offset(off)
                            .rw_flags(rw_flags)
                            .build()
                    }),
                }
            }
            Op::Flush => with_fd!(fd, f, {
                opcode::Fsync::new(f)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build()
            }),
            Op::Discard => with_fd!(fd, f, {
                opcode::Fallocate::new(f, len as u64)
                    .offset(off)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }),
            Op::WriteZeroes => with_fd!(fd, f, {
                opcode::Fallocate::new(f, len as u64)
                    .offset(off)
                    .mode(if block_device {
                        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                    } else {
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                    })
                    .build()
            }),
        };
        self.bios.set(self.bios.get() + 1);
        e.user_data(bio.into_raw() as u64)
    }

    /// Submits `bio` as [`Ring::submit_bio`] does, behind a data-sync of `fd`
    /// that must complete first (a PREFLUSH ahead of a write). The sync's own
    /// success posts nothing; its failure cancels the bio, which then fails.
    pub fn submit_bio_preflush(
        &self,
        fd: RingFd,
        bio: BioPtr,
        base: u64,
        fua: bool,
        block_device: bool,
    ) {
        let sync = with_fd!(fd, f, {
            opcode::Fsync::new(f)
                .flags(types::FsyncFlags::DATASYNC)
                .build()
        })
        .flags(squeue::Flags::IO_LINK | squeue::Flags::SKIP_SUCCESS)
        .user_data(TAG_IGNORE);
        let e = self.bio_entry(fd, bio, base, fua, block_device);
        // SAFETY: the fsync carries no pointers; the bio's entry is built
        // under submit_bio's argument (owned through user_data until its CQE).
        unsafe { self.push_linked(sync, e) };
        // Only a failed fsync posts a CQE (TAG_IGNORE): not counted in flight.
        self.inflight.set(self.inflight.get() - 1);
    }

    /// Arms a read of the eventfd `fd` into `buf`, whose CQE wakes the reactor.
    ///
    /// # Safety
    /// `buf` must stay valid until the CQE tagged [`TAG_WAKE`] is reaped.
    pub(crate) unsafe fn arm_wake(&self, fd: RawFd, buf: *mut u64) {
        let e = opcode::Read::new(types::Fd(fd), buf.cast(), 8)
            .build()
            .user_data(TAG_WAKE);
        // SAFETY: the caller keeps `buf` valid until the CQE.
        unsafe { self.push(e) };
        // The wake read is not an I/O anyone waits for.
        self.inflight.set(self.inflight.get() - 1);
    }

    /// Passes queued SQEs to the kernel without waiting. Returns how many were
    /// submitted.
    #[inline]
    pub fn submit(&self) -> usize {
        // SAFETY: single-threaded, not re-entered; the borrow ends at once.
        if unsafe { !(*self.backlog.get()).is_empty() } {
            self.drain_backlog();
        }
        // One match on the SQE size per call, not one per step.
        match self.ring() {
            Uring::Sqe64(r) => self.submit_on(r),
            Uring::Sqe128(r) => self.submit_on(r),
        }
    }

    #[inline(always)]
    fn submit_on<S: squeue::EntryMarker>(&self, r: &IoUring<S>) -> usize {
        let (pending, cq_overflow, taskrun) = {
            // SAFETY: see `ring()`; the SQ borrow ends in this block.
            let sq = unsafe { r.submission_shared() };
            (sq.len(), sq.cq_overflow(), sq.taskrun())
        };
        // Completions that overflowed the CQ, and those waiting for deferred
        // task work, only come back through an enter (which the submitter
        // makes with GETEVENTS): without one, a reactor that never sleeps
        // (Poll mode, or busy with a poller) would wait for them forever.
        if pending == 0 && !cq_overflow && !taskrun && !self.kind.iopoll {
            return 0;
        }
        r.submitter().submit().unwrap_or(0)
    }

    /// Submits and waits for a completion, or `timeout`. A ring made on a
    /// thread confined to one CPU waits for a quarter of its bios in flight
    /// (at least one, at most 8).
    ///
    /// Why only there: io-wq workers, which complete what a file cannot do
    /// without blocking (every O_DIRECT I/O to tmpfs), inherit the
    /// submitter's CPUs. Confined to the reactor's one CPU, each wake-up for
    /// a completion is a context switch the worker pays for, and at depth
    /// that is the largest cost there is (4 KiB random writes to a tmpfs
    /// file at QD32: 0.87x fio waking for each, 1.2x gathering). With a CPU
    /// of its own the reactor's wake-ups cost the worker nothing, and
    /// refilling the queue at once wins (random reads, unpinned: 10% fewer
    /// IOPS gathering).
    ///
    /// Only bios count towards the batch: a socket's receive may never
    /// complete, a device's I/O normally does. The rest stay queued at the
    /// device, which never idles while the reactor sleeps; a reactor below
    /// depth 8 still wakes for each completion. A batch waits at most 10 ms,
    /// so a bio that needs this reactor to complete, a message or a request
    /// still gets its turn. The cap is long on purpose: a timer that is the
    /// CPU's next event is reprogrammed on every wait, which traps to the
    /// hypervisor (a 1 ms cap cost 9% of the randwrite figure above, 10 ms
    /// 2%).
    pub fn submit_and_wait(&self, timeout: Option<Duration>) {
        // SAFETY: single-threaded, not re-entered; the borrow ends at once.
        if unsafe { !(*self.backlog.get()).is_empty() } {
            self.drain_backlog();
        }
        let want = wait_target(self.bios.get(), self.wait_batch);
        let timeout = match timeout {
            _ if want == 1 => timeout,
            Some(t) => Some(t.min(WAIT_BATCH_CAP)),
            None => Some(WAIT_BATCH_CAP),
        };
        let sub = self.ring().submitter();
        let r = match timeout {
            Some(t) => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                sub.submit_with_args(want, &args)
            }
            None => sub.submit_and_wait(want),
        };
        // ETIME (timeout) and EINTR just end the wait; the loop reaps what came.
        let _ = r;
    }

    /// Whether [`Ring::submit_and_wait_gathering`] gathers here (the kernel
    /// takes a minimum wait, Linux 6.12).
    pub fn gathers(&self) -> bool {
        self.min_wait
    }

    /// [`Ring::submit_and_wait`], except that once a completion has come the
    /// wait goes on for up to `gather` (io_uring's minimum wait) for more,
    /// [`GATHER_WANT`] at most: a client that keeps sending meanwhile has
    /// its requests taken in one receive and answered in one send, instead
    /// of a wakeup each. With bios in flight (whose batch
    /// [`Ring::submit_and_wait`] already waits for), or on a kernel without
    /// minimum waits, a plain wait.
    pub fn submit_and_wait_gathering(&self, timeout: Option<Duration>, gather: Duration) {
        if !self.min_wait || self.bios.get() > 0 {
            return self.submit_and_wait(timeout);
        }
        // SAFETY: single-threaded, not re-entered; the borrow ends at once.
        if unsafe { !(*self.backlog.get()).is_empty() } {
            self.drain_backlog();
        }
        // The minimum wait needs an overall one; a wait that ends with
        // nothing just goes round the reactor's loop.
        let ts = types::Timespec::from(timeout.unwrap_or(GATHER_TIMEOUT));
        let us = gather.as_micros().clamp(1, u32::MAX as u128) as u32;
        let args = types::SubmitArgs::new().timespec(&ts).min_wait_usec(us);
        // ETIME (timeout) and EINTR just end the wait, as in submit_and_wait.
        let _ = self.ring().submitter().submit_with_args(GATHER_WANT, &args);
    }

    /// Whether completions overflowed the CQ and wait in the kernel for an
    /// enter (which [`Ring::submit`] makes) to post them.
    pub fn cq_overflow(&self) -> bool {
        // SAFETY: see `ring()`; the borrow ends in `sq_state`.
        unsafe { self.ring().sq_state().2 }
    }

    fn sq_len(&self) -> usize {
        // SAFETY: see `ring()`; the borrow ends in `sq_state`.
        unsafe { self.ring().sq_state().0 }
    }

    #[cold]
    fn drain_backlog(&self) {
        // SAFETY: single-threaded and not re-entered: nothing below calls out.
        let backlog = unsafe { &mut *self.backlog.get() };
        while let Some(&(_, linked)) = backlog.front() {
            // SAFETY: see `ring()`; the borrow ends in `sq_state`.
            let cap = unsafe { self.ring().sq_state().1 };
            // A pair enters together; a one-entry SQ (never set up here) could
            // not hold one and gets it an entry at a time.
            let need = (if linked { 2 } else { 1 }).min(cap).min(backlog.len());
            let first = &backlog[0].0;
            // SAFETY: see `ring()`; the SQ borrow ends in `push`. Entries in
            // the backlog were built under push's contract (a 128-byte one
            // only by push_op128, on a 128-byte ring).
            let pushed = unsafe {
                if need == 2 {
                    self.ring().push(&[first, &backlog[1].0])
                } else {
                    self.ring().push(&[first])
                }
            };
            if !pushed {
                // Make room: hand what the SQ holds to the kernel. A SQPOLL
                // thread takes entries in its own time (and not at all while
                // the CQ is overflowing, which only our reaping cures): if
                // that made no room, leave the rest for the next turn rather
                // than spin here. Completions of what is in the SQ wake us.
                let before = self.sq_len();
                if self.ring().submitter().submit().is_err() || self.sq_len() >= before {
                    return;
                }
                continue;
            }
            backlog.drain(..need);
        }
    }

    /// Reaps completions and completes their bios. Returns how many.
    pub fn reap(&self) -> usize {
        // One match on the SQE size per reap, not one per completion.
        match self.ring() {
            Uring::Sqe64(r) => self.reap_from(r),
            Uring::Sqe128(r) => self.reap_from(r),
        }
    }

    #[inline(always)]
    fn reap_from<S: squeue::EntryMarker>(&self, r: &IoUring<S>) -> usize {
        let mut n = 0;
        loop {
            let next = {
                // SAFETY: see `ring()`; the CQ borrow ends before any end_io
                // runs (an end_io may push to this ring: the SQ, untouched here).
                let mut cq = unsafe { r.completion_shared() };
                let e = cq.next().map(|c| (c.user_data(), c.result(), c.flags()));
                cq.sync();
                e
            };
            let Some((ud, res, flags)) = next else {
                return n;
            };
            n += 1;
            match ud {
                TAG_IGNORE => {}
                TAG_WAKE => self.woken.set(true),
                _ if ud & TAG_MASK == TAG_OP => {
                    if !cqe_more(flags) {
                        self.inflight.set(self.inflight.get() - 1);
                    }
                    let op = (ud & !TAG_MASK) as *mut RingOp;
                    // SAFETY: user_data tagged TAG_OP was made by push_op from
                    // a live RingOp, which push_op's contract keeps valid
                    // until its final CQE (this one or a later one).
                    let complete = unsafe { (*op).complete };
                    complete(op, res, flags);
                }
                _ => {
                    self.inflight.set(self.inflight.get() - 1);
                    self.bios.set(self.bios.get() - 1);
                    // SAFETY: every other user_data is a bio pointer that
                    // submit_bio made with into_raw, completed exactly once.
                    let mut bio = unsafe { BioPtr::from_raw(ud as *mut Bio) };
                    let status = if res < 0 {
                        Status::from_errno(-res)
                    } else if bio.op.has_data() && res as u32 != bio.len() {
                        // A short transfer inside a device's bounds is an error.
                        Status::IoErr
                    } else {
                        Status::Ok
                    };
                    bio.set_status(status);
                    bio.endio();
                }
            }
        }
    }
}

/// How many completions a wait gathers with `bios` in flight and a batch of
/// at most `batch`: a quarter of them, so that three quarters stay queued at
/// the device while the reactor sleeps.
fn wait_target(bios: u32, batch: u32) -> usize {
    (bios / 4).clamp(1, batch.max(1)) as usize
}

/// Sets up an io_uring of `kind` with SQEs of type `S` (the crate adds
/// IORING_SETUP_SQE128 for 128-byte ones).
fn build<S: squeue::EntryMarker>(
    entries: u32,
    kind: RingKind,
    deferred_taskrun: bool,
) -> io::Result<IoUring<S>> {
    let mut b = IoUring::<S>::builder();
    b.setup_cqsize(entries * 2).setup_clamp();
    if kind.sqpoll {
        b.setup_sqpoll(2000);
    } else if deferred_taskrun {
        // Completions are only reaped on this thread: let the kernel
        // defer task work to our next enter instead of interrupting
        // us. TASKRUN_FLAG makes the kernel say (IORING_SQ_TASKRUN)
        // when such work waits, so a reactor that spins (or skips the
        // wait because it has work) still enters the kernel to have
        // it run: socket completions are posted only then.
        // DEFER_TASKRUN keeps that work on the ring (not the task's
        // generic task_work list, which a wait must first be
        // signalled out of): a wake-up of a reactor sleeping in the
        // ring goes straight to it, and the enter that wakes runs the
        // ring's work and returns. Measured on NBD 4 KiB reads at QD1:
        // 6 % less server CPU per I/O, 3 % more IOPS. The reactor
        // owns its ring on its own thread (Ring is !Send), as
        // SINGLE_ISSUER and DEFER_TASKRUN require.
        b.setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_defer_taskrun();
    }
    if kind.iopoll {
        b.setup_iopoll();
    }
    b.build(entries)
}

/// Whether the calling thread may run on one CPU only.
fn confined_to_one_cpu() -> bool {
    crate::affinity::allowed_cpus().is_ok_and(|c| c.len() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nop() -> squeue::Entry {
        opcode::Nop::new().build().user_data(TAG_IGNORE)
    }

    fn backlog_len(r: &Ring) -> usize {
        // SAFETY: as above.
        unsafe { (*r.backlog.get()).len() }
    }

    #[repr(C)]
    struct Got {
        op: RingOp,
        res: Cell<Option<i32>>,
    }

    fn got(op: *mut RingOp, res: i32, _flags: u32) {
        // SAFETY: the op pushed below is the first field of a live Got.
        unsafe { (*(op as *mut Got)).res.set(Some(res)) };
    }

    #[test]
    fn a_gathering_wait_goes_on_after_the_first_completion_and_a_plain_one_does_not() {
        let r = Ring::new(8, RingKind::default()).unwrap();
        if !r.gathers() {
            eprintln!("skipped: this kernel has no minimum wait");
            return;
        }
        let wait = |gather: Option<Duration>| {
            let mut g = Got {
                op: RingOp { complete: got },
                res: Cell::new(None),
            };
            // SAFETY: `g` outlives the op: its CQE is reaped below.
            unsafe { r.push_op(opcode::Nop::new().build(), &mut g.op) };
            let t0 = std::time::Instant::now();
            match gather {
                Some(d) => r.submit_and_wait_gathering(None, d),
                None => r.submit_and_wait(None),
            }
            let took = t0.elapsed();
            assert_eq!(r.reap(), 1);
            assert_eq!(g.res.get(), Some(0));
            took
        };
        // The NOP completes at once; the gathering wait still waits its
        // 50 ms for more (it returns early only for GATHER_WANT).
        let plain = wait(None);
        let gathered = wait(Some(Duration::from_millis(50)));
        assert!(gathered >= Duration::from_millis(50), "{gathered:?}");
        assert!(plain < gathered, "{plain:?} against {gathered:?}");
    }

    #[test]
    fn socket_completions_wait_for_the_rings_own_enter_and_submit_makes_it() {
        let r = Ring::new(8, RingKind::default()).unwrap();
        if !r.ring().single_issuer() {
            eprintln!("skipped: this kernel has no DEFER_TASKRUN");
            return;
        }
        let mut fds = [0; 2];
        // SAFETY: socketpair fills the two-element array.
        let rc = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) };
        assert_eq!(rc, 0);
        let mut buf = [0u8; 8];
        let mut g = Got {
            op: RingOp { complete: got },
            res: Cell::new(None),
        };
        let e = opcode::Recv::new(types::Fd(fds[0]), buf.as_mut_ptr(), 8).build();
        // SAFETY: `g` and `buf` outlive the op: its CQE is reaped below.
        unsafe { r.push_op(e, &mut g.op) };
        r.submit(); // nothing to read: the recv waits for data
                    // SAFETY: writing one byte from a live array to our own socket.
        assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
        // The recv's work is deferred to the ring's owner: it did not run
        // on the way back from the write (no interruption of the reactor)...
        assert_eq!(r.reap(), 0);
        assert_eq!(g.res.get(), None);
        // ...but a submit with nothing queued still enters for it, which a
        // spinning reactor relies on to see socket completions at all.
        r.submit();
        assert_eq!(r.reap(), 1);
        assert_eq!(g.res.get(), Some(1));
        assert_eq!(buf[0], b'x');
        for fd in fds {
            // SAFETY: closing the descriptors made above.
            unsafe { libc::close(fd) };
        }
    }

    /// `SOCKET_URING_OP_SIOCINQ` (linux/io_uring.h): a socket's URING_CMD
    /// that answers the bytes waiting to be read, since Linux 6.7.
    const SOCKET_URING_OP_SIOCINQ: u32 = 0;

    #[test]
    fn a_128_byte_ring_carries_uring_cmds_and_plain_entries_through_its_backlog() {
        let r = Ring::new(
            2,
            RingKind {
                sqe128: true,
                ..RingKind::default()
            },
        )
        .unwrap();
        // A TCP connection: AF_UNIX sockets take no URING_CMD.
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (rx, _) = l.accept().unwrap();
        tx.write_all(b"abc").unwrap();
        let fd = rx.as_raw_fd();
        let mut buf = [0u8; 8];
        let mut g: Vec<Got> = (0..4)
            .map(|_| Got {
                op: RingOp { complete: got },
                res: Cell::new(None),
            })
            .collect();
        // Four entries on a two-slot SQ: two wait in the backlog, in order.
        for g in &mut g[..3] {
            let cmd = opcode::UringCmd80::new(types::Fd(fd), SOCKET_URING_OP_SIOCINQ).build();
            // SAFETY: the cmd names no memory; `g` outlives its CQE (reaped below).
            unsafe { r.push_op128(cmd, &mut g.op) }.unwrap();
        }
        let e = opcode::Recv::new(types::Fd(fd), buf.as_mut_ptr(), 8).build();
        // SAFETY: `g[3]` and `buf` outlive the op: its CQE is reaped below.
        unsafe { r.push_op(e, &mut g[3].op) };
        assert_eq!((r.sq_len(), backlog_len(&r)), (2, 2));
        while g.iter().any(|g| g.res.get().is_none()) {
            r.submit_and_wait(Some(Duration::from_secs(1)));
            r.reap();
        }
        let res: Vec<i32> = g.iter().map(|g| g.res.get().unwrap()).collect();
        if res[0] == -libc::EOPNOTSUPP || res[0] == -libc::EINVAL {
            eprintln!("skipped: this kernel has no socket URING_CMD ({})", res[0]);
            return;
        }
        // The commands ran before the receive took the bytes.
        assert_eq!(res, [3, 3, 3, 3]);
        assert_eq!(&buf[..3], b"abc");
    }

    #[test]
    fn a_64_byte_ring_refuses_a_128_byte_entry() {
        let r = Ring::new(2, RingKind::default()).unwrap();
        let mut g = Got {
            op: RingOp { complete: got },
            res: Cell::new(None),
        };
        let cmd = opcode::UringCmd80::new(types::Fd(0), SOCKET_URING_OP_SIOCINQ).build();
        // SAFETY: refused before it reaches the ring.
        let e = unsafe { r.push_op128(cmd, &mut g.op) }.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!((r.inflight(), r.sq_len()), (0, 0));
    }

    #[test]
    fn a_wait_gathers_a_quarter_of_the_bios_in_flight_up_to_the_batch() {
        // Shallow queues wake for every completion...
        for bios in 0..8 {
            assert_eq!(wait_target(bios, WAIT_BATCH_MAX), 1, "{bios} in flight");
        }
        // ...deeper ones for a quarter of what is in flight, at most 8.
        assert_eq!(wait_target(8, WAIT_BATCH_MAX), 2);
        assert_eq!(wait_target(31, WAIT_BATCH_MAX), 7);
        assert_eq!(wait_target(32, WAIT_BATCH_MAX), 8);
        assert_eq!(wait_target(1024, WAIT_BATCH_MAX), 8);
        // A ring that is not confined to one CPU always wakes for each.
        assert_eq!(wait_target(1024, 1), 1);
    }

    /// Runs `f` on a thread allowed only the CPUs in `cpus`.
    fn on_cpus<T: Send>(cpus: &[usize], f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                crate::affinity::set_allowed_cpus(cpus).unwrap();
                f()
            })
            .join()
            .unwrap()
        })
    }

    #[test]
    fn only_a_ring_made_on_a_thread_confined_to_one_cpu_gathers() {
        let batch = |cpus: &[usize]| {
            on_cpus(cpus, || {
                Ring::new(8, RingKind::default()).unwrap().wait_batch
            })
        };
        assert_eq!(batch(&[0]), WAIT_BATCH_MAX);
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        if n >= 2 {
            assert_eq!(batch(&[0, 1]), 1);
        }
    }

    #[test]
    fn a_linked_pair_never_straddles_a_submission() {
        let r = Ring::new(2, RingKind::default()).unwrap();
        // SAFETY: nops carry no pointers.
        unsafe { r.push(nop()) };
        assert_eq!(r.sq_len(), 1);
        // One slot left: the pair must wait whole in the backlog, not put
        // its first half (the one with IO_LINK) at the end of this batch.
        // SAFETY: as above.
        unsafe { r.push_linked(nop().flags(squeue::Flags::IO_LINK), nop()) };
        assert_eq!((r.sq_len(), backlog_len(&r)), (1, 2));
        // Entries pushed later queue behind the backlog, keeping order.
        // SAFETY: as above.
        unsafe { r.push(nop()) };
        assert_eq!((r.sq_len(), backlog_len(&r)), (1, 3));
        // Draining submits the lone nop to make room, then the pair as one
        // batch of its own, and leaves the last nop queued.
        r.drain_backlog();
        assert_eq!((r.sq_len(), backlog_len(&r)), (1, 0));
        r.submit();
        assert_eq!(r.sq_len(), 0);
    }
}
