//! The npu backend: Ascend ACL runtime + HCCL, loaded at run time through `hprt-sys`.
//!
//! Verified against the ACL/HCCL emulator in `tests/ascend-emulator` only, until it runs on
//! real Ascend hardware. Coexists with torch_npu: if `aclInit` reports "repeat initialize",
//! someone else owns ACL and hprt never calls `aclFinalize`.

mod check;
mod host_fn;

use crate::sync::lock;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use half::{bf16, f16};
use hprt_sys::types::{
    aclrtEventRecordedStatus, aclrtMemAttr, aclrtMemMallocPolicy, aclrtMemcpyKind,
    aclrtStreamStatus, HcclDataType, HcclReduceOp, HcclRootInfo, ACL_ERROR_REPEAT_INITIALIZE,
    ACL_EVENT_SYNC, ACL_EVENT_TIME_LINE,
};
use hprt_sys::{Ascend, SearchEnv, OPTIONAL_SYMBOLS};

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
use crate::kernel::{run_on_host, Access, HostFn, Kernel};
use crate::memory::{MemInfo, MemoryCounter, MemoryStats};
use check::{acl, hccl, npu_err};
use host_fn::Reporter;

/// Calls an ACL function of `$api` (an `Ascend`) and checks its status, naming the function in
/// the error. The call is `unsafe`: each use carries the SAFETY reasoning for its arguments.
macro_rules! acl_call {
    ($api:expr, $f:ident($($arg:expr),* $(,)?)) => {
        acl(unsafe { $api.acl.$f($($arg),*) }, stringify!($f))
    };
}

const ROOT_INFO_BYTES: usize = std::mem::size_of::<HcclRootInfo>();

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// (platform instance → device bound on this thread with `aclrtSetDevice`).
    static BOUND: RefCell<HashMap<u64, i32>> = RefCell::new(HashMap::new());
}

/// What every object of one npu platform value shares.
pub struct Shared {
    api: Arc<Ascend>,
    instance: u64,
    owns_acl: bool,
    devices: Vec<Arc<MemoryCounter>>,
    pinned: Arc<MemoryCounter>,
    streams: Mutex<HashMap<usize, Weak<StreamObj>>>,
    /// Started on first need; a failed start (say, `aclrtSetDevice` failing on its thread) is
    /// retried at the next need rather than disabling host functions for the process.
    reporter: OnceLock<Reporter>,
    reporter_start: Mutex<()>,
    /// Pinned staging buffers for the host scale step of `Avg`, by size, returned after use.
    staging: Arc<Mutex<HashMap<usize, Vec<usize>>>>,
    /// Where memory whose queued work is not finished waits to be freed (the platform value
    /// owns the list).
    frees: Weak<DeferredFrees>,
}

impl Shared {
    /// Binds the calling thread to its device (ACL keeps the device per thread).
    fn bind(&self) -> Result<i32> {
        // `try_with`: handles may be dropped while this thread's locals are being torn down.
        if let Ok(Some(d)) = BOUND.try_with(|b| b.borrow().get(&self.instance).copied()) {
            return Ok(d);
        }
        // SAFETY: plain ACL call.
        acl(unsafe { self.api.acl.aclrtSetDevice(0) }, "aclrtSetDevice")?;
        let _ = BOUND.try_with(|b| b.borrow_mut().insert(self.instance, 0));
        Ok(0)
    }

    fn reporter(&self) -> Option<&Reporter> {
        if let Some(r) = self.reporter.get() {
            return Some(r);
        }
        if !host_fn::available(&self.api) {
            return None;
        }
        let _one_at_a_time = lock(&self.reporter_start);
        if self.reporter.get().is_none() {
            match Reporter::start(Arc::clone(&self.api), 0) {
                Ok(r) => drop(self.reporter.set(r)),
                Err(e) => {
                    tracing::warn!(error = %e, "npu host-function thread unavailable (retried at next use)");
                    return None;
                }
            }
        }
        self.reporter.get()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for (_, bufs) in lock(&self.staging).drain() {
            for p in bufs {
                // SAFETY: pool buffers came from aclrtMallocHost and are no longer referenced.
                unsafe { self.api.acl.aclrtFreeHost(p as _) };
            }
        }
        if self.owns_acl {
            // SAFETY: hprt initialised ACL and nothing of this platform is left.
            unsafe { self.api.acl.aclFinalize() };
        }
    }
}

/// An ACL stream.
pub struct StreamObj {
    shared: Arc<Shared>,
    raw: usize,
    owned: bool,
    /// Subscribed to the report thread (host functions can run on it); tried again at each need
    /// until it succeeds.
    subscribed: AtomicBool,
    errors: StreamErrors,
}

