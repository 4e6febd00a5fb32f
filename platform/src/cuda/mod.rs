//! The cuda backend: the CUDA driver API through cudarc's `sys` layer, NCCL and NVRTC through
//! tables loaded at run time (see [`CudaSearch`] for where each library is looked for).
//!
//! Every library is probed with libloading before cudarc touches it, so a machine without CUDA
//! gets a typed `Unavailable` error naming the libraries and paths tried, and auto-detection
//! moves on. Without NCCL only collectives are unavailable; without NVRTC only kernels.
//!
//! Devices use their primary contexts (the ones PyTorch and the runtime API use), so streams and
//! pointers of a framework in the same process can be wrapped directly. Streams are created
//! non-blocking; pinned memory is page-locked, portable and never write-combined (the host reads
//! D2H targets). Memory is freed in stream order: each buffer keeps one event per stream that
//! used it, re-recorded after every use, and memory whose last handle goes under queued work is
//! freed once those events completed, without a host wait (`crate::auxil::uses`), into a
//! per-device allocation cache that later allocations of the size reuse without calling the
//! driver, and their events into a pool the next buffers' uses take from (`memory.rs`,
//! `HP_CUDA_ALLOC_CACHE`).
//!
//! Kernels ([`crate::Kernel`]) are CUDA C generated in `kernels.rs`, compiled by NVRTC once per
//! device on first use and cached; `Avg` reductions use `ncclAvg` (NCCL 2.10+) or a sum followed
//! by the scale kernel.
//!
//! Layout (as wgpu-hal's backends): this file holds the objects and the [`Backend`] impl;
//! `context.rs` opening and device contexts, `memory.rs` buffers, `stream.rs` streams and
//! events, `launch.rs` kernels, `collective.rs` NCCL. Driver calls go through `result.rs`
//! (cudarc's layering: `sys` → checked calls on typed handles → this backend); `check.rs` turns
//! statuses into errors, `probe.rs` / `dynlib.rs` find the libraries, `nccl.rs` / `nvrtc.rs`
//! load their tables.

#[cfg(feature = "bench-baselines")]
mod baseline;
mod check;
mod collective;
mod context;
mod dynlib;
mod host_fn;
mod kernels;
mod launch;
mod memory;
mod module_kernel;
mod nccl;
mod nvrtc;
mod probe;
mod result;
mod stream;
mod watchdog;

use crate::sync::lock;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys::{ncclComm_t, ncclUniqueId};

use crate::auxil;
use crate::auxil::deferred::{self, DeferredFrees};
use crate::auxil::uses::{Origin, TrackedMem, UseEvents};
use crate::backend::Backend;
use crate::capabilities::Capabilities;
use crate::collective::Collective;
use crate::dtype::{DType, ReduceOp};
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::{CopyKind, RawStream, ReleaseFn, UniqueId};
use crate::host_errors::{synchronize_all, EventRecord, Retired, StreamErrors};
use crate::info::{DeviceInfo, LibraryProbe, PlatformInfo};
use crate::kernel::{HostFn, Kernel};
use crate::memory::{MemInfo, MemoryCounter, MemoryStats};
use crate::place::{Memory, Place};
use check::cuda_err;
use host_fn::Reaper;
use launch::ptr;
use memory::addr;
use nccl::{check_supported, nccl_dtype, nccl_op, Nccl, NcclApi, UNIQUE_ID_BYTES};
use nvrtc::{Nvrtc, NvrtcApi};
pub use probe::CudaSearch;
use probe::{search, LibrarySpec};
use watchdog::{CommWatch, Watchdog};

/// Driver functions the backend calls; checked at open so a missing one is an error, not a
/// cudarc panic later. All exist since CUDA 10.0.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuMemGetInfo_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuStreamGetCtx",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyAsync",
    "cuMemsetD8Async",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuLaunchHostFunc",
];

const CU_STREAM_NON_BLOCKING: u32 = 0x1;
const CU_EVENT_DEFAULT: u32 = 0x0;
const CU_EVENT_DISABLE_TIMING: u32 = 0x2;
/// Page-locked for every context; deliberately not `CU_MEMHOSTALLOC_WRITECOMBINED`, which makes
/// host reads of D2H targets uncached and slow.
const CU_MEMHOSTALLOC_PORTABLE: u32 = 0x1;

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// (platform instance → device selected on this thread with `set_device`).
    static CURRENT: RefCell<HashMap<u64, usize>> = RefCell::new(HashMap::new());
    /// This thread's `ncclGroupStart` depth, and the collectives issued in the open group, for
    /// the watchdog once `ncclGroupEnd` queued them.
    static GROUP: RefCell<(u32, Vec<Grouped>)> = const { RefCell::new((0, Vec::new())) };
}

