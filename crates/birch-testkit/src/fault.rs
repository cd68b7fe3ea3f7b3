//! A fault-injecting device: wraps any [`BlockDevice`] and makes chosen requests fail, lie,
//! land elsewhere, stall or hang, as a dying disk, a lying write cache or a thin-provisioned
//! pool does (after xfstests' dm-error, dm-flakey and dm-dust, ZFS's ztest).
//!
//! Owns: the rules ([`Rule`]: which requests, from when, how often, with what effect), the
//! decision per request, and the count of what it injected ([`FaultStats`]). Rules can be
//! added, released (a hang) and cleared while the device is in use.
//!
//! Must not touch: the filesystem above it. It only sees byte offsets; which are data and
//! which are metadata is the test's business (it may learn the addresses from the engine).
//! Lives in the test kit, so no shipped build of `birch` contains it by accident.
//!
//! Effects and what the device does:
//! - [`Effect::Eio`]: the request fails with `EIO`, nothing is written (a write) or flushed.
//! - [`Effect::NoSpace`]: a write fails with `ENOSPC` (a thin pool or a Ceph cluster at its
//!   full ratio), distinct from the filesystem's own full disk.
//! - [`Effect::Lose`]: a write is acknowledged and dropped (a lost write).
//! - [`Effect::Misdirect`]: a write lands `delta` bytes away (a misdirected write), and its
//!   own place keeps its old bytes.
//! - [`Effect::Lie`]: a flush is acknowledged without flushing (a volatile cache that lies).
//! - [`Effect::Delay`]: the request waits that long, then runs.
//! - [`Effect::Hang`]: the request waits until [`FaultDevice::release_hangs`], then runs.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use birch_core::counters::Counters;
use birch_core::device::BlockDevice;

use crate::rng::Rng;

/// Which kind of request a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `read_at` and each read of `read_many`.
    Read,
    /// `write_at` and each write of `write_many`.
    Write,
    /// `flush`.
    Flush,
}

/// What a matching request meets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Effect {
    /// Fails with `EIO`.
    Eio,
    /// A write fails with `ENOSPC` (the device is full, not the filesystem).
    NoSpace,
    /// A write is acknowledged and not stored.
    Lose,
    /// A write is stored `delta` bytes from where it was sent (wrapping inside the device).
    Misdirect {
        /// Bytes to add to the offset (a multiple of the block size).
        delta: u64,
    },
    /// A flush is acknowledged and nothing is flushed.
    Lie,
    /// The request waits this long, then runs.
    Delay(Duration),
    /// The request waits until [`FaultDevice::release_hangs`], then runs.
    Hang,
}

/// One fault: requests of `op` overlapping `range`, from the `after`th matching request on,
/// each with `percent` chance, at most `times` times, meet `effect`.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The kind of request.
    pub op: Op,
    /// Byte range `[start, end)` a request must overlap; `None`: anywhere (flushes have no
    /// range and match only `None`).
    pub range: Option<(u64, u64)>,
    /// Matching requests let through before the fault starts.
    pub after: u64,
    /// Chance of each matching request, in percent (100: every one).
    pub percent: u64,
    /// At most this many injections; `None`: no limit.
    pub times: Option<u64>,
    /// Only writes whose bytes this accepts (a test that stamps one file's blocks fails only
    /// that file's writes, wherever the allocator puts them); `None`: any.
    pub content: Option<fn(&[u8]) -> bool>,
    /// What happens.
    pub effect: Effect,
}

impl Rule {
    /// Every request of `op` meets `effect`, from now on.
    pub fn always(op: Op, effect: Effect) -> Rule {
        Rule {
            op,
            range: None,
            after: 0,
            percent: 100,
            times: None,
            content: None,
            effect,
        }
    }

    /// Only writes whose bytes `accept` says yes to.
    pub fn matching(mut self, accept: fn(&[u8]) -> bool) -> Rule {
        self.content = Some(accept);
        self
    }

