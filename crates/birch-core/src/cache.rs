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

/// A sharded cache of decoded nodes.
pub struct NodeCache {
    shards: Vec<CachePadded<Mutex<HashMap<u64, Arc<Node>>>>>,
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

    /// Returns the node at `expect.addr`, reading and verifying it on a miss.
    /// May do device I/O; holds no lock while it does.
    pub fn read(
        &self,
        device: &dyn BlockDevice,
        counters: &Counters,
        expect: &Expect,
    ) -> Result<Arc<Node>> {
        if let Some(node) = self.shard(expect.addr).lock().get(&expect.addr) {
            if node.header.generation == expect.generation
                && node.header.owner == expect.owner
                && expect.level.is_none_or(|l| l == node.header.level)
            {
                counters.add(|c| &c.cache_hits, 1);
                return Ok(node.clone());
            }
        }
        counters.add(|c| &c.cache_misses, 1);
        let mut bytes = vec![0u8; NODE_SIZE];
        device
            .read_at(&mut bytes, expect.addr)
            .map_err(|e| Error::io(format!("read node {:#x}", expect.addr), e))?;
        let node = Arc::new(
            Node::decode(&bytes, expect)
                .map_err(|e| Error::corrupt(format!("read node {:#x}", expect.addr), e))?,
        );
        self.insert(node.clone());
        Ok(node)
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
