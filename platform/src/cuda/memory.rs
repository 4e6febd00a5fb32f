//! Memory: buffers are `auxil::uses::TrackedMem` (use events, stream-ordered frees) over the
//! driver calls below, and device memory comes from a caching pool ([`DevicePool`]) in front of
//! `cuMemAlloc` / `cuMemFree`.

use super::*;

/// Sizes are rounded up to this, so storages of nearly equal size share blocks (the smallest
/// rounding of torch's caching allocator).
const BLOCK_GRANULE: usize = 512;

/// Bytes of freed device memory each device keeps for reuse unless `HP_CUDA_ALLOC_CACHE` says
/// otherwise (as the cpu backend's `HP_CPU_ALLOC_CACHE`).
pub(super) const DEFAULT_ALLOC_CACHE: usize = 1 << 30;

/// `HP_CUDA_ALLOC_CACHE`: a byte count (`0` turns the pool off), else the default.
pub(super) fn alloc_cache_from_env() -> Result<usize> {
    match std::env::var("HP_CUDA_ALLOC_CACHE") {
        Ok(v) if !v.trim().is_empty() => crate::cpu::parse_bytes(&v).ok_or_else(|| {
            cuda_err(
                ErrorKind::InvalidValue,
                "configure",
                format!("HP_CUDA_ALLOC_CACHE={v:?} is not a byte count (e.g. 1073741824 or 1G)"),
            )
        }),
        _ => Ok(DEFAULT_ALLOC_CACHE),
    }
}

/// Freed device memory kept for reuse, hprt's own caching pool (the role of torch's caching
/// allocator, or of a driver memory pool with a release threshold): swap releases a storage at
/// every offload and re-acquires it at every reload, and without the pool each of those was a
/// `cuMemFree` and a `cuMemAlloc` (the free synchronizes the device). A block enters the pool
/// only from the deferred-free list, once the work queued on it finished, so handing it out
/// again needs no stream ordering; blocks are kept by size ([`DevicePool::block_size`]), at most
/// `cap` bytes per device; the pool is emptied when the driver runs out of memory (another
/// allocator in the process may need it) and when the platform is dropped. Cached bytes do not
/// count as allocated in [`MemoryStats`].
pub(super) struct DevicePool {
    cap: usize,
    inner: Mutex<PoolBlocks>,
}

#[derive(Default)]
struct PoolBlocks {
    bytes: usize,
    by_size: HashMap<usize, Vec<u64>>,
}

impl DevicePool {
    pub(super) fn new(cap: usize) -> Self {
        DevicePool {
            cap,
            inner: Mutex::default(),
        }
    }

    /// The size of the driver allocation behind a buffer of `bytes` (0 stays 0, which the
    /// driver refuses).
    pub(super) fn block_size(bytes: usize) -> usize {
        bytes
            .checked_next_multiple_of(BLOCK_GRANULE)
            .unwrap_or(bytes)
    }

    /// A cached block of exactly `size` bytes.
    fn take(&self, size: usize) -> Option<u64> {
        let mut c = lock(&self.inner);
        let p = c.by_size.get_mut(&size)?.pop()?;
        c.bytes -= size;
        Some(p)
    }

    /// Keeps the block if it fits under the cap; false means the caller frees it.
    fn put(&self, ptr: u64, size: usize) -> bool {
        let mut c = lock(&self.inner);
        if size == 0 || c.bytes + size > self.cap {
            return false;
        }
        c.bytes += size;
        c.by_size.entry(size).or_default().push(ptr);
        true
    }

    /// Every cached block, leaving the pool empty.
    pub(super) fn drain(&self) -> Vec<u64> {
        let mut c = lock(&self.inner);
        c.bytes = 0;
        c.by_size.drain().flat_map(|(_, v)| v).collect()
    }

    /// Bytes cached now.
    pub(super) fn cached_bytes(&self) -> usize {
        lock(&self.inner).bytes
    }

    pub(super) fn cap(&self) -> usize {
        self.cap
    }
}

/// Most use events a device keeps for reuse.
const EVENT_POOL_MAX: usize = 4096;

/// Use events of freed buffers, kept for the next buffers' uses while the allocation cache is
/// on: a re-acquired storage is a new buffer, whose first use on each stream would otherwise be a
/// `cuEventCreate`, and whose free a `cuEventDestroy`. An event enters only once its last record
/// completed (the deferred-free list checked it), so recording it again is all a reuse needs.
#[derive(Default)]
pub(super) struct EventPool {
    idle: Mutex<Vec<result::Event>>,
}

impl EventPool {
    fn take(&self) -> Option<result::Event> {
        lock(&self.idle).pop()
    }

    fn put(&self, event: result::Event) -> bool {
        let mut idle = lock(&self.idle);
        if idle.len() >= EVENT_POOL_MAX {
            return false;
        }
        idle.push(event);
        true
    }

