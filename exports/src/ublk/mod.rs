//! ublk export: a udm device as a Linux block device, `/dev/ublkbN`, served
//! through the kernel's ublk driver.
//!
//! ```text
//!   mod.rs    UblkDevice: add the device (ADD_DEV, SET_PARAMS from the
//!      │      device's limits and capabilities), one thread and reactor
//!      │      per queue, START_DEV; stop: STOP_DEV, join, DEL_DEV
//!      ▼
//!   queue.rs  one queue on one reactor: FETCH_REQ / COMMIT_AND_FETCH_REQ
//!      │      URING_CMDs on the reactor's own ring (128-byte SQEs), requests
//!      │      through the export front (crate::front) as bios on that ring
//!   ctrl.rs   /dev/ublk-control's commands
//!   sys.rs    the UAPI, mirrored and checked against the kernel header
//! ```
//!
//! Devices are added with `UBLK_F_USER_RECOVERY_REISSUE`: when the serving
//! process dies, the kernel keeps `/dev/ublkbN` and queues its I/O (the
//! requests in flight are reissued) until a new process recovers it
//! ([`UblkConfig::recover`]).
//!
//! A device is privileged (root's) unless added with
//! [`UblkConfig::unprivileged`] (`UBLK_F_UNPRIVILEGED_DEV`): then it is its
//! creator's, the kernel checks each command against the creator's access
//! to `/dev/ublkcN`, and there is no crash recovery.

pub mod ctrl;
mod queue;
pub mod sys;

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use udm_core::{
    BlockDevice, Caps, Dispatch, Error, ErrorKind, Reactor, ReactorConfig, ReactorHandle,
};

use crate::front::{AutoReport, Front};
use crate::limits::{Budget, Reservation};
use ctrl::Ctrl;
pub use ctrl::NOT_AVAILABLE;
use queue::Queue;

/// Requests each queue holds by default.
pub const DEFAULT_DEPTH: u32 = 64;
/// The largest request the device takes (its per-tag buffer).
pub const MAX_IO_BYTES: u32 = 512 << 10;
/// How long a recovery waits for the kernel to let go of the dead server.
const RECOVER_WAIT: Duration = Duration::from_secs(10);
/// How long a stop waits for the queues to see the kernel's abort.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// How to serve a device over ublk.
#[derive(Clone, Copy, Debug)]
pub struct UblkConfig {
    /// The N of `/dev/ublkbN` (None: the next free).
    pub id: Option<u32>,
    /// Queues, one thread and reactor each (None: one per CPU).
    pub queues: Option<u32>,
    /// Requests each queue holds (None: [`DEFAULT_DEPTH`]).
    pub depth: Option<u32>,
    /// Refuse writes (the kernel sees a read-only disk).
    pub read_only: bool,
    /// Re-attach device `id`, left behind by a udm that died, instead of
    /// adding one.
    pub recover: bool,
    /// Add the device as an unprivileged one (`UBLK_F_UNPRIVILEGED_DEV`):
    /// it belongs to udm's user, who may command it without
    /// CAP_SYS_ADMIN once a udev rule gives them `/dev/ublkcN` and
    /// `/dev/ublkbN`. The kernel gives such a device no crash recovery,
    /// and makes the device of a caller with CAP_SYS_ADMIN privileged
    /// regardless. Off: a privileged device, commanded and (with the
    /// nodes' default mode) opened by root only.
    pub unprivileged: bool,
    /// How each queue's reactor is built (its ring gets 128-byte SQEs).
    pub reactor: ReactorConfig,
    /// How requests go to the device: `Direct` or `Queued` (each batch of
    /// requests one reap of the ring brings is sorted and merged); `Auto`
    /// follows the device's report ([`Dispatch::choose`]).
    pub dispatch: Dispatch,
}

