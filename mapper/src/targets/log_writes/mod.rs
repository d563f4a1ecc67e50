//! `log-writes`: passes I/O to a device and logs every write, flush, FUA
//! and discard to a second device, in dm-log-writes' on-disk format
//! ([`format`](mod@format)), so that the log can be replayed to any point
//! ([`replay`], `udm log-replay`, or xfstests' `replay-log`).
//!
//! Table line: `<start> <length> log-writes <dev> <log dev>`
//!
//! Message: `mark <name>`: adds a mark entry (the name cut to fit the
//! block) and returns once it and everything logged before it is on the
//! log device.
//!
//! Status: `<logged entries> <highest log sector used>[ logging_disabled]`.
//!
//! As dm-log-writes, writes are logged once a flush covers them: a write
//! completes into an "unflushed" list; a flush takes that list when it is
//! submitted and, when it completes, logs the list and then itself. FUA
//! writes are logged as they complete; discards wait for a flush, as
//! writes do. Marks are logged at once. When the target
//! is destroyed, what is still unflushed is logged, then a mark
//! `dm-log-writes-end`. Writes that fail are not logged. Write-zeroes are
//! logged as writes of zeroes (replay-log has no such op).
//!
//! The target remaps onto an internal device (the engine) so that flushes,
//! which the core fans out to a table's devices, reach it. The engine copies
//! each write's data (the log is written after the caller's buffer is gone)
//! and hands finished entries to a logger thread with a reactor of its own,
//! which lays them out on the log device in order. This is a test target:
//! it allocates per write, as dm-log-writes does.

pub mod format;
pub mod replay;

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use udm_core::{
    AlignedBuf, BioPtr, BlockDevice, Caps, Channel, Error, ErrorKind, Limits, Op, Reactor,
    ReactorConfig, ReactorHandle, Status, SECTOR_SHIFT,
};

