//! `rbd`: a Ceph RBD image through librbd's asynchronous API.
//!
//! Spec: `rbd:<pool>/<image>[@<snap>][,conf=<path>][,id=<client>][,cluster=<name>][,ro][,timeout=<s>]`.
//!
//! - One `rbd_image_t` per device, shared by every reactor (librbd's image
//!   is internally locked and its aio calls are thread-safe).
//! - Each reactor's channel submits with `rbd_aio_readv`/`writev`/`flush`/
//!   `discard`/`write_zeroes`. librbd completes on its own threads: the
//!   callback records the result in the request's slot, pushes the slot onto
//!   the channel's lock-free completion stack and, if the stack was empty,
//!   wakes the reactor through its eventfd ([`ReactorHandle::wake`]), as
//!   QEMU's `block/rbd.c` and SPDK's `bdev_rbd` do. The reactor takes the
//!   whole stack in one swap and ends the bios on its own thread. No thread
//!   per request, no lock, and no allocation on udm's side per I/O: slots
//!   are allocated in chunks when the queue depth first reaches a new high
//!   and reused after. (librbd itself allocates an `AioCompletion` in
//!   `rbd_aio_create_completion` for every I/O; its API offers no way to
//!   reuse one.)
//! - Limits from the image: the object size is the optimal I/O size.
//! - Flush and FUA: with librbd's cache on (`rbd_cache`, the default, in
//!   policy `rbd_cache_policy`) a completed write may sit in the cache, so
//!   PREFLUSH runs `rbd_aio_flush` before the write and FUA one after it;
//!   with `rbd_cache = false` librbd acknowledges a write only once the OSDs
//!   have it, so FUA and PREFLUSH need nothing more and FLUSH is cheap.
//! - Errors: connecting, a missing pool, image or snapshot fail at create
//!   time with one line naming the cause, bounded by `client_mount_timeout`
//!   and `rados_mon_op_timeout` (10 s, or `timeout=`). At run time an I/O
//!   the OSDs do not answer fails with EIO after `rados_osd_op_timeout`
//!   (30 s, or `timeout=`).
//! - Resize: `udm message DEV 0 resize` re-reads the image's size (after
//!   `rbd resize`); the new size is used at once by the device's channels.

mod ffi;
pub mod sys;

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::os::raw::c_void;
use std::ptr;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicIsize, AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_core::{
    check_bio, push_extent, Alloc, Bio, BioFlags, BioPtr, BlockDevice, Caps, Channel, Error,
    Extent, Limits, Op, Poller, Reactor, ReactorHandle, Status, WorkQueue, SECTOR_SHIFT,
};

/// `RBD_FEATURE_FAST_DIFF`: the object map tells which objects exist.
const RBD_FEATURE_FAST_DIFF: u64 = 1 << 4;
/// Objects one block-status answer covers at most (4 GiB of 4 MiB objects):
/// the object map's bits for them, and at most 1024 extents.
const BLOCK_STATUS_OBJECTS: u64 = 1024;

use sys::{AioOp, Completion, Image};
pub use sys::{Cluster, ImageInfo, Pool, Timeouts};

/// What an `rbd:` spec names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdOpts {
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// A snapshot to open (read-only) instead of the head.
    pub snap: Option<String>,
    /// The ceph config file (else librados's search path and `$CEPH_CONF`).
    pub conf: Option<String>,
    /// The client id (`admin` for `client.admin`).
    pub id: String,
    /// The cluster name (`ceph`).
    pub cluster: String,
    /// Open read-only.
    pub read_only: bool,
    /// Connect and I/O timeouts.
    pub timeouts: Timeouts,
}