impl StreamObj {
    fn host_fns_ready(&self) -> bool {
        if self.subscribed.load(Ordering::Acquire) {
            return true;
        }
        let ok = self
            .shared
            .reporter()
            .is_some_and(|r| r.subscribe(self.raw).is_ok());
        if ok {
            self.subscribed.store(true, Ordering::Release);
        }
        ok
    }
}

impl Drop for StreamObj {
    fn drop(&mut self) {
        lock(&self.shared.streams).remove(&self.raw);
        if self.subscribed.load(Ordering::Acquire) {
            if let Some(r) = self.shared.reporter.get() {
                let _ = r.unsubscribe(self.raw);
            }
        }
        if self.owned && self.shared.bind().is_ok() {
            // SAFETY: we created this stream; ACL lets queued work finish.
            let _ = acl_call!(self.shared.api, aclrtDestroyStream(self.raw as _));
        }
    }
}

/// An ACL event, with whether it was ever recorded (ACL does not say).
pub struct EventObj {
    shared: Arc<Shared>,
    raw: usize,
    timing: bool,
    recorded: AtomicBool,
    /// The backend's errors the latest record carries (`host_errors`).
    carries: Mutex<Vec<Span>>,
}

impl Drop for EventObj {
    fn drop(&mut self) {
        if self.shared.bind().is_ok() {
            // SAFETY: we created this event.
            unsafe { self.shared.api.acl.aclrtDestroyEvent(self.raw as _) };
        }
    }
}

/// How a buffer's memory was obtained.
pub enum Origin {
    Device(usize),
    Pinned,
    Borrowed(Option<ReleaseFn>),
}

/// Device, pinned or borrowed memory, with the events of its uses (`auxil::uses`).
pub type MemObj = TrackedMem<Shared>;

/// ACL binds one device per thread: events and streams need no more than `bind`.
impl UseEvents for Shared {
    type Stream = usize;
    type Event = usize;
    type Origin = Origin;
    const NAME: &'static str = "npu";

    fn bind_for(&self, _: usize) -> Result<()> {
        self.bind().map(drop)
    }
    fn create_event(&self) -> Result<usize> {
        let mut e = std::ptr::null_mut();
        // SAFETY: plain ACL call.
        acl_call!(self.api, aclrtCreateEventWithFlag(&mut e, ACL_EVENT_SYNC))?;
        Ok(e as usize)
    }
    fn record_event(&self, event: usize, stream: usize) -> Result<()> {
        // SAFETY: live handles.
        acl_call!(self.api, aclrtRecordEvent(event as _, stream as _))
    }
    fn event_complete(&self, event: usize) -> Option<bool> {
        let mut status = aclrtEventRecordedStatus(0);
        // SAFETY: an event use tracking created and has not destroyed.
        let queried = unsafe { self.api.acl.aclrtQueryEventStatus(event as _, &mut status) };
        (queried == 0).then_some(status.0 == 1)
    }
    fn wait_event(&self, event: usize) -> bool {
        // SAFETY: as above.
        (unsafe { self.api.acl.aclrtSynchronizeEvent(event as _) }) == 0
    }
    fn destroy_event(&self, event: usize) {
        // SAFETY: as above; destroyed once.
        unsafe { self.api.acl.aclrtDestroyEvent(event as _) };
    }
    fn drain(&self, stream: usize) {
        // SAFETY: a live stream.
        let _ = acl_call!(self.api, aclrtSynchronizeStream(stream as _));
    }
    fn free(&self, origin: Origin, ptr: usize, len: usize) {
        let api = &self.api.acl;
        match origin {
            Origin::Device(d) => {
                // SAFETY: allocated by aclrtMalloc; no queued work uses it any more.
                let _ = acl(unsafe { api.aclrtFree(ptr as _) }, "aclrtFree");
                self.devices[d].release(len);
            }
            Origin::Pinned => {
                // SAFETY: allocated by aclrtMallocHost; no queued work uses it any more.
                let _ = acl(unsafe { api.aclrtFreeHost(ptr as _) }, "aclrtFreeHost");
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
            Origin::Pinned => "pinned",
            Origin::Borrowed(_) => "borrowed (its release is not run)",
        }
    }
    fn frees(&self) -> &Weak<DeferredFrees> {
        &self.frees
    }
}

/// An HCCL communicator, with a scratch word for barriers.
pub struct CommObj {
    shared: Arc<Shared>,
    raw: usize,
    rank: usize,
    world: usize,
    scratch: Arc<MemObj>,
}

impl Drop for CommObj {
    fn drop(&mut self) {
        // SAFETY: we created this communicator.
        let _ = hccl(
            unsafe { self.shared.api.hccl.HcclCommDestroy(self.raw as _) }.0 as i32,
            "HcclCommDestroy",
        );
    }
}

/// The npu backend (see the module docs).
pub struct NpuBackend {
    shared: Arc<Shared>,
    device_count: usize,
    retired: Retired<Arc<StreamObj>>,
    /// Dropped last: waits for the memory still waiting for its queued work, then frees it.
    frees: Arc<DeferredFrees>,
}

fn hccl_dtype(d: DType) -> HcclDataType {
    HcclDataType(match d {
        DType::I8 => 0,
        DType::I32 => 2,
        DType::F16 => 3,
        DType::F32 => 4,
        DType::I64 => 5,
        DType::U8 => 7,
        DType::F64 => 10,
        DType::BF16 => 11,
    })
}

fn hccl_op(op: ReduceOp) -> HcclReduceOp {
    HcclReduceOp(match op {
        ReduceOp::Sum | ReduceOp::Avg => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    })
}

fn memcpy_kind(k: CopyKind) -> aclrtMemcpyKind {
    aclrtMemcpyKind(match k {
        CopyKind::HostToHost => 0,
        CopyKind::HostToDevice => 1,
        CopyKind::DeviceToHost => 2,
        CopyKind::DeviceToDevice => 3,
    })
}

/// Divides `count` elements at `ptr` (host memory) by `n`, rounding once per element.
///
/// # Safety
/// `ptr` must address `count` elements of `dtype`, not touched by anyone else meanwhile.
unsafe fn divide_in_place(ptr: usize, count: usize, dtype: DType, n: usize) {
    unsafe fn each<T: Copy>(ptr: usize, count: usize, f: impl Fn(T) -> T) {
        let p = ptr as *mut T;
        for i in 0..count {
            p.add(i).write_unaligned(f(p.add(i).read_unaligned()));
        }
    }
    match dtype {
        DType::F32 => each::<f32>(ptr, count, |x| x / n as f32),
        DType::F64 => each::<f64>(ptr, count, |x| x / n as f64),
        DType::F16 => each::<f16>(ptr, count, |x| f16::from_f32(x.to_f32() / n as f32)),
        DType::BF16 => each::<bf16>(ptr, count, |x| bf16::from_f32(x.to_f32() / n as f32)),
        DType::I8 => each::<i8>(ptr, count, |x| (i64::from(x) / n as i64) as i8),
        DType::U8 => each::<u8>(ptr, count, |x| (u64::from(x) / n as u64) as u8),
        DType::I32 => each::<i32>(ptr, count, |x| (i64::from(x) / n as i64) as i32),
        DType::I64 => each::<i64>(ptr, count, |x| (i128::from(x) / n as i128) as i64),
    }
}

impl NpuBackend {
    /// Loads ACL and HCCL, initialises ACL (or adopts someone else's initialisation), and
    /// counts devices. Every failure is a typed `Unavailable` error saying what is missing.
    pub fn open() -> Result<Self> {
        Self::open_with(&SearchEnv::from_process())
    }

