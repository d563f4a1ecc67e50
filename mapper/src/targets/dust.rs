//! `dust`: a device with bad blocks named at run time (dm-dust, as in Linux
//! 6.12).
//!
//! Table line: `<start> <length> dust <dev> <offset> <blksz>`
//! - `dev`, `offset`: where the range maps, as `linear`;
//! - `blksz`: the size in bytes of the blocks that messages name (a power
//!   of two, at least 512). I/O is split at block boundaries.
//!
//! Block numbers count `blksz` blocks from sector 0 of `dev` (dm-dust
//! numbers the remapped sector; with offset 0 that is the target's own).
//! While enabled, a read of a bad block fails with EIO; a write to it
//! succeeds and removes it from the list, unless it was added with a write
//! failure count, in which case that many writes fail first. Disabled (the
//! initial state), every I/O passes.
//!
//! Messages (`udm message DEV 0 ...`): `addbadblock <block> [<wr_fail_cnt>]`,
//! `removebadblock <block>`, `queryblock <block>`, `countbadblocks`,
//! `listbadblocks`, `clearbadblocks`, `enable`, `disable`, `quiet`, with
//! dm-dust's replies.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use udm_core::{BioPtr, Error, Op, Status};

use crate::target::{parse_sector, CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `dust` target type.
pub const DUST: TargetType = TargetType {
    name: "dust",
    version: [1, 0, 0],
    summary: "fails reads of bad blocks named by messages, until they are written",
    usage: "<dev> <offset> <blksz>",
    min_args: 3,
    max_args: Some(3),
    splits: true,
    exclusive_args: &[],
    ctr: dust_ctr,
};

struct Dust {
    devs: [DevArea; 1],
    blksz: u32,
    /// log2 of the block size in sectors.
    shift: u32,
    /// Bad blocks, each with the writes that must still fail.
    bad: Mutex<BTreeMap<u64, u8>>,
    /// Read failures on (the `enable` message).
    enabled: AtomicBool,
    /// Log lines off (`quiet`).
    quiet: AtomicBool,
    /// Enabled and some block is bad: the one word the map reads when
    /// nothing is to fail. Changed under `bad`'s lock.
    armed: AtomicBool,
    /// `!armed`: the fast path's [`Target::remap_gate`]. While set, the
    /// core remaps by the offset without calling `map`.
    pass: AtomicBool,
}

fn bad_arg(msg: String) -> Error {
    Error::invalid(format!("dust: {msg}"))
}

fn dust_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    // Three arguments: the core checked the count (DUST.max_args).
    let (dev, offset, blksz) = (argv[0], argv[1], argv[2]);
    let start = parse_sector("device offset sector", offset).map_err(|e| e.context("dust"))?;
    let size: u32 = blksz
        .parse()
        .map_err(|_| bad_arg(format!("invalid block size '{blksz}': expected bytes")))?;
    if size < 512 {
        return Err(bad_arg(format!(
            "invalid block size {size}: must be at least 512"
        )));
    }
    if !size.is_power_of_two() {
        return Err(bad_arg(format!(
            "invalid block size {size}: must be a power of 2"
        )));
    }
    let dev = ctx.get_device(dev).map_err(|e| e.context("dust"))?;
    Ok(Box::new(Dust {
        devs: [DevArea {
            dev,
            start,
            len: ctx.len,
        }],
        blksz: size,
        shift: (size >> 9).trailing_zeros(),
        bad: Mutex::new(BTreeMap::new()),
        enabled: AtomicBool::new(false),
        quiet: AtomicBool::new(false),
        armed: AtomicBool::new(false),
        pass: AtomicBool::new(true),
    }))
}

impl Dust {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, u8>> {
        self.bad.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Recomputes `armed` (with `bad` locked).
    fn rearm(&self, bad: &BTreeMap<u64, u8>) {
        let armed = self.enabled.load(Ordering::Relaxed) && !bad.is_empty();
        self.armed.store(armed, Ordering::Release);
        self.pass.store(!armed, Ordering::Release);
    }

    /// The map with bad blocks to look at. The core split the bio at block
    /// boundaries, so it lies in one block.
    #[cold]
    fn map_armed(&self, bio: BioPtr) -> Map {
        let block = bio.sector >> self.shift;
        let mut bad = self.lock();
        if bio.op == Op::Read {
            return if bad.contains_key(&block) {
                Map::Kill(bio, Status::IoErr)
            } else {
                Map::Remapped(bio, 0)
            };
        }
        if let Some(n) = bad.get_mut(&block) {
            if *n > 0 {
                *n -= 1;
                return Map::Kill(bio, Status::IoErr);
            }
            bad.remove(&block);
            self.rearm(&bad);
            if !self.quiet.load(Ordering::Relaxed) {
                tracing::info!("dust: block {block} removed from badblocklist by write");
            }
        }
        Map::Remapped(bio, 0)
    }