use crate::target::{CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `log-writes` target type.
pub const LOG_WRITES: TargetType = TargetType {
    name: "log-writes",
    version: [1, 1, 0],
    summary: "logs every write, flush, FUA and discard to a log device for replay",
    usage: "<dev> <log dev>",
    min_args: 2,
    max_args: Some(2),
    splits: false,
    exclusive_args: &[1],
    ctr: log_writes_ctr,
};

/// The mark the target logs when it is destroyed (as dm-log-writes).
pub const END_MARK: &str = "dm-log-writes-end";

/// How long a mark or a suspend waits for the logger before it fails.
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// One entry waiting to be logged.
struct Block {
    flags: u64,
    /// In log blocks (the device's logical block size).
    sector: u64,
    nr_sectors: u64,
    /// The write's data (empty for a flush, discard or mark).
    data: AlignedBuf,
    /// A mark's name.
    mark: Vec<u8>,
    /// A flush's: the writes it covers, logged before it.
    covered: Vec<Block>,
}

impl Block {
    fn new(flags: u64) -> Block {
        Block {
            flags,
            sector: 0,
            nr_sectors: 0,
            data: AlignedBuf::default(),
            mark: Vec::new(),
            covered: Vec::new(),
        }
    }
}

/// What the engine, the logger and the target share.
struct Shared {
    dev: Arc<dyn BlockDevice>,
    log: Arc<dyn BlockDevice>,
    len: u64,
    /// Log block size in bytes.
    sectorsize: u32,
    /// log2 of 512-byte sectors per log block.
    shift: u32,
    /// Completed writes no flush has taken yet.
    unflushed: Mutex<Vec<Block>>,
    /// Cleared when the log device is full or fails (dm's logging_enabled).
    enabled: AtomicBool,
    /// For the status line (the logger updates them).
    entries: AtomicU64,
    next_sector: AtomicU64,
    /// The logger's reactor.
    logger: ReactorHandle,
    /// Tells the logger thread to end once idle.
    stop: Arc<AtomicBool>,
}

struct LogWrites {
    devs: [DevArea; 1],
    shared: Arc<Shared>,
    join: Mutex<Option<JoinHandle<()>>>,
}

fn log_writes_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    let dev = ctx
        .get_device(argv[0])
        .map_err(|e| e.context("log-writes: device"))?;
    let log = ctx
        .get_device(argv[1])
        .map_err(|e| e.context("log-writes: log device"))?;
    let sectorsize = dev.limits().logical_block_size;
    if !sectorsize.is_power_of_two() || sectorsize < 512 {
        return Err(Error::invalid(format!(
            "log-writes: device '{}' has an unsupported logical block size {sectorsize}",
            dev.name()
        )));
    }
    let log_lbs = log.limits().logical_block_size;
    if log_lbs > sectorsize {
        return Err(Error::invalid(format!(
            "log-writes: log device '{}' has {log_lbs}-byte blocks, larger than the device's {sectorsize}",
            log.name()
        )));
    }
    let (tx, rx) = mpsc::channel();
    let lsectors = log.limits().sectors;
    let log2 = log.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let join = std::thread::Builder::new()
        .name("udm-log-writes".into())
        .spawn(move || logger_thread(log2, sectorsize, lsectors, stop2, tx))
        .map_err(|e| Error::os("log-writes: spawning the logger thread", e))?;
    let handle = match rx.recv() {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            let _ = join.join();
            return Err(e);
        }
        Err(_) => {
            let _ = join.join();
            return Err(Error::new(
                ErrorKind::Io,
                "log-writes: the logger thread died starting",
            ));
        }
    };
    let shared = Arc::new(Shared {
        dev: dev.clone(),
        log,
        len: ctx.len,
        sectorsize,
        shift: (sectorsize >> SECTOR_SHIFT).trailing_zeros(),
        unflushed: Mutex::new(Vec::new()),
        enabled: AtomicBool::new(true),
        entries: AtomicU64::new(0),
        next_sector: AtomicU64::new((sectorsize >> SECTOR_SHIFT) as u64),
        logger: handle,
        stop,
    });
    let engine: Arc<dyn BlockDevice> = Arc::new(LwDev {
        name: format!("log-writes({},{})", dev.name(), shared.log.name()),
        shared: shared.clone(),
    });
    Ok(Box::new(LogWrites {
        devs: [DevArea {
            dev: engine,
            start: 0,
            len: ctx.len,
        }],
        shared,
        join: Mutex::new(Some(join)),
    }))
}

impl Shared {
    fn unflushed(&self) -> std::sync::MutexGuard<'_, Vec<Block>> {
        self.unflushed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `blocks` to the logger, in order; with `done`, that is told
    /// once they (and all before them) are on the log device.
    fn log(self: &Arc<Self>, blocks: Vec<Block>, done: Option<mpsc::Sender<()>>) {
        let sh = self.clone();
        self.logger.send(move |r| {
            if let Some(l) = r
                .local(LOGGER_KEY)
                .and_then(|l| l.downcast::<Logger>().ok())
            {
                for b in blocks {
                    l.log_block(b, &sh);
                }
                if let Some(d) = done {
                    l.waiters.borrow_mut().push(d);
                    l.maybe_wake();
                }
            }
        });
    }

    /// Logs `blocks` and waits until they are on the log device.
    fn log_and_wait(self: &Arc<Self>, blocks: Vec<Block>) -> Result<(), Error> {
        let (tx, rx) = mpsc::channel();
        self.log(blocks, Some(tx));
        rx.recv_timeout(SYNC_TIMEOUT).map_err(|_| {
            Error::new(
                ErrorKind::Io,
                "log-writes: the logger did not finish writing the log",
            )
        })
    }

    fn mark(&self, name: &str) -> Block {
        let max = self.sectorsize as usize - format::ENTRY_BYTES - 1;
        let mut b = Block::new(format::MARK);
        b.mark = name.as_bytes()[..name.len().min(max)].to_vec();
        b
    }
}

