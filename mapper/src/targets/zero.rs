//! `zero`: reads return zeroes, writes are discarded (dm-zero).
//!
//! Table line: `<start> <length> zero`

use udm_core::{BioPtr, Caps, Error, Op, Status};

use crate::target::{CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `zero` target type.
pub const ZERO: TargetType = TargetType {
    name: "zero",
    version: [1, 2, 0],
    ctr: zero_ctr,
};

struct Zero;

fn zero_ctr(_ctx: &CtrCtx<'_>, argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    if !argv.is_empty() {
        return Err(Error::invalid(format!(
            "zero: takes no arguments (got '{}')",
            argv.join(" ")
        )));
    }
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

    fn caps(&self, _stacked: Caps) -> Caps {
        Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES
    }
}
