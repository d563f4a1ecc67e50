//! `flakey`: a device that works for a while, then fails (dm-flakey, as in
//! Linux 6.12).
//!
//! Table line:
//! `<start> <length> flakey <dev> <offset> <up interval> <down interval> [<#features> <feature>...]`
//! - `dev`, `offset`: where the range maps, as `linear`;
//! - `up interval`, `down interval`: seconds up, then seconds down, in a
//!   cycle that starts when the target is constructed (their sum must not
//!   be 0);
//! - features (their count is the number of words that follow, arguments
//!   included):
//!   - `error_reads`: reads fail while down;
//!   - `drop_writes`: writes (and discards) are acknowledged and dropped
//!     while down;
//!   - `error_writes`: writes fail while down;
//!   - `corrupt_bio_byte <Nth> <r|w> <value> <flags>`: while down, byte
//!     `Nth` (from 1) of each matching read (as it completes) or write (as
//!     it goes down) becomes `value`; `flags` 0 matches every bio, otherwise
//!     bios carrying all of udm's flag bits given (1 PREFLUSH, 2 FUA);
//!   - `random_read_corrupt <p>`, `random_write_corrupt <p>`: while down,
//!     a read or write is corrupted at one random byte with probability
//!     `p` / 1 000 000 000.
//!
//!   With none of these, the device errors every I/O while down.
//!
//! A corrupted write goes down from a copy: the caller's buffer stays as it
//! was (as dm-flakey clones the pages). Time comes from a [`Clock`], which
//! tests replace ([`ctr_with_clock`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use udm_core::{Bio, BioFlags, BioPtr, Error, Op, Status};

use crate::target::{
    parse_sector, CtrCtx, DevArea, EndIoWhen, Map, MapCtx, StatusType, Target, TargetType,
};

/// The `flakey` target type.
pub const FLAKEY: TargetType = TargetType {
    name: "flakey",
    version: [1, 5, 0],
    summary: "works for <up> seconds, then fails, drops or corrupts I/O for <down> seconds",
    usage: "<dev> <offset> <up interval> <down interval> [<#features> <feature>...]",
    min_args: 4,
    max_args: None,
    splits: false,
    exclusive_args: &[],
    ctr: flakey_ctr,
};

/// Random corruption probabilities count out of this (dm's `PROBABILITY_BASE`).
pub const PROBABILITY_BASE: u32 = 1_000_000_000;

/// Where flakey reads the time: milliseconds from any fixed origin.
pub trait Clock: Send + Sync {
    /// Milliseconds since the clock's origin; never decreases.
    fn now_ms(&self) -> u64;

    /// Runs `f` once the clock reads `ms` or later: on a timer thread for
    /// the real clock, inside [`ManualClock::advance_ms`] for the manual one.
    fn at(&self, ms: u64, f: Timer);
}

/// A callback for [`Clock::at`].
pub type Timer = Box<dyn FnOnce() + Send>;

/// The real clock: milliseconds since it was made.
pub struct MonotonicClock(Instant);

/// The process's one timer thread for [`MonotonicClock::at`]: callbacks by
/// due time, run in order (one thread for every flakey target; the
/// callbacks only flip a flag).
struct TimerThread {
    queue: Mutex<Vec<(Instant, Timer)>>,
    cv: Condvar,
}

fn timer_thread() -> Option<&'static TimerThread> {
    static T: OnceLock<Option<&'static TimerThread>> = OnceLock::new();
    *T.get_or_init(|| {
        let t: &'static TimerThread = Box::leak(Box::new(TimerThread {
            queue: Mutex::new(Vec::new()),
            cv: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("udm-flakey-timer".into())
            .spawn(move || t.run())
            .ok()
            .map(|_| t)
    })
}

