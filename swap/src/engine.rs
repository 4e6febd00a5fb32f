//! The copy engine every front end drives: batched offload / reload of [`SwapTensor`]s on the
//! engine's own copy streams, with the stream waits and host synchronizations that make it safe.
//! (Over 800 lines because every ordering rule lives here, beside the fault switches that prove
//! each one.)

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::{codec_for, CompressedTensor, DecodeItem, DeviceCodec, EncodeItem};
pub use hprt_platform::PlatformHandle;
use hprt_platform::{DeviceBuffer, Platform, Stream};

use crate::error::{Result, SwapError, SwapState};
use crate::payload::{
    codec_dtype, size_class, take, Charge, Compression, CompressionPolicy, HostCopy, ReloadCheck,
    Slot, SwapTensor,
};
use crate::pool::{Fence, PinnedBlock, PinnedPool, PoolConfig, PoolStats};
use crate::tensor::{DeviceTensor, Origin, Saved, VersionCounter};
use hprt_platform::sync::lock;

/// Settings of a [`SwapEngine`].
#[derive(Clone, Default)]
pub struct EngineConfig {
    /// One copy stream for both directions (hyper_parallel) instead of separate d2h and h2d
    /// streams.
    pub single_copy_stream: bool,
    pub pool: PoolConfig,
    /// How tensors travel (compress-then-swap) when no policy decides.
    pub compression: Compression,
    /// Per-tensor choice of the compression; `None` applies `compression` to every tensor.
    pub compression_policy: Option<CompressionPolicy>,
    /// A stream for the device codec ([`Compression::Device`]), so its work shows and overlaps
    /// apart from the copies; `None` runs it on the copy streams.
    pub codec_stream: Option<Stream>,
    /// Bounds on the bytes in flight (Megatron-LM's `max_inflight_offloads`, in bytes).
    pub window: InflightWindow,
}

/// Whoever else may read an owned storage's memory through a view of it (a binding's DLPack
/// exports): the engine releases owned storage only through it, so that no view outlives the
/// memory it names.
pub trait ReleaseGuard: Send + Sync {
    /// Runs `release`, which frees `storage`'s memory, unless a view of it is alive: then
    /// [`SwapError::StorageInUse`] and nothing is released. No view may start meanwhile.
    fn release(
        &self,
        storage: &DeviceBuffer,
        release: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()>;
}

/// How many bytes may be on their way at once, each way (`None`: no bound beyond the front
/// end's own schedule).
///
/// - `offload_bytes`: bytes of offloads whose device-to-host copy is not known to have
///   finished. Their device memory cannot be reused yet (the engine, or the framework ordering
///   its reuse after the copy, still holds it), so on a device that trails the host these are
///   what piles up. An offload that would pass the bound first waits on the host for the
///   oldest ones (backpressure), as a GPU framework's offload manager caps its queue.
/// - `reload_bytes`: bytes of reloads started and not yet handed to the compute stream. A
///   prefetch that would pass the bound is not started (its consumer's own load starts it);
///   a load the compute stream needs now always starts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InflightWindow {
    pub offload_bytes: Option<usize>,
    pub reload_bytes: Option<usize>,
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("single_copy_stream", &self.single_copy_stream)
            .field("pool", &self.pool)
            .field("compression", &self.compression)
            .field("compression_policy", &self.compression_policy.is_some())
            .field("codec_stream", &self.codec_stream.is_some())
            .field("window", &self.window)
            .finish()
    }
}

/// Test-only switches that each remove one wait the engine needs, so tests can show (under the
/// cpu backend's jitter) that the wait is what keeps the bytes right. Exported, with the
/// engine's and front ends' `set_faults`, only with the feature `test-faults`: without it every
/// switch stays off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Offload does not wait for the compute stream that produced the tensor.
    pub skip_producer_wait: bool,
    /// The compute stream does not wait for a reload before the tensor is handed back.
    pub skip_reload_wait: bool,
    /// An offload into a recycled pinned block does not wait for the block's last reload.
    pub skip_pinned_reuse_wait: bool,
    /// A reload does not wait for the copies of offloads taken back before it (the device
    /// footprint then grows past two layers where copies lag).
    pub skip_taken_back_wait: bool,
}

/// Bytes and tensors moved by an engine since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub offloaded_tensors: u64,
    /// Bytes of the offloaded tensors (before compression).
    pub offloaded_bytes: u64,
    pub reloaded_tensors: u64,
    pub reloaded_bytes: u64,
    /// Bytes the engine moved over the host link, device to host and host to device
    /// (compressed bytes for compressed payloads).
    pub link_d2h_bytes: u64,
    pub link_h2d_bytes: u64,
    /// Tensors offloaded compressed, and the bytes of their encodings.
    pub compressed_tensors: u64,
    pub compressed_bytes: u64,
    /// Host-measured codec time (encode + decode) in nanoseconds.
    pub codec_ns: u64,
    /// Tensors whose device memory went back to its framework as soon as their offload was
    /// queued ([`crate::Allocator::hand_over`]).
    pub handed_back_tensors: u64,
    /// Times an offload waited on the host for older ones to fit the window.
    pub offload_window_waits: u64,
    /// Prefetches not started because the reload window was full.
    pub prefetches_deferred: u64,
    /// Most bytes of offloads in flight, and of reloads in flight, at once.
    pub offload_inflight_peak: u64,
    pub reload_inflight_peak: u64,
}