impl Target for LogWrites {
    #[inline]
    fn map(&self, bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        // The engine spans the target: same sectors.
        Map::Remapped(bio, 0)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn no_clone(&self) -> bool {
        true
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        let sh = &self.shared;
        match ty {
            StatusType::Info => {
                out.push_str(&format!(
                    "{} {}",
                    sh.entries.load(Ordering::Relaxed),
                    sh.next_sector.load(Ordering::Relaxed) - 1
                ));
                if !sh.enabled.load(Ordering::Relaxed) {
                    out.push_str(" logging_disabled");
                }
            }
            StatusType::Table => {
                out.push_str(&format!("{} {}", sh.dev.name(), sh.log.name()));
            }
        }
    }

    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        match argv {
            [m, name] if m.eq_ignore_ascii_case("mark") => {
                let b = self.shared.mark(name);
                self.shared.log_and_wait(vec![b])?;
                Ok(String::new())
            }
            _ => Err(Error::invalid(format!(
                "log-writes: unknown message '{}' (known: mark <name>)",
                argv.join(" ")
            ))),
        }
    }

    fn postsuspend(&self) -> Result<(), Error> {
        // Everything acknowledged so far is in the log (or unflushed).
        self.shared.log_and_wait(Vec::new())
    }
}

impl Drop for LogWrites {
    fn drop(&mut self) {
        let sh = &self.shared;
        let mut blocks = std::mem::take(&mut *sh.unflushed());
        blocks.push(sh.mark(END_MARK));
        let _ = sh.log_and_wait(blocks);
        sh.stop.store(true, Ordering::Release);
        sh.logger.wake();
        let j = self.join.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(j) = j {
            let _ = j.join();
        }
    }
}

// ---------------------------------------------------------------------------
// The engine: a device that is the logged device plus the log.

struct LwDev {
    name: String,
    shared: Arc<Shared>,
}

impl BlockDevice for LwDev {
    fn name(&self) -> &str {
        &self.name
    }

    fn limits(&self) -> Limits {
        let mut l = self.shared.dev.limits();
        l.sectors = self.shared.len;
        l
    }

