//! `raid`: a mirror (dm-raid's raid1) with a write-intent bitmap, that goes
//! on over a failing leg and resyncs after a crash only what was being
//! written.
//!
//! Table line (dm-raid's syntax):
//!
//! ```text
//! <start> <length> raid raid1 <#raid_params> <chunk size> [<param>…]
//!     <#raid_devs> <meta dev> <data dev> [<meta dev> <data dev>…]
//! ```
//!
//! - `raid1`: the only raid type;
//! - `#raid_params`: the arguments that follow, the chunk size included;
//!   `chunk size` (sectors) is read and printed back, unused by raid1;
//! - params: `region_size <sectors>` (a power of two, at least 8; default
//!   the smallest power of two of at least 8192 sectors that keeps the
//!   bitmap under 2^21 regions), `nosync` (the legs are taken as in sync),
//!   `sync` (resync everything), `rebuild <idx>` (rebuild that leg from the
//!   others; may repeat), `write_mostly <idx>` (read that leg only when no
//!   other can serve; may repeat), `max_recovery_rate <KiB/s per leg>`
//!   (0, the default: no limit), `daemon_sleep <ms>` (how long a region must
//!   be idle before its bit is cleared; default 5000);
//! - each leg: a metadata device (superblock and bitmap; `-` for none) and
//!   a data device, used from sector 0. Every data device has the same
//!   size, at least the target's length.
//!
//! Status (`dmsetup status`), as dm-raid:
//! `raid1 <#devs> <health chars> <synced>/<total> <sync action> <mismatch
//! count> <data offset> <journal char>`, where each health char is `A`
//! (alive, in sync), `a` (alive, being rebuilt) or `D` (failed); the sync
//! action one of `idle`, `frozen`, `resync`, `recover`, `check`, `repair`;
//! the data offset 0 and the journal char `-` (no journal).
//!
//! Messages: `idle` (stop a check or repair), `frozen` (pause every
//! action), `resync` (resync every region), `recover` (go on rebuilding),
//! `check` (count the sectors that differ between legs), `repair` (and
//! rewrite them from the first leg in sync).
//!
//! How it is built: `state.rs` (what the I/O path and the worker share),
//! `channel.rs` (the I/O path), `metadata.rs` (the on-disk format and the
//! assembly of the array), `worker.rs` (metadata writes and the bitmap
//! daemon), `resync.rs` (resync, rebuild, check, repair, read repair).

mod channel;
pub(crate) mod fuzzing;
mod metadata;
mod resync;
mod state;
mod worker;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use udm_core::{BioPtr, BlockDevice, Caps, Error, SECTOR_SHIFT};

use crate::target::{CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};
use channel::RaidDev;
use state::{Action, Config, Leg, Shared};

/// The `raid` target type.
pub const RAID: TargetType = TargetType {
    name: "raid",
    version: [1, 15, 1],
    summary: "a mirror (raid1) with a write-intent bitmap, resync, rebuild and read repair",
    usage: "raid1 <#raid_params> <chunk size> [<param>...] <#raid_devs> <meta dev> <data dev> ...",
    min_args: 6,
    max_args: None,
    splits: false,
    exclusive_args: &[],
    ctr: raid_ctr,
};

/// Most legs (masks are 64 bits; the read path keeps legs tried in 56).
const MAX_LEGS: usize = 32;

struct Raid {
    devs: [DevArea; 1],
    shared: Arc<Shared>,
    /// The arguments as given, from the raid type on (for the table line).
    args: Vec<String>,
    join: Mutex<Option<JoinHandle<()>>>,
}

fn bad(m: impl Into<String>) -> Error {
    Error::invalid(format!("raid: {}", m.into()))
}

fn num<T: std::str::FromStr>(what: &str, v: Option<&&str>) -> Result<T, Error> {
    let Some(v) = v else {
        return Err(bad(format!("parameter '{what}' needs a value")));
    };
    v.parse::<T>()
        .map_err(|_| bad(format!("invalid {what} '{v}': expected a number")))
}

