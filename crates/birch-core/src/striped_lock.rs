// The striped lock's code, without its tests: `striped.rs` (the module, with its doc and unit
// tests) and `tests/shuttle_striped.rs` (the same code on shuttle's primitives) both
// `include!` it. Its names come from `crate::sync` and `crate::counters`.

use crate::counters::{stripe_index, CachePadded, STRIPES};
use crate::sync::{
    thread_local, AtomicUsize, Condvar, Mutex, Ordering, RwLock, RwLockReadGuard,
    RwLockWriteGuard,
};

// `StripedWrite::first` relies on at least one stripe.
const _: () = assert!(STRIPES > 0);

/// How many slots the reads a thread holds are counted in. Each lock counts in one slot
/// (`Striped::slot`, handed out round robin), so two locks may share one: a thread that holds
/// the other then reads this one at once instead of waiting for its writer. That costs only
/// fairness, never a deadlock (a count is never too low), and it keeps a read's bookkeeping to
/// one thread-local add and subtract, with no search.
const HELD_SLOTS: usize = 64;

/// The next lock's slot. Plain std (not `crate::sync`): which slot a lock gets is not part of
/// what a model checker explores, and a static must outlive its runs.
static NEXT_SLOT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    /// Reads of striped locks this thread holds, by slot.
    static HELD: [std::cell::Cell<u32>; HELD_SLOTS] =
        const { [const { std::cell::Cell::new(0) }; HELD_SLOTS] };
}

/// How many reads of locks of `slot` this thread holds.
fn held(slot: usize) -> u32 {
    HELD.with(|h| h[slot].get())
}

/// Counts one more read of a lock of `slot` by this thread.
fn enter(slot: usize) {
    HELD.with(|h| h[slot].set(h[slot].get() + 1));
}

/// Counts one read of a lock of `slot` by this thread as ended.
fn leave(slot: usize) {
    HELD.with(|h| h[slot].set(h[slot].get().saturating_sub(1)));
}

/// The lock; each stripe holds its own copy of the value.
pub(crate) struct Striped<T> {
    stripes: Box<[CachePadded<RwLock<T>>]>,
    /// Writers that found a stripe busy and have not got every stripe yet.
    waiting: CachePadded<AtomicUsize>,
    /// Readers that hold no stripe wait here while `waiting` is not zero.
    door: Mutex<()>,
    opened: Condvar,
    /// Where this thread's reads of this lock are counted ([`HELD_SLOTS`]).
    slot: usize,
}

/// This thread's stripe, read-locked: what [`Striped::read`] returns.
pub(crate) struct StripedRead<'a, T> {
    guard: RwLockReadGuard<'a, T>,
    slot: usize,
}

impl<T> std::ops::Deref for StripedRead<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> Drop for StripedRead<'_, T> {
    fn drop(&mut self) {
        leave(self.slot);
    }
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
            waiting: CachePadded(AtomicUsize::new(0)),
            door: Mutex::new(()),
            opened: Condvar::new(),
            slot: NEXT_SLOT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % HELD_SLOTS,
        }
    }

    /// Writers waiting now (for tests).
    #[cfg(test)]
    pub(crate) fn writers_waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// This thread's stripe, read-locked. Recursive: a thread that holds a read of this lock
    /// may read again even while a writer waits; a thread that holds none waits first for
    /// the writers that wait (module doc).
    pub(crate) fn read(&self) -> StripedRead<'_, T> {
        if self.waiting.load(Ordering::SeqCst) > 0 && held(self.slot) == 0 {
            let mut door = self.door.lock();
            while self.waiting.load(Ordering::SeqCst) > 0 {
                self.opened.wait(&mut door);
            }
        }
        let guard = self.stripes[stripe_index() % self.stripes.len()].read_recursive();
        enter(self.slot);
        StripedRead {
            guard,
            slot: self.slot,
        }
    }

    /// Every stripe, write-locked. Never holds some stripes while it waits for another: it
    /// takes them with `try_write`, and when one is busy it lets go of all, waits for that one
    /// alone, and starts over. So a writer waiting on one long reader (an operation doing data
    /// I/O under the gate) holds up no reader that is already inside, as one lock would.
    pub(crate) fn write(&self) -> StripedWrite<'_, T> {
        let mut counted = false;
        let guards = 'attempt: loop {
            let mut guards = Vec::with_capacity(self.stripes.len());
            for stripe in self.stripes.iter() {
                match stripe.try_write() {
                    Some(guard) => guards.push(guard),
                    None => {
                        drop(guards);
                        if !counted {
                            self.waiting.fetch_add(1, Ordering::SeqCst);
                            counted = true;
                        }
                        drop(stripe.write());
                        continue 'attempt;
                    }
                }
            }
            break guards;
        };
        if counted && self.waiting.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Taken under the door's lock, so a reader between its check and its wait
            // cannot miss the wake-up.
            let _door = self.door.lock();
            self.opened.notify_all();
        }
        StripedWrite { guards }
    }
}
