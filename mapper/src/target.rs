//! The target contract: dm's `struct target_type`.
//!
//! A target is constructed from its table-line arguments ([`TargetType::ctr`])
//! and then maps bios. The core owns everything else: it finds the target for
//! a sector, makes the sector relative to the target's start before `map`,
//! splits I/O at target boundaries and at [`Target::max_io_len`], fans
//! flushes out to every device of [`Target::devices`], and stacks limits and
//! capabilities. So a simple target's `map` is a couple of lines.

use std::rc::Rc;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use udm_core::{
    push_extent, Alloc, Bio, BioPtr, BlockDevice, Caps, Channel, Error, Extent, Limits, Reactor,
    Status,
};

/// What [`Target::map`] did with the bio (dm's `DM_MAPIO_*`).
pub enum Map {
    /// The bio now addresses device `.1` of [`Target::devices`] (its sector
    /// rewritten to that device's); the core submits it there.
    Remapped(BioPtr, usize),
    /// The target took the bio and will complete it.
    Submitted,
    /// Complete the bio with this error.
    Kill(BioPtr, Status),
    /// Try the bio again later (e.g. the target is out of a resource).
    Requeue(BioPtr),
}

/// What `map` may use besides the bio: this reactor's channels to the
/// target's devices, in [`Target::devices`] order, for targets that submit
/// I/O themselves.
pub struct MapCtx<'a> {
    /// Channels to the target's devices.
    pub devs: &'a [Rc<dyn Channel>],
}

/// When the core calls a target's end_io.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndIoWhen {
    /// Never (the common case: nothing to do on completion).
    Never,
    /// Only for bios that failed (error accounting).
    OnError,
    /// For every bio.
    Always,
}

impl EndIoWhen {
    /// The wider of two: what a table of both targets must watch for.
    pub fn max(self, other: EndIoWhen) -> EndIoWhen {
        match (self, other) {
            (EndIoWhen::Always, _) | (_, EndIoWhen::Always) => EndIoWhen::Always,
            (EndIoWhen::OnError, _) | (_, EndIoWhen::OnError) => EndIoWhen::OnError,
            _ => EndIoWhen::Never,
        }
    }

    /// Whether a bio completing with `ok` needs the end_io.
    #[inline]
    pub fn applies(self, ok: bool) -> bool {
        match self {
            EndIoWhen::Never => false,
            EndIoWhen::OnError => !ok,
            EndIoWhen::Always => true,
        }
    }
}

/// Which status line to produce (dm's `status_type_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusType {
    /// Runtime state and counters (`dmsetup status`).
    Info,
    /// The arguments that would construct the target again (`dmsetup table`).
    Table,
}

/// One device a target uses and the area of it (dm's `iterate_devices`).
#[derive(Clone)]
pub struct DevArea {
    /// The device.
    pub dev: Arc<dyn BlockDevice>,
    /// First sector used.
    pub start: u64,
    /// Sectors used.
    pub len: u64,
}

