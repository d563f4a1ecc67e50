//! The vhost-user protocol's device side, on the server's control thread:
//! features, the configuration space, the guest's memory table and each
//! ring's setup. A ring runs on its reactor once it has a size,
//! addresses, memory, a kick eventfd and is enabled; GET_VRING_BASE (or a
//! disable, a reset, a disconnect) stops it after its requests in flight
//! completed.
//!
//! What a frontend gets wrong (a queue index past the ones offered, a
//! size that is not a power of two, addresses outside its memory, a
//! feature not offered) is refused with an error reply (or a disconnect,
//! where the protocol has no reply), logged in one line.

use std::fs::File;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use udm_core::ReactorHandle;
use vhost::vhost_user::message::*;
use vhost::vhost_user::{Backend, Error, GpuBackend, Result, VhostUserBackendReqHandlerMut};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_CONFIG_WCE;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use super::config::Shared;
use super::config::{F_PROTOCOL_FEATURES, MAX_QUEUE_SIZE, WRITEBACK_OFFSET};
use super::inflight::{self, InflightMap};
use super::memory::{Memory, Region};
use super::queue::on_worker;
use super::queue::Start;

/// Memory regions a frontend may add (CONFIGURE_MEM_SLOTS).
const MAX_MEM_SLOTS: usize = 32;

/// How long a queue may take to start, or to stop (its requests in flight
/// completing) before the frontend is told it failed.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// One ring's setup, as the frontend gave it.
#[derive(Default)]
struct Ring {
    num: u16,
    /// Descriptor table, avail and used rings, in the frontend's addresses.
    addrs: Option<(u64, u64, u64)>,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    enabled: bool,
    running: bool,
}

/// One frontend's view of the device.
pub struct Device {
    shared: Arc<Shared>,
    handles: Vec<ReactorHandle>,
    features: u64,
    protocol: u64,
    regions: Vec<Region>,
    mem: Option<Arc<Memory>>,
    rings: Vec<Ring>,
    /// The inflight area (SET_INFLIGHT_FD), kept across resets: the
    /// frontend sends a new one when it wants a fresh one.
    inflight: Option<Arc<InflightMap>>,
    /// The backend request channel (SET_BACKEND_REQ_FD): config-change
    /// notifications go there.
    backend_req: Option<UnixStream>,
}

/// Logs why a request is refused and returns the error the crate maps to
/// a failed reply (REPLY_ACK's status). The connection goes on: the
/// server ends it only for errors of other kinds (a malformed message, a
/// request whose reply would carry a value).
fn refuse<T>(why: String) -> Result<T> {
    tracing::warn!("vhost: frontend: {why}");
    Err(refused())
}

/// The error of a request refused by the device (see [`refuse`]).
fn refused() -> Error {
    Error::ReqHandlerError(std::io::Error::other("refused"))
}

/// Whether `e` is a refusal the connection survives.
pub fn is_refusal(e: &Error) -> bool {
    matches!(e, Error::ReqHandlerError(_))
}

impl Device {
    /// The device of `shared`, whose queue `i` runs on reactor
    /// `handles[i % handles.len()]`.
    pub fn new(shared: Arc<Shared>, handles: Vec<ReactorHandle>) -> Device {
        let rings = (0..shared.queues).map(|_| Ring::default()).collect();
        // A new frontend starts with the device's own cache mode.
        shared.writeback.store(
            shared.cfg.volatile_cache,
            std::sync::atomic::Ordering::Relaxed,
        );
        Device {
            shared,
            handles,
            features: 0,
            protocol: 0,
            regions: Vec::new(),
            mem: None,
            rings,
            inflight: None,
            backend_req: None,
        }
    }

    fn ring(&mut self, index: u32) -> Result<&mut Ring> {
        let n = self.rings.len();
        match self.rings.get_mut(index as usize) {
            Some(r) => Ok(r),
            None => refuse(format!("queue index {index} past the {n} queues offered")),
        }
    }

    fn handle(&self, index: usize) -> &ReactorHandle {
        &self.handles[index % self.handles.len()]
    }

