//! The v2 codec as CUDA C for NVRTC (`kernels.cu`): count (histogram, checksum and table in one
//! pass), measure (warp per block: the blocks' lengths, then the prefix), encode (warp per
//! block, straight to the block's place); decode in one kernel;
//! and [`CudaCodec`], which launches them on a platform stream through the backend's NVRTC
//! ([`Platform::launch_module_kernel`]: compiled once per device, as a cubin for the device's
//! own architecture where NVRTC knows it, and cached, like the platform's elementwise kernels).
//! Launch shapes and the workspace layout are in the source's header comment and `Layout`.
//! (Over 800 lines because the launcher and its host-compiled byte-equality tests belong with
//! the source they check.)
//!
//! The hot path allocates nothing, waits for nothing and reads nothing back: per stream the
//! codec keeps a device workspace (tables and counters per tensor, a length and an offset per
//! block: no copy of the data) and a few pinned slots (with an event each), grown to the largest
//! batch seen and then reused; an encode is one host-to-device copy of the batch's
//! descriptors, three launches and one device-to-host copy of the lengths into the slot, before
//! its event; a decode the same with one launch. The host reads a length or a status only when
//! asked ([`crate::device::PendingEncode::wait_len`]), after that event.
//!
//! The same source is compiled as host C++ by this module's test against the CUDA emulator's
//! device shim (`platform/src/cuda/host_shim.h`: blocks of fiber threads that meet at barriers
//! and warp operations) and must write exactly the bytes of the CPU codec (the corpus of `data`
//! and random bit patterns) and decode them back; `compress/tests/device.rs` runs [`CudaCodec`]
//! on the cuda backend over the CUDA emulator, with the work model (launches, allocations, host
//! waits) counted by the emulator.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use hprt_platform::{
    Access, BufRef, DeviceBuffer, DeviceModule, Event, KernelArg, LaunchShape, Mem, PinnedBuffer,
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
                .buf
                .check_range("codec_encode", it.src.offset, bytes)?;
            descs.push(EncodeDesc {
                src: (it.src.buf.device_ptr() + it.src.offset) as u64,
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
            .flat_map(|it| [it.src.buf.clone(), it.scratch.clone()])
            .collect();
        let opts = self.encode.clone();
        let extra: usize = empties.iter().flatten().map(Vec::len).sum();
        let run = |ws: &DeviceBuffer, l: &Layout, slot: &PinnedBuffer| -> Result<()> {
            // The empty tensors' bytes, from the slot after the descriptors.
            let mut at = l.upload.len();
            for (it, bytes) in items.iter().zip(&empties) {
                if let Some(b) = bytes {
                    p.copy_async(
                        Mem::Device(it.scratch),
                        0,
                        Mem::Pinned(slot),
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
                .buf
                .check_range("codec_decode", it.dst.offset, src.original_len())?;
            src.device_buffer()
                .check_range("codec_decode", 0, src.byte_len())?;
            descs.push(DecodeDesc {
                enc: src.device_buffer().device_ptr() as u64,
                enc_len: src.byte_len(),
                dst: (it.dst.buf.device_ptr() + it.dst.offset) as u64,
                dtype: src.dtype(),
                numel: src.numel(),
            });
        }
        let held: Vec<DeviceBuffer> = items
            .iter()
            .flat_map(|it| [it.src.device_buffer().clone(), it.dst.buf.clone()])
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
                Mem::Device(&ws),
                0,
                Mem::Pinned(&pinned),
                0,
                l.upload.len(),
                s,
            )?;
            run(&ws, &l, &pinned)?;
            if n > 0 {
                p.copy_async(
                    Mem::Pinned(&pinned),
                    results_in_slot,
                    Mem::Device(&ws),
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
        src: BufRef<'_>,
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
        dst: BufRef<'_>,
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
mod host_compiled {
    use super::*;
    use crate::codec::{encode, v2, EncodeOptions};
    use crate::data::{generate, DataKind, SplitMix64};
    use crate::CodecDType;

    /// The emulator's device shim (fiber threads per block, warp operations), so the kernels
    /// run here with their launch shapes as on the emulator.
    const SHIM: &str = include_str!("../../../platform/src/cuda/host_shim.h");

    /// A launcher per kernel: `test_launch(kernel index, grid, block, workspace)`.
    const LAUNCHERS: &str = r#"
template <class F> static void hprt_test_body(void* p) { (*static_cast<F*>(p))(); }
template <class F> static int hprt_test_run(unsigned grid, unsigned block, F f) {
    unsigned d[6] = {grid, 1, 1, block, 1, 1};
    return ::hprt_emu::run_grid(d, 0, true, hprt_test_body<F>, &f);
}
extern "C" int hprt_test_launch(unsigned k, unsigned grid, unsigned block, u8* ws) {
    switch (k) {
    case 0: return hprt_test_run(grid, block, [=] { hprt_codec_count(ws); });
    case 1: return hprt_test_run(grid, block, [=] { hprt_codec_measure(ws); });
    case 2: return hprt_test_run(grid, block, [=] { hprt_codec_encode(ws); });
    case 3: return hprt_test_run(grid, block, [=] { hprt_codec_decode(ws); });
    }
    return 2;
}
extern "C" void hprt_test_bytes(u64* read, u64* written, int reset) {
    *read = hprt_bytes_read;
    *written = hprt_bytes_written;
    if (reset) hprt_bytes_read = hprt_bytes_written = 0;
}
"#;

    /// The compiled source, built once per process; the lock serialises the tests (the
    /// shim's grid state is per thread, but the build is shared).
    fn library() -> std::sync::MutexGuard<'static, libloading::Library> {
        static LIB: std::sync::OnceLock<std::sync::Mutex<libloading::Library>> =
            std::sync::OnceLock::new();
        hprt_platform::sync::lock(LIB.get_or_init(|| std::sync::Mutex::new(compile())))
    }

    fn compile() -> libloading::Library {
        let dir = std::env::temp_dir().join(format!("hprt-codec-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, lib) = (dir.join("codec.cpp"), dir.join("libcodec.so"));
        std::fs::write(&src, format!("{SHIM}\n{SOURCE}\n{LAUNCHERS}")).unwrap();
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = std::process::Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O2",
                "-shared",
                "-fPIC",
                "-Wall",
                "-Werror",
                "-Wno-unused-function",
                "-DHPRT_COUNT_BYTES",
                "-o",
            ])
            .arg(&lib)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the C++ compiler {cxx:?}: {e}"));
        assert!(
            out.status.success(),
            "the codec kernel source does not compile:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: a library we just built from our own source.
        unsafe { libloading::Library::new(&lib) }.unwrap()
    }

    type Launch = unsafe extern "C" fn(u32, u32, u32, *mut u8) -> i32;

    /// A zeroed 16-byte-aligned workspace of `len` bytes with `l`'s upload at its start.
    fn workspace(l: &Layout) -> Vec<u128> {
        let mut ws = vec![0u128; l.len.div_ceil(16)];
        // SAFETY: `ws` has at least `l.len >= upload.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                l.upload.as_ptr(),
                ws.as_mut_ptr() as *mut u8,
                l.upload.len(),
            )
        };
        ws
    }

    fn run(
        lib: &libloading::Library,
        k: usize,
        shape: LaunchShape,
        ws: &mut [u128],
        cap: Option<u32>,
    ) {
        // SAFETY: the signature `LAUNCHERS` defines.
        let f = unsafe { *lib.get::<Launch>(b"hprt_test_launch\0").unwrap() };
        let grid = cap.map_or(shape.grid, |c| shape.grid.min(c));
        // SAFETY: the workspace holds the layout the kernels read; the addresses in it are
        // live host buffers of the sizes the descriptors give.
        let r = unsafe { f(k as u32, grid, shape.block, ws.as_mut_ptr() as *mut u8) };
        assert_eq!(r, 0, "kernel {} failed (divergent barrier?)", KERNELS[k]);
    }

    fn result(ws: &[u128], l: &Layout, t: usize) -> u64 {
        // SAFETY: in bounds of the workspace.
        let p = unsafe { (ws.as_ptr() as *const u8).add(l.results_at + 8 * t) };
        u64::from_le_bytes(
            // SAFETY: the 8 bytes at `p` are tensor `t`'s result slot (`t < l.tensors`), inside
            // the workspace of `l.len` bytes borrowed for this call; its u128s are initialised
            // and any byte is a valid u8.
            unsafe { std::slice::from_raw_parts(p, 8) }
                .try_into()
                .unwrap(),
        )
    }

    /// The zeroed region is zero again after a sequence (what lets the next one skip a
    /// memset), but for each tensor's total and prefix length, which are written before read.
    fn assert_counters_zero(ws: &[u128], l: &Layout) {
        // SAFETY: in bounds.
        let z = unsafe {
            std::slice::from_raw_parts((ws.as_ptr() as *const u8).add(l.zero_at), l.zero_len)
        };
        let counters = COUNTERS * l.tensors;
        for (i, w) in z.chunks(8).enumerate() {
            if i * 8 < counters && matches!(i % 8, 3 | 4) {
                continue;
            }
            assert!(w.iter().all(|&b| b == 0), "counter word {i} left non-zero");
        }
    }

    /// The encode launches on host memory, for a batch; each tensor's encoding.
    fn kernel_encode_batch(
        lib: &libloading::Library,
        tensors: &[(CodecDType, &[u8])],
        opts: &EncodeOptions,
        cap: Option<u32>,
    ) -> Vec<Vec<u8>> {
        let mut outs: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(d, b)| vec![0u8; v2::max_encoded_len(*d, b.len() / d.size(), opts.chunk_elems)])
            .collect();
        let descs: Vec<EncodeDesc> = tensors
            .iter()
            .zip(outs.iter_mut())
            .map(|((dtype, data), out)| EncodeDesc {
                src: data.as_ptr() as u64,
                dst: out.as_mut_ptr() as u64,
                dtype: *dtype,
                numel: data.len() / dtype.size(),
            })
            .collect();
        let l = Layout::encode(descs.len(), &descs, opts);
        let mut ws = workspace(&l);
        for (k, shape) in encode_shapes(l.blocks) {
            run(lib, k, shape, &mut ws, cap);
        }
        assert_counters_zero(&ws, &l);
        outs.iter_mut()
            .enumerate()
            .map(|(t, out)| {
                out.truncate(result(&ws, &l, t) as usize);
                std::mem::take(out)
            })
            .collect()
    }

    fn kernel_encode(
        lib: &libloading::Library,
        dtype: CodecDType,
        data: &[u8],
        pb: u32,
        block: usize,
    ) -> Vec<u8> {
        let opts = EncodeOptions {
            chunk_elems: block,
            prob_bits: pb,
            threads: 1,
        };
        kernel_encode_batch(lib, &[(dtype, data)], &opts, None)
            .pop()
            .unwrap()
    }

    /// The decode launch; the decoded bytes and the status word.
    fn kernel_decode_with(
        lib: &libloading::Library,
        dtype: CodecDType,
        numel: usize,
        enc: &[u8],
        cap: Option<u32>,
    ) -> (Vec<u8>, u32) {
        let mut out = vec![0u8; numel * dtype.size()];
        let descs = [DecodeDesc {
            enc: enc.as_ptr() as u64,
            enc_len: enc.len(),
            dst: out.as_mut_ptr() as u64,
            dtype,
            numel,
        }];
        let l = Layout::decode(1, &descs);
        let mut ws = workspace(&l);
        run(lib, 3, decode_shape(&descs, 256), &mut ws, cap);
        assert_counters_zero(&ws, &l);
        let status = result(&ws, &l, 0) as u32;
        (out, status)
    }

    fn kernel_decode(
        lib: &libloading::Library,
        dtype: CodecDType,
        numel: usize,
        enc: &[u8],
    ) -> (Vec<u8>, u32) {
        kernel_decode_with(lib, dtype, numel, enc, None)
    }

    /// As `kernel_decode` on one CTA of one warp (the cheapest launch to repeat).
    fn kernel_decode_small(
        lib: &libloading::Library,
        dtype: CodecDType,
        numel: usize,
        enc: &[u8],
    ) -> (Vec<u8>, u32) {
        let mut out = vec![0u8; numel * dtype.size()];
        let descs = [DecodeDesc {
            enc: enc.as_ptr() as u64,
            enc_len: enc.len(),
            dst: out.as_mut_ptr() as u64,
            dtype,
            numel,
        }];
        let l = Layout::decode(1, &descs);
        let mut ws = workspace(&l);
        run(lib, 3, LaunchShape { grid: 1, block: 32 }, &mut ws, None);
        assert_counters_zero(&ws, &l);
        (out, result(&ws, &l, 0) as u32)
    }

    fn corpus() -> Vec<(CodecDType, Vec<u8>)> {
        let mut rng = SplitMix64::new(99);
        let mut out = Vec::new();
        for dtype in CodecDType::ALL {
            for kind in DataKind::ALL {
                out.push((dtype, generate(kind, dtype, 20_000 + 13, 3)));
            }
            // Random bit patterns: every symbol, NaN payloads, subnormals.
            let n = 5_000 * dtype.size() + dtype.size() * 7;
            out.push((dtype, (0..n).map(|_| rng.next_u64() as u8).collect()));
            // Skewed random patterns: few symbols, random mantissas.
            out.push((
                dtype,
                (0..4_001)
                    .flat_map(|_| {
                        let r = rng.next_u64();
                        let v = (r >> 40) as u32 & 0x3 | (r as u32) << 2;
                        v.to_le_bytes()[..dtype.size()].to_vec()
                    })
                    .collect(),
            ));
        }
        out
    }

    /// The count kernel's table (FORMAT.md's normalisation) against `v2::normalize`, on data
    /// whose symbol counts are given: equal counts (every unit moved is a tie), few distinct
    /// counts, skewed, random, a lone symbol.
    #[test]
    fn count_kernel_builds_the_cpu_codecs_table_with_ties_either_way() {
        let lib = library();
        let mut r = SplitMix64::new(11);
        for pb in [9, 12, 14] {
            for dtype in [CodecDType::F16, CodecDType::BF16] {
                let a = 1usize << dtype.symbol_bits();
                let w = dtype.mantissa_bits();
                let cases: Vec<Vec<u64>> = vec![
                    (0..a).map(|_| 3).collect(),
                    (0..a).map(|s| if s % 3 == 0 { 7 } else { 0 }).collect(),
                    (0..a).map(|_| 1 + r.next_u64() % 3).collect(),
                    (0..a).map(|s| 20_000 >> (s / 2).min(14)).collect(),
                    (0..a).map(|_| r.next_u64() % 100).collect(),
                    (0..a).map(|s| (s == 5) as u64 * 9).collect(),
                ];
                for counts in cases {
                    let data: Vec<u8> = counts
                        .iter()
                        .enumerate()
                        .flat_map(|(s, &c)| {
                            std::iter::repeat_n(((s as u16) << w).to_le_bytes(), c as usize)
                        })
                        .flatten()
                        .collect();
                    let numel = data.len() / 2;
                    let opts = EncodeOptions {
                        chunk_elems: 16_384,
                        prob_bits: pb,
                        threads: 1,
                    };
                    let descs = [EncodeDesc {
                        src: data.as_ptr() as u64,
                        dst: 0,
                        dtype,
                        numel,
                    }];
                    let l = Layout::encode(1, &descs, &opts);
                    let mut ws = workspace(&l);
                    let (k, shape) = encode_shapes(l.blocks)[0];
                    run(&lib, k, shape, &mut ws, Some(3));
                    // SAFETY: the table region of tensor 0 (512 entries of 16 bytes).
                    let table: &[u8] = unsafe {
                        let at = u64::from_le_bytes(
                            std::slice::from_raw_parts((ws.as_ptr() as *const u8).add(24), 8)
                                .try_into()
                                .unwrap(),
                        ) as usize;
                        std::slice::from_raw_parts((ws.as_ptr() as *const u8).add(at), 512 * 16)
                    };
                    let freq = v2::normalize(&counts, pb);
                    let cpu = crate::codec::rans::enc_table(&freq, pb);
                    for s in 0..512 {
                        let e = &table[16 * s..16 * s + 16];
                        let word =
                            |k: usize| u32::from_le_bytes(e[4 * k..4 * k + 4].try_into().unwrap());
                        let c = &cpu[s];
                        assert_eq!(
                            (word(0), word(1), word(2), word(3)),
                            (
                                c.x_max,
                                c.rcp,
                                c.bias,
                                c.cmpl as u32 | (c.shift as u32) << 16
                            ),
                            "{dtype} {pb} bits, symbol {s}, {counts:?}"
                        );
                    }
                }
            }
        }
    }

    /// Bytes the kernels read and wrote since the last call (the source's work-model counters).
    fn bytes_moved(lib: &libloading::Library) -> (u64, u64) {
        type Bytes = unsafe extern "C" fn(*mut u64, *mut u64, i32);
        let (mut r, mut w) = (0, 0);
        // SAFETY: the signature `LAUNCHERS` defines.
        unsafe { lib.get::<Bytes>(b"hprt_test_bytes\0").unwrap()(&mut r, &mut w, 1) };
        (r, w)
    }

    /// The work model in bytes: an encode reads its input three times (count, measure, code)
    /// and writes the encoding once; a decode reads the encoding once (plus the prefix per
    /// CTA) and writes the tensor once. A change that adds a pass over the data fails here.
    #[test]
    fn kernels_move_the_modelled_bytes_per_input_byte() {
        let lib = library();
        let data = generate(DataKind::Gelu, CodecDType::BF16, 200_000, 9);
        let opts = EncodeOptions {
            chunk_elems: 16_384,
            prob_bits: 12,
            threads: 1,
        };
        bytes_moved(&lib);
        let enc = kernel_encode_batch(&lib, &[(CodecDType::BF16, &data)], &opts, None)
            .pop()
            .unwrap();
        let (er, ew) = bytes_moved(&lib);
        let (back, status) = kernel_decode_with(&lib, CodecDType::BF16, 200_000, &enc, Some(4));
        let (dr, dw) = bytes_moved(&lib);
        assert_eq!(status, 0);
        assert!(back == data);
        let (n, c) = (data.len() as f64, enc.len() as f64);
        let per = |b: u64| b as f64 / n;
        eprintln!(
            "per input byte (ratio {:.3}): encode reads {:.3}, writes {:.3}; decode reads {:.3}, writes {:.3}",
            n / c,
            per(er),
            per(ew),
            per(dr),
            per(dw)
        );
        assert!(per(er) <= 3.0 + 0.01, "encode reads {er}");
        assert!(per(ew) <= c / n + 0.01, "encode writes {ew}");
        let prefix = crate::codec::inspect(&enc).unwrap().offsets[0] as f64;
        let ctas = 4.0;
        assert!(
            per(dr) <= (c + ctas * prefix) / n + 0.01,
            "decode reads {dr}"
        );
        assert!(per(dw) <= 1.0 + 0.001, "decode writes {dw}");
    }

    #[test]
    fn kernels_write_the_cpu_codecs_bytes_and_decode_them() {
        let lib = library();
        for (dtype, data) in corpus() {
            for (pb, block) in [(12, v2::DEFAULT_BLOCK_ELEMS), (11, 1024), (14, 96)] {
                let opts = EncodeOptions {
                    chunk_elems: block,
                    prob_bits: pb,
                    threads: 1,
                };
                let cpu = encode(dtype, &data, &opts).unwrap();
                let dev = kernel_encode(&lib, dtype, &data, pb, block);
                assert!(
                    dev == cpu,
                    "{dtype}, {pb} bits, blocks of {block}: the bytes differ"
                );
                let numel = data.len() / dtype.size();
                let (back, status) = kernel_decode(&lib, dtype, numel, &cpu);
                assert_eq!(status, 0, "{dtype}: {}", status_message(status));
                assert!(back == data, "{dtype}: the kernels decode other bytes");
            }
        }
    }

    /// A batch of tensors of every dtype, sizes and alignments (one misaligned source), on a
    /// few CTAs (so every kernel loops over blocks of several tensors): each is the CPU codec's
    /// bytes; and decoded with a grid of 2 (the last-CTA finish across CTAs).
    #[test]
    fn one_launch_sequence_encodes_a_batch_as_the_cpu_codec() {
        let lib = library();
        let mut rng = SplitMix64::new(5);
        let random: Vec<u8> = (0..8_003).map(|_| rng.next_u64() as u8).collect();
        let gelu = generate(DataKind::Gelu, CodecDType::BF16, 9_001, 1);
        let soft = generate(DataKind::Softmax, CodecDType::F16, 3_000, 2);
        let w32 = generate(DataKind::Weights, CodecDType::F32, 2_500, 3);
        let mut shifted = vec![0u8; gelu.len() + 1];
        shifted[1..].copy_from_slice(&gelu);
        let tensors: Vec<(CodecDType, &[u8])> = vec![
            (CodecDType::BF16, &gelu),
            (CodecDType::F16, &soft),
            (CodecDType::F32, &w32),
            (CodecDType::BF16, &shifted[1..]),
            (CodecDType::BF16, &random[..2 * 40]),
            (CodecDType::F32, &random[..4 * 2_000]),
        ];
        for (pb, block, cap) in [(12, 1024, Some(2)), (13, 96, Some(5)), (12, 65_536, None)] {
            let opts = EncodeOptions {
                chunk_elems: block,
                prob_bits: pb,
                threads: 1,
            };
            let encs = kernel_encode_batch(&lib, &tensors, &opts, cap);
            for ((dtype, data), enc) in tensors.iter().zip(&encs) {
                assert!(
                    *enc == encode(*dtype, data, &opts).unwrap(),
                    "{dtype} x {}, blocks of {block}: not the CPU codec's bytes",
                    data.len()
                );
                let (back, status) =
                    kernel_decode_with(&lib, *dtype, data.len() / dtype.size(), enc, Some(2));
                assert_eq!(status, 0, "{}", status_message(status));
                assert!(back == *data);
            }
        }
    }

    /// Differential check: on mutated encodings (random bytes anywhere; table, index and
    /// header fields rewritten with the prefix checksum resealed) the kernels accept exactly
    /// what the CPU decoder accepts for the expected tensor, and decode the same bytes.
    #[test]
    fn kernel_decoder_agrees_with_the_cpu_decoder_on_mutated_encodings() {
        let lib = library();
        let mut rng = SplitMix64::new(2026);
        let random: Vec<u8> = (0..4 * 1_000).map(|_| rng.next_u64() as u8).collect();
        let cases = [
            (
                CodecDType::BF16,
                generate(DataKind::Gelu, CodecDType::BF16, 3_000, 1),
                256,
            ),
            (
                CodecDType::F16,
                generate(DataKind::Softmax, CodecDType::F16, 2_000, 2),
                512,
            ),
            (CodecDType::F32, random, 96),
        ];
        let (mut accepted, mut rejected) = (0, 0);
        for (dtype, data, block) in cases {
            let opts = EncodeOptions {
                chunk_elems: block,
                prob_bits: 12,
                threads: 1,
            };
            let enc = encode(dtype, &data, &opts).unwrap();
            let prefix = crate::codec::inspect(&enc).unwrap().offsets[0];
            let numel = data.len() / dtype.size();
            for i in 0..600 {
                let mut m = enc.clone();
                let r = rng.next_u64();
                let at = (r >> 8) as usize % m.len();
                match i % 3 {
                    0 => m[at] ^= 1 << (r % 8),
                    1 => m[at] = (r >> 40) as u8,
                    _ => {
                        // A prefix field rewritten by someone who knows the checksum.
                        m[at % prefix] = (r >> 40) as u8;
                        v2::seal(&mut m[..prefix]);
                    }
                }
                let cpu = crate::codec::decode(&m)
                    .ok()
                    .filter(|d| d.dtype == dtype && d.numel == numel)
                    .map(|d| d.data);
                let (back, status) = kernel_decode_small(&lib, dtype, numel, &m);
                match cpu {
                    Some(d) => {
                        assert_eq!(
                            status,
                            0,
                            "{dtype} mutation {i}: {}",
                            status_message(status)
                        );
                        assert!(
                            back == d,
                            "{dtype} mutation {i}: other bytes than the CPU's"
                        );
                        accepted += 1;
                    }
                    None => {
                        assert_ne!(
                            status, 0,
                            "{dtype} mutation {i}: the CPU decoder refuses it"
                        );
                        rejected += 1;
                    }
                }
            }
        }
        assert!(
            accepted > 0 && rejected > 0,
            "{accepted} accepted, {rejected} rejected"
        );
    }

    #[test]
    fn kernel_decoder_rejects_or_survives_every_bit_flip() {
        let lib = library();
        let data = generate(DataKind::Gelu, CodecDType::BF16, 700, 3);
        let opts = EncodeOptions {
            chunk_elems: 256,
            prob_bits: 12,
            threads: 1,
        };
        let enc = encode(CodecDType::BF16, &data, &opts).unwrap();
        for bit in 0..enc.len() * 8 {
            let mut m = enc.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            let (back, status) = kernel_decode_small(&lib, CodecDType::BF16, 700, &m);
            assert!(
                status != 0 || back == data,
                "flip of bit {bit} silently changed the data"
            );
        }
        for len in 0..enc.len() {
            assert_ne!(
                kernel_decode_small(&lib, CodecDType::BF16, 700, &enc[..len]).1,
                0,
                "truncated to {len}"
            );
        }
        assert_eq!(kernel_decode_small(&lib, CodecDType::BF16, 701, &enc).1, 9);
    }
}
