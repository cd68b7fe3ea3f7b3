//! birchfs core: a copy-on-write B-tree filesystem as a library.
//!
//! Layers, each allowed to call only those after it: `vfs` (the POSIX API) → `items` (typed
//! keys and operations over inode, link and xattr items, over a live or committed view) and
//! `data` (file data blocks and extent maps: allocation, writes, verified reads, reservations,
//! the one free path) → `txn` (the engine, a folder of parts: `open` (mkfs, open), `commit`,
//! `read` (merged reads, committed views), `snapshots` (the snapshot policy), `objectid`,
//! `fsync` (the log, reached through `Engine::log`)) → `snapshot` (the snapshot list and the
//! walks between snapshot trees) and `log` (the fsync log) → `delta` → `btree` (its `walk`:
//! the whole-tree walks, the open's and the union walk) → `cache` → `device`; `alloc` is
//! reached through the engine (for data blocks, only by `data`); `check` never writes: it
//! reads the device through `birch-format`, the engine's superblock reader and `log`'s
//! reader (to check a replayed log it opens a `vfs::Filesystem` on an overlay of the image);
//! `space` (where the blocks go: `birch inspect IMAGE space`) reads through the engine,
//! `snapshot` and `btree::walk` and never writes; `scrub` reads committed views (the engine's
//! committed roots and snapshot list, or an image's superblock and snapshot list) straight
//! from the device and never writes.
//! `error`, `readonly` (why the engine is read-only) and `ids` (object-id batching) are leaves
//! that every layer may use and that use no layer. No module's code imports a module that
//! imports it back (`log`'s unit tests do use `txn` and `vfs`). The on-disk format lives in
//! the `birch-format` crate. Nothing here knows about FUSE.

#![warn(missing_docs)]

pub mod alloc;
pub mod btree;
pub mod cache;
pub mod check;
pub mod control;
pub mod counters;
mod data;
pub mod delta;
pub mod device;
pub mod diff;
pub mod error;
mod ids;
pub mod items;
pub mod log;
mod pending;
pub mod readonly;
pub mod repair;
pub mod scrub;
pub mod snapshot;
pub mod space;
mod striped;
mod sync;
pub mod txn;
pub mod vfs;

pub use error::{Error, Result};
pub use readonly::ReadOnlyCause;
pub use txn::{Engine, MkfsOptions};
pub use vfs::{Filesystem, OpenOptions};
