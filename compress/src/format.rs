//! The container layout of `compress/FORMAT.md`: header, chunk table, checksums and size bounds.
//!
//! Everything here is plain byte layout; the entropy coder lives in [`crate::codec`].

use hprt_platform::DType;

use crate::error::{CompressError, Result};

/// First four bytes of every encoding.
pub const MAGIC: [u8; 4] = *b"HPRZ";
/// The format version this build writes and reads.
pub const VERSION: u16 = 1;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 40;
/// Bytes of one chunk-table entry.
pub const CHUNK_ENTRY_LEN: usize = 16;
/// Interleaved rANS states per chunk; also the mantissa packing group.
pub const LANES: usize = 8;
/// Default elements per chunk: large enough that the frequency table and final states cost
/// well under 1% of the coded symbols, small enough to stay in L2 and to spread over threads.
pub const DEFAULT_CHUNK_ELEMS: usize = 1 << 17;
/// Chunk sizes are multiples of this (one mantissa packing group).
pub const CHUNK_ALIGN: usize = LANES;
/// The largest chunk the format allows (keeps every per-chunk length within `u32`).
pub const MAX_CHUNK_ELEMS: usize = 1 << 24;
/// Bytes of the eight final rANS states at the end of a `Rans` chunk.
pub const STATES_LEN: usize = 4 * LANES;
/// Smallest frequency table: the `u16` count and two one-byte (gap, freq - 1) pairs.
const MIN_TABLE_LEN: usize = 2 + 2 * 2;
/// The most output bytes a valid encoding can declare per byte of its own length: a chunk of
/// [`MAX_CHUNK_ELEMS`] f32 elements stored as one constant element costs a 16-byte table entry
/// and 4 payload bytes (FORMAT.md, "Memory").
pub const MAX_EXPANSION: usize = MAX_CHUNK_ELEMS * 4 / (CHUNK_ENTRY_LEN + 4) + 1;
/// Default probability resolution of the rANS tables (frequencies sum to `1 << PROB_BITS`).
pub const DEFAULT_PROB_BITS: u32 = 12;
/// Range of probability resolutions the decoder accepts.
pub const PROB_BITS_RANGE: std::ops::RangeInclusive<u32> = 9..=14;

/// Element types the codec can split into a sign+exponent symbol and raw mantissa bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodecDType {
    F32,
    F16,
    BF16,
}

impl CodecDType {
    pub const ALL: [CodecDType; 3] = [CodecDType::F32, CodecDType::F16, CodecDType::BF16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            CodecDType::F32 => 4,
            CodecDType::F16 | CodecDType::BF16 => 2,
        }
    }
    /// Width of the entropy-coded sign+exponent symbol.
    pub const fn symbol_bits(self) -> u32 {
        match self {
            CodecDType::F32 | CodecDType::BF16 => 9,
            CodecDType::F16 => 6,
        }
    }
    /// Width of the mantissa, stored raw.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            CodecDType::F32 => 23,
            CodecDType::F16 => 10,
            CodecDType::BF16 => 7,
        }
    }
    pub const fn code(self) -> u8 {
        match self {
            CodecDType::F32 => 1,
            CodecDType::F16 => 2,
            CodecDType::BF16 => 3,
        }
    }
    pub fn from_code(code: u8) -> Option<Self> {
        CodecDType::ALL.into_iter().find(|d| d.code() == code)
    }
    pub fn name(self) -> &'static str {
        self.dtype().name()
    }
    pub fn dtype(self) -> DType {
        match self {
            CodecDType::F32 => DType::F32,
            CodecDType::F16 => DType::F16,
            CodecDType::BF16 => DType::BF16,
        }
    }
    /// The codec's element type of `d`, if it codes it (the one mapping: [`TryFrom`] and
    /// [`FromStr`](std::str::FromStr) go through it).
    pub fn of(d: DType) -> Option<Self> {
        CodecDType::ALL.into_iter().find(|c| c.dtype() == d)
    }
    /// Parses a dtype name as [`DType`]'s `FromStr` does (`f32`, `f16`, `bf16`, or their
    /// numpy / torch names, spelled exactly).
    pub fn parse(s: &str) -> Result<Self> {
        s.parse()
    }
}