    /// [`NpuBackend::open`] with the library search settings given explicitly.
    pub fn open_with(env: &SearchEnv) -> Result<Self> {
        let api = hprt_sys::load_with(env)
            .map_err(|e| npu_err(ErrorKind::Unavailable, "load", e.to_string()))?;
        Self::with_api(api)
    }

    fn with_api(api: Ascend) -> Result<Self> {
        let api = Arc::new(api);
        // SAFETY: aclInit with no config file.
        let code = unsafe { api.acl.aclInit(std::ptr::null()) };
        let owns_acl = code != ACL_ERROR_REPEAT_INITIALIZE as i32;
        if owns_acl {
            acl(code, "aclInit")?;
        } else {
            tracing::info!(
                "ACL already initialised by another component; hprt will not finalize it"
            );
        }
        let finalize = |e| {
            if owns_acl {
                // SAFETY: undo our own initialisation on the way out.
                unsafe { api.acl.aclFinalize() };
            }
            e
        };
        let mut count = 0u32;
        // SAFETY: plain ACL call.
        acl_call!(api, aclrtGetDeviceCount(&mut count)).map_err(finalize)?;
        if count == 0 {
            return Err(finalize(npu_err(
                ErrorKind::Unavailable,
                "open",
                "ACL reports no NPU device",
            )));
        }
        let (frees, frees_ref) = deferred::new_list();
        let shared = Arc::new(Shared {
            frees: frees_ref,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            owns_acl,
            devices: (0..count)
                .map(|_| Arc::new(MemoryCounter::new(None)))
                .collect(),
            pinned: Arc::new(MemoryCounter::new(None)),
            streams: Mutex::new(HashMap::new()),
            reporter: OnceLock::new(),
            reporter_start: Mutex::new(()),
            staging: Arc::new(Mutex::new(HashMap::new())),
            api,
        });
        Ok(NpuBackend {
            shared,
            device_count: count as usize,
            retired: Retired::default(),
            frees,
        })
    }

    fn api(&self) -> &Ascend {
        &self.shared.api
    }