    /// Starts ring `index` if it has all it needs and is not running.
    fn try_start(&mut self, index: usize) -> Result<()> {
        let protocol_features = self.features & F_PROTOCOL_FEATURES != 0;
        let event_idx = self.features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let Some(mem) = self.mem.clone() else {
            return Ok(());
        };
        let r = &mut self.rings[index];
        // Without the protocol-features handshake a ring starts enabled.
        let enabled = r.enabled || !protocol_features;
        if r.running || r.kick.is_none() || !enabled {
            return Ok(());
        }
        let Some((desc, avail, used)) = r.addrs else {
            return refuse(format!(
                "queue {index} kicked before its addresses were set"
            ));
        };
        let gpa = |va: u64, what: &str| match mem.gpa_of(va) {
            Some(a) => Ok(GuestAddress(a)),
            None => refuse(format!(
                "queue {index}: its {what} at {va:#x} is outside the memory table"
            )),
        };
        let mut q = Queue::new(MAX_QUEUE_SIZE).map_err(|_| Error::BackendInternalError)?;
        if r.num == 0 {
            return refuse(format!("queue {index} kicked before its size was set"));
        }
        q.set_size(r.num);
        let bad = |e| refuse::<()>(format!("queue {index}: {e}"));
        if let Err(e) = q.try_set_desc_table_address(gpa(desc, "descriptor table")?) {
            return bad(e);
        }
        if let Err(e) = q.try_set_avail_ring_address(gpa(avail, "avail ring")?) {
            return bad(e);
        }
        if let Err(e) = q.try_set_used_ring_address(gpa(used, "used ring")?) {
            return bad(e);
        }
        q.set_next_avail(r.base);
        q.set_next_used(r.base);
        q.set_event_idx(event_idx);
        q.set_ready(true);
        if !q.is_valid(&mem.guest) {
            return refuse(format!(
                "queue {index}: its rings do not lie inside the guest's memory"
            ));
        }
        let kick = r
            .kick
            .as_ref()
            .and_then(|f| f.try_clone().ok())
            .ok_or(Error::BackendInternalError)?;
        let call = r.call.as_ref().and_then(|f| f.try_clone().ok());
        let inflight = match &self.inflight {
            None => None,
            Some(m) => match m.queue(index as u16, r.num) {
                Ok(q) => Some(q),
                Err(e) => return refuse(e),
            },
        };
        let start = Start {
            index: index as u16,
            queue: q,
            mem,
            kick,
            call,
            inflight,
        };
        let (tx, rx) = mpsc::channel();
        on_worker(self.handle(index), move |w| w.start(start, tx));
        match rx.recv_timeout(QUEUE_TIMEOUT) {
            Ok(Ok(())) => {
                tracing::debug!(
                    "vhost: queue {index} started: {} entries from {}, event_idx {event_idx}",
                    self.rings[index].num,
                    self.rings[index].base
                );
                self.rings[index].running = true;
                Ok(())
            }
            Ok(Err(e)) => {
                tracing::warn!("vhost: queue {index}: {e}");
                Err(Error::BackendInternalError)
            }
            Err(_) => {
                tracing::warn!("vhost: queue {index}: its reactor did not start it");
                Err(Error::BackendInternalError)
            }
        }
    }

    /// Stops ring `index` if it runs; its base becomes the next available
    /// index.
    fn stop(&mut self, index: usize) -> Result<()> {
        if !self.rings[index].running {
            return Ok(());
        }
        let (tx, rx) = mpsc::channel();
        on_worker(self.handle(index), move |w| w.stop(index as u16, tx));
        let base = rx.recv_timeout(QUEUE_TIMEOUT).map_err(|_| {
            tracing::warn!("vhost: queue {index}: still busy after {QUEUE_TIMEOUT:?}");
            Error::BackendInternalError
        })?;
        let r = &mut self.rings[index];
        r.running = false;
        r.base = base;
        Ok(())
    }

