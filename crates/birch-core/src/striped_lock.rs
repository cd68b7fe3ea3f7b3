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

thread_local! {
    /// The striped locks this thread holds a read of: (lock address, depth).
    static HELD: std::cell::RefCell<Vec<(usize, usize)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How many reads of the lock at `addr` this thread holds.
fn held(addr: usize) -> usize {
    HELD.with(|h| h.borrow().iter().find(|(a, _)| *a == addr).map_or(0, |(_, d)| *d))
}

/// Counts one more read of the lock at `addr` by this thread.
fn enter(addr: usize) {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        match h.iter_mut().find(|(a, _)| *a == addr) {
            Some((_, depth)) => *depth += 1,
            None => h.push((addr, 1)),
        }
    });
}

/// Counts one read of the lock at `addr` by this thread as ended.
fn leave(addr: usize) {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if let Some(at) = h.iter().position(|(a, _)| *a == addr) {
            h[at].1 -= 1;
            if h[at].1 == 0 {
                h.swap_remove(at);
            }
        }
    });
}

/// The lock; each stripe holds its own copy of the value.
pub(crate) struct Striped<T> {
    stripes: Box<[CachePadded<RwLock<T>>]>,
    /// Writers that found a stripe busy and have not got every stripe yet.
    waiting: CachePadded<AtomicUsize>,
    /// Readers that hold no stripe wait here while `waiting` is not zero.
    door: Mutex<()>,
    opened: Condvar,
}

/// This thread's stripe, read-locked: what [`Striped::read`] returns.
pub(crate) struct StripedRead<'a, T> {
    guard: RwLockReadGuard<'a, T>,
    addr: usize,
}

impl<T> std::ops::Deref for StripedRead<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> Drop for StripedRead<'_, T> {
    fn drop(&mut self) {
        leave(self.addr);
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
        }
    }

    /// Writers waiting now (for tests).
    #[cfg(test)]
    pub(crate) fn writers_waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    fn addr(&self) -> usize {
        self as *const Striped<T> as usize
    }

    /// This thread's stripe, read-locked. Recursive: a thread that holds a read of this lock
    /// may read again even while a writer waits; a thread that holds none waits first for
    /// the writers that wait (module doc).
    pub(crate) fn read(&self) -> StripedRead<'_, T> {
        let addr = self.addr();
        if self.waiting.load(Ordering::SeqCst) > 0 && held(addr) == 0 {
            let mut door = self.door.lock();
            while self.waiting.load(Ordering::SeqCst) > 0 {
                self.opened.wait(&mut door);
            }
        }
        let guard = self.stripes[stripe_index() % self.stripes.len()].read_recursive();
        enter(addr);
        StripedRead { guard, addr }
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
