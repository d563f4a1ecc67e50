//! `file`: a regular file or block device through io_uring.
//!
//! Spec: `file:<path>[,size=<size>][,buffered][,sqpoll][,iopoll][,ro]`.
//! - O_DIRECT unless `buffered`;
//! - the file is registered in each reactor's ring, and bios whose buffer is a
//!   registered one use fixed-buffer reads and writes;
//! - SQEs are batched: each reactor turn submits everything queued with one
//!   `io_uring_enter`;
//! - `sqpoll`: a kernel thread polls the submission queue;
//! - `iopoll`: completions are polled from the device; refused with a clear
//!   error when the device cannot poll (checked by a probe read at open);
//! - a missing regular file is created when `size` is given.

use std::any::Any;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::rc::Rc;
use std::sync::Arc;

use udm_core::{
    check_bio, AlignedBuf, BioFlags, BioPtr, BlockDevice, Caps, Channel, Error, ErrorKind, Limits,
    Op, Reactor, ReactorConfig, Ring, RingFd, RingKind, Status, SECTOR_SHIFT,
};

/// How to open a file device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileOpts {
    /// Use the page cache instead of O_DIRECT.
    pub buffered: bool,
    /// Submit through a kernel SQ-polling thread.
    pub sqpoll: bool,
    /// Poll for completions (needs a device with poll queues).
    pub iopoll: bool,
    /// Open read-only.
    pub read_only: bool,
    /// Size to use (and to create a missing regular file with).
    pub size: Option<u64>,
}

/// A file or block device.
pub struct FileDevice {
    name: String,
    path: String,
    file: File,
    opts: FileOpts,
    limits: Limits,
    caps: Caps,
    /// Why merging requests helps the file or not ([`medium`]).
    merge_reason: String,
    /// A block device rather than a regular file (picks how to zero).
    block_device: bool,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

impl FileDevice {
    /// Opens `path` as device `name`.
    pub fn open(name: impl Into<String>, path: &str, opts: FileOpts) -> Result<FileDevice, Error> {
        let ctx = |e: std::io::Error| Error::os(format!("file '{path}'"), e);
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.read_only);
        if !opts.buffered {
            oo.custom_flags(libc::O_DIRECT);
        }
        if opts.size.is_some() && !opts.read_only {
            oo.create(true);
        }
        let file = oo.open(path).map_err(ctx)?;
        let meta = file.metadata().map_err(ctx)?;
        let (bytes, lbs) = if meta.file_type().is_block_device() {
            let mut size: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes a u64 through the pointer, which is live.
            if unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) } < 0 {
                return Err(ctx(std::io::Error::last_os_error()));
            }
            let mut ssz: libc::c_int = 512;
            // SAFETY: BLKSSZGET writes an int through the pointer, which is live.
            unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut ssz) };
            (opts.size.map_or(size, |s| s.min(size)), ssz.max(512) as u32)
        } else if meta.file_type().is_file() {
            if let Some(s) = opts.size {
                if meta.len() < s && !opts.read_only {
                    file.set_len(s).map_err(ctx)?;
                }
            }
            (opts.size.unwrap_or(meta.len()), 512)
        } else {
            return Err(Error::invalid(format!(
                "file '{path}': not a regular file or block device"
            )));
        };
        let sectors = bytes >> SECTOR_SHIFT;
        if sectors == 0 {
            return Err(Error::invalid(format!(
                "file '{path}': empty (give a size, e.g. file:{path},size=1G, to create it)"
            )));
        }
        let mut limits = Limits::new(sectors);
        limits.logical_block_size = lbs;
        limits.physical_block_size = lbs.max(4096);
        limits.max_io_bytes = 8 << 20;
        limits.max_segments = libc::UIO_MAXIOV as u32;
        let mut caps =
            Caps::FLUSH | Caps::FUA | Caps::DISCARD | Caps::WRITE_ZEROES | Caps::PERSISTENT;
        if opts.read_only {
            caps.insert(Caps::READ_ONLY);
        }
        if opts.iopoll {
            caps.insert(Caps::POLL);
        }
        let (merge, merge_reason) = medium(&file, &meta, opts.buffered);
        if merge {
            caps.insert(Caps::MERGE);
        }
        let dev = FileDevice {
            name: name.into(),
            path: path.to_string(),
            file,
            opts,
            limits,
            caps,
            merge_reason,
            block_device: meta.file_type().is_block_device(),
        };
        if dev.opts.iopoll {
            dev.probe_iopoll()?;
        }
        Ok(dev)
    }

    /// The path opened.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Reads the first block through an IOPOLL ring; the error says plainly
    /// when the device cannot poll.
    fn probe_iopoll(&self) -> Result<(), Error> {
        if self.opts.buffered {
            return Err(Error::invalid(format!(
                "file '{}': iopoll needs O_DIRECT; drop 'buffered'",
                self.path
            )));
        }
        let reactor = Reactor::new(ReactorConfig {
            ring_entries: 8,
            ..ReactorConfig::default()
        })
        .map_err(|e| Error::os("probe ring", e))?;
        let ring = reactor
            .ring_of(RingKind {
                iopoll: true,
                sqpoll: self.opts.sqpoll,
                ..RingKind::default()
            })
            .map_err(|e| Error::os(format!("file '{}': IOPOLL ring", self.path), e))?;
        let lbs = self.limits.logical_block_size as usize;
        let mut buf = AlignedBuf::new(lbs);
        let mut bio = reactor.alloc_bio();
        // SAFETY: `buf` outlives the probe: we wait below until the bio completes.
        unsafe { bio.add_seg(buf.as_mut_ptr(), lbs) };
        let result = Rc::new(std::cell::Cell::new(None));
        let r2 = result.clone();
        bio.set_end_io(probe_done, Rc::into_raw(r2) as *mut ());
        let fd = RingFd::Raw(self.file.as_raw_fd());
        ring.submit_bio(fd, bio, 0, false, self.block_device);
        reactor.run_until(|| result.get().is_some());
        match result.get() {
            Some(Status::Ok) => Ok(()),
            Some(Status::NotSupp) => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "file '{}': the device does not support polled I/O (IOPOLL read failed with EOPNOTSUPP: it has no poll queues); drop 'iopoll'",
                    self.path
                ),
            )),
            Some(s) => Err(Error::new(
                ErrorKind::Io,
                format!("file '{}': IOPOLL probe read failed: {s}", self.path),
            )),
            None => unreachable!("run_until returned without a result"),
        }
    }
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;
/// Block devices whose names start so keep their data in memory.
const MEMORY_DISKS: [&str; 4] = ["ram", "zram", "nullb", "pmem"];

