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
//! D2H targets). Memory is freed only after the work queued on it finished: each buffer keeps one
//! event per stream that used it, re-recorded after every use.
//!
//! Kernels ([`crate::Kernel`]) are CUDA C generated in `kernels.rs`, compiled by NVRTC once per
//! device on first use and cached; `Avg` reductions use `ncclAvg` (NCCL 2.10+) or a sum followed
//! by the scale kernel.

mod baseline;
mod check;
mod dynlib;
mod host_fn;
mod kernels;
mod nccl;
mod nvrtc;
mod probe;
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
use crate::auxil::uses::{TrackedMem, UseEvents};
use crate::backend::{Backend, Loc, Place};
use crate::collective::Collective;
use crate::dtype::{DType, ReduceOp};
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::{CopyKind, RawStream, ReleaseFn, UniqueId};
use crate::host_errors::{first_error, Retired, Span, StreamErrors};
use crate::info::{DeviceInfo, LibraryProbe, PlatformInfo};
use crate::kernel::{HostFn, Kernel};
use crate::memory::{MemInfo, MemoryCounter, MemoryStats};
use check::{cu, cu_error, cuda_err};
use host_fn::Reaper;
use nccl::{check_supported, nccl_dtype, nccl_op, Nccl, NcclApi, UNIQUE_ID_BYTES};
use nvrtc::{Nvrtc, NvrtcApi};
pub use probe::CudaSearch;
use probe::{search, LibrarySpec};
use watchdog::{CommWatch, Watchdog};

/// Calls a driver function through cudarc and checks its status, naming the function in the
/// error. The call is `unsafe`: each use carries the SAFETY reasoning for its arguments.
macro_rules! cu_call {
    ($f:ident($($arg:expr),* $(,)?)) => {
        cu(unsafe { cu::$f($($arg),*) }, stringify!($f))
    };
}

// After the macro, which it uses.
mod module_kernel;

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
    raw: usize,
    functions: Mutex<HashMap<String, usize>>,
}

struct Device {
    handle: cu::CUdevice,
    name: String,
    total: usize,
    compute_capability: (i32, i32),
    /// The primary context, retained on first use (retaining creates it on the GPU). A failed
    /// retain is not kept: the next use tries again.
    ctx: OnceLock<usize>,
    /// Serialises the first retain, so the context is retained once.
    ctx_init: Mutex<()>,
    memory: MemoryCounter,
    /// NVRTC modules by name, compiled once per device. Only successes are kept: a failed
    /// compile or load (the driver may have been out of memory) is tried again by the next use.
    modules: Mutex<HashMap<&'static str, Arc<Module>>>,
}

/// What every object of one cuda platform value shares.
pub struct Shared {
    instance: u64,
    driver_path: String,
    driver_version: i32,
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

impl Shared {
    fn ctx(&self, device: usize) -> Result<usize> {
        let d = &self.devices[device];
        if let Some(&ctx) = d.ctx.get() {
            return Ok(ctx);
        }
        let _init = lock(&d.ctx_init);
        if let Some(&ctx) = d.ctx.get() {
            return Ok(ctx);
        }
        let mut ctx = std::ptr::null_mut();
        // SAFETY: plain driver call into a local.
        cu_call!(cuDevicePrimaryCtxRetain(&mut ctx, d.handle))?;
        Ok(*d.ctx.get_or_init(|| ctx as usize))
    }

    /// Makes `device`'s primary context current on this thread (nothing when it already is).
    fn bind(&self, device: usize) -> Result<()> {
        let ctx = self.ctx(device)?;
        let mut current = std::ptr::null_mut();
        // SAFETY: plain driver calls.
        cu_call!(cuCtxGetCurrent(&mut current))?;
        if current as usize != ctx {
            cu_call!(cuCtxSetCurrent(ctx as cu::CUcontext))?;
        }
        Ok(())
    }

    fn current_device(&self) -> usize {
        // `try_with`: handles may be dropped while this thread's locals are torn down.
        CURRENT
            .try_with(|m| m.borrow().get(&self.instance).copied())
            .ok()
            .flatten()
            .unwrap_or(0)
    }

    /// Binds the calling thread's current device; returns it.
    fn bind_current(&self) -> Result<usize> {
        let d = self.current_device();
        self.bind(d)?;
        Ok(d)
    }

    fn nccl(&self) -> Result<&Nccl> {
        self.nccl.as_ref().map_err(Clone::clone)
    }

    /// The function `name` of module `module` on `device`, compiling the module from `source`
    /// on first use. The caller has bound `device`.
    fn function(
        &self,
        device: usize,
        module: &'static str,
        source: impl FnOnce() -> String,
        name: &str,
    ) -> Result<usize> {
        let d = &self.devices[device];
        let m = {
            let mut modules = lock(&d.modules);
            match modules.get(module) {
                Some(m) => Arc::clone(m),
                None => {
                    let m = self.compile(d, module, source())?;
                    modules.insert(module, Arc::clone(&m));
                    m
                }
            }
        };
        let mut functions = lock(&m.functions);
        if let Some(&f) = functions.get(name) {
            return Ok(f);
        }
        let cname = CString::new(name).map_err(|_| {
            cuda_err(
                ErrorKind::InvalidValue,
                "cuModuleGetFunction",
                "NUL in name",
            )
        })?;
        let mut f = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        cu_call!(cuModuleGetFunction(
            &mut f,
            m.raw as cu::CUmodule,
            cname.as_ptr()
        ))?;
        functions.insert(name.to_string(), f as usize);
        Ok(f as usize)
    }

    fn compile(&self, d: &Device, module: &'static str, source: String) -> Result<Arc<Module>> {
        let nvrtc = self.nvrtc.as_ref().map_err(Clone::clone)?;
        let image = nvrtc.compile(&source, module, d.compute_capability)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: a complete cubin or NUL-terminated PTX image that outlives the call.
        // The context is added to the driver's error, whose status code and name it keeps.
        cu_call!(cuModuleLoadData(&mut raw, image.bytes.as_ptr().cast())).map_err(|e| Error {
            message: format!(
                "{} ({} of {module}, NVRTC {}.{})",
                e.message, image.kind, nvrtc.version.0, nvrtc.version.1
            ),
            ..e
        })?;
        tracing::debug!(module, kind = image.kind, device = %d.name, "kernel module loaded");
        Ok(Arc::new(Module {
            raw: raw as usize,
            functions: Mutex::new(HashMap::new()),
        }))
    }

