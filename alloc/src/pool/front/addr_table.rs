//! A hash table from block addresses to small records, for the thread caches' records
//! (`pool/front/thread_records.rs`): open addressing with linear probing, each key in its slot.
//!
//! Why not `hashbrown` (std's `HashMap`), which the rest of the pool uses: a lookup there
//! reads a group of control bytes, then the slot they point to, two dependent memory
//! accesses; here the address's hash names the slot, so a hit in a table that is not in the
//! L1 cache is one access (a cache line holds two 32-byte slots, and a probe mostly stays
//! in it). A warm alloc/free pair does one lookup on each side, and on the KV traces that
//! lookup is the operation's one cold access (`bench/gpu/README.md`, "Where the time goes").
//!
//! - Keys are block addresses; 0 (the null address, never a block's) marks an empty slot.
//! - The home slot is Fibonacci hashing of the address in granules (multiply by 2^64/phi,
//!   keep the top bits): blocks of one size in one arena are an arithmetic run of
//!   addresses, which this spreads evenly over the table (1.1 slots probed per lookup on
//!   both KV traces).
//! - At most 3/4 of the slots are used (the table doubles past that; fuller, a lookup of an
//!   absent address, such as the free of a block this cache does not hold, probes long
//!   runs), and a removal shifts the following entries of its run back (no tombstones), so
//!   a probe ends at the first empty slot.
#![forbid(unsafe_code)]

/// The key of an empty slot: no block starts at the null address.
pub(crate) const NO_KEY: u64 = 0;

/// Slots of a table's first allocation.
const MIN_SLOTS: usize = 16;

/// Block addresses are multiples of the sub-allocator's granule (512): their low 9 bits,
/// always 0, are dropped before hashing (multiplying by 2^9 as well would take the
/// multiplier's top 9 bits away, and with them the even spread: 1.9 slots probed per lookup
/// instead of 1.1 on the second KV trace).
const GRANULE_BITS: u32 = crate::range::GRANULE.trailing_zeros();

/// 2^64 / phi, odd: Fibonacci hashing's multiplier (Knuth, TAOCP vol. 3, 6.4).
const FIBONACCI: u64 = 0x9E37_79B9_7F4A_7C15;

/// Block addresses to `V` (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct AddrTable<V> {
    /// A power of two of them, or none (a boxed slice: the table's header is 32 bytes, and
    /// the thread cache's hot fields fit two cache lines).
    slots: Box<[(u64, V)]>,
    /// 64 - log2(number of slots): the hash's top bits name the home slot.
    shift: u32,
    len: usize,
}

impl<V: Copy + Default> Default for AddrTable<V> {
    fn default() -> Self {
        Self {
            slots: Box::default(),
            shift: 64,
            len: 0,
        }
    }
}

impl<V: Copy + Default> AddrTable<V> {
    /// Number of entries.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no entry.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first slot a probe for `key` looks at.
    #[inline]
    fn home(&self, key: u64) -> usize {
        ((key >> GRANULE_BITS).wrapping_mul(FIBONACCI) >> self.shift) as usize
    }

    /// The slot of `key`, if it is in the table.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 || key == NO_KEY {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let (k, _) = self.slots[i];
            if k == key {
                return Some(i);
            }
            if k == NO_KEY {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// The value of `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        let i = self.find(key)?;
        Some(&self.slots[i].1)
    }

