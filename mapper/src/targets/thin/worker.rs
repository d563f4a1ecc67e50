//! The pool's worker (dm-thin's `do_worker`): one thread that owns the
//! metadata and does everything off the fast path, one job at a time:
//! lookups of blocks the reactors' caches do not know, provisioning
//! (allocate, zero or copy, then insert the mapping once the data is
//! written), discards, commits (on FLUSH/FUA and at least every second
//! while dirty), messages, and holding writes while the data device is
//! full. Its own I/O (zeroing, copying, passdown, the data flush before a
//! commit) runs on a reactor of its own, waited for in place: the worker
//! is a slow path by design.
//!
//! The bio prison: a virtual block being provisioned has a cell
//! ([`Worker::cells`]) from the moment its block is allocated until its
//! mapping is inserted; jobs for it wait there and run again after, so a
//! block is never provisioned twice. Before a block is unmapped, the
//! worker clears the cache entry and waits for the bios remapped earlier
//! ([`Vol::drain`]), so that no write lands in a block after it is freed.
//!
//! Reactors provision most blocks themselves ([`super::vol`]): the worker
//! reserves data blocks for each volume's channel on a reactor ahead of
//! need ([`Job::Refill`]), and inserts the mappings the reactors made from
//! the pool's journal before each job and each commit. A reserved block
//! not yet mapped is given back to the space map before a commit and
//! taken again after it, so that no commit counts a block no mapping
//! holds; a FLUSH, which the reactors pass on after the writes it covers
//! completed and were journaled, commits their mappings.

use std::cell::Cell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use udm_core::{
    AlignedBuf, BioPtr, BlockDevice, Channel, Error, ErrorKind, Op, Reactor, ReactorConfig,
    ReactorHandle, Status, SECTOR_SHIFT,
};

use super::meta::{Lookup, MetaStore};
use super::pool::{Mode, Shared};
use super::vol::{mapped, provisioning, Vol, UNKNOWN, UNMAPPED};

/// How often a dirty pool commits at the latest (dm's `COMMIT_PERIOD`).
const COMMIT_PERIOD: Duration = Duration::from_secs(1);
/// How long writes wait for space before they fail (dm's
/// `no_space_timeout`).
pub(crate) const NO_SPACE_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest the worker waits for remapped bios to complete before it
/// unmaps a block anyway (only a device that never completes hits it).
const DRAIN_LIMIT: Duration = Duration::from_secs(30);
/// The largest I/O the worker issues for zeroing and copying.
const CHUNK: usize = 1 << 20;

/// A bio handed to the worker: its reactor keeps it (it never leaves
/// that reactor's thread); the worker only carries the pointer back.
pub(crate) struct SendBio(pub *mut udm_core::Bio);

// SAFETY: the worker never dereferences the pointer; it only sends it back
// to the reactor the bio came from (`Reply::send`), which owns it again.
unsafe impl Send for SendBio {}

/// Where the answer for a bio goes: its reactor and the engine channel
/// there (a reactor-local key).
pub(crate) struct Reply {
    pub handle: ReactorHandle,
    pub key: u64,
    pub bio: SendBio,
}

/// What the reactor does with a bio the worker answered.
pub(crate) enum Action {
    /// Complete it with this status.
    Complete(Status),
    /// Fill it with zeroes and complete it (a read of an unmapped block).
    Zero,
    /// Send it to this data sector, counted in the volume's epoch.
    Remap { sector: u64, epoch: usize },
    /// Read it from the external origin; only its first `inside` sectors
    /// lie on the origin (the rest reads as zeroes).
    Origin { inside: u64 },
    /// Write it to this data sector, then tell the worker (`Job::Done`) to
    /// insert the mapping and, for FUA, commit.
    Write {
        sector: u64,
        insert: Option<Insert>,
        fua: bool,
    },
}

impl Reply {
    /// Sends `a` for the bio back to its reactor.
    pub fn send(self, a: Action) {
        let Reply { handle, key, bio } = self;
        // A reactor that is gone took its bios with it.
        handle.send(move |r| super::thin::finish(r, key, bio, a));
    }
}

/// A slow-path bio.
pub(crate) struct BioJob {
    pub vol: Arc<Vol>,
    /// The volume's external origin, if any.
    pub origin: Option<Arc<dyn BlockDevice>>,
    pub op: Op,
    /// Volume-relative.
    pub sector: u64,
    pub sectors: u64,
    pub fua: bool,
    pub reply: Reply,
}

/// The mapping a provisioning write makes once it has completed.
#[derive(Clone, Copy)]
pub(crate) struct Insert {
    pub vblock: u64,
    pub block: u64,
    /// It replaces a mapping (a shared block's): the old block may be
    /// freed by the insert.
    pub replaces: bool,
}

