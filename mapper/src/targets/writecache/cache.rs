//! The cache engine: shared state and the per-reactor data path.
//!
//! The target itself only remaps onto [`WcDev`], an internal block device
//! that *is* the cache. Making the engine a device gives it what a target's
//! `map` lacks: a hook on every reactor (`open`), where it opens that
//! reactor's channels to the origin and the cache and registers itself so
//! that the worker can complete bios parked on that reactor (a FLUSH or FUA
//! waiting for a commit). The mapper needs no change: flushes fan out to
//! the table's devices, so they reach the engine; the no-clone fast path
//! hands it the caller's bio, and the engine's own bios point into the
//! caller's buffers (no copies on the data path).
//!
//! All shared state is behind one mutex (as the kernel's `wc_lock`), held
//! only to decide; bios are submitted after it is dropped.

use std::any::Any;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use udm_core::{
    Bio, BioPtr, BlockDevice, Caps, Channel, Error, Limits, Op, Reactor, ReactorHandle, Status,
    SECTOR_SHIFT,
};

use super::alloc::FreeExtents;
use super::image::Image;
use super::meta::{DiskEntry, Geometry, ENTRIES_PER_MBLOCK, ENTRY_BYTES};
use super::stream;

/// "No cache block".
pub(crate) const NONE: u32 = u32::MAX;

/// The constructor's settings.
#[derive(Clone)]
pub(crate) struct Config {
    pub origin: Arc<dyn BlockDevice>,
    pub cache: Arc<dyn BlockDevice>,
    pub block_size: u32,
    pub start_sector: u64,
    pub high_watermark: u32,
    pub low_watermark: u32,
    pub writeback_jobs: u32,
    pub autocommit_blocks: u64,
    pub autocommit_time: Duration,
    pub fua: bool,
    pub max_age: Option<Duration>,
    pub pause_writeback: Duration,
    pub nocoalesce: bool,
    /// Sectors of the target (the origin area used).
    pub len: u64,
}

impl Config {
    pub fn bs_sectors(&self) -> u64 {
        (self.block_size >> SECTOR_SHIFT) as u64
    }
}

/// Where a cache block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum St {
    /// In the free extents.
    Free,
    /// Holds the newest data of its origin block.
    Live,
    /// Rewritten elsewhere (block `by`); still on disk until marked free.
    Superseded,
    /// Marked free in the image at generation `gen`; reusable once that is
    /// committed.
    FreePending,
    /// Free on disk, but I/O still pins it.
    Zombie,
}

/// A cache block's in-memory state.
///
/// `repr(C)` with every byte a field (no padding): the write path stores
/// new entries as words with streaming stores ([`super::stream::entry`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Entry {
    /// Generation its entry was (or will be) committed with: the one no
    /// commit had started on when the block was allocated (0 when free).
    pub seq: u64,
    /// Origin block index (the constructor bounds it to u32).
    pub ob: u32,
    /// Milliseconds since the engine started, when it was cached (max_age).
    pub born_ms: u32,
    pub prev: u32,
    pub next: u32,
    pub writes: u16,
    pub reads: u16,
    pub wb: bool,
    pub st: St,
    /// Always 0: makes the padding a field, so every byte is initialized.
    pub _pad: u16,
}

// Two per cache line: at 512-byte blocks the data path writes an entry per
// block, so its size is a share of the memory traffic beside the data's.
const _: () = assert!(std::mem::size_of::<Entry>() == 32);
// The fields tile the 32 bytes: no padding (see `Entry::to_words`).
const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(Entry, ob) == 8);
    assert!(offset_of!(Entry, born_ms) == 12);
    assert!(offset_of!(Entry, prev) == 16);
    assert!(offset_of!(Entry, next) == 20);
    assert!(offset_of!(Entry, writes) == 24);
    assert!(offset_of!(Entry, reads) == 26);
    assert!(offset_of!(Entry, wb) == 28);
    assert!(offset_of!(Entry, st) == 29);
    assert!(offset_of!(Entry, _pad) == 30);
};

impl Entry {
    /// A free block's entry; every block in the free extents has it.
    pub const FREE: Entry = Entry {
        ob: 0,
        seq: 0,
        born_ms: 0,
        prev: NONE,
        next: NONE,
        writes: 0,
        reads: 0,
        wb: false,
        st: St::Free,
        _pad: 0,
    };

    /// The entry's 32 bytes in memory, as words.
    #[inline(always)]
    pub fn to_words(self) -> [u64; 4] {
        // SAFETY: Entry is 32 bytes of fields with no padding (the
        // assertions above), each of which is plain data, so every byte
        // is initialized; any bytes are a valid [u64; 4].
        unsafe { std::mem::transmute::<Entry, [u64; 4]>(self) }
    }
}

/// Blocks `old..old + len`, superseded by blocks `by..by + len` (their
/// origin blocks' newer copies). Kept as runs: a large overwrite
/// supersedes a whole earlier write at once, and a commit then handles
/// it in a few passes over arrays, not one list item per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Superseded {
    pub old: u32,
    pub by: u32,
    pub len: u32,
}

/// Blocks `b..b + len`, marked free in the image at generation `gen`:
/// reusable once a commit of `gen` completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FreePending {
    pub b: u32,
    pub len: u32,
    pub gen: u64,
}

/// dm-writecache's statistics counters (in blocks, as dm counts them).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Stats {
    pub reads: u64,
    pub read_hits: u64,
    pub writes: u64,
    pub write_hits_uncommitted: u64,
    pub write_hits_committed: u64,
    pub writes_around: u64,
    pub writes_allocate: u64,
    pub writes_blocked_on_freelist: u64,
    pub flushes: u64,
    pub discards: u64,
}

