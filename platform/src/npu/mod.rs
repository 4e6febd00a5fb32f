//! The npu backend: Ascend ACL runtime + HCCL, loaded at run time through `hprt-sys`.
//!
//! Verified against the ACL/HCCL emulator in `tests/ascend-emulator` only, until it runs on
//! real Ascend hardware. Coexists with torch_npu: if `aclInit` reports "repeat initialize",
//! someone else owns ACL and hprt never calls `aclFinalize`.
//!
//! Memory is freed in stream order, once the events of its uses completed (`crate::auxil::uses`).
//! Layout (the cuda backend's): this file holds the objects and the [`Backend`] impl;
//! `context.rs` opening and the thread's device, `memory.rs` buffers and staging, `stream.rs`
//! streams and events, `launch.rs` host steps (compute without a device kernel), `collective.rs`
//! HCCL. Stream, event and memory calls go through `result.rs` (checked calls on typed handles,
//! as cuda's); `check.rs` turns ACL / HCCL statuses into errors, `host_fn.rs` runs host
//! functions.

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
    aclrtMemcpyKind, HcclDataType, HcclReduceOp, HcclRootInfo, ACL_ERROR_REPEAT_INITIALIZE,
    ACL_EVENT_SYNC, ACL_EVENT_TIME_LINE,
};
use hprt_sys::{Ascend, SearchEnv, OPTIONAL_SYMBOLS};

use crate::auxil;
use crate::auxil::deferred::{self, DeferredFrees};
use crate::auxil::uses::{Origin, TrackedMem, UseEvents};
use crate::backend::Backend;
use crate::capabilities::Capabilities;
use crate::collective::Collective;
use crate::dtype::{DType, ReduceOp};
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::{CopyKind, RawStream, ReleaseFn, UniqueId};
use crate::host_errors::{synchronize_all, EventRecord, Point, Retired, StreamErrors};
use crate::info::{DeviceInfo, LibraryProbe, PlatformInfo};
use crate::kernel::{run_on_host, Access, HostFn, Kernel};
use crate::memory::{MemInfo, MemoryCounter, MemoryStats};
use crate::place::{Memory, Place};
use check::{acl, hccl, npu_err};
use host_fn::Reporter;
use launch::host_fn_unsupported;

/// Calls an ACL function of `$api` (an `Ascend`) and checks its status, naming the function in
/// the error. The call is `unsafe`: each use carries the SAFETY reasoning for its arguments.
macro_rules! acl_call {
    ($api:expr, $f:ident($($arg:expr),* $(,)?)) => {
        // SAFETY: the function pointer is one `$api` resolved and keeps loaded; the arguments
        // are the caller's to justify: every use carries a `// SAFETY:` comment for them.
        acl(unsafe { $api.acl.$f($($arg),*) }, stringify!($f))
    };
}

// After the macro, which they use.
mod collective;
mod context;
mod launch;
mod memory;
mod result;
mod stream;

const ROOT_INFO_BYTES: usize = std::mem::size_of::<HcclRootInfo>();

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// (platform instance → device bound on this thread with `aclrtSetDevice`).
    static BOUND: RefCell<HashMap<u64, i32>> = RefCell::new(HashMap::new());
    /// `HcclGroupStart`s of this thread not yet ended: grouped collectives are queued at the
    /// end, so no marks are recorded around them.
    static GROUP_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// What every object of one npu platform value shares.
pub struct Shared {
    api: Arc<Ascend>,
    instance: u64,
    owns_acl: bool,
    /// The ACL library is hprt's Ascend emulator ([`crate::Capabilities`]).
    emulated: bool,
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
    /// Collectives queued and not known to have finished (`collective::Watched`).
    watched: Mutex<Vec<collective::Watched>>,
    /// `HP_COLLECTIVE_TIMEOUT_MS`: a collective that failed after running this long timed out.
    collective_timeout_ms: AtomicU64,
}

/// An ACL stream.
pub struct StreamObj {
    shared: Arc<Shared>,
    raw: result::Stream,
    owned: bool,
    /// Subscribed to the report thread (host functions can run on it); tried again at each need
    /// until it succeeds.
    subscribed: AtomicBool,
    errors: StreamErrors,
}

/// An ACL event, with whether it was ever recorded (ACL does not say).
pub struct EventObj {
    shared: Arc<Shared>,
    raw: result::Event,
    timing: bool,
    /// Whether it was recorded, and the backend's errors its latest record carries.
    record: EventRecord,
}

/// Device, pinned or borrowed memory, with the events of its uses (`auxil::uses`).
pub type MemObj = TrackedMem<Shared>;

/// An HCCL communicator, with a scratch word for barriers.
pub struct CommObj {
    shared: Arc<Shared>,
    raw: result::Comm,
    rank: usize,
    world: usize,
    scratch: Arc<MemObj>,
    /// Collectives issued on it, for their names in errors (`all_gather #3`).
    issued: AtomicU64,
}

/// The npu backend (see the module docs).
pub struct NpuBackend {
    shared: Arc<Shared>,
    device_count: usize,
    retired: Retired<Arc<StreamObj>>,
    /// Dropped last: waits for the memory still waiting for its queued work, then frees it.
    frees: Arc<DeferredFrees>,
}

