//! The rANS loops with AVX2, and the codec's other vectorised passes (v2 mantissa packing,
//! checksum terms). Eight lanes of a group are one vector; table entries are loaded lane by
//! lane (on AMD cores eight loads cost far less than gathers) and refill words are
//! handed to the refilling lanes in lane order by one permutation from a 256-entry table.
//! Several independent chains advance in step to overlap their latencies: the four quarters
//! of a v2 group, or two v1 chunks (see `chunk::decode_pair`). Every loop computes exactly
//! what the scalar code computes (same states, same words, same bytes), so the choice between
//! them is invisible in the output.

use super::rans::{DecTable, EncTable};
use crate::format::LANES;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::super::rans::{DecTable, EncTable, MAX_SLOTS, RANS_L};
    use super::super::split::{mantissa_len, Elem};
    use crate::format::LANES;

    /// Eight lanes of `u32`, aligned for one vector load.
    #[repr(C, align(32))]
    struct Lanes([u32; 8]);

    /// Four vectors of `u32`, aligned for vector stores.
    #[repr(C, align(32))]
    struct Lanes4([u32; 32]);

    /// For each 8-bit refill mask, the window lane each lane takes its word from: the window
    /// holds words `p - 8 .. p` in order and refilling lane `k` takes word
    /// `p - 1 - popcount(mask & ((1 << k) - 1))` (the refilling lanes in lane order).
    static REFILL: [Lanes; 256] = {
        let mut t = [const { Lanes([0; 8]) }; 256];
        let mut m = 0;
        while m < 256 {
            let mut before = 0u32;
            let mut k = 0;
            while k < 8 {
                t[m].0[k] = 7 - before;
                before += (m as u32 >> k) & 1;
                k += 1;
            }
            m += 1;
        }
        t
    };

    /// For each 8-bit emit mask, the emitting lanes from the highest to the lowest (the order
    /// the sequential encoder emits in), then the others.
    static EMIT: [Lanes; 256] = {
        let mut t = [const { Lanes([0; 8]) }; 256];
        let mut m = 0;
        while m < 256 {
            let (mut at, mut k) = (0, 8);
            while k > 0 {
                k -= 1;
                if (m >> k) & 1 == 1 {
                    t[m].0[at] = k as u32;
                    at += 1;
                }
            }
            m += 1;
        }
        t
    };

    /// AVX2, and POPCNT for the refill and emit counts (every AVX2 CPU has it; without it
    /// `count_ones` compiles to a multiply-and-shift sequence on the loops' critical paths).
    pub(crate) fn available() -> bool {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("popcnt")
    }

    /// Loop constants, built once per call.
    struct Consts {
        slot_mask: __m256i,
        shift: __m128i,
        low16: __m256i,
        l: __m256i,
    }

    /// # Safety
    /// AVX2 and POPCNT (`unsafe` rather than a safe `#[target_feature]` fn, which needs Rust
    /// 1.86).
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn consts(prob_bits: u32) -> Consts {
        // Masked slots index the decoding table unchecked (`lookup8`).
        assert!(1 << prob_bits <= MAX_SLOTS);
        Consts {
            slot_mask: _mm256_set1_epi32((1 << prob_bits) - 1),
            shift: _mm_cvtsi32_si128(prob_bits as i32),
            low16: _mm256_set1_epi32(0xffff),
            l: _mm256_set1_epi32(RANS_L as i32),
        }
    }

    /// The table entries of eight slots, loaded lane by lane (faster than two gathers on AMD
    /// cores): `freq | (slot - cum) << 16` and the symbols, one lane per slot.
    ///
    /// # Safety
    /// AVX2 and POPCNT.
    #[target_feature(enable = "avx2,popcnt")]
    #[inline]
    unsafe fn lookup8(table: &DecTable, slot: __m256i) -> (__m256i, __m256i) {
        let mut idx = [0u32; 8];
        // SAFETY: `idx` is 32 bytes. The slots were masked below `1 << prob_bits`, and
        // `consts` asserted `prob_bits <= 14`, so every entry read lies inside the table.
        _mm256_storeu_si256(idx.as_mut_ptr().cast(), slot);
        let t = table.entries.as_ptr();
        // Volatile: read back from memory (cheap loads) rather than extracted lane by lane.
        let e = |k: usize| {
            t.add(std::ptr::read_volatile(&idx[k]) as usize)
                .cast::<__m128i>()
        };
        // Two entries per half from memory (a load and a load-merge each); lanes 0, 1, 4, 5
        // and 2, 3, 6, 7, so the two shuffles below keep lane order.
        let pair = |i: usize, j: usize| {
            _mm_castpd_si128(_mm_loadh_pd(
                _mm_castsi128_pd(_mm_loadl_epi64(e(i))),
                e(j).cast::<f64>(),
            ))
        };
        let a = _mm256_castsi256_ps(_mm256_set_m128i(pair(4, 5), pair(0, 1)));
        let b = _mm256_castsi256_ps(_mm256_set_m128i(pair(6, 7), pair(2, 3)));
        (
            _mm256_castps_si256(_mm256_shuffle_ps::<0b10_00_10_00>(a, b)),
            _mm256_castps_si256(_mm256_shuffle_ps::<0b11_01_11_01>(a, b)),
        )
    }

    /// One step of eight lanes of one stream: returns the new states, the words used and the
    /// decoded symbols (one per 32-bit lane).
    ///
    /// # Safety
    /// AVX2 and POPCNT; `window` points at 16 readable bytes, the eight words below the next
    /// unread one.
    #[target_feature(enable = "avx2,popcnt")]
    #[inline]
    unsafe fn step(
        c: &Consts,
        table: &DecTable,
        xv: __m256i,
        window: *const u8,
    ) -> (__m256i, usize, __m256i) {
        // SAFETY: slots are masked below `1 << prob_bits <= MAX_SLOTS`; `window` per the
        // caller.
        let (e, s) = lookup8(table, _mm256_and_si256(xv, c.slot_mask));
        let v = _mm256_add_epi32(
            _mm256_mullo_epi32(_mm256_and_si256(e, c.low16), _mm256_srl_epi32(xv, c.shift)),
            _mm256_srli_epi32::<16>(e),
        );
        // States stay below 2^31, so the signed compare is the unsigned one.
        let refill = _mm256_cmpgt_epi32(c.l, v);
        let m = _mm256_movemask_ps(_mm256_castsi256_ps(refill)) as usize;
        let win = _mm_loadu_si128(window.cast());
        let win = _mm256_cvtepu16_epi32(win);
        let idx = _mm256_load_si256(REFILL[m & 255].0.as_ptr().cast());
        let w = _mm256_permutevar8x32_epi32(win, idx);
        let refilled = _mm256_or_si256(_mm256_slli_epi32::<16>(v), w);
        (
            _mm256_blendv_epi8(v, refilled, refill),
            m.count_ones() as usize,
            s,
        )
    }

    /// One group of eight symbols of one stream into `grp`: returns the new states and the
    /// words used.
    ///
    /// # Safety
    /// AVX2 and POPCNT; `8 <= p <= words.len() / 2`; `grp` has eight symbols.
    #[target_feature(enable = "avx2,popcnt")]
    #[inline]
    unsafe fn group(
        c: &Consts,
        table: &DecTable,
        xv: __m256i,
        words: &[u8],
        p: usize,
        grp: &mut [u16],
    ) -> (__m256i, usize) {
        // SAFETY: the 16 bytes at `2 * (p - 8)` lie inside `words` (`8 <= p <= len / 2`).
        let (v, used, s) = step(c, table, xv, words.as_ptr().add(2 * (p - LANES)));
        let s16 = _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        assert!(grp.len() >= LANES);
        // SAFETY: the 16-byte store covers the eight symbols of `grp`.
        _mm_storeu_si128(grp.as_mut_ptr().cast(), s16);
        (v, used)
    }

    /// Decodes whole groups of eight symbols of `N` independent streams in step (stream `j`
    /// into `syms[j]`, all of the same length) while every stream has at least eight words
    /// left (`LANES <= pos <= words.len() / 2`); returns how many symbols each stream decoded.
    /// The caller finishes the rest with the scalar decoder.
    ///
    /// # Safety
    /// The CPU must support AVX2 and POPCNT ([`available`]).
    #[target_feature(enable = "avx2,popcnt")]
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
    /// Encodes whole groups of 32 symbols of a version-2 block, the last group first (the
    /// caller has coded the partial tail group, if any, with the scalar coder), exactly as
    /// `rans::put` does lane by lane: lanes 31 down to 0, words appended in emission order.
    /// `words` needs room for `*pos + syms.len() + 8` words (each quarter stores eight and
    /// keeps those of its emitting lanes).
    ///
    /// # Safety
    /// The CPU must support AVX2 and POPCNT ([`available`]); `syms.len()` is a multiple of 32.
    #[target_feature(enable = "avx2,popcnt")]
    pub(crate) unsafe fn encode_groups32(
        syms: &[u16],
        table: &EncTable,
        words: &mut [u16],
        pos: &mut usize,
        x: &mut [u32; 4 * LANES],
    ) {
        assert!(syms.len() % (4 * LANES) == 0 && words.len() >= *pos + syms.len() + LANES);
        let t = table.as_ptr();
        let low16 = _mm256_set1_epi32(0xffff);
        // SAFETY (whole body): entries are read at byte offsets `16 * (symbol & 511)`, inside
        // the 512 16-byte entries; loads and stores stay inside `x`, `syms` (checked length) and
        // `words` (asserted room: at most one word per symbol plus eight of slack).
        let ld = |q: usize| _mm256_loadu_si256(x[q * LANES..].as_ptr().cast());
        let (mut x0, mut x1, mut x2, mut x3) = (ld(0), ld(1), ld(2), ld(3));
        let mut p = *pos;
        // One quarter of a group, written out four times (not a loop over an array), so the
        // states stay in registers.
        macro_rules! quarter {
            ($grp:ident, $v:ident, $q:expr) => {
                let q = $q;
                // The eight lanes' 16-byte entries, loaded one by one (faster than four
                // gathers on AMD cores) and transposed into one vector per field.
                // Volatile: each offset is one plain load, not a two-uop lane extraction the
                // compiler would otherwise make of the stored vector.
                let ent = |k: usize| {
                    t.cast::<u8>()
                        .add(std::ptr::read_volatile(&$grp[q * LANES + k]) as usize)
                        .cast::<__m128i>()
                };
                let row = |k: usize| _mm256_loadu2_m128i(ent(k + 4), ent(k));
                let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
                let (t0, t1) = (_mm256_unpacklo_epi32(r0, r1), _mm256_unpackhi_epi32(r0, r1));
                let (t2, t3) = (_mm256_unpacklo_epi32(r2, r3), _mm256_unpackhi_epi32(r2, r3));
                let x_max = _mm256_unpacklo_epi64(t0, t2);
                let rcp = _mm256_unpackhi_epi64(t0, t2);
                let bias = _mm256_unpacklo_epi64(t1, t3);
                let cs = _mm256_unpackhi_epi64(t1, t3);
                let v = $v;
                // Unsigned v >= x_max (x_max may be 2^31).
                let emit = _mm256_cmpeq_epi32(_mm256_max_epu32(v, x_max), v);
                let m = _mm256_movemask_ps(_mm256_castsi256_ps(emit)) as usize;
                let order = _mm256_load_si256(EMIT[m & 255].0.as_ptr().cast());
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
                $v = _mm256_add_epi32(_mm256_add_epi32(v, bias), _mm256_mullo_epi32(quot, cmpl));
            };
        }
        let (mask, offsets) = (_mm256_set1_epi32(511), &mut Lanes4([0u32; 4 * LANES]));
        for grp in syms.chunks_exact(4 * LANES).rev() {
            // Byte offsets of the group's table entries, computed eight at a time (the scalar
            // loads below then need no arithmetic).
            for h in 0..4 {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(grp[8 * h..].as_ptr().cast()));
                let o = _mm256_slli_epi32::<4>(_mm256_and_si256(v, mask));
                _mm256_store_si256(offsets.0[8 * h..].as_mut_ptr().cast(), o);
            }
            let offsets = &offsets.0;
            let grp = offsets;
            quarter!(grp, x3, 3);
            quarter!(grp, x2, 2);
            quarter!(grp, x1, 1);
            quarter!(grp, x0, 0);
        }
        for (q, v) in [x0, x1, x2, x3].into_iter().enumerate() {
            _mm256_storeu_si256(x[q * LANES..].as_mut_ptr().cast(), v);
        }
        *pos = p;
    }

    /// Packs the mantissas of whole runs of 16 two-byte elements of `src` (bf16, f16) into the
    /// mantissa stream at the start of `dst`, as `split::pack8` does; returns how many elements
    /// it packed. Each run's second group of eight is stored 16 bytes wide at byte `w` of the
    /// run, so a run needs `16 - w` bytes of room past its own `2 w` bytes: runs stop where
    /// `dst` ends, and the caller packs the rest (overwriting what those wide stores spilled).
    ///
    /// # Safety
    /// The CPU must support AVX2 and POPCNT ([`available`]).
    #[target_feature(enable = "avx2,popcnt")]
    pub(crate) unsafe fn pack_mantissas16<E: Elem>(src: &[u8], dst: &mut [u8]) -> usize {
        if E::BYTES != 2 {
            return 0;
        }
        let w = E::MANT_BITS as usize;
        let n = src.len() / 2;
        let mask = _mm256_set1_epi16(E::MANT_MASK as i16);
        // Pairs of elements into 32-bit lanes: `m[2j] + m[2j + 1] << w`.
        let pair = _mm256_set1_epi32(1 | (1 << (w + 16)));
        let low32 = _mm256_set1_epi64x(0xffff_ffff);
        let shift2 = _mm_cvtsi32_si128(2 * w as i32);
        let shift4 = _mm_cvtsi32_si128(4 * w as i32);
        // f16: four elements are five whole bytes; keep bytes 0-4 and 8-12 of each half.
        let five = _mm256_setr_epi8(
            0, 1, 2, 3, 4, 8, 9, 10, 11, 12, -1, -1, -1, -1, -1, -1, 0, 1, 2, 3, 4, 8, 9, 10, 11,
            12, -1, -1, -1, -1, -1, -1,
        );
        let mut done = 0;
        while done + 16 <= n && done / 8 * w + w + 16 <= dst.len() {
            // SAFETY: 32 source bytes of 16 whole elements; the two 16-byte stores end at
            // `done / 8 * w + w + 16 <= dst.len()`.
            let v = _mm256_loadu_si256(src.as_ptr().add(2 * done).cast());
            let a = _mm256_madd_epi16(_mm256_and_si256(v, mask), pair);
            // Four elements per 64-bit lane.
            let b = _mm256_or_si256(
                _mm256_and_si256(a, low32),
                _mm256_sll_epi64(_mm256_srli_epi64::<32>(a), shift2),
            );
            // Eight elements at the start of each 16-byte half.
            let c = if w == 7 {
                _mm256_or_si256(b, _mm256_sll_epi64(_mm256_bsrli_epi128::<8>(b), shift4))
            } else {
                _mm256_shuffle_epi8(b, five)
            };
            let out = dst.as_mut_ptr().add(done / 8 * w);
            _mm_storeu_si128(out.cast(), _mm256_castsi256_si128(c));
            _mm_storeu_si128(out.add(w).cast(), _mm256_extracti128_si256::<1>(c));
            done += 16;
        }
        done
    }

    /// `format::checksum_terms` of the whole 32-byte runs of `data` (words numbered from
    /// `first_word`), four words per vector: the 64-bit products are put together from three
    /// 32-bit ones. Returns the sum and how many bytes it covered.
    ///
    /// # Safety
    /// The CPU must support AVX2 and POPCNT ([`available`]).
    #[target_feature(enable = "avx2,popcnt")]
    pub(crate) unsafe fn checksum_terms32(data: &[u8], first_word: u64) -> (u64, usize) {
        use crate::format::{K1, K2};
        let k2 = _mm256_set1_epi64x(K2 as i64);
        let k2_hi = _mm256_set1_epi64x((K2 >> 32) as i64);
        let step = _mm256_set1_epi64x(K1.wrapping_mul(4) as i64);
        let ik = |k: u64| first_word.wrapping_add(k).wrapping_mul(K1) as i64;
        let mut index = _mm256_setr_epi64x(ik(0), ik(1), ik(2), ik(3));
        let mut acc = _mm256_setzero_si256();
        let runs = data.len() / 32;
        for r in 0..runs {
            // SAFETY: run `r` is 32 bytes inside `data`.
            let wv = _mm256_loadu_si256(data.as_ptr().add(32 * r).cast());
            let a = _mm256_xor_si256(wv, index);
            // a * K2 mod 2^64 = lo*lo + (hi(a)*lo(K2) + lo(a)*hi(K2)) << 32.
            let cross = _mm256_add_epi64(
                _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), k2),
                _mm256_mul_epu32(a, k2_hi),
            );
            let z = _mm256_add_epi64(_mm256_mul_epu32(a, k2), _mm256_slli_epi64::<32>(cross));
            acc = _mm256_add_epi64(acc, _mm256_xor_si256(z, _mm256_srli_epi64::<29>(z)));
            index = _mm256_add_epi64(index, step);
        }
        let mut lanes = [0u64; 4];
        _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc);
        let sum = lanes.iter().fold(0u64, |s, &l| s.wrapping_add(l));
        (sum, 32 * runs)
    }

    /// The [`SignRanges`](super::super::v2::SignRanges) of the whole 32-byte runs of `src`
    /// (two- or four-byte elements, symbol = element >> `mant_bits`, of an alphabet of `half`
    /// symbols a sign); returns them and how many bytes it covered.
    ///
    /// # Safety
    /// The CPU must support AVX2 and POPCNT ([`available`]).
    #[target_feature(enable = "avx2,popcnt")]
    pub(crate) unsafe fn sign_ranges32(
        src: &[u8],
        elem_bytes: usize,
        mant_bits: u32,
        half: u32,
    ) -> (super::super::v2::SignRanges, usize) {
        let ones = _mm256_set1_epi32(-1);
        let zero = _mm256_setzero_si256();
        let sh = _mm_cvtsi32_si128(mant_bits as i32);
        let (mut pos_lo, mut neg_lo, mut pos_hi, mut neg_hi) = (ones, ones, zero, zero);
        // Per lane, the edge exponents seen: bit 1 a non-negative element's, bit 2 a negative
        // one's (two accumulators, not four: with four, one spilled to the stack and the loop
        // waited on it every iteration).
        let (mut zf, mut tf) = (zero, zero);
        let runs = src.len() / 32;
        // Lanes that do not count (the other sign, an edge exponent) are all ones for a
        // minimum and zero for a maximum, so they never win.
        macro_rules! scan {
            ($srai:ident, $srl:ident, $set1:ident, $cmpeq:ident, $min:ident, $max:ident,
             $add:ident, $bits:expr, $t:ty) => {
                let exp_mask = $set1((half - 1) as $t);
                let one = $set1(1);
                for r in 0..runs {
                    // SAFETY: run `r` is 32 bytes inside `src`.
                    let x = _mm256_loadu_si256(src.as_ptr().add(32 * r).cast());
                    let neg = $srai::<$bits>(x);
                    let sym = $srl(x, sh);
                    let e = _mm256_and_si256(sym, exp_mask);
                    let is_z = $cmpeq(e, zero);
                    let is_t = $cmpeq(e, exp_mask);
                    let sign_bit = $add(_mm256_and_si256(neg, one), one);
                    zf = _mm256_or_si256(zf, _mm256_and_si256(is_z, sign_bit));
                    tf = _mm256_or_si256(tf, _mm256_and_si256(is_t, sign_bit));
                    let edge = _mm256_or_si256(is_z, is_t);
                    let out_p = _mm256_or_si256(neg, edge);
                    let out_n = _mm256_or_si256(_mm256_xor_si256(neg, ones), edge);
                    pos_lo = $min(pos_lo, _mm256_or_si256(sym, out_p));
                    pos_hi = $max(pos_hi, _mm256_andnot_si256(out_p, sym));
                    neg_lo = $min(neg_lo, _mm256_or_si256(sym, out_n));
                    neg_hi = $max(neg_hi, _mm256_andnot_si256(out_n, sym));
                }
            };
        }
        let wide = elem_bytes == 4;
        if wide {
            scan!(
                _mm256_srai_epi32,
                _mm256_srl_epi32,
                _mm256_set1_epi32,
                _mm256_cmpeq_epi32,
                _mm256_min_epu32,
                _mm256_max_epu32,
                _mm256_add_epi32,
                31,
                i32
            );
        } else {
            scan!(
                _mm256_srai_epi16,
                _mm256_srl_epi16,
                _mm256_set1_epi16,
                _mm256_cmpeq_epi16,
                _mm256_min_epu16,
                _mm256_max_epu16,
                _mm256_add_epi16,
                15,
                i16
            );
        }
        let lanes = |x: __m256i| -> Vec<u32> {
            let mut v = [0u32; 8];
            _mm256_storeu_si256(v.as_mut_ptr().cast(), x);
            if wide {
                v.to_vec()
            } else {
                v.iter().flat_map(|w| [w & 0xffff, w >> 16]).collect()
            }
        };
        let none = if wide { u32::MAX } else { 0xffff };
        let lo = |x: __m256i| match lanes(x).into_iter().min() {
            Some(m) if m != none => m,
            _ => u32::MAX,
        };
        let hi = |x: __m256i| lanes(x).into_iter().max().unwrap_or(0);
        let seen = |x: __m256i, bit: u32| lanes(x).iter().any(|l| l & bit != 0);
        (
            super::super::v2::SignRanges {
                lo: [lo(pos_lo), lo(neg_lo)],
                hi: [hi(pos_hi), hi(neg_hi)],
                zero: [seen(zf, 1), seen(zf, 2)],
                top: [seen(tf, 1), seen(tf, 2)],
            },
            32 * runs,
        )
    }

    /// How eight `w`-bit mantissas of a packed group are cut out with one byte shuffle: lanes
    /// 0-3 read from the group's first byte, lanes 4-7 from byte `second`, each lane takes the
    /// four bytes its field starts in, then shifts and masks.
    struct MantLayout {
        second: usize,
        bytes: __m256i,
        shifts: __m256i,
        mask: __m256i,
        w: __m128i,
    }

    /// # Safety
    /// AVX2 and POPCNT.
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn mant_layout(w: u32) -> MantLayout {
        let byte = |k: u32| (k * w / 8) as usize;
        let second = byte(4);
        let mut ctl = [-1i8; 32];
        let mut shifts = [0i32; 8];
        for k in 0..8u32 {
            let rel = byte(k) - if k < 4 { 0 } else { second };
            for j in 0..4 {
                ctl[4 * k as usize + j] = (rel + j) as i8;
            }
            shifts[k as usize] = (k * w % 8) as i32;
        }
        MantLayout {
            second,
            // SAFETY: 32 and 32 bytes.
            bytes: _mm256_loadu_si256(ctl.as_ptr().cast()),
            shifts: _mm256_loadu_si256(shifts.as_ptr().cast()),
            mask: _mm256_set1_epi32(((1u64 << w) - 1) as i32),
            w: _mm_cvtsi32_si128(w as i32),
        }
    }

    /// Decodes whole groups of 32 elements of one version-2 block (lane `k` = element `k % 32`)
    /// while at least 32 words are left, and writes each element `symbol << w | mantissa`
    /// straight into `out` (no symbol buffer, no second pass); returns how many elements it
    /// wrote. The four 8-lane quarters of a group are four independent lookup-multiply chains
    /// that only share the word position. `payload` is the block's payload (mantissas,
    /// words, states), `words` its word bytes.
    ///
    /// # Safety
    /// The CPU must support AVX2 and POPCNT ([`available`]).
    #[target_feature(enable = "avx2,popcnt")]
    pub(crate) unsafe fn decode_merge32<E: Elem>(
        out: &mut [u8],
        payload: &[u8],
        words_len: usize,
        table: &DecTable,
        prob_bits: u32,
        pos: &mut usize,
        x: &mut [u32; 4 * LANES],
    ) -> usize {
        let c = consts(prob_bits);
        let ml = mant_layout(E::MANT_BITS);
        let (n, w) = (out.len() / E::BYTES, E::MANT_BITS as usize);
        let mlen = mantissa_len(n, E::MANT_BITS);
        // The last group's mantissa reads end at most `second + 16 - w` bytes past the
        // mantissas, inside the words and 128 bytes of states that follow them; the words
        // (at `mlen`) fit the payload.
        assert!(payload.len() >= mlen + 32 && payload.len() >= mlen + words_len);
        // A word window reaches 16 bytes below the next unread word: with no words left,
        // into the mantissas (at least 28 bytes whenever there is a whole group).
        if mlen < 16 {
            return 0;
        }
        // SAFETY: `x` is four runs of eight lanes.
        let ld = |q: usize| _mm256_loadu_si256(x[q * LANES..].as_ptr().cast());
        let (mut x0, mut x1, mut x2, mut x3) = (ld(0), ld(1), ld(2), ld(3));
        let mut p = *pos;
        let full = n / (4 * LANES) * (4 * LANES);
        let mut done = 0;
        let mut lost = false;
        // One quarter: its eight states step, its eight elements are written. Written out
        // four times (not a loop over an array), so the states stay in registers.
        macro_rules! quarter {
            ($v:ident, $q:expr, $advance:ident) => {
                // SAFETY: AVX2 per the caller; element `e + 8 <= n`, so the store stays
                // inside `out`, and the mantissa loads inside `payload` (asserted above).
                let e = done + $q * LANES;
                // The window below word `p` starts inside the payload (`mlen >= 16`) and
                // ends at or before the last word (`p <= words_len / 2`).
                let window = payload.as_ptr().add(mlen + 2 * p - 16);
                let (nv, used, s) = step(&c, table, $v, window);
                $v = nv;
                $advance!(used);
                let g = payload.as_ptr().add(e / 8 * w);
                let raw = _mm256_set_m128i(
                    _mm_loadu_si128(g.add(ml.second).cast()),
                    _mm_loadu_si128(g.cast()),
                );
                let m = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_shuffle_epi8(raw, ml.bytes), ml.shifts),
                    ml.mask,
                );
                let el = _mm256_or_si256(_mm256_sll_epi32(s, ml.w), m);
                let dst = out.as_mut_ptr().add(e * E::BYTES);
                if E::BYTES == 4 {
                    _mm256_storeu_si256(dst.cast(), el);
                } else {
                    let el16 = _mm_packus_epi32(
                        _mm256_castsi256_si128(el),
                        _mm256_extracti128_si256::<1>(el),
                    );
                    _mm_storeu_si128(dst.cast(), el16);
                }
            };
        }
        // While a group cannot use up the words left.
        macro_rules! plain {
            ($used:ident) => {
                p -= $used;
            };
        }
        while done < full && p >= 4 * LANES {
            quarter!(x0, 0, plain);
            quarter!(x1, 1, plain);
            quarter!(x2, 2, plain);
            quarter!(x3, 3, plain);
            done += 4 * LANES;
        }
        // The last words (and blocks with none, such as those of a lone symbol): more refills
        // than words left is a corrupt stream; `p` stays at 0 so the windows stay inside the
        // payload, and the stream is reported as not ending where it should.
        macro_rules! guarded {
            ($used:ident) => {
                lost |= $used > p;
                p -= $used.min(p);
            };
        }
        while done < full && !lost {
            quarter!(x0, 0, guarded);
            quarter!(x1, 1, guarded);
            quarter!(x2, 2, guarded);
            quarter!(x3, 3, guarded);
            done += 4 * LANES;
        }
        for (q, v) in [x0, x1, x2, x3].into_iter().enumerate() {
            _mm256_storeu_si256(x[q * LANES..].as_mut_ptr().cast(), v);
        }
        // A lost stream reads on from before its first word, as the scalar decoder does.
        *pos = if lost { usize::MAX } else { p };
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
        // SAFETY: the CPU has AVX2 and POPCNT.
        return unsafe { avx2::decode_groups(syms, tables, prob_bits, words, pos, x) };
    }
    let _ = (syms, tables, prob_bits, words, pos, x);
    0
}

