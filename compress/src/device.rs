//! The codec on a [`Platform`] stream, for device tensors of any backend.
//!
//! [`DeviceCodec`] is what a device implementation provides; it must produce the bytes of
//! `FORMAT.md`, identical to the CPU codec. [`crate::codec_for`] chooses per backend: on
//! `cuda` [`crate::CudaCodec`], the v2 kernels of [`crate::codec::cuda`] compiled by the
//! backend's NVRTC and launched in stream order (three launches an encode, one a decode, on a
//! workspace and pinned result words the codec keeps per stream: no allocation and no host wait
//! per call; the encoding's length and the decoder's status are read after an event, when asked
//! for); on `cpu` (device memory is host memory) and on `npu` (no Ascend kernel exists yet)
//! [`HostCodec`]: in stream order it copies the tensor to pinned
//! memory, runs the CPU codec on host threads inside a host function
//! ([`Platform::launch_host_fn`]) and copies the result back. Both take batches
//! ([`DeviceCodec::encode_batch_async`]: a layer's saved tensors in one launch sequence on
//! `cuda`, one after the other elsewhere).
//!
//! ```
//! use std::sync::Arc;
//! use hprt_compress::{codec_for, CompressedTensor};
//! use hprt_compress::CodecDType;
//! use hprt_platform::{CpuBackend, CpuConfig, Platform};
//!
//! let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
//! let s = p.create_stream()?;
//! let data: Vec<u8> = (0..4096u32).flat_map(|i| ((i % 100) as f32 * 0.5).to_le_bytes()).collect();
//! let src = p.alloc_device(data.len())?;
//! p.write_device_sync(&src, 0, &data, &s)?;
//!
//! let codec = codec_for(p.as_ref());
//! let scratch = p.alloc_device(codec.max_encoded_len(CodecDType::F32, 4096))?;
//! let pending = codec.encode_async(p.as_ref(), src.at(0), CodecDType::F32, 4096, &scratch, &s)?;
//! let packed: CompressedTensor = pending.finish(p.as_ref(), &s)?;
//! assert!(packed.byte_len() < data.len());
//!
//! let dst = p.alloc_device(data.len())?;
//! codec.decode_async(p.as_ref(), &packed, dst.at(0), &s)?.finish(p.as_ref())?;
//! let mut back = vec![0u8; data.len()];
//! p.read_device_sync(&dst, 0, &mut back, &s)?;
//! assert_eq!(back, data);
//! # Ok::<(), hprt_compress::CompressError>(())
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use hprt_platform::{DeviceBuffer, Event, Memory, PinnedBuffer, Place, Platform, Stream};

mod cuda;
pub use cuda::CudaCodec;

use crate::codec::{self, DecodeOptions, EncodeOptions};
use crate::error::{CompressError, Result};
use crate::format::CodecDType;
use hprt_platform::sync::lock;

/// A compressed tensor in device memory: `byte_len` bytes of `FORMAT.md` at the start of `buf`.
#[derive(Clone, Debug)]
pub struct CompressedTensor {
    buf: DeviceBuffer,
    len: usize,
    dtype: CodecDType,
    numel: usize,
}

impl CompressedTensor {
    /// Wraps device bytes that hold an encoding of `numel` elements of `dtype` (for example
    /// after a swap engine brought them back). Decoding checks them; nothing is trusted.
    pub fn from_device_bytes(
        buf: DeviceBuffer,
        len: usize,
        dtype: CodecDType,
        numel: usize,
    ) -> Result<Self> {
        if len > buf.len() {
            return Err(CompressError::InvalidArgument(format!(
                "{len} compressed bytes do not fit the {}-byte buffer",
                buf.len()
            )));
        }
        Ok(CompressedTensor {
            buf,
            len,
            dtype,
            numel,
        })
    }
    pub fn dtype(&self) -> CodecDType {
        self.dtype
    }
    pub fn numel(&self) -> usize {
        self.numel
    }
    /// Bytes of the encoding.
    pub fn byte_len(&self) -> usize {
        self.len
    }
    /// The device buffer whose first [`CompressedTensor::byte_len`] bytes hold the encoding.
    pub fn device_buffer(&self) -> &DeviceBuffer {
        &self.buf
    }
    /// Bytes of the original tensor.
    pub fn original_len(&self) -> usize {
        self.numel * self.dtype.size()
    }
    /// Original bytes over compressed bytes.
    pub fn ratio(&self) -> f64 {
        self.original_len() as f64 / self.len.max(1) as f64
    }
}

