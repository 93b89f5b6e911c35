//! What an engine that owns its GPU block pool (vLLM 0.33's HiSparse) must undo when the pool hands out a
//! block it released but still reads: the pages still reading the block, and the host page whose GPU copy
//! the block holds, indexed for host prefix hits (vLLM's `_owners` and `_copy_by_block`).
//!
//! Both are per block id. vLLM keeps them in dicts as large as the released part of its pool, whose entries
//! are touched a few at a time and long apart, so each touch is a cache (and TLB) miss in a heap of every
//! request's blocks; here they are tables indexed by block id, the size of the pool.

use crate::error::{invalid, Result};

/// A request's page that still reads a released block.
pub type Owner = (Box<str>, u32);

/// What the pool's reuse of a block takes away ([`ReuseWatch::reused`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reused {
    /// The host page hash under which the block was indexed as a GPU copy.
    pub copy: Option<Box<[u8]>>,
    /// The pages that were still reading it.
    pub owners: Vec<Owner>,
}

/// Per GPU block: its owners and its copy index entry (module docs).
#[derive(Clone, Debug, Default)]
pub struct ReuseWatch {
    owners: Vec<Vec<Owner>>,
    copies: Vec<Option<Box<[u8]>>>,
}

impl ReuseWatch {
    /// Tables for a pool of `blocks` blocks (ids `0 .. blocks`).
    pub fn new(blocks: usize) -> Self {
        Self { owners: vec![Vec::new(); blocks], copies: vec![None; blocks] }
    }

    /// Every id a valid block of this pool; checked before anything changes.
    fn check(&self, blocks: &[u32]) -> Result<()> {
        match blocks.iter().find(|&&block| block as usize >= self.owners.len()) {
            Some(block) => invalid(format!("block {block} is past the pool's {} blocks", self.owners.len())),
            None => Ok(()),
        }
    }

    /// `request`'s `page` still reads these released blocks (a set: an owner is recorded once per block).
    pub fn own(&mut self, blocks: &[u32], request: &str, page: u32) -> Result<()> {
        self.check(blocks)?;
        for &block in blocks {
            let owners = &mut self.owners[block as usize];
            if !owners.iter().any(|(r, p)| *p == page && &**r == request) {
                owners.push((request.into(), page));
            }
        }
        Ok(())
    }

    /// `request`'s `page` no longer reads these blocks (lost, or its request freed); absent owners are fine.
    pub fn disown(&mut self, blocks: &[u32], request: &str, page: u32) -> Result<()> {
        self.check(blocks)?;
        for &block in blocks {
            self.owners[block as usize].retain(|(r, p)| *p != page || &**r != request);
        }
        Ok(())
    }

    /// These blocks hold the GPU copy of the host page `hash` (each replaces the block's entry, if any).
    pub fn index(&mut self, blocks: &[u32], hash: &[u8]) -> Result<()> {
        self.check(blocks)?;
        for &block in blocks {
            self.copies[block as usize] = Some(hash.into());
        }
        Ok(())
    }

    /// These blocks' copy index entries go (their copy was dropped), whatever hash each names.
    pub fn unindex(&mut self, blocks: &[u32]) -> Result<()> {
        self.check(blocks)?;
        for &block in blocks {
            self.copies[block as usize] = None;
        }
        Ok(())
    }

    /// The pool handed `block` out: its copy index entry and owners, taken; `None` when it had neither (the
    /// common case: the other blocks of a page whose first block's reuse already took the page away).
    pub fn reused(&mut self, block: u32) -> Result<Option<Reused>> {
        self.check(&[block])?;
        let slot = block as usize;
        if self.copies[slot].is_none() && self.owners[slot].is_empty() {
            return Ok(None);
        }
        Ok(Some(Reused { copy: self.copies[slot].take(), owners: std::mem::take(&mut self.owners[slot]) }))
    }

    /// The pages still reading `block`, in the order they released it.
    pub fn owners(&self, block: u32) -> Result<&[Owner]> {
        self.check(&[block])?;
        Ok(&self.owners[block as usize])
    }

    /// Every indexed block with the host page hash it holds a copy of, by block id.
    pub fn indexed(&self) -> impl Iterator<Item = (u32, &[u8])> {
        (0u32..).zip(&self.copies).filter_map(|(block, hash)| Some((block, hash.as_deref()?)))
    }

    /// Forgets everything (the engine's pools were reset).
    pub fn clear(&mut self) {
        self.owners.iter_mut().for_each(Vec::clear);
        self.copies.iter_mut().for_each(|hash| *hash = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(watch: &ReuseWatch, block: u32) -> Vec<(&str, u32)> {
        watch.owners(block).unwrap().iter().map(|(r, p)| (&**r, *p)).collect()
    }

    #[test]
    fn an_owner_is_recorded_once_and_disowned_alone() {
        let mut w = ReuseWatch::new(8);
        w.own(&[1, 2], "a", 3).unwrap();
        w.own(&[1, 2], "a", 3).unwrap();
        w.own(&[2], "b", 0).unwrap();
        assert_eq!(owners(&w, 1), [("a", 3)]);
        assert_eq!(owners(&w, 2), [("a", 3), ("b", 0)]);
        w.disown(&[2], "a", 3).unwrap();
        w.disown(&[2], "a", 4).unwrap(); // not an owner: nothing changes
        assert_eq!(owners(&w, 2), [("b", 0)]);
    }

    #[test]
    fn reuse_takes_the_copy_entry_and_the_owners_once() {
        let mut w = ReuseWatch::new(4);
        w.index(&[0, 1], b"h1").unwrap();
        w.own(&[0, 1], "a", 7).unwrap();
        let reused = w.reused(0).unwrap().unwrap();
        assert_eq!(reused.copy.as_deref(), Some(&b"h1"[..]));
        assert_eq!(reused.owners, vec![("a".into(), 7)]);
        assert_eq!(w.reused(0).unwrap(), None);
        assert_eq!(w.reused(3).unwrap(), None);
        // Block 1 keeps its own entries until the engine drops them (its copy, its page's loss).
        assert_eq!(w.indexed().collect::<Vec<_>>(), [(1, &b"h1"[..])]);
    }

    #[test]
    fn index_replaces_and_unindex_clears_whatever_hash_a_block_names() {
        let mut w = ReuseWatch::new(4);
        w.index(&[0, 1], b"h1").unwrap();
        w.index(&[1, 2], b"h2").unwrap();
        assert_eq!(w.indexed().collect::<Vec<_>>(), [(0, &b"h1"[..]), (1, &b"h2"[..]), (2, &b"h2"[..])]);
        w.unindex(&[0, 1]).unwrap(); // h1's blocks, as vLLM drops a copy: block 1's h2 entry goes too
        assert_eq!(w.indexed().collect::<Vec<_>>(), [(2, &b"h2"[..])]);
        w.clear();
        assert_eq!(w.indexed().count(), 0);
    }

    #[test]
    fn a_block_past_the_pool_is_refused_and_changes_nothing() {
        let mut w = ReuseWatch::new(2);
        assert!(w.own(&[0, 2], "a", 0).is_err());
        assert!(w.owners(0).unwrap().is_empty());
        assert!(w.index(&[1, 9], b"h").is_err());
        assert_eq!(w.indexed().count(), 0);
        assert!(w.reused(2).is_err());
        assert!(w.disown(&[5], "a", 0).is_err());
        assert!(w.unindex(&[5]).is_err());
    }
}
