//! The checked layer between cudarc's `sys` (raw driver calls) and the backend, as cudarc's own
//! `result` layer: each driver call the backend makes, once, returning the crate's typed
//! [`Error`] (naming the driver function and its status), over typed handles instead of raw
//! pointers cast to `usize`.
//!
//! Handles are identifiers (`Copy`); the backend's objects own them and destroy them once:
//! [`super::StreamObj`], [`super::EventObj`], buffers (`auxil::uses`), a device's primary
//! context and modules (`context.rs`). Destroying calls are `unsafe` for that reason. Only the
//! baseline measurement (`baseline.rs`) and host-function launch (`host_fn.rs`) call `sys`
//! directly; NCCL's calls go through its checked table (`nccl.rs`, on a typed `nccl::Comm`).

use std::ffi::{c_int, c_void, CStr};

use cudarc::driver::sys as cu;

use super::check::{cu, cu_error};
use crate::error::{Error, ErrorKind, Result};

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident($raw:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name($raw);
        // SAFETY: a driver handle is an identifier the driver accepts from any thread (with
        // its context current where the call needs one).
        unsafe impl Send for $name {}
        // SAFETY: `&self` only copies the identifier out; the driver calls made with it are
        // thread-safe, and the owning object (not this handle) decides when it is destroyed.
        unsafe impl Sync for $name {}
    };
}

handle!(
    /// A context (hprt uses primary contexts only).
    Context(cu::CUcontext)
);
handle!(
    /// A stream: created here, or a framework's, wrapped.
    Stream(cu::CUstream)
);
handle!(
    /// An event.
    Event(cu::CUevent)
);
handle!(
    /// A loaded module.
    Module(cu::CUmodule)
);
handle!(
    /// A kernel of a loaded module.
    Function(cu::CUfunction)
);

impl Context {
    fn sys(self) -> cu::CUcontext {
        self.0
    }
}

impl Stream {
    /// The `sys` handle, for calls this layer does not wrap (NCCL's, host functions').
    pub(crate) fn sys(self) -> cu::CUstream {
        self.0
    }
    /// The stream behind a framework's handle value.
    ///
    /// # Safety
    /// `raw` must be a live stream handle.
    pub(crate) unsafe fn from_raw(raw: usize) -> Self {
        Stream(raw as cu::CUstream)
    }
    /// The handle value frameworks exchange ([`crate::RawStream`]).
    pub(crate) fn addr(self) -> usize {
        self.0 as usize
    }
}

/// `Ok(true)` for success, `Ok(false)` for `CUDA_ERROR_NOT_READY`, else the error.
fn ready(r: cu::CUresult, function: &'static str) -> Result<bool> {
    match r {
        cu::CUresult::CUDA_SUCCESS => Ok(true),
        cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => cu(other, function).map(|()| true),
    }
}

pub(crate) mod ctx {
    use super::*;

