//! One chunk: choose its mode, encode it, and decode it with every length and table checked.
//!
//! Both directions run in two simple passes instead of one fused loop: the symbols go through
//! a `u16` scratch array, so the rANS loops touch nothing but states, tables and words, and
//! the mantissa packing and merging run as separate straight-line loops.

use super::rans::{self, DecTable, EncTable, RANS_L};
use super::simd;
use super::split::{mantissa_len, merge_group, pack_mantissas, symbols_of, unpack_tail, Elem};
use crate::error::{CompressError, Result};
use crate::format::{check_mantissa_padding, checksum, ChunkEntry, ChunkMode, LANES, STATES_LEN};

/// Reusable per-thread buffers, so steady-state encoding allocates nothing per chunk.
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<u16>,
    words: Vec<u16>,
}

/// Reusable per-thread decoding tables and symbol buffers, two of each for [`decode_pair`].
pub(crate) struct DecodeScratch {
    tables: [DecTable; 2],
    syms: [Vec<u16>; 2],
}

impl DecodeScratch {
    pub(crate) fn new() -> Self {
        DecodeScratch {
            tables: [rans::new_dec_table(), rans::new_dec_table()],
            syms: [Vec::new(), Vec::new()],
        }
    }
}

/// Symbol counts of `src` (at most 512 symbols; the unused tail stays zero).
pub(crate) fn histogram<E: Elem>(src: &[u8]) -> [u32; 512] {
    let mut syms = vec![0u16; src.len() / E::BYTES];
    symbols_of::<E>(src, &mut syms);
    count(&syms)
}

/// Symbol counts of `syms` (each below 512).
fn count(syms: &[u16]) -> [u32; 512] {
    // Four tables so runs of equal symbols do not serialize on one counter.
    let mut h = [[0u32; 512]; 4];
    let mut quads = syms.chunks_exact(4);
    for q in &mut quads {
        for (t, &s) in h.iter_mut().zip(q) {
            t[s as usize & 511] += 1;
        }
    }
    for &s in quads.remainder() {
        h[0][s as usize & 511] += 1;
    }
    let mut out = [0u32; 512];
    for (s, o) in out.iter_mut().enumerate() {
        *o = h[0][s] + h[1][s] + h[2][s] + h[3][s];
    }
    out
}

/// Appends the encoding of `src` (whole elements) to `out` and returns its table entry.
pub(crate) fn encode<E: Elem>(
    src: &[u8],
    prob_bits: u32,
    out: &mut Vec<u8>,
    scratch: &mut Scratch,
) -> ChunkEntry {
    let n = src.len() / E::BYTES;
    let check = checksum(src);
    let start = out.len();
    let entry = |mode, out: &Vec<u8>| ChunkEntry {
        mode,
        len: out.len() - start,
        check,
    };
    let raw = |out: &mut Vec<u8>| {
        out.truncate(start);
        out.extend_from_slice(src);
        entry(ChunkMode::Raw, out)
    };
    if n == 0 {
        return raw(out);
    }
    scratch.syms.resize(n, 0);
    let syms = &mut scratch.syms[..n];
    symbols_of::<E>(src, syms);
    let counts = count(syms);
    let counts = &counts[..E::ALPHABET];
    let present = counts.iter().filter(|&&c| c > 0).count();
    let mlen = mantissa_len(n, E::MANT_BITS);

    if present == 1 {
        let first = &src[..E::BYTES];
        if src.chunks_exact(E::BYTES).all(|e| e == first) {
            out.extend_from_slice(first);
            return entry(ChunkMode::Constant, out);
        }
        out.extend_from_slice(&syms[0].to_le_bytes());
        let at = out.len();
        out.resize(at + mlen, 0);
        pack_mantissas::<E>(src, &mut out[at..]);
        return entry(ChunkMode::SingleSymbol, out);
    }

    // Skip the coder when even the entropy bound would not beat the raw bytes.
    let bound = rans::entropy_bits(counts) / 8.0 + (mlen + STATES_LEN + 2) as f64;
    if bound >= src.len() as f64 {
        return raw(out);
    }
    let freq = rans::normalize(counts, prob_bits);
    rans::write_table(&freq, out);
    let estimate = rans::coded_bits(counts, &freq, prob_bits) / 8.0;
    if (out.len() - start + mlen + STATES_LEN) as f64 + estimate >= src.len() as f64 {
        return raw(out);
    }
    let enc = rans::enc_table(&freq, prob_bits);
    let mant_at = out.len();
    out.resize(mant_at + mlen, 0);
    pack_mantissas::<E>(src, &mut out[mant_at..]);
    if scratch.words.len() < n {
        scratch.words.resize(n, 0);
    }
    let (words, states) = encode_symbols(syms, &enc, &mut scratch.words);
    let words_at = out.len();
    out.resize(words_at + 2 * words + STATES_LEN, 0);
    let (word_bytes, state_bytes) = out[words_at..].split_at_mut(2 * words);
    for (o, w) in word_bytes.chunks_exact_mut(2).zip(&scratch.words[..words]) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    for (o, x) in state_bytes.chunks_exact_mut(4).zip(states) {
        o.copy_from_slice(&x.to_le_bytes());
    }
    if out.len() - start >= src.len() {
        return raw(out);
    }
    entry(ChunkMode::Rans, out)
}