    fn stream_obj(&self, raw: usize, owned: bool) -> Arc<StreamObj> {
        let s = Arc::new(StreamObj {
            shared: Arc::clone(&self.shared),
            raw,
            owned,
            subscribed: AtomicBool::new(false),
            errors: StreamErrors::default(),
        });
        s.host_fns_ready();
        lock(&self.shared.streams).insert(raw, Arc::downgrade(&s));
        s
    }

    fn take_staging(&self, bytes: usize) -> Result<usize> {
        if let Some(p) = lock(&self.shared.staging)
            .get_mut(&bytes)
            .and_then(Vec::pop)
        {
            return Ok(p);
        }
        let mut p = std::ptr::null_mut();
        // SAFETY: plain ACL call.
        self.frees
            .retrying(|| acl_call!(self.api(), aclrtMallocHost(&mut p, bytes)))?;
        Ok(p as usize)
    }

    /// `buf = buf / n` on the stream (the scale step of `Avg`).
    fn divide_on_stream(
        &self,
        place: &Place<Arc<MemObj>>,
        count: usize,
        dtype: DType,
        n: usize,
        stream: &StreamObj,
    ) -> Result<()> {
        let bytes = count * dtype.size();
        if bytes == 0 || n == 1 {
            return Ok(());
        }
        self.host_step(
            "all_reduce(avg)",
            vec![(place.clone(), bytes, Access::ReadWrite)],
            stream,
            // SAFETY: the staging copy holds `count` elements of `dtype`.
            move |staged| unsafe { divide_in_place(staged[0], count, dtype, n) },
        )
    }

    /// Device compute this ACL subset has no kernel for, done on the host in stream order:
    /// each place is copied D2H into pinned staging (unless only written), `compute` runs on the
    /// staging copies in a blocking host function, written places are copied back H2D, and the
    /// staging buffers return to the pool once the stream passed them.
    fn host_step(
        &self,
        op: &'static str,
        places: Vec<(Place<Arc<MemObj>>, usize, Access)>,
        stream: &StreamObj,
        compute: impl FnOnce(&[usize]) + Send + 'static,
    ) -> Result<()> {
        if !stream.host_fns_ready() {
            return Err(host_fn_unsupported(op));
        }
        let api = self.api();
        let s = stream.raw as *mut c_void;
        let mut staged = Vec::with_capacity(places.len());
        let give_back = |staged: &[(usize, usize)]| {
            let mut pool = lock(&self.shared.staging);
            for &(p, b) in staged {
                pool.entry(b).or_default().push(p);
            }
        };
        for ((_, _), bytes, _) in &places {
            match self.take_staging(*bytes) {
                Ok(p) => staged.push((p, *bytes)),
                Err(e) => {
                    give_back(&staged);
                    return Err(e);
                }
            }
        }
        for (((mem, off), bytes, access), &(st, _)) in places.iter().zip(&staged) {
            if *access != Access::Write {
                // SAFETY: the device range is live and bounds-checked; staging is ours.
                acl_call!(
                    api,
                    aclrtMemcpyAsync(
                        st as _,
                        *bytes,
                        (mem.ptr + off) as _,
                        *bytes,
                        memcpy_kind(CopyKind::DeviceToHost),
                        s,
                    )
                )?;
            }
        }
        let ptrs: Vec<usize> = staged.iter().map(|&(p, _)| p).collect();
        host_fn::launch(api, stream.raw, true, Box::new(move || compute(&ptrs)))?;
        for (((mem, off), bytes, access), &(st, _)) in places.iter().zip(&staged) {
            if *access != Access::Read {
                // SAFETY: as above.
                acl_call!(
                    api,
                    aclrtMemcpyAsync(
                        (mem.ptr + off) as _,
                        mem.len - off,
                        st as _,
                        *bytes,
                        memcpy_kind(CopyKind::HostToDevice),
                        s,
                    )
                )?;
            }
            mem.used_on(stream.raw)?;
        }
        // Only the pool travels into the callback: the report thread must never hold the last
        // reference to `Shared`, whose drop joins that thread.
        let pool = Arc::clone(&self.shared.staging);
        host_fn::launch(
            api,
            stream.raw,
            false,
            Box::new(move || {
                let mut pool = lock(&pool);
                for (p, b) in staged {
                    pool.entry(b).or_default().push(p);
                }
            }),
        )
    }

    fn new_comm(&self, raw: usize, rank: usize, world: usize) -> Result<Arc<CommObj>> {
        let scratch = Backend::alloc_device(self, 4)?.0;
        Ok(Arc::new(CommObj {
            shared: Arc::clone(&self.shared),
            raw,
            rank,
            world,
            scratch,
        }))
    }
}

fn host_fn_unsupported(op: &'static str) -> Error {
    let missing: Vec<&str> = OPTIONAL_SYMBOLS
        .iter()
        .copied()
        .filter(|s| s.contains("Report") || s.contains("Callback"))
        .collect();
    npu_err(
        ErrorKind::Unsupported,
        op,
        format!("{op} needs a host-function step on the stream ({missing:?}), unavailable on this stream or ACL build"),
    )
}

fn ptr(place: &Option<Place<Arc<MemObj>>>) -> *mut c_void {
    place
        .as_ref()
        .map_or(std::ptr::null_mut(), |(m, o)| (m.ptr + o) as *mut c_void)
}

impl Backend for NpuBackend {
    type Stream = Arc<StreamObj>;
    type Event = Arc<EventObj>;
    type DeviceMemory = Arc<MemObj>;
    type PinnedMemory = Arc<MemObj>;
    type Comm = Arc<CommObj>;

