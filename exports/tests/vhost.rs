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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use udm_core::testing::TempDir;
use udm_core::{
    check_bio, BioPtr, BlockDevice, Caps, Channel, Dispatch, Error, Limits, Op, Reactor,
    ReactorConfig, Ring, RingFd,
};
use udm_exports::limits::Budget;
use udm_exports::vhost::{Server, ServerConfig};

const SIZE: u64 = 64 << 20;

/// A memfd named `name` of `len` bytes.
fn memfd(name: &std::ffi::CStr, len: u64) -> File {
    // SAFETY: plain syscall with a NUL-terminated name; checked below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor we own.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).unwrap();
    file
}

/// A memfd, read and written through the reactor's io_uring; discard and
/// write-zeroes punch holes.
struct MemfdDev {
    file: File,
    limits: Limits,
    /// Write bios submitted.
    writes: AtomicU64,
    /// Fixed reads and writes (READ_FIXED/WRITE_FIXED) its bios made.
    fixed: AtomicU64,
}

impl MemfdDev {
    fn new(bytes: u64) -> Arc<MemfdDev> {
        let file = memfd(c"udm-vhost-test", bytes);
        Arc::new(MemfdDev {
            file,
            limits: Limits::new(bytes / 512),
            writes: AtomicU64::new(0),
            fixed: AtomicU64::new(0),
        })
    }

