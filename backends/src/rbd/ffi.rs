//! The C ABI of the parts of librados and librbd (Ceph 16, librbd 1.16)
//! that the rbd backend uses, transcribed from `<rados/librados.h>` and
//! `<rbd/librbd.h>`. Nothing more: every function here is called by
//! [`super::sys`], the safe layer.
//!
//! The libraries are loaded at run time, by soname (`librados.so.2`,
//! `librbd.so.1`), when the first `rbd:` device is opened ([`load`]): the
//! binary links neither, so it builds without Ceph's headers or libraries
//! and runs everything else where they are missing. Every symbol is
//! resolved once into one table ([`Api`]); a call through it is an indirect
//! call, as a PLT call into a linked library is.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};
use std::sync::OnceLock;

use udm_core::{Error, ErrorKind};

/// `rados_t`: a cluster handle.
pub type rados_t = *mut c_void;
/// `rados_ioctx_t`: an I/O context (one pool).
pub type rados_ioctx_t = *mut c_void;
/// `rbd_image_t`: an open image.
pub type rbd_image_t = *mut c_void;
/// `rbd_completion_t`: an asynchronous I/O's completion.
pub type rbd_completion_t = *mut c_void;
/// `rbd_callback_t`: called on one of librbd's threads when an I/O completes.
pub type rbd_callback_t = Option<unsafe extern "C" fn(cb: rbd_completion_t, arg: *mut c_void)>;

/// The callback of `rbd_diff_iterate2`: an extent, whether it exists.
pub type rbd_diff_callback_t =
    Option<unsafe extern "C" fn(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int>;

/// `RBD_MAX_BLOCK_NAME_SIZE`.
pub const RBD_MAX_BLOCK_NAME_SIZE: usize = 24;
/// `RBD_MAX_IMAGE_NAME_SIZE`.
pub const RBD_MAX_IMAGE_NAME_SIZE: usize = 96;

/// `rbd_image_info_t`.
#[repr(C)]
pub struct rbd_image_info_t {
    /// Size in bytes.
    pub size: u64,
    /// Object size in bytes.
    pub obj_size: u64,
    /// Number of objects.
    pub num_objs: u64,
    /// log2 of the object size.
    pub order: c_int,
    /// Deprecated.
    pub block_name_prefix: [c_char; RBD_MAX_BLOCK_NAME_SIZE],
    /// Deprecated.
    pub parent_pool: i64,
    /// Deprecated.
    pub parent_name: [c_char; RBD_MAX_IMAGE_NAME_SIZE],
}

/// The shared objects, by soname, and the Debian package that has each.
const RADOS: (&str, &str) = ("librados.so.2", "librados2");
const RBD: (&str, &str) = ("librbd.so.1", "librbd1");

/// Declares the functions once: a field of [`Api`] each, resolved by
/// [`Api::resolve`], and an `unsafe fn` of the same name and signature
/// that calls through the loaded table, so the safe layer reads as if the
/// libraries were linked.
macro_rules! api {
    ($( $lib:ident: fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?; )*) => {
        /// Every function the backend calls, resolved from the loaded
        /// libraries.
        pub struct Api {
            $( $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?, )*
            // Last, so the functions are dropped (nothing to drop) before the
            // libraries that hold their code; never unloaded in practice, as
            // the table lives in a static.
            _rbd: libloading::Library,
            _rados: libloading::Library,
        }

        impl Api {
            fn resolve(rados: libloading::Library, rbd: libloading::Library) -> Result<Api, String> {
                Ok(Api {
                    $( $name: {
                        let lib = match stringify!($lib) { "rados" => &rados, _ => &rbd };
                        let soname = match stringify!($lib) { "rados" => RADOS.0, _ => RBD.0 };
                        // SAFETY: the symbol is the C function of this name,
                        // whose signature the type transcribes from Ceph's
                        // headers; the pointer is copied out, and the library
                        // that holds it is kept in the same table for as long
                        // as the pointer is.
                        unsafe {
                            *lib.get::<unsafe extern "C" fn($($ty),*) $(-> $ret)?>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                            .map_err(|e| format!("{soname} has no {}: {}", stringify!($name), why(&e)))?
                        }
                    }, )*
                    _rbd: rbd,
                    _rados: rados,
                })
            }
        }

        $(
            #[doc = concat!("`", stringify!($name), "`, through the loaded library.")]
            ///
            /// # Safety
            /// As the C function's; and [`load`] has succeeded (every handle
            /// the safe layer makes proves it: [`super::sys::Cluster::connect`]
            /// loads first).
            #[inline]
            #[allow(clippy::too_many_arguments)] // the C function's
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: the caller's promise, as the C function's.
                unsafe { (loaded().$name)($($arg),*) }
            }
        )*
    };
}

