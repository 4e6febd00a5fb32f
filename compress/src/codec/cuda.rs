//! The v2 codec as CUDA C for NVRTC (`kernels.cu`): count (histogram, checksum and table in one
//! pass), measure (warp per block: the blocks' lengths, then the prefix), encode (warp per
//! block, straight to the block's place); decode in one kernel. This module is what the kernels
//! expect: the source, the launch shapes, the per-batch descriptors and the workspace `Layout`
//! (see also the source's header comment). [`crate::CudaCodec`] (`device/cuda.rs`) launches
//! them on a platform stream.
//!
//! The same source is compiled as host C++ by this module's test (`cuda/host_compiled.rs`)
//! against the CUDA emulator's device shim (`platform/src/cuda/host_shim.h`: blocks of fiber
//! threads that meet at barriers and warp operations) and must write exactly the bytes of the
//! CPU codec (the corpus of `data` and random bit patterns) and decode them back;
//! `compress/tests/device.rs` runs [`crate::CudaCodec`] on the cuda backend over the CUDA
//! emulator, with the work model (launches, allocations, host waits) counted by the emulator.

use hprt_platform::{DeviceModule, LaunchShape};

use crate::codec::{v2, EncodeOptions};
use crate::error::{CompressError, Result};
use crate::format::CodecDType;

/// The CUDA C source of the v2 codec kernels.
pub const SOURCE: &str = include_str!("kernels.cu");
/// The module for NVRTC; its name keys the backend's per-device cache.
pub const MODULE: DeviceModule = DeviceModule {
    name: "hprt_codec_v2c.cu",
    source: SOURCE,
};
/// The kernels, in stream order for an encode (three) and then a decode (one).
pub const KERNELS: [&str; 4] = [
    "hprt_codec_count",
    "hprt_codec_measure",
    "hprt_codec_encode",
    "hprt_codec_decode",
];
/// Kernel launches of one encode and of one decode, whatever the batch holds (the work model
/// `compress/tests/device.rs` checks on the emulator).
pub const ENCODE_LAUNCHES: usize = 3;
pub const DECODE_LAUNCHES: usize = 1;

/// Most CTAs of one launch; the kernels loop over the rest.
const MAX_GRID: usize = 4096;
/// Most CTAs of a decode: each checks the prefix of every tensor of the batch.
const MAX_DECODE_GRID: usize = 1024;
/// Warps of an encode or decode CTA (`HPRT_WARPS`).
const WARPS: usize = 4;
/// Bytes per tensor of the workspace's regions (see `kernels.cu`).
const HEAD: usize = 128;
const DESC: usize = 128;
pub(crate) const HIST: usize = 512 * 8;
pub(crate) const COUNTERS: usize = 10 * 8;
const TABLE: usize = 512 * 16;

/// What a non-zero decoder status word of the kernels means.
pub fn status_message(status: u32) -> &'static str {
    match status {
        0 => "ok",
        1 => "bad header",
        2 => "header/table/index checksum mismatch",
        3 => "frequencies do not sum to 2^prob_bits",
        4 => "impossible block length or total length",
        5 => "non-zero padding bits after the last mantissa",
        6 => "rANS state outside [2^15, 2^31)",
        7 => "rANS stream does not end where it should",
        8 => "decoded data fails the tensor checksum",
        9 => "dtype or element count differs from the expected tensor",
        10 => "format version 1, which only the CPU codec decodes",
        _ => "unknown decoder status",
    }
}

/// The decoder's status word as a result: 0 is fine, 10 is a valid version-1 encoding (which
/// only the CPU codec decodes), anything else is corrupt input.
pub(crate) fn status_result(status: u32) -> Result<()> {
    match status {
        0 => Ok(()),
        10 => Err(CompressError::UnsupportedFormat(
            "format version 1 is decoded by the CPU codec (HostCodec), not the CUDA kernels".into(),
        )),
        s => Err(CompressError::corrupt(
            0,
            format!("the CUDA decoder reports status {s}: {}", status_message(s)),
        )),
    }
}

/// One tensor of an encode batch, by device address (the workspace's descriptors hold
/// addresses; the caller keeps the memory alive).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EncodeDesc {
    pub src: u64,
    pub dst: u64,
    pub dtype: CodecDType,
    pub numel: usize,
}

/// One tensor of a decode batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeDesc {
    pub enc: u64,
    pub enc_len: usize,
    pub dst: u64,
    pub dtype: CodecDType,
    pub numel: usize,
}

/// The workspace of one launch sequence: a header and the descriptors (uploaded), then per
/// tensor of capacity `tensors` the counts and counters (zero between sequences), tables and
/// results, then per block lengths and offsets. The regions that must be
/// zero sit at places that depend on the tensor capacity alone, so a workspace stays valid for
/// every batch it fits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Tensors the per-tensor regions have room for.
    pub tensors: usize,
    /// The header and descriptors, as uploaded (`upload.len()` bytes at offset 0).
    pub upload: Vec<u8>,
    /// The zeroed region (histograms and counters).
    pub zero_at: usize,
    pub zero_len: usize,
    /// Where the kernels leave one u64 per tensor (encode: length; decode: status).
    pub results_at: usize,
    /// Bytes the workspace needs.
    pub len: usize,
    /// Global blocks of an encode (0 for a decode).
    pub blocks: usize,
}

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

