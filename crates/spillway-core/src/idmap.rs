//! Hash maps keyed by the pool's own ids ([`IdMap`], [`IdSet`]): one multiply per word
//! instead of SipHash. The keys are ids the core hands out (buffers, pages, acquires,
//! transfers), not input an adversary picks, so a keyed hash buys nothing; SipHash was a
//! third of the predictor's `upcoming` (perf, `mixtral_b4.jsonl`) and the other maps of
//! the acquire path paid it at every lookup.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// The hasher of [`IdMap`] and [`IdSet`] (see the module docs).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

/// A `HashMap` keyed by ids, with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
/// A `HashSet` of ids, with [`IdHasher`].
pub type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_spread_and_maps_work() {
        let mut m: IdMap<u64, u64> = IdMap::default();
        for i in 0..10_000u64 {
            m.insert(i, i * 2);
        }
        assert_eq!(m.len(), 10_000);
        assert!((0..10_000u64).all(|i| m[&i] == i * 2));
        // Consecutive ids land in different low bits (the buckets a small table uses).
        let low = |i: u64| {
            let mut h = IdHasher::default();
            h.write_u64(i);
            h.finish() & 0xff
        };
        let distinct: IdSet<u64> = (0..256u64).map(low).collect();
        assert!(distinct.len() > 128, "{}", distinct.len());
    }
}