/// The codec on a platform stream. Implementations must write exactly the bytes of the CPU
/// codec (`FORMAT.md`), so an encoding made on one backend decodes on any other.
pub trait DeviceCodec: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether this codec computes on the host (the CPU codec behind [`HostCodec`]): then
    /// compressing in a host stage moves fewer bytes than coding "on the device" (what
    /// `hprt-swap` resolves `Compression::Auto` against).
    fn encodes_on_host(&self) -> bool {
        false
    }
    /// Bytes a scratch buffer for [`DeviceCodec::encode_async`] must have.
    fn max_encoded_len(&self, dtype: CodecDType, numel: usize) -> usize;
    /// Enqueues the encoding of `numel` elements at `src` into `scratch` on `stream`. The
    /// result is known once [`PendingEncode::finish`] returned.
    fn encode_async(
        &self,
        platform: &dyn Platform,
        src: Place<&DeviceBuffer>,
        dtype: CodecDType,
        numel: usize,
        scratch: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<PendingEncode>;
    /// Enqueues the decoding of `src` into `dst` (which must hold the original bytes).
    fn decode_async(
        &self,
        platform: &dyn Platform,
        src: &CompressedTensor,
        dst: Place<&DeviceBuffer>,
        stream: &Stream,
    ) -> Result<PendingDecode>;
    /// Enqueues the encoding of every tensor of `items` (a layer's saved tensors, say), in
    /// order; one result per item. The CUDA codec codes them with one launch sequence; this
    /// default queues [`DeviceCodec::encode_async`] per item.
    fn encode_batch_async(
        &self,
        platform: &dyn Platform,
        items: &[EncodeItem<'_>],
        stream: &Stream,
    ) -> Result<Vec<PendingEncode>> {
        items
            .iter()
            .map(|it| self.encode_async(platform, it.src, it.dtype, it.numel, it.scratch, stream))
            .collect()
    }
    /// Enqueues the decoding of every tensor of `items`; as
    /// [`DeviceCodec::encode_batch_async`].
    fn decode_batch_async(
        &self,
        platform: &dyn Platform,
        items: &[DecodeItem<'_>],
        stream: &Stream,
    ) -> Result<Vec<PendingDecode>> {
        items
            .iter()
            .map(|it| self.decode_async(platform, it.src, it.dst, stream))
            .collect()
    }
}

/// One tensor of [`DeviceCodec::encode_batch_async`]: `numel` elements of `dtype` at `src`,
/// encoded into `scratch` (at least [`DeviceCodec::max_encoded_len`] bytes).
#[derive(Clone, Copy, Debug)]
pub struct EncodeItem<'a> {
    pub src: Place<&'a DeviceBuffer>,
    pub dtype: CodecDType,
    pub numel: usize,
    pub scratch: &'a DeviceBuffer,
}

/// One tensor of [`DeviceCodec::decode_batch_async`]: `src` decoded into `dst`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeItem<'a> {
    pub src: &'a CompressedTensor,
    pub dst: Place<&'a DeviceBuffer>,
}

impl std::fmt::Debug for dyn DeviceCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceCodec({})", self.name())
    }
}

type Slot<T> = Arc<Mutex<Option<Result<T>>>>;

fn take_slot<T>(slot: &Slot<T>, what: &str) -> Result<T> {
    lock(slot).take().unwrap_or_else(|| {
        Err(CompressError::InvalidState(format!(
            "the {what} host step did not run (its stream reported no error)"
        )))
    })
}

/// Where a queued operation leaves its result: the slot a host step fills, or little-endian
/// words that device kernels computed and the stream copied into pinned memory.
enum Outcome<T> {
    Host(Slot<T>),
    /// Word `index` of `words` (or a value known when queued, still ready only after `done`).
    Device {
        words: Arc<DeviceWords>,
        index: usize,
        known: Option<u64>,
    },
}

/// Result words a device codec's launch sequence leaves in pinned memory (one u64 per tensor
/// of its batch at `at`), shared by the batch's pending operations; `lease` gives the pinned
/// slot back to the codec when the last of them is gone.
pub(crate) struct DeviceWords {
    pub(crate) words: PinnedBuffer,
    pub(crate) at: usize,
    pub(crate) waited: AtomicBool,
    pub(crate) lease: Box<dyn GiveBack>,
}

/// What a [`DeviceWords`] gives back to its codec when the last pending operation of its batch
/// is gone: whether its event was seen complete (then the memory its kernels used can be let
/// go at once; otherwise only once the event completed).
pub(crate) trait GiveBack: Send + Sync {
    fn give_back(&mut self, completed: bool);
}