/// Everything behind the lock.
pub(crate) struct State {
    pub entries: Vec<Entry>,
    /// Origin block → cache block holding its newest data.
    pub map: Vec<u32>,
    pub free: FreeExtents,
    /// The entry array as it is to be on disk (whole metadata blocks of
    /// 16-byte entries, see `meta`), kept in step with `entries` wherever
    /// `State::disk_entry` changes: a block's allocation (see `unwritten`), a
    /// free marker, a rebuild. A commit writes its dirty metadata blocks
    /// from it (see `image`) instead of encoding them from the entries
    /// under the lock, which took 0.3-0.6 ms per 65536 entries and stalled
    /// writers.
    pub image: Image,
    /// Metadata blocks whose entries changed since the last commit started
    /// (what the next commit writes).
    pub dirty: Vec<bool>,
    /// Cache blocks whose first data write is in flight, one bit each. A
    /// new block's entry is published when the block is allocated (as
    /// dm-writecache does): the data path then writes each entry once,
    /// while it is hot, and completion touches only these bits. A commit
    /// waits for the writes of its generation (`inflight_writes`) before it
    /// flushes, so no durable entry points at data that was never written;
    /// until then reads of the block wait and discards skip it.
    pub unwritten: Vec<u64>,
    /// Cache data writes in flight, by the parity of the generation they
    /// were mapped in (one commit runs at a time, so two counters do): a
    /// commit of generation g waits for `[g & 1]` to drain.
    pub inflight_writes: [u64; 2],
    /// The generation of a commit waiting for its writes to drain (0:
    /// none); the last of them pokes the worker.
    pub barrier: u64,
    pub ndirty: usize,
    pub lru_head: u32,
    pub lru_tail: u32,
    /// Live entries.
    pub live: u64,
    /// Generation of the last completed commit.
    pub committed: u64,
    /// The generation the next commit to start will publish.
    pub pending_gen: u64,
    /// Highest generation someone waits for.
    pub commit_wanted: u64,
    /// Image changes since the last commit started (autocommit).
    pub uncommitted: u64,
    pub dirty_since: Option<Instant>,
    /// Superseded blocks, as runs, waiting for their successors to be
    /// durable (then they get a free marker).
    pub superseded: Vec<Superseded>,
    /// Blocks with a free marker not yet durable, as runs.
    pub free_pending: Vec<FreePending>,
    /// Per origin block: how many of its superseded or freed entries have
    /// a free marker that is not durable yet. Its newest entry must not be
    /// written back (or discarded) and freed before those markers are on
    /// disk, nor may a write to it go around the cache. (An array, not a
    /// hash: an overwrite of a committed block bumps it once per block.)
    pub shadows: Vec<u16>,
    pub wb_active: bool,
    pub wb_inflight: u64,
    pub writeback_all: u32,
    pub cleaner: bool,
    pub flush_on_suspend: bool,
    pub last_origin_write: Option<Instant>,
    pub space_waiters: u64,
    /// Reads held back because they overlap a block whose first write is
    /// still in flight (see `map_read`).
    pub read_waiters: u64,
    /// Discards waiting for writeback of their range to finish, or for a
    /// commit to drop the rest of their blocks.
    pub discard_waiters: u64,
    /// Per origin block: blocks of it under writeback (see start_discard).
    pub wb_ob: Vec<u8>,
    pub stats: Stats,
    pub error: i32,
    pub ready: bool,
}

impl State {
    pub fn new(g: &Geometry, origin_blocks: u64) -> State {
        let n = g.n_blocks as usize;
        State {
            entries: vec![Entry::FREE; n],
            map: vec![NONE; origin_blocks as usize],
            free: FreeExtents::new(),
            image: Image::new(g.mblocks as usize),
            dirty: vec![false; g.mblocks as usize],
            unwritten: touched(n.div_ceil(64), 0),
            inflight_writes: [0; 2],
            barrier: 0,
            ndirty: 0,
            lru_head: NONE,
            lru_tail: NONE,
            live: 0,
            committed: 0,
            pending_gen: 1,
            commit_wanted: 0,
            uncommitted: 0,
            dirty_since: None,
            superseded: Vec::new(),
            free_pending: Vec::new(),
            shadows: touched(origin_blocks as usize, 0),
            wb_active: false,
            wb_inflight: 0,
            writeback_all: 0,
            cleaner: false,
            flush_on_suspend: false,
            last_origin_write: None,
            space_waiters: 0,
            read_waiters: 0,
            discard_waiters: 0,
            wb_ob: touched(origin_blocks as usize, 0),
            stats: Stats::default(),
            error: 0,
            ready: false,
        }
    }

    /// Block `b`'s entry changed to free (its state already says so): its
    /// metadata block goes in the next commit.
    pub fn mark_free(&mut self, b: u32) {
        self.set_image(b, DiskEntry::FREE);
        self.image_changed(b, 1, 1);
    }

    /// Blocks `b..b + len` (their states already FreePending) get free
    /// markers in the pending generation.
    pub fn mark_free_run(&mut self, b: u32, len: u32) {
        if len == 0 {
            return;
        }
        self.image
            .for_each_run(b as usize, len as usize, |_, out| out.fill([0; 16]));
        self.image_changed(b, len, len as u64);
        self.push_free_pending(b, len);
    }

    /// Marks blocks `b..b + n` as awaiting (or, with `on` false, done
    /// with) their first data write.
    pub fn set_unwritten(&mut self, b: u32, n: u32, on: bool) {
        for (w, mask) in bit_words(b, n) {
            if on {
                self.unwritten[w] |= mask;
            } else {
                self.unwritten[w] &= !mask;
            }
        }
    }

    /// Counts a cache data write mapped now; returns the Sub kind bits
    /// that carry its generation's parity to `account`.
    pub fn write_started(&mut self) -> u64 {
        let odd = self.pending_gen & 1;
        self.inflight_writes[odd as usize] += 1;
        odd << 8
    }

    /// Whether any of blocks `b..b + n` awaits its first data write.
    pub fn any_unwritten(&self, b: u32, n: u32) -> bool {
        bit_words(b, n).any(|(w, mask)| self.unwritten[w] & mask != 0)
    }

    /// Writes block `b`'s entry into the image (not yet marked dirty).
    #[inline]
    pub fn set_image(&mut self, b: u32, e: DiskEntry) {
        self.image.set(b as usize, e);
    }

    /// What the on-disk entry of block `b` is to say, from its state: its
    /// origin sector and generation while it holds (or, its first write in
    /// flight, is about to hold) its origin block's data, live or
    /// superseded but not yet marked free; free otherwise. The image holds exactly this for every block
    /// (`image_is_consistent`); a rebuild derives the image from it.
    #[inline]
    pub fn disk_entry(&self, b: usize, bs_sectors: u64) -> DiskEntry {
        let e = &self.entries[b];
        if e.seq != 0 && matches!(e.st, St::Live | St::Superseded) {
            DiskEntry {
                sector: e.ob as u64 * bs_sectors,
                seq: e.seq,
            }
        } else {
            DiskEntry::FREE
        }
    }

    /// Whether the image says what the entries' states do for every block
    /// of metadata blocks `m0..m1` (a check for tests: see the `paranoid`
    /// feature).
    pub fn image_is_consistent(&self, m0: usize, m1: usize, bs_sectors: u64) -> bool {
        let n = self.entries.len();
        let (first, last) = (m0 * ENTRIES_PER_MBLOCK, (m1 * ENTRIES_PER_MBLOCK).min(n));
        let mut want = [0u8; ENTRY_BYTES as usize];
        (first..last).all(|b| {
            self.disk_entry(b, bs_sectors).encode(&mut want);
            self.image.entry(b) == want
        })
    }

    /// Records that `changed` entries among the `n` blocks from `first`
    /// changed in the image: their metadata blocks go in the next commit.
    /// Per run, not per block: a 512 KiB write of 512-byte blocks touches
    /// 1024 entries but at most 5 metadata blocks.
    pub fn image_changed(&mut self, first: u32, n: u32, changed: u64) {
        let m0 = first as usize / ENTRIES_PER_MBLOCK;
        let m1 = (first + n - 1) as usize / ENTRIES_PER_MBLOCK;
        for m in m0..=m1 {
            if !self.dirty[m] {
                self.dirty[m] = true;
                self.ndirty += 1;
            }
        }
        self.uncommitted += changed;
        if self.dirty_since.is_none() {
            self.dirty_since = Some(Instant::now());
        }
    }

