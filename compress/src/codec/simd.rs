//! The rANS decode loop with AVX2: the eight lanes of a group are one vector; table entries
//! come from two gathers and refill words are handed to the refilling lanes in lane order by
//! one permutation. It computes exactly what the scalar loop computes (same states, same
//! words consumed), so the choice between them is invisible in the output.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::super::rans::{DecTable, RANS_L};
    use crate::format::LANES;

    /// For each 8-bit refill mask, lane `k`'s index among the refilling lanes
    /// (`popcount(mask & ((1 << k) - 1))`), as eight 4-bit fields.
    const EXPAND: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut m = 0;
        while m < 256 {
            let mut packed = 0u32;
            let mut before = 0u32;
            let mut k = 0;
            while k < 8 {
                packed |= before << (4 * k);
                before += (m >> k) & 1;
                k += 1;
            }
            t[m as usize] = packed;
            m += 1;
        }
        t
    };

    pub(crate) fn available() -> bool {
        std::is_x86_feature_detected!("avx2")
    }

    /// Decodes whole groups of eight symbols into `syms` while at least eight words remain
    /// (`LANES <= *pos <= words.len() / 2`); returns how many symbols it decoded. The caller
    /// finishes the rest with the scalar decoder.
    ///
    /// # Safety
    /// The CPU must support AVX2 ([`available`]).
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn decode_groups(
        syms: &mut [u16],
        table: &DecTable,
        prob_bits: u32,
        words: &[u8],
        pos: &mut usize,
        x: &mut [u32; LANES],
    ) -> usize {
        let n_words = words.len() / 2;
        // SAFETY (all loads and stores below): `x` is 32 bytes; gathers index slots masked
        // below `1 << prob_bits <= MAX_SLOTS`, inside both tables; the 16 word bytes read
        // start at `2 * (p - 8)` with `8 <= p <= n_words`, so they lie inside `words`; each
        // group stores 16 bytes into its own 8-symbol chunk of `syms`.
        let mut xv = _mm256_loadu_si256(x.as_ptr().cast());
        let slot_mask = _mm256_set1_epi32((1 << prob_bits) - 1);
        let shift = _mm_cvtsi32_si128(prob_bits as i32);
        let low16 = _mm256_set1_epi32(0xffff);
        let seven = _mm256_set1_epi32(7);
        let l = _mm256_set1_epi32(RANS_L as i32);
        let field_shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        // Word `p - 1` first: reverse the eight 16-bit words of the window.
        let reverse = _mm_setr_epi8(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
        let freq_bias = table.freq_bias.as_ptr().cast::<i32>();
        let sym = table.sym.as_ptr().cast::<i32>();
        let mut p = *pos;
        let mut done = 0;
        for grp in syms.chunks_exact_mut(LANES) {
            if !(LANES..=n_words).contains(&p) {
                break;
            }
            let slot = _mm256_and_si256(xv, slot_mask);
            let e = _mm256_i32gather_epi32::<4>(freq_bias, slot);
            let s = _mm256_i32gather_epi32::<4>(sym, slot);
            let v = _mm256_add_epi32(
                _mm256_mullo_epi32(_mm256_and_si256(e, low16), _mm256_srl_epi32(xv, shift)),
                _mm256_srli_epi32::<16>(e),
            );
            // States stay below 2^31, so the signed compare is the unsigned one.
            let refill = _mm256_cmpgt_epi32(l, v);
            let m = _mm256_movemask_ps(_mm256_castsi256_ps(refill)) as usize;
            let win = _mm_loadu_si128(words.as_ptr().add(2 * (p - LANES)).cast());
            let win = _mm256_cvtepu16_epi32(_mm_shuffle_epi8(win, reverse));
            let idx = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(EXPAND[m & 255] as i32), field_shifts),
                seven,
            );
            let w = _mm256_permutevar8x32_epi32(win, idx);
            let refilled = _mm256_or_si256(_mm256_slli_epi32::<16>(v), w);
            xv = _mm256_blendv_epi8(v, refilled, refill);
            p -= m.count_ones() as usize;
            let s16 = _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            _mm_storeu_si128(grp.as_mut_ptr().cast(), s16);
            done += LANES;
        }
        _mm256_storeu_si256(x.as_mut_ptr().cast(), xv);
        *pos = p;
        done
    }
}
