//! One chunk: choose its mode, encode it, and decode it with every length and table checked.

use super::rans::{self, DecTable, EncTable, RANS_L};
use super::split::{mantissa_len, pack8, pack_tail, unpack8, unpack_tail, Elem};
use crate::error::{CompressError, Result};
use crate::format::{checksum, ChunkEntry, ChunkMode, LANES};

/// Bytes of the final rANS states at the end of a `Rans` chunk.
const STATES_LEN: usize = 4 * LANES;

/// Reusable per-thread buffers, so steady-state encoding allocates nothing per chunk.
#[derive(Default)]
pub(crate) struct Scratch {
    words: Vec<u8>,
}

/// Reusable per-thread decoding table.
pub(crate) struct DecodeScratch {
    table: Box<DecTable>,
}

impl DecodeScratch {
    pub(crate) fn new() -> Self {
        DecodeScratch {
            table: rans::new_dec_table(),
        }
    }
}

/// Symbol counts of `src` (at most 512 symbols; the unused tail stays zero).
pub(crate) fn histogram<E: Elem>(src: &[u8]) -> [u32; 512] {
    // Four tables so consecutive equal symbols do not serialize on one counter.
    let mut h = [[0u32; 512]; 4];
    let mut quads = src.chunks_exact(4 * E::BYTES);
    for q in &mut quads {
        for (k, t) in h.iter_mut().enumerate() {
            t[E::symbol(E::load(&q[k * E::BYTES..]))] += 1;
        }
    }
    for e in quads.remainder().chunks_exact(E::BYTES) {
        h[0][E::symbol(E::load(e))] += 1;
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
    let counts = histogram::<E>(src);
    let counts = &counts[..E::ALPHABET];
    let present = counts.iter().filter(|&&c| c > 0).count();
    let mlen = mantissa_len(n, E::MANT_BITS);

    if present == 1 {
        let first = &src[..E::BYTES];
        if src.chunks_exact(E::BYTES).all(|e| e == first) {
            out.extend_from_slice(first);
            return entry(ChunkMode::Constant, out);
        }
        let sym = E::symbol(E::load(first)) as u16;
        out.extend_from_slice(&sym.to_le_bytes());
        write_mantissas::<E>(src, out, mlen);
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
    let words_len = encode_symbols::<E>(src, &enc, &mut out[mant_at..], scratch);
    out.extend_from_slice(&scratch.words[..words_len]);
    let states_at = out.len();
    out.resize(states_at + STATES_LEN, 0);
    for (k, x) in scratch_states(&scratch.words, words_len).iter().enumerate() {
        out[states_at + 4 * k..states_at + 4 * k + 4].copy_from_slice(&x.to_le_bytes());
    }
    if out.len() - start >= src.len() {
        return raw(out);
    }
    entry(ChunkMode::Rans, out)
}

/// The final states parked by [`encode_symbols`] after its words in the scratch buffer.
fn scratch_states(words: &[u8], words_len: usize) -> [u32; LANES] {
    std::array::from_fn(|k| {
        let at = words_len + 4 * k;
        u32::from_le_bytes(words[at..at + 4].try_into().expect("4 bytes"))
    })
}

fn write_mantissas<E: Elem>(src: &[u8], out: &mut Vec<u8>, mlen: usize) {
    let at = out.len();
    out.resize(at + mlen, 0);
    let mant = &mut out[at..];
    let w = E::MANT_BITS as usize;
    let mut groups = src.chunks_exact(8 * E::BYTES);
    for (g, grp) in (&mut groups).enumerate() {
        let m: [u32; 8] = std::array::from_fn(|k| E::load(&grp[k * E::BYTES..]) & E::MANT_MASK);
        pack8::<E>(&m, &mut mant[g * w..]);
    }
    let rest = groups.remainder();
    if !rest.is_empty() {
        let m: Vec<u32> = rest
            .chunks_exact(E::BYTES)
            .map(|e| E::load(e) & E::MANT_MASK)
            .collect();
        let full = src.len() / (8 * E::BYTES);
        pack_tail::<E>(&m, &mut mant[full * w..]);
    }
}

/// Packs the mantissas into `mant` and rANS-codes the symbols, last element first, element `i`
/// on lane `i % 8`. Leaves the words in `scratch.words[..returned]` followed by the final states.
fn encode_symbols<E: Elem>(
    src: &[u8],
    enc: &EncTable,
    mant: &mut [u8],
    scratch: &mut Scratch,
) -> usize {
    let n = src.len() / E::BYTES;
    let need = 2 * n + STATES_LEN + 64;
    if scratch.words.len() < need {
        scratch.words.resize(need, 0);
    }
    let words = &mut scratch.words[..];
    let w = E::MANT_BITS as usize;
    let full = n / 8;
    let tail = n % 8;
    let mut x = [RANS_L; LANES];
    let mut pos = 0usize;
    if tail > 0 {
        let base = full * 8;
        let mut m = [0u32; 8];
        for k in (0..tail).rev() {
            let v = E::load(&src[(base + k) * E::BYTES..]);
            m[k] = v & E::MANT_MASK;
            rans::put(&mut x[k], &enc[E::symbol(v) & 511], words, &mut pos);
        }
        pack_tail::<E>(&m[..tail], &mut mant[full * w..]);
    }
    let groups = src[..full * 8 * E::BYTES].chunks_exact(8 * E::BYTES);
    let mants = mant[..full * w].chunks_exact_mut(w.max(1));
    for (grp, mo) in groups.rev().zip(mants.rev()) {
        let v: [u32; 8] = std::array::from_fn(|k| E::load(&grp[k * E::BYTES..]));
        let m = v.map(|v| v & E::MANT_MASK);
        pack8::<E>(&m, mo);
        // At most eight words per group: collect them in a fixed window, store it whole and
        // advance by the count (the buffer has slack for the unused tail).
        let mut win = [0u8; 16];
        let mut emitted = 0usize;
        for k in (0..8).rev() {
            let e = &enc[E::symbol(v[k]) & 511];
            let mut s = x[k];
            let emit = s >= e.x_max;
            let i = emitted & 7;
            win[2 * i..2 * i + 2].copy_from_slice(&(s as u16).to_le_bytes());
            emitted += emit as usize;
            s = if emit { s >> 16 } else { s };
            let q = (((s as u64 * e.rcp as u64) >> 32) as u32) >> e.shift;
            x[k] = s + e.bias + q * e.cmpl as u32;
        }
        words[2 * pos..2 * pos + 16].copy_from_slice(&win);
        pos += emitted;
    }
    let words_len = 2 * pos;
    for (k, s) in x.iter().enumerate() {
        words[words_len + 4 * k..words_len + 4 * k + 4].copy_from_slice(&s.to_le_bytes());
    }
    words_len
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
    let mlen = mantissa_len(n, E::MANT_BITS);
    let expect_len = |want: usize| {
        if payload.len() == want {
            Ok(())
        } else {
            Err(CompressError::corrupt(
                base,
                format!(
                    "{} chunk of {n} elements is {} bytes, expected {want}",
                    entry.mode.name(),
                    payload.len()
                ),
            ))
        }
    };
    match entry.mode {
        ChunkMode::Raw => {
            expect_len(out.len())?;
            out.copy_from_slice(payload);
        }
        ChunkMode::Constant => {
            expect_len(E::BYTES)?;
            for e in out.chunks_exact_mut(E::BYTES) {
                e.copy_from_slice(payload);
            }
        }
        ChunkMode::SingleSymbol => {
            expect_len(2 + mlen)?;
            let sym = u16::from_le_bytes([payload[0], payload[1]]) as usize;
            if sym >= E::ALPHABET {
                return Err(CompressError::corrupt(
                    base,
                    format!("symbol {sym} outside the alphabet"),
                ));
            }
            let mant = &payload[2..];
            merge::<E>(out, mant, |_| sym as u16);
        }
        ChunkMode::Rans => {
            let alphabet = E::ALPHABET;
            let (freq, tlen) = rans::read_table(payload, alphabet, prob_bits, base)?;
            let words_start = tlen + mlen;
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
            let mant = &payload[tlen..words_start];
            let words = &payload[words_start..words_end];
            let mut x: [u32; LANES] = std::array::from_fn(|k| {
                let at = words_end + 4 * k;
                u32::from_le_bytes(payload[at..at + 4].try_into().expect("4 bytes"))
            });
            if x.iter().any(|&s| !(RANS_L..1 << 31).contains(&s)) {
                return Err(CompressError::corrupt(
                    base + words_end,
                    "rans state out of range",
                ));
            }
            rans::fill_dec_table(&mut scratch.table, &freq);
            let mut pos = words.len() / 2;
            let t = &scratch.table;
            // The resolution as a constant, so masks and shifts are immediates.
            match prob_bits {
                9 => decode_symbols::<E, 9>(out, mant, t, words, &mut pos, &mut x),
                10 => decode_symbols::<E, 10>(out, mant, t, words, &mut pos, &mut x),
                11 => decode_symbols::<E, 11>(out, mant, t, words, &mut pos, &mut x),
                12 => decode_symbols::<E, 12>(out, mant, t, words, &mut pos, &mut x),
                13 => decode_symbols::<E, 13>(out, mant, t, words, &mut pos, &mut x),
                14 => decode_symbols::<E, 14>(out, mant, t, words, &mut pos, &mut x),
                _ => {
                    return Err(CompressError::UnsupportedFormat(format!(
                        "probability resolution of {prob_bits} bits"
                    )))
                }
            }
            if pos != 0 || x.iter().any(|&s| s != RANS_L) {
                return Err(CompressError::corrupt(
                    base + words_start,
                    "rans stream does not end where it should",
                ));
            }
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

/// The rANS decode loop: lane `k` of each group of eight, mantissas merged as they come.
fn decode_symbols<E: Elem, const PB: u32>(
    out: &mut [u8],
    mant: &[u8],
    table: &DecTable,
    words: &[u8],
    pos_io: &mut usize,
    x_io: &mut [u32; LANES],
) {
    let w = E::MANT_BITS as usize;
    let n = out.len() / E::BYTES;
    let full = n / 8;
    // Locals, so the eight states and the read position stay in registers.
    let mut x = *x_io;
    let mut pos = *pos_io;
    let mut groups = out.chunks_exact_mut(8 * E::BYTES);
    let mants = mant[..full * w].chunks_exact(w.max(1));
    for (grp, mi) in (&mut groups).zip(mants) {
        let m = unpack8::<E>(mi);
        let mut vals = [0u32; 8];
        // A group refills at most eight words: take them as one bounds-checked window (word
        // `pos - 1` last) and index it with a count the compiler sees is below 8. Near the
        // start of the stream, or once a corrupt stream ran past it, words are read one by one.
        let window = pos
            .checked_sub(8)
            .and_then(|p| p.checked_mul(2))
            .and_then(|at| words.get(at..at + 16));
        if let Some(win) = window {
            let win: &[u8; 16] = win.try_into().expect("a 16-byte range");
            let mut used = 0usize;
            for k in 0..8 {
                let v = x[k];
                let d = table[(v & ((1 << PB) - 1)) as usize & (rans::MAX_SLOTS - 1)];
                let v = (d.freq as u32) * (v >> PB) + d.bias as u32;
                let refill = v < RANS_L;
                let i = 7usize.wrapping_sub(used) & 7;
                let word = u16::from_le_bytes([win[2 * i], win[2 * i + 1]]) as u32;
                x[k] = if refill { (v << 16) | word } else { v };
                used += refill as usize;
                vals[k] = ((d.sym as u32) << E::MANT_BITS) | m[k];
            }
            pos -= used;
        } else {
            for k in 0..8 {
                let s = rans::get(&mut x[k], table, PB, words, &mut pos) as u32;
                vals[k] = (s << E::MANT_BITS) | m[k];
            }
        }
        let mut bytes = [0u8; 32];
        for (k, v) in vals.iter().enumerate() {
            E::store(*v, &mut bytes[k * E::BYTES..]);
        }
        grp.copy_from_slice(&bytes[..8 * E::BYTES]);
    }
    let rest = groups.into_remainder();
    if !rest.is_empty() {
        let t = rest.len() / E::BYTES;
        let m = unpack_tail::<E>(&mant[full * w..], t);
        for (k, e) in rest.chunks_exact_mut(E::BYTES).enumerate() {
            let s = rans::get(&mut x[k], table, PB, words, &mut pos) as u32;
            E::store((s << E::MANT_BITS) | m[k], e);
        }
    }
    *x_io = x;
    *pos_io = pos;
}

/// Writes element `i` as `(next_symbol(i) << mantissa bits) | mantissa i`, in element order.
#[inline(always)]
fn merge<E: Elem>(out: &mut [u8], mant: &[u8], mut next_symbol: impl FnMut(usize) -> u16) {
    let n = out.len() / E::BYTES;
    let w = E::MANT_BITS as usize;
    let full = n / 8;
    let mut groups = out.chunks_exact_mut(8 * E::BYTES);
    for (g, grp) in (&mut groups).enumerate() {
        let m = unpack8::<E>(&mant[g * w..g * w + w]);
        for k in 0..8 {
            let s = next_symbol(g * 8 + k) as u32;
            E::store((s << E::MANT_BITS) | m[k], &mut grp[k * E::BYTES..]);
        }
    }
    let rest = groups.into_remainder();
    if !rest.is_empty() {
        let t = rest.len() / E::BYTES;
        let m = unpack_tail::<E>(&mant[full * w..], t);
        for (k, e) in rest.chunks_exact_mut(E::BYTES).enumerate() {
            let s = next_symbol(full * 8 + k) as u32;
            E::store((s << E::MANT_BITS) | m[k], e);
        }
    }
}
