//! `thin`: a thin volume of a pool, and its engine: the per-volume device
//! whose channel takes what the fast path does not (see `mod.rs`).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_core::{
    push_extent, Alloc, BioFlags, BioPtr, BlockDevice, Caps, Channel, Error, Extent, Limits, Op,
    Reactor, ReactorHandle, Status, BLOCK_STATUS_MAX_EXTENTS, SECTOR_SHIFT,
};

use super::pool::{pool_of_device, Pool, MAX_DEV_ID};
use super::vol::{mapped, Vol, MAPPED, SHARED, UNMAPPED};
use super::worker::{
    Action, BioJob, Blocks, DoneJob, Insert, Job, Provisioned, RefillJob, Reply, SendBio, RESERVE,
};
use crate::target::{
    BlockMap, CtrCtx, DevArea, EndIoWhen, Map, MapCtx, StatusType, Target, TargetType,
};

/// The `thin` target type.
pub const THIN: TargetType = TargetType {
    name: "thin",
    version: [1, 23, 0],
    summary: "a thin volume (or snapshot) of a thin-pool",
    usage: "<pool dev> <dev id> [<external origin dev>]",
    min_args: 2,
    max_args: Some(3),
    splits: true,
    exclusive_args: &[],
    ctr: thin_ctr,
};

/// The most blocks one [`Target::block_status`] call looks at.
const MAX_STATUS_BLOCKS: usize = 1 << 16;

/// Index of the engine in the thin target's devices (0: where the core
/// says a bio went that the target completed itself).
const ENGINE: usize = 0;
/// Indices of the data device, listed twice: a remapped bio goes to the
/// one of the epoch it counted in, so that its end_io knows which count
/// to drop without a frame of the target's own.
const DATA: [usize; 2] = [1, 2];

struct Thin {
    pool: Arc<Pool>,
    vol: Arc<Vol>,
    devs: [DevArea; 3],
    /// Sectors per block, and its log2 when a power of two.
    bs: u64,
    shift: Option<u32>,
    pool_name: String,
    origin: Option<Arc<dyn BlockDevice>>,
    discard: bool,
}

fn bad(m: String) -> Error {
    Error::invalid(format!("thin: {m}"))
}

fn thin_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    let pool_dev = ctx.get_device(argv[0]).map_err(|e| e.context("thin"))?;
    let pool = pool_of_device(&pool_dev).map_err(|e| e.context("thin"))?;
    let dev = argv[1]
        .parse::<u32>()
        .ok()
        .filter(|d| *d <= MAX_DEV_ID)
        .ok_or_else(|| {
            bad(format!(
                "invalid dev id '{}': expected 0 to {MAX_DEV_ID}",
                argv[1]
            ))
        })?;
    let sh = &pool.sh;
    let bs = sh.block_sectors;
    let vol = Arc::new(Vol::new(dev, ctx.len.div_ceil(bs)));
    // Load the volume's mappings and register it in one job: no change of
    // the device's mappings falls between.
    let v = vol.clone();
    let loaded = pool.sh.call(move |w| {
        if !w.meta.device_exists(dev) {
            return Ok(false);
        }
        // A view already open (a reload) stops provisioning on its
        // reactors first, so that this one loads every mapping made.
        w.quiesce(dev);
        let runs = w.meta.mapped_ranges(dev, 0, v.nr_blocks)?;
        v.load(&runs);
        w.sh.add_vol(&v);
        Ok::<_, Error>(true)
    })??;
    if !loaded {
        return Err(bad(format!(
            "dev id {dev} does not exist in pool '{}' (create it with the message 'create_thin {dev}')",
            argv[0]
        )));
    }
    let origin = match argv.get(2) {
        Some(o) => {
            let o = ctx
                .get_device(o)
                .map_err(|e| e.context("thin: external origin"))?;
            if std::ptr::addr_eq(Arc::as_ptr(&o), Arc::as_ptr(&pool_dev)) {
                return Err(bad("the external origin cannot be the pool itself".into()));
            }
            Some(o)
        }
        None => None,
    };
    let data_lim = sh.data_dev.limits();
    let mut limits = Limits {
        sectors: ctx.len,
        ..data_lim
    };
    if let Some(o) = &origin {
        limits.logical_block_size = limits.logical_block_size.max(o.limits().logical_block_size);
    }
    let discard = !sh.lock_cfg().ignore_discard;
    let mut caps = Caps::FLUSH | Caps::FUA | (sh.data_dev.caps() & (Caps::PERSISTENT | Caps::POLL));
    if discard {
        caps |= Caps::DISCARD;
    }
    let engine = Arc::new(Engine {
        name: format!("{}:thin{dev}", argv[0]),
        pool: pool.clone(),
        vol: vol.clone(),
        origin: origin.clone(),
        limits,
        caps,
        key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
    });
    Ok(Box::new(Thin {
        devs: [
            DevArea {
                dev: engine,
                start: 0,
                len: ctx.len,
            },
            DevArea {
                dev: sh.data_dev.clone(),
                start: 0,
                len: data_lim.sectors,
            },
            DevArea {
                dev: sh.data_dev.clone(),
                start: 0,
                len: data_lim.sectors,
            },
        ],
        pool: pool.clone(),
        vol,
        bs,
        shift: bs.is_power_of_two().then(|| bs.trailing_zeros()),
        pool_name: argv[0].to_string(),
        origin,
        discard,
    }))
}