fn memcpy_kind(k: CopyKind) -> aclrtMemcpyKind {
    aclrtMemcpyKind(match k {
        CopyKind::HostToHost => 0,
        CopyKind::HostToDevice => 1,
        CopyKind::DeviceToHost => 2,
        CopyKind::DeviceToDevice => 3,
    })
}

fn ptr(place: &Option<Place<Arc<MemObj>>>) -> *mut c_void {
    place.as_ref().map_or(std::ptr::null_mut(), |p| {
        (p.mem.ptr + p.offset) as *mut c_void
    })
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
    fn capabilities(&self) -> Capabilities {
        Capabilities::driver("npu", self.shared.emulated, false)
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
        // SAFETY: no pointer arguments; ACL checks the ordinal itself.
        acl_call!(self.api(), aclrtSetDevice(ordinal as i32))?;
        BOUND.with(|b| b.borrow_mut().insert(self.shared.instance, ordinal as i32));
        Ok(())
    }
    fn current_device(&self) -> usize {
        BOUND.with(|b| b.borrow().get(&self.shared.instance).copied().unwrap_or(0)) as usize
    }
    fn mem_info(&self) -> Result<MemInfo> {
        self.shared.bind()?;
        let (free, total) = result::mem::info(self.api())?;
        Ok(MemInfo { free, total })
    }
    fn memory_stats(&self) -> MemoryStats {
        MemoryStats::of(
            &self.shared.devices[Backend::current_device(self)],
            &self.shared.pinned,
        )
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
        let raw = result::stream::create(self.api())?;
        Ok((self.stream_obj(raw, true), RawStream(raw.addr())))
    }
    unsafe fn wrap_stream(&self, raw: RawStream) -> Result<Arc<StreamObj>> {
        if raw.0 == 0 {
            return Err(npu_err(
                ErrorKind::InvalidValue,
                "wrap_external_stream",
                "null aclrtStream",
            ));
        }
        // SAFETY: the caller guarantees `raw` is a live stream.
        Ok(self.stream_obj(unsafe { result::Stream::from_raw(raw.0) }, false))
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
        let driver = result::stream::synchronize(self.api(), stream.raw);
        // A collective that failed becomes its own error, naming it, at its place; those that
        // finished are no longer watched.
        self.shared.settle_collectives();
        // Both reported at once: the backend's are not left for a later synchronize. The
        // backend's is the more telling (a collective's name and cause, a host function's
        // panic) where both failed.
        let backend = stream.errors.take();
        driver
            .and(backend.clone())
            .map_err(|e| backend.err().unwrap_or(e))
    }
    fn query_stream(&self, stream: &Arc<StreamObj>) -> Result<bool> {
        self.shared.bind()?;
        if let Some(done) = result::stream::query(self.api(), stream.raw) {
            return done;
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
        synchronize_all(
            live,
            |s| Backend::synchronize_stream(self, s),
            &self.retired,
        )
    }

    fn create_event(&self, timing: bool) -> Result<Arc<EventObj>> {
        self.shared.bind()?;
        let flags = if timing {
            ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE
        } else {
            ACL_EVENT_SYNC
        };
        let raw = result::event::create(self.api(), flags)?;
        Ok(Arc::new(EventObj {
            shared: Arc::clone(&self.shared),
            raw,
            timing,
            record: EventRecord::default(),
        }))
    }
    fn destroy_event(&self, event: Arc<EventObj>) -> Result<()> {
        drop(event);
        Ok(())
    }
    fn record_event(&self, event: &Arc<EventObj>, stream: &Arc<StreamObj>) -> Result<()> {
        self.shared.bind()?;
        result::event::record(self.api(), event.raw, stream.raw)?;
        event.record.recorded_on(&stream.errors);
        Ok(())
    }
    fn stream_wait_event(&self, stream: &Arc<StreamObj>, event: &Arc<EventObj>) -> Result<()> {
        if !event.record.is_recorded() {
            return Ok(());
        }
        self.shared.bind()?;
        result::stream::wait_event(self.api(), stream.raw, event.raw)?;
        event.record.waited_by(&stream.errors);
        Ok(())
    }
    fn query_event(&self, event: &Arc<EventObj>) -> Result<bool> {
        if !event.record.is_recorded() {
            return Ok(true);
        }
        self.shared.bind()?;
        result::event::query(self.api(), event.raw)
    }
    fn synchronize_event(&self, event: &Arc<EventObj>) -> Result<()> {
        Self::wait_event(event)
    }
    fn wait_event(event: &Arc<EventObj>) -> Result<()> {
        if !event.record.is_recorded() {
            return Ok(());
        }
        event.shared.bind()?;
        let driver = result::event::synchronize(&event.shared.api, event.raw);
        if driver.is_err() {
            event.shared.settle_collectives();
        }
        // As in `synchronize_stream`: the backend's error where both failed.
        match event.record.first_error() {
            Some(e) => Err(e),
            None => driver,
        }
    }
    fn event_elapsed_ms(&self, start: &Arc<EventObj>, end: &Arc<EventObj>) -> Result<f32> {
        for (e, what) in [(start, "start"), (end, "end")] {
            debug_assert!(e.timing);
            if !e.record.is_recorded() || !Backend::query_event(self, e)? {
                return Err(npu_err(
                    ErrorKind::NotReady,
                    "event_elapsed_ms",
                    format!("the {what} event has not completed its last record"),
                ));
            }
        }
        result::event::elapsed_ms(self.api(), start.raw, end.raw)
    }

    fn alloc_device(&self, bytes: usize) -> Result<(Arc<MemObj>, usize)> {
        let device = self.shared.bind()? as usize;
        let p = self
            .frees
            .retrying(|| result::mem::alloc(self.api(), bytes))?;
        self.shared.devices[device].reserve(BackendKind::Npu, "aclrtMalloc", bytes)?;
        let m = MemObj::new(&self.shared, p, bytes, Origin::Device(device));
        Ok((m, p))
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
        let device = self.shared.bind()? as usize;
        let p = self
            .frees
            .retrying(|| result::mem::alloc_host(self.api(), bytes))?;
        self.shared
            .pinned
            .reserve(BackendKind::Npu, "aclrtMallocHost", bytes)?;
        let m = MemObj::new(&self.shared, p, bytes, Origin::Pinned(device));
        Ok((m, p))
    }

    fn copy(
        &self,
        kind: CopyKind,
        dst: Place<Memory<Arc<MemObj>, Arc<MemObj>>>,
        src: Place<Memory<Arc<MemObj>, Arc<MemObj>>>,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        let (d, doff) = (dst.mem.into_inner(), dst.offset);
        let (s, soff) = (src.mem.into_inner(), src.offset);
        self.shared.bind()?;
        let (dst, dst_max, src) = (d.ptr + doff, d.len - doff, s.ptr + soff);
        // SAFETY: ranges bounds-checked by the caller, kept live by their use events.
        unsafe {
            result::mem::copy_async(
                self.api(),
                dst,
                dst_max,
                src,
                bytes,
                memcpy_kind(kind),
                stream.raw,
            )
        }?;
        d.used_on(stream.raw)?;
        s.used_on(stream.raw)
    }
    fn memset(
        &self,
        Place {
            mem: d,
            offset: off,
        }: Place<Arc<MemObj>>,
        value: u8,
        bytes: usize,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: as in `copy`.
        unsafe {
            result::mem::set_async(
                self.api(),
                d.ptr + off,
                d.len - off,
                value,
                bytes,
                stream.raw,
            )
        }?;
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
        // ACL's calls need the device on the calling thread, as every other operation binds it.
        self.shared.bind()?;
        if !stream.host_fns_ready() {
            return Err(host_fn_unsupported("launch_host_fn"));
        }
        let f = stream.errors.guard(BackendKind::Npu, f);
        host_fn::launch(self.api(), stream.raw.addr(), true, f)
    }

    fn unique_id(&self) -> Result<UniqueId> {
        self.shared.bind()?;
        let mut info = HcclRootInfo {
            internal: [0; ROOT_INFO_BYTES],
        };
        hccl(
            // SAFETY: HCCL writes one `HcclRootInfo` (`ROOT_INFO_BYTES` bytes) through the
            // pointer: a live local of that type; the device is bound above.
            unsafe { self.api().hccl.HcclGetRootInfo(&mut info) }.0 as i32,
            "HcclGetRootInfo",
        )?;
        Ok(UniqueId(
            info.internal
                .iter()
                .map(|&c| u8::from_ne_bytes(c.to_ne_bytes()))
                .collect(),
        ))
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
        hccl(
            // SAFETY: `info` is a live local `HcclRootInfo` HCCL only reads; the out-pointer is
            // a live local `HcclComm`; HCCL checks `rank < world` itself. Blocks until every rank
            // joined.
            unsafe {
                self.api()
                    .hccl
                    .HcclCommInitRootInfo(world as u32, &info, rank as u32, &mut comm)
            }
            .0 as i32,
            "HcclCommInitRootInfo",
        )?;
        self.new_comm(result::Comm::from_sys(comm), rank, world)
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
    /// HCCL has no abort (CANN's API has `HcclCommDestroy` only): peers waiting for this rank
    /// fail at HCCL's timeout.
    fn abort_comm(&self, comm: Arc<CommObj>) -> Result<()> {
        Backend::destroy_comm(self, comm)
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
        let h = &self.api().hccl;
        if h.HcclGroupStart.is_err() {
            return Err(npu_err(
                ErrorKind::Unsupported,
                "group_start",
                "this HCCL does not export HcclGroupStart",
            ));
        }
        // SAFETY: plain HCCL call.
        hccl(unsafe { h.HcclGroupStart() }.0 as i32, "HcclGroupStart")?;
        GROUP_DEPTH.with(|d| d.set(d.get() + 1));
        Ok(())
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
        GROUP_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        // SAFETY: plain HCCL call.
        hccl(unsafe { h.HcclGroupEnd() }.0 as i32, "HcclGroupEnd")
    }
}
