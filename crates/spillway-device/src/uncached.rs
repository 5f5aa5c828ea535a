//! A copy that leaves its destination out of the CPU caches, as a DMA engine would.
//!
//! The sim device stands in for a GPU copy with a CPU copy. A plain `memcpy` leaves the
//! destination's lines hot in the CPU cache, which a real host-to-device copy does not:
//! a page copied just before a kernel reads it would then compute faster than one copied
//! earlier (or resident), and a benchmark would reward copying late (issue 18: on_demand
//! ran ~30% faster "compute" than resident on the sim). [`copy_uncached`] writes the
//! destination with non-temporal stores on x86_64 (SSE2, part of the x86_64 baseline, so
//! no runtime detection), which go to memory and drop any cached copy of the line. That
//! measured faster than a plain copy followed by `clflush` of each line (the flush writes
//! back what the copy just pulled in; `clflushopt` is not in stable `std::arch`), and as
//! cold for the next reader. Elsewhere it is a plain copy (the sim is then less faithful,
//! never wrong).

/// Bytes moved per loop iteration of the streaming copy: one 64-byte cache line, so
/// every write-combining buffer fills whole and goes to memory as one burst.
#[cfg(target_arch = "x86_64")]
const LINE: usize = 64;

/// Copies `len` bytes from `src` to `dst`, leaving `dst` out of the CPU caches (on x86_64).
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` is valid for `len` bytes of reads, `dst`
/// for `len` bytes of writes, the two ranges do not overlap, and nobody else accesses
/// `dst` during the copy. No alignment is required.
pub(crate) unsafe fn copy_uncached(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        stream_copy(src, dst, len)
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract is `copy_nonoverlapping`'s.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}

/// The x86_64 body of [`copy_uncached`]: a plain copy up to the first 16-byte-aligned
/// destination byte, whole lines with unaligned loads and non-temporal 16-byte stores,
/// a plain copy of the tail, then `sfence` so the streamed stores are ordered before
/// whatever the caller does next (its completion tells another thread the data is there).
///
/// # Safety
/// As [`copy_uncached`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    let head = dst.align_offset(16).min(len);
    let lines = (len - head) / LINE;
    let body = lines * LINE;
    // SAFETY: `head + body <= len`, so every pointer below stays inside the caller's
    // ranges. Stores go through `dst + head + k`, 16-byte aligned by the choice of `head`
    // (as `_mm_stream_si128` needs); loads are unaligned (`_mm_loadu_si128`). SSE2 is part
    // of the x86_64 baseline, so the intrinsics are always available.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (s, d) = (src.add(head), dst.add(head));
        for line in 0..lines {
            let at = line * LINE;
            for k in (0..LINE).step_by(16) {
                let v = _mm_loadu_si128(s.add(at + k).cast::<__m128i>());
                _mm_stream_si128(d.add(at + k).cast::<__m128i>(), v);
            }
        }
        std::ptr::copy_nonoverlapping(s.add(body), d.add(body), len - head - body);
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::copy_uncached;
    use spillway_types::pattern;

    /// Copies `len` bytes from `src_off` of a patterned buffer to `dst_off` of a zeroed one.
    fn copied(src_off: usize, dst_off: usize, len: usize) -> (Vec<u8>, Vec<u8>) {
        let src = pattern::bytes(len as u64 ^ 0x5eed, src_off + len + 64);
        let mut dst = vec![0u8; dst_off + len + 64];
        // SAFETY: both ranges lie inside their own vectors, which do not overlap.
        unsafe {
            copy_uncached(
                src.as_ptr().add(src_off),
                dst.as_mut_ptr().add(dst_off),
                len,
            )
        };
        (src, dst)
    }

    #[test]
    fn copies_every_byte_at_any_alignment_and_length_and_nothing_else() {
        let lengths = [
            0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096, 4099, 65_537,
        ];
        for len in lengths {
            for src_off in 0..17 {
                for dst_off in [0, 1, 7, 8, 15, 16, 31, 33] {
                    let (src, dst) = copied(src_off, dst_off, len);
                    let case = format!("len {len} src_off {src_off} dst_off {dst_off}");
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "{case}"
                    );
                    assert!(
                        dst[..dst_off].iter().all(|&b| b == 0),
                        "{case}: wrote before"
                    );
                    assert!(
                        dst[dst_off + len..].iter().all(|&b| b == 0),
                        "{case}: wrote after"
                    );
                }
            }
        }
    }

    #[test]
    fn copies_a_whole_2mib_page() {
        let len = 2 << 20;
        let (src, dst) = copied(0, 0, len);
        assert_eq!(&dst[..len], &src[..len]);
    }
}
