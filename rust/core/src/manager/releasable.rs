//! A request's releasable pages (clean, outside the tail), kept split the way the `coldest` policy lets
//! them go after the latest heat summary, and kept so as pages change, one page at a time.
//!
//! Why incremental: pressure looks at the front of every hot-region holder's order every step, and a
//! summary's lists go stale within steps (their pages are released, lost, restored...). Filtering the lists
//! against the releasable set on each look walked up to a summary's length of dead entries per request and
//! step, each a lookup in a set that grows with context; here a page moves between sets only when it
//! changes, and the front of the order is stored.

use std::collections::{btree_set, BTreeSet};

use crate::page_set::{self, PageSet};

/// The heat given to releasable pages the last summary did not list (between its coldest and its hottest,
/// or released after it) and to its hottest: the pressure order across requests is by heat, so every
/// request's coldest pages go before any request's unlisted ones, and those before anyone's hottest.
pub(super) const UNLISTED: u32 = u32::MAX - 1;
pub(super) const HOTTEST: u32 = u32::MAX;

/// A page the latest summary listed: its heat, and whether it was among the hottest (else the coldest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Listed {
    page: u32,
    heat: u32,
    hottest: bool,
}

/// The releasable pages of one request, in three ordered parts that together hold exactly `all`:
/// the summary's coldest, the pages it did not list, its hottest.
#[derive(Clone, Debug, Default)]
pub(super) struct Releasable {
    /// Every releasable page, by page (what the plan flags, and vLLM's order newest first).
    all: PageSet,
    /// Those the summary listed among its coldest, as (heat, page): released first, coldest first.
    coldest: BTreeSet<(u32, u32)>,
    /// Those it did not list, by page: released next, oldest first. Most releasable pages, so one bit
    /// each, as `all` (`page_set.rs`: a tree of them made the step's cost grow with context).
    unlisted: PageSet,
    /// Those it listed among its hottest, as (heat, page): released last, the least hot first.
    hottest: BTreeSet<(u32, u32)>,
    /// Every page the summary listed, releasable now or not, sorted by page: a listed page that becomes
    /// releasable again goes back to its part with the heat the summary gave it.
    listed: Vec<Listed>,
    /// The first entry of [`Self::order`], kept after every change: pressure reads it for every hot-region
    /// holder each step, and reading it here touches nothing but this struct.
    front: Option<(u32, u32)>,
}

impl Releasable {
    pub fn len(&self) -> usize {
        self.all.len()
    }

    /// Every releasable page, by page.
    pub fn pages(&self) -> &PageSet {
        &self.all
    }

    /// The first `(heat, page)` of [`Self::order`], if any page is releasable.
    pub fn front(&self) -> Option<(u32, u32)> {
        self.front
    }

    /// The pages in the order `coldest` lets them go, as `(heat, page)`: the summary's coldest, coldest
    /// first; then those it did not list (heat [`UNLISTED`]), oldest first; then its hottest (heat
    /// [`HOTTEST`]), the least hot first.
    pub fn order(&self) -> Order<'_> {
        Order { coldest: self.coldest.iter(), unlisted: self.unlisted.iter(), hottest: self.hottest.iter() }
    }

    fn find(&self, page: u32) -> Option<Listed> {
        self.listed.binary_search_by_key(&page, |l| l.page).ok().map(|i| self.listed[i])
    }

    /// Adds (`yes`) or removes a page; returns whether that changed anything.
    pub fn set(&mut self, page: u32, yes: bool) -> bool {
        let changed = self.all.set(page, yes);
        if changed {
            self.place(page, yes);
            self.front = self.order().next();
        }
        changed
    }

    /// Puts a page into (or takes it out of) the part the summary assigns it.
    fn place(&mut self, page: u32, yes: bool) {
        match self.find(page) {
            None => {
                self.unlisted.set(page, yes);
            }
            Some(l) if l.hottest => put(&mut self.hottest, (l.heat, page), yes),
            Some(l) => put(&mut self.coldest, (l.heat, page), yes),
        }
    }

    /// Takes a new summary of this request: its `coldest` and `hottest` `(heat, page)` pairs (no page
    /// twice). Only the pages the old and the new summary list move; the unlisted rest stays put.
    pub fn set_summary(&mut self, coldest: &[(u32, u32)], hottest: &[(u32, u32)]) {
        for l in std::mem::take(&mut self.listed) {
            if self.all.contains(l.page) {
                put(if l.hottest { &mut self.hottest } else { &mut self.coldest }, (l.heat, l.page), false);
                self.unlisted.insert(l.page);
            }
        }
        let listed = |&(heat, page): &(u32, u32), hottest| Listed { page, heat, hottest };
        self.listed =
            coldest.iter().map(|e| listed(e, false)).chain(hottest.iter().map(|e| listed(e, true))).collect();
        self.listed.sort_unstable_by_key(|l| l.page);
        for i in 0..self.listed.len() {
            let page = self.listed[i].page;
            if self.all.contains(page) {
                self.unlisted.remove(page);
                self.place(page, true);
            }
        }
        self.front = self.order().next();
    }

    /// Forgets the summary and every page from `from` on (the request's pages were dropped from there).
    pub fn truncate(&mut self, from: u32) {
        self.set_summary(&[], &[]);
        self.all.truncate(from);
        self.unlisted.truncate(from);
        self.front = self.order().next();
    }

    /// Whether the parts and the front agree with `all` and the summary (for the invariants audit).
    pub fn is_consistent(&self) -> bool {
        let mut ok = self.listed.windows(2).all(|w| w[0].page < w[1].page);
        let mut held = 0;
        for page in self.all.iter() {
            let in_part = match self.find(page) {
                None => self.unlisted.contains(page),
                Some(l) if l.hottest => self.hottest.contains(&(l.heat, page)),
                Some(l) => self.coldest.contains(&(l.heat, page)),
            };
            ok &= in_part;
            held += 1;
        }
        ok && held == self.coldest.len() + self.unlisted.len() + self.hottest.len()
            && self.front == self.order().next()
    }
}