/// Arrays that went live, by the metadata devices they write.
static LIVE: Mutex<Vec<(usize, Weak<Shared>)>> = Mutex::new(Vec::new());

fn meta_keys(sh: &Shared) -> Vec<usize> {
    sh.cfg
        .legs
        .iter()
        .filter_map(|l| l.meta.as_ref())
        .map(|m| Arc::as_ptr(m) as *const () as usize)
        .collect()
}

/// The worker may start: the table is live (a channel opened, or resume).
/// An older instance on the same metadata (the table this one replaced,
/// whose last I/O may still be draining) stops clearing bits and
/// resyncing: its bitmap image is stale from now on.
pub(crate) fn activate(sh: &Arc<Shared>) {
    let mut st = sh.lock();
    if st.active {
        return;
    }
    st.active = true;
    drop(st);
    let keys = meta_keys(sh);
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|(_, w)| w.strong_count() > 0);
    for (k, w) in live.iter() {
        if let Some(old) = w.upgrade() {
            if !Arc::ptr_eq(&old, sh) && keys.contains(k) {
                old.retired.store(true, Ordering::Release);
            }
        }
    }
    for k in keys {
        live.push((k, Arc::downgrade(sh)));
    }
    drop(live);
    sh.poke();
}

/// The region size without `region_size`: the smallest power of two of at
/// least 8192 sectors that keeps an array of `len` sectors under 2^21
/// regions.
pub(crate) fn default_region_size(len: u64) -> u64 {
    len.div_ceil(1 << 21).max(8192).next_power_of_two()
}