impl Drop for DeviceWords {
    fn drop(&mut self) {
        self.lease.give_back(self.waited.load(Ordering::Acquire));
    }
}

impl DeviceWords {
    /// Word `index`, once `done` (recorded after the copy that brings the words) completed:
    /// one event wait for the whole batch.
    fn word(&self, platform: &dyn Platform, done: &Event, index: usize) -> Result<u64> {
        if !self.waited.load(Ordering::Acquire) {
            platform.synchronize_event(done)?;
            self.waited.store(true, Ordering::Release);
        }
        let mut b = [0u8; 8];
        // SAFETY: the event is recorded after the copy into these bytes and completed; no
        // later copy writes them while the lease (held by `self`) keeps the slot.
        unsafe { self.words.read_unsynchronized(self.at + 8 * index, &mut b) }?;
        Ok(u64::from_le_bytes(b))
    }
}

/// Buffers a queued operation uses, held until the stream passed them (dropping device memory
/// earlier would make its release wait for the stream on the caller's thread).
struct Held {
    _pinned: Vec<PinnedBuffer>,
    _device: Vec<DeviceBuffer>,
}

/// An encoding queued on a stream.
#[must_use = "an encoding is only usable after finish()"]
pub struct PendingEncode {
    scratch: DeviceBuffer,
    done: Event,
    len: Outcome<usize>,
    dtype: CodecDType,
    numel: usize,
    _held: Held,
}

impl PendingEncode {
    /// An encoding whose length the device writes as word `index` of `words`, in stream
    /// order before `done` (or `known` when queued).
    pub(crate) fn from_device(
        scratch: &DeviceBuffer,
        done: Event,
        words: Arc<DeviceWords>,
        index: usize,
        known: Option<usize>,
        dtype: CodecDType,
        numel: usize,
    ) -> Self {
        PendingEncode {
            scratch: scratch.clone(),
            done,
            len: Outcome::Device {
                words,
                index,
                known: known.map(|n| n as u64),
            },
            dtype,
            numel,
            _held: Held {
                _pinned: Vec::new(),
                _device: Vec::new(),
            },
        }
    }

    /// The element type and count being encoded.
    pub fn dtype(&self) -> CodecDType {
        self.dtype
    }
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Whether the encoding is complete: [`Self::wait_len`] would not wait.
    pub fn is_done(&self, platform: &dyn Platform) -> Result<bool> {
        Ok(platform.query_event(&self.done)?)
    }

    /// Waits for the encoding (only it, not the rest of the stream) and returns its length.
    pub fn wait_len(&self, platform: &dyn Platform) -> Result<usize> {
        let slot = match &self.len {
            Outcome::Host(slot) => {
                platform.synchronize_event(&self.done)?;
                slot
            }
            Outcome::Device {
                words,
                index,
                known,
            } => {
                let word = words.word(platform, &self.done, *index)?;
                let len = known.unwrap_or(word) as usize;
                if len > self.scratch.len() {
                    return Err(CompressError::InvalidState(format!(
                        "the device encoder reports {len} bytes in a {}-byte scratch buffer",
                        self.scratch.len()
                    )));
                }
                return Ok(len);
            }
        };
        let mut slot = lock(slot);
        match slot.as_ref() {
            Some(Ok(n)) => Ok(*n),
            Some(Err(_)) => Err(slot.take().expect("checked").expect_err("checked")),
            None => Err(CompressError::InvalidState(
                "the encode host step did not run".into(),
            )),
        }
    }

    /// Waits, then copies the encoding into a buffer of exactly its length (enqueued on
    /// `stream`), so the scratch buffer can be reused.
    pub fn finish(self, platform: &dyn Platform, stream: &Stream) -> Result<CompressedTensor> {
        let len = self.wait_len(platform)?;
        let buf = platform.alloc_device(len)?;
        platform.copy_async(
            Memory::Device(&buf),
            0,
            Memory::Device(&self.scratch),
            0,
            len,
            stream,
        )?;
        Ok(CompressedTensor {
            buf,
            len,
            dtype: self.dtype,
            numel: self.numel,
        })
    }

    /// Waits and keeps the encoding in the scratch buffer itself.
    pub fn finish_in_place(self, platform: &dyn Platform) -> Result<CompressedTensor> {
        let len = self.wait_len(platform)?;
        Ok(CompressedTensor {
            buf: self.scratch,
            len,
            dtype: self.dtype,
            numel: self.numel,
        })
    }
}

/// A decoding queued on a stream.
#[must_use = "a decoding's errors are only seen by finish()"]
pub struct PendingDecode {
    done: Event,
    result: Outcome<()>,
    /// What the device codec's status word means (a device outcome only).
    status: fn(u32) -> Result<()>,
    _held: Held,
}

