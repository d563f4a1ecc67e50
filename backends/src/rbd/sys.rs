//! A safe layer over `ffi`: a connected cluster, a pool's I/O
//! context and an open image, each closed on drop in the right order (an
//! image keeps its pool, a pool its cluster), and one-line errors that name
//! the cause (no monitor, a rejected key, a missing pool, image or snapshot).
//!
//! The asynchronous I/O calls stay `unsafe`: librbd reads or writes the
//! caller's memory until the completion's callback runs, which no Rust
//! lifetime can express; the backend's channel keeps that promise.

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::Arc;

use udm_core::{Error, ErrorKind, Seg};

use super::ffi;

fn cstr(what: &str, s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::invalid(format!("rbd: {what} '{s}' contains a NUL byte")))
}

fn strerror(rc: c_int) -> String {
    std::io::Error::from_raw_os_error(-rc).to_string()
}

/// How long the cluster may take to answer, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Connecting and authenticating (`client_mount_timeout`,
    /// `rados_mon_op_timeout`).
    pub mon: u32,
    /// An I/O to an OSD (`rados_osd_op_timeout`): past it, the I/O fails
    /// with an error instead of waiting for the OSD to come back.
    pub osd: u32,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts { mon: 10, osd: 30 }
    }
}

/// A connected cluster handle (`rados_t`).
pub struct Cluster {
    raw: ffi::rados_t,
    /// The cluster's name (for messages).
    pub name: String,
    /// The client's name, `client.ID`.
    pub client: String,
}

