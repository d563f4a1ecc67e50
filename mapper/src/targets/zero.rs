//! `zero`: reads return zeroes, writes are discarded (dm-zero).
//!
//! Table line: `<start> <length> zero`

use udm_core::{push_extent, Alloc, BioPtr, Caps, Error, Extent, Op, Status};

use crate::target::{CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `zero` target type.
pub const ZERO: TargetType = TargetType {
    name: "zero",
    version: [1, 2, 0],
    summary: "reads return zeroes, writes are discarded",
    usage: "",
    min_args: 0,
    max_args: Some(0),
    splits: false,
    exclusive_args: &[],
    ctr: zero_ctr,
};

struct Zero;

fn zero_ctr(_ctx: &CtrCtx<'_>, _argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    Ok(Box::new(Zero))
}

impl Target for Zero {
    fn map(&self, mut bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        if bio.op == Op::Read {
            bio.zero_fill();
        }
        bio.complete(Status::Ok);
        Map::Submitted
    }

    fn devices(&self) -> &[DevArea] {
        &[]
    }

    fn status(&self, _ty: StatusType, _out: &mut String) {}

    fn no_clone(&self) -> bool {
        true
    }

    /// A hole: it reads as zeroes and holds nothing.
    fn block_status(&self, _rel: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        push_extent(
            out,
            Extent {
                sectors,
                alloc: Alloc::Hole,
            },
        );
        Ok(())
    }

    fn caps(&self, _stacked: Caps) -> Caps {
        Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES
    }
}
