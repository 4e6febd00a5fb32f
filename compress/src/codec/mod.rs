//! The CPU codec: split each element into a sign+exponent symbol (rANS-coded) and raw mantissa
//! bits. [`encode`] writes format version 2 ([`v2`]: one table per tensor, blocks of 32
//! interleaved states, decoded with AVX2 where the CPU has it); the decoders read versions 1
//! and 2. Blocks (v2) and chunks (v1) encode and decode independently, on as many threads as
//! asked.
//!
//! ```
//! use hprt_compress::codec::{decode, encode, EncodeOptions};
//! use hprt_compress::CodecDType;
//!
//! let values: Vec<u8> = (0..4096u32)
//!     .flat_map(|i| ((i as f32 * 0.01).sin() as f32).to_le_bytes())
//!     .collect();
//! let packed = encode(CodecDType::F32, &values, &EncodeOptions::default())?;
//! assert!(packed.len() < values.len());
//! let back = decode(&packed)?;
//! assert_eq!(back.data, values);
//! # Ok::<(), hprt_compress::CompressError>(())
//! ```

mod chunk;
pub mod cuda;
mod rans;
mod simd;
mod split;
pub mod v2;

pub use rans::entropy_bits;

use crate::error::{CompressError, Result};
use crate::format::{
    self, parse_prefix, ChunkEntry, CodecDType, Header, Prefix, CHUNK_ALIGN, CHUNK_ENTRY_LEN,
    DEFAULT_PROB_BITS, HEADER_LEN, MAX_CHUNK_ELEMS, PROB_BITS_RANGE,
};
use split::{BF16, F16, F32};

macro_rules! with_elem {
    ($dtype:expr, $e:ident => $body:expr) => {
        match $dtype {
            CodecDType::F32 => {
                type $e = F32;
                $body
            }
            CodecDType::F16 => {
                type $e = F16;
                $body
            }
            CodecDType::BF16 => {
                type $e = BF16;
                $body
            }
        }
    };
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How to encode.
#[derive(Clone, Debug)]
pub struct EncodeOptions {
    /// Elements per block (version 2: a multiple of 32, at most 2^24; [`encode_v1`] takes
    /// multiples of 8).
    pub chunk_elems: usize,
    /// Probability resolution of the rANS tables (9..=14 bits).
    pub prob_bits: u32,
    /// Worker threads (1 = encode on the calling thread).
    pub threads: usize,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            chunk_elems: v2::DEFAULT_BLOCK_ELEMS,
            prob_bits: DEFAULT_PROB_BITS,
            threads: default_threads(),
        }
    }
}

impl EncodeOptions {
    /// The defaults on one thread.
    pub fn single_threaded() -> Self {
        EncodeOptions {
            threads: 1,
            ..Default::default()
        }
    }

    pub(crate) fn validate(&self, align: usize) -> Result<()> {
        if self.chunk_elems == 0
            || self.chunk_elems % align != 0
            || self.chunk_elems > MAX_CHUNK_ELEMS
        {
            return Err(CompressError::InvalidArgument(format!(
                "block size {} is not a positive multiple of {align} up to {MAX_CHUNK_ELEMS}",
                self.chunk_elems
            )));
        }
        if !PROB_BITS_RANGE.contains(&self.prob_bits) {
            return Err(CompressError::InvalidArgument(format!(
                "probability resolution {} is outside {PROB_BITS_RANGE:?}",
                self.prob_bits
            )));
        }
        Ok(())
    }
}

/// How to decode.
#[derive(Clone, Debug)]
pub struct DecodeOptions {
    pub threads: usize,
    /// Check every chunk's checksum (on by default; off only to measure the coder alone).
    pub verify: bool,
    /// The most output bytes [`decode_with`] may allocate: an encoding declaring more is
    /// [`CompressError::OutputTooLarge`] before anything is allocated. `None` = no limit other
    /// than what the allocator grants. Set it when decoding untrusted bytes: a valid encoding
    /// may declare up to [`format::MAX_EXPANSION`] times its own length (FORMAT.md, "Memory").
    pub max_output: Option<usize>,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            threads: default_threads(),
            verify: true,
            max_output: None,
        }
    }
}

impl DecodeOptions {
    pub fn single_threaded() -> Self {
        DecodeOptions {
            threads: 1,
            ..Default::default()
        }
    }
}

/// A decoded tensor: its element type and little-endian bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded {
    pub dtype: CodecDType,
    pub numel: usize,
    pub data: Vec<u8>,
}

