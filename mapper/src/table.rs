//! Tables: dmsetup's `<start> <length> <type> <args…>` lines, parsed, checked
//! and built into targets, then looked up by sector.

use std::sync::Arc;

use udm_core::{
    push_extent, BlockDevice, Caps, Error, Extent, Limits, BLOCK_STATUS_MAX_EXTENTS, SECTOR_SHIFT,
};

use crate::target::{CtrCtx, DeviceResolver, EndIoWhen, StatusType, Target, TargetType};
use crate::targets;

/// One parsed table line, before construction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetSpec {
    /// First sector covered.
    pub start: u64,
    /// Sectors covered.
    pub len: u64,
    /// Target type name.
    pub ty: String,
    /// The type's arguments.
    pub args: Vec<String>,
}

/// Splits table text into lines: newline- or `;`-separated; blank lines and
/// `#` comments are skipped. Errors name the line and the bad token.
pub fn parse(text: &str) -> Result<Vec<TargetSpec>, Error> {
    let mut specs = Vec::new();
    for (i, line) in text.split(['\n', ';']).enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut tok = line.split_whitespace();
        let ctx = |m: String| Error::invalid(format!("table line {} '{}': {m}", i + 1, line));
        let (Some(start), Some(len), Some(ty)) = (tok.next(), tok.next(), tok.next()) else {
            return Err(ctx("expected <start> <length> <type> [args…]".into()));
        };
        let start = start
            .parse::<u64>()
            .map_err(|_| ctx(format!("invalid start sector '{start}'")))?;
        let len = len
            .parse::<u64>()
            .map_err(|_| ctx(format!("invalid length '{len}'")))?;
        specs.push(TargetSpec {
            start,
            len,
            ty: ty.to_string(),
            args: tok.map(str::to_string).collect(),
        });
    }
    if specs.is_empty() {
        return Err(Error::invalid("table is empty"));
    }
    Ok(specs)
}

/// `<start> <length> <type>` and the target's arguments, as one line.
fn join_line(t: &TableTarget, args: &str) -> String {
    let mut l = format!("{} {} {}", t.begin, t.len, t.ty);
    if !args.is_empty() {
        l.push(' ');
        l.push_str(args);
    }
    l
}

/// The target types udm knows, by name.
pub struct Registry {
    types: Vec<TargetType>,
}

impl Registry {
    /// The built-in targets.
    pub fn builtin() -> Registry {
        Registry {
            types: vec![
                targets::linear::LINEAR,
                targets::striped::STRIPED,
                targets::zero::ZERO,
                targets::error::ERROR,
                targets::writecache::WRITECACHE,
                targets::flakey::FLAKEY,
                targets::delay::DELAY,
                targets::dust::DUST,
                targets::log_writes::LOG_WRITES,
                targets::crypt::CRYPT,
                targets::thin::THIN_POOL,
                targets::thin::THIN,
                targets::raid::RAID,
            ],
        }
    }

    /// Adds a target type (replacing one of the same name).
    pub fn register(&mut self, t: TargetType) {
        self.types.retain(|x| x.name != t.name);
        self.types.push(t);
    }

    /// The type called `name`.
    pub fn get(&self, name: &str) -> Option<&TargetType> {
        self.types.iter().find(|t| t.name == name)
    }

    /// Names of all types.
    pub fn names(&self) -> Vec<&'static str> {
        self.types.iter().map(|t| t.name).collect()
    }

    /// All types, sorted by name.
    pub fn types(&self) -> Vec<&TargetType> {
        let mut v: Vec<&TargetType> = self.types.iter().collect();
        v.sort_by_key(|t| t.name);
        v
    }
}

/// A constructed target in a table.
pub struct TableTarget {
    /// First sector.
    pub begin: u64,
    /// Sectors.
    pub len: u64,
    /// The type name.
    pub ty: &'static str,
    /// The target.
    pub target: Arc<dyn Target>,
    /// [`Target::max_io_len`], cached.
    pub max_io_len: u64,
    /// [`Target::wants_end_io`], cached.
    pub end_io: EndIoWhen,
    /// [`Target::remap_offset`], cached.
    pub remap_offset: Option<u64>,
    /// [`Target::stripe_shifts`] and the one sector every stripe's area
    /// starts at, when the fast path may stripe the target itself (see
    /// `build`): (log2 chunk, log2 stripes, start).
    pub fast_stripes: Option<(u32, u32, u64)>,
    /// [`Target::sector_map`], cached.
    pub sector_map: bool,
    /// For each of the target's devices, its index in [`Table::devices`].
    pub dev_index: Vec<usize>,
}

