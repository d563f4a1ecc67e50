//! One queue of a ublk device, served on one reactor: its requests arrive
//! as completions of FETCH_REQ URING_CMDs on the reactor's own ring (which
//! has 128-byte SQEs), go through the export front as bios on the same
//! ring, and are answered with COMMIT_AND_FETCH_REQ, which also fetches
//! the tag's next request. One `io_uring_enter` per reactor turn carries
//! the commits and the backend I/O together.
//!
//! ```text
//!  kernel ──FETCH cqe(tag)──▶ Queue::fetched ── desc[tag] ──▶ Front::submit
//!  kernel ◀──COMMIT_AND_FETCH(tag, result)── Queue::commit ◀── done
//! ```
//!
//! The data moves by copy: the driver copies a write's data into the tag's
//! buffer before the request arrives, and a read's data out of it when the
//! commit arrives.
//!
//! With queued (or stream) dispatch, the requests that one reap of the
//! ring brings (the driver hands over what queued up while the server was
//! busy in one task-work run) are held by the front and unplugged together
//! at the end of the reactor's turn, sorted and merged, by a poller the first request
//! of the batch queues on the reactor's work queue: direct dispatch pays
//! nothing for it.

use std::cell::Cell;
use std::os::fd::RawFd;
use std::rc::Rc;

use udm_core::io_uring::{opcode, types};
use udm_core::{Dispatch, Error, ErrorKind, Mmap, Poller, Ring, RingOp, WorkQueue};

use super::sys::{self, IoCmd, IoDesc};
use crate::front::{Done, Front, FrontError, FrontOp, ReqFlags, Request, Submitted};

/// Queued, stream or auto dispatch: unplugs the front once the turn's requests
/// are in.
struct Unplug {
    front: Rc<Front>,
    /// On the work queue now.
    armed: Cell<bool>,
}

impl Poller for Unplug {
    fn poll(&self) -> usize {
        self.armed.set(false);
        self.front.unplug();
        // The bios went to the ring, whose submission ends the turn: no
        // need for another turn at once.
        0
    }

    fn pending(&self) -> bool {
        false
    }
}

/// A tag's ring operation: its fetch (or commit-and-fetch) in flight.
#[repr(C)]
struct Tag {
    /// First field: the ring hands this pointer back on completion.
    op: RingOp,
    queue: *const Queue,
    tag: u16,
}

/// One queue on its reactor. Boxed: its tags point back at it.
pub(crate) struct Queue {
    q_id: u16,
    cdev: RawFd,
    ring: Rc<Ring>,
    front: Rc<Front>,
    /// Queued, stream or auto dispatch: the reactor's work queue and what unplugs
    /// the front.
    unplug: Option<(WorkQueue, Rc<Unplug>)>,
    read_only: bool,
    /// The kernel's descriptor array for this queue (read-only for us).
    descs: Mmap,
    /// One buffer of `buf_bytes` per tag.
    bufs: Mmap,
    buf_bytes: u32,
    tags: Box<[Tag]>,
    /// Tags whose commands the kernel still holds (not aborted).
    live: Cell<u32>,
}