/// A provisioning write (or FUA write) finished on its reactor.
pub(crate) struct DoneJob {
    pub vol: Arc<Vol>,
    pub insert: Option<Insert>,
    pub status: Status,
    pub fua: bool,
    pub reply: Reply,
}

/// A call from a control thread (a message, a status, a resize).
pub(crate) type Call = Box<dyn FnOnce(&mut Worker) + Send>;

/// A mapping a reactor made (its data written), for the worker to insert.
pub(crate) struct Provisioned {
    pub vol: Arc<Vol>,
    pub vblock: u64,
    pub block: u64,
}

/// A volume's channel on a reactor asks for reserved data blocks.
pub(crate) struct RefillJob {
    pub vol: Arc<Vol>,
    pub handle: ReactorHandle,
    /// The channel's reactor-local key.
    pub key: u64,
    /// The channel's own number (a volume has a channel on each reactor,
    /// all under one key).
    pub id: u64,
    pub want: usize,
}

/// Reserved data blocks on their way between the worker and a channel:
/// whatever is left in them when dropped (a channel that is gone, a
/// reactor that stopped) goes back to the worker.
pub(crate) struct Blocks {
    pub sh: Arc<Shared>,
    pub blocks: Vec<u64>,
    /// The worker asked for them back and counts the answers.
    pub reclaim: bool,
}

impl Drop for Blocks {
    fn drop(&mut self) {
        if self.reclaim || !self.blocks.is_empty() {
            self.sh.push(Job::Return {
                blocks: std::mem::take(&mut self.blocks),
                reclaim: self.reclaim,
            });
        }
    }
}

/// What the worker is asked to do.
pub(crate) enum Job {
    Bio(BioJob),
    Done(DoneJob),
    Flush(Reply),
    Call(Call),
    /// Reserve blocks for a channel.
    Refill(RefillJob),
    /// Reserved blocks come back unused.
    Return {
        blocks: Vec<u64>,
        reclaim: bool,
    },
    /// A reactor ended its provisioning of (device, virtual block), for
    /// which the worker holds bios.
    Wake(u32, u64),
}

/// The most blocks a channel holds in reserve: enough to bridge a wait
/// for the worker of several milliseconds at full speed (64 MiB of 64 KiB
/// blocks).
pub(crate) const RESERVE: usize = 1024;

/// The worker's state; it lives on the worker thread only.
pub(crate) struct Worker {
    pub sh: Arc<Shared>,
    pub meta: Box<dyn MetaStore>,
    reactor: Reactor,
    data: Rc<dyn Channel>,
    /// Channels to external origins, by the device's address.
    origins: HashMap<usize, Rc<dyn Channel>>,
    /// The bio prison: virtual blocks being provisioned, and the jobs
    /// waiting for them.
    cells: HashMap<(u32, u64), Vec<Job>>,
    /// Jobs released from a cell, run before new ones.
    ready: VecDeque<Job>,
    /// Writes held while the data device is full, since when.
    no_space: VecDeque<(Instant, Job)>,
    /// Blocks reserved for the reactors and not yet seen in the journal:
    /// counted in the space map between commits, not in a commit.
    reserved: HashSet<u64>,
    /// Channels holding reserved blocks, by id (with their key): asked to
    /// give them back when the data device runs out.
    grants: HashMap<u64, (u64, ReactorHandle)>,
    /// Channels asked to give their blocks back and not answered yet.
    reclaiming: usize,
    /// Writes waiting for a block a reactor is provisioning.
    prov_wait: HashMap<(u32, u64), Vec<Job>>,
    last_commit: Instant,
    /// The low water mark's event was raised (and not re-armed since).
    lwm_raised: bool,
    zeroes: AlignedBuf,
    buf: AlignedBuf,
}

fn sync_done(bio: BioPtr) {
    // SAFETY: private is the Rc<Cell> leaked in `Worker::io`, taken back once.
    let done = unsafe { Rc::from_raw(bio.private() as *const Cell<Option<Status>>) };
    done.set(Some(bio.status()));
}

