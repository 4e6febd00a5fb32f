//! The rANS decode loop with AVX2: the eight lanes of a group are one vector; table entries
//! come from two gathers and refill words are handed to the refilling lanes in lane order by
//! one permutation. A group's gather-multiply-refill chain is long, so several independent
//! streams (two chunks, see `chunk::decode_pair`) advance in step to overlap their chains.
//! It computes exactly what the scalar loop computes (same states, same words consumed), so
//! the choice between them is invisible in the output.

use super::rans::{DecTable, EncTable};
use crate::format::LANES;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::super::rans::{DecTable, EncTable, RANS_L};
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

    /// Loop constants, built once per call.
    struct Consts {
        slot_mask: __m256i,
        shift: __m128i,
        low16: __m256i,
        seven: __m256i,
        l: __m256i,
        field_shifts: __m256i,
        reverse: __m128i,
    }

    /// # Safety
    /// AVX2 (`unsafe` rather than a safe `#[target_feature]` fn, which needs Rust 1.86).
    #[target_feature(enable = "avx2")]
    unsafe fn consts(prob_bits: u32) -> Consts {
        Consts {
            slot_mask: _mm256_set1_epi32((1 << prob_bits) - 1),
            shift: _mm_cvtsi32_si128(prob_bits as i32),
            low16: _mm256_set1_epi32(0xffff),
            seven: _mm256_set1_epi32(7),
            l: _mm256_set1_epi32(RANS_L as i32),
            field_shifts: _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
            // Word `p - 1` first: reverses the eight 16-bit words of the window.
            reverse: _mm_setr_epi8(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1),
        }
    }

    /// One group of eight symbols of one stream: returns the new states and the words used.
    ///
    /// # Safety
    /// AVX2; `8 <= p <= words.len() / 2`; `grp` has eight symbols.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn group(
        c: &Consts,
        table: &DecTable,
        xv: __m256i,
        words: &[u8],
        p: usize,
        grp: &mut [u16],
    ) -> (__m256i, usize) {
        // SAFETY: gathers index slots masked below `1 << prob_bits <= MAX_SLOTS`, inside both
        // tables; the 16 word bytes start at `2 * (p - 8)` with `8 <= p <= words.len() / 2`;
        // the 16-byte store covers exactly the eight symbols of `grp`.
        let slot = _mm256_and_si256(xv, c.slot_mask);
        let e = _mm256_i32gather_epi32::<4>(table.freq_bias.as_ptr().cast(), slot);
        let s = _mm256_i32gather_epi32::<4>(table.sym.as_ptr().cast(), slot);
        let v = _mm256_add_epi32(
            _mm256_mullo_epi32(_mm256_and_si256(e, c.low16), _mm256_srl_epi32(xv, c.shift)),
            _mm256_srli_epi32::<16>(e),
        );
        // States stay below 2^31, so the signed compare is the unsigned one.
        let refill = _mm256_cmpgt_epi32(c.l, v);
        let m = _mm256_movemask_ps(_mm256_castsi256_ps(refill)) as usize;
        let win = _mm_loadu_si128(words.as_ptr().add(2 * (p - LANES)).cast());
        let win = _mm256_cvtepu16_epi32(_mm_shuffle_epi8(win, c.reverse));
        let idx = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32(EXPAND[m & 255] as i32), c.field_shifts),
            c.seven,
        );
        let w = _mm256_permutevar8x32_epi32(win, idx);
        let refilled = _mm256_or_si256(_mm256_slli_epi32::<16>(v), w);
        let s16 = _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        debug_assert!(grp.len() >= LANES);
        _mm_storeu_si128(grp.as_mut_ptr().cast(), s16);
        (
            _mm256_blendv_epi8(v, refilled, refill),
            m.count_ones() as usize,
        )
    }

    /// Decodes whole groups of eight symbols of `N` independent streams in step (stream `j`
    /// into `syms[j]`, all of the same length) while every stream has at least eight words
    /// left (`LANES <= pos <= words.len() / 2`); returns how many symbols each stream decoded.
    /// The caller finishes the rest with the scalar decoder.
    ///
    /// # Safety
    /// The CPU must support AVX2 ([`available`]).
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn decode_groups<const N: usize>(
        syms: [&mut [u16]; N],
        tables: [&DecTable; N],
        prob_bits: u32,
        words: [&[u8]; N],
        pos: [&mut usize; N],
        x: [&mut [u32; LANES]; N],
    ) -> usize {
        let c = consts(prob_bits);
        // SAFETY: each `x[j]` is 32 bytes.
        let mut xv: [__m256i; N] =
            std::array::from_fn(|j| _mm256_loadu_si256(x[j].as_ptr().cast()));
        let mut p: [usize; N] = std::array::from_fn(|j| *pos[j]);
        let n = syms.iter().map(|s| s.len()).min().unwrap_or(0) / LANES * LANES;
        let mut done = 0;
        while done < n && (0..N).all(|j| (LANES..=words[j].len() / 2).contains(&p[j])) {
            for j in 0..N {
                // SAFETY: AVX2 per the caller; `p[j]` checked above; `done + 8 <= n`.
                let (v, used) = group(
                    &c,
                    tables[j],
                    xv[j],
                    words[j],
                    p[j],
                    &mut syms[j][done..done + LANES],
                );
                xv[j] = v;
                p[j] -= used;
            }
            done += LANES;
        }
        for j in 0..N {
            _mm256_storeu_si256(x[j].as_mut_ptr().cast(), xv[j]);
            *pos[j] = p[j];
        }
        done
    }
    /// For each 8-bit emit mask, the emitting lanes from the highest to the lowest (the order
    /// the sequential encoder emits in), as eight 4-bit fields.
    const DESCENDING: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut m = 0;
        while m < 256 {
            let (mut packed, mut at, mut k) = (0u32, 0, 8);
            while k > 0 {
                k -= 1;
                if (m >> k) & 1 == 1 {
                    packed |= (k as u32) << (4 * at);
                    at += 1;
                }
            }
            t[m as usize] = packed;
            m += 1;
        }
        t
    };

    /// Encodes whole groups of 32 symbols of a version-2 block, the last group first (the
    /// caller has coded the partial tail group, if any, with the scalar coder), exactly as
    /// `rans::put` does lane by lane: lanes 31 down to 0, words appended in emission order.
    /// `words` needs room for `*pos + syms.len() + 8` words (each quarter stores eight and
    /// keeps those of its emitting lanes).
    ///
    /// # Safety
    /// The CPU must support AVX2 ([`available`]); `syms.len()` is a multiple of 32.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn encode_groups32(
        syms: &[u16],
        table: &EncTable,
        words: &mut [u16],
        pos: &mut usize,
        x: &mut [u32; 4 * LANES],
    ) {
        assert!(syms.len() % (4 * LANES) == 0 && words.len() >= *pos + syms.len() + LANES);
        let t = table.as_ptr().cast::<i32>();
        let low16 = _mm256_set1_epi32(0xffff);
        let seven = _mm256_set1_epi32(7);
        let field_shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let (k1, k2, k3) = (
            _mm256_set1_epi32(1),
            _mm256_set1_epi32(2),
            _mm256_set1_epi32(3),
        );
        // SAFETY (whole body): gathers index `4 * symbol + field` with symbols below 512, inside
        // the 512 16-byte entries; loads and stores stay inside `x`, `syms` (checked length)
        // and `words` (asserted room: at most one word per symbol plus eight of slack).
        let mut xv: [__m256i; 4] =
            std::array::from_fn(|q| _mm256_loadu_si256(x[q * LANES..].as_ptr().cast()));
        let mut p = *pos;
        for grp in syms.chunks_exact(4 * LANES).rev() {
            for q in (0..4).rev() {
                let s = _mm256_cvtepu16_epi32(_mm_loadu_si128(grp[q * LANES..].as_ptr().cast()));
                let s = _mm256_and_si256(s, _mm256_set1_epi32(511));
                let idx = _mm256_slli_epi32::<2>(s);
                let x_max = _mm256_i32gather_epi32::<4>(t, idx);
                let rcp = _mm256_i32gather_epi32::<4>(t, _mm256_add_epi32(idx, k1));
                let bias = _mm256_i32gather_epi32::<4>(t, _mm256_add_epi32(idx, k2));
                let cs = _mm256_i32gather_epi32::<4>(t, _mm256_add_epi32(idx, k3));
                let v = xv[q];
                // Unsigned v >= x_max (x_max may be 2^31).
                let emit = _mm256_cmpeq_epi32(_mm256_max_epu32(v, x_max), v);
                let m = _mm256_movemask_ps(_mm256_castsi256_ps(emit)) as usize;
                let order = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_set1_epi32(DESCENDING[m] as i32), field_shifts),
                    seven,
                );
                let w = _mm256_and_si256(_mm256_permutevar8x32_epi32(v, order), low16);
                let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(w, w));
                _mm_storeu_si128(words.as_mut_ptr().add(p).cast(), _mm256_castsi256_si128(w));
                p += m.count_ones() as usize;
                let v = _mm256_blendv_epi8(v, _mm256_srli_epi32::<16>(v), emit);
                // q = mulhi(v, rcp) >> shift, then v + bias + q * cmpl.
                let even = _mm256_srli_epi64::<32>(_mm256_mul_epu32(v, rcp));
                let odd =
                    _mm256_mul_epu32(_mm256_srli_epi64::<32>(v), _mm256_srli_epi64::<32>(rcp));
                let hi = _mm256_blend_epi32::<0b1010_1010>(even, odd);
                let quot = _mm256_srlv_epi32(hi, _mm256_srli_epi32::<16>(cs));
                let cmpl = _mm256_and_si256(cs, low16);
                xv[q] = _mm256_add_epi32(_mm256_add_epi32(v, bias), _mm256_mullo_epi32(quot, cmpl));
            }
        }
        for (q, v) in xv.iter().enumerate() {
            _mm256_storeu_si256(x[q * LANES..].as_mut_ptr().cast(), *v);
        }
        *pos = p;
    }

    /// Decodes whole groups of 32 symbols of one version-2 block (lane `k` = symbol `k % 32`)
    /// while at least 32 words are left; returns how many symbols it decoded. The four 8-lane
    /// quarters of a group are four independent gather-multiply chains that only share the word
    /// position, so one block keeps the core as busy as v1's chunk pairs did.
    ///
    /// # Safety
    /// The CPU must support AVX2 ([`available`]).
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn decode_groups32(
        syms: &mut [u16],
        table: &DecTable,
        prob_bits: u32,
        words: &[u8],
        pos: &mut usize,
        x: &mut [u32; 4 * LANES],
    ) -> usize {
        let c = consts(prob_bits);
        // SAFETY: `x` is four runs of eight lanes.
        let mut xv: [__m256i; 4] =
            std::array::from_fn(|q| _mm256_loadu_si256(x[q * LANES..].as_ptr().cast()));
        let mut p = *pos;
        let n = syms.len() / (4 * LANES) * (4 * LANES);
        let mut done = 0;
        while done < n && (4 * LANES..=words.len() / 2).contains(&p) {
            for (q, v) in xv.iter_mut().enumerate() {
                // SAFETY: AVX2 per the caller; each quarter uses at most eight words, so
                // `p >= 8` holds for every quarter; `done + 32 <= n`.
                let at = done + q * LANES;
                let (nv, used) = group(&c, table, *v, words, p, &mut syms[at..at + LANES]);
                *v = nv;
                p -= used;
            }
            done += 4 * LANES;
        }
        for (q, v) in xv.iter().enumerate() {
            _mm256_storeu_si256(x[q * LANES..].as_mut_ptr().cast(), *v);
        }
        *pos = p;
        done
    }
}