impl std::str::FromStr for CodecDType {
    type Err = CompressError;
    fn from_str(s: &str) -> Result<Self> {
        let d: DType = s.parse().map_err(|e: hprt_platform::UnknownName| {
            CompressError::InvalidArgument(e.to_string())
        })?;
        d.try_into()
    }
}

impl TryFrom<DType> for CodecDType {
    type Error = CompressError;
    fn try_from(d: DType) -> Result<Self> {
        CodecDType::of(d).ok_or_else(|| {
            CompressError::InvalidArgument(format!(
                "no codec for dtype {d} (only f32, f16 and bf16 are coded)"
            ))
        })
    }
}

impl std::fmt::Display for CodecDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How one chunk is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChunkMode {
    /// The original bytes (chosen whenever coding would not make the chunk smaller).
    Raw,
    /// Frequency table, packed mantissas, interleaved rANS words, final states.
    Rans,
    /// Every symbol is the same: the symbol, then the packed mantissas.
    SingleSymbol,
    /// Every element is the same: one element.
    Constant,
}

impl ChunkMode {
    pub const fn code(self) -> u8 {
        match self {
            ChunkMode::Raw => 0,
            ChunkMode::Rans => 1,
            ChunkMode::SingleSymbol => 2,
            ChunkMode::Constant => 3,
        }
    }
    pub fn from_code(c: u8) -> Option<Self> {
        [
            ChunkMode::Raw,
            ChunkMode::Rans,
            ChunkMode::SingleSymbol,
            ChunkMode::Constant,
        ]
        .into_iter()
        .find(|m| m.code() == c)
    }
    pub fn name(self) -> &'static str {
        match self {
            ChunkMode::Raw => "raw",
            ChunkMode::Rans => "rans",
            ChunkMode::SingleSymbol => "single-symbol",
            ChunkMode::Constant => "constant",
        }
    }
}

/// The fixed header at the start of an encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub dtype: CodecDType,
    pub prob_bits: u32,
    pub chunk_elems: usize,
    pub numel: usize,
    /// Bytes of all chunk payloads together (they follow the chunk table back to back).
    pub payload_len: usize,
}

impl Header {
    pub fn chunk_count(&self) -> usize {
        self.numel.div_ceil(self.chunk_elems)
    }
    /// Bytes of header plus chunk table.
    pub fn prefix_len(&self) -> usize {
        HEADER_LEN + self.chunk_count() * CHUNK_ENTRY_LEN
    }
    pub fn total_len(&self) -> usize {
        self.prefix_len() + self.payload_len
    }
    /// Bytes the decoded tensor occupies; [`Header::parse`] checked it fits `usize`.
    pub fn output_len(&self) -> usize {
        self.numel * self.dtype.size()
    }
    /// Elements in chunk `i` (the last one may be short).
    pub fn chunk_numel(&self, i: usize) -> usize {
        let start = i * self.chunk_elems;
        self.chunk_elems.min(self.numel - start)
    }