    fn caps(&self) -> Caps {
        let d = self.shared.dev.caps();
        let mut c = d.intersection(Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES);
        if d.contains(Caps::READ_ONLY) || self.shared.log.caps().contains(Caps::READ_ONLY) {
            c.insert(Caps::READ_ONLY);
        }
        if d.contains(Caps::PERSISTENT) && self.shared.log.caps().contains(Caps::PERSISTENT) {
            c.insert(Caps::PERSISTENT);
        }
        c
    }

    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        Ok(Rc::new(LwChannel {
            dev: self.shared.dev.clone().open(reactor)?,
            shared: self.shared.clone(),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct LwChannel {
    shared: Arc<Shared>,
    dev: Rc<dyn Channel>,
}

impl Channel for LwChannel {
    fn submit(&self, bio: BioPtr) {
        let sh = &*self.shared;
        if bio.op == Op::Read || !sh.enabled.load(Ordering::Relaxed) {
            return self.dev.submit(bio);
        }
        let shift = sh.shift;
        let mut block = Block::new(0);
        block.sector = bio.sector >> shift;
        block.nr_sectors = bio.sectors() >> shift;
        if bio.flags.contains(udm_core::BioFlags::FUA) {
            block.flags |= format::FUA;
        }
        match bio.op {
            Op::Write => {
                block.data = AlignedBuf::new(bio.len() as usize);
                bio.copy_out(0, &mut block.data);
            }
            // Logged as a write of zeroes: replay-log knows no such op.
            Op::WriteZeroes => block.data = AlignedBuf::new(bio.len() as usize),
            Op::Discard => block.flags |= format::DISCARD,
            Op::Flush => {
                block.flags |= format::FLUSH;
                block.covered = std::mem::take(&mut *sh.unflushed());
            }
            Op::Read => {}
        }
        let mut bio = bio.make_room();
        let b = Box::into_raw(Box::new((block, self.shared.clone())));
        if !bio.push_end_io(logged_done, b.cast()) {
            // SAFETY: `b` was leaked just above and not handed out.
            drop(unsafe { Box::from_raw(b) });
            return bio.complete(Status::NoMem);
        }
        self.dev.submit(bio)
    }
}

/// A logged bio completed on the device: queue its entry as dm-log-writes'
/// end_io does, then complete it.
fn logged_done(mut bio: BioPtr) {
    // SAFETY: `submit` pushed this end_io with a leaked Box of this type,
    // taken back exactly once here.
    let b = unsafe { Box::from_raw(bio.private() as *mut (Block, Arc<Shared>)) };
    let (mut block, sh) = *b;
    bio.pop_end_io();
    if bio.status().is_ok() {
        if block.flags & format::FLUSH != 0 {
            let mut blocks = std::mem::take(&mut block.covered);
            blocks.push(block);
            sh.log(blocks, None);
        } else if block.flags & format::FUA != 0 {
            sh.log(vec![block], None);
        } else {
            sh.unflushed().push(block);
        }
    } else if block.flags & format::FLUSH != 0 {
        // The covered writes wait for the next flush.
        let mut u = sh.unflushed();
        let mut covered = std::mem::take(&mut block.covered);
        covered.append(&mut u);
        *u = covered;
    }
    bio.endio();
}

// ---------------------------------------------------------------------------
// The logger: its own thread and reactor, laying entries out on the log.

const LOGGER_KEY: u64 = 0x6c77_6c6f_6767_6572;

struct Logger {
    reactor: *const Reactor,
    ch: Rc<dyn Channel>,
    sectorsize: u32,
    /// Where the next entry goes, in 512-byte sectors.
    next: Cell<u64>,
    end: u64,
    entries: Cell<u64>,
    enabled: Cell<bool>,
    inflight: Cell<u64>,
    super_busy: Cell<bool>,
    super_again: Cell<bool>,
    /// Told once nothing is in flight.
    waiters: RefCell<Vec<mpsc::Sender<()>>>,
    shared: RefCell<Option<Arc<Shared>>>,
}

type Ready = Result<ReactorHandle, Error>;

fn logger_thread(
    log: Arc<dyn BlockDevice>,
    sectorsize: u32,
    sectors: u64,
    stop: Arc<AtomicBool>,
    tx: mpsc::Sender<Ready>,
) {
    let reactor = match Reactor::new(ReactorConfig::default()) {
        Ok(r) => r,
        Err(e) => {
            let _ = tx.send(Err(Error::os(
                "log-writes: creating the logger's reactor",
                e,
            )));
            return;
        }
    };
    let ch = match log.clone().open(&reactor) {
        Ok(c) => c,
        Err(e) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    let l = Rc::new(Logger {
        reactor: &reactor,
        ch,
        sectorsize,
        next: Cell::new((sectorsize >> SECTOR_SHIFT) as u64),
        end: sectors,
        entries: Cell::new(0),
        enabled: Cell::new(true),
        inflight: Cell::new(0),
        super_busy: Cell::new(false),
        super_again: Cell::new(false),
        waiters: RefCell::new(Vec::new()),
        shared: RefCell::new(None),
    });
    reactor.set_local(LOGGER_KEY, l.clone());
    let _ = tx.send(Ok(reactor.handle()));
    // The target sets `stop` once its last entries are logged; until then
    // the reactor sleeps between messages.
    reactor.run_until(|| stop.load(Ordering::Acquire) && l.inflight.get() == 0);
    reactor.remove_local(LOGGER_KEY);
    // The logger holds the Shared that holds the logger's handle: let go.
    l.shared.borrow_mut().take();
}

/// One log write in flight: its buffer and the logger.
struct LogIo {
    logger: *const Logger,
    _buf: AlignedBuf,
    is_super: bool,
}

impl Logger {
    fn reactor(&self) -> &Reactor {
        // SAFETY: the logger lives in the reactor's locals and in closures
        // run by it, and logger_thread drops the reactor only after
        // run_until returned with nothing in flight.
        unsafe { &*self.reactor }
    }

    /// Lays `b` out after the last entry (dm's log_writes_kthread).
    fn log_block(&self, b: Block, sh: &Arc<Shared>) {
        if self.shared.borrow().is_none() {
            *self.shared.borrow_mut() = Some(sh.clone());
        }
        if !self.enabled.get() {
            return;
        }
        let bs = self.sectorsize as u64;
        let per = bs >> SECTOR_SHIFT;
        let sector = self.next.get();
        let data_blocks = if b.flags & format::DISCARD != 0 {
            0
        } else {
            b.nr_sectors
        };
        let next = sector + (data_blocks + 1) * per;
        if next >= self.end {
            tracing::error!("log-writes: ran out of space on the log device");
            self.enabled.set(false);
            sh.enabled.store(false, Ordering::Relaxed);
            return;
        }
        self.next.set(next);
        self.entries.set(self.entries.get() + 1);
        sh.entries.store(self.entries.get(), Ordering::Relaxed);
        sh.next_sector.store(next, Ordering::Relaxed);
        let mut head = AlignedBuf::new(bs as usize);
        format::Entry {
            sector: b.sector,
            nr_sectors: b.nr_sectors,
            flags: b.flags,
            data_len: b.mark.len() as u64,
        }
        .encode(&mut head);
        head[format::ENTRY_BYTES..format::ENTRY_BYTES + b.mark.len()].copy_from_slice(&b.mark);
        self.write(sector, head, false);
        if data_blocks > 0 && !b.data.is_empty() {
            self.write(sector + per, b.data, false);
        }
        if b.flags & (format::FUA | format::MARK) != 0 {
            self.write_super();
        }
    }

    fn write_super(&self) {
        if self.super_busy.replace(true) {
            self.super_again.set(true);
            return;
        }
        let mut buf = AlignedBuf::new(self.sectorsize as usize);
        format::Super {
            nr_entries: self.entries.get(),
            sectorsize: self.sectorsize,
        }
        .encode(&mut buf);
        self.write(0, buf, true);
    }

    fn write(&self, sector: u64, mut buf: AlignedBuf, is_super: bool) {
        let mut bio = self.reactor().alloc_bio();
        bio.op = Op::Write;
        bio.sector = sector;
        // SAFETY: the buffer moves into the LogIo below, whose heap block
        // does not move and lives until log_io_done.
        unsafe { bio.add_seg(buf.as_mut_ptr(), buf.len()) };
        let io = Box::new(LogIo {
            logger: self,
            _buf: buf,
            is_super,
        });
        bio.set_end_io(log_io_done, Box::into_raw(io).cast());
        self.inflight.set(self.inflight.get() + 1);
        self.ch.submit(bio);
    }

    /// Tells the waiters when nothing is in flight.
    fn maybe_wake(&self) {
        if self.inflight.get() == 0 {
            for w in self.waiters.borrow_mut().drain(..) {
                let _ = w.send(());
            }
        }
    }
}

fn log_io_done(bio: BioPtr) {
    // SAFETY: `write` leaked this Box as the bio's private; taken back once.
    let io = unsafe { Box::from_raw(bio.private() as *mut LogIo) };
    // SAFETY: the logger outlives its I/O (see Logger::reactor).
    let l = unsafe { &*io.logger };
    if !bio.status().is_ok() {
        tracing::error!("log-writes: error writing the log: {:?}", bio.status());
        l.enabled.set(false);
        if let Some(sh) = l.shared.borrow().as_ref() {
            sh.enabled.store(false, Ordering::Relaxed);
        }
    }
    drop(bio);
    l.inflight.set(l.inflight.get() - 1);
    if io.is_super {
        l.super_busy.set(false);
        if l.super_again.replace(false) {
            l.write_super();
        }
    }
    l.maybe_wake();
}