impl Queue {
    /// Queue `q_id` of depth `depth` on the device whose char device is
    /// `cdev`, with the front's device served on `ring` (the reactor's,
    /// whose `work` queue unplugs a queued front).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        q_id: u16,
        depth: u16,
        buf_bytes: u32,
        cdev: RawFd,
        ring: Rc<Ring>,
        work: WorkQueue,
        front: Rc<Front>,
        read_only: bool,
    ) -> Result<Box<Queue>, Error> {
        if !ring.kind().sqe128 {
            return Err(Error::new(
                ErrorKind::Invalid,
                "a ublk queue needs a reactor ring with 128-byte SQEs",
            ));
        }
        let descs = Mmap::fd(
            cdev,
            sys::queue_desc_offset(q_id),
            sys::queue_desc_bytes(depth as u32),
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_POPULATE,
        )
        .map_err(|e| e.context(format_args!("queue {q_id}'s descriptors")))?;
        let bufs = Mmap::anon(depth as usize * buf_bytes as usize)
            .map_err(|e| e.context(format_args!("queue {q_id}'s buffers")))?;
        let unplug = (front.dispatch() != Dispatch::Direct).then(|| {
            let u = Rc::new(Unplug {
                front: front.clone(),
                armed: Cell::new(false),
            });
            (work, u)
        });
        let mut q = Box::new(Queue {
            q_id,
            cdev,
            ring,
            front,
            unplug,
            read_only,
            descs,
            bufs,
            buf_bytes,
            tags: Box::new([]),
            live: Cell::new(0),
        });
        let qp: *const Queue = &*q;
        q.tags = (0..depth)
            .map(|tag| Tag {
                op: RingOp { complete },
                queue: qp,
                tag,
            })
            .collect();
        Ok(q)
    }

    /// Sends every tag's first FETCH_REQ.
    pub(crate) fn fetch_all(&self) -> Result<(), Error> {
        for t in 0..self.tags.len() as u16 {
            self.command(t, sys::UBLK_U_IO_FETCH_REQ, -1)?;
            self.live.set(self.live.get() + 1);
        }
        Ok(())
    }

    /// Whether the kernel has aborted every tag (the device stopped) and
    /// nothing is left in flight.
    pub(crate) fn finished(&self) -> bool {
        self.live.get() == 0 && self.front.in_flight() == 0
    }

    fn buf(&self, tag: u16) -> *mut u8 {
        // SAFETY: `tag` < depth, so the offset lies inside the buffers' mapping.
        unsafe {
            self.bufs
                .as_ptr()
                .add(tag as usize * self.buf_bytes as usize)
        }
    }

    fn command(&self, tag: u16, op: u32, result: i32) -> Result<(), Error> {
        let cmd = IoCmd {
            q_id: self.q_id,
            tag,
            result,
            addr: self.buf(tag) as u64,
        };
        let e = opcode::UringCmd80::new(types::Fd(self.cdev), op)
            .cmd(sys::cmd_bytes(&cmd))
            .build();
        let op = std::ptr::addr_of!(self.tags[tag as usize].op).cast_mut();
        // SAFETY: the op is the first field of a #[repr(C)] Tag in this
        // boxed queue, which outlives its commands (the queue's thread
        // keeps it until `finished`, i.e. until the kernel has aborted
        // every tag's command). The command names the tag's buffer, which
        // the queue's mapping keeps for as long; `complete` only reads
        // through the pointer.
        unsafe { self.ring.push_op128(e, op) }
            .map_err(|e| Error::os(format!("queue {}: URING_CMD", self.q_id), e))
    }

    /// A tag's command completed: `res` is a request (OK), an abort, or an
    /// error.
    fn fetched(&self, tag: u16, res: i32) {
        if res != sys::UBLK_IO_RES_OK {
            if res != sys::UBLK_IO_RES_ABORT {
                tracing::warn!(
                    "ublk queue {} tag {tag}: command failed: {}",
                    self.q_id,
                    std::io::Error::from_raw_os_error(-res)
                );
            }
            self.live.set(self.live.get() - 1);
            return;
        }
        // SAFETY: the kernel wrote the tag's descriptor before completing
        // its fetch and leaves it alone until our commit; `tag` < depth,
        // inside the mapping. Read once, by value.
        let d: IoDesc = unsafe {
            std::ptr::read_volatile(self.descs.as_ptr().cast::<IoDesc>().add(tag as usize))
        };
        let bytes = (d.nr_sectors as u64) << 9;
        let op = match d.op() {
            sys::UBLK_IO_OP_READ => FrontOp::Read,
            sys::UBLK_IO_OP_WRITE => FrontOp::Write,
            sys::UBLK_IO_OP_FLUSH => FrontOp::Flush,
            sys::UBLK_IO_OP_DISCARD => FrontOp::Discard,
            sys::UBLK_IO_OP_WRITE_ZEROES => FrontOp::WriteZeroes,
            _ => return self.commit(tag, -libc::EOPNOTSUPP),
        };
        let data = matches!(op, FrontOp::Read | FrontOp::Write);
        if data && bytes > self.buf_bytes as u64 {
            return self.commit(tag, -libc::EINVAL);
        }
        // A flush changes nothing: a read-only device takes it too.
        if !matches!(op, FrontOp::Read | FrontOp::Flush) && self.read_only {
            return self.commit(tag, -libc::EROFS);
        }
        let len = bytes.min(u32::MAX as u64) as u32;
        let req = Request {
            op,
            offset: d.start_sector << 9,
            len,
            flags: ReqFlags {
                fua: d.op_flags & sys::UBLK_IO_F_FUA != 0,
                no_hole: d.op_flags & sys::UBLK_IO_F_NOUNMAP != 0,
                ..ReqFlags::default()
            },
            buf: self.buf(tag),
            buf_index: udm_core::Bio::NO_BUF,
            // The tag, and what a success answers (bytes for data).
            token: tag as u64 | (if data { len as u64 } else { 0 }) << 16,
            done,
            ctx: (self as *const Queue).cast_mut().cast(),
        };
        // SAFETY: a data request's `len` bytes lie in the tag's buffer
        // (checked against buf_bytes above), which nothing touches until
        // the request is finished and committed.
        match unsafe { self.front.submit(req) } {
            Submitted::Later => self.plugged(),
            Submitted::Now(r) => self.commit(tag, result(req.token, r)),
        }
    }

    /// Queued or stream dispatch: a request may be held; unplug at the
    /// turn's end.
    #[inline]
    fn plugged(&self) {
        if let Some((work, u)) = &self.unplug {
            if !u.armed.replace(true) {
                work.queue(u.clone());
            }
        }
    }

    /// Answers `tag` with `res` and fetches its next request.
    fn commit(&self, tag: u16, res: i32) {
        if let Err(e) = self.command(tag, sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ, res) {
            // Only on a ring without 128-byte SQEs, which `new` refuses.
            tracing::error!("{e}");
        }
    }
}

/// A commit's result for the request with `token`: bytes or -errno.
fn result(token: u64, r: Result<(), FrontError>) -> i32 {
    match r {
        Ok(()) => (token >> 16) as i32,
        Err(FrontError::Io) => -libc::EIO,
        Err(FrontError::Invalid) => -libc::EINVAL,
        Err(FrontError::NoSpace) => -libc::ENOSPC,
        Err(FrontError::NoMemory) => -libc::ENOMEM,
        Err(FrontError::NotFast | FrontError::NotSupported) => -libc::EOPNOTSUPP,
    }
}

fn complete(op: *mut RingOp, res: i32, _flags: u32) {
    // SAFETY: every op the queue pushes is the first field of one of its
    // #[repr(C)] tags, whose queue outlives the command (see `command`).
    let t = unsafe { &*op.cast::<Tag>() };
    // SAFETY: as above: the tag's queue is alive.
    unsafe { &*t.queue }.fetched(t.tag, res);
}

fn done(ctx: *mut (), d: Done<'_>) {
    // SAFETY: `ctx` is the queue that submitted the request (`fetched`),
    // alive until every request it submitted is finished.
    let q = unsafe { &*ctx.cast::<Queue>() };
    q.commit((d.token & 0xffff) as u16, result(d.token, d.result));
}
