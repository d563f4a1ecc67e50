//! `linear`: maps a range onto a contiguous area of another device.
//!
//! Table line: `<start> <length> linear <dev> <offset>`
//! - `dev`: a udm device name or a path;
//! - `offset`: the sector of `dev` where the range begins.

use udm_core::{BioPtr, Error, Extent};

use crate::target::{parse_sector, CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `linear` target type.
pub const LINEAR: TargetType = TargetType {
    name: "linear",
    version: [1, 4, 0],
    summary: "maps the range onto a contiguous area of another device",
    usage: "<dev> <offset>",
    min_args: 2,
    max_args: Some(2),
    splits: false,
    exclusive_args: &[],
    ctr: linear_ctr,
};

struct Linear {
    devs: [DevArea; 1],
}

fn linear_ctr(ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    // Two arguments: the core checked the count (LINEAR.max_args).
    let (dev, offset) = (argv[0], argv[1]);
    let start = parse_sector("device sector", offset).map_err(|e| e.context("linear"))?;
    let dev = ctx.get_device(dev).map_err(|e| e.context("linear"))?;
    Ok(Box::new(Linear {
        devs: [DevArea {
            dev,
            start,
            len: ctx.len,
        }],
    }))
}

impl Target for Linear {
    #[inline]
    fn map(&self, mut bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        bio.sector += self.devs[0].start;
        Map::Remapped(bio, 0)
    }

    fn devices(&self) -> &[DevArea] {
        &self.devs
    }

    fn status(&self, ty: StatusType, out: &mut String) {
        if ty == StatusType::Table {
            out.push_str(&format!(
                "{} {}",
                self.devs[0].dev.name(),
                self.devs[0].start
            ));
        }
    }

    fn no_clone(&self) -> bool {
        true
    }

    /// The device's own answer for the area the range maps to.
    fn block_status(&self, rel: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let d = &self.devs[0];
        d.dev.block_status(d.start + rel, sectors, out)
    }

    fn remap_offset(&self) -> Option<u64> {
        Some(self.devs[0].start)
    }
}
