//! Direct or queued dispatch (seed 004): whether an export hands each
//! request to the device as it arrives, or collects a batch, sorts it and
//! merges adjacent requests first. The device reports which suits it
//! ([`Caps::MERGE`] and [`BlockDevice::merge_reason`]); the host decides
//! from that report, not the client.
//!
//! - *direct*: no queue. Each request becomes its bios at once; nothing is
//!   paid for sorting, and a fast device (RAM) serves more requests per
//!   second (virtio-blk's bio path: +16–28% IOPS on a ramdisk).
//! - *queued*: the requests of one notification batch (one NBD receive,
//!   one virtqueue kick, one bench submission round) are sorted by offset
//!   and adjacent ones of the same op merged into one bio of several
//!   segments, up to the device's limits, then submitted together at the
//!   batch's end (the kernel's plug and `blk_finish_plug`); a device whose
//!   requests each cost a seek or a round trip serves fewer, larger ones
//!   faster.
//! - *stream*: direct, except that a request which continues the one
//!   before it (same op and flags, the next byte) is held with it, and the
//!   run goes as one bio when a request does not continue it or the batch
//!   ends (the kernel's plug merge, which also looks at the last request
//!   only). Scattered requests pay no sort; a sequential stream is merged
//!   as in queued mode.
//! - *auto*: queued where the device reports [`Caps::MERGE`] (a device
//!   that gains from sorting scattered requests too). Elsewhere it chooses
//!   per request: a request that continues the one before while others
//!   are in flight is held to merge as in stream mode; a lone request
//!   (nothing else in flight) or a scattered one goes on direct's path,
//!   with nothing held. A fast device then pays direct's cost for what
//!   stream could not merge anyway (a lone sequential request held and
//!   sent alone at the batch's end costs ~13% more instructions on RAM).
//!   The request after a held run is held wherever it starts, so a
//!   stream that jumps (wraps, seeks) goes on merging where it lands; the
//!   request after the jump is held only if it continues it.

use std::fmt;
use std::str::FromStr;

use crate::device::{BlockDevice, Caps};
use crate::error::Error;

/// How an export or a bench hands requests to a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Dispatch {
    /// Pick from the device's report ([`Dispatch::choose`]): queued where
    /// merging helps the device, else a choice per request (stream's
    /// merging only for a request that continues the one before while
    /// others are in flight, direct's path for any other).
    #[default]
    Auto,
    /// Each request to the device as it arrives.
    Direct,
    /// A batch of requests sorted, merged and submitted at its end.
    Queued,
    /// Each request as it arrives, unless it continues the one before: a
    /// run of back-to-back requests goes as one bio.
    Stream,
}

impl Dispatch {
    /// The name, as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            Dispatch::Auto => "auto",
            Dispatch::Direct => "direct",
            Dispatch::Queued => "queued",
            Dispatch::Stream => "stream",
        }
    }

    /// The mode to use on `dev`, and why: `auto` follows the device's
    /// report (`Queued` where merging helps it, else `Auto` itself: the
    /// choice per request), the others were asked for.
    pub fn choose(self, dev: &dyn BlockDevice) -> (Dispatch, String) {
        match self {
            Dispatch::Auto => {
                let (helps, why) = merge_report(dev);
                if helps {
                    (Dispatch::Queued, format!("auto: merging helps ({why})"))
                } else {
                    (
                        Dispatch::Auto,
                        format!("auto: merging does not help ({why}); {AUTO_PER_REQUEST}"),
                    )
                }
            }
            m => (m, "asked for".to_string()),
        }
    }
}

/// How `auto` goes on where merging does not help, as `choose` tells it.
pub const AUTO_PER_REQUEST: &str =
    "back-to-back requests merge while others are in flight, the rest go direct";

/// Whether merging helps `dev` ([`Caps::MERGE`]) and why
/// ([`BlockDevice::merge_reason`]).
pub fn merge_report(dev: &dyn BlockDevice) -> (bool, String) {
    (dev.caps().contains(Caps::MERGE), dev.merge_reason())
}

impl fmt::Display for Dispatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dispatch {
    type Err = Error;
    fn from_str(s: &str) -> Result<Dispatch, Error> {
        match s {
            "auto" => Ok(Dispatch::Auto),
            "direct" => Ok(Dispatch::Direct),
            "queued" => Ok(Dispatch::Queued),
            "stream" => Ok(Dispatch::Stream),
            _ => Err(Error::invalid(format!(
                "dispatch '{s}': expected auto, direct, queued or stream"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_anything_else_is_refused_by_name() {
        for d in [
            Dispatch::Auto,
            Dispatch::Direct,
            Dispatch::Queued,
            Dispatch::Stream,
        ] {
            assert_eq!(d.name().parse::<Dispatch>().unwrap(), d);
        }
        let e = "fast".parse::<Dispatch>().unwrap_err().to_string();
        assert!(
            e.contains("'fast'") && e.contains("auto, direct, queued or stream"),
            "{e}"
        );
    }
}
