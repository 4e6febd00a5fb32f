//! C entry points of the platform layer: selection, streams, events, memory; copies are in
//! `platform/copy.rs`, collectives in `platform/collective.rs`. One thin `extern "C"` function
//! per `Platform` operation, each with its safety contract, in the trait's order.

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use hprt_platform::{
    select_platform, Communicator, DType, DeviceBuffer, Event, PinnedBuffer, Platform,
    PlatformRequest, RawStream, ReduceOp, Stream, UniqueId,
};

use super::handle::{handle_kind, Handle};
use super::{arg, c_enum, c_stats, guard, out, publish, release, FfiError, FfiResult, HprtStatus};

// Declared in this order (not sorted) so that cbindgen writes the copies before the collectives
// in include/hprt.h, as when they lived in this file.
mod copy;
pub use copy::*;
mod collective;
pub use collective::*;

/// A platform: the process-wide one (`hprt_platform_get`) or one opened for the caller
/// (`hprt_platform_open`, released with `hprt_platform_close`).
pub struct HprtPlatform {
    platform: PlatformRef,
}

enum PlatformRef {
    Global(&'static dyn Platform),
    Owned(Arc<dyn Platform>),
}

impl HprtPlatform {
    pub(crate) fn get(&self) -> &dyn Platform {
        match &self.platform {
            PlatformRef::Global(p) => *p,
            PlatformRef::Owned(p) => p.as_ref(),
        }
    }

    /// A handle the swap/compress/hsdp objects keep: an opened platform stays alive while they
    /// hold it, even past `hprt_platform_close`.
    pub(crate) fn handle(&self) -> hprt_platform::PlatformHandle {
        match &self.platform {
            PlatformRef::Global(p) => (*p).into(),
            PlatformRef::Owned(p) => Arc::clone(p).into(),
        }
    }
}

/// A stream (owned, or a wrapped framework stream).
pub struct HprtStream(pub(crate) Stream);
/// An event.
pub struct HprtEvent(pub(crate) Event);
/// Device memory (allocated by hprt, or a wrapped framework allocation).
pub struct HprtDeviceBuffer(pub(crate) DeviceBuffer);
/// Page-locked host memory.
pub struct HprtPinnedBuffer(pub(crate) PinnedBuffer);
/// A communicator: one rank of a world.
pub struct HprtComm(pub(crate) Communicator);

/// Element types (pass them as `int32_t`; other values are rejected).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HprtDtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    F64 = 3,
    I8 = 4,
    U8 = 5,
    I32 = 6,
    I64 = 7,
}

c_enum!(HprtDtype <=> DType, fn dtype_arg, {
    F32 <=> F32,
    F16 <=> F16,
    Bf16 <=> BF16,
    F64 <=> F64,
    I8 <=> I8,
    U8 <=> U8,
    I32 <=> I32,
    I64 <=> I64,
});

/// Reduction operators (see `ReduceOp` for their exact semantics; passed as `int32_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HprtReduceOp {
    Sum = 0,
    Avg = 1,
    Max = 2,
    Min = 3,
    Prod = 4,
}

c_enum!(HprtReduceOp <=> ReduceOp, fn op_arg, {
    Sum <=> Sum,
    Avg <=> Avg,
    Max <=> Max,
    Min <=> Min,
    Prod <=> Prod,
});

/// Device and pinned memory accounting of a platform, in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtMemoryStats {
    pub device_current: usize,
    pub device_peak: usize,
    pub device_allocations: usize,
    pub pinned_current: usize,
    pub pinned_peak: usize,
    pub pinned_allocations: usize,
}

/// Longest unique id `hprt_unique_id` produces, in bytes: HCCL's root info (4,108 bytes) is the
/// longest; NCCL's id has 128. A buffer of this size holds the id of every backend.
pub const HPRT_UNIQUE_ID_MAX_BYTES: usize = 4108;

