//! Seed 001's "before", for benchmarks only (mount option `bench_serialize_sync_writes`, off
//! by default): synchronous and direct WRITEs to one inode serialized in the daemon for the
//! write and its flush, as ext4 held the inode lock across an O_SYNC direct write's flush.
//!
//! Owns: one mutex per inode written through while the switch is on (kept until unmount: a
//! benchmark's handful of files), and two figures for the stats: `sync_write_waits` (writes
//! that found their inode's mutex held) and `sync_write_max_inside` (the most writes ever
//! inside one inode's mutex at once: 1 unless the serialization is broken).
//! Must not touch: the write itself (its caller's closure) or anything when the switch is off:
//! the default path pays one branch.
//!
//! Only a build with the `seed-before` feature (benchmark builds, bench/run.sh) has the switch;
//! without it the gate is an empty type whose `run` only runs the write, and the two figures
//! stay 0 (reported all the same, so `birch stats` shows the same fields in every build).

#[cfg(feature = "seed-before")]
pub(crate) use gate::SyncWriteGate;

/// The gate of a build without the `seed-before` feature: no switch, no mutex, no figures.
#[cfg(not(feature = "seed-before"))]
pub(crate) struct SyncWriteGate;

#[cfg(not(feature = "seed-before"))]
impl SyncWriteGate {
    /// The gate for `options` (there is nothing to switch on in this build).
    pub(crate) fn for_options(_options: &crate::FuseOptions) -> SyncWriteGate {
        SyncWriteGate
    }

    /// Runs `write`.
    pub(crate) fn run<T>(&self, _ino: u64, write: impl FnOnce() -> T) -> T {
        write()
    }

    /// The figures for the stats xattr: always 0 here.
    pub(crate) fn pairs(&self) -> [(&'static str, u64); 2] {
        [("sync_write_waits", 0), ("sync_write_max_inside", 0)]
    }
}

#[cfg(feature = "seed-before")]
mod gate {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use parking_lot::Mutex;

    /// The per-inode mutexes of `bench_serialize_sync_writes` and their figures.
    #[derive(Default)]
    pub(crate) struct SyncWriteGate {
        on: bool,
        inodes: Mutex<HashMap<u64, Arc<InodeGate>>>,
        waits: AtomicU64,
        max_inside: AtomicU64,
    }

    #[derive(Default)]
    struct InodeGate {
        lock: Mutex<()>,
        inside: AtomicU64,
    }

    impl SyncWriteGate {
        /// A gate that serializes when `on`, and otherwise only runs what it is given.
        pub(crate) fn new(on: bool) -> SyncWriteGate {
            SyncWriteGate {
                on,
                ..SyncWriteGate::default()
            }
        }

        /// The gate for `options`' `bench_serialize_sync_writes`.
        pub(crate) fn for_options(options: &crate::FuseOptions) -> SyncWriteGate {
            SyncWriteGate::new(options.bench_serialize_sync_writes)
        }

        fn inode(&self, ino: u64) -> Arc<InodeGate> {
            self.inodes.lock().entry(ino).or_default().clone()
        }

        /// Runs `write` (a synchronous or direct write of `ino` and its flush): with the switch on,
        /// holding `ino`'s mutex, counting a wait when another write holds it.
        pub(crate) fn run<T>(&self, ino: u64, write: impl FnOnce() -> T) -> T {
            if !self.on {
                return write();
            }
            let gate = self.inode(ino);
            let _guard = match gate.lock.try_lock() {
                Some(guard) => guard,
                None => {
                    self.waits.fetch_add(1, Ordering::Relaxed);
                    gate.lock.lock()
                }
            };
            let inside = gate.inside.fetch_add(1, Ordering::Relaxed) + 1;
            self.max_inside.fetch_max(inside, Ordering::Relaxed);
            let result = write();
            gate.inside.fetch_sub(1, Ordering::Relaxed);
            result
        }

        /// The figures for the stats xattr.
        pub(crate) fn pairs(&self) -> [(&'static str, u64); 2] {
            [
                ("sync_write_waits", self.waits.load(Ordering::Relaxed)),
                (
                    "sync_write_max_inside",
                    self.max_inside.load(Ordering::Relaxed),
                ),
            ]
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::sync::atomic::AtomicBool;
        use std::time::Duration;

        /// On: a write of an inode whose mutex another write holds waits (and counts the wait);
        /// many writers of one inode are never inside at once. Off: nothing waits or is counted.
        #[test]
        fn on_two_writes_of_one_inode_never_overlap_and_off_they_do() {
            for on in [true, false] {
                let gate = Arc::new(SyncWriteGate::new(on));
                let first_in = Arc::new(AtomicBool::new(false));
                let release = Arc::new(AtomicBool::new(false));
                let overlapped = Arc::new(AtomicBool::new(false));
                let first = {
                    let (gate, first_in, release) =
                        (gate.clone(), first_in.clone(), release.clone());
                    std::thread::spawn(move || {
                        gate.run(7, || {
                            first_in.store(true, Ordering::SeqCst);
                            while !release.load(Ordering::SeqCst) {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        })
                    })
                };
                while !first_in.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                let second = {
                    let (gate, first_in, overlapped) =
                        (gate.clone(), first_in.clone(), overlapped.clone());
                    std::thread::spawn(move || {
                        gate.run(7, || {
                            // Inside while the first write has not been released: an overlap.
                            overlapped.store(first_in.load(Ordering::SeqCst), Ordering::SeqCst);
                        })
                    })
                };
                if on {
                    while gate.pairs()[0].1 == 0 {
                        std::thread::yield_now();
                    }
                } else {
                    while !second.is_finished() {
                        std::thread::yield_now();
                    }
                }
                // Another inode is never held up.
                gate.run(8, || ());
                first_in.store(false, Ordering::SeqCst);
                release.store(true, Ordering::SeqCst);
                first.join().expect("first");
                second.join().expect("second");
                assert_eq!(overlapped.load(Ordering::SeqCst), !on, "switch on: {on}");
                let [(_, waits), (_, max_inside)] = gate.pairs();
                assert_eq!((waits, max_inside), if on { (1, 1) } else { (0, 0) });
            }

            // Many writers of one inode: never two inside.
            let gate = Arc::new(SyncWriteGate::new(true));
            let writers: Vec<_> = (0..8)
                .map(|_| {
                    let gate = gate.clone();
                    std::thread::spawn(move || {
                        for _ in 0..200 {
                            gate.run(1, std::thread::yield_now);
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().expect("writer");
            }
            assert_eq!(gate.pairs()[1].1, 1);
        }
    }
}