impl EngineStats {
    /// Every counter with its name, in declaration order: the one list the Python `stats()`
    /// dicts and the C `HprtSwapStats` are filled from.
    pub fn fields(&self) -> [(&'static str, u64); 14] {
        [
            ("offloaded_tensors", self.offloaded_tensors),
            ("offloaded_bytes", self.offloaded_bytes),
            ("reloaded_tensors", self.reloaded_tensors),
            ("reloaded_bytes", self.reloaded_bytes),
            ("link_d2h_bytes", self.link_d2h_bytes),
            ("link_h2d_bytes", self.link_h2d_bytes),
            ("compressed_tensors", self.compressed_tensors),
            ("compressed_bytes", self.compressed_bytes),
            ("codec_ns", self.codec_ns),
            ("handed_back_tensors", self.handed_back_tensors),
            ("offload_window_waits", self.offload_window_waits),
            ("prefetches_deferred", self.prefetches_deferred),
            ("offload_inflight_peak", self.offload_inflight_peak),
            ("reload_inflight_peak", self.reload_inflight_peak),
        ]
    }
}

/// Moves tensors between device and pinned host memory for all three front ends.
///
/// The caller passes its compute stream (the framework's current stream); the engine owns its
/// copy streams. The ordering rules it enforces:
/// - an offload waits for the compute work queued before it (which produced the tensor);
/// - device bytes are released only after the host synchronized with the device-to-host copy
///   ([`SwapEngine::finish_offload`]), so a reload, which needs state `host`, can only read a
///   complete host copy; except where the framework orders its memory's reuse after hprt's
///   copy stream itself ([`crate::Allocator::hand_over`], torch's `record_stream`): then the
///   memory goes back to it as soon as the copy is queued, and the reload stream waits for the
///   copy instead of the host;
/// - a reloaded tensor's framework memory goes back to the framework once the compute stream
///   waits for its reload (the same hand-over): the engine keeps only the handle the front end
///   hands out;
/// - at most [`InflightWindow::offload_bytes`] of offloads are in flight: one more first waits
///   on the host for the oldest (backpressure); prefetches stay within
///   [`InflightWindow::reload_bytes`];
/// - the compute stream waits for a reload before the tensor is handed back
///   ([`SwapEngine::finish_reload`]);
/// - a reload into memory a framework's caching allocator handed out on one of its streams
///   ([`crate::Reacquired::ready_on`]) is written after the work queued on that stream before
///   the allocation (which may still use the block);
/// - a pinned block handed back while its reload is queued is not written again before that
///   reload read it;
/// - a reload allocates no device memory while an offload taken back by
///   [`SwapEngine::cancel_offload`] may still be reading its tensors: the host waits for such
///   copies first. Memory that queued work still uses stays device memory until that work
///   finished (the platform frees in stream order, as `cuMemFreeAsync` / torch's
///   `record_stream` do), so without the wait the taken-back group, freed by the framework
///   after its backward, would still hold the device while the next group reloads: this wait
///   is what keeps the front ends' footprint at two layers on a device whose copies lag.
///
/// Batch calls act on the tensors in their source state and skip those already at or past their
/// target (so a failed batch can be retried); any other state is a [`SwapError::WrongState`].
///
/// ```
/// use std::sync::Arc;
/// use hprt_platform::{CpuBackend, CpuConfig, DType, Platform};
/// use hprt_swap::{DeviceTensor, EngineConfig, Saved, SwapEngine, SwapState, SwapTensor};
///
/// let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
/// let compute = p.create_stream().unwrap();
/// let buf = p.alloc_device(1024).unwrap();
/// p.write_device_sync(&buf, 0, &[7u8; 1024], &compute).unwrap();
/// let mut engine = SwapEngine::new(Arc::clone(&p), EngineConfig::default()).unwrap();
/// let mut t = SwapTensor::new(Saved::Tensor(DeviceTensor::whole(buf.clone(), DType::U8, vec![1024]))).unwrap();
/// engine.offload([&mut t], &compute).unwrap();
/// engine.finish_offload([&mut t]).unwrap();
/// assert_eq!((t.state(), buf.len()), (SwapState::Host, 0)); // device bytes released
/// engine.start_reload([&mut t]).unwrap();
/// engine.finish_reload([&mut t], &compute).unwrap();
/// let mut back = vec![0u8; 1024];
/// p.read_device_sync(&buf, 0, &mut back, &compute).unwrap();
/// assert_eq!(back, vec![7u8; 1024]);
/// ```
pub struct SwapEngine {
    platform: PlatformHandle,
    d2h: Stream,
    h2d: Stream,
    pool: PinnedPool,
    /// Reused for every cross-stream ordering mark: a stream wait binds to the record made just
    /// before it, so re-recording later does not move an earlier wait.
    mark: hprt_platform::Event,
    /// What a released borrowed tensor points at: a storage with no bytes.
    empty: DeviceBuffer,
    codec: Arc<dyn DeviceCodec>,
    codec_stream: Option<Stream>,
    compression: Compression,
    policy: Option<CompressionPolicy>,
    /// Owned storages released by this engine with views still to reload: a storage found
    /// non-empty at a reload must have been re-acquired here (by a sibling view), not by
    /// someone else who may have written it.
    /// Keyed by the address the storage had when offloaded (shared by its views; a later
    /// storage may reuse an address, so a bucket can hold several).
    released: HashMap<usize, Vec<Released>>,
    /// Offload fences of tensors taken back while their copies were queued: the next reload
    /// waits for them before it allocates.
    taken_back: Vec<Fence>,
    faults: Faults,
    stats: EngineStats,
    codec_ns: Arc<AtomicU64>,
    window: InflightWindow,
    release_guard: Option<Arc<dyn ReleaseGuard>>,
    /// Offload batches whose copies are not known to have finished, oldest first, with their
    /// bytes (the fences are shared with the batch's tensors).
    offloads_in_flight: VecDeque<(Fence, usize)>,
    /// Bytes of reloads started and not yet handed to a compute stream (see [`Charge`]).
    reload_inflight: Arc<AtomicUsize>,
    /// Fences no tensor holds any more, to record again instead of creating an event per batch.
    spare_fences: Vec<Fence>,
}

/// The offload batch being queued: its fence (made at its first tensor) and bytes.
#[derive(Default)]
struct OpenBatch {
    fence: Option<Fence>,
    bytes: usize,
}

/// A reload's device decode, queued with the others of its call.
struct DeferredDecode {
    /// The tensor's place in the call.
    index: usize,
    enc: CompressedTensor,
    undo: Undo,
}

/// A device encoding waiting for its copy: the scratch it lies in and its length.
struct Encoded {
    scratch: DeviceBuffer,
    len: usize,
}

/// Device scratch the encodings of one batched launch may take at most (beyond one tensor's):
/// they all live until their copies are queued, on top of the tensors being offloaded.
const ENCODE_SCRATCH_BYTES: usize = 256 << 20;

/// Fences kept for reuse at most (beyond it a batch creates its event and lets it go).
const SPARE_FENCES: usize = 64;

/// How to give back a re-acquisition whose reload failed.
#[derive(Clone, Copy)]
enum Undo {
    Borrowed,
    /// `resized`: this reload resized the storage (else a sibling view's reload had).
    Owned {
        resized: bool,
    },
}

struct Released {
    storage: DeviceBuffer,
    /// Views released and not yet reloaded.
    pending: usize,
    reacquired: bool,
}

/// Waits issued by one batch, so that a fence shared by many tensors is waited once.
#[derive(Default)]
struct Waited(Option<Fence>);

impl Waited {
    fn first_time(&mut self, fence: &Fence) -> bool {
        if self.0.as_ref().is_some_and(|w| Arc::ptr_eq(w, fence)) {
            return false;
        }
        self.0 = Some(Arc::clone(fence));
        true
    }
}

fn elapsed_ns(since: Instant) -> u64 {
    since.elapsed().as_nanos().min(u64::MAX as u128) as u64
}

impl SwapEngine {
    pub fn new(platform: impl Into<PlatformHandle>, config: EngineConfig) -> Result<Self> {
        let platform = platform.into();
        let d2h = platform.create_stream()?;
        let h2d = if config.single_copy_stream {
            d2h.clone()
        } else {
            platform.create_stream()?
        };
        let pool = PinnedPool::new(platform.clone(), config.pool);
        let mark = platform.create_event(false)?;
        let empty = platform.alloc_device(0)?;
        let codec = codec_for(&*platform);
        Ok(SwapEngine {
            platform,
            d2h,
            h2d,
            pool,
            mark,
            empty,
            codec,
            codec_stream: config.codec_stream,
            compression: config.compression,
            policy: config.compression_policy,
            released: HashMap::new(),
            taken_back: Vec::new(),
            faults: Faults::default(),
            stats: EngineStats::default(),
            codec_ns: Arc::default(),
            window: config.window,
            release_guard: None,
            offloads_in_flight: VecDeque::new(),
            reload_inflight: Arc::default(),
            spare_fences: Vec::new(),
        })
    }