    /// Only requests overlapping `[start, end)`.
    pub fn within(mut self, start: u64, end: u64) -> Rule {
        self.range = Some((start, end));
        self
    }

    /// Only from the `n`th matching request on (the first `n` pass).
    pub fn after(mut self, n: u64) -> Rule {
        self.after = n;
        self
    }

    /// Each matching request with `percent` chance.
    pub fn percent(mut self, percent: u64) -> Rule {
        self.percent = percent.min(100);
        self
    }

    /// At most `n` injections.
    pub fn times(mut self, n: u64) -> Rule {
        self.times = Some(n);
        self
    }

    /// Parses `OP:EFFECT[,range=START-END][,after=N][,percent=P][,times=N]`, the form a
    /// test's environment or command line gives: OP is `read`, `write` or `flush`; EFFECT is
    /// `eio`, `nospace`, `lose`, `misdirect=DELTA`, `lie`, `delay=MS` or `hang`. Numbers may
    /// be decimal or `0x` hex.
    pub fn parse(text: &str) -> Result<Rule, String> {
        let bad = |why: &str| format!("fault rule {text:?}: {why}");
        let mut parts = text.split(',');
        let head = parts.next().unwrap_or_default();
        let (op, effect) = head
            .split_once(':')
            .ok_or_else(|| bad("expected OP:EFFECT first"))?;
        let op = match op {
            "read" => Op::Read,
            "write" => Op::Write,
            "flush" => Op::Flush,
            other => return Err(bad(&format!("unknown request kind {other:?}"))),
        };
        let (name, value) = match effect.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (effect, None),
        };
        let number = |v: Option<&str>| -> Result<u64, String> {
            let v = v.ok_or_else(|| bad("a value is missing"))?;
            parse_number(v).ok_or_else(|| bad(&format!("{v:?} is not a number")))
        };
        let effect = match name {
            "eio" => Effect::Eio,
            "nospace" => Effect::NoSpace,
            "lose" => Effect::Lose,
            "misdirect" => Effect::Misdirect {
                delta: number(value)?,
            },
            "lie" => Effect::Lie,
            "delay" => Effect::Delay(Duration::from_millis(number(value)?)),
            "hang" => Effect::Hang,
            other => return Err(bad(&format!("unknown effect {other:?}"))),
        };
        let fits = match effect {
            Effect::Lose | Effect::Misdirect { .. } | Effect::NoSpace => op == Op::Write,
            Effect::Lie => op == Op::Flush,
            Effect::Eio | Effect::Delay(_) | Effect::Hang => true,
        };
        if !fits {
            return Err(bad("that effect does not apply to that request kind"));
        }
        let mut rule = Rule::always(op, effect);
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(&format!("{part:?} is not KEY=VALUE")))?;
            match key {
                "range" => {
                    let (start, end) = value
                        .split_once('-')
                        .ok_or_else(|| bad("range is START-END"))?;
                    let (start, end) = (number(Some(start))?, number(Some(end))?);
                    if start >= end {
                        return Err(bad("range is empty"));
                    }
                    rule = rule.within(start, end);
                }
                "after" => rule = rule.after(number(Some(value))?),
                "percent" => rule = rule.percent(number(Some(value))?),
                "times" => rule = rule.times(number(Some(value))?),
                other => return Err(bad(&format!("unknown key {other:?}"))),
            }
        }
        if op == Op::Flush && rule.range.is_some() {
            return Err(bad("a flush has no range"));
        }
        Ok(rule)
    }

    fn matches(&self, op: Op, span: Option<(u64, u64)>, bytes: Option<&[u8]>) -> bool {
        if self.op != op {
            return false;
        }
        if let Some(accept) = self.content {
            if !bytes.is_some_and(accept) {
                return false;
            }
        }
        match (self.range, span) {
            (None, _) => true,
            (Some((start, end)), Some((at, len))) => at < end && at.saturating_add(len) > start,
            (Some(_), None) => false,
        }
    }
}