/// rANS-codes `syms`, last first, symbol `i` on lane `i % 8`, into `words` (which has room
/// for one word per symbol); returns the number of words and the final states.
fn encode_symbols(syms: &[u16], enc: &EncTable, words: &mut [u16]) -> (usize, [u32; LANES]) {
    let mut x = [RANS_L; LANES];
    let mut pos = 0usize;
    rans::put_lanes(syms, enc, words, &mut pos, &mut x);
    (pos, x)
}

/// Decodes one chunk payload of `out.len() / E::BYTES` elements into `out`.
/// `base` is the payload's absolute offset (for error messages).
pub(crate) fn decode<E: Elem>(
    entry: &ChunkEntry,
    payload: &[u8],
    prob_bits: u32,
    out: &mut [u8],
    base: usize,
    verify: bool,
    scratch: &mut DecodeScratch,
) -> Result<()> {
    let n = out.len() / E::BYTES;
    entry.check_len(E::DTYPE, n, base)?;
    match entry.mode {
        ChunkMode::Raw => {
            out.copy_from_slice(payload);
        }
        ChunkMode::Constant => {
            for e in out.chunks_exact_mut(E::BYTES) {
                e.copy_from_slice(payload);
            }
        }
        ChunkMode::SingleSymbol => {
            check_mantissa_padding(&payload[2..], n, E::MANT_BITS, base + 2)?;
            let sym = u16::from_le_bytes([payload[0], payload[1]]);
            if sym as usize >= E::ALPHABET {
                return Err(CompressError::corrupt(
                    base,
                    format!("symbol {sym} outside the alphabet"),
                ));
            }
            let syms = &mut scratch.syms[0];
            syms.clear();
            syms.resize(n, sym);
            merge::<E>(out, &payload[2..], syms);
        }
        ChunkMode::Rans => {
            let mut r = open_rans::<E>(payload, prob_bits, n, base, &mut scratch.tables[0])?;
            let syms = &mut scratch.syms[0];
            syms.resize(n, 0);
            run_symbols(prob_bits, syms, &scratch.tables[0], &mut r)?;
            r.close(base)?;
            merge::<E>(out, r.mant, syms);
        }
    }
    if verify && checksum(out) != entry.check {
        return Err(CompressError::corrupt(
            base,
            "decoded chunk fails its checksum",
        ));
    }
    Ok(())
}