    /// A device of `bytes` with logical blocks of `lbs`.
    fn with_block_size(bytes: u64, lbs: u32) -> Arc<MemfdDev> {
        let mut d = Arc::into_inner(MemfdDev::new(bytes)).unwrap();
        d.limits.logical_block_size = lbs;
        d.limits.physical_block_size = lbs;
        Arc::new(d)
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
        if bio.op == Op::Write {
            self.dev.writes.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(bio) = check_bio(bio, &self.dev.limits, self.dev.caps()) {
            let before = self.ring.fixed_ops();
            self.ring.submit_bio(self.fd, bio, 0, false, false);
            let fixed = self.ring.fixed_ops() - before;
            self.dev.fixed.fetch_add(fixed, Ordering::Relaxed);
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
        Served::start_with(
            dev,
            queues,
            read_only,
            Budget::new(64 << 20, 16),
            Dispatch::Auto,
        )
    }

    fn start_dispatch(
        dev: Arc<MemfdDev>,
        queues: u16,
        read_only: bool,
        dispatch: Dispatch,
    ) -> Served {
        Served::start_with(dev, queues, read_only, Budget::new(64 << 20, 16), dispatch)
    }

    /// A server whose bounce buffers are charged to `budget`.
    fn start_with(
        dev: Arc<dyn BlockDevice>,
        queues: u16,
        read_only: bool,
        budget: Budget,
        dispatch: Dispatch,
    ) -> Served {
        let dir = TempDir::new("vhost");
        let path = dir.path("vhost.sock");
        let srv = Server::bind(
            dev,
            ServerConfig {
                path: path.clone(),
                queues,
                reactors: 0,
                reactor: ReactorConfig::default(),
                read_only,
                budget: Some(Arc::new(budget)),
                dispatch,
                access: udm_core::access::Access::OWNER,
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
        Client::try_connect_polled(path, queues, 0, read_only)
    }

    /// `queues` interrupt-driven queues, then `poll` poll queues (the
    /// driver turns the device's used-ring notifications off and polls the
    /// ring, as a guest's `virtio_blk.poll_queues`).
    fn try_connect_polled(
        path: &Path,
        queues: i32,
        poll: i32,
        read_only: bool,
    ) -> blkio::Result<Client> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", path.to_str().unwrap())?;
        b.set_bool("read-only", read_only)?;
        b.connect()?;
        b.set_i32("num-queues", queues)?;
        b.set_i32("num-poll-queues", poll)?;
        let started = b.start()?;
        let mut q = started.queues;
        q.extend(started.poll_queues);
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
fn a_poll_queue_gets_its_completions_without_a_call() {
    // Queue 0 waits on its call eventfd, queue 1 polls with the device's
    // notifications off: 32 writes in flight on the poll queue complete
    // (a server that only signalled would leave them pending: the poll
    // times out and the test fails), and read back on the other queue.
    let srv = Served::start(MemfdDev::new(SIZE), 2, false);
    let mut c = Client::try_connect_polled(&srv.path, 1, 1, false).unwrap();
    const N: usize = 32;
    const LEN: usize = 4096;
    let data = pattern(7, N * LEN);
    c.buf()[..N * LEN].copy_from_slice(&data);
    // Scattered: slot i goes to block 3 * i + 1.
    let off = |i: usize| ((3 * i + 1) * LEN) as u64;
    for i in 0..N {
        let p = c.ptr(i * LEN);
        c.queues[1].write(off(i), p, LEN, i, ReqFlags::empty());
    }
    let mut done = [const { MaybeUninit::<Completion>::uninit() }; N];
    let mut got = 0;
    while got < N {
        let mut timeout = std::time::Duration::from_secs(10);
        let n = c.queues[1]
            .do_io(&mut done[got..], 1, Some(&mut timeout), None)
            .expect("the poll queue's completions");
        for d in &done[got..got + n] {
            // SAFETY: do_io filled these n completions.
            assert_eq!(unsafe { d.assume_init_read() }.ret, 0);
        }
        got += n;
    }
    c.buf()[..N * LEN].fill(0);
    for i in 0..N {
        assert_eq!(c.read(0, off(i), i * LEN, LEN), 0);
    }
    assert!(c.buf()[..N * LEN] == data[..], "read back on queue 0");
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

/// Queued dispatch (seed 004): the requests of one kick reach the device
/// sorted and merged into fewer bios; direct hands each over as it came.
#[test]
fn queued_dispatch_merges_the_writes_of_one_kick_and_direct_does_not() {
    for (mode, merged) in [(Dispatch::Queued, true), (Dispatch::Direct, false)] {
        let dev = MemfdDev::new(SIZE);
        let srv = Served::start_dispatch(dev.clone(), 1, false, mode);
        let mut c = Client::connect(&srv.path, 1);
        let data = pattern(11, 32 << 12);
        c.buf()[..32 << 12].copy_from_slice(&data);
        // 32 adjacent 4 KiB writes, queued last first, one kick.
        let base = c.ptr(0) as usize;
        let q = &mut c.queues[0];
        for i in (0..32usize).rev() {
            let p = (base + (i << 12)) as *mut u8;
            q.write((i as u64) << 12, p, 4096, 0, ReqFlags::empty());
        }
        let mut done = [const { MaybeUninit::<Completion>::uninit() }; 32];
        assert_eq!(q.do_io(&mut done, 32, None, None).unwrap(), 32);
        for d in &done {
            // SAFETY: do_io filled all 32.
            assert_eq!(unsafe { d.assume_init_read() }.ret, 0, "{mode}");
        }
        let writes = dev.writes.load(Ordering::Relaxed);
        eprintln!("{mode}: 32 writes of 4 KiB reached the device as {writes} bios");
        if merged {
            assert!(writes < 32, "{mode}: {writes} bios");
        } else {
            assert_eq!(writes, 32, "{mode}");
        }
        c.buf().fill(0);
        assert_eq!(c.read(0, 0, 0, 32 << 12), 0);
        assert!(c.buf()[..32 << 12] == data[..], "{mode}: read back differs");
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

// ---------------------------------------------------------------------------
// A frontend that puts what it likes in its rings: the vhost crate's
// frontend sets up a queue over memory the test writes by hand.

mod hostile {
    use super::*;
    use std::time::{Duration, Instant};
    use udm_core::Mmap;
    use vhost::vhost_user::message::{
        VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures,
    };
    use vhost::vhost_user::{Frontend, VhostUserFrontend};
    use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
    use vmm_sys_util::eventfd::EventFd;

    /// Guest-physical address of the guest's memory (0 is outside it).
    const G: u64 = 0x10_0000;
    const MEM: usize = 1 << 20;
    const QSIZE: u16 = 16;
    const DESC: usize = 0;
    const AVAIL: usize = 0x1000;
    const USED: usize = 0x2000;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const F_INDIRECT: u16 = 4;

    /// A guest: its memory (a memfd mapped here), one queue set up on the
    /// server, and the count of chains it made available.
    struct Guest {
        fe: Option<Frontend>,
        mem: Mmap,
        _memfd: File,
        kick: EventFd,
        call: EventFd,
        avail: u16,
        /// Negotiate VIRTIO_RING_F_EVENT_IDX (off unless set before attach).
        event_idx: bool,
    }

    impl Guest {
        fn connect(path: &Path) -> Guest {
            let mut g = Guest::memory();
            g.attach(path, None, 0);
            g
        }

        /// The guest's memory and eventfds, no frontend yet.
        fn memory() -> Guest {
            let memfd = memfd(c"guest", MEM as u64);
            let mem = map_area(&memfd, MEM as u64);
            Guest {
                fe: None,
                mem,
                _memfd: memfd,
                // Non-blocking, as QEMU makes its kick eventfds.
                kick: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                call: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                avail: 0,
                event_idx: false,
            }
        }

        /// Connects a frontend (after dropping the one before) and starts
        /// the queue at `base`. With `inflight`, it negotiates
        /// INFLIGHT_SHMFD: an empty slot gets a new area from the server
        /// (GET_INFLIGHT_FD), a full one is handed back as it is, as QEMU
        /// does after a backend restart (SET_INFLIGHT_FD).
        fn attach(
            &mut self,
            path: &Path,
            inflight: Option<&mut Option<(VhostUserInflight, File)>>,
            base: u16,
        ) {
            self.fe = None;
            let mem = self.mem.as_ptr();
            let mut fe = Frontend::connect(path, 1).unwrap();
            fe.set_owner().unwrap();
            let f = fe.get_features().unwrap();
            let event_idx = if self.event_idx { 1 << 29 } else { 0 };
            fe.set_features(f & !(1 << 29) | f & event_idx).unwrap();
            let p = fe.get_protocol_features().unwrap();
            let want = if inflight.is_some() {
                VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            } else {
                VhostUserProtocolFeatures::REPLY_ACK
            };
            fe.set_protocol_features(p & want).unwrap();
            if let Some(slot) = inflight {
                if slot.is_none() {
                    let ask = VhostUserInflight::new(0, 0, 1, QSIZE);
                    *slot = Some(fe.get_inflight_fd(&ask).unwrap());
                }
                let (info, file) = slot.as_ref().unwrap();
                fe.set_inflight_fd(info, file.as_raw_fd()).unwrap();
            }
            let region = VhostUserMemoryRegionInfo {
                guest_phys_addr: G,
                memory_size: MEM as u64,
                userspace_addr: mem as u64,
                mmap_offset: 0,
                mmap_handle: self._memfd.as_raw_fd(),
            };
            fe.set_mem_table(&[region]).unwrap();
            fe.set_vring_num(0, QSIZE).unwrap();
            let va = |off: usize| mem as u64 + off as u64;
            fe.set_vring_addr(
                0,
                &VringConfigData {
                    queue_max_size: QSIZE,
                    queue_size: QSIZE,
                    flags: 0,
                    desc_table_addr: va(DESC),
                    used_ring_addr: va(USED),
                    avail_ring_addr: va(AVAIL),
                    log_addr: None,
                },
            )
            .unwrap();
            fe.set_vring_base(0, base).unwrap();
            fe.set_vring_call(0, &self.call).unwrap();
            fe.set_vring_kick(0, &self.kick).unwrap();
            fe.set_vring_enable(0, true).unwrap();
            self.fe = Some(fe);
        }

        /// Moves the guest's memory to a new memfd holding a copy of it
        /// (rings included) and sends the new table (SET_MEM_TABLE, same
        /// guest address) while the queue runs. The old memory stays
        /// mapped here as long as the returned mapping.
        fn move_memory(&mut self) -> Mmap {
            let memfd = memfd(c"guest2", MEM as u64);
            let mem = map_area(&memfd, MEM as u64);
            // SAFETY: two distinct live mappings of MEM bytes; nothing is
            // in flight (requests are waited for).
            unsafe { std::ptr::copy_nonoverlapping(self.mem.as_ptr(), mem.as_ptr(), MEM) };
            let old = std::mem::replace(&mut self.mem, mem);
            self._memfd = memfd;
            self.send_mem_table(MEM as u64);
            old
        }

        /// Sends a one-region table: the first `len` bytes of the guest's
        /// memfd and mapping at guest address G. Answered (REPLY_ACK) once
        /// udm's reactors took it, as QEMU asks: requests made after use
        /// the new table.
        fn send_mem_table(&mut self, len: u64) {
            let region = VhostUserMemoryRegionInfo {
                guest_phys_addr: G,
                memory_size: len,
                userspace_addr: self.mem.as_ptr() as u64,
                mmap_offset: 0,
                mmap_handle: self._memfd.as_raw_fd(),
            };
            let fe = self.fe.as_mut().unwrap();
            fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            fe.set_mem_table(&[region]).unwrap();
            fe.set_hdr_flags(VhostUserHeaderFlag::empty());
        }

        /// Makes the chain at `head` available and kicks, without waiting.
        fn make_available(&mut self, head: u16) {
            let slot = AVAIL + 4 + (self.avail % QSIZE) as usize * 2;
            self.write(slot, &head.to_le_bytes());
            self.avail = self.avail.wrapping_add(1);
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            self.write(AVAIL + 2, &self.avail.to_le_bytes());
            self.kick.write(1).unwrap();
        }

        fn write(&self, off: usize, bytes: &[u8]) {
            assert!(off + bytes.len() <= MEM);
            // SAFETY: inside the mapping (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    self.mem.as_ptr().add(off),
                    bytes.len(),
                )
            };
        }

        fn read(&self, off: usize, len: usize) -> Vec<u8> {
            let mut v = vec![0u8; len];
            // SAFETY: as in write.
            unsafe {
                std::ptr::copy_nonoverlapping(self.mem.as_ptr().add(off), v.as_mut_ptr(), len)
            };
            v
        }

        fn desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
            let mut d = Vec::new();
            d.extend_from_slice(&addr.to_le_bytes());
            d.extend_from_slice(&len.to_le_bytes());
            d.extend_from_slice(&flags.to_le_bytes());
            d.extend_from_slice(&next.to_le_bytes());
            self.write(DESC + i as usize * 16, &d);
        }

        /// A request header at `off`.
        fn header(&self, off: usize, kind: u32, sector: u64) {
            let mut h = kind.to_le_bytes().to_vec();
            h.extend_from_slice(&[0; 4]);
            h.extend_from_slice(&sector.to_le_bytes());
            self.write(off, &h);
        }

        fn used_idx(&self) -> u16 {
            let b = self.read(USED + 2, 2);
            u16::from_le_bytes([b[0], b[1]])
        }

        /// Makes the chain at `head` available, kicks, and waits for it in
        /// the used ring; its used element's (id, len).
        fn submit(&mut self, head: u16) -> (u32, u32) {
            self.make_available(head);
            let t0 = Instant::now();
            while self.used_idx() != self.avail {
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "chain {head} never used"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            let e = self.read(USED + 4 + ((self.avail - 1) % QSIZE) as usize * 8, 8);
            (
                u32::from_le_bytes(e[0..4].try_into().unwrap()),
                u32::from_le_bytes(e[4..8].try_into().unwrap()),
            )
        }

        /// A three-descriptor request of `kind` at `sector` from head 0:
        /// header at 0x3000, data (`len`, `data_flags`) at 0x4000, status
        /// at 0x3800. Its status byte and used length.
        fn request(&mut self, kind: u32, sector: u64, len: u32, data_flags: u16) -> (u8, u32) {
            self.header(0x3000, kind, sector);
            self.write(0x3800, &[0xff]);
            self.desc(0, G + 0x3000, 16, F_NEXT, 1);
            self.desc(1, G + 0x4000, len, data_flags | F_NEXT, 2);
            self.desc(2, G + 0x3800, 1, F_WRITE, 0);
            let (id, used) = self.submit(0);
            assert_eq!(id, 0);
            (self.read(0x3800, 1)[0], used)
        }
    }

    /// Each new memory table (another memfd at the same guest address,
    /// sent while the queue runs) is the one the fixed I/O reads and
    /// writes: not the pages registered for the table before, even where
    /// udm's new mapping lands on addresses an old one had.
    #[test]
    fn fixed_io_follows_each_new_memory_table() {
        let dev = MemfdDev::new(SIZE);
        let srv = Served::start(dev.clone(), 1, false);
        let mut g = Guest::connect(&srv.path);
        let block = |seed: u8| pattern(seed, 4096);
        g.write(0x4000, &block(1));
        assert_eq!(g.request(1, 0, 4096, 0), (0, 1));
        for round in 0..6u8 {
            let old = g.move_memory();
            // What the old memory holds from now on must not reach the
            // device, and the device's data must not land in it.
            poke(&old, 0x4000, &block(0xee));
            let seed = 2 + round;
            g.write(0x4000, &block(seed));
            let sector = 8 * (round as u64 + 1);
            assert_eq!(g.request(1, sector, 4096, 0), (0, 1), "round {round}");
            g.write(0x4000, &[0; 4096]);
            assert_eq!(g.request(0, 0, 4096, F_WRITE), (0, 4097), "round {round}");
            assert!(
                g.read(0x4000, 4096) == block(1),
                "round {round}: read into the new memory"
            );
            assert_eq!(g.request(0, sector, 4096, F_WRITE).0, 0);
            assert!(
                g.read(0x4000, 4096) == block(seed),
                "round {round}: the write took the new memory's data"
            );
            assert!(
                peek::<4096>(&old, 0x4000)[..] == block(0xee)[..],
                "round {round}: old memory untouched"
            );
            // Unmapped here; udm has its own mapping.
            drop(old);
        }
        let (writes, fixed) = (
            dev.writes.load(Ordering::Relaxed),
            dev.fixed.load(Ordering::Relaxed),
        );
        assert_eq!(writes, 7);
        assert_eq!(fixed, 7 + 12, "every read and write went fixed");
    }

    /// A ring that breaks mid-batch still sends what it took: with
    /// EVENT_IDX, a used ring left out of a new memory table shows only
    /// when notifications go back on, after the kick's chains were taken;
    /// the write queued dispatch held from that batch reaches the device,
    /// and the queue then stops at once (nothing left in flight).
    #[test]
    fn a_write_taken_before_the_ring_breaks_reaches_the_device_and_the_queue_stops() {
        use std::os::unix::fs::FileExt;
        let dev = MemfdDev::new(SIZE);
        let srv = Served::start_dispatch(dev.clone(), 1, false, Dispatch::Queued);
        let mut g = Guest::memory();
        g.event_idx = true;
        g.attach(&srv.path, None, 0);
        // Descriptors and avail ring stay in the table, the used ring
        // (at USED = 0x2000) does not.
        g.send_mem_table(USED as u64);
        let data = pattern(9, 512);
        g.header(0x1100, 1, 8);
        g.write(0x1200, &[0xff]);
        g.write(0x1800, &data);
        g.desc(0, G + 0x1100, 16, F_NEXT, 1);
        g.desc(1, G + 0x1800, 512, F_NEXT, 2);
        g.desc(2, G + 0x1200, 1, F_WRITE, 0);
        g.make_available(0);
        let t0 = Instant::now();
        let mut got = vec![0u8; 512];
        loop {
            dev.file.read_exact_at(&mut got, 8 * 512).unwrap();
            if got == data {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the write taken before the ring broke never reached the device"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let t0 = Instant::now();
        g.fe.as_mut().unwrap().get_vring_base(0).unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the queue stops without waiting"
        );
    }

    /// A queue is polled, with kicks off, only while its reactor has
    /// work: before the reactor sleeps it asks the driver to kick again
    /// (no NO_NOTIFY flag in the used ring; with EVENT_IDX, `avail_event`
    /// at the avail index), so the next request wakes it.
    #[test]
    fn an_idle_queue_asks_the_driver_to_kick_again() {
        for event_idx in [false, true] {
            let srv = Served::start(MemfdDev::new(SIZE), 1, false);
            let mut g = Guest::memory();
            g.event_idx = event_idx;
            g.attach(&srv.path, None, 0);
            for sector in 0..3 {
                assert_eq!(g.request(0, sector, 512, F_WRITE), (0, 513));
                let t0 = Instant::now();
                loop {
                    let flags = u16::from_le_bytes(g.read(USED, 2).try_into().unwrap());
                    let at = USED + 4 + QSIZE as usize * 8;
                    let avail_event = u16::from_le_bytes(g.read(at, 2).try_into().unwrap());
                    if event_idx && avail_event == g.avail || !event_idx && flags & 1 == 0 {
                        break;
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(10),
                        "event_idx {event_idx}: kicks still off (flags {flags}, avail_event {avail_event})"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// The chains of one kick come back as used elements naming each
    /// head with its length, the used index at their end; with EVENT_IDX
    /// the driver is called exactly when the used index passes the
    /// used_event it wrote: not for a batch that stops short of it, once
    /// for a batch that crosses it (whatever turns its completions take),
    /// the indexes wrapping past 65535.
    #[test]
    fn a_batch_lands_whole_in_the_used_ring_and_calls_exactly_when_event_idx_says() {
        let srv = Served::start(MemfdDev::new(SIZE), 1, false);
        let mut g = Guest::memory();
        g.event_idx = true;
        let used_event_at = AVAIL + 4 + 2 * QSIZE as usize;
        // The ring resumes two short of the indexes' wrap.
        let base = 65534u16;
        let at = |n: u16| base.wrapping_add(n).to_le_bytes();
        g.write(AVAIL + 2, &at(0));
        g.write(USED + 2, &at(0));
        g.avail = base;
        // Far ahead: nothing calls but the queue's start (one call).
        g.write(used_event_at, &at(100));
        g.attach(&srv.path, None, base);
        let heads = [0u16, 3, 6, 9];
        for (i, &h) in heads.iter().enumerate() {
            let base = 0x3000 + i * 0x100;
            g.header(base, 0, 8 * i as u64);
            g.write(base + 0x80, &[0xff]);
            g.desc(h, G + base as u64, 16, F_NEXT, h + 1);
            g.desc(
                h + 1,
                G + 0x10000 + i as u64 * 0x1000,
                512,
                F_WRITE | F_NEXT,
                h + 2,
            );
            g.desc(h + 2, G + base as u64 + 0x80, 1, F_WRITE, 0);
        }
        let batch = |g: &mut Guest| {
            for &h in &heads {
                let slot = AVAIL + 4 + (g.avail % QSIZE) as usize * 2;
                g.write(slot, &h.to_le_bytes());
                g.avail = g.avail.wrapping_add(1);
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            g.write(AVAIL + 2, &g.avail.to_le_bytes());
            g.kick.write(1).unwrap();
            let t0 = Instant::now();
            while g.used_idx() != g.avail {
                assert!(t0.elapsed() < Duration::from_secs(10), "batch never used");
                std::thread::sleep(Duration::from_millis(1));
            }
            let mut got: Vec<(u32, u32)> = (1..=4u16)
                .map(|k| {
                    let i = g.avail.wrapping_sub(k);
                    let e = g.read(USED + 4 + (i % QSIZE) as usize * 8, 8);
                    (
                        u32::from_le_bytes(e[0..4].try_into().unwrap()),
                        u32::from_le_bytes(e[4..8].try_into().unwrap()),
                    )
                })
                .collect();
            got.sort_unstable();
            let want: Vec<(u32, u32)> = heads.iter().map(|&h| (h as u32, 513)).collect();
            assert_eq!(got, want, "used elements after index {}", g.avail);
            for i in 0..4 {
                assert_eq!(g.read(0x3000 + i * 0x100 + 0x80, 1)[0], 0, "status {i}");
            }
        };
        let calls = |g: &Guest, want: u64| {
            let mut n = 0;
            let t0 = Instant::now();
            while n < want {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "{n} calls of {want}"
                );
                n += g.call.read().unwrap_or(0);
                std::thread::sleep(Duration::from_millis(1));
            }
            // Nothing more comes (a call made late would show here).
            std::thread::sleep(Duration::from_millis(100));
            n + g.call.read().unwrap_or(0)
        };
        // Used index +0 -> +4, used_event +100: only the start's call.
        batch(&mut g);
        // +4 -> +8 passes used_event +5: one call.
        g.write(used_event_at, &at(5));
        batch(&mut g);
        assert_eq!(calls(&g, 2), 2, "the start's call and the crossing's");
        // +8 -> +12, used_event +5 behind: none; +12 -> +16 passes +15
        // at its last element: one.
        batch(&mut g);
        g.write(used_event_at, &at(15));
        batch(&mut g);
        assert_eq!(calls(&g, 1), 1, "the second crossing's call");
        assert_eq!(g.used_idx(), base.wrapping_add(16));
    }

    #[test]
    fn malformed_chains_are_answered_with_errors_and_the_queue_goes_on() {
        let srv = Served::start(MemfdDev::new(SIZE), 1, false);
        let mut g = Guest::connect(&srv.path);
        // A good read: status OK, 512 bytes and the status written.
        assert_eq!(g.request(0, 0, 512, F_WRITE), (0, 513));
        // Past the end of the device: an I/O error.
        assert_eq!(g.request(0, SIZE / 512, 512, F_WRITE).0, 1);
        // A write whose data the device would have to write: an error.
        assert_eq!(g.request(1, 0, 512, F_WRITE).0, 1);
        // An unknown type: unsupported.
        assert_eq!(g.request(99, 0, 512, 0).0, 2);

        // Chains that cannot carry a status come back with nothing
        // written, and nothing is touched outside the guest's memory:
        // data outside it (below it, and past its end),
        for addr in [0x1000, G + MEM as u64 - 256] {
            g.header(0x3000, 0, 0);
            g.desc(3, G + 0x3000, 16, F_NEXT, 4);
            g.desc(4, addr, 512, F_WRITE | F_NEXT, 5);
            g.desc(5, G + 0x3800, 1, F_WRITE, 0);
            assert_eq!(g.submit(3), (3, 0), "data at {addr:#x}");
        }
        // a loop (the walk stops after the ring's size),
        g.desc(6, G + 0x3000, 16, F_NEXT, 7);
        g.desc(7, G + 0x4000, 512, F_WRITE | F_NEXT, 6);
        assert_eq!(g.submit(6), (6, 0));
        // an indirect table outside the memory, and one inside an
        // indirect table,
        g.desc(8, 0x10, 48, F_INDIRECT, 0);
        assert_eq!(g.submit(8), (8, 0));
        g.desc(9, G + 0x5000, 48, F_INDIRECT, 0);
        let mut t = Vec::new();
        for (a, l, f, n) in [
            (G + 0x3000, 16u32, F_NEXT, 1u16),
            (G + 0x6000, 48, F_INDIRECT | F_NEXT, 2),
            (G + 0x3800, 1, F_WRITE, 0),
        ] {
            t.extend_from_slice(&a.to_le_bytes());
            t.extend_from_slice(&l.to_le_bytes());
            t.extend_from_slice(&f.to_le_bytes());
            t.extend_from_slice(&n.to_le_bytes());
        }
        g.write(0x5000, &t);
        let (id, _) = g.submit(9);
        assert_eq!(id, 9);
        // a header cut short.
        g.desc(10, G + 0x3000, 8, F_NEXT, 11);
        g.desc(11, G + 0x3800, 1, F_WRITE, 0);
        assert_eq!(g.submit(10), (10, 0));

        // The queue still serves good requests.
        assert_eq!(g.request(0, 8, 4096, F_WRITE), (0, 4097));
        drop(g);
        // And the next frontend is served.
        let mut c = Client::connect(&srv.path, 1);
        assert_eq!(c.read(0, 0, 0, 4096), 0);
    }

    #[test]
    fn many_sub_block_segments_land_in_order_within_a_small_bounce_budget() {
        // 4 KiB blocks and a 16 KiB budget: 64 segments of 512 bytes at
        // byte 512 are 64 read-modify-writes over 9 blocks, at most a few
        // bounce buffers at a time.
        let dev = MemfdDev::with_block_size(SIZE, 4096);
        let srv = Served::start_with(dev, 1, false, Budget::new(16 << 10, 1), Dispatch::Auto);
        let mut g = Guest::connect(&srv.path);
        let data = pattern(7, 64 * 512);
        g.write(0x10000, &data);
        g.header(0x3000, 1, 1);
        g.write(0x3800, &[0xff]);
        let mut t = Vec::new();
        let mut entry = |a: u64, l: u32, f: u16, n: u16| {
            t.extend_from_slice(&a.to_le_bytes());
            t.extend_from_slice(&l.to_le_bytes());
            t.extend_from_slice(&f.to_le_bytes());
            t.extend_from_slice(&n.to_le_bytes());
        };
        entry(G + 0x3000, 16, F_NEXT, 1);
        for i in 0..64u16 {
            entry(G + 0x10000 + i as u64 * 512, 512, F_NEXT, i + 2);
        }
        entry(G + 0x3800, 1, F_WRITE, 0);
        g.write(0x8000, &t);
        g.desc(12, G + 0x8000, t.len() as u32, F_INDIRECT, 0);
        assert_eq!(g.submit(12), (12, 1));
        assert_eq!(g.read(0x3800, 1)[0], 0, "status");
        // Read the blocks back: the 64 pieces, in order, after 512 zeroes.
        assert_eq!(g.request(0, 0, 40960, F_WRITE), (0, 40961));
        let got = g.read(0x4000, 40960);
        assert!(got[..512].iter().all(|&b| b == 0));
        assert!(got[512..512 + data.len()] == data[..]);
    }

    /// A shared read-write mapping of `len` bytes of `file`: the guest's
    /// memory, or an inflight area for the test to look at and write as a
    /// crashed backend would have left it.
    fn map_area(file: &File, len: u64) -> Mmap {
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        Mmap::fd(file.as_raw_fd(), 0, len as usize, rw, libc::MAP_SHARED).unwrap()
    }

    fn peek<const N: usize>(m: &Mmap, off: usize) -> [u8; N] {
        assert!(off + N <= m.len());
        let mut b = [0u8; N];
        // SAFETY: inside the live mapping (checked above).
        unsafe { std::ptr::copy_nonoverlapping(m.as_ptr().add(off), b.as_mut_ptr(), N) };
        b
    }

    fn poke(m: &Mmap, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= m.len());
        // SAFETY: as in peek.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), m.as_ptr().add(off), bytes.len()) };
    }

    /// Area offsets (QEMU's split layout): the header's used_idx and
    /// last_batch_head, and descriptor `h`'s inflight flag and counter.
    const A_USED_IDX: usize = 14;
    const A_LAST_BATCH_HEAD: usize = 12;
    fn a_desc(h: u16) -> usize {
        16 + 16 * h as usize
    }

    #[test]
    fn a_frontend_back_with_its_inflight_area_gets_what_was_left_in_flight_done_once_in_order() {
        let srv = Served::start(MemfdDev::new(SIZE), 1, false);
        let mut g = Guest::memory();
        let mut area = None;
        g.attach(&srv.path, Some(&mut area), 0);
        let (info, file) = area.as_ref().unwrap();
        assert_eq!((info.num_queues, info.queue_size), (1, QSIZE));
        assert!(info.mmap_size >= 16 + 16 * QSIZE as u64);
        let a = map_area(file, info.mmap_size);
        // A write through the queue: unmarked once answered, used_idx 1;
        // the area was stamped (version 1, desc_num) as the queue started.
        g.write(0x4000, &[0xa1; 512]);
        assert_eq!(g.request(1, 0, 512, 0), (0, 1));
        assert_eq!(peek::<2>(&a, 8), 1u16.to_le_bytes());
        assert_eq!(peek::<2>(&a, 10), QSIZE.to_le_bytes());
        assert_eq!(peek::<1>(&a, a_desc(0)), [0]);
        assert_eq!(peek::<2>(&a, A_USED_IDX), 1u16.to_le_bytes());

        // The backend "dies" having taken three writes: heads 6, 9 and 3,
        // in that order (counters 7, 8, 9). 9 was put on the used ring
        // (used index 2) but its mark not yet cleared. 6 and 3 write the
        // same sector: the one taken last must win.
        g.fe = None;
        for (head, hdr, data, status, fill, sector) in [
            (6u16, 0x3100, 0x5000, 0x3900, 0xb6u8, 8u64),
            (9, 0x3200, 0x5200, 0x3a00, 0xb9, 24),
            (3, 0x3300, 0x5400, 0x3b00, 0xb3, 8),
        ] {
            g.header(hdr, 1, sector);
            g.write(data, &[fill; 512]);
            g.write(status, &[0xff]);
            g.desc(head, G + hdr as u64, 16, F_NEXT, head + 1);
            g.desc(head + 1, G + data as u64, 512, F_NEXT, head + 2);
            g.desc(head + 2, G + status as u64, 1, F_WRITE, 0);
        }
        for (pos, head) in [(1usize, 6u16), (2, 9), (3, 3)] {
            g.write(AVAIL + 4 + pos * 2, &head.to_le_bytes());
        }
        g.avail = 4;
        g.write(AVAIL + 2, &4u16.to_le_bytes());
        g.write(USED + 4 + 8, &[9, 0, 0, 0, 1, 0, 0, 0]);
        g.write(USED + 2, &2u16.to_le_bytes());
        for (head, counter) in [(6u16, 7u64), (9, 8), (3, 9)] {
            poke(&a, a_desc(head), &[1]);
            poke(&a, a_desc(head) + 8, &counter.to_le_bytes());
        }
        poke(&a, A_LAST_BATCH_HEAD, &9u16.to_le_bytes());

        // Back, as QEMU comes back: the same area, the ring from its used
        // index. 6 and 3 are done (and answered), 9 is not done again.
        g.attach(&srv.path, Some(&mut area), 2);
        let t0 = Instant::now();
        while g.used_idx() != 4 {
            assert!(t0.elapsed() < Duration::from_secs(5), "never resubmitted");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut ids: Vec<u8> = (2..4).map(|i| g.read(USED + 4 + i * 8, 1)[0]).collect();
        ids.sort();
        assert_eq!(ids, [3, 6]);
        assert_eq!(g.read(0x3900, 1)[0], 0, "head 6 answered");
        assert_eq!(g.read(0x3b00, 1)[0], 0, "head 3 answered");
        assert_eq!(g.read(0x3a00, 1)[0], 0xff, "head 9 not done again");
        for h in [3, 6, 9] {
            assert_eq!(peek::<1>(&a, a_desc(h)), [0], "head {h} unmarked");
        }
        assert_eq!(peek::<2>(&a, A_USED_IDX), 4u16.to_le_bytes());
        // New requests go on after them: sector 8 holds the later write,
        // sector 24 what it held (9 was never done).
        assert_eq!(g.request(0, 8, 512, F_WRITE), (0, 513));
        let got = g.read(0x4000, 512);
        assert!(
            got.iter().all(|&b| b == 0xb3),
            "sector 8 holds {:#x}, not the write taken last (0xb3)",
            got[0]
        );
        assert_eq!(g.request(0, 24, 512, F_WRITE), (0, 513));
        assert_eq!(g.read(0x4000, 512), vec![0; 512]);
    }

    /// With EVENT_IDX the driver is called only when the used index
    /// crosses the used_event it wrote. A backend killed after putting
    /// the crossing element on the used ring and before calling leaves a
    /// driver that no later element calls (they all lie past the
    /// crossing): the backend that takes the ring over (a new server, as
    /// a restarted udm) calls it once, whatever used_event says.
    #[test]
    fn a_frontend_back_is_called_for_what_a_killed_backend_used_and_did_not_tell() {
        let srv = Served::start(MemfdDev::new(SIZE), 1, false);
        let mut g = Guest::memory();
        g.event_idx = true;
        let mut area = None;
        g.attach(&srv.path, Some(&mut area), 0);
        let (info, file) = area.as_ref().unwrap();
        let a = map_area(file, info.mmap_size);
        g.write(0x4000, &[0xa1; 512]);
        assert_eq!(g.request(1, 0, 512, 0), (0, 1));

        // The driver took that one and wants a call for the next one
        // (used_event 1). The backend "dies" having taken heads 6 and 3
        // (counters 1 and 2): 6 answered (used index 2: the crossing)
        // without the call, 3 still in flight. (Its server is stopped
        // first, so that every call it made was made.)
        g.fe = None;
        drop(srv);
        g.write(AVAIL + 4 + 2 * QSIZE as usize, &1u16.to_le_bytes());
        for (head, hdr, data, status, sector) in [
            (6u16, 0x3100, 0x5000, 0x3900, 8u64),
            (3, 0x3300, 0x5400, 0x3b00, 16),
        ] {
            g.header(hdr, 1, sector);
            g.write(data, &[0xc3; 512]);
            g.write(status, &[0xff]);
            g.desc(head, G + hdr as u64, 16, F_NEXT, head + 1);
            g.desc(head + 1, G + data as u64, 512, F_NEXT, head + 2);
            g.desc(head + 2, G + status as u64, 1, F_WRITE, 0);
        }
        for (pos, head) in [(1usize, 6u16), (2, 3)] {
            g.write(AVAIL + 4 + pos * 2, &head.to_le_bytes());
        }
        g.avail = 3;
        g.write(AVAIL + 2, &3u16.to_le_bytes());
        g.write(0x3900, &[0]);
        g.write(USED + 4 + 8, &[6, 0, 0, 0, 1, 0, 0, 0]);
        g.write(USED + 2, &2u16.to_le_bytes());
        poke(&a, a_desc(6) + 8, &1u64.to_le_bytes());
        poke(&a, a_desc(3), &[1]);
        poke(&a, a_desc(3) + 8, &2u64.to_le_bytes());
        poke(&a, A_LAST_BATCH_HEAD, &6u16.to_le_bytes());
        poke(&a, A_USED_IDX, &2u16.to_le_bytes());
        // What the first server's calls left.
        let _ = g.call.read();

        let srv = Served::start(MemfdDev::new(SIZE), 1, false);
        g.attach(&srv.path, Some(&mut area), 2);
        let t0 = Instant::now();
        while g.used_idx() != 3 {
            assert!(t0.elapsed() < Duration::from_secs(10), "never resubmitted");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(g.read(0x3b00, 1)[0], 0, "head 3 answered");
        // A hang detector: the call comes at once, or never.
        while g.call.read().is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the driver was never called: it would wait for heads 6 and 3 forever"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

// ---------------------------------------------------------------------------
// Guest memory registered with the reactors' io_uring: a file backend reads
// and writes guest buffers with READ_FIXED / WRITE_FIXED.

mod fixed {
    use super::*;
    use udm_backends::file::{FileDevice, FileOpts};

    /// The file backend, counting its data bios and the fixed ops they
    /// made on the reactor's ring (the count the ring keeps, read on the
    /// reactor's thread around each submission).
    struct Counted {
        file: Arc<FileDevice>,
        data_bios: AtomicU64,
        fixed: AtomicU64,
    }

    struct CountedChannel {
        dev: Arc<Counted>,
        inner: Rc<dyn Channel>,
        ring: Rc<Ring>,
    }

    impl BlockDevice for Counted {
        fn name(&self) -> &str {
            "counted"
        }
        fn limits(&self) -> Limits {
            self.file.limits()
        }
        fn caps(&self) -> Caps {
            self.file.caps()
        }
        fn open(self: Arc<Self>, reactor: &Reactor) -> Result<Rc<dyn Channel>, Error> {
            let inner = self.file.clone().open(reactor)?;
            Ok(Rc::new(CountedChannel {
                dev: self,
                inner,
                ring: reactor.ring_rc(),
            }))
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    impl Channel for CountedChannel {
        fn submit(&self, bio: BioPtr) {
            let data = bio.op.has_data();
            let before = self.ring.fixed_ops();
            self.inner.submit(bio);
            let fixed = self.ring.fixed_ops() - before;
            if data {
                self.dev.data_bios.fetch_add(1, Ordering::Relaxed);
            }
            self.dev.fixed.fetch_add(fixed, Ordering::Relaxed);
        }
    }

    impl Counted {
        /// A file of SIZE in a fresh directory, O_DIRECT unless `buffered`.
        fn new(dir: &TempDir, buffered: bool) -> Arc<Counted> {
            let path = dir.path("disk.img");
            let opts = FileOpts {
                buffered,
                size: Some(SIZE),
                ..FileOpts::default()
            };
            let file = FileDevice::open("f0", path.to_str().unwrap(), opts).unwrap();
            Arc::new(Counted {
                file: Arc::new(file),
                data_bios: AtomicU64::new(0),
                fixed: AtomicU64::new(0),
            })
        }

        /// (data bios, fixed ops) so far.
        fn counts(&self) -> (u64, u64) {
            (
                self.data_bios.load(Ordering::Relaxed),
                self.fixed.load(Ordering::Relaxed),
            )
        }
    }

    fn serve(dev: Arc<Counted>, queues: u16) -> Served {
        Served::start_with(
            dev,
            queues,
            false,
            Budget::new(64 << 20, 16),
            Dispatch::Direct,
        )
    }

    /// A second buffer of the client's: a region of its own, added to the
    /// guest's memory (ADD_MEM_REG) while the queues run.
    struct Extra {
        region: MemoryRegion,
    }

    impl Extra {
        fn map(c: &mut Client, len: usize) -> Extra {
            let region = c._b.alloc_mem_region(len).unwrap();
            c._b.map_mem_region(&region).unwrap();
            Extra { region }
        }

        fn ptr(&self, at: usize) -> *mut u8 {
            assert!(at < self.region.len);
            (self.region.addr + at) as *mut u8
        }

        fn buf(&mut self) -> &mut [u8] {
            // SAFETY: the region is mapped while `self` lives; the server
            // touches it only during a request, which `io` waits for.
            unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
        }

        /// Removes it from the guest's memory (REM_MEM_REG) and frees it.
        fn unmap(self, c: &mut Client) {
            c._b.unmap_mem_region(&self.region);
            c._b.free_mem_region(&self.region);
        }
    }

    /// A read or write of `len` bytes at `off` from `p` on queue `q`.
    fn io(c: &mut Client, q: usize, write: bool, off: u64, p: *mut u8, len: usize) -> i32 {
        c.run(q, |q| {
            if write {
                q.write(off, p, len, 0, ReqFlags::empty())
            } else {
                q.read(off, p, len, 0, ReqFlags::empty())
            }
        })
    }

    fn guest_buffers_go_fixed_across_memory_table_changes(buffered: bool) {
        let mode = if buffered { "buffered" } else { "O_DIRECT" };
        let dir = TempDir::new("vhost");
        let dev = Counted::new(&dir, buffered);
        let srv = serve(dev.clone(), 2);
        let mut c = Client::connect(&srv.path, 2);

        // The client's first buffer, on both queues (two reactors).
        let data = pattern(1, 64 << 10);
        c.buf()[..64 << 10].copy_from_slice(&data);
        assert_eq!(c.write(0, 0, 0, 64 << 10), 0);
        c.buf()[..64 << 10].fill(0);
        assert_eq!(c.read(1, 0, 0, 64 << 10), 0);
        assert!(c.buf()[..64 << 10] == data[..], "{mode}: read back");
        let (bios, fixed) = dev.counts();
        assert!(bios >= 2);
        assert_eq!(
            fixed, bios,
            "{mode}: every data bio from guest memory went fixed"
        );

        // A region added while the queues run: its buffers go fixed too.
        let mut b = Extra::map(&mut c, 1 << 20);
        let data_b = pattern(2, 128 << 10);
        b.buf()[4096..4096 + (128 << 10)].copy_from_slice(&data_b);
        assert_eq!(io(&mut c, 1, true, 1 << 20, b.ptr(4096), 128 << 10), 0);
        assert_eq!(io(&mut c, 0, false, 0, b.ptr(512 << 10), 64 << 10), 0);
        assert!(
            b.buf()[512 << 10..576 << 10] == data[..],
            "{mode}: region B reads what A wrote"
        );
        // The first region goes: B goes on, and the data written from A
        // and from B reads back into B.
        let (bios, fixed) = dev.counts();
        assert_eq!(fixed, bios, "{mode}: after ADD_MEM_REG");
        let a = std::mem::replace(&mut c.region, b.region);
        c._b.unmap_mem_region(&a);
        c._b.free_mem_region(&a);
        c.buf().fill(0);
        assert_eq!(c.read(0, 1 << 20, 0, 128 << 10), 0);
        assert!(
            c.buf()[..128 << 10] == data_b[..],
            "{mode}: after REM_MEM_REG"
        );
        assert_eq!(c.read(1, 0, 256 << 10, 64 << 10), 0);
        assert!(
            c.buf()[256 << 10..320 << 10] == data[..],
            "{mode}: after REM_MEM_REG"
        );
        let (bios, fixed) = dev.counts();
        assert_eq!(fixed, bios, "{mode}: after REM_MEM_REG");

        // Many regions come and go, more than the rings' buffer table
        // holds: each goes fixed, so the registrations of those that went
        // were given back.
        let rounds = udm_core::ring::BUFFER_SLOTS as usize + 16;
        for i in 0..rounds {
            let mut e = Extra::map(&mut c, 64 << 10);
            let d = pattern(i as u8, 4096);
            e.buf()[..4096].copy_from_slice(&d);
            let q = i % 2;
            let off = (2 << 20) + (i as u64) * 4096;
            let before = dev.counts();
            assert_eq!(io(&mut c, q, true, off, e.ptr(0), 4096), 0);
            e.buf()[..4096].fill(0);
            assert_eq!(io(&mut c, 1 - q, false, off, e.ptr(0), 4096), 0);
            assert!(e.buf()[..4096] == d[..], "{mode}: region {i}");
            let after = dev.counts();
            assert_eq!(
                after.1 - before.1,
                after.0 - before.0,
                "{mode}: region {i} (of {rounds}) did not go fixed"
            );
            e.unmap(&mut c);
        }
        // And what they wrote stays where it went.
        for i in (0..rounds).step_by(37) {
            let off = (2 << 20) + (i as u64) * 4096;
            assert_eq!(c.read(0, off, 0, 4096), 0);
            assert!(
                c.buf()[..4096] == pattern(i as u8, 4096)[..],
                "{mode}: block {i}"
            );
        }

        // A new frontend (a new memory table): fixed again, same data.
        drop(c);
        let before = dev.counts();
        let mut c = Client::connect(&srv.path, 2);
        assert_eq!(c.read(1, 1 << 20, 0, 128 << 10), 0);
        assert!(
            c.buf()[..128 << 10] == data_b[..],
            "{mode}: after reconnecting"
        );
        let after = dev.counts();
        assert_eq!(
            after.1 - before.1,
            after.0 - before.0,
            "{mode}: after reconnecting"
        );
    }

    /// RLIMIT_MEMLOCK's soft limit, if small enough for a test to pass it
    /// (up to 64 MiB).
    fn memlock_limit() -> Option<usize> {
        let limit = udm_core::memlock::soft_limit().expect("getrlimit");
        limit.filter(|&l| l <= 64 << 20).map(|l| l as usize)
    }

    #[test]
    fn guest_memory_past_the_memlock_limit_goes_plain_and_its_data_is_right() {
        let Some(limit) = memlock_limit() else {
            eprintln!("skipped: RLIMIT_MEMLOCK is above 64 MiB or unlimited");
            return;
        };
        std::thread::spawn(move || {
            udm_core::memlock::drop_ipc_lock().expect("capset");
            let dir = TempDir::new("vhost");
            let dev = Counted::new(&dir, false);
            let srv = serve(dev.clone(), 1);
            let mut c = Client::connect(&srv.path, 1);
            // The client's first 1 MiB fits under the limit: fixed.
            let data = pattern(3, 64 << 10);
            c.buf()[..64 << 10].copy_from_slice(&data);
            assert_eq!(c.write(0, 0, 0, 64 << 10), 0);
            let (bios, fixed) = dev.counts();
            assert_eq!(fixed, bios, "memory under the limit goes fixed");
            // A region of twice the limit: the kernel refuses it, the
            // export goes on with plain I/O for it, data intact.
            let len = (2 * limit).next_multiple_of(1 << 20);
            let mut big = Extra::map(&mut c, len);
            let before = dev.counts();
            let at = len - (64 << 10);
            assert_eq!(io(&mut c, 0, false, 0, big.ptr(at), 64 << 10), 0);
            assert!(big.buf()[at..] == data[..], "read into the big region");
            let d2 = pattern(4, 64 << 10);
            big.buf()[..64 << 10].copy_from_slice(&d2);
            assert_eq!(io(&mut c, 0, true, 1 << 20, big.ptr(0), 64 << 10), 0);
            let after = dev.counts();
            assert!(after.0 - before.0 >= 2);
            assert_eq!(
                after.1, before.1,
                "nothing of the refused region went fixed"
            );
            // The first region keeps its registration.
            assert_eq!(c.read(0, 1 << 20, 0, 64 << 10), 0);
            assert!(c.buf()[..64 << 10] == d2[..]);
            let last = dev.counts();
            assert_eq!(last.1 - after.1, last.0 - after.0);
            big.unmap(&mut c);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn guest_buffers_go_fixed_to_an_o_direct_file_across_memory_table_changes() {
        guest_buffers_go_fixed_across_memory_table_changes(false);
    }

    #[test]
    fn guest_buffers_go_fixed_to_a_buffered_file_across_memory_table_changes() {
        guest_buffers_go_fixed_across_memory_table_changes(true);
    }
}
