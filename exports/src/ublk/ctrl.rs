//! The control device, `/dev/ublk-control`: adds, configures, starts,
//! stops and deletes ublk devices. Each command is a URING_CMD on a small
//! ring of its own, waited for at once (the control path; the data path
//! runs on the reactors' rings, see `queue.rs`).

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use udm_core::io_uring::{opcode, squeue, types, IoUring};
use udm_core::{Error, ErrorKind};

use super::sys::{self, CtrlCmd, DevInfo, Params};

/// The path of the control device.
pub const CONTROL: &str = "/dev/ublk-control";

/// What `udm` says on a kernel without ublk.
pub const NOT_AVAILABLE: &str = "ublk not available in this kernel";

/// An open control device.
pub struct Ctrl {
    fd: OwnedFd,
    ring: IoUring<squeue::Entry128>,
}

impl Ctrl {
    /// Opens the control device. A kernel without ublk (no
    /// `/dev/ublk-control`) gives [`NOT_AVAILABLE`] (Unsupported).
    pub fn open() -> Result<Ctrl, Error> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(CONTROL)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => Error::new(
                    ErrorKind::Unsupported,
                    format!("{NOT_AVAILABLE} (no {CONTROL}; modprobe ublk_drv?)"),
                ),
                _ => Error::os(format!("opening {CONTROL}"), e),
            })?;
        let ring = IoUring::<squeue::Entry128>::builder()
            .build(4)
            .map_err(|e| Error::os("a ring with 128-byte SQEs for ublk control", e))?;
        Ok(Ctrl { fd: f.into(), ring })
    }

    /// Sends `op` with `cmd` and waits for its result (>= 0) or errno.
    fn cmd(&mut self, op: u32, cmd: CtrlCmd) -> io::Result<i32> {
        let e = opcode::UringCmd80::new(types::Fd(self.fd.as_raw_fd()), op)
            .cmd(sys::cmd_bytes(&cmd))
            .build()
            .user_data(1);
        // SAFETY: the buffer `cmd.addr` names (if any) is the caller's,
        // borrowed across this call, which waits for the command's CQE
        // before it returns.
        unsafe { self.ring.submission().push(&e) }
            .map_err(|_| io::Error::other("the ublk control ring is full"))?;
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            if let Some(c) = self.ring.completion().next() {
                let r = c.result();
                return if r < 0 {
                    Err(io::Error::from_raw_os_error(-r))
                } else {
                    Ok(r)
                };
            }
        }
    }

    fn dev_cmd<T>(dev_id: u32, buf: Option<&mut T>) -> CtrlCmd {
        let (addr, len) = match buf {
            Some(b) => (b as *mut T as u64, std::mem::size_of::<T>() as u16),
            None => (0, 0),
        };
        CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            len,
            addr,
            ..CtrlCmd::default()
        }
    }

    /// ADD_DEV: `info.dev_id` u32::MAX picks the next free id; the kernel
    /// fills in the rest of `info`.
    pub fn add(&mut self, info: &mut DevInfo) -> io::Result<()> {
        let c = Self::dev_cmd(info.dev_id, Some(info));
        self.cmd(sys::UBLK_U_CMD_ADD_DEV, c).map(|_| ())
    }

    /// SET_PARAMS (before START_DEV).
    pub fn set_params(&mut self, dev_id: u32, p: &mut Params) -> io::Result<()> {
        p.len = std::mem::size_of::<Params>() as u32;
        let c = Self::dev_cmd(dev_id, Some(p));
        self.cmd(sys::UBLK_U_CMD_SET_PARAMS, c).map(|_| ())
    }

    /// GET_PARAMS.
    pub fn params(&mut self, dev_id: u32) -> io::Result<Params> {
        let mut p = Params {
            len: std::mem::size_of::<Params>() as u32,
            ..Params::default()
        };
        let c = Self::dev_cmd(dev_id, Some(&mut p));
        self.cmd(sys::UBLK_U_CMD_GET_PARAMS, c)?;
        Ok(p)
    }

    /// GET_DEV_INFO.
    pub fn info(&mut self, dev_id: u32) -> io::Result<DevInfo> {
        let mut i = DevInfo::default();
        let c = Self::dev_cmd(dev_id, Some(&mut i));
        self.cmd(sys::UBLK_U_CMD_GET_DEV_INFO, c)?;
        Ok(i)
    }

    /// START_DEV, served by process `pid`: returns once every queue has
    /// fetched, with `/dev/ublkbN` created.
    pub fn start(&mut self, dev_id: u32, pid: i32) -> io::Result<()> {
        let mut c = Self::dev_cmd::<()>(dev_id, None);
        c.data[0] = pid as u64;
        self.cmd(sys::UBLK_U_CMD_START_DEV, c).map(|_| ())
    }

    /// STOP_DEV: removes `/dev/ublkbN`; queued fetches end with ABORT.
    pub fn stop(&mut self, dev_id: u32) -> io::Result<()> {
        self.cmd(sys::UBLK_U_CMD_STOP_DEV, Self::dev_cmd::<()>(dev_id, None))
            .map(|_| ())
    }

    /// DEL_DEV: waits until `/dev/ublkcN` is closed, then frees the id.
    pub fn del(&mut self, dev_id: u32) -> io::Result<()> {
        self.cmd(sys::UBLK_U_CMD_DEL_DEV, Self::dev_cmd::<()>(dev_id, None))
            .map(|_| ())
    }

    /// START_USER_RECOVERY: a device whose server died takes a new one.
    pub fn start_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        let c = Self::dev_cmd::<()>(dev_id, None);
        self.cmd(sys::UBLK_U_CMD_START_USER_RECOVERY, c).map(|_| ())
    }

    /// END_USER_RECOVERY, served by `pid`: returns once every queue has
    /// fetched again; queued I/O resumes.
    pub fn end_recovery(&mut self, dev_id: u32, pid: i32) -> io::Result<()> {
        let mut c = Self::dev_cmd::<()>(dev_id, None);
        c.data[0] = pid as u64;
        self.cmd(sys::UBLK_U_CMD_END_USER_RECOVERY, c).map(|_| ())
    }
}