    fn kind(&self) -> BackendKind {
        BackendKind::Npu
    }
    fn instance(&self) -> u64 {
        self.shared.instance
    }
    fn info(&self) -> PlatformInfo {
        let api = self.api();
        let version = if api.acl.aclrtGetVersion.is_ok() {
            let (mut a, mut b, mut c) = (0, 0, 0);
            // SAFETY: plain ACL call.
            match unsafe { api.acl.aclrtGetVersion(&mut a, &mut b, &mut c) } {
                0 => format!("ACL interface {a}.{b}.{c}"),
                code => format!("ACL interface version unknown (aclrtGetVersion returned {code})"),
            }
        } else {
            "ACL interface version unknown (aclrtGetVersion not exported)".to_string()
        };
        let mut libraries: Vec<LibraryProbe> = api
            .searched
            .iter()
            .map(|c| LibraryProbe {
                path: format!("{} ({})", c.path.display(), c.source),
                found: c.found,
            })
            .collect();
        libraries.dedup_by(|a, b| a.path == b.path);
        let optional: Vec<String> = OPTIONAL_SYMBOLS
            .iter()
            .map(|s| {
                let present = match *s {
                    "aclrtGetVersion" => api.acl.aclrtGetVersion.is_ok(),
                    "aclrtStreamQuery" => api.acl.aclrtStreamQuery.is_ok(),
                    "HcclGroupStart" => api.hccl.HcclGroupStart.is_ok(),
                    "HcclGroupEnd" => api.hccl.HcclGroupEnd.is_ok(),
                    _ => host_fn::available(api),
                };
                format!("{s}: {}", if present { "present" } else { "absent" })
            })
            .collect();
        PlatformInfo {
            backend: BackendKind::Npu,
            devices: (0..self.device_count)
                .map(|ordinal| DeviceInfo {
                    ordinal,
                    name: format!("Ascend NPU {ordinal}"),
                    // ACL reports memory for the calling thread's device only.
                    total_memory: if ordinal == Backend::current_device(self) {
                        Backend::mem_info(self).map_or(0, |m| m.total)
                    } else {
                        0
                    },
                })
                .collect(),
            driver: format!(
                "{version}; libascendcl: {}; libhccl: {}",
                api.acl_path.display(),
                api.hccl_path.display()
            ),
            libraries,
            settings: vec![
                (
                    "aclInit".into(),
                    if self.shared.owns_acl {
                        "by hprt (finalized when the platform is dropped)".into()
                    } else {
                        "by another component (torch_npu?); hprt never calls aclFinalize".into()
                    },
                ),
                ("optional symbols".into(), optional.join(", ")),
            ],
        }
    }

    fn device_count(&self) -> usize {
        self.device_count
    }
    fn set_device(&self, ordinal: usize) -> Result<()> {
        if ordinal >= self.device_count {
            return Err(npu_err(
                ErrorKind::InvalidValue,
                "set_device",
                format!(
                    "device {ordinal} does not exist ({} devices)",
                    self.device_count
                ),
            ));
        }
        // SAFETY: plain ACL call.
        acl_call!(self.api(), aclrtSetDevice(ordinal as i32))?;
        BOUND.with(|b| b.borrow_mut().insert(self.shared.instance, ordinal as i32));
        Ok(())
    }
    fn current_device(&self) -> usize {
        BOUND.with(|b| b.borrow().get(&self.shared.instance).copied().unwrap_or(0)) as usize
    }
    fn mem_info(&self) -> Result<MemInfo> {
        self.shared.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: plain ACL call.
        acl_call!(
            self.api(),
            aclrtGetMemInfo(aclrtMemAttr(1), &mut free, &mut total)
        )?;
        Ok(MemInfo { free, total })
    }
    fn memory_stats(&self) -> MemoryStats {
        let d = &self.shared.devices[Backend::current_device(self)];
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
        self.frees.reclaim(false);
    }
    fn reset_peak_memory(&self) {
        self.shared.devices[Backend::current_device(self)].reset_peak();
        self.shared.pinned.reset_peak();
    }