handle_kind!(HprtPlatform, 1, "platform");
handle_kind!(HprtStream, 2, "stream");
handle_kind!(HprtEvent, 3, "event");
handle_kind!(HprtDeviceBuffer, 4, "device buffer");
handle_kind!(HprtPinnedBuffer, 5, "pinned buffer");
handle_kind!(HprtComm, 6, "communicator");

// --- platform --------------------------------------------------------------------------------

/// The process-wide platform chosen by `HP_PLATFORM` (cpu, cuda, npu or auto), made on first use.
/// Never close it.
///
/// # Safety
/// `out` must be valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn hprt_platform_get(out_platform: *mut *const HprtPlatform) -> HprtStatus {
    static GLOBAL: OnceLock<usize> = OnceLock::new();
    guard("hprt_platform_get", || {
        let p = hprt_platform::get_platform()?;
        let id = *GLOBAL.get_or_init(|| {
            HprtPlatform::registry().insert(HprtPlatform {
                platform: PlatformRef::Global(p),
            })
        });
        // SAFETY: the caller's contract.
        unsafe { out(out_platform, "out_platform", id as *const HprtPlatform) }
    })
}

/// A new platform value: `request` is "cpu", "cuda", "npu", "auto", or null for `HP_PLATFORM`.
/// Release it with `hprt_platform_close` after every object made from it.
///
/// # Safety
/// `request` must be null or a NUL-terminated string; `out_platform` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_platform_open(
    request: *const c_char,
    out_platform: *mut *mut HprtPlatform,
) -> HprtStatus {
    guard("hprt_platform_open", || {
        let req = if request.is_null() {
            PlatformRequest::from_env()?
        } else {
            // SAFETY: non-null, NUL-terminated by the caller's contract.
            let s = unsafe { CStr::from_ptr(request) }
                .to_str()
                .map_err(|_| FfiError::invalid("request is not UTF-8"))?;
            PlatformRequest::parse_name(s)?
        };
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_platform, "out_platform", || {
                Ok(HprtPlatform {
                    platform: PlatformRef::Owned(Arc::from(select_platform(req)?.platform)),
                })
            })
        }
    })
}

/// Releases a platform from `hprt_platform_open` (the process-wide one is refused). Afterwards
/// its handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`); objects made from it stay valid
/// handles but can only be released through it, so close it after them.
///
/// # Safety
/// None beyond the ABI's: `platform` is a handle (checked).
#[no_mangle]
pub unsafe extern "C" fn hprt_platform_close(platform: *mut HprtPlatform) -> HprtStatus {
    guard("hprt_platform_close", || {
        let p = arg(platform, "platform")?;
        if matches!(p.platform, PlatformRef::Global(_)) {
            return Err(FfiError::invalid(
                "the process-wide platform (hprt_platform_get) cannot be closed",
            ));
        }
        release(platform, "platform")?;
        Ok(())
    })
}

/// The backend's name: "cpu", "cuda" or "npu" (a static string).
///
/// # Safety
/// `platform` must be live; `out_name` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_platform_backend_name(
    platform: *const HprtPlatform,
    out_name: *mut *const c_char,
) -> HprtStatus {
    guard("hprt_platform_backend_name", || {
        let p = arg(platform, "platform")?.get();
        let name = static_c_str(p.backend().name());
        // SAFETY: the caller's contract.
        unsafe { out(out_name, "out_name", name.as_ptr()) }
    })
}

/// The body of the `*_destroy` / `*_free` of an object `platform` made: the platform's own
/// destroy (`undo`), then the handle's release (so a failed destroy leaves the handle valid).
fn destroy_on<H: Handle>(
    platform: *const HprtPlatform,
    obj: *const H,
    what: &str,
    undo: impl FnOnce(&dyn Platform, &H::Stored) -> hprt_platform::Result<()>,
) -> FfiResult {
    let p = arg(platform, "platform")?.get();
    undo(p, arg(obj, what)?)?;
    release(obj, what)
}