/// Whether [`decode_pair_groups`] decodes anything on this CPU.
pub(crate) fn paired_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Two streams' leading groups in step (see [`avx2::decode_groups`]); 0 without AVX2.
pub(crate) fn decode_pair_groups(
    syms: [&mut [u16]; 2],
    tables: [&DecTable; 2],
    prob_bits: u32,
    words: [&[u8]; 2],
    pos: [&mut usize; 2],
    x: [&mut [u32; LANES]; 2],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::decode_groups(syms, tables, prob_bits, words, pos, x) };
    }
    let _ = (syms, tables, prob_bits, words, pos, x);
    0
}

/// Leading whole groups of a version-2 block with AVX2 (see [`avx2::decode_groups32`]);
/// 0 without it, and the caller's scalar loop decodes everything.
pub(crate) fn decode_groups32(
    syms: &mut [u16],
    table: &DecTable,
    prob_bits: u32,
    words: &[u8],
    pos: &mut usize,
    x: &mut [u32; 4 * LANES],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::decode_groups32(syms, table, prob_bits, words, pos, x) };
    }
    let _ = (syms, table, prob_bits, words, pos, x);
    0
}

/// Whole groups of a version-2 block with AVX2 (see [`avx2::encode_groups32`]); `false`
/// without it, and the caller codes them with the scalar coder.
pub(crate) fn encode_groups32(
    syms: &[u16],
    table: &EncTable,
    words: &mut [u16],
    pos: &mut usize,
    x: &mut [u32; 4 * LANES],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2; the callee asserts its length requirements.
        unsafe { avx2::encode_groups32(syms, table, words, pos, x) };
        return true;
    }
    let _ = (syms, table, words, pos, x);
    false
}