impl RbdOpts {
    /// Parses what follows `rbd:`:
    /// `<pool>/<image>[@<snap>][,conf=<path>][,id=<client>][,cluster=<name>][,ro][,timeout=<s>]`.
    pub fn parse(s: &str) -> Result<RbdOpts, Error> {
        let mut parts = s.split(',');
        let what = parts.next().unwrap_or("");
        let (path, snap) = match what.split_once('@') {
            Some((p, s)) if !s.is_empty() => (p, Some(s.to_string())),
            Some(_) => {
                return Err(Error::invalid(format!(
                    "rbd: empty snapshot name in '{what}'"
                )))
            }
            None => (what, None),
        };
        let (pool, image) = match path.split_once('/') {
            Some((p, i)) if !p.is_empty() && !i.is_empty() && !i.contains('/') => (p, i),
            _ => {
                return Err(Error::invalid(format!(
                    "rbd: expected <pool>/<image>[@<snap>], got '{what}'"
                )))
            }
        };
        let mut o = RbdOpts {
            pool: pool.to_string(),
            image: image.to_string(),
            snap,
            conf: None,
            id: "admin".to_string(),
            cluster: "ceph".to_string(),
            read_only: false,
            timeouts: Timeouts::default(),
        };
        for p in parts {
            match p.split_once('=') {
                Some(("conf", v)) if !v.is_empty() => o.conf = Some(v.to_string()),
                Some(("id", v)) if !v.is_empty() => o.id = v.to_string(),
                Some(("cluster", v)) if !v.is_empty() => o.cluster = v.to_string(),
                Some(("timeout", v)) => {
                    let t: u32 = v.parse().ok().filter(|t| *t > 0).ok_or_else(|| {
                        Error::invalid(format!("rbd: invalid timeout '{v}': expected seconds > 0"))
                    })?;
                    o.timeouts = Timeouts { mon: t, osd: t };
                }
                None if p == "ro" => o.read_only = true,
                _ => {
                    return Err(Error::invalid(format!(
                        "rbd: unknown option '{p}' (known: conf=, id=, cluster=, ro, timeout=)"
                    )))
                }
            }
        }
        Ok(o)
    }

    /// `pool/image[@snap]`.
    pub fn image_spec(&self) -> String {
        match &self.snap {
            Some(s) => format!("{}/{}@{s}", self.pool, self.image),
            None => format!("{}/{}", self.pool, self.image),
        }
    }
}

/// Whether completed writes may sit in librbd's cache until a flush.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// `rbd_cache = false`: a write completes once the OSDs have it.
    Off,
    /// `rbd_cache = true`, with its `rbd_cache_policy`.
    On(String),
}

/// An RBD image.
pub struct RbdDevice {
    name: String,
    spec: String,
    image: Image,
    info: ImageInfo,
    cache: CacheMode,
    /// The size in sectors; grows on `resize`.
    sectors: AtomicU64,
    limits: Limits,
    caps: Caps,
    timeouts: Timeouts,
}

impl RbdDevice {
    /// Connects to the cluster and opens the image `o` names.
    pub fn open(name: impl Into<String>, o: &RbdOpts) -> Result<RbdDevice, Error> {
        let cluster = Arc::new(Cluster::connect(
            &o.cluster,
            &o.id,
            o.conf.as_deref(),
            o.timeouts,
        )?);
        let cache = if cluster.get_bool("rbd_cache") {
            CacheMode::On(
                cluster
                    .get("rbd_cache_policy")
                    .unwrap_or_else(|| "writeback".into()),
            )
        } else {
            CacheMode::Off
        };
        let pool = Arc::new(Pool::open(cluster, &o.pool)?);
        let read_only = o.read_only || o.snap.is_some();
        let image = Image::open(pool, &o.image, o.snap.as_deref(), read_only)?;
        let info = image.info()?;
        let spec = o.image_spec();
        let sectors = info.size >> SECTOR_SHIFT;
        if sectors == 0 {
            return Err(Error::invalid(format!(
                "rbd: image '{spec}' is empty (rbd resize it)"
            )));
        }
        let mut limits = Limits::new(sectors);
        limits.physical_block_size = 4096;
        limits.max_io_bytes = 32 << 20;
        limits.max_segments = libc::UIO_MAXIOV as u32;
        limits.io_opt = u32::try_from(info.obj_size).unwrap_or(0);
        let mut caps = Caps::FLUSH
            | Caps::FUA
            | Caps::DISCARD
            | Caps::WRITE_ZEROES
            | Caps::PERSISTENT
            | Caps::MERGE;
        if read_only {
            caps.insert(Caps::READ_ONLY);
        }
        Ok(RbdDevice {
            name: name.into(),
            spec,
            image,
            info,
            cache,
            sectors: AtomicU64::new(sectors),
            limits,
            caps,
            timeouts: o.timeouts,
        })
    }

