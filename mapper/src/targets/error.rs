//! `error`: every I/O fails (dm-error); a hole in a table that must not be used.
//!
//! Table line: `<start> <length> error`

use udm_core::{BioPtr, Caps, Error, Status};

use crate::target::{CtrCtx, DevArea, Map, MapCtx, StatusType, Target, TargetType};

/// The `error` target type.
pub const ERROR: TargetType = TargetType {
    name: "error",
    version: [1, 7, 0],
    summary: "every I/O fails",
    usage: "",
    min_args: 0,
    max_args: Some(0),
    splits: false,
    exclusive_args: &[],
    ctr: error_ctr,
};

struct ErrorTarget;

fn error_ctr(_ctx: &CtrCtx<'_>, _argv: &[&str]) -> Result<Box<dyn Target>, Error> {
    Ok(Box::new(ErrorTarget))
}

impl Target for ErrorTarget {
    fn map(&self, bio: BioPtr, _ctx: &MapCtx<'_>) -> Map {
        Map::Kill(bio, Status::IoErr)
    }

    fn devices(&self) -> &[DevArea] {
        &[]
    }

    fn status(&self, _ty: StatusType, _out: &mut String) {}

    fn no_clone(&self) -> bool {
        true
    }

    // block_status: the default, data. Reads of it fail, so a client that
    // skipped it as a hole would copy zeroes where the source has none.

    fn caps(&self, _stacked: Caps) -> Caps {
        Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES
    }
}