fn put(buf: &mut [u8], word: usize, v: u64) {
    buf[word * 8..word * 8 + 8].copy_from_slice(&v.to_le_bytes());
}

impl Layout {
    /// The regions of a workspace for `tensors`: a decode needs them up to its counters (a
    /// few hundred bytes a tensor), an encode all.
    fn base(tensors: usize, n: usize) -> (Layout, usize) {
        let desc_at = HEAD;
        let results_at = desc_at + DESC * tensors;
        let zero_at = results_at + 8 * tensors;
        let counters_at = zero_at;
        let hist_at = counters_at + COUNTERS * tensors;
        let table_at = hist_at + HIST * tensors;
        let end = table_at + TABLE * tensors;
        let mut upload = vec![0u8; HEAD + DESC * n];
        for (word, v) in [
            (0, n),
            (2, hist_at),
            (3, table_at),
            (4, counters_at),
            (5, results_at),
            (8, desc_at),
        ] {
            put(&mut upload, word, v as u64);
        }
        let l = Layout {
            tensors,
            upload,
            zero_at,
            zero_len: table_at - zero_at,
            results_at,
            len: end,
            blocks: 0,
        };
        (l, end)
    }

    /// An encode of `items` (none empty) with blocks of `opts`.
    pub(crate) fn encode(tensors: usize, items: &[EncodeDesc], opts: &EncodeOptions) -> Layout {
        let tensors = tensors.max(items.len());
        let (mut l, end) = Layout::base(tensors, items.len());
        let block = opts.chunk_elems;
        let blocks: usize = items.iter().map(|d| d.numel.div_ceil(block)).sum();
        let lens_at = align16(end);
        let offsets_at = align16(lens_at + 4 * blocks);
        put(&mut l.upload, 1, blocks as u64);
        put(&mut l.upload, 6, lens_at as u64);
        put(&mut l.upload, 7, offsets_at as u64);
        let mut first = 0;
        for (t, d) in items.iter().enumerate() {
            let nb = d.numel.div_ceil(block);
            let w = (HEAD + DESC * t) / 8;
            for (f, v) in [
                (0, d.src),
                (1, d.dst),
                (2, d.numel as u64),
                (4, d.dtype.code() as u64),
                (5, d.dtype.size() as u64),
                (6, d.dtype.mantissa_bits() as u64),
                (7, opts.prob_bits as u64),
                (8, block as u64),
                (9, nb as u64),
                (10, first as u64),
            ] {
                put(&mut l.upload, w + f, v);
            }
            first += nb;
        }
        l.len = align16(offsets_at + 8 * blocks);
        l.blocks = blocks;
        l
    }

    /// A decode of `items`.
    pub(crate) fn decode(tensors: usize, items: &[DecodeDesc]) -> Layout {
        let tensors = tensors.max(items.len());
        let (mut l, _) = Layout::base(tensors, items.len());
        // Neither counts nor tables: a stream that only decodes keeps a few hundred bytes.
        l.zero_len = COUNTERS * tensors;
        l.len = l.zero_at + l.zero_len;
        for (t, d) in items.iter().enumerate() {
            // Every block holds at least 32 elements and has a 4-byte index entry: this bounds
            // the blocks the decoder accepts whatever the header declares.
            let max_blocks = d.numel.div_ceil(v2::BLOCK_ALIGN).min(d.enc_len / 4);
            let w = (HEAD + DESC * t) / 8;
            for (f, v) in [
                (0, d.enc),
                (1, d.dst),
                (2, d.numel as u64),
                (3, d.enc_len as u64),
                (4, d.dtype.code() as u64),
                (5, d.dtype.size() as u64),
                (6, d.dtype.mantissa_bits() as u64),
                (9, max_blocks as u64),
            ] {
                put(&mut l.upload, w + f, v);
            }
        }
        l
    }
}

/// Launch shapes: (kernel, grid, threads per CTA).
pub(crate) fn encode_shapes(blocks: usize) -> [(usize, LaunchShape); 3] {
    let g = |n: usize| n.clamp(1, MAX_GRID) as u32;
    [
        (
            0,
            LaunchShape {
                grid: g(blocks),
                block: 256,
            },
        ),
        (
            1,
            LaunchShape {
                grid: g(blocks.div_ceil(WARPS)),
                block: 32 * WARPS as u32,
            },
        ),
        (
            2,
            LaunchShape {
                grid: g(blocks.div_ceil(WARPS)),
                block: 32 * WARPS as u32,
            },
        ),
    ]
}

/// The decode's shape: enough warps for the blocks expected at `block_elems` elements a block
/// (an encoding with smaller blocks is decoded by fewer warps per block, not wrongly).
pub(crate) fn decode_shape(items: &[DecodeDesc], block_elems: usize) -> LaunchShape {
    let blocks: usize = items
        .iter()
        .map(|d| d.numel.div_ceil(block_elems.max(1)))
        .sum();
    LaunchShape {
        grid: blocks.div_ceil(WARPS).clamp(1, MAX_DECODE_GRID) as u32,
        block: 32 * WARPS as u32,
    }
}

#[cfg(test)]
mod host_compiled;
