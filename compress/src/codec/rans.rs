//! rANS with 32-bit states and 16-bit renormalization (states live in `[2^15, 2^31)`), encoder
//! divisions replaced by exact reciprocals, and the compact frequency-table serialization.

use crate::error::{CompressError, Result};

/// Lower bound of a normalized state.
pub(crate) const RANS_L: u32 = 1 << 15;

/// Quantizes symbol counts to frequencies summing to `1 << prob_bits`, every present symbol
/// at least 1, choosing each +1/-1 step where it costs the fewest coded bits.
///
/// At least two symbols must be present (one symbol is coded by the single-symbol mode).
pub(crate) fn normalize(counts: &[u32], prob_bits: u32) -> Vec<u32> {
    let m = 1u64 << prob_bits;
    let total: u64 = counts.iter().map(|&c| c as u64).sum();
    let mut freq: Vec<u32> = counts
        .iter()
        .map(|&c| {
            if c == 0 {
                0
            } else {
                ((c as u64 * m + total / 2) / total).max(1) as u32
            }
        })
        .collect();
    let present: Vec<usize> = (0..counts.len()).filter(|&s| counts[s] > 0).collect();
    let mut sum: i64 = freq.iter().map(|&f| f as i64).sum();
    // Bits saved (or lost) by one more (or one less) unit of a symbol, kept per symbol and
    // recomputed only for the symbol that changed; ties go to the same symbol as a full scan
    // would pick (the first smallest loss, the last largest gain).
    let loss = |s: usize, freq: &[u32]| {
        if freq[s] > 1 {
            counts[s] as f64 * (freq[s] as f64 / (freq[s] - 1) as f64).ln()
        } else {
            f64::INFINITY
        }
    };
    let gain =
        |s: usize, freq: &[u32]| counts[s] as f64 * ((freq[s] + 1) as f64 / freq[s] as f64).ln();
    if sum > m as i64 {
        let mut cost: Vec<f64> = present.iter().map(|&s| loss(s, &freq)).collect();
        while sum > m as i64 {
            let mut best = 0;
            for (i, c) in cost.iter().enumerate() {
                if c.total_cmp(&cost[best]).is_lt() {
                    best = i;
                }
            }
            // Some frequency exceeds 1 while the sum exceeds the total, so `best` has a finite
            // loss.
            let s = present[best];
            freq[s] -= 1;
            sum -= 1;
            cost[best] = loss(s, &freq);
        }
    } else if sum < m as i64 {
        let mut value: Vec<f64> = present.iter().map(|&s| gain(s, &freq)).collect();
        while sum < m as i64 {
            let mut best = 0;
            for (i, g) in value.iter().enumerate() {
                if g.total_cmp(&value[best]).is_ge() {
                    best = i;
                }
            }
            let s = present[best];
            freq[s] += 1;
            sum += 1;
            value[best] = gain(s, &freq);
        }
    }
    freq
}

/// Bits the coded symbols will take with these frequencies (the rANS cost to within a word).
pub(crate) fn coded_bits(counts: &[u32], freq: &[u32], prob_bits: u32) -> f64 {
    counts
        .iter()
        .zip(freq)
        .filter(|(&c, _)| c > 0)
        .map(|(&c, &f)| c as f64 * (prob_bits as f64 - (f as f64).log2()))
        .sum()
}

/// Order-0 entropy of the counts, in bits for all of them.
pub fn entropy_bits(counts: &[u32]) -> f64 {
    let total: f64 = counts.iter().map(|&c| c as f64).sum();
    if total == 0.0 {
        return 0.0;
    }
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let c = c as f64;
            c * (total / c).log2()
        })
        .sum()
}

