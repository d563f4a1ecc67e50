//! The ublk UAPI (`include/uapi/linux/ublk_cmd.h`), mirrored: the control
//! commands sent to `/dev/ublk-control`, the I/O commands sent to
//! `/dev/ublkcN`, both as io_uring URING_CMDs, and the structs they carry.
//! Commands are the ioctl-encoded forms (`UBLK_U_*`), which every kernel
//! with ublk takes and newer ones require. The layouts are checked against
//! the system's header in this module's tests.

#![allow(missing_docs)]

/// `_IOC(dir, 'u', nr, size)`.
const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr
}
const IOC_READ: u32 = 2;
const IOC_RW: u32 = 3;
const CTRL: usize = std::mem::size_of::<CtrlCmd>();
const IO: usize = std::mem::size_of::<IoCmd>();

pub const UBLK_U_CMD_GET_DEV_INFO: u32 = ioc(IOC_READ, 0x02, CTRL);
pub const UBLK_U_CMD_ADD_DEV: u32 = ioc(IOC_RW, 0x04, CTRL);
pub const UBLK_U_CMD_DEL_DEV: u32 = ioc(IOC_RW, 0x05, CTRL);
pub const UBLK_U_CMD_START_DEV: u32 = ioc(IOC_RW, 0x06, CTRL);
pub const UBLK_U_CMD_STOP_DEV: u32 = ioc(IOC_RW, 0x07, CTRL);
pub const UBLK_U_CMD_SET_PARAMS: u32 = ioc(IOC_RW, 0x08, CTRL);
pub const UBLK_U_CMD_GET_PARAMS: u32 = ioc(IOC_READ, 0x09, CTRL);
pub const UBLK_U_CMD_START_USER_RECOVERY: u32 = ioc(IOC_RW, 0x10, CTRL);
pub const UBLK_U_CMD_END_USER_RECOVERY: u32 = ioc(IOC_RW, 0x11, CTRL);
pub const UBLK_U_CMD_GET_FEATURES: u32 = ioc(IOC_READ, 0x13, CTRL);

pub const UBLK_U_IO_FETCH_REQ: u32 = ioc(IOC_RW, 0x20, IO);
pub const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 = ioc(IOC_RW, 0x21, IO);

/// A fetch's result: a request is in the descriptor.
pub const UBLK_IO_RES_OK: i32 = 0;
/// A fetch's result: the queue is going away; fetch no more.
pub const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;

/// Offset of queue 0's descriptors in `/dev/ublkcN`'s mmap space.
pub const UBLKSRV_CMD_BUF_OFFSET: u64 = 0;
pub const UBLK_MAX_QUEUE_DEPTH: u32 = 4096;

pub const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
pub const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
/// The device belongs to the user who added it (the kernel sets
/// `owner_uid`/`owner_gid`); each command on it carries the path of its
/// char device, which the caller must be able to open.
pub const UBLK_F_UNPRIVILEGED_DEV: u64 = 1 << 5;
pub const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;

pub const UBLK_S_DEV_DEAD: u16 = 0;
pub const UBLK_S_DEV_LIVE: u16 = 1;
pub const UBLK_S_DEV_QUIESCED: u16 = 2;

pub const UBLK_IO_OP_READ: u8 = 0;
pub const UBLK_IO_OP_WRITE: u8 = 1;
pub const UBLK_IO_OP_FLUSH: u8 = 2;
pub const UBLK_IO_OP_DISCARD: u8 = 3;
pub const UBLK_IO_OP_WRITE_SAME: u8 = 4;
pub const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;
/// Flags in the upper bits of [`IoDesc::op_flags`].
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;

pub const UBLK_ATTR_READ_ONLY: u32 = 1 << 0;
pub const UBLK_ATTR_ROTATIONAL: u32 = 1 << 1;
pub const UBLK_ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub const UBLK_ATTR_FUA: u32 = 1 << 3;

pub const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;

/// `struct ublksrv_ctrl_cmd`: a control command's payload (the SQE's cmd area).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CtrlCmd {
    pub dev_id: u32,
    /// `u16::MAX` when the command is not for one queue.
    pub queue_id: u16,
    /// Length of the buffer at `addr`.
    pub len: u16,
    pub addr: u64,
    pub data: [u64; 1],
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

/// `struct ublksrv_ctrl_dev_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    pub flags: u64,
    pub ublksrv_flags: u64,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

/// `struct ublksrv_io_desc`: one request, in the queue's mmap'd array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IoDesc {
    /// Op in bits 0-7, flags above.
    pub op_flags: u32,
    pub nr_sectors: u32,
    pub start_sector: u64,
    pub addr: u64,
}

impl IoDesc {
    /// The request's `UBLK_IO_OP_*`.
    pub fn op(&self) -> u8 {
        (self.op_flags & 0xff) as u8
    }
}

/// `struct ublksrv_io_cmd`: an I/O command's payload.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    /// The request's result (COMMIT_AND_FETCH): bytes done or -errno.
    pub result: i32,
    /// The request's buffer in this process.
    pub addr: u64,
}

/// `struct ublk_param_basic`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamBasic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

/// `struct ublk_param_discard`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamDiscard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

/// `struct ublk_params` up to its discard part (what SET_PARAMS takes
/// here; `len` tells the kernel where it ends).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Params {
    pub len: u32,
    pub types: u32,
    pub basic: ParamBasic,
    pub discard: ParamDiscard,
}

/// Bytes of descriptors a queue of `depth` maps (page-rounded).
pub fn queue_desc_bytes(depth: u32) -> usize {
    let page = page_size();
    (depth as usize * std::mem::size_of::<IoDesc>()).div_ceil(page) * page
}

/// The mmap offset of queue `q`'s descriptors in `/dev/ublkcN`: queues are
/// spaced by the largest array (`UBLK_MAX_QUEUE_DEPTH` descriptors).
pub fn queue_desc_offset(q: u16) -> u64 {
    UBLKSRV_CMD_BUF_OFFSET + q as u64 * queue_desc_bytes(UBLK_MAX_QUEUE_DEPTH) as u64
}

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// A struct as the bytes of an SQE's 80-byte command area.
pub fn cmd_bytes<T: Copy>(v: &T) -> [u8; 80] {
    const { assert!(std::mem::size_of::<T>() <= 80) };
    let mut out = [0u8; 80];
    // SAFETY: `T` is a plain repr(C) struct of integers no larger than
    // `out` (checked above); its bytes are copied, not reinterpreted.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (v as *const T).cast::<u8>(),
            out.as_mut_ptr(),
            std::mem::size_of::<T>(),
        )
    };
    out
}

#[cfg(test)]
mod tests;
