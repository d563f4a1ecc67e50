//! `writecache`: a persistent write cache on a fast device (dm-writecache's
//! SSD mode), whose writes stay large as the cache ages.
//!
//! Table line (dm's syntax):
//!
//! ```text
//! <start> <length> writecache s <origin> <cache> <block size> <#features> [features…]
//! ```
//!
//! - `s`: SSD mode (the only mode; `p`, persistent memory, is refused);
//! - `origin`: the device being cached; `cache`: the fast device holding
//!   the superblock, the entry array and the data blocks;
//! - `block size`: bytes per cache block, a power of two from 512 to 65536,
//!   at least both devices' logical block size; it is the device's logical
//!   block size;
//! - features (a feature with a value counts as two arguments):
//!   `start_sector n` (cache sectors to skip, default 0),
//!   `high_watermark n` (percent used that starts writeback, default 50),
//!   `low_watermark n` (percent where it stops, default 45),
//!   `writeback_jobs n` (most blocks under writeback, default unlimited),
//!   `autocommit_blocks n` (commit after this many changed blocks, default
//!   65536), `autocommit_time ms` (commit this long after a change, default
//!   1000), `fua`/`nofua` (writeback writes to the origin carry FUA instead
//!   of a flush after them; default nofua), `cleaner` (cache nothing new and
//!   write everything back), `max_age ms` (write back blocks cached longer),
//!   `pause_writeback ms` (watermark writeback waits this long after a write
//!   went around the cache, default 3000), and the udm extension
//!   `nocoalesce` (one cache write per block, as before the seed's patch, to
//!   measure what coalescing gains).
//!
//! Status (`dmsetup status`): error, cache blocks, free blocks, blocks under
//! writeback, then the counters reads, read hits, writes, write hits on
//! uncommitted blocks, write hits on committed blocks, writes around the
//! cache, writes allocating a block, writes blocked on the free list,
//! flushes, discards (all in blocks except flushes).
//!
//! DISCARD (offered when the origin takes it) drops the cached blocks of
//! its range and is passed on to the origin, as dm's; see
//! `Discarder::discard` and rule 4 in `meta.rs` for the crash-safe order.
//!
//! Messages: `flush` (commit, write everything back, return when done),
//! `flush_on_suspend` (do that at the next suspend), `cleaner` (switch the
//! cleaner on), `clear_stats`.
//!
//! How it is built: `state.rs` (the shared state behind the lock),
//! `channel.rs` (the engine as a device, its channel on each reactor),
//! `map.rs` (how a bio becomes sub-I/Os), `discard.rs`, `entry.rs` and
//! `alloc.rs` (a block's entry, free space as extents), `meta.rs` and
//! `image.rs` (on-disk format and why commits are crash-safe), and the
//! worker: `worker.rs` (its state and I/O), `load.rs`, `commit.rs`,
//! `clean.rs` (writing blocks back) and `writeback.rs` (when it does what).

mod alloc;
mod channel;
mod clean;
mod commit;
mod discard;
mod entry;
mod fuzzing;
mod image;
mod load;
mod map;
mod meta;
mod state;
mod stream;
mod worker;
mod writeback;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use udm_core::{BioPtr, BlockDevice, Error, ErrorKind, SECTOR_SHIFT};

use crate::target::{CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};
use channel::WcDev;
use meta::Geometry;

pub(crate) use fuzzing::fuzz_load;
use state::{Config, Shared};

/// The `writecache` target type.
pub const WRITECACHE: TargetType = TargetType {
    name: "writecache",
    version: [1, 6, 0],
    summary: "a persistent write cache on a fast device (SSD mode)",
    usage: "s <origin> <cache> <block size> <#features> [features...]",
    min_args: 5,
    max_args: None,
    splits: false,
    // The cache device: its superblock and entries are this target's.
    exclusive_args: &[2],
    ctr: writecache_ctr,
};

struct Writecache {
    devs: [DevArea; 1],
    shared: Arc<Shared>,
    /// The feature arguments as given (for the table line).
    features: Vec<String>,
    join: Mutex<Option<JoinHandle<()>>>,
}

fn bad(m: String) -> Error {
    Error::invalid(format!("writecache: {m}"))
}

fn num<T: std::str::FromStr>(what: &str, v: Option<&&str>) -> Result<T, Error> {
    let Some(v) = v else {
        return Err(bad(format!("feature '{what}' needs a value")));
    };
    v.parse::<T>()
        .map_err(|_| bad(format!("invalid {what} '{v}': expected a number")))
}