/// A constructed target. Shared by every reactor.
pub trait Target: Send + Sync {
    /// Maps `bio`, whose sector is relative to the target's start and which
    /// lies inside the target and inside [`Target::max_io_len`]'s boundaries.
    fn map(&self, bio: BioPtr, ctx: &MapCtx<'_>) -> Map;

    /// The devices this target sends I/O to, with the areas it uses. Flushes
    /// go to each; limits and capabilities stack over them.
    fn devices(&self) -> &[DevArea];

    /// Appends the target's status line of type `ty` (without start, length and
    /// type name, which the core prints) to `out`.
    fn status(&self, ty: StatusType, out: &mut String);

    /// Appends the table line's arguments as [`Target::status`] of
    /// [`StatusType::Table`] does, but with the secrets it hides shown (a
    /// crypt key; `dmsetup table --showkeys`). Only a target that holds
    /// secrets overrides it.
    fn table_with_secrets(&self, out: &mut String) {
        self.status(StatusType::Table, out)
    }

    /// When [`Target::end_io`] must run.
    fn wants_end_io(&self) -> EndIoWhen {
        EndIoWhen::Never
    }

    /// Sees a bio this target mapped as it completes (as
    /// [`Target::wants_end_io`] asks), with the index in [`Target::devices`]
    /// it was remapped to (0 if the target completed it itself).
    fn end_io(&self, _bio: &mut Bio, _dev: usize) {}

    /// Events the target raised so far (dm's `dm_table_event`), e.g. a
    /// writecache's first I/O error: the control plane adds them to the
    /// device's event counter, which `udm wait` watches. Read off the I/O
    /// path only.
    fn events(&self) -> u64 {
        0
    }

    /// What the `sectors` from target-relative sector `rel` on hold, appended
    /// to `out` as [`BlockDevice::block_status`] does (a non-empty prefix of
    /// the range, extents merged with [`push_extent`], bounded work): the
    /// device's [`BlockDevice::block_status`] walks its table and asks each
    /// target for its part. The range lies inside the target. Called off
    /// the I/O path (an NBD BLOCK_STATUS, on a reactor), so a target that
    /// would have to wait for I/O to answer keeps the default, which reports
    /// everything as data (always correct).
    fn block_status(&self, rel: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let _ = rel;
        push_extent(
            out,
            Extent {
                sectors,
                alloc: Alloc::Data,
            },
        );
        Ok(())
    }

    /// Handles a `udm message` sent to the target; returns its reply.
    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        Err(Error::invalid(format!(
            "target does not accept messages (got '{}')",
            argv.join(" ")
        )))
    }

    /// I/O is split so that no bio crosses a multiple of this many sectors
    /// (relative to the target's start); 0 for no limit.
    fn max_io_len(&self) -> u64 {
        0
    }

    /// Bytes of per-I/O data the target needs in each clone it maps (at most
    /// [`udm_core::bio::PER_IO_DATA`]). Targets that need any take the clone path.
    fn per_io_data_size(&self) -> usize {
        0
    }

    /// Opts in to the no-clone fast path: `map` only remaps (or completes)
    /// the bio, needs no per-I/O data, and does not care whether it sees the
    /// caller's bio or a clone.
    fn no_clone(&self) -> bool {
        false
    }

    /// For a target whose `map` only adds a constant to the (target-relative)
    /// sector and remaps to device 0, as `linear` does: that constant. The
    /// fast path then does the remap itself and skips the call to `map`.
    /// Only meaningful with [`Target::no_clone`].
    fn remap_offset(&self) -> Option<u64> {
        None
    }

    /// With [`Target::remap_offset`]: a flag that says when the offset
    /// remap holds. While it is set the fast path remaps by the offset
    /// without calling the target; while it is clear it calls `map`. For a
    /// target that is a pure remap only in some states (dust with no bad
    /// blocks), so that its pass-through state stays on the no-clone fast
    /// path (a one-target table's gated plan, or the general plan, checks
    /// the flag; linear's own plan checks nothing).
    /// The target keeps the flag true exactly while `map` would only add the
    /// offset to any bio of the target, whatever its
    /// [`Target::max_io_len`] (which then matters only while it is clear).
    fn remap_gate(&self) -> Option<&AtomicBool> {
        None
    }

    /// For a target that maps whole blocks through a cache of its own that
    /// reactors read without a lock (thin): where that cache is, so that a
    /// one-target table's plan remaps an already mapped block itself, with
    /// no call to `map` and no end_io (see [`BlockMap`]). Only meaningful
    /// with [`Target::no_clone`].
    fn block_map(&self) -> Option<BlockMap> {
        None
    }