/// A validated rANS chunk: its mantissas, words, read position and states.
struct RansChunk<'a> {
    mant: &'a [u8],
    words: &'a [u8],
    words_at: usize,
    pos: usize,
    x: [u32; LANES],
}

/// Reads and checks the frequency table, region lengths and initial states of a rANS chunk
/// of `n` elements and fills `table`.
fn open_rans<'a, E: Elem>(
    payload: &'a [u8],
    prob_bits: u32,
    n: usize,
    base: usize,
    table: &mut DecTable,
) -> Result<RansChunk<'a>> {
    let (freq, tlen) = rans::read_table(payload, E::ALPHABET, prob_bits, base)?;
    let words_start = tlen + mantissa_len(n, E::MANT_BITS);
    let words_end = payload
        .len()
        .checked_sub(STATES_LEN)
        .filter(|&e| e >= words_start);
    let Some(words_end) = words_end else {
        return Err(CompressError::corrupt(base, "rans chunk truncated"));
    };
    if (words_end - words_start) % 2 != 0 {
        return Err(CompressError::corrupt(
            base + words_start,
            "odd rans word region",
        ));
    }
    let x: [u32; LANES] = std::array::from_fn(|k| {
        let at = words_end + 4 * k;
        u32::from_le_bytes(payload[at..at + 4].try_into().expect("4 bytes"))
    });
    if x.iter().any(|&s| !(RANS_L..1 << 31).contains(&s)) {
        return Err(CompressError::corrupt(
            base + words_end,
            "rans state out of range",
        ));
    }
    check_mantissa_padding(&payload[tlen..words_start], n, E::MANT_BITS, base + tlen)?;
    rans::fill_dec_table(table, &freq);
    let words = &payload[words_start..words_end];
    Ok(RansChunk {
        mant: &payload[tlen..words_start],
        words,
        words_at: words_start,
        pos: words.len() / 2,
        x,
    })
}

impl RansChunk<'_> {
    /// A valid stream ends having read every word, with every state back at the start.
    fn close(&self, base: usize) -> Result<()> {
        if self.pos != 0 || self.x.iter().any(|&s| s != RANS_L) {
            return Err(CompressError::corrupt(
                base + self.words_at,
                "rans stream does not end where it should",
            ));
        }
        Ok(())
    }
}

/// Decodes the symbols of `r` into `syms` (continuing from its position and states), with
/// the resolution as a constant so masks and shifts are immediates.
fn run_symbols(prob_bits: u32, syms: &mut [u16], t: &DecTable, r: &mut RansChunk) -> Result<()> {
    let (w, pos, x) = (r.words, &mut r.pos, &mut r.x);
    match prob_bits {
        9 => decode_symbols::<9>(syms, t, w, pos, x),
        10 => decode_symbols::<10>(syms, t, w, pos, x),
        11 => decode_symbols::<11>(syms, t, w, pos, x),
        12 => decode_symbols::<12>(syms, t, w, pos, x),
        13 => decode_symbols::<13>(syms, t, w, pos, x),
        14 => decode_symbols::<14>(syms, t, w, pos, x),
        _ => {
            return Err(CompressError::UnsupportedFormat(format!(
                "probability resolution of {prob_bits} bits"
            )))
        }
    }
    Ok(())
}

/// One chunk for [`decode_pair`]: table entry, payload, destination, payload offset.
pub(crate) struct ChunkJob<'a, 'b> {
    pub entry: &'a ChunkEntry,
    pub payload: &'a [u8],
    pub out: &'b mut [u8],
    pub base: usize,
}

