//! The C ABI of the parts of librados and librbd (Ceph 16, librbd 1.16)
//! that the rbd backend uses, transcribed from `<rados/librados.h>` and
//! `<rbd/librbd.h>`. Nothing more: every function here is called by
//! [`super::sys`], the safe layer.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

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

#[link(name = "rados")]
extern "C" {
    pub fn rados_create2(
        pcluster: *mut rados_t,
        clustername: *const c_char,
        name: *const c_char,
        flags: u64,
    ) -> c_int;
    pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    pub fn rados_conf_parse_env(cluster: rados_t, var: *const c_char) -> c_int;
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    pub fn rados_conf_get(
        cluster: rados_t,
        option: *const c_char,
        buf: *mut c_char,
        len: usize,
    ) -> c_int;
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool_name: *const c_char,
        ioctx: *mut rados_ioctx_t,
    ) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
}

#[link(name = "rbd")]
extern "C" {
    pub fn rbd_version(major: *mut c_int, minor: *mut c_int, extra: *mut c_int);
    pub fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_close(image: rbd_image_t) -> c_int;
    pub fn rbd_stat(image: rbd_image_t, info: *mut rbd_image_info_t, infosize: usize) -> c_int;
    pub fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    pub fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    pub fn rbd_features_to_string(
        features: u64,
        str_features: *mut c_char,
        size: *mut usize,
    ) -> c_int;
    pub fn rbd_aio_create_completion(
        cb_arg: *mut c_void,
        complete_cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    pub fn rbd_aio_release(c: rbd_completion_t);
    pub fn rbd_aio_readv(
        image: rbd_image_t,
        iov: *const libc::iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_writev(
        image: rbd_image_t,
        iov: *const libc::iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    pub fn rbd_diff_iterate2(
        image: rbd_image_t,
        fromsnapname: *const c_char,
        ofs: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        cb: Option<
            unsafe extern "C" fn(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int,
        >,
        arg: *mut c_void,
    ) -> c_int;
    pub fn rbd_aio_write_zeroes(
        image: rbd_image_t,
        off: u64,
        len: usize,
        c: rbd_completion_t,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
}
