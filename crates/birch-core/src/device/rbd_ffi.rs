//! The few librados and librbd calls birch uses, declared by hand from Debian 12's
//! `librados-dev` and `librbd-dev` headers (Ceph 16.2, pacific).
//!
//! A small module of our own rather than bindgen at build time: the build then needs neither
//! libclang nor the headers, only the libraries to link, and every declaration here is one
//! we call and have read the header comment of. The Rust crates for librbd are too old
//! (`librbd-sys` 0.1.0 of 2016). Each declaration's signature is copied from
//! `/usr/include/rados/librados.h` or `/usr/include/rbd/librbd.h`; the C API is stable across
//! Ceph releases (symbols are only added).
//!
//! Linked only with the `rbd` cargo feature.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int};

/// `rados_t`: a cluster handle.
pub type rados_t = *mut libc::c_void;
/// `rados_ioctx_t`: an I/O context (one pool and namespace).
pub type rados_ioctx_t = *mut libc::c_void;
/// `rbd_image_t`: an open image.
pub type rbd_image_t = *mut libc::c_void;
/// `rbd_image_options_t`: options for `rbd_create4`.
pub type rbd_image_options_t = *mut libc::c_void;

/// `rbd_completion_t`: an asynchronous request's completion.
pub type rbd_completion_t = *mut libc::c_void;
/// `rbd_callback_t`: called once when an asynchronous request completes (on a librbd thread,
/// which must not call librbd synchronously).
pub type rbd_callback_t =
    Option<unsafe extern "C" fn(cb: rbd_completion_t, arg: *mut libc::c_void)>;
/// `rbd_update_callback_t`: the quiesce and unquiesce callbacks.
pub type rbd_update_callback_t = Option<unsafe extern "C" fn(arg: *mut libc::c_void)>;

/// `rbd_image_watcher_t`, filled by `rbd_watchers_list`.
#[repr(C)]
pub struct rbd_image_watcher_t {
    pub addr: *mut c_char,
    pub id: i64,
    pub cookie: u64,
}

/// `rbd_lock_mode_t`: `RBD_LOCK_MODE_EXCLUSIVE`.
pub const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;
/// `RBD_IMAGE_OPTION_FEATURES` of `rbd_image_option_t`.
pub const RBD_IMAGE_OPTION_FEATURES: c_int = 1;
/// `RBD_FEATURE_LAYERING` (features.h).
pub const RBD_FEATURE_LAYERING: u64 = 1 << 0;
/// `RBD_FEATURE_EXCLUSIVE_LOCK` (features.h).
pub const RBD_FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

/// `RBD_MAX_BLOCK_NAME_SIZE`.
const RBD_MAX_BLOCK_NAME_SIZE: usize = 24;
/// `RBD_MAX_IMAGE_NAME_SIZE`.
const RBD_MAX_IMAGE_NAME_SIZE: usize = 96;

/// `rbd_image_info_t`, filled by `rbd_stat`.
#[repr(C)]
pub struct rbd_image_info_t {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; RBD_MAX_BLOCK_NAME_SIZE],
    pub parent_pool: i64,
    pub parent_name: [c_char; RBD_MAX_IMAGE_NAME_SIZE],
}

#[link(name = "rados")]
extern "C" {
    pub fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    pub fn rados_conf_parse_env(cluster: rados_t, var: *const c_char) -> c_int;
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    pub fn rados_conf_get(
        cluster: rados_t,
        option: *const c_char,
        buf: *mut c_char,
        len: libc::size_t,
    ) -> c_int;
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_get_instance_id(cluster: rados_t) -> u64;
    /// Writes a strdup'ed string (freed with `free`) of this session's addresses, the form
    /// `rbd_lock_get_owners` names owners in.
    pub fn rados_getaddrs(cluster: rados_t, addrs: *mut *mut c_char) -> c_int;
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool_name: *const c_char,
        ioctx: *mut rados_ioctx_t,
    ) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
    /// Blocklists a client address for `expire_seconds` (0: the cluster's default, 1 h): the
    /// OSDs refuse its operations from then on.
    pub fn rados_blocklist_add(
        cluster: rados_t,
        client_address: *mut c_char,
        expire_seconds: u32,
    ) -> c_int;
    pub fn rados_ioctx_set_namespace(io: rados_ioctx_t, nspace: *const c_char);
}