/// A static name (an enum's canonical name, say) as a C string that lives as long as the
/// process (made once per distinct name).
fn static_c_str(name: &'static str) -> &'static CStr {
    static NAMES: Mutex<Vec<(&'static str, &'static CStr)>> = Mutex::new(Vec::new());
    let mut names = hprt_platform::sync::lock(&NAMES);
    if let Some((_, c)) = names.iter().find(|(n, _)| *n == name) {
        return c;
    }
    let c: &'static CStr = Box::leak(
        CString::new(name)
            .expect("enum names hold no NUL")
            .into_boxed_c_str(),
    );
    names.push((name, c));
    c
}

/// What a platform can do (`hprt_platform_capabilities`); each field as `Capabilities` in
/// hprt-platform documents it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HprtCapabilities {
    /// Device memory is plain host memory (a device address is a host address).
    pub device_memory_is_host: bool,
    /// The framework device type whose tensors live in this platform's device memory ("cpu",
    /// "cuda", "npu"; a static string), or null where none does (the emulators).
    pub framework_device: *const c_char,
    /// Raw stream 0 wraps the host's own stream (work runs in the calling thread).
    pub host_stream: bool,
    /// Device kernels are compiled from source at run time (the device codec runs on the
    /// device).
    pub kernel_compiler: bool,
    /// All ranks of a world are threads of one process.
    pub ranks_are_threads: bool,
    /// Several ranks of a world may use one device.
    pub ranks_share_device: bool,
    /// The devices are hprt's own, any number can be made in-process.
    pub configurable_devices: bool,
    /// A raw stream handle given to `hprt_stream_wrap` is checked against the backend's own
    /// streams (the cpu backend); elsewhere it is taken on the caller's word.
    pub checked_stream_handles: bool,
}

/// What `platform` can do: what a framework integration branches on instead of the backend's
/// name.
///
/// # Safety
/// `platform` must be live; `out_capabilities` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_platform_capabilities(
    platform: *const HprtPlatform,
    out_capabilities: *mut HprtCapabilities,
) -> HprtStatus {
    guard("hprt_platform_capabilities", || {
        let c = arg(platform, "platform")?.get().capabilities();
        let caps = HprtCapabilities {
            device_memory_is_host: c.device_memory_is_host,
            framework_device: c
                .framework_device
                .map_or(std::ptr::null(), |d| static_c_str(d).as_ptr()),
            host_stream: c.host_stream,
            kernel_compiler: c.kernel_compiler,
            ranks_are_threads: c.ranks_are_threads,
            ranks_share_device: c.ranks_share_device,
            configurable_devices: c.configurable_devices,
            checked_stream_handles: c.checked_stream_handles,
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_capabilities, "out_capabilities", caps) }
    })
}

/// Makes device `ordinal` the calling thread's current device (one rank per GPU: call it on each
/// rank's thread before making streams, buffers or communicators there).
///
/// # Safety
/// `platform` must be live.
#[no_mangle]
pub unsafe extern "C" fn hprt_set_device(
    platform: *const HprtPlatform,
    ordinal: usize,
) -> HprtStatus {
    guard("hprt_set_device", || {
        arg(platform, "platform")?.get().set_device(ordinal)?;
        Ok(())
    })
}

/// How many devices the platform has.
///
/// # Safety
/// `platform` live; `out_count` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_device_count(
    platform: *const HprtPlatform,
    out_count: *mut usize,
) -> HprtStatus {
    guard("hprt_device_count", || {
        let n = arg(platform, "platform")?.get().device_count();
        // SAFETY: the caller's contract.
        unsafe { out(out_count, "out_count", n) }
    })
}

/// Blocks until every stream of the platform finished its queued work.
///
/// # Safety
/// `platform` must be live.
#[no_mangle]
pub unsafe extern "C" fn hprt_platform_synchronize(platform: *const HprtPlatform) -> HprtStatus {
    guard("hprt_platform_synchronize", || {
        arg(platform, "platform")?.get().synchronize_device()?;
        Ok(())
    })
}