    /// Every pooled event, leaving the pool empty.
    pub(super) fn drain(&self) -> Vec<result::Event> {
        std::mem::take(&mut *lock(&self.idle))
    }
}

impl Shared {
    /// The device whose context is bound on this thread, if it is one of this platform's.
    fn bound_device(&self) -> Option<usize> {
        let ctx = result::ctx::current().ok()??;
        self.devices.iter().position(|d| d.ctx.get() == Some(&ctx))
    }

    /// `size` bytes (a [`DevicePool::block_size`]) of `device`'s memory: a cached block, else
    /// the driver's; when the driver is out of memory the pool is emptied and the allocation
    /// tried once more. Binds `device`.
    pub(super) fn device_block(&self, device: usize, size: usize) -> Result<u64> {
        if let Some(p) = self.devices[device].pool.take(size) {
            return Ok(p);
        }
        self.bind(device)?;
        match result::mem::alloc(size) {
            Err(e) if e.kind == ErrorKind::OutOfMemory && self.empty_pool(device) > 0 => {
                result::mem::alloc(size)
            }
            r => r,
        }
    }

    /// Hands a block whose queued work finished back: to the pool if it fits, else to the
    /// driver.
    pub(super) fn release_block(&self, device: usize, ptr: u64, size: usize) {
        if self.devices[device].pool.put(ptr, size) {
            return;
        }
        if self.bind(device).is_ok() {
            // SAFETY: allocated by cuMemAlloc; no queued work uses it any more.
            let _ = unsafe { result::mem::free(ptr) };
        }
    }

    /// Frees `device`'s cached blocks with the driver (binds it); returns how many there were.
    pub(super) fn empty_pool(&self, device: usize) -> usize {
        if self.bind(device).is_err() {
            return 0;
        }
        let blocks = self.devices[device].pool.drain();
        for &p in &blocks {
            // SAFETY: cached blocks came from cuMemAlloc and no queued work uses them.
            let _ = unsafe { result::mem::free(p) };
        }
        blocks.len()
    }
}

impl MemObj {
    pub(super) fn at(&self, offset: usize) -> u64 {
        (self.ptr + offset) as u64
    }
}

/// The device address of a place.
pub(super) fn addr(place: &Place<Arc<MemObj>>) -> u64 {
    place.mem.at(place.offset)
}

/// Streams are told apart by (handle, device): a stream handle value can come back for another
/// device's stream. Frees go through the reaper: the last handle may die in a host function.
impl UseEvents for Shared {
    type Stream = (result::Stream, usize);
    type Event = result::Event;
    const NAME: &'static str = "cuda";

    fn bind_for(&self, (_, device): (result::Stream, usize)) -> Result<()> {
        self.bind(device)
    }
    fn create_event(&self) -> Result<result::Event> {
        // Called with the stream's device bound: a pooled event of that context, if any.
        let pooled = self
            .bound_device()
            .and_then(|d| self.devices[d].events.take());
        match pooled {
            Some(e) => Ok(e),
            None => result::event::create(CU_EVENT_DISABLE_TIMING),
        }
    }
    fn record_event(
        &self,
        event: result::Event,
        (stream, _): (result::Stream, usize),
    ) -> Result<()> {
        result::event::record(event, stream)
    }
    fn event_complete(&self, event: result::Event) -> Option<bool> {
        result::event::query(event).ok()
    }
    fn wait_event(&self, event: result::Event) -> bool {
        result::event::synchronize(event).is_ok()
    }
    fn destroy_event(&self, event: result::Event) {
        // Called with the device of the stream it was recorded on bound, its record complete.
        let pooled = self
            .bound_device()
            .is_some_and(|d| self.devices[d].pool.cap() > 0 && self.devices[d].events.put(event));
        if !pooled {
            // SAFETY: an event use tracking created, destroyed once, no longer waited on.
            unsafe { result::event::destroy(event) };
        }
    }
    fn drain(&self, (stream, _): (result::Stream, usize)) {
        let _ = result::stream::synchronize(stream);
    }
    fn may_call_driver(&self) -> bool {
        !host_fn::in_host_fn()
    }
    fn free_device(&self, d: usize, ptr: usize, len: usize) {
        self.devices[d].memory.release(len);
        self.release_block(d, ptr as u64, DevicePool::block_size(len));
    }
    fn free_pinned(&self, d: usize, ptr: usize, len: usize) {
        if self.bind(d).is_ok() {
            // SAFETY: allocated by cuMemHostAlloc; no queued work uses it any more.
            let _ = unsafe { result::mem::free_host(ptr as *mut c_void) };
        }
        self.pinned.release(len);
    }
    fn frees(&self) -> &Weak<DeferredFrees> {
        &self.frees
    }
    fn hand_over(self: &Arc<Self>, job: Box<dyn FnOnce() + Send>) {
        self.reaper.run_or_defer(job);
    }
}
