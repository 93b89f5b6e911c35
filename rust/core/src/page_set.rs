//! A set of a request's page indices as one bit per page.
//!
//! Why not a `BTreeSet`: the set is touched every step for every request under pressure (a page becomes
//! releasable, is released, is looked up), and at long contexts a tree of 16K pages (1M tokens) walks five
//! levels of nodes spread over memory, each a cache miss once hundreds of requests hold one: the step's cost
//! then grew with context. Here a page is one bit, a request's set at 1M tokens is 2 KiB, and a change
//! touches one word. The smallest page, which releases read first, is found from a remembered lower bound.

use std::cell::Cell;

#[derive(Clone, Debug, Default)]
pub struct PageSet {
    words: Vec<u64>,
    len: usize,
    /// No word below this one holds a page (a lower bound, raised as [`Self::iter`] finds empty words).
    low_word: Cell<usize>,
}

impl PageSet {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, page: u32) -> bool {
        let (word, bit) = Self::at(page);
        self.words.get(word).is_some_and(|w| w & bit != 0)
    }

    /// Adds `page`; returns whether it was absent.
    pub fn insert(&mut self, page: u32) -> bool {
        let (word, bit) = Self::at(page);
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        let absent = self.words[word] & bit == 0;
        if absent {
            self.words[word] |= bit;
            self.len += 1;
            self.low_word.set(self.low_word.get().min(word));
        }
        absent
    }

    /// Removes `page`; returns whether it was present.
    pub fn remove(&mut self, page: u32) -> bool {
        let (word, bit) = Self::at(page);
        let present = self.words.get(word).is_some_and(|w| w & bit != 0);
        if present {
            self.words[word] &= !bit;
            self.len -= 1;
        }
        present
    }

    /// Adds (`present`) or removes `page`; returns whether that changed the set.
    pub fn set(&mut self, page: u32, present: bool) -> bool {
        if present {
            self.insert(page)
        } else {
            self.remove(page)
        }
    }

    /// Keeps only the pages below `end`.
    pub fn truncate(&mut self, end: u32) {
        let (word, bit) = Self::at(end);
        if word < self.words.len() {
            self.words[word] &= bit - 1;
            self.words.truncate(word + 1);
            self.len = self.words.iter().map(|w| w.count_ones() as usize).sum();
        }
    }

    /// The pages in increasing order.
    pub fn iter(&self) -> Iter<'_> {
        let mut word = self.low_word.get();
        while self.words.get(word) == Some(&0) {
            word += 1;
        }
        self.low_word.set(word);
        Iter { words: &self.words, word, bits: self.words.get(word).copied().unwrap_or(0) }
    }

    fn at(page: u32) -> (usize, u64) {
        ((page / 64) as usize, 1u64 << (page % 64))
    }
}

/// The pages of a [`PageSet`] in increasing order.
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    words: &'a [u64],
    word: usize,
    /// The pages of `words[word]` not yet returned.
    bits: u64,
}

impl Iterator for Iter<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        while self.bits == 0 {
            self.word += 1;
            self.bits = *self.words.get(self.word)?;
        }
        let bit = self.bits.trailing_zeros();
        self.bits &= self.bits - 1;
        Some(self.word as u32 * 64 + bit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Any sequence of inserts, removals and truncations leaves the set a `BTreeSet` would hold.
        #[test]
        fn behaves_as_an_ordered_set(ops in proptest::collection::vec((0u8..4, 0u32..700), 0..300)) {
            let (mut set, mut model) = (PageSet::default(), BTreeSet::new());
            for (op, page) in ops {
                match op {
                    0 => prop_assert_eq!(set.insert(page), model.insert(page)),
                    1 => prop_assert_eq!(set.set(page, true), model.insert(page)),
                    2 => prop_assert_eq!(set.set(page, false), model.remove(&page)),
                    _ => {
                        set.truncate(page);
                        model.retain(|&p| p < page);
                    }
                }
                prop_assert_eq!(set.len(), model.len());
                prop_assert_eq!(set.iter().next(), model.first().copied());
                prop_assert!(set.iter().eq(model.iter().copied()));
                prop_assert!((0..700).all(|p| set.contains(p) == model.contains(&p)));
            }
        }
    }
}