/// A built table: targets sorted by sector, covering `0..sectors` with no gaps.
pub struct Table {
    /// The targets, in order.
    pub targets: Vec<TableTarget>,
    /// Every distinct device the targets use (flushes go to each).
    pub devices: Vec<Arc<dyn BlockDevice>>,
    /// Stacked limits; `sectors` is the table's size.
    pub limits: Limits,
    /// Stacked capabilities.
    pub caps: Caps,
    /// Whether every target opted in to the no-clone fast path.
    pub no_clone: bool,
}

impl Table {
    /// Parses `text` and builds it.
    pub fn from_text(
        text: &str,
        reg: &Registry,
        resolver: &dyn DeviceResolver,
    ) -> Result<Table, Error> {
        Table::build(&parse(text)?, reg, resolver)
    }

    /// Constructs every target and checks the table as dm does: contiguous
    /// from sector 0, no empty targets, device areas inside their devices,
    /// boundaries aligned to the logical block size.
    pub fn build(
        specs: &[TargetSpec],
        reg: &Registry,
        resolver: &dyn DeviceResolver,
    ) -> Result<Table, Error> {
        let mut targets = Vec::with_capacity(specs.len());
        let mut devices: Vec<Arc<dyn BlockDevice>> = Vec::new();
        let mut next = 0u64;
        for (i, s) in specs.iter().enumerate() {
            let line = |m: String| Error::invalid(format!("table line {}: {m}", i + 1));
            if s.start != next {
                return Err(line(format!(
                    "gap or overlap: target starts at {} but the previous one ends at {next}",
                    s.start
                )));
            }
            if s.len == 0 {
                return Err(line("zero-length target".into()));
            }
            let Some(end) = s.start.checked_add(s.len) else {
                return Err(line(format!(
                    "target of {} sectors from {} ends past the last sector ({})",
                    s.len,
                    s.start,
                    u64::MAX
                )));
            };
            let Some(tt) = reg.get(&s.ty) else {
                return Err(line(format!(
                    "unknown target type '{}' (known: {})",
                    s.ty,
                    reg.names().join(", ")
                )));
            };
            let ctx = CtrCtx {
                begin: s.start,
                len: s.len,
                resolver,
            };
            let args: Vec<&str> = s.args.iter().map(String::as_str).collect();
            tt.check_args(args.len())
                .map_err(|e| e.context(format!("table line {}", i + 1)))?;
            let target =
                (tt.ctr)(&ctx, &args).map_err(|e| e.context(format!("table line {}", i + 1)))?;
            if target.per_io_data_size() > udm_core::bio::PER_IO_DATA {
                return Err(line(format!(
                    "target needs {} bytes of per-I/O data; the core reserves {}",
                    target.per_io_data_size(),
                    udm_core::bio::PER_IO_DATA
                )));
            }
            let mut dev_index = Vec::new();
            for area in target.devices() {
                let size = area.dev.limits().sectors;
                if area
                    .start
                    .checked_add(area.len)
                    .is_none_or(|end| end > size)
                {
                    return Err(line(format!(
                        "device '{}' is too small: the target needs sectors {}..{}, it has {size}",
                        area.dev.name(),
                        area.start,
                        area.start.saturating_add(area.len)
                    )));
                }
                let idx = match devices.iter().position(|d| Arc::ptr_eq(d, &area.dev)) {
                    Some(i) => i,
                    None => {
                        devices.push(area.dev.clone());
                        devices.len() - 1
                    }
                };
                dev_index.push(idx);
            }
            next = end;
            targets.push(TableTarget {
                begin: s.start,
                len: s.len,
                ty: tt.name,
                max_io_len: target.max_io_len(),
                end_io: target.wants_end_io(),
                remap_offset: target.remap_offset().filter(|_| !dev_index.is_empty()),
                // Trusted only where it cannot send a bio outside the
                // target's areas: as many devices as stripes, a length of
                // whole rows, each area a stripe's width, and max_io_len
                // the chunk (the fast path's window keeps a bio in one).
                // And only with every area at one start, which the fast
                // path adds: stripes at different offsets map through the
                // target.
                fast_stripes: target.stripe_shifts().and_then(|(cs, ss)| {
                    let areas = target.devices();
                    let start = areas.first()?.start;
                    let row = 1u64.checked_shl(cs + ss).unwrap_or(0);
                    (1usize.checked_shl(ss) == Some(dev_index.len())
                        && row != 0
                        && s.len.is_multiple_of(row)
                        && areas.iter().all(|a| a.len >= s.len >> ss)
                        && areas.iter().all(|a| a.start == start)
                        && target.max_io_len() == 1 << cs)
                        .then_some((cs, ss, start))
                }),
                sector_map: target.sector_map() && !dev_index.is_empty(),
                dev_index,
                target: Arc::from(target),
            });
        }

        let mut limits = Limits::new(next);
        let mut caps = Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES | Caps::POLL;
        let mut persistent = true;
        let mut read_only = false;
        let mut merge = false;
        for t in &targets {
            let mut tcaps =
                Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES | Caps::POLL;
            for a in t.target.devices() {
                let l = a.dev.limits();
                limits.stack(&l);
                let c = a.dev.caps();
                tcaps = tcaps.intersection(c);
                persistent &= c.contains(Caps::PERSISTENT);
                read_only |= c.contains(Caps::READ_ONLY);
                merge |= c.contains(Caps::MERGE);
            }
            if t.target.devices().is_empty() {
                persistent = false;
            }
            caps = caps.intersection(t.target.caps(tcaps));
            t.target.io_hints(&mut limits);
        }
        if persistent {
            caps.insert(Caps::PERSISTENT);
        }
        if read_only {
            caps.insert(Caps::READ_ONLY);
        }
        if merge {
            caps.insert(Caps::MERGE);
        }
        let lbs_sectors = (limits.logical_block_size >> SECTOR_SHIFT) as u64;
        for (i, t) in targets.iter().enumerate() {
            if t.begin % lbs_sectors != 0 || t.len % lbs_sectors != 0 {
                return Err(Error::invalid(format!(
                    "table line {}: target {}+{} is not aligned to the logical block size ({} bytes)",
                    i + 1,
                    t.begin,
                    t.len,
                    limits.logical_block_size
                )));
            }
            if t.max_io_len % lbs_sectors != 0 {
                return Err(Error::invalid(format!(
                    "table line {}: {} sectors (chunk) is not a multiple of the logical block size ({} bytes)",
                    i + 1,
                    t.max_io_len,
                    limits.logical_block_size
                )));
            }
        }
        let no_clone = targets
            .iter()
            .all(|t| t.target.no_clone() && t.target.per_io_data_size() == 0);
        Ok(Table {
            targets,
            devices,
            limits,
            caps,
            no_clone,
        })
    }

