//! An intrusive doubly linked list over dense indices `0..capacity`.
//!
//! Both pools keep their free and cached blocks in such lists: push to the back, pop from the front and
//! remove from the middle are all O(1), and no node is ever allocated after construction.

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
pub struct IndexList {
    prev: Vec<u32>,
    next: Vec<u32>,
    member: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl IndexList {
    pub fn new(capacity: usize) -> Self {
        IndexList {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            member: vec![false; capacity],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn contains(&self, i: u32) -> bool {
        self.member[i as usize]
    }

    pub fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Appends `i`; it must not be a member already.
    pub fn push_back(&mut self, i: u32) {
        debug_assert!(!self.member[i as usize], "index {i} pushed twice");
        let iu = i as usize;
        self.member[iu] = true;
        self.prev[iu] = self.tail;
        self.next[iu] = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.next[self.tail as usize] = i;
        }
        self.tail = i;
        self.len += 1;
    }

    /// Removes `i` if it is a member; returns whether it was.
    pub fn remove(&mut self, i: u32) -> bool {
        let iu = i as usize;
        if !self.member[iu] {
            return false;
        }
        let (p, n) = (self.prev[iu], self.next[iu]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.member[iu] = false;
        self.len -= 1;
        true
    }

    pub fn pop_front(&mut self) -> Option<u32> {
        let h = self.front()?;
        self.remove(h);
        Some(h)
    }

    /// Moves a member to the back (most recently used); a non-member is left alone.
    pub fn touch(&mut self, i: u32) {
        if self.remove(i) {
            self.push_back(i);
        }
    }

    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let i = cur;
                cur = self.next[i as usize];
                i
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_order_and_middle_removal() {
        let mut l = IndexList::new(8);
        for i in [3, 1, 4, 5] {
            l.push_back(i);
        }
        assert!(l.remove(4));
        assert!(!l.remove(4));
        l.touch(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 5, 3]);
        assert_eq!(l.pop_front(), Some(1));
        assert_eq!(l.len(), 2);
        assert!(l.contains(5) && !l.contains(1));
    }
}
