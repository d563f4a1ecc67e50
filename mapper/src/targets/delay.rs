//! `delay`: holds each I/O back for a fixed time before it goes down
//! (dm-delay, as in Linux 6.12).
//!
//! Table line (3, 6 or 9 arguments):
//! `<start> <length> delay <dev> <offset> <delay ms> [<write dev> <write offset> <write delay ms> [<flush dev> <flush offset> <flush delay ms>]]`
//!
//! Reads go to the first device; writes, discards and write-zeroes to the
//! second (the first when not given); flushes to the third (the second when
//! not given), each after its delay. Order is kept within each class (one
//! FIFO per class and reactor, all of one delay). A suspend lets every
//! held bio go at once, as dm's presuspend does, and resume holds them
//! again.
//!
//! With every delay 0 the target is a pure remap (no engine, no timer: the
//! fast path's cost is linear's). Otherwise it remaps onto an internal
//! device, the engine ([`DelayDev`]), so that flushes, which the core fans
//! out to a table's devices, reach it too. The engine's channel on each
//! reactor keeps the three queues and sits on the reactor's work queue
//! while any holds a bio, with the earliest due time as its deadline: the
//! reactor's turn releases what is due and its sleep wakes for the next
//! one. No thread, no allocation per I/O (the queues keep their capacity).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use udm_core::{
    BioPtr, BlockDevice, Caps, Channel, Error, Limits, Op, Poller, Reactor, ReactorHandle,
    WorkQueue,
};

use crate::target::{parse_sector, CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `delay` target type.
pub const DELAY: TargetType = TargetType {
    name: "delay",
    version: [1, 4, 0],
    summary: "delays reads, writes and flushes by fixed times, each class in order",
    usage: "<dev> <offset> <delay ms> [<write dev> <write offset> <write delay ms> [<flush dev> <flush offset> <flush delay ms>]]",
    min_args: 3,
    max_args: Some(9),
    splits: false,
    exclusive_args: &[],
    ctr: delay_ctr,
};

/// Queue capacity each class starts with on each reactor (grown only past
/// that many bios held at once).
const QUEUE_CAP: usize = 256;

static NEXT_KEY: AtomicU64 = AtomicU64::new(0x6465_6c61_0000_0000);

/// One class of I/O: where it goes and how long it waits.
#[derive(Clone)]
struct Class {
    dev: Arc<dyn BlockDevice>,
    start: u64,
    delay_ms: u32,
}

const READ: usize = 0;
const WRITE: usize = 1;
const FLUSH: usize = 2;

struct Delay {
    /// The real devices (pass-through) or the engine (delaying).
    devs: Vec<DevArea>,
    classes: [Class; 3],
    /// Arguments given: 3, 6 or 9 (the table line repeats that many).
    argc: usize,
    /// Pass-through with one device: the offset the fast path adds.
    offset: Option<u64>,
    /// The engine, when any delay is set.
    engine: Option<Arc<Shared>>,
}

fn delay_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    if !matches!(argv.len(), 3 | 6 | 9) {
        return Err(Error::invalid(format!(
            "delay: {} arguments: expected exactly 3, 6 or 9 ({})",
            argv.len(),
            DELAY.usage
        )));
    }
    let class = |i: usize, what: &str| -> Result<Class, Error> {
        let e = |e: Error| e.context(format!("delay: {what}"));
        let start = parse_sector("offset", argv[i + 1]).map_err(e)?;
        let delay_ms = argv[i + 2].parse::<u32>().map_err(|_| {
            Error::invalid(format!(
                "delay: {what}: invalid delay '{}': expected milliseconds",
                argv[i + 2]
            ))
        })?;
        let dev = ctx.get_device(argv[i]).map_err(e)?;
        let size = dev.limits().sectors;
        if start.checked_add(ctx.len).is_none_or(|end| end > size) {
            return Err(Error::invalid(format!(
                "delay: {what}: device '{}' is too small: the target needs sectors {start}..{}, it has {size}",
                dev.name(),
                start.saturating_add(ctx.len)
            )));
        }
        Ok(Class {
            dev,
            start,
            delay_ms,
        })
    };
    let read = class(0, "read device")?;
    let write = if argv.len() >= 6 {
        class(3, "write device")?
    } else {
        read.clone()
    };
    let flush = if argv.len() >= 9 {
        class(6, "flush device")?
    } else {
        write.clone()
    };
    let classes = [read, write, flush];
    let area = |c: &Class| DevArea {
        dev: c.dev.clone(),
        start: c.start,
        len: ctx.len,
    };
    if classes.iter().all(|c| c.delay_ms == 0) {
        // Pass-through: the real devices, read and write in map order.
        let devs = match argv.len() {
            3 => vec![area(&classes[READ])],
            6 => vec![area(&classes[READ]), area(&classes[WRITE])],
            _ => classes.iter().map(area).collect(),
        };
        return Ok(Box::new(Delay {
            offset: (devs.len() == 1).then_some(classes[READ].start),
            devs,
            classes,
            argc: argv.len(),
            engine: None,
        }));
    }
    let shared = Arc::new(Shared {
        key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
        classes: classes.clone(),
        len: ctx.len,
        ops: Default::default(),
        flushing: AtomicBool::new(false),
        reactors: Mutex::new(Vec::new()),
    });
    let engine: Arc<dyn BlockDevice> = Arc::new(DelayDev {
        name: format!("delay({})", classes[READ].dev.name()),
        shared: shared.clone(),
    });
    Ok(Box::new(Delay {
        devs: vec![DevArea {
            dev: engine,
            start: 0,
            len: ctx.len,
        }],
        classes,
        argc: argv.len(),
        offset: None,
        engine: Some(shared),
    }))
}

