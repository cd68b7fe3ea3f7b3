//! The node cache.
//!
//! Owns: decoded nodes in memory keyed by address, and verifying every node read from the
//! device (checksum, address, generation, owner, level: [`birch_format::node::Node::decode`]).
//!
//! Must not touch: the commit order or the decision to write. It never writes: commits hand it
//! the nodes they wrote. Entries are immutable (`Arc<Node>`); a cached node whose generation
//! differs from what a pointer expects is treated as a miss, so a reused address never serves
//! a stale node.

use std::collections::HashMap;
use std::sync::Arc;

use birch_format::node::{Expect, Node};
use birch_format::NODE_SIZE;
use parking_lot::Mutex;

use crate::counters::{CachePadded, Counters};
use crate::device::BlockDevice;
use crate::error::{Error, Result};

const SHARDS: usize = 16;

/// Nodes one [`NodeCache::prefetch`] reads at most: one `read_many` of 1 MiB.
pub const PREFETCH_MAX: usize = 64;

/// One shard of the cache: node address → decoded node, alone on its cache lines.
type Shard = CachePadded<Mutex<HashMap<u64, Arc<Node>>>>;

/// A sharded cache of decoded nodes.
pub struct NodeCache {
    shards: Vec<Shard>,
    capacity_per_shard: usize,
}

impl NodeCache {
    /// A cache holding about `capacity` nodes.
    pub fn new(capacity: usize) -> NodeCache {
        NodeCache {
            shards: (0..SHARDS)
                .map(|_| CachePadded(Mutex::new(HashMap::new())))
                .collect(),
            capacity_per_shard: (capacity / SHARDS).max(16),
        }
    }

    fn shard(&self, addr: u64) -> &Mutex<HashMap<u64, Arc<Node>>> {
        let index = ((addr / NODE_SIZE as u64) as usize) % SHARDS;
        &self.shards[index]
    }

    /// The cached node `expect` names, if the cache holds it with the generation, owner and
    /// level `expect` asks for. Counts nothing.
    fn cached(&self, expect: &Expect) -> Option<Arc<Node>> {
        let shard = self.shard(expect.addr).lock();
        let node = shard.get(&expect.addr)?;
        (node.header.generation == expect.generation
            && node.header.owner == expect.owner
            && expect.level.is_none_or(|l| l == node.header.level))
        .then(|| node.clone())
    }

    /// Verifies the bytes read for `expect` (checksum, address, generation, owner, level) and
    /// puts the node in the cache. The one place a node read from the device enters it.
    fn verify_and_insert(&self, bytes: &[u8], expect: &Expect) -> Result<Arc<Node>> {
        let node = Arc::new(
            Node::decode(bytes, expect)
                .map_err(|e| Error::corrupt(format!("read node {:#x}", expect.addr), e))?,
        );
        self.insert(node.clone());
        Ok(node)
    }

    /// Returns the node at `expect.addr`, reading and verifying it on a miss.
    /// May do device I/O; holds no lock while it does.
    pub fn read(
        &self,
        device: &dyn BlockDevice,
        counters: &Counters,
        expect: &Expect,
    ) -> Result<Arc<Node>> {
        if let Some(node) = self.cached(expect) {
            counters.add(|c| &c.cache_hits, 1);
            return Ok(node);
        }
        counters.add(|c| &c.cache_misses, 1);
        let mut bytes = vec![0u8; NODE_SIZE];
        device
            .read_at(&mut bytes, expect.addr)
            .map_err(|e| Error::io(format!("read node {:#x}", expect.addr), e))?;
        // A node that does not verify counts once, here (a prefetch leaves it to this read).
        self.verify_and_insert(&bytes, expect).inspect_err(|_| {
            counters.add(|c| &c.checksum_errors, 1);
        })
    }