/// Decodes two chunks. Two rANS chunks of the same length run their symbol loops together,
/// so the vector decoder has two independent dependency chains to overlap; anything else
/// decodes one after the other. Errors are those of [`decode`], the first chunk's first.
pub(crate) fn decode_pair<E: Elem>(
    a: ChunkJob,
    b: ChunkJob,
    prob_bits: u32,
    verify: bool,
    scratch: &mut DecodeScratch,
) -> Result<()> {
    let n = a.out.len() / E::BYTES;
    let paired = a.entry.mode == ChunkMode::Rans
        && b.entry.mode == ChunkMode::Rans
        && b.out.len() == a.out.len()
        && simd::paired_available();
    if !paired {
        decode::<E>(
            a.entry, a.payload, prob_bits, a.out, a.base, verify, scratch,
        )?;
        return decode::<E>(
            b.entry, b.payload, prob_bits, b.out, b.base, verify, scratch,
        );
    }
    a.entry.check_len(E::DTYPE, n, a.base)?;
    b.entry.check_len(E::DTYPE, n, b.base)?;
    let [ta, tb] = &mut scratch.tables;
    let mut ra = open_rans::<E>(a.payload, prob_bits, n, a.base, ta)?;
    let mut rb = open_rans::<E>(b.payload, prob_bits, n, b.base, tb)?;
    let [sa, sb] = &mut scratch.syms;
    sa.resize(n, 0);
    sb.resize(n, 0);
    let done = simd::decode_pair_groups(
        [&mut sa[..], &mut sb[..]],
        [ta, tb],
        prob_bits,
        [ra.words, rb.words],
        [&mut ra.pos, &mut rb.pos],
        [&mut ra.x, &mut rb.x],
    );
    run_symbols(prob_bits, &mut sa[done..], ta, &mut ra)?;
    run_symbols(prob_bits, &mut sb[done..], tb, &mut rb)?;
    for (r, job, syms) in [(&ra, a, &sa), (&rb, b, &sb)] {
        r.close(job.base)?;
        merge::<E>(job.out, r.mant, syms);
        if verify && checksum(job.out) != job.entry.check {
            return Err(CompressError::corrupt(
                job.base,
                "decoded chunk fails its checksum",
            ));
        }
    }
    Ok(())
}

/// The rANS decode loop: symbol `i` from lane `i % 8`, refills taken from the end of `words`;
/// vectorized where the CPU allows.
fn decode_symbols<const PB: u32>(
    syms: &mut [u16],
    table: &DecTable,
    words: &[u8],
    pos_io: &mut usize,
    x_io: &mut [u32; LANES],
) {
    decode_symbols_with::<PB>(syms, table, words, pos_io, x_io, true)
}