    pub fn platform(&self) -> &PlatformHandle {
        &self.platform
    }
    /// The stream offloads run on.
    pub fn d2h_stream(&self) -> &Stream {
        &self.d2h
    }
    /// The stream reloads run on (the same as [`SwapEngine::d2h_stream`] with one copy stream).
    pub fn h2d_stream(&self) -> &Stream {
        &self.h2d
    }
    pub fn pool(&self) -> &PinnedPool {
        &self.pool
    }
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            codec_ns: self.codec_ns.load(Ordering::Relaxed),
            ..self.stats
        }
    }
    /// The compression applied where no policy decides.
    pub fn compression(&self) -> Compression {
        self.compression
    }
    pub fn set_compression(&mut self, compression: Compression) {
        self.compression = compression;
    }
    pub fn set_compression_policy(&mut self, policy: Option<CompressionPolicy>) {
        self.policy = policy;
    }
    /// The in-flight bounds (see [`InflightWindow`]).
    pub fn window(&self) -> InflightWindow {
        self.window
    }
    pub fn set_window(&mut self, window: InflightWindow) {
        self.window = window;
    }
    /// Releases owned storage through `guard` from now on (see [`ReleaseGuard`]).
    pub fn set_release_guard(&mut self, guard: Option<Arc<dyn ReleaseGuard>>) {
        self.release_guard = guard;
    }
    /// Frees an owned storage's memory (resized to zero), through the release guard if any.
    fn release_owned(&self, storage: &DeviceBuffer) -> Result<()> {
        let mut release = || Ok(self.platform.resize_device(storage, 0)?);
        match &self.release_guard {
            Some(guard) => guard.release(storage, &mut release),
            None => release(),
        }
    }
    /// Everything a front end's `stats()` reports, by name: [`EngineStats::fields`], the bytes in
    /// flight now (`offload_inflight_bytes`, `reload_inflight_bytes`) and [`PoolStats::fields`].
    /// The Python dicts and the C `HprtSwapStats` are filled from this one list.
    pub fn stat_fields(&self) -> Vec<(&'static str, u64)> {
        let (offloads, reloads) = self.inflight_bytes();
        let mut fields = self.stats().fields().to_vec();
        fields.push(("offload_inflight_bytes", offloads as u64));
        fields.push(("reload_inflight_bytes", reloads as u64));
        fields.extend(self.pool_stats().fields());
        fields
    }

    /// Bytes of offloads not known to have finished, and of reloads not yet handed to a compute
    /// stream, now.
    pub fn inflight_bytes(&self) -> (usize, usize) {
        (
            self.offload_inflight_bytes(),
            self.reload_inflight.load(Ordering::Acquire),
        )
    }

    #[cfg(feature = "test-faults")]
    #[doc(hidden)]
    pub fn set_faults(&mut self, faults: Faults) {
        self.faults = faults;
    }

    /// How `t` travels: the policy's (or the engine's) choice, `Off` for dtypes the codec does
    /// not take, `Auto` resolved against the platform's codec.
    pub fn compression_for(&self, t: &DeviceTensor) -> Compression {
        let chosen = match &self.policy {
            Some(policy) => policy(t),
            None => self.compression,
        };
        if chosen == Compression::Off || codec_dtype(t.dtype).is_none() || t.len == 0 {
            return Compression::Off;
        }
        match chosen {
            Compression::Auto if self.codec.encodes_on_host() => Compression::HostStage,
            Compression::Auto => Compression::Device,
            c => c,
        }
    }

    /// Work queued on `waiter` from now on runs after the work queued on `on` so far.
    fn order_after(&self, waiter: &Stream, on: &Stream, skip: bool) -> Result<()> {
        if skip {
            return Ok(());
        }
        self.platform.record_event(&self.mark, on)?;
        self.platform.stream_wait_event(waiter, &self.mark)?;
        Ok(())
    }

    /// A fence for a new batch: a spare one no tensor holds any more (recording it again moves
    /// no earlier wait: a stream wait binds to the record made before it), or a new event.
    fn new_fence(&mut self) -> Result<Fence> {
        if let Some(i) = self
            .spare_fences
            .iter()
            .position(|f| Arc::strong_count(f) == 1)
        {
            return Ok(Arc::clone(&self.spare_fences[i]));
        }
        let f = Arc::new(self.platform.create_event(false)?);
        if self.spare_fences.len() < SPARE_FENCES {
            self.spare_fences.push(Arc::clone(&f));
        }
        Ok(f)
    }

    /// Records `fence` after the copies `outcome` queued, then reports `outcome`: tensors that
    /// got a copy before a failure hold a fence that covers it.
    fn seal(&self, fence: Option<Fence>, stream: &Stream, outcome: Result<()>) -> Result<()> {
        if let Some(f) = fence {
            self.platform.record_event(&f, stream)?;
        }
        outcome
    }

    /// A pinned block of `bytes` that `stream` may write: a recycled block's last copy is
    /// waited for first.
    fn block(&self, bytes: usize, stream: &Stream, waited: &mut Waited) -> Result<PinnedBlock> {
        let block = self.pool.acquire(bytes)?;
        if let Some(prev) = block.last_use() {
            if !self.faults.skip_pinned_reuse_wait && waited.first_time(prev) {
                self.platform.stream_wait_event(stream, prev)?;
            }
        }
        Ok(block)
    }

    /// Queues device → host copies of the tensors in state `device` (compressed where their
    /// compression says so), after the work queued on `compute` so far. Tensors already
    /// offloaded (`d2h`, `host`) are skipped; `h2d` is an error.
    pub fn offload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
    ) -> Result<()> {
        let mut batch = OpenBatch::default();
        let outcome = self.offload_into(tensors, compute, &mut batch);
        self.close_batch(&mut batch, outcome)
    }

    /// Records the open batch's fence after its copies and counts it in flight, then reports
    /// `outcome` (tensors that got a copy before a failure hold a fence that covers it).
    fn close_batch(&mut self, batch: &mut OpenBatch, outcome: Result<()>) -> Result<()> {
        let Some(f) = batch.fence.take() else {
            return outcome;
        };
        self.platform.record_event(&f, &self.d2h)?;
        self.offloads_in_flight
            .push_back((f, std::mem::take(&mut batch.bytes)));
        self.note_offload_peak();
        outcome
    }

    /// Bytes of the offload batches in flight (a few batches: summed when asked).
    fn offload_inflight_bytes(&self) -> usize {
        self.offloads_in_flight.iter().map(|(_, n)| n).sum()
    }

    fn note_offload_peak(&mut self) {
        let now = self.offload_inflight_bytes() as u64;
        self.stats.offload_inflight_peak = self.stats.offload_inflight_peak.max(now);
    }

    /// Forgets the offload batches whose copies finished (never blocks).
    fn retire_offloads(&mut self) -> Result<()> {
        while let Some((f, _)) = self.offloads_in_flight.front() {
            if !self.platform.query_event(f)? {
                break;
            }
            self.offloads_in_flight.pop_front();
        }
        Ok(())
    }

    /// Makes room for `bytes` more of offloads in the window: waits on the host for the
    /// oldest batches (closing the open one first when it is all there is to wait for). An
    /// offload larger than the whole window goes alone.
    fn make_room(&mut self, bytes: usize, batch: &mut OpenBatch) -> Result<()> {
        self.retire_offloads()?;
        let Some(max) = self.window.offload_bytes else {
            return Ok(());
        };
        loop {
            let inflight = self.offload_inflight_bytes() + batch.bytes;
            if inflight == 0 || inflight + bytes <= max {
                return Ok(());
            }
            if self.offloads_in_flight.is_empty() {
                self.close_batch(batch, Ok(()))?;
            }
            let (f, _) = self
                .offloads_in_flight
                .pop_front()
                .expect("the open batch was just closed");
            self.platform.synchronize_event(&f)?;
            self.stats.offload_window_waits += 1;
        }
    }

    fn offload_into<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
        batch: &mut OpenBatch,
    ) -> Result<()> {
        let mut reuse_waited = Waited::default();
        let mut tensors: Vec<&mut SwapTensor> = tensors.into_iter().collect();
        // How each tensor to offload travels, decided once (a policy may be the framework's).
        let mut modes = Vec::with_capacity(tensors.len());
        for t in &tensors {
            modes.push(match t.state {
                SwapState::Device => {
                    let tensor = t.saved.tensor().expect("device state holds a tensor");
                    Some(self.compression_for(tensor))
                }
                SwapState::NonTensor | SwapState::D2h | SwapState::Host => None,
                SwapState::H2d => return Err(t.wrong("offload", "device")),
            });
        }
        // Device-codec encodings of the tensors ahead, by index: made a chunk at a time.
        let mut encoded: HashMap<usize, Encoded> = HashMap::new();
        for i in 0..tensors.len() {
            let Some(mode) = modes[i] else { continue };
            if mode == Compression::Device && !encoded.contains_key(&i) {
                self.order_after(&self.d2h, compute, self.faults.skip_producer_wait)?;
                encoded = self.encode_chunk_on_device(&tensors, &modes, i)?;
            }
            let t = &mut *tensors[i];
            self.make_room(t.swap_bytes(), batch)?;
            let f = match &batch.fence {
                Some(f) => Arc::clone(f),
                None => {
                    self.order_after(&self.d2h, compute, self.faults.skip_producer_wait)?;
                    let f = self.new_fence()?;
                    batch.fence = Some(Arc::clone(&f));
                    f
                }
            };
            let tensor = t.saved.tensor().expect("device state holds a tensor");
            let version = tensor.version.get();
            // (A device-coded tensor always has its encoding made ahead.)
            let mut host = match (encoded.remove(&i), mode) {
                (Some(e), _) => self.copy_encoding(e, &mut reuse_waited)?,
                (None, Compression::HostStage) => self.encode_on_host(tensor, &mut reuse_waited)?,
                (None, _) => {
                    let block = self.block(tensor.len, &self.d2h, &mut reuse_waited)?;
                    self.platform.copy_async(
                        block.buffer().into(),
                        0,
                        (&tensor.storage).into(),
                        tensor.offset,
                        tensor.len,
                        &self.d2h,
                    )?;
                    HostCopy::Plain(block)
                }
            };
            if let Some(b) = host.block_mut() {
                b.set_last_use(&f);
            }
            self.stats.offloaded_tensors += 1;
            self.stats.offloaded_bytes += tensor.len as u64;
            self.stats.link_d2h_bytes += host.link_bytes() as u64;
            batch.bytes += tensor.len;
            t.version_at_offload = version;
            // Released storages are keyed by the address they had: unique among live storages,
            // and the same for every view offloaded while it is live.
            t.release_key = tensor.storage.device_ptr();
            t.modified = None;
            t.host = Some(host);
            t.d2h = Some(f);
            t.state = SwapState::D2h;
            // The copy is queued: a framework that orders its memory's reuse after the copy
            // stream takes the memory back now, not when the host later sees the copy done.
            if self.hand_over(tensor, &[&self.d2h]) {
                release_borrowed(t, &self.empty);
                t.handed_back = true;
                self.stats.handed_back_tensors += 1;
            }
        }
        Ok(())
    }

    /// Asks a borrowed tensor's framework to take its memory back, ordered after `streams`
    /// (see [`crate::Allocator::hand_over`]); a failure is logged and leaves the memory with
    /// the engine, which releases it the usual way.
    fn hand_over(&self, tensor: &DeviceTensor, streams: &[&Stream]) -> bool {
        let Origin::Borrowed(alloc) = &tensor.origin else {
            return false;
        };
        alloc.hand_over(tensor, streams).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the framework could not take its memory back early");
            false
        })
    }

    /// Encodes, with one batched launch sequence on the device codec, the device-coded tensors
    /// from `first` on, as many as fit [`ENCODE_SCRATCH_BYTES`] of scratch (at least one), and
    /// waits on the host once for their lengths, which size the copies.
    fn encode_chunk_on_device(
        &mut self,
        tensors: &[&mut SwapTensor],
        modes: &[Option<Compression>],
        first: usize,
    ) -> Result<HashMap<usize, Encoded>> {
        let p: &dyn Platform = &*self.platform;
        let start = Instant::now();
        let mut chunk = Vec::new(); // (index, tensor, dtype, numel, scratch)
        let mut scratch_bytes = 0;
        for (i, t) in tensors.iter().enumerate().skip(first) {
            if modes[i] != Some(Compression::Device) {
                continue;
            }
            let tensor = t.saved.tensor().expect("device state holds a tensor");
            let dtype = codec_dtype(tensor.dtype).expect("compression_for checked the dtype");
            let numel = tensor.numel();
            let max = self.codec.max_encoded_len(dtype, numel);
            if !chunk.is_empty() && scratch_bytes + max > ENCODE_SCRATCH_BYTES {
                break;
            }
            scratch_bytes += max;
            chunk.push((i, tensor, dtype, numel, p.alloc_device(max)?));
        }
        let stream = match &self.codec_stream {
            // After the producer, which the offload stream already waits for.
            Some(c) => {
                self.order_after(c, &self.d2h, false)?;
                c
            }
            None => &self.d2h,
        };
        let items: Vec<EncodeItem<'_>> = chunk
            .iter()
            .map(|(_, t, dtype, numel, scratch)| EncodeItem {
                src: t.storage.at(t.offset),
                dtype: *dtype,
                numel: *numel,
                scratch,
            })
            .collect();
        let pending = self.codec.encode_batch_async(p, &items, stream)?;
        drop(items);
        let mut encoded = HashMap::with_capacity(chunk.len());
        // The host waits for the encodes (once: they share a stream), so the copies queued
        // from them read complete encodings.
        for ((i, _, _, _, scratch), pending) in chunk.into_iter().zip(pending) {
            let len = pending.wait_len(p)?;
            encoded.insert(i, Encoded { scratch, len });
        }
        self.codec_ns
            .fetch_add(elapsed_ns(start), Ordering::Relaxed);
        Ok(encoded)
    }

    /// Queues the copy of a device encoding alone into a pinned block.
    fn copy_encoding(&mut self, e: Encoded, waited: &mut Waited) -> Result<HostCopy> {
        let Encoded { scratch, len } = e;
        let block = self.block(size_class(len), &self.d2h, waited)?;
        self.platform.copy_async(
            block.buffer().into(),
            0,
            (&scratch).into(),
            0,
            len,
            &self.d2h,
        )?;
        // Dropped now: the platform frees it after the queued copy read it.
        drop(scratch);
        self.stats.compressed_tensors += 1;
        self.stats.compressed_bytes += len as u64;
        Ok(HostCopy::Device { block, len })
    }

    /// Copies the raw bytes into a pinned staging block and encodes them on a host thread in
    /// stream order; the staging block goes back to the pool once the encoding is taken.
    fn encode_on_host(&mut self, t: &DeviceTensor, waited: &mut Waited) -> Result<HostCopy> {
        let dtype = codec_dtype(t.dtype).expect("compression_for checked the dtype");
        let staging = self.block(t.len, &self.d2h, waited)?;
        self.platform.copy_async(
            staging.buffer().into(),
            0,
            (&t.storage).into(),
            t.offset,
            t.len,
            &self.d2h,
        )?;
        let slot: Slot<Vec<u8>> = Arc::default();
        let (buf, out, ns) = (
            staging.buffer().clone(),
            Arc::clone(&slot),
            Arc::clone(&self.codec_ns),
        );
        let raw_len = t.len;
        self.platform.launch_host_fn(
            &self.d2h,
            Box::new(move || {
                let start = Instant::now();
                // Encoded where the copy left the bytes: no copy out of the block, and no
                // fresh buffer for it to fault in page by page.
                // SAFETY: stream order: the copy into the block, queued before this host
                // function on its stream, finished, and nothing queued after it has started.
                let r = unsafe {
                    buf.with_unsynchronized(0, raw_len, |raw| {
                        codec::encode(dtype, raw, &EncodeOptions::default())
                    })
                }
                .map_err(SwapError::from)
                .and_then(|encoded| encoded.map_err(SwapError::from));
                ns.fetch_add(elapsed_ns(start), Ordering::Relaxed);
                *lock(&out) = Some(r);
            }),
        )?;
        Ok(HostCopy::Staged {
            staging: Some(staging),
            slot,
            encoded: None,
            raw_len,
        })
    }

    /// Waits (on the host) for the offloads of the tensors in state `d2h`, then releases their
    /// device memory (owned: resized to zero; borrowed: every reference dropped, so the
    /// framework gets it back). Tensors already in `host` are skipped; `device`/`h2d` are errors.
    /// A tensor whose memory its framework took back when the offload was queued needs no host
    /// wait (its reload waits for the copy on the reload stream), except a host-stage one,
    /// whose encoding the host collects.
    pub fn finish_offload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<()> {
        let mut synced = Waited::default();
        for t in tensors {
            match t.state {
                SwapState::D2h => {}
                SwapState::NonTensor | SwapState::Host => continue,
                SwapState::Device | SwapState::H2d => return Err(t.wrong("finish_offload", "d2h")),
            }
            let staged = matches!(t.host, Some(HostCopy::Staged { .. }));
            let fence = t.d2h.as_ref().expect("d2h state holds its fence");
            if (staged || !t.handed_back) && synced.first_time(fence) {
                self.platform.synchronize_event(fence)?;
            }
            if let (false, Saved::Tensor(tensor)) = (t.handed_back, &t.saved) {
                if matches!(tensor.origin, Origin::Owned) {
                    // First, so that a refusal (a view of the memory is alive) leaves the
                    // tensor in `d2h`, to be finished again once the view is gone.
                    self.release_owned(&tensor.storage)?;
                }
            }
            self.keep_host_copy(t);
            if t.handed_back {
                t.state = SwapState::Host;
                continue;
            }
            let Saved::Tensor(tensor) = &mut t.saved else {
                unreachable!("d2h state holds a tensor")
            };
            // A write that raced the copy may have torn it: the reload reports it.
            let now = tensor.version.get();
            if now != t.version_at_offload {
                t.modified = Some(now);
            }
            match tensor.origin {
                Origin::Owned => {
                    let key = t.release_key;
                    let bucket = self.released.entry(key).or_default();
                    match bucket
                        .iter_mut()
                        .find(|r| r.storage.same_as(&tensor.storage))
                    {
                        Some(r) => r.pending += 1,
                        None => bucket.push(Released {
                            storage: tensor.storage.clone(),
                            pending: 1,
                            reacquired: false,
                        }),
                    }
                }
                Origin::Borrowed(_) => release_borrowed(t, &self.empty),
            }
            t.state = SwapState::Host;
        }
        Ok(())
    }

    /// Waits on the host for the offload copies of the tensors in state `d2h` (once per batch),
    /// without releasing anything: how a front end keeps its schedule's bound on the copies in
    /// flight when their memory already went back to the framework, which cannot reuse it
    /// before the copies finished (device memory is still taken until then).
    pub fn wait_copies<'a>(&self, tensors: impl IntoIterator<Item = &'a SwapTensor>) -> Result<()> {
        let mut synced = Waited::default();
        for t in tensors {
            if let (SwapState::D2h, Some(f)) = (t.state, &t.d2h) {
                if synced.first_time(f) {
                    self.platform.synchronize_event(f)?;
                }
            }
        }
        Ok(())
    }

    /// After the offload completed: the host stage's encoding replaces its staging block (the
    /// raw bytes stay if the encode failed, so nothing is lost).
    fn keep_host_copy(&mut self, t: &mut SwapTensor) {
        let Some(HostCopy::Staged {
            staging,
            slot,
            encoded,
            ..
        }) = t.host.as_mut()
        else {
            return;
        };
        match take(slot) {
            Some(Ok(bytes)) => {
                self.stats.compressed_tensors += 1;
                self.stats.compressed_bytes += bytes.len() as u64;
                *encoded = Some(Arc::new(bytes));
                *staging = None;
            }
            failed => {
                if let Some(Err(e)) = failed {
                    tracing::warn!(error = %e, "host-stage encode failed; keeping raw bytes");
                }
                let block = staging.take().expect("staged offload holds its block");
                t.host = Some(HostCopy::Plain(block));
            }
        }
    }

    /// Takes back tensors whose offload is still queued (`d2h`) without copying: their device
    /// bytes were never released. Their host blocks return to the pool, to be reused only after
    /// the queued copy, and the next reload waits for that copy before it allocates (see the
    /// ordering rules on [`SwapEngine`]). Tensors in `device` are skipped; `host`/`h2d` are
    /// errors. A tensor whose memory its framework already took back cannot be taken back: it
    /// goes to `host` (as [`SwapEngine::finish_offload`] does), for the caller's reload.
    pub fn cancel_offload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<()> {
        for t in tensors {
            match t.state {
                SwapState::D2h => {}
                SwapState::NonTensor | SwapState::Device => continue,
                SwapState::Host | SwapState::H2d => return Err(t.wrong("cancel_offload", "d2h")),
            }
            if t.handed_back {
                self.finish_offload([t])?;
                continue;
            }
            if let Some(f) = t.d2h.take() {
                if !self.taken_back.iter().any(|w| Arc::ptr_eq(w, &f)) {
                    self.taken_back.push(f);
                }
            }
            t.host = None;
            t.state = SwapState::Device;
        }
        Ok(())
    }

    /// Waits for the copies of the offloads taken back since the last reload (the memory they
    /// read stays device memory until they finished).
    fn wait_taken_back(&mut self) -> Result<()> {
        if self.faults.skip_taken_back_wait {
            self.taken_back.clear();
        }
        while let Some(f) = self.taken_back.last() {
            self.platform.synchronize_event(f)?;
            self.taken_back.pop();
        }
        Ok(())
    }

    /// Re-acquires the device memory of the tensors in state `host` and queues host → device
    /// copies (and decodes) on the reload stream. A tensor changed since its offload, or whose
    /// storage someone else re-acquired, is an error; a failed re-acquisition (device out of
    /// memory) leaves that tensor and the rest in `host` with their host copies, so the call can
    /// be retried. Tensors in `h2d`/`device` are skipped; `d2h` (offload not finished) is an
    /// error.
    pub fn start_reload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<()> {
        let mut fence = None;
        let outcome = self.reload_into(tensors, &mut fence);
        self.seal(fence, &self.h2d, outcome)
    }

    fn reload_into<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        fence: &mut Option<Fence>,
    ) -> Result<()> {
        let mut tensors: Vec<&mut SwapTensor> = tensors.into_iter().collect();
        let mut decodes = Vec::new();
        let queued = self.queue_reloads(&mut tensors, fence, &mut decodes);
        // The device decodes of the tensors queued, also when a later one failed.
        let decoded = self.decode_on_device(&mut tensors, decodes);
        queued.and(decoded)
    }

    /// The loop of [`SwapEngine::reload_into`]: the device codec's decodes are left in
    /// `decodes`, to be queued together.
    fn queue_reloads(
        &mut self,
        tensors: &mut [&mut SwapTensor],
        fence: &mut Option<Fence>,
        decodes: &mut Vec<DeferredDecode>,
    ) -> Result<()> {
        let mut reuse_waited = Waited::default();
        let mut copy_waited = Waited::default();
        for (index, t) in tensors.iter_mut().enumerate() {
            let t = &mut **t;
            match t.state {
                SwapState::Host => {}
                SwapState::NonTensor | SwapState::H2d | SwapState::Device => continue,
                SwapState::D2h => return Err(t.wrong("start_reload", "host")),
            }
            self.wait_taken_back()?;
            if let Some(current) = t.modified {
                return Err(SwapError::ModifiedSinceOffload {
                    saved: t.version_at_offload,
                    current,
                });
            }
            // The device codec's encoding comes back into a scratch buffer, allocated before
            // the storage so that running out of memory for either leaves nothing behind.
            let scratch = match &t.host {
                Some(HostCopy::Device { len, .. }) => Some(self.platform.alloc_device(*len)?),
                _ => None,
            };
            let (ready_on, undo) = self.reacquire(t)?;
            // Memory pressure is when swap runs: a step failing after the re-acquisition gives
            // the memory back, so the tensor stays in `host` with its copy, ready for a retry.
            let queued = self.queue_reload(
                t,
                ready_on,
                scratch,
                fence,
                &mut reuse_waited,
                &mut copy_waited,
            );
            match queued {
                Ok(Some(enc)) => decodes.push(DeferredDecode { index, enc, undo }),
                Ok(None) => {}
                Err(e) => {
                    self.undo_reacquire(t, undo);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Queues the device codec's decodes of one reload call with one batched launch, on the
    /// codec stream between the copies in and the reload's fence. A failure gives every one
    /// of them back to `host`, as a failed reload of each would.
    fn decode_on_device(
        &mut self,
        tensors: &mut [&mut SwapTensor],
        decodes: Vec<DeferredDecode>,
    ) -> Result<()> {
        if decodes.is_empty() {
            return Ok(());
        }
        let p: &dyn Platform = &*self.platform;
        let start = Instant::now();
        let items: Vec<DecodeItem<'_>> = decodes
            .iter()
            .map(|d| {
                let t = tensors[d.index].saved.tensor().expect("h2d holds a tensor");
                DecodeItem {
                    src: &d.enc,
                    dst: t.storage.at(t.offset),
                }
            })
            .collect();
        let pending = match &self.codec_stream {
            // After the copies in, and the reload stream (whose fence the caller waits for)
            // after the decodes.
            Some(c) => self.order_after(c, &self.h2d, false).and_then(|()| {
                let d = self.codec.decode_batch_async(p, &items, c)?;
                self.order_after(&self.h2d, c, false)?;
                Ok(d)
            }),
            None => self
                .codec
                .decode_batch_async(p, &items, &self.h2d)
                .map_err(SwapError::from),
        };
        drop(items);
        self.codec_ns
            .fetch_add(elapsed_ns(start), Ordering::Relaxed);
        match pending {
            Ok(pending) => {
                for (d, pending) in decodes.into_iter().zip(pending) {
                    tensors[d.index].check = ReloadCheck::Decode(pending);
                }
                Ok(())
            }
            Err(e) => {
                for d in decodes {
                    let t = &mut *tensors[d.index];
                    t.state = SwapState::Host;
                    t.h2d = None;
                    t.reload_charge = None;
                    self.undo_reacquire(t, d.undo);
                }
                Err(e)
            }
        }
    }

    /// Queues the reload of `t`, whose memory was just re-acquired (see `reload_into`); a
    /// device encoding's decode is returned, to be queued with the others of the call.
    fn queue_reload(
        &mut self,
        t: &mut SwapTensor,
        ready_on: Option<Stream>,
        scratch: Option<DeviceBuffer>,
        fence: &mut Option<Fence>,
        reuse_waited: &mut Waited,
        copy_waited: &mut Waited,
    ) -> Result<Option<CompressedTensor>> {
        let mut decode = None;
        {
            // A platform never hands back memory under queued work, so a reload into it needs
            // no wait and a prefetch overlaps the compute before it; a framework's caching
            // allocator does (torch's hands a block out again in its stream's order): the copy
            // then waits for the work queued on that stream so far.
            if let Some(ready_on) = ready_on {
                self.order_after(&self.h2d, &ready_on, false)?;
            }
            // The host never waited for an offload whose memory went back early: the reload
            // reads the pinned copy after it, in stream order.
            if t.handed_back {
                if let Some(d2h) = t.d2h.as_ref().filter(|f| copy_waited.first_time(f)) {
                    self.platform.stream_wait_event(&self.h2d, d2h)?;
                }
            }
            let f = match fence {
                Some(f) => Arc::clone(f),
                None => {
                    let f = self.new_fence()?;
                    *fence = Some(Arc::clone(&f));
                    f
                }
            };
            let tensor = t.saved.tensor().expect("host state holds a tensor");
            let (dst, offset, len) = (&tensor.storage, tensor.offset, tensor.len);
            let p: &dyn Platform = &*self.platform;
            let host = t.host.as_mut().expect("host state holds its copy");
            let link = match host {
                HostCopy::Plain(block) => {
                    p.copy_async(dst.into(), offset, block.buffer().into(), 0, len, &self.h2d)?;
                    block.set_last_use(&f);
                    len
                }
                HostCopy::Device { block, len: n, .. } => {
                    let scratch = scratch.expect("allocated above for a device encoding");
                    p.copy_async(
                        (&scratch).into(),
                        0,
                        block.buffer().into(),
                        0,
                        *n,
                        &self.h2d,
                    )?;
                    block.set_last_use(&f);
                    let dtype = codec_dtype(tensor.dtype).expect("compressed dtype");
                    // The encoding holds the scratch, which the platform frees after the
                    // queued decode read it.
                    decode = Some(CompressedTensor::from_device_bytes(
                        scratch,
                        *n,
                        dtype,
                        tensor.numel(),
                    )?);
                    *n
                }
                HostCopy::Staged {
                    encoded, raw_len, ..
                } => {
                    let encoded = Arc::clone(encoded.as_ref().expect("host state holds it"));
                    let raw_len = *raw_len;
                    let mut raw = self.block(raw_len, &self.h2d, reuse_waited)?;
                    let slot: Slot<()> = Arc::default();
                    let (buf, out, ns) = (
                        raw.buffer().clone(),
                        Arc::clone(&slot),
                        Arc::clone(&self.codec_ns),
                    );
                    p.launch_host_fn(
                        &self.h2d,
                        Box::new(move || {
                            let start = Instant::now();
                            // Decoded straight into the pinned block the copy takes to the
                            // device: no fresh buffer, no second pass over the bytes.
                            // SAFETY: stream order: the copy out of the block is queued after
                            // this host function on its stream, and the block's previous use
                            // finished before the pool handed it out.
                            let r = unsafe {
                                buf.with_unsynchronized_mut(0, raw_len, |out| {
                                    codec::decode_into(&encoded, out, &DecodeOptions::default())
                                })
                            }
                            .map_err(SwapError::from)
                            .and_then(|decoded| decoded.map(drop).map_err(SwapError::from));
                            ns.fetch_add(elapsed_ns(start), Ordering::Relaxed);
                            *lock(&out) = Some(r);
                        }),
                    )?;
                    p.copy_async(dst.into(), offset, raw.buffer().into(), 0, len, &self.h2d)?;
                    raw.set_last_use(&f);
                    t.check = ReloadCheck::Staged(slot, raw);
                    len
                }
            };
            self.stats.reloaded_tensors += 1;
            self.stats.reloaded_bytes += len as u64;
            self.stats.link_h2d_bytes += link as u64;
            t.reload_charge = Some(Charge::new(&self.reload_inflight, len));
            let now = self.reload_inflight.load(Ordering::Acquire) as u64;
            self.stats.reload_inflight_peak = self.stats.reload_inflight_peak.max(now);
            t.h2d = Some(f);
            t.state = SwapState::H2d;
        }
        Ok(decode)
    }

    /// Gives back what [`SwapEngine::reacquire`] took for a reload that then failed: borrowed
    /// memory goes back to its framework, owned storage is resized to zero again (when this
    /// reload resized it) and counted released again.
    fn undo_reacquire(&mut self, t: &mut SwapTensor, undo: Undo) {
        match undo {
            Undo::Borrowed => release_borrowed(t, &self.empty),
            Undo::Owned { resized } => {
                let Saved::Tensor(tensor) = &t.saved else {
                    return;
                };
                if resized {
                    if let Err(e) = self.release_owned(&tensor.storage) {
                        tracing::warn!(error = %e, "a failed reload could not release its storage");
                    }
                }
                let bucket = self.released.entry(t.release_key).or_default();
                match bucket
                    .iter_mut()
                    .find(|r| r.storage.same_as(&tensor.storage))
                {
                    Some(r) => {
                        r.pending += 1;
                        r.reacquired &= !resized;
                    }
                    None => bucket.push(Released {
                        storage: tensor.storage.clone(),
                        pending: 1,
                        reacquired: !resized,
                    }),
                }
            }
        }
    }

    /// [`SwapEngine::start_reload`] for a prefetch: only the tensors that fit the reload window
    /// (see [`InflightWindow`]) start, in order; the rest stay in `host` for a later prefetch
    /// or their own load. Returns how many started (with at most one tensor of an empty
    /// window, so an oversized tensor still prefetches alone).
    pub fn prefetch<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
    ) -> Result<usize> {
        let Some(max) = self.window.reload_bytes else {
            let mut started = 0;
            let tensors: Vec<_> = tensors
                .into_iter()
                .inspect(|t| started += usize::from(t.state == SwapState::Host))
                .collect();
            self.start_reload(tensors)?;
            return Ok(started);
        };
        let mut planned = self.reload_inflight.load(Ordering::Acquire);
        let mut admitted = Vec::new();
        for t in tensors {
            if t.state != SwapState::Host {
                continue;
            }
            let n = t.swap_bytes();
            if planned > 0 && planned + n > max {
                self.stats.prefetches_deferred += 1;
                continue;
            }
            planned += n;
            admitted.push(t);
        }
        let started = admitted.len();
        self.start_reload(admitted)?;
        Ok(started)
    }

    /// Gives a released tensor device memory again: owned storage is resized back (once for all
    /// its views), borrowed memory comes from the framework's allocator. Returns the stream the
    /// allocator's memory is ready on ([`crate::Reacquired::ready_on`]).
    fn reacquire(&mut self, t: &mut SwapTensor) -> Result<(Option<Stream>, Undo)> {
        let storage_len = t.storage_len;
        let Saved::Tensor(tensor) = &mut t.saved else {
            unreachable!("host state holds a tensor")
        };
        match &tensor.origin {
            Origin::Owned => {
                let current = tensor.version.get();
                if current != t.version_at_offload {
                    return Err(SwapError::ModifiedSinceOffload {
                        saved: t.version_at_offload,
                        current,
                    });
                }
                let key = t.release_key;
                let bucket = self.released.get_mut(&key);
                let at = bucket
                    .as_ref()
                    .and_then(|b| b.iter().position(|r| r.storage.same_as(&tensor.storage)));
                let reacquired_here = match (&bucket, at) {
                    (Some(b), Some(i)) => b[i].reacquired,
                    _ => false,
                };
                let resized = tensor.storage.is_empty();
                match tensor.storage.len() {
                    0 => self.platform.resize_device(&tensor.storage, storage_len)?,
                    // Another saved view of it was reloaded first.
                    n if n == storage_len && reacquired_here => {}
                    n if n == storage_len => return Err(SwapError::ReacquiredOutsideSwap),
                    actual => {
                        return Err(SwapError::StorageResized {
                            expected: storage_len,
                            actual,
                        })
                    }
                }
                if let (Some(bucket), Some(i)) = (self.released.get_mut(&key), at) {
                    let r = &mut bucket[i];
                    r.reacquired = true;
                    r.pending -= 1;
                    if r.pending == 0 {
                        bucket.swap_remove(i);
                        if bucket.is_empty() {
                            self.released.remove(&key);
                        }
                    }
                }
                Ok((None, Undo::Owned { resized }))
            }
            Origin::Borrowed(allocator) => {
                let got = allocator.allocate(tensor)?;
                let fits = got
                    .offset
                    .checked_add(tensor.len)
                    .is_some_and(|end| end <= got.storage.len());
                if !fits {
                    return Err(SwapError::InvalidTensor(format!(
                        "the allocator gave {} bytes for a {}-byte tensor at offset {}",
                        got.storage.len(),
                        tensor.len,
                        got.offset
                    )));
                }
                tensor.storage = got.storage;
                tensor.offset = got.offset;
                tensor.handle = got.handle;
                tensor.version = got.version;
                Ok((got.ready_on, Undo::Borrowed))
            }
        }
    }

    /// Makes `compute` wait for the reloads of the tensors in state `h2d` (no host
    /// synchronization, except for compressed payloads, whose decode is checked on the host)
    /// and hands them back in state `device`; their host copies are dropped. A failed decode
    /// leaves the tensor in `host` with its copy. Tensors in `device` are skipped; `d2h`/`host`
    /// are errors.
    pub fn finish_reload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
    ) -> Result<()> {
        let mut waited = Waited::default();
        for t in tensors {
            match t.state {
                SwapState::H2d => {}
                SwapState::NonTensor | SwapState::Device => continue,
                SwapState::D2h | SwapState::Host => return Err(t.wrong("finish_reload", "h2d")),
            }
            let fence = Arc::clone(t.h2d.as_ref().expect("h2d state holds its fence"));
            let checked = match std::mem::take(&mut t.check) {
                ReloadCheck::None => Ok(()),
                ReloadCheck::Decode(pending) => pending.finish(&*self.platform).map_err(Into::into),
                ReloadCheck::Staged(slot, _raw) => {
                    self.platform.synchronize_event(&fence)?;
                    take(&slot).unwrap_or_else(|| {
                        Err(SwapError::Order("the host-stage decode did not run".into()))
                    })
                }
            };
            if let Err(e) = checked {
                t.h2d = None;
                t.state = SwapState::Host;
                return Err(e);
            }
            if !self.faults.skip_reload_wait && waited.first_time(&fence) {
                self.platform.stream_wait_event(compute, &fence)?;
            }
            t.h2d = None;
            t.host = None;
            t.d2h = None;
            t.handed_back = false;
            t.reload_charge = None;
            t.state = SwapState::Device;
            // The compute stream waits for the copy: the memory is the framework's from now on
            // (hprt keeps only the handle the front end hands out). No stream to record: every
            // use and the free come after that wait in the compute stream's order (recording the
            // reload stream would hold the block until the later prefetches queued there ran).
            if let Some(tensor) = t.saved.tensor() {
                self.hand_over(tensor, &[]);
            }
        }
        Ok(())
    }

    /// Makes `compute` wait for everything queued on the reload stream so far (events only: safe
    /// inside graph capture).
    pub fn wait_reloads_on(&self, compute: &Stream) -> Result<()> {
        self.order_after(compute, &self.h2d, self.faults.skip_reload_wait)
    }

    /// Makes `compute` wait for every offload queued so far (events only).
    pub fn wait_offloads_on(&self, compute: &Stream) -> Result<()> {
        self.order_after(compute, &self.d2h, false)
    }

    /// Makes the offload stream wait for everything queued on `compute` so far (events only).
    pub fn order_offloads_after(&self, compute: &Stream) -> Result<()> {
        self.order_after(&self.d2h, compute, self.faults.skip_producer_wait)
    }

    /// Whether every copy queued on `tensors`' offload fences has completed (never blocks).
    pub(crate) fn offload_done(&self, t: &SwapTensor) -> Result<bool> {
        match &t.d2h {
            Some(f) if t.state == SwapState::D2h => Ok(self.platform.query_event(f)?),
            _ => Ok(true),
        }
    }

    /// Blocks until every copy the engine queued has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.platform.synchronize_stream(&self.d2h)?;
        self.platform.synchronize_stream(&self.h2d)?;
        Ok(())
    }

    /// Ends an iteration: waits for queued copies, forgets released storages (their tensors
    /// were dropped by the caller) and starts a new iteration of the pinned pool.
    pub fn end_iteration(&mut self) -> Result<()> {
        self.synchronize()?;
        self.released.clear();
        self.taken_back.clear();
        self.offloads_in_flight.clear();
        self.pool.reset();
        Ok(())
    }
}

/// Drops the engine's references to a borrowed tensor's memory (its framework gets it back once
/// no queued work uses it, or at once when it took it over).
fn release_borrowed(t: &mut SwapTensor, empty: &DeviceBuffer) {
    if let Saved::Tensor(tensor) = &mut t.saved {
        tensor.storage = empty.clone();
        tensor.handle = None;
        tensor.version = VersionCounter::new();
    }
}
