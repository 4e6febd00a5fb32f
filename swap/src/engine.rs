//! The copy engine every front end drives: batched offload / reload of [`SwapTensor`]s on the
//! engine's own copy streams, with the stream waits and host synchronizations that make it safe.
//! This file holds the engine's configuration, fault switches, statistics and the ordering
//! helpers both paths share; the offload path is in `engine/offload.rs`, the reload path in
//! `engine/reload.rs`.

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

mod offload;
mod reload;

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