impl PendingDecode {
    /// A decoding whose kernels leave a status word as word `index` of `words` before `done`;
    /// `status` says what the word means (the device codec's own codes).
    pub(crate) fn from_device(
        done: Event,
        words: Arc<DeviceWords>,
        index: usize,
        status: fn(u32) -> Result<()>,
    ) -> Self {
        PendingDecode {
            done,
            result: Outcome::Device {
                words,
                index,
                known: None,
            },
            status,
            _held: Held {
                _pinned: Vec::new(),
                _device: Vec::new(),
            },
        }
    }

    /// Waits for the decoding and reports a corrupt input.
    pub fn finish(self, platform: &dyn Platform) -> Result<()> {
        match &self.result {
            Outcome::Host(slot) => {
                platform.synchronize_event(&self.done)?;
                take_slot(slot, "decode")
            }
            Outcome::Device { words, index, .. } => {
                let word = words.word(platform, &self.done, *index)?;
                (self.status)(word as u32)
            }
        }
    }
}

/// The CPU codec on a platform stream, which every backend can run: D2H into pinned memory,
/// encode or decode in a host function in stream order, H2D back; where device memory is host
/// memory (the cpu backend), the host function reads and writes it in place instead
/// ([`Platform::launch_host_fn_on_memory`]: no pinned staging, no copy of the raw bytes). The
/// caller's thread never blocks. Its name is `"host"`, and it [encodes on the host](DeviceCodec::encodes_on_host)
/// (what `hprt-swap` resolves `Compression::Auto` against: where the codec is the host's,
/// compressing in a host stage moves fewer bytes).
#[derive(Clone, Debug, Default)]
pub struct HostCodec {
    pub encode: EncodeOptions,
    pub decode: DecodeOptions,
}