    pub fn lru_push(&mut self, b: u32) {
        let t = self.lru_tail;
        self.entries[b as usize].prev = t;
        self.entries[b as usize].next = NONE;
        if t == NONE {
            self.lru_head = b;
        } else {
            self.entries[t as usize].next = b;
        }
        self.lru_tail = b;
    }

    pub fn lru_remove(&mut self, b: u32) {
        let Entry { prev, next, .. } = self.entries[b as usize];
        if prev == NONE {
            self.lru_head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NONE {
            self.lru_tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
        self.entries[b as usize].prev = NONE;
        self.entries[b as usize].next = NONE;
    }

    /// Whether a write may go to `b` in place: its entry is not part of a
    /// commit yet (so no durable entry points at its old data) and it is
    /// not being written back.
    #[inline]
    pub fn in_place_ok(&self, b: u32) -> bool {
        let e = &self.entries[b as usize];
        e.st == St::Live && !e.wb && e.seq == self.pending_gen
    }

    /// The block is free on disk for good: true if it may go back to the
    /// free space now (the caller frees it, batched into runs), false if
    /// I/O still pins it (it is freed when unpinned).
    pub fn release(&mut self, b: u32) -> bool {
        let e = &mut self.entries[b as usize];
        if e.reads > 0 || e.writes > 0 {
            e.st = St::Zombie;
            false
        } else {
            *e = Entry::FREE;
            true
        }
    }

    /// A block whose pins dropped: free it if it was waiting for that.
    pub fn unpinned(&mut self, b: u32) -> bool {
        let e = &self.entries[b as usize];
        if e.st == St::Zombie && e.reads == 0 && e.writes == 0 {
            self.entries[b as usize] = Entry::FREE;
            self.free.free(b, 1);
            return true;
        }
        false
    }

    /// Unmaps live block `b`, cached for origin block `ob`, and frees it
    /// with a marker in the pending commit: its space is reused only once
    /// that marker is durable (written back or discarded alike).
    pub fn release_live(&mut self, b: u32, ob: u64) {
        self.map[ob as usize] = NONE;
        self.lru_remove(b);
        self.live -= 1;
        self.entries[b as usize].st = St::FreePending;
        self.mark_free_run(b, 1);
        self.shadow_add(ob);
    }

    /// Blocks `b..b + len` got free markers in the pending generation.
    pub fn push_free_pending(&mut self, b: u32, len: u32) {
        let gen = self.pending_gen;
        match self.free_pending.last_mut() {
            Some(l) if l.gen == gen && l.b + l.len == b => l.len += len,
            _ => self.free_pending.push(FreePending { b, len, gen }),
        }
    }

    /// Block `old` was superseded by block `by`.
    pub fn push_superseded(&mut self, old: u32, by: u32) {
        match self.superseded.last_mut() {
            Some(l) if l.old + l.len == old && l.by + l.len == by => l.len += 1,
            _ => self.superseded.push(Superseded { old, by, len: 1 }),
        }
    }

    pub fn shadow_add(&mut self, ob: u64) {
        // At most a few per block: one per generation that superseded or
        // freed it, and each marker is durable two commits later.
        self.shadows[ob as usize] += 1;
    }

    pub fn shadow_sub(&mut self, ob: u64) {
        let c = &mut self.shadows[ob as usize];
        debug_assert!(*c > 0, "shadow count of origin block {ob} underflows");
        *c = c.saturating_sub(1);
    }

    /// Whether origin block `ob` has older entries whose free markers are
    /// not durable yet.
    #[inline]
    pub fn shadowed(&self, ob: u64) -> bool {
        self.shadows[ob as usize] != 0
    }

    /// Blocks in use (not in the free extents).
    pub fn used(&self, n: u64) -> u64 {
        n - self.free.free_blocks()
    }
}

/// The words and masks of a bitmap that cover bits `b..b + n`.
fn bit_words(b: u32, n: u32) -> impl Iterator<Item = (usize, u64)> {
    let (first, end) = (b as usize, b as usize + n as usize);
    (first / 64..end.div_ceil(64)).map(move |w| {
        let lo = first.max(w * 64) - w * 64;
        let hi = end.min(w * 64 + 64) - w * 64;
        let mask = if hi - lo == 64 {
            !0
        } else {
            ((1u64 << (hi - lo)) - 1) << lo
        };
        (w, mask)
    })
}

/// A vector of `n` copies of `v`, every page written now. `vec![0; n]`
/// comes from calloc as untouched zero pages, which the data path would
/// then fault in one by one (a 1 GiB origin of 512-byte blocks has a 4 MiB
/// shadow array: 1024 page faults during the first overwrites).
fn touched<T: Copy>(n: usize, v: T) -> Vec<T> {
    let mut out = Vec::with_capacity(n);
    out.resize(n, v);
    // resize of an all-zero Copy value may still become a calloc-like
    // memset; black_box keeps the writes.
    std::hint::black_box(&mut out);
    out
}

/// What every reactor and the worker share.
pub(crate) struct Shared {
    pub cfg: Config,
    pub geo: Geometry,
    pub origin_blocks: u64,
    st: Mutex<State>,
    /// Signalled when commits and writeback make progress (message waiters).
    pub cv: Condvar,
    pub worker: OnceLock<ReactorHandle>,
    pub poked: AtomicBool,
    pub stop: AtomicBool,
    chans: Mutex<Vec<(ReactorHandle, u64)>>,
    pub started: Instant,
    /// Blocks under writeback (for the status line without the lock).
    pub wb_blocks: AtomicU64,
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(0x7763_0000_0000);

impl Shared {
    pub fn new(cfg: Config, geo: Geometry) -> Shared {
        let origin_blocks = cfg.len / cfg.bs_sectors();
        Shared {
            st: Mutex::new(State::new(&geo, origin_blocks)),
            cfg,
            geo,
            origin_blocks,
            cv: Condvar::new(),
            worker: OnceLock::new(),
            poked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            chans: Mutex::new(Vec::new()),
            started: Instant::now(),
            wb_blocks: AtomicU64::new(0),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the worker to look at the state again.
    pub fn poke(&self) {
        if !self.poked.swap(true, Ordering::AcqRel) {
            if let Some(h) = self.worker.get() {
                h.wake();
            }
        }
    }

    /// Tells every reactor's channel to release what waits on a commit or
    /// on free space.
    pub fn kick_all(&self) {
        let chans = self.chans.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (h, key) in chans {
            h.send(move |r| {
                if let Some(ch) = r.local(key).and_then(|c| c.downcast::<WcChannel>().ok()) {
                    ch.kick();
                }
            });
        }
        self.cv.notify_all();
    }

    /// Sector of data block `b` on the cache device.
    #[inline]
    pub fn cache_sector(&self, b: u32) -> u64 {
        self.cfg.start_sector + (self.geo.block_offset(b) >> SECTOR_SHIFT)
    }

    pub fn now_ms(&self) -> u32 {
        self.started.elapsed().as_millis().min(u32::MAX as u128) as u32
    }
}

/// The engine as a block device (see the module docs).
pub(crate) struct WcDev {
    name: String,
    pub shared: Arc<Shared>,
    key: u64,
}

impl WcDev {
    pub fn new(shared: Arc<Shared>) -> WcDev {
        WcDev {
            name: format!(
                "writecache({},{})",
                shared.cfg.origin.name(),
                shared.cfg.cache.name()
            ),
            shared,
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl BlockDevice for WcDev {
    fn name(&self) -> &str {
        &self.name
    }

    fn limits(&self) -> Limits {
        let c = &self.shared.cfg;
        let mut l = Limits::new(c.len);
        l.stack(&c.origin.limits());
        l.stack(&c.cache.limits());
        // dm-writecache: the logical block size is the cache block size.
        l.logical_block_size = l.logical_block_size.max(c.block_size);
        l.physical_block_size = l.physical_block_size.max(c.block_size);
        l.sectors = c.len;
        l
    }

    fn caps(&self) -> Caps {
        let c = &self.shared.cfg;
        let mut caps = Caps::FLUSH | Caps::FUA;
        let (o, k) = (c.origin.caps(), c.cache.caps());
        if o.contains(Caps::DISCARD) {
            // Passed on to the origin, cached blocks of the range dropped.
            caps.insert(Caps::DISCARD);
        }
        if o.contains(Caps::PERSISTENT) && k.contains(Caps::PERSISTENT) {
            caps.insert(Caps::PERSISTENT);
        }
        if o.contains(Caps::READ_ONLY) || k.contains(Caps::READ_ONLY) {
            caps.insert(Caps::READ_ONLY);
        }
        caps
    }

    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        if let Some(ch) = reactor
            .local(self.key)
            .and_then(|c| c.downcast::<WcChannel>().ok())
        {
            return Ok(ch);
        }
        let c = &self.shared.cfg;
        let ch = Rc::new(WcChannel {
            shared: self.shared.clone(),
            origin: c.origin.clone().open(reactor)?,
            cache: c.cache.clone().open(reactor)?,
            parked: RefCell::new(Vec::new()),
            space_wait: RefCell::new(Vec::new()),
            read_wait: RefCell::new(Vec::new()),
            discard_wait: RefCell::new(Vec::new()),
            subs: RefCell::new(Vec::new()),
        });
        reactor.set_local(self.key, ch.clone());
        let mut chans = self.shared.chans.lock().unwrap_or_else(|p| p.into_inner());
        chans.retain(|(h, _)| !h.is_closed());
        chans.push((reactor.handle(), self.key));
        Ok(ch)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Sub-I/O kinds, in the top byte of a sub-bio's context word.
/// An overwrite in place of cached blocks.
const K_CACHE_WRITE: u64 = 1;
const K_CACHE_READ: u64 = 2;
const K_ORIGIN: u64 = 3;
/// The first write of newly allocated blocks.
const K_CACHE_NEW: u64 = 4;
/// Context bit: a cache write mapped in an odd generation.
const CTX_ODD: u64 = 1 << 55;

/// One I/O the engine issues for a caller's bio.
#[derive(Clone, Copy)]
struct Sub {
    /// Kind, and CTX_ODD for cache writes of an odd generation.
    kind: u64,
    /// First cache block (cache kinds) or origin block.
    block: u64,
    /// Offset in the caller's bio, in blocks.
    off: u64,
    /// Length in blocks.
    n: u64,
}

impl Sub {
    /// The context word of its bio: kind, generation parity, block.
    fn ctx(&self) -> u64 {
        (self.kind & 0xff) << 56 | self.kind >> 8 << 55 | self.block
    }
}

/// A parked bio: a FLUSH or a FUA write waiting for generation `gen` to
/// commit. `framed` says whether the engine pushed a frame on it.
struct Parked {
    gen: u64,
    bio: BioPtr,
    framed: bool,
}

/// The engine's channel on one reactor.
pub(crate) struct WcChannel {
    shared: Arc<Shared>,
    origin: Rc<dyn Channel>,
    cache: Rc<dyn Channel>,
    parked: RefCell<Vec<Parked>>,
    /// Writes waiting for free blocks (their context word says where to
    /// resume).
    space_wait: RefCell<Vec<BioPtr>>,
    /// Reads waiting for the first write of a block they overlap.
    read_wait: RefCell<Vec<BioPtr>>,
    /// Discards whose origin part is done, waiting to drop cached blocks
    /// that could not go yet (see `finish_discard`).
    discard_wait: RefCell<Vec<BioPtr>>,
    /// Scratch list of sub-I/Os (reused: no allocation per bio).
    subs: RefCell<Vec<Sub>>,
}

impl Channel for WcChannel {
    fn submit(&self, mut bio: BioPtr) {
        // Cache blocks are reused for other sectors once a read releases
        // them, before its caller's end_io runs: never lend them. (The
        // mapper already removes the flag before a target's map.)
        bio.flags.remove(udm_core::BioFlags::MAY_LEND);
        match bio.op {
            Op::Flush => self.park_until_committed(bio, false, true),
            Op::Read | Op::Write => {
                let bs = self.shared.cfg.bs_sectors();
                if !bio.sector.is_multiple_of(bs)
                    || !bio.sectors().is_multiple_of(bs)
                    || bio.sectors() == 0
                {
                    return bio.complete(Status::Inval);
                }
                let me = self as *const WcChannel as *mut ();
                // Stacked deeper than a bio has frames: a stand-in carries it.
                let mut bio = bio.make_room();
                if !bio.push_end_io(parent_done, me) {
                    // make_room left a free frame.
                    return bio.complete(Status::NoMem);
                }
                bio.set_status(Status::Ok);
                bio.pending = 1;
                bio.set_ctx(0);
                self.map(bio);
            }
            Op::Discard => self.discard(bio),
            _ => bio.complete(Status::NotSupp),
        }
    }
}

/// A discard's context word: how many times it tried to drop its cached
/// blocks, and whether it has any to drop (else the origin's completion
/// completes it).
const DISCARD_PASS: u64 = 1 << 32;
/// The discard waits for writeback of its range before going to the origin.
const DISCARD_WAIT_WB: u64 = 1 << 33;
/// Tries (one per commit) before a discard gives up on blocks that stay
/// under writeback or shadowed; they then stay cached, which a discard
/// allows (the range reads back as anything written there before).
const DISCARD_TRIES: u64 = 8;

impl WcChannel {
    /// DISCARD, as dm-writecache does it: the cached blocks of the range are
    /// dropped (so reads then go to the origin) and the discard goes on to
    /// the origin. The order is writeback's, so that no crash brings back
    /// data older than the newest durable write: the origin is discarded
    /// and flushed first, then each dropped block is unmapped and marked
    /// free in the next commit, and only once no older entry for its sector
    /// is left on disk (meta.rs, rule 4). A block whose first write is in
    /// flight belongs to a write racing the discard and stays.
    fn discard(&self, bio: BioPtr) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        if !bio.sector.is_multiple_of(bs) || !bio.sectors().is_multiple_of(bs) {
            return bio.complete(Status::Inval);
        }
        if !sh.cfg.origin.caps().contains(Caps::DISCARD) {
            return bio.complete(Status::NotSupp);
        }
        sh.lock().stats.discards += bio.sectors() / bs;
        let mut bio = bio.make_room();
        if !bio.push_end_io(discard_origin_done, self as *const WcChannel as *mut ()) {
            // make_room left a free frame.
            return bio.complete(Status::NoMem);
        }
        bio.set_ctx(0);
        self.start_discard(bio);
    }

    /// Sends the discard on to the origin — once no writeback of the range
    /// is in flight: a block superseded while under writeback still writes
    /// its (older) data to the origin, which must not land on top of the
    /// discard (the newer copy, dropped, would then uncover it).
    fn start_discard(&self, mut bio: BioPtr) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let (ob0, n) = ((bio.sector / bs) as usize, (bio.sectors() / bs) as usize);
        let cached = {
            let mut st = sh.lock();
            if st.error != 0 {
                drop(st);
                bio.pop_end_io();
                return bio.complete(Status::IoErr);
            }
            if st.wb_ob[ob0..ob0 + n].iter().any(|&w| w != 0) {
                st.discard_waiters += 1;
                drop(st);
                bio.set_ctx(DISCARD_WAIT_WB);
                self.discard_wait.borrow_mut().push(bio);
                return;
            }
            let map = &st.map[ob0..ob0 + n];
            unmapped_prefix(map) < map.len()
        };
        bio.set_ctx(if cached { 0 } else { DISCARD_PASS });
        // The target maps sector for sector onto the origin.
        self.origin.submit(bio);
    }

    /// The origin is discarded and flushed: drop what is cached in the
    /// range, then complete the discard (or wait for a commit and try
    /// again, for blocks that cannot go yet).
    fn finish_discard(&self, mut bio: BioPtr, in_completion: bool) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let (ob0, n) = (bio.sector / bs, bio.sectors() / bs);
        let tries = bio.ctx() + 1;
        let retry = {
            let mut st = sh.lock();
            if st.error != 0 && bio.status().is_ok() {
                bio.set_status(Status::IoErr);
            }
            let (dropped, left) = drop_range(&mut st, ob0, n);
            let retry = left && tries < DISCARD_TRIES && st.error == 0;
            if dropped || retry {
                // Free the blocks soon; what is left needs a commit first.
                let pg = st.pending_gen;
                st.commit_wanted = st.commit_wanted.max(pg);
            }
            if retry {
                st.discard_waiters += 1;
            }
            retry
        };
        if retry {
            bio.set_ctx(tries);
            self.discard_wait.borrow_mut().push(bio);
            sh.poke();
            return;
        }
        sh.poke();
        bio.pop_end_io();
        if in_completion {
            bio.endio();
        } else {
            let s = bio.status();
            bio.complete(s);
        }
    }
}

/// Drops the cached blocks of origin blocks `ob0..ob0+n` that may go now:
/// unmapped, out of the writeback order, marked free in the next commit
/// and reusable once that is durable (as written-back blocks). Returns
/// whether it dropped any, and whether some must wait: under writeback, or
/// with older entries of their sector whose free markers are not durable
/// yet (a torn commit could then keep those and lose this one's marker,
/// bringing back data older than this block's).
fn drop_range(st: &mut State, ob0: u64, n: u64) -> (bool, bool) {
    let (mut dropped, mut left) = (false, false);
    let end = ob0 + n;
    let mut ob = ob0;
    while ob < end {
        // Uncached stretches in bulk.
        ob += unmapped_prefix(&st.map[ob as usize..end as usize]) as u64;
        if ob >= end {
            break;
        }
        let this = ob;
        ob += 1;
        let b = st.map[this as usize];
        let e = st.entries[b as usize];
        if st.any_unwritten(b, 1) {
            // A first write racing the discard: ordered after it.
            continue;
        }
        if e.wb || st.shadowed(this) {
            left = true;
            continue;
        }
        st.release_live(b, this);
        dropped = true;
    }
    (dropped, left)
}

/// End_io of a discard the engine sent on to the origin.
fn discard_origin_done(mut bio: BioPtr) {
    // SAFETY: the private of the engine's frame is the WcChannel that pushed
    // it, kept alive by its table while I/O is in flight.
    let ch = unsafe { &*(bio.private() as *const WcChannel) };
    if !bio.status().is_ok() || bio.ctx() & DISCARD_PASS != 0 {
        bio.pop_end_io();
        return bio.endio();
    }
    if !ch.shared.cfg.origin.caps().contains(Caps::FLUSH) {
        return ch.finish_discard(bio, true);
    }
    // Flush the origin before any block of the range is marked free, so
    // that a crash cannot lose the discard but keep the markers.
    let mut f = bio.alloc_clone();
    f.flags = udm_core::BioFlags::NONE;
    f.set_dataless(Op::Flush, 0, 0);
    f.set_end_io(discard_flush_done, bio.into_raw().cast());
    ch.origin.submit(f);
}

fn discard_flush_done(f: BioPtr) {
    // SAFETY: the flush's private is the discard, given up with into_raw in
    // discard_origin_done and taken back only here.
    let mut bio = unsafe { BioPtr::from_raw(f.private().cast()) };
    let s = f.status();
    drop(f);
    // SAFETY: as in discard_origin_done: the discard's frame is ours.
    let ch = unsafe { &*(bio.private() as *const WcChannel) };
    if !s.is_ok() {
        bio.set_status(s);
        bio.pop_end_io();
        return bio.endio();
    }
    ch.finish_discard(bio, true);
}

impl WcChannel {
    /// Parks `bio` until a commit covering everything acknowledged so far
    /// is durable (a FLUSH; a FUA write that completed) and asks the worker
    /// for that commit.
    fn park_until_committed(&self, bio: BioPtr, framed: bool, flush: bool) {
        let gen = {
            let mut st = self.shared.lock();
            if flush {
                st.stats.flushes += 1;
            }
            let g = st.pending_gen;
            st.commit_wanted = st.commit_wanted.max(g);
            g
        };
        self.park(Parked { gen, bio, framed });
        self.shared.poke();
    }

    fn park(&self, p: Parked) {
        self.parked.borrow_mut().push(p);
        // The commit may have completed between taking the generation and
        // parking: look again so the bio is not left waiting.
        self.kick();
    }

    /// Releases parked bios whose generation is committed, and retries
    /// writes that waited for space.
    pub fn kick(&self) {
        let (committed, error) = {
            let st = self.shared.lock();
            (st.committed, st.error)
        };
        let ready: Vec<Parked> = {
            let mut p = self.parked.borrow_mut();
            if p.is_empty() {
                Vec::new()
            } else {
                let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut *p)
                    .into_iter()
                    .partition(|x| x.gen <= committed || error != 0);
                *p = wait;
                ready
            }
        };
        for Parked {
            mut bio, framed, ..
        } in ready
        {
            let s = if error != 0 && bio.status().is_ok() {
                Status::IoErr
            } else {
                bio.status()
            };
            if framed {
                bio.pop_end_io();
            }
            bio.complete(s);
        }
        let discards: Vec<BioPtr> = std::mem::take(&mut *self.discard_wait.borrow_mut());
        if !discards.is_empty() {
            self.shared.lock().discard_waiters -= discards.len() as u64;
            for bio in discards {
                if bio.ctx() & DISCARD_WAIT_WB != 0 {
                    self.start_discard(bio);
                } else {
                    self.finish_discard(bio, false);
                }
            }
        }
        let reads: Vec<BioPtr> = std::mem::take(&mut *self.read_wait.borrow_mut());
        if !reads.is_empty() {
            self.shared.lock().read_waiters -= reads.len() as u64;
            for bio in reads {
                self.map(bio);
            }
        }
        let waiting: Vec<BioPtr> = std::mem::take(&mut *self.space_wait.borrow_mut());
        if !waiting.is_empty() {
            self.shared.lock().space_waiters -= waiting.len() as u64;
            for bio in waiting {
                // map fails them if the cache has failed meanwhile.
                self.map(bio);
            }
        }
    }

    /// Maps the caller's bio (from the block in its context word on) into
    /// sub-I/Os, under the lock, then issues them without it.
    fn map(&self, mut bio: BioPtr) {
        let sh = &*self.shared;
        let bs = sh.cfg.bs_sectors();
        let ob0 = bio.sector / bs;
        let nblk = bio.sectors() / bs;
        let mut from = bio.ctx();
        let mut subs = self.subs.borrow_mut();
        subs.clear();
        let mut blocked = false;
        let mut read_held = false;
        let mut poke = false;
        {
            let mut st = sh.lock();
            if st.error != 0 {
                // A failed cache fails all I/O (as dm-writecache does).
                bio.set_status(Status::IoErr);
                from = nblk;
            } else if bio.op == Op::Read {
                if map_read(&mut st, ob0, nblk, &mut subs) {
                    from = nblk;
                } else {
                    read_held = true;
                    st.read_waiters += 1;
                }
            } else {
                let now = sh.now_ms();
                let was_clean = st.dirty_since.is_none();
                from = map_write(sh, &mut st, ob0, nblk, from, now, &mut subs);
                // The first change since a commit starts the autocommit
                // clock: the worker may be asleep with no deadline, so it
                // must hear of it; as it must of a full autocommit.
                poke = (was_clean && st.dirty_since.is_some())
                    || st.uncommitted >= sh.cfg.autocommit_blocks;
                if from < nblk {
                    blocked = true;
                    st.stats.writes_blocked_on_freelist += 1;
                    st.space_waiters += 1;
                }
            }
        }
        if poke {
            sh.poke();
        }
        if subs.len() == 1
            && !read_held
            && !blocked
            && bio.pending == 1
            && !bio.flags.contains(udm_core::BioFlags::FUA)
            && !bio.flags.contains(udm_core::BioFlags::PREFLUSH)
            && bio.status().is_ok()
            && subs[0].off == 0
            && subs[0].n == nblk
        {
            // One piece covering the whole bio (a hit in one cache run, a
            // miss, a write to one extent): remap the caller's bio itself,
            // as a linear target would, instead of cloning it. Its frame
            // (pushed in submit) brings it back to `parent_done`, which
            // reads what to account from the context word.
            let sub = subs[0];
            subs.clear();
            drop(subs);
            bio.set_ctx(sub.ctx());
            if sub.kind == K_ORIGIN {
                bio.sector = sub.block * bs;
                self.origin.submit(bio);
            } else {
                bio.sector = sh.cache_sector(sub.block as u32);
                self.cache.submit(bio);
            }
            return;
        }
        bio.pending += subs.len() as u32;
        bio.set_ctx(from);
        let p = bio.into_raw();
        // SAFETY: `p` came from into_raw above; the parent stays alive while
        // its pending count (held by this function and by each sub) is
        // non-zero, and subs only complete on a later reactor turn.
        let parent = unsafe { &*p };
        let bsz = sh.cfg.block_size as u64;
        for s in subs.iter() {
            let mut c = parent.alloc_clone();
            c.flags = udm_core::BioFlags::NONE;
            c.add_segs_from(parent, (s.off * bsz) as usize, (s.n * bsz) as usize);
            c.set_end_io(sub_done, p.cast());
            c.set_ctx(s.ctx());
            match s.kind {
                K_ORIGIN => {
                    c.sector = s.block * bs;
                    self.origin.submit(c);
                }
                _ => {
                    c.sector = sh.cache_sector(s.block as u32);
                    self.cache.submit(c);
                }
            }
        }
        subs.clear();
        drop(subs);
        // SAFETY: as above; we still hold one pending count.
        let bio = unsafe { BioPtr::from_raw(p) };
        if read_held {
            // Retried by `kick` once a first write completes (`account`
            // sees read_waiters, counted under the lock above).
            self.read_wait.borrow_mut().push(bio);
        } else if blocked {
            self.space_wait.borrow_mut().push(bio);
            sh.poke();
        } else {
            self.put(bio, false);
        }
    }

    /// Drops one pending count of the caller's bio; the last one finishes it.
    fn put(&self, mut bio: BioPtr, in_completion: bool) {
        bio.pending -= 1;
        if bio.pending > 0 {
            let _ = bio.into_raw();
            return;
        }
        let s = bio.status();
        if bio.op == Op::Write && bio.flags.contains(udm_core::BioFlags::FUA) && s.is_ok() {
            // FUA: durable before it is acknowledged.
            return self.park_until_committed(bio, true, false);
        }
        bio.pop_end_io();
        if in_completion {
            bio.endio();
        } else {
            bio.complete(s);
        }
    }
}

/// Read runs: cached blocks contiguous on the cache in one read, misses
/// contiguous on the origin in another.
///
/// Returns false, having issued and pinned nothing, when the read overlaps
/// a block whose first write has not completed: the block is mapped (so
/// later writes find it) but holds whatever it held before it was
/// allocated — another sector's data. The read waits for the write rather
/// than returning that (a read concurrent with a write may return the old
/// data or the new, never a third thing).
fn map_read(st: &mut State, ob0: u64, n: u64, subs: &mut Vec<Sub>) -> bool {
    let mut i = 0;
    while i < n {
        let b = st.map[(ob0 + i) as usize];
        let mut k = 1;
        if b != NONE {
            while i + k < n && st.map[(ob0 + i + k) as usize] == b + k as u32 {
                k += 1;
            }
            if st.any_unwritten(b, k as u32) {
                // Unpin what this read pinned so far.
                for s in subs.drain(..) {
                    if s.kind == K_CACHE_READ {
                        for e in &mut st.entries[s.block as usize..(s.block + s.n) as usize] {
                            e.reads -= 1;
                        }
                    }
                }
                return false;
            }
            for e in &mut st.entries[b as usize..(b as u64 + k) as usize] {
                e.reads += 1;
            }
            st.stats.read_hits += k;
            subs.push(Sub {
                kind: K_CACHE_READ,
                block: b as u64,
                off: i,
                n: k,
            });
        } else {
            while i + k < n && st.map[(ob0 + i + k) as usize] == NONE {
                k += 1;
            }
            subs.push(Sub {
                kind: K_ORIGIN,
                block: ob0 + i,
                off: i,
                n: k,
            });
        }
        i += k;
    }
    st.stats.reads += n;
    true
}

/// Write runs from block `from`; returns where it stopped (`n` when done,
/// less when the cache ran out of free blocks).
fn map_write(
    sh: &Shared,
    st: &mut State,
    ob0: u64,
    n: u64,
    mut i: u64,
    now: u32,
    subs: &mut Vec<Sub>,
) -> u64 {
    while i < n {
        let ob = ob0 + i;
        let b = st.map[ob as usize];
        if b != NONE && st.in_place_ok(b) {
            // Overwrite in place, as one I/O while the blocks lie
            // contiguously on the cache (dm commit ee50cc19).
            let mut k = 1;
            st.entries[b as usize].writes += 1;
            while i + k < n
                && st.map[(ob + k) as usize] == b + k as u32
                && st.in_place_ok(b + k as u32)
            {
                st.entries[(b + k as u32) as usize].writes += 1;
                k += 1;
            }
            st.stats.write_hits_uncommitted += k;
            st.stats.writes += k;
            subs.push(Sub {
                kind: K_CACHE_WRITE | st.write_started(),
                block: b as u64,
                off: i,
                n: k,
            });
            i += k;
            continue;
        }
        if b == NONE && st.cleaner && !st.shadowed(ob) {
            // The cleaner caches nothing new: straight to the origin —
            // unless an older entry for the block may still be on disk (its
            // free marker not durable yet), which a crash would bring back
            // over this write: that write goes to the cache, newer there.
            let mut k = 1;
            while i + k < n && st.map[(ob + k) as usize] == NONE && !st.shadowed(ob + k) {
                k += 1;
            }
            st.stats.writes_around += k;
            st.stats.writes += k;
            st.last_origin_write = Some(Instant::now());
            subs.push(Sub {
                kind: K_ORIGIN,
                block: ob,
                off: i,
                n: k,
            });
            i += k;
            continue;
        }
        // New blocks: as many as follow that need one, in as few extents
        // as the free space allows.
        let mut m = 1;
        let mut any_old = b != NONE;
        if !st.cleaner {
            // Uncached blocks all need one: find their run in bulk.
            m += unmapped_prefix(&st.map[(ob + 1) as usize..(ob0 + n) as usize]) as u64;
        }
        while i + m < n {
            let nb = st.map[(ob + m) as usize];
            let needs = if nb == NONE {
                !st.cleaner || st.shadowed(ob + m)
            } else {
                !st.in_place_ok(nb)
            };
            if !needs {
                break;
            }
            any_old |= nb != NONE;
            m += 1;
        }
        let want = if sh.cfg.nocoalesce { 1 } else { m as u32 };
        let Some((start, got)) = st.free.alloc(want) else {
            return i;
        };
        // The run is handled as one: superseded copies first (unlinking
        // them may move the LRU tail), then the new entries, written whole
        // and already linked to each other, then the run joins the tail.
        let mut superseded = 0u64;
        if any_old {
            for k in 0..got {
                let obk = ob + k as u64;
                let old = st.map[obk as usize];
                if old != NONE {
                    // The old copy stays on disk until this one is committed.
                    st.entries[old as usize].st = St::Superseded;
                    st.lru_remove(old);
                    st.push_superseded(old, start + k);
                    st.shadow_add(obk);
                    superseded += 1;
                }
            }
        }
        let last = start + got - 1;
        // Whole entries, already linked to each other, and their image
        // (published now, see `State::unwritten`), in one branch-free pass;
        // the run's ends are linked to the LRU list after it.
        let tail = st.lru_tail;
        let run = NewRun {
            start,
            got,
            ob,
            g: st.pending_gen,
            bss: sh.cfg.bs_sectors(),
            now,
        };
        let stm = &mut *st;
        // Streamed (and fenced inside, before the plain stores to the
        // run's ends below and the release of the lock that publishes the
        // run) when long enough.
        if got >= STREAM_MIN_RUN {
            fill_run::<true>(&mut stm.entries, &mut stm.image, run);
        } else {
            fill_run::<false>(&mut stm.entries, &mut stm.image, run);
        }
        st.image_changed(start, got, got as u64);
        st.set_unwritten(start, got, true);
        st.entries[start as usize].prev = tail;
        st.entries[last as usize].next = NONE;
        st.map[ob as usize..(ob + got as u64) as usize]
            .iter_mut()
            .zip(start..)
            .for_each(|(m, nb)| *m = nb);
        if tail == NONE {
            st.lru_head = start;
        } else {
            st.entries[tail as usize].next = start;
        }
        st.lru_tail = last;
        st.live += got as u64 - superseded;
        st.stats.write_hits_committed += superseded;
        st.stats.writes_allocate += got as u64 - superseded;
        st.stats.writes += got as u64;
        subs.push(Sub {
            kind: K_CACHE_NEW | st.write_started(),
            block: start as u64,
            off: i,
            n: got as u64,
        });
        i += got as u64;
    }
    n
}

/// New runs at least this long write their metadata with streaming stores
/// (see [`stream`]): 64 entries are 32 whole cache lines of entries and 16
/// of image. Shorter runs keep it in the cache, where a small write's
/// next access (its overwrite, its writeback) finds it; streaming them cost
/// a 4 KiB random overwrite a fifth of its rate.
const STREAM_MIN_RUN: u32 = 64;

/// A new run, as [`fill_run`] writes it: cache blocks `start..start + got`
/// caching origin blocks from `ob`, generation `g`, `bss` sectors a block,
/// cached at `now` (ms).
#[derive(Clone, Copy)]
struct NewRun {
    start: u32,
    got: u32,
    ob: u64,
    g: u64,
    bss: u64,
    now: u32,
}

/// Writes whole entries for a new run, already linked to each other, and
/// their image, in one branch-free pass per metadata block. Every field is
/// affine in the block's place in the run: counters stepped once per
/// block, no multiply and no index check in the inner loop. `NT`: with
/// streaming stores, fenced before it returns.
#[inline(always)]
fn fill_run<const NT: bool>(entries: &mut [Entry], image: &mut Image, run: NewRun) {
    let NewRun {
        start,
        got,
        ob,
        g,
        bss,
        now,
    } = run;
    // Fences on return, and on unwinding: nothing touches the run first.
    let _fence = NT.then_some(stream::Fence);
    image.for_each_run(start as usize, got as usize, |first, image| {
        let k = first as u32 - start;
        let (mut sector, mut obk, mut nb) = ((ob + k as u64) * bss, ob as u32 + k, first as u32);
        let ents = &mut entries[first..first + image.len()];
        for (e, out) in ents.iter_mut().zip(image) {
            let d = DiskEntry { sector, seq: g }.to_bytes();
            let n = Entry {
                ob: obk,
                seq: g,
                born_ms: now,
                prev: nb.wrapping_sub(1),
                next: nb.wrapping_add(1),
                st: St::Live,
                ..Entry::FREE
            };
            if NT {
                // SAFETY: `_fence` fences before this function returns or
                // unwinds, and nothing reads the run before then (the loop
                // writes each entry once; `block_mut` only touches other
                // metadata blocks, with plain stores).
                unsafe {
                    stream::bytes16(out, d);
                    stream::entry(e, n);
                }
            } else {
                *out = d;
                *e = n;
            }
            sector += bss;
            obk += 1;
            nb += 1;
        }
    });
}

/// How many of the first entries of `map` are unmapped (NONE): 16 at a
/// time with one AND each and no branch (vectorized), then one by one. A
/// large write to uncached space costs a few instructions per 16 blocks.
fn unmapped_prefix(map: &[u32]) -> usize {
    let mut k = 0;
    for c in map.chunks_exact(16) {
        if c.iter().fold(NONE, |a, &x| a & x) != NONE {
            break;
        }
        k += 16;
    }
    k + map[k..].iter().take_while(|&&x| x == NONE).count()
}

/// A sub-I/O completed: account it under the lock, then drop its parent's
/// pending count.
fn sub_done(c: BioPtr) {
    let p = c.private() as *mut Bio;
    // SAFETY: a sub's private is its parent, alive while the sub is pending
    // (put drops the count only below).
    let parent = unsafe { &mut *p };
    // SAFETY: the parent's private is the WcChannel that pushed its frame,
    // kept alive by its table while I/O is in flight.
    let ch = unsafe { &*(parent.private() as *const WcChannel) };
    let sh = &*ch.shared;
    let (status, ctx) = (c.status(), c.ctx());
    let n = c.len() / sh.cfg.block_size;
    drop(c);
    account(sh, ctx, n, status, parent.op);
    if !status.is_ok() && parent.status().is_ok() {
        parent.set_status(status);
    }
    // SAFETY: we hold one of the parent's pending counts; it is ours again.
    let bio = unsafe { BioPtr::from_raw(p) };
    ch.put(bio, true);
}

/// Accounts a completed piece (its context word `ctx`, `n` blocks) of a
/// caller's `op`: unpins, marks first writes done, counts drained writes
/// for a waiting commit, wakes whoever waits on any of that.
fn account(sh: &Shared, ctx: u64, n: u32, status: Status, op: Op) {
    let kind = ctx >> 56;
    let block = ctx as u32;
    if kind == K_ORIGIN {
        if op == Op::Write {
            sh.lock().last_origin_write = Some(Instant::now());
        }
        return;
    }
    let mut st = sh.lock();
    let mut freed = false;
    let mut wake_readers = false;
    if kind == K_CACHE_NEW {
        // A first write: its entries were published when it was mapped;
        // only the bits say it is done (no pins were taken).
        st.set_unwritten(block, n, false);
        wake_readers = st.read_waiters > 0;
    } else {
        // One tight pass over the run's entries.
        let mut zombies = false;
        let run = &mut st.entries[block as usize..(block + n) as usize];
        if kind == K_CACHE_WRITE {
            for e in run {
                e.writes -= 1;
                zombies |= e.st == St::Zombie;
            }
        } else {
            for e in run {
                e.reads -= 1;
                zombies |= e.st == St::Zombie;
            }
        }
        if zombies {
            for b in block..block + n {
                freed |= st.unpinned(b);
            }
        }
    }
    let mut drained = false;
    if kind != K_CACHE_READ {
        let odd = (ctx & CTX_ODD != 0) as usize;
        st.inflight_writes[odd] -= 1;
        drained = st.inflight_writes[odd] == 0 && st.barrier != 0 && st.barrier & 1 == odd as u64;
    }
    if !status.is_ok() {
        st.error = Status::IoErr.errno();
    }
    let kick = (freed && st.space_waiters > 0) || !status.is_ok() || wake_readers;
    drop(st);
    if drained || !status.is_ok() {
        sh.poke();
    }
    if kick {
        sh.kick_all();
    }
}

/// End_io pushed on callers' bios: reached when the engine remapped the
/// caller's bio itself (one piece, see `map`); the context word says what
/// the piece was. (Bios the engine split complete through `put`, which pops
/// the frame first.)
fn parent_done(mut bio: BioPtr) {
    // SAFETY: the private of the engine's frame is the WcChannel that pushed
    // it, kept alive by its table while I/O is in flight.
    let ch = unsafe { &*(bio.private() as *const WcChannel) };
    let n = bio.len() / ch.shared.cfg.block_size;
    account(&ch.shared, bio.ctx(), n, bio.status(), bio.op);
    bio.pop_end_io();
    bio.endio();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run's entries and image, written with plain stores or streamed.
    fn filled<const NT: bool>(start: u32, got: u32) -> (Vec<Entry>, Vec<u8>) {
        let n = 3 * ENTRIES_PER_MBLOCK;
        let mut entries = vec![Entry::FREE; n];
        let mut image = Image::new(3);
        let run = NewRun {
            start,
            got,
            ob: 1000,
            g: 7,
            bss: 8,
            now: 42,
        };
        fill_run::<NT>(&mut entries, &mut image, run);
        let bytes = (0..3).flat_map(|m| image.block(m).to_vec()).collect();
        (entries, bytes)
    }

    #[test]
    fn a_streamed_run_writes_what_plain_stores_write() {
        // Across a metadata block boundary, and short and long runs.
        for (start, got) in [(ENTRIES_PER_MBLOCK as u32 - 5, 200), (3, 1), (17, 64)] {
            let (e0, i0) = filled::<false>(start, got);
            let (e1, i1) = filled::<true>(start, got);
            assert_eq!(e0, e1, "entries of run {start}+{got}");
            assert_eq!(i0, i1, "image of run {start}+{got}");
            // The run's last block: the origin block, its links, its image.
            let (b, obl) = ((start + got - 1) as usize, 1000 + got as u64 - 1);
            assert_eq!(e1[b].ob as u64, obl);
            assert_eq!((e1[b].prev, e1[b].next), (b as u32 - 1, b as u32 + 1));
            assert_eq!(e1[start as usize - 1], Entry::FREE);
            assert_eq!(e1[(start + got) as usize], Entry::FREE);
            let d = DiskEntry::decode(&i1[b * ENTRY_BYTES as usize..]);
            assert_eq!((d.sector, d.seq), (obl * 8, 7));
        }
    }
}
