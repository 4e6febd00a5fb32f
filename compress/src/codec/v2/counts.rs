//! The symbol counts a version-2 table is normalised from (FORMAT.md, "Symbol counts"): every
//! element of a tensor of fewer than [`SAMPLE_FROM`] elements; from there on the elements of a
//! fixed sample (the first [`SAMPLE_RUN`] of every [`SAMPLE_PERIOD`]), plus one for each symbol
//! the sample missed that may be in the tensor: between the least and the greatest symbol of
//! its sign other than the zero and all-ones exponents, or one of those two where the tensor
//! has it (zeros, infinities and NaNs sit far from an activation's exponents: inside a range
//! they would give a frequency to every exponent between). The histogram was a quarter of a
//! large tensor's encode on a CPU core; the sample is an eighth of it, and the sign ranges
//! (every present symbol needs a frequency) a vector pass over the piece the checksum then
//! reads from the cache. The CUDA kernels count the same way.

use std::ops::Range;

use super::super::simd;
use super::super::split::Elem;

/// Tensors of this many elements and more are counted on a sample.
pub const SAMPLE_FROM: usize = 1 << 20;
/// The sample: elements whose index `i` has `i % SAMPLE_PERIOD < SAMPLE_RUN`.
pub const SAMPLE_RUN: usize = 64;
pub const SAMPLE_PERIOD: usize = 512;

/// Per sign (index 0: sign bit clear, 1: set), among the elements seen: the least and the
/// greatest symbol whose exponent is neither zero nor all ones (`lo > hi`: none), and whether
/// the zero-exponent and the all-ones-exponent symbol occur.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SignRanges {
    pub lo: [u32; 2],
    pub hi: [u32; 2],
    pub zero: [bool; 2],
    pub top: [bool; 2],
}

impl SignRanges {
    pub const EMPTY: SignRanges = SignRanges {
        lo: [u32::MAX; 2],
        hi: [0; 2],
        zero: [false; 2],
        top: [false; 2],
    };

    pub fn merge(&mut self, o: &SignRanges) {
        for g in 0..2 {
            self.lo[g] = self.lo[g].min(o.lo[g]);
            self.hi[g] = self.hi[g].max(o.hi[g]);
            self.zero[g] |= o.zero[g];
            self.top[g] |= o.top[g];
        }
    }
}

/// Pass 1's tally over part of a tensor.
pub(crate) struct Tally {
    pub counts: [u64; 512],
    pub ranges: SignRanges,
}

impl Tally {
    pub fn new() -> Tally {
        Tally {
            counts: [0; 512],
            ranges: SignRanges::EMPTY,
        }
    }

    pub fn merge(&mut self, o: &Tally) {
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.ranges.merge(&o.ranges);
    }

    /// Tallies `piece` (whole elements; element `first` of the tensor at its start): every
    /// element, or for a sampled tensor the sample's, and the sign ranges of all.
    pub fn add<E: Elem>(&mut self, piece: &[u8], first: usize, sampled: bool) {
        if !sampled {
            return histogram::<E>(piece, &mut self.counts);
        }
        // The ranges first: their sequential pass brings the piece into the cache the
        // sample's strided reads then hit (the other way round, each sampled run missed).
        simd::sign_ranges::<E>(piece, &mut self.ranges);
        let runs = sample_runs(first, piece.len() / E::BYTES)
            .map(|r| &piece[r.start * E::BYTES..r.end * E::BYTES]);
        count_runs::<E>(runs, &mut self.counts);
    }

    /// The counts the table is normalised from: for a sampled tensor, each symbol the sample
    /// missed inside its sign's range counts one.
    pub fn table_counts<E: Elem>(mut self, sampled: bool) -> [u64; 512] {
        if sampled {
            let (r, half) = (self.ranges, E::ALPHABET / 2);
            for g in 0..2 {
                if r.lo[g] <= r.hi[g] {
                    for c in &mut self.counts[r.lo[g] as usize..=r.hi[g] as usize] {
                        *c = (*c).max(1);
                    }
                }
                for (there, s) in [(r.zero[g], g * half), (r.top[g], g * half + half - 1)] {
                    if there {
                        self.counts[s] = self.counts[s].max(1);
                    }
                }
            }
        }
        self.counts
    }
}

