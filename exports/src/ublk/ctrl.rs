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
    /// The devices commanded are unprivileged ones: each command carries
    /// the device's char device path ([`frame`]).
    unprivileged: bool,
}

/// The buffer of a command on device `dev_id` carrying `payload`, and the
/// length of the path before it. An unprivileged device's commands start
/// with the path of its char device, `/dev/ublkcN` (no NUL): the kernel
/// lets through only a caller who may open that path (read for queries,
/// read and write for changes), then reads the payload after it. A
/// privileged device's commands carry the payload alone (only
/// CAP_SYS_ADMIN may send them).
pub fn frame(dev_id: u32, unprivileged: bool, payload_len: usize) -> (Vec<u8>, u16) {
    let path = if unprivileged {
        format!("/dev/ublkc{dev_id}").into_bytes()
    } else {
        Vec::new()
    };
    let n = path.len();
    let mut buf = path;
    buf.resize(n + payload_len, 0);
    (buf, n as u16)
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
                io::ErrorKind::PermissionDenied => Error::os(
                    format!("opening {CONTROL} (root's unless a udev rule opens it to users: docs/ublk.md)"),
                    e,
                ),
                _ => Error::os(format!("opening {CONTROL}"), e),
            })?;
        let ring = IoUring::<squeue::Entry128>::builder()
            .build(4)
            .map_err(|e| Error::os("a ring with 128-byte SQEs for ublk control", e))?;
        Ok(Ctrl {
            fd: f.into(),
            ring,
            unprivileged: false,
        })
    }

    /// Whether the devices commanded from now on are unprivileged ones
    /// (added with [`sys::UBLK_F_UNPRIVILEGED_DEV`]).
    pub fn set_unprivileged(&mut self, on: bool) {
        self.unprivileged = on;
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

    /// Sends `op` for device `dev_id` with `buf` as its payload (read
    /// back after: the kernel may fill it) and `data0` in the command's
    /// data word, framed as [`frame`] says.
    fn dev_op<T: Copy>(
        &mut self,
        op: u32,
        dev_id: u32,
        buf: Option<&mut T>,
        data0: u64,
    ) -> io::Result<i32> {
        let size = if buf.is_some() {
            std::mem::size_of::<T>()
        } else {
            0
        };
        let (mut framed, path_len) = frame(dev_id, self.unprivileged, size);
        let at = path_len as usize;
        if let Some(b) = &buf {
            // SAFETY: framed holds path_len + size_of::<T>() bytes; an
            // unaligned write of a Copy value into them.
            unsafe { std::ptr::write_unaligned(framed.as_mut_ptr().add(at).cast::<T>(), **b) };
        }
        let (addr, len) = if framed.is_empty() {
            (0, 0)
        } else {
            (framed.as_mut_ptr() as u64, framed.len() as u16)
        };
        let c = CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            len,
            addr,
            data: [data0],
            dev_path_len: path_len,
            ..CtrlCmd::default()
        };
        let r = self.cmd(op, c)?;
        if let Some(b) = buf {
            // SAFETY: as above, read back from the same bytes (the T written
            // there, as the kernel left it: a valid T of plain integers).
            *b = unsafe { std::ptr::read_unaligned(framed.as_ptr().add(at).cast::<T>()) };
        }
        Ok(r)
    }

    /// ADD_DEV: `info.dev_id` u32::MAX picks the next free id; the kernel
    /// fills in the rest of `info`.
    /// ADD_DEV carries no path, whatever the device.
    pub fn add(&mut self, info: &mut DevInfo) -> io::Result<()> {
        let c = CtrlCmd {
            dev_id: info.dev_id,
            queue_id: u16::MAX,
            len: std::mem::size_of::<DevInfo>() as u16,
            addr: info as *mut DevInfo as u64,
            ..CtrlCmd::default()
        };
        self.cmd(sys::UBLK_U_CMD_ADD_DEV, c).map(|_| ())
    }

    /// SET_PARAMS (before START_DEV).
    pub fn set_params(&mut self, dev_id: u32, p: &mut Params) -> io::Result<()> {
        p.len = std::mem::size_of::<Params>() as u32;
        self.dev_op(sys::UBLK_U_CMD_SET_PARAMS, dev_id, Some(p), 0)
            .map(|_| ())
    }

    /// GET_PARAMS.
    pub fn params(&mut self, dev_id: u32) -> io::Result<Params> {
        let mut p = Params {
            len: std::mem::size_of::<Params>() as u32,
            ..Params::default()
        };
        self.dev_op(sys::UBLK_U_CMD_GET_PARAMS, dev_id, Some(&mut p), 0)?;
        Ok(p)
    }

    /// GET_DEV_INFO.
    pub fn info(&mut self, dev_id: u32) -> io::Result<DevInfo> {
        let mut i = DevInfo::default();
        self.dev_op(sys::UBLK_U_CMD_GET_DEV_INFO, dev_id, Some(&mut i), 0)?;
        Ok(i)
    }

    /// START_DEV, served by process `pid`: returns once every queue has
    /// fetched, with `/dev/ublkbN` created.
    pub fn start(&mut self, dev_id: u32, pid: i32) -> io::Result<()> {
        self.dev_op::<()>(sys::UBLK_U_CMD_START_DEV, dev_id, None, pid as u64)
            .map(|_| ())
    }

    /// STOP_DEV: removes `/dev/ublkbN`; queued fetches end with ABORT.
    pub fn stop(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_op::<()>(sys::UBLK_U_CMD_STOP_DEV, dev_id, None, 0)
            .map(|_| ())
    }

    /// DEL_DEV: waits until `/dev/ublkcN` is closed, then frees the id.
    pub fn del(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_op::<()>(sys::UBLK_U_CMD_DEL_DEV, dev_id, None, 0)
            .map(|_| ())
    }

    /// START_USER_RECOVERY: a device whose server died takes a new one.
    pub fn start_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_op::<()>(sys::UBLK_U_CMD_START_USER_RECOVERY, dev_id, None, 0)
            .map(|_| ())
    }

    /// END_USER_RECOVERY, served by `pid`: returns once every queue has
    /// fetched again; queued I/O resumes.
    pub fn end_recovery(&mut self, dev_id: u32, pid: i32) -> io::Result<()> {
        self.dev_op::<()>(sys::UBLK_U_CMD_END_USER_RECOVERY, dev_id, None, pid as u64)
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unprivileged_devices_commands_start_with_its_char_device_path() {
        let (b, n) = frame(7, true, 80);
        assert_eq!(n, 11);
        assert_eq!(&b[..11], b"/dev/ublkc7");
        assert_eq!(b.len(), 11 + 80);
        let (b, n) = frame(12, true, 0);
        assert_eq!((&b[..], n), (&b"/dev/ublkc12"[..], 12));
    }

    #[test]
    fn a_privileged_devices_commands_carry_the_payload_alone() {
        let (b, n) = frame(7, false, 80);
        assert_eq!((b.len(), n), (80, 0));
        assert!(frame(7, false, 0).0.is_empty());
    }
}