/// The largest encoding `encode` can produce for this input (see [`v2::max_encoded_len`]).
pub fn max_encoded_len(dtype: CodecDType, numel: usize, opts: &EncodeOptions) -> usize {
    v2::max_encoded_len(dtype, numel, opts.chunk_elems)
}

/// Encodes `data` (little-endian elements of `dtype`) into a new vector (format version 2).
pub fn encode(dtype: CodecDType, data: &[u8], opts: &EncodeOptions) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_into(dtype, data, opts, &mut out)?;
    Ok(out)
}

fn check_whole_elements(dtype: CodecDType, data: &[u8]) -> Result<()> {
    if data.len() % dtype.size() != 0 {
        return Err(CompressError::InvalidArgument(format!(
            "{} bytes is not a whole number of {dtype} elements",
            data.len()
        )));
    }
    Ok(())
}

/// Encodes `data` into `out` (replacing its contents) as format version 2; never longer than
/// [`max_encoded_len`].
pub fn encode_into(
    dtype: CodecDType,
    data: &[u8],
    opts: &EncodeOptions,
    out: &mut Vec<u8>,
) -> Result<()> {
    opts.validate(v2::BLOCK_ALIGN)?;
    check_whole_elements(dtype, data)?;
    v2::encode_into(
        dtype,
        data,
        opts.prob_bits,
        opts.chunk_elems,
        opts.threads,
        out,
    )
}

