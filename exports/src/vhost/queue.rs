//! A virtqueue on its reactor: the kick eventfd polled on the reactor's
//! io_uring, descriptor chains walked into requests to the export front
//! with guest memory as the buffers, completions written to the used
//! ring, and the driver notified through the call eventfd at the end of
//! the turn (once for all that completed in it).
//!
//! The rings are read and written through the queue's own map of guest
//! memory, not virtio-queue's generic accessors: each ring is looked up
//! once, as the queue starts and when the memory changes, and where it
//! lies whole in one region its entries are a load or store at an offset
//! (else each access looks its address up among the regions): the avail
//! index once per batch, the heads and descriptors, and each used element
//! as its request completes; the used index is stored once per turn (store-release,
//! after the elements), before the EVENT_IDX check of whether the driver
//! wants a call (after a full fence, as virtio's rules want).
//!
//! What a request costs in system calls and notifications:
//! - The kick is one multishot poll, armed once: a kick costs a CQE, not a
//!   `read` of the eventfd and a new poll. Its counter is never read (a
//!   poll CQE follows each write to it, whatever the count).
//! - A queue that took requests is polled, not kicked: notifications stay
//!   off (EVENT_IDX: `avail_event` is left behind, so the driver kicks at
//!   most once more) and each turn of the reactor reads the avail index,
//!   while the reactor spins. Only when it is about to sleep
//!   ([`Poller::must_spin`]) are notifications turned on again, and the
//!   ring checked once more for what came meanwhile. A driver that keeps
//!   the queue busy then makes no `write` per batch, and the server no
//!   wakeup.
//!
//! A reactor owns its queues: nothing here is shared or locked. The
//! control thread reaches a queue only through messages to its reactor
//! ([`Worker::start`], [`Worker::stop`], [`Worker::set_call`],
//! [`Worker::set_mem`]).

use std::cell::RefCell;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use udm_core::io_uring::{opcode, types};
use udm_core::{cqe_more, Bio, BioPtr, BlockDevice, Poller, Reactor, RingOp};
use virtio_bindings::virtio_blk::*;
use virtio_queue::{Queue, QueueT};

use super::chain::{self, Seg};
use super::config::{Shared, MAX_RANGES, MAX_RANGE_SECTORS};
use super::fixed::{Guest, Registry};
use super::inflight::QueueInflight;
use super::memory::{self, Memory};
use crate::front::{Done, Front, FrontError, FrontOp, ReqFlags, Request, Submitted};

const S_OK: u8 = VIRTIO_BLK_S_OK as u8;
const S_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const S_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// What the control thread hands a reactor to run queue `index`.
pub struct Start {
    /// The queue's index.
    pub index: u16,
    /// The ring, set up and valid for `mem`.
    pub queue: Queue,
    /// The guest's memory.
    pub mem: Arc<Memory>,
    /// The driver's kick eventfd.
    pub kick: File,
    /// The call eventfd (None: the driver polls).
    pub call: Option<File>,
    /// Inflight tracking (INFLIGHT_SHMFD), when the frontend set it up.
    pub inflight: Option<QueueInflight>,
}

/// One request in flight, at its chain's head in [`VQueue::reqs`]: what is
/// left of it, and where its status goes.
struct VReq {
    /// Front requests in flight, plus one while it is being submitted
    /// (0: the head's slot is free).
    pending: u32,
    status: u8,
    status_ptr: *mut u8,
    /// Bytes written into the chain (the used element's length).
    written: u32,
    /// Keeps the memory its pointers are in mapped, and registered.
    _mem: Option<Rc<Guest>>,
}

impl VReq {
    const FREE: VReq = VReq {
        pending: 0,
        status: S_OK,
        status_ptr: std::ptr::null_mut(),
        written: 0,
        _mem: None,
    };
}

/// One queue on its reactor. Boxed (its kick op's address is handed to
/// the ring); freed by the worker once stopped, with no kick read and no
/// request in flight.
#[repr(C)]
pub struct VQueue {
    kick_op: RingOp,
    /// The kick poll is armed (until its final CQE).
    kick_inflight: bool,
    /// Cancels the kick poll when the queue stops.
    cancel_op: RingOp,
    cancel_inflight: bool,
    /// Notifications are off and the worker polls the avail ring
    /// (the queue is in [`Worker::polled`]).
    polled: bool,
    kick: File,
    call: Option<File>,
    index: u16,
    queue: Queue,
    mem: Rc<Guest>,
    front: Rc<Front>,
    shared: Arc<Shared>,
    /// Requests in flight, by head: a head names one chain until its
    /// used element is written (the driver may not offer it again before;
    /// one that does is refused, [`VQueue::take`]), so the head is the
    /// request's key, with no allocator to keep.
    reqs: Vec<VReq>,
    /// How many of `reqs` are in flight.
    in_flight: usize,
    segs: Vec<Seg>,
    worker: *const Worker,
    in_dirty: bool,
    /// Completed requests were added to the used ring since the last
    /// notification check.
    used_added: bool,
    /// Used elements added since the last notification check (EVENT_IDX
    /// calls when the used index crossed `used_event` among them).
    num_added: u16,
    /// Used elements were written and the used index not yet stored.
    used_unpublished: bool,
    /// The next notification check calls the driver whatever its
    /// used_event says (see [`Worker::start`]).
    call_anyway: bool,
    /// Requests wait in the ring because as many as it holds are in flight.
    throttled: bool,
    /// Set by [`Worker::stop`]: answered with the next available index
    /// once nothing is in flight.
    stop: Option<Sender<u16>>,
    /// The ring is unusable (its memory refused an access): nothing more
    /// is taken from it.
    broken: bool,
    /// Heads taken and not answered, in the frontend's shared file.
    inflight: Option<QueueInflight>,
    /// The rings, where they lie whole in one region of `mem`.
    rings: Rings,
}