fn writecache_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    match argv[0] {
        "s" => {}
        "p" => {
            return Err(bad(
                "mode 'p' (persistent memory) is not supported: use 's'".into(),
            ))
        }
        m => return Err(bad(format!("invalid mode '{m}': expected 's'"))),
    }
    let origin = ctx
        .get_device(argv[1])
        .map_err(|e| e.context("writecache"))?;
    let cache = ctx
        .get_device(argv[2])
        .map_err(|e| e.context("writecache"))?;
    let bs: u32 = argv[3]
        .parse()
        .ok()
        .filter(|b: &u32| b.is_power_of_two() && (512..=65536).contains(b))
        .ok_or_else(|| {
            bad(format!(
                "invalid block size '{}': expected a power of two from 512 to 65536",
                argv[3]
            ))
        })?;
    let nfeat: usize = argv[4]
        .parse()
        .map_err(|_| bad(format!("invalid number of feature arguments '{}'", argv[4])))?;
    let feats = &argv[5..];
    if feats.len() != nfeat {
        return Err(bad(format!(
            "number of feature arguments is {nfeat} but {} follow",
            feats.len()
        )));
    }
    let mut cfg = Config {
        origin,
        cache,
        block_size: bs,
        start_sector: 0,
        high_watermark: 50,
        low_watermark: 45,
        writeback_jobs: 0,
        autocommit_blocks: 65536,
        autocommit_time: Duration::from_millis(1000),
        fua: false,
        max_age: None,
        pause_writeback: Duration::from_millis(3000),
        nocoalesce: false,
        len: ctx.len,
    };
    let mut i = 0;
    while i < feats.len() {
        let f = feats[i];
        let v = feats.get(i + 1);
        let mut took_value = true;
        match f {
            "start_sector" => cfg.start_sector = num(f, v)?,
            "high_watermark" | "low_watermark" => {
                let p: u32 = num(f, v)?;
                if p > 100 {
                    return Err(bad(format!("invalid {f} '{p}': must be 0..100")));
                }
                if f == "high_watermark" {
                    cfg.high_watermark = p;
                } else {
                    cfg.low_watermark = p;
                }
            }
            "writeback_jobs" => cfg.writeback_jobs = num(f, v)?,
            "autocommit_blocks" => {
                cfg.autocommit_blocks = num(f, v)?;
                if cfg.autocommit_blocks == 0 {
                    return Err(bad(
                        "invalid autocommit_blocks '0': must be at least 1".into()
                    ));
                }
            }
            "autocommit_time" => cfg.autocommit_time = Duration::from_millis(num(f, v)?),
            "max_age" => {
                let ms: u64 = num(f, v)?;
                if ms == 0 {
                    return Err(bad("invalid max_age '0': must be at least 1 ms".into()));
                }
                cfg.max_age = Some(Duration::from_millis(ms));
            }
            "pause_writeback" => {
                let ms: u64 = num(f, v)?;
                if ms > 60_000 {
                    return Err(bad(format!(
                        "invalid pause_writeback '{ms}': at most 60000 ms"
                    )));
                }
                cfg.pause_writeback = Duration::from_millis(ms);
            }
            "fua" | "nofua" | "cleaner" | "nocoalesce" => {
                took_value = false;
                match f {
                    "fua" => cfg.fua = true,
                    "nofua" => cfg.fua = false,
                    "nocoalesce" => cfg.nocoalesce = true,
                    _ => {}
                }
            }
            other => {
                return Err(bad(format!(
                "unknown feature '{other}' (known: start_sector, high_watermark, low_watermark, \
                     writeback_jobs, autocommit_blocks, autocommit_time, fua, nofua, cleaner, \
                     max_age, pause_writeback, nocoalesce)"
            )))
            }
        }
        i += if took_value { 2 } else { 1 };
    }
    if cfg.low_watermark > cfg.high_watermark {
        return Err(bad(format!(
            "low_watermark {} is above high_watermark {}",
            cfg.low_watermark, cfg.high_watermark
        )));
    }
    let bss = (bs >> SECTOR_SHIFT) as u64;
    if !ctx.len.is_multiple_of(bss) {
        return Err(bad(format!(
            "target length {} is not a multiple of the block size ({bss} sectors)",
            ctx.len
        )));
    }
    if ctx.len / bss > u32::MAX as u64 {
        // Origin blocks are u32 in the entries (and the map, one slot per
        // origin block, would not fit in memory anyway).
        return Err(bad(format!(
            "target length {} is too large: at most {} blocks of {bs} bytes",
            ctx.len,
            u32::MAX
        )));
    }
    let olen = cfg.origin.limits().sectors;
    if olen < ctx.len {
        return Err(bad(format!(
            "origin '{}' is too small: {olen} sectors for a target of {}",
            cfg.origin.name(),
            ctx.len
        )));
    }
    // As dm: every cache block, and the metadata, must be I/O both devices
    // take (a 512-byte block on a 4 KiB-sector SSD could not be written).
    for (what, dev) in [("origin", &cfg.origin), ("cache", &cfg.cache)] {
        let lbs = dev.limits().logical_block_size;
        if bs < lbs {
            return Err(bad(format!(
                "block size {bs} is smaller than the logical block size of the {what} '{}' ({lbs} bytes)",
                dev.name()
            )));
        }
    }
    let clbs = (cfg.cache.limits().logical_block_size as u64 >> SECTOR_SHIFT).max(1);
    if !cfg.start_sector.is_multiple_of(clbs) {
        return Err(bad(format!(
            "invalid start_sector '{}': not a multiple of the cache '{}''s logical block size ({clbs} sectors)",
            cfg.start_sector,
            cfg.cache.name()
        )));
    }
    let clen = cfg.cache.limits().sectors;
    if cfg.start_sector >= clen {
        return Err(bad(format!(
            "invalid start_sector '{}': the cache '{}' has {clen} sectors",
            cfg.start_sector,
            cfg.cache.name()
        )));
    }
    let geo = Geometry::fit((clen - cfg.start_sector) << SECTOR_SHIFT, bs)
        .map_err(|e| e.context(format!("cache '{}'", cfg.cache.name())))?;
    let cleaner = feats.contains(&"cleaner");
    let shared = Arc::new(Shared::new(cfg, geo));
    shared.lock().cleaner = cleaner;
    let join = writeback::start(shared.clone())?;
    let dev: Arc<dyn BlockDevice> = Arc::new(WcDev::new(shared.clone()));
    Ok(Box::new(Writecache {
        devs: [DevArea {
            dev,
            start: 0,
            len: ctx.len,
        }],
        shared,
        features: feats.iter().map(|s| s.to_string()).collect(),
        join: Mutex::new(Some(join)),
    }))
}