    pub(crate) fn primary_retain(device: cu::CUdevice) -> Result<Context> {
        let mut c = std::ptr::null_mut();
        cu(
            // SAFETY: the out-pointer is a live local `CUcontext`; the driver checks `device`
            // itself (an unknown ordinal is an error status).
            unsafe { cu::cuDevicePrimaryCtxRetain(&mut c, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Context(c))
    }

    /// # Safety
    /// Once per successful [`primary_retain`], after nothing uses the context any more.
    pub(crate) unsafe fn primary_release(device: cu::CUdevice) {
        // SAFETY: the caller's contract: this balances one successful `primary_retain` of
        // `device`, and nothing uses the context any more.
        unsafe { cu::cuDevicePrimaryCtxRelease_v2(device) };
    }

    /// The thread's current context (`None`: none is).
    pub(crate) fn current() -> Result<Option<Context>> {
        let mut c = std::ptr::null_mut();
        // SAFETY: plain driver call into a local.
        cu(unsafe { cu::cuCtxGetCurrent(&mut c) }, "cuCtxGetCurrent")?;
        Ok((!c.is_null()).then_some(Context(c)))
    }

    pub(crate) fn set_current(c: Option<Context>) -> Result<()> {
        let raw = c.map_or(std::ptr::null_mut(), Context::sys);
        // SAFETY: a live context (or none).
        cu(unsafe { cu::cuCtxSetCurrent(raw) }, "cuCtxSetCurrent")
    }

    /// The device of context `c` (made current for the one query, then the previous one is
    /// put back).
    pub(crate) fn device_of(c: Context) -> Result<cu::CUdevice> {
        let mut dev = 0;
        cu(
            // SAFETY: `c` is a live context (a `Context` comes from `primary_retain` or from
            // the driver's answer for a live stream, and its device's retain outlives its use);
            // it is popped again below, whatever the query returns.
            unsafe { cu::cuCtxPushCurrent_v2(c.0) },
            "cuCtxPushCurrent_v2",
        )?;
        // SAFETY: a context is current (pushed above); the out-pointer is a live local.
        let got = cu(unsafe { cu::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice");
        let mut popped = std::ptr::null_mut();
        cu(
            // SAFETY: pops the context pushed above (the push succeeded, or we returned); the
            // out-pointer is a live local.
            unsafe { cu::cuCtxPopCurrent_v2(&mut popped) },
            "cuCtxPopCurrent_v2",
        )?;
        got.map(|()| dev)
    }

    /// Free and total bytes of the current context's device.
    pub(crate) fn mem_info() -> Result<(usize, usize)> {
        let (mut free, mut total) = (0, 0);
        cu(
            // SAFETY: both out-pointers are live locals; without a current context the driver
            // answers an error status.
            unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo_v2",
        )?;
        Ok((free, total))
    }
}

pub(crate) mod stream {
    use super::*;

    /// A stream of the current context that does not synchronise with the legacy stream.
    pub(crate) fn create(flags: u32) -> Result<Stream> {
        let mut s = std::ptr::null_mut();
        cu(
            // SAFETY: the out-pointer is a live local `CUstream`; the driver checks `flags`.
            unsafe { cu::cuStreamCreate(&mut s, flags) },
            "cuStreamCreate",
        )?;
        Ok(Stream(s))
    }

    /// # Safety
    /// A stream created by [`create`], destroyed once, its context current.
    pub(crate) unsafe fn destroy(s: Stream) -> Result<()> {
        // SAFETY: the caller's contract: `s` is a stream of ours, destroyed this once, with its
        // context current.
        cu(unsafe { cu::cuStreamDestroy_v2(s.0) }, "cuStreamDestroy_v2")
    }

    pub(crate) fn synchronize(s: Stream) -> Result<()> {
        // SAFETY: a live stream.
        cu(
            unsafe { cu::cuStreamSynchronize(s.0) },
            "cuStreamSynchronize",
        )
    }

    /// Whether everything queued on `s` finished.
    pub(crate) fn query(s: Stream) -> Result<bool> {
        // SAFETY: a live stream.
        ready(unsafe { cu::cuStreamQuery(s.0) }, "cuStreamQuery")
    }

    pub(crate) fn wait_event(s: Stream, e: Event) -> Result<()> {
        // SAFETY: a live stream and event.
        cu(
            unsafe { cu::cuStreamWaitEvent(s.0, e.0, 0) },
            "cuStreamWaitEvent",
        )
    }

    pub(crate) fn context(s: Stream) -> Result<Context> {
        let mut c = std::ptr::null_mut();
        // SAFETY: a live stream; plain driver call into a local.
        cu(unsafe { cu::cuStreamGetCtx(s.0, &mut c) }, "cuStreamGetCtx")?;
        Ok(Context(c))
    }
}

pub(crate) mod event {
    use super::*;

    pub(crate) fn create(flags: u32) -> Result<Event> {
        let mut e = std::ptr::null_mut();
        // SAFETY: plain driver call into a local.
        cu(unsafe { cu::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(Event(e))
    }

    /// # Safety
    /// An event created by [`create`], destroyed once.
    pub(crate) unsafe fn destroy(e: Event) {
        // SAFETY: the caller's contract: `e` is an event of ours, destroyed this once.
        unsafe { cu::cuEventDestroy_v2(e.0) };
    }

    pub(crate) fn record(e: Event, s: Stream) -> Result<()> {
        // SAFETY: a live event and stream of one context.
        cu(unsafe { cu::cuEventRecord(e.0, s.0) }, "cuEventRecord")
    }

    /// Whether the work before the event's last record finished.
    pub(crate) fn query(e: Event) -> Result<bool> {
        // SAFETY: a live event.
        ready(unsafe { cu::cuEventQuery(e.0) }, "cuEventQuery")
    }

    pub(crate) fn synchronize(e: Event) -> Result<()> {
        // SAFETY: a live event.
        cu(unsafe { cu::cuEventSynchronize(e.0) }, "cuEventSynchronize")
    }

    pub(crate) fn elapsed_ms(start: Event, end: Event) -> Result<f32> {
        let mut ms = 0f32;
        cu(
            // SAFETY: both events are live (their `EventObj`s own them for the duration of
            // this call); the out-pointer is a live local.
            unsafe { cu::cuEventElapsedTime(&mut ms, start.0, end.0) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }
}

pub(crate) mod mem {
    use super::*;

    /// `bytes` of device memory in the current context.
    pub(crate) fn alloc(bytes: usize) -> Result<u64> {
        let mut p = 0;
        // SAFETY: plain driver call into a local.
        cu(unsafe { cu::cuMemAlloc_v2(&mut p, bytes) }, "cuMemAlloc_v2")?;
        Ok(p)
    }

    /// # Safety
    /// Memory from [`alloc`], freed once, no queued work using it.
    pub(crate) unsafe fn free(p: u64) -> Result<()> {
        // SAFETY: the caller's contract: `p` came from `alloc`, is freed this once, and no
        // queued work uses it.
        cu(unsafe { cu::cuMemFree_v2(p) }, "cuMemFree_v2")
    }

    /// `bytes` of page-locked host memory; a size no host can lock is out of memory.
    pub(crate) fn alloc_host(bytes: usize, flags: u32) -> Result<*mut c_void> {
        let mut p = std::ptr::null_mut();
        // SAFETY: plain driver call into a local.
        let r = unsafe { cu::cuMemHostAlloc(&mut p, bytes, flags) };
        match r {
            cu::CUresult::CUDA_SUCCESS => Ok(p),
            // The only argument is the size: an invalid one is one no host can hold.
            cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY | cu::CUresult::CUDA_ERROR_INVALID_VALUE => {
                let e = cu_error(r as u32, &format!("{r:?}"), "cuMemHostAlloc");
                Err(Error {
                    kind: ErrorKind::OutOfMemory,
                    message: format!("cannot page-lock {bytes} bytes: {}", e.message),
                    ..e
                })
            }
            other => cu(other, "cuMemHostAlloc").map(|()| p),
        }
    }

    /// # Safety
    /// Memory from [`alloc_host`], freed once, no queued work using it.
    pub(crate) unsafe fn free_host(p: *mut c_void) -> Result<()> {
        // SAFETY: the caller's contract: `p` came from `alloc_host`, is freed this once, and no
        // queued work uses it.
        cu(unsafe { cu::cuMemFreeHost(p) }, "cuMemFreeHost")
    }

    /// # Safety
    /// Both ranges are live memory of `bytes` bytes that stays so until the copy ran.
    pub(crate) unsafe fn copy_async(dst: u64, src: u64, bytes: usize, s: Stream) -> Result<()> {
        cu(
            // SAFETY: the caller's contract: both ranges are live for `bytes` until the copy
            // ran on `s`.
            unsafe { cu::cuMemcpyAsync(dst, src, bytes, s.0) },
            "cuMemcpyAsync",
        )
    }

    /// # Safety
    /// `dst..dst + bytes` is live device memory that stays so until the memset ran.
    pub(crate) unsafe fn set_d8_async(dst: u64, value: u8, bytes: usize, s: Stream) -> Result<()> {
        cu(
            // SAFETY: the caller's contract: `dst..dst + bytes` is live device memory until the
            // memset ran on `s`.
            unsafe { cu::cuMemsetD8Async(dst, value, bytes, s.0) },
            "cuMemsetD8Async",
        )
    }
}

pub(crate) mod module {
    use super::*;

    /// Loads a module from a PTX or cubin image in the current context.
    pub(crate) fn load_data(image: &[u8]) -> Result<Module> {
        let mut m = std::ptr::null_mut();
        cu(
            // SAFETY: the image is a NUL-terminated PTX or a cubin the driver only reads, during
            // this call (the slice outlives it); the out-pointer is a live local.
            unsafe { cu::cuModuleLoadData(&mut m, image.as_ptr().cast()) },
            "cuModuleLoadData",
        )?;
        Ok(Module(m))
    }

    /// # Safety
    /// A module from [`load_data`], unloaded once, its context current, no kernel of it queued.
    pub(crate) unsafe fn unload(m: Module) {
        // SAFETY: the caller's contract: `m` is a module of ours, unloaded this once, its
        // context current and no kernel of it queued.
        unsafe { cu::cuModuleUnload(m.0) };
    }

    pub(crate) fn function(m: Module, name: &CStr) -> Result<Function> {
        let mut f = std::ptr::null_mut();
        cu(
            // SAFETY: `m` is live (a device's module table owns it; it is unloaded only when
            // the platform is dropped);
            // `name` is a NUL-terminated string borrowed for the call; the out-pointer is a
            // live local.
            unsafe { cu::cuModuleGetFunction(&mut f, m.0, name.as_ptr()) },
            "cuModuleGetFunction",
        )?;
        Ok(Function(f))
    }

    /// Queues `f` on `s` with `grid` blocks of `block` threads.
    ///
    /// # Safety
    /// `args` point at values matching the kernel's parameters (the driver copies them), and
    /// every pointer among them addresses memory that stays live until the kernel ran.
    pub(crate) unsafe fn launch(
        f: Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        s: Stream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        cu(
            // SAFETY: the caller's contract: `args` match the kernel's parameters and every
            // pointer among them stays live until the kernel ran; `args` itself is read during
            // this call only, and `extra` is null.
            unsafe {
                cu::cuLaunchKernel(
                    f.0,
                    grid.0,
                    grid.1,
                    grid.2,
                    block.0,
                    block.1,
                    block.2,
                    shared_bytes,
                    s.0,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

/// Initialises the driver (idempotent).
pub(crate) fn init() -> Result<()> {
    // SAFETY: plain driver call.
    cu(unsafe { cu::cuInit(0) }, "cuInit")
}

/// The driver's CUDA version (1000 × major + 10 × minor).
pub(crate) fn driver_version() -> Result<c_int> {
    let mut v = 0;
    cu(
        // SAFETY: the out-pointer is a live local `c_int`.
        unsafe { cu::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
    )?;
    Ok(v)
}

pub(crate) mod device {
    use super::*;

    pub(crate) fn count() -> Result<c_int> {
        let mut n = 0;
        // SAFETY: plain driver call into a local.
        cu(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        Ok(n)
    }

    /// The device of ordinal `ordinal`.
    pub(crate) fn get(ordinal: c_int) -> Result<cu::CUdevice> {
        let mut d = 0;
        // SAFETY: plain driver call into a local.
        cu(unsafe { cu::cuDeviceGet(&mut d, ordinal) }, "cuDeviceGet")?;
        Ok(d)
    }

    pub(crate) fn name(d: cu::CUdevice) -> Result<String> {
        let mut name = [0 as std::ffi::c_char; 256];
        cu(
            // SAFETY: the driver writes at most `name.len()` bytes into the local buffer; it
            // checks `d` itself.
            unsafe { cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, d) },
            "cuDeviceGetName",
        )?;
        // SAFETY: the driver NUL-terminates within the buffer.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    pub(crate) fn total_mem(d: cu::CUdevice) -> Result<usize> {
        let mut total = 0;
        cu(
            // SAFETY: the out-pointer is a live local; the driver checks `d` itself.
            unsafe { cu::cuDeviceTotalMem_v2(&mut total, d) },
            "cuDeviceTotalMem_v2",
        )?;
        Ok(total)
    }

    pub(crate) fn attribute(d: cu::CUdevice, a: cu::CUdevice_attribute) -> Result<c_int> {
        let mut v = 0;
        cu(
            // SAFETY: the out-pointer is a live local; the driver checks `a` and `d` itself.
            unsafe { cu::cuDeviceGetAttribute(&mut v, a, d) },
            "cuDeviceGetAttribute",
        )?;
        Ok(v)
    }
}
