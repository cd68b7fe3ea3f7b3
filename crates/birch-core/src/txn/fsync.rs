//! The engine's face to the fsync log, [`LogHandle`] ([`Engine::log`]): the calls of
//! [`FsyncLog`](crate::log::FsyncLog) with the engine's device and counters, the ones that
//! write or wait checking for a shutdown first and turning the engine read-only on a failed
//! log write; and the replay read at open (taken once by the filesystem, erased when
//! rejected).
//!
//! Must not touch: the log format or batching (`crate::log`), the delta, the commit.

use crate::error::{Error, Result};
use crate::log::{LogOutcome, Replay};
use crate::readonly::ReadOnlyCause;
use birch_format::log::LogRecord;

use super::Engine;

/// The fsync log of an [`Engine`] ([`Engine::log`]): queue records, wait for them (group
/// commit), lead deferred waits, and take the replay read at open. Every call that writes or
/// waits fails with [`Error::Shutdown`] once the engine is shut down, and a failed log write
/// turns the engine read-only; [`LogHandle::enqueue`], [`LogHandle::set_hand_off`] and
/// [`LogHandle::fill_bytes`] are [`FsyncLog`](crate::log::FsyncLog)'s own.
#[derive(Clone, Copy)]
pub struct LogHandle<'e> {
    engine: &'e Engine,
}

impl Engine {
    /// The fsync log (`LogHandle`).
    pub fn log(&self) -> LogHandle<'_> {
        LogHandle { engine: self }
    }
}

impl LogHandle<'_> {
    /// Bytes of the log area that hold batches no durable commit has covered yet, and the
    /// size of the area: how close fsyncs are to falling back to commits for want of room.
    pub fn fill_bytes(&self) -> (u64, u64) {
        self.engine.log.fill_bytes()
    }

    /// Writes the fsync records queued so far (group commit: waits for a batch in flight) and
    /// returns once they are durable. The `log` variant of a shutdown runs this first.
    pub fn flush(&self) -> Result<LogOutcome> {
        self.wait(self.engine.log.enqueue(Vec::new()))
    }

    /// Writes fsync records to the log (group commit); returns once durable or when the log is
    /// full. Does device I/O with no engine lock held.
    pub fn submit(&self, records: Vec<LogRecord>) -> Result<LogOutcome> {
        self.engine.check_up()?;
        let result = self
            .engine
            .log
            .submit(&*self.engine.device, &self.engine.counters, records);
        if self.engine.is_shut_down() && result.is_err() {
            return Err(Error::Shutdown);
        }
        result
    }

    /// Queues fsync records (no I/O); see [`LogHandle::wait`].
    pub fn enqueue(&self, records: Vec<LogRecord>) -> u64 {
        self.engine.log.enqueue(records)
    }

    /// [`LogHandle::wait`] without blocking: `done` gets the outcome (errors mapped as
    /// `wait` maps them) from whichever thread learns it
    /// ([`FsyncLog::defer`](crate::log::FsyncLog::defer)). Returns true when the caller must
    /// arrange a leader: a call of [`LogHandle::wait`] for `ticket` (or of [`LogHandle::lead`])
    /// on a thread that may block.
    pub fn defer(&self, ticket: u64, done: crate::log::Deferred) -> bool {
        if let Err(e) = self.engine.check_up() {
            done(Err(e));
            return false;
        }
        let fence = self.engine.fence.clone();
        self.engine.log.defer(
            ticket,
            Box::new(move |result| {
                done(match result {
                    Err(_) if fence.is_down() => Err(Error::Shutdown),
                    other => other,
                })
            }),
        )
    }

    /// Leads log batches until every deferred wait is answered
    /// ([`FsyncLog::lead`](crate::log::FsyncLog::lead)); what the hand-off of
    /// [`LogHandle::set_hand_off`] must arrange.
    pub fn lead(&self) {
        if self.engine.check_up().is_err() {
            self.engine.log.abandon_deferred();
            return;
        }
        let _ = self
            .engine
            .log
            .lead(&*self.engine.device, &self.engine.counters);
        // The leader's own outcome is no error (it waited for nothing): a failure it met
        // turns the engine read-only here, as `wait` would.
        if let Some(error) = self.engine.log.failure() {
            self.engine
                .set_read_only(ReadOnlyCause::LogWriteFailed { error });
        }
    }

    /// How a waiter hands the leading of deferred waits over
    /// ([`FsyncLog::set_hand_off`](crate::log::FsyncLog::set_hand_off)).
    pub fn set_hand_off(&self, hand_off: crate::log::HandOff) {
        self.engine.log.set_hand_off(hand_off);
    }

    /// Waits for queued records to be durable (group commit). A failed log write turns the
    /// engine read-only. Does device I/O with no engine lock held.
    pub fn wait(&self, ticket: u64) -> Result<LogOutcome> {
        if let Err(e) = self.engine.check_up() {
            // It may have been asked to lead for deferred waits: they hear the shutdown.
            self.engine.log.abandon_deferred();
            return Err(e);
        }
        let result = self
            .engine
            .log
            .wait(&*self.engine.device, &self.engine.counters, ticket);
        if self.engine.is_shut_down() && result.is_err() {
            return Err(Error::Shutdown);
        }
        if let Err(e) = &result {
            self.engine.set_read_only(ReadOnlyCause::LogWriteFailed {
                error: e.to_string(),
            });
        }
        result
    }

    /// For a writable open, before the log writes again: erases the first block of the
    /// batch replay stopped at because the data it names did not verify (a batch that landed
    /// without its data: never acknowledged, §11.1), so that no later replay takes it, once a
    /// commit covers its records, for the batch that will carry its sequence number
    /// elsewhere (a unit skip or a wrap). [`crate::log::Replay::rejected_at`].
    pub fn erase_rejected_batch(&self) -> Result<()> {
        let at = self
            .engine
            .replay
            .lock()
            .as_ref()
            .and_then(|r| r.rejected_at);
        let Some(at) = at else {
            return Ok(());
        };
        log::info!("erasing the log batch at {at:#x} that replay rejected for its data");
        self.engine
            .device
            .write_at(&[0u8; birch_format::BLOCK_SIZE as usize], at)
            .and_then(|()| self.engine.device.flush())
            .map_err(|e| Error::io(format!("erase the rejected log batch at {at:#x}"), e))?;
        if let Some(r) = self.engine.replay.lock().as_mut() {
            r.rejected_at = None;
        }
        Ok(())
    }

    /// Whether log records read at open still wait for replay (a read-only open).
    pub fn replay_pending(&self) -> bool {
        self.engine
            .replay
            .lock()
            .as_ref()
            .is_some_and(|r| !r.records.is_empty())
    }

    /// Takes what the log held at open (once).
    pub fn take_replay(&self) -> Option<Replay> {
        self.engine.replay.lock().take()
    }
}
