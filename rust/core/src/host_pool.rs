//! The pinned host pool.
//!
//! Host blocks are reference counted by the pages that hold them. A block's content becomes findable
//! through the prefix index only once its copy is durable (`publish`). When the last reference goes, a
//! published block stays cached and is evicted least-recently-used only when a new block is needed; an
//! unpublished one is simply free.
//!
//! Admission reserves, per request, the host blocks it could need at its longest, so proactive copies never
//! dead-lock on a full pool.

use std::collections::HashMap;

use crate::error::{invariant, Result};
use crate::index_list::IndexList;

pub type HostBlockId = u32;

#[derive(Clone, Copy, Debug, Default)]
struct HostMeta {
    ref_count: u32,
    hash: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct HostPool {
    meta: Vec<HostMeta>,
    free: IndexList,
    cached: IndexList,
    index: HashMap<u64, HostBlockId>,
    reserved: u64,
}

impl HostPool {
    pub fn new(num_blocks: u32) -> Self {
        let mut free = IndexList::new(num_blocks as usize);
        for b in 0..num_blocks {
            free.push_back(b);
        }
        HostPool {
            meta: vec![HostMeta::default(); num_blocks as usize],
            free,
            cached: IndexList::new(num_blocks as usize),
            index: HashMap::new(),
            reserved: 0,
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.meta.len() as u32
    }

    /// Blocks that can be handed out: free ones and cached ones nobody references.
    pub fn num_available(&self) -> u32 {
        (self.free.len() + self.cached.len()) as u32
    }

    pub fn num_cached(&self) -> u32 {
        self.cached.len() as u32
    }

    pub fn num_referenced(&self) -> u32 {
        self.num_blocks() - self.num_available()
    }

    pub fn ref_count(&self, h: HostBlockId) -> u32 {
        self.meta[h as usize].ref_count
    }

    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    pub fn try_reserve(&mut self, blocks: u64) -> bool {
        if self.reserved + blocks > self.num_blocks() as u64 {
            return false;
        }
        self.reserved += blocks;
        true
    }

    /// Reserves blocks that are already held (copies still in flight), even beyond the pool: until they
    /// are returned, admissions see the pool as that much fuller.
    pub fn reserve_held(&mut self, blocks: u64) {
        self.reserved += blocks;
    }

    pub fn unreserve(&mut self, blocks: u64) {
        debug_assert!(self.reserved >= blocks);
        self.reserved -= blocks;
    }

    /// Takes a block referenced once: a free one, else the least recently used cached one (evicted).
    pub fn allocate(&mut self) -> Option<HostBlockId> {
        let h = match self.free.pop_front() {
            Some(h) => h,
            None => {
                let h = self.cached.pop_front()?;
                if let Some(hash) = self.meta[h as usize].hash.take() {
                    self.index.remove(&hash);
                }
                h
            }
        };
        self.meta[h as usize].ref_count = 1;
        Some(h)
    }

    pub fn incref(&mut self, h: HostBlockId) {
        let meta = &mut self.meta[h as usize];
        if meta.ref_count == 0 {
            self.cached.remove(h);
        }
        meta.ref_count += 1;
    }

    pub fn decref(&mut self, h: HostBlockId) -> Result<()> {
        let meta = &mut self.meta[h as usize];
        if meta.ref_count == 0 {
            return invariant(format!("host block {h} released while unreferenced"));
        }
        meta.ref_count -= 1;
        if meta.ref_count == 0 {
            if meta.hash.is_some() {
                self.cached.push_back(h);
            } else {
                self.free.push_back(h);
            }
        }
        Ok(())
    }

    /// Publishes a durable block under its content hash. Returns the block that already holds that hash,
    /// if any, in which case nothing changes and the caller should share that one instead.
    pub fn publish(&mut self, h: HostBlockId, hash: u64) -> Option<HostBlockId> {
        if let Some(&existing) = self.index.get(&hash) {
            return (existing != h).then_some(existing);
        }
        self.meta[h as usize].hash = Some(hash);
        self.index.insert(hash, h);
        None
    }

    /// The durable block holding `hash`, refreshed in the eviction order.
    pub fn lookup(&mut self, hash: u64) -> Option<HostBlockId> {
        let h = *self.index.get(&hash)?;
        self.cached.touch(h);
        Some(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_blocks_are_evicted_lru_and_unpublished() {
        let mut pool = HostPool::new(2);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert_eq!(pool.publish(a, 10), None);
        assert_eq!(pool.publish(b, 20), None);
        pool.decref(a).unwrap();
        pool.decref(b).unwrap();
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(pool.lookup(10), Some(a)); // refreshes a: b is now the oldest
        let c = pool.allocate().unwrap();
        assert_eq!(c, b);
        assert_eq!(pool.lookup(20), None);
        assert_eq!(pool.lookup(10), Some(a));
        pool.incref(a);
        assert!(pool.allocate().is_none());
        assert_eq!(pool.publish(c, 10), Some(a));
    }

    #[test]
    fn reservations_are_bounded() {
        let mut pool = HostPool::new(10);
        assert!(pool.try_reserve(6));
        assert!(!pool.try_reserve(5));
        pool.unreserve(6);
        assert!(pool.try_reserve(10));
    }
}