    fn parse_block(&self, s: &str) -> Result<u64, Error> {
        s.parse::<u64>()
            .map_err(|_| bad_arg(format!("invalid block '{s}': expected a block number")))
    }

    fn info(&self, msg: String) {
        if !self.quiet.load(Ordering::Relaxed) {
            tracing::info!("dust: {msg}");
        }
    }
}

impl Target for Dust {
    #[inline]
    fn map(&self, mut bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        bio.sector += self.devs[0].start;
        if !self.armed.load(Ordering::Relaxed) {
            return Map::Remapped(bio, 0);
        }
        self.map_armed(bio)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn no_clone(&self) -> bool {
        true
    }

    fn max_io_len(&self) -> u64 {
        1 << self.shift
    }

    fn remap_offset(&self) -> Option<u64> {
        Some(self.devs[0].start)
    }

    fn remap_gate(&self) -> Option<&AtomicBool> {
        Some(&self.pass)
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        let d = &self.devs[0];
        match ty {
            StatusType::Info => out.push_str(&format!(
                "{} {} {}",
                d.dev.name(),
                if self.enabled.load(Ordering::Relaxed) {
                    "fail_read_on_bad_block"
                } else {
                    "bypass"
                },
                if self.quiet.load(Ordering::Relaxed) {
                    "quiet"
                } else {
                    "verbose"
                }
            )),
            StatusType::Table => {
                out.push_str(&format!("{} {} {}", d.dev.name(), d.start, self.blksz))
            }
        }
    }

    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        let mut bad = self.lock();
        let reply = match argv {
            ["countbadblocks"] => format!("countbadblocks: {} badblock(s) found", bad.len()),
            ["clearbadblocks"] => {
                let r = if bad.is_empty() {
                    "dust_clear_badblocks: no badblocks found"
                } else {
                    "dust_clear_badblocks: badblocks cleared"
                };
                bad.clear();
                r.to_string()
            }
            ["listbadblocks"] => {
                if bad.is_empty() {
                    "No blocks in badblocklist".to_string()
                } else {
                    let v: Vec<String> = bad.keys().map(u64::to_string).collect();
                    v.join("\n")
                }
            }
            ["enable"] => {
                self.enabled.store(true, Ordering::Relaxed);
                self.info("enabling read failures on bad sectors".into());
                String::new()
            }
            ["disable"] => {
                self.enabled.store(false, Ordering::Relaxed);
                self.info("disabling read failures on bad sectors".into());
                String::new()
            }
            ["quiet"] => {
                self.quiet.fetch_xor(true, Ordering::Relaxed);
                String::new()
            }
            ["addbadblock", b, rest @ ..] if rest.len() <= 1 => {
                let block = self.parse_block(b)?;
                let cnt = match rest {
                    [c] => match c.parse::<u8>() {
                        Ok(c) => c,
                        Err(_) => {
                            return Err(bad_arg(format!(
                                "invalid write fail count '{c}': expected 0 to 255"
                            )))
                        }
                    },
                    _ => 0,
                };
                let blocks = (self.devs[0].start + self.devs[0].len) >> self.shift;
                if block > blocks {
                    return Err(bad_arg(format!(
                        "block {block} out of range (the device has {blocks} blocks)"
                    )));
                }
                if bad.contains_key(&block) {
                    return Err(bad_arg(format!(
                        "dust_add_block: block {block} already in badblocklist"
                    )));
                }
                bad.insert(block, cnt);
                self.info(format!("dust_add_block: badblock added at block {block}"));
                String::new()
            }
            ["removebadblock", b] => {
                let block = self.parse_block(b)?;
                if bad.remove(&block).is_none() {
                    return Err(bad_arg(format!(
                        "dust_remove_block: block {block} not found in badblocklist"
                    )));
                }
                self.info(format!(
                    "dust_remove_block: badblock removed at block {block}"
                ));
                String::new()
            }
            ["queryblock", b] => {
                let block = self.parse_block(b)?;
                let found = if bad.contains_key(&block) { "" } else { "not " };
                format!("dust_query_block: block {block} {found}found in badblocklist")
            }
            _ => {
                return Err(bad_arg(format!(
                    "unknown message '{}' (known: addbadblock <block> [<wr_fail_cnt>], \
                     removebadblock <block>, queryblock <block>, countbadblocks, \
                     listbadblocks, clearbadblocks, enable, disable, quiet)",
                    argv.join(" ")
                )))
            }
        };
        self.rearm(&bad);
        Ok(reply)
    }
}
