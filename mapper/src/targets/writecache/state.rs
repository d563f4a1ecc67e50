//! The engine's shared state: the settings, everything behind the lock
//! (entries, map, free space, image, commit and writeback bookkeeping) and
//! what every reactor and the worker share.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use udm_core::{BlockDevice, ReactorHandle, SECTOR_SHIFT};

use super::alloc::FreeExtents;
use super::entry::{Entry, St, NONE};
use super::image::Image;
use super::meta::{DiskEntry, Geometry, ENTRIES_PER_MBLOCK, ENTRY_BYTES};

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
    /// A watermark pass is on: set when the cache reaches the high
    /// watermark, cleared when it is down to the low one. Between them a
    /// pass goes on but none starts (dm's hysteresis), so blocks written
    /// after a pass ended stay cached until the high watermark again.
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
    /// Origin block ranges `[start, end)` of discards gone to the origin
    /// with cached blocks to drop after: writeback takes none of their
    /// blocks until the discard completes (see start_discard).
    pub discarding: Vec<(u64, u64)>,
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
            discarding: Vec::new(),
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

    /// Whether origin block `ob` lies in a discard in flight (see
    /// [`State::discarding`]).
    #[inline]
    pub fn discarding(&self, ob: u64) -> bool {
        self.discarding.iter().any(|&(s, e)| s <= ob && ob < e)
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
    /// The engine's channel on each reactor (see `Shared::kick_all`).
    pub chans: Mutex<Vec<(ReactorHandle, u64)>>,
    pub started: Instant,
    /// Blocks under writeback (for the status line without the lock).
    pub wb_blocks: AtomicU64,
}

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

    /// Whether the blocks in use reach `high_watermark` percent of the
    /// cache (where watermark writeback starts).
    #[inline]
    pub fn above_high_watermark(&self, st: &State) -> bool {
        let n = self.geo.n_blocks as u64;
        st.used(n) * 100 >= n * self.cfg.high_watermark as u64
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
