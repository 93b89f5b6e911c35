//! Who still reads a released page's GPU blocks, for an engine that owns its block ids (vLLM 0.33's HiSparse).
//!
//! A request reading through its hot region releases its clean pages to the pool's free queue, where each stays
//! readable until the pool hands its block out again. The engine then tells the page's readers to stop reading
//! it: the reuse of any one of a page's blocks (a block per resident group) loses the whole page. vLLM keeps a
//! Python set of `(request, page)` per released block and calls back into Python for every block the pool
//! hands out; here the readers are recorded by block id, and a request's released pages with their blocks, so
//! that the engine asks once per released, lost or freed page, and a reused block nobody reads costs a lookup.
//!
//! The record follows vLLM's rules exactly: a page is released on the blocks it has then (each block gains the
//! reader at most once), a reused block is given up by all its readers at once ([`ReleasedPages::reused`]), and
//! a reader gives up a page on every block it was released on ([`ReleasedPages::forget`]) when the engine
//! drops the page, or all its pages when the request is freed ([`ReleasedPages::forget_request`]).

use std::sync::Arc;

use crate::ids::IdMap;
use crate::slab::{Handle, NamedSlab};

/// A request's released pages.
#[derive(Debug)]
struct Reader {
    name: Arc<str>,
    /// Page -> the blocks it was released on, one per resident group.
    pages: IdMap<u32, Vec<u32>>,
}

/// The readers of released blocks (module docs).
#[derive(Debug, Default)]
pub struct ReleasedPages {
    /// Block id -> the `(request, page)` pairs still reading it, in the order they were released.
    readers: IdMap<u32, Vec<(Handle, u32)>>,
    requests: NamedSlab<Reader>,
}

impl ReleasedPages {
    /// `request`'s `page`, on `blocks`, went back to the pool: reusing any of them loses the page.
    pub fn release(&mut self, request: &str, page: u32, blocks: &[u32]) {
        let reader = self
            .requests
            .get_or_insert_with(request, || Reader { name: request.into(), pages: IdMap::default() });
        let recorded = reader.pages.entry(page).or_default();
        for &block in blocks {
            if !recorded.contains(&block) {
                recorded.push(block);
            }
        }
        let handle = self.requests.find(request).expect("recorded above").0;
        for &block in blocks {
            let readers = self.readers.entry(block).or_default();
            if !readers.contains(&(handle, page)) {
                readers.push((handle, page));
            }
        }
    }

    /// The pool handed `block` out again: the `(request, page)` pairs that read it, in release order, which no
    /// longer read it. Each pair still reads its page's other blocks until [`forget`] drops the page.
    ///
    /// [`forget`]: ReleasedPages::forget
    pub fn reused(&mut self, block: u32) -> Vec<(Arc<str>, u32)> {
        let Some(readers) = self.readers.remove(&block) else { return Vec::new() };
        readers
            .into_iter()
            .map(|(handle, page)| {
                let reader = self.requests.by_handle(handle).expect("a reader is forgotten with its pairs");
                (reader.name.clone(), page)
            })
            .collect()
    }

    /// `request` no longer reads `page`: on none of the blocks it was released on.
    pub fn forget(&mut self, request: &str, page: u32) {
        let Some((handle, _)) = self.requests.find(request) else { return };
        let reader = self.requests.get_mut(request).expect("found above");
        let Some(blocks) = reader.pages.remove(&page) else { return };
        let empty = reader.pages.is_empty();
        self.unread(handle, page, &blocks);
        if empty {
            self.requests.remove(request);
        }
    }

    /// `request` was freed: it reads none of its released pages.
    pub fn forget_request(&mut self, request: &str) {
        let Some((handle, _)) = self.requests.find(request) else { return };
        let reader = self.requests.remove(request).expect("found above");
        for (page, blocks) in reader.pages {
            self.unread(handle, page, &blocks);
        }
    }

    /// Forgets every reader (the engine's pools were reset).
    pub fn clear(&mut self) {
        self.readers.clear();
        self.requests.clear();
    }

    /// `request`'s released pages with the blocks each was released on, by page.
    pub fn pages(&self, request: &str) -> Vec<(u32, Vec<u32>)> {
        let mut pages: Vec<_> = self
            .requests
            .get(request)
            .map(|reader| reader.pages.iter().map(|(&page, blocks)| (page, blocks.clone())).collect())
            .unwrap_or_default();
        pages.sort_unstable();
        pages
    }

    /// Released blocks someone still reads.
    pub fn len(&self) -> usize {
        self.readers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.readers.is_empty()
    }

