//! What the device tells the driver: virtio feature bits and the
//! virtio-blk configuration space, both derived from the udm device's
//! limits and capabilities.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;

use udm_core::{BlockDevice, Caps, Dispatch};

use crate::front::AutoReport;
use crate::limits::Budget;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// vhost-user's own feature bit: the protocol-features handshake.
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;

/// The largest ring a queue may have.
pub const MAX_QUEUE_SIZE: u16 = 1024;

/// Data segments in one request (advertised as SEG_MAX): the ring's
/// descriptors minus the header and the status.
pub const SEG_MAX: u32 = 254;

/// The largest data segment (SIZE_MAX).
pub const SIZE_MAX: u32 = 1 << 20;

/// Ranges in one discard or write-zeroes request.
pub const MAX_RANGES: u32 = 32;

/// The longest discard or write-zeroes range, in sectors: its length in
/// bytes must fit a front request's u32.
pub const MAX_RANGE_SECTORS: u32 = u32::MAX >> 9;

/// Bytes of the configuration space udm fills (up to and including
/// `write_zeroes_may_unmap` and its padding); a driver that reads more
/// gets zeroes.
pub const CONFIG_LEN: usize = 60;

/// The device as the driver sees it.
#[derive(Clone, Debug)]
pub struct BlkConfig {
    /// The virtio features offered.
    pub features: u64,
    /// The configuration space (writeback byte as it starts).
    pub space: [u8; CONFIG_LEN],
    /// The device has a volatile cache (CONFIG_WCE's writeback starts at 1).
    pub volatile_cache: bool,
    /// Writes are refused.
    pub read_only: bool,
    /// The device's size in bytes.
    pub size: u64,
    /// The answer to GET_ID (at most 20 bytes).
    pub id: Vec<u8>,
}

/// Offset of the `writeback` byte in the configuration space.
pub const WRITEBACK_OFFSET: usize = 32;

const fn bit(b: u32) -> u64 {
    1 << b
}

impl BlkConfig {
    /// The device `dev` served with `queues` queues, read-only when asked
    /// or when the device is.
    pub fn new(dev: &dyn BlockDevice, queues: u16, read_only: bool) -> BlkConfig {
        let l = dev.limits();
        let caps = dev.caps();
        let ro = read_only || caps.contains(Caps::READ_ONLY);
        let lbs = l.logical_block_size.max(512);
        let pbs = l.physical_block_size.max(lbs);
        let volatile_cache = caps.contains(Caps::FLUSH);
        let mut features = bit(VIRTIO_F_VERSION_1)
            | F_PROTOCOL_FEATURES
            | bit(VIRTIO_RING_F_EVENT_IDX)
            | bit(VIRTIO_RING_F_INDIRECT_DESC)
            | bit(VIRTIO_BLK_F_SIZE_MAX)
            | bit(VIRTIO_BLK_F_SEG_MAX)
            | bit(VIRTIO_BLK_F_BLK_SIZE)
            | bit(VIRTIO_BLK_F_TOPOLOGY)
            | bit(VIRTIO_BLK_F_FLUSH)
            | bit(VIRTIO_BLK_F_CONFIG_WCE)
            | bit(VIRTIO_BLK_F_MQ);
        if ro {
            features |= bit(VIRTIO_BLK_F_RO);
        } else {
            if caps.contains(Caps::DISCARD) {
                features |= bit(VIRTIO_BLK_F_DISCARD);
            }
            if caps.contains(Caps::WRITE_ZEROES) {
                features |= bit(VIRTIO_BLK_F_WRITE_ZEROES);
            }
        }
        let lbs_sectors = lbs >> 9;
        let max_range = MAX_RANGE_SECTORS / lbs_sectors * lbs_sectors;
        let mut s = [0u8; CONFIG_LEN];
        let put = |s: &mut [u8; CONFIG_LEN], at: usize, v: &[u8]| {
            s[at..at + v.len()].copy_from_slice(v);
        };
        put(&mut s, 0, &l.sectors.to_le_bytes());
        put(&mut s, 8, &SIZE_MAX.max(lbs).to_le_bytes());
        put(&mut s, 12, &SEG_MAX.to_le_bytes());
        // 16..20: geometry, not offered.
        put(&mut s, 20, &lbs.to_le_bytes());
        s[24] = (pbs / lbs).trailing_zeros() as u8;
        s[25] = 0;
        put(&mut s, 26, &((pbs / lbs) as u16).to_le_bytes());
        put(&mut s, 28, &(l.io_opt / lbs).to_le_bytes());
        s[WRITEBACK_OFFSET] = volatile_cache as u8;
        put(&mut s, 34, &queues.to_le_bytes());
        put(&mut s, 36, &max_range.to_le_bytes());
        put(&mut s, 40, &MAX_RANGES.to_le_bytes());
        put(&mut s, 44, &lbs_sectors.to_le_bytes());
        put(&mut s, 48, &max_range.to_le_bytes());
        put(&mut s, 52, &MAX_RANGES.to_le_bytes());
        s[56] = 0;
        let mut id = dev.name().as_bytes().to_vec();
        id.truncate(VIRTIO_BLK_ID_BYTES as usize);
        BlkConfig {
            features,
            space: s,
            volatile_cache,
            read_only: ro,
            size: l.bytes(),
            id,
        }
    }

    /// `size` bytes of the configuration space from `offset` (zeroes past
    /// what udm fills), with the current `writeback` byte and `capacity`
    /// (sectors); None when the range is unreasonable.
    pub fn read(&self, offset: u32, size: u32, writeback: bool, capacity: u64) -> Option<Vec<u8>> {
        let (off, len) = (offset as usize, size as usize);
        if off.checked_add(len)? > 256 {
            return None;
        }
        let mut s = self.space;
        s[WRITEBACK_OFFSET] = writeback as u8;
        s[..8].copy_from_slice(&capacity.to_le_bytes());
        let mut out = vec![0u8; len];
        for (i, b) in out.iter_mut().enumerate() {
            *b = s.get(off + i).copied().unwrap_or(0);
        }
        Some(out)
    }
}

/// What every part of an export shares: what the driver is told, and the
/// state the driver may change.
pub struct Shared {
    /// Features and configuration space.
    pub cfg: BlkConfig,
    /// The driver's write-cache mode (CONFIG_WCE's writeback byte): when
    /// false on a device with a volatile cache, writes carry FUA.
    pub writeback: AtomicBool,
    /// Queues offered.
    pub queues: u16,
    /// The device's size in sectors as the driver is told it (it grows
    /// when the device does: see the server).
    pub capacity: AtomicU64,
    /// How requests go to the device.
    pub dispatch: Dispatch,
    /// What the queues' trials of auto dispatch run and ran.
    pub auto: Arc<AutoReport>,
    /// Frontends connected (0 or 1).
    pub(super) clients: AtomicUsize,
    /// Where the queues' fronts charge bounce buffers.
    pub budget: Option<Arc<Budget>>,
}
