//! Why the engine is read-only: the one type that decides whether it may become writable again.
//!
//! Owns: the causes of the read-only state, their human-readable text (`Display`, what logs and
//! `EROFS` errors say) and the two rules built on them: a remount may make the engine writable
//! again only after a read-only state someone chose ([`ReadOnlyCause::may_become_writable`]),
//! and a failure replaces a chosen state but never the reverse ([`ReadOnlyCause::replaces`]).
//! The rules look at the variant, never at the text, so rewording a message cannot change
//! durability behaviour.
//!
//! Must not touch: the engine's state itself (`txn` holds the current cause and applies the
//! rules), I/O, locks.

use std::fmt;

/// Why the engine refuses changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOnlyCause {
    /// Opened read-only (`ro` mount option, `OpenOptions::read_only`). A remount may make it
    /// writable.
    Mounted,
    /// Remounted read-only (`remount,ro`, control command `ro`). A remount may make it
    /// writable again.
    Remounted,
    /// A writable open of an image with read-only-compatible feature flags this build does not
    /// know: it may be read, never written. Not a state of a running engine (the open fails).
    UnknownRoCompat {
        /// The unknown bits of the superblock's `ro_compat` mask.
        flags: u64,
    },
    /// A commit failed (a write, a flush, a node that failed validation): the in-memory state
    /// is ahead of the disk in ways no later commit can repair safely. Only a fresh open
    /// clears it.
    CommitFailed {
        /// The generation whose commit failed.
        generation: u64,
        /// The commit's error, as text.
        error: String,
    },
    /// A write or flush of the fsync log failed: no later fsync may claim durability through
    /// it, and the engine stops taking changes. Only a fresh open clears it.
    LogWriteFailed {
        /// The log's error, as text.
        error: String,
    },
    /// The device failed outside a commit and the log: a file's written data was lost and
    /// the mount says `errors=remount-ro` (by default such an error sticks to its file only,
    /// SEMANTICS §2). Only a fresh open clears it.
    DeviceError {
        /// The device's error, as text.
        error: String,
    },
    /// The engine was shut down (`Filesystem::shutdown`, `FS_IOC_SHUTDOWN`): nothing reaches
    /// the image any more. Only a fresh open clears it.
    Shutdown,
}

impl ReadOnlyCause {
    /// Whether a remount may make the engine writable again: only after a read-only state
    /// that was chosen (a read-only mount or remount), never after a failure or a shutdown.
    pub fn may_become_writable(&self) -> bool {
        self.is_chosen()
    }

    /// Whether the state was chosen by the user rather than forced by a failure.
    pub fn is_chosen(&self) -> bool {
        matches!(self, ReadOnlyCause::Mounted | ReadOnlyCause::Remounted)
    }

    /// Whether this cause takes the place of `current` as the engine's read-only state: a
    /// failure replaces a chosen state (once a commit has failed, no remount may make the
    /// engine writable and no later commit may run); nothing else replaces anything, so the
    /// first failure is the one reported.
    pub fn replaces(&self, current: &ReadOnlyCause) -> bool {
        current.is_chosen() && !self.is_chosen()
    }

    /// Whether the commit may still run in this state: a chosen read-only state commits what
    /// reached the delta before it began (remount,ro turns read-only first, then commits);
    /// after a failure nothing more may become durable.
    pub fn allows_commit(&self) -> bool {
        self.is_chosen()
    }

    /// The level the engine logs the change to this state at: information for a chosen
    /// state, an error for a failure.
    pub fn log_level(&self) -> log::Level {
        if self.is_chosen() {
            log::Level::Info
        } else {
            log::Level::Error
        }
    }
}

impl fmt::Display for ReadOnlyCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadOnlyCause::Mounted => write!(f, "mounted read-only"),
            ReadOnlyCause::Remounted => write!(f, "mounted read-only (remount)"),
            ReadOnlyCause::UnknownRoCompat { flags } => write!(
                f,
                "image has read-only-compatible features {flags:#x} this build does not know; \
                 open it read-only"
            ),
            ReadOnlyCause::CommitFailed { generation, error } => {
                write!(f, "commit of generation {generation} failed: {error}")
            }
            ReadOnlyCause::LogWriteFailed { error } => write!(f, "fsync log failed: {error}"),
            ReadOnlyCause::DeviceError { error } => write!(f, "device error: {error}"),
            ReadOnlyCause::Shutdown => write!(f, "the filesystem is shut down"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_cause() -> Vec<ReadOnlyCause> {
        vec![
            ReadOnlyCause::Mounted,
            ReadOnlyCause::Remounted,
            ReadOnlyCause::UnknownRoCompat { flags: 4 },
            ReadOnlyCause::CommitFailed {
                generation: 7,
                error: "I/O error".into(),
            },
            ReadOnlyCause::LogWriteFailed {
                error: "I/O error".into(),
            },
            ReadOnlyCause::DeviceError {
                error: "I/O error".into(),
            },
            ReadOnlyCause::Shutdown,
        ]
    }

    #[test]
    fn a_read_only_mount_may_become_writable() {
        assert!(ReadOnlyCause::Mounted.may_become_writable());
    }

    #[test]
    fn a_read_only_remount_may_become_writable() {
        assert!(ReadOnlyCause::Remounted.may_become_writable());
    }

    #[test]
    fn unknown_ro_compat_features_never_become_writable() {
        assert!(!ReadOnlyCause::UnknownRoCompat { flags: 1 }.may_become_writable());
    }

    #[test]
    fn a_failed_commit_never_becomes_writable() {
        let cause = ReadOnlyCause::CommitFailed {
            generation: 3,
            error: "flush failed".into(),
        };
        assert!(!cause.may_become_writable());
        assert!(!cause.allows_commit());
    }

    #[test]
    fn a_failed_log_write_never_becomes_writable() {
        let cause = ReadOnlyCause::LogWriteFailed {
            error: "write failed".into(),
        };
        assert!(!cause.may_become_writable());
        assert!(!cause.allows_commit());
    }

    #[test]
    fn a_device_error_never_becomes_writable() {
        let cause = ReadOnlyCause::DeviceError {
            error: "EIO".into(),
        };
        assert!(!cause.may_become_writable());
    }

    #[test]
    fn a_shutdown_never_becomes_writable() {
        assert!(!ReadOnlyCause::Shutdown.may_become_writable());
        assert!(!ReadOnlyCause::Shutdown.allows_commit());
    }

    /// The rule the free-text test used to encode: a failure replaces a chosen state, a
    /// chosen state never replaces anything, and the first failure stays.
    #[test]
    fn failures_replace_chosen_states_and_nothing_replaces_a_failure() {
        for new in every_cause() {
            for current in every_cause() {
                let expected = current.is_chosen() && !new.is_chosen();
                assert_eq!(new.replaces(&current), expected, "{new:?} over {current:?}");
            }
        }
    }

    /// The remount decision follows the variant, not the text: the messages of chosen states
    /// still read as before (logs and scripts see them), and a failure's text may say
    /// "mounted read-only" without becoming writable.
    #[test]
    fn the_decision_is_the_variants_not_the_texts() {
        assert_eq!(ReadOnlyCause::Mounted.to_string(), "mounted read-only");
        assert_eq!(
            ReadOnlyCause::Remounted.to_string(),
            "mounted read-only (remount)"
        );
        let misleading = ReadOnlyCause::DeviceError {
            error: "mounted read-only".into(),
        };
        assert!(!misleading.may_become_writable());
    }
}