fn put<T: Ord>(set: &mut BTreeSet<T>, key: T, yes: bool) {
    if yes {
        set.insert(key);
    } else {
        set.remove(&key);
    }
}

/// An iterator over [`Releasable::order`] (a named type: pressure keeps one per request it releases from).
pub(super) struct Order<'a> {
    coldest: btree_set::Iter<'a, (u32, u32)>,
    unlisted: page_set::Iter<'a>,
    hottest: btree_set::Iter<'a, (u32, u32)>,
}

impl Iterator for Order<'_> {
    type Item = (u32, u32);

    fn next(&mut self) -> Option<(u32, u32)> {
        if let Some(&entry) = self.coldest.next() {
            return Some(entry);
        }
        if let Some(page) = self.unlisted.next() {
            return Some((UNLISTED, page));
        }
        self.hottest.next().map(|&(_, page)| (HOTTEST, page))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(r: &Releasable) -> Vec<(u32, u32)> {
        r.order().collect()
    }

    #[test]
    fn pages_keep_their_part_as_they_come_and_go() {
        let mut r = Releasable::default();
        for page in 1..=6 {
            assert!(r.set(page, true));
        }
        assert!(!r.set(3, true), "already releasable");
        // Coldest 4 then 2; hottest 1; page 9 is listed but not releasable (yet).
        r.set_summary(&[(0, 4), (2, 2), (3, 9)], &[(7, 1)]);
        let listed = vec![(0, 4), (2, 2), (UNLISTED, 3), (UNLISTED, 5), (UNLISTED, 6), (HOTTEST, 1)];
        assert_eq!(order(&r), listed);
        assert_eq!(r.front(), Some((0, 4)));
        assert!(r.set(4, false));
        assert_eq!(r.front(), Some((2, 2)));
        // Releasable again: back among the coldest with the heat the summary gave it.
        assert!(r.set(4, true) && r.set(9, true));
        assert_eq!(order(&r)[..3], [(0, 4), (2, 2), (3, 9)]);
        assert!(r.is_consistent());
        // A new summary moves only what it and the last one list.
        r.set_summary(&[(1, 5)], &[]);
        let pages = vec![(1, 5), (UNLISTED, 1), (UNLISTED, 2), (UNLISTED, 3), (UNLISTED, 4), (UNLISTED, 6)];
        assert_eq!(order(&r), [pages, vec![(UNLISTED, 9)]].concat());
        r.truncate(4);
        assert_eq!(order(&r), vec![(UNLISTED, 1), (UNLISTED, 2), (UNLISTED, 3)]);
        assert!(r.is_consistent() && r.len() == 3 && r.pages().contains(2) && !r.pages().contains(5));
        for page in 1..=3 {
            r.set(page, false);
        }
        assert_eq!(r.front(), None);
    }
}