/// A collective issued inside an open NCCL group.
struct Grouped {
    comm: Arc<CommObj>,
    op: &'static str,
    stream: Arc<StreamObj>,
}

/// A module compiled for one device, with the functions looked up so far.
struct Module {
    raw: result::Module,
    functions: Mutex<HashMap<String, result::Function>>,
}

struct Device {
    handle: cu::CUdevice,
    name: String,
    total: usize,
    compute_capability: (i32, i32),
    /// The primary context, retained on first use (retaining creates it on the GPU). A failed
    /// retain is not kept: the next use tries again.
    ctx: OnceLock<result::Context>,
    /// Serialises the first retain, so the context is retained once.
    ctx_init: Mutex<()>,
    memory: MemoryCounter,
    /// Freed device memory kept for reuse (`memory.rs`).
    pool: memory::DevicePool,
    /// Use events of freed buffers kept for reuse, while the pool is on (`memory.rs`).
    events: memory::EventPool,
    /// Streams this platform lent to a framework (`lend_stream_to_framework`) and let go of,
    /// for its next `create_stream` on this device. Such a CUstream lives as long as the
    /// platform (its last handle), not just as long as its `Stream`: the framework may still
    /// record events on it (torch's caching allocator records on every stream a block was
    /// `record_stream`ed to when the block is freed, which can be long after the swap front end
    /// that handed the block over and its streams are gone; recording on a destroyed stream
    /// aborts the process, as it did on an H200). Dropping the platform destroys them with
    /// everything else it made.
    parked_streams: Mutex<Vec<result::Stream>>,
    /// NVRTC modules by name, compiled once per device. Only successes are kept: a failed
    /// compile or load (the driver may have been out of memory) is tried again by the next use.
    modules: Mutex<HashMap<&'static str, Arc<Module>>>,
}

/// What every object of one cuda platform value shares.
pub struct Shared {
    instance: u64,
    driver_path: String,
    driver_version: i32,
    /// The driver library is hprt's CUDA emulator ([`crate::Capabilities`]).
    emulated: bool,
    devices: Vec<Device>,
    pinned: MemoryCounter,
    streams: Mutex<Vec<Weak<StreamObj>>>,
    nccl: Result<Nccl>,
    nvrtc: Result<Nvrtc>,
    probes: Vec<LibraryProbe>,
    reaper: Reaper,
    watchdog: Arc<Watchdog>,
    /// Where memory whose queued work is not finished waits to be freed (the platform value
    /// owns the list).
    frees: Weak<DeferredFrees>,
    /// Keeps the driver library that cudarc resolved mapped.
    _driver: libloading::Library,
}

/// A CUDA stream (owned, or wrapped from a framework).
pub struct StreamObj {
    shared: Arc<Shared>,
    raw: result::Stream,
    device: usize,
    owned: bool,
    /// Lent to a framework (`lend_stream_to_framework`): parked when let go, not destroyed.
    lent: AtomicBool,
    errors: StreamErrors,
}

/// A CUDA event, with whether it was ever recorded.
pub struct EventObj {
    shared: Arc<Shared>,
    raw: result::Event,
    device: usize,
    /// Whether it was recorded, and the backend's errors its latest record carries.
    record: EventRecord,
}

/// Device, pinned or borrowed memory, with the events of its uses (`auxil::uses`).
pub type MemObj = TrackedMem<Shared>;

/// An NCCL communicator on one device, with a scratch word for barriers.
pub struct CommObj {
    shared: Arc<Shared>,
    raw: nccl::Comm,
    device: usize,
    rank: usize,
    world: usize,
    scratch: Arc<MemObj>,
    /// Whether it was aborted, and the collectives outstanding on it (`watchdog`).
    watch: Mutex<CommWatch>,
}