impl TimerThread {
    fn run(&self) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let now = Instant::now();
            if let Some(i) = q.iter().position(|(d, _)| *d <= now) {
                let (_, f) = q.swap_remove(i);
                drop(q);
                f();
                q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                continue;
            }
            let wait = q
                .iter()
                .map(|(d, _)| d.saturating_duration_since(now))
                .min()
                .unwrap_or(Duration::from_secs(3600));
            q = match self.cv.wait_timeout(q, wait) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl MonotonicClock {
    /// A clock starting now.
    pub fn new() -> MonotonicClock {
        MonotonicClock(Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }

    fn at(&self, ms: u64, f: Timer) {
        // Without a timer thread the gate stays shut and every bio goes
        // through the map, which reads the clock: slower, still right.
        if let Some(t) = timer_thread() {
            let due = self.0 + Duration::from_millis(ms);
            t.queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((due, f));
            t.cv.notify_one();
        }
    }
}

/// A clock that moves only when told: for tests of the intervals.
#[derive(Default)]
pub struct ManualClock {
    now: AtomicU64,
    timers: Mutex<Vec<(u64, Timer)>>,
}

impl ManualClock {
    /// A clock at 0.
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves the clock forward by `ms` milliseconds and runs the timers
    /// that fall due.
    pub fn advance_ms(&self, ms: u64) {
        let now = self.now.fetch_add(ms, Ordering::SeqCst) + ms;
        let due: Vec<Timer> = {
            let mut t = self.timers.lock().unwrap_or_else(|p| p.into_inner());
            let (due, keep): (Vec<_>, Vec<_>) = t.drain(..).partition(|(d, _)| *d <= now);
            *t = keep;
            due.into_iter().map(|(_, f)| f).collect()
        };
        for f in due {
            f();
        }
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    fn at(&self, ms: u64, f: Timer) {
        if ms <= self.now_ms() {
            return f();
        }
        self.timers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((ms, f));
    }
}

const ERROR_READS: u8 = 1;
const DROP_WRITES: u8 = 2;
const ERROR_WRITES: u8 = 4;

/// `corrupt_bio_byte`'s arguments.
#[derive(Clone, Copy)]
struct Corrupt {
    /// Byte offset (the argument minus one).
    byte: u32,
    write: bool,
    value: u8,
    flags: u8,
}

struct Flakey {
    devs: [DevArea; 1],
    up: u32,
    down: u32,
    flags: u8,
    corrupt: Option<Corrupt>,
    /// Raw `corrupt_bio_byte` flags argument, for the table line.
    corrupt_flags_arg: u32,
    random_read: u32,
    random_write: u32,
    clock: Arc<dyn Clock>,
    /// Clock reading at construction: the cycle's origin.
    t0: u64,
    /// Clock reading until which the device is known to be up: the map
    /// compares against it and computes the cycle only past it.
    up_until: AtomicU64,
    /// The fast path's [`Target::remap_gate`]: set while up, so that the
    /// core remaps by the offset without calling `map`; cleared by a clock
    /// timer at `up_until` (and so within the timer's latency of it).
    pass: Arc<AtomicBool>,
    /// xorshift state for the random features.
    rng: AtomicU64,
}

fn flakey_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    ctr_with_clock(ctx, argv, Arc::new(MonotonicClock::new()))
}

fn bad(msg: String) -> Error {
    Error::invalid(format!("flakey: {msg}"))
}

fn parse_u32(what: &str, s: &str, max: u32) -> Result<u32, Error> {
    match s.parse::<u32>() {
        Ok(v) if v <= max => Ok(v),
        _ => Err(bad(format!("invalid {what} '{s}': expected 0 to {max}"))),
    }
}

/// Builds a flakey target (the arguments of [`FLAKEY`]) reading time from
/// `clock`: what tests register under the name `flakey` to drive the
/// intervals without sleeping.
pub fn ctr_with_clock(
    ctx: &CtrCtx<'_>,
    argv: &[&str],
    clock: Arc<dyn Clock>,
) -> Result<Box<dyn Target>, Error> {
    let [dev, offset, up, down, rest @ ..] = argv else {
        return Err(bad(format!("expected {} arguments", FLAKEY.usage)));
    };
    let start = parse_sector("device sector", offset).map_err(|e| e.context("flakey"))?;
    let up = parse_u32("up interval", up, u32::MAX)?;
    let down = parse_u32("down interval", down, u32::MAX)?;
    match up.checked_add(down) {
        Some(0) => return Err(bad("total (up + down) interval is zero".into())),
        None => return Err(bad("interval overflow: up + down exceeds 2^32-1".into())),
        Some(_) => {}
    }
    let mut f = Flakey {
        devs: [DevArea {
            dev: ctx.get_device(dev).map_err(|e| e.context("flakey"))?,
            start,
            len: ctx.len,
        }],
        up,
        down,
        flags: 0,
        corrupt: None,
        corrupt_flags_arg: 0,
        random_read: 0,
        random_write: 0,
        t0: clock.now_ms(),
        clock,
        up_until: AtomicU64::new(0),
        pass: Arc::new(AtomicBool::new(false)),
        rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
    };
    parse_features(&mut f, rest)?;
    f.up_until = AtomicU64::new(f.t0 + up as u64 * 1000);
    if up > 0 {
        f.open_gate(f.t0 + up as u64 * 1000);
    }
    Ok(Box::new(f))
}

fn parse_features(f: &mut Flakey, args: &[&str]) -> Result<(), Error> {
    let Some((n, args)) = args.split_first() else {
        // No features: errors both ways while down.
        f.flags = ERROR_READS | ERROR_WRITES;
        return Ok(());
    };
    let n = parse_u32("number of feature arguments", n, 7)? as usize;
    if n != args.len() {
        return Err(bad(format!(
            "{n} feature arguments announced, {} given",
            args.len()
        )));
    }
    let mut it = args.iter();
    while let Some(&name) = it.next() {
        let mut next = |what: &str| {
            it.next()
                .copied()
                .ok_or_else(|| bad(format!("feature {name} requires {what}")))
        };
        let flag = match name.to_ascii_lowercase().as_str() {
            "error_reads" => ERROR_READS,
            "drop_writes" => DROP_WRITES,
            "error_writes" => ERROR_WRITES,
            "corrupt_bio_byte" => {
                let nth = parse_u32("corrupt bio byte", next("<Nth_byte>")?, u32::MAX)?;
                if nth == 0 {
                    return Err(bad("invalid corrupt bio byte '0': counts from 1".into()));
                }
                let write = match next("<direction>")? {
                    d if d.eq_ignore_ascii_case("w") => true,
                    d if d.eq_ignore_ascii_case("r") => false,
                    d => return Err(bad(format!("invalid corrupt bio direction '{d}' (r or w)"))),
                };
                let value = parse_u32("corrupt value", next("<value>")?, 255)? as u8;
                let flags = parse_u32("corrupt bio flags", next("<flags>")?, u32::MAX)?;
                f.corrupt_flags_arg = flags;
                f.corrupt = Some(Corrupt {
                    byte: nth - 1,
                    write,
                    value,
                    flags: (flags & 0xff) as u8,
                });
                continue;
            }
            "random_read_corrupt" => {
                f.random_read = parse_u32("random read corrupt", next("<p>")?, PROBABILITY_BASE)?;
                continue;
            }
            "random_write_corrupt" => {
                f.random_write = parse_u32("random write corrupt", next("<p>")?, PROBABILITY_BASE)?;
                continue;
            }
            other => return Err(bad(format!("unrecognised feature '{other}'"))),
        };
        if f.flags & flag != 0 {
            return Err(bad(format!("feature {name} duplicated")));
        }
        f.flags |= flag;
    }
    let corrupts_writes = f.corrupt.is_some_and(|c| c.write) || f.random_write > 0;
    if f.flags & DROP_WRITES != 0 && f.flags & ERROR_WRITES != 0 {
        return Err(bad("drop_writes conflicts with error_writes".into()));
    }
    if f.flags & (DROP_WRITES | ERROR_WRITES) != 0 && corrupts_writes {
        return Err(bad(
            "drop_writes and error_writes are incompatible with random_write_corrupt or corrupt_bio_byte w"
                .into(),
        ));
    }
    if f.flags == 0 && f.corrupt.is_none() && f.random_read == 0 && f.random_write == 0 {
        f.flags = ERROR_READS | ERROR_WRITES;
    }
    Ok(())
}

impl Flakey {
    /// Whether the device is down at clock reading `now`; when up, moves
    /// `up_until` to the end of this up interval.
    #[cold]
    fn is_down(&self, now: u64) -> bool {
        let secs = now.saturating_sub(self.t0) / 1000;
        let cycle = self.up as u64 + self.down as u64;
        let pos = secs % cycle;
        if pos < self.up as u64 {
            let end = self.t0 + (secs - pos + self.up as u64) * 1000;
            if self.up_until.swap(end, Ordering::Relaxed) != end {
                self.open_gate(end);
            }
            return false;
        }
        true
    }

    /// Lets the fast path remap until clock reading `until`, when a timer
    /// shuts the gate again.
    fn open_gate(&self, until: u64) {
        self.pass.store(true, Ordering::Release);
        let gate = Arc::downgrade(&self.pass);
        self.clock.at(
            until,
            Box::new(move || {
                if let Some(g) = gate.upgrade() {
                    g.store(false, Ordering::Release);
                }
            }),
        );
    }

    /// A random number below `PROBABILITY_BASE`-sized ranges and offsets.
    fn random(&self) -> u64 {
        // xorshift64*: a shared state updated racily is fine for fault
        // injection (a lost update only repeats a number).
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.store(x, Ordering::Relaxed);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn chance(&self, p: u32) -> bool {
        p > 0 && ((self.random() >> 16) % PROBABILITY_BASE as u64) < p as u64
    }

    fn flags_match(c: &Corrupt, bio: &Bio) -> bool {
        bio.flags.bits() & c.flags == c.flags
    }

    /// The map while not known to be up: dm-flakey's down state.
    #[cold]
    fn map_down(&self, bio: BioPtr, now: u64, ctx: &MapCtx<'_>) -> Map {
        if !self.is_down(now) {
            return Map::Remapped(bio, 0);
        }
        if bio.op == Op::Read {
            if self.flags & ERROR_READS != 0 {
                return Map::Kill(bio, Status::IoErr);
            }
            // Corrupted (or not) as it completes: end_io.
            return Map::Remapped(bio, 0);
        }
        if self.flags & DROP_WRITES != 0 {
            return Map::Kill(bio, Status::Ok);
        }
        if self.flags & ERROR_WRITES != 0 {
            return Map::Kill(bio, Status::IoErr);
        }
        if bio.op != Op::Write || bio.is_empty() {
            return Map::Remapped(bio, 0);
        }
        let fixed = self
            .corrupt
            .filter(|c| c.write && Flakey::flags_match(c, &bio));
        let random = self.chance(self.random_write);
        if fixed.is_none() && !random {
            return Map::Remapped(bio, 0);
        }
        let mut buf = vec![0u8; bio.len() as usize].into_boxed_slice();
        bio.copy_out(0, &mut buf);
        if let Some(c) = fixed {
            if let Some(b) = buf.get_mut(c.byte as usize) {
                *b = c.value;
            }
        }
        if random {
            let r = self.random();
            let i = (r % buf.len() as u64) as usize;
            buf[i] = (r >> 56) as u8;
        }
        submit_copy(bio, buf, ctx);
        Map::Submitted
    }

    /// Corrupts a read that completed while down, as the features ask.
    fn corrupt_read(&self, bio: &mut Bio) {
        if let Some(c) = self
            .corrupt
            .filter(|c| !c.write && Flakey::flags_match(c, bio))
        {
            if (c.byte as u64) < bio.len() as u64 {
                bio.copy_in(c.byte as usize, &[c.value]);
            }
        }
        if self.chance(self.random_read) && !bio.is_empty() {
            let r = self.random();
            let i = (r % bio.len() as u64) as usize;
            bio.copy_in(i, &[(r >> 56) as u8]);
        }
    }
}

/// A corrupted write in flight: the caller's bio and the copy that goes down.
struct CopyWrite {
    orig: *mut Bio,
    _buf: Box<[u8]>,
}

/// Sends a copy of `bio`'s write, with data `buf`, to device 0; `bio`
/// completes with the copy's status.
fn submit_copy(bio: BioPtr, mut buf: Box<[u8]>, ctx: &MapCtx<'_>) {
    let mut c = bio.alloc_clone();
    c.sector = bio.sector;
    c.flags.remove(BioFlags::PREFLUSH);
    let (ptr, len) = (buf.as_mut_ptr(), buf.len());
    // SAFETY: `buf` moves into the CopyWrite below, which lives until the
    // copy's end_io runs: the segment stays valid and unaliased until then.
    unsafe { c.add_seg(ptr, len) };
    let job = Box::new(CopyWrite {
        orig: bio.into_raw(),
        _buf: buf,
    });
    c.set_end_io(copy_done, Box::into_raw(job).cast());
    match ctx.devs.first() {
        Some(ch) => ch.submit(c),
        None => c.complete(Status::IoErr),
    }
}

fn copy_done(c: BioPtr) {
    // SAFETY: `submit_copy` set private to a leaked Box<CopyWrite>, taken
    // back here exactly once (the copy completes once).
    let job = unsafe { Box::from_raw(c.private() as *mut CopyWrite) };
    let status = c.status();
    drop(c);
    // SAFETY: `orig` came from into_raw in submit_copy and was not wrapped since.
    let orig = unsafe { BioPtr::from_raw(job.orig) };
    orig.complete(status);
}

impl Target for Flakey {
    #[inline]
    fn map(&self, mut bio: BioPtr, ctx: &MapCtx<'_>) -> Map {
        bio.sector += self.devs[0].start;
        let now = self.clock.now_ms();
        if now < self.up_until.load(Ordering::Relaxed) {
            return Map::Remapped(bio, 0);
        }
        self.map_down(bio, now, ctx)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn no_clone(&self) -> bool {
        true
    }

    fn remap_offset(&self) -> Option<u64> {
        Some(self.devs[0].start)
    }

    fn remap_gate(&self) -> Option<&AtomicBool> {
        Some(&self.pass)
    }

    fn wants_end_io(&self) -> EndIoWhen {
        let reads = self.corrupt.is_some_and(|c| !c.write) || self.random_read > 0;
        if reads {
            EndIoWhen::Always
        } else {
            EndIoWhen::Never
        }
    }

    fn end_io(&self, bio: &mut Bio, _dev: usize) {
        if bio.op != Op::Read || !bio.status().is_ok() {
            return;
        }
        let now = self.clock.now_ms();
        if now >= self.up_until.load(Ordering::Relaxed) && self.is_down(now) {
            self.corrupt_read(bio);
        }
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        if ty == StatusType::Info {
            return;
        }
        let d = &self.devs[0];
        let mut feats: Vec<String> = Vec::new();
        // As dm prints them: the default (no features) prints none.
        let default = self.flags == ERROR_READS | ERROR_WRITES
            && self.corrupt.is_none()
            && self.random_read == 0
            && self.random_write == 0;
        if !default {
            if self.flags & DROP_WRITES != 0 {
                feats.push("drop_writes".into());
            } else if self.flags & ERROR_WRITES != 0 {
                feats.push("error_writes".into());
            }
            if self.flags & ERROR_READS != 0 {
                feats.push("error_reads".into());
            }
            if let Some(c) = self.corrupt {
                feats.push(format!(
                    "corrupt_bio_byte {} {} {} {}",
                    c.byte + 1,
                    if c.write { 'w' } else { 'r' },
                    c.value,
                    self.corrupt_flags_arg
                ));
            }
            if self.random_read > 0 {
                feats.push(format!("random_read_corrupt {}", self.random_read));
            }
            if self.random_write > 0 {
                feats.push(format!("random_write_corrupt {}", self.random_write));
            }
        }
        let words: usize = feats.iter().map(|f| f.split(' ').count()).sum();
        out.push_str(&format!(
            "{} {} {} {} {}",
            d.dev.name(),
            d.start,
            self.up,
            self.down,
            words
        ));
        for f in feats {
            out.push(' ');
            out.push_str(&f);
        }
    }
}
