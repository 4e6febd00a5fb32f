//! The copy engine every front end drives: batched offload / reload of [`SwapTensor`]s on the
//! engine's own copy streams, with the stream waits and host synchronizations that make it safe.

use std::sync::Arc;

pub use hprt_platform::PlatformHandle;
use hprt_platform::Stream;

use crate::error::{Result, SwapError, SwapState};
use crate::pool::{PinnedPool, PoolConfig, PoolStats};
use crate::tensor::{Fence, SwapTensor};

/// Settings of a [`SwapEngine`].
#[derive(Clone, Debug, Default)]
pub struct EngineConfig {
    /// One copy stream for both directions (seed 000) instead of separate d2h and h2d streams.
    pub single_copy_stream: bool,
    pub pool: PoolConfig,
}

/// Test-only switches that each remove one wait the engine needs, so tests can show (under the
/// cpu backend's jitter) that the wait is what keeps the bytes right. Never set them otherwise.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Offload does not wait for the compute stream that produced the tensor.
    pub skip_producer_wait: bool,
    /// The compute stream does not wait for a reload before the tensor is handed back.
    pub skip_reload_wait: bool,
    /// An offload into a recycled pinned block does not wait for the block's last reload.
    pub skip_pinned_reuse_wait: bool,
}

/// Bytes and tensors moved by an engine since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub offloaded_tensors: u64,
    pub offloaded_bytes: u64,
    pub reloaded_tensors: u64,
    pub reloaded_bytes: u64,
}

