//! Format version 2 (`FORMAT.md`, "Version 2"): one frequency table per tensor, blocks of
//! `block_elems` elements each coded by 32 interleaved rANS states (one warp of a GPU, four
//! AVX2 vectors of a CPU core), an index of block lengths, one checksum of the whole tensor.
//!
//! Everything that decides bytes — the histogram, the integer frequency normalisation, the
//! block coder and the raw fallback — is written once here and once in the CUDA source
//! (`kernels.cu`), and the two are compared byte for byte by the host-compiled check.

mod counts;

#[cfg(test)]
use counts::histogram;
pub(crate) use counts::{sign_ranges_scalar, SignRanges, Tally};
pub use counts::{SAMPLE_FROM, SAMPLE_PERIOD, SAMPLE_RUN};

use super::rans::{self, DecTable, EncTable, RANS_L};
use super::simd;
use super::split::{mantissa_len, pack_mantissas, symbols_of, Elem};
use crate::error::{CompressError, Result};
use crate::format::{
    check_mantissa_padding, checksum_finish, checksum_terms, ChunkEntry, ChunkMode, CodecDType,
    Header, Prefix, MAGIC, PROB_BITS_RANGE,
};

/// The version number v2 encodings carry.
pub const VERSION: u16 = 2;
/// Bytes of the v2 header.
pub const HEADER_LEN: usize = 48;
/// Interleaved rANS states per block: one warp.
pub const LANES: usize = 32;
/// Bytes of a block's final states.
pub const STATES_LEN: usize = 4 * LANES;
/// Block sizes are multiples of this (one element per lane; keeps blocks 8-byte aligned for
/// the checksum's words).
pub const BLOCK_ALIGN: usize = LANES;
/// The largest block (keeps every block length within `u32`).
pub const MAX_BLOCK_ELEMS: usize = 1 << 24;
/// Default elements per block: the 132 bytes of final states and index entry per block stay
/// near 0.5% of the coded symbols of real activations (about 3.5 bits per element), inside the
/// 1% budget with the table and the quantisation loss. (A GPU codes a block with one warp, so
/// smaller blocks would give it more parallelism on tensors under a few hundred MiB: on an H200,
/// 2^14 coded a 64 MiB bf16 tensor 2.4x faster, but f32 Gaussian data came out 1.6% over the
/// symbol entropy, past this budget; BENCHMARKS.md.)
pub const DEFAULT_BLOCK_ELEMS: usize = 1 << 16;
/// The encoder refuses tensors of `2^48` elements or more, so the integer normalisation's
/// products (`count * 2^14`, `count * (2 freq + 1)`) stay inside `u64`.
pub const MAX_NUMEL: usize = 1 << 48;
/// Output bytes a valid v2 encoding can declare per byte of its own length, rounded up: the
/// densest block is a single-symbol bf16 block (7 mantissa bits of 16 stored, plus states).
pub const MAX_EXPANSION: usize = 3;

/// Bytes of the presence bitmap that starts the frequency table: one bit per symbol of the
/// alphabet of `dtype` (64 bytes for f32 and bf16, 8 for f16).
pub const fn bitmap_len(dtype: CodecDType) -> usize {
    (1 << dtype.symbol_bits()) / 8
}

/// Symbols marked present in a table's bitmap.
pub fn present_in(bitmap: &[u8]) -> usize {
    bitmap.iter().map(|b| b.count_ones() as usize).sum()
}

/// Bytes of header, table (bitmap and `present` frequencies) and index of `blocks` blocks.
pub fn prefix_len(dtype: CodecDType, present: usize, blocks: usize) -> Option<usize> {
    blocks
        .checked_mul(4)?
        .checked_add(HEADER_LEN + bitmap_len(dtype) + 2 * present)
}

/// The v2 header fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header2 {
    pub dtype: CodecDType,
    pub prob_bits: u32,
    pub block_elems: usize,
    pub numel: usize,
    pub payload_len: usize,
    pub data_check: u64,
}