    /// Stops every ring and forgets its setup and the features (a reset:
    /// the memory table and protocol features belong to the connection
    /// and stay, as the frontend does not send them again).
    fn reset(&mut self) {
        for i in 0..self.rings.len() {
            let _ = self.stop(i);
            self.rings[i] = Ring::default();
        }
        self.features = 0;
    }

    /// Stops every ring and forgets all the frontend gave (it went away).
    pub fn disconnect(&mut self) {
        self.reset();
        self.mem = None;
        self.regions.clear();
        self.protocol = 0;
        self.inflight = None;
        self.backend_req = None;
    }

    /// Rebuilds the memory from the regions and hands it to the rings.
    fn update_mem(&mut self) -> Result<()> {
        if self.regions.is_empty() {
            if self.rings.iter().any(|r| r.running) {
                return refuse("the last memory region removed while queues run".into());
            }
            self.mem = None;
            return Ok(());
        }
        let mut regions = self.regions.clone();
        regions.sort_by_key(|r| r.gpa);
        let mem = match Memory::new(regions) {
            Ok(m) => Arc::new(m),
            Err(e) => return refuse(e),
        };
        self.mem = Some(mem.clone());
        // The reactors take the new memory before the frontend is answered:
        // it may put buffers in a new region as soon as it is.
        let mut sent = vec![false; self.handles.len()];
        let (tx, rx) = mpsc::channel();
        let mut waits = 0;
        for (i, r) in self.rings.iter().enumerate() {
            let h = i % self.handles.len();
            if r.running && !sent[h] {
                sent[h] = true;
                let (m, tx) = (mem.clone(), tx.clone());
                if on_worker(&self.handles[h], move |w| {
                    w.set_mem(m);
                    let _ = tx.send(());
                }) {
                    waits += 1;
                }
            }
        }
        for _ in 0..waits {
            if rx.recv_timeout(QUEUE_TIMEOUT).is_err() {
                tracing::warn!("vhost: a reactor did not take the new memory table");
                return Err(Error::BackendInternalError);
            }
        }
        for i in 0..self.rings.len() {
            self.try_start(i)?;
        }
        Ok(())
    }

    /// Whether the frontend acked protocol feature `f`.
    pub fn acked(&self, f: VhostUserProtocolFeatures) -> bool {
        self.protocol & f.bits() != 0
    }

    /// The frontend's backend request channel (SET_BACKEND_REQ_FD, which
    /// the server takes before the vhost crate sees it: its `Backend` has
    /// no sender of config-change messages).
    pub fn set_backend_channel(&mut self, sock: UnixStream) {
        let _ = sock.set_write_timeout(Some(Duration::from_secs(1)));
        self.backend_req = Some(sock);
    }

    /// Tells the frontend that the configuration space changed
    /// (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG, no reply asked: the
    /// frontend answers it by reading the configuration, which this
    /// thread serves). Whether it was sent.
    pub fn config_changed(&mut self) -> bool {
        let Some(s) = &self.backend_req else {
            return false;
        };
        // Header (request, flags: version 1, body size), then a u64 0.
        let mut msg = [0u8; 20];
        msg[..4].copy_from_slice(&(BackendReq::CONFIG_CHANGE_MSG as u32).to_le_bytes());
        msg[4..8].copy_from_slice(&1u32.to_le_bytes());
        msg[8..12].copy_from_slice(&8u32.to_le_bytes());
        match (&*s).write_all(&msg) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("vhost: config-change message: {e}");
                self.backend_req = None;
                false
            }
        }
    }

    fn map_region(r: &VhostUserMemoryRegion, file: File) -> Result<Region> {
        match Region::map(
            file,
            r.mmap_offset,
            r.guest_phys_addr,
            r.memory_size,
            r.user_addr,
        ) {
            Ok(m) => Ok(m),
            Err(e) => refuse(e),
        }
    }
}

impl VhostUserBackendReqHandlerMut for Device {
    fn set_owner(&mut self) -> Result<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> Result<()> {
        tracing::trace!("vhost: reset_owner");
        self.reset();
        Ok(())
    }

