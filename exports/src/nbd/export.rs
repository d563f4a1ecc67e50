//! One export: a device and what its clients are told about it (size,
//! block sizes, transmission flags), derived from the device's limits and
//! capabilities.

use std::sync::Arc;

use udm_core::{BlockDevice, Caps, Dispatch};

use crate::front::AutoReport;

use super::proto::{self, ExportInfo};

/// Largest READ/WRITE payload advertised (the spec's interoperable maximum).
pub const MAX_PAYLOAD: u32 = 32 << 20;
// The smallest budget must hold two of the largest requests.
const _: () = assert!(2 * MAX_PAYLOAD as u64 <= crate::limits::MIN_INFLIGHT);

/// One export: a name, a device and what clients are told about it.
pub struct Export {
    /// Size, block sizes and transmission flags, as advertised.
    pub info: ExportInfo,
    /// The device served.
    pub dev: Arc<dyn BlockDevice>,
    /// Connections in transmission on this export at once (None: only the
    /// server-wide cap).
    pub max_connections: Option<usize>,
    /// How each connection's front hands requests to the device: `Direct`
    /// or `Queued` ([`Export::set_dispatch`]; auto's choice by default).
    pub dispatch: Dispatch,
    /// Why that mode ([`Dispatch::choose`]).
    pub dispatch_why: String,
    /// What the connections' trials of auto dispatch run and ran (where
    /// the device reports that merging helps it).
    pub auto: Arc<AutoReport>,
}

impl Export {
    /// Exports `dev` as `name`, read-only when asked or when the device is.
    ///
    /// Advertised: block sizes from the device's limits (minimum: logical
    /// block size; preferred: the larger of `io_opt` and 4 KiB, a power of
    /// two; maximum payload: [`MAX_PAYLOAD`], larger I/O is split into bios
    /// of the device's `max_io_bytes`), and transmission flags from its
    /// capabilities. FLUSH and FUA are always offered (a device without a
    /// volatile cache completes them at once; one without native FUA gets
    /// a flush after the write); CACHE is a no-op; CAN_MULTI_CONN is set
    /// because the server keeps no per-connection cache: every connection's
    /// I/O reaches the same device, and a flush reaches all of it.
    ///
    /// Dispatch is `auto`'s choice from the device's report until
    /// [`Export::set_dispatch`].
    pub fn new(name: &str, dev: Arc<dyn BlockDevice>, read_only: bool) -> Export {
        let l = dev.limits();
        let caps = dev.caps();
        let ro = read_only || caps.contains(Caps::READ_ONLY);
        let min_block = l.logical_block_size.clamp(1, 1 << 16).next_power_of_two();
        let pref_block = l
            .io_opt
            .max(4096)
            .max(min_block)
            .min(MAX_PAYLOAD)
            .next_power_of_two();
        let mut flags = proto::FLAG_HAS_FLAGS
            | proto::FLAG_SEND_FLUSH
            | proto::FLAG_SEND_FUA
            | proto::FLAG_SEND_CACHE
            | proto::FLAG_CAN_MULTI_CONN;
        if ro {
            flags |= proto::FLAG_READ_ONLY;
        } else {
            if caps.contains(Caps::DISCARD) {
                flags |= proto::FLAG_SEND_TRIM;
            }
            if caps.contains(Caps::WRITE_ZEROES) {
                flags |= proto::FLAG_SEND_WRITE_ZEROES | proto::FLAG_SEND_FAST_ZERO;
            }
        }
        let (dispatch, dispatch_why) = Dispatch::Auto.choose(&*dev);
        Export {
            info: ExportInfo {
                name: name.to_string(),
                description: format!("udm device '{}'", dev.name()),
                size: l.bytes(),
                flags,
                min_block,
                pref_block,
                max_payload: MAX_PAYLOAD.max(pref_block),
            },
            dev,
            max_connections: None,
            dispatch,
            dispatch_why,
            auto: Arc::default(),
        }
    }

    /// Sets the dispatch asked for (`auto` chooses from the device's report).
    pub fn set_dispatch(&mut self, mode: Dispatch) {
        (self.dispatch, self.dispatch_why) = mode.choose(&*self.dev);
    }
}