    fn register(&self, s: &Arc<StreamObj>) {
        let mut streams = lock(&self.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(s));
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let mut work: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, d) in self.devices.iter_mut().enumerate() {
            let modules: Vec<usize> = d
                .modules
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .drain()
                .map(|(_, m)| m.raw)
                .collect();
            if d.ctx.get().is_some() {
                work.push((i, modules));
            }
        }
        let handles: Vec<cu::CUdevice> = self.devices.iter().map(|d| d.handle).collect();
        let ctxs: Vec<usize> = self
            .devices
            .iter()
            .map(|d| d.ctx.get().copied().unwrap_or(0))
            .collect();
        let release = move || {
            for (i, modules) in work {
                // SAFETY: the context is ours (retained); the modules were loaded in it and
                // nothing of this platform uses them any more.
                unsafe {
                    cu::cuCtxSetCurrent(ctxs[i] as cu::CUcontext);
                    for m in modules {
                        cu::cuModuleUnload(m as cu::CUmodule);
                    }
                    cu::cuDevicePrimaryCtxRelease_v2(handles[i]);
                }
            }
        };
        if host_fn::in_host_fn() {
            // The last handle died in a host function, where the driver may not be called.
            std::thread::spawn(release);
        } else {
            release();
        }
    }
}

/// A CUDA stream (owned, or wrapped from a framework).
pub struct StreamObj {
    shared: Arc<Shared>,
    raw: usize,
    device: usize,
    owned: bool,
    errors: StreamErrors,
}

impl StreamObj {
    /// What use tracking tells streams apart by.
    fn key(&self) -> (usize, usize) {
        (self.raw, self.device)
    }
}

impl Drop for StreamObj {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (shared, raw, device) = (Arc::clone(&self.shared), self.raw, self.device);
        self.shared.reaper.run_or_defer(move || {
            if shared.bind(device).is_ok() {
                // SAFETY: we created this stream; queued work still completes.
                let _ = cu_call!(cuStreamDestroy_v2(raw as cu::CUstream));
            }
        });
    }
}

/// A CUDA event, with whether it was ever recorded.
pub struct EventObj {
    shared: Arc<Shared>,
    raw: usize,
    device: usize,
    recorded: AtomicBool,
    /// The backend's errors the latest record carries (`host_errors`).
    carries: Mutex<Vec<Span>>,
}

impl Drop for EventObj {
    fn drop(&mut self) {
        let (shared, raw, device) = (Arc::clone(&self.shared), self.raw, self.device);
        self.shared.reaper.run_or_defer(move || {
            if shared.bind(device).is_ok() {
                // SAFETY: we created this event.
                let _ = cu_call!(cuEventDestroy_v2(raw as cu::CUevent));
            }
        });
    }
}

/// How a buffer's memory was obtained.
pub enum Origin {
    Device(usize),
    /// With the device whose context allocated it (freeing needs a current context).
    Pinned(usize),
    Borrowed(Option<ReleaseFn>),
}

/// Device, pinned or borrowed memory, with the events of its uses (`auxil::uses`).
pub type MemObj = TrackedMem<Shared>;

impl MemObj {
    fn at(&self, offset: usize) -> u64 {
        (self.ptr + offset) as u64
    }
}

/// A newly created event of the bound context, for use tracking.
fn new_use_event() -> Result<usize> {
    let mut e = std::ptr::null_mut();
    // SAFETY: plain driver call into a local.
    cu_call!(cuEventCreate(&mut e, CU_EVENT_DISABLE_TIMING))?;
    Ok(e as usize)
}

/// Streams are told apart by (handle, device): a stream handle value can come back for another
/// device's stream. Frees go through the reaper: the last handle may die in a host function.
impl UseEvents for Shared {
    type Stream = (usize, usize);
    type Event = usize;
    type Origin = Origin;
    const NAME: &'static str = "cuda";

    fn bind_for(&self, (_, device): (usize, usize)) -> Result<()> {
        self.bind(device)
    }
    fn create_event(&self) -> Result<usize> {
        new_use_event()
    }
    fn record_event(&self, event: usize, (stream, _): (usize, usize)) -> Result<()> {
        // SAFETY: live event and stream of the bound context.
        cu_call!(cuEventRecord(event as cu::CUevent, stream as cu::CUstream))
    }
    fn event_complete(&self, event: usize) -> Option<bool> {
        // SAFETY: an event use tracking created and has not destroyed.
        match unsafe { cu::cuEventQuery(event as cu::CUevent) } {
            cu::CUresult::CUDA_SUCCESS => Some(true),
            cu::CUresult::CUDA_ERROR_NOT_READY => Some(false),
            _ => None,
        }
    }
    fn wait_event(&self, event: usize) -> bool {
        // SAFETY: as above.
        (unsafe { cu::cuEventSynchronize(event as cu::CUevent) }) == cu::CUresult::CUDA_SUCCESS
    }
    fn destroy_event(&self, event: usize) {
        // SAFETY: as above; destroyed once.
        unsafe { cu::cuEventDestroy_v2(event as cu::CUevent) };
    }
    fn drain(&self, (stream, _): (usize, usize)) {
        // SAFETY: a live stream of the bound context.
        let _ = cu_call!(cuStreamSynchronize(stream as cu::CUstream));
    }
    fn may_call_driver(&self) -> bool {
        !host_fn::in_host_fn()
    }
    fn free(&self, origin: Origin, ptr: usize, len: usize) {
        match origin {
            Origin::Device(d) => {
                if self.bind(d).is_ok() {
                    // SAFETY: allocated by cuMemAlloc; no queued work uses it any more.
                    let _ = cu_call!(cuMemFree_v2(ptr as cu::CUdeviceptr));
                }
                self.devices[d].memory.release(len);
            }
            Origin::Pinned(d) => {
                if self.bind(d).is_ok() {
                    // SAFETY: allocated by cuMemHostAlloc; no queued work uses it any more.
                    let _ = cu_call!(cuMemFreeHost(ptr as *mut c_void));
                }
                self.pinned.release(len);
            }
            Origin::Borrowed(release) => {
                if let Some(f) = release {
                    f();
                }
            }
        }
    }
    fn describe(origin: &Origin) -> &'static str {
        match origin {
            Origin::Device(_) => "device",
            Origin::Pinned(_) => "pinned",
            Origin::Borrowed(_) => "borrowed (its release is not run)",
        }
    }
    fn frees(&self) -> &Weak<DeferredFrees> {
        &self.frees
    }
    fn hand_over(self: &Arc<Self>, job: Box<dyn FnOnce() + Send>) {
        self.reaper.run_or_defer(job);
    }
}