    /// `pool/image[@snap]`.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// The image's size, object size and features (as opened).
    pub fn image_info(&self) -> &ImageInfo {
        &self.info
    }

    /// librbd's cache mode.
    pub fn cache_mode(&self) -> &CacheMode {
        &self.cache
    }

    /// Re-reads the image's size (after `rbd resize`); returns it in sectors.
    /// The channels use it for the next bio. Shrinking is refused: a stack
    /// above may still address the space.
    pub fn refresh_size(&self) -> Result<u64, Error> {
        let sectors = self.image.size()? >> SECTOR_SHIFT;
        let old = self.sectors.load(Ordering::Acquire);
        if sectors < old {
            return Err(Error::invalid(format!(
                "rbd: image '{}' shrank from {old} to {sectors} sectors: refusing (remove and recreate the device)",
                self.spec
            )));
        }
        self.sectors.store(sectors, Ordering::Release);
        Ok(sectors)
    }

    /// One line for `udm info` and `status`.
    pub fn describe(&self) -> String {
        let cache = match &self.cache {
            CacheMode::Off => "off (writes durable on completion)".to_string(),
            CacheMode::On(p) => format!("on, {p} (durable after flush)"),
        };
        format!(
            "rbd {} size {} object size {} features {} cache {cache} osd timeout {} s",
            self.spec,
            self.sectors.load(Ordering::Acquire) << SECTOR_SHIFT,
            self.info.obj_size,
            self.info.feature_names,
            self.timeouts.osd
        )
    }

    fn current_limits(&self) -> Limits {
        Limits {
            sectors: self.sectors.load(Ordering::Relaxed),
            ..self.limits
        }
    }

    fn cache_on(&self) -> bool {
        self.cache != CacheMode::Off
    }
}