    /// Size in sectors.
    pub fn sectors(&self) -> u64 {
        self.limits.sectors
    }

    /// Index of the target holding `sector` (which must be inside the table).
    #[inline]
    pub fn find(&self, sector: u64) -> usize {
        if self.targets.len() == 1 {
            return 0;
        }
        // The first target whose end is past `sector`.
        self.targets
            .partition_point(|t| t.begin + t.len <= sector)
            .min(self.targets.len() - 1)
    }

    /// The table as `dmsetup table` prints it, one line per target, with
    /// secrets (crypt keys) hidden: what listings, configuration dumps and
    /// logs show.
    pub fn table_lines(&self) -> Vec<String> {
        self.lines(StatusType::Table)
    }

    /// The table with its secrets shown (`dmsetup table --showkeys`): lines
    /// that construct the same targets again.
    pub fn table_lines_with_keys(&self) -> Vec<String> {
        self.targets
            .iter()
            .map(|t| {
                let mut args = String::new();
                t.target.table_with_secrets(&mut args);
                join_line(t, &args)
            })
            .collect()
    }

    /// Events raised by the table's targets ([`crate::Target::events`]).
    pub fn events(&self) -> u64 {
        self.targets.iter().map(|t| t.target.events()).sum()
    }

    /// The table's status as `dmsetup status` prints it.
    pub fn status_lines(&self) -> Vec<String> {
        self.lines(StatusType::Info)
    }

    fn lines(&self, ty: StatusType) -> Vec<String> {
        self.targets
            .iter()
            .map(|t| {
                let mut args = String::new();
                t.target.status(ty, &mut args);
                join_line(t, &args)
            })
            .collect()
    }

