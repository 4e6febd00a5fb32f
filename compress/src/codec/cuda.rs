//! The v2 codec as CUDA C for NVRTC (`kernels.cu`): count (histogram, checksum and table in one
//! pass), measure (warp per block: the blocks' lengths, then the prefix), encode (warp per
//! block, straight to the block's place); decode in one kernel;
//! and [`CudaCodec`], which launches them on a platform stream through the backend's NVRTC
//! ([`Platform::launch_module_kernel`]: compiled once per device, as a cubin for the device's
//! own architecture where NVRTC knows it, and cached, like the platform's elementwise kernels).
//! Launch shapes and the workspace layout are in the source's header comment and `Layout`.
//!
//! The hot path allocates nothing, waits for nothing and reads nothing back: per stream the
//! codec keeps a device workspace (tables and counters per tensor, a length and an offset per
//! block: no copy of the data) and a few pinned slots (with an event each), grown to the largest
//! batch seen and then reused; an encode is one host-to-device copy of the batch's
//! descriptors, three launches and one device-to-host copy of the lengths into the slot, before
//! its event; a decode the same with one launch. The host reads a length or a status only when
//! asked ([`crate::device::PendingEncode::wait_len`]), after that event.
//!
//! The same source is compiled as host C++ by this module's test (`cuda/host_compiled.rs`)
//! against the CUDA emulator's device shim (`platform/src/cuda/host_shim.h`: blocks of fiber
//! threads that meet at barriers and warp operations) and must write exactly the bytes of the
//! CPU codec (the corpus of `data` and random bit patterns) and decode them back;
//! `compress/tests/device.rs` runs [`CudaCodec`] on the cuda backend over the CUDA emulator,
//! with the work model (launches, allocations, host waits) counted by the emulator.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use hprt_platform::{
    Access, DeviceBuffer, DeviceModule, Event, KernelArg, LaunchShape, Memory, PinnedBuffer, Place,
    Platform, Stream,
};

use crate::codec::{self, v2, EncodeOptions};
use crate::device::{
    CompressedTensor, DecodeItem, DeviceCodec, DeviceWords, EncodeItem, GiveBack, PendingDecode,
    PendingEncode,
};
use crate::error::{CompressError, Result};
use crate::format::CodecDType;
use hprt_platform::sync::lock;

/// The CUDA C source of the v2 codec kernels.
pub const SOURCE: &str = include_str!("kernels.cu");
/// The module for NVRTC; its name keys the backend's per-device cache.
pub const MODULE: DeviceModule = DeviceModule {
    name: "hprt_codec_v2b.cu",
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
const HIST: usize = 512 * 8;
const COUNTERS: usize = 8 * 8;
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

/// A pinned slot of a stream: the uploaded descriptors and the results read back, with the event
/// that marks its last use; `held` keeps the memory its descriptors point into until then.
struct PinnedSlot {
    pinned: PinnedBuffer,
    done: Event,
    busy: bool,
    held: Vec<DeviceBuffer>,
}

/// What the codec keeps per stream.
struct StreamState {
    stream: Stream,
    ws: Option<DeviceBuffer>,
    tensors: usize,
    slots: Vec<PinnedSlot>,
    /// A launch sequence stopped part way: the counters may not be zero.
    dirty: bool,
}

type States = Arc<Mutex<Vec<StreamState>>>;

/// Gives a pinned slot back to its stream's pool (with the buffers to hold until its event).
struct Lease {
    states: States,
    stream: Stream,
    slot: usize,
    held: Vec<DeviceBuffer>,
}

impl GiveBack for Lease {
    /// The slot is free again; the buffers its sequence used are let go now when its event was
    /// seen complete (a finished encode or decode: the swap engine releases a tensor's memory
    /// right after), else held by the slot until its event completed.
    fn give_back(&mut self, completed: bool) {
        let held = std::mem::take(&mut self.held);
        let mut states = lock(&self.states);
        if let Some(st) = states.iter_mut().find(|s| s.stream.same_as(&self.stream)) {
            if let Some(slot) = st.slots.get_mut(self.slot) {
                slot.busy = false;
                if !completed {
                    slot.held = held;
                    return;
                }
            }
        }
        drop(states);
        drop(held);
    }
}

/// The v2 codec's CUDA kernels on a platform stream: the CPU codec's bytes for the same
/// options, with every step queued on the stream and nothing waited for until `finish`.
/// Only the cuda backend launches them; elsewhere launching is a typed `Unsupported` error.
///
/// Per stream it keeps a workspace (about 12.5 KiB per tensor of the largest batch and 12 bytes
/// per block: never a copy of the data) and pinned slots, reused by every later call; [`CudaCodec::release_workspaces`] frees them.
/// Clones share them.
#[derive(Clone, Default)]
pub struct CudaCodec {
    /// Block size and probability resolution (threads are the GPU's).
    pub encode: EncodeOptions,
    states: States,
}

impl std::fmt::Debug for CudaCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCodec")
            .field("encode", &self.encode)
            .finish_non_exhaustive()
    }
}