impl Writecache {
    /// Waits (on a control thread) until `done` holds, poking the worker.
    fn wait(&self, mut done: impl FnMut(&state::State) -> bool) -> Result<(), Error> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            if st.error != 0 {
                return Err(Error::new(
                    ErrorKind::Io,
                    format!("writecache: the cache has an I/O error ({})", st.error),
                ));
            }
            if done(&st) {
                return Ok(());
            }
            drop(st);
            sh.poke();
            st = sh.lock();
            let (g, _) = sh
                .cv
                .wait_timeout(st, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner());
            st = g;
        }
    }

    /// Commits everything acknowledged so far.
    fn commit(&self) -> Result<(), Error> {
        let gen = {
            let mut st = self.shared.lock();
            let g = st.pending_gen;
            st.commit_wanted = st.commit_wanted.max(g);
            g
        };
        self.wait(|st| st.committed >= gen)
    }

    /// Commits, then writes everything back and waits until the cache is
    /// empty (dm's `flush` message).
    fn flush_all(&self) -> Result<(), Error> {
        self.commit()?;
        {
            let mut st = self.shared.lock();
            st.writeback_all += 1;
            let g = st.pending_gen;
            st.commit_wanted = st.commit_wanted.max(g);
        }
        let r =
            self.wait(|st| st.live == 0 && st.superseded.is_empty() && st.free_pending.is_empty());
        self.shared.lock().writeback_all -= 1;
        r
    }
}

impl Drop for Writecache {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.shared.worker.get() {
            h.wake();
        }
        let j = self.join.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(j) = j {
            let _ = j.join();
        }
    }
}

impl Target for Writecache {
    #[inline]
    fn map(&self, bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        // The engine device spans the target: same sectors.
        Map::Remapped(bio, 0)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn no_clone(&self) -> bool {
        true
    }

    /// One event, when the cache first fails (as dm-writecache's
    /// `writecache_error`): the error sticks until the table is replaced.
    fn events(&self) -> u64 {
        (self.shared.lock().error != 0) as u64
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        let sh = &*self.shared;
        match ty {
            StatusType::Info => {
                let st = sh.lock();
                let s = st.stats;
                out.push_str(&format!(
                    "{} {} {} {} {} {} {} {} {} {} {} {} {} {}",
                    st.error,
                    sh.geo.n_blocks,
                    st.free.free_blocks(),
                    sh.wb_blocks.load(Ordering::Relaxed),
                    s.reads,
                    s.read_hits,
                    s.writes,
                    s.write_hits_uncommitted,
                    s.write_hits_committed,
                    s.writes_around,
                    s.writes_allocate,
                    s.writes_blocked_on_freelist,
                    s.flushes,
                    s.discards
                ));
            }
            StatusType::Table => {
                let c = &sh.cfg;
                out.push_str(&format!(
                    "s {} {} {} {}",
                    c.origin.name(),
                    c.cache.name(),
                    c.block_size,
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
            ["flush"] => self.flush_all().map(|_| String::new()),
            ["flush_on_suspend"] => {
                self.shared.lock().flush_on_suspend = true;
                Ok(String::new())
            }
            ["cleaner"] => {
                self.shared.lock().cleaner = true;
                self.shared.poke();
                Ok(String::new())
            }
            ["clear_stats"] => {
                self.shared.lock().stats = Default::default();
                Ok(String::new())
            }
            _ => Err(bad(format!(
                "unknown message '{}' (known: flush, flush_on_suspend, cleaner, clear_stats)",
                argv.join(" ")
            ))),
        }
    }

    fn postsuspend(&self) -> Result<(), Error> {
        // As dm: what was acknowledged is committed when suspended; and on
        // request, everything goes back to the origin.
        let all = self.shared.lock().flush_on_suspend;
        if all {
            self.flush_all()
        } else {
            self.commit()
        }
    }
}
