//! Deterministic page contents and their checksum, shared by every backend.
//!
//! Tests, the demo and the benchmarks fill pages with [`fill`] and check them with
//! [`checksum`]. Both work on little-endian `u64` words and are simple enough to run as a
//! GPU kernel: the checksum is a wrapping sum of position-mixed words, so it is
//! order-independent (a parallel reduction gives the same value) but still catches a
//! moved, zeroed or corrupted word. A trailing part shorter than a word is mixed in too.

/// One word of the pattern for `seed` at word index `i` (splitmix64 of `seed + i`).
#[inline]
pub fn word(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with the pattern for `seed`.
pub fn fill(seed: u64, out: &mut [u8]) {
    let mut chunks = out.chunks_exact_mut(8);
    let mut i = 0u64;
    for c in &mut chunks {
        c.copy_from_slice(&word(seed, i).to_le_bytes());
        i += 1;
    }
    let rest = chunks.into_remainder();
    let w = word(seed, i).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&w[..n]);
}

/// `len` bytes of the pattern for `seed`: [`fill`] into a new vector.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(seed, &mut v);
    v
}

#[inline]
fn mix(w: u64, i: u64) -> u64 {
    (w ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93))
        .wrapping_mul(0xA076_1D64_78BD_642F)
        .rotate_left(29)
}

/// The checksum of `data`: a wrapping sum over words of `mix(word, index)`.
pub fn checksum(data: &[u8]) -> u64 {
    let mut chunks = data.chunks_exact(8);
    let mut sum = 0u64;
    let mut i = 0u64;
    for c in &mut chunks {
        sum = sum.wrapping_add(mix(u64::from_le_bytes(c.try_into().expect("8 bytes")), i));
        i += 1;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        sum = sum.wrapping_add(mix(u64::from_le_bytes(w), i));
    }
    sum ^ (data.len() as u64)
}

/// The checksum [`fill`] with `seed` would give for `len` bytes, without allocating.
pub fn expected_checksum(seed: u64, len: usize) -> u64 {
    let words = len / 8;
    let mut sum = 0u64;
    for i in 0..words as u64 {
        sum = sum.wrapping_add(mix(word(seed, i), i));
    }
    let rest = len % 8;
    if rest != 0 {
        let mut w = word(seed, words as u64).to_le_bytes();
        w[rest..].fill(0);
        sum = sum.wrapping_add(mix(u64::from_le_bytes(w), words as u64));
    }
    sum ^ (len as u64)
}

/// A seed for page `index` of a buffer whose contents have seed `buffer_seed`.
pub fn page_seed(buffer_seed: u64, index: u64) -> u64 {
    word(buffer_seed ^ 0x5EED_5EED_5EED_5EED, index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_matches_filled_for_odd_lengths() {
        for len in [0usize, 1, 7, 8, 9, 4095, 4096, 65_543] {
            let buf = bytes(42, len);
            assert_eq!(buf.len(), len);
            assert_eq!(checksum(&buf), expected_checksum(42, len), "len {len}");
        }
    }

    #[test]
    fn checksum_catches_changes() {
        let mut buf = vec![0u8; 4096];
        fill(7, &mut buf);
        let good = checksum(&buf);
        buf[100] ^= 1;
        assert_ne!(checksum(&buf), good);
        buf[100] ^= 1;
        buf.swap(8, 16); // two words' first bytes exchanged
        assert_ne!(checksum(&buf), good);
        assert_ne!(checksum(&vec![0u8; 4096]), good);
        assert_ne!(expected_checksum(8, 4096), good);
    }
}
