//! The cpu streams' copy engine. A GPU's copy engine moves bytes by DMA without passing them
//! through the CPU's caches; a plain `memmove` of an offloaded activation (a few hundred KiB to
//! a few MiB: under glibc's non-temporal threshold) into host memory would instead fill the
//! shared cache with bytes nobody reads until backward and evict the working set of the compute
//! on the other core. Large copies into host (pinned) memory therefore store with non-temporal
//! (cache-bypassing) writes where the CPU has them; copies into device memory (a reload, read
//! by the next layer's backward) are plain, so what the compute reads next may still be cached.

/// Copies at least this long bypass the cache on their stores.
const STREAMING_MIN: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst` (the ranges may overlap); `bypass_cache`: the
/// destination is not read soon.
///
/// # Safety
/// As `std::ptr::copy`: both ranges valid for `len` bytes.
pub(crate) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize, bypass_cache: bool) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bypass_cache;
    #[cfg(target_arch = "x86_64")]
    if bypass_cache {
        let (s, d) = (src as usize, dst as usize);
        let disjoint = s.saturating_add(len) <= d || d.saturating_add(len) <= s;
        if len >= STREAMING_MIN && disjoint && std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the caller's ranges, checked disjoint; AVX detected.
            return unsafe { streaming_copy(src, dst, len) };
        }
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(src, dst, len) }
}

/// 32-byte streaming stores from an aligned destination on; the ragged ends by `memcpy`.
///
/// # Safety
/// Both ranges valid for `len` bytes and disjoint; the CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn streaming_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    const LANE: usize = 32;
    let head = dst.align_offset(LANE).min(len);
    // SAFETY: (the whole function) every access is inside [0, len) of both ranges, which the
    // caller guarantees valid and disjoint; stores through `dst + i` are 32-byte aligned; the
    // caller checked AVX.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 4 * LANE <= len {
            let a = _mm256_loadu_si256(src.add(i).cast::<__m256i>());
            let b = _mm256_loadu_si256(src.add(i + LANE).cast::<__m256i>());
            let c = _mm256_loadu_si256(src.add(i + 2 * LANE).cast::<__m256i>());
            let e = _mm256_loadu_si256(src.add(i + 3 * LANE).cast::<__m256i>());
            _mm256_stream_si256(dst.add(i).cast::<__m256i>(), a);
            _mm256_stream_si256(dst.add(i + LANE).cast::<__m256i>(), b);
            _mm256_stream_si256(dst.add(i + 2 * LANE).cast::<__m256i>(), c);
            _mm256_stream_si256(dst.add(i + 3 * LANE).cast::<__m256i>(), e);
            i += 4 * LANE;
        }
        while i + LANE <= len {
            let a = _mm256_loadu_si256(src.add(i).cast::<__m256i>());
            _mm256_stream_si256(dst.add(i).cast::<__m256i>(), a);
            i += LANE;
        }
        // Streaming stores are weakly ordered: fenced before the job reports completion.
        _mm_sfence();
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + i / 251) as u8).collect()
    }

    #[test]
    fn every_alignment_and_ragged_end_copies_exactly() {
        let src = pattern(STREAMING_MIN * 2 + 300);
        for len in [
            0,
            1,
            31,
            STREAMING_MIN - 1,
            STREAMING_MIN,
            STREAMING_MIN + 97,
        ] {
            for (so, d_off) in [(0, 0), (1, 0), (0, 7), (5, 31), (33, 64)] {
                let mut dst = vec![0xAAu8; len + 128];
                // SAFETY: both ranges inside their vectors, distinct allocations.
                unsafe { copy_bytes(src.as_ptr().add(so), dst.as_mut_ptr().add(d_off), len, true) };
                assert_eq!(
                    &dst[d_off..d_off + len],
                    &src[so..so + len],
                    "len {len} at {so}/{d_off}"
                );
                assert!(
                    dst[..d_off].iter().all(|&b| b == 0xAA),
                    "wrote before the range"
                );
                assert!(
                    dst[d_off + len..].iter().all(|&b| b == 0xAA),
                    "wrote past the range"
                );
            }
        }
    }

    #[test]
    fn overlapping_ranges_move_like_memmove() {
        let len = STREAMING_MIN + 100;
        let mut buf = pattern(len + 4096);
        let expected = buf[..len].to_vec();
        // SAFETY: both ranges inside `buf`; they overlap, which `copy_bytes` allows.
        unsafe { copy_bytes(buf.as_ptr(), buf.as_mut_ptr().add(4096), len, true) };
        assert_eq!(&buf[4096..], &expected[..]);
    }
}