impl Header2 {
    pub fn blocks(&self) -> usize {
        self.numel.div_ceil(self.block_elems)
    }
    fn block_numel(&self, i: usize) -> usize {
        self.block_elems.min(self.numel - i * self.block_elems)
    }
    fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.dtype.code();
        out[7] = LANES as u8;
        out[8] = self.prob_bits as u8;
        out[9..12].fill(0);
        out[12..16].copy_from_slice(&(self.block_elems as u32).to_le_bytes());
        out[16..24].copy_from_slice(&(self.numel as u64).to_le_bytes());
        out[24..32].copy_from_slice(&(self.payload_len as u64).to_le_bytes());
        out[32..40].copy_from_slice(&self.data_check.to_le_bytes());
        out[40..48].fill(0);
    }
    fn parse(b: &[u8]) -> Result<Header2> {
        if b.len() < HEADER_LEN {
            return Err(CompressError::corrupt(
                b.len(),
                format!(
                    "{} bytes is shorter than the {HEADER_LEN}-byte v2 header",
                    b.len()
                ),
            ));
        }
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let dtype = CodecDType::from_code(b[6])
            .ok_or_else(|| CompressError::corrupt(6, format!("unknown dtype code {}", b[6])))?;
        if b[7] as usize != LANES {
            return Err(CompressError::UnsupportedFormat(format!(
                "{} interleaved states per block (version 2 has {LANES})",
                b[7]
            )));
        }
        let prob_bits = b[8] as u32;
        if !PROB_BITS_RANGE.contains(&prob_bits) {
            return Err(CompressError::corrupt(
                8,
                format!("probability resolution {prob_bits} outside {PROB_BITS_RANGE:?}"),
            ));
        }
        if b[9..12] != [0; 3] {
            return Err(CompressError::corrupt(9, "non-zero reserved header bytes"));
        }
        let block_elems = u32_at(12) as usize;
        if block_elems == 0 || block_elems % BLOCK_ALIGN != 0 || block_elems > MAX_BLOCK_ELEMS {
            return Err(CompressError::corrupt(
                12,
                format!("block size {block_elems} is not a positive multiple of {BLOCK_ALIGN} up to {MAX_BLOCK_ELEMS}"),
            ));
        }
        let numel = usize::try_from(u64_at(16))
            .ok()
            .filter(|n| n.checked_mul(dtype.size()).is_some())
            .ok_or_else(|| CompressError::corrupt(16, "element count overflows"))?;
        let payload_len = usize::try_from(u64_at(24))
            .map_err(|_| CompressError::corrupt(24, "payload length overflows"))?;
        Ok(Header2 {
            dtype,
            prob_bits,
            block_elems,
            numel,
            payload_len,
            data_check: u64_at(32),
        })
    }
}

/// `checksum` of the prefix (header, table, index) with the `prefix_check` field zeroed.
fn prefix_check(prefix: &[u8]) -> u64 {
    let mut head = [0u8; HEADER_LEN];
    head.copy_from_slice(&prefix[..HEADER_LEN]);
    head[40..48].fill(0);
    let sum = checksum_terms(&head, 0).wrapping_add(checksum_terms(
        &prefix[HEADER_LEN..],
        (HEADER_LEN / 8) as u64,
    ));
    checksum_finish(sum, prefix.len())
}

/// Stores the prefix checksum into a fully written v2 prefix (header, table and index; also
/// for tools that edit them, such as the decoder's mutation fuzzer).
pub fn seal(prefix: &mut [u8]) {
    let c = prefix_check(prefix);
    prefix[40..48].copy_from_slice(&c.to_le_bytes());
}

/// The largest v2 encoding of `numel` elements: header, a table of every symbol that can
/// occur, index and every block raw.
pub fn max_encoded_len(dtype: CodecDType, numel: usize, block_elems: usize) -> usize {
    let present = numel.min(1 << dtype.symbol_bits());
    HEADER_LEN
        + bitmap_len(dtype)
        + 2 * present
        + 4 * numel.div_ceil(block_elems.max(1))
        + numel * dtype.size()
}