fn put_varint(out: &mut Vec<u8>, mut v: u32) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], pos: &mut usize, base: usize) -> Result<u32> {
    let mut v = 0u32;
    for shift in (0..35).step_by(7) {
        let byte = *b
            .get(*pos)
            .ok_or_else(|| CompressError::corrupt(base + *pos, "frequency table truncated"))?;
        *pos += 1;
        if shift == 28 && byte > 0x0f {
            return Err(CompressError::corrupt(
                base + *pos - 1,
                "varint overflows 32 bits",
            ));
        }
        v |= ((byte & 0x7f) as u32) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(CompressError::corrupt(base + *pos, "varint too long"))
}

/// Appends the table: `u16` count of present symbols, then per present symbol in increasing
/// order the gap to the previous present symbol and `freq - 1`, both LEB128.
pub(crate) fn write_table(freq: &[u32], out: &mut Vec<u8>) {
    let present = freq.iter().filter(|&&f| f > 0).count() as u16;
    out.extend_from_slice(&present.to_le_bytes());
    let mut next = 0usize;
    for (s, &f) in freq.iter().enumerate() {
        if f > 0 {
            put_varint(out, (s - next) as u32);
            put_varint(out, f - 1);
            next = s + 1;
        }
    }
}

/// Parses a table for an alphabet of `alphabet` symbols; returns frequencies and bytes read.
/// `base` is the absolute offset of `b`, for error messages.
pub(crate) fn read_table(
    b: &[u8],
    alphabet: usize,
    prob_bits: u32,
    base: usize,
) -> Result<(Vec<u32>, usize)> {
    if b.len() < 2 {
        return Err(CompressError::corrupt(base, "frequency table truncated"));
    }
    let present = u16::from_le_bytes([b[0], b[1]]) as usize;
    if present < 2 || present > alphabet {
        return Err(CompressError::corrupt(
            base,
            format!("{present} coded symbols (expected 2..={alphabet})"),
        ));
    }
    let m = 1u64 << prob_bits;
    let mut freq = vec![0u32; alphabet];
    let mut pos = 2;
    let mut next = 0usize;
    let mut sum = 0u64;
    for _ in 0..present {
        let gap = get_varint(b, &mut pos, base)? as usize;
        let s = next
            .checked_add(gap)
            .filter(|&s| s < alphabet)
            .ok_or_else(|| CompressError::corrupt(base + pos, "symbol outside the alphabet"))?;
        let f = get_varint(b, &mut pos, base)? as u64 + 1;
        sum += f;
        if sum > m {
            return Err(CompressError::corrupt(
                base + pos,
                "frequencies exceed the total",
            ));
        }
        freq[s] = f as u32;
        next = s + 1;
    }
    if sum != m {
        return Err(CompressError::corrupt(
            base + pos,
            format!("frequencies sum to {sum}, not {m}"),
        ));
    }
    Ok((freq, pos))
}

/// Encoder constants of one symbol.
#[derive(Clone, Copy, Default)]
#[repr(C, align(16))]
pub(crate) struct EncSym {
    pub x_max: u32,
    pub rcp: u32,
    pub bias: u32,
    pub cmpl: u16,
    pub shift: u16,
}

/// Encoder constants for every symbol of the largest alphabet (9 bits).
pub(crate) type EncTable = [EncSym; 512];

pub(crate) fn enc_table(freq: &[u32], prob_bits: u32) -> EncTable {
    let m = 1u32 << prob_bits;
    let mut cum = 0u32;
    let mut t = [EncSym::default(); 512];
    for (slot, &f) in t.iter_mut().zip(freq) {
        *slot = {
            let e = if f == 0 {
                EncSym::default()
            } else if f == 1 {
                EncSym {
                    x_max: ((RANS_L >> prob_bits) << 16) * f,
                    rcp: u32::MAX,
                    bias: cum + m - 1,
                    cmpl: (m - f) as u16,
                    shift: 0,
                }
            } else {
                let shift = 32 - (f - 1).leading_zeros(); // ceil(log2 f)
                EncSym {
                    x_max: ((RANS_L >> prob_bits) << 16) * f,
                    rcp: (1u64 << (shift + 31)).div_ceil(f as u64) as u32,
                    bias: cum,
                    cmpl: (m - f) as u16,
                    shift: (shift - 1) as u16,
                }
            };
            cum += f;
            e
        };
    }
    t
}

/// Encodes one symbol into `x`, first emitting 16 bits as word `*pos` of `words` when needed.
/// `words` must have room for one more word (a symbol emits at most one): the word is stored
/// unconditionally and kept by advancing `*pos`, so the loop has no data-dependent branch.
#[inline(always)]
pub(crate) fn put(x: &mut u32, e: &EncSym, words: &mut [u16], pos: &mut usize) {
    let mut v = *x;
    let emit = v >= e.x_max;
    words[*pos] = v as u16;
    *pos += emit as usize;
    v = if emit { v >> 16 } else { v };
    let q = (((v as u64 * e.rcp as u64) >> 32) as u32) >> e.shift;
    *x = v + e.bias + q * e.cmpl as u32;
}

/// rANS-codes `syms` into the `N` states `x`, last first, symbol `i` on lane `i % N` (`syms`
/// starts on lane 0); `words` has room for one more word per symbol after `*pos`. A tail group shorter than `N` is coded first.
pub(crate) fn put_lanes<const N: usize>(
    syms: &[u16],
    enc: &EncTable,
    words: &mut [u16],
    pos: &mut usize,
    x: &mut [u32; N],
) {
    let full = syms.len() / N * N;
    for (k, &s) in syms[full..].iter().enumerate().rev() {
        put(&mut x[k], &enc[s as usize & 511], words, pos);
    }
    // A symbol emits at most one word, so after `i` symbols `pos <= i`: the last group starts
    // with at most `full - N` words written and every write below stays inside `words`.
    for grp in syms[..full].chunks_exact(N).rev() {
        for k in (0..N).rev() {
            put(&mut x[k], &enc[grp[k] as usize & 511], words, pos);
        }
    }
}

/// Slots of the largest decoding table (`1 << 14`); smaller tables use a prefix.
pub(crate) const MAX_SLOTS: usize = 1 << 14;

/// The decoding table: per slot of `1 << prob_bits`, one `u64` entry
/// `freq | (slot - cum) << 16 | symbol << 32`, so one load (scalar or vector) yields all three;
/// [`MAX_SLOTS`] entries, so masked indices need no bounds checks. (One 8-byte entry rather
/// than two gathered `u32` arrays: AMD cores gather slower than they load lane by lane.)
pub(crate) struct DecTable {
    pub entries: Box<[u64; MAX_SLOTS]>,
}

impl DecTable {
    /// `freq | (slot - cum) << 16` and the symbol of a masked slot.
    #[inline(always)]
    pub(crate) fn lookup(&self, slot: usize) -> (u32, u16) {
        let e = self.entries[slot & (MAX_SLOTS - 1)];
        (e as u32, (e >> 32) as u16)
    }
}

pub(crate) fn new_dec_table() -> DecTable {
    DecTable {
        entries: vec![0u64; MAX_SLOTS]
            .into_boxed_slice()
            .try_into()
            .unwrap_or_else(|_| unreachable!("the vector has MAX_SLOTS entries")),
    }
}

/// Fills the first `1 << prob_bits` slots of `t` from validated frequencies.
pub(crate) fn fill_dec_table(t: &mut DecTable, freq: &[u32]) {
    let mut slot = 0usize;
    for (s, &f) in freq.iter().enumerate() {
        for k in 0..f {
            t.entries[slot] = (f | k << 16) as u64 | (s as u64) << 32;
            slot += 1;
        }
    }
}

/// Decodes one symbol from `x`, then refills it from `words[*pos - 1]` when it fell below
/// [`RANS_L`]. Corrupt input cannot read out of bounds: past the first word `*pos` wraps and
/// every later read sees 0, which the caller detects (`*pos` never returns to exactly 0).
#[inline(always)]
pub(crate) fn get(
    x: &mut u32,
    table: &DecTable,
    prob_bits: u32,
    words: &[u8],
    pos: &mut usize,
) -> u16 {
    let mask = (1u32 << prob_bits) - 1;
    let v = *x;
    let (e, sym) = table.lookup((v & mask) as usize);
    let v = (e & 0xffff)
        .wrapping_mul(v >> prob_bits)
        .wrapping_add(e >> 16);
    let refill = v < RANS_L;
    *pos = pos.wrapping_sub(refill as usize);
    let at = pos.wrapping_mul(2);
    let w = match words.get(at..at.wrapping_add(2)) {
        Some(b) => u16::from_le_bytes([b[0], b[1]]) as u32,
        None => 0,
    };
    *x = if refill { (v << 16) | w } else { v };
    sym
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalized_frequencies_sum_exactly_and_keep_every_symbol() {
        for counts in [
            vec![1u32, 1_000_000, 0, 3],
            vec![5; 512],
            vec![1, 1],
            vec![0, 7, 0, 0, 9, 1, 1, 1, 1, 100],
        ] {
            for pb in [9, 12, 14] {
                let f = normalize(&counts, pb);
                assert_eq!(f.iter().map(|&x| x as u64).sum::<u64>(), 1 << pb);
                for (c, x) in counts.iter().zip(&f) {
                    assert_eq!(*c > 0, *x > 0);
                }
            }
        }
    }

    #[test]
    fn tables_round_trip_and_corrupt_tables_are_rejected() {
        let counts = [0u32, 7, 0, 0, 9, 1, 1, 1, 1, 100, 0, 0, 0, 0, 0, 0];
        let f = normalize(&counts, 12);
        let mut b = Vec::new();
        write_table(&f, &mut b);
        let (g, used) = read_table(&b, 16, 12, 0).unwrap();
        assert_eq!((g, used), (f.clone(), b.len()));
        assert!(
            read_table(&b, 8, 12, 0).is_err(),
            "symbol 9 is outside 8 symbols"
        );
        assert!(read_table(&b, 16, 13, 0).is_err(), "sum is for 12 bits");
        assert!(read_table(&b[..b.len() - 1], 16, 12, 0).is_err());
    }

    #[test]
    fn reciprocal_encoder_inverts_the_decoder() {
        let counts = [3u32, 1, 50, 0, 700, 2];
        let pb = 12;
        let f = normalize(&counts, pb);
        let enc = enc_table(&f, pb);
        let mut dec = new_dec_table();
        fill_dec_table(&mut dec, &f);
        let syms: Vec<usize> = (0..5000).map(|i| [0, 1, 2, 4, 5, 4, 4, 2][i % 8]).collect();
        let mut words = vec![0u16; syms.len() + 1];
        let (mut x, mut pos) = (RANS_L, 0);
        for &s in syms.iter().rev() {
            put(&mut x, &enc[s], &mut words, &mut pos);
        }
        let bytes: Vec<u8> = words[..pos].iter().flat_map(|w| w.to_le_bytes()).collect();
        let bytes = &bytes[..];
        for &s in &syms {
            assert_eq!(get(&mut x, &dec, pb, bytes, &mut pos) as usize, s);
        }
        assert_eq!((x, pos), (RANS_L, 0));
    }
}
