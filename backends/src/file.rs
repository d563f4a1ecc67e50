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
//! - a missing regular file is created when `size` is given;
//! - [`BlockDevice::block_status`] of a regular file comes from
//!   `SEEK_DATA`/`SEEK_HOLE`: holes (and space past the end of the file)
//!   are holes, the rest data; a block device reports data throughout.

use std::any::Any;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::rc::Rc;
use std::sync::Arc;

use udm_core::{
    check_bio, push_extent, AlignedBuf, Alloc, BioFlags, BioPtr, BlockDevice, Caps, Channel, Error,
    ErrorKind, Extent, Limits, Op, Reactor, ReactorConfig, Ring, RingFd, RingKind, Status,
    SECTOR_SHIFT,
};

/// Extents one [`FileDevice`] block-status call reports at most: each costs
/// an `lseek`, on the reactor that asked, so a call stays well under a
/// millisecond; a client asks again for the rest.
const FILE_MAX_EXTENTS: usize = 128;

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
/// cache, which merges writeback itself, nor on a ram, zram, null_blk or
/// pmem device, where a request costs its copy. An O_DIRECT file on tmpfs
/// or ramfs says yes: io_uring serves its requests on its worker threads,
/// where merged ones go on fewer workers, and which of the two wins
/// depends on the host (queued 2.2x direct on one day, direct 1.7x queued
/// on another, on one 2-core host), so `auto` weighs them there
/// (`udm_core::dispatch::AutoTrial`) and keeps direct where it measures
/// faster.
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
            return (
                true,
                "file in memory (tmpfs), O_DIRECT: served by io_uring's workers".into(),
            );
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
    /// Holes and data by `SEEK_DATA`/`SEEK_HOLE` for a regular file, at most
    /// `FILE_MAX_EXTENTS` extents per call; data throughout for a block
    /// device, or a file system without them. A sector holding any data is
    /// data.
    fn block_status(&self, sector: u64, sectors: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        let end = sector
            .checked_add(sectors)
            .filter(|&e| e <= self.limits.sectors)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "file '{}': block status of {sectors} sectors at {sector} is beyond the device",
                    self.path
                ))
            })?;
        let data = |sectors| Extent {
            sectors,
            alloc: Alloc::Data,
        };
        if self.block_device {
            push_extent(out, data(sectors));
            return Ok(());
        }
        let fd = self.file.as_raw_fd();
        let seek = |sector: u64, whence| -> Result<Option<u64>, std::io::Error> {
            let off = (sector << SECTOR_SHIFT) as libc::off_t;
            // SAFETY: lseek on our own descriptor; it only moves the file
            // position, which nothing uses (the ring's I/O has offsets).
            let r = unsafe { libc::lseek(fd, off, whence) };
            if r >= 0 {
                return Ok(Some(r as u64));
            }
            match std::io::Error::last_os_error() {
                // No data (or hole) at or after the offset: past the end.
                e if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
                e => Err(e),
            }
        };
        let mut pos = sector;
        for _ in 0..FILE_MAX_EXTENTS {
            if pos >= end {
                break;
            }
            let next_data = match seek(pos, libc::SEEK_DATA) {
                Ok(d) => d.map_or(end, |b| (b >> SECTOR_SHIFT).min(end)),
                // No SEEK_DATA here (EINVAL): everything is data.
                Err(_) => {
                    push_extent(out, data(end - pos));
                    return Ok(());
                }
            };
            if next_data > pos {
                push_extent(
                    out,
                    Extent {
                        sectors: next_data - pos,
                        alloc: Alloc::Hole,
                    },
                );
                pos = next_data;
                continue;
            }
            // Data at pos (or in its sector): up to the next hole, whose
            // sector is data too if the hole starts inside it.
            let hole = match seek(pos, libc::SEEK_HOLE) {
                Ok(Some(b)) => b.div_ceil(1 << SECTOR_SHIFT).clamp(pos + 1, end),
                Ok(None) | Err(_) => end,
            };
            push_extent(out, data(hole - pos));
            pos = hole;
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    /// A sparse file on tmpfs (which has SEEK_DATA/SEEK_HOLE), removed on drop.
    struct Sparse(String);
    impl Drop for Sparse {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn extents(dev: &FileDevice, sector: u64, sectors: u64) -> Vec<(u64, Alloc)> {
        let mut out = Vec::new();
        dev.block_status(sector, sectors, &mut out).unwrap();
        out.iter().map(|e| (e.sectors, e.alloc)).collect()
    }

    /// Holes of a sparse file are holes, written blocks data (at the file
    /// system's block size, 4 KiB on tmpfs), and the space past the end of
    /// a shorter file is a hole.
    #[test]
    fn a_sparse_file_reports_its_holes() {
        let f = Sparse(format!("/dev/shm/udm-file-bs-{}", std::process::id()));
        let file = File::create(&f.0).unwrap();
        file.set_len(1 << 20).unwrap();
        file.write_all_at(&[1; 4096], 64 << 10).unwrap(); // sectors 128..136
        file.write_all_at(&[2; 1], 512 << 10).unwrap(); // its page: 1024..1032
        drop(file);
        let opts = FileOpts {
            buffered: true,
            size: Some(2 << 20),
            ..FileOpts::default()
        };
        let dev = FileDevice::open("f", &f.0, opts).unwrap();
        // The file grew to the size given (a hole).
        assert_eq!(
            extents(&dev, 0, 4096),
            vec![
                (128, Alloc::Hole),
                (8, Alloc::Data),
                (888, Alloc::Hole),
                (8, Alloc::Data),
                (3064, Alloc::Hole)
            ]
        );
        assert_eq!(extents(&dev, 130, 2), vec![(2, Alloc::Data)]);
        assert_eq!(
            extents(&dev, 132, 10),
            vec![(4, Alloc::Data), (6, Alloc::Hole)]
        );
        let mut out = Vec::new();
        assert!(
            dev.block_status(4000, 97, &mut out).is_err(),
            "beyond the end"
        );
    }

    /// A file of alternating data and holes is answered in bounded pieces.
    #[test]
    fn a_fragmented_file_is_answered_in_bounded_pieces() {
        let f = Sparse(format!("/dev/shm/udm-file-frag-{}", std::process::id()));
        let file = File::create(&f.0).unwrap();
        let blocks = 2 * FILE_MAX_EXTENTS as u64;
        file.set_len(blocks * 4096).unwrap();
        for b in (0..blocks).step_by(2) {
            file.write_all_at(&[7; 4096], b * 4096).unwrap();
        }
        drop(file);
        let opts = FileOpts {
            buffered: true,
            ..FileOpts::default()
        };
        let dev = FileDevice::open("f", &f.0, opts).unwrap();
        let got = extents(&dev, 0, blocks * 8);
        assert_eq!(got.len(), FILE_MAX_EXTENTS);
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, &(n, a))| n == 8 && a == if i % 2 == 0 { Alloc::Data } else { Alloc::Hole }));
    }
}
