//! Group commit: the protocol by which concurrent fsyncs share one write and one flush.
//!
//! Owns: the tickets (the open one, the last durable one, the last refused one), the leader
//! flag, the failure, the generations that decide when a refused batch stops answering
//! `Full`, the deferred waits and the hand-off, the lock they live under and the condition
//! variables waiters sleep on. The first wait that finds no leader becomes one: it takes
//! everything queued as the batch of the open ticket (opening the next), writes it through a
//! [`Writer`] with no lock held, and wakes the waiters of its ticket and one waiter of the
//! next to lead it.
//!
//! Must not touch: the device, the bytes of a batch, where it goes, what a record is. All of
//! that is the [`Writer`]'s (for the fsync log, `FsyncLog` in `log/mod.rs`); the writer's
//! queue and position (`Q`) are kept under the protocol's lock and reached only through it.
//! No lock of this module is held while a writer encodes, writes or flushes, or while a
//! deferred wait's callback or the hand-off runs.
//!
//! The code is in `group_commit.rs`, so that `tests/shuttle_group_commit.rs` can compile it
//! against shuttle's primitives (its own `crate::sync`) and check the protocol under shuttle's
//! PCT scheduler with a fake writer: waiters return only after their records are durable,
//! batches go in ticket order, one leader at a time, every deferred wait answered once, a
//! failure or a refusal answered to every waiter it concerns.

include!("group_commit.rs");
