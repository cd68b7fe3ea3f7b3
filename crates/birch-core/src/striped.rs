//! A reader-writer lock striped by thread, for state that every operation reads and only
//! commits write (the engine's gate and its read state).
//!
//! Owns: the stripes and which stripe a thread reads. A reader takes the read lock of its own
//! stripe only (each stripe alone on its cache lines), so readers on different cores write no
//! common line; a writer takes every stripe's write lock and changes every
//! stripe's copy of the value, never holding some stripes while it waits for another. Must
//! not touch: what the value means.

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::counters::{stripe_index, CachePadded, STRIPES};

// `StripedWrite::first` relies on at least one stripe.
const _: () = assert!(STRIPES > 0);

/// The lock; each stripe holds its own copy of the value.
pub(crate) struct Striped<T> {
    stripes: Box<[CachePadded<RwLock<T>>]>,
}

/// Every stripe write-locked, in order: what [`Striped::write`] returns.
pub(crate) struct StripedWrite<'a, T> {
    guards: Vec<RwLockWriteGuard<'a, T>>,
}

impl<T> StripedWrite<'_, T> {
    /// Changes each stripe's copy.
    pub(crate) fn each(&mut self, mut change: impl FnMut(&mut T)) {
        for guard in &mut self.guards {
            change(guard);
        }
    }

    /// The first stripe's copy (every copy agrees on what the caller keeps in step).
    pub(crate) fn first(&self) -> &T {
        &self.guards[0]
    }
}

impl<T> Striped<T> {
    /// A lock whose stripes start as `make()` each.
    pub(crate) fn new(mut make: impl FnMut() -> T) -> Striped<T> {
        Striped {
            stripes: (0..STRIPES)
                .map(|_| CachePadded(RwLock::new(make())))
                .collect(),
        }
    }

    /// This thread's stripe, read-locked. Recursive: a thread that holds it may take it again
    /// even while a writer waits.
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
        self.stripes[stripe_index() % self.stripes.len()].read_recursive()
    }

    /// Every stripe, write-locked. Never holds some stripes while it waits for another: it
    /// takes them with `try_write`, and when one is busy it lets go of all, waits for that one
    /// alone, and starts over. So a writer waiting on one long reader (an operation doing data
    /// I/O under the gate) blocks no reader of the other stripes, as one lock would not.
    pub(crate) fn write(&self) -> StripedWrite<'_, T> {
        'attempt: loop {
            let mut guards = Vec::with_capacity(self.stripes.len());
            for stripe in self.stripes.iter() {
                match stripe.try_write() {
                    Some(guard) => guards.push(guard),
                    None => {
                        drop(guards);
                        drop(stripe.write());
                        continue 'attempt;
                    }
                }
            }
            return StripedWrite { guards };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn writers_change_every_stripe_and_readers_see_their_stripe() {
        let lock = Arc::new(Striped::new(|| 0u64));
        lock.write().each(|v| *v = 7);
        let seen: Vec<u64> = std::thread::scope(|s| {
            (0..2 * STRIPES)
                .map(|_| s.spawn(|| *lock.read()))
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().expect("reader"))
                .collect()
        });
        assert!(seen.iter().all(|v| *v == 7), "{seen:?}");
    }

    #[test]
    fn a_waiting_writer_holds_no_stripe() {
        let lock = Arc::new(Striped::new(|| 0u64));
        // The last stripe is held; a writer must wait for it, and while it waits a reader of
        // any other stripe still gets in (a writer that took stripes in order would hold all
        // the others).
        let reader = lock.stripes[STRIPES - 1].read();
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || lock.write().each(|v| *v += 1))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        for stripe in lock.stripes.iter() {
            let got = stripe.try_read_recursive().is_some();
            assert!(got, "a stripe stayed locked while the writer waited");
        }
        drop(reader);
        writer.join().expect("writer");
        assert_eq!(*lock.read(), 1);
    }

    #[test]
    fn a_writer_waits_for_readers_of_any_stripe() {
        let lock = Arc::new(Striped::new(|| 0u64));
        let reader = lock.read();
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || lock.write().each(|v| *v += 1))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !writer.is_finished(),
            "the writer went past a held read lock"
        );
        assert_eq!(*reader, 0);
        drop(reader);
        writer.join().expect("writer");
        assert_eq!(*lock.read(), 1);
    }
}