/// An NCCL communicator on one device, with a scratch word for barriers.
pub struct CommObj {
    shared: Arc<Shared>,
    raw: usize,
    device: usize,
    rank: usize,
    world: usize,
    scratch: Arc<MemObj>,
    /// Whether it was aborted, and the collectives outstanding on it (`watchdog`).
    watch: Mutex<CommWatch>,
}

impl CommObj {
    fn ident(&self) -> watchdog::Ident {
        watchdog::Ident {
            raw: self.raw,
            rank: self.rank,
            world: self.world,
        }
    }
}

impl Drop for CommObj {
    fn drop(&mut self) {
        let watch = std::mem::take(self.watch.get_mut().unwrap_or_else(|p| p.into_inner()));
        let (shared, device, ident) = (Arc::clone(&self.shared), self.device, self.ident());
        self.shared.reaper.run_or_defer(move || {
            if let (Ok(n), Ok(())) = (shared.nccl(), shared.bind(device)) {
                watch.close(n, ident, shared.watchdog.timeout());
            }
        });
    }
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

fn unavailable(op: &'static str, msg: impl Into<String>) -> Error {
    cuda_err(ErrorKind::Unavailable, op, msg)
}

/// Any failure while opening means the backend cannot be used here.
fn as_unavailable(e: Error) -> Error {
    Error {
        kind: ErrorKind::Unavailable,
        ..e
    }
}

fn load_nccl(
    search_path: Option<&std::path::PathBuf>,
    probes: &mut Vec<LibraryProbe>,
) -> Result<Nccl> {
    let s = search(&LibrarySpec::nccl(), search_path);
    probes.extend(s.tried.iter().cloned());
    let missing = s.missing_message();
    let found = s
        .found
        .ok_or_else(|| unavailable("nccl", format!("collectives are unavailable: {missing}")))?;
    let api = NcclApi::load(found.lib)
        .map_err(|m| unavailable("nccl", format!("{} lacks {}", found.path, m.join(", "))))?;
    let mut version: c_int = 0;
    // SAFETY: plain NCCL call into a local.
    let code = unsafe { (api.ncclGetVersion)(&mut version) };
    let nccl = Nccl {
        api,
        version,
        path: found.path,
    };
    nccl.check(code, "ncclGetVersion").map_err(as_unavailable)?;
    Ok(nccl)
}

fn load_nvrtc(
    search_path: Option<&std::path::PathBuf>,
    probes: &mut Vec<LibraryProbe>,
) -> Result<Nvrtc> {
    let s = search(&LibrarySpec::nvrtc(), search_path);
    probes.extend(s.tried.iter().cloned());
    let missing = s.missing_message();
    let found = s
        .found
        .ok_or_else(|| unavailable("nvrtc", format!("kernels are unavailable: {missing}")))?;
    let api = NvrtcApi::load(found.lib)
        .map_err(|m| unavailable("nvrtc", format!("{} lacks {}", found.path, m.join(", "))))?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain NVRTC call into locals.
    if unsafe { (api.nvrtcVersion)(&mut major, &mut minor) } != 0 {
        return Err(unavailable(
            "nvrtc",
            format!("nvrtcVersion failed in {}", found.path),
        ));
    }
    Ok(Nvrtc {
        api,
        version: (major, minor),
        path: found.path,
    })
}

/// The address of `symbol` in `lib`, or 0.
fn symbol_address(lib: &libloading::Library, symbol: &str) -> usize {
    // SAFETY: the symbol is only compared by address, never called through this type.
    unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }
        .map(|s| *s as usize)
        .unwrap_or(0)
}

impl CudaBackend {
    /// Opens the backend with the library search the environment describes ([`CudaSearch`]).
    pub fn open() -> Result<Self> {
        Self::open_with(&CudaSearch::from_process())
    }