/// Current and peak device and pinned bytes.
///
/// # Safety
/// `platform` must be live; `out_stats` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_platform_memory_stats(
    platform: *const HprtPlatform,
    out_stats: *mut HprtMemoryStats,
) -> HprtStatus {
    guard("hprt_platform_memory_stats", || {
        let s = arg(platform, "platform")?.get().memory_stats();
        let c = c_stats!(HprtMemoryStats {
            device_current,
            device_peak,
            device_allocations,
            pinned_current,
            pinned_peak,
            pinned_allocations,
        } from s.fields());
        // SAFETY: the caller's contract.
        unsafe { out(out_stats, "out_stats", c) }
    })
}

// --- streams and events ----------------------------------------------------------------------

/// # Safety
/// `platform` live; `out_stream` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_stream_create(
    platform: *const HprtPlatform,
    out_stream: *mut *mut HprtStream,
) -> HprtStatus {
    guard("hprt_stream_create", || {
        let p = arg(platform, "platform")?.get();
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_stream, "out_stream", || {
                Ok(HprtStream(p.create_stream()?))
            })
        }
    })
}

/// Wraps a framework's stream (`CUstream`, `aclrtStream`, or a cpu stream's raw id) without
/// owning it; `hprt_stream_destroy` then only releases hprt's handle.
///
/// # Safety
/// `raw` must be a live stream of this platform's backend for as long as the handle is used.
#[no_mangle]
pub unsafe extern "C" fn hprt_stream_wrap(
    platform: *const HprtPlatform,
    raw: usize,
    out_stream: *mut *mut HprtStream,
) -> HprtStatus {
    guard("hprt_stream_wrap", || {
        let p = arg(platform, "platform")?.get();
        // SAFETY: the caller's contract (`out_stream` writable, a live raw stream).
        unsafe {
            publish(out_stream, "out_stream", || {
                Ok(HprtStream(p.wrap_external_stream(RawStream(raw))?))
            })
        }
    })
}

/// The driver's stream handle (what `hprt_stream_wrap` takes).
///
/// # Safety
/// `stream` live; `out_raw` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_stream_raw(
    stream: *const HprtStream,
    out_raw: *mut usize,
) -> HprtStatus {
    guard("hprt_stream_raw", || {
        let s = arg(stream, "stream")?;
        // SAFETY: the caller's contract.
        unsafe { out(out_raw, "out_raw", s.0.raw().0) }
    })
}

/// Destroys the stream (after its queued work) and releases the handle.
///
/// # Safety
/// `stream` from `hprt_stream_create`/`_wrap` of `platform`; afterwards the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_stream_destroy(
    platform: *const HprtPlatform,
    stream: *mut HprtStream,
) -> HprtStatus {
    guard("hprt_stream_destroy", || {
        destroy_on(platform, stream, "stream", |p, s| p.destroy_stream(&s.0))
    })
}

/// Blocks until the stream's queued work finished; returns its first asynchronous error.
///
/// # Safety
/// Both live.
#[no_mangle]
pub unsafe extern "C" fn hprt_stream_synchronize(
    platform: *const HprtPlatform,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_stream_synchronize", || {
        let (p, s) = (arg(platform, "platform")?, arg(stream, "stream")?);
        p.get().synchronize_stream(&s.0)?;
        Ok(())
    })
}

/// # Safety
/// `platform` live; `out_event` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_event_create(
    platform: *const HprtPlatform,
    timing: bool,
    out_event: *mut *mut HprtEvent,
) -> HprtStatus {
    guard("hprt_event_create", || {
        let p = arg(platform, "platform")?.get();
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_event, "out_event", || {
                Ok(HprtEvent(p.create_event(timing)?))
            })
        }
    })
}

/// # Safety
/// `event` from `hprt_event_create` of `platform`; afterwards the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_event_destroy(
    platform: *const HprtPlatform,
    event: *mut HprtEvent,
) -> HprtStatus {
    guard("hprt_event_destroy", || {
        destroy_on(platform, event, "event", |p, e| p.destroy_event(&e.0))
    })
}