/// Whether merging requests helps I/O to `file`, and why: yes for O_DIRECT
/// to a disk, where each request is a device command (a seek on a
/// rotating disk, a round trip on a virtual one); no through the page
/// cache, which merges writeback itself, nor on memory (tmpfs, ramfs, a
/// ram, zram, null_blk or pmem device), where a request costs its copy.
fn medium(file: &File, meta: &std::fs::Metadata, buffered: bool) -> (bool, String) {
    if buffered {
        return (false, "buffered: the page cache merges".into());
    }
    if meta.file_type().is_block_device() {
        use std::os::unix::fs::MetadataExt;
        let rdev = meta.rdev();
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        let name = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        if MEMORY_DISKS.iter().any(|m| name.starts_with(m)) {
            return (false, format!("block device in memory ({name})"));
        }
        return (true, "block device, O_DIRECT".into());
    }
    // SAFETY: statfs is plain data, for which all-zero bytes are valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open for the call; fstatfs writes a statfs through
    // the pointer, which is live and of that type.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } == 0 {
        #[allow(clippy::unnecessary_cast)]
        let fs = st.f_type as i64;
        if fs == TMPFS_MAGIC || fs == RAMFS_MAGIC {
            return (false, "file in memory (tmpfs), O_DIRECT".into());
        }
    }
    (true, "file on a disk, O_DIRECT".into())
}

fn probe_done(bio: BioPtr) {
    // SAFETY: private is the Rc leaked in probe_iopoll, taken back once.
    let r = unsafe { Rc::from_raw(bio.private() as *const std::cell::Cell<Option<Status>>) };
    r.set(Some(bio.status()));
}

impl BlockDevice for FileDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn caps(&self) -> Caps {
        self.caps
    }
    fn merge_reason(&self) -> String {
        self.merge_reason.clone()
    }
    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        let raw = self.file.as_raw_fd();
        let ring = reactor.ring_rc();
        let fd = ring.register_file(raw);
        let fast = if self.opts.sqpoll || self.opts.iopoll {
            let kind = RingKind {
                sqpoll: self.opts.sqpoll,
                iopoll: self.opts.iopoll,
                ..RingKind::default()
            };
            let r = reactor
                .ring_of(kind)
                .map_err(|e| Error::os(format!("file '{}': io_uring setup", self.path), e))?;
            let rfd = r.register_file(raw);
            Some((r, rfd))
        } else {
            None
        };
        Ok(Rc::new(FileChannel {
            dev: self,
            ring,
            fd,
            fast,
        }))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct FileChannel {
    dev: Arc<FileDevice>,
    /// The reactor's ring: everything when no polling was asked for, and
    /// flush, discard and write-zeroes (which IOPOLL rings refuse) otherwise.
    ring: Rc<Ring>,
    fd: RingFd,
    /// The SQPOLL/IOPOLL ring for reads and writes, when asked for.
    fast: Option<(Rc<Ring>, RingFd)>,
}

impl Channel for FileChannel {
    #[inline]
    fn submit(&self, bio: BioPtr) {
        if let Some(bio) = check_bio(bio, &self.dev.limits, self.dev.caps) {
            // SAFETY: just checked.
            unsafe { self.submit_nocheck(bio) }
        }
    }

    #[inline]
    unsafe fn submit_nocheck(&self, bio: BioPtr) {
        let preflush = bio.flags.contains(BioFlags::PREFLUSH);
        let fua = bio.flags.contains(BioFlags::FUA);
        let (ring, fd) = match &self.fast {
            Some((r, fd)) if bio.op.has_data() && !preflush => (&**r, *fd),
            _ => (&*self.ring, self.fd),
        };
        if preflush && bio.op != Op::Flush {
            ring.submit_bio_preflush(fd, bio, 0, fua, self.dev.block_device);
        } else {
            ring.submit_bio(fd, bio, 0, fua, self.dev.block_device);
        }
    }
}