    /// [`CudaBackend::open`] with the library search given explicitly. Fails with
    /// `Unavailable` (naming the library and every name or path tried) when the driver cannot
    /// be loaded or initialised or has no device; NCCL and NVRTC are optional.
    pub fn open_with(search_env: &CudaSearch) -> Result<Self> {
        let timeout = crate::collective::collective_timeout_from_env(BackendKind::Cuda, None)?
            .unwrap_or(crate::collective::DEFAULT_COLLECTIVE_TIMEOUT);
        let driver = search(&LibrarySpec::driver(), search_env.cuda_lib.as_ref());
        let mut probes = driver.tried.clone();
        let missing = driver.missing_message();
        let found = driver.found.ok_or_else(|| unavailable("open", missing))?;
        let absent: Vec<&str> = DRIVER_SYMBOLS
            .iter()
            .copied()
            .filter(|s| symbol_address(&found.lib, s) == 0)
            .collect();
        if !absent.is_empty() {
            return Err(unavailable(
                "open",
                format!("{} lacks {}", found.path, absent.join(", ")),
            ));
        }
        // cudarc loads the driver by name on its own; make sure that resolves, and to the same
        // library (an HP_CUDA_LIB override must not lose against another libcuda on the path).
        // SAFETY: only opens libraries by name, as the probe above did.
        if !unsafe { cu::is_culib_present() } {
            return Err(unavailable(
                "open",
                format!(
                    "{} loaded, but none of the names cudarc resolves the driver by ({}) leads to it",
                    found.path,
                    LibrarySpec::driver().names.join(", ")
                ),
            ));
        }
        // SAFETY: present, checked just above, so this does not panic.
        let cudarc_lib = unsafe { cu::culib() };
        // SAFETY: compared by address only.
        let theirs = unsafe { cudarc_lib.get::<unsafe extern "C" fn()>(b"cuInit") }
            .map(|s| *s as usize)
            .unwrap_or(0);
        if theirs != symbol_address(&found.lib, "cuInit") {
            return Err(unavailable(
                "open",
                format!(
                    "cudarc resolved the driver to another library than {} (set by {}); remove the other libcuda from the loader path or unset the override",
                    found.path,
                    if search_env.cuda_lib.is_some() { "HP_CUDA_LIB" } else { "the loader search" }
                ),
            ));
        }
        // SAFETY: plain driver calls into locals.
        cu_call!(cuInit(0)).map_err(as_unavailable)?;
        let mut version = 0;
        cu_call!(cuDriverGetVersion(&mut version)).map_err(as_unavailable)?;
        let mut count = 0;
        cu_call!(cuDeviceGetCount(&mut count)).map_err(as_unavailable)?;
        if count <= 0 {
            return Err(unavailable(
                "open",
                format!("the CUDA driver ({}) reports no device", found.path),
            ));
        }
        let devices = (0..count)
            .map(|i| Self::describe_device(i).map_err(as_unavailable))
            .collect::<Result<Vec<_>>>()?;
        let nccl = load_nccl(search_env.nccl_lib.as_ref(), &mut probes);
        let nvrtc = load_nvrtc(search_env.nvrtc_lib.as_ref(), &mut probes);
        for (what, r) in [
            ("nccl", nccl.as_ref().err()),
            ("nvrtc", nvrtc.as_ref().err()),
        ] {
            if let Some(e) = r {
                tracing::warn!(library = what, error = %e, "cuda backend without {what}");
            }
        }
        let (frees, frees_ref) = deferred::new_list();
        Ok(CudaBackend {
            frees,
            shared: Arc::new(Shared {
                instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
                driver_path: found.path,
                driver_version: version,
                devices,
                pinned: MemoryCounter::new(None),
                streams: Mutex::new(Vec::new()),
                nccl,
                nvrtc,
                probes,
                reaper: Reaper::new(),
                watchdog: Arc::new(Watchdog::new(timeout)),
                frees: frees_ref,
                _driver: found.lib,
            }),
            retired: Retired::default(),
        })
    }

    fn describe_device(ordinal: c_int) -> Result<Device> {
        let mut handle = 0;
        // SAFETY: plain driver calls into locals and a buffer of the size passed.
        cu_call!(cuDeviceGet(&mut handle, ordinal))?;
        let mut name = [0 as std::ffi::c_char; 256];
        cu_call!(cuDeviceGetName(
            name.as_mut_ptr(),
            name.len() as c_int,
            handle
        ))?;
        // SAFETY: the driver NUL-terminates within the buffer.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total = 0usize;
        cu_call!(cuDeviceTotalMem_v2(&mut total, handle))?;
        let attr = |a: cu::CUdevice_attribute| -> Result<i32> {
            let mut v = 0;
            cu_call!(cuDeviceGetAttribute(&mut v, a, handle))?;
            Ok(v)
        };
        let major = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok(Device {
            handle,
            name,
            total,
            compute_capability: (major, minor),
            ctx: OnceLock::new(),
            ctx_init: Mutex::new(()),
            memory: MemoryCounter::new(None),
            modules: Mutex::new(HashMap::new()),
        })
    }

    fn stream_obj(&self, raw: usize, device: usize, owned: bool) -> Arc<StreamObj> {
        let s = Arc::new(StreamObj {
            shared: Arc::clone(&self.shared),
            raw,
            device,
            owned,
            errors: StreamErrors::default(),
        });
        self.shared.register(&s);
        s
    }

    /// The device whose primary context `ctx` is (a stream from another context is refused:
    /// hprt's memory lives in primary contexts).
    fn device_of_context(&self, ctx: usize) -> Result<usize> {
        let mut dev = 0;
        // SAFETY: `ctx` came from the driver; pushed and popped around one query.
        cu_call!(cuCtxPushCurrent_v2(ctx as cu::CUcontext))?;
        let got = cu_call!(cuCtxGetDevice(&mut dev));
        let mut popped = std::ptr::null_mut();
        cu_call!(cuCtxPopCurrent_v2(&mut popped))?;
        got?;
        let ordinal = self
            .shared
            .devices
            .iter()
            .position(|d| d.handle == dev)
            .ok_or_else(|| {
                cuda_err(
                    ErrorKind::InvalidValue,
                    "wrap_external_stream",
                    format!("the stream's device {dev} is not one of this platform's"),
                )
            })?;
        if self.shared.ctx(ordinal)? != ctx {
            return Err(cuda_err(
                ErrorKind::Unsupported,
                "wrap_external_stream",
                "the stream belongs to a context other than the device's primary context",
            ));
        }
        Ok(ordinal)
    }

    fn launch(
        &self,
        stream: &StreamObj,
        function: usize,
        count: usize,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: `args` point at locals of the caller matching the kernel's parameters, alive
        // for the call (the driver copies them); the stream's context is bound.
        cu_call!(cuLaunchKernel(
            function as cu::CUfunction,
            kernels::grid_for(count),
            1,
            1,
            kernels::BLOCK,
            1,
            1,
            0,
            stream.raw as cu::CUstream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        ))
    }

