//! The named rules under which an fsync commits instead of logging (DESIGN §11.3).
//!
//! fsync logs an inode's changes (one batch, one flush) unless one of these rules applies;
//! then it makes everything durable with a full commit. Each rule is a [`CommitReason`] with
//! its counter, so `birch stats` says which rule cost a commit, and each has a test that
//! reaches it (`crates/birch-core/tests/fsync_rules.rs`, checked against
//! [`CommitReason::ALL`]). btrfs's tree-log keeps the same decisions as named predicates
//! (`btrfs_inode_in_log`, `last_unlink_trans`, `log_conflicting_inodes`, ...).

#![deny(clippy::too_many_lines)]

use std::sync::atomic::AtomicU64;

use crate::counters::{CounterStripe, Counters};

/// Why an fsync commits instead of logging: one variant per rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommitReason {
    /// The mount says `fsync=commit`: every fsync commits (the seeds' "before", kept for
    /// comparison); nothing is unsafe about the log, it is not used.
    CommitMode,
    /// The log area has no room for the batch (no area, a batch larger than half of it, or not
    /// enough reusable space): the records cannot be written; a commit retires batches and
    /// frees log space.
    LogFull,
    /// The inode is a directory and some item of it changed since the last commit is not its
    /// inode item or an entry a file's fsync queued with that value: logging those entries
    /// would mean logging the inodes they name (or their removal), which the log does not do.
    Directory,
    /// The inode was a `copy_file_range` clone's source or destination since the last commit
    /// (or, its state evicted since, some clone is uncommitted and a shared extent is among its
    /// changes): a batch could name a shared extent whose source the committed tree holds
    /// unflagged, which the next open would refuse.
    Cloned,
    /// The inode has link count 0 (unlinked but open, or a tmpfile not linked yet): its orphan
    /// item would have to be logged, and only a commit makes it durable with the inode.
    Unlinked,
    /// An incompat feature flag is wanted that no durable commit has set yet (the first
    /// out-of-line xattr value): a record could need a flag the image lacks.
    IncompatPending,
    /// A name of the inode was removed or renamed since replay's base (an inode ref deleted, a
    /// name replay would start from gone from a ref or back with a new dir index, or the dir
    /// item of a name missing): the old entry lives in the old parent's items, which are not
    /// logged, so replay would leave it pointing at the inode.
    NameRemoved,
    /// A name's dir item holds, in replay's base, another inode that cannot be logged with
    /// this one (it still exists and its move is not all that changed, or its names there are
    /// not exactly that one, or the committed dir item holds several entries): replaying the
    /// new entry would leave that inode with a name without an entry.
    NameHeld,
    /// A new name's directory is itself not in the last durable commit: after replay the
    /// directory would have an entry but no inode and no name of its own.
    NewParent,
    /// The dir item of a name of the inode holds more than one entry (a hash collision): its
    /// record would carry another inode's entry without that inode's items.
    HashCollision,
}

