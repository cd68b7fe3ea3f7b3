//! The engine's face to the fsync log: the calls that check for a shutdown and turn the
//! engine read-only on a failed log write around [`crate::log::FsyncLog`]'s own, and the replay read at
//! open (taken once by the filesystem, erased when rejected).
//!
//! Must not touch: the log format or batching (`crate::log`), the delta, the commit.

use crate::error::{Error, Result};
use crate::log::{LogOutcome, Replay};
use crate::readonly::ReadOnlyCause;
use birch_format::log::LogRecord;

use super::Engine;

impl Engine {
    /// Bytes of the log area that hold batches no durable commit has covered yet, and the
    /// size of the area: how close fsyncs are to falling back to commits for want of room.
    pub fn log_fill_bytes(&self) -> (u64, u64) {
        self.log.fill_bytes()
    }

    /// Writes the fsync records queued so far (group commit: waits for a batch in flight) and
    /// returns once they are durable. The `log` variant of a shutdown runs this first.
    pub fn log_flush(&self) -> Result<LogOutcome> {
        self.log_wait(self.log.enqueue(Vec::new()))
    }

    /// Writes fsync records to the log (group commit); returns once durable or when the log is
    /// full. Does device I/O with no engine lock held.
    pub fn log_submit(&self, records: Vec<LogRecord>) -> Result<LogOutcome> {
        self.check_up()?;
        let result = self.log.submit(&*self.device, &self.counters, records);
        if self.is_shut_down() && result.is_err() {
            return Err(Error::Shutdown);
        }
        result
    }

    /// Queues fsync records (no I/O); see [`Engine::log_wait`].
    pub fn log_enqueue(&self, records: Vec<LogRecord>) -> u64 {
        self.log.enqueue(records)
    }

    /// [`Engine::log_wait`] without blocking: `done` gets the outcome (errors mapped as
    /// `log_wait` maps them) from whichever thread learns it ([`FsyncLog::defer`]). Returns
    /// true when the caller must arrange a leader: a call of [`Engine::log_wait`] for `ticket`
    /// (or of [`Engine::log_lead`]) on a thread that may block.
    pub fn log_defer(&self, ticket: u64, done: crate::log::Deferred) -> bool {
        if let Err(e) = self.check_up() {
            done(Err(e));
            return false;
        }
        let fence = self.fence.clone();
        self.log.defer(
            ticket,
            Box::new(move |result| {
                done(match result {
                    Err(_) if fence.is_down() => Err(Error::Shutdown),
                    other => other,
                })
            }),
        )
    }

    /// Leads log batches until every deferred wait is answered ([`FsyncLog::lead`]); what the
    /// hand-off of [`Engine::set_log_hand_off`] must arrange.
    pub fn log_lead(&self) {
        if self.check_up().is_err() {
            self.log.abandon_deferred();
            return;
        }
        let _ = self.log.lead(&*self.device, &self.counters);
        // The leader's own outcome is no error (it waited for nothing): a failure it met
        // turns the engine read-only here, as `log_wait` would.
        if let Some(error) = self.log.failure() {
            self.set_read_only(ReadOnlyCause::LogWriteFailed { error });
        }
    }

    /// How a waiter hands the leading of deferred waits over ([`FsyncLog::set_hand_off`]).
    pub fn set_log_hand_off(&self, hand_off: crate::log::HandOff) {
        self.log.set_hand_off(hand_off);
    }

    /// Waits for queued records to be durable (group commit). A failed log write turns the
    /// engine read-only. Does device I/O with no engine lock held.
    pub fn log_wait(&self, ticket: u64) -> Result<LogOutcome> {
        if let Err(e) = self.check_up() {
            // It may have been asked to lead for deferred waits: they hear the shutdown.
            self.log.abandon_deferred();
            return Err(e);
        }
        let result = self.log.wait(&*self.device, &self.counters, ticket);
        if self.is_shut_down() && result.is_err() {
            return Err(Error::Shutdown);
        }
        if let Err(e) = &result {
            self.set_read_only(ReadOnlyCause::LogWriteFailed {
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
        let at = self.replay.lock().as_ref().and_then(|r| r.rejected_at);
        let Some(at) = at else {
            return Ok(());
        };
        log::info!("erasing the log batch at {at:#x} that replay rejected for its data");
        self.device
            .write_at(&[0u8; birch_format::BLOCK_SIZE as usize], at)
            .and_then(|()| self.device.flush())
            .map_err(|e| Error::io(format!("erase the rejected log batch at {at:#x}"), e))?;
        if let Some(r) = self.replay.lock().as_mut() {
            r.rejected_at = None;
        }
        Ok(())
    }

    /// Whether log records read at open still wait for replay (a read-only open).
    pub fn replay_pending(&self) -> bool {
        self.replay
            .lock()
            .as_ref()
            .is_some_and(|r| !r.records.is_empty())
    }

    /// Takes what the log held at open (once).
    pub fn take_replay(&self) -> Option<Replay> {
        self.replay.lock().take()
    }
}
