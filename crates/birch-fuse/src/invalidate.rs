//! What the daemon tells the kernel to drop: cached attributes (inline, safe in a request
//! handler), and pages and entries (on a thread of its own, since they wait on the kernel).
//! Must not touch: the requests themselves; it only notifies.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use fuser::INodeNo;

use crate::BirchFuse;

/// A thread of its own for invalidations that wait on the kernel: a ranged invalidation
/// writes back (launders) and waits for the inode's dirty pages, whose WRITEs other request
/// loops serve, and an entry invalidation locks the parent directory, which a request being
/// served may hold. Neither may run inside a request handler. A clone shares the thread, which
/// ends when the last clone is dropped.
#[derive(Clone)]
pub(crate) struct Invalidator {
    pub(crate) queue: mpsc::Sender<(Inval, mpsc::Sender<()>)>,
}

/// What [`Invalidator`]'s thread tells the kernel to drop.
pub(crate) enum Inval {
    /// Every page of an inode (a directory's: its cached listing), dirty ones written back.
    Pages(u64),
    /// The dentry of a name in a directory.
    Entry(u64, Vec<u8>),
}

impl Invalidator {
    /// Starts the thread; it ends when the adapter (and every clone) is dropped.
    pub(crate) fn start(notifier: Arc<OnceLock<fuser::Notifier>>) -> Invalidator {
        let (tx, rx) = mpsc::channel::<(Inval, mpsc::Sender<()>)>();
        let spawned = std::thread::Builder::new()
            .name("birch-inval".into())
            .spawn(move || {
                for (job, done) in rx {
                    if let Some(n) = notifier.get() {
                        match job {
                            // Offset 0, length 0: every page; dirty ones are written back
                            // first.
                            Inval::Pages(ino) => {
                                if let Err(e) = n.inval_inode(INodeNo(ino), 0, 0) {
                                    log::debug!("invalidate pages of inode {ino}: {e}");
                                }
                            }
                            Inval::Entry(parent, name) => {
                                if let Err(e) =
                                    n.inval_entry(INodeNo(parent), OsStr::from_bytes(&name))
                                {
                                    log::debug!(
                                        "invalidate entry {:?} of inode {parent}: {e}",
                                        String::from_utf8_lossy(&name)
                                    );
                                }
                            }
                        }
                    }
                    let _ = done.send(());
                }
            });
        if let Err(e) = spawned {
            log::warn!("invalidation thread: {e}");
        }
        Invalidator { queue: tx }
    }

    /// Has the kernel write back and drop the pages of `ino`, and waits (at most `limit`)
    /// until it has. Returns whether it finished in time.
    pub(crate) fn write_back(&self, ino: u64, limit: Duration) -> bool {
        let (done, wait) = mpsc::channel();
        if self.queue.send((Inval::Pages(ino), done)).is_err() {
            return false;
        }
        wait.recv_timeout(limit).is_ok()
    }

    /// Has the kernel drop the pages of `ino` (dirty ones written back first), without
    /// waiting: for data the filesystem lost, whose bytes the kernel's cache still holds.
    pub(crate) fn drop_pages(&self, ino: u64) {
        let (done, _) = mpsc::channel();
        let _ = self.queue.send((Inval::Pages(ino), done));
    }

    /// Has the kernel drop its cached listing of `/.snapshot` and its entry `name` there
    /// (a snapshot made or deleted through the control xattr, which the kernel cannot see),
    /// without waiting: the entry's invalidation locks `/.snapshot`, which a request being
    /// served may hold.
    pub(crate) fn snapshot_changed(&self, name: &[u8]) {
        let dir = birch_format::SNAPSHOT_DIR_OBJECTID;
        for job in [Inval::Entry(dir, name.to_vec()), Inval::Pages(dir)] {
            let (done, _) = mpsc::channel();
            let _ = self.queue.send((job, done));
        }
    }
}

/// Tells the kernel to drop its cached attributes of `ino` (and ACLs): for changes the daemon
/// makes that the kernel cannot know of. Attributes only: safe inside a request handler (an
/// entry or range invalidation is not, see DESIGN §12.4).
pub(crate) fn invalidate_attrs(notifier: &OnceLock<fuser::Notifier>, ino: u64) {
    if let Some(notifier) = notifier.get() {
        if let Err(e) = notifier.inval_inode(INodeNo(ino), -1, 0) {
            log::debug!("invalidate attributes of inode {ino}: {e}");
        }
    }
}

impl BirchFuse {
    /// Tells the kernel to drop its cached attributes of `ino` (and ACLs): for changes the
    /// daemon makes that the kernel cannot know of. Attributes only: safe inside a request
    /// handler (an entry or range invalidation is not, see DESIGN §12.4).
    pub(crate) fn invalidate_attrs(&self, ino: u64) {
        invalidate_attrs(&self.notifier, ino);
    }
}