impl Target for Delay {
    #[inline]
    fn map(&self, mut bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        if self.engine.is_some() {
            // The engine spans the target: same sectors.
            return Map::Remapped(bio, 0);
        }
        let (c, d) = if bio.op == Op::Read || self.devs.len() == 1 {
            (READ, 0)
        } else {
            (WRITE, 1)
        };
        bio.sector += self.classes[c].start;
        Map::Remapped(bio, d)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn no_clone(&self) -> bool {
        true
    }

    fn remap_offset(&self) -> Option<u64> {
        self.offset
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        match ty {
            StatusType::Info => {
                let ops = |i: usize| {
                    self.engine
                        .as_ref()
                        .map_or(0, |e| e.ops[i].load(Ordering::Relaxed))
                };
                out.push_str(&format!("{} {}", ops(READ), ops(WRITE)));
                if self.argc == 9 {
                    out.push_str(&format!(" {}", ops(FLUSH)));
                }
            }
            StatusType::Table => {
                let n = self.argc / 3;
                let v: Vec<String> = self.classes[..n]
                    .iter()
                    .map(|c| format!("{} {} {}", c.dev.name(), c.start, c.delay_ms))
                    .collect();
                out.push_str(&v.join(" "));
            }
        }
    }

    fn presuspend(&self) {
        if let Some(e) = &self.engine {
            e.flushing.store(true, Ordering::Release);
            // Wake every reactor with held bios: its turn releases them.
            let reactors = e.reactors.lock().unwrap_or_else(|p| p.into_inner());
            for h in reactors.iter() {
                h.send(|_| {});
            }
        }
    }

    fn resume(&self) {
        if let Some(e) = &self.engine {
            e.flushing.store(false, Ordering::Release);
        }
    }
}

/// What the engine's channels share.
struct Shared {
    /// Key of this engine's channel in each reactor's locals.
    key: u64,
    classes: [Class; 3],
    len: u64,
    /// Bios held now, per class (dm-delay's status).
    ops: [AtomicU32; 3],
    /// Set from presuspend to resume: nothing is held.
    flushing: AtomicBool,
    /// Reactors with a channel, to wake on presuspend.
    reactors: Mutex<Vec<ReactorHandle>>,
}

/// The delay engine as a block device (see the module docs).
pub struct DelayDev {
    name: String,
    shared: Arc<Shared>,
}

impl BlockDevice for DelayDev {
    fn name(&self) -> &str {
        &self.name
    }

    fn limits(&self) -> Limits {
        let mut l = Limits::new(self.shared.len);
        for c in &self.shared.classes {
            l.stack(&c.dev.limits());
        }
        l.sectors = self.shared.len;
        l
    }

