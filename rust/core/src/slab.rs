//! Values found by name, stored side by side, each reachable again through a [`Handle`] without its name.
//!
//! A map keyed by `String` reads, for every lookup, the map's bucket and then the key's own allocation to
//! compare it: two lines spread over the heap. Per-step scans look up every scheduled request, and between
//! two steps the engine's own work evicts both, so those lookups dominated a batch scan (about 0.5 us per
//! request at 128 requests, over half the scan, timed in a probe build over `benches/vllm_step.py`'s trace).
//! A caller that keeps each value's [`Handle`] from one step to the next reads the value's slot alone, one read
//! of a dense vector, and falls back to the name only where the handle has gone stale.

use crate::ids::IdMap;

/// Where a value sits: its slot and which of the slot's occupants it is. A handle to a value since removed
/// matches no value (its slot's generation moved on), even after the slot is reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    slot: u32,
    generation: u32,
}

#[derive(Clone, Debug)]
struct Slot<T> {
    /// How many values have left this slot: a handle holds the count of its value's time.
    generation: u32,
    value: Option<T>,
}

/// Values by name (module docs).
#[derive(Clone, Debug)]
pub struct NamedSlab<T> {
    index: IdMap<Box<str>, u32>,
    slots: Vec<Slot<T>>,
    /// Empty slots, reused last-freed first.
    free: Vec<u32>,
}

impl<T> Default for NamedSlab<T> {
    fn default() -> Self {
        Self { index: IdMap::default(), slots: Vec::new(), free: Vec::new() }
    }
}

impl<T> NamedSlab<T> {
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// `name`'s value and its handle, if it has one.
    pub fn find(&self, name: &str) -> Option<(Handle, &T)> {
        let slot = *self.index.get(name)?;
        let entry = &self.slots[slot as usize];
        Some((Handle { slot, generation: entry.generation }, entry.value.as_ref()?))
    }

    /// The value `handle` was made for, unless it has been removed since.
    pub fn by_handle(&self, handle: Handle) -> Option<&T> {
        let slot = self.slots.get(handle.slot as usize)?;
        slot.value.as_ref().filter(|_| slot.generation == handle.generation)
    }

    pub fn get(&self, name: &str) -> Option<&T> {
        self.slots[*self.index.get(name)? as usize].value.as_ref()
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut T> {
        self.slots[*self.index.get(name)? as usize].value.as_mut()
    }

    /// `name`'s value, made by `make` when it has none.
    pub fn get_or_insert_with(&mut self, name: &str, make: impl FnOnce() -> T) -> &mut T {
        let slot = match self.index.get(name) {
            Some(&slot) => slot,
            None => {
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.slots.push(Slot { generation: 0, value: None });
                    u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 values")
                });
                self.slots[slot as usize].value = Some(make());
                self.index.insert(name.into(), slot);
                slot
            }
        };
        self.slots[slot as usize].value.as_mut().expect("an occupied slot")
    }

    /// Removes `name`'s value; every handle to it stops matching.
    pub fn remove(&mut self, name: &str) -> Option<T> {
        let slot = self.index.remove(name)?;
        Some(self.vacate(slot))
    }

    /// Removes every value; no handle made so far matches again.
    pub fn clear(&mut self) {
        for slot in std::mem::take(&mut self.index).into_values() {
            self.vacate(slot);
        }
    }

    fn vacate(&mut self, slot: u32) -> T {
        let entry = &mut self.slots[slot as usize];
        entry.generation = entry.generation.wrapping_add(1);
        self.free.push(slot);
        entry.value.take().expect("an occupied slot")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl<T> NamedSlab<T> {
        fn handle(&self, name: &str) -> Option<Handle> {
            self.find(name).map(|(handle, _)| handle)
        }
    }

    #[test]
    fn a_handle_reaches_its_value_until_the_value_is_removed() {
        let mut slab = NamedSlab::default();
        *slab.get_or_insert_with("a", || 1) += 10;
        slab.get_or_insert_with("b", || 2);
        let (a, b) = (slab.handle("a").unwrap(), slab.handle("b").unwrap());
        assert_eq!((slab.by_handle(a), slab.by_handle(b), slab.len()), (Some(&11), Some(&2), 2));
        assert_eq!(slab.remove("a"), Some(11));
        assert_eq!((slab.by_handle(a), slab.get("a"), slab.handle("a")), (None, None, None));
        // "c" takes a's slot: a's handle still matches nothing, c's reaches c.
        slab.get_or_insert_with("c", || 3);
        let c = slab.handle("c").unwrap();
        assert_ne!(a, c);
        assert_eq!((slab.by_handle(a), slab.by_handle(c), slab.by_handle(b)), (None, Some(&3), Some(&2)));
        // A name inserted again is a new value, with a new handle.
        slab.get_or_insert_with("a", || 4);
        assert_eq!((slab.by_handle(a), slab.get("a")), (None, Some(&4)));
    }

    #[test]
    fn clearing_invalidates_every_handle() {
        let mut slab = NamedSlab::default();
        slab.get_or_insert_with("a", || 1);
        let a = slab.handle("a").unwrap();
        slab.clear();
        assert!(slab.is_empty() && slab.by_handle(a).is_none() && slab.get("a").is_none());
        slab.get_or_insert_with("a", || 2);
        assert!(slab.by_handle(a).is_none());
        assert_eq!(slab.get_mut("a"), Some(&mut 2));
        assert_eq!(slab.remove("nobody"), None);
    }
}
