//! `thin-pool`: the pool target, its shared state ([`Shared`]) and the
//! registry that binds pools to their metadata devices.
//!
//! As in dm, the pool is an object of its own, found by its metadata
//! device: loading a new `thin-pool` table over the same metadata device
//! (to grow the data device, or change features) reuses the pool, its
//! worker and its volumes, and the new table's settings apply when it is
//! resumed. The pool lives while any `thin-pool` or `thin` target holds it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use udm_core::{BioPtr, BlockDevice, Caps, Error, SECTOR_SHIFT};

use super::meta::MetaStore;
use super::metadata::ThinMetadata;
use super::metaio::MetaIo;
use super::vol::Vol;
use super::worker::{worker_gone, Job, Provisioned, Worker};
use crate::device::MappedDevice;
use crate::target::{CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `thin-pool` target type.
pub const THIN_POOL: TargetType = TargetType {
    name: "thin-pool",
    version: [1, 23, 0],
    summary: "a pool of data blocks that thin volumes and snapshots allocate from",
    usage:
        "<metadata dev> <data dev> <data block size> <low water mark> [<#features> <feature>...]",
    min_args: 4,
    max_args: None,
    splits: false,
    // The metadata and data devices are the pool's alone.
    exclusive_args: &[0, 1],
    ctr: pool_ctr,
};

/// Smallest and largest data block, in sectors (64 KiB and 1 GiB), and
/// the step between sizes (dm's `DATA_DEV_BLOCK_SIZE_MIN_SECTORS`).
pub(crate) const MIN_BLOCK: u64 = 128;
const MAX_BLOCK: u64 = 2_097_152;

/// Highest thin device id (dm's ids are 24 bits).
pub(crate) const MAX_DEV_ID: u32 = (1 << 24) - 1;

/// The pool's settings from its table line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Config {
    pub skip_block_zeroing: bool,
    pub ignore_discard: bool,
    pub no_discard_passdown: bool,
    pub read_only: bool,
    pub error_if_no_space: bool,
    /// Free data blocks at which the pool raises an event.
    pub low_water_blocks: u64,
}

/// The pool's mode, as its status reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Reads and writes.
    Write,
    /// Writes that need a new block wait (or fail) until the data device grows.
    OutOfDataSpace,
    /// No writes: `read_only`, or the metadata failed.
    ReadOnly,
}

/// The status numbers, copied out by the worker after each job.
#[derive(Clone, Debug)]
pub(crate) struct Stat {
    pub transaction_id: u64,
    pub metadata: (u64, u64),
    pub data: (u64, u64),
    pub held_root: Option<u64>,
    pub mode: Mode,
    pub needs_check: bool,
    /// A metadata operation failed (the pool stays read-only).
    pub meta_failed: bool,
}