impl DeviceCodec for HostCodec {
    fn name(&self) -> &'static str {
        "host"
    }

    fn encodes_on_host(&self) -> bool {
        true
    }

    fn max_encoded_len(&self, dtype: CodecDType, numel: usize) -> usize {
        codec::max_encoded_len(dtype, numel, &self.encode)
    }

    fn encode_async(
        &self,
        p: &dyn Platform,
        src: Place<&DeviceBuffer>,
        dtype: CodecDType,
        numel: usize,
        scratch: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<PendingEncode> {
        let bytes = numel * dtype.size();
        let max = self.max_encoded_len(dtype, numel);
        if scratch.len() < max {
            return Err(CompressError::InvalidArgument(format!(
                "scratch buffer of {} bytes is below the worst case of {max}",
                scratch.len()
            )));
        }
        let len: Slot<usize> = Arc::new(Mutex::new(None));
        if p.capabilities().device_memory_is_host {
            let (slot, opts) = (len.clone(), self.encode.clone());
            p.launch_host_fn_on_memory(
                stream,
                (scratch.at(0), max),
                (src, bytes),
                Box::new(move |out, raw| {
                    let r = codec::encode(dtype, raw, &opts).map(|enc| {
                        out[..enc.len()].copy_from_slice(&enc);
                        enc.len()
                    });
                    *lock(&slot) = Some(r);
                }),
            )?;
            return host_step_encoded(p, scratch, len, dtype, numel, stream, Vec::new());
        }
        let input = p.alloc_pinned(bytes)?;
        let output = p.alloc_pinned(max)?;
        p.copy_async(
            Memory::Pinned(&input),
            0,
            Memory::Device(src.mem),
            src.offset,
            bytes,
            stream,
        )?;
        let (inp, out, slot, opts) = (
            input.clone(),
            output.clone(),
            len.clone(),
            self.encode.clone(),
        );
        p.launch_host_fn(
            stream,
            Box::new(move || {
                // Both accesses are in stream order: the copy into `inp` is queued before this
                // host function on its stream, the copy out of `out` after it.
                let r = (|| {
                    let mut raw = vec![0u8; inp.len()];
                    // SAFETY: the copy into `inp` ran before this host function (stream
                    // order), and no other queued copy touches `inp`.
                    unsafe { inp.read_unsynchronized(0, &mut raw) }?;
                    let enc = codec::encode(dtype, &raw, &opts)?;
                    // SAFETY: the copy out of `out` is queued after this host function on
                    // the same stream, so it cannot run while this writes.
                    unsafe { out.write_unsynchronized(0, &enc) }?;
                    Ok(enc.len())
                })();
                *lock(&slot) = Some(r);
            }),
        )?;
        // The length is not known when this is queued: the worst case is copied.
        p.copy_async(
            Memory::Device(scratch),
            0,
            Memory::Pinned(&output),
            0,
            max,
            stream,
        )?;
        host_step_encoded(p, scratch, len, dtype, numel, stream, vec![input, output])
    }

    fn decode_async(
        &self,
        p: &dyn Platform,
        src: &CompressedTensor,
        dst: Place<&DeviceBuffer>,
        stream: &Stream,
    ) -> Result<PendingDecode> {
        let bytes = src.original_len();
        let result: Slot<()> = Arc::new(Mutex::new(None));
        let (dtype, numel) = (src.dtype, src.numel);
        if p.capabilities().device_memory_is_host {
            let (slot, opts) = (result.clone(), self.decode.clone());
            p.launch_host_fn_on_memory(
                stream,
                (dst, bytes),
                (src.buf.at(0), src.len),
                Box::new(move |out, enc| {
                    let r = check_holds(enc, dtype, numel)
                        .and_then(|()| codec::decode_into(enc, out, &opts).map(drop));
                    *lock(&slot) = Some(r);
                }),
            )?;
            return host_step_decoded(p, result, stream, Vec::new());
        }
        let input = p.alloc_pinned(src.len)?;
        let output = p.alloc_pinned(bytes)?;
        p.copy_async(
            Memory::Pinned(&input),
            0,
            Memory::Device(&src.buf),
            0,
            src.len,
            stream,
        )?;
        let (inp, out, slot, opts) = (
            input.clone(),
            output.clone(),
            result.clone(),
            self.decode.clone(),
        );
        p.launch_host_fn(
            stream,
            Box::new(move || {
                // Both accesses are in stream order, as in `encode_async`.
                let r = (|| {
                    let mut enc = vec![0u8; inp.len()];
                    // SAFETY: the copy into `inp` ran before this host function (stream
                    // order), and no other queued copy touches `inp`.
                    unsafe { inp.read_unsynchronized(0, &mut enc) }?;
                    // The expected size, not the declared one, bounds what decoding allocates.
                    check_holds(&enc, dtype, numel)?;
                    let d = codec::decode_with(&enc, &opts)?;
                    // SAFETY: the copy out of `out` is queued after this host function on
                    // the same stream, so it cannot run while this writes.
                    unsafe { out.write_unsynchronized(0, &d.data) }?;
                    Ok(())
                })();
                *lock(&slot) = Some(r);
            }),
        )?;
        p.copy_async(
            Memory::Device(dst.mem),
            dst.offset,
            Memory::Pinned(&output),
            0,
            bytes,
            stream,
        )?;
        host_step_decoded(p, result, stream, vec![input, output])
    }
}

/// That encoding `enc` holds `numel` elements of `dtype`, read from its header.
fn check_holds(enc: &[u8], dtype: CodecDType, numel: usize) -> Result<()> {
    let h = codec::inspect(enc)?.header;
    if h.dtype != dtype || h.numel != numel {
        return Err(CompressError::corrupt(
            0,
            format!(
                "holds {} {} elements, expected {numel} {dtype}",
                h.numel, h.dtype
            ),
        ));
    }
    Ok(())
}

/// The pending encode of a host step queued on `stream`: its length comes in `len`, the
/// `pinned` buffers it stages through are held until the stream passed them.
fn host_step_encoded(
    p: &dyn Platform,
    scratch: &DeviceBuffer,
    len: Slot<usize>,
    dtype: CodecDType,
    numel: usize,
    stream: &Stream,
    pinned: Vec<PinnedBuffer>,
) -> Result<PendingEncode> {
    let done = p.create_event(false)?;
    p.record_event(&done, stream)?;
    Ok(PendingEncode {
        scratch: scratch.clone(),
        done,
        len: Outcome::Host(len),
        dtype,
        numel,
        _held: Held {
            _pinned: pinned,
            _device: Vec::new(),
        },
    })
}

/// The pending decode of a host step queued on `stream`, as [`host_step_encoded`].
fn host_step_decoded(
    p: &dyn Platform,
    result: Slot<()>,
    stream: &Stream,
    pinned: Vec<PinnedBuffer>,
) -> Result<PendingDecode> {
    let done = p.create_event(false)?;
    p.record_event(&done, stream)?;
    Ok(PendingDecode {
        done,
        result: Outcome::Host(result),
        // A host step reports in its slot, not in a status word.
        status: |_| Ok(()),
        _held: Held {
            _pinned: pinned,
            _device: Vec::new(),
        },
    })
}