/// Where a queue's rings are mapped here, each when it lies whole in one
/// region of the guest's memory (null: each access looks its address up,
/// and refuses what is outside). Mapped again with the memory
/// ([`Worker::set_mem`]): valid as long as the queue's `mem`.
#[derive(Clone, Copy)]
struct Rings {
    /// The descriptor table (size × 16 bytes).
    desc: *const u8,
    /// The avail ring: flags, index, the heads, used_event.
    avail: *mut u8,
    /// The used ring: flags, index, the elements, avail_event.
    used: *mut u8,
}

impl Rings {
    fn map(q: &Queue, mem: &Memory) -> Rings {
        let size = u32::from(q.size());
        // A ring's slot is its index masked with size - 1 (virtio-queue
        // takes sizes that are powers of 2 only; any other is looked up).
        let ok = q.ready() && size.is_power_of_two();
        let at = |addr: u64, len: u32| match mem.map(addr, len) {
            Some(p) if ok && addr != 0 => p,
            _ => std::ptr::null_mut(),
        };
        Rings {
            desc: at(q.desc_table(), 16 * size),
            avail: at(q.avail_ring(), 6 + 2 * size),
            used: at(q.used_ring(), 6 + 8 * size),
        }
    }
}

fn status_of(e: FrontError) -> u8 {
    match e {
        FrontError::NotSupported => S_UNSUPP,
        _ => S_IOERR,
    }
}

impl VQueue {
    fn worker(&self) -> &Worker {
        // SAFETY: the worker frees its queues before it goes (Worker::release).
        unsafe { &*self.worker }
    }

    /// Posts a multishot poll of the kick eventfd on the reactor's ring: a
    /// CQE per kick, with nothing to read or re-arm.
    fn arm_kick(&mut self) {
        if self.kick_inflight || self.stop.is_some() || self.broken {
            return;
        }
        let e = opcode::PollAdd::new(types::Fd(self.kick.as_raw_fd()), libc::POLLIN as u32)
            .multi(true)
            .build();
        self.kick_inflight = true;
        let op: *mut RingOp = &mut self.kick_op;
        // SAFETY: the op is a field of this boxed queue, which is freed
        // only once kick_inflight is false again (the final CQE arrived:
        // Worker::retire checks it); the kick file stays open as long as
        // the queue.
        unsafe { self.worker().reactor().ring().push_op(e, op) };
    }

    /// Ends the kick poll (the queue stops): its final CQE follows.
    fn cancel_kick(&mut self) {
        if !self.kick_inflight || self.cancel_inflight {
            return;
        }
        let e = opcode::AsyncCancel::new(RingOp::user_data(&self.kick_op)).build();
        self.cancel_inflight = true;
        let op: *mut RingOp = &mut self.cancel_op;
        // SAFETY: as in arm_kick: the queue is freed only once
        // cancel_inflight is false again (retirable()).
        unsafe { self.worker().reactor().ring().push_op(e, op) };
    }

    fn on_kick(&mut self, res: i32, flags: u32) {
        if !cqe_more(flags) {
            self.kick_inflight = false;
        }
        if self.stop.is_some() {
            self.dirty();
            return;
        }
        if res < 0 && res != -libc::EINTR && res != -libc::EAGAIN && res != -libc::ECANCELED {
            tracing::warn!(
                "vhost: queue {}: polling its kick eventfd: {}",
                self.index,
                std::io::Error::from_raw_os_error(-res)
            );
            self.broken = true;
            self.dirty();
            return;
        }
        // A kick after the ring is read posts another CQE. A poll the
        // kernel ended (a full CQ ends multishot) is armed again.
        self.process();
        self.arm_kick();
    }

    /// Takes every available chain, then sends what the front holds of
    /// them: also when the ring breaks mid-batch, since the chains taken
    /// before are in flight and must complete (a stop waits for them).
    fn process(&mut self) -> usize {
        let n = self.take_all();
        self.front.unplug();
        n
    }

    /// Takes every available chain, with notifications off; the queue is
    /// then polled ([`Worker::poll`]) until the reactor is about to sleep
    /// ([`VQueue::quiesce`]). Returns how many it took.
    fn take_all(&mut self) -> usize {
        let mem = self.mem.clone();
        let mut n = 0;
        if !self.polled {
            if self.queue.disable_notification(&mem.guest).is_err() {
                self.fail_ring("its avail ring is outside guest memory");
                return 0;
            }
            self.polled = true;
            let p: *mut VQueue = self;
            self.worker().polled.borrow_mut().push(p);
        }
        // The avail index once per batch (what comes meanwhile is the
        // next turn's), the heads read through the queue's own map.
        let size = self.queue.size();
        let ring = self.queue.avail_ring();
        let rings = self.rings;
        let mut next = self.queue.next_avail();
        let avail = if !rings.avail.is_null() {
            // Acquire: the heads and descriptors it covers are seen.
            // SAFETY: the ring is mapped whole at rings.avail (Rings::map),
            // in guest memory the queue's Rc<Guest> keeps mapped.
            unsafe { load_acquire_u16(rings.avail.add(2)) }
        } else if self.queue.ready() && ring != 0 {
            match mem.map(ring.wrapping_add(2), 2) {
                // Acquire: the heads and descriptors it covers are seen.
                // SAFETY: `map` vouched for 2 bytes at p, in guest memory
                // the queue's Rc<Guest> keeps mapped.
                Some(p) => unsafe { load_acquire_u16(p) },
                None => {
                    self.fail_ring("its avail ring is outside guest memory");
                    return n;
                }
            }
        } else {
            next
        };
        if avail.wrapping_sub(next) > size {
            // More than the ring holds: the driver is broken (virtio-queue
            // refuses such an index too). Stopped, not polled forever.
            self.fail_ring("its avail index is further ahead than the ring holds");
            return n;
        }
        if !rings.avail.is_null() && !rings.desc.is_null() {
            prefetch_descs(rings, size, next, avail);
        }
        let table = self.queue.desc_table();
        // Out of the queue for the batch (the requests borrow it mutably).
        let mut segs = std::mem::take(&mut self.segs);
        while next != avail && self.in_flight < size as usize {
            let Some(head) = avail_head(&mem, rings.avail, ring, size, next) else {
                self.fail_ring("its avail ring is outside guest memory");
                break;
            };
            next = next.wrapping_add(1);
            self.queue.set_next_avail(next);
            n += 1;
            if let Some(f) = &mut self.inflight {
                f.taken(head);
            }
            if head >= self.queue.size() {
                // Nothing to answer: a used element must name a head.
                tracing::warn!(
                    "vhost: queue {}: avail entry names descriptor {head}, past the ring's {}; skipped",
                    self.index,
                    self.queue.size()
                );
                continue;
            }
            self.take(head, (table, rings.desc, size), &mem, &mut segs);
        }
        self.segs = segs;
        if self.in_flight >= self.queue.size() as usize {
            // Resumed when a request completes.
            self.throttled = true;
        }
        n
    }