impl Thin {
    /// `sector`'s block and offset in it.
    #[inline(always)]
    fn split(&self, sector: u64) -> (u64, u64) {
        match self.shift {
            Some(s) => (sector >> s, sector & (self.bs - 1)),
            None => (sector / self.bs, sector % self.bs),
        }
    }
}

/// A bio the engine remapped completes: it no longer counts in its
/// volume's epoch.
fn remap_endio(mut bio: BioPtr) {
    // SAFETY: pushed by `EngineChannel::finish` with the volume, which the
    // engine (alive while its bios are in flight) holds.
    let vol = unsafe { &*(bio.private() as *const Vol) };
    vol.exit(bio.ctx() as usize);
    bio.pop_end_io();
    bio.endio();
}

impl Target for Thin {
    /// The fast path: a read of a mapped block, or a write of a mapped
    /// block no other device shares (with FUA: while the pool has nothing
    /// to commit), goes to the data device with its sector rewritten,
    /// counted in the volume's epoch (the device index says which); a
    /// read of a block known unmapped (without an external origin)
    /// completes with zeroes. Everything else goes to the engine.
    #[inline]
    fn map(&self, mut bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        if bio.op.has_data() {
            let (v, off) = self.split(bio.sector);
            let vol = &*self.vol;
            let e = vol.enter();
            let ent = vol.get(v);
            // A FUA write is durable on completion only if its mapping is
            // committed: read after the entry, a clean pool says it is (the
            // worker marks the pool dirty before a cache shows a change).
            if ent & MAPPED != 0
                && (bio.op == Op::Read || ent & SHARED == 0)
                && !(bio.flags.contains(BioFlags::FUA) && self.pool.sh.dirty.load(Ordering::SeqCst))
            {
                bio.sector = (ent >> 2) * self.bs + off;
                return Map::Remapped(bio, DATA[e]);
            }
            vol.exit(e);
            if ent == UNMAPPED && bio.op == Op::Read && self.origin.is_none() {
                bio.zero_fill();
                return Map::Kill(bio, Status::Ok);
            }
        }
        Map::Remapped(bio, ENGINE)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    /// The volume's cache, when blocks are a power of two: the core's plan
    /// then takes this `map`'s first case (without FUA) itself.
    fn block_map(&self) -> Option<BlockMap> {
        let shift = self.shift?;
        Some(BlockMap {
            vol: Arc::as_ptr(&self.vol),
            shift,
            data_blocks: self.devs[DATA[0]].len >> shift,
        })
    }

    fn no_clone(&self) -> bool {
        true
    }

    /// Every bio: one remapped to the data device drops its count.
    fn wants_end_io(&self) -> EndIoWhen {
        EndIoWhen::Always
    }

    fn end_io(&self, _bio: &mut udm_core::Bio, dev: usize) {
        if let Some(e) = DATA.iter().position(|&d| d == dev) {
            self.vol.exit(e);
        }
    }

    fn max_io_len(&self) -> u64 {
        self.bs
    }

    fn caps(&self, stacked: Caps) -> Caps {
        let mut c = stacked - Caps::WRITE_ZEROES;
        if self.discard {
            c |= Caps::DISCARD;
        } else {
            c -= Caps::DISCARD;
        }
        c
    }

    /// From the volume's cache, without waiting: mapped blocks are data,
    /// unmapped ones holes (data over an external origin, which this does
    /// not ask), blocks the cache does not know data.
    fn block_status(&self, rel: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let end = rel + sectors;
        let mut pos = rel;
        // Bounded: at most this many blocks per call (a prefix).
        for _ in 0..MAX_STATUS_BLOCKS {
            if pos >= end || out.len() >= BLOCK_STATUS_MAX_EXTENTS {
                break;
            }
            let (v, off) = self.split(pos);
            let n = (self.bs - off).min(end - pos);
            let e = self.vol.get(v);
            let alloc = if e == UNMAPPED && self.origin.is_none() {
                Alloc::Hole
            } else {
                Alloc::Data
            };
            push_extent(out, Extent { sectors: n, alloc });
            pos += n;
        }
        Ok(())
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        match ty {
            StatusType::Info => {
                let dev = self.vol.dev;
                let r = self.pool.sh.call(move |w| {
                    Ok::<_, Error>((w.meta.mapped_blocks(dev)?, w.meta.highest_mapped(dev)?))
                });
                match r {
                    Ok(Ok((n, h))) => {
                        out.push_str(&format!("{} ", n * self.bs));
                        match h {
                            Some(h) => out.push_str(&format!("{}", (h + 1) * self.bs - 1)),
                            None => out.push('-'),
                        }
                    }
                    _ => out.push_str("Fail"),
                }
            }
            StatusType::Table => {
                out.push_str(&format!("{} {}", self.pool_name, self.vol.dev));
                if let Some(o) = &self.origin {
                    out.push(' ');
                    out.push_str(o.name());
                }
            }
        }
    }
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(2 << 40);

/// A thin volume's engine: a device of the volume's size whose channel
/// hands bios to the pool's worker and carries out its answers. The thin
/// target lists it as a device, so flushes reach it (and commit).
struct Engine {
    name: String,
    pool: Arc<Pool>,
    vol: Arc<Vol>,
    origin: Option<Arc<dyn BlockDevice>>,
    limits: Limits,
    caps: Caps,
    /// Key of the reactor-local that finds this engine's channel.
    key: u64,
}

impl BlockDevice for Engine {
    fn name(&self) -> &str {
        &self.name
    }

    fn limits(&self) -> Limits {
        self.limits
    }

    fn caps(&self) -> Caps {
        self.caps
    }

    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        let data = self.pool.sh.data_dev.clone().open(reactor)?;
        let origin = match &self.origin {
            Some(o) => Some(o.clone().open(reactor)?),
            None => None,
        };
        let ch = Rc::new(EngineChannel {
            handle: reactor.handle(),
            eng: self.clone(),
            data,
            origin,
            reserve: RefCell::new(Vec::new()),
            id: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            asked: Cell::new(false),
            backoff: Cell::new(0),
        });
        // Each channel of the engine on this reactor is listed (a table
        // may be opened more than once): reserves go to the one that asked.
        match reactor
            .local(self.key)
            .and_then(|l| l.downcast::<ChanRef>().ok())
        {
            Some(c) => {
                let mut v = c.0.borrow_mut();
                v.retain(|w| w.strong_count() > 0);
                v.push(Rc::downgrade(&ch));
            }
            None => reactor.set_local(
                self.key,
                Rc::new(ChanRef(RefCell::new(vec![Rc::downgrade(&ch)]))),
            ),
        }
        // A reserve ahead of the first writes.
        ch.ask();
        Ok(ch)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The reactor-local that finds an engine's channels on a reactor (weak:
/// the tables own them); the last opened answers for the engine.
struct ChanRef(RefCell<Vec<Weak<EngineChannel>>>);

struct EngineChannel {
    handle: ReactorHandle,
    eng: Arc<Engine>,
    data: Rc<dyn Channel>,
    origin: Option<Rc<dyn Channel>>,
    /// Data blocks the worker reserved for this channel's provisioning.
    reserve: RefCell<Vec<u64>>,
    /// This channel's number, for the worker's reclaim.
    id: u64,
    /// A refill is asked for and not answered yet.
    asked: Cell<bool>,
    /// Allocating writes to pass before asking again after an empty refill.
    backoff: Cell<u32>,
}

/// A channel asks for a refill when its reserve falls below this.
const REFILL_AT: usize = RESERVE * 3 / 4;

impl Drop for EngineChannel {
    fn drop(&mut self) {
        let blocks = std::mem::take(self.reserve.get_mut());
        if !blocks.is_empty() {
            self.eng.pool.sh.push(Job::Return {
                blocks,
                reclaim: false,
            });
        }
    }
}

impl EngineChannel {
    fn reply(&self, bio: BioPtr) -> Reply {
        Reply {
            handle: self.handle.clone(),
            key: self.eng.key,
            bio: SendBio(bio.into_raw()),
        }
    }
}

impl EngineChannel {
    /// A block's first write, provisioned here when it can be: the block
    /// known unmapped, no zeroing or copy needed (the write covers the
    /// block, or `skip_block_zeroing`), not FUA (which waits for a
    /// commit), a reserved block at hand and the worker letting reactors
    /// provision. Gives the bio back otherwise.
    fn provision(&self, bio: BioPtr) -> Option<BioPtr> {
        let eng = &self.eng;
        let (sh, vol) = (&eng.pool.sh, &eng.vol);
        if bio.flags.contains(BioFlags::FUA) || eng.origin.is_some() {
            return Some(bio);
        }
        let bs = sh.block_sectors;
        let (v, off) = (bio.sector / bs, bio.sector % bs);
        if v >= vol.nr_blocks
            || off + bio.sectors() > bs
            || !(off == 0 && bio.sectors() == bs || sh.skip_zeroing.load(Ordering::Relaxed))
            || vol.get(v) != UNMAPPED
        {
            return Some(bio);
        }
        let Some(block) = self.reserve.borrow_mut().pop() else {
            self.ask();
            return Some(bio);
        };
        // Counted before the flag and the entry are read (see Vol::enter):
        // the worker's quiesce waits for this write.
        let e = vol.enter();
        if !vol.provision.load(Ordering::SeqCst) || !vol.claim(v) {
            vol.exit(e);
            self.reserve.borrow_mut().push(block);
            return Some(bio);
        }
        if self.reserve.borrow().len() < REFILL_AT {
            self.ask();
        }
        let ctx = Box::new(ProvCtx {
            eng: eng.clone(),
            vblock: v,
            block,
            epoch: e,
        });
        let mut bio = bio.make_room();
        let _ = bio.push_end_io(provision_endio, Box::into_raw(ctx).cast());
        bio.sector = block * bs + off;
        self.data.submit(bio);
        None
    }

    /// Asks the worker for reserved blocks, once at a time.
    fn ask(&self) {
        if self.asked.get() {
            return;
        }
        let b = self.backoff.get();
        if b > 0 {
            self.backoff.set(b - 1);
            return;
        }
        self.asked.set(true);
        let want = RESERVE.saturating_sub(self.reserve.borrow().len());
        self.eng.pool.sh.push(Job::Refill(RefillJob {
            vol: self.eng.vol.clone(),
            handle: self.handle.clone(),
            key: self.eng.key,
            id: self.id,
            want,
        }));
    }
}

/// A write a reactor provisions.
struct ProvCtx {
    eng: Arc<Engine>,
    vblock: u64,
    block: u64,
    epoch: usize,
}

/// A provisioning write completed: its mapping goes to the journal before
/// the cache shows it and before the bio completes (so that a FLUSH after
/// it commits the mapping).
fn provision_endio(mut bio: BioPtr) {
    // SAFETY: private is the Box<ProvCtx> leaked in `provision`, taken
    // back once.
    let ctx = unsafe { Box::from_raw(bio.private() as *mut ProvCtx) };
    bio.pop_end_io();
    let (sh, vol) = (&ctx.eng.pool.sh, &ctx.eng.vol);
    let v = ctx.vblock;
    let waited = if bio.status().is_ok() {
        sh.journal(Provisioned {
            vol: vol.clone(),
            vblock: v,
            block: ctx.block,
        });
        vol.end_provisioning(v, mapped(ctx.block, false))
    } else {
        sh.push(Job::Return {
            blocks: vec![ctx.block],
            reclaim: false,
        });
        vol.end_provisioning(v, UNMAPPED)
    };
    if waited {
        sh.push(Job::Wake(vol.dev, v));
    }
    vol.exit(ctx.epoch);
    bio.endio();
}

/// Reserved blocks from the worker arrive for the channel of `key`.
pub(crate) fn granted(r: &Reactor, key: u64, id: u64, mut g: Blocks) {
    let Some(ch) = channel_id(r, key, id) else {
        return; // dropping `g` gives the blocks back
    };
    if g.blocks.is_empty() {
        // None to spare: ask again after a while.
        ch.backoff.set(RESERVE as u32);
    }
    ch.reserve.borrow_mut().append(&mut g.blocks);
    ch.asked.set(false);
}

/// The worker asks for the reserve of the channel of `key` back.
pub(crate) fn reclaimed(r: &Reactor, key: u64, id: u64, mut g: Blocks) {
    if let Some(ch) = channel_id(r, key, id) {
        g.blocks.append(&mut ch.reserve.borrow_mut());
    }
    // Dropped: back to the worker, which counts the answer.
}

fn channel(r: &Reactor, key: u64) -> Option<Rc<EngineChannel>> {
    let c = r.local(key)?.downcast::<ChanRef>().ok()?;
    let v = c.0.borrow();
    v.iter().rev().find_map(Weak::upgrade)
}

/// The channel `id` of the engine of `key` on this reactor.
fn channel_id(r: &Reactor, key: u64, id: u64) -> Option<Rc<EngineChannel>> {
    let c = r.local(key)?.downcast::<ChanRef>().ok()?;
    let v = c.0.borrow();
    v.iter().filter_map(Weak::upgrade).find(|ch| ch.id == id)
}

impl Channel for EngineChannel {
    fn submit(&self, bio: BioPtr) {
        let bio = match bio.op {
            Op::Write => match self.provision(bio) {
                Some(bio) => bio,
                None => return,
            },
            _ => bio,
        };
        let sh = &self.eng.pool.sh;
        match bio.op {
            Op::Flush => sh.push(Job::Flush(self.reply(bio))),
            Op::Read | Op::Write | Op::Discard => {
                let (op, sector, sectors) = (bio.op, bio.sector, bio.sectors());
                let fua = bio.flags.contains(BioFlags::FUA);
                sh.push(Job::Bio(BioJob {
                    vol: self.eng.vol.clone(),
                    origin: self.eng.origin.clone(),
                    op,
                    sector,
                    sectors,
                    fua,
                    reply: self.reply(bio),
                }))
            }
            Op::WriteZeroes => bio.complete(Status::NotSupp),
        }
    }
}

/// Context of a provisioning (or FUA) write in flight.
struct WriteCtx {
    ch: Rc<EngineChannel>,
    insert: Option<Insert>,
    fua: bool,
}

fn write_endio(mut bio: BioPtr) {
    // SAFETY: private is the Box<WriteCtx> leaked in `finish`, taken back once.
    let ctx = unsafe { Box::from_raw(bio.private() as *mut WriteCtx) };
    let status = bio.status();
    bio.pop_end_io();
    let eng = &ctx.ch.eng;
    eng.pool.sh.push(Job::Done(DoneJob {
        vol: eng.vol.clone(),
        insert: ctx.insert,
        status,
        fua: ctx.fua,
        reply: ctx.ch.reply(bio),
    }));
}

/// A read of which only the first part lies on the external origin: the
/// part read completes the bio (whose rest was zeroed).
fn origin_part_endio(c: BioPtr) {
    // SAFETY: private is the parent bio, given up with into_raw in
    // `finish` and taken back only here.
    let mut bio = unsafe { BioPtr::from_raw(c.private() as *mut udm_core::Bio) };
    bio.set_status(c.status());
    drop(c);
    bio.endio();
}

/// Carries out the worker's answer for a bio, on its reactor `r`.
pub(crate) fn finish(r: &Reactor, key: u64, bio: SendBio, a: Action) {
    // SAFETY: the pointer came from `EngineChannel::reply` on this reactor
    // and the worker handed it back exactly once.
    let bio = unsafe { BioPtr::from_raw(bio.0) };
    let Some(ch) = channel(r, key) else {
        // The volume's table is gone from this reactor (it cannot be while
        // its bios are in flight): fail rather than lose the bio.
        return bio.complete(Status::IoErr);
    };
    ch.finish(bio, a)
}

impl EngineChannel {
    fn finish(self: Rc<Self>, bio: BioPtr, a: Action) {
        match a {
            Action::Complete(s) => bio.complete(s),
            Action::Zero => {
                let mut bio = bio;
                bio.zero_fill();
                bio.complete(Status::Ok)
            }
            Action::Remap { sector, epoch } => {
                let vol = Arc::as_ptr(&self.eng.vol) as *mut ();
                let mut bio = bio.make_room();
                let _ = bio.push_end_io_ctx(remap_endio, vol, epoch as u64);
                bio.sector = sector;
                self.data.submit(bio)
            }
            Action::Origin { inside } => {
                let Some(o) = &self.origin else {
                    return bio.complete(Status::IoErr);
                };
                if inside >= bio.sectors() {
                    return o.submit(bio);
                }
                let at = (inside << SECTOR_SHIFT) as usize;
                let rest = vec![0u8; bio.len() as usize - at];
                bio.copy_in(at, &rest);
                let mut c = bio.alloc_clone();
                c.add_segs_from(&bio, 0, at);
                c.sector = bio.sector;
                c.set_end_io(origin_part_endio, bio.into_raw().cast());
                o.submit(c)
            }
            Action::Write {
                sector,
                insert,
                fua,
            } => {
                let mut bio = bio.make_room();
                let ctx = Box::new(WriteCtx {
                    ch: self.clone(),
                    insert,
                    fua,
                });
                let _ = bio.push_end_io(write_endio, Box::into_raw(ctx).cast());
                bio.sector = sector;
                self.data.submit(bio)
            }
        }
    }
}