    /// The value of `key`, to change.
    #[inline]
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        let i = self.find(key)?;
        Some(&mut self.slots[i].1)
    }

    /// Insert `key` (not [`NO_KEY`], which is ignored) with `value`; its previous value.
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        debug_assert_ne!(key, NO_KEY, "the null address is no block's");
        if key == NO_KEY {
            return None;
        }
        if let Some(i) = self.find(key) {
            return Some(std::mem::replace(&mut self.slots[i].1, value));
        }
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        self.place(key, value);
        self.len += 1;
        None
    }

    /// Put `key`, known absent, in the first empty slot from its home.
    fn place(&mut self, key: u64, value: V) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        while self.slots[i].0 != NO_KEY {
            i = (i + 1) & mask;
        }
        self.slots[i] = (key, value);
    }

    /// Double the slots (or make the first ones) and place every entry again.
    fn grow(&mut self) {
        self.resize((self.slots.len() * 2).max(MIN_SLOTS));
    }

    /// At most 1/8 of the slots used: halve them until half are (a thread that once held
    /// 50,000 records and now a few hundred gives the memory back). Far from the 3/4 at
    /// which the table grows, so a count that moves back and forth does not rebuild it
    /// each time. Whether it shrank.
    pub(crate) fn shrink_if_sparse(&mut self) -> bool {
        let n = self.fitted_slots();
        if n == self.slots.len() {
            return false;
        }
        self.resize(n);
        true
    }

    /// The number of slots [`Self::shrink_if_sparse`] leaves: the present one, or half the
    /// entries' count rounded up to a power of two when at most 1/8 of the slots are used.
    fn fitted_slots(&self) -> usize {
        let n = self.slots.len();
        if n <= MIN_SLOTS || self.len * 8 > n {
            return n;
        }
        (self.len * 2).next_power_of_two().max(MIN_SLOTS)
    }

    /// `n` slots (a power of two, above the entries' count), every entry placed again.
    fn resize(&mut self, n: usize) {
        let old = std::mem::replace(&mut self.slots, vec![(NO_KEY, V::default()); n].into());
        self.shift = 64 - n.trailing_zeros();
        for &(k, v) in old.iter() {
            if k != NO_KEY {
                self.place(k, v);
            }
        }
    }

    /// Remove `key`; its value. The entries after it in its run move back into the hole
    /// when their home allows it, so every probe still ends at the first empty slot.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        self.remove_if(key, |_| true)
    }

    /// Remove `key` if `take` says so of its value, in one probe; the value removed.
    pub(crate) fn remove_if(&mut self, key: u64, take: impl FnOnce(&V) -> bool) -> Option<V> {
        let mut hole = self.find(key)?;
        let value = self.slots[hole].1;
        if !take(&value) {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let (k, v) = self.slots[i];
            if k == NO_KEY {
                break;
            }
            let home = self.home(k);
            // `k` may move back to the hole unless its home lies cyclically in (hole, i].
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.slots[hole] = (k, v);
                hole = i;
            }
        }
        self.slots[hole] = (NO_KEY, V::default());
        self.len -= 1;
        Some(value)
    }

    /// Keep the entries for which `keep` returns true (it may change their values). When
    /// some go, the rest are placed again (the holes broke their probe runs), in fewer slots
    /// if the table is then sparse ([`Self::shrink_if_sparse`]).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64, &mut V) -> bool) {
        let mut removed = 0;
        for slot in self.slots.iter_mut() {
            if slot.0 != NO_KEY && !keep(slot.0, &mut slot.1) {
                *slot = (NO_KEY, V::default());
                removed += 1;
            }
        }
        if removed == 0 {
            return;
        }
        self.len -= removed;
        self.resize(self.fitted_slots());
    }

    /// The entries, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        self.slots
            .iter()
            .filter(|(k, _)| *k != NO_KEY)
            .map(|(k, v)| (*k, v))
    }

    /// The values, in no particular order.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.slots
            .iter_mut()
            .filter(|(k, _)| *k != NO_KEY)
            .map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::HashMap;

    use super::*;

    /// Every operation agrees with `HashMap` over a long random sequence whose keys collide
    /// (a small key space: long runs, removals in the middle of runs, wrap-around at the
    /// table's end), and after each step every key is found where a probe reaches it.
    #[test]
    fn agrees_with_a_hash_map_through_inserts_removes_and_growth() {
        let mut t: AddrTable<u64> = AddrTable::default();
        let mut m: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..200_000u64 {
            let r = next();
            // Block-like keys: 2 MiB strides in a few arenas, and 512 B ones.
            let key = match r % 3 {
                0 => 0x7f00_0000_0000 + (r >> 8) % 3000 * (2 << 20),
                1 => 0x7e00_0000_0000 + (r >> 8) % 500 * 512,
                _ => 0x7d00_0000_0000 + (r >> 8) % 64 * (1 << 30),
            };
            match (r >> 40) % 5 {
                0..=2 => assert_eq!(t.insert(key, step), m.insert(key, step)),
                3 => assert_eq!(t.remove(key), m.remove(&key)),
                _ => assert_eq!(t.get_mut(key).copied(), m.get(&key).copied()),
            }
            assert_eq!(t.len(), m.len());
            if step % 20_000 == 0 {
                for (k, v) in &m {
                    assert_eq!(t.get_mut(*k).copied(), Some(*v), "step {step}");
                }
                assert_eq!(t.iter().count(), m.len());
            }
        }
        for (k, v) in &m {
            assert_eq!(t.get_mut(*k).copied(), Some(*v));
        }
    }

    /// The null address is never a key; lookups on an empty table find nothing.
    #[test]
    fn the_null_address_and_an_empty_table_find_nothing() {
        let mut t: AddrTable<u32> = AddrTable::default();
        assert!(t.get_mut(0x1000).is_none());
        assert!(t.remove(0x1000).is_none());
        assert!(t.get_mut(NO_KEY).is_none());
        t.insert(0x1000, 1);
        assert!(t.get_mut(NO_KEY).is_none());
        assert!(t.remove(NO_KEY).is_none());
        assert_eq!(t.len(), 1);
    }

    /// `remove_if` removes only what its predicate takes, and keeps the table findable.
    #[test]
    fn remove_if_takes_only_what_it_is_told() {
        let mut t: AddrTable<u64> = AddrTable::default();
        for i in 1..=100u64 {
            t.insert(i * 512, i);
        }
        assert_eq!(t.remove_if(512, |&v| v == 2), None);
        assert_eq!(t.get_mut(512).copied(), Some(1));
        assert_eq!(t.remove_if(512, |&v| v == 1), Some(1));
        assert_eq!(t.remove_if(512, |_| true), None);
        assert_eq!(t.len(), 99);
        assert!((2..=100u64).all(|i| t.get_mut(i * 512).copied() == Some(i)));
    }

    /// A table emptied down to a few entries shrinks (and keeps them), one still a quarter
    /// full does not, and the shrunk table grows again as before.
    #[test]
    fn a_sparse_table_shrinks_and_keeps_its_entries() {
        let mut t: AddrTable<u64> = AddrTable::default();
        for i in 1..=10_000u64 {
            t.insert(i * 512, i);
        }
        let full = t.slots.len();
        for i in 1..=7_500u64 {
            t.remove(i * 512);
        }
        assert!(!t.shrink_if_sparse(), "a quarter full");
        for i in 7_501..=9_900u64 {
            t.remove(i * 512);
        }
        assert!(t.shrink_if_sparse());
        assert!(t.slots.len() < full / 8 && t.slots.len() >= 2 * t.len());
        assert!(!t.shrink_if_sparse(), "already half full");
        for i in 9_901..=10_000u64 {
            assert_eq!(t.get_mut(i * 512).copied(), Some(i));
        }
        for i in 1..=9_900u64 {
            assert!(t.get_mut(i * 512).is_none());
            t.insert(i * 512, i);
        }
        assert_eq!(t.len(), 10_000);
        assert!((1..=10_000u64).all(|i| t.get_mut(i * 512).copied() == Some(i)));
        for i in 1..=10_000u64 {
            t.remove(i * 512);
        }
        assert!(t.shrink_if_sparse());
        assert_eq!(t.slots.len(), MIN_SLOTS);
    }

    /// `retain` keeps exactly the entries it is told to (with their changed values), and
    /// the rest are gone for lookups, iteration and removal.
    #[test]
    fn retain_keeps_what_it_is_told_and_lookups_still_work() {
        let mut t: AddrTable<u64> = AddrTable::default();
        for i in 1..=1000u64 {
            t.insert(i * 512, i);
        }
        t.retain(|k, v| {
            *v += 1;
            k % 1024 == 0
        });
        assert_eq!(t.len(), 500);
        for i in 1..=1000u64 {
            let want = (i % 2 == 0).then_some(i + 1);
            assert_eq!(t.get_mut(i * 512).copied(), want);
        }
        for v in t.values_mut() {
            *v = 7;
        }
        assert!(t.iter().all(|(_, v)| *v == 7));
        assert_eq!(t.remove(1024), Some(7));
        assert_eq!(t.len(), 499);
        // Keeping few: the table is placed again in fewer slots.
        let before = t.slots.len();
        t.retain(|k, _| k % (64 * 1024) == 0);
        assert_eq!(t.len(), 7);
        assert!(t.slots.len() < before);
        assert!((1..=7u64).all(|i| t.get_mut(i * 64 * 1024) == Some(&mut 7)));
    }
}