/// Records `event` at the current end of `stream`.
///
/// # Safety
/// All live.
#[no_mangle]
pub unsafe extern "C" fn hprt_event_record(
    platform: *const HprtPlatform,
    event: *const HprtEvent,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_event_record", || {
        let (p, e, s) = (
            arg(platform, "platform")?,
            arg(event, "event")?,
            arg(stream, "stream")?,
        );
        p.get().record_event(&e.0, &s.0)?;
        Ok(())
    })
}

/// Makes `stream` wait (on the device, without blocking the host) for `event`.
///
/// # Safety
/// All live.
#[no_mangle]
pub unsafe extern "C" fn hprt_stream_wait_event(
    platform: *const HprtPlatform,
    stream: *const HprtStream,
    event: *const HprtEvent,
) -> HprtStatus {
    guard("hprt_stream_wait_event", || {
        let (p, e, s) = (
            arg(platform, "platform")?,
            arg(event, "event")?,
            arg(stream, "stream")?,
        );
        p.get().stream_wait_event(&s.0, &e.0)?;
        Ok(())
    })
}

/// Blocks the host until `event` completed.
///
/// # Safety
/// Both live.
#[no_mangle]
pub unsafe extern "C" fn hprt_event_synchronize(
    platform: *const HprtPlatform,
    event: *const HprtEvent,
) -> HprtStatus {
    guard("hprt_event_synchronize", || {
        let (p, e) = (arg(platform, "platform")?, arg(event, "event")?);
        p.get().synchronize_event(&e.0)?;
        Ok(())
    })
}

/// Milliseconds between two completed timing events.
///
/// # Safety
/// All live; `out_ms` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_event_elapsed_ms(
    platform: *const HprtPlatform,
    start: *const HprtEvent,
    end: *const HprtEvent,
    out_ms: *mut f32,
) -> HprtStatus {
    guard("hprt_event_elapsed_ms", || {
        let (p, a, b) = (
            arg(platform, "platform")?,
            arg(start, "start")?,
            arg(end, "end")?,
        );
        let ms = p.get().event_elapsed_ms(&a.0, &b.0)?;
        // SAFETY: the caller's contract.
        unsafe { out(out_ms, "out_ms", ms) }
    })
}

// --- memory ----------------------------------------------------------------------------------

/// # Safety
/// `platform` live; `out_buffer` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_device_alloc(
    platform: *const HprtPlatform,
    bytes: usize,
    out_buffer: *mut *mut HprtDeviceBuffer,
) -> HprtStatus {
    guard("hprt_device_alloc", || {
        let p = arg(platform, "platform")?.get();
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_buffer, "out_buffer", || {
                Ok(HprtDeviceBuffer(p.alloc_device(bytes)?))
            })
        }
    })
}

/// A framework's device allocation used in place. `release(user)` runs once after the last
/// use hprt queued on it finished (pass null to manage its lifetime yourself).
///
/// # Safety
/// `ptr..ptr+bytes` must be device memory of this backend, valid until `release` runs (or, with
/// no `release`, until the handle is freed and its queued work finished).
#[no_mangle]
pub unsafe extern "C" fn hprt_device_wrap(
    platform: *const HprtPlatform,
    ptr: usize,
    bytes: usize,
    release: Option<unsafe extern "C" fn(user: *mut c_void)>,
    user: *mut c_void,
    out_buffer: *mut *mut HprtDeviceBuffer,
) -> HprtStatus {
    struct User(*mut c_void);
    // SAFETY: the C caller hands `user` to hprt for the one release call, on any thread.
    unsafe impl Send for User {}
    guard("hprt_device_wrap", || {
        let p = arg(platform, "platform")?.get();
        let user = User(user);
        let release: Option<hprt_platform::ReleaseFn> = release.map(|f| {
            Box::new(move || {
                let u = user;
                // SAFETY: the caller's contract: `f` accepts its `user` once.
                unsafe { f(u.0) }
            }) as hprt_platform::ReleaseFn
        });
        // SAFETY: the caller's contract (`out_buffer` writable; the memory as documented). A
        // null `out_buffer` is refused before the memory is wrapped, so `release` is not called.
        unsafe {
            publish(out_buffer, "out_buffer", || {
                Ok(HprtDeviceBuffer(p.wrap_device_memory(ptr, bytes, release)?))
            })
        }
    })
}