/// The cuda backend (see the module docs).
///
/// ```no_run
/// use hprt_platform::{cuda::CudaBackend, Platform};
/// let cuda = CudaBackend::open()?; // Unavailable (naming libcuda and the paths tried) without CUDA
/// let stream = cuda.create_stream()?;
/// let buf = cuda.alloc_device(1 << 20)?;
/// cuda.memset_async(&buf, 0, 0, buf.len(), &stream)?;
/// cuda.synchronize_stream(&stream)?;
/// # Ok::<(), hprt_platform::Error>(())
/// ```
pub struct CudaBackend {
    shared: Arc<Shared>,
    retired: Retired<Arc<StreamObj>>,
    /// Dropped last: waits for the memory still waiting for its queued work, then frees it.
    frees: Arc<DeferredFrees>,
}

impl Backend for CudaBackend {
    type Stream = Arc<StreamObj>;
    type Event = Arc<EventObj>;
    type DeviceMemory = Arc<MemObj>;
    type PinnedMemory = Arc<MemObj>;
    type Comm = Arc<CommObj>;

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn instance(&self) -> u64 {
        self.shared.instance
    }
    fn capabilities(&self) -> Capabilities {
        let s = &self.shared;
        Capabilities::driver("cuda", s.emulated, s.nvrtc.is_ok())
    }
    fn info(&self) -> PlatformInfo {
        let s = &self.shared;
        let v = s.driver_version;
        let nccl = match &s.nccl {
            Ok(n) => format!("NCCL {} ({})", n.version_string(), n.path),
            Err(e) => format!("NCCL unavailable: {}", e.message),
        };
        let nvrtc = match &s.nvrtc {
            Ok(n) => format!("NVRTC {}.{} ({})", n.version.0, n.version.1, n.path),
            Err(e) => format!("NVRTC unavailable: {}", e.message),
        };
        PlatformInfo {
            backend: BackendKind::Cuda,
            devices: s
                .devices
                .iter()
                .enumerate()
                .map(|(ordinal, d)| DeviceInfo {
                    ordinal,
                    name: format!(
                        "{} (sm_{}{})",
                        d.name, d.compute_capability.0, d.compute_capability.1
                    ),
                    total_memory: d.total,
                })
                .collect(),
            driver: format!(
                "CUDA driver {}.{} ({})",
                v / 1000,
                (v % 1000) / 10,
                s.driver_path
            ),
            libraries: s.probes.clone(),
            settings: vec![
                ("nccl".into(), nccl),
                ("nvrtc".into(), nvrtc),
                (
                    "cudarc".into(),
                    "0.19 (dynamic loading, bindings of CUDA 12.8)".into(),
                ),
                (
                    "device allocation cache".into(),
                    match s.devices.first().map_or(0, |d| d.pool.cap()) {
                        0 => "off (HP_CUDA_ALLOC_CACHE=0): every buffer is a cuMemAlloc / cuMemFree".into(),
                        cap => format!(
                            "up to {cap} bytes of freed device memory per device kept for reuse, with the freed buffers' use events (HP_CUDA_ALLOC_CACHE), emptied when the driver runs out of memory; {} bytes cached on the current device",
                            s.devices[s.current_device()].pool.cached_bytes()
                        ),
                    },
                ),
                (
                    "pinned memory".into(),
                    "cuMemHostAlloc(PORTABLE), not write-combined".into(),
                ),
                (
                    "collective timeout".into(),
                    format!(
                        "{} ms (HP_COLLECTIVE_TIMEOUT_MS; the NCCL watchdog aborts a communicator whose collective takes longer)",
                        s.watchdog.timeout().as_millis()
                    ),
                ),
            ],
        }
    }

    fn device_count(&self) -> usize {
        self.shared.devices.len()
    }
    fn set_device(&self, ordinal: usize) -> Result<()> {
        if ordinal >= self.shared.devices.len() {
            return Err(cuda_err(
                ErrorKind::InvalidValue,
                "set_device",
                format!(
                    "device {ordinal} does not exist ({} devices)",
                    self.shared.devices.len()
                ),
            ));
        }
        self.shared.bind(ordinal)?;
        CURRENT.with(|m| m.borrow_mut().insert(self.shared.instance, ordinal));
        Ok(())
    }
    fn current_device(&self) -> usize {
        self.shared.current_device()
    }
    fn mem_info(&self) -> Result<MemInfo> {
        let device = self.shared.bind_current()?;
        let (free, total) = result::ctx::mem_info()?;
        // The allocation cache's blocks are free to any allocation of this platform (it empties
        // the cache when the driver runs out), as the cpu backend's cached blocks are.
        let cached = self.shared.devices[device].pool.cached_bytes();
        Ok(MemInfo {
            free: free.saturating_add(cached).min(total),
            total,
        })
    }
    fn memory_stats(&self) -> MemoryStats {
        let d = &self.shared.devices[self.shared.current_device()].memory;
        MemoryStats::of(d, &self.shared.pinned)
    }
    fn reclaim_frees(&self) {
        // Reclaiming binds the devices of the memory it frees: the caller's context is put back.
        let saved = result::ctx::current();
        self.frees.reclaim(false);
        if let Ok(current) = saved {
            let _ = result::ctx::set_current(current);
        }
    }
    fn reset_peak_memory(&self) {
        self.shared.devices[self.shared.current_device()]
            .memory
            .reset_peak();
        self.shared.pinned.reset_peak();
    }