    /// Enqueues an elementwise kernel whose places were checked by the dispatch layer.
    fn run_kernel(&self, kernel: &Kernel<Place<Arc<MemObj>>>, stream: &StreamObj) -> Result<()> {
        let op = kernel.name();
        self.shared.bind(stream.device)?;
        let places = kernel.places();
        if let Kernel::Cast {
            src: (s, so),
            dst: (d, doff),
            src_dtype,
            ..
        } = kernel
        {
            if kernel_name_is_copy(kernel) {
                if s.at(*so) != d.at(*doff) {
                    // SAFETY: both ranges were bounds-checked and do not overlap.
                    cu_call!(cuMemcpyAsync(
                        d.at(*doff),
                        s.at(*so),
                        kernel.count() * src_dtype.size(),
                        stream.raw as cu::CUstream
                    ))?;
                    s.used_on(stream.key())?;
                    d.used_on(stream.key())?;
                }
                return Ok(());
            }
        }
        let name = kernels::kernel_name(kernel).ok_or_else(|| {
            cuda_err(
                ErrorKind::Internal,
                op,
                "no device kernel for this operation",
            )
        })?;
        let function =
            self.shared
                .function(stream.device, kernels::MODULE, kernels::source, &name)?;
        let aligned: c_int = places
            .iter()
            .zip(kernel.place_dtypes())
            .all(|(((m, off), _, _), dt)| m.at(*off) % dt.size() as u64 == 0)
            .into();
        let mut n = kernel.count() as u64;
        let n_ptr: *mut c_void = (&mut n as *mut u64).cast();
        let a_ptr: *mut c_void = (&aligned as *const c_int).cast_mut().cast();
        match *kernel {
            Kernel::Fill {
                dst: (ref d, off),
                mut value,
                ..
            } => {
                let mut p = d.at(off);
                let mut args = [
                    (&mut p as *mut u64).cast(),
                    n_ptr,
                    (&mut value as *mut f64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Cast {
                src: (ref s, so),
                dst: (ref d, doff),
                ..
            } => {
                let (mut sp, mut dp) = (s.at(so), d.at(doff));
                let mut args = [
                    (&mut sp as *mut u64).cast(),
                    (&mut dp as *mut u64).cast(),
                    n_ptr,
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Scale {
                buf: (ref b, off),
                mut factor,
                ..
            } => {
                let mut p = b.at(off);
                let mut args = [
                    (&mut p as *mut u64).cast(),
                    n_ptr,
                    (&mut factor as *mut f64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Axpy {
                src: (ref s, so),
                dst: (ref d, doff),
                mut alpha,
                ..
            } => {
                let (mut sp, mut dp) = (s.at(so), d.at(doff));
                let mut args = [
                    (&mut sp as *mut u64).cast(),
                    (&mut dp as *mut u64).cast(),
                    n_ptr,
                    (&mut alpha as *mut f64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Matmul {
                a: (ref a, ao),
                b: (ref b, bo),
                c: (ref c, co),
                m,
                n: cols,
                k,
                ..
            } => {
                let (mut ap, mut bp, mut cp) = (a.at(ao), b.at(bo), c.at(co));
                let (mut m64, mut n64, mut k64) = (m as u64, cols as u64, k as u64);
                let mut args = [
                    (&mut ap as *mut u64).cast(),
                    (&mut bp as *mut u64).cast(),
                    (&mut cp as *mut u64).cast(),
                    (&mut m64 as *mut u64).cast(),
                    (&mut n64 as *mut u64).cast(),
                    (&mut k64 as *mut u64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
        }
        for ((m, _), _, _) in places {
            m.used_on(stream.key())?;
        }
        Ok(())
    }

    fn new_comm(
        &self,
        raw: usize,
        device: usize,
        rank: usize,
        world: usize,
    ) -> Result<Arc<CommObj>> {
        let scratch = Backend::alloc_device(self, 4)?.0;
        Ok(Arc::new(CommObj {
            shared: Arc::clone(&self.shared),
            raw,
            device,
            rank,
            world,
            scratch,
            watch: Mutex::default(),
        }))
    }
}

fn kernel_name_is_copy<B>(k: &Kernel<B>) -> bool {
    kernels::kernel_name(k).is_none()
}

fn ptr(place: &Option<Place<Arc<MemObj>>>) -> *mut c_void {
    place
        .as_ref()
        .map_or(std::ptr::null_mut(), |(m, o)| (m.ptr + o) as *mut c_void)
}

fn is_ready(r: cu::CUresult, function: &'static str) -> Result<bool> {
    match r {
        cu::CUresult::CUDA_SUCCESS => Ok(true),
        cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => cu(other, function).map(|()| true),
    }
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
        self.shared.bind_current()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: plain driver call into locals.
        cu_call!(cuMemGetInfo_v2(&mut free, &mut total))?;
        Ok(MemInfo { free, total })
    }
    fn memory_stats(&self) -> MemoryStats {
        let d = &self.shared.devices[self.shared.current_device()].memory;
        let p = &self.shared.pinned;
        MemoryStats {
            device_current: d.current(),
            device_peak: d.peak(),
            device_allocations: d.allocations(),
            pinned_current: p.current(),
            pinned_peak: p.peak(),
            pinned_allocations: p.allocations(),
        }
    }
    fn reclaim_frees(&self) {
        // Reclaiming binds the devices of the memory it frees: the caller's context is put back.
        let mut current = std::ptr::null_mut();
        // SAFETY: plain driver calls.
        let saved = unsafe { cu::cuCtxGetCurrent(&mut current) } == cu::CUresult::CUDA_SUCCESS;
        self.frees.reclaim(false);
        if saved {
            unsafe { cu::cuCtxSetCurrent(current) };
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
        let mut raw = std::ptr::null_mut();
        // SAFETY: plain driver call into a local.
        cu_call!(cuStreamCreate(&mut raw, CU_STREAM_NON_BLOCKING))?;
        Ok((
            self.stream_obj(raw as usize, device, true),
            RawStream(raw as usize),
        ))
    }
    unsafe fn wrap_stream(&self, raw: RawStream) -> Result<Arc<StreamObj>> {
        // 0 (the legacy default stream, PyTorch's default) and the per-thread handles are valid
        // CUstreams too; they belong to the current context.
        self.shared.bind_current()?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the caller guarantees `raw` is a live stream.
        cu_call!(cuStreamGetCtx(raw.0 as cu::CUstream, &mut ctx))?;
        let device = self.device_of_context(ctx as usize)?;
        Ok(self.stream_obj(raw.0, device, false))
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
        // SAFETY: live stream.
        let driver = cu_call!(cuStreamSynchronize(stream.raw as cu::CUstream));
        // Both reported at once: the backend's are not left for a later synchronize.
        driver.and(stream.errors.take())
    }
    fn query_stream(&self, stream: &Arc<StreamObj>) -> Result<bool> {
        self.shared.bind(stream.device)?;
        // SAFETY: live stream.
        is_ready(
            unsafe { cu::cuStreamQuery(stream.raw as cu::CUstream) },
            "cuStreamQuery",
        )
    }
    fn synchronize_device(&self) -> Result<()> {
        let live: Vec<Arc<StreamObj>> = lock(&self.shared.streams)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let mut first = Ok(());
        for s in live {
            if let Err(e) = Backend::synchronize_stream(self, &s) {
                first = first.and(Err(e));
            }
        }
        first.and(self.retired.take())
    }

    fn create_event(&self, timing: bool) -> Result<Arc<EventObj>> {
        let device = self.shared.bind_current()?;
        let mut raw = std::ptr::null_mut();
        let flags = if timing {
            CU_EVENT_DEFAULT
        } else {
            CU_EVENT_DISABLE_TIMING
        };
        // SAFETY: plain driver call into a local.
        cu_call!(cuEventCreate(&mut raw, flags))?;
        Ok(Arc::new(EventObj {
            shared: Arc::clone(&self.shared),
            raw: raw as usize,
            device,
            recorded: AtomicBool::new(false),
            carries: Mutex::default(),
        }))
    }
    fn destroy_event(&self, event: Arc<EventObj>) -> Result<()> {
        drop(event);
        Ok(())
    }
    fn record_event(&self, event: &Arc<EventObj>, stream: &Arc<StreamObj>) -> Result<()> {
        self.shared.bind(stream.device)?;
        // SAFETY: live handles.
        cu_call!(cuEventRecord(
            event.raw as cu::CUevent,
            stream.raw as cu::CUstream
        ))?;
        *lock(&event.carries) = stream.errors.record();
        event.recorded.store(true, Ordering::Release);
        Ok(())
    }
    fn stream_wait_event(&self, stream: &Arc<StreamObj>, event: &Arc<EventObj>) -> Result<()> {
        if !event.recorded.load(Ordering::Acquire) {
            return Ok(());
        }
        self.shared.bind(stream.device)?;
        // SAFETY: live handles.
        cu_call!(cuStreamWaitEvent(
            stream.raw as cu::CUstream,
            event.raw as cu::CUevent,
            0
        ))?;
        stream.errors.wait(&lock(&event.carries));
        Ok(())
    }
    fn query_event(&self, event: &Arc<EventObj>) -> Result<bool> {
        if !event.recorded.load(Ordering::Acquire) {
            return Ok(true);
        }
        self.shared.bind(event.device)?;
        // SAFETY: live handle.
        is_ready(
            unsafe { cu::cuEventQuery(event.raw as cu::CUevent) },
            "cuEventQuery",
        )
    }
    fn synchronize_event(&self, event: &Arc<EventObj>) -> Result<()> {
        Self::wait_event(event)
    }
    fn wait_event(event: &Arc<EventObj>) -> Result<()> {
        if !event.recorded.load(Ordering::Acquire) {
            return Ok(());
        }
        event.shared.bind(event.device)?;
        // SAFETY: live handle.
        cu_call!(cuEventSynchronize(event.raw as cu::CUevent))?;
        first_error(&lock(&event.carries)).map_or(Ok(()), Err)
    }
    fn event_elapsed_ms(&self, start: &Arc<EventObj>, end: &Arc<EventObj>) -> Result<f32> {
        for (e, what) in [(start, "start"), (end, "end")] {
            if !e.recorded.load(Ordering::Acquire) || !Backend::query_event(self, e)? {
                return Err(cuda_err(
                    ErrorKind::NotReady,
                    "event_elapsed_ms",
                    format!("the {what} event has not completed its last record"),
                ));
            }
        }
        let mut ms = 0f32;
        // SAFETY: live handles.
        cu_call!(cuEventElapsedTime(
            &mut ms,
            start.raw as cu::CUevent,
            end.raw as cu::CUevent
        ))?;
        Ok(ms)
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
        let mut p: cu::CUdeviceptr = 0;
        self.frees.retrying(|| {
            // Bound again: reclaiming frees binds the devices of their memory.
            self.shared.bind(device)?;
            // SAFETY: plain driver call into a local.
            cu_call!(cuMemAlloc_v2(&mut p, bytes))
        })?;
        // Accounted only once the driver succeeded, so a refused request leaves the peak alone.
        let reserve = || d.memory.reserve(BackendKind::Cuda, "cuMemAlloc_v2", bytes);
        if let Err(e) = self.frees.retrying(reserve) {
            // SAFETY: just allocated, never handed out.
            unsafe { cu::cuMemFree_v2(p) };
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
        let mut p = std::ptr::null_mut();
        // SAFETY: plain driver call into a local.
        let r = unsafe { cu::cuMemHostAlloc(&mut p, bytes, CU_MEMHOSTALLOC_PORTABLE) };
        match r {
            cu::CUresult::CUDA_SUCCESS => {}
            // The only argument is the size: an invalid one is one no host can hold.
            cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY | cu::CUresult::CUDA_ERROR_INVALID_VALUE => {
                let e = cu_error(r as u32, &format!("{r:?}"), "cuMemHostAlloc");
                return Err(Error {
                    kind: ErrorKind::OutOfMemory,
                    message: format!("cannot page-lock {bytes} bytes: {}", e.message),
                    ..e
                });
            }
            other => cu(other, "cuMemHostAlloc")?,
        }
        let reserve = || {
            self.shared
                .pinned
                .reserve(BackendKind::Cuda, "cuMemHostAlloc", bytes)
        };
        if let Err(e) = self.frees.retrying(reserve) {
            // SAFETY: just allocated, never handed out.
            unsafe { cu::cuMemFreeHost(p) };
            return Err(e);
        }
        let m = MemObj::new(&self.shared, p as usize, bytes, Origin::Pinned(device));
        Ok((m, p as usize))
    }

    fn copy(
        &self,
        _kind: CopyKind,
        dst: Loc<Self>,
        src: Loc<Self>,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        // With unified addressing one call covers every direction.
        let (
            Loc::Device(d, doff) | Loc::Pinned(d, doff),
            Loc::Device(s, soff) | Loc::Pinned(s, soff),
        ) = (dst, src);
        self.shared.bind(stream.device)?;
        // SAFETY: ranges bounds-checked by the caller; live stream.
        cu_call!(cuMemcpyAsync(
            d.at(doff),
            s.at(soff),
            bytes,
            stream.raw as cu::CUstream
        ))?;
        d.used_on(stream.key())?;
        s.used_on(stream.key())
    }
    fn memset(
        &self,
        (d, off): Place<Arc<MemObj>>,
        value: u8,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.shared.bind(stream.device)?;
        // SAFETY: as in `copy`.
        cu_call!(cuMemsetD8Async(
            d.at(off),
            value,
            bytes,
            stream.raw as cu::CUstream
        ))?;
        d.used_on(stream.key())
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
        // SAFETY: plain NCCL call into a correctly sized struct.
        n.check(
            unsafe { (n.api.ncclGetUniqueId)(&mut id) },
            "ncclGetUniqueId",
        )?;
        Ok(UniqueId(id.internal.iter().map(|&c| c as u8).collect()))
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
        // SAFETY: plain NCCL call; blocks until every rank joined.
        n.check(
            unsafe { (n.api.ncclCommInitRank)(&mut comm, world as c_int, uid, rank as c_int) },
            "ncclCommInitRank",
        )?;
        self.new_comm(comm as usize, device, rank, world)
    }
    fn comm_split(
        &self,
        comm: &Arc<CommObj>,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<(Arc<CommObj>, usize, usize)>> {
        // The communicator's device is current while the gather's stream and the new
        // communicator are made.
        let on_comm_device = |f: &mut dyn FnMut()| {
            let previous = self.shared.current_device();
            CURRENT.with(|m| m.borrow_mut().insert(self.shared.instance, comm.device));
            f();
            CURRENT.with(|m| m.borrow_mut().insert(self.shared.instance, previous));
        };
        let gather = |mine: &[u8]| {
            let mut stream = None;
            on_comm_device(&mut || stream = Some(Backend::create_stream(self)));
            let stream = stream.expect("set above")?.0;
            auxil::comm::host_all_gather(self, comm, comm.world, mine, &stream)
        };
        let init = |id: &UniqueId, rank: usize, size: usize| {
            let mut sub = None;
            on_comm_device(&mut || sub = Some(Backend::comm_init(self, id, rank, size)));
            sub.expect("set above")
        };
        auxil::comm::split_by_leader(
            self,
            UNIQUE_ID_BYTES,
            comm.rank,
            comm.world,
            rank_lists,
            gather,
            init,
        )
    }
    fn destroy_comm(&self, comm: Arc<CommObj>) -> Result<()> {
        drop(comm);
        Ok(())
    }
    fn collective(
        &self,
        comm: &Arc<CommObj>,
        op: Collective<Option<Place<Arc<MemObj>>>>,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        let n = self.shared.nccl()?;
        let name = op.name();
        if let Some(dtype) = op.dtype() {
            let reduce = match &op {
                Collective::AllReduce { op, .. } | Collective::ReduceScatter { op, .. } => {
                    Some(*op)
                }
                _ => None,
            };
            check_supported(n, dtype, reduce, name)?;
        }
        self.shared.bind(comm.device)?;
        // Held until the collective is queued and watched: the watchdog aborts only between
        // calls, never under one.
        let mut watch = lock(&comm.watch);
        if watch.aborted.is_none() {
            if let Some(e) = watchdog::async_error(n, comm.ident()) {
                watchdog::abort(n, comm.ident(), &mut watch, e);
            }
        }
        if let Some(e) = &watch.aborted {
            stream.errors.queue(e.clone());
            return Ok(());
        }
        let op = match op {
            Collective::Barrier => auxil::comm::barrier_as_all_reduce(Arc::clone(&comm.scratch)),
            op => op,
        };
        let a = &n.api;
        let (c, s) = (comm.raw as ncclComm_t, stream.raw as *mut c_void);
        // Avg without ncclAvg: a sum, then the scale kernel below.
        let emulate_avg = !n.has_avg_and_bf16();
        let red = |op: ReduceOp| {
            if emulate_avg && op == ReduceOp::Avg {
                nccl_op(ReduceOp::Sum)
            } else {
                nccl_op(op)
            }
        };
        let count_of = |x: &Collective<_>| match x {
            Collective::AllReduce { count, .. }
            | Collective::AllGather { count, .. }
            | Collective::ReduceScatter { count, .. }
            | Collective::Broadcast { count, .. }
            | Collective::AllToAll { count, .. }
            | Collective::Send { count, .. }
            | Collective::Recv { count, .. } => *count,
            Collective::AllToAllV { .. } | Collective::Barrier => 1,
        };
        if count_of(&op) == 0 {
            // Every rank passes the same count: skipping on all of them keeps them paired.
            return Ok(());
        }
        // SAFETY (every call below): places were bounds-checked by the dispatch layer for the
        // extent NCCL touches; handles are live; NCCL only queues the work on `s`.
        let issued = (|| -> Result<()> {
            unsafe {
                match &op {
                    Collective::AllReduce {
                        send,
                        recv,
                        count,
                        dtype,
                        op,
                    } => n.check(
                        (a.ncclAllReduce)(
                            ptr(send),
                            ptr(recv),
                            *count,
                            nccl_dtype(*dtype),
                            red(*op),
                            c,
                            s,
                        ),
                        "ncclAllReduce",
                    )?,
                    Collective::ReduceScatter {
                        send,
                        recv,
                        count,
                        dtype,
                        op,
                    } => n.check(
                        (a.ncclReduceScatter)(
                            ptr(send),
                            ptr(recv),
                            *count,
                            nccl_dtype(*dtype),
                            red(*op),
                            c,
                            s,
                        ),
                        "ncclReduceScatter",
                    )?,
                    Collective::AllGather {
                        send,
                        recv,
                        count,
                        dtype,
                    } => n.check(
                        (a.ncclAllGather)(ptr(send), ptr(recv), *count, nccl_dtype(*dtype), c, s),
                        "ncclAllGather",
                    )?,
                    Collective::Broadcast {
                        buf,
                        count,
                        dtype,
                        root,
                    } => n.check(
                        (a.ncclBroadcast)(
                            ptr(buf),
                            ptr(buf),
                            *count,
                            nccl_dtype(*dtype),
                            *root as c_int,
                            c,
                            s,
                        ),
                        "ncclBroadcast",
                    )?,
                    Collective::AllToAll {
                        send,
                        recv,
                        count,
                        dtype,
                    } => {
                        let blocks: Vec<(usize, usize, usize, usize)> = (0..comm.world)
                            .map(|q| (*count, q * count, *count, q * count))
                            .collect();
                        self.exchange(n, comm, send, recv, &blocks, *dtype, stream)?
                    }
                    Collective::AllToAllV {
                        send,
                        recv,
                        send_counts,
                        send_displs,
                        recv_counts,
                        recv_displs,
                        dtype,
                    } => {
                        let blocks: Vec<(usize, usize, usize, usize)> = (0..comm.world)
                            .map(|q| {
                                (
                                    send_counts[q],
                                    send_displs[q],
                                    recv_counts[q],
                                    recv_displs[q],
                                )
                            })
                            .collect();
                        self.exchange(n, comm, send, recv, &blocks, *dtype, stream)?
                    }
                    Collective::Send {
                        send,
                        count,
                        dtype,
                        peer,
                    } => n.check(
                        (a.ncclSend)(ptr(send), *count, nccl_dtype(*dtype), *peer as c_int, c, s),
                        "ncclSend",
                    )?,
                    Collective::Recv {
                        recv,
                        count,
                        dtype,
                        peer,
                    } => n.check(
                        (a.ncclRecv)(ptr(recv), *count, nccl_dtype(*dtype), *peer as c_int, c, s),
                        "ncclRecv",
                    )?,
                    Collective::Barrier => unreachable!("issued as an all-reduce above"),
                }
            }
            Ok(())
        })();
        // Recorded even when issuing failed part-way (an all-to-all's own block may be queued
        // before a send fails): the places must never be freed under what was queued, nor a
        // hang in it go unwatched.
        let grouped = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            (g.0 > 0).then(|| {
                g.1.push(Grouped {
                    comm: Arc::clone(comm),
                    op: name,
                    stream: Arc::clone(stream),
                })
            })
        });
        let watched = match grouped {
            Some(()) => {
                watch.in_group += 1;
                Ok(())
            }
            None => self.shared.watchdog.watch(comm, &mut watch, name, stream),
        };
        drop(watch);
        for (place, _) in op.places(comm.world) {
            if let Some((m, _)) = place {
                m.used_on(stream.key())?;
            }
        }
        issued?;
        watched?;
        match auxil::comm::avg_to_scale(op, comm.world) {
            Some(((m, off), count, dtype)) if emulate_avg => self.run_kernel(
                &Kernel::Scale {
                    buf: (m, off),
                    dtype,
                    count,
                    factor: 1.0 / comm.world as f64,
                },
                stream,
            ),
            _ => Ok(()),
        }
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

impl CudaBackend {
    /// All-to-all as one NCCL group of sends and receives (NCCL has no all-to-all of its own
    /// before 2.28): `blocks[q]` = (send count, send displacement, recv count, recv
    /// displacement) in elements for peer `q`. This rank's own block is a device copy.
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &self,
        n: &Nccl,
        comm: &Arc<CommObj>,
        send: &Option<Place<Arc<MemObj>>>,
        recv: &Option<Place<Arc<MemObj>>>,
        blocks: &[(usize, usize, usize, usize)],
        dtype: DType,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        let size = dtype.size();
        let (sp, rp) = (ptr(send) as usize, ptr(recv) as usize);
        let (c, s) = (comm.raw as ncclComm_t, stream.raw as *mut c_void);
        let me = comm.rank;
        let (sc, sd, rc, rd) = blocks[me];
        if sc != rc {
            return Err(cuda_err(
                ErrorKind::Mismatch,
                "all_to_all",
                format!("this rank sends itself {sc} elements but expects {rc}"),
            ));
        }
        if sc > 0 {
            // SAFETY: both blocks lie inside the bounds-checked places.
            cu_call!(cuMemcpyAsync(
                (rp + rd * size) as u64,
                (sp + sd * size) as u64,
                sc * size,
                stream.raw as cu::CUstream
            ))?;
        }
        // SAFETY: plain NCCL calls on bounds-checked blocks; the group is always closed.
        n.check(unsafe { (n.api.ncclGroupStart)() }, "ncclGroupStart")?;
        let mut issued = Ok(());
        for (q, &(sc, sd, rc, rd)) in blocks.iter().enumerate() {
            if q == me || issued.is_err() {
                continue;
            }
            let dt = nccl_dtype(dtype);
            if sc > 0 {
                issued = n.check(
                    unsafe {
                        (n.api.ncclSend)(
                            (sp + sd * size) as *const c_void,
                            sc,
                            dt,
                            q as c_int,
                            c,
                            s,
                        )
                    },
                    "ncclSend",
                );
            }
            if rc > 0 && issued.is_ok() {
                issued = n.check(
                    unsafe {
                        (n.api.ncclRecv)((rp + rd * size) as *mut c_void, rc, dt, q as c_int, c, s)
                    },
                    "ncclRecv",
                );
            }
        }
        let closed = n.check(unsafe { (n.api.ncclGroupEnd)() }, "ncclGroupEnd");
        issued.and(closed)
    }
}
