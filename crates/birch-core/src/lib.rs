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
//!
//! # Public surface
//!
//! What a user of the library (and birch-fuse, birch-tools) gets: [`Filesystem`] and the
//! rest of [`vfs`] (the POSIX API, [`OpenOptions`]); [`Engine`] and [`MkfsOptions`] (mkfs,
//! open, the superblock reader, snapshots, rollback, diff, the space report: what `birch
//! mkfs`, `rollback`, `snapshot` and `inspect` call; [`Filesystem::engine`] reaches the
//! engine of an open filesystem); [`device`] (block devices: image files, block devices,
//! `rbd:`, the memory device); [`check`], [`repair`] and [`scrub`] (fsck, its repairs, the
//! checksum scrub); [`space`] (`birch inspect IMAGE space`); [`items`] and [`log`] (the item
//! keys and the fsync log reader `birch inspect` prints); [`control`] (the commands a mount
//! takes through its control xattr); [`counters`] (the figures of `birch stats`); [`error`]
//! and [`readonly`] ([`Error`], [`ReadOnlyCause`]). Everything else is `pub(crate)`.
//!
//! The feature `internals` makes the engine's modules `alloc`, `btree`, `cache`, `diff` and
//! `txn` public (they are `pub(crate)` without it; their types that the public API returns
//! stay reachable, unnamed): this crate's integration tests drive the B-tree, the node cache
//! and the allocator directly (the crate's dev-dependency on itself turns it on for them), and
//! birch-engine-bench measures them. No stability is promised for them. The shipped binary
//! (`cargo build -p birch-tools`) is built without it; a build of the whole workspace has it,
//! since birch-bench asks for it and Cargo unifies the features of one build.
//!
//! The feature `seed-before` compiles in the seeds' "before" switches
//! (`OpenOptions::bench_global_objectid_lock`, `OpenOptions::bench_apply_per_item`), for
//! benchmark builds only: bench/run.sh builds a birch with them; docs/BENCHMARKS.md.

#![warn(missing_docs)]

/// Declares engine modules that are `pub` with the `internals` feature and `pub(crate)`
/// without it (see the crate documentation: the integration tests and birch-engine-bench
/// reach into them; a library user should not). Without the feature, what only those users
/// call (items and re-exports) is dead code here, and is allowed to be; the workspace's lint
/// run has the feature on (birch-bench asks for it), so it still sees real dead code.
macro_rules! internal_mods {
    ($($(#[$attr:meta])* mod $name:ident;)*) => {$(
        $(#[$attr])*
        #[cfg(feature = "internals")]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "internals"))]
        #[allow(dead_code, unused_imports)]
        pub(crate) mod $name;
    )*};
}

// The public surface.
pub mod check;
pub mod control;
pub mod counters;
pub mod device;
pub mod error;
pub mod items;
pub mod log;
pub mod readonly;
pub mod repair;
pub mod scrub;
pub mod space;
pub mod vfs;

// Engine internals: public with the `internals` feature only.
internal_mods! {
    mod alloc;
    mod btree;
    mod cache;
    mod diff;
    mod txn;
}

// Private to the crate.
mod data;
mod delta;
mod ids;
mod pending;
mod snapshot;
mod striped;
mod sync;

pub use error::{Error, Result};
pub use readonly::ReadOnlyCause;
pub use txn::{Engine, MkfsOptions};
pub use vfs::{Filesystem, OpenOptions};
