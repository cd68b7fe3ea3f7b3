//! birchfs test kit: the crash matrix, its oracle and its seeded generator.
//!
//! Test machinery kept out of `birch-core`, so the library ships none of it. Modules:
//!
//! - `fault`: a device that injects faults ([`FaultDevice`]: EIO, full device, lost and
//!   misdirected writes, lying flushes, delays, hangs) by [`Rule`]s;
//! - `matrix`: the library workloads ([`Workload`]) run on a recording `MemDevice`
//!   ([`run_matrix`]);
//! - `oracle`: what a workload did ([`History`]) and the check of every crash state of a
//!   recording ([`check_recording`], [`CrashReport`]); the FUSE-level runs of
//!   `birch crashtest --fuse-runs` (in `birch-tools`, because their mount is the FUSE
//!   adapter's) fill a `History` and call the same check;
//! - `rng`: the seeded generator ([`Rng`]) both draw from, so a seed replays exactly;
//! - `seeds`: the seeds every model and crash test runs (a fixed set plus one fresh seed a run,
//!   printed; `BIRCH_SEED` and `BIRCH_FRESH_SEED` replay).
//!
//! Dependency direction: `birch-testkit` → `birch-core` (public API only; the memory and
//! overlay devices are the core's, since fsck and the engine benchmark use them too). The
//! core's integration tests use this crate as a dev-dependency; `birch-tools` uses it for
//! `birch crashtest`.

#![warn(missing_docs)]

pub mod fault;
pub mod matrix;
pub mod oracle;
pub mod rng;
pub mod seeds;
pub mod stamp;

pub use fault::{Effect, FaultDevice, Op, Rule};
pub use matrix::{run_matrix, Workload};
pub use oracle::{check_recording, CrashReport, History, RolledBack};
pub use rng::Rng;