/// Quantises symbol counts to frequencies summing to `2^prob_bits`, in integer arithmetic
/// only (FORMAT.md, "Frequency normalisation"): every present symbol gets
/// `max(1, round(count * M / n))`, then single units move, one at a time, to or from the
/// symbol where they gain the most or cost the least coded bits, approximated by
/// `count / (2 freq + 1)` and `count / (2 freq - 1)` and compared by cross-multiplication;
/// ties go to the lowest symbol. A lone symbol gets all of `M`.
pub fn normalize(counts: &[u64], prob_bits: u32) -> Vec<u32> {
    let m = 1u64 << prob_bits;
    let n: u64 = counts.iter().sum();
    let mut f = vec![0u32; counts.len()];
    if n == 0 {
        return f;
    }
    let present = counts.iter().filter(|&&c| c > 0).count();
    if present == 1 {
        let s = counts.iter().position(|&c| c > 0).expect("one present");
        f[s] = m as u32;
        return f;
    }
    let mut sum = 0u64;
    for (fs, &c) in f.iter_mut().zip(counts) {
        if c > 0 {
            *fs = ((c * m + n / 2) / n).max(1) as u32;
            sum += *fs as u64;
        }
    }
    while sum > m {
        // Take a unit where it costs least: smallest count / (2 f - 1) among f > 1.
        let mut best = usize::MAX;
        for s in 0..f.len() {
            if f[s] > 1
                && (best == usize::MAX
                    || counts[s] * (2 * f[best] as u64 - 1) < counts[best] * (2 * f[s] as u64 - 1))
            {
                best = s;
            }
        }
        f[best] -= 1;
        sum -= 1;
    }
    while sum < m {
        // Give a unit where it gains most: largest count / (2 f + 1) among present symbols.
        let mut best = usize::MAX;
        for s in 0..f.len() {
            if counts[s] > 0
                && (best == usize::MAX
                    || counts[s] * (2 * f[best] as u64 + 1) > counts[best] * (2 * f[s] as u64 + 1))
            {
                best = s;
            }
        }
        f[best] += 1;
        sum += 1;
    }
    f
}

/// Per-thread buffers of the block coder.
#[derive(Default)]
struct EncScratch {
    syms: Vec<u16>,
    words: Vec<u16>,
}

/// Appends block `src` (whole elements) to `out`: `mantissas | words | states`, or the raw
/// bytes when that would not be shorter. Returns the block's length.
fn encode_block<E: Elem>(
    src: &[u8],
    enc: &EncTable,
    out: &mut Vec<u8>,
    s: &mut EncScratch,
) -> usize {
    let n = src.len() / E::BYTES;
    let start = out.len();
    let mlen = mantissa_len(n, E::MANT_BITS);
    s.syms.resize(n, 0);
    // One word per symbol at most, plus the SIMD coder's eight words of slack.
    s.words.resize(n + 8, 0);
    symbols_of::<E>(src, &mut s.syms);
    let (nwords, states) = encode_symbols(&s.syms, enc, &mut s.words);
    let len = mlen + 2 * nwords + STATES_LEN;
    if len >= src.len() {
        out.extend_from_slice(src);
        return src.len();
    }
    out.resize(start + len, 0);
    // The vector packer may spill past the mantissas into the words, written below.
    let packed = simd::pack_mantissas16::<E>(src, &mut out[start..]);
    let (mant, rest) = out[start..].split_at_mut(mlen);
    pack_mantissas::<E>(
        &src[packed * E::BYTES..],
        &mut mant[packed / 8 * E::MANT_BITS as usize..],
    );
    let (wb, sb) = rest.split_at_mut(2 * nwords);
    for (o, w) in wb.chunks_exact_mut(2).zip(&s.words[..nwords]) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    for (o, x) in sb.chunks_exact_mut(4).zip(states) {
        o.copy_from_slice(&x.to_le_bytes());
    }
    len
}