    /// What the table's `sectors` from `sector` on hold
    /// ([`BlockDevice::block_status`]): each target in the range is asked
    /// for its part, relative to its start, and neighbouring extents of one
    /// kind merge across target boundaries. Stops early (a prefix of the
    /// range) where a target answered only part of its piece, or once `out`
    /// holds [`BLOCK_STATUS_MAX_EXTENTS`] extents or that many targets were
    /// asked: the work of one call stays bounded whatever the range and
    /// the table. A range outside the table is an error.
    pub fn block_status(
        &self,
        sector: u64,
        sectors: u64,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        let end = sector
            .checked_add(sectors)
            .filter(|&e| e <= self.sectors() && sectors > 0)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "block status of {sectors} sectors at {sector}: outside the device ({} sectors)",
                    self.sectors()
                ))
            })?;
        let mut part = Vec::new();
        let mut pos = sector;
        let first = self.find(sector);
        for (i, t) in self.targets[first..]
            .iter()
            .take(BLOCK_STATUS_MAX_EXTENTS)
            .enumerate()
        {
            if pos >= end || (i > 0 && out.len() >= BLOCK_STATUS_MAX_EXTENTS) {
                break;
            }
            let rel = pos - t.begin;
            let want = (t.len - rel).min(end - pos);
            part.clear();
            t.target.block_status(rel, want, &mut part)?;
            // A target may answer a prefix, never more than asked.
            let mut got = 0;
            for e in &part {
                let e = Extent {
                    sectors: e.sectors.min(want - got),
                    ..*e
                };
                got += e.sectors;
                push_extent(out, e);
            }
            pos += got;
            if got < want {
                break;
            }
        }
        Ok(())
    }

    /// Sends a message to the target holding `sector` (dmsetup message's
    /// sector argument).
    pub fn message(&self, sector: u64, argv: &[&str]) -> Result<String, Error> {
        if sector >= self.sectors() {
            return Err(Error::invalid(format!(
                "message sector {sector} is beyond the device ({} sectors)",
                self.sectors()
            )));
        }
        self.targets[self.find(sector)].target.message(argv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_on_newlines_and_semicolons() {
        let s = parse("0 8 zero; 8 8 error\n16 8 linear ram0 0 # tail").unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s[1].ty, "error");
        assert_eq!(s[2].args, vec!["ram0", "0"]);
    }

    #[test]
    fn bad_lines_name_the_token() {
        let e = parse("0 x zero").unwrap_err().to_string();
        assert!(e.contains("invalid length 'x'"), "{e}");
        let e = parse("-1 8 zero").unwrap_err().to_string();
        assert!(e.contains("invalid start sector '-1'"), "{e}");
        let e = parse("0 8").unwrap_err().to_string();
        assert!(e.contains("expected <start> <length> <type>"), "{e}");
        assert!(parse(" ; \n").unwrap_err().to_string().contains("empty"));
    }

    fn no_devices(name: &str) -> Result<Arc<dyn BlockDevice>, Error> {
        Err(Error::new(
            udm_core::ErrorKind::NotFound,
            format!("no device '{name}'"),
        ))
    }

    #[test]
    fn gaps_overlaps_and_unknown_types_are_rejected() {
        let reg = Registry::builtin();
        let e = |t: &str| {
            Table::from_text(t, &reg, &no_devices)
                .err()
                .unwrap()
                .to_string()
        };
        assert!(e("0 8 zero; 16 8 zero").contains("gap or overlap"));
        assert!(e("0 8 zero; 4 8 zero").contains("gap or overlap"));
        assert!(e("8 8 zero").contains("gap or overlap"));
        assert!(e("0 0 zero").contains("zero-length"));
        assert!(e("0 8 mirror x").contains("unknown target type 'mirror'"));
        assert!(e("0 8 zero extra").contains("zero: too many arguments (1): expected no arguments"));
        assert!(e("0 8 linear ram9 0").contains("no device 'ram9'"));
        assert!(e("0 8 linear ram9").contains("linear: not enough arguments (1): expected 2"));
    }

    #[test]
    fn find_picks_the_target_holding_the_sector() {
        let reg = Registry::builtin();
        let t = Table::from_text("0 8 zero; 8 16 error; 24 8 zero", &reg, &no_devices).unwrap();
        assert_eq!(t.sectors(), 32);
        assert_eq!(t.find(0), 0);
        assert_eq!(t.find(7), 0);
        assert_eq!(t.find(8), 1);
        assert_eq!(t.find(23), 1);
        assert_eq!(t.find(24), 2);
        assert_eq!(t.find(31), 2);
        assert_eq!(t.table_lines(), vec!["0 8 zero", "8 16 error", "24 8 zero"]);
    }
}