impl CudaCodec {
    /// A codec writing blocks of `encode`'s options.
    pub fn new(encode: EncodeOptions) -> Self {
        CudaCodec {
            encode,
            states: States::default(),
        }
    }

    /// Device bytes the workspaces hold, over all streams.
    pub fn workspace_bytes(&self) -> usize {
        lock(&self.states)
            .iter()
            .filter_map(|s| s.ws.as_ref().map(DeviceBuffer::len))
            .sum()
    }

    /// Lets go of every stream's workspace and pinned slots not leased to a pending operation
    /// (the platform frees them once the work queued on them finished); the next call on a
    /// stream allocates again.
    pub fn release_workspaces(&self) {
        let mut states = lock(&self.states);
        for st in states.iter_mut() {
            st.ws = None;
            st.tensors = 0;
            for slot in st.slots.iter_mut().filter(|s| !s.busy) {
                slot.held.clear();
            }
        }
        states.retain(|s| s.slots.iter().any(|slot| slot.busy));
    }

    /// Encodes every tensor of `items` with one launch sequence (three kernels whatever their
    /// number), one upload of their descriptors and one read-back of their lengths; the pending
    /// encodings share one event, and waiting for the first waits for all. The source and
    /// scratch buffers are held until the sequence ran.
    pub fn encode_batch_async(
        &self,
        p: &dyn Platform,
        items: &[EncodeItem<'_>],
        s: &Stream,
    ) -> Result<Vec<PendingEncode>> {
        self.encode.validate(v2::BLOCK_ALIGN)?;
        let mut descs = Vec::with_capacity(items.len());
        for it in items {
            if it.numel >= v2::MAX_NUMEL {
                return Err(CompressError::InvalidArgument(format!(
                    "{} elements: version 2 encodes fewer than 2^48",
                    it.numel
                )));
            }
            let max = self.max_encoded_len(it.dtype, it.numel);
            if it.scratch.len() < max {
                return Err(CompressError::InvalidArgument(format!(
                    "scratch buffer of {} bytes is below the worst case of {max}",
                    it.scratch.len()
                )));
            }
            let bytes = it.numel * it.dtype.size();
            it.src
                .mem
                .check_range("codec_encode", it.src.offset, bytes)?;
            descs.push(EncodeDesc {
                src: (it.src.mem.device_ptr() + it.src.offset) as u64,
                dst: it.scratch.device_ptr() as u64,
                dtype: it.dtype,
                numel: it.numel,
            });
        }
        // Empty tensors are the same few bytes every time: the CPU codec's, uploaded with the
        // descriptors; the kernels code the others.
        let empties: Vec<Option<Vec<u8>>> = items
            .iter()
            .map(|it| {
                (it.numel == 0)
                    .then(|| codec::encode(it.dtype, &[], &self.encode))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        let coded: Vec<EncodeDesc> = descs.iter().copied().filter(|d| d.numel > 0).collect();
        let held: Vec<DeviceBuffer> = items
            .iter()
            .flat_map(|it| [it.src.mem.clone(), it.scratch.clone()])
            .collect();
        let opts = self.encode.clone();
        let extra: usize = empties.iter().flatten().map(Vec::len).sum();
        let run = |ws: &DeviceBuffer, l: &Layout, slot: &PinnedBuffer| -> Result<()> {
            // The empty tensors' bytes, from the slot after the descriptors.
            let mut at = l.upload.len();
            for (it, bytes) in items.iter().zip(&empties) {
                if let Some(b) = bytes {
                    p.copy_async(
                        Memory::Device(it.scratch),
                        0,
                        Memory::Pinned(slot),
                        at,
                        b.len(),
                        s,
                    )?;
                    at += b.len();
                }
            }
            if coded.is_empty() {
                return Ok(());
            }
            for (k, shape) in encode_shapes(l.blocks) {
                launch(p, ws, k, shape, s)?;
            }
            Ok(())
        };
        let (words, done) = self.sequence(
            p,
            s,
            coded.len(),
            |tensors| Layout::encode(tensors, &coded, &opts),
            |l, slot| {
                let mut at = l.upload.len();
                for b in empties.iter().flatten() {
                    // SAFETY: a slot is written only while no queued copy uses it (its event
                    // completed, see `sequence`).
                    unsafe { slot.write_unsynchronized(at, b) }?;
                    at += b.len();
                }
                Ok(())
            },
            extra,
            run,
            held,
        )?;
        let mut k = 0;
        Ok(items
            .iter()
            .zip(&empties)
            .map(|(it, empty)| {
                let (index, known) = match empty {
                    Some(b) => (0, Some(b.len())),
                    None => {
                        k += 1;
                        (k - 1, None)
                    }
                };
                PendingEncode::from_device(
                    it.scratch,
                    done.clone(),
                    Arc::clone(&words),
                    index,
                    known,
                    it.dtype,
                    it.numel,
                )
            })
            .collect())
    }

    /// Decodes every tensor of `items` with one kernel launch; as
    /// [`CudaCodec::encode_batch_async`], the pending decodings share one event.
    pub fn decode_batch_async(
        &self,
        p: &dyn Platform,
        items: &[DecodeItem<'_>],
        s: &Stream,
    ) -> Result<Vec<PendingDecode>> {
        let mut descs = Vec::with_capacity(items.len());
        for it in items {
            let src = it.src;
            it.dst
                .mem
                .check_range("codec_decode", it.dst.offset, src.original_len())?;
            src.device_buffer()
                .check_range("codec_decode", 0, src.byte_len())?;
            descs.push(DecodeDesc {
                enc: src.device_buffer().device_ptr() as u64,
                enc_len: src.byte_len(),
                dst: (it.dst.mem.device_ptr() + it.dst.offset) as u64,
                dtype: src.dtype(),
                numel: src.numel(),
            });
        }
        let held: Vec<DeviceBuffer> = items
            .iter()
            .flat_map(|it| [it.src.device_buffer().clone(), it.dst.mem.clone()])
            .collect();
        let shape = decode_shape(&descs, self.encode.chunk_elems);
        let (words, done) = self.sequence(
            p,
            s,
            descs.len(),
            |tensors| Layout::decode(tensors, &descs),
            |_, _| Ok(()),
            0,
            |ws, _, _| {
                if descs.is_empty() {
                    return Ok(());
                }
                launch(p, ws, 3, shape, s)
            },
            held,
        )?;
        Ok((0..items.len())
            .map(|i| PendingDecode::from_device(done.clone(), Arc::clone(&words), i, status_result))
            .collect())
    }

    /// One launch sequence on `s`: the stream's workspace (grown and zeroed if `layout` does not
    /// fit it), a free pinned slot (grown if needed), the upload of the layout's descriptors,
    /// `run`, the read-back of `n` result words and the slot's event. Allocates only while
    /// growing; never waits.
    #[allow(clippy::too_many_arguments)]
    fn sequence(
        &self,
        p: &dyn Platform,
        s: &Stream,
        n: usize,
        layout: impl Fn(usize) -> Layout,
        fill: impl FnOnce(&Layout, &PinnedBuffer) -> Result<()>,
        extra: usize,
        run: impl FnOnce(&DeviceBuffer, &Layout, &PinnedBuffer) -> Result<()>,
        held: Vec<DeviceBuffer>,
    ) -> Result<(Arc<DeviceWords>, Event)> {
        let mut states = lock(&self.states);
        // A stream whose handle value came back for a new stream is another stream.
        states.retain(|st| st.stream.is_live() || st.slots.iter().any(|slot| slot.busy));
        let at = match states.iter().position(|st| st.stream.same_as(s)) {
            Some(i) => i,
            None => {
                states.push(StreamState {
                    stream: s.clone(),
                    ws: None,
                    tensors: 0,
                    slots: Vec::new(),
                    dirty: false,
                });
                states.len() - 1
            }
        };
        let st = &mut states[at];
        let mut l = layout(st.tensors);
        let fits = st.ws.as_ref().is_some_and(|ws| ws.len() >= l.len) && l.tensors == st.tensors;
        if !fits {
            // Grown to this batch (or the largest before it), zeroed once.
            let tensors = l.tensors.max(st.tensors);
            l = layout(tensors);
            let len = l.len.max(st.ws.as_ref().map_or(0, DeviceBuffer::len));
            let ws = p.alloc_device(len)?;
            p.memset_async(&ws, 0, 0, len, s)?;
            st.ws = Some(ws);
            st.tensors = tensors;
            st.dirty = false;
        }
        let ws = st.ws.clone().expect("allocated above");
        if st.dirty {
            // Counters and counts, as far as this workspace has them.
            let full = (COUNTERS + HIST) * st.tensors;
            p.memset_async(&ws, l.zero_at, 0, full.min(ws.len() - l.zero_at), s)?;
            st.dirty = false;
        }
        let results_in_slot = l.upload.len() + extra;
        let need = results_in_slot + 8 * n.max(1);
        // A free slot whose last use finished (the event query does not wait), else a new one.
        let mut chosen = None;
        for (i, slot) in st.slots.iter_mut().enumerate() {
            if !slot.busy && p.query_event(&slot.done)? {
                slot.held.clear();
                if slot.pinned.len() >= need {
                    chosen = Some(i);
                    break;
                }
                if chosen.is_none() {
                    slot.pinned = p.alloc_pinned(need)?;
                    chosen = Some(i);
                    break;
                }
            }
        }
        let i = match chosen {
            Some(i) => i,
            None => {
                st.slots.push(PinnedSlot {
                    pinned: p.alloc_pinned(need)?,
                    done: p.create_event(false)?,
                    busy: false,
                    held: Vec::new(),
                });
                st.slots.len() - 1
            }
        };
        let slot = &mut st.slots[i];
        let pinned = slot.pinned.clone();
        let done = slot.done.clone();
        // SAFETY: the slot's last use finished (its event completed, or it is new).
        unsafe { pinned.write_unsynchronized(0, &l.upload) }?;
        fill(&l, &pinned)?;
        slot.busy = true;
        let queued = (|| -> Result<()> {
            p.copy_async(
                Memory::Device(&ws),
                0,
                Memory::Pinned(&pinned),
                0,
                l.upload.len(),
                s,
            )?;
            run(&ws, &l, &pinned)?;
            if n > 0 {
                p.copy_async(
                    Memory::Pinned(&pinned),
                    results_in_slot,
                    Memory::Device(&ws),
                    l.results_at,
                    8 * n,
                    s,
                )?;
            }
            Ok(())
        })();
        // Recorded on failure too: the slot is reused only after what was queued ran.
        let recorded = p.record_event(&done, s);
        if let Err(e) = queued.and(recorded.map_err(CompressError::from)) {
            st.dirty = true;
            let slot = &mut st.slots[i];
            slot.busy = false;
            slot.held = held;
            return Err(e);
        }
        let words = DeviceWords {
            words: pinned,
            at: results_in_slot,
            waited: AtomicBool::new(false),
            lease: Box::new(Lease {
                states: Arc::clone(&self.states),
                stream: s.clone(),
                slot: i,
                held,
            }),
        };
        Ok((Arc::new(words), done))
    }
}

/// Runs kernel `kernel` of [`MODULE`] on the workspace.
fn launch(
    p: &dyn Platform,
    ws: &DeviceBuffer,
    kernel: usize,
    shape: LaunchShape,
    s: &Stream,
) -> Result<()> {
    let arg = KernelArg::Ptr {
        at: ws.at(0),
        bytes: ws.len(),
        access: Access::ReadWrite,
    };
    Ok(p.launch_module_kernel(&MODULE, KERNELS[kernel], shape, &[arg], s)?)
}

impl DeviceCodec for CudaCodec {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn max_encoded_len(&self, dtype: CodecDType, numel: usize) -> usize {
        v2::max_encoded_len(dtype, numel, self.encode.chunk_elems)
    }

    fn encode_async(
        &self,
        p: &dyn Platform,
        src: Place<&DeviceBuffer>,
        dtype: CodecDType,
        numel: usize,
        scratch: &DeviceBuffer,
        s: &Stream,
    ) -> Result<PendingEncode> {
        let item = EncodeItem {
            src,
            dtype,
            numel,
            scratch,
        };
        let mut v = self.encode_batch_async(p, &[item], s)?;
        Ok(v.pop().expect("one item"))
    }

    fn decode_async(
        &self,
        p: &dyn Platform,
        src: &CompressedTensor,
        dst: Place<&DeviceBuffer>,
        s: &Stream,
    ) -> Result<PendingDecode> {
        let mut v = self.decode_batch_async(p, &[DecodeItem { src, dst }], s)?;
        Ok(v.pop().expect("one item"))
    }

    fn encode_batch_async(
        &self,
        p: &dyn Platform,
        items: &[EncodeItem<'_>],
        s: &Stream,
    ) -> Result<Vec<PendingEncode>> {
        CudaCodec::encode_batch_async(self, p, items, s)
    }

    fn decode_batch_async(
        &self,
        p: &dyn Platform,
        items: &[DecodeItem<'_>],
        s: &Stream,
    ) -> Result<Vec<PendingDecode>> {
        CudaCodec::decode_batch_async(self, p, items, s)
    }
}

#[cfg(test)]
mod host_compiled;