/// A pool's state shared by its targets, its volumes and its worker.
pub(crate) struct Shared {
    pub meta_dev: Arc<dyn BlockDevice>,
    pub data_dev: Arc<dyn BlockDevice>,
    /// Sectors per data block.
    pub block_sectors: u64,
    cfg: Mutex<Config>,
    stat: Mutex<Stat>,
    queue: Mutex<VecDeque<Job>>,
    cv: Condvar,
    vols: Mutex<Vec<Weak<Vol>>>,
    /// Events raised (low water mark, out of space, read-only).
    pub events: AtomicU64,
    /// The metadata changed since the last commit (the worker's; read by
    /// the fast path for FUA writes).
    pub dirty: AtomicBool,
    /// The mappings reactors made, for the worker to insert (see
    /// `worker.rs`).
    journal: Mutex<Vec<Provisioned>>,
    /// The table's `skip_block_zeroing`, for the reactors.
    pub skip_zeroing: AtomicBool,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub fn lock_cfg(&self) -> MutexGuard<'_, Config> {
        lock(&self.cfg)
    }

    pub fn lock_stat(&self) -> MutexGuard<'_, Stat> {
        lock(&self.stat)
    }

    /// Queues a job for the worker.
    pub fn push(&self, j: Job) {
        lock(&self.queue).push_back(j);
        self.cv.notify_one();
    }

    /// The next job, waiting up to `timeout`; `Err` once the pool stops.
    pub fn next_job(&self, timeout: Duration) -> Result<Option<Job>, ()> {
        let mut q = lock(&self.queue);
        if let Some(j) = q.pop_front() {
            return Ok(Some(j));
        }
        if self.stop.load(Ordering::Acquire) {
            return Err(());
        }
        let (mut q, _) = self
            .cv
            .wait_timeout(q, timeout)
            .unwrap_or_else(|p| p.into_inner());
        Ok(q.pop_front())
    }

    /// Records a mapping a reactor made; the pool is dirty before the
    /// volume's cache shows it (see `dirty`).
    pub fn journal(&self, p: Provisioned) {
        let mut j = lock(&self.journal);
        j.push(p);
        self.dirty.store(true, Ordering::SeqCst);
    }

    /// The mappings journaled since the last call (worker only).
    pub fn take_journal(&self) -> Vec<Provisioned> {
        std::mem::take(&mut *lock(&self.journal))
    }

    /// After a commit: the pool is clean unless a reactor journaled a
    /// mapping since the worker last took the journal.
    pub fn clean_unless_journaled(&self) {
        let j = lock(&self.journal);
        if j.is_empty() {
            self.dirty.store(false, Ordering::SeqCst);
        }
    }

    /// Runs `f` on the worker and waits for its answer.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Worker) -> R + Send + 'static,
    ) -> Result<R, Error> {
        let (tx, rx) = mpsc::channel();
        self.push(Job::Call(Box::new(move |w| {
            let _ = tx.send(f(w));
        })));
        rx.recv().map_err(|_| worker_gone())
    }

    /// Registers a volume's view (the worker updates its cache).
    pub fn add_vol(&self, v: &Arc<Vol>) {
        let mut vs = lock(&self.vols);
        vs.retain(|w| w.strong_count() > 0);
        vs.push(Arc::downgrade(v));
    }

    /// The live views of device `dev` (or of every device).
    pub fn vols(&self, dev: Option<u32>) -> Vec<Arc<Vol>> {
        lock(&self.vols)
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|v| dev.is_none_or(|d| v.dev == d))
            .collect()
    }

    /// The pool turned read-only: every volume's mapped blocks are marked
    /// shared, so that no write takes the fast path (the worker fails them).
    pub fn read_only_caches(&self) {
        for v in self.vols(None) {
            v.provision.store(false, Ordering::SeqCst);
            v.share_all();
        }
    }

    /// Data blocks the data device holds.
    fn data_blocks(&self) -> u64 {
        self.data_dev.limits().sectors / self.block_sectors
    }
}

/// A pool: its shared state and its worker thread, which stops when the
/// last target lets go of the pool.
pub(crate) struct Pool {
    pub sh: Arc<Shared>,
    join: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
        self.sh.cv.notify_all();
        if let Some(j) = lock(&self.join).take() {
            let _ = j.join();
        }
    }
}

/// Every pool, by metadata device (dm's `dm_thin_pool_table`).
static POOLS: Mutex<Vec<Weak<Pool>>> = Mutex::new(Vec::new());

