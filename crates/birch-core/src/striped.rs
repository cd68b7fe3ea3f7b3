//! A reader-writer lock striped by thread, for state that every operation reads and only
//! commits write (the engine's gate and its read state).
//!
//! Owns: the stripes, which stripe a thread reads, which locks of this kind a thread holds
//! (to let it read again), and the writers-waiting count. A reader takes the read lock of its
//! own stripe only (each stripe alone on its cache lines), so readers on different cores
//! write no common line; a writer takes every stripe's write lock and changes every stripe's
//! copy of the value, never holding some stripes while it waits for another. Must not touch:
//! what the value means.
//!
//! Writers are not starved: once a writer finds a stripe busy it counts itself in `waiting`,
//! and a thread that holds no stripe of this lock waits for that count to fall to zero before
//! it reads. A thread that holds a stripe already reads again at once (an operation that holds
//! the gate records its items through it), so the writer waits at most for the reads in flight
//! when it started to wait, and for their nested reads. `tests/shuttle_striped.rs` checks this
//! under shuttle's PCT scheduler, with this file compiled against shuttle's primitives
//! (`crate::sync`).

include!("striped_lock.rs");

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A thread that adds 1 under the write lock.
    fn spawn_writer(lock: &Arc<Striped<u64>>) -> std::thread::JoinHandle<()> {
        let lock = lock.clone();
        std::thread::spawn(move || lock.write().each(|v| *v += 1))
    }

    fn wait_until_the_writer_waits(lock: &Striped<u64>) {
        while lock.writers_waiting() == 0 {
            std::thread::yield_now();
        }
    }

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
        let writer = spawn_writer(&lock);
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
        let writer = spawn_writer(&lock);
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

    #[test]
    fn a_reader_that_holds_the_lock_reads_again_while_a_writer_waits() {
        let lock = Arc::new(Striped::new(|| 0u64));
        let first = lock.read();
        let writer = spawn_writer(&lock);
        wait_until_the_writer_waits(&lock);
        // Would deadlock if it waited for the writer, which waits for `first`.
        let again = lock.read();
        assert_eq!(*again, 0);
        drop(again);
        drop(first);
        writer.join().expect("writer");
        assert_eq!(*lock.read(), 1);
    }

    #[test]
    fn a_new_reader_waits_for_a_waiting_writer() {
        let lock = Arc::new(Striped::new(|| 0u64));
        let first = lock.read();
        let writer = spawn_writer(&lock);
        wait_until_the_writer_waits(&lock);
        // Another thread (holding nothing) reads only after the writer: it sees 1.
        let reader = {
            let lock = lock.clone();
            std::thread::spawn(move || *lock.read())
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !reader.is_finished(),
            "a new reader went ahead of a waiting writer"
        );
        drop(first);
        writer.join().expect("writer");
        assert_eq!(reader.join().expect("reader"), 1);
    }
}