fn parse_number(text: &str) -> Option<u64> {
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// What the device injected, by effect.
#[derive(Debug, Default)]
pub struct FaultStats {
    /// Requests failed with `EIO`.
    pub eio: AtomicU64,
    /// Writes failed with `ENOSPC`.
    pub nospace: AtomicU64,
    /// Writes acknowledged and dropped.
    pub lost: AtomicU64,
    /// Writes stored elsewhere.
    pub misdirected: AtomicU64,
    /// Flushes acknowledged without flushing.
    pub lied: AtomicU64,
    /// Requests delayed.
    pub delayed: AtomicU64,
    /// Requests that hung until released.
    pub hung: AtomicU64,
}

impl std::fmt::Display for FaultStats {
    /// `eio N, nospace N, lost N, misdirected N, lied N, delayed N, hung N`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        write!(
            f,
            "eio {}, nospace {}, lost {}, misdirected {}, lied {}, delayed {}, hung {}",
            n(&self.eio),
            n(&self.nospace),
            n(&self.lost),
            n(&self.misdirected),
            n(&self.lied),
            n(&self.delayed),
            n(&self.hung)
        )
    }
}

impl FaultStats {
    /// Every injection, whatever its effect.
    pub fn total(&self) -> u64 {
        [
            &self.eio,
            &self.nospace,
            &self.lost,
            &self.misdirected,
            &self.lied,
            &self.delayed,
            &self.hung,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }
}

/// Rules taken off a device, with their counts ([`FaultDevice::take_rules`]).
pub struct SavedRules(Vec<Armed>);

struct Armed {
    rule: Rule,
    /// Matching requests seen.
    seen: u64,
    /// Injections made.
    injected: u64,
}

struct Rules {
    armed: Vec<Armed>,
    rng: Rng,
}

/// A [`BlockDevice`] that injects [`Rule`]s' faults into the requests it passes to `inner`.
pub struct FaultDevice {
    inner: Arc<dyn BlockDevice>,
    rules: Mutex<Rules>,
    /// Bumped by [`FaultDevice::release_hangs`]; a hung request waits for it to change.
    release: Mutex<u64>,
    released: Condvar,
    /// What was injected.
    pub stats: FaultStats,
}

impl FaultDevice {
    /// A device that passes every request to `inner` until rules are added; `seed` draws
    /// the chances.
    pub fn new(inner: Arc<dyn BlockDevice>, seed: u64) -> FaultDevice {
        FaultDevice {
            inner,
            rules: Mutex::new(Rules {
                armed: Vec::new(),
                rng: Rng::new(seed),
            }),
            release: Mutex::new(0),
            released: Condvar::new(),
            stats: FaultStats::default(),
        }
    }

    /// Adds a rule; it counts its `after` from now.
    pub fn add(&self, rule: Rule) {
        self.lock_rules().armed.push(Armed {
            rule,
            seen: 0,
            injected: 0,
        });
    }

    /// Removes every rule (requests hung now stay hung until [`FaultDevice::release_hangs`]).
    pub fn clear(&self) {
        self.lock_rules().armed.clear();
    }

    /// Removes every rule and returns them, with what they counted, for
    /// [`FaultDevice::restore_rules`] (a step that must run without faults).
    pub fn take_rules(&self) -> SavedRules {
        SavedRules(std::mem::take(&mut self.lock_rules().armed))
    }

    /// Puts back rules [`FaultDevice::take_rules`] took, before any added since.
    pub fn restore_rules(&self, saved: SavedRules) {
        let mut rules = self.lock_rules();
        let added = std::mem::replace(&mut rules.armed, saved.0);
        rules.armed.extend(added);
    }

    /// Lets every request hung so far go on.
    pub fn release_hangs(&self) {
        let mut generation = self.release.lock().unwrap_or_else(|e| e.into_inner());
        *generation += 1;
        self.released.notify_all();
    }