/// A device served as `/dev/ublkbN`. Dropping it stops and deletes it.
pub struct UblkDevice {
    id: u32,
    ctrl: Ctrl,
    cdev: Option<OwnedFd>,
    stop: Arc<AtomicBool>,
    handles: Vec<ReactorHandle>,
    threads: Vec<JoinHandle<()>>,
    stopped: bool,
    /// What the queues' trials of auto dispatch run and ran.
    auto: Arc<AutoReport>,
    /// The queues' buffers, charged to the process's in-flight budget.
    _buffers: Reservation,
}

/// What a queue's thread needs.
struct QueueSpec {
    q_id: u16,
    depth: u16,
    buf_bytes: u32,
    cdev: RawFd,
    read_only: bool,
    reactor: ReactorConfig,
    dispatch: Dispatch,
    auto: Arc<AutoReport>,
    dev: Arc<dyn BlockDevice>,
    stop: Arc<AtomicBool>,
}

/// Reserves the buffers of `queues` queues of `depth` tags of `buf_bytes`.
fn reserve(
    budget: &Arc<Budget>,
    dev: &Arc<dyn BlockDevice>,
    queues: u32,
    depth: u32,
    buf_bytes: u32,
) -> Result<Reservation, Error> {
    let what = format!(
        "ublk export of '{}' ({queues} queue{} × {depth} requests × {} KiB)",
        dev.name(),
        if queues == 1 { "" } else { "s" },
        buf_bytes >> 10
    );
    budget.reserve(queues as u64 * depth as u64 * buf_bytes as u64, &what)
}

fn log2(v: u32) -> u8 {
    v.max(1).ilog2() as u8
}

/// The ublk parameters of `dev`: its size, block sizes, largest I/O,
/// discard and write-zeroes limits, volatile cache (flush, FUA) and
/// read-only state.
pub fn params(dev: &dyn BlockDevice, read_only: bool, buf_bytes: u32) -> sys::Params {
    let l = dev.limits();
    let caps = dev.caps();
    let lbs = l.logical_block_size.clamp(512, 4096).next_power_of_two();
    let pbs = l.physical_block_size.max(lbs).next_power_of_two();
    let ro = read_only || caps.contains(Caps::READ_ONLY);
    let mut attrs = 0;
    if ro {
        attrs |= sys::UBLK_ATTR_READ_ONLY;
    }
    if caps.contains(Caps::FLUSH) {
        // The front does FUA natively or as a flush after the write.
        attrs |= sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
    }
    let mut p = sys::Params {
        types: sys::UBLK_PARAM_TYPE_BASIC,
        basic: sys::ParamBasic {
            attrs,
            logical_bs_shift: log2(lbs),
            physical_bs_shift: log2(pbs),
            io_opt_shift: if l.io_opt.is_power_of_two() {
                log2(l.io_opt)
            } else {
                0
            },
            io_min_shift: log2(pbs),
            max_sectors: buf_bytes >> 9,
            chunk_sectors: 0,
            dev_sectors: l.sectors,
            virt_boundary_mask: 0,
        },
        ..sys::Params::default()
    };
    let discard = caps.contains(Caps::DISCARD);
    let zeroes = caps.contains(Caps::WRITE_ZEROES);
    if !ro && (discard || zeroes) {
        p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
        p.discard = sys::ParamDiscard {
            discard_alignment: 0,
            discard_granularity: pbs,
            max_discard_sectors: if discard { u32::MAX >> 9 } else { 0 },
            max_write_zeroes_sectors: if zeroes { u32::MAX >> 9 } else { 0 },
            max_discard_segments: 1,
            reserved0: 0,
        };
    }
    p
}

fn ctrl_err(what: &str, id: u32, e: std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::EEXIST) => Error::new(ErrorKind::Busy, format!("ublk device {id} exists")),
        Some(libc::ENODEV) | Some(libc::ENOENT) => {
            Error::new(ErrorKind::NotFound, format!("no ublk device {id}"))
        }
        _ => Error::os(format!("ublk device {id}: {what}"), e),
    }
}