    /// Writes the 40 header bytes, leaving the checksum field zero (see [`seal`]).
    pub(crate) fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.dtype.code();
        out[7] = LANES as u8;
        out[8] = self.prob_bits as u8;
        out[9..12].fill(0);
        out[12..16].copy_from_slice(&(self.chunk_elems as u32).to_le_bytes());
        out[16..24].copy_from_slice(&(self.numel as u64).to_le_bytes());
        out[24..32].copy_from_slice(&(self.payload_len as u64).to_le_bytes());
        out[32..40].fill(0);
    }

    /// Parses and validates the header (not yet the table checksum, see [`parse_prefix`]).
    pub fn parse(bytes: &[u8]) -> Result<Header> {
        if bytes.len() < HEADER_LEN {
            return Err(CompressError::corrupt(
                bytes.len(),
                format!(
                    "{} bytes is shorter than the {HEADER_LEN}-byte header",
                    bytes.len()
                ),
            ));
        }
        if bytes[..4] != MAGIC {
            return Err(CompressError::corrupt(
                0,
                "bad magic (not an hprt encoding)",
            ));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION {
            return Err(CompressError::UnsupportedFormat(format!(
                "format version {version} (this build reads version {VERSION})"
            )));
        }
        let dtype = CodecDType::from_code(bytes[6])
            .ok_or_else(|| CompressError::corrupt(6, format!("unknown dtype code {}", bytes[6])))?;
        if bytes[7] as usize != LANES {
            return Err(CompressError::UnsupportedFormat(format!(
                "{} interleaved lanes (this build decodes {LANES})",
                bytes[7]
            )));
        }
        let prob_bits = bytes[8] as u32;
        if !PROB_BITS_RANGE.contains(&prob_bits) {
            return Err(CompressError::UnsupportedFormat(format!(
                "probability resolution of {prob_bits} bits (accepted: {PROB_BITS_RANGE:?})"
            )));
        }
        if bytes[9..12] != [0, 0, 0] {
            return Err(CompressError::corrupt(
                9,
                "reserved header bytes are not zero",
            ));
        }
        let chunk_elems = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
        if chunk_elems == 0 || chunk_elems % CHUNK_ALIGN != 0 || chunk_elems > MAX_CHUNK_ELEMS {
            return Err(CompressError::corrupt(
                12,
                format!("chunk size {chunk_elems} is not a positive multiple of {CHUNK_ALIGN} up to {MAX_CHUNK_ELEMS}"),
            ));
        }
        let numel = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        let payload_len = u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes"));
        let numel = usize::try_from(numel)
            .ok()
            .filter(|n| n.checked_mul(dtype.size()).is_some())
            .ok_or_else(|| {
                CompressError::corrupt(16, format!("element count {numel} is too large"))
            })?;
        let payload_len = usize::try_from(payload_len)
            .ok()
            .ok_or_else(|| CompressError::corrupt(24, "payload length is too large"))?;
        Ok(Header {
            dtype,
            prob_bits,
            chunk_elems,
            numel,
            payload_len,
        })
    }
}

/// One chunk-table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkEntry {
    pub mode: ChunkMode,
    /// Bytes of this chunk's payload.
    pub len: usize,
    /// [`checksum`] of the chunk's decoded bytes.
    pub check: u64,
}

impl ChunkEntry {
    pub(crate) fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&(self.len as u32).to_le_bytes());
        out[4] = self.mode.code();
        out[5..8].fill(0);
        out[8..16].copy_from_slice(&self.check.to_le_bytes());
    }

    fn parse(b: &[u8], at: usize) -> Result<ChunkEntry> {
        let len = u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) as usize;
        let mode = ChunkMode::from_code(b[4]).ok_or_else(|| {
            CompressError::corrupt(at + 4, format!("unknown chunk mode {}", b[4]))
        })?;
        if b[5..8] != [0, 0, 0] {
            return Err(CompressError::corrupt(
                at + 5,
                "reserved chunk-entry bytes are not zero",
            ));
        }
        let check = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        Ok(ChunkEntry { mode, len, check })
    }

    /// Checks that the payload length fits the mode for a chunk of `n` elements of `dtype`
    /// (`base` is the payload's offset, for the message). The decoder relies on it before it
    /// reads any payload.
    pub(crate) fn check_len(&self, dtype: CodecDType, n: usize, base: usize) -> Result<()> {
        let raw = n * dtype.size();
        let mlen = mantissa_len(n, dtype.mantissa_bits());
        let fits = match self.mode {
            ChunkMode::Raw => self.len == raw,
            ChunkMode::Constant => self.len == dtype.size(),
            ChunkMode::SingleSymbol => self.len == 2 + mlen,
            // The encoder stores a chunk raw whenever coding would not make it smaller.
            ChunkMode::Rans => (MIN_TABLE_LEN + mlen + STATES_LEN..raw).contains(&self.len),
        };
        if fits {
            return Ok(());
        }
        let want = match self.mode {
            ChunkMode::Rans => format!(
                "from {} to {} bytes",
                MIN_TABLE_LEN + mlen + STATES_LEN,
                raw.saturating_sub(1)
            ),
            ChunkMode::Raw => format!("{raw} bytes"),
            ChunkMode::Constant => format!("{} bytes", dtype.size()),
            ChunkMode::SingleSymbol => format!("{} bytes", 2 + mlen),
        };
        Err(CompressError::corrupt(
            base,
            format!(
                "{} chunk of {n} elements is {} bytes, expected {want}",
                self.mode.name(),
                self.len
            ),
        ))
    }
}

