//! The I/O timeout (`io_timeout=SECS`): a device that gives up a request its device has not
//! answered in time, and the device with it.
//!
//! Owns: a pool of I/O threads that run the requests of one device, the deadline of each
//! request, and the device's "given up" state (the first request that ran out of time, named).
//! Must not touch: what is read or written (it copies bytes, never looks at them), or what the
//! filesystem does about a lost device (its owner's hook decides; a mount turns the
//! filesystem read-only, SEMANTICS §2).
//!
//! A hung device (a dying disk, an image file on a network filesystem that went away) never
//! returns from a read, write or flush. A thread cannot be pulled out of such a system call,
//! so the request runs on a thread of the pool while its caller waits for the answer for at
//! most the timeout: then the caller gets `EIO` ("the device did not answer a write … within
//! 30 s"), the device is given up, and every later request fails at once with the same
//! cause, reads included. The hook runs once, on the caller's thread. What was in flight may
//! still land later; the filesystem treats each such request as failed (a commit that failed
//! is not durable, a log batch that failed acknowledged nothing), so a late write changes
//! nothing anyone was told. The pool's thread stays in the device until it answers.
//!
//! Cost: the bytes of every request are copied once (the caller's buffers cannot be lent to
//! a thread that may outlive the call) and each request is a hand-off between two threads.
//! Off unless asked for (DESIGN §10.12).

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::BlockDevice;
use crate::counters::Counters;

/// Threads the pool grows to at most; a request that finds them all busy waits in the queue
/// (its wait counts against its deadline).
const MAX_THREADS: usize = 512;

/// What a caller is told once the device is given up.
type Hook = Box<dyn Fn(&str) + Send + Sync>;

type Job = Box<dyn FnOnce() + Send>;

/// A device whose requests must be answered within a timeout.
pub struct TimeoutDevice {
    base: Arc<dyn BlockDevice>,
    timeout: Duration,
    pool: Arc<Pool>,
    /// The request that ran out of time first, named; set once.
    given_up: OnceLock<String>,
    on_give_up: OnceLock<Hook>,
}

struct Pool {
    queue: Mutex<PoolState>,
    ready: Condvar,
    /// Threads started (never fewer: a thread in a hung device stays).
    threads: AtomicUsize,
}

struct PoolState {
    jobs: VecDeque<Job>,
    idle: usize,
    closed: bool,
}

impl TimeoutDevice {
    /// `base`, its requests given up after `timeout`.
    pub fn new(base: Arc<dyn BlockDevice>, timeout: Duration) -> Arc<TimeoutDevice> {
        Arc::new(TimeoutDevice {
            base,
            timeout,
            pool: Arc::new(Pool {
                queue: Mutex::new(PoolState {
                    jobs: VecDeque::new(),
                    idle: 0,
                    closed: false,
                }),
                ready: Condvar::new(),
                threads: AtomicUsize::new(0),
            }),
            given_up: OnceLock::new(),
            on_give_up: OnceLock::new(),
        })
    }

    /// Sets what runs (once) when the device is given up, told the cause. Only the first
    /// hook set counts.
    pub fn on_give_up(&self, hook: Hook) {
        let _ = self.on_give_up.set(hook);
        // Given up before the hook was set (during the open): tell it now.
        if let Some(cause) = self.given_up.get() {
            if let Some(hook) = self.on_give_up.get() {
                hook(cause);
            }
        }
    }

    /// Why the device was given up, if it was.
    pub fn given_up(&self) -> Option<&str> {
        self.given_up.get().map(String::as_str)
    }

    /// The timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `io` on the pool and waits for it at most the timeout. `what` names the request
    /// in the error.
    fn run<T: Send + 'static>(
        &self,
        what: impl FnOnce() -> String,
        io: impl FnOnce(&dyn BlockDevice) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        if let Some(cause) = self.given_up.get() {
            return Err(given_up_error(cause));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let base = self.base.clone();
        self.pool.submit(Box::new(move || {
            let _ = tx.send(io(&*base));
        }));
        match rx.recv_timeout(self.timeout) {
            Ok(result) => result,
            Err(RecvTimeoutError::Timeout) => {
                let cause = format!(
                    "the device did not answer a {} within {} s (io_timeout); it is given up, \
                     and every later request fails",
                    what(),
                    self.timeout.as_secs_f64()
                );
                if self.given_up.set(cause.clone()).is_ok() {
                    log::error!("{cause}");
                    if let Some(hook) = self.on_give_up.get() {
                        hook(&cause);
                    }
                }
                Err(given_up_error(self.given_up.get().unwrap_or(&cause)))
            }
            Err(RecvTimeoutError::Disconnected) => Err(io::Error::other(format!(
                "{}: the I/O thread ended without an answer",
                what()
            ))),
        }
    }
}