impl Worker {
    /// Runs the worker: `open` makes the metadata on this thread; its
    /// result goes to `ready` (the pool's constructor waits for it).
    pub fn run(
        sh: Arc<Shared>,
        open: impl FnOnce() -> Result<Box<dyn MetaStore>, Error>,
        ready: mpsc::Sender<Result<(), Error>>,
    ) {
        let mut w = match Worker::new(sh, open) {
            Ok(w) => w,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        w.refresh_stat();
        let _ = ready.send(Ok(()));
        w.main_loop();
    }

    fn new(
        sh: Arc<Shared>,
        open: impl FnOnce() -> Result<Box<dyn MetaStore>, Error>,
    ) -> Result<Worker, Error> {
        let reactor = Reactor::new(ReactorConfig::default())
            .map_err(|e| Error::os("thin-pool: creating the worker's reactor", e))?;
        let data = sh.data_dev.clone().open(&reactor)?;
        let meta = open()?;
        let ro = sh.lock_cfg().read_only;
        if ro {
            sh.lock_stat().mode = Mode::ReadOnly;
        }
        if meta.needs_check() && !ro {
            return Err(Error::invalid(
                "thin-pool: the metadata is marked needs_check: repair it with thin_check/thin_repair, or open the pool read_only",
            ));
        }
        Ok(Worker {
            sh,
            meta,
            reactor,
            data,
            origins: HashMap::new(),
            cells: HashMap::new(),
            ready: VecDeque::new(),
            no_space: VecDeque::new(),
            reserved: HashSet::new(),
            grants: HashMap::new(),
            reclaiming: 0,
            prov_wait: HashMap::new(),
            last_commit: Instant::now(),
            lwm_raised: false,
            zeroes: AlignedBuf::default(),
            buf: AlignedBuf::default(),
        })
    }

    fn main_loop(&mut self) {
        loop {
            let job = match self.ready.pop_front() {
                Some(j) => Some(j),
                None => match self.sh.next_job(self.timeout()) {
                    Ok(j) => j,
                    Err(()) => break,
                },
            };
            let _ = self.apply_journal();
            if let Some(j) = job {
                self.run_job(j);
            }
            if self.dirty() && self.last_commit.elapsed() >= COMMIT_PERIOD {
                let _ = self.commit();
            }
            self.expire_no_space();
            self.refresh_stat();
        }
        if self.dirty() {
            let _ = self.commit();
        }
        // Nothing maps through the pool any more (it is being dropped);
        // anything still parked is answered.
        for (_, j) in std::mem::take(&mut self.no_space) {
            self.fail(j, Status::IoErr);
        }
        let parked: Vec<Job> = self
            .cells
            .drain()
            .chain(self.prov_wait.drain())
            .flat_map(|(_, v)| v)
            .collect();
        for j in parked {
            self.fail(j, Status::IoErr);
        }
    }

    /// How long the worker may sleep: until the next commit or no-space
    /// deadline, at most a second.
    /// Whether the metadata changed since the last commit.
    pub fn dirty(&self) -> bool {
        self.sh.dirty.load(Ordering::SeqCst)
    }

    /// Records a change (before the caches show it: a FUA write that sees
    /// a mapping then sees it uncommitted) or a commit (after it).
    pub fn set_dirty(&self, on: bool) {
        self.sh.dirty.store(on, Ordering::SeqCst);
    }

    fn timeout(&self) -> Duration {
        let mut t = COMMIT_PERIOD;
        if self.dirty() {
            t = t.min(COMMIT_PERIOD.saturating_sub(self.last_commit.elapsed()));
        }
        if let Some((since, _)) = self.no_space.front() {
            t = t.min(NO_SPACE_TIMEOUT.saturating_sub(since.elapsed()));
        }
        t.max(Duration::from_millis(1))
    }

    fn run_job(&mut self, j: Job) {
        match j {
            Job::Bio(b) => self.bio(b),
            Job::Done(d) => self.done(d),
            Job::Flush(r) => {
                let s = self.commit();
                r.send(Action::Complete(s));
            }
            Job::Call(f) => f(self),
            Job::Refill(r) => self.refill(r),
            Job::Return { blocks, reclaim } => self.returned(blocks, reclaim),
            Job::Wake(dev, v) => {
                if let Some(waiting) = self.prov_wait.remove(&(dev, v)) {
                    self.ready.extend(waiting);
                }
            }
        }
    }

    fn fail(&mut self, j: Job, s: Status) {
        match j {
            Job::Bio(b) => b.reply.send(Action::Complete(s)),
            Job::Done(d) => d.reply.send(Action::Complete(s)),
            Job::Flush(r) => r.send(Action::Complete(s)),
            Job::Call(f) => f(self),
            // Stopping: no more reserves.
            Job::Refill(_) | Job::Wake(..) => {}
            Job::Return { blocks, reclaim } => self.returned(blocks, reclaim),
        }
    }

    fn bs(&self) -> u64 {
        self.sh.block_sectors
    }

    /// The live views of device `dev`.
    fn vols_of(&self, dev: u32) -> Vec<Arc<Vol>> {
        self.sh.vols(Some(dev))
    }

    fn set_entry(&self, dev: u32, vblock: u64, v: u64) {
        for vol in self.vols_of(dev) {
            vol.set(vblock, v);
        }
    }

    /// Waits for every bio remapped so far, on every volume of the pool,
    /// to complete (before a block may be freed).
    pub fn drain_all(&self) {
        for vol in self.sh.vols(None) {
            vol.drain(DRAIN_LIMIT);
        }
    }

    fn bio(&mut self, b: BioJob) {
        let bs = self.bs();
        let v = b.sector / bs;
        let dev = b.vol.dev;
        if b.op.is_write() && self.sh.lock_stat().mode == Mode::ReadOnly {
            return b.reply.send(Action::Complete(Status::IoErr));
        }
        if b.op.is_write() {
            if let Some(q) = self.cells.get_mut(&(dev, v)) {
                q.push(Job::Bio(b));
                return;
            }
            if provisioning(b.vol.get(v)) {
                return self.wait_provisioning(b);
            }
            // A reactor that ended its provisioning just now journaled
            // the mapping before the entry changed: insert it before the
            // lookup.
            let _ = self.apply_journal();
        }
        let found = match self.meta.lookup(dev, v) {
            Ok(f) => f,
            Err(e) => {
                let s = self.meta_failed(e);
                return b.reply.send(Action::Complete(s));
            }
        };
        // Read-only, every mapped block counts as shared: no write may take
        // the fast path.
        let ro = self.sh.lock_stat().mode == Mode::ReadOnly;
        let entry = found.map_or(UNMAPPED, |m| mapped(m.block, m.shared || ro));
        match b.op {
            Op::Read => {
                self.set_entry(dev, v, entry);
                self.read(b, found)
            }
            Op::Write => {
                self.set_entry(dev, v, entry);
                self.write(b, found, entry)
            }
            Op::Discard => self.discard(b, found),
            _ => b.reply.send(Action::Complete(Status::NotSupp)),
        }
    }

    fn read(&mut self, b: BioJob, found: Option<Lookup>) {
        let bs = self.bs();
        if let Some(m) = found {
            let epoch = b.vol.enter();
            let sector = m.block * bs + b.sector % bs;
            return b.reply.send(Action::Remap { sector, epoch });
        }
        match &b.origin {
            Some(o) => {
                let olen = o.limits().sectors;
                if b.sector >= olen {
                    b.reply.send(Action::Zero)
                } else {
                    let inside = (olen - b.sector).min(b.sectors);
                    b.reply.send(Action::Origin { inside })
                }
            }
            None => b.reply.send(Action::Zero),
        }
    }

    /// A write; `entry` is what the volume's cache was just set to.
    fn write(&mut self, b: BioJob, found: Option<Lookup>, entry: u64) {
        let bs = self.bs();
        let (v, off) = (b.sector / bs, b.sector % bs);
        if let Some(m) = found.filter(|m| !m.shared) {
            let sector = m.block * bs + off;
            if b.fua {
                return b.reply.send(Action::Write {
                    sector,
                    insert: None,
                    fua: true,
                });
            }
            let epoch = b.vol.enter();
            return b.reply.send(Action::Remap { sector, epoch });
        }
        // The block is the worker's to provision from here: no reactor
        // claims it, and writes to it wait in its cell. If a reactor
        // claimed it since the lookup (and maybe mapped it already), the
        // write runs again.
        if !b.vol.take(v, entry) {
            let _ = self.apply_journal();
            self.ready.push_front(Job::Bio(b));
            return;
        }
        self.maybe_enable(&b.vol);
        let block = match self.alloc() {
            Ok(Some(block)) => block,
            Ok(None) => {
                b.vol.store(v, UNKNOWN);
                return self.out_of_space(Job::Bio(b));
            }
            Err(s) => {
                b.vol.store(v, UNKNOWN);
                return b.reply.send(Action::Complete(s));
            }
        };
        let whole = off == 0 && b.sectors == bs;
        let s = if whole {
            Status::Ok
        } else if let Some(m) = found {
            self.copy(m.block * bs, block * bs, bs)
        } else if let Some(o) = b.origin.clone() {
            self.copy_origin(&o, v * bs, block * bs)
        } else if self.sh.lock_cfg().skip_block_zeroing {
            Status::Ok
        } else {
            self.zero(block * bs, bs)
        };
        if !s.is_ok() {
            b.vol.store(v, UNKNOWN);
            return b.reply.send(Action::Complete(s));
        }
        self.cells.insert((b.vol.dev, v), Vec::new());
        b.reply.send(Action::Write {
            sector: block * bs + off,
            insert: Some(Insert {
                vblock: v,
                block,
                replaces: found.is_some(),
            }),
            fua: b.fua,
        });
    }

    fn discard(&mut self, b: BioJob, found: Option<Lookup>) {
        let bs = self.bs();
        let (dev, v) = (b.vol.dev, b.sector / bs);
        let Some(m) = found else {
            return b.reply.send(Action::Complete(Status::Ok));
        };
        // Only whole blocks are unmapped (the core splits discards at
        // block boundaries). Part of a block stays mapped; as in dm, with
        // passdown the data device is told of it, unless another device
        // shares the block or it is being provisioned.
        if !(b.sector.is_multiple_of(bs) && b.sectors == bs) {
            if !m.shared && !self.cells.contains_key(&(dev, v)) && self.passdown() {
                let at = m.block * bs + b.sector % bs;
                // Advisory: a failed passdown does not fail the discard.
                let _ = self.io_data(Op::Discard, at, std::ptr::null_mut(), b.sectors);
            }
            return b.reply.send(Action::Complete(Status::Ok));
        }
        if let Some(q) = self.cells.get_mut(&(dev, v)) {
            q.push(Job::Bio(b));
            return;
        }
        self.set_entry(dev, v, UNKNOWN);
        self.drain_all();
        if let Err(e) = self.meta.remove_range(dev, v, v + 1) {
            let s = self.meta_failed(e);
            return b.reply.send(Action::Complete(s));
        }
        self.set_dirty(true);
        self.set_entry(dev, v, UNMAPPED);
        if !m.shared && self.passdown() {
            // Advisory: a failed passdown does not fail the discard.
            let _ = self.io_data(Op::Discard, m.block * bs, std::ptr::null_mut(), bs);
        }
        b.reply.send(Action::Complete(Status::Ok));
    }

    /// Whether discards go on to the data device: the pool passes them
    /// down and the device takes them.
    fn passdown(&self) -> bool {
        let on = {
            let c = self.sh.lock_cfg();
            !c.no_discard_passdown && !c.ignore_discard
        };
        on && self.sh.data_dev.caps().supports(Op::Discard)
    }

    fn done(&mut self, d: DoneJob) {
        let mut s = d.status;
        let dev = d.vol.dev;
        if let Some(Insert {
            vblock: v,
            block,
            replaces,
        }) = d.insert
        {
            if s.is_ok() && replaces {
                // The old block loses a reference and may be freed: the
                // reads remapped to it finish first, and new ones wait here.
                self.set_entry(dev, v, UNKNOWN);
                self.drain_all();
            }
            if s.is_ok() {
                match self.meta.insert(dev, v, block) {
                    Ok(()) => {
                        self.set_dirty(true);
                        self.set_entry(dev, v, mapped(block, false));
                        d.vol.store(v, mapped(block, false));
                    }
                    Err(e) => s = self.meta_failed(e),
                }
            } else {
                // Asked again next time.
                d.vol.store(v, UNKNOWN);
            }
            if let Some(waiting) = self.cells.remove(&(dev, v)) {
                for j in waiting.into_iter().rev() {
                    self.ready.push_front(j);
                }
            }
        }
        if d.fua && s.is_ok() {
            s = self.commit();
        }
        d.reply.send(Action::Complete(s));
    }

    /// A data block, or None when the data device is full; counts the low
    /// water mark.
    fn alloc(&mut self) -> Result<Option<u64>, Status> {
        match self.meta.alloc_data_block() {
            Ok(Some(b)) => {
                self.set_dirty(true);
                self.check_low_water();
                Ok(Some(b))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.meta_failed(e)),
        }
    }

    /// Raises the low water mark's event when the free blocks (reserves
    /// counted free) reach it.
    fn check_low_water(&mut self) {
        let (used, total) = self.data_usage();
        let lwm = self.sh.lock_cfg().low_water_blocks;
        if total - used.min(total) <= lwm && !self.lwm_raised {
            self.lwm_raised = true;
            self.sh.events.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A write found no free block: fail it (`error_if_no_space`) or hold
    /// it until the data device grows or the timeout.
    fn out_of_space(&mut self, j: Job) {
        // Blocks in the channels' reserves come back first; the write runs
        // again once every channel answered.
        if self.reclaiming > 0 || self.reclaim() {
            self.no_space.push_back((Instant::now(), j));
            return;
        }
        {
            let mut st = self.sh.lock_stat();
            if st.mode == Mode::Write {
                st.mode = Mode::OutOfDataSpace;
                self.sh.events.fetch_add(1, Ordering::Relaxed);
            }
        }
        if self.sh.lock_cfg().error_if_no_space {
            return self.fail(j, Status::NoSpace);
        }
        self.no_space.push_back((Instant::now(), j));
    }

    fn expire_no_space(&mut self) {
        while self
            .no_space
            .front()
            .is_some_and(|(t, _)| t.elapsed() >= NO_SPACE_TIMEOUT)
        {
            if let Some((_, j)) = self.no_space.pop_front() {
                self.fail(j, Status::NoSpace);
            }
        }
    }

    /// The data device grew to `nr_blocks`: held writes run again.
    pub fn resize_data(&mut self, nr_blocks: u64) -> Result<(), Error> {
        let (_, total) = self.meta.data_usage();
        if nr_blocks < total {
            return Err(Error::invalid(format!(
                "thin-pool: the data device shrank from {total} to {nr_blocks} blocks; pools do not shrink"
            )));
        }
        if nr_blocks > total {
            self.meta.resize_data_dev(nr_blocks)?;
            self.set_dirty(true);
            self.lwm_raised = false;
        }
        {
            let mut st = self.sh.lock_stat();
            if st.mode == Mode::OutOfDataSpace {
                st.mode = Mode::Write;
            }
        }
        for (_, j) in std::mem::take(&mut self.no_space) {
            self.ready.push_back(j);
        }
        Ok(())
    }

    /// The metadata device grew to `nr_blocks` (of 4 KiB).
    pub fn resize_metadata(&mut self, nr_blocks: u64) -> Result<(), Error> {
        let (_, total) = self.meta.metadata_usage();
        if nr_blocks > total {
            self.meta.resize_metadata_dev(nr_blocks)?;
            self.set_dirty(true);
        }
        Ok(())
    }

    /// A metadata operation failed: as dm, the pool turns read-only (the
    /// transaction is dropped) and raises an event. Returns the bio status.
    fn meta_failed(&mut self, _e: Error) -> Status {
        let _ = self.meta.abort();
        // The reserves were of the dropped transaction (and the reactors
        // no longer provision: read_only_caches below).
        self.reserved.clear();
        self.grants.clear();
        self.set_dirty(false);
        {
            let mut st = self.sh.lock_stat();
            st.meta_failed = true;
            if st.mode != Mode::ReadOnly {
                st.mode = Mode::ReadOnly;
                self.sh.events.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sh.read_only_caches();
        // What the caches say may be of the dropped transaction.
        for v in self.sh.vols(None) {
            v.forget();
        }
        Status::IoErr
    }

    /// Commits the transaction if it changed: the data device is flushed
    /// first, so that no committed mapping points at data that is not
    /// durable (dm does the same since 5.2).
    pub fn commit(&mut self) -> Status {
        let s = self.apply_journal();
        if !s.is_ok() {
            return s;
        }
        if !self.dirty() {
            return Status::Ok;
        }
        if self.sh.data_dev.caps().supports(Op::Flush) {
            let s = self.io_data(Op::Flush, 0, std::ptr::null_mut(), 0);
            if !s.is_ok() {
                return s;
            }
        }
        // Reserved blocks are free in what is committed (see the module).
        let reserved: Vec<u64> = self.reserved.iter().copied().collect();
        for &b in &reserved {
            if let Err(e) = self.meta.release_data_block(b) {
                return self.meta_failed(e);
            }
        }
        if let Err(e) = self.meta.commit() {
            return self.meta_failed(e);
        }
        for &b in &reserved {
            if let Err(e) = self.meta.claim_data_block(b) {
                return self.meta_failed(e);
            }
        }
        self.sh.clean_unless_journaled();
        self.last_commit = Instant::now();
        Status::Ok
    }

    /// (used, total) data blocks, the reserved ones counted free.
    fn data_usage(&self) -> (u64, u64) {
        let (used, total) = self.meta.data_usage();
        (used.saturating_sub(self.reserved.len() as u64), total)
    }

    /// Inserts the mappings the reactors made (see the module); IoErr if
    /// the metadata failed (and dropped them).
    pub fn apply_journal(&mut self) -> Status {
        let journal = self.sh.take_journal();
        if journal.is_empty() {
            return Status::Ok;
        }
        let mut s = Status::Ok;
        for p in journal {
            // A block not reserved any more was of a transaction dropped
            // since (a metadata failure): nothing to insert.
            if !self.reserved.remove(&p.block) {
                continue;
            }
            match self.meta.insert(p.vol.dev, p.vblock, p.block) {
                Ok(()) => {
                    self.set_dirty(true);
                    // Another view of the device (there is none while
                    // reactors provision; see quiesce) learns it too.
                    self.set_entry(p.vol.dev, p.vblock, mapped(p.block, false));
                }
                Err(e) => s = self.meta_failed(e),
            }
        }
        self.check_low_water();
        s
    }

    /// A write to a block a reactor is provisioning waits for its end.
    fn wait_provisioning(&mut self, b: BioJob) {
        let (dev, v) = (b.vol.dev, b.sector / self.bs());
        if b.vol.wait_for(v) {
            self.prov_wait
                .entry((dev, v))
                .or_default()
                .push(Job::Bio(b));
        } else {
            // Ended meanwhile: its mapping is in the journal.
            let _ = self.apply_journal();
            self.ready.push_front(Job::Bio(b));
        }
    }

    /// Stops reactors provisioning blocks of `dev`, waits for those
    /// provisioning now, and inserts their mappings: after it, the
    /// metadata holds every write to `dev` completed before.
    pub fn quiesce(&mut self, dev: u32) {
        let vols = self.vols_of(dev);
        for v in &vols {
            v.provision.store(false, Ordering::SeqCst);
        }
        for v in &vols {
            v.drain(DRAIN_LIMIT);
        }
        let _ = self.apply_journal();
    }

    /// Lets reactors provision `vol`'s blocks, if it is its device's only
    /// view and the pool writes.
    fn maybe_enable(&self, vol: &Arc<Vol>) {
        if vol.provision.load(Ordering::Relaxed) {
            return;
        }
        let ok = {
            let st = self.sh.lock_stat();
            st.mode == Mode::Write && !st.meta_failed
        };
        if ok && self.reclaiming == 0 && self.vols_of(vol.dev).len() == 1 {
            vol.provision.store(true, Ordering::SeqCst);
        }
    }

    /// Reserves blocks for a channel: up to what it wants, a quarter of
    /// the free blocks above the low water mark at most, and no more than
    /// keeps every reserve together under half the free blocks.
    fn refill(&mut self, r: RefillJob) {
        let mut g = Blocks {
            sh: self.sh.clone(),
            blocks: Vec::new(),
            reclaim: false,
        };
        self.maybe_enable(&r.vol);
        if r.vol.provision.load(Ordering::Relaxed) {
            let (used, total) = self.meta.data_usage();
            let lwm = self.sh.lock_cfg().low_water_blocks;
            // `used` counts the reserves.
            let free = total.saturating_sub(used);
            let n = (free.saturating_sub(lwm) / 4)
                .min((free / 2).saturating_sub(self.reserved.len() as u64))
                .min(r.want as u64);
            for _ in 0..n {
                match self.meta.alloc_data_block() {
                    Ok(Some(b)) => {
                        self.reserved.insert(b);
                        g.blocks.push(b);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.meta_failed(e);
                        g.blocks.clear();
                        break;
                    }
                }
            }
            if !g.blocks.is_empty() {
                self.grants.insert(r.id, (r.key, r.handle.clone()));
            }
        }
        let (key, id) = (r.key, r.id);
        r.handle
            .send(move |reactor| super::thin::granted(reactor, key, id, g));
    }

    /// Reserved blocks came back (`reclaim`: asked for).
    fn returned(&mut self, blocks: Vec<u64>, reclaim: bool) {
        for b in blocks {
            if self.reserved.remove(&b) {
                if let Err(e) = self.meta.release_data_block(b) {
                    self.meta_failed(e);
                    break;
                }
            }
        }
        if reclaim {
            self.reclaiming = self.reclaiming.saturating_sub(1);
            if self.reclaiming == 0 {
                for (_, j) in std::mem::take(&mut self.no_space) {
                    self.ready.push_back(j);
                }
            }
        }
    }

    /// Asks every channel holding reserved blocks to give them back, and
    /// stops reactors provisioning; false if none holds any.
    fn reclaim(&mut self) -> bool {
        if self.grants.is_empty() {
            return false;
        }
        for v in self.sh.vols(None) {
            v.provision.store(false, Ordering::SeqCst);
        }
        for (id, (key, handle)) in std::mem::take(&mut self.grants) {
            self.reclaiming += 1;
            let g = Blocks {
                sh: self.sh.clone(),
                blocks: Vec::new(),
                reclaim: true,
            };
            handle.send(move |reactor| super::thin::reclaimed(reactor, key, id, g));
        }
        true
    }

    /// Copies the status's numbers out of the metadata for readers on
    /// other threads.
    pub fn refresh_stat(&mut self) {
        let mut st = self.sh.lock_stat();
        st.transaction_id = self.meta.transaction_id();
        st.data = self.data_usage();
        st.metadata = self.meta.metadata_usage();
        st.held_root = self.meta.held_root();
        st.needs_check = self.meta.needs_check();
    }

    /// One I/O of `sectors` at `sector` on the data device, waited for.
    fn io_data(&mut self, op: Op, sector: u64, data: *mut u8, sectors: u64) -> Status {
        let ch = self.data.clone();
        self.io(&ch, op, sector, data, sectors)
    }

    fn io(&self, ch: &Rc<dyn Channel>, op: Op, sector: u64, data: *mut u8, sectors: u64) -> Status {
        let done = Rc::new(Cell::new(None));
        let mut bio = self.reactor.alloc_bio();
        let len = (sectors << SECTOR_SHIFT) as usize;
        if op.has_data() {
            bio.op = op;
            bio.sector = sector;
            // SAFETY: the caller's buffer outlives this call, which waits
            // for the bio to complete before it returns.
            unsafe { bio.add_seg(data, len) };
        } else {
            bio.set_dataless(op, sector, len as u32);
        }
        bio.set_end_io(sync_done, Rc::into_raw(done.clone()) as *mut ());
        ch.submit(bio);
        self.reactor.run_until(|| done.get().is_some());
        done.get().unwrap_or(Status::IoErr)
    }

    /// Sectors per I/O of zeroing and copying.
    fn chunk_sectors(&self) -> u64 {
        let max = self.sh.data_dev.limits().max_io_bytes as usize;
        (CHUNK.min(max.max(4096)) >> SECTOR_SHIFT) as u64
    }

    /// Writes zeroes over `sectors` at `sector` of the data device.
    fn zero(&mut self, sector: u64, sectors: u64) -> Status {
        let step = self.chunk_sectors();
        if self.zeroes.len() < (step << SECTOR_SHIFT) as usize {
            self.zeroes = AlignedBuf::new((step << SECTOR_SHIFT) as usize);
        }
        let mut done = 0;
        while done < sectors {
            let n = step.min(sectors - done);
            let p = self.zeroes.as_mut_ptr();
            let s = self.io_data(Op::Write, sector + done, p, n);
            if !s.is_ok() {
                return s;
            }
            done += n;
        }
        Status::Ok
    }

    /// Copies `sectors` from `from` to `to` on the data device.
    fn copy(&mut self, from: u64, to: u64, sectors: u64) -> Status {
        let step = self.chunk_sectors();
        self.ensure_buf(step);
        let mut done = 0;
        while done < sectors {
            let n = step.min(sectors - done);
            let p = self.buf.as_mut_ptr();
            let s = self.io_data(Op::Read, from + done, p, n);
            if !s.is_ok() {
                return s;
            }
            let s = self.io_data(Op::Write, to + done, p, n);
            if !s.is_ok() {
                return s;
            }
            done += n;
        }
        Status::Ok
    }

    fn ensure_buf(&mut self, sectors: u64) {
        if self.buf.len() < (sectors << SECTOR_SHIFT) as usize {
            self.buf = AlignedBuf::new((sectors << SECTOR_SHIFT) as usize);
        }
    }

    /// Copies the block at virtual sector `vsector` of external origin `o`
    /// to data sector `to`, zeroes past the origin's end.
    fn copy_origin(&mut self, o: &Arc<dyn BlockDevice>, vsector: u64, to: u64) -> Status {
        let key = Arc::as_ptr(o) as *const () as usize;
        let ch = match self.origins.get(&key) {
            Some(c) => c.clone(),
            None => match o.clone().open(&self.reactor) {
                Ok(c) => {
                    self.origins.insert(key, c.clone());
                    c
                }
                Err(_) => return Status::IoErr,
            },
        };
        let bs = self.bs();
        let olen = o.limits().sectors;
        let inside = olen.saturating_sub(vsector).min(bs);
        let step = self.chunk_sectors();
        self.ensure_buf(step);
        let mut done = 0;
        while done < inside {
            let n = step.min(inside - done);
            let p = self.buf.as_mut_ptr();
            let s = self.io(&ch, Op::Read, vsector + done, p, n);
            if !s.is_ok() {
                return s;
            }
            let s = self.io_data(Op::Write, to + done, p, n);
            if !s.is_ok() {
                return s;
            }
            done += n;
        }
        if inside < bs {
            return self.zero(to + inside, bs - inside);
        }
        Status::Ok
    }
}

/// An error for a message the worker could not answer (it stopped).
pub(crate) fn worker_gone() -> Error {
    Error::new(ErrorKind::Io, "thin-pool: the pool's worker has stopped")
}