    fn create_stream(&self) -> Result<(Arc<StreamObj>, RawStream)> {
        self.shared.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: plain ACL call.
        acl_call!(self.api(), aclrtCreateStream(&mut raw))?;
        Ok((self.stream_obj(raw as usize, true), RawStream(raw as usize)))
    }
    unsafe fn wrap_stream(&self, raw: RawStream) -> Result<Arc<StreamObj>> {
        if raw.0 == 0 {
            return Err(npu_err(
                ErrorKind::InvalidValue,
                "wrap_external_stream",
                "null aclrtStream",
            ));
        }
        Ok(self.stream_obj(raw.0, false))
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
        self.shared.bind()?;
        // SAFETY: live stream.
        let driver = acl_call!(self.api(), aclrtSynchronizeStream(stream.raw as _));
        // Both reported at once: the backend's are not left for a later synchronize.
        driver.and(stream.errors.take())
    }
    fn query_stream(&self, stream: &Arc<StreamObj>) -> Result<bool> {
        if self.api().acl.aclrtStreamQuery.is_ok() {
            self.shared.bind()?;
            let mut status = aclrtStreamStatus(0xFFFF);
            // SAFETY: live stream.
            acl_call!(self.api(), aclrtStreamQuery(stream.raw as _, &mut status))?;
            return Ok(status == aclrtStreamStatus::ACL_STREAM_STATUS_COMPLETE);
        }
        // Older ACL: record a private event and ask it. It may still say "busy" for a moment on
        // a stream that is idle, until the mark itself has run.
        let e = Backend::create_event(self, false)?;
        Backend::record_event(self, &e, stream)?;
        Backend::query_event(self, &e)
    }
    fn synchronize_device(&self) -> Result<()> {
        let live: Vec<Arc<StreamObj>> = lock(&self.shared.streams)
            .values()
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
        self.shared.bind()?;
        let mut raw = std::ptr::null_mut();
        let flags = if timing {
            ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE
        } else {
            ACL_EVENT_SYNC
        };
        // SAFETY: plain ACL call.
        acl_call!(self.api(), aclrtCreateEventWithFlag(&mut raw, flags))?;
        Ok(Arc::new(EventObj {
            shared: Arc::clone(&self.shared),
            raw: raw as usize,
            timing,
            recorded: AtomicBool::new(false),
            carries: Mutex::default(),
        }))
    }
    fn destroy_event(&self, event: Arc<EventObj>) -> Result<()> {
        drop(event);
        Ok(())
    }
    fn record_event(&self, event: &Arc<EventObj>, stream: &Arc<StreamObj>) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: live handles.
        acl_call!(
            self.api(),
            aclrtRecordEvent(event.raw as _, stream.raw as _)
        )?;
        *lock(&event.carries) = stream.errors.record();
        event.recorded.store(true, Ordering::Release);
        Ok(())
    }
    fn stream_wait_event(&self, stream: &Arc<StreamObj>, event: &Arc<EventObj>) -> Result<()> {
        if !event.recorded.load(Ordering::Acquire) {
            return Ok(());
        }
        self.shared.bind()?;
        // SAFETY: live handles.
        acl_call!(
            self.api(),
            aclrtStreamWaitEvent(stream.raw as _, event.raw as _)
        )?;
        stream.errors.wait(&lock(&event.carries));
        Ok(())
    }
    fn query_event(&self, event: &Arc<EventObj>) -> Result<bool> {
        if !event.recorded.load(Ordering::Acquire) {
            return Ok(true);
        }
        self.shared.bind()?;
        let mut status = aclrtEventRecordedStatus(0);
        // SAFETY: live handle.
        acl_call!(
            self.api(),
            aclrtQueryEventStatus(event.raw as _, &mut status)
        )?;
        Ok(status.0 == 1)
    }
    fn synchronize_event(&self, event: &Arc<EventObj>) -> Result<()> {
        Self::wait_event(event)
    }
    fn wait_event(event: &Arc<EventObj>) -> Result<()> {
        if !event.recorded.load(Ordering::Acquire) {
            return Ok(());
        }
        event.shared.bind()?;
        // SAFETY: live handle.
        acl_call!(event.shared.api, aclrtSynchronizeEvent(event.raw as _))?;
        first_error(&lock(&event.carries)).map_or(Ok(()), Err)
    }
    fn event_elapsed_ms(&self, start: &Arc<EventObj>, end: &Arc<EventObj>) -> Result<f32> {
        for (e, what) in [(start, "start"), (end, "end")] {
            debug_assert!(e.timing);
            if !e.recorded.load(Ordering::Acquire) || !Backend::query_event(self, e)? {
                return Err(npu_err(
                    ErrorKind::NotReady,
                    "event_elapsed_ms",
                    format!("the {what} event has not completed its last record"),
                ));
            }
        }
        let mut ms = 0f32;
        // SAFETY: live handles.
        acl_call!(
            self.api(),
            aclrtEventElapsedTime(&mut ms, start.raw as _, end.raw as _)
        )?;
        Ok(ms)
    }