    /// Whether the worker should poll this queue's avail ring.
    fn pollable(&self) -> bool {
        self.polled && !self.throttled && self.stop.is_none() && !self.broken
    }

    /// The reactor is about to sleep: notifications on again (the
    /// EVENT_IDX `avail_event` brought up to date), then one more look at
    /// the ring. Returns whether chains came meanwhile (the queue stays
    /// polled, and the reactor must not sleep); else the queue leaves the
    /// polled list and a kick wakes the reactor.
    fn quiesce(&mut self) -> bool {
        if self.pollable() {
            match self.queue.enable_notification(&self.mem.guest) {
                Ok(true) => {
                    // Off again for the turn that takes them.
                    if self.queue.disable_notification(&self.mem.guest).is_ok() {
                        return true;
                    }
                    self.fail_ring("its avail ring is outside guest memory");
                }
                Ok(false) => {}
                Err(_) => self.fail_ring("its used ring is outside guest memory"),
            }
        } else if self.throttled && self.stop.is_none() && !self.broken {
            // Resumed by a completion (Worker::poll), not by a kick: it
            // may sleep with notifications off.
            return false;
        }
        self.polled = false;
        false
    }

    /// Starts the request of the chain at `head` of the descriptor table
    /// `(guest address, where it is mapped whole or null, size)`. `segs`:
    /// the queue's vector, out of it meanwhile.
    fn take(
        &mut self,
        head: u16,
        (table, host, size): (u64, *const u8, u16),
        mem: &Rc<Guest>,
        segs: &mut Vec<Seg>,
    ) {
        // Offered again while in flight (or past the ring, from a
        // recovered inflight record): the driver is broken. A first offer
        // is answered; this one cannot be (its used element would name
        // the same chain).
        if self
            .reqs
            .get(usize::from(head))
            .is_none_or(|r| r.pending != 0)
        {
            tracing::warn!(
                "vhost: queue {}: avail entry names descriptor {head}, in flight or past the ring; skipped",
                self.index
            );
            return;
        }
        // The regions at hand (not through the Rc, the Guest and the Arc
        // at each of the chain's lookups).
        let regions = mem.regions();
        let map = |a, l| memory::map_in(regions, a, l);
        match chain::parse_chain(map, table, host, size, head, segs) {
            Ok(p) => self.start_request(head, p, p.data(segs), mem),
            Err(e) => {
                tracing::warn!(
                    "vhost: queue {}: chain {head}: {e}; returned unanswered",
                    self.index
                );
                self.add_used(head, 0);
            }
        }
    }

    /// With inflight tracking, as the queue starts: resubmits the requests
    /// a udm before this one took and did not answer (oldest first), and
    /// resumes the ring after them.
    fn resubmit(&mut self) {
        let mem = self.mem.clone();
        let Some(f) = &mut self.inflight else {
            return;
        };
        let Ok(used) = self.queue.used_idx(&mem.guest, Ordering::Acquire) else {
            return self.fail_ring("its used ring is outside guest memory");
        };
        let Some(heads) = f.recover(used.0) else {
            return;
        };
        let (table, size) = (self.queue.desc_table(), self.queue.size());
        self.queue.set_next_used(used.0);
        self.queue
            .set_next_avail(used.0.wrapping_add(heads.len() as u16));
        if !heads.is_empty() {
            tracing::info!(
                "vhost: queue {}: resubmitting {} requests a previous udm left in flight",
                self.index,
                heads.len()
            );
        }
        let desc = self.rings.desc;
        let mut segs = std::mem::take(&mut self.segs);
        for head in heads {
            self.take(head, (table, desc, size), &mem, &mut segs);
        }
        self.segs = segs;
        self.front.unplug();
    }

    fn fail_ring(&mut self, why: &str) {
        if !self.broken {
            tracing::warn!("vhost: queue {}: {why}; stopped", self.index);
        }
        self.broken = true;
    }

    fn start_request(&mut self, head: u16, p: chain::Parsed, segs: &[Seg], mem: &Rc<Guest>) {
        let idx = usize::from(head);
        self.reqs[idx] = VReq {
            pending: 1,
            status: S_OK,
            status_ptr: p.status,
            written: 1,
            _mem: Some(mem.clone()),
        };
        self.in_flight += 1;
        let st = self.submit_request(idx, p, segs, mem);
        // The submission's own count: in flight still, in the common case.
        let r = &mut self.reqs[idx];
        if st == S_OK && r.pending > 1 {
            r.pending -= 1;
            return;
        }
        self.piece_done(idx, st);
    }