/// Bytes of `n` packed mantissas of width `w` bits.
pub(crate) const fn mantissa_len(n: usize, w: u32) -> usize {
    (n * w as usize).div_ceil(8)
}

/// Checks that the padding bits after `n` mantissas of width `w` (the high bits of the stream's
/// last byte) are zero, as the format requires: they are not covered by any checksum, so
/// anything else would be bytes the decoder silently ignores.
pub(crate) fn check_mantissa_padding(mant: &[u8], n: usize, w: u32, at: usize) -> Result<()> {
    let used = (n * w as usize) % 8;
    match mant.last() {
        Some(&last) if used != 0 && last >> used != 0 => Err(CompressError::corrupt(
            at + mant.len() - 1,
            "non-zero padding bits after the last mantissa",
        )),
        _ => Ok(()),
    }
}

/// A parsed and checked header and chunk table, with each chunk's payload offset.
#[derive(Clone, Debug)]
pub struct Prefix {
    /// The format version (1 or 2). For version 2, `header.chunk_elems` is the block size,
    /// `chunks` are the blocks (mode `Raw` or `Rans`) and their `check` is 0: version 2 checks
    /// the decoded tensor as a whole.
    pub version: u16,
    pub header: Header,
    pub chunks: Vec<ChunkEntry>,
    /// Absolute byte offset of each chunk's payload.
    pub offsets: Vec<usize>,
}

/// Parses header and chunk table, verifies the prefix checksum, that every payload length fits
/// its mode, lies inside `bytes` and that the lengths add up to exactly the stored total. Its
/// allocations are bounded by the table's length in `bytes`; nothing is sized from the declared
/// element count.
pub fn parse_prefix(bytes: &[u8]) -> Result<Prefix> {
    let header = Header::parse(bytes)?;
    let n_chunks = header.chunk_count();
    let prefix_len = n_chunks
        .checked_mul(CHUNK_ENTRY_LEN)
        .and_then(|t| t.checked_add(HEADER_LEN))
        .filter(|&p| p <= bytes.len())
        .ok_or_else(|| {
            CompressError::corrupt(
                bytes.len(),
                format!("truncated: the chunk table of {n_chunks} chunks does not fit"),
            )
        })?;
    let stored = u64::from_le_bytes(bytes[32..40].try_into().expect("8 bytes"));
    if prefix_checksum(&bytes[..prefix_len]) != stored {
        return Err(CompressError::corrupt(
            32,
            "header/chunk-table checksum mismatch",
        ));
    }
    let total = header.payload_len.checked_add(prefix_len);
    if total != Some(bytes.len()) {
        return Err(CompressError::corrupt(
            bytes.len(),
            format!(
                "length {} does not match the stored length {}",
                bytes.len(),
                total.map_or_else(|| "overflow".into(), |t| t.to_string())
            ),
        ));
    }
    let mut chunks = Vec::with_capacity(n_chunks);
    let mut offsets = Vec::with_capacity(n_chunks);
    let mut off = prefix_len;
    for i in 0..n_chunks {
        let at = HEADER_LEN + i * CHUNK_ENTRY_LEN;
        let e = ChunkEntry::parse(&bytes[at..at + CHUNK_ENTRY_LEN], at)?;
        e.check_len(header.dtype, header.chunk_numel(i), off)?;
        offsets.push(off);
        off = off
            .checked_add(e.len)
            .filter(|&o| o <= bytes.len())
            .ok_or_else(|| CompressError::corrupt(at, format!("chunk {i} runs past the end")))?;
        chunks.push(e);
    }
    if off != bytes.len() {
        return Err(CompressError::corrupt(
            off,
            "chunk lengths do not add up to the payload length",
        ));
    }
    Ok(Prefix {
        version: VERSION,
        header,
        chunks,
        offsets,
    })
}