    fn alloc_device(&self, bytes: usize) -> Result<(Arc<MemObj>, usize)> {
        let device = self.shared.bind()? as usize;
        let mut p = std::ptr::null_mut();
        self.frees.retrying(|| {
            // SAFETY: plain ACL call.
            acl_call!(
                self.api(),
                aclrtMalloc(&mut p, bytes, aclrtMemMallocPolicy(0))
            )
        })?;
        self.shared.devices[device].reserve(BackendKind::Npu, "aclrtMalloc", bytes)?;
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
        self.shared.bind()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: plain ACL call.
        self.frees
            .retrying(|| acl_call!(self.api(), aclrtMallocHost(&mut p, bytes)))?;
        self.shared
            .pinned
            .reserve(BackendKind::Npu, "aclrtMallocHost", bytes)?;
        let m = MemObj::new(&self.shared, p as usize, bytes, Origin::Pinned);
        Ok((m, p as usize))
    }

    fn copy(
        &self,
        kind: CopyKind,
        dst: Loc<Self>,
        src: Loc<Self>,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        let (
            Loc::Device(d, doff) | Loc::Pinned(d, doff),
            Loc::Device(s, soff) | Loc::Pinned(s, soff),
        ) = (dst, src);
        self.shared.bind()?;
        // SAFETY: ranges bounds-checked by the caller; destMax is what remains of the destination.
        acl_call!(
            self.api(),
            aclrtMemcpyAsync(
                (d.ptr + doff) as _,
                d.len - doff,
                (s.ptr + soff) as _,
                bytes,
                memcpy_kind(kind),
                stream.raw as _,
            )
        )?;
        d.used_on(stream.raw)?;
        s.used_on(stream.raw)
    }
    fn memset(
        &self,
        (d, off): Place<Arc<MemObj>>,
        value: u8,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: as in `copy`.
        acl_call!(
            self.api(),
            aclrtMemsetAsync(
                (d.ptr + off) as _,
                d.len - off,
                i32::from(value),
                bytes,
                stream.raw as _,
            )
        )?;
        d.used_on(stream.raw)
    }

    fn kernel(&self, kernel: Kernel<Place<Arc<MemObj>>>, stream: &Arc<StreamObj>) -> Result<()> {
        // The ACL subset hprt loads has no elementwise operators, so kernels run on the host.
        let places = kernel
            .places()
            .into_iter()
            .map(|(p, bytes, access)| (p.clone(), bytes, access))
            .collect();
        let name = kernel.name();
        let shape = kernel.try_map(|_| Ok(()))?;
        self.host_step(name, places, stream, move |staged| {
            // `host_step` stages one buffer per place, in the order of `places()`.
            let mut next = staged.iter();
            let on_staging = shape.try_map(|()| {
                next.next()
                    .map(|&p| p as *mut u8)
                    .ok_or_else(|| npu_err(ErrorKind::Internal, name, "staging missing"))
            });
            if let Ok(k) = on_staging {
                // SAFETY: each staging buffer holds its place's bytes; in-place kernels got
                // separate staging copies of the same bytes, which `run_on_host` allows.
                unsafe { run_on_host(&k) };
            }
        })
    }
    fn host_fn(&self, stream: &Arc<StreamObj>, f: HostFn) -> Result<()> {
        if !stream.host_fns_ready() {
            return Err(host_fn_unsupported("launch_host_fn"));
        }
        let f = stream.errors.guard(BackendKind::Npu, f);
        host_fn::launch(self.api(), stream.raw, true, f)
    }