impl BlockDevice for RbdDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn limits(&self) -> Limits {
        self.current_limits()
    }
    fn caps(&self) -> Caps {
        self.caps
    }
    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        let shared = Arc::new(Shared {
            head: AtomicPtr::new(ptr::null_mut()),
            wake: reactor.handle(),
        });
        Ok(Rc::new_cyclic(|me| RbdChannel {
            dev: self,
            shared,
            slots: RefCell::new(Vec::new()),
            state: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            inflight: Cell::new(0),
            queued: Cell::new(false),
            work: reactor.work_queue(),
            me: me.clone(),
        }))
    }
    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        match argv {
            ["resize"] => Ok(format!("{}", self.refresh_size()?)),
            ["info"] => Ok(self.describe()),
            _ => Err(Error::invalid(format!(
                "rbd: unknown message '{}' (known: resize, info)",
                argv.join(" ")
            ))),
        }
    }
    fn describe(&self) -> Option<String> {
        Some(RbdDevice::describe(self))
    }
    fn merge_reason(&self) -> String {
        "network backend: a round trip per request".into()
    }
    /// With fast-diff, from the object map (`rbd_diff_iterate2`, whole
    /// objects): objects never written are holes, the rest data; at most
    /// `BLOCK_STATUS_OBJECTS` objects an answer. It reads the object map
    /// (a round trip unless this client holds the image's exclusive lock),
    /// on the caller's thread. Without fast-diff, librbd would ask the OSD
    /// of every object: everything is reported as data instead.
    fn block_status(&self, sector: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let size = self.sectors.load(Ordering::Acquire);
        if sector.checked_add(sectors).is_none_or(|e| e > size) {
            return Err(Error::invalid(format!(
                "rbd: block status of {sectors} sectors at {sector} is beyond the image ({size} sectors)"
            )));
        }
        if self.info.features & RBD_FEATURE_FAST_DIFF == 0 {
            push_extent(
                out,
                Extent {
                    sectors,
                    alloc: Alloc::Data,
                },
            );
            return Ok(());
        }
        let obj = (self.info.obj_size >> SECTOR_SHIFT).max(1);
        let end = sector + sectors.min(BLOCK_STATUS_OBJECTS * obj - sector % obj);
        let mut pos = sector;
        let ranges = self
            .image
            .allocated(sector << SECTOR_SHIFT, (end - sector) << SECTOR_SHIFT)?;
        for (off, len) in ranges {
            let s = (off >> SECTOR_SHIFT).clamp(pos, end);
            let e = (off.saturating_add(len))
                .div_ceil(1 << SECTOR_SHIFT)
                .clamp(s, end);
            push_extent(
                out,
                Extent {
                    sectors: s - pos,
                    alloc: Alloc::Hole,
                },
            );
            push_extent(
                out,
                Extent {
                    sectors: e - s,
                    alloc: Alloc::Data,
                },
            );
            pos = pos.max(e);
        }
        push_extent(
            out,
            Extent {
                sectors: end - pos,
                alloc: Alloc::Hole,
            },
        );
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The part of a channel librbd's threads touch.
struct Shared {
    /// Completed slots, a Treiber stack: librbd's threads push, the reactor
    /// takes all at once (no pop of one element, so no ABA).
    head: AtomicPtr<Slot>,
    /// Wakes the reactor.
    wake: ReactorHandle,
}

/// One request's completion record. Allocated in chunks that never move
/// while the channel lives; librbd's callback gets a pointer to one.
struct Slot {
    next: AtomicPtr<Slot>,
    ret: AtomicIsize,
    index: u32,
    shared: Arc<Shared>,
}

/// Slots allocated at a time.
const CHUNK: usize = 64;

/// What the reactor knows of a slot's request.
#[derive(Clone, Copy)]
struct SlotState {
    bio: *mut Bio,
    /// Stages left: PRE (a flush before), DATA, POST (a flush after).
    stages: u8,
}

const PRE: u8 = 1;
const DATA: u8 = 2;
const POST: u8 = 4;

const FREE: SlotState = SlotState {
    bio: ptr::null_mut(),
    stages: 0,
};

/// A reactor's channel to the image.
struct RbdChannel {
    dev: Arc<RbdDevice>,
    shared: Arc<Shared>,
    slots: RefCell<Vec<Box<[Slot]>>>,
    state: RefCell<Vec<SlotState>>,
    free: RefCell<Vec<u32>>,
    inflight: Cell<usize>,
    /// On the reactor's work queue (polled each turn while I/O is in flight).
    queued: Cell<bool>,
    work: WorkQueue,
    me: Weak<RbdChannel>,
}

/// librbd's completion callback, on one of its threads.
///
/// # Safety
/// `arg` is the `Slot` the request was submitted with; it stays allocated
/// until the channel has seen this completion (or forever, see `Drop`).
unsafe extern "C" fn rbd_done(c: ffi::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: called once per completion, from its callback.
    let ret = unsafe { sys::finish(c) };
    // SAFETY: see the function's contract: the slot outlives the request.
    let slot = unsafe { &*(arg as *const Slot) };
    slot.ret.store(ret, Ordering::Relaxed);
    // Keep the channel's shared part alive past the push: once the slot is
    // on the stack, the reactor may end the request and drop the channel.
    let shared = slot.shared.clone();
    let me = arg as *mut Slot;
    let mut head = shared.head.load(Ordering::Relaxed);
    loop {
        slot.next.store(head, Ordering::Relaxed);
        match shared
            .head
            .compare_exchange_weak(head, me, Ordering::Release, Ordering::Relaxed)
        {
            Ok(_) => break,
            Err(h) => head = h,
        }
    }
    // A non-empty stack was announced by whoever made it non-empty, and the
    // reactor has not taken it yet (taking empties it): wake only on the
    // first push.
    if head.is_null() {
        shared.wake.wake();
    }
}

impl RbdChannel {
    fn slot_ptr(&self, i: u32) -> *mut Slot {
        let slots = self.slots.borrow();
        let s: *const Slot = &slots[i as usize / CHUNK][i as usize % CHUNK];
        s as *mut Slot
    }

    fn alloc_slot(&self) -> u32 {
        if let Some(i) = self.free.borrow_mut().pop() {
            return i;
        }
        // A new high of requests in flight: one more chunk.
        let mut slots = self.slots.borrow_mut();
        let base = (slots.len() * CHUNK) as u32;
        let chunk: Box<[Slot]> = (0..CHUNK as u32)
            .map(|k| Slot {
                next: AtomicPtr::new(ptr::null_mut()),
                ret: AtomicIsize::new(0),
                index: base + k,
                shared: self.shared.clone(),
            })
            .collect();
        slots.push(chunk);
        self.state.borrow_mut().resize(slots.len() * CHUNK, FREE);
        let mut free = self.free.borrow_mut();
        free.reserve(slots.len() * CHUNK);
        free.extend((base + 1..base + CHUNK as u32).rev());
        base
    }

    /// Starts the next stage of slot `i`'s request. On a refusal from
    /// librbd, ends the request with its error (deferred: this may run
    /// inside `submit`).
    fn start(&self, i: u32) {
        let st = self.state.borrow()[i as usize];
        // SAFETY: a slot's bio is owned by the slot while it is in flight,
        // and only this thread touches it.
        let bio = unsafe { &*st.bio };
        let off = bio.sector << SECTOR_SHIFT;
        let op = if st.stages & PRE != 0 {
            AioOp::Flush
        } else if st.stages & DATA != 0 {
            match bio.op {
                Op::Read => AioOp::Read(bio.segs(), off),
                Op::Write => AioOp::Write(bio.segs(), off),
                Op::Flush => AioOp::Flush,
                Op::Discard => AioOp::Discard(off, bio.len() as u64),
                Op::WriteZeroes => AioOp::WriteZeroes(off, bio.len() as u64),
            }
        } else {
            AioOp::Flush
        };
        // SAFETY: the slot is what rbd_done expects, and it stays allocated
        // until the channel has seen this completion (slots are freed only
        // with the channel, and leaked if I/O is still in flight then).
        let rc = match unsafe { Completion::new(self.slot_ptr(i).cast(), rbd_done) } {
            // SAFETY: the bio's segments are the submitter's buffers, which
            // stay valid until its end_io runs, after this completion.
            Ok(c) => match unsafe { self.dev.image.aio(op, &c) } {
                Ok(()) => return,
                Err(rc) => {
                    c.release();
                    rc
                }
            },
            Err(rc) => rc,
        };
        let bio = self.take(i);
        bio.complete(Status::from_errno(-rc));
    }

    /// Frees slot `i` and gives its bio back.
    fn take(&self, i: u32) -> BioPtr {
        let st = std::mem::replace(&mut self.state.borrow_mut()[i as usize], FREE);
        self.free.borrow_mut().push(i);
        self.inflight.set(self.inflight.get() - 1);
        // SAFETY: the pointer came from into_raw in submit and is taken back once.
        unsafe { BioPtr::from_raw(st.bio) }
    }

    /// A stage of slot `i` finished with `ret`.
    fn finished(&self, i: u32, ret: isize) {
        let stages = {
            let mut state = self.state.borrow_mut();
            let st = &mut state[i as usize];
            if ret >= 0 {
                // Stages run in order: drop the lowest.
                st.stages &= st.stages - 1;
            }
            st.stages
        };
        if ret >= 0 && stages != 0 {
            self.start(i);
            return;
        }
        let status = if ret < 0 {
            Status::from_errno(-ret as i32)
        } else {
            Status::Ok
        };
        let mut bio = self.take(i);
        bio.set_status(status);
        bio.endio();
    }
}

impl Channel for RbdChannel {
    fn submit(&self, bio: BioPtr) {
        let limits = self.dev.current_limits();
        let Some(bio) = check_bio(bio, &limits, self.dev.caps) else {
            return;
        };
        let cache = self.dev.cache_on();
        let mut stages = DATA;
        if cache && bio.flags.contains(BioFlags::PREFLUSH) && bio.op != Op::Flush {
            stages |= PRE;
        }
        if cache && bio.flags.contains(BioFlags::FUA) && bio.op.is_write() {
            stages |= POST;
        }
        let i = self.alloc_slot();
        self.state.borrow_mut()[i as usize] = SlotState {
            bio: bio.into_raw(),
            stages,
        };
        self.inflight.set(self.inflight.get() + 1);
        if !self.queued.get() {
            if let Some(me) = self.me.upgrade() {
                self.queued.set(true);
                self.work.queue(me);
            }
        }
        self.start(i);
    }
}

impl Poller for RbdChannel {
    fn poll(&self) -> usize {
        let mut p = self.shared.head.swap(ptr::null_mut(), Ordering::Acquire);
        let mut n = 0;
        while !p.is_null() {
            // SAFETY: pushed by rbd_done; slots live as long as the channel.
            let slot = unsafe { &*p };
            p = slot.next.load(Ordering::Relaxed);
            self.finished(slot.index, slot.ret.load(Ordering::Relaxed));
            n += 1;
        }
        n
    }
    fn deadline(&self) -> Option<Instant> {
        // While I/O is in flight the reactor is busy (so `drain` waits for
        // it) and sleeps at most a second between checks, a guard against
        // a lost wake-up; completions wake it at once.
        (self.inflight.get() > 0).then(|| Instant::now() + Duration::from_secs(1))
    }
    fn pending(&self) -> bool {
        let p = self.inflight.get() > 0 || !self.shared.head.load(Ordering::Acquire).is_null();
        if !p {
            self.queued.set(false);
        }
        p
    }
}

impl Drop for RbdChannel {
    fn drop(&mut self) {
        if self.inflight.get() > 0 {
            // Only when a reactor is torn down with I/O in flight (the work
            // queue holds the channel otherwise): librbd will still call back
            // into these slots, so they and the image must stay.
            std::mem::forget(std::mem::take(&mut *self.slots.borrow_mut()));
            std::mem::forget(self.dev.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_their_options() {
        let o = RbdOpts::parse("rbd/vol1").unwrap();
        assert_eq!((o.pool.as_str(), o.image.as_str()), ("rbd", "vol1"));
        assert_eq!((o.id.as_str(), o.cluster.as_str()), ("admin", "ceph"));
        assert_eq!((o.snap, o.conf, o.read_only), (None, None, false));
        assert_eq!(o.timeouts, Timeouts::default());
        let o = RbdOpts::parse("p/i@s1,conf=/etc/c.conf,id=udm,cluster=c2,ro,timeout=3").unwrap();
        assert_eq!(o.image_spec(), "p/i@s1");
        assert_eq!(o.conf.as_deref(), Some("/etc/c.conf"));
        assert_eq!(
            (o.id.as_str(), o.cluster.as_str(), o.read_only),
            ("udm", "c2", true)
        );
        assert_eq!(o.timeouts, Timeouts { mon: 3, osd: 3 });
        let err = |s: &str| RbdOpts::parse(s).err().unwrap().to_string();
        assert!(err("").contains("expected <pool>/<image>"));
        assert!(err("pool").contains("expected <pool>/<image>"));
        assert!(err("/img").contains("expected <pool>/<image>"));
        assert!(err("p/a/b").contains("expected <pool>/<image>"));
        assert!(err("p/i@").contains("empty snapshot name"));
        assert!(err("p/i,timeout=x").contains("invalid timeout 'x'"));
        assert!(err("p/i,conf=").contains("unknown option 'conf='"));
        assert!(err("p/i,fast").contains("unknown option 'fast'"));
    }

    #[test]
    fn names_with_nul_bytes_are_refused_before_librados_sees_them() {
        let e = Cluster::connect("ce\0ph", "admin", None, Timeouts::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("contains a NUL byte"), "{e}");
    }
}