    /// For a target whose `map` stripes as dm's `striped` does with
    /// power-of-two geometry: chunk `c` (of `1 << chunk_shift` sectors) of
    /// the target goes to device `c & (n - 1)`, at chunk `c >> stripe_shift`
    /// of that device's area (from its [`DevArea::start`]), where
    /// n = `1 << stripe_shift` is the number of [`Target::devices`]: the
    /// shifts. When every device's area starts at the same sector, the fast
    /// path then maps with shifts and masks itself and calls nothing
    /// (otherwise it calls [`Target::map_sector`], if the target has it).
    /// Only meaningful with [`Target::no_clone`].
    fn stripe_shifts(&self) -> Option<(u32, u32)> {
        None
    }

    /// Opts in to [`Target::map_sector`]: `map` only moves the bio to
    /// another sector of one of its devices, as `striped` does. Only
    /// meaningful with [`Target::no_clone`].
    fn sector_map(&self) -> bool {
        false
    }

    /// For a [`Target::sector_map`] target: where `map` sends the
    /// target-relative sector `rel`, as (device index, sector on that
    /// device); dm's `stripe_map_sector`. The fast path calls this instead
    /// of `map`, and submits to the device itself.
    fn map_sector(&self, rel: u64) -> (usize, u64) {
        (0, rel)
    }

    /// Capabilities, given those stacked over [`Target::devices`].
    fn caps(&self, stacked: Caps) -> Caps {
        stacked
    }

    /// Adjusts the stacked limits (dm's `io_hints`), e.g. a stripe's io_opt.
    fn io_hints(&self, _limits: &mut Limits) {}

    /// Called on a control thread when a suspend begins, before it holds
    /// new I/O and waits for the I/O in flight (dm's `presuspend`): where a
    /// target that keeps bios back (delay) lets them go, so that the drain
    /// does not wait for them.
    fn presuspend(&self) {}

    /// Called on a control thread when the device resumes with this
    /// target's table live (dm's `resume`): the match of
    /// [`Target::presuspend`].
    fn resume(&self) {}

    /// Called on a control thread once a suspend has drained the device's
    /// I/O (dm's `postsuspend`), e.g. for a cache to commit or write back.
    /// An error fails the suspend (the device stays suspended).
    fn postsuspend(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Called on `reactor`'s thread when a table holding this target is
    /// opened there (a device's channel opened on the reactor, or a new
    /// table swapped in on it), before any bio is mapped through it there:
    /// where a target sets up per-reactor state (a timer wheel, a queue).
    fn reactor_open(&self, _reactor: &Reactor) {}

    /// The match of [`Target::reactor_open`]: the table is closed on the
    /// reactor whose [`Reactor::id`] is `reactor_id` (an old table once its
    /// I/O there has finished after a reload, or the channel dropped). No
    /// bio of the table is in flight there any more. Called on that
    /// reactor's thread, possibly while the reactor itself is being
    /// dropped, so it gets the reactor's id, not the reactor.
    fn reactor_close(&self, _reactor_id: usize) {}
}

/// A block-mapped target's cache as the core's plan reads it
/// ([`Target::block_map`]): thin's per-volume mapping cache and in-flight
/// counts. The plan takes a read, or a write without FUA, that lies inside
/// one block the cache says is mapped (and, for a write, not shared); it
/// counts the bio in flight, remaps it to the data device (the target's
/// device 1 or 2, by the count's epoch) and drops the count when it
/// completes: what the target's `map` and `end_io` do for such a bio.
/// Everything else goes to `map`.
#[derive(Clone, Copy)]
pub struct BlockMap {
    /// The cache; the target that returned this owns it.
    pub(crate) vol: *const crate::targets::thin::Vol,
    /// log2 of the block size in sectors.
    pub(crate) shift: u32,
    /// Data blocks inside the data device's area (the table checked that
    /// area against the device when it was built): a cache entry past it
    /// (a pool grown since) goes to `map`.
    pub(crate) data_blocks: u64,
}

/// Resolves a device named in a table: another udm device, or a path.
pub trait DeviceResolver {
    /// The device called `name`, or an error naming it.
    fn resolve(&self, name: &str) -> Result<Arc<dyn BlockDevice>, Error>;
}

impl<F> DeviceResolver for F
where
    F: Fn(&str) -> Result<Arc<dyn BlockDevice>, Error>,
{
    fn resolve(&self, name: &str) -> Result<Arc<dyn BlockDevice>, Error> {
        self(name)
    }
}

/// What a constructor gets besides its arguments.
pub struct CtrCtx<'a> {
    /// The target's start in the table (sectors).
    pub begin: u64,
    /// The target's length (sectors).
    pub len: u64,
    pub(crate) resolver: &'a dyn DeviceResolver,
}