    fn create_stream(&self) -> Result<(Arc<StreamObj>, RawStream)> {
        let device = self.shared.bind_current()?;
        let parked = lock(&self.shared.devices[device].parked_streams).pop();
        let raw = match parked {
            Some(raw) => raw,
            None => result::stream::create(CU_STREAM_NON_BLOCKING)?,
        };
        let obj = self.stream_obj(raw, device, true);
        // A parked stream was lent before: the framework may still record on it.
        obj.lent.store(parked.is_some(), Ordering::Release);
        Ok((obj, RawStream(raw.addr())))
    }
    unsafe fn wrap_stream(&self, raw: RawStream) -> Result<Arc<StreamObj>> {
        // 0 (the legacy default stream, PyTorch's default) and the per-thread handles are valid
        // CUstreams too; they belong to the current context.
        self.shared.bind_current()?;
        // SAFETY: the caller guarantees `raw` is a live stream.
        let raw = unsafe { result::Stream::from_raw(raw.0) };
        let device = self.device_of_context(result::stream::context(raw)?)?;
        Ok(self.stream_obj(raw, device, false))
    }
    fn destroy_stream(&self, stream: Arc<StreamObj>) -> Result<()> {
        self.retired.retire(
            stream,
            |s| Backend::query_stream(self, s).unwrap_or(true),
            |s| Backend::synchronize_stream(self, s),
        );
        Ok(())
    }
    fn synchronize_stream(&self, stream: &Arc<StreamObj>) -> Result<()> {
        self.shared.bind(stream.device)?;
        let driver = result::stream::synchronize(stream.raw);
        // Both reported at once: the backend's are not left for a later synchronize.
        driver.and(stream.errors.take())
    }
    fn query_stream(&self, stream: &Arc<StreamObj>) -> Result<bool> {
        self.shared.bind(stream.device)?;
        result::stream::query(stream.raw)
    }
    fn lend_stream_to_framework(&self, stream: &Arc<StreamObj>) -> Result<()> {
        stream.lent.store(true, Ordering::Release);
        Ok(())
    }
    fn synchronize_device(&self) -> Result<()> {
        let live: Vec<Arc<StreamObj>> = lock(&self.shared.streams)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        synchronize_all(
            live,
            |s| Backend::synchronize_stream(self, s),
            &self.retired,
        )
    }