/// Computes the prefix checksum over header (with a zero checksum field) and chunk table.
pub(crate) fn prefix_checksum(prefix: &[u8]) -> u64 {
    let mut head = [0u8; HEADER_LEN];
    head.copy_from_slice(&prefix[..HEADER_LEN]);
    head[32..40].fill(0);
    checksum(&head) ^ checksum(&prefix[HEADER_LEN..]).rotate_left(17)
}

/// Stores the prefix checksum into a fully written header + table (for tools that edit an
/// encoding's header or table, such as the decoder's mutation fuzzer).
pub fn seal(prefix: &mut [u8]) {
    let c = prefix_checksum(prefix);
    prefix[32..40].copy_from_slice(&c.to_le_bytes());
}

/// The encoding of `numel` zero elements of `dtype` as constant chunks of `chunk_elems`: the
/// most output per input byte the format allows ([`MAX_EXPANSION`] at the largest chunk size),
/// built without materializing the output. With `valid` the chunk checksums are right (it
/// decodes); without, they are zero, which is cheap for chunks of any size. For tests of
/// decoded-size limits (the fuzzer's and the CLI's decoded-size bombs).
pub fn constant_encoding(
    dtype: CodecDType,
    chunk_elems: usize,
    numel: usize,
    valid: bool,
) -> Vec<u8> {
    let header = Header {
        dtype,
        prob_bits: DEFAULT_PROB_BITS,
        chunk_elems,
        numel,
        payload_len: numel.div_ceil(chunk_elems) * dtype.size(),
    };
    let mut out = vec![0u8; header.total_len()];
    header.write(&mut out[..HEADER_LEN]);
    let zeros_check = |n: usize| {
        if valid {
            checksum(&vec![0u8; n * dtype.size()])
        } else {
            0
        }
    };
    let full = zeros_check(chunk_elems.min(numel));
    for i in 0..header.chunk_count() {
        let n = header.chunk_numel(i);
        let entry = ChunkEntry {
            mode: ChunkMode::Constant,
            len: dtype.size(),
            check: if n == chunk_elems {
                full
            } else {
                zeros_check(n)
            },
        };
        entry.write(&mut out[HEADER_LEN + i * CHUNK_ENTRY_LEN..][..CHUNK_ENTRY_LEN]);
    }
    seal(&mut out[..header.prefix_len()]);
    out
}

/// The largest encoding of `numel` elements of `dtype` in chunks of `chunk_elems`: every chunk
/// stored raw plus header and table. Known before encoding, so buffers can be pre-allocated.
pub fn max_encoded_len(dtype: CodecDType, numel: usize, chunk_elems: usize) -> usize {
    let chunk_elems = chunk_elems.max(1);
    HEADER_LEN + numel.div_ceil(chunk_elems) * CHUNK_ENTRY_LEN + numel * dtype.size()
}

pub(crate) const K1: u64 = 0x9E37_79B9_7F4A_7C15;
pub(crate) const K2: u64 = 0xD6E8_FEB8_6659_FD93;

