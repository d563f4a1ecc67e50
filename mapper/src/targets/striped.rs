//! `striped`: spreads a range over several devices in chunks (RAID 0).
//!
//! Table line:
//! `<start> <length> striped <#stripes> <chunk sectors> <dev> <offset> [<dev> <offset>]…`
//!
//! dm's rules: the length divides by the number of stripes, and each stripe's
//! width divides by the chunk size (which need not be a power of two, and
//! must be a multiple of the devices' logical block size). Chunk `c` of the
//! range lives on stripe `c % #stripes`, at chunk `c / #stripes` of that
//! stripe's area.

use std::sync::atomic::{AtomicU32, Ordering};

use udm_core::{push_extent, Bio, BioPtr, Error, Extent, Limits, BLOCK_STATUS_MAX_EXTENTS};

use crate::target::{
    parse_count, parse_sector, CtrCtx, DevArea, EndIoWhen, Map, MapCtx, StatusType, Target,
    TargetType,
};

/// The `striped` target type.
pub const STRIPED: TargetType = TargetType {
    name: "striped",
    version: [1, 6, 0],
    summary: "spreads the range over several devices in chunks (RAID 0)",
    usage: "<#stripes> <chunk sectors> <dev> <offset> [<dev> <offset>]...",
    min_args: 2,
    max_args: None,
    splits: true,
    exclusive_args: &[],
    ctr: striped_ctr,
};

struct Striped {
    devs: Vec<DevArea>,
    chunk: u64,
    stripes: u64,
    /// (log2 chunk, log2 stripes) when both are powers of two: the common
    /// case then maps with shifts and masks only.
    shifts: Option<(u32, u32)>,
    errors: Vec<AtomicU32>,
}

fn pow2_shifts(chunk: u64, stripes: u64) -> Option<(u32, u32)> {
    (chunk.is_power_of_two() && stripes.is_power_of_two())
        .then(|| (chunk.trailing_zeros(), stripes.trailing_zeros()))
}

fn striped_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    let e = |m: String| Error::invalid(format!("striped: {m}"));
    let stripes = parse_count("stripe count", argv[0]).map_err(|x| x.context("striped"))?;
    if stripes == 0 {
        return Err(e(format!(
            "invalid stripe count '{}': must be at least 1",
            argv[0]
        )));
    }
    let chunk = parse_sector("chunk size", argv[1]).map_err(|x| x.context("striped"))?;
    if chunk == 0 {
        return Err(e(format!(
            "invalid chunk size '{}': must be at least 1 sector",
            argv[1]
        )));
    }
    if !ctx.len.is_multiple_of(stripes as u64) {
        return Err(e(format!(
            "target length {} not divisible by number of stripes {stripes}",
            ctx.len
        )));
    }
    let width = ctx.len / stripes as u64;
    if !width.is_multiple_of(chunk) {
        return Err(e(format!(
            "target length {} not divisible by chunk size {chunk} times {stripes} stripes",
            ctx.len
        )));
    }
    let dests = &argv[2..];
    if dests.len() != 2 * stripes as usize {
        return Err(e(format!(
            "{stripes} stripes need {} destination arguments (<dev> <offset> each), got {}",
            2 * stripes,
            dests.len()
        )));
    }
    let mut devs = Vec::with_capacity(stripes as usize);
    for pair in dests.chunks(2) {
        let start = parse_sector("stripe offset", pair[1]).map_err(|x| x.context("striped"))?;
        let dev = ctx.get_device(pair[0]).map_err(|x| x.context("striped"))?;
        devs.push(DevArea {
            dev,
            start,
            len: width,
        });
    }
    Ok(Box::new(Striped {
        errors: devs.iter().map(|_| AtomicU32::new(0)).collect(),
        devs,
        chunk,
        stripes: stripes as u64,
        shifts: pow2_shifts(chunk, stripes as u64),
    }))
}

impl Target for Striped {
    #[inline]
    fn map(&self, mut bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        let (stripe, sector) = self.map_sector(bio.sector);
        bio.sector = sector;
        Map::Remapped(bio, stripe)
    }

    fn stripe_shifts(&self) -> Option<(u32, u32)> {
        self.shifts
    }

    fn sector_map(&self) -> bool {
        true
    }