/// The flags a new device is added with: crash recovery for a privileged
/// device; an unprivileged one gets none (the kernel would drop it).
pub fn add_flags(unprivileged: bool) -> u64 {
    if unprivileged {
        sys::UBLK_F_UNPRIVILEGED_DEV | sys::UBLK_F_CMD_IOCTL_ENCODE
    } else {
        sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE | sys::UBLK_F_CMD_IOCTL_ENCODE
    }
}

impl UblkDevice {
    /// Serves `dev` as a new `/dev/ublkbN` (or recovers device `cfg.id`),
    /// and returns once the block device exists.
    ///
    /// The queues' buffers (queues × depth × largest I/O) are reserved
    /// from `budget` first: a device whose buffers do not fit is refused.
    pub fn start(
        dev: Arc<dyn BlockDevice>,
        cfg: UblkConfig,
        budget: &Arc<Budget>,
    ) -> Result<UblkDevice, Error> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        let queues = cfg.queues.unwrap_or(cpus);
        if queues == 0 || queues > cpus {
            return Err(Error::invalid(format!(
                "--queues {queues}: give 1 to {cpus} (the CPUs here)"
            )));
        }
        let depth = cfg.depth.unwrap_or(DEFAULT_DEPTH);
        if depth == 0 || depth > sys::UBLK_MAX_QUEUE_DEPTH {
            return Err(Error::invalid(format!(
                "--depth {depth}: give 1 to {}",
                sys::UBLK_MAX_QUEUE_DEPTH
            )));
        }
        if cfg.recover && cfg.unprivileged {
            return Err(Error::invalid(
                "--recover: an unprivileged ublk device has no crash recovery (the kernel keeps none for it)",
            ));
        }
        if cfg.recover && cfg.id.is_none() {
            return Err(Error::invalid(
                "--recover needs --id N (the device to re-attach)",
            ));
        }
        let page = 4096;
        let buf_bytes = (dev.limits().max_io_bytes.min(MAX_IO_BYTES) / page * page).max(page);
        let mut ctrl = Ctrl::open()?;
        let read_only = cfg.read_only || dev.caps().contains(Caps::READ_ONLY);
        let (id, queues, depth, buf_bytes, buffers) = if cfg.recover {
            let id = cfg.id.unwrap_or(0);
            let info = ctrl.info(id).map_err(|e| ctrl_err("GET_DEV_INFO", id, e))?;
            let p = ctrl.params(id).map_err(|e| ctrl_err("GET_PARAMS", id, e))?;
            if p.basic.dev_sectors != dev.limits().sectors {
                return Err(Error::invalid(format!(
                    "ublk device {id} has {} sectors, '{}' {}",
                    p.basic.dev_sectors,
                    dev.name(),
                    dev.limits().sectors
                )));
            }
            let buffers = reserve(
                budget,
                &dev,
                info.nr_hw_queues as u32,
                info.queue_depth as u32,
                info.max_io_buf_bytes,
            )?;
            // The kernel takes it once the dead server's char device is
            // released (its exit finished) and the device quiesced: EBUSY
            // until then.
            let t0 = Instant::now();
            loop {
                match ctrl.start_recovery(id) {
                    Ok(()) => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && t0.elapsed() < RECOVER_WAIT =>
                    {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(e) => {
                        return Err(ctrl_err(
                            "START_USER_RECOVERY (is it live, or not left by a dead udm?)",
                            id,
                            e,
                        ))
                    }
                }
            }
            (
                id,
                info.nr_hw_queues as u32,
                info.queue_depth as u32,
                info.max_io_buf_bytes,
                buffers,
            )
        } else {
            let buffers = reserve(budget, &dev, queues, depth, buf_bytes)?;
            let mut info = sys::DevInfo {
                nr_hw_queues: queues as u16,
                queue_depth: depth as u16,
                max_io_buf_bytes: buf_bytes,
                dev_id: cfg.id.unwrap_or(u32::MAX),
                flags: add_flags(cfg.unprivileged),
                ..sys::DevInfo::default()
            };
            let want = info.dev_id;
            if let Err(e) = ctrl.add(&mut info) {
                // A device a dead server left: say how to take it back.
                let left = e.raw_os_error() == Some(libc::EEXIST)
                    && ctrl
                        .info(want)
                        .is_ok_and(|i| i.state == sys::UBLK_S_DEV_QUIESCED);
                if left {
                    return Err(Error::new(
                        ErrorKind::Busy,
                        format!("ublk device {want} was left by a server that died (--recover re-attaches it)"),
                    ));
                }
                if e.raw_os_error() == Some(libc::EPERM) && !cfg.unprivileged {
                    return Err(Error::os(
                        "ublk: ADD_DEV: only root (CAP_SYS_ADMIN) adds a privileged device; --unprivileged adds one of udm's user",
                        e,
                    ));
                }
                return Err(ctrl_err("ADD_DEV", want, e));
            }
            let id = info.dev_id;
            let unprivileged = info.flags & sys::UBLK_F_UNPRIVILEGED_DEV != 0;
            if cfg.unprivileged && !unprivileged {
                // More closed than asked, not less: said, not refused.
                tracing::warn!(
                    "ublk: --unprivileged: the kernel made device {id} privileged (udm has CAP_SYS_ADMIN): only root opens its nodes"
                );
            }
            ctrl.set_unprivileged(unprivileged);
            let mut p = params(&*dev, read_only, info.max_io_buf_bytes);
            if let Err(e) = ctrl.set_params(id, &mut p) {
                let _ = ctrl.del(id);
                return Err(ctrl_err("SET_PARAMS", id, e));
            }
            (
                id,
                info.nr_hw_queues as u32,
                info.queue_depth as u32,
                info.max_io_buf_bytes,
                buffers,
            )
        };
        let mut d = UblkDevice {
            id,
            ctrl,
            cdev: None,
            stop: Arc::new(AtomicBool::new(false)),
            handles: Vec::new(),
            threads: Vec::new(),
            stopped: false,
            auto: Arc::default(),
            _buffers: buffers,
        };
        // From here on, a failure stops and deletes the device (drop).
        let path = format!("/dev/ublkc{id}");
        let cdev: OwnedFd = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                    " (an unprivileged device's nodes are given to its owner by a udev rule: docs/ublk.md)"
                } else {
                    ""
                };
                Error::os(format!("opening {path}{hint}"), e)
            })?
            .into();
        let (tx, rx) = mpsc::channel();
        for q in 0..queues {
            let spec = QueueSpec {
                q_id: q as u16,
                depth: depth as u16,
                buf_bytes,
                cdev: cdev.as_raw_fd(),
                read_only,
                reactor: cfg.reactor,
                dispatch: cfg.dispatch,
                auto: d.auto.clone(),
                dev: dev.clone(),
                stop: d.stop.clone(),
            };
            let tx = tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("udm-ublk{id}q{q}"))
                .spawn(move || serve_queue(spec, tx))
                .map_err(|e| Error::os("spawning a ublk queue's thread", e))?;
            d.threads.push(t);
        }
        d.cdev = Some(cdev);
        drop(tx);
        for _ in 0..queues {
            match rx.recv() {
                Ok(Ok(h)) => d.handles.push(h),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::new(ErrorKind::Io, "a ublk queue's thread died")),
            }
        }
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let started = if cfg.recover {
            d.ctrl
                .end_recovery(id, pid)
                .map_err(|e| ctrl_err("END_USER_RECOVERY", id, e))
        } else {
            d.ctrl
                .start(id, pid)
                .map_err(|e| ctrl_err("START_DEV", id, e))
        };
        started?;
        tracing::info!(
            "ublk: /dev/ublkb{id} serves '{}' ({queues} queues of {depth})",
            dev.name()
        );
        Ok(d)
    }

    /// What the queues' trials of auto dispatch run and ran (where the
    /// device reports that merging helps it), kept up to date while it runs.
    pub fn auto_report(&self) -> Arc<AutoReport> {
        self.auto.clone()
    }

    /// The device's id, the N of `/dev/ublkbN`.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// `/dev/ublkbN`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.id))
    }

    /// Processes that hold `/dev/ublkbN` open (other than this one), and
    /// whether it is held exclusively (mounted, or opened with O_EXCL).
    pub fn openers(&self) -> usize {
        let path = self.path();
        let me = std::process::id().to_string();
        let mut n = 0;
        for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let name = p.file_name();
            let name = name.to_string_lossy();
            if !name.bytes().all(|b| b.is_ascii_digit()) || name == me {
                continue;
            }
            let fds = std::fs::read_dir(p.path().join("fd"))
                .into_iter()
                .flatten()
                .flatten();
            if fds
                .into_iter()
                .any(|f| std::fs::read_link(f.path()).is_ok_and(|l| l == path))
            {
                n += 1;
            }
        }
        if n == 0 {
            use std::os::unix::fs::OpenOptionsExt;
            let excl = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_EXCL)
                .open(&path);
            if excl.is_err_and(|e| e.raw_os_error() == Some(libc::EBUSY)) {
                n = 1;
            }
        }
        n
    }

    /// Stops the device: `/dev/ublkbN` goes away (I/O still queued fails),
    /// the queues end, and the device is deleted.
    pub fn stop(mut self) -> Result<(), Error> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), Error> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let id = self.id;
        let stopped = self.ctrl.stop(id).map_err(|e| ctrl_err("STOP_DEV", id, e));
        self.stop.store(true, Ordering::Release);
        // Wake the queues until they end (a sleeping reactor checks its
        // stop only when woken); one whose commands the kernel never
        // aborts gives up after STOP_WAIT.
        let give_up = Instant::now() + STOP_WAIT + Duration::from_secs(1);
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < give_up {
            for h in &self.handles {
                h.wake();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut wedged = false;
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            } else {
                wedged = true;
            }
        }
        if wedged {
            // Its queue still uses the char device: keep it open.
            std::mem::forget(self.cdev.take());
            return Err(Error::new(
                ErrorKind::TimedOut,
                format!("ublk device {id}: a queue did not stop"),
            ));
        }
        self.cdev = None;
        stopped?;
        self.ctrl.del(id).map_err(|e| ctrl_err("DEL_DEV", id, e))?;
        tracing::info!("ublk: /dev/ublkb{id} deleted");
        Ok(())
    }
}