#[link(name = "rbd")]
extern "C" {
    pub fn rbd_image_options_create(opts: *mut rbd_image_options_t);
    pub fn rbd_image_options_destroy(opts: rbd_image_options_t);
    pub fn rbd_image_options_set_uint64(
        opts: rbd_image_options_t,
        optname: c_int,
        optval: u64,
    ) -> c_int;
    pub fn rbd_create4(
        io: rados_ioctx_t,
        name: *const c_char,
        size: u64,
        opts: rbd_image_options_t,
    ) -> c_int;
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
    pub fn rbd_stat(
        image: rbd_image_t,
        info: *mut rbd_image_info_t,
        infosize: libc::size_t,
    ) -> c_int;
    pub fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    pub fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    pub fn rbd_get_stripe_unit(image: rbd_image_t, stripe_unit: *mut u64) -> c_int;
    pub fn rbd_get_stripe_count(image: rbd_image_t, stripe_count: *mut u64) -> c_int;
    pub fn rbd_lock_acquire(image: rbd_image_t, lock_mode: c_int) -> c_int;
    pub fn rbd_lock_release(image: rbd_image_t) -> c_int;
    pub fn rbd_lock_get_owners(
        image: rbd_image_t,
        lock_mode: *mut c_int,
        lock_owners: *mut *mut c_char,
        max_lock_owners: *mut libc::size_t,
    ) -> c_int;
    pub fn rbd_lock_get_owners_cleanup(
        lock_owners: *mut *mut c_char,
        lock_owner_count: libc::size_t,
    );
    pub fn rbd_metadata_get(
        image: rbd_image_t,
        key: *const c_char,
        value: *mut c_char,
        val_len: *mut libc::size_t,
    ) -> c_int;
    pub fn rbd_metadata_set(image: rbd_image_t, key: *const c_char, value: *const c_char) -> c_int;
    pub fn rbd_metadata_remove(image: rbd_image_t, key: *const c_char) -> c_int;
    /// Asks the OSD whether this client still holds the lock (`assert_header_locked`).
    pub fn rbd_is_exclusive_lock_owner(image: rbd_image_t, is_owner: *mut c_int) -> c_int;
    pub fn rbd_lock_break(image: rbd_image_t, lock_mode: c_int, lock_owner: *const c_char)
        -> c_int;
    pub fn rbd_watchers_list(
        image: rbd_image_t,
        watchers: *mut rbd_image_watcher_t,
        max_watchers: *mut libc::size_t,
    ) -> c_int;
    pub fn rbd_watchers_list_cleanup(
        watchers: *mut rbd_image_watcher_t,
        num_watchers: libc::size_t,
    );
    pub fn rbd_aio_create_completion(
        cb_arg: *mut libc::c_void,
        complete_cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_write(
        image: rbd_image_t,
        off: u64,
        len: libc::size_t,
        buf: *const c_char,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_read(
        image: rbd_image_t,
        off: u64,
        len: libc::size_t,
        buf: *mut c_char,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_get_return_value(c: rbd_completion_t) -> libc::ssize_t;
    pub fn rbd_aio_release(c: rbd_completion_t);
    pub fn rbd_quiesce_watch(
        image: rbd_image_t,
        quiesce_cb: rbd_update_callback_t,
        unquiesce_cb: rbd_update_callback_t,
        arg: *mut libc::c_void,
        handle: *mut u64,
    ) -> c_int;
    pub fn rbd_quiesce_complete(image: rbd_image_t, handle: u64, r: c_int);
    pub fn rbd_quiesce_unwatch(image: rbd_image_t, handle: u64) -> c_int;
}