impl CommitReason {
    /// Every rule, in the order the fsync path checks them.
    pub const ALL: &'static [CommitReason] = &[
        CommitReason::CommitMode,
        CommitReason::Directory,
        CommitReason::Cloned,
        CommitReason::Unlinked,
        CommitReason::IncompatPending,
        CommitReason::NameRemoved,
        CommitReason::NewParent,
        CommitReason::HashCollision,
        CommitReason::NameHeld,
        CommitReason::LogFull,
    ];

    /// The rule's name in snake case (the name of its test's reason).
    pub fn name(self) -> &'static str {
        match self {
            CommitReason::CommitMode => "commit_mode",
            CommitReason::LogFull => "log_full",
            CommitReason::Directory => "directory",
            CommitReason::Cloned => "cloned",
            CommitReason::Unlinked => "unlinked",
            CommitReason::IncompatPending => "incompat_pending",
            CommitReason::NameRemoved => "name_removed",
            CommitReason::NameHeld => "name_held",
            CommitReason::NewParent => "new_parent",
            CommitReason::HashCollision => "hash_collision",
        }
    }

    /// The counter an fsync committing for this rule adds one to.
    pub fn counter(self) -> fn(&CounterStripe) -> &AtomicU64 {
        match self {
            CommitReason::CommitMode => |c| &c.fsync_fallback_mode,
            CommitReason::LogFull => |c| &c.fsync_fallback_log_full,
            CommitReason::Directory => |c| &c.fsync_fallback_dir,
            CommitReason::Cloned => |c| &c.fsync_fallback_clone,
            CommitReason::Unlinked => |c| &c.fsync_fallback_unlinked,
            CommitReason::IncompatPending => |c| &c.fsync_fallback_incompat,
            CommitReason::NameRemoved => |c| &c.fsync_fallback_names,
            CommitReason::NameHeld => |c| &c.fsync_fallback_name_held,
            CommitReason::NewParent => |c| &c.fsync_fallback_new_parent,
            CommitReason::HashCollision => |c| &c.fsync_fallback_collision,
        }
    }

    /// The name of [`CommitReason::counter`] (in `birch stats` and
    /// [`crate::counters::CounterValues::pairs`]).
    pub fn counter_name(self) -> &'static str {
        match self {
            CommitReason::CommitMode => "fsync_fallback_mode",
            CommitReason::LogFull => "fsync_fallback_log_full",
            CommitReason::Directory => "fsync_fallback_dir",
            CommitReason::Cloned => "fsync_fallback_clone",
            CommitReason::Unlinked => "fsync_fallback_unlinked",
            CommitReason::IncompatPending => "fsync_fallback_incompat",
            CommitReason::NameRemoved => "fsync_fallback_names",
            CommitReason::NameHeld => "fsync_fallback_name_held",
            CommitReason::NewParent => "fsync_fallback_new_parent",
            CommitReason::HashCollision => "fsync_fallback_collision",
        }
    }

    /// The broader counter that also counts this rule, for a rule split out of one that
    /// counter lumped together: `fsync_fallback_other` (unlinked inode, incompat flag pending,
    /// hash collision) and `fsync_fallback_names` (a name removed or held), whose meanings
    /// stay as they were.
    pub fn broader_counter(self) -> Option<fn(&CounterStripe) -> &AtomicU64> {
        match self {
            CommitReason::Unlinked
            | CommitReason::IncompatPending
            | CommitReason::HashCollision => Some(|c| &c.fsync_fallback_other),
            CommitReason::NameHeld => Some(|c| &c.fsync_fallback_names),
            _ => None,
        }
    }

    /// The name of [`CommitReason::broader_counter`].
    pub fn broader_counter_name(self) -> Option<&'static str> {
        match self {
            CommitReason::Unlinked
            | CommitReason::IncompatPending
            | CommitReason::HashCollision => Some("fsync_fallback_other"),
            CommitReason::NameHeld => Some("fsync_fallback_names"),
            _ => None,
        }
    }

    /// Counts one fsync that commits for this rule.
    pub(crate) fn count(self, counters: &Counters) {
        counters.add(self.counter(), 1);
        if let Some(broader) = self.broader_counter() {
            counters.add(broader, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// Each rule's counter functions add to the counters their names say.
    #[test]
    fn counters_match_their_names() {
        for reason in CommitReason::ALL {
            let counters = Counters::default();
            reason.count(&counters);
            let moved: BTreeSet<&str> = counters
                .values()
                .pairs()
                .into_iter()
                .filter(|(_, v)| *v > 0)
                .map(|(name, _)| name)
                .collect();
            let want: BTreeSet<&str> = std::iter::once(reason.counter_name())
                .chain(reason.broader_counter_name())
                .collect();
            assert_eq!(moved, want, "{reason:?}");
        }
    }

    /// `ALL` lists every rule once: a new variant must be added to this match, and then to
    /// `ALL` (and to the rules' tests, `tests/fsync_rules.rs`).
    #[test]
    fn all_lists_every_rule() {
        let index = |r: CommitReason| match r {
            CommitReason::CommitMode => 0,
            CommitReason::LogFull => 1,
            CommitReason::Directory => 2,
            CommitReason::Cloned => 3,
            CommitReason::Unlinked => 4,
            CommitReason::IncompatPending => 5,
            CommitReason::NameRemoved => 6,
            CommitReason::NameHeld => 7,
            CommitReason::NewParent => 8,
            CommitReason::HashCollision => 9,
        };
        let mut seen = [false; 10];
        for r in CommitReason::ALL {
            assert!(!seen[index(*r)], "{r:?} twice");
            seen[index(*r)] = true;
        }
        assert!(seen.iter().all(|s| *s), "ALL misses a rule: {seen:?}");
    }
}