    /// (stripe, sector on that stripe's device) of a target-relative sector.
    #[inline]
    fn map_sector(&self, rel: u64) -> (usize, u64) {
        let (row, stripe, off) = match self.shifts {
            Some((cs, ss)) => {
                let chunk = rel >> cs;
                (
                    chunk >> ss,
                    chunk & (self.stripes - 1),
                    rel & (self.chunk - 1),
                )
            }
            None => {
                let chunk = rel / self.chunk;
                (chunk / self.stripes, chunk % self.stripes, rel % self.chunk)
            }
        };
        let stripe = stripe as usize;
        (stripe, self.devs[stripe].start + row * self.chunk + off)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn max_io_len(&self) -> u64 {
        self.chunk
    }

    fn wants_end_io(&self) -> EndIoWhen {
        EndIoWhen::OnError
    }

    fn end_io(&self, _bio: &mut Bio, dev: usize) {
        if let Some(e) = self.errors.get(dev) {
            e.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        out.push_str(&format!("{}", self.stripes));
        match ty {
            StatusType::Info => {
                for d in &self.devs {
                    out.push_str(&format!(" {}", d.dev.name()));
                }
                out.push_str(" 1 ");
                for e in &self.errors {
                    out.push(if e.load(Ordering::Relaxed) > 0 {
                        'D'
                    } else {
                        'A'
                    });
                }
            }
            StatusType::Table => {
                out.push_str(&format!(" {}", self.chunk));
                for d in &self.devs {
                    out.push_str(&format!(" {} {}", d.dev.name(), d.start));
                }
            }
        }
    }

    fn message(&self, argv: &[&str]) -> Result<String, Error> {
        match argv {
            ["clear_errors"] => {
                for e in &self.errors {
                    e.store(0, Ordering::Relaxed);
                }
                Ok(String::new())
            }
            _ => Err(Error::invalid(format!(
                "striped: unknown message '{}' (supported: clear_errors)",
                argv.join(" ")
            ))),
        }
    }

    fn no_clone(&self) -> bool {
        true
    }

    /// Chunk by chunk, each from the stripe's device that holds it; stops
    /// (a prefix) after [`BLOCK_STATUS_MAX_EXTENTS`] chunks, or where a
    /// device answered only part of its chunk.
    fn block_status(&self, rel: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let mut part = Vec::new();
        let mut pos = rel;
        let end = rel + sectors;
        for i in 0..BLOCK_STATUS_MAX_EXTENTS {
            if pos >= end || (i > 0 && out.len() >= BLOCK_STATUS_MAX_EXTENTS) {
                break;
            }
            let (stripe, sector) = self.map_sector(pos);
            let want = (self.chunk - pos % self.chunk).min(end - pos);
            part.clear();
            self.devs[stripe]
                .dev
                .block_status(sector, want, &mut part)?;
            let mut got = 0;
            for e in &part {
                let n = e.sectors.min(want - got);
                got += n;
                push_extent(out, Extent { sectors: n, ..*e });
            }
            pos += got;
            if got < want {
                break;
            }
        }
        Ok(())
    }

    fn io_hints(&self, limits: &mut Limits) {
        let chunk_bytes = (self.chunk << udm_core::SECTOR_SHIFT) as u32;
        limits.io_opt = chunk_bytes.saturating_mul(self.stripes as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn striped(stripes: u64, chunk: u64, starts: &[u64]) -> Striped {
        // Mapping needs no devices; build the struct directly.
        Striped {
            devs: Vec::new(),
            chunk,
            stripes,
            shifts: pow2_shifts(chunk, stripes),
            errors: Vec::new(),
        }
        .with_starts(starts)
    }

    impl Striped {
        fn with_starts(mut self, starts: &[u64]) -> Striped {
            struct NoDev;
            impl udm_core::BlockDevice for NoDev {
                fn name(&self) -> &str {
                    "none"
                }
                fn limits(&self) -> Limits {
                    Limits::new(0)
                }
                fn caps(&self) -> udm_core::Caps {
                    udm_core::Caps::NONE
                }
                fn open(
                    self: std::sync::Arc<Self>,
                    _r: &udm_core::Reactor,
                ) -> Result<std::rc::Rc<dyn udm_core::Channel>, Error> {
                    Err(Error::invalid("test stub"))
                }
                fn as_any(&self) -> &dyn std::any::Any {
                    self
                }
            }
            let dev: std::sync::Arc<dyn udm_core::BlockDevice> = std::sync::Arc::new(NoDev);
            self.devs = starts
                .iter()
                .map(|&start| DevArea {
                    dev: dev.clone(),
                    start,
                    len: 0,
                })
                .collect();
            self
        }
    }

    #[test]
    fn chunks_rotate_over_stripes_then_advance_rows() {
        let s = striped(2, 8, &[0, 100]);
        assert_eq!(s.map_sector(0), (0, 0));
        assert_eq!(s.map_sector(7), (0, 7));
        assert_eq!(s.map_sector(8), (1, 100)); // second chunk: stripe 1
        assert_eq!(s.map_sector(15), (1, 107));
        assert_eq!(s.map_sector(16), (0, 8)); // third chunk: back to stripe 0, row 1
        assert_eq!(s.map_sector(24 + 3), (1, 111));
    }

    #[test]
    fn non_power_of_two_chunk_and_stripe_count() {
        let s = striped(3, 6, &[10, 20, 30]);
        // chunk 4 → stripe 1, row 1
        assert_eq!(s.map_sector(4 * 6 + 5), (1, 20 + 6 + 5));
        // chunk 6 → stripe 0, row 2
        assert_eq!(s.map_sector(6 * 6), (0, 10 + 12));
        // every sector maps to a distinct (stripe, sector)
        let mut seen = std::collections::HashSet::new();
        for rel in 0..(3 * 6 * 5) {
            assert!(seen.insert(s.map_sector(rel)), "sector {rel} collides");
        }
    }

    #[test]
    fn shift_and_division_paths_agree_with_dms_formula() {
        // Powers of two take shifts only when both chunk and stripe count
        // are; every mix must give dm's answer.
        for (stripes, chunk) in [(1, 8), (2, 8), (4, 1), (3, 8), (2, 6), (3, 6), (8, 128)] {
            let starts: Vec<u64> = (0..stripes).map(|i| 1000 * i + 7).collect();
            let s = striped(stripes, chunk, &starts);
            for rel in 0..(stripes * chunk * 4) {
                let c = rel / chunk;
                let st = (c % stripes) as usize;
                let want = (st, starts[st] + (c / stripes) * chunk + rel % chunk);
                assert_eq!(
                    s.map_sector(rel),
                    want,
                    "{stripes} stripes, chunk {chunk}, sector {rel}"
                );
            }
        }
    }
}
