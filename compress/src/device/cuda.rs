//! [`CudaCodec`]: the v2 CUDA kernels of [`crate::codec::cuda`] launched on a platform stream
//! through the backend's NVRTC ([`Platform::launch_module_kernel`]: compiled once per device, as a
//! cubin for the device's own architecture where NVRTC knows it, and cached, like the platform's
//! elementwise kernels).
//!
//! The hot path allocates nothing, waits for nothing and reads nothing back: per stream the
//! codec keeps a device workspace (tables and counters per tensor, a length and an offset per
//! block: no copy of the data) and a few pinned slots (with an event each), grown to the largest
//! batch seen and then reused; an encode is one host-to-device copy of the batch's
//! descriptors, three launches and one device-to-host copy of the lengths into the slot, before
//! its event; a decode the same with one launch. The host reads a length or a status only when
//! asked ([`super::PendingEncode::wait_len`]), after that event.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use hprt_platform::{
    Access, DeviceBuffer, Event, KernelArg, LaunchShape, Memory, PinnedBuffer, Place, Platform,
    Stream,
};

use super::{
    CompressedTensor, DecodeItem, DeviceCodec, DeviceWords, EncodeItem, GiveBack, PendingDecode,
    PendingEncode,
};
use crate::codec::cuda::{
    decode_shape, encode_shapes, status_result, DecodeDesc, EncodeDesc, Layout, COUNTERS, HIST,
    KERNELS, MODULE,
};
use crate::codec::{self, v2, EncodeOptions};
use crate::error::{CompressError, Result};
use crate::format::CodecDType;
use hprt_platform::sync::lock;

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