    /// Reads every node of `expects` the cache does not hold with one
    /// [`BlockDevice::read_many`] (on RBD: in flight together), verifies each as
    /// [`NodeCache::read`] does and caches those that verify: a later `read` of them is a hit.
    /// At most [`PREFETCH_MAX`] nodes are read (the first ones missing); fewer than two
    /// missing read nothing (the caller's own `read` costs the same). Each node read counts
    /// one cache miss (its later `read` counts a hit).
    ///
    /// A device error fails the call, naming the batch's first node and, through the
    /// device's error, the read that failed; nothing of the batch is cached. A node that
    /// does not verify is left out of the cache and does not fail the call: the caller's own
    /// `read` of it, if it gets there, reads it again and fails exactly as without the
    /// prefetch (a scan stopped by its limit before that node does not fail).
    /// May do device I/O; holds no lock while it does.
    pub fn prefetch(
        &self,
        device: &dyn BlockDevice,
        counters: &Counters,
        expects: &[Expect],
    ) -> Result<()> {
        let missing: Vec<&Expect> = expects
            .iter()
            .filter(|e| self.cached(e).is_none())
            .take(PREFETCH_MAX)
            .collect();
        if missing.len() < 2 {
            return Ok(());
        }
        counters.add(|c| &c.cache_misses, missing.len() as u64);
        let mut bytes = vec![0u8; missing.len() * NODE_SIZE];
        let mut reads: Vec<(u64, &mut [u8])> = missing
            .iter()
            .map(|e| e.addr)
            .zip(bytes.chunks_mut(NODE_SIZE))
            .collect();
        device.read_many(&mut reads).map_err(|e| {
            Error::io(
                format!(
                    "read node {:#x} and {} more in one batch",
                    missing[0].addr,
                    missing.len() - 1
                ),
                e,
            )
        })?;
        for (expect, node_bytes) in missing.iter().zip(bytes.chunks(NODE_SIZE)) {
            if let Err(e) = self.verify_and_insert(node_bytes, expect) {
                log::debug!("prefetch: {e}; left for the read that needs it");
            }
        }
        Ok(())
    }

    /// Puts a node in the cache (after a commit wrote it).
    pub fn insert(&self, node: Arc<Node>) {
        let mut shard = self.shard(node.header.addr).lock();
        if shard.len() >= self.capacity_per_shard {
            // Evict an arbitrary half: cheap, and the hot upper levels come back on next use.
            let victims: Vec<u64> = shard.keys().step_by(2).copied().collect();
            for v in victims {
                shard.remove(&v);
            }
        }
        shard.insert(node.header.addr, node);
    }

    /// Drops every entry (tests, and after a failed commit).
    pub fn clear(&self) {
        for shard in &self.shards {
            shard.lock().clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::atomic::{AtomicU64, Ordering};

    use birch_format::node::{NodeBody, NodeHeader};
    use birch_format::Key;

    use super::*;
    use crate::device::MemDevice;

    const FSID: [u8; 16] = [4; 16];

    /// A memory device counting `read_at` and `read_many` calls; a read of `fail_at` fails.
    struct Counting {
        base: MemDevice,
        read_ats: AtomicU64,
        read_manys: AtomicU64,
        fail_at: AtomicU64,
    }

    impl BlockDevice for Counting {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.read_ats.fetch_add(1, Ordering::SeqCst);
            if offset == self.fail_at.load(Ordering::SeqCst) {
                return Err(io::Error::other(format!("injected failure at {offset:#x}")));
            }
            self.base.read_at(buf, offset)
        }
        fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
            self.read_manys.fetch_add(1, Ordering::SeqCst);
            for (offset, buf) in reads.iter_mut() {
                if *offset == self.fail_at.load(Ordering::SeqCst) {
                    return Err(io::Error::other(format!("injected failure at {offset:#x}")));
                }
                self.base.read_at(buf, *offset)?;
            }
            Ok(())
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.base.write_at(buf, offset)
        }
        fn flush(&self) -> io::Result<()> {
            self.base.flush()
        }
        fn size_bytes(&self) -> u64 {
            self.base.size_bytes()
        }
        fn counters(&self) -> &Counters {
            self.base.counters()
        }
    }

    fn addr(n: u64) -> u64 {
        (n + 1) * NODE_SIZE as u64
    }

    fn expect(n: u64) -> Expect {
        Expect {
            fsid: FSID,
            addr: addr(n),
            generation: 7,
            owner: 5,
            level: Some(0),
        }
    }

    /// A device holding `count` valid leaves at `addr(0..count)`, generation 7, owner 5.
    fn device(count: u64) -> Counting {
        let base = MemDevice::new(4 << 20);
        for n in 0..count {
            let node = Node {
                header: NodeHeader {
                    fsid: FSID,
                    addr: addr(n),
                    generation: 7,
                    owner: 5,
                    level: 0,
                },
                body: NodeBody::Leaf(vec![(
                    Key {
                        objectid: n,
                        item_type: 1,
                        offset: 0,
                    },
                    vec![n as u8; 10],
                )]),
            };
            base.write_at(&node.encode().expect("encode"), addr(n))
                .expect("write");
        }
        Counting {
            base,
            read_ats: AtomicU64::new(0),
            read_manys: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
        }
    }