    /// Runs a command in the text form a mount's control channel carries (`birch fault MNT
    /// TEXT` on a test build): a rule in [`Rule::parse`]'s form is added, `clear` removes
    /// every rule, `release` lets hung requests go on. Returns what was done, for the log.
    pub fn command(&self, text: &str) -> Result<String, String> {
        match text.trim() {
            "clear" => {
                self.clear();
                Ok("fault rules cleared".into())
            }
            "release" => {
                self.release_hangs();
                Ok("hung requests released".into())
            }
            rule => {
                let parsed = Rule::parse(rule)?;
                self.add(parsed);
                Ok(format!("fault rule added: {rule}"))
            }
        }
    }

    /// The device the faults are injected in front of.
    pub fn inner(&self) -> &Arc<dyn BlockDevice> {
        &self.inner
    }

    fn lock_rules(&self) -> MutexGuard<'_, Rules> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The effect a request meets, if any (the first rule that fires). Every matching rule
    /// counts the request.
    fn decide(&self, op: Op, span: Option<(u64, u64)>, bytes: Option<&[u8]>) -> Option<Effect> {
        let mut rules = self.lock_rules();
        let Rules { armed, rng } = &mut *rules;
        let mut fired = None;
        for armed in armed.iter_mut() {
            if !armed.rule.matches(op, span, bytes) {
                continue;
            }
            armed.seen += 1;
            if fired.is_some()
                || armed.seen <= armed.rule.after
                || armed.rule.times.is_some_and(|t| armed.injected >= t)
                || !rng.chance(armed.rule.percent)
            {
                continue;
            }
            armed.injected += 1;
            fired = Some(armed.rule.effect);
        }
        fired
    }

    /// Waits out a delay or a hang; returns the effect left to apply (`None` when the
    /// request then runs as usual).
    fn wait(&self, effect: Option<Effect>) -> Option<Effect> {
        match effect {
            Some(Effect::Delay(pause)) => {
                self.stats.delayed.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(pause);
                None
            }
            Some(Effect::Hang) => {
                self.stats.hung.fetch_add(1, Ordering::Relaxed);
                let mut generation = self.release.lock().unwrap_or_else(|e| e.into_inner());
                let start = *generation;
                while *generation == start {
                    generation = self
                        .released
                        .wait(generation)
                        .unwrap_or_else(|e| e.into_inner());
                }
                None
            }
            other => other,
        }
    }

    fn eio(&self, what: &str, offset: Option<u64>) -> io::Error {
        self.stats.eio.fetch_add(1, Ordering::Relaxed);
        let at = offset.map_or(String::new(), |o| format!(" at {o:#x}"));
        io::Error::other(format!("injected EIO: {what}{at}"))
    }

    fn write_one(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let effect = self.decide(Op::Write, Some((offset, buf.len() as u64)), Some(buf));
        match self.wait(effect) {
            None => self.inner.write_at(buf, offset),
            Some(Effect::Eio) => Err(self.eio("write", Some(offset))),
            Some(Effect::NoSpace) => {
                self.stats.nospace.fetch_add(1, Ordering::Relaxed);
                Err(io::Error::from_raw_os_error(libc::ENOSPC))
            }
            Some(Effect::Lose) => {
                self.stats.lost.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Some(Effect::Misdirect { delta }) => {
                self.stats.misdirected.fetch_add(1, Ordering::Relaxed);
                let size = self.inner.size_bytes();
                let len = buf.len() as u64;
                let span = size.saturating_sub(len).max(1);
                let to = offset.saturating_add(delta) % span;
                let to = to - to % birch_format::BLOCK_SIZE;
                self.inner.write_at(buf, to)
            }
            // Not a write's effect (the parser refuses it): the write runs.
            Some(Effect::Lie | Effect::Delay(_) | Effect::Hang) => self.inner.write_at(buf, offset),
        }
    }
}

impl BlockDevice for FaultDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let effect = self.decide(Op::Read, Some((offset, buf.len() as u64)), None);
        match self.wait(effect) {
            Some(Effect::Eio) => Err(self.eio("read", Some(offset))),
            _ => self.inner.read_at(buf, offset),
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_one(buf, offset)
    }