impl Drop for UblkDevice {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!("{e}");
        }
    }
}

/// A queue's thread: its reactor, the device's channel and front on it,
/// the queue; reports its reactor's handle (or why it could not start),
/// then serves until the kernel aborts every tag.
fn serve_queue(s: QueueSpec, ready: mpsc::Sender<Result<ReactorHandle, Error>>) {
    let reactor = match Reactor::new(ReactorConfig {
        sqe128: true,
        ..s.reactor
    }) {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(Error::os("a ublk queue's reactor", e)));
            return;
        }
    };
    let started = (|| {
        let chan = s.dev.clone().open(&reactor)?;
        // SAFETY: the reactor outlives the front: both live on this
        // thread, and the queue (which holds the front) is dropped first.
        let front = unsafe { Front::new(&reactor, &*s.dev, chan) };
        front.set_report(s.auto.clone());
        front.set_dispatch(s.dispatch);
        let q = Queue::new(
            s.q_id,
            s.depth,
            s.buf_bytes,
            s.cdev,
            reactor.ring_rc(),
            reactor.work_queue(),
            front,
            s.read_only,
        )?;
        q.fetch_all()?;
        reactor.ring().submit();
        Ok::<_, Error>(q)
    })();
    let q = match started {
        Ok(q) => q,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(reactor.handle()));
    let mut deadline: Option<Instant> = None;
    reactor.run_until(|| {
        if q.finished() {
            return true;
        }
        if s.stop.load(Ordering::Acquire) {
            let d = *deadline.get_or_insert_with(|| Instant::now() + STOP_WAIT);
            return Instant::now() >= d;
        }
        false
    });
    if !q.finished() {
        // The kernel still holds commands that point at the queue: it
        // must outlive them (the process's exit ends them).
        tracing::error!(
            "ublk queue {}: the kernel did not abort its commands",
            s.q_id
        );
        std::mem::forget(q);
        std::mem::forget(reactor);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use udm_core::Limits;

    #[test]
    fn on_a_kernel_without_ublk_starting_says_so_in_one_line() {
        if std::path::Path::new(ctrl::CONTROL).exists() {
            eprintln!("skipped: this kernel has ublk");
            return;
        }
        let e = Ctrl::open().err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let msg = e.to_string();
        assert!(msg.starts_with(NOT_AVAILABLE), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn devices_are_roots_unless_unprivileged_which_have_no_recovery() {
        let root = add_flags(false);
        assert_eq!(root & sys::UBLK_F_UNPRIVILEGED_DEV, 0);
        assert_ne!(root & sys::UBLK_F_USER_RECOVERY_REISSUE, 0);
        let user = add_flags(true);
        assert_ne!(user & sys::UBLK_F_UNPRIVILEGED_DEV, 0);
        assert_eq!(
            user & (sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE),
            0
        );
        // Refused before the kernel is asked anything.
        let cfg = UblkConfig {
            id: Some(0),
            queues: Some(1),
            depth: None,
            read_only: false,
            recover: true,
            unprivileged: true,
            reactor: ReactorConfig::default(),
            dispatch: Dispatch::Auto,
        };
        let dev = Arc::new(Described(Limits::new(2048), Caps::empty()));
        let e = UblkDevice::start(dev, cfg, &Arc::new(Budget::new(64 << 20, 1)))
            .err()
            .unwrap();
        assert_eq!(e.kind(), ErrorKind::Invalid);
        assert!(
            e.to_string().starts_with("--recover: an unprivileged"),
            "{e}"
        );
    }

    /// A device that only describes itself.
    struct Described(Limits, Caps);

    impl BlockDevice for Described {
        fn name(&self) -> &str {
            "described"
        }
        fn limits(&self) -> Limits {
            self.0
        }
        fn caps(&self) -> Caps {
            self.1
        }
        fn open(self: Arc<Self>, _: &Reactor) -> Result<std::rc::Rc<dyn udm_core::Channel>, Error> {
            Err(Error::invalid("not for I/O"))
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn parameters_follow_the_devices_limits_and_capabilities() {
        let l = Limits {
            logical_block_size: 512,
            physical_block_size: 4096,
            io_opt: 65536,
            ..Limits::new(1 << 21)
        };
        let all = Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES;
        let p = params(&Described(l, all), false, 256 << 10);
        let b = p.basic;
        assert_eq!((b.logical_bs_shift, b.physical_bs_shift), (9, 12));
        assert_eq!((b.io_opt_shift, b.io_min_shift), (16, 12));
        assert_eq!((b.dev_sectors, b.max_sectors), (1 << 21, 512));
        assert_eq!(b.attrs, sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA);
        assert_eq!(
            p.types,
            sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD
        );
        assert_eq!(p.discard.discard_granularity, 4096);
        assert_eq!(p.discard.max_discard_segments, 1);
        assert!(p.discard.max_discard_sectors > 0 && p.discard.max_write_zeroes_sectors > 0);

        // No cache: no flushes or FUA; no discard: only write-zeroes.
        let p = params(&Described(l, Caps::WRITE_ZEROES), false, 256 << 10);
        assert_eq!(p.basic.attrs, 0);
        assert_eq!(p.discard.max_discard_sectors, 0);
        assert!(p.discard.max_write_zeroes_sectors > 0);

        // Read-only, asked or by the device: no discard parameters at all.
        for (caps, asked) in [(all, true), (all | Caps::READ_ONLY, false)] {
            let p = params(&Described(l, caps), asked, 256 << 10);
            assert_eq!(
                p.basic.attrs & sys::UBLK_ATTR_READ_ONLY,
                sys::UBLK_ATTR_READ_ONLY
            );
            assert_eq!(p.types, sys::UBLK_PARAM_TYPE_BASIC);
        }
    }
}