/// Leading whole groups of a version-2 block with AVX2, decoded and merged with their
/// mantissas into `out` (see [`avx2::decode_merge32`]); 0 without AVX2, and the caller's
/// scalar loop decodes everything.
pub(crate) fn decode_merge32<E: super::split::Elem>(
    out: &mut [u8],
    payload: &[u8],
    words_len: usize,
    table: &DecTable,
    prob_bits: u32,
    pos: &mut usize,
    x: &mut [u32; 4 * LANES],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2 and POPCNT.
        return unsafe {
            avx2::decode_merge32::<E>(out, payload, words_len, table, prob_bits, pos, x)
        };
    }
    let _ = (out, payload, words_len, table, prob_bits, pos, x);
    0
}

/// Packs leading runs of 16 mantissas of two-byte elements with AVX2 (see
/// [`avx2::pack_mantissas16`]); returns how many elements it packed (0 without AVX2).
pub(crate) fn pack_mantissas16<E: super::split::Elem>(src: &[u8], dst: &mut [u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2 and POPCNT.
        return unsafe { avx2::pack_mantissas16::<E>(src, dst) };
    }
    let _ = (src, dst);
    0
}

/// `format::checksum_terms`, with AVX2 where the CPU has it.
pub(crate) fn checksum_terms(data: &[u8], first_word: u64) -> u64 {
    #[allow(unused_mut)]
    let (mut sum, mut done) = (0u64, 0usize);
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2 and POPCNT.
        (sum, done) = unsafe { avx2::checksum_terms32(data, first_word) };
    }
    sum.wrapping_add(crate::format::checksum_terms(
        &data[done..],
        first_word.wrapping_add(done as u64 / 8),
    ))
}

/// The least and greatest symbol of each sign in `src` (whole elements), merged into `r`:
/// the 32-byte runs with AVX2 where the CPU has it, the rest by the scalar loop.
pub(crate) fn sign_ranges<E: super::split::Elem>(src: &[u8], r: &mut super::v2::SignRanges) {
    #[allow(unused_mut)]
    let mut done = 0usize;
    #[cfg(target_arch = "x86_64")]
    if (E::BYTES == 2 || E::BYTES == 4) && avx2::available() {
        // SAFETY: the CPU has AVX2 and POPCNT.
        let (v, n) =
            unsafe { avx2::sign_ranges32(src, E::BYTES, E::MANT_BITS, E::ALPHABET as u32 / 2) };
        r.merge(&v);
        done = n;
    }
    super::v2::sign_ranges_scalar::<E>(&src[done..], r);
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
        // SAFETY: the CPU has AVX2 and POPCNT; the callee asserts its length requirements.
        unsafe { avx2::encode_groups32(syms, table, words, pos, x) };
        return true;
    }
    let _ = (syms, table, words, pos, x);
    false
}