fn same_dev(a: &Arc<dyn BlockDevice>, b: &Arc<dyn BlockDevice>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

impl Pool {
    /// The pool over `meta` (an existing one, or one opened now).
    fn get_or_open(
        meta: Arc<dyn BlockDevice>,
        data: Arc<dyn BlockDevice>,
        block_sectors: u64,
        cfg: Config,
    ) -> Result<Arc<Pool>, Error> {
        let mut pools = lock(&POOLS);
        pools.retain(|p| p.strong_count() > 0);
        if let Some(p) = pools
            .iter()
            .filter_map(Weak::upgrade)
            .find(|p| same_dev(&p.sh.meta_dev, &meta))
        {
            if !same_dev(&p.sh.data_dev, &data) {
                return Err(Error::invalid(format!(
                    "thin-pool: metadata device '{}' belongs to a pool over data device '{}', not '{}'",
                    meta.name(),
                    p.sh.data_dev.name(),
                    data.name()
                )));
            }
            if p.sh.block_sectors != block_sectors {
                return Err(Error::invalid(format!(
                    "thin-pool: the pool on '{}' has data blocks of {} sectors, not {block_sectors}",
                    meta.name(),
                    p.sh.block_sectors
                )));
            }
            return Ok(p);
        }
        if pools
            .iter()
            .filter_map(Weak::upgrade)
            .any(|p| same_dev(&p.sh.data_dev, &data))
        {
            return Err(Error::invalid(format!(
                "thin-pool: data device '{}' already belongs to another pool",
                data.name()
            )));
        }
        let p = Pool::open(meta, data, block_sectors, cfg)?;
        pools.push(Arc::downgrade(&p));
        Ok(p)
    }

    fn open(
        meta: Arc<dyn BlockDevice>,
        data: Arc<dyn BlockDevice>,
        block_sectors: u64,
        cfg: Config,
    ) -> Result<Arc<Pool>, Error> {
        let nr_blocks = data.limits().sectors / block_sectors;
        let read_only = cfg.read_only;
        let skip_zeroing = cfg.skip_block_zeroing;
        let sh = Arc::new(Shared {
            meta_dev: meta,
            data_dev: data,
            block_sectors,
            cfg: Mutex::new(cfg),
            stat: Mutex::new(Stat {
                transaction_id: 0,
                metadata: (0, 0),
                data: (0, nr_blocks),
                held_root: None,
                mode: if read_only {
                    Mode::ReadOnly
                } else {
                    Mode::Write
                },
                needs_check: false,
                meta_failed: false,
            }),
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            vols: Mutex::new(Vec::new()),
            events: AtomicU64::new(0),
            dirty: AtomicBool::new(false),
            journal: Mutex::new(Vec::new()),
            skip_zeroing: AtomicBool::new(skip_zeroing),
            stop: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel();
        let wsh = sh.clone();
        let (mdev, bs) = (sh.meta_dev.clone(), block_sectors);
        let open = move || open_metadata(&mdev, bs, nr_blocks, read_only);
        let join = std::thread::Builder::new()
            .name("thin-pool".into())
            .spawn(move || Worker::run(wsh, open, tx))
            .map_err(|e| Error::os("thin-pool: spawning the worker thread", e))?;
        let pool = Arc::new(Pool {
            sh,
            join: Mutex::new(Some(join)),
        });
        match rx.recv() {
            Ok(Ok(())) => Ok(pool),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(worker_gone()),
        }
    }
}

/// Opens (or formats, when its first block is zeroes) a pool's metadata
/// on its worker thread: Linux's format on the metadata device.
fn open_metadata(
    dev: &Arc<dyn BlockDevice>,
    block_sectors: u64,
    nr_blocks: u64,
    read_only: bool,
) -> Result<Box<dyn MetaStore>, Error> {
    let io = MetaIo::open(dev)?;
    match ThinMetadata::open_or_format(Box::new(io), block_sectors as u32, nr_blocks, read_only) {
        Ok(m) => Ok(Box::new(m)),
        Err(e) => Err(e.context(format!("thin-pool: metadata device '{}'", dev.name()))),
    }
}

/// The pool of pool *device* `dev` (a udm device whose live table has a
/// `thin-pool` target): how a `thin` table line reaches its pool.
pub(crate) fn pool_of_device(dev: &Arc<dyn BlockDevice>) -> Result<Arc<Pool>, Error> {
    let not_pool = || {
        Error::invalid(format!(
            "'{}' is not a thin-pool device (its table has no thin-pool target)",
            dev.name()
        ))
    };
    let md = dev
        .as_any()
        .downcast_ref::<MappedDevice>()
        .ok_or_else(not_pool)?;
    let table = md.table();
    let t = table
        .targets
        .iter()
        .find(|t| t.ty == THIN_POOL.name)
        .ok_or_else(not_pool)?;
    let data = &t.target.devices().first().ok_or_else(not_pool)?.dev;
    lock(&POOLS)
        .iter()
        .filter_map(Weak::upgrade)
        .find(|p| same_dev(&p.sh.data_dev, data))
        .ok_or_else(not_pool)
}

struct PoolTarget {
    pool: Arc<Pool>,
    devs: [DevArea; 1],
    cfg: Config,
    /// The feature words as given (for the table line).
    features: Vec<String>,
}

fn bad(m: String) -> Error {
    Error::invalid(format!("thin-pool: {m}"))
}

/// Parses `<data block size>`: 64 KiB to 1 GiB in steps of 64 KiB.
pub(crate) fn parse_block_size(s: &str) -> Result<u64, Error> {
    s.parse::<u64>()
        .ok()
        .filter(|b| (MIN_BLOCK..=MAX_BLOCK).contains(b) && b.is_multiple_of(MIN_BLOCK))
        .ok_or_else(|| {
            bad(format!(
                "invalid data block size '{s}': expected a multiple of {MIN_BLOCK} sectors (64 KiB) from {MIN_BLOCK} to {MAX_BLOCK} (1 GiB)"
            ))
        })
}

/// Parses `[<#features> <feature>...]` into `cfg`.
pub(crate) fn parse_features(argv: &[&str], cfg: &mut Config) -> Result<Vec<String>, Error> {
    let Some((n, feats)) = argv.split_first() else {
        return Ok(Vec::new());
    };
    let n: usize = n
        .parse()
        .map_err(|_| bad(format!("invalid number of features '{n}'")))?;
    if feats.len() != n {
        return Err(bad(format!(
            "number of features is {n} but {} follow",
            feats.len()
        )));
    }
    for f in feats {
        match *f {
            "skip_block_zeroing" => cfg.skip_block_zeroing = true,
            "ignore_discard" => cfg.ignore_discard = true,
            "no_discard_passdown" => cfg.no_discard_passdown = true,
            "read_only" => cfg.read_only = true,
            "error_if_no_space" => cfg.error_if_no_space = true,
            other => {
                return Err(bad(format!(
                    "unknown feature '{other}' (known: skip_block_zeroing, ignore_discard, \
                     no_discard_passdown, read_only, error_if_no_space)"
                )))
            }
        }
    }
    Ok(feats.iter().map(|s| s.to_string()).collect())
}

fn pool_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    let block_sectors = parse_block_size(argv[2])?;
    let low_water_blocks: u64 = argv[3].parse().map_err(|_| {
        bad(format!(
            "invalid low water mark '{}': expected a number of blocks",
            argv[3]
        ))
    })?;
    let mut cfg = Config {
        low_water_blocks,
        ..Config::default()
    };
    let features = parse_features(&argv[4..], &mut cfg)?;
    let meta = ctx
        .get_device(argv[0])
        .map_err(|e| e.context("thin-pool"))?;
    let data = ctx
        .get_device(argv[1])
        .map_err(|e| e.context("thin-pool"))?;
    if same_dev(&meta, &data) {
        return Err(bad(format!(
            "the metadata and data devices are both '{}'",
            meta.name()
        )));
    }
    // The smallest metadata the format needs: a superblock, the two space
    // maps' roots and the two trees' roots, with room to copy on write.
    let meta_bytes = meta.limits().sectors << SECTOR_SHIFT;
    if meta_bytes < 64 * 4096 {
        return Err(bad(format!(
            "metadata device '{}' is too small: {meta_bytes} bytes, at least {} needed",
            meta.name(),
            64 * 4096
        )));
    }
    let data_sectors = data.limits().sectors;
    if data_sectors < block_sectors {
        return Err(bad(format!(
            "data device '{}' is too small: {data_sectors} sectors, less than one block of {block_sectors}",
            data.name()
        )));
    }
    let pool = Pool::get_or_open(meta, data.clone(), block_sectors, cfg.clone())?;
    Ok(Box::new(PoolTarget {
        pool,
        devs: [DevArea {
            dev: data,
            start: 0,
            len: ctx.len,
        }],
        cfg,
        features,
    }))
}

impl PoolTarget {
    /// Runs a message on the worker and commits after it (dm's messages
    /// change the metadata and commit).
    fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Worker) -> Result<R, Error> + Send + 'static,
    ) -> Result<R, Error> {
        self.pool.sh.call(move |w| {
            if w.sh.lock_stat().mode == Mode::ReadOnly {
                return Err(bad("the pool is read-only".into()));
            }
            let r = f(w)?;
            w.set_dirty(true);
            if !w.commit().is_ok() {
                return Err(bad("committing the metadata failed".into()));
            }
            w.refresh_stat();
            Ok(r)
        })?
    }
}