// SAFETY: a rados_t is used from any thread (librados is thread-safe: its
// handles are internally locked, and QEMU, SPDK and fio share them across
// threads); we only call it through &self after connect, and drop it once.
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl Cluster {
    /// Reads the configuration (`conf`, else librados's search path:
    /// `$CEPH_CONF`, `/etc/ceph/$cluster.conf`, `~/.ceph/config`,
    /// `./$cluster.conf`) and `$CEPH_ARGS`, sets the timeouts, and connects
    /// as `client.<id>`.
    pub fn connect(
        cluster: &str,
        id: &str,
        conf: Option<&str>,
        t: Timeouts,
    ) -> Result<Cluster, Error> {
        ffi::load()?;
        let client = format!("client.{id}");
        let c_cluster = cstr("cluster name", cluster)?;
        let c_client = cstr("client id", &client)?;
        let mut raw: ffi::rados_t = ptr::null_mut();
        // SAFETY: `raw` is a live out-pointer; both strings are NUL-terminated
        // and outlive the call (librados copies them).
        let rc = unsafe { ffi::rados_create2(&mut raw, c_cluster.as_ptr(), c_client.as_ptr(), 0) };
        if rc < 0 {
            return Err(Error::new(
                ErrorKind::Os,
                format!(
                    "rbd: cannot create a handle for cluster '{cluster}' as {client}: {}",
                    strerror(rc)
                ),
            ));
        }
        // From here the handle is shut down on drop, connected or not.
        let c = Cluster {
            raw,
            name: cluster.to_string(),
            client,
        };
        let c_conf = conf.map(|p| cstr("conf path", p)).transpose()?;
        // SAFETY: the handle is live and not yet connected; the path is
        // NUL-terminated or null (librados's search path).
        let rc = unsafe {
            ffi::rados_conf_read_file(c.raw, c_conf.as_ref().map_or(ptr::null(), |p| p.as_ptr()))
        };
        if rc < 0 {
            return Err(Error::new(
                ErrorKind::NotFound,
                match conf {
                    Some(p) => format!("rbd: cannot read ceph config '{p}': {}", strerror(rc)),
                    None => format!(
                        "rbd: no ceph config found for cluster '{cluster}' ($CEPH_CONF, /etc/ceph/{cluster}.conf, ~/.ceph/config, ./{cluster}.conf): give conf=PATH"
                    ),
                },
            ));
        }
        // SAFETY: live, unconnected handle; a null name means $CEPH_ARGS.
        unsafe { ffi::rados_conf_parse_env(c.raw, ptr::null()) };
        for (k, v) in [
            ("client_mount_timeout", t.mon),
            ("rados_mon_op_timeout", t.mon),
            ("rados_osd_op_timeout", t.osd),
        ] {
            c.set(k, &v.to_string())?;
        }
        // SAFETY: live, unconnected handle; connect blocks for at most
        // client_mount_timeout.
        let rc = unsafe { ffi::rados_connect(c.raw) };
        if rc < 0 {
            let mon = c.get("mon_host").unwrap_or_default();
            let keyring = c.get("keyring").unwrap_or_default();
            let (kind, why) = match -rc {
                libc::ETIMEDOUT => (
                    ErrorKind::TimedOut,
                    format!("no monitor answered within {} s (mon host {mon})", t.mon),
                ),
                libc::EACCES | libc::EPERM => (
                    ErrorKind::Os,
                    format!(
                        "authentication as {} failed: wrong key (keyring {keyring})",
                        c.client
                    ),
                ),
                libc::ENOENT => (
                    ErrorKind::NotFound,
                    format!("no key for {} (keyring {keyring})", c.client),
                ),
                _ => (
                    ErrorKind::Os,
                    format!("connect failed: {} (mon host {mon})", strerror(rc)),
                ),
            };
            return Err(Error::new(kind, format!("rbd: cluster '{cluster}': {why}")));
        }
        Ok(c)
    }

    fn set(&self, key: &str, value: &str) -> Result<(), Error> {
        let (k, v) = (cstr("option", key)?, cstr("value", value)?);
        // SAFETY: live handle, NUL-terminated strings that outlive the call.
        let rc = unsafe { ffi::rados_conf_set(self.raw, k.as_ptr(), v.as_ptr()) };
        if rc < 0 {
            return Err(Error::invalid(format!(
                "rbd: cannot set {key}={value}: {}",
                strerror(rc)
            )));
        }
        Ok(())
    }

    /// A configuration value, as librados reports it.
    pub fn get(&self, key: &str) -> Option<String> {
        let k = CString::new(key).ok()?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: live handle; `buf` is writable for its length, and librados
        // NUL-terminates what it writes (or fails with -ENAMETOOLONG).
        let rc = unsafe { ffi::rados_conf_get(self.raw, k.as_ptr(), buf.as_mut_ptr(), buf.len()) };
        if rc < 0 {
            return None;
        }
        // SAFETY: on success the buffer holds a NUL-terminated string.
        Some(
            unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// Whether a configuration boolean is on (`true`, `1`).
    pub fn get_bool(&self, key: &str) -> bool {
        matches!(self.get(key).as_deref(), Some("true" | "1"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle came from rados_create2 and is shut down once;
        // every pool and image on it holds an Arc of it, so none is left.
        unsafe { ffi::rados_shutdown(self.raw) };
    }
}

/// A pool's I/O context (`rados_ioctx_t`).
pub struct Pool {
    raw: ffi::rados_ioctx_t,
    /// The pool's name.
    pub name: String,
    cluster: Arc<Cluster>,
}

// SAFETY: an ioctx is thread-safe in librados (as the cluster handle); it is
// only passed to rbd_open and destroyed once.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Pool {
    /// Opens pool `name`.
    pub fn open(cluster: Arc<Cluster>, name: &str) -> Result<Pool, Error> {
        let c_name = cstr("pool name", name)?;
        let mut raw: ffi::rados_ioctx_t = ptr::null_mut();
        // SAFETY: connected cluster, NUL-terminated name, live out-pointer.
        let rc = unsafe { ffi::rados_ioctx_create(cluster.raw, c_name.as_ptr(), &mut raw) };
        if rc < 0 {
            let (kind, why) = if rc == -libc::ENOENT {
                (ErrorKind::NotFound, format!("pool '{name}' does not exist"))
            } else {
                (ErrorKind::Os, format!("pool '{name}': {}", strerror(rc)))
            };
            return Err(Error::new(
                kind,
                format!("rbd: cluster '{}': {why}", cluster.name),
            ));
        }
        Ok(Pool {
            raw,
            name: name.to_string(),
            cluster,
        })
    }

    /// The cluster it belongs to.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: created by rados_ioctx_create, destroyed once; images on
        // it hold an Arc of it, so none is open.
        unsafe { ffi::rados_ioctx_destroy(self.raw) };
    }
}

/// What `rbd_stat` and `rbd_get_features` say about an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    /// Size in bytes.
    pub size: u64,
    /// Object size in bytes (2^order).
    pub obj_size: u64,
    /// Feature bits (`RBD_FEATURE_*`).
    pub features: u64,
    /// The features as librbd names them (`layering,exclusive-lock,…`).
    pub feature_names: String,
}

/// An open image (`rbd_image_t`).
pub struct Image {
    raw: ffi::rbd_image_t,
    pool: Arc<Pool>,
}

// SAFETY: librbd's image (ImageCtx) is internally locked; its aio entry
// points and rbd_get_size/rbd_stat may be called from any thread at once
// (QEMU's iothreads and tcmu-runner do). We close it once, in drop.
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

impl Image {
    /// Opens `image` in `pool`, at `snap` if given (then read-only),
    /// read-only if `read_only`.
    pub fn open(
        pool: Arc<Pool>,
        image: &str,
        snap: Option<&str>,
        read_only: bool,
    ) -> Result<Image, Error> {
        let spec = format!("{}/{image}", pool.name);
        let c_image = cstr("image name", image)?;
        let c_snap = snap.map(|s| cstr("snapshot name", s)).transpose()?;
        let snap_ptr = c_snap.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        let mut raw: ffi::rbd_image_t = ptr::null_mut();
        // SAFETY: live ioctx, NUL-terminated names (or a null snapshot), live
        // out-pointer; librbd copies the names.
        let rc = unsafe {
            if read_only || snap.is_some() {
                ffi::rbd_open_read_only(pool.raw, c_image.as_ptr(), &mut raw, snap_ptr)
            } else {
                ffi::rbd_open(pool.raw, c_image.as_ptr(), &mut raw, snap_ptr)
            }
        };
        if rc < 0 {
            let why = match (-rc, snap) {
                (libc::ENOENT, Some(s)) if Image::open(pool.clone(), image, None, true).is_ok() => {
                    format!("snapshot '{s}' of image '{spec}' does not exist")
                }
                (libc::ENOENT, _) => format!("image '{spec}' does not exist"),
                (libc::EACCES | libc::EPERM, _) => {
                    format!(
                        "image '{spec}': permission denied for {}",
                        pool.cluster.client
                    )
                }
                _ => format!("image '{spec}': open failed: {}", strerror(rc)),
            };
            let kind = if rc == -libc::ENOENT {
                ErrorKind::NotFound
            } else {
                ErrorKind::Os
            };
            return Err(Error::new(kind, format!("rbd: {why}")));
        }
        Ok(Image { raw, pool })
    }

    /// The pool it lives in.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Size, object size and features.
    pub fn info(&self) -> Result<ImageInfo, Error> {
        // SAFETY: an all-zero rbd_image_info_t is valid (integers and arrays).
        let mut st: ffi::rbd_image_info_t = unsafe { std::mem::zeroed() };
        // SAFETY: open image; `st` is writable and its size is passed.
        let rc = unsafe { ffi::rbd_stat(self.raw, &mut st, std::mem::size_of_val(&st)) };
        if rc < 0 {
            return Err(Error::new(
                ErrorKind::Io,
                format!("rbd: stat: {}", strerror(rc)),
            ));
        }
        let mut features = 0u64;
        // SAFETY: open image, live out-pointer.
        let rc = unsafe { ffi::rbd_get_features(self.raw, &mut features) };
        if rc < 0 {
            return Err(Error::new(
                ErrorKind::Io,
                format!("rbd: features: {}", strerror(rc)),
            ));
        }
        let mut buf = [0 as c_char; 512];
        let mut len = buf.len();
        // SAFETY: `buf` is writable for `len` bytes, which librbd is told;
        // it NUL-terminates on success.
        let rc = unsafe { ffi::rbd_features_to_string(features, buf.as_mut_ptr(), &mut len) };
        let feature_names = if rc < 0 {
            format!("{features:#x}")
        } else {
            // SAFETY: NUL-terminated on success.
            unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        };
        Ok(ImageInfo {
            size: st.size,
            obj_size: st.obj_size,
            features,
            feature_names,
        })
    }

    /// The allocated byte ranges (offset, length) of `len` bytes from `off`,
    /// sorted, by `rbd_diff_iterate2` from the image's creation with its
    /// parent included, in whole objects (`whole_object`: from the object
    /// map when the image has fast-diff, a read of it at most; otherwise
    /// librbd lists each object on its OSD). Synchronous.
    pub fn allocated(&self, off: u64, len: u64) -> Result<Vec<(u64, u64)>, Error> {
        unsafe extern "C" fn found(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
            if exists != 0 {
                // SAFETY: `arg` is the Vec that `allocated` lent for this
                // call, which is still running: librbd calls back before
                // rbd_diff_iterate2 returns, one call at a time.
                unsafe { (*arg.cast::<Vec<(u64, u64)>>()).push((off, len as u64)) };
            }
            0
        }
        let mut found_ranges: Vec<(u64, u64)> = Vec::new();
        // SAFETY: open image; no snapshot name (from the beginning); the
        // callback and its argument, the Vec above, live through the call,
        // which makes every callback before it returns.
        let rc = unsafe {
            ffi::rbd_diff_iterate2(
                self.raw,
                ptr::null(),
                off,
                len,
                1,
                1,
                Some(found),
                (&mut found_ranges as *mut Vec<(u64, u64)>).cast(),
            )
        };
        if rc < 0 {
            return Err(Error::new(
                ErrorKind::Io,
                format!("rbd: diff iterate: {}", strerror(rc)),
            ));
        }
        found_ranges.sort_unstable();
        Ok(found_ranges)
    }

    /// The current size in bytes (librbd refreshes its header first when a
    /// resize elsewhere notified it).
    pub fn size(&self) -> Result<u64, Error> {
        let mut size = 0u64;
        // SAFETY: open image, live out-pointer.
        let rc = unsafe { ffi::rbd_get_size(self.raw, &mut size) };
        if rc < 0 {
            return Err(Error::new(
                ErrorKind::Io,
                format!("rbd: get size: {}", strerror(rc)),
            ));
        }
        Ok(size)
    }

    /// Starts an asynchronous `op` completing through `c`; returns librbd's
    /// error if it refused to start it (then `c` will not be called and is
    /// the caller's to release).
    ///
    /// # Safety
    /// For reads and writes, every segment of `segs` must stay valid (and,
    /// for reads, unaliased) until `c`'s callback runs.
    pub unsafe fn aio(&self, op: AioOp<'_>, c: &Completion) -> Result<(), c_int> {
        // SAFETY: the image is open; `c` is a live completion not yet
        // submitted; segment validity is the caller's promise. Seg is
        // layout-compatible with iovec (asserted in udm_core).
        let rc = unsafe {
            match op {
                AioOp::Read(segs, off) => ffi::rbd_aio_readv(
                    self.raw,
                    segs.as_ptr().cast(),
                    segs.len() as c_int,
                    off,
                    c.raw,
                ),
                AioOp::Write(segs, off) => ffi::rbd_aio_writev(
                    self.raw,
                    segs.as_ptr().cast(),
                    segs.len() as c_int,
                    off,
                    c.raw,
                ),
                AioOp::Flush => ffi::rbd_aio_flush(self.raw, c.raw),
                AioOp::Discard(off, len) => ffi::rbd_aio_discard(self.raw, off, len, c.raw),
                AioOp::WriteZeroes(off, len) => {
                    ffi::rbd_aio_write_zeroes(self.raw, off, len as usize, c.raw, 0, 0)
                }
            }
        };
        if rc < 0 {
            Err(rc)
        } else {
            Ok(())
        }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: opened by rbd_open*, closed once; the device drops the
        // image only when no channel (so no I/O) is left.
        unsafe { ffi::rbd_close(self.raw) };
    }
}

/// An asynchronous operation.
#[derive(Clone, Copy)]
pub enum AioOp<'a> {
    /// Read into the segments from a byte offset.
    Read(&'a [Seg], u64),
    /// Write the segments at a byte offset.
    Write(&'a [Seg], u64),
    /// Make completed writes durable.
    Flush,
    /// Discard (offset, length) in bytes.
    Discard(u64, u64),
    /// Write zeroes over (offset, length) in bytes.
    WriteZeroes(u64, u64),
}

/// The callback librbd calls, on one of its threads, when an I/O completes.
pub type Callback = unsafe extern "C" fn(c: ffi::rbd_completion_t, arg: *mut c_void);

/// An `rbd_completion_t` for one I/O. librbd allocates it (an AioCompletion)
/// in [`Completion::new`].
pub struct Completion {
    raw: ffi::rbd_completion_t,
}

impl Completion {
    /// A completion that calls `cb(c, arg)` when its I/O finishes.
    ///
    /// # Safety
    /// `arg` must be what `cb` expects, valid until `cb` has run (or the
    /// completion is released unsubmitted).
    pub unsafe fn new(arg: *mut c_void, cb: Callback) -> Result<Completion, c_int> {
        let mut raw: ffi::rbd_completion_t = ptr::null_mut();
        // SAFETY: live out-pointer; librbd only stores `arg` and hands it to
        // `cb` (the caller's promise covers that).
        let rc = unsafe { ffi::rbd_aio_create_completion(arg, Some(cb), &mut raw) };
        if rc < 0 {
            return Err(rc);
        }
        Ok(Completion { raw })
    }

    /// Releases a completion whose I/O never started.
    pub fn release(self) {
        // SAFETY: created above, never submitted, released once.
        unsafe { ffi::rbd_aio_release(self.raw) };
    }
}

/// In a completion callback: the I/O's result (bytes or a negative errno),
/// and the completion released.
///
/// # Safety
/// `c` is the completion the callback was called with, and this is called
/// once, from that callback.
pub unsafe fn finish(c: ffi::rbd_completion_t) -> isize {
    // SAFETY: the completion is live for the duration of its callback.
    let r = unsafe { ffi::rbd_aio_get_return_value(c) };
    // SAFETY: librbd keeps its own reference while the callback runs, so
    // releasing ours here (as QEMU's block/rbd.c does) frees it after.
    unsafe { ffi::rbd_aio_release(c) };
    r
}

/// librbd's version, `major.minor.extra` (loading the library if needed).
pub fn version() -> Result<String, Error> {
    ffi::load()?;
    let (mut a, mut b, mut c) = (0, 0, 0);
    // SAFETY: the library is loaded; three live out-pointers.
    unsafe { ffi::rbd_version(&mut a, &mut b, &mut c) };
    Ok(format!("{a}.{b}.{c}"))
}