/// The error of a request on a device given up (`EIO` to a POSIX caller, as every device
/// error is).
fn given_up_error(cause: &str) -> io::Error {
    io::Error::other(cause.to_string())
}

impl Pool {
    fn submit(self: &Arc<Self>, job: Job) {
        let mut q = self.queue.lock();
        q.jobs.push_back(job);
        if q.idle == 0 && self.threads.load(Ordering::Relaxed) < MAX_THREADS {
            self.threads.fetch_add(1, Ordering::Relaxed);
            let pool = self.clone();
            let spawned = std::thread::Builder::new()
                .name("birch-io".into())
                .spawn(move || pool.work());
            if spawned.is_err() {
                // No thread to be had: an idle or busy one takes the job when it can (the
                // caller's deadline still holds).
                self.threads.fetch_sub(1, Ordering::Relaxed);
            }
        }
        drop(q);
        self.ready.notify_one();
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q.idle += 1;
                    self.ready.wait(&mut q);
                    q.idle -= 1;
                }
            };
            job();
        }
    }
}

impl Drop for TimeoutDevice {
    fn drop(&mut self) {
        self.pool.queue.lock().closed = true;
        self.pool.ready.notify_all();
    }
}

impl BlockDevice for TimeoutDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = buf.len();
        let data = self.run(
            || format!("read at {offset:#x} length {len}"),
            move |d| {
                let mut data = vec![0u8; len];
                d.read_at(&mut data, offset).map(|()| data)
            },
        )?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let data = buf.to_vec();
        self.run(
            || format!("write at {offset:#x} length {}", buf.len()),
            move |d| d.write_at(&data, offset),
        )
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        let owned: Vec<(u64, Vec<u8>)> = writes.iter().map(|(o, b)| (*o, b.to_vec())).collect();
        let first = writes.first().map_or(0, |(o, _)| *o);
        self.run(
            || format!("batch of {} writes from {first:#x}", writes.len()),
            move |d| {
                let borrowed: Vec<(u64, &[u8])> =
                    owned.iter().map(|(o, b)| (*o, b.as_slice())).collect();
                d.write_many(&borrowed)
            },
        )
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let shape: Vec<(u64, usize)> = reads.iter().map(|(o, b)| (*o, b.len())).collect();
        let first = shape.first().map_or(0, |(o, _)| *o);
        let count = shape.len();
        let data = self.run(
            || format!("batch of {count} reads from {first:#x}"),
            move |d| {
                let mut owned: Vec<(u64, Vec<u8>)> =
                    shape.iter().map(|(o, n)| (*o, vec![0u8; *n])).collect();
                let mut borrowed: Vec<(u64, &mut [u8])> = owned
                    .iter_mut()
                    .map(|(o, b)| (*o, b.as_mut_slice()))
                    .collect();
                d.read_many(&mut borrowed)?;
                Ok(owned)
            },
        )?;
        for ((_, buf), (_, bytes)) in reads.iter_mut().zip(data) {
            buf.copy_from_slice(&bytes);
        }
        Ok(())
    }

    fn can_trim(&self) -> bool {
        self.base.can_trim()
    }

    fn trim(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        let ranges = ranges.to_vec();
        let count = ranges.len();
        self.run(
            || format!("trim of {count} ranges"),
            move |d| d.trim(&ranges),
        )
    }

    fn discard(&self, ranges: &[(u64, u64)]) -> io::Result<()> {
        let ranges = ranges.to_vec();
        let count = ranges.len();
        self.run(
            || format!("discard of {count} ranges"),
            move |d| d.discard(&ranges),
        )
    }

    fn flush(&self) -> io::Result<()> {
        self.run(|| "flush".to_string(), |d| d.flush())
    }

    fn size_bytes(&self) -> u64 {
        self.base.size_bytes()
    }

    fn atomic_unit(&self) -> u64 {
        self.base.atomic_unit()
    }

    fn write_error_is_fatal(&self) -> bool {
        self.base.write_error_is_fatal()
    }

    fn counters(&self) -> &Counters {
        self.base.counters()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    /// A memory device whose flushes hang while `hang` is set.
    struct Stuck {
        mem: MemDevice,
        hang: Arc<AtomicBool>,
    }

    impl BlockDevice for Stuck {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.mem.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.mem.write_at(buf, offset)
        }
        fn flush(&self) -> io::Result<()> {
            while self.hang.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            self.mem.flush()
        }
        fn size_bytes(&self) -> u64 {
            self.mem.size_bytes()
        }
        fn counters(&self) -> &Counters {
            self.mem.counters()
        }
    }

    fn stuck() -> (Arc<AtomicBool>, Arc<dyn BlockDevice>) {
        let hang = Arc::new(AtomicBool::new(false));
        let dev = Stuck {
            mem: MemDevice::new(1 << 20),
            hang: hang.clone(),
        };
        (hang, Arc::new(dev))
    }

    #[test]
    fn requests_pass_through_with_their_bytes() {
        let (_hang, base) = stuck();
        let dev = TimeoutDevice::new(base.clone(), Duration::from_secs(5));
        let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        dev.write_at(&block, 8192).expect("write");
        dev.write_many(&[(0, &block[..]), (4096, &[9u8; 4096][..])])
            .expect("write_many");
        dev.flush().expect("flush");
        let mut back = vec![0u8; 4096];
        base.read_at(&mut back, 8192).expect("read the base");
        assert_eq!(back, block, "the bytes reached the device");
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        dev.read_many(&mut [(0, &mut a[..]), (4096, &mut b[..])])
            .expect("read_many");
        assert_eq!(a, block);
        assert_eq!(b, vec![9u8; 4096]);
        let mut c = vec![0u8; 4096];
        dev.read_at(&mut c, 8192).expect("read");
        assert_eq!(c, block);
        assert!(dev.given_up().is_none());
    }

    #[test]
    fn a_hung_request_is_given_up_and_so_is_every_later_one() {
        let (hang, base) = stuck();
        let dev = TimeoutDevice::new(base, Duration::from_millis(200));
        let told = Arc::new(Mutex::new(Vec::<String>::new()));
        let t = told.clone();
        dev.on_give_up(Box::new(move |why| t.lock().push(why.to_string())));
        hang.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let err = dev.flush().expect_err("a hung flush fails");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "given up after the timeout, not before and not never: {waited:?}"
        );
        assert!(
            err.to_string()
                .contains("did not answer a flush within 0.2 s"),
            "{err}"
        );
        // Every later request fails at once, reads too, even once the device answers again.
        hang.store(false, Ordering::SeqCst);
        let started = Instant::now();
        let mut buf = vec![0u8; 4096];
        let err = dev
            .read_at(&mut buf, 0)
            .expect_err("a read after the give-up");
        assert!(started.elapsed() < Duration::from_millis(100), "at once");
        assert!(err.to_string().contains("io_timeout"), "{err}");
        assert!(dev.write_at(&buf, 0).is_err());
        assert_eq!(
            told.lock().len(),
            1,
            "the hook runs once: {:?}",
            told.lock()
        );
        assert!(dev.given_up().is_some_and(|w| w.contains("flush")));
    }

    #[test]
    fn a_hook_set_after_the_give_up_is_told_at_once() {
        let (hang, base) = stuck();
        let dev = TimeoutDevice::new(base, Duration::from_millis(50));
        hang.store(true, Ordering::SeqCst);
        assert!(dev.flush().is_err());
        hang.store(false, Ordering::SeqCst);
        let told = Arc::new(AtomicBool::new(false));
        let t = told.clone();
        dev.on_give_up(Box::new(move |_| t.store(true, Ordering::SeqCst)));
        assert!(told.load(Ordering::SeqCst));
    }

    #[test]
    fn many_callers_at_once_each_get_their_own_answer() {
        let (_hang, base) = stuck();
        let dev = TimeoutDevice::new(base, Duration::from_secs(10));
        std::thread::scope(|s| {
            for t in 0..16u64 {
                let dev = &dev;
                s.spawn(move || {
                    for v in 0..20u64 {
                        let stamp = (t << 32 | v).to_le_bytes();
                        let block: Vec<u8> = stamp.iter().copied().cycle().take(4096).collect();
                        dev.write_at(&block, t * 4096).expect("write");
                        let mut back = vec![0u8; 4096];
                        dev.read_at(&mut back, t * 4096).expect("read");
                        assert_eq!(back, block, "thread {t} version {v}");
                    }
                });
            }
        });
        assert!(dev.given_up().is_none());
    }
}