fn decode_symbols_with<const PB: u32>(
    syms: &mut [u16],
    table: &DecTable,
    words: &[u8],
    pos_io: &mut usize,
    x_io: &mut [u32; LANES],
    allow_simd: bool,
) {
    let n_words = words.len() / 2;
    #[cfg(target_arch = "x86_64")]
    let syms = if allow_simd && simd::avx2::available() {
        // SAFETY: the CPU has AVX2.
        let done =
            unsafe { simd::avx2::decode_groups([syms], [table], PB, [words], [pos_io], [x_io]) };
        &mut syms[done..]
    } else {
        syms
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = allow_simd;
    // Locals, so the eight states and the read position stay in registers.
    let mut x = *x_io;
    let mut pos = *pos_io;
    let mut groups = syms.chunks_exact_mut(LANES);
    for grp in &mut groups {
        if (LANES..=n_words).contains(&pos) {
            for k in 0..LANES {
                let v = x[k];
                let (e, sym) = table.lookup((v & ((1 << PB) - 1)) as usize);
                grp[k] = sym;
                let v = (e & 0xffff) * (v >> PB) + (e >> 16);
                let refill = v < RANS_L;
                // SAFETY: `LANES <= pos <= n_words` at the start of the group and a lane
                // lowers `pos` by at most one, so `pos - 1` stays in `0..n_words` for all eight
                // lanes and the two bytes at `2 * (pos - 1)` lie inside `words`.
                let word = unsafe { words.as_ptr().add(2 * (pos - 1)).cast::<[u8; 2]>().read() };
                let word = u16::from_le_bytes(word) as u32;
                x[k] = if refill { (v << 16) | word } else { v };
                pos -= refill as usize;
            }
        } else {
            // Near the start of the stream, or after a corrupt one ran past it.
            for (k, s) in grp.iter_mut().enumerate() {
                *s = rans::get(&mut x[k], table, PB, words, &mut pos);
            }
        }
    }
    for (k, s) in groups.into_remainder().iter_mut().enumerate() {
        *s = rans::get(&mut x[k], table, PB, words, &mut pos);
    }
    *x_io = x;
    *pos_io = pos;
}

/// Writes element `i` as `syms[i] << mantissa bits | mantissa i`, in element order.
pub(crate) fn merge<E: Elem>(out: &mut [u8], mant: &[u8], syms: &[u16]) {
    let w = E::MANT_BITS as usize;
    let full = syms.len() / LANES;
    let mut groups = out.chunks_exact_mut(LANES * E::BYTES);
    for ((grp, s), m) in (&mut groups)
        .zip(syms.chunks_exact(LANES))
        .zip(mant.chunks_exact(w))
    {
        merge_group::<E>(grp, s, m);
    }
    let rest = groups.into_remainder();
    if !rest.is_empty() {
        let t = rest.len() / E::BYTES;
        let m = unpack_tail::<E>(&mant[full * w..], t);
        for ((e, &s), m) in rest
            .chunks_exact_mut(E::BYTES)
            .zip(&syms[full * 8..])
            .zip(m)
        {
            E::store(((s as u32) << E::MANT_BITS) | m, e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::SplitMix64;

    /// Decodes with the reference one-symbol-at-a-time decoder.
    fn reference(
        words: &[u8],
        t: &DecTable,
        n: usize,
        mut x: [u32; 8],
    ) -> (Vec<u16>, usize, [u32; 8]) {
        let mut pos = words.len() / 2;
        let syms = (0..n)
            .map(|i| rans::get(&mut x[i % LANES], t, 12, words, &mut pos))
            .collect();
        (syms, pos, x)
    }

    #[test]
    fn group_decoders_match_the_reference_on_valid_and_corrupt_streams() {
        let mut rng = SplitMix64::new(5);
        let counts: Vec<u32> = (0..512u32)
            .map(|s| if s % 3 == 0 { 1 + (s * 7919) % 300 } else { 0 })
            .collect();
        let freq = rans::normalize(&counts, 12);
        let enc = rans::enc_table(&freq, 12);
        let mut t = rans::new_dec_table();
        rans::fill_dec_table(&mut t, &freq);
        let present: Vec<u16> = (0..512)
            .filter(|&s| freq[s] > 0)
            .map(|s| s as u16)
            .collect();
        let n = 1003;
        let syms: Vec<u16> = (0..n)
            .map(|_| present[(rng.next_u64() % present.len() as u64) as usize])
            .collect();
        let mut words = vec![0u16; n];
        let (pos, states) = encode_symbols(&syms, &enc, &mut words);
        let valid: Vec<u8> = words[..pos].iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut corrupt = valid.clone();
        for b in corrupt.iter_mut().skip(3).step_by(17) {
            *b ^= 0x5a;
        }
        let short = valid[..valid.len() / 2].to_vec();
        for (name, words) in [("valid", &valid), ("corrupt", &corrupt), ("short", &short)] {
            let want = reference(words, &t, n, states);
            if name == "valid" {
                assert_eq!((&want.0, want.1, want.2), (&syms, 0, [RANS_L; 8]));
            }
            for allow_simd in [false, true] {
                let mut got = vec![0u16; n];
                let (mut p, mut x) = (words.len() / 2, states);
                decode_symbols_with::<12>(&mut got, &t, words, &mut p, &mut x, allow_simd);
                assert_eq!(
                    (got, p, x),
                    want.clone(),
                    "{name} stream, simd allowed: {allow_simd}"
                );
            }
        }
    }
}