    fn caps(&self) -> Caps {
        let mut caps = Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES;
        let mut ro = false;
        let mut persistent = true;
        for c in &self.shared.classes {
            let k = c.dev.caps();
            caps = caps.intersection(k);
            ro |= k.contains(Caps::READ_ONLY);
            persistent &= k.contains(Caps::PERSISTENT);
        }
        if ro {
            caps.insert(Caps::READ_ONLY);
        }
        if persistent {
            caps.insert(Caps::PERSISTENT);
        }
        caps
    }

    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        let sh = &self.shared;
        if let Some(ch) = reactor
            .local(sh.key)
            .and_then(|c| c.downcast::<DelayChannel>().ok())
        {
            return Ok(ch);
        }
        let mut opened: Vec<(Arc<dyn BlockDevice>, Rc<dyn Channel>)> = Vec::new();
        let mut chans = Vec::with_capacity(3);
        for c in &sh.classes {
            let ch = match opened.iter().find(|(d, _)| Arc::ptr_eq(d, &c.dev)) {
                Some((_, ch)) => ch.clone(),
                None => {
                    let ch = c.dev.clone().open(reactor)?;
                    opened.push((c.dev.clone(), ch.clone()));
                    ch
                }
            };
            chans.push(ch);
        }
        let delay = |i: usize| Duration::from_millis(sh.classes[i].delay_ms as u64);
        let ch = Rc::new(DelayChannel {
            shared: sh.clone(),
            classes: [0, 1, 2].map(|i| ChanClass {
                ch: chans[i].clone(),
                start: sh.classes[i].start,
                delay: delay(i),
                queue: RefCell::new(VecDeque::with_capacity(QUEUE_CAP)),
            }),
            work: reactor.work_queue(),
            queued: Cell::new(false),
            me: RefCell::new(None),
        });
        let me: Rc<dyn Poller> = ch.clone();
        *ch.me.borrow_mut() = Some(Rc::downgrade(&me));
        reactor.set_local(sh.key, ch.clone());
        let mut rs = sh.reactors.lock().unwrap_or_else(|p| p.into_inner());
        rs.retain(|h| !h.is_closed());
        rs.push(reactor.handle());
        Ok(ch)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// One class on one reactor: its device's channel and its FIFO.
struct ChanClass {
    ch: Rc<dyn Channel>,
    start: u64,
    delay: Duration,
    /// (due, bio) in arrival order, which is due order (one delay).
    queue: RefCell<VecDeque<(Instant, BioPtr)>>,
}

impl ChanClass {
    #[inline]
    fn send(&self, mut bio: BioPtr) {
        bio.sector += self.start;
        self.ch.submit(bio);
    }
}

/// The engine's channel on one reactor.
struct DelayChannel {
    shared: Arc<Shared>,
    classes: [ChanClass; 3],
    work: WorkQueue,
    /// On the work queue (from a hold until the queues are empty).
    queued: Cell<bool>,
    me: RefCell<Option<std::rc::Weak<dyn Poller>>>,
}

impl Channel for DelayChannel {
    fn submit(&self, bio: BioPtr) {
        let i = match bio.op {
            Op::Read => READ,
            Op::Flush => FLUSH,
            _ => WRITE,
        };
        let c = &self.classes[i];
        if c.delay.is_zero() || self.shared.flushing.load(Ordering::Acquire) {
            return c.send(bio);
        }
        c.queue
            .borrow_mut()
            .push_back((Instant::now() + c.delay, bio));
        self.shared.ops[i].fetch_add(1, Ordering::Relaxed);
        if !self.queued.replace(true) {
            if let Some(me) = self.me.borrow().as_ref().and_then(|w| w.upgrade()) {
                self.work.queue(me);
            }
        }
    }
}

impl Poller for DelayChannel {
    fn poll(&self) -> usize {
        let all = self.shared.flushing.load(Ordering::Acquire);
        let now = Instant::now();
        let mut n = 0;
        for (i, c) in self.classes.iter().enumerate() {
            loop {
                let bio = {
                    let mut q = c.queue.borrow_mut();
                    match q.front() {
                        Some((due, _)) if all || *due <= now => q.pop_front().map(|(_, b)| b),
                        _ => None,
                    }
                };
                let Some(bio) = bio else { break };
                self.shared.ops[i].fetch_sub(1, Ordering::Relaxed);
                c.send(bio);
                n += 1;
            }
        }
        if !self.pending_now() {
            self.queued.set(false);
        }
        n
    }

    fn deadline(&self) -> Option<Instant> {
        self.classes
            .iter()
            .filter_map(|c| c.queue.borrow().front().map(|(d, _)| *d))
            .min()
    }

    fn pending(&self) -> bool {
        self.queued.get()
    }
}

impl DelayChannel {
    fn pending_now(&self) -> bool {
        self.classes.iter().any(|c| !c.queue.borrow().is_empty())
    }
}