fn dev_id(what: &str, s: &str) -> Result<u32, Error> {
    s.parse::<u32>()
        .ok()
        .filter(|d| *d <= MAX_DEV_ID)
        .ok_or_else(|| bad(format!("invalid {what} '{s}': expected 0 to {MAX_DEV_ID}")))
}

fn txid(s: &str) -> Result<u64, Error> {
    s.parse::<u64>()
        .map_err(|_| bad(format!("invalid transaction id '{s}': expected a number")))
}

impl Target for PoolTarget {
    /// As dm's pool: I/O to the pool device goes to the data device.
    #[inline]
    fn map(&self, bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        Map::Remapped(bio, 0)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn no_clone(&self) -> bool {
        true
    }

    fn remap_offset(&self) -> Option<u64> {
        Some(0)
    }

    fn caps(&self, stacked: Caps) -> Caps {
        stacked
    }

    fn events(&self) -> u64 {
        self.pool.sh.events.load(Ordering::Relaxed)
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        let sh = &self.pool.sh;
        match ty {
            StatusType::Info => {
                // The mappings the reactors made count (as dm's counts
                // include every allocation).
                let _ = sh.call(|w| {
                    let _ = w.apply_journal();
                    w.refresh_stat();
                });
                let st = sh.lock_stat().clone();
                let cfg = sh.lock_cfg().clone();
                let held = st
                    .held_root
                    .map_or_else(|| "-".to_string(), |r| r.to_string());
                let mode = match st.mode {
                    Mode::Write => "rw",
                    Mode::OutOfDataSpace => "out_of_data_space",
                    Mode::ReadOnly => "ro",
                };
                let passdown = if cfg.no_discard_passdown || cfg.ignore_discard {
                    "no_discard_passdown"
                } else {
                    "discard_passdown"
                };
                let nospace = if cfg.error_if_no_space {
                    "error_if_no_space"
                } else {
                    "queue_if_no_space"
                };
                // dm's metadata low watermark: a quarter of the metadata
                // device, at most 4 MiB (1024 blocks).
                let meta_lwm = (st.metadata.1 / 4).min(1024);
                out.push_str(&format!(
                    "{} {}/{} {}/{} {held} {mode} {passdown} {nospace} {} {meta_lwm}",
                    st.transaction_id,
                    st.metadata.0,
                    st.metadata.1,
                    st.data.0,
                    st.data.1,
                    if st.needs_check { "needs_check" } else { "-" },
                ));
            }
            StatusType::Table => {
                out.push_str(&format!(
                    "{} {} {} {} {}",
                    sh.meta_dev.name(),
                    sh.data_dev.name(),
                    sh.block_sectors,
                    self.cfg.low_water_blocks,
                    self.features.len()
                ));
                for f in &self.features {
                    out.push(' ');
                    out.push_str(f);
                }
            }
        }
    }

    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        match argv {
            ["create_thin", id] => {
                let dev = dev_id("dev id", id)?;
                self.run(move |w| {
                    if w.meta.device_exists(dev) {
                        return Err(bad(format!("create_thin: dev id {dev} is in use")));
                    }
                    w.meta.create_thin(dev)
                })?;
            }
            ["create_snap", id, origin] => {
                let dev = dev_id("dev id", id)?;
                let origin = dev_id("origin dev id", origin)?;
                self.run(move |w| {
                    if w.meta.device_exists(dev) {
                        return Err(bad(format!("create_snap: dev id {dev} is in use")));
                    }
                    if !w.meta.device_exists(origin) {
                        return Err(bad(format!(
                            "create_snap: origin dev id {origin} does not exist"
                        )));
                    }
                    // The origin's blocks become shared: its caches say so,
                    // and the writes they remapped before finish,
                    // so that the snapshot holds every write completed
                    // before this message returns (dm asks for the origin
                    // to be suspended instead).
                    w.quiesce(origin);
                    for v in w.sh.vols(Some(origin)) {
                        v.share_all();
                    }
                    w.drain_all();
                    w.meta.create_snap(dev, origin)
                })?;
            }
            ["delete", id] => {
                let dev = dev_id("dev id", id)?;
                self.run(move |w| {
                    if !w.meta.device_exists(dev) {
                        return Err(bad(format!("delete: dev id {dev} does not exist")));
                    }
                    // A volume's device just removed lets go of its tables
                    // on each reactor's next turn: give them a moment.
                    let until = std::time::Instant::now() + Duration::from_millis(250);
                    while !w.sh.vols(Some(dev)).is_empty() {
                        if std::time::Instant::now() >= until {
                            return Err(bad(format!(
                                "delete: dev id {dev} is open (a thin table uses it): remove that device first"
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    w.drain_all();
                    w.meta.delete_thin(dev)
                })?;
            }
            ["set_transaction_id", old, new] => {
                let (old, new) = (txid(old)?, txid(new)?);
                self.run(move |w| {
                    w.meta
                        .set_transaction_id(old, new)
                        .map_err(|e| e.context("thin-pool: set_transaction_id"))
                })?;
            }
            ["reserve_metadata_snap"] => {
                self.run(|w| {
                    w.meta
                        .reserve_metadata_snap()
                        .map_err(|e| e.context("thin-pool: reserve_metadata_snap"))
                })?;
            }
            ["release_metadata_snap"] => {
                self.run(|w| {
                    w.meta
                        .release_metadata_snap()
                        .map_err(|e| e.context("thin-pool: release_metadata_snap"))
                })?;
            }
            _ => {
                return Err(bad(format!(
                    "unknown message '{}' (known: create_thin <id>, create_snap <id> <origin id>, \
                     delete <id>, set_transaction_id <old> <new>, reserve_metadata_snap, \
                     release_metadata_snap)",
                    argv.join(" ")
                )))
            }
        }
        Ok(String::new())
    }

    /// As dm's: what was acknowledged is committed once suspended.
    fn postsuspend(&self) -> Result<(), Error> {
        let ok = self.pool.sh.call(|w| w.commit().is_ok())?;
        if ok {
            Ok(())
        } else {
            Err(bad("committing the metadata failed".into()))
        }
    }

    /// This table's settings become the pool's, and a grown data device
    /// its new size (held writes then run).
    fn resume(&self) {
        let sh = &self.pool.sh;
        *sh.lock_cfg() = self.cfg.clone();
        sh.skip_zeroing
            .store(self.cfg.skip_block_zeroing, Ordering::SeqCst);
        let ro = {
            let mut st = sh.lock_stat();
            if self.cfg.read_only {
                st.mode = Mode::ReadOnly;
            } else if st.mode == Mode::ReadOnly && !st.meta_failed {
                st.mode = Mode::Write;
            }
            st.mode == Mode::ReadOnly
        };
        if ro {
            sh.read_only_caches();
        }
        let blocks = sh.data_blocks();
        let meta_blocks = sh.meta_dev.limits().sectors >> 3;
        // A resume cannot fail: a size that cannot be taken leaves the
        // pool as it was (its status shows the sizes it uses).
        let _ = sh.call(move |w| {
            let _ = w.resize_data(blocks);
            let _ = w.resize_metadata(meta_blocks);
            w.refresh_stat();
        });
    }
}
