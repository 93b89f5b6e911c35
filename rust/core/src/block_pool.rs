//! The GPU block pool.
//!
//! A block is *pinned* while its reference count is positive. At zero it sits in the free list, ordered by
//! when it was freed, and is handed out least-recently-freed first. A block at zero may still have
//! *readers*: released pages whose owners keep reading the block in place until the pool reuses it. The
//! pool reports those readers when it reuses the block, so the owners can drop it from their tables in the
//! same step: nobody ever reads a block that was handed to someone else.
//!
//! A block whose page has a published hash stays findable by that hash until it is reused, so a new request
//! with the same prefix can adopt it without any copy.

use std::collections::HashMap;

use crate::error::{invariant, Result};
use crate::index_list::IndexList;

pub type BlockId = u32;
pub const NULL_BLOCK: BlockId = 0;

/// A page that reads a block it does not pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Reader {
    pub request: u64,
    pub page: u32,
}

#[derive(Clone, Debug, Default)]
struct BlockMeta {
    ref_count: u32,
    readers: Vec<Reader>,
    hash: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct BlockPool {
    meta: Vec<BlockMeta>,
    free: IndexList,
    by_hash: HashMap<u64, BlockId>,
    /// Free blocks that still have readers, kept as blocks change so stats and policy read it in O(1).
    released: u32,
}

impl BlockPool {
    pub fn new(num_blocks: u32) -> Self {
        let mut free = IndexList::new(num_blocks as usize);
        for b in 1..num_blocks {
            free.push_back(b);
        }
        BlockPool {
            meta: vec![BlockMeta::default(); num_blocks as usize],
            free,
            by_hash: HashMap::new(),
            released: 0,
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.meta.len() as u32
    }

    /// Blocks anyone may take now: never-used, freed, and released ones (the latter still read in place).
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Free blocks that some page still reads in place.
    pub fn num_released(&self) -> u32 {
        self.released
    }

    /// Free blocks nobody reads: taking one costs no one anything.
    pub fn num_unread_free(&self) -> u32 {
        self.num_free() - self.released
    }

    fn is_released(&self, b: BlockId) -> bool {
        self.free.contains(b) && !self.meta[b as usize].readers.is_empty()
    }

    /// Runs a change to block `b`, keeping the released count in step with it.
    fn tracking<T>(&mut self, b: BlockId, change: impl FnOnce(&mut Self) -> T) -> T {
        let before = self.is_released(b);
        let out = change(self);
        self.released = self.released + self.is_released(b) as u32 - before as u32;
        out
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.meta[b as usize].ref_count
    }

    pub fn readers(&self, b: BlockId) -> &[Reader] {
        &self.meta[b as usize].readers
    }

    pub fn is_free(&self, b: BlockId) -> bool {
        self.free.contains(b)
    }

    /// Takes the least recently freed block, pinned once, and returns it with its former readers: they lose
    /// it, and the caller must turn their pages host-only in this same step.
    pub fn allocate(&mut self) -> Option<(BlockId, Vec<Reader>)> {
        let b = self.free.front()?;
        self.released -= self.is_released(b) as u32;
        self.free.remove(b);
        let meta = &mut self.meta[b as usize];
        meta.ref_count = 1;
        if let Some(h) = meta.hash.take() {
            self.by_hash.remove(&h);
        }
        Some((b, std::mem::take(&mut meta.readers)))
    }

    /// Pins a block once more; a free block leaves the free list, keeping its content and readers.
    pub fn pin(&mut self, b: BlockId) {
        self.tracking(b, |pool| {
            if pool.meta[b as usize].ref_count == 0 {
                pool.free.remove(b);
            }
            pool.meta[b as usize].ref_count += 1;
        })
    }

    /// Drops one pin; at zero the block goes to the back of the free list.
    pub fn unpin(&mut self, b: BlockId) -> Result<()> {
        if self.meta[b as usize].ref_count == 0 {
            return invariant(format!("block {b} unpinned while not pinned"));
        }
        self.tracking(b, |pool| {
            let meta = &mut pool.meta[b as usize];
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                pool.free.push_back(b);
            }
        });
        Ok(())
    }

    pub fn add_reader(&mut self, b: BlockId, reader: Reader) {
        self.tracking(b, |pool| pool.meta[b as usize].readers.push(reader));
    }

    pub fn remove_reader(&mut self, b: BlockId, reader: Reader) -> Result<()> {
        let Some(i) = self.meta[b as usize].readers.iter().position(|r| *r == reader) else {
            return invariant(format!("block {b} has no reader {reader:?}"));
        };
        self.tracking(b, |pool| pool.meta[b as usize].readers.swap_remove(i));
        Ok(())
    }

    /// Keeps a free block longer before reuse (its page was just selected).
    pub fn touch(&mut self, b: BlockId) {
        self.free.touch(b);
    }

    /// Makes a block findable by the hash of its (durable) content, unless that hash already names one.
    pub fn publish(&mut self, b: BlockId, hash: u64) {
        if self.meta[b as usize].hash.is_none() && !self.by_hash.contains_key(&hash) {
            self.meta[b as usize].hash = Some(hash);
            self.by_hash.insert(hash, b);
        }
    }

    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_reports_readers_and_drops_hash() {
        let mut pool = BlockPool::new(4);
        let (a, _) = pool.allocate().unwrap();
        let (b, _) = pool.allocate().unwrap();
        assert_eq!((a, b), (1, 2));
        let reader = Reader { request: 7, page: 3 };
        pool.add_reader(a, reader);
        pool.publish(a, 99);
        pool.unpin(a).unwrap();
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.num_released(), 1);
        assert_eq!(pool.lookup(99), Some(a));
        // Block 3 was freed first (never used), so it goes before the released block 1.
        assert_eq!(pool.allocate().unwrap().0, 3);
        let (again, readers) = pool.allocate().unwrap();
        assert_eq!(again, a);
        assert_eq!(readers, vec![reader]);
        assert_eq!(pool.lookup(99), None);
        assert!(pool.allocate().is_none());
        assert!(pool.unpin(b).is_ok() && pool.unpin(b).is_err());
    }

    #[test]
    fn pin_adopts_a_free_block_in_place() {
        let mut pool = BlockPool::new(3);
        let (a, _) = pool.allocate().unwrap();
        pool.unpin(a).unwrap();
        pool.pin(a);
        assert!(!pool.is_free(a));
        assert_eq!(pool.allocate().unwrap().0, 2);
        assert!(pool.allocate().is_none());
    }
}