    /// A prefetch reads the nodes the cache lacks with one `read_many`, verified, and the
    /// reads after it are hits; the nodes it held already are not read again.
    #[test]
    fn prefetch_reads_what_is_missing_in_one_batch() {
        let dev = device(10);
        let cache = NodeCache::new(1024);
        let counters = Counters::default();
        cache.read(&dev, &counters, &expect(3)).expect("read 3");
        let expects: Vec<Expect> = (0..10).map(expect).collect();
        cache.prefetch(&dev, &counters, &expects).expect("prefetch");
        assert_eq!(dev.read_manys.load(Ordering::SeqCst), 1);
        assert_eq!(dev.read_ats.load(Ordering::SeqCst), 1, "only the read of 3");
        assert_eq!(
            dev.counters().values().device_reads,
            10,
            "3 is not read again"
        );
        assert_eq!(counters.values().cache_misses, 10);
        for n in 0..10 {
            let node = cache.read(&dev, &counters, &expect(n)).expect("read");
            assert_eq!(node.header.addr, addr(n));
        }
        assert_eq!(dev.read_ats.load(Ordering::SeqCst), 1, "all hits");
        assert_eq!(counters.values().cache_hits, 10);
        // All cached: nothing to read.
        cache.prefetch(&dev, &counters, &expects).expect("prefetch");
        assert_eq!(dev.read_manys.load(Ordering::SeqCst), 1);
        // One missing: left to the caller's own read.
        cache.clear();
        cache
            .prefetch(&dev, &counters, &expects[..1])
            .expect("prefetch");
        assert_eq!(dev.read_manys.load(Ordering::SeqCst), 1);
        // At most PREFETCH_MAX nodes per call.
        let dev = device(PREFETCH_MAX as u64 + 20);
        let expects: Vec<Expect> = (0..PREFETCH_MAX as u64 + 20).map(expect).collect();
        cache.prefetch(&dev, &counters, &expects).expect("prefetch");
        assert_eq!(
            dev.counters().values().device_reads,
            PREFETCH_MAX as u64,
            "bounded batch"
        );
    }

    /// A node of the batch that does not verify (a bad checksum; a valid node of another
    /// address; a valid node not of the generation the pointer names) is not cached and does
    /// not fail the prefetch; the caller's own read of it then fails naming the block, as
    /// without the prefetch.
    #[test]
    fn a_node_that_does_not_verify_is_not_cached() {
        let dev = device(6);
        dev.base.corrupt(addr(2) + 100, &[0xFF; 8]);
        let mut other = vec![0u8; NODE_SIZE];
        dev.base.read_at(&mut other, addr(5)).expect("read");
        dev.base.corrupt(addr(1), &other);
        let cache = NodeCache::new(1024);
        let counters = Counters::default();
        let mut expects: Vec<Expect> = (0..6).map(expect).collect();
        expects[4].generation = 8;
        cache.prefetch(&dev, &counters, &expects).expect("prefetch");
        assert_eq!(dev.read_manys.load(Ordering::SeqCst), 1);
        for (n, e) in expects.iter().enumerate() {
            let before = dev.read_ats.load(Ordering::SeqCst);
            let got = cache.read(&dev, &counters, e);
            let reads = dev.read_ats.load(Ordering::SeqCst) - before;
            if [1, 2, 4].contains(&n) {
                let err = got.expect_err("does not verify");
                let text = err.to_string();
                assert!(
                    text.contains(&format!("read node {:#x}", addr(n as u64))),
                    "{text}"
                );
                assert_eq!(reads, 1, "node {n} read again, not served from the cache");
            } else {
                got.expect("verified node");
                assert_eq!(reads, 0, "node {n} is a hit");
            }
        }
    }

    /// A failed device read fails the prefetch, naming the batch and the device's error, and
    /// caches nothing of the batch.
    #[test]
    fn a_failed_batch_read_fails_with_context_and_caches_nothing() {
        let dev = device(6);
        dev.fail_at.store(addr(3), Ordering::SeqCst);
        let cache = NodeCache::new(1024);
        let counters = Counters::default();
        let expects: Vec<Expect> = (0..6).map(expect).collect();
        let err = cache
            .prefetch(&dev, &counters, &expects)
            .expect_err("the batch fails");
        let text = err.to_string();
        assert!(
            text.contains(&format!("read node {:#x} and 5 more in one batch", addr(0)))
                && text.contains(&format!("injected failure at {:#x}", addr(3))),
            "{text}"
        );
        dev.fail_at.store(u64::MAX, Ordering::SeqCst);
        for e in &expects {
            let before = dev.read_ats.load(Ordering::SeqCst);
            cache.read(&dev, &counters, e).expect("read");
            assert_eq!(
                dev.read_ats.load(Ordering::SeqCst) - before,
                1,
                "not cached"
            );
        }
    }
}