    fn write_many(&self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        for (offset, bytes) in writes {
            self.write_one(bytes, *offset)?;
        }
        Ok(())
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (offset, buf) in reads.iter_mut() {
            self.read_at(buf, *offset)?;
        }
        Ok(())
    }

    fn atomic_unit(&self) -> u64 {
        self.inner.atomic_unit()
    }

    fn write_error_is_fatal(&self) -> bool {
        self.inner.write_error_is_fatal()
    }

    fn flush(&self) -> io::Result<()> {
        let effect = self.decide(Op::Flush, None, None);
        match self.wait(effect) {
            Some(Effect::Eio) => Err(self.eio("flush", None)),
            Some(Effect::Lie) => {
                self.stats.lied.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            _ => self.inner.flush(),
        }
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn counters(&self) -> &Counters {
        self.inner.counters()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;
    use birch_core::device::MemDevice;

    const BS: u64 = birch_format::BLOCK_SIZE;

    fn device() -> (Arc<MemDevice>, FaultDevice) {
        let mem = Arc::new(MemDevice::new(64 * BS));
        let fault = FaultDevice::new(mem.clone(), 7);
        (mem, fault)
    }

    fn block(fill: u8) -> Vec<u8> {
        vec![fill; BS as usize]
    }

    fn read(dev: &dyn BlockDevice, at: u64) -> Vec<u8> {
        let mut buf = block(0);
        dev.read_at(&mut buf, at).expect("read");
        buf
    }

    /// The text commands of a mount's control channel: a rule arms, `clear` disarms, a bad
    /// rule is refused with its reason and changes nothing.
    #[test]
    fn text_commands_add_and_clear_rules() {
        let (_mem, dev) = device();
        dev.command("write:eio,times=1").expect("rule");
        assert!(dev.write_at(&block(1), 0).is_err(), "the rule fires once");
        dev.write_at(&block(1), 0).expect("then passes");
        dev.command("flush:eio").expect("rule");
        dev.command("clear").expect("clear");
        dev.flush().expect("cleared");
        let e = dev.command("flush:lose").expect_err("lose is for writes");
        assert!(e.contains("does not apply"), "{e}");
        dev.flush().expect("nothing armed by a refused rule");
        dev.command("release").expect("release");
        assert_eq!(
            dev.stats.to_string(),
            "eio 1, nospace 0, lost 0, misdirected 0, lied 0, delayed 0, hung 0"
        );
    }

    #[test]
    fn a_write_in_the_range_fails_and_one_outside_it_does_not() {
        let (mem, dev) = device();
        dev.add(Rule::always(Op::Write, Effect::Eio).within(4 * BS, 8 * BS));
        let err = dev.write_at(&block(1), 5 * BS).expect_err("inside");
        assert!(
            err.to_string().contains("injected EIO: write at 0x5000"),
            "{err}"
        );
        dev.write_at(&block(2), 8 * BS).expect("outside");
        assert_eq!(read(&*mem, 5 * BS), block(0), "nothing written");
        assert_eq!(read(&*mem, 8 * BS), block(2));
        assert_eq!(dev.stats.eio.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn after_and_times_bound_the_faults() {
        let (_, dev) = device();
        dev.add(Rule::always(Op::Read, Effect::Eio).after(2).times(1));
        let mut buf = block(0);
        let results: Vec<bool> = (0..5).map(|_| dev.read_at(&mut buf, 0).is_ok()).collect();
        assert_eq!(results, vec![true, true, false, true, true]);
    }

    #[test]
    fn a_lost_write_is_acknowledged_and_not_stored() {
        let (mem, dev) = device();
        dev.write_at(&block(1), 3 * BS).expect("first");
        dev.add(Rule::always(Op::Write, Effect::Lose).times(1));
        dev.write_at(&block(2), 3 * BS).expect("acknowledged");
        assert_eq!(read(&*mem, 3 * BS), block(1));
        assert_eq!(dev.stats.lost.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_misdirected_write_lands_elsewhere() {
        let (mem, dev) = device();
        dev.add(Rule::always(Op::Write, Effect::Misdirect { delta: 2 * BS }).times(1));
        dev.write_at(&block(9), 3 * BS).expect("acknowledged");
        assert_eq!(read(&*mem, 3 * BS), block(0));
        assert_eq!(read(&*mem, 5 * BS), block(9));
    }

    #[test]
    fn a_lying_flush_makes_nothing_durable() {
        let (mem, dev) = device();
        dev.write_at(&block(4), 2 * BS).expect("write");
        dev.add(Rule::always(Op::Flush, Effect::Lie).times(1));
        dev.flush().expect("acknowledged");
        assert_eq!(read(&mem.crash(), 2 * BS), block(0), "lost at power loss");
        dev.flush().expect("a true flush");
        assert_eq!(read(&mem.crash(), 2 * BS), block(4));
    }

    #[test]
    fn a_content_rule_fails_only_the_writes_it_accepts() {
        let (mem, dev) = device();
        dev.add(Rule::always(Op::Write, Effect::Eio).matching(|b| b.first() == Some(&7)));
        assert!(dev.write_at(&block(7), 0).is_err());
        dev.write_at(&block(8), BS).expect("other bytes");
        assert_eq!(read(&*mem, BS), block(8));
    }

    #[test]
    fn a_full_device_says_enospc() {
        let (_, dev) = device();
        dev.add(Rule::always(Op::Write, Effect::NoSpace));
        let err = dev.write_at(&block(1), 0).expect_err("full");
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
    }

    #[test]
    fn a_hung_request_waits_for_its_release() {
        let (_, dev) = device();
        let dev = Arc::new(dev);
        dev.add(Rule::always(Op::Flush, Effect::Hang).times(1));
        let waiter = {
            let dev = dev.clone();
            std::thread::spawn(move || dev.flush())
        };
        while dev.stats.hung.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "hung until released");
        dev.release_hangs();
        waiter.join().expect("join").expect("flush after release");
    }

    #[test]
    fn a_percentage_fires_about_that_often() {
        let (_, dev) = device();
        dev.add(Rule::always(Op::Read, Effect::Eio).percent(25));
        let mut buf = block(0);
        let failed = (0..2000)
            .filter(|_| dev.read_at(&mut buf, 0).is_err())
            .count();
        assert!((350..650).contains(&failed), "{failed} of 2000");
    }

    #[test]
    fn rules_parse_from_text_and_bad_ones_are_refused() {
        let rule =
            Rule::parse("write:eio,range=0x1000-0x3000,after=3,percent=50,times=2").expect("parse");
        let same = |a: &Rule, b: &Rule| format!("{a:?}") == format!("{b:?}");
        assert!(same(
            &rule,
            &Rule::always(Op::Write, Effect::Eio)
                .within(0x1000, 0x3000)
                .after(3)
                .percent(50)
                .times(2)
        ));
        assert!(same(
            &Rule::parse("flush:lie").expect("lie"),
            &Rule::always(Op::Flush, Effect::Lie)
        ));
        assert!(same(
            &Rule::parse("read:delay=15").expect("delay"),
            &Rule::always(Op::Read, Effect::Delay(Duration::from_millis(15)))
        ));
        for bad in [
            "",
            "write",
            "erase:eio",
            "write:melt",
            "read:lose",
            "write:lie",
            "flush:eio,range=0-10",
            "write:eio,range=9-3",
            "write:eio,after=x",
            "write:misdirect",
            "write:eio,colour=red",
        ] {
            let err = Rule::parse(bad).expect_err(bad);
            assert!(err.contains("fault rule"), "{bad}: {err}");
        }
    }
}