    /// Submits the front requests of request `idx`; returns the status of
    /// what failed at once.
    /// `mem`: the memory the request's buffers are in (its VReq holds it).
    fn submit_request(&mut self, idx: usize, p: chain::Parsed, segs: &[Seg], mem: &Guest) -> u8 {
        let cfg = &self.shared.cfg;
        if !p.layout_ok {
            return S_IOERR;
        }
        let writes = matches!(
            p.kind,
            VIRTIO_BLK_T_OUT | VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES
        );
        if writes && cfg.read_only {
            return S_IOERR;
        }
        match p.kind {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let Some(mut off) = p.sector.checked_mul(512) else {
                    return S_IOERR;
                };
                if p.data_len > cfg.size {
                    return S_IOERR;
                }
                let (op, fua) = if p.kind == VIRTIO_BLK_T_IN {
                    self.reqs[idx].written += p.data_len as u32;
                    (FrontOp::Read, false)
                } else {
                    let wt = cfg.volatile_cache && !self.shared.writeback.load(Ordering::Relaxed);
                    (FrontOp::Write, wt)
                };
                let flags = ReqFlags {
                    fua,
                    ..ReqFlags::default()
                };
                let ctx: *mut () = (self as *mut VQueue).cast();
                for s in segs {
                    let bi = mem.buf_index(s.ptr, s.len);
                    if op == FrontOp::Read {
                        // Counted first: a device may end the bio inline.
                        self.reqs[idx].pending += 1;
                        // SAFETY: as for `submit` below; ctx is this queue,
                        // which is not freed while a request is in flight
                        // (retirable()), as read_end_io expects.
                        if unsafe {
                            self.front.read_direct(
                                off,
                                s.len,
                                s.ptr,
                                bi,
                                read_end_io,
                                ctx,
                                idx as u64,
                            )
                        } {
                            off += s.len as u64;
                            continue;
                        }
                        self.reqs[idx].pending -= 1;
                    }
                    let st = self.submit(idx, op, off, s.len, flags, s.ptr, bi);
                    if st != S_OK {
                        return st;
                    }
                    off += s.len as u64;
                }
                S_OK
            }
            VIRTIO_BLK_T_FLUSH => self.submit(
                idx,
                FrontOp::Flush,
                0,
                0,
                ReqFlags::default(),
                std::ptr::null_mut(),
                Bio::NO_BUF,
            ),
            VIRTIO_BLK_T_GET_ID => {
                // The id, NUL-padded to 20 bytes, as much as fits.
                let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
                id[..cfg.id.len()].copy_from_slice(&cfg.id);
                let mut n = 0;
                for s in segs {
                    let k = (id.len() - n).min(s.len as usize);
                    // SAFETY: k <= s.len writable bytes of guest memory
                    // (chain::parse mapped the segment whole).
                    unsafe { std::ptr::copy_nonoverlapping(id[n..].as_ptr(), s.ptr, k) };
                    n += k;
                }
                self.reqs[idx].written += n as u32;
                S_OK
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => self.submit_ranges(idx, p, segs),
            _ => S_UNSUPP,
        }
    }

    /// Discard and write-zeroes: an array of (sector, sectors, flags).
    fn submit_ranges(&mut self, idx: usize, p: chain::Parsed, segs: &[Seg]) -> u8 {
        let discard = p.kind == VIRTIO_BLK_T_DISCARD;
        let offered = self.shared.cfg.features
            & (1 << if discard {
                VIRTIO_BLK_F_DISCARD
            } else {
                VIRTIO_BLK_F_WRITE_ZEROES
            })
            != 0;
        if !offered {
            return S_UNSUPP;
        }
        if p.data_len == 0 || !p.data_len.is_multiple_of(16) || p.data_len > MAX_RANGES as u64 * 16
        {
            return S_UNSUPP;
        }
        let mut buf = [0u8; MAX_RANGES as usize * 16];
        let mut n = 0;
        for s in segs {
            // SAFETY: s.len readable bytes of guest memory (mapped whole by
            // chain::parse); n + s.len <= data_len <= buf's length.
            unsafe { std::ptr::copy_nonoverlapping(s.ptr, buf[n..].as_mut_ptr(), s.len as usize) };
            n += s.len as usize;
        }
        for r in buf[..n].chunks_exact(16) {
            let sector = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
            let sectors = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
            let flags = u32::from_le_bytes(r[12..16].try_into().unwrap_or_default());
            // Bit 0 is UNMAP: a discard may not ask it; write-zeroes may.
            if flags & !1 != 0 || (discard && flags != 0) {
                return S_UNSUPP;
            }
            if sectors > MAX_RANGE_SECTORS {
                return S_UNSUPP;
            }
            let Some(off) = sector.checked_mul(512) else {
                return S_IOERR;
            };
            let (op, rf) = if discard {
                (FrontOp::Discard, ReqFlags::default())
            } else {
                (
                    FrontOp::WriteZeroes,
                    ReqFlags {
                        no_hole: flags & 1 == 0,
                        ..ReqFlags::default()
                    },
                )
            };
            let st = self.submit(
                idx,
                op,
                off,
                sectors << 9,
                rf,
                std::ptr::null_mut(),
                Bio::NO_BUF,
            );
            if st != S_OK {
                return st;
            }
        }
        S_OK
    }