    fn unread(&mut self, handle: Handle, page: u32, blocks: &[u32]) {
        for block in blocks {
            if let Some(readers) = self.readers.get_mut(block) {
                readers.retain(|&pair| pair != (handle, page));
                if readers.is_empty() {
                    self.readers.remove(block);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    fn lost(released: &mut ReleasedPages, block: u32) -> Vec<(String, u32)> {
        released.reused(block).into_iter().map(|(name, page)| (name.to_string(), page)).collect()
    }

    #[test]
    fn a_page_is_lost_with_the_first_of_its_blocks_to_be_reused() {
        let mut released = ReleasedPages::default();
        released.release("a", 3, &[10, 11]);
        released.release("b", 0, &[20, 21]);
        assert_eq!(lost(&mut released, 99), vec![]);
        assert_eq!(lost(&mut released, 11), vec![("a".to_string(), 3)]);
        // Until the engine drops the page, its other block still names it.
        assert_eq!(released.pages("a"), vec![(3, vec![10, 11])]);
        released.forget("a", 3);
        assert_eq!((lost(&mut released, 10), released.pages("a")), (vec![], vec![]));
        assert_eq!(released.len(), 2);
        released.forget_request("b");
        assert!(released.is_empty());
        assert_eq!(lost(&mut released, 20), vec![]);
    }

    #[test]
    fn a_shared_block_loses_every_page_read_from_it_in_release_order() {
        let mut released = ReleasedPages::default();
        released.release("a", 1, &[5, 6]);
        released.release("b", 4, &[5, 7]);
        released.release("a", 1, &[5, 6]); // again: a reader counts once
        assert_eq!(lost(&mut released, 5), vec![("a".to_string(), 1), ("b".to_string(), 4)]);
        released.forget("b", 4);
        assert_eq!(lost(&mut released, 7), vec![]);
        assert_eq!(lost(&mut released, 6), vec![("a".to_string(), 1)]);
    }

    #[test]
    fn forgetting_a_request_leaves_the_others_and_a_freed_name_can_return() {
        let mut released = ReleasedPages::default();
        released.release("a", 0, &[1]);
        released.release("a", 2, &[3]);
        released.release("b", 0, &[3]);
        released.forget_request("a");
        assert_eq!((released.pages("a"), released.pages("b")), (vec![], vec![(0, vec![3])]));
        released.release("a", 0, &[1]);
        assert_eq!(lost(&mut released, 1), vec![("a".to_string(), 0)]);
        assert_eq!(lost(&mut released, 3), vec![("b".to_string(), 0)]);
        released.clear();
        assert_eq!((released.len(), released.pages("a")), (0, vec![]));
    }

    /// vLLM's record, as its coordinator keeps it: a set of `(request, page)` per block, and the pages each
    /// request has released with their blocks (its state's unpinned pages, on its rows' blocks).
    #[derive(Default)]
    struct Sets {
        owners: BTreeMap<u32, BTreeSet<(String, u32)>>,
        pages: BTreeMap<String, BTreeMap<u32, Vec<u32>>>,
    }

    impl Sets {
        fn release(&mut self, request: &str, page: u32, blocks: &[u32]) {
            self.pages.entry(request.into()).or_default().insert(page, blocks.to_vec());
            for &block in blocks {
                self.owners.entry(block).or_default().insert((request.into(), page));
            }
        }

        fn reused(&mut self, block: u32) -> BTreeSet<(String, u32)> {
            self.owners.remove(&block).unwrap_or_default()
        }

        fn forget(&mut self, request: &str, page: u32) {
            let blocks =
                self.pages.get_mut(request).and_then(|pages| pages.remove(&page)).unwrap_or_default();
            for block in blocks {
                if let Some(owners) = self.owners.get_mut(&block) {
                    owners.remove(&(request.to_string(), page));
                }
            }
        }

        fn forget_request(&mut self, request: &str) {
            let pages: Vec<u32> =
                self.pages.get(request).map(|p| p.keys().copied().collect()).unwrap_or_default();
            for page in pages {
                self.forget(request, page);
            }
            self.pages.remove(request);
        }
    }

    proptest! {
        /// Through any releases, reuses and forgetting, as the coordinator makes them (a page released again
        /// only once lost), a reused block loses the pages vLLM's sets would lose.
        #[test]
        fn reuse_loses_what_vllms_sets_lose(ops in prop::collection::vec((0..4u8, 0..4usize, 0..6u32, 0..8u32), 1..300)) {
            let names = ["a", "b", "c", "d"];
            let (mut released, mut sets) = (ReleasedPages::default(), Sets::default());
            for (op, request, page, block) in ops {
                let request = names[request];
                match op {
                    // A page on two blocks (two resident groups), unless the request has it released already.
                    0 if !sets.pages.get(request).is_some_and(|p| p.contains_key(&page)) => {
                        let blocks = [block, (block + 1) % 8];
                        released.release(request, page, &blocks);
                        sets.release(request, page, &blocks);
                    }
                    1 => {
                        let mut lost: Vec<_> =
                            released.reused(block).into_iter().map(|(name, page)| (name.to_string(), page)).collect();
                        lost.sort();
                        prop_assert_eq!(&lost, &sets.reused(block).into_iter().collect::<Vec<_>>());
                        for (request, page) in lost {
                            released.forget(&request, page); // the coordinator's _lose_page
                            sets.forget(&request, page);
                        }
                    }
                    2 => {
                        released.forget(request, page);
                        sets.forget(request, page);
                    }
                    3 => {
                        released.forget_request(request);
                        sets.forget_request(request);
                    }
                    _ => {}
                }
                for name in names {
                    let expected: Vec<_> = sets.pages.get(name).map(|p| p.clone().into_iter().collect()).unwrap_or_default();
                    prop_assert_eq!(released.pages(name), expected);
                }
                prop_assert_eq!(released.len(), sets.owners.values().filter(|o| !o.is_empty()).count());
            }
        }
    }
}