/// Encodes `data` in format version 1 (chunks of `opts.chunk_elems` with their own tables),
/// which every decoder still reads; never longer than [`format::max_encoded_len`].
pub fn encode_v1(dtype: CodecDType, data: &[u8], opts: &EncodeOptions) -> Result<Vec<u8>> {
    opts.validate(CHUNK_ALIGN)?;
    check_whole_elements(dtype, data)?;
    let mut out = Vec::new();
    let numel = data.len() / dtype.size();
    let mut header = Header {
        dtype,
        prob_bits: opts.prob_bits,
        chunk_elems: opts.chunk_elems,
        numel,
        payload_len: 0,
    };
    let n_chunks = header.chunk_count();
    let prefix_len = header.prefix_len();
    let chunk_bytes = opts.chunk_elems * dtype.size();
    out.reserve(prefix_len + data.len() / 2);
    out.resize(prefix_len, 0);
    let threads = opts.threads.clamp(1, n_chunks.max(1));
    let entries: Vec<ChunkEntry> = with_elem!(dtype, E => {
        if threads == 1 {
            let mut scratch = chunk::Scratch::default();
            data.chunks(chunk_bytes)
                .map(|c| chunk::encode::<E>(c, opts.prob_bits, &mut out, &mut scratch))
                .collect()
        } else {
            let per = n_chunks.div_ceil(threads);
            let parts: Vec<(Vec<u8>, Vec<ChunkEntry>)> = std::thread::scope(|s| {
                let handles: Vec<_> = data
                    .chunks(per * chunk_bytes)
                    .map(|range| {
                        s.spawn(move || {
                            let mut scratch = chunk::Scratch::default();
                            let mut buf = Vec::with_capacity(range.len() * 3 / 4);
                            let entries = range
                                .chunks(chunk_bytes)
                                .map(|c| chunk::encode::<E>(c, opts.prob_bits, &mut buf, &mut scratch))
                                .collect();
                            (buf, entries)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("codec worker panicked"))
                    .collect()
            });
            let mut entries = Vec::with_capacity(n_chunks);
            for (buf, e) in parts {
                out.extend_from_slice(&buf);
                entries.extend(e);
            }
            entries
        }
    });
    header.payload_len = out.len() - prefix_len;
    header.write(&mut out[..HEADER_LEN]);
    for (i, e) in entries.iter().enumerate() {
        let at = HEADER_LEN + i * CHUNK_ENTRY_LEN;
        e.write(&mut out[at..at + CHUNK_ENTRY_LEN]);
    }
    format::seal(&mut out[..prefix_len]);
    Ok(out)
}

/// Decodes an encoding into a new vector.
pub fn decode(bytes: &[u8]) -> Result<Decoded> {
    decode_with(bytes, &DecodeOptions::default())
}

/// Decodes into a new vector. The whole header and chunk table are validated first (every
/// payload length against its mode); only then is the declared output allocated, checked
/// against `opts.max_output` and fallibly, so a size the allocator refuses is
/// [`CompressError::OutOfMemory`], never an abort.
pub fn decode_with(bytes: &[u8], opts: &DecodeOptions) -> Result<Decoded> {
    let parsed = Parsed::parse(bytes)?;
    let h = parsed.header();
    let mut data = alloc_output(checked_output_len(&h, opts.max_output)?)?;
    parsed.decode(bytes, &mut data, opts)?;
    Ok(Decoded {
        dtype: h.dtype,
        numel: h.numel,
        data,
    })
}

/// The output bytes `header` declares, refused above `max_output`
/// ([`CompressError::OutputTooLarge`]): the check [`decode_with`] makes before allocating, for
/// callers that allocate the output themselves.
pub fn checked_output_len(header: &Header, max_output: Option<usize>) -> Result<usize> {
    let len = header.output_len();
    match max_output {
        Some(limit) if len > limit => Err(CompressError::OutputTooLarge {
            declared: len,
            limit,
        }),
        _ => Ok(len),
    }
}

/// Allocates `len` zeroed bytes without aborting on failure. The pages stay untouched (the
/// allocator maps zero pages) until chunks are decoded into them, so an encoding rejected at
/// its first chunk costs no resident memory.
fn alloc_output(len: usize) -> Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len)
        .map_err(|_| CompressError::OutOfMemory { bytes: len })?;
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(CompressError::OutOfMemory { bytes: len });
    }
    advise_huge_pages(ptr, len);
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `len` bytes
    // (u8's alignment, capacity `len`), and all `len` bytes are initialized (zeroed).
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// Outputs from this size on ask for transparent huge pages.
const HUGE_PAGES_FROM: usize = 4 << 20;

/// Asks Linux to back the pages of `ptr..ptr + len` (freshly allocated, not yet touched) with
/// transparent huge pages where it allows them (`madvise` mode): a 128 MiB output then costs 64
/// page faults instead of 32,768, which on one core was a third of a one-shot decode's time
/// (BENCHMARKS.md, "CPU codec on large tensors"). Only advice: contents and failures change
/// nothing, and elsewhere it does nothing.
pub(crate) fn advise_huge_pages(ptr: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const MADV_HUGEPAGE: std::ffi::c_int = 14;
        extern "C" {
            fn madvise(
                addr: *mut std::ffi::c_void,
                len: usize,
                advice: std::ffi::c_int,
            ) -> std::ffi::c_int;
        }
        if len < HUGE_PAGES_FROM {
            return;
        }
        let start = (ptr as usize).next_multiple_of(4096);
        let end = (ptr as usize + len) & !4095;
        if end > start {
            // SAFETY: advice on whole pages inside an allocation the caller owns; it changes
            // neither contents nor validity, and an error (an unsupported kernel) is ignored.
            unsafe { madvise(start as *mut std::ffi::c_void, end - start, MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len, HUGE_PAGES_FROM);
}

/// Decodes into `out`, which must be exactly `numel * dtype size` bytes; returns the header.
/// `out` is the caller's own bound on the output: nothing is allocated from the declared size.
pub fn decode_into(bytes: &[u8], out: &mut [u8], opts: &DecodeOptions) -> Result<Header> {
    let parsed = Parsed::parse(bytes)?;
    parsed.decode(bytes, out, opts)?;
    Ok(parsed.header())
}

/// Parses and checks header, table and index (v2) or chunk table (v1) without decoding (see
/// [`Prefix`]).
pub fn inspect(bytes: &[u8]) -> Result<Prefix> {
    Ok(match Parsed::parse(bytes)? {
        Parsed::V1(p) => p,
        Parsed::V2(p) => p.summary(),
    })
}

/// A checked prefix of either version.
enum Parsed {
    V1(Prefix),
    V2(v2::Prefix2),
}

impl Parsed {
    fn parse(bytes: &[u8]) -> Result<Parsed> {
        if bytes.len() >= 6
            && bytes[..4] == format::MAGIC
            && bytes[4..6] == v2::VERSION.to_le_bytes()
        {
            return Ok(Parsed::V2(v2::parse(bytes)?));
        }
        Ok(Parsed::V1(parse_prefix(bytes)?))
    }
    fn header(&self) -> Header {
        match self {
            Parsed::V1(p) => p.header,
            Parsed::V2(p) => p.summary().header,
        }
    }
    fn decode(&self, bytes: &[u8], out: &mut [u8], opts: &DecodeOptions) -> Result<()> {
        match self {
            Parsed::V1(p) => decode_prefixed(bytes, p, out, opts),
            Parsed::V2(p) => {
                let want = self.header().output_len();
                if out.len() != want {
                    return Err(CompressError::InvalidArgument(format!(
                        "output is {} bytes, the encoding holds {want}",
                        out.len()
                    )));
                }
                v2::decode_into(bytes, p, out, opts.threads, opts.verify)
            }
        }
    }
}

fn decode_prefixed(
    bytes: &[u8],
    prefix: &Prefix,
    out: &mut [u8],
    opts: &DecodeOptions,
) -> Result<()> {
    let want = prefix.header.output_len();
    if out.len() != want {
        return Err(CompressError::InvalidArgument(format!(
            "output is {} bytes, the encoding holds {want}",
            out.len()
        )));
    }
    let h = prefix.header;
    let chunk_bytes = h.chunk_elems * h.dtype.size();
    let n_chunks = prefix.chunks.len();
    let threads = opts.threads.clamp(1, n_chunks.max(1));
    fn job<'a, 'b>(
        bytes: &'a [u8],
        prefix: &'a Prefix,
        i: usize,
        out: &'b mut [u8],
    ) -> chunk::ChunkJob<'a, 'b> {
        let (entry, base) = (&prefix.chunks[i], prefix.offsets[i]);
        chunk::ChunkJob {
            entry,
            payload: &bytes[base..base + entry.len],
            out,
            base,
        }
    }
    // Decodes the chunks of `range`, the first being chunk `first`, two at a time.
    let run = |first: usize, range: &mut [u8], scratch: &mut chunk::DecodeScratch| -> Result<()> {
        let mut dsts = range.chunks_mut(chunk_bytes).enumerate();
        while let Some((k, a)) = dsts.next() {
            let a = job(bytes, prefix, first + k, a);
            match dsts.next() {
                Some((k, b)) => with_elem!(h.dtype, E => chunk::decode_pair::<E>(
                    a, job(bytes, prefix, first + k, b), h.prob_bits, opts.verify, scratch
                ))?,
                None => with_elem!(h.dtype, E => chunk::decode::<E>(
                    a.entry, a.payload, h.prob_bits, a.out, a.base, opts.verify, scratch
                ))?,
            }
        }
        Ok(())
    };
    if threads == 1 {
        return run(0, out, &mut chunk::DecodeScratch::new());
    }
    let per = n_chunks.div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = out
            .chunks_mut(per * chunk_bytes)
            .enumerate()
            .map(|(t, range)| {
                let run = &run;
                s.spawn(move || run(t * per, range, &mut chunk::DecodeScratch::new()))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("codec worker panicked"))
            .collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}

/// Per-chunk symbol statistics of raw data, for reports: what the coder is measured against.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkSymbols {
    pub numel: usize,
    /// Distinct sign+exponent symbols in the chunk.
    pub distinct: usize,
    /// Order-0 entropy of the chunk's symbols, in bits for all of them.
    pub entropy_bits: f64,
}

/// Symbol statistics of each chunk `encode` would make of `data`.
pub fn chunk_symbols(dtype: CodecDType, data: &[u8], chunk_elems: usize) -> Vec<ChunkSymbols> {
    let chunk_bytes = chunk_elems.max(1) * dtype.size();
    data.chunks(chunk_bytes)
        .map(|c| {
            let h = with_elem!(dtype, E => chunk::histogram::<E>(c));
            ChunkSymbols {
                numel: c.len() / dtype.size(),
                distinct: h.iter().filter(|&&x| x > 0).count(),
                entropy_bits: entropy_bits(&h),
            }
        })
        .collect()
}

/// Bits a canonical Huffman code of each chunk's symbols would take (for the coder choice
/// reported by the benchmark; the format itself uses rANS).
pub fn huffman_bits(dtype: CodecDType, data: &[u8], chunk_elems: usize) -> f64 {
    let chunk_bytes = chunk_elems.max(1) * dtype.size();
    data.chunks(chunk_bytes)
        .map(|c| {
            let h = with_elem!(dtype, E => chunk::histogram::<E>(c));
            huffman_cost(&h)
        })
        .sum()
}

/// Total bits of an optimal prefix code (Huffman's algorithm on the counts).
fn huffman_cost(counts: &[u32]) -> f64 {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut heap: BinaryHeap<Reverse<u64>> = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| Reverse(c as u64))
        .collect();
    if heap.len() == 1 {
        return heap.pop().map_or(0.0, |Reverse(c)| c as f64);
    }
    // The total cost equals the sum of all merged weights.
    let mut total = 0u64;
    while heap.len() > 1 {
        let Reverse(a) = heap.pop().expect("two items");
        let Reverse(b) = heap.pop().expect("two items");
        total += a + b;
        heap.push(Reverse(a + b));
    }
    total as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_ramp(n: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| {
                let f = ((i as f32) * 0.37).sin() * 3.0;
                ((f.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn round_trips_every_mode_and_tail_length() {
        let opts = |threads| EncodeOptions {
            chunk_elems: 64,
            prob_bits: 12,
            threads,
        };
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 1000, 5000] {
            let data = bf16_ramp(n);
            for threads in [1, 3] {
                let enc = encode(CodecDType::BF16, &data, &opts(threads)).unwrap();
                assert!(enc.len() <= max_encoded_len(CodecDType::BF16, n, &opts(1)));
                assert_eq!(decode(&enc).unwrap().data, data, "n = {n}");
                let v1 = encode_v1(CodecDType::BF16, &data, &opts(threads)).unwrap();
                assert_eq!(decode(&v1).unwrap().data, data, "v1, n = {n}");
            }
        }
        // Version 1's chunk modes, which every decoder still reads.
        let constant: Vec<u8> = [0x12u8, 0x3f].repeat(1000);
        let enc = encode_v1(CodecDType::BF16, &constant, &opts(1)).unwrap();
        let p = inspect(&enc).unwrap();
        assert!(p
            .chunks
            .iter()
            .all(|c| c.mode == format::ChunkMode::Constant));
        assert_eq!(decode(&enc).unwrap().data, constant);
        // One exponent, varying mantissas.
        let single: Vec<u8> = (0..1000u16)
            .flat_map(|i| (0x3f80 | (i % 128)).to_le_bytes())
            .collect();
        let enc = encode_v1(CodecDType::BF16, &single, &opts(1)).unwrap();
        assert_eq!(
            inspect(&enc).unwrap().chunks[0].mode,
            format::ChunkMode::SingleSymbol
        );
        assert_eq!(decode(&enc).unwrap().data, single);
    }

    #[test]
    fn paired_chunks_round_trip_and_report_corruption_in_either_chunk() {
        let opts = EncodeOptions {
            chunk_elems: 256,
            prob_bits: 12,
            threads: 1,
        };
        let data = bf16_ramp(256 * 4 + 40);
        let enc = encode_v1(CodecDType::BF16, &data, &opts).unwrap();
        let p = inspect(&enc).unwrap();
        assert!(p.chunks[..4]
            .iter()
            .all(|c| c.mode == format::ChunkMode::Rans));
        for verify in [true, false] {
            let o = DecodeOptions {
                threads: 1,
                verify,
                max_output: None,
            };
            assert_eq!(decode_with(&enc, &o).unwrap().data, data);
            // The last rANS word of each chunk of the first pair: the streams no longer end
            // where they should, whether or not checksums are checked.
            for chunk in [0, 1] {
                let mut bad = enc.clone();
                let end = p.offsets[chunk] + p.chunks[chunk].len - STATE_BYTES - 1;
                bad[end] ^= 0x40;
                assert!(
                    decode_with(&bad, &o).is_err(),
                    "chunk {chunk}, verify {verify}"
                );
            }
        }
    }

    /// Bytes of the final states at the end of a rANS chunk.
    const STATE_BYTES: usize = 32;

    #[test]
    fn rejects_partial_elements_and_bad_options() {
        let o = EncodeOptions::single_threaded();
        assert!(encode(CodecDType::F32, &[0u8; 6], &o).is_err());
        let bad = EncodeOptions {
            chunk_elems: 12,
            ..o.clone()
        };
        assert!(encode(CodecDType::F32, &[0u8; 64], &bad).is_err());
        let bad = EncodeOptions { prob_bits: 16, ..o };
        assert!(encode(CodecDType::F32, &[0u8; 64], &bad).is_err());
    }

    #[test]
    fn huffman_cost_matches_a_known_code() {
        // Counts 1,1,2,4: code lengths 3,3,2,1 -> 3+3+4+4 = 14 bits.
        assert_eq!(huffman_cost(&[1, 1, 2, 4]), 14.0);
        assert_eq!(huffman_cost(&[5]), 5.0);
    }
}