    /// One front request of request `idx`; `buf_index` names the
    /// registered buffer `buf` lies in, if one does.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        idx: usize,
        op: FrontOp,
        offset: u64,
        len: u32,
        flags: ReqFlags,
        buf: *mut u8,
        buf_index: u16,
    ) -> u8 {
        let req = Request {
            op,
            offset,
            len,
            flags,
            buf,
            buf_index,
            token: idx as u64,
            done: front_done,
            ctx: (self as *mut VQueue).cast(),
        };
        // SAFETY: `buf` is `len` bytes of guest memory mapped whole by
        // chain::parse and kept mapped (and registered, when `buf_index`
        // says so) by the request's Rc<Guest> until it completes; the device's driver does not reuse the buffer
        // before the request is in the used ring, which happens after
        // every front request of it completed (piece_done).
        match unsafe { self.front.submit(req) } {
            Submitted::Later => {
                self.reqs[idx].pending += 1;
                S_OK
            }
            Submitted::Now(Ok(())) => S_OK,
            Submitted::Now(Err(e)) => status_of(e),
        }
    }

    /// A part of request `idx` ended with status `st`. Inlined into the
    /// end_ios (one call fewer per request).
    #[inline(always)]
    fn piece_done(&mut self, idx: usize, st: u8) {
        let r = &mut self.reqs[idx];
        if st != S_OK && r.status == S_OK {
            r.status = st;
        }
        r.pending -= 1;
        if r.pending > 0 {
            return;
        }
        // The slot is free again (pending 0); start_request sets every
        // field when it is next used, so only the memory is let go.
        let (status, written) = (r.status, r.written);
        // SAFETY: the status byte is guest memory mapped by chain::parse,
        // kept mapped by r's Rc<Guest>, which lives until after this.
        unsafe { std::ptr::write_volatile(r.status_ptr, status) };
        let mem = r._mem.take();
        self.in_flight -= 1;
        self.add_used(idx as u16, if status == S_OK { written } else { 1 });
        drop(mem);
    }

    /// Puts `head` on the used ring with `len` bytes written: the element
    /// is written at once, through the queue's own map of guest memory;
    /// the used index is published once per batch ([`VQueue::publish_used`],
    /// at the end of the turn), except with inflight tracking, whose
    /// recovery needs each element's index stored before its mark is
    /// cleared.
    #[inline]
    fn add_used(&mut self, head: u16, len: u32) {
        if self.inflight.is_some() || self.rings.used.is_null() {
            return self.add_used_slow(head, len);
        }
        let (next, size) = (self.queue.next_used(), self.queue.size());
        // SAFETY: the ring is mapped whole at rings.used (Rings::map), in
        // guest memory the queue's Rc<Guest> keeps mapped; size is a power
        // of 2 there, so the slot is inside it.
        let p = unsafe { self.rings.used.add(4 + 8 * usize::from(next & (size - 1))) };
        let e = u64::from(head) | u64::from(len) << 32;
        // SAFETY: 8 bytes at p, as above; a byte array needs no alignment.
        // Volatile: the driver reads it, after the index's store-release.
        unsafe { std::ptr::write_volatile(p.cast::<[u8; 8]>(), e.to_le_bytes()) };
        self.queue.set_next_used(next.wrapping_add(1));
        self.num_added = self.num_added.wrapping_add(1);
        self.used_unpublished = true;
        self.used_added = true;
        self.dirty();
    }

    /// [`VQueue::add_used`] with inflight tracking, or with a used ring
    /// not mapped whole: each element looked up, and with tracking its
    /// index stored at once.
    #[cold]
    #[inline(never)]
    fn add_used_slow(&mut self, head: u16, len: u32) {
        if let Some(f) = &self.inflight {
            f.putting(head);
        }
        let next = self.queue.next_used();
        // Heads are checked as they are taken: never past the ring here.
        let at = (head < self.queue.size())
            .then(|| {
                let (ring, size) = (self.queue.used_ring(), self.queue.size());
                used_elem(&self.mem, self.rings.used, ring, size, next)
            })
            .flatten();
        let Some(p) = at else {
            self.fail_ring("its used ring is outside guest memory");
            self.used_added = true;
            self.dirty();
            return;
        };
        let mut e = [0u8; 8];
        e[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        e[4..].copy_from_slice(&len.to_le_bytes());
        // SAFETY: `used_elem` vouched for 8 bytes at p, in guest memory the
        // queue's Rc<Guest> keeps mapped; a byte array needs no alignment.
        // Volatile: the driver reads it, after the index's store-release.
        unsafe { std::ptr::write_volatile(p.cast::<[u8; 8]>(), e) };
        let next = next.wrapping_add(1);
        self.queue.set_next_used(next);
        self.num_added = self.num_added.wrapping_add(1);
        self.used_unpublished = true;
        if self.inflight.is_some() {
            self.publish_used();
            if let Some(f) = &self.inflight {
                f.put(head, next);
            }
        }
        self.used_added = true;
        self.dirty();
    }

    /// Stores the used index (store-release: after the elements it
    /// covers), if elements were added since it was last stored.
    fn publish_used(&mut self) {
        if !self.used_unpublished {
            return;
        }
        self.used_unpublished = false;
        let p = if !self.rings.used.is_null() {
            // SAFETY: the ring is mapped whole at rings.used (Rings::map).
            unsafe { self.rings.used.add(2) }
        } else if let Some(p) = self.mem.map(self.queue.used_ring().wrapping_add(2), 2) {
            p
        } else {
            return self.fail_ring("its used ring is outside guest memory");
        };
        // SAFETY: `map` vouched for 2 bytes at p, in guest memory the
        // queue's Rc<Guest> keeps mapped.
        unsafe { store_release_u16(p, self.queue.next_used()) };
    }

    /// Whether the driver wants to be called for the elements added since
    /// the last check (which this one ends). With EVENT_IDX, when the used
    /// index went past its `used_event` since then (the check the Linux
    /// driver's `virtqueue_kick_prepare` makes, wrapping); without, always.
    /// The used index must be published.
    fn needs_call(&mut self) -> bool {
        let new = self.queue.next_used();
        let old = new.wrapping_sub(self.num_added);
        self.num_added = 0;
        if !self.queue.event_idx_enabled() {
            return true;
        }
        // The used index's store before the read of used_event: else the
        // driver may set used_event after our read, see the old index, and
        // sleep uncalled.
        fence(Ordering::SeqCst);
        let (ring, size) = (self.queue.avail_ring(), self.queue.size());
        let Some(used_event) = used_event(&self.mem, self.rings.avail, ring, size) else {
            return true;
        };
        new.wrapping_sub(used_event).wrapping_sub(1) < new.wrapping_sub(old)
    }

    fn dirty(&mut self) {
        if !self.in_dirty {
            self.in_dirty = true;
            let p: *mut VQueue = self;
            self.worker().dirty.borrow_mut().push(p);
        }
    }

    /// Tells the driver about what was added to the used ring, if it
    /// wants to know.
    fn notify(&mut self) {
        self.publish_used();
        if !self.used_added {
            return;
        }
        self.used_added = false;
        // Asked even when calling anyway: it restarts the count of
        // elements added since the last check.
        let wants = self.needs_call() || self.call_anyway;
        if let (true, Some(call)) = (wants, &self.call) {
            self.call_anyway = false;
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to the call eventfd.
            unsafe { libc::write(call.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Whether a stopped queue may be freed.
    fn retirable(&self) -> bool {
        self.stop.is_some() && !self.kick_inflight && !self.cancel_inflight && self.in_flight == 0
    }
}

/// The head the avail ring at guest address `ring` (of `size` entries, a
/// power of 2; mapped whole at `host` unless null) holds at index `idx`:
/// None if that entry is outside guest memory.
#[inline]
fn avail_head(mem: &Guest, host: *mut u8, ring: u64, size: u16, idx: u16) -> Option<u16> {
    let p = if !host.is_null() {
        // SAFETY: size is a power of 2 (Rings::map), so slot < size:
        // inside the ring mapped whole at host.
        unsafe { host.add(4 + 2 * usize::from(idx & (size - 1))) }
    } else {
        let slot = u64::from(idx.checked_rem(size)?);
        mem.map(ring.checked_add(4 + 2 * slot)?, 2)?
    };
    // SAFETY: `map` vouched for 2 bytes at p; a byte array needs no
    // alignment. Volatile: the driver writes the ring; the avail index
    // was read with Acquire before, so the entries it covers are seen.
    let b = unsafe { std::ptr::read_volatile(p.cast::<[u8; 2]>()) };
    Some(u16::from_le_bytes(b))
}

/// Asks for the head descriptors of the chains in `next..avail` before
/// the walk reads them: the driver wrote them on another CPU, so each is a
/// cache miss, and asked for together their misses overlap instead of
/// coming one per request as the walk reaches it. Both rings are mapped
/// whole (`rings.avail` and `rings.desc` not null); `size` is a power of 2.
#[inline]
fn prefetch_descs(rings: Rings, size: u16, next: u16, avail: u16) {
    let mut i = next;
    while i != avail {
        let slot = usize::from(i & (size - 1));
        // SAFETY: slot < size: inside the avail ring mapped whole at
        // rings.avail. Volatile: the driver writes the ring (the index
        // that covers this entry was read with Acquire).
        let b = unsafe { std::ptr::read_volatile(rings.avail.add(4 + 2 * slot).cast::<[u8; 2]>()) };
        let head = usize::from(u16::from_le_bytes(b) & (size - 1));
        prefetch(rings.desc.wrapping_add(16 * head));
        i = i.wrapping_add(1);
    }
}

/// A hint that the line at `p` is read soon; never faults, whatever `p`.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally and does not fault,
    // on any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Where used element number `next` (wrapping) of the used ring at guest
/// address `ring` (of `size` entries, a power of 2; mapped whole at `host`
/// unless null) is mapped: None if outside guest memory.
#[inline]
fn used_elem(mem: &Guest, host: *mut u8, ring: u64, size: u16, next: u16) -> Option<*mut u8> {
    if !host.is_null() {
        // SAFETY: size is a power of 2 (Rings::map), so slot < size:
        // inside the ring mapped whole at host.
        return Some(unsafe { host.add(4 + 8 * usize::from(next & (size - 1))) });
    }
    let slot = u64::from(next.checked_rem(size)?);
    mem.map(ring.checked_add(4 + 8 * slot)?, 8)
}

/// The driver's `used_event` (EVENT_IDX), after the avail ring at guest
/// address `ring` of `size` entries (mapped whole at `host` unless null):
/// None if outside guest memory.
fn used_event(mem: &Guest, host: *mut u8, ring: u64, size: u16) -> Option<u16> {
    let p = if !host.is_null() {
        // SAFETY: the ring, used_event included, is mapped whole at host.
        unsafe { host.add(4 + 2 * usize::from(size)) }
    } else {
        mem.map(ring.checked_add(4 + 2 * u64::from(size))?, 2)?
    };
    // SAFETY: `map` vouched for 2 bytes at p; a byte array needs no
    // alignment. Volatile: the driver writes it at any time.
    let b = unsafe { std::ptr::read_volatile(p.cast::<[u8; 2]>()) };
    Some(u16::from_le_bytes(b))
}

/// Stores `v` little-endian at `p` (2 bytes of guest memory) with release
/// ordering: what was written before is seen by a reader that sees `v`.
///
/// # Safety
/// `p` is valid for a 2-byte write for the call, and the memory there is
/// accessed only atomically or volatilely (guest memory).
unsafe fn store_release_u16(p: *mut u8, v: u16) {
    if p.align_offset(2) == 0 {
        // SAFETY: p is 2 mapped bytes (the caller's), 2-aligned; only
        // atomic or volatile accesses are made to guest memory here.
        unsafe { AtomicU16::from_ptr(p.cast()) }.store(v.to_le(), Ordering::Release);
    } else {
        // A used ring the driver misaligned (the spec wants 4): the
        // fence orders the elements' stores before this one.
        fence(Ordering::Release);
        // SAFETY: p is 2 mapped bytes; a byte array needs no alignment.
        unsafe { std::ptr::write_volatile(p.cast::<[u8; 2]>(), v.to_le_bytes()) };
    }
}

/// Loads the little-endian u16 at `p` (2 bytes of guest memory) with
/// acquire ordering: what the writer stored before it is seen after.
///
/// # Safety
/// `p` is valid for a 2-byte read for the call, and the memory there is
/// accessed only atomically or volatilely (guest memory).
unsafe fn load_acquire_u16(p: *mut u8) -> u16 {
    if p.align_offset(2) == 0 {
        // SAFETY: p is 2 mapped bytes (the caller's), 2-aligned; only
        // atomic or volatile accesses are made to guest memory here.
        u16::from_le(unsafe { AtomicU16::from_ptr(p.cast()) }.load(Ordering::Acquire))
    } else {
        // SAFETY: p is 2 mapped bytes; a byte array needs no alignment.
        let b = unsafe { std::ptr::read_volatile(p.cast::<[u8; 2]>()) };
        fence(Ordering::Acquire);
        u16::from_le_bytes(b)
    }
}

/// The [`crate::front::DoneFn`] of every front request of a queue.
fn front_done(ctx: *mut (), done: Done<'_>) {
    // SAFETY: ctx is the queue that submitted the request; it is not freed
    // while a request is in flight (retirable()).
    let q = unsafe { &mut *ctx.cast::<VQueue>() };
    let st = match done.result {
        Ok(()) => S_OK,
        Err(e) => status_of(e),
    };
    q.piece_done(done.token as usize, st);
}

/// The end_io of a read the front sent straight to the device
/// ([`Front::read_direct`]): private is the queue, ctx the request.
fn read_end_io(bio: BioPtr) {
    // SAFETY: private is the queue that submitted the read; it is not
    // freed while a request is in flight (retirable()).
    let q = unsafe { &mut *bio.private().cast::<VQueue>() };
    let (idx, st) = (bio.ctx() as usize, bio.status());
    drop(bio);
    let st = if st.is_ok() {
        S_OK
    } else {
        status_of(FrontError::from_status(st, ReqFlags::default()))
    };
    q.piece_done(idx, st);
}

fn kick_done(op: *mut RingOp, res: i32, flags: u32) {
    // SAFETY: the op is the first field of a #[repr(C)] VQueue, alive
    // until the kick poll's final CQE (this call or a later one).
    let q = unsafe { &mut *op.cast::<VQueue>() };
    q.on_kick(res, flags);
}

fn cancel_done(op: *mut RingOp, _res: i32, _flags: u32) {
    // SAFETY: the op is the cancel_op field of a #[repr(C)] VQueue, alive
    // until this CQE (retirable()); stepping back by the field's offset
    // gives the queue.
    let q = unsafe {
        &mut *op
            .cast::<u8>()
            .sub(std::mem::offset_of!(VQueue, cancel_op))
            .cast::<VQueue>()
    };
    q.cancel_inflight = false;
    q.dirty();
}

/// A reactor's share of a vhost-user-blk export: the device's front on
/// this reactor and the queues placed here. Registered as a poller: at the
/// end of each turn it notifies the driver for the queues that completed
/// requests, resumes throttled ones and frees stopped ones.
pub struct Worker {
    reactor: *const Reactor,
    dev: Arc<dyn BlockDevice>,
    shared: Arc<Shared>,
    front: RefCell<Option<Rc<Front>>>,
    queues: RefCell<Vec<*mut VQueue>>,
    dirty: RefCell<Vec<*mut VQueue>>,
    scratch: RefCell<Vec<*mut VQueue>>,
    /// Queues whose avail ring is polled (notifications off).
    polled: RefCell<Vec<*mut VQueue>>,
    /// The guest's memory registered with this reactor's rings.
    fixed: Registry,
}

impl Worker {
    /// A worker for `reactor`, which must outlive it (the server keeps both
    /// on the reactor's thread and releases the worker first).
    pub fn new(reactor: &Reactor, dev: Arc<dyn BlockDevice>, shared: Arc<Shared>) -> Rc<Worker> {
        Rc::new(Worker {
            reactor,
            dev,
            shared,
            front: RefCell::new(None),
            queues: RefCell::new(Vec::new()),
            dirty: RefCell::new(Vec::new()),
            scratch: RefCell::new(Vec::new()),
            polled: RefCell::new(Vec::new()),
            fixed: Registry::new(reactor),
        })
    }

    fn reactor(&self) -> &Reactor {
        // SAFETY: `new`'s contract.
        unsafe { &*self.reactor }
    }

    fn front(&self) -> Result<Rc<Front>, String> {
        if let Some(f) = &*self.front.borrow() {
            return Ok(f.clone());
        }
        let chan = self
            .dev
            .clone()
            .open(self.reactor())
            .map_err(|e| format!("opening '{}': {e}", self.dev.name()))?;
        // SAFETY: the reactor outlives the worker, which holds the front
        // and drops it in release(), on this thread.
        let f = unsafe { Front::new(self.reactor(), &*self.dev, chan) };
        if let Some(b) = &self.shared.budget {
            f.set_budget(b.clone());
        }
        f.set_report(self.shared.auto.clone());
        f.set_dispatch(self.shared.dispatch);
        *self.front.borrow_mut() = Some(f.clone());
        Ok(f)
    }

    /// Starts a queue here; `done` gets the outcome.
    pub fn start(&self, s: Start, done: Sender<Result<(), String>>) {
        let front = match self.front() {
            Ok(f) => f,
            Err(e) => {
                let _ = done.send(Err(e));
                return;
            }
        };
        let size = s.queue.size();
        let q = Box::new(VQueue {
            kick_op: RingOp {
                complete: kick_done,
            },
            kick_inflight: false,
            cancel_op: RingOp {
                complete: cancel_done,
            },
            cancel_inflight: false,
            polled: false,
            kick: s.kick,
            call: s.call,
            index: s.index,
            queue: s.queue,
            mem: self.fixed.guest(s.mem),
            front,
            shared: self.shared.clone(),
            reqs: (0..size).map(|_| VReq::FREE).collect(),
            in_flight: 0,
            segs: Vec::with_capacity(64),
            worker: self,
            in_dirty: false,
            // The used ring may hold elements no one told the driver of: a
            // udm before this one (or this one, before the ring stopped)
            // may have added them and gone before calling. With EVENT_IDX
            // the driver is called only when the used index crosses its
            // used_event, and that crossing may be among them: without a
            // call now it would never be called again on this ring.
            used_added: true,
            num_added: 0,
            used_unpublished: false,
            call_anyway: true,
            throttled: false,
            stop: None,
            broken: false,
            inflight: s.inflight,
            rings: Rings {
                desc: std::ptr::null(),
                avail: std::ptr::null_mut(),
                used: std::ptr::null_mut(),
            },
        });
        let p = Box::into_raw(q);
        self.queues.borrow_mut().push(p);
        let _ = done.send(Ok(()));
        // SAFETY: just made; freed only by retire().
        let q = unsafe { &mut *p };
        q.rings = Rings::map(&q.queue, &q.mem);
        // What a previous udm left in flight first, then requests the
        // driver queued before the ring started (or while the frontend
        // was away).
        q.resubmit();
        q.process();
        q.arm_kick();
        q.dirty();
    }

    fn find(&self, index: u16) -> Option<*mut VQueue> {
        self.queues
            .borrow()
            .iter()
            // SAFETY: queues in the list are live (see retire()).
            .find(|&&p| unsafe { (*p).index } == index && unsafe { (*p).stop.is_none() })
            .copied()
    }

    /// Stops queue `index`: it takes nothing more from the ring, and once
    /// its requests in flight completed, `done` gets its next available
    /// index and it is freed.
    pub fn stop(&self, index: u16, done: Sender<u16>) {
        let Some(p) = self.find(index) else {
            let _ = done.send(0);
            return;
        };
        // SAFETY: as in find().
        let q = unsafe { &mut *p };
        q.stop = Some(done);
        q.cancel_kick();
        q.dirty();
    }

    /// Queue `index` signals completions through `call` from now on.
    pub fn set_call(&self, index: u16, call: Option<File>) {
        tracing::trace!("vhost: queue {index}: call fd {}", call.is_some());
        if let Some(p) = self.find(index) {
            // SAFETY: as in find().
            unsafe { (*p).call = call };
        }
    }

    /// The guest's memory changed: the queues use `mem` from now on
    /// (requests in flight keep the old mapping, and its registration with
    /// the rings, until they finish).
    pub fn set_mem(&self, mem: Arc<Memory>) {
        if self.queues.borrow().is_empty() {
            return;
        }
        let g = self.fixed.guest(mem);
        for &p in self.queues.borrow().iter() {
            // SAFETY: as in find().
            let q = unsafe { &mut *p };
            q.mem = g.clone();
            q.rings = Rings::map(&q.queue, &q.mem);
        }
    }

    /// The device grew to `bytes`: requests up to there are taken.
    pub fn grow(&self, bytes: u64) {
        if let Some(f) = &*self.front.borrow() {
            f.grow(bytes);
        }
    }

    /// Queues placed here and not yet freed.
    pub fn queues(&self) -> usize {
        self.queues.borrow().len()
    }

    fn retire(&self, p: *mut VQueue) {
        self.queues.borrow_mut().retain(|&x| x != p);
        self.polled.borrow_mut().retain(|&x| x != p);
        // SAFETY: made by Box::into_raw in start(); no kick read and no
        // request refers to it (retirable()), and it left every list.
        let q = unsafe { Box::from_raw(p) };
        if let Some(tx) = &q.stop {
            let _ = tx.send(q.queue.next_avail());
        }
    }

    /// Drops the front (before the reactor goes); every queue must be freed.
    pub fn release(&self) {
        *self.front.borrow_mut() = None;
    }
}

impl Poller for Worker {
    fn poll(&self) -> usize {
        let mut took = 0;
        if !self.polled.borrow().is_empty() {
            took = self.poll_rings();
        }
        if self.dirty.borrow().is_empty() {
            return took;
        }
        let mut batch = std::mem::take(&mut *self.scratch.borrow_mut());
        std::mem::swap(&mut batch, &mut *self.dirty.borrow_mut());
        for &p in &batch {
            // SAFETY: a queue in the dirty list is live: only retire() frees
            // queues, and only from this loop, after taking it off the list.
            let q = unsafe { &mut *p };
            q.in_dirty = false;
            q.notify();
            if q.retirable() {
                self.retire(p);
                continue;
            }
            if q.throttled && q.stop.is_none() && !q.broken && q.in_flight < q.queue.size() as usize
            {
                // Room again: the requests that waited in the ring.
                q.throttled = false;
                q.process();
                q.notify();
            }
        }
        batch.clear();
        *self.scratch.borrow_mut() = batch;
        took
    }

    fn must_spin(&self) -> bool {
        if !self.dirty.borrow().is_empty() {
            return true;
        }
        if self.polled.borrow().is_empty() {
            return false;
        }
        let mut list = std::mem::take(&mut *self.polled.borrow_mut());
        let mut more = false;
        list.retain(|&p| {
            // SAFETY: a queue in the polled list is live (retire() takes
            // it off first); nothing else holds a reference to it while
            // the reactor decides to sleep.
            let q = unsafe { &mut *p };
            more |= q.quiesce();
            q.polled
        });
        // quiesce() adds nothing to the list, which was empty meanwhile.
        *self.polled.borrow_mut() = list;
        more
    }
}

impl Worker {
    /// Takes what the drivers queued on the polled rings since the last
    /// turn. Returns how many chains it took.
    fn poll_rings(&self) -> usize {
        let list = std::mem::take(&mut *self.polled.borrow_mut());
        let mut took = 0;
        for &p in &list {
            // SAFETY: as in must_spin().
            let q = unsafe { &mut *p };
            if q.pollable() {
                took += q.process();
            }
        }
        // Queues process() added meanwhile (none: each here is polled).
        let mut added = std::mem::replace(&mut *self.polled.borrow_mut(), list);
        self.polled.borrow_mut().append(&mut added);
        took
    }
}

/// Reactor-local key under which each reactor keeps its [`Worker`].
pub(super) const WORKER_KEY: u64 = 0x5648_4f53_5400_0000;

fn worker_of(r: &Reactor) -> Option<Rc<Worker>> {
    r.local(WORKER_KEY)?.downcast::<Worker>().ok()
}

/// Runs `f` with the worker of the reactor it is sent to.
pub(super) fn on_worker(
    h: &udm_core::ReactorHandle,
    f: impl FnOnce(&Worker) + Send + 'static,
) -> bool {
    h.send(move |r: &Reactor| {
        if let Some(w) = worker_of(r) {
            f(&w)
        }
    })
}