api! {
    rados: fn rados_create2(pcluster: *mut rados_t, clustername: *const c_char, name: *const c_char, flags: u64) -> c_int;
    rados: fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    rados: fn rados_conf_parse_env(cluster: rados_t, var: *const c_char) -> c_int;
    rados: fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    rados: fn rados_conf_get(cluster: rados_t, option: *const c_char, buf: *mut c_char, len: usize) -> c_int;
    rados: fn rados_connect(cluster: rados_t) -> c_int;
    rados: fn rados_shutdown(cluster: rados_t);
    rados: fn rados_ioctx_create(cluster: rados_t, pool_name: *const c_char, ioctx: *mut rados_ioctx_t) -> c_int;
    rados: fn rados_ioctx_destroy(io: rados_ioctx_t);
    rbd: fn rbd_version(major: *mut c_int, minor: *mut c_int, extra: *mut c_int);
    rbd: fn rbd_open(io: rados_ioctx_t, name: *const c_char, image: *mut rbd_image_t, snap_name: *const c_char) -> c_int;
    rbd: fn rbd_open_read_only(io: rados_ioctx_t, name: *const c_char, image: *mut rbd_image_t, snap_name: *const c_char) -> c_int;
    rbd: fn rbd_close(image: rbd_image_t) -> c_int;
    rbd: fn rbd_stat(image: rbd_image_t, info: *mut rbd_image_info_t, infosize: usize) -> c_int;
    rbd: fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    rbd: fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    rbd: fn rbd_features_to_string(features: u64, str_features: *mut c_char, size: *mut usize) -> c_int;
    rbd: fn rbd_aio_create_completion(cb_arg: *mut c_void, complete_cb: rbd_callback_t, c: *mut rbd_completion_t) -> c_int;
    rbd: fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    rbd: fn rbd_aio_release(c: rbd_completion_t);
    rbd: fn rbd_aio_readv(image: rbd_image_t, iov: *const libc::iovec, iovcnt: c_int, off: u64, c: rbd_completion_t) -> c_int;
    rbd: fn rbd_aio_writev(image: rbd_image_t, iov: *const libc::iovec, iovcnt: c_int, off: u64, c: rbd_completion_t) -> c_int;
    rbd: fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    rbd: fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    rbd: fn rbd_diff_iterate2(image: rbd_image_t, fromsnapname: *const c_char, ofs: u64, len: u64, include_parent: u8, whole_object: u8, cb: rbd_diff_callback_t, arg: *mut c_void) -> c_int;
    rbd: fn rbd_aio_write_zeroes(image: rbd_image_t, off: u64, len: usize, c: rbd_completion_t, zero_flags: c_int, op_flags: c_int) -> c_int;
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn open(lib: (&str, &str)) -> Result<libloading::Library, String> {
    let (soname, package) = lib;
    // SAFETY: loading runs the library's initialisers; librados and librbd
    // are Ceph's own client libraries, whose initialisers only set up their
    // globals (they are what QEMU and fio load the same way).
    unsafe { libloading::Library::new(soname) }.map_err(|e| {
        format!(
            "rbd: cannot load {soname} (install the {package} package): {}",
            why(&e)
        )
    })
}

/// dlerror's text (libloading's own Display only says which call failed).
fn why(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(s) => s.to_string(),
        None => e.to_string(),
    }
}

/// Loads librados and librbd and resolves every function, once; later calls
/// return the first outcome. The error names the library and the package
/// that provides it.
pub fn load() -> Result<&'static Api, Error> {
    API.get_or_init(|| {
        let rados = open(RADOS)?;
        let rbd = open(RBD)?;
        Api::resolve(rados, rbd).map_err(|e| format!("rbd: {e} (librbd too old?)"))
    })
    .as_ref()
    .map_err(|e| Error::new(ErrorKind::NotFound, e.clone()))
}

/// The loaded table. Only reached through a handle made after [`load`]
/// succeeded.
fn loaded() -> &'static Api {
    match API.get() {
        Some(Ok(api)) => api,
        _ => unreachable!("rbd: a librbd call before the library was loaded"),
    }
}