fn raid_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    if argv[0] != "raid1" {
        return Err(bad(format!(
            "raid type '{}' is not supported (only raid1)",
            argv[0]
        )));
    }
    let nparams: usize = argv[1]
        .parse()
        .map_err(|_| bad(format!("invalid #raid_params '{}'", argv[1])))?;
    if nparams < 1 || 2 + nparams > argv.len() {
        return Err(bad(format!(
            "#raid_params is {nparams} but {} arguments follow it (at least the chunk size)",
            argv.len() - 2
        )));
    }
    let params = &argv[2..2 + nparams];
    let _chunk: u32 = params[0]
        .parse()
        .map_err(|_| bad(format!("invalid chunk size '{}'", params[0])))?;
    let rest = &argv[2 + nparams..];
    let ndevs: usize = match rest.first() {
        Some(v) => v
            .parse()
            .map_err(|_| bad(format!("invalid #raid_devs '{v}'")))?,
        None => return Err(bad("missing #raid_devs after the parameters")),
    };
    if !(2..=MAX_LEGS).contains(&ndevs) {
        return Err(bad(format!(
            "#raid_devs is {ndevs}: raid1 takes 2 to {MAX_LEGS} legs"
        )));
    }
    if rest.len() != 1 + 2 * ndevs {
        return Err(bad(format!(
            "#raid_devs is {ndevs} but {} device arguments follow (expected {}: a metadata and a data device per leg)",
            rest.len() - 1,
            2 * ndevs
        )));
    }
    let mut region_size: Option<u64> = None;
    let (mut nosync, mut sync) = (false, false);
    let (mut rebuild, mut write_mostly) = (0u64, 0u64);
    let mut max_recovery_rate = 0u64;
    let mut daemon_sleep = Duration::from_millis(5000);
    let leg_idx = |what: &str, v: Option<&&str>| -> Result<u64, Error> {
        let i: usize = num(what, v)?;
        if i >= ndevs {
            return Err(bad(format!(
                "{what} {i}: no such leg (the array has {ndevs}, numbered from 0)"
            )));
        }
        Ok(1 << i)
    };
    let mut i = 1;
    while i < params.len() {
        let p = params[i];
        let v = params.get(i + 1);
        let mut took = true;
        match p {
            "region_size" => {
                let r: u64 = num(p, v)?;
                if !r.is_power_of_two() || r < 8 {
                    return Err(bad(format!(
                        "invalid region_size '{r}': expected a power of two of at least 8 sectors"
                    )));
                }
                region_size = Some(r);
            }
            "nosync" => {
                took = false;
                nosync = true;
            }
            "sync" => {
                took = false;
                sync = true;
            }
            "rebuild" => rebuild |= leg_idx(p, v)?,
            "write_mostly" => write_mostly |= leg_idx(p, v)?,
            "max_recovery_rate" => max_recovery_rate = num(p, v)?,
            "daemon_sleep" => {
                let ms: u64 = num(p, v)?;
                if ms == 0 || ms > 100_000 {
                    return Err(bad(format!(
                        "invalid daemon_sleep '{ms}': expected 1 to 100000 ms"
                    )));
                }
                daemon_sleep = Duration::from_millis(ms);
            }
            "min_recovery_rate" | "stripe_cache" | "journal_dev" | "journal_mode"
            | "raid10_copies" | "raid10_format" | "data_offset" | "delta_disks" => {
                return Err(bad(format!("parameter '{p}' is not supported for raid1")))
            }
            other => {
                return Err(bad(format!(
                    "unknown parameter '{other}' (known: region_size, nosync, sync, rebuild, \
                     write_mostly, max_recovery_rate, daemon_sleep)"
                )))
            }
        }
        i += if took { 2 } else { 1 };
    }
    if nosync && sync {
        return Err(bad("'sync' and 'nosync' exclude each other"));
    }
    if write_mostly.count_ones() as usize == ndevs {
        return Err(bad(
            "every leg is write_mostly: at least one must serve reads",
        ));
    }
    let len = ctx.len;
    let region_size = region_size.unwrap_or_else(|| default_region_size(len));
    let region_shift = region_size.trailing_zeros();
    let nregions = len.div_ceil(region_size);
    // Devices: each named once, legs of one size.
    let mut seen = HashSet::new();
    let mut legs = Vec::new();
    let mut size: Option<(u64, String)> = None;
    for l in 0..ndevs {
        let (mname, dname) = (rest[1 + 2 * l], rest[2 + 2 * l]);
        if dname == "-" {
            return Err(bad(format!("leg {l} has no data device ('-')")));
        }
        for n in [mname, dname] {
            if n != "-" && !seen.insert(n.to_string()) {
                return Err(bad(format!("device '{n}' is named twice")));
            }
        }
        let data = ctx.get_device(dname).map_err(|e| e.context("raid"))?;
        let meta = if mname == "-" {
            None
        } else {
            Some(ctx.get_device(mname).map_err(|e| e.context("raid"))?)
        };
        for d in std::iter::once(&data).chain(meta.as_ref()) {
            if !seen.insert(format!("\0{}", d.name())) {
                return Err(bad(format!("device '{}' is named twice", d.name())));
            }
        }
        let s = data.limits().sectors;
        match &size {
            None => size = Some((s, dname.to_string())),
            Some((s0, n0)) if *s0 != s => {
                return Err(bad(format!(
                    "legs of different sizes: '{n0}' has {s0} sectors, '{dname}' has {s}"
                )))
            }
            _ => {}
        }
        if s < len {
            return Err(bad(format!(
                "leg '{dname}' is too small: {s} sectors for a target of {len}"
            )));
        }
        if let Some(m) = &meta {
            let need = metadata::meta_bytes(nregions);
            let have = m.limits().sectors << SECTOR_SHIFT;
            if have < need {
                return Err(bad(format!(
                    "metadata device '{}' is too small: {have} bytes, {need} needed for {nregions} regions",
                    m.name()
                )));
            }
        }
        legs.push(Leg { meta, data });
    }
    let cfg = Config {
        legs,
        len,
        region_shift,
        nregions,
        write_mostly,
        rebuild,
        nosync,
        sync,
        max_recovery_rate,
        daemon_sleep,
    };
    let shared = Arc::new(Shared::new(cfg));
    let join = worker::start(shared.clone())?;
    let dev: Arc<dyn BlockDevice> = Arc::new(RaidDev::new(shared.clone()));
    Ok(Box::new(Raid {
        devs: [DevArea { dev, start: 0, len }],
        shared,
        args: argv.iter().map(|s| s.to_string()).collect(),
        join: Mutex::new(Some(join)),
    }))
}