    fn unique_id(&self) -> Result<UniqueId> {
        self.shared.bind()?;
        let mut info = HcclRootInfo {
            internal: [0; ROOT_INFO_BYTES],
        };
        // SAFETY: plain HCCL call into a correctly sized struct.
        hccl(
            unsafe { self.api().hccl.HcclGetRootInfo(&mut info) }.0 as i32,
            "HcclGetRootInfo",
        )?;
        Ok(UniqueId(info.internal.iter().map(|&c| c as u8).collect()))
    }
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Arc<CommObj>> {
        if id.0.len() != ROOT_INFO_BYTES {
            return Err(npu_err(
                ErrorKind::InvalidValue,
                "comm_init",
                format!(
                    "an HcclRootInfo has {ROOT_INFO_BYTES} bytes, not {}",
                    id.0.len()
                ),
            ));
        }
        self.shared.bind()?;
        let mut info = HcclRootInfo {
            internal: [0; ROOT_INFO_BYTES],
        };
        for (d, s) in info.internal.iter_mut().zip(&id.0) {
            *d = *s as _;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: plain HCCL call; blocks until every rank joined.
        hccl(
            unsafe {
                self.api()
                    .hccl
                    .HcclCommInitRootInfo(world as u32, &info, rank as u32, &mut comm)
            }
            .0 as i32,
            "HcclCommInitRootInfo",
        )?;
        self.new_comm(comm as usize, rank, world)
    }
    fn comm_split(
        &self,
        comm: &Arc<CommObj>,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<(Arc<CommObj>, usize, usize)>> {
        let gather = |mine: &[u8]| {
            let stream = Backend::create_stream(self)?.0;
            auxil::comm::host_all_gather(self, comm, comm.world, mine, &stream)
        };
        auxil::comm::split_by_leader(
            self,
            ROOT_INFO_BYTES,
            comm.rank,
            comm.world,
            rank_lists,
            gather,
            |id, rank, size| Backend::comm_init(self, id, rank, size),
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
        self.shared.bind()?;
        let h = &self.api().hccl;
        let op = match op {
            Collective::Barrier => auxil::comm::barrier_as_all_reduce(Arc::clone(&comm.scratch)),
            op => op,
        };
        let (c, s) = (comm.raw as *mut c_void, stream.raw as *mut c_void);
        // SAFETY (every call below): places were bounds-checked for the extent HCCL touches;
        // handles are live; HCCL only queues the work on `s`.
        let (code, name) = unsafe {
            match &op {
                Collective::AllReduce {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => (
                    h.HcclAllReduce(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        hccl_op(*op),
                        c,
                        s,
                    ),
                    "HcclAllReduce",
                ),
                Collective::ReduceScatter {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => (
                    h.HcclReduceScatter(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        hccl_op(*op),
                        c,
                        s,
                    ),
                    "HcclReduceScatter",
                ),
                Collective::AllGather {
                    send,
                    recv,
                    count,
                    dtype,
                } => (
                    h.HcclAllGather(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        c,
                        s,
                    ),
                    "HcclAllGather",
                ),
                Collective::Broadcast {
                    buf,
                    count,
                    dtype,
                    root,
                } => (
                    h.HcclBroadcast(
                        ptr(buf),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *root as u32,
                        c,
                        s,
                    ),
                    "HcclBroadcast",
                ),
                Collective::AllToAll {
                    send,
                    recv,
                    count,
                    dtype,
                } => {
                    let dt = hccl_dtype(*dtype);
                    (
                        h.HcclAlltoAll(
                            ptr(send),
                            *count as u64,
                            dt,
                            ptr(recv),
                            *count as u64,
                            dt,
                            c,
                            s,
                        ),
                        "HcclAlltoAll",
                    )
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
                    let v = |x: &[usize]| x.iter().map(|&n| n as u64).collect::<Vec<u64>>();
                    let (sc, sd, rc, rd) = (
                        v(send_counts),
                        v(send_displs),
                        v(recv_counts),
                        v(recv_displs),
                    );
                    let dt = hccl_dtype(*dtype);
                    (
                        h.HcclAlltoAllV(
                            ptr(send),
                            sc.as_ptr().cast(),
                            sd.as_ptr().cast(),
                            dt,
                            ptr(recv),
                            rc.as_ptr().cast(),
                            rd.as_ptr().cast(),
                            dt,
                            c,
                            s,
                        ),
                        "HcclAlltoAllV",
                    )
                }
                Collective::Send {
                    send,
                    count,
                    dtype,
                    peer,
                } => (
                    h.HcclSend(
                        ptr(send),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *peer as u32,
                        c,
                        s,
                    ),
                    "HcclSend",
                ),
                Collective::Recv {
                    recv,
                    count,
                    dtype,
                    peer,
                } => (
                    h.HcclRecv(
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *peer as u32,
                        c,
                        s,
                    ),
                    "HcclRecv",
                ),
                Collective::Barrier => unreachable!("issued as an all-reduce above"),
            }
        };
        hccl(code.0 as i32, name)?;
        for (place, _) in op.places(comm.world) {
            if let Some((m, _)) = place {
                m.used_on(stream.raw)?;
            }
        }
        match auxil::comm::avg_to_scale(op, comm.world) {
            Some((recv, count, dtype)) => {
                self.divide_on_stream(&recv, count, dtype, comm.world, stream)
            }
            None => Ok(()),
        }
    }
    fn group_start(&self) -> Result<()> {
        let h = &self.api().hccl;
        if h.HcclGroupStart.is_err() {
            return Err(npu_err(
                ErrorKind::Unsupported,
                "group_start",
                "this HCCL does not export HcclGroupStart",
            ));
        }
        // SAFETY: plain HCCL call.
        hccl(unsafe { h.HcclGroupStart() }.0 as i32, "HcclGroupStart")
    }
    fn group_end(&self) -> Result<()> {
        let h = &self.api().hccl;
        if h.HcclGroupEnd.is_err() {
            return Err(npu_err(
                ErrorKind::Unsupported,
                "group_end",
                "this HCCL does not export HcclGroupEnd",
            ));
        }
        // SAFETY: plain HCCL call.
        hccl(unsafe { h.HcclGroupEnd() }.0 as i32, "HcclGroupEnd")
    }
}
