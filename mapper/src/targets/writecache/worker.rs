//! The writecache's worker (the kernel's workqueue): its state on its own
//! reactor and the I/O it issues to the origin and the cache. What it does
//! with them is in load.rs, commit.rs and clean.rs; when, in writeback.rs.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use udm_core::{AlignedBuf, BioFlags, BioPtr, Caps, Channel, Op, Reactor, Status};

use super::meta::MBLOCK_BYTES;
use super::state::{Shared, State};

/// Largest origin write writeback issues (and metadata I/O, see
/// [`Worker::max_meta_io`]).
pub(crate) const MAX_RUN_BYTES: u64 = 1 << 20;

/// What an I/O's completion runs, with the buffer handed back.
pub(crate) type Done = Box<dyn FnOnce(Status, AlignedBuf)>;

struct IoCtx {
    buf: AlignedBuf,
    done: Done,
}

/// The worker's state; it lives on its reactor's thread only.
pub(crate) struct Worker {
    pub shared: Arc<Shared>,
    reactor: *const Reactor,
    origin: Rc<dyn Channel>,
    cache: Rc<dyn Channel>,
    /// Its I/Os in flight (the thread ends once none is left).
    pub inflight: Cell<u64>,
    pub commit_busy: Cell<bool>,
    pub wb_busy: Cell<bool>,
    pub cache_fua: bool,
    /// Writeback buffers handed back after their origin write, reused so
    /// that a buffer is zeroed once, not per group (zeroing every group's
    /// buffer before the cache reads overwrite it cost the worker a third
    /// of its instructions at 512-byte blocks).
    pub bufs: RefCell<Vec<AlignedBuf>>,
    /// A commit waiting for its generation's data writes to drain (see
    /// `State::unwritten`): its generation and continuation.
    pub barrier_then: RefCell<Option<(u64, Then)>>,
}

/// A commit's continuation: told whether the commit succeeded.
pub(crate) type Then = Option<Box<dyn FnOnce(bool)>>;

fn io_done(bio: BioPtr) {
    // SAFETY: private is the Box<IoCtx> leaked in `Worker::io`, taken back once.
    let ctx = unsafe { Box::from_raw(bio.private() as *mut IoCtx) };
    let s = bio.status();
    drop(bio);
    let IoCtx { buf, done } = *ctx;
    done(s, buf);
}

impl Worker {
    /// The worker of `shared` on `reactor`, with its channels there.
    ///
    /// # Safety
    /// `reactor` outlives the worker and every I/O it issues (`run` drains
    /// them before the reactor is dropped).
    pub unsafe fn new(
        shared: Arc<Shared>,
        reactor: &Reactor,
        origin: Rc<dyn Channel>,
        cache: Rc<dyn Channel>,
    ) -> Worker {
        Worker {
            cache_fua: shared.cfg.cache.caps().contains(Caps::FUA),
            shared,
            reactor: reactor as *const Reactor,
            origin,
            cache,
            inflight: Cell::new(0),
            commit_busy: Cell::new(false),
            wb_busy: Cell::new(false),
            bufs: RefCell::new(Vec::new()),
            barrier_then: RefCell::new(None),
        }
    }

    pub fn reactor(&self) -> &Reactor {
        // SAFETY: the worker lives inside `run`, on the reactor's thread,
        // and `run` drains all of its I/O before the reactor is dropped.
        unsafe { &*self.reactor }
    }

    /// Issues one I/O on `ch` with `buf` as its data (moved in, handed back
    /// to `done`).
    pub fn io(
        self: &Rc<Self>,
        cache: bool,
        op: Op,
        flags: BioFlags,
        sector: u64,
        mut buf: AlignedBuf,
        done: impl FnOnce(Status, AlignedBuf) + 'static,
    ) {
        let mut bio = self.reactor().alloc_bio();
        bio.flags = flags;
        if op.has_data() {
            bio.op = op;
            bio.sector = sector;
            // SAFETY: the buffer moves into the IoCtx below, which keeps it
            // (its heap block does not move) until io_done runs.
            unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
        } else {
            bio.set_dataless(op, sector, 0);
        }
        self.issue(cache, bio, buf, Box::new(done));
    }

    /// Submits `bio` on the cache (or origin) channel, counted in flight
    /// until `done` runs; `buf` (what the bio's segment points into, or
    /// empty) is kept alive until then and handed back to `done`.
    pub fn issue(self: &Rc<Self>, cache: bool, mut bio: BioPtr, buf: AlignedBuf, done: Done) {
        self.inflight.set(self.inflight.get() + 1);
        let me = self.clone();
        let ctx = Box::new(IoCtx {
            buf,
            done: Box::new(move |s, b| {
                me.inflight.set(me.inflight.get() - 1);
                done(s, b)
            }),
        });
        bio.set_end_io(io_done, Box::into_raw(ctx).cast());
        if cache {
            self.cache.submit(bio)
        } else {
            self.origin.submit(bio)
        }
    }

    /// Issues one I/O on `ch` whose data is `len` bytes at `data`, which
    /// the worker owns.
    ///
    /// # Safety
    /// `data..data + len` stays valid until `done` runs, and nobody else
    /// writes it meanwhile (for a write; for a read, nobody else touches
    /// it).
    pub unsafe fn io_at(
        self: &Rc<Self>,
        cache: bool,
        op: Op,
        sector: u64,
        data: *mut u8,
        len: usize,
        done: impl FnOnce(Status) + 'static,
    ) {
        let mut bio = self.reactor().alloc_bio();
        bio.op = op;
        bio.sector = sector;
        // SAFETY: the caller keeps the range valid until `done` runs.
        unsafe { bio.add_seg(data, len) };
        self.issue(
            cache,
            bio,
            AlignedBuf::default(),
            Box::new(move |s, _| done(s)),
        );
    }

    pub fn fail(&self, st: &mut State) {
        st.error = Status::IoErr.errno();
    }

    /// The most bytes of metadata one I/O carries (a commit's write, a
    /// load's read): MAX_RUN_BYTES, or less if the cache device takes less
    /// in one I/O, in whole metadata blocks.
    pub fn max_meta_io(&self) -> usize {
        let l = self.shared.cfg.cache.limits();
        (l.max_io_bytes as usize)
            .min(MAX_RUN_BYTES as usize)
            .max(MBLOCK_BYTES)
            / MBLOCK_BYTES
            * MBLOCK_BYTES
    }
}