/// rANS-codes `syms`, last first, symbol `i` on lane `i % 32`; returns the word count and the
/// final states. `words` has room for one word per symbol (a symbol emits at most one) and
/// eight more.
fn encode_symbols(syms: &[u16], enc: &EncTable, words: &mut [u16]) -> (usize, [u32; LANES]) {
    let mut x = [RANS_L; LANES];
    let mut pos = 0usize;
    let full = syms.len() / LANES * LANES;
    rans::put_lanes(&syms[full..], enc, words, &mut pos, &mut x);
    if !simd::encode_groups32(&syms[..full], enc, words, &mut pos, &mut x) {
        rans::put_lanes(&syms[..full], enc, words, &mut pos, &mut x);
    }
    (pos, x)
}

/// Encodes `data` as version 2 into `out` (replacing its contents).
pub(crate) fn encode_into(
    dtype: CodecDType,
    data: &[u8],
    prob_bits: u32,
    block_elems: usize,
    threads: usize,
    out: &mut Vec<u8>,
) -> Result<()> {
    let numel = data.len() / dtype.size();
    if numel >= MAX_NUMEL {
        return Err(CompressError::InvalidArgument(format!(
            "{numel} elements: version 2 encodes fewer than 2^48"
        )));
    }
    with_elem2!(dtype, E => encode_elems::<E>(data, prob_bits, block_elems, threads, out));
    Ok(())
}

fn encode_elems<E: Elem>(
    data: &[u8],
    prob_bits: u32,
    block_elems: usize,
    threads: usize,
    out: &mut Vec<u8>,
) {
    let numel = data.len() / E::BYTES;
    let block_bytes = block_elems * E::BYTES;
    let n_blocks = numel.div_ceil(block_elems);
    let threads = threads.clamp(1, n_blocks.max(1));
    let per = n_blocks.div_ceil(threads).max(1) * block_bytes;
    // Pass 1: the tensor's symbol counts (of a sample, with the sign ranges, from
    // SAMPLE_FROM elements on) and checksum terms, one partial per thread.
    let sampled = numel >= SAMPLE_FROM;
    let partials: Vec<(Tally, u64)> = par_map(data.chunks(per), threads, |t, range| {
        // Pieces of 256 KiB, so the checksum reads what the histogram left in the cache.
        const PIECE: usize = 1 << 18;
        let (mut tally, mut terms) = (Tally::new(), 0u64);
        for (k, piece) in range.chunks(PIECE).enumerate() {
            let at = t * per + k * PIECE;
            tally.add::<E>(piece, at / E::BYTES, sampled);
            terms = terms.wrapping_add(simd::checksum_terms(piece, (at / 8) as u64));
        }
        (tally, terms)
    });
    let mut tally = Tally::new();
    let mut terms = 0u64;
    for (p, c) in &partials {
        tally.merge(p);
        terms = terms.wrapping_add(*c);
    }
    let counts = tally.table_counts::<E>(sampled);
    let freq = normalize(&counts[..E::ALPHABET], prob_bits);
    let enc = rans::enc_table(&freq, prob_bits);
    let present = freq.iter().filter(|&&f| f > 0).count();
    let prefix_len = prefix_len(E::DTYPE, present, n_blocks).expect("fits: the input is in memory");
    out.clear();
    let fresh = out.capacity() < prefix_len + data.len();
    out.reserve(prefix_len + data.len());
    if fresh {
        super::advise_huge_pages(out.as_ptr(), out.capacity());
    }
    out.resize(prefix_len, 0);
    // Pass 2: blocks. The first run of blocks is appended to `out` on this thread, the others
    // into buffers of their own threads, appended after it.
    let encode_run = |range: &[u8], buf: &mut Vec<u8>| -> Vec<u32> {
        let mut s = EncScratch::default();
        range
            .chunks(block_bytes)
            .map(|b| encode_block::<E>(b, &enc, buf, &mut s) as u32)
            .collect()
    };
    let mut runs = data.chunks(per);
    let first = runs.next().unwrap_or_default();
    // Each other thread's run: its payload bytes and block lengths.
    type Run = (Vec<u8>, Vec<u32>);
    let (lens0, parts): (Vec<u32>, Vec<Run>) = std::thread::scope(|sc| {
        let encode_run = &encode_run;
        let handles: Vec<_> = runs
            .map(|range| {
                sc.spawn(move || {
                    let mut buf = Vec::with_capacity(range.len());
                    let lens = encode_run(range, &mut buf);
                    (buf, lens)
                })
            })
            .collect();
        let lens0 = encode_run(first, out);
        let parts = handles
            .into_iter()
            .map(|h| h.join().expect("codec worker panicked"))
            .collect();
        (lens0, parts)
    });
    let header = Header2 {
        dtype: E::DTYPE,
        prob_bits,
        block_elems,
        numel,
        payload_len: out.len() - prefix_len + parts.iter().map(|p| p.0.len()).sum::<usize>(),
        data_check: checksum_finish(terms, data.len()),
    };
    header.write(&mut out[..HEADER_LEN]);
    let (bitmap, rest) = out[HEADER_LEN..].split_at_mut(bitmap_len(E::DTYPE));
    for (o, f) in rest
        .chunks_exact_mut(2)
        .zip(freq.iter().filter(|&&f| f > 0))
    {
        o.copy_from_slice(&(*f as u16).to_le_bytes());
    }
    for (s, _) in freq.iter().enumerate().filter(|(_, &f)| f > 0) {
        bitmap[s / 8] |= 1 << (s % 8);
    }
    let mut at = HEADER_LEN + bitmap_len(E::DTYPE) + 2 * present;
    for l in lens0.iter().chain(parts.iter().flat_map(|p| &p.1)) {
        out[at..at + 4].copy_from_slice(&l.to_le_bytes());
        at += 4;
    }
    seal(&mut out[..prefix_len]);
    for (buf, _) in &parts {
        out.extend_from_slice(buf);
    }
}