    fn reset_device(&mut self) -> Result<()> {
        tracing::trace!("vhost: reset_device");
        self.reset();
        Ok(())
    }

    fn get_features(&mut self) -> Result<u64> {
        Ok(self.shared.cfg.features)
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        tracing::trace!("vhost: set_features");
        let extra = features & !self.shared.cfg.features;
        if extra != 0 {
            return refuse(format!("features {extra:#x} were not offered"));
        }
        self.features = features;
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy: Option<bool>,
    ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        tracing::trace!("vhost: set_mem_table");
        let mut new = Vec::with_capacity(regions.len());
        for (r, f) in regions.iter().zip(files) {
            new.push(Device::map_region(r, f)?);
        }
        self.regions = new;
        self.update_mem()?;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> Result<()> {
        tracing::trace!("vhost: set_vring_num {index}");
        if num == 0 || num > MAX_QUEUE_SIZE as u32 || !num.is_power_of_two() {
            return refuse(format!(
                "queue {index}: size {num} is not a power of two up to {MAX_QUEUE_SIZE}"
            ));
        }
        let r = self.ring(index)?;
        if r.running {
            return refuse(format!("queue {index}: resized while it runs"));
        }
        r.num = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> Result<()> {
        let r = self.ring(index)?;
        if r.running {
            return refuse(format!("queue {index}: addresses changed while it runs"));
        }
        r.addrs = Some((descriptor, available, used));
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> Result<()> {
        tracing::trace!("vhost: set_vring_base {index}");
        let r = self.ring(index)?;
        if r.running {
            return refuse(format!("queue {index}: base set while it runs"));
        }
        let Ok(b) = u16::try_from(base) else {
            return refuse(format!("queue {index}: base {base} past 65535"));
        };
        r.base = b;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> Result<VhostUserVringState> {
        tracing::trace!("vhost: get_vring_base {index}");
        // Its reply carries the base: an error cannot be told, so the
        // frontend is disconnected.
        self.ring(index).map_err(|_| Error::InvalidParam)?;
        let i = index as usize;
        self.stop(i)?;
        let r = &mut self.rings[i];
        r.kick = None;
        r.call = None;
        r.enabled = false;
        Ok(VhostUserVringState::new(index, r.base as u32))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        tracing::trace!("vhost: set_vring_kick {index}");
        self.ring(index as u32)?;
        let Some(fd) = fd else {
            return refuse(format!(
                "queue {index}: no kick eventfd (polling mode is not supported)"
            ));
        };
        let i = index as usize;
        self.stop(i)?;
        self.rings[i].kick = Some(fd);
        self.try_start(i)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> Result<()> {
        tracing::trace!("vhost: set_vring_call {index}");
        self.ring(index as u32)?;
        let i = index as usize;
        if self.rings[i].running {
            let c = fd.as_ref().and_then(|f| f.try_clone().ok());
            on_worker(self.handle(i), move |w| w.set_call(i as u16, c));
        }
        self.rings[i].call = fd;
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> Result<()> {
        tracing::trace!("vhost: set_vring_err {index}");
        self.ring(index as u32)?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::RESET_DEVICE)
    }

    fn set_protocol_features(&mut self, features: u64) -> Result<()> {
        tracing::trace!("vhost: set_protocol_features");
        let offered = self.get_protocol_features()?.bits();
        let extra = features & !offered;
        if extra != 0 {
            return refuse(format!("protocol features {extra:#x} were not offered"));
        }
        self.protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> Result<u64> {
        Ok(self.shared.queues as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<()> {
        tracing::trace!("vhost: set_vring_enable {index}");
        self.ring(index)?;
        let i = index as usize;
        self.rings[i].enabled = enable;
        if enable {
            self.try_start(i)
        } else {
            self.stop(i)
        }
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> Result<Vec<u8>> {
        let wb = self
            .shared
            .writeback
            .load(std::sync::atomic::Ordering::Relaxed);
        let capacity = self
            .shared
            .capacity
            .load(std::sync::atomic::Ordering::Relaxed);
        match self.shared.cfg.read(offset, size, wb, capacity) {
            Some(v) => Ok(v),
            None => refuse(format!("config space read of {size} bytes at {offset}")),
        }
    }

    fn set_config(&mut self, offset: u32, buf: &[u8], _flags: VhostUserConfigFlags) -> Result<()> {
        tracing::trace!("vhost: set_config");
        let wce = self.features & (1 << VIRTIO_BLK_F_CONFIG_WCE) != 0;
        if wce && offset as usize == WRITEBACK_OFFSET && buf.len() == 1 {
            self.shared
                .writeback
                .store(buf[0] != 0, std::sync::atomic::Ordering::Relaxed);
            return Ok(());
        }
        refuse(format!(
            "config space write of {} bytes at {offset} (only the writeback byte, with CONFIG_WCE)",
            buf.len()
        ))
    }

    // Not reached: the server takes SET_BACKEND_REQ_FD itself.
    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu: GpuBackend) -> Result<()> {
        Err(Error::InvalidOperation("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> Result<File> {
        Err(Error::InvalidOperation("no shared objects"))
    }

    fn get_inflight_fd(&mut self, i: &VhostUserInflight) -> Result<(VhostUserInflight, File)> {
        tracing::trace!("vhost: get_inflight_fd");
        // Its reply carries the file: an error cannot be told, so the
        // frontend is disconnected.
        let made = inflight::check(i, self.shared.queues, MAX_QUEUE_SIZE)
            .and_then(|len| Ok((len, inflight::create(len)?)));
        match made {
            Ok((len, file)) => Ok((
                VhostUserInflight::new(len, 0, i.num_queues, i.queue_size),
                file,
            )),
            Err(e) => {
                tracing::warn!("vhost: frontend: {e}");
                Err(Error::InvalidParam)
            }
        }
    }

    fn set_inflight_fd(&mut self, i: &VhostUserInflight, file: File) -> Result<()> {
        tracing::trace!("vhost: set_inflight_fd");
        if self.rings.iter().any(|r| r.running) {
            return refuse("inflight area set while queues run".into());
        }
        match InflightMap::map(file, i, self.shared.queues, MAX_QUEUE_SIZE) {
            Ok(m) => {
                self.inflight = Some(Arc::new(m));
                Ok(())
            }
            Err(e) => refuse(e),
        }
    }

    fn get_max_mem_slots(&mut self) -> Result<u64> {
        Ok(MAX_MEM_SLOTS as u64)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy: Option<bool>,
    ) -> Result<Option<VhostUserMemoryRegionBase>> {
        tracing::trace!("vhost: add_mem_region");
        if self.regions.len() >= MAX_MEM_SLOTS {
            return refuse(format!("more than {MAX_MEM_SLOTS} memory regions"));
        }
        let r = Device::map_region(region, fd)?;
        self.regions.push(r);
        if let Err(e) = self.update_mem() {
            self.regions.pop();
            return Err(e);
        }
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> Result<()> {
        tracing::trace!("vhost: remove_mem_region");
        let (gpa, len) = (region.guest_phys_addr, region.memory_size);
        let Some(i) = self
            .regions
            .iter()
            .position(|r| r.gpa == gpa && r.len == len)
        else {
            return refuse(format!(
                "removing memory region {gpa:#x}+{len:#x}, which is not in the table"
            ));
        };
        let r = self.regions.remove(i);
        if let Err(e) = self.update_mem() {
            self.regions.insert(i, r);
            return Err(e);
        }
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _d: VhostTransferStateDirection,
        _p: VhostTransferStatePhase,
        _fd: File,
    ) -> Result<Option<File>> {
        Err(Error::InvalidOperation("no device state transfer"))
    }

    fn check_device_state(&mut self) -> Result<()> {
        Err(Error::InvalidOperation("no device state transfer"))
    }

    fn get_shmem_config(&mut self) -> Result<VhostUserShMemConfig> {
        Err(Error::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> Result<()> {
        Err(Error::InvalidOperation("no dirty logging"))
    }
}