/// Moves tensors between device and pinned host memory for all three front ends.
///
/// The caller passes its compute stream (the framework's current stream); the engine owns its
/// copy streams. The ordering rules it enforces:
/// - an offload waits for the compute work queued before it (which produced the tensor);
/// - device bytes are released only after the host synchronized with the device-to-host copy
///   ([`SwapEngine::finish_offload`]), so a reload, which needs state `host`, can only read a
///   complete host copy;
/// - the compute stream waits for a reload before the tensor is handed back
///   ([`SwapEngine::finish_reload`]);
/// - a pinned block handed back while its reload is queued is not written again before that
///   reload read it.
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
    faults: Faults,
    stats: EngineStats,
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
        Ok(SwapEngine {
            platform,
            d2h,
            h2d,
            pool,
            mark,
            faults: Faults::default(),
            stats: EngineStats::default(),
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
        self.stats
    }

    #[doc(hidden)]
    pub fn set_faults(&mut self, faults: Faults) {
        self.faults = faults;
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

    fn new_fence(&self) -> Result<Fence> {
        Ok(Arc::new(self.platform.create_event(false)?))
    }

    /// Records `fence` after the copies `outcome` queued, then reports `outcome`: tensors that
    /// got a copy before a failure hold a fence that covers it.
    fn seal(&self, fence: Option<Fence>, stream: &Stream, outcome: Result<()>) -> Result<()> {
        if let Some(f) = fence {
            self.platform.record_event(&f, stream)?;
        }
        outcome
    }

    /// Queues device → pinned copies of the tensors in state `device`, after the work queued on
    /// `compute` so far. Tensors already offloaded (`d2h`, `host`) are skipped; `h2d` is an error.
    pub fn offload<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
    ) -> Result<()> {
        let mut fence = None;
        let outcome = self.offload_into(tensors, compute, &mut fence);
        self.seal(fence, &self.d2h, outcome)
    }

    fn offload_into<'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a mut SwapTensor>,
        compute: &Stream,
        fence: &mut Option<Fence>,
    ) -> Result<()> {
        let mut reuse_waited = Waited::default();
        for t in tensors {
            match t.state {
                SwapState::Device => {}
                SwapState::NonTensor | SwapState::D2h | SwapState::Host => continue,
                SwapState::H2d => return Err(t.wrong("offload", "device")),
            }
            let f = match fence {
                Some(f) => Arc::clone(f),
                None => {
                    self.order_after(&self.d2h, compute, self.faults.skip_producer_wait)?;
                    let f = self.new_fence()?;
                    *fence = Some(Arc::clone(&f));
                    f
                }
            };
            let tensor = t.saved.tensor().expect("device state holds a tensor");
            let mut block = self.pool.acquire(tensor.len)?;
            if let Some(prev) = block.last_use() {
                if !self.faults.skip_pinned_reuse_wait && reuse_waited.first_time(prev) {
                    self.platform.stream_wait_event(&self.d2h, prev)?;
                }
            }
            self.platform.copy_async(
                block.buffer().into(),
                0,
                (&tensor.storage).into(),
                tensor.offset,
                tensor.len,
                &self.d2h,
            )?;
            block.set_last_use(&f);
            t.version_at_offload = tensor.version.get();
            self.stats.offloaded_tensors += 1;
            self.stats.offloaded_bytes += tensor.len as u64;
            t.host = Some(block);
            t.d2h = Some(f);
            t.state = SwapState::D2h;
        }
        Ok(())
    }

    /// Waits (on the host) for the offloads of the tensors in state `d2h`, then releases their
    /// device storage. Tensors already in `host` are skipped; `device`/`h2d` are errors.
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
            let fence = t.d2h.as_ref().expect("d2h state holds its fence");
            if synced.first_time(fence) {
                self.platform.synchronize_event(fence)?;
            }
            let tensor = t.saved.tensor().expect("d2h state holds a tensor");
            self.platform.resize_device(&tensor.storage, 0)?;
            t.state = SwapState::Host;
        }
        Ok(())
    }

    /// Takes back tensors whose offload is still queued (`d2h`) without copying: their device
    /// bytes were never released. Their host blocks return to the pool, to be reused only after
    /// the queued copy. Tensors in `device` are skipped; `host`/`h2d` are errors.
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
            t.host = None;
            t.d2h = None;
            t.state = SwapState::Device;
        }
        Ok(())
    }

    /// Re-acquires the device storage of the tensors in state `host` and queues pinned → device
    /// copies on the reload stream. A tensor changed since its offload is an
    /// error; a failed re-acquisition (device out of memory) leaves that tensor and the rest in
    /// `host` with their host copies, so the call can be retried. Tensors in `h2d`/`device` are
    /// skipped; `d2h` (offload not finished) is an error.
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
        for t in tensors {
            match t.state {
                SwapState::Host => {}
                SwapState::NonTensor | SwapState::H2d | SwapState::Device => continue,
                SwapState::D2h => return Err(t.wrong("start_reload", "host")),
            }
            let tensor = t.saved.tensor().expect("host state holds a tensor");
            let current = tensor.version.get();
            if current != t.version_at_offload {
                return Err(SwapError::ModifiedSinceOffload {
                    saved: t.version_at_offload,
                    current,
                });
            }
            match tensor.storage.len() {
                0 => self
                    .platform
                    .resize_device(&tensor.storage, t.storage_len)?,
                n if n == t.storage_len => {} // another saved view of it was reloaded first
                actual => {
                    return Err(SwapError::StorageResized {
                        expected: t.storage_len,
                        actual,
                    })
                }
            }
            // No wait for the compute stream here (the seeds need one because their caching
            // allocator may hand back memory compute work still uses; a platform never hands
            // back memory under queued work), so a prefetch overlaps the compute before it.
            let f = match fence {
                Some(f) => Arc::clone(f),
                None => {
                    let f = self.new_fence()?;
                    *fence = Some(Arc::clone(&f));
                    f
                }
            };
            let block = t.host.as_mut().expect("host state holds its block");
            self.platform.copy_async(
                (&tensor.storage).into(),
                tensor.offset,
                block.buffer().into(),
                0,
                tensor.len,
                &self.h2d,
            )?;
            block.set_last_use(&f);
            self.stats.reloaded_tensors += 1;
            self.stats.reloaded_bytes += tensor.len as u64;
            t.h2d = Some(f);
            t.state = SwapState::H2d;
        }
        Ok(())
    }

    /// Makes `compute` wait for the reloads of the tensors in state `h2d` (no host
    /// synchronization) and hands them back in state `device`; their host blocks return to the
    /// pool. Tensors in `device` are skipped; `d2h`/`host` are errors.
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
            let fence = t.h2d.take().expect("h2d state holds its fence");
            if !self.faults.skip_reload_wait && waited.first_time(&fence) {
                self.platform.stream_wait_event(compute, &fence)?;
            }
            t.host = None;
            t.d2h = None;
            t.state = SwapState::Device;
        }
        Ok(())
    }

    /// Makes `compute` wait for everything queued on the reload stream so far (events only: safe
    /// inside graph capture).
    pub fn wait_reloads_on(&self, compute: &Stream) -> Result<()> {
        self.order_after(compute, &self.h2d, self.faults.skip_reload_wait)
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
}