/// Frees (or, for wrapped memory, releases) the buffer after its queued work and releases the
/// handle.
///
/// # Safety
/// `buffer` from `hprt_device_alloc`/`_wrap` of `platform`; afterwards the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_device_free(
    platform: *const HprtPlatform,
    buffer: *mut HprtDeviceBuffer,
) -> HprtStatus {
    guard("hprt_device_free", || {
        destroy_on(platform, buffer, "buffer", |p, b| p.free_device(&b.0))
    })
}

/// The buffer's device address and size.
///
/// # Safety
/// `buffer` live; out-pointers valid for writing (either may be null).
#[no_mangle]
pub unsafe extern "C" fn hprt_device_info(
    buffer: *const HprtDeviceBuffer,
    out_ptr: *mut usize,
    out_bytes: *mut usize,
) -> HprtStatus {
    guard("hprt_device_info", || {
        let b = arg(buffer, "buffer")?;
        if !out_ptr.is_null() {
            // SAFETY: non-null, valid by contract.
            unsafe { out_ptr.write(b.0.device_ptr()) };
        }
        if !out_bytes.is_null() {
            // SAFETY: as above.
            unsafe { out_bytes.write(b.0.len()) };
        }
        Ok(())
    })
}

/// # Safety
/// `platform` live; `out_buffer` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_pinned_alloc(
    platform: *const HprtPlatform,
    bytes: usize,
    out_buffer: *mut *mut HprtPinnedBuffer,
) -> HprtStatus {
    guard("hprt_pinned_alloc", || {
        let p = arg(platform, "platform")?.get();
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_buffer, "out_buffer", || {
                Ok(HprtPinnedBuffer(p.alloc_pinned(bytes)?))
            })
        }
    })
}

/// # Safety
/// `buffer` from `hprt_pinned_alloc` of `platform`; afterwards the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_pinned_free(
    platform: *const HprtPlatform,
    buffer: *mut HprtPinnedBuffer,
) -> HprtStatus {
    guard("hprt_pinned_free", || {
        destroy_on(platform, buffer, "buffer", |p, b| p.free_pinned(&b.0))
    })
}

/// The pinned buffer's host address and size. The host may read or write it only after the
/// copies queued on it finished (`hprt_pinned_wait`, or a synchronize that covers them).
///
/// # Safety
/// `buffer` live; out-pointers valid for writing (either may be null).
#[no_mangle]
pub unsafe extern "C" fn hprt_pinned_info(
    buffer: *const HprtPinnedBuffer,
    out_ptr: *mut *mut c_void,
    out_bytes: *mut usize,
) -> HprtStatus {
    guard("hprt_pinned_info", || {
        let b = arg(buffer, "buffer")?;
        if !out_ptr.is_null() {
            // SAFETY: non-null, valid by contract.
            unsafe { out_ptr.write(b.0.as_ptr().cast()) };
        }
        if !out_bytes.is_null() {
            // SAFETY: as above.
            unsafe { out_bytes.write(b.0.len()) };
        }
        Ok(())
    })
}

/// Waits until the copies queued on the pinned buffer so far finished, so the host may access
/// it through the address of `hprt_pinned_info`; the status of a copy that failed, if one did.
/// Refused (`HPRT_STATUS_ERROR_UNSUPPORTED`) inside a host function, which its stream orders.
///
/// # Safety
/// `buffer` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pinned_wait(buffer: *const HprtPinnedBuffer) -> HprtStatus {
    guard("hprt_pinned_wait", || {
        arg(buffer, "buffer")?.0.wait_queued()?;
        Ok(())
    })
}