/// The sample's elements among `n` elements starting at element `first` of the tensor, as
/// ranges of those `n`.
pub(crate) fn sample_runs(first: usize, n: usize) -> impl Iterator<Item = Range<usize>> {
    let end = first + n;
    (first / SAMPLE_PERIOD..)
        .map(|k| k * SAMPLE_PERIOD)
        .take_while(move |&s| s < end)
        .filter_map(move |s| {
            let (a, b) = (s.max(first), (s + SAMPLE_RUN).min(end));
            (a < b).then(|| a - first..b - first)
        })
}

/// The [`SignRanges`] of `src` (whole elements), merged into `r`: the scalar loop the vector
/// one must agree with.
pub(crate) fn sign_ranges_scalar<E: Elem>(src: &[u8], r: &mut SignRanges) {
    let half = (E::ALPHABET / 2) as u32;
    for e in src.chunks_exact(E::BYTES) {
        let s = E::symbol(E::load(e)) as u32;
        let g = (s >= half) as usize;
        match s & (half - 1) {
            0 => r.zero[g] = true,
            x if x == half - 1 => r.top[g] = true,
            _ => {
                r.lo[g] = r.lo[g].min(s);
                r.hi[g] = r.hi[g].max(s);
            }
        }
    }
}

/// Symbol counts of whole elements of `src`, added to `counts`.
pub(crate) fn histogram<E: Elem>(src: &[u8], counts: &mut [u64; 512]) {
    count_runs::<E>(std::iter::once(src), counts)
}

/// [`histogram`] of several runs. Eight partial tables, so runs of one symbol (common in
/// activations) do not wait on one counter's previous increment; two-byte elements (bf16, f16)
/// four per 64-bit load into 16-bit counters (8 KiB of tables, a quarter of the L1 cache):
/// 15-25% faster than one load per element into 32-bit counters on real activations.
fn count_runs<'a, E: Elem>(runs: impl Iterator<Item = &'a [u8]>, counts: &mut [u64; 512]) {
    if E::BYTES == 2 {
        return count_runs16::<E>(runs, counts);
    }
    // Flushed every 2^31 elements, so no `u32` counter passes 2^28.
    const FLUSH: usize = 1 << 31;
    let mut h = [[0u32; 512]; 8];
    let mut since = 0usize;
    for run in runs {
        for part in run.chunks(E::BYTES * FLUSH) {
            let n = part.len() / E::BYTES;
            if since + n > FLUSH {
                flush(&mut h, counts);
                since = 0;
            }
            since += n;
            let mut groups = part.chunks_exact(8 * E::BYTES);
            for g in &mut groups {
                for (k, t) in h.iter_mut().enumerate() {
                    t[E::symbol(E::load(&g[k * E::BYTES..])) & 511] += 1;
                }
            }
            for e in groups.remainder().chunks_exact(E::BYTES) {
                counts[E::symbol(E::load(e)) & 511] += 1;
            }
        }
    }
    flush(&mut h, counts);
}

fn count_runs16<'a, E: Elem>(runs: impl Iterator<Item = &'a [u8]>, counts: &mut [u64; 512]) {
    // A table counts one element in eight of whole groups: flushed every 8 * 65535 elements,
    // no 16-bit counter overflows.
    const FLUSH: usize = 8 * 0xffff;
    let (w, mask) = (E::MANT_BITS, E::ALPHABET - 1);
    let mut h = [[0u16; 512]; 8];
    let mut since = 0usize;
    for run in runs {
        for part in run.chunks(2 * FLUSH) {
            let n = part.len() / 2;
            if since + n > FLUSH {
                flush(&mut h, counts);
                since = 0;
            }
            since += n;
            let mut groups = part.chunks_exact(16);
            for g in &mut groups {
                let a = u64::from_le_bytes(g[..8].try_into().expect("8 bytes"));
                let b = u64::from_le_bytes(g[8..].try_into().expect("8 bytes"));
                for k in 0..4 {
                    h[k][(a >> (16 * k as u32 + w)) as usize & mask] += 1;
                    h[4 + k][(b >> (16 * k as u32 + w)) as usize & mask] += 1;
                }
            }
            for e in groups.remainder().chunks_exact(2) {
                counts[E::symbol(E::load(e)) & 511] += 1;
            }
        }
    }
    flush(&mut h, counts);
}

/// Adds the partial tables to `counts` and zeroes them.
fn flush<T: Copy + Default + Into<u64>>(h: &mut [[T; 512]; 8], counts: &mut [u64; 512]) {
    for (s, c) in counts.iter_mut().enumerate() {
        for t in h.iter_mut() {
            *c += std::mem::take(&mut t[s]).into();
        }
    }
}