impl CtrCtx<'_> {
    /// Looks up a device named in the arguments (dm's `dm_get_device`).
    pub fn get_device(&self, name: &str) -> Result<Arc<dyn BlockDevice>, Error> {
        self.resolver.resolve(name)
    }
}

/// A target constructor: arguments in, target (or an error naming the bad
/// argument) out. The core calls it only with a count of arguments its
/// [`TargetType`] admits ([`TargetType::check_args`]).
pub type Ctr = fn(&CtrCtx<'_>, &[&str]) -> Result<Box<dyn Target>, Error>;

/// A target type: what it is, what it takes, and its constructor (dm's
/// `target_type` registration). Everything but `ctr` is data, so that tools
/// can describe a target (`udm targets`) and the core and control library
/// can check a table line without constructing it.
pub struct TargetType {
    /// The name used in table lines.
    pub name: &'static str,
    /// Version, as dm reports it.
    pub version: [u32; 3],
    /// One line: what the target does.
    pub summary: &'static str,
    /// The table-line arguments after the type name, as dm documents them
    /// (e.g. `<dev> <offset>`); empty for a target that takes none.
    pub usage: &'static str,
    /// Fewest arguments a table line gives.
    pub min_args: usize,
    /// Most arguments, or `None` for no limit.
    pub max_args: Option<usize>,
    /// Whether the target may split I/O at boundaries of its own
    /// ([`Target::max_io_len`]: chunks, windows) besides target boundaries.
    pub splits: bool,
    /// Positions (0-based, among the arguments after the type name) of the
    /// arguments naming devices the target claims exclusively: no other
    /// target may use them while it does (a writecache's cache device).
    pub exclusive_args: &'static [usize],
    /// Builds a target from its arguments; the error names the bad argument.
    pub ctr: Ctr,
}

impl TargetType {
    /// Checks an argument count against `min_args`/`max_args`; the error
    /// is one line naming the target, the count given and the count (and
    /// arguments) it takes.
    pub fn check_args(&self, n: usize) -> Result<(), Error> {
        let (few, many) = (n < self.min_args, self.max_args.is_some_and(|m| n > m));
        if !few && !many {
            return Ok(());
        }
        let want = match self.max_args {
            Some(0) => "no arguments".to_string(),
            Some(m) if m == self.min_args => format!("{m}"),
            Some(m) => format!("{} to {m}", self.min_args),
            None => format!("at least {}", self.min_args),
        };
        let usage = if self.usage.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.usage)
        };
        Err(Error::invalid(format!(
            "{}: {} arguments ({n}): expected {want}{usage}",
            self.name,
            if few { "not enough" } else { "too many" },
        )))
    }
}

/// Parses a sector count or offset argument, naming it in the error.
pub fn parse_sector(what: &str, s: &str) -> Result<u64, Error> {
    s.parse::<u64>()
        .map_err(|_| Error::invalid(format!("invalid {what} '{s}': expected a sector number")))
}

/// Parses a count argument, naming it in the error.
pub fn parse_count(what: &str, s: &str) -> Result<u32, Error> {
    s.parse::<u32>()
        .map_err(|_| Error::invalid(format!("invalid {what} '{s}': expected a number")))
}