/// Runs `f(index, item)` on up to `threads` scoped threads (inline for one), in order.
fn par_map<'a, I, T, F>(items: I, threads: usize, f: F) -> Vec<T>
where
    I: Iterator<Item = &'a [u8]>,
    T: Send,
    F: Fn(usize, &'a [u8]) -> T + Sync,
{
    if threads <= 1 {
        return items.enumerate().map(|(i, r)| f(i, r)).collect();
    }
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = items
            .enumerate()
            .map(|(i, r)| s.spawn(move || f(i, r)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("codec worker panicked"))
            .collect()
    })
}

/// A parsed and checked v2 prefix: header, frequencies, block lengths and offsets.
pub(crate) struct Prefix2 {
    pub header: Header2,
    pub freq: Vec<u32>,
    pub lens: Vec<usize>,
    pub offsets: Vec<usize>,
}

/// Parses and checks a v2 prefix: header, prefix checksum, table (frequencies summing to `M`,
/// or all zero for an empty tensor), and every block length against its block (raw: exactly
/// the raw bytes; coded: mantissas, an even number of word bytes and the states, shorter than
/// raw), the lengths adding up to the stored payload and the input's length. Allocations are
/// bounded by the index's length in the input.
pub(crate) fn parse(bytes: &[u8]) -> Result<Prefix2> {
    let h = Header2::parse(bytes)?;
    let table_at = HEADER_LEN + bitmap_len(h.dtype);
    if bytes.len() < table_at {
        return Err(CompressError::corrupt(
            bytes.len(),
            "truncated: the table's bitmap does not fit",
        ));
    }
    let present = present_in(&bytes[HEADER_LEN..table_at]);
    let prefix_len = prefix_len(h.dtype, present, h.blocks())
        .filter(|&p| p <= bytes.len())
        .ok_or_else(|| {
            CompressError::corrupt(
                bytes.len(),
                format!("truncated: the index of {} blocks does not fit", h.blocks()),
            )
        })?;
    let stored = u64::from_le_bytes(bytes[40..48].try_into().expect("8 bytes"));
    if prefix_check(&bytes[..prefix_len]) != stored {
        return Err(CompressError::corrupt(
            40,
            "header/table/index checksum mismatch",
        ));
    }
    if h.payload_len.checked_add(prefix_len) != Some(bytes.len()) {
        return Err(CompressError::corrupt(
            bytes.len(),
            "length does not match the stored payload length",
        ));
    }
    let bitmap = &bytes[HEADER_LEN..table_at];
    let mut stored = bytes[table_at..table_at + 2 * present]
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32);
    let freq: Vec<u32> = (0..1usize << h.dtype.symbol_bits())
        .map(|s| match bitmap[s / 8] >> (s % 8) & 1 {
            1 => stored
                .next()
                .expect("one stored frequency per present symbol"),
            _ => 0,
        })
        .collect();
    if freq.iter().filter(|&&f| f > 0).count() != present {
        return Err(CompressError::corrupt(
            table_at,
            "a present symbol has frequency 0",
        ));
    }
    let total: u32 = freq.iter().sum();
    let m = 1u32 << h.prob_bits;
    if (h.numel == 0 && total != 0) || (h.numel > 0 && total != m) {
        return Err(CompressError::corrupt(
            HEADER_LEN,
            format!("frequencies sum to {total}, not {m}"),
        ));
    }
    let (size, w) = (h.dtype.size(), h.dtype.mantissa_bits());
    let mut lens = Vec::with_capacity(h.blocks());
    let mut offsets = Vec::with_capacity(h.blocks());
    let mut off = prefix_len;
    let index_at = table_at + 2 * present;
    for (i, e) in bytes[index_at..prefix_len].chunks_exact(4).enumerate() {
        let at = index_at + 4 * i;
        let len = u32::from_le_bytes(e.try_into().expect("4 bytes")) as usize;
        let n = h.block_numel(i);
        let (raw, min) = (n * size, mantissa_len(n, w) + STATES_LEN);
        if len != raw && !(len >= min && len < raw && (len - min) % 2 == 0) {
            return Err(CompressError::corrupt(
                at,
                format!("block {i} of {n} elements has an impossible length {len}"),
            ));
        }
        offsets.push(off);
        lens.push(len);
        off += len;
        if off > bytes.len() {
            return Err(CompressError::corrupt(
                at,
                format!("block {i} runs past the end"),
            ));
        }
    }
    if off != bytes.len() {
        return Err(CompressError::corrupt(
            off,
            "block lengths do not add up to the payload",
        ));
    }
    Ok(Prefix2 {
        header: h,
        freq,
        lens,
        offsets,
    })
}