    fn create_event(&self, timing: bool) -> Result<Arc<EventObj>> {
        let device = self.shared.bind_current()?;
        let flags = if timing {
            CU_EVENT_DEFAULT
        } else {
            CU_EVENT_DISABLE_TIMING
        };
        let raw = result::event::create(flags)?;
        Ok(Arc::new(EventObj {
            shared: Arc::clone(&self.shared),
            raw,
            device,
            record: EventRecord::default(),
        }))
    }
    fn destroy_event(&self, event: Arc<EventObj>) -> Result<()> {
        drop(event);
        Ok(())
    }
    fn record_event(&self, event: &Arc<EventObj>, stream: &Arc<StreamObj>) -> Result<()> {
        self.shared.bind(stream.device)?;
        result::event::record(event.raw, stream.raw)?;
        event.record.recorded_on(&stream.errors);
        Ok(())
    }
    fn stream_wait_event(&self, stream: &Arc<StreamObj>, event: &Arc<EventObj>) -> Result<()> {
        if !event.record.is_recorded() {
            return Ok(());
        }
        self.shared.bind(stream.device)?;
        result::stream::wait_event(stream.raw, event.raw)?;
        event.record.waited_by(&stream.errors);
        Ok(())
    }
    fn query_event(&self, event: &Arc<EventObj>) -> Result<bool> {
        if !event.record.is_recorded() {
            return Ok(true);
        }
        self.shared.bind(event.device)?;
        result::event::query(event.raw)
    }
    fn synchronize_event(&self, event: &Arc<EventObj>) -> Result<()> {
        Self::wait_event(event)
    }
    fn wait_event(event: &Arc<EventObj>) -> Result<()> {
        if !event.record.is_recorded() {
            return Ok(());
        }
        event.shared.bind(event.device)?;
        result::event::synchronize(event.raw)?;
        event.record.first_error().map_or(Ok(()), Err)
    }
    fn event_elapsed_ms(&self, start: &Arc<EventObj>, end: &Arc<EventObj>) -> Result<f32> {
        for (e, what) in [(start, "start"), (end, "end")] {
            if !e.record.is_recorded() || !Backend::query_event(self, e)? {
                return Err(cuda_err(
                    ErrorKind::NotReady,
                    "event_elapsed_ms",
                    format!("the {what} event has not completed its last record"),
                ));
            }
        }
        result::event::elapsed_ms(start.raw, end.raw)
    }

