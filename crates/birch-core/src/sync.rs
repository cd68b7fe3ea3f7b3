//! The synchronization primitives of the core's own lock (`striped`) and of the fsync log's
//! group commit (`log::group`), named in one place so a model checker can swap them:
//! `tests/shuttle_striped.rs` and `tests/shuttle_group_commit.rs` compile `striped_lock.rs` and
//! `log/group_commit.rs` against a `sync` module of the same names built on shuttle's
//! primitives, and run them under shuttle's schedulers.
//!
//! Owns: nothing but these names. Must not touch: what the locks protect.

pub(crate) use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
pub(crate) use std::sync::atomic::{AtomicUsize, Ordering};
pub(crate) use std::thread_local;
