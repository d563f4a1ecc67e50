//! The vhost-user-blk export against a real client: libblkio's
//! `virtio-blk-vhost-user` driver (the `blkio` crate, pure Rust), which
//! speaks vhost-user over the socket and puts virtio requests in shared
//! memory as a guest's driver would. The device is a memfd served through
//! the reactor's io_uring.

// Test support: a failed setup step is a test failure.
#![allow(clippy::unwrap_used)]

use std::any::Any;
use std::fs::File;
use std::io::Write;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use udm_core::{
    check_bio, BioPtr, BlockDevice, Caps, Channel, Error, Limits, Reactor, ReactorConfig, Ring,
    RingFd,
};
use udm_exports::vhost::{Server, ServerConfig};

const SIZE: u64 = 64 << 20;

/// A memfd, read and written through the reactor's io_uring; discard and
/// write-zeroes punch holes.
struct MemfdDev {
    file: File,
    limits: Limits,
}

impl MemfdDev {
    fn new(bytes: u64) -> Arc<MemfdDev> {
        // SAFETY: plain syscall with a NUL-terminated name; checked below.
        let fd = unsafe { libc::memfd_create(c"udm-vhost-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor we own.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(bytes).unwrap();
        Arc::new(MemfdDev {
            file,
            limits: Limits::new(bytes / 512),
        })
    }
}

struct MemfdChannel {
    dev: Arc<MemfdDev>,
    ring: Rc<Ring>,
    fd: RingFd,
}

impl BlockDevice for MemfdDev {
    fn name(&self) -> &str {
        "memfd0"
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn caps(&self) -> Caps {
        Caps::FLUSH | Caps::DISCARD | Caps::WRITE_ZEROES
    }
    fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
        let ring = reactor.ring_rc();
        let fd = ring.register_file(self.file.as_raw_fd());
        Ok(Rc::new(MemfdChannel {
            dev: self,
            ring,
            fd,
        }))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Channel for MemfdChannel {
    fn submit(&self, bio: BioPtr) {
        if let Some(bio) = check_bio(bio, &self.dev.limits, self.dev.caps()) {
            self.ring.submit_bio(self.fd, bio, 0, false, false);
        }
    }
}

/// A vhost-user-blk server on its own thread; stopped when dropped.
struct Served {
    path: PathBuf,
    _dir: TempDir,
    stop: UnixStream,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

impl Served {
    fn start(dev: Arc<MemfdDev>, queues: u16, read_only: bool) -> Served {
        let dir = TempDir::new();
        let path = dir.0.join("vhost.sock");
        let srv = Server::bind(
            dev,
            ServerConfig {
                path: path.clone(),
                queues,
                reactors: 0,
                reactor: ReactorConfig::default(),
                read_only,
            },
        )
        .unwrap();
        let (rd, stop) = UnixStream::pair().unwrap();
        let thread = std::thread::spawn(move || srv.run(rd.as_raw_fd()));
        Served {
            path,
            _dir: dir,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = (&self.stop).write_all(&[1]);
        if let Some(t) = self.thread.take() {
            t.join().unwrap().unwrap();
        }
        assert!(!self.path.exists(), "the socket is removed on stop");
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("udm-vhost-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A libblkio client with one shared buffer of 1 MiB.
struct Client {
    _b: Blkio,
    queues: Vec<Blkioq>,
    region: MemoryRegion,
}

const BUF: usize = 1 << 20;

impl Client {
    fn connect(path: &Path, queues: i32) -> Client {
        Client::try_connect(path, queues, false).unwrap()
    }

    fn try_connect(path: &Path, queues: i32, read_only: bool) -> blkio::Result<Client> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", path.to_str().unwrap())?;
        b.set_bool("read-only", read_only)?;
        b.connect()?;
        b.set_i32("num-queues", queues)?;
        let q = b.start()?.queues;
        let region = b.alloc_mem_region(BUF)?;
        b.map_mem_region(&region)?;
        Ok(Client {
            _b: b,
            queues: q,
            region,
        })
    }

    fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is BUF bytes mapped for the client's life; the
        // server writes it only during a request, which `run` waits for.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, BUF) }
    }

    fn ptr(&self, at: usize) -> *mut u8 {
        (self.region.addr + at) as *mut u8
    }

    /// Queues one request on queue `q` with `f`, waits for it; its result
    /// (0 or a negative errno).
    fn run(&mut self, q: usize, f: impl FnOnce(&mut Blkioq)) -> i32 {
        let q = &mut self.queues[q];
        f(q);
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let n = q.do_io(&mut c, 1, None, None).unwrap();
        assert_eq!(n, 1);
        // SAFETY: do_io filled the first n completions.
        unsafe { c[0].assume_init_read() }.ret
    }

    fn write(&mut self, q: usize, off: u64, at: usize, len: usize) -> i32 {
        let p = self.ptr(at);
        self.run(q, |q| q.write(off, p, len, 0, ReqFlags::empty()))
    }

    fn read(&mut self, q: usize, off: u64, at: usize, len: usize) -> i32 {
        let p = self.ptr(at);
        self.run(q, |q| q.read(off, p, len, 0, ReqFlags::empty()))
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3] ^ seed)
        .collect()
}

#[test]
fn data_written_on_one_queue_reads_back_on_the_other_after_a_flush() {
    let srv = Served::start(MemfdDev::new(SIZE), 2, false);
    let mut c = Client::connect(&srv.path, 2);
    for (q, off, seed) in [(0usize, 0u64, 1u8), (1, 1 << 20, 2), (0, SIZE - 65536, 3)] {
        let data = pattern(seed, 65536);
        c.buf()[..65536].copy_from_slice(&data);
        assert_eq!(c.write(q, off, 0, 65536), 0);
        assert_eq!(c.run(q, |q| q.flush(0, ReqFlags::empty())), 0);
        c.buf()[..65536].fill(0);
        assert_eq!(c.read(1 - q, off, 0, 65536), 0);
        assert!(
            c.buf()[..65536] == data[..],
            "read back at {off} on queue {}",
            1 - q
        );
    }
}

#[test]
fn reads_and_writes_past_the_end_fail() {
    let srv = Served::start(MemfdDev::new(SIZE), 1, false);
    let mut c = Client::connect(&srv.path, 1);
    assert_eq!(c.read(0, SIZE, 0, 4096), -libc::EIO);
    assert_eq!(c.write(0, SIZE - 4096, 0, 8192), -libc::EIO);
    // The last block is fine.
    assert_eq!(c.read(0, SIZE - 4096, 0, 4096), 0);
}

#[test]
fn discard_and_write_zeroes_leave_zeroes() {
    let srv = Served::start(MemfdDev::new(SIZE), 1, false);
    let mut c = Client::connect(&srv.path, 1);
    let data = pattern(9, 1 << 20);
    c.buf().copy_from_slice(&data);
    assert_eq!(c.write(0, 0, 0, 1 << 20), 0);
    assert_eq!(
        c.run(0, |q| q.discard(0, 256 << 10, 0, ReqFlags::empty())),
        0
    );
    assert_eq!(
        c.run(0, |q| q.write_zeroes(
            512 << 10,
            128 << 10,
            0,
            ReqFlags::empty()
        )),
        0
    );
    assert_eq!(c.read(0, 0, 0, 1 << 20), 0);
    let got = c.buf().to_vec();
    assert!(got[..256 << 10].iter().all(|&b| b == 0), "discarded");
    assert!(got[256 << 10..512 << 10] == data[256 << 10..512 << 10]);
    assert!(got[512 << 10..640 << 10].iter().all(|&b| b == 0), "zeroed");
    assert!(got[640 << 10..] == data[640 << 10..]);
}

#[test]
fn a_request_of_many_segments_lands_in_order() {
    let srv = Served::start(MemfdDev::new(SIZE), 1, false);
    let mut c = Client::connect(&srv.path, 1);
    // Eight 4 KiB pieces scattered in the buffer, written as one request.
    let data = pattern(5, 32 << 10);
    let at = |i: usize| (7 - i) * 65536 + 512;
    for i in 0..8 {
        let piece = data[i * 4096..(i + 1) * 4096].to_vec();
        c.buf()[at(i)..at(i) + 4096].copy_from_slice(&piece);
    }
    let iov: Vec<libc::iovec> = (0..8)
        .map(|i| libc::iovec {
            iov_base: c.ptr(at(i)).cast(),
            iov_len: 4096,
        })
        .collect();
    assert_eq!(
        c.run(0, |q| q.writev(8192, iov.as_ptr(), 8, 0, ReqFlags::empty())),
        0
    );
    c.buf().fill(0);
    assert_eq!(c.read(0, 8192, 0, 32 << 10), 0);
    assert!(c.buf()[..32 << 10] == data[..]);
    // And read back scattered.
    c.buf().fill(0);
    assert_eq!(
        c.run(0, |q| q.readv(8192, iov.as_ptr(), 8, 0, ReqFlags::empty())),
        0
    );
    for i in 0..8 {
        assert!(c.buf()[at(i)..at(i) + 4096] == data[i * 4096..(i + 1) * 4096]);
    }
}

#[test]
fn a_read_only_export_says_so_and_serves_reads() {
    let dev = MemfdDev::new(SIZE);
    dev.file.write_all_at_start(&pattern(4, 4096));
    let srv = Served::start(dev, 1, true);
    // The driver sees VIRTIO_BLK_F_RO: libblkio refuses a writable open.
    let e = Client::try_connect(&srv.path, 1, false).err().unwrap();
    assert_eq!(e.errno(), blkio::Errno::ROFS, "{}", e.message());
    let mut c = Client::try_connect(&srv.path, 1, true).unwrap();
    assert_eq!(c.read(0, 0, 0, 4096), 0);
    assert!(c.buf()[..4096] == pattern(4, 4096)[..]);
}

#[test]
fn a_frontend_that_goes_away_can_come_back() {
    let srv = Served::start(MemfdDev::new(SIZE), 2, false);
    let data = pattern(7, 65536);
    {
        let mut c = Client::connect(&srv.path, 2);
        c.buf()[..65536].copy_from_slice(&data);
        assert_eq!(c.write(1, 4 << 20, 0, 65536), 0);
    }
    for _ in 0..3 {
        let mut c = Client::connect(&srv.path, 2);
        assert_eq!(c.read(0, 4 << 20, 0, 65536), 0);
        assert!(c.buf()[..65536] == data[..]);
    }
}

trait WriteAt {
    fn write_all_at_start(&self, data: &[u8]);
}

impl WriteAt for File {
    fn write_all_at_start(&self, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        self.write_all_at(data, 0).unwrap();
    }
}