/// The format's 64-bit checksum: a wrapping sum over 8-byte little-endian words of a mix of
/// the word and its index, then the length. Each word's term is independent, so threads or GPU
/// blocks can sum partial ranges in any order; the mix is a bijection of the word, so every
/// single-word change (any bit flip) changes the sum, and the index term catches moved words.
pub fn checksum(data: &[u8]) -> u64 {
    checksum_finish(checksum_terms(data, 0), data.len())
}

/// The wrapping sum of the checksum terms of `data`'s 8-byte words, numbered from
/// `first_word` (the last word zero-padded): partial sums of ranges that start at multiples of
/// 8 bytes add up to the whole's, so threads and GPU blocks sum their own ranges.
pub(crate) fn checksum_terms(data: &[u8], first_word: u64) -> u64 {
    #[inline(always)]
    fn term(w: u64, i: u64) -> u64 {
        let z = (w ^ i.wrapping_mul(K1)).wrapping_mul(K2);
        z ^ (z >> 29)
    }
    let mut sums = [0u64; 4];
    let mut blocks = data.chunks_exact(32);
    let mut i = first_word;
    for b in &mut blocks {
        for (k, s) in sums.iter_mut().enumerate() {
            let w = u64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
            *s = s.wrapping_add(term(w, i.wrapping_add(k as u64)));
        }
        i = i.wrapping_add(4);
    }
    let mut h = sums[0]
        .wrapping_add(sums[1])
        .wrapping_add(sums[2])
        .wrapping_add(sums[3]);
    for w in blocks.remainder().chunks(8) {
        let mut buf = [0u8; 8];
        buf[..w.len()].copy_from_slice(w);
        h = h.wrapping_add(term(u64::from_le_bytes(buf), i));
        i = i.wrapping_add(1);
    }
    h
}

/// The checksum of `len` bytes whose terms sum to `terms`.
pub(crate) fn checksum_finish(terms: u64, len: usize) -> u64 {
    let z = (terms ^ (len as u64)).wrapping_mul(K1);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_sees_every_single_bit_flip_and_moved_words() {
        let data: Vec<u8> = (0..203u32).map(|i| (i * 37 % 251) as u8).collect();
        let base = checksum(&data);
        for bit in 0..data.len() * 8 {
            let mut d = data.clone();
            d[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(checksum(&d), base, "flip of bit {bit} unnoticed");
        }
        let mut swapped = data.clone();
        swapped.swap(0, 8);
        assert_ne!(checksum(&swapped), base);
        assert_ne!(checksum(&data[..202]), base);
    }

    #[test]
    fn header_round_trips_and_rejects_bad_fields() {
        let h = Header {
            dtype: CodecDType::BF16,
            prob_bits: 12,
            chunk_elems: 1024,
            numel: 5000,
            payload_len: 77,
        };
        let mut b = [0u8; HEADER_LEN];
        h.write(&mut b);
        assert_eq!(Header::parse(&b).unwrap(), h);
        let mut bad = b;
        bad[0] = b'X';
        assert!(matches!(
            Header::parse(&bad),
            Err(CompressError::Corrupt { .. })
        ));
        let mut bad = b;
        bad[4] = 9;
        assert!(matches!(
            Header::parse(&bad),
            Err(CompressError::UnsupportedFormat(_))
        ));
        let mut bad = b;
        bad[12] = 3; // chunk size no longer a multiple of 8
        assert!(Header::parse(&bad).is_err());
        assert!(Header::parse(&b[..39]).is_err());
    }

    #[test]
    fn worst_case_bound_counts_header_table_and_raw_bytes() {
        assert_eq!(max_encoded_len(CodecDType::BF16, 0, 1024), HEADER_LEN);
        assert_eq!(
            max_encoded_len(CodecDType::F32, 1025, 1024),
            HEADER_LEN + 2 * CHUNK_ENTRY_LEN + 4100
        );
    }
}