    fn alloc_device(&self, bytes: usize) -> Result<(Arc<MemObj>, usize)> {
        let device = self.shared.bind_current()?;
        let d = &self.shared.devices[device];
        if bytes > d.total {
            return Err(cuda_err(
                ErrorKind::OutOfMemory,
                "alloc_device",
                format!(
                    "cannot allocate {bytes} bytes on {} with {} bytes in all",
                    d.name, d.total
                ),
            ));
        }
        // From the device's pool when a block of the size is cached (memory whose queued work
        // finished comes back to it at the reclaim `retrying` starts with), else the driver's.
        let size = memory::DevicePool::block_size(bytes);
        let p = self
            .frees
            .retrying(|| self.shared.device_block(device, size))?;
        // Accounted only once the memory is there, so a refused request leaves the peak alone.
        let reserve = || d.memory.reserve(BackendKind::Cuda, "cuMemAlloc_v2", bytes);
        if let Err(e) = self.frees.retrying(reserve) {
            // Never handed out.
            self.shared.release_block(device, p, size);
            return Err(e);
        }
        let m = MemObj::new(&self.shared, p as usize, bytes, Origin::Device(device));
        Ok((m, p as usize))
    }
    unsafe fn wrap_device_memory(
        &self,
        ptr: usize,
        bytes: usize,
        release: Option<ReleaseFn>,
    ) -> Result<Arc<MemObj>> {
        Ok(MemObj::new(
            &self.shared,
            ptr,
            bytes,
            Origin::Borrowed(release),
        ))
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<(Arc<MemObj>, usize)> {
        let device = self.shared.bind_current()?;
        let p = result::mem::alloc_host(bytes, CU_MEMHOSTALLOC_PORTABLE)?;
        let reserve = || {
            self.shared
                .pinned
                .reserve(BackendKind::Cuda, "cuMemHostAlloc", bytes)
        };
        if let Err(e) = self.frees.retrying(reserve) {
            // SAFETY: just allocated, never handed out.
            let _ = unsafe { result::mem::free_host(p) };
            return Err(e);
        }
        let m = MemObj::new(&self.shared, p as usize, bytes, Origin::Pinned(device));
        Ok((m, p as usize))
    }

    fn copy(
        &self,
        _kind: CopyKind,
        dst: Place<Memory<Arc<MemObj>, Arc<MemObj>>>,
        src: Place<Memory<Arc<MemObj>, Arc<MemObj>>>,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        // With unified addressing one call covers every direction.
        let (d, s) = (dst.map(Memory::into_inner), src.map(Memory::into_inner));
        self.shared.bind(stream.device)?;
        // SAFETY: ranges bounds-checked by the caller, kept live by their use events.
        unsafe { result::mem::copy_async(addr(&d), addr(&s), bytes, stream.raw) }?;
        d.mem.used_on(stream.key())?;
        s.mem.used_on(stream.key())
    }
    fn memset(
        &self,
        dst: Place<Arc<MemObj>>,
        value: u8,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.shared.bind(stream.device)?;
        // SAFETY: as in `copy`.
        unsafe { result::mem::set_d8_async(addr(&dst), value, bytes, stream.raw) }?;
        dst.mem.used_on(stream.key())
    }

    fn kernel(&self, kernel: Kernel<Place<Arc<MemObj>>>, stream: &Arc<StreamObj>) -> Result<()> {
        self.run_kernel(&kernel, stream)
    }
    fn module_kernel(
        &self,
        module: &crate::kernel::DeviceModule,
        kernel: &str,
        shape: crate::kernel::LaunchShape,
        args: &[crate::kernel::KernelArg<Option<Place<Arc<MemObj>>>>],
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.run_module_kernel(module, kernel, shape, args, stream)
    }
    fn host_fn(&self, stream: &Arc<StreamObj>, f: HostFn) -> Result<()> {
        self.shared.bind(stream.device)?;
        host_fn::launch(stream.raw, stream.errors.guard(BackendKind::Cuda, f))
    }

    fn unique_id(&self) -> Result<UniqueId> {
        let n = self.shared.nccl()?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        n.check(
            // SAFETY: NCCL writes one `ncclUniqueId` through the pointer: a live local of that
            // type; the function pointer comes from the loaded library `n` keeps open.
            unsafe { (n.api.ncclGetUniqueId)(&mut id) },
            "ncclGetUniqueId",
        )?;
        Ok(UniqueId(
            id.internal
                .iter()
                .map(|&c| u8::from_ne_bytes(c.to_ne_bytes()))
                .collect(),
        ))
    }
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Arc<CommObj>> {
        let n = self.shared.nccl()?;
        if id.0.len() != UNIQUE_ID_BYTES {
            return Err(cuda_err(
                ErrorKind::InvalidValue,
                "comm_init",
                format!(
                    "an ncclUniqueId has {UNIQUE_ID_BYTES} bytes, not {}",
                    id.0.len()
                ),
            ));
        }
        let device = self.shared.bind_current()?;
        let mut uid = ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(&id.0) {
            *d = *s as _;
        }
        let mut comm: ncclComm_t = std::ptr::null_mut();
        n.check(
            // SAFETY: the out-pointer is a live local `ncclComm_t`; the id is passed by value;
            // NCCL checks `rank < world` itself; the device is bound above. Blocks until every
            // rank joined.
            unsafe { (n.api.ncclCommInitRank)(&mut comm, world as c_int, uid, rank as c_int) },
            "ncclCommInitRank",
        )?;
        self.new_comm(nccl::Comm::from_sys(comm), device, rank, world)
    }
    fn comm_split(
        &self,
        comm: &Arc<CommObj>,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<(Arc<CommObj>, usize, usize)>> {
        self.split_comm(comm, rank_lists)
    }
    fn destroy_comm(&self, comm: Arc<CommObj>) -> Result<()> {
        drop(comm);
        Ok(())
    }
    fn abort_comm(&self, comm: Arc<CommObj>) -> Result<()> {
        self.abort_comm_now(&comm)
    }
    fn collective(
        &self,
        comm: &Arc<CommObj>,
        op: Collective<Option<Place<Arc<MemObj>>>>,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.issue_collective(comm, op, stream)
    }
    fn group_start(&self) -> Result<()> {
        let n = self.shared.nccl()?;
        // SAFETY: plain NCCL call.
        n.check(unsafe { (n.api.ncclGroupStart)() }, "ncclGroupStart")?;
        GROUP.with(|g| g.borrow_mut().0 += 1);
        Ok(())
    }
    fn group_end(&self) -> Result<()> {
        let n = self.shared.nccl()?;
        // SAFETY: plain NCCL call.
        let ended = n.check(unsafe { (n.api.ncclGroupEnd)() }, "ncclGroupEnd");
        let queued = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            g.0 = g.0.saturating_sub(1);
            if g.0 == 0 {
                std::mem::take(&mut g.1)
            } else {
                Vec::new()
            }
        });
        // Now on their streams (or dropped, if the group failed): watched from here.
        let mut first = ended;
        for Grouped { comm, op, stream } in queued {
            let mut watch = lock(&comm.watch);
            watch.in_group -= 1;
            let watched = match watch.aborted {
                Some(_) => Ok(()),
                None => self
                    .shared
                    .bind(comm.device)
                    .and_then(|()| self.shared.watchdog.watch(&comm, &mut watch, op, &stream)),
            };
            first = first.and(watched);
        }
        first
    }
}