impl Drop for Raid {
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

impl Raid {
    fn health(&self) -> String {
        let sh = &*self.shared;
        let (failed, insync) = (
            sh.failed.load(Ordering::Acquire),
            sh.insync.load(Ordering::Acquire),
        );
        (0..sh.cfg.legs.len())
            .map(|i| {
                if failed & (1 << i) != 0 {
                    'D'
                } else if insync & (1 << i) != 0 {
                    'A'
                } else {
                    'a'
                }
            })
            .collect()
    }
}

impl Target for Raid {
    #[inline]
    fn map(&self, bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        // The mirror device spans the target: same sectors.
        Map::Remapped(bio, 0)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn no_clone(&self) -> bool {
        true
    }

    /// `map` is a remap by 0 onto the mirror: the fast path does it itself
    /// (linear's plan), without calling `map`.
    fn remap_offset(&self) -> Option<u64> {
        Some(0)
    }

    /// An event when a leg fails and when an action finishes (as dm-raid).
    fn events(&self) -> u64 {
        self.shared.events.load(Ordering::Acquire)
    }

    fn caps(&self, stacked: Caps) -> Caps {
        stacked
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        let sh = &*self.shared;
        match ty {
            StatusType::Info => {
                let st = sh.lock();
                let len = sh.cfg.len;
                let recovering = sh.live() & !sh.insync.load(Ordering::Acquire) != 0;
                let unsynced = sh.any_unsynced.load(Ordering::Acquire);
                // What runs, or is about to (the worker picks it up next).
                let action = match st.action {
                    Action::Idle if recovering && sh.source().is_some() => Action::Recover,
                    Action::Idle if unsynced => Action::Resync,
                    a => a,
                };
                let synced = match action {
                    Action::Idle => len,
                    _ if st.action == Action::Idle => 0,
                    _ => (st.cursor << sh.cfg.region_shift).min(len),
                };
                let action = if st.frozen { "frozen" } else { action.name() };
                out.push_str(&format!(
                    "raid1 {} {} {synced}/{len} {action} {} 0 -",
                    sh.cfg.legs.len(),
                    self.health(),
                    st.mismatches
                ));
            }
            StatusType::Table => out.push_str(&self.args.join(" ")),
        }
    }

    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        let busy = matches!(st.action, Action::Resync | Action::Recover);
        match argv {
            ["idle"] => {
                st.frozen = false;
                if matches!(st.action, Action::Check | Action::Repair) {
                    st.action = Action::Idle;
                }
            }
            ["frozen"] => st.frozen = true,
            ["resync"] => {
                st.frozen = false;
                // Dirty on disk too, so that a crash does not cut it short.
                for r in 0..sh.cfg.nregions {
                    state::set(&sh.unsynced, r);
                    st.want_mark[(r / 64) as usize] |= 1 << (r % 64);
                }
                st.mark_wanted = true;
                sh.any_unsynced.store(true, Ordering::Release);
                sh.paths();
                st.action = Action::Idle;
            }
            ["recover"] => st.frozen = false,
            ["check"] | ["repair"] => {
                if busy {
                    return Err(bad(format!(
                        "cannot start '{}': a {} is running",
                        argv[0],
                        st.action.name()
                    )));
                }
                st.frozen = false;
                st.mismatches = 0;
                st.cursor = 0;
                st.action = if argv[0] == "check" {
                    Action::Check
                } else {
                    Action::Repair
                };
            }
            _ => {
                return Err(bad(format!(
                    "unknown message '{}' (known: idle, frozen, resync, recover, check, repair)",
                    argv.join(" ")
                )))
            }
        }
        drop(st);
        sh.poke();
        Ok(String::new())
    }

    fn resume(&self) {
        activate(&self.shared);
    }
}