impl Prefix2 {
    /// The version-neutral view `codec::inspect` returns.
    pub(crate) fn summary(&self) -> Prefix {
        let h = &self.header;
        let raw = |i: usize| h.block_numel(i) * h.dtype.size();
        Prefix {
            header: Header {
                dtype: h.dtype,
                prob_bits: h.prob_bits,
                chunk_elems: h.block_elems,
                numel: h.numel,
                payload_len: h.payload_len,
            },
            version: VERSION,
            chunks: self
                .lens
                .iter()
                .enumerate()
                .map(|(i, &len)| ChunkEntry {
                    mode: if len == raw(i) {
                        ChunkMode::Raw
                    } else {
                        ChunkMode::Rans
                    },
                    len,
                    check: 0,
                })
                .collect(),
            offsets: self.offsets.clone(),
        }
    }
}

/// Per-thread decoding state.
struct DecScratch {
    table: DecTable,
    syms: Vec<u16>,
}

/// Decodes a parsed v2 encoding into `out` (exactly the declared output) on `threads`.
pub(crate) fn decode_into(
    bytes: &[u8],
    p: &Prefix2,
    out: &mut [u8],
    threads: usize,
    verify: bool,
) -> Result<()> {
    let h = p.header;
    let block_bytes = h.block_elems * h.dtype.size();
    let n_blocks = p.lens.len();
    let threads = threads.clamp(1, n_blocks.max(1));
    let per = n_blocks.div_ceil(threads).max(1);
    let run = |first: usize, range: &mut [u8]| -> Result<u64> {
        let mut s = DecScratch {
            table: rans::new_dec_table(),
            syms: Vec::new(),
        };
        rans::fill_dec_table(&mut s.table, &p.freq);
        let mut terms = 0u64;
        for (k, dst) in range.chunks_mut(block_bytes).enumerate() {
            let i = first + k;
            let payload = &bytes[p.offsets[i]..p.offsets[i] + p.lens[i]];
            with_elem2!(h.dtype, E => decode_block::<E>(payload, p.offsets[i], h.prob_bits, &p.freq, dst, &mut s))?;
            if verify {
                terms = terms.wrapping_add(simd::checksum_terms(dst, (i * block_bytes / 8) as u64));
            }
        }
        Ok(terms)
    };
    let sums: Vec<Result<u64>> = if threads == 1 {
        vec![run(0, out)]
    } else {
        std::thread::scope(|s| {
            let hs: Vec<_> = out
                .chunks_mut(per * block_bytes)
                .enumerate()
                .map(|(t, r)| {
                    let run = &run;
                    s.spawn(move || run(t * per, r))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("codec worker panicked"))
                .collect()
        })
    };
    let mut terms = 0u64;
    for s in sums {
        terms = terms.wrapping_add(s?);
    }
    if verify && checksum_finish(terms, out.len()) != h.data_check {
        return Err(CompressError::corrupt(
            32,
            "decoded data fails the tensor checksum",
        ));
    }
    Ok(())
}

fn decode_block<E: Elem>(
    payload: &[u8],
    base: usize,
    prob_bits: u32,
    freq: &[u32],
    out: &mut [u8],
    s: &mut DecScratch,
) -> Result<()> {
    if payload.len() == out.len() {
        out.copy_from_slice(payload);
        return Ok(());
    }
    let n = out.len() / E::BYTES;
    let mlen = mantissa_len(n, E::MANT_BITS);
    let (mant, rest) = payload.split_at(mlen);
    check_mantissa_padding(mant, n, E::MANT_BITS, base)?;
    let (words, st) = rest.split_at(rest.len() - STATES_LEN);
    let mut x = [0u32; LANES];
    for (k, (v, b)) in x.iter_mut().zip(st.chunks_exact(4)).enumerate() {
        *v = u32::from_le_bytes(b.try_into().expect("4 bytes"));
        if !(RANS_L..RANS_L << 16).contains(v) {
            return Err(CompressError::corrupt(
                base + payload.len() - STATES_LEN + 4 * k,
                format!("rANS state {v:#x} outside [2^15, 2^31)"),
            ));
        }
    }
    let mut pos = words.len() / 2;
    let done = simd::decode_merge32::<E>(
        out,
        payload,
        words.len(),
        &s.table,
        prob_bits,
        &mut pos,
        &mut x,
    );
    s.syms.resize(n - done, 0);
    for (i, sym) in (done..n).zip(s.syms.iter_mut()) {
        *sym = rans::get(&mut x[i % LANES], &s.table, prob_bits, words, &mut pos);
    }
    if pos != 0 || x.iter().any(|&v| v != RANS_L) {
        return Err(CompressError::corrupt(
            base,
            "rANS stream does not end where it should",
        ));
    }
    // A symbol outside the table decodes from no slot, so every symbol seen had a frequency.
    debug_assert!(s.syms.iter().all(|&v| freq[v as usize] > 0));
    // `done` is a multiple of 32 elements, so the rest starts on a mantissa group.
    super::chunk::merge::<E>(
        &mut out[done * E::BYTES..],
        &mant[done / 8 * E::MANT_BITS as usize..],
        &s.syms,
    );
    Ok(())
}

macro_rules! with_elem2 {
    ($dtype:expr, $e:ident => $body:expr) => {
        match $dtype {
            CodecDType::F32 => {
                type $e = super::split::F32;
                $body
            }
            CodecDType::F16 => {
                type $e = super::split::F16;
                $body
            }
            CodecDType::BF16 => {
                type $e = super::split::BF16;
                $body
            }
        }
    };
}
use with_elem2;

#[cfg(test)]
mod tests;
