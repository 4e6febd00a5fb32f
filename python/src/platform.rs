//! `hprt.Platform` and its handles: streams, events, device and pinned buffers (their methods;
//! their data is in [`crate::handles`]).
//!
//! Every call that can block on queued device work (synchronizations, destroys, collectives,
//! rendezvous) releases the GIL, so other Python threads — other ranks, framework threads, and
//! DLPack deleters that take the GIL — keep running.

use std::sync::Arc;
use std::time::Duration;

use hprt_platform::{
    BackendKind, CapabilityValue, CpuBackend, CpuConfig, DType, DeviceBuffer, ErrorKind, Memory,
    PinnedBuffer, PlatformRequest,
};
use hprt_swap::PlatformHandle;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::dlpack::{unexported, Backing, TensorView};
use crate::error::{invalid, py_bytes, Result};
use crate::handles::{
    PyCommunicator, PyDeviceBuffer, PyDeviceTensor, PyEvent, PyPinnedBuffer, PyPlatform, PyStream,
};
use crate::wait::interruptible;

/// The process-wide platform chosen by `HP_PLATFORM` (`cpu`, `cuda`, `npu`; unset = detect).
#[pyfunction]
pub fn get_platform() -> Result<PyPlatform> {
    Ok(PyPlatform {
        p: PlatformHandle::Static(hprt_platform::get_platform()?),
    })
}

/// Why `get_platform()` chose the backend it chose.
#[pyfunction]
pub fn platform_selection_reason() -> Result<String> {
    Ok(hprt_platform::platform_selection_reason()?.to_owned())
}

/// A new platform value of the named backend (not the process-wide one).
#[pyfunction]
pub fn open_platform(name: &str) -> Result<PyPlatform> {
    let request = PlatformRequest::parse_name(name)?;
    let selection = hprt_platform::select_platform(request)?;
    Ok(PyPlatform {
        p: PlatformHandle::Shared(Arc::from(selection.platform)),
    })
}

/// `n` zero bytes to read into; a size the host cannot provide is an out-of-memory error, not an
/// abort (sizes are checked against the buffer before this).
fn zeroed(backend: BackendKind, n: usize) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        hprt_platform::Error::new(
            ErrorKind::OutOfMemory,
            backend,
            "read",
            format!("cannot allocate {n} host bytes to read into"),
        )
    })?;
    v.resize(n, 0);
    Ok(v)
}

/// A private cpu platform with its own capacity, devices, pinned limit and jitter seed.
///
/// `from_env` starts from the `HP_CPU_*` variables (`HP_CPU_JITTER`, ...) instead of the
/// defaults; the arguments given override them.
#[pyfunction]
#[pyo3(signature = (device_memory=None, devices=1, pinned_memory=None, jitter=None, collective_timeout_s=None, from_env=false))]
pub fn cpu_platform(
    device_memory: Option<usize>,
    devices: usize,
    pinned_memory: Option<usize>,
    jitter: Option<u64>,
    collective_timeout_s: Option<f64>,
    from_env: bool,
) -> Result<PyPlatform> {
    let mut cfg = if from_env {
        CpuConfig::from_env()?
    } else {
        CpuConfig::default()
    };
    if let Some(bytes) = device_memory {
        cfg.device_memory = bytes;
    }
    cfg.devices = devices;
    if pinned_memory.is_some() || !from_env {
        cfg.pinned_memory = pinned_memory;
    }
    if jitter.is_some() || !from_env {
        cfg.jitter = jitter;
    }
    if let Some(s) = collective_timeout_s {
        cfg.collective_timeout = Duration::try_from_secs_f64(s)
            .map_err(|_| invalid(format!("collective_timeout_s={s} is not a duration")))?;
    }
    Ok(PyPlatform {
        p: PlatformHandle::Shared(Arc::new(CpuBackend::try_new(cfg)?)),
    })
}

/// One end of a copy, from either buffer class.
fn copy_end(obj: &Bound<'_, PyAny>) -> Result<Memory<DeviceBuffer, PinnedBuffer>> {
    if let Ok(d) = obj.cast::<PyDeviceBuffer>() {
        return Ok(Memory::Device(d.get().b.clone()));
    }
    if let Ok(p) = obj.cast::<PyPinnedBuffer>() {
        return Ok(Memory::Pinned(p.get().b.clone()));
    }
    Err(invalid("expected a DeviceBuffer or a PinnedBuffer"))
}

#[pymethods]
impl PyPlatform {
    /// `"cpu"`, `"cuda"` or `"npu"`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.p.backend().name()
    }

    /// What this platform can do, to branch on instead of `backend` (hprt-platform's
    /// `Capabilities`): a `types.SimpleNamespace` with
    ///
    /// - `device_memory_is_host` — device memory is plain host memory (DLPack `kDLCPU`: torch
    ///   views it as CPU tensors);
    /// - `framework_device` — torch's device type whose tensors live in this platform's device
    ///   memory (`"cpu"`, `"cuda"`, `"npu"`), or `None` (the emulators: torch computes on host
    ///   tensors, staged into the emulator's memory);
    /// - `host_stream` — `wrap_stream(0)` is the host's own stream (work runs in the calling
    ///   thread, a wait blocks it);
    /// - `kernel_compiler` — device kernels are compiled at run time (the device codec runs on
    ///   the device);
    /// - `ranks_are_threads` — all ranks of a world are threads of this process;
    /// - `ranks_share_device` — several ranks may use one device;
    /// - `configurable_devices` — the devices are hprt's own (`cpu_platform(devices=n)`);
    /// - `checked_stream_handles` — `wrap_stream(raw)` checks a raw handle against the
    ///   backend's own streams (the cpu backend); elsewhere only `unsafe_wrap_stream` takes one.
    #[getter]
    fn capabilities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(py);
        for (name, value) in self.p.capabilities().fields() {
            match value {
                CapabilityValue::Flag(b) => kwargs.set_item(name, b)?,
                CapabilityValue::Name(n) => kwargs.set_item(name, n)?,
            }
        }
        py.import("types")?
            .getattr("SimpleNamespace")?
            .call((), Some(&kwargs))
    }

    /// Backend, driver, devices and settings, as a dict.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = self.p.info();
        let d = PyDict::new(py);
        d.set_item("backend", info.backend.name())?;
        d.set_item("driver", info.driver)?;
        d.set_item("devices", info.devices.len())?;
        d.set_item("settings", info.settings)?;
        Ok(d)
    }

    fn device_count(&self) -> usize {
        self.p.device_count()
    }

    fn set_device(&self, ordinal: usize) -> Result<()> {
        Ok(self.p.set_device(ordinal)?)
    }

    fn current_device(&self) -> usize {
        self.p.current_device()
    }

    /// `(free, total)` bytes of the current device.
    fn mem_info(&self) -> Result<(usize, usize)> {
        let m = self.p.mem_info()?;
        Ok((m.free, m.total))
    }

    /// hprt's accounting of device and pinned memory (current, peak, allocations).
    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, value) in self.p.memory_stats().fields() {
            d.set_item(name, value)?;
        }
        Ok(d)
    }

    fn reset_peak_memory(&self) {
        self.p.reset_peak_memory()
    }

    fn create_stream(&self) -> Result<PyStream> {
        Ok(self.stream(self.p.create_stream()?))
    }

    /// Wraps a stream by its raw handle without taking ownership, where the handle can be
    /// checked: raw 0 (CUDA's default stream; on the cpu backend the host's own stream: work
    /// queued on it runs in the calling thread, and a wait on it blocks the caller, as torch's
    /// CPU ops are done when they return; the npu backend refuses a null `aclrtStream`), or any
    /// handle on a backend whose handles are
    /// checked against its own streams (`capabilities.checked_stream_handles`: the cpu
    /// backend). A cuda / npu handle (`torch.cuda.current_stream().cuda_stream`, an
    /// `aclrtStream` as an int) is a pointer nothing can check: `unsafe_wrap_stream` takes it.
    fn wrap_stream(&self, raw: usize) -> Result<PyStream> {
        if raw != 0 && !self.p.capabilities().checked_stream_handles {
            return Err(invalid(format!(
                "wrap_stream({raw:#x}): a raw {} stream handle cannot be checked; \
                 unsafe_wrap_stream(raw) takes it on your word",
                self.p.backend()
            )));
        }
        // SAFETY: raw 0 is a default stream or refused by the backend (npu), and where it is not
        // 0 the backend checks the handle against its own live streams
        // (`checked_stream_handles`).
        let s = unsafe { self.p.wrap_external_stream(hprt_platform::RawStream(raw))? };
        Ok(self.stream(s))
    }

    /// Wraps a framework's stream by its raw handle (`torch.cuda.current_stream().cuda_stream`,
    /// an `aclrtStream` as an int) without taking ownership.
    ///
    /// **Unsafe** (hence the name): a driver's stream handle is a pointer nothing can check, so
    /// the caller promises that `raw` is a live stream of this backend for as long as the
    /// wrapper is used; a wrong one is undefined behaviour (a crash) at the first use.
    /// `wrap_stream` is the checked form.
    fn unsafe_wrap_stream(&self, raw: usize) -> Result<PyStream> {
        // SAFETY: the documented contract of this method, whose name says it is unchecked.
        let s = unsafe { self.p.wrap_external_stream(hprt_platform::RawStream(raw))? };
        Ok(self.stream(s))
    }

    /// Blocks until every stream of the platform is idle.
    fn synchronize(&self, py: Python<'_>) -> Result<()> {
        Ok(interruptible(py, &self.p, |p| p.synchronize_device())??)
    }

    #[pyo3(signature = (timing=false))]
    fn create_event(&self, timing: bool) -> Result<PyEvent> {
        Ok(PyEvent {
            p: self.p.clone(),
            e: self.p.create_event(timing)?,
        })
    }

    fn alloc_device(&self, nbytes: usize) -> Result<PyDeviceBuffer> {
        Ok(self.device_buffer(self.p.alloc_device(nbytes)?))
    }

    /// cpu backend: device memory for a tensor of `layout` (`(shape, strides, storage offset,
    /// dtype, itemsize)`, in elements) as a DLPack capsule, or None when the platform has no
    /// room. The capsule holds the layout where `dtype` (hprt's name) has the itemsize and the
    /// storage offset is 0, else the span from the storage's start as one row (of `dtype`, or of
    /// `u8` where the itemsize differs) for the importer to restride.
    fn alloc_dlpack(
        &self,
        py: Python<'_>,
        layout: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> Result<Option<Py<PyAny>>> {
        let made = crate::dlpack::HostLayout::parse(layout)?.alloc_capsule(
            py,
            &self.p,
            dtype.parse::<DType>()?,
        )?;
        Ok(made.map(|(capsule, _)| capsule))
    }

    /// Borrows `nbytes` of device memory at `ptr` (a framework tensor's `data_ptr()`); `owner`
    /// (e.g. the tensor) is kept alive until hprt no longer references the memory.
    ///
    /// **Unsafe** (hence the name): nothing can check a raw pointer, so the caller promises
    /// that `ptr..ptr + nbytes` is device memory of this backend, valid while `owner` lives; a
    /// wrong pointer is undefined behaviour (a crash, or silent corruption) at the first copy.
    /// `from_dlpack(tensor)` is the safe way to borrow a host tensor.
    #[pyo3(signature = (ptr, nbytes, owner=None))]
    fn unsafe_wrap_device_memory(
        &self,
        ptr: usize,
        nbytes: usize,
        owner: Option<Py<PyAny>>,
    ) -> Result<PyDeviceBuffer> {
        if ptr == 0 && nbytes > 0 {
            return Err(invalid("cannot wrap a null pointer"));
        }
        let release: Option<hprt_platform::ReleaseFn> =
            owner.map(|o| Box::new(move || drop(o)) as hprt_platform::ReleaseFn);
        // SAFETY: the documented contract of this method, whose name says it is unchecked: the
        // caller vouches for the range, and `owner` (which keeps it valid) lives until the
        // release callback runs.
        let b = unsafe { self.p.wrap_device_memory(ptr, nbytes, release)? };
        Ok(self.device_buffer(b))
    }

    /// Wraps a DLPack producer's memory (a numpy array, a torch tensor) as a `DeviceTensor`
    /// without copying. The producer's memory must be addressable by this backend's devices
    /// (host memory on the cpu backend).
    #[pyo3(signature = (obj, is_parameter=false))]
    #[allow(clippy::wrong_self_convention)] // the Python Array API's name for this operation
    fn from_dlpack(&self, obj: &Bound<'_, PyAny>, is_parameter: bool) -> Result<PyDeviceTensor> {
        crate::dlpack::import(self, obj, is_parameter)
    }

    fn alloc_pinned(&self, nbytes: usize) -> Result<PyPinnedBuffer> {
        Ok(PyPinnedBuffer {
            p: self.p.clone(),
            b: self.p.alloc_pinned(nbytes)?,
        })
    }

    /// Queues a copy of `nbytes` (default: all of `src` past `src_offset`) on `stream`; the
    /// direction follows from the buffer kinds.
    #[pyo3(signature = (dst, src, stream, nbytes=None, dst_offset=0, src_offset=0))]
    fn copy(
        &self,
        dst: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
        stream: &PyStream,
        nbytes: Option<usize>,
        dst_offset: usize,
        src_offset: usize,
    ) -> Result<()> {
        let (d, s) = (copy_end(dst)?, copy_end(src)?);
        let (d, s) = (d.as_ref(), s.as_ref());
        let n = nbytes.unwrap_or_else(|| s.len().saturating_sub(src_offset));
        Ok(self
            .p
            .copy_async(d, dst_offset, s, src_offset, n, &stream.s)?)
    }

    #[pyo3(signature = (dst, value, nbytes, stream, offset=0))]
    fn memset(
        &self,
        dst: &PyDeviceBuffer,
        value: u8,
        nbytes: usize,
        stream: &PyStream,
        offset: usize,
    ) -> Result<()> {
        Ok(self
            .p
            .memset_async(&dst.b, offset, value, nbytes, &stream.s)?)
    }

    /// Copies `data` into device memory at `offset` and waits for it.
    #[pyo3(signature = (dst, data, stream, offset=0))]
    fn write(
        &self,
        py: Python<'_>,
        dst: &PyDeviceBuffer,
        data: &Bound<'_, PyBytes>,
        stream: &PyStream,
        offset: usize,
    ) -> Result<()> {
        let bytes = data.as_bytes().to_vec();
        let (b, s) = (dst.b.clone(), stream.s.clone());
        Ok(interruptible(py, &self.p, move |p| {
            p.write_device_sync(&b, offset, &bytes, &s)
        })??)
    }

    /// `nbytes` of device memory at `offset`, after the work queued on `stream` so far.
    #[pyo3(signature = (src, nbytes, stream, offset=0))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        src: &PyDeviceBuffer,
        nbytes: usize,
        stream: &PyStream,
        offset: usize,
    ) -> Result<Bound<'py, PyBytes>> {
        src.b.check_range("read", offset, nbytes)?;
        let mut out = zeroed(self.p.backend(), nbytes)?;
        let (b, s) = (src.b.clone(), stream.s.clone());
        let out = interruptible(py, &self.p, move |p| {
            p.read_device_sync(&b, offset, &mut out, &s).map(|()| out)
        })??;
        py_bytes(py, &out, "the bytes read")
    }

    /// A new rendezvous key (rank 0 makes it, hands it to the other ranks).
    fn unique_id<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.p.unique_id()?.0))
    }

    /// Joins a communicator of `world` ranks; blocks (without the GIL) until all joined.
    fn comm_init(
        &self,
        py: Python<'_>,
        unique_id: &Bound<'_, PyBytes>,
        rank: usize,
        world: usize,
    ) -> Result<PyCommunicator> {
        let id = hprt_platform::UniqueId(unique_id.as_bytes().to_vec());
        let c = interruptible(py, &self.p, move |p| p.comm_init(&id, rank, world))??;
        Ok(PyCommunicator {
            p: self.p.clone(),
            c,
        })
    }

    fn __repr__(&self) -> String {
        format!("Platform(backend={:?})", self.p.backend().name())
    }
}

#[pymethods]
impl PyStream {
    /// The driver handle (`CUstream`, `aclrtStream`, or the cpu stream number) as an int.
    #[getter]
    fn raw(&self) -> usize {
        self.s.raw().0
    }
    #[getter]
    fn is_external(&self) -> bool {
        self.s.is_external()
    }
    fn synchronize(&self, py: Python<'_>) -> Result<()> {
        // Done already (the cpu host stream always is): no waiting thread to start.
        if self.p.query_stream(&self.s)? {
            return Ok(self.p.synchronize_stream(&self.s)?);
        }
        let s = self.s.clone();
        Ok(interruptible(py, &self.p, move |p| {
            p.synchronize_stream(&s)
        })??)
    }
    /// Whether all work queued so far completed.
    fn query(&self) -> Result<bool> {
        Ok(self.p.query_stream(&self.s)?)
    }
    /// Records `event` (a new one if none) at the work queued so far and returns it.
    #[pyo3(signature = (event=None))]
    fn record_event(&self, event: Option<&PyEvent>) -> Result<PyEvent> {
        let e = match event {
            Some(e) => e.e.clone(),
            None => self.p.create_event(false)?,
        };
        self.p.record_event(&e, &self.s)?;
        Ok(PyEvent {
            p: self.p.clone(),
            e,
        })
    }
    /// Work queued from now on waits for `event` (on the cpu backend's host stream, raw 0,
    /// the caller waits: off the GIL).
    fn wait_event(&self, py: Python<'_>, event: &PyEvent) -> Result<()> {
        Ok(py.detach(|| self.p.stream_wait_event(&self.s, &event.e))?)
    }
    /// Work queued from now on waits for the work queued on `other` so far.
    fn wait_stream(&self, py: Python<'_>, other: &PyStream) -> Result<()> {
        let mark = self.p.create_event(false)?;
        self.p.record_event(&mark, &other.s)?;
        Ok(py.detach(|| self.p.stream_wait_event(&self.s, &mark))?)
    }
    fn destroy(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| self.p.destroy_stream(&self.s))?)
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.s)
    }
}

#[pymethods]
impl PyEvent {
    fn record(&self, stream: &PyStream) -> Result<()> {
        Ok(self.p.record_event(&self.e, &stream.s)?)
    }
    fn synchronize(&self, py: Python<'_>) -> Result<()> {
        if self.p.query_event(&self.e)? {
            return Ok(self.p.synchronize_event(&self.e)?);
        }
        let e = self.e.clone();
        Ok(interruptible(py, &self.p, move |p| {
            p.synchronize_event(&e)
        })??)
    }
    fn query(&self) -> Result<bool> {
        Ok(self.p.query_event(&self.e)?)
    }
    /// Milliseconds from this event to `end` (both created with `timing=True`, both complete).
    fn elapsed_ms(&self, end: &PyEvent) -> Result<f32> {
        Ok(self.p.event_elapsed_ms(&self.e, &end.e)?)
    }
    fn destroy(&self) -> Result<()> {
        Ok(self.p.destroy_event(&self.e)?)
    }
}

#[pymethods]
impl PyDeviceBuffer {
    #[getter]
    fn nbytes(&self) -> usize {
        self.b.len()
    }
    /// The device pointer (0 while released).
    #[getter]
    fn ptr(&self) -> usize {
        self.b.device_ptr()
    }
    #[getter]
    fn is_borrowed(&self) -> bool {
        self.b.is_borrowed()
    }
    #[getter]
    fn is_freed(&self) -> bool {
        self.b.is_freed()
    }
    /// Resizes the storage keeping the handle: 0 releases the bytes, a size re-acquires them.
    /// Refused (`BufferExportedError`) while a DLPack export of the memory is alive.
    fn resize(&self, py: Python<'_>, nbytes: usize) -> Result<()> {
        if nbytes == self.b.len() {
            return Ok(self.p.resize_device(&self.b, nbytes)?);
        }
        let bufs = [Backing::Device(self.b.clone())];
        py.detach(|| {
            unexported(&bufs, "resize", || {
                Ok(self.p.resize_device(&self.b, nbytes)?)
            })
        })
    }
    /// Frees the memory; refused (`BufferExportedError`) while a DLPack export of it is alive.
    fn free(&self, py: Python<'_>) -> Result<()> {
        let bufs = [Backing::Device(self.b.clone())];
        py.detach(|| unexported(&bufs, "free", || Ok(self.p.free_device(&self.b)?)))
    }
    /// A typed view for DLPack export (`numpy.from_dlpack(buf.view("f32", [n]))`); only where
    /// device memory is host-addressable (the cpu backend). Synchronize first: a view reads
    /// whatever the memory holds when the consumer reads it. While an export is alive the
    /// buffer cannot be freed or resized.
    #[pyo3(signature = (dtype, shape, offset=0))]
    fn view(&self, dtype: &str, shape: Vec<usize>, offset: usize) -> Result<TensorView> {
        TensorView::of_device(&self.p, &self.b, dtype.parse::<DType>()?, shape, offset)
    }
    fn same_as(&self, other: &PyDeviceBuffer) -> bool {
        self.b.same_as(&other.b)
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.b)
    }
}

#[pymethods]
impl PyPinnedBuffer {
    #[getter]
    fn nbytes(&self) -> usize {
        self.b.len()
    }
    /// Bytes of the buffer, once the copies queued on it finished.
    #[pyo3(signature = (offset=0, nbytes=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        nbytes: Option<usize>,
    ) -> Result<Bound<'py, PyBytes>> {
        let n = nbytes.unwrap_or_else(|| self.b.len().saturating_sub(offset));
        self.b.check_range("read", offset, n)?;
        let mut out = zeroed(self.p.backend(), n)?;
        py.detach(|| self.b.read(offset, &mut out))?;
        py_bytes(py, &out, "the bytes read")
    }
    /// Writes `data` at `offset`, once the copies queued on the buffer finished.
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyBytes>, offset: usize) -> Result<()> {
        let data = data.as_bytes();
        Ok(py.detach(|| self.b.write(offset, data))?)
    }
    /// Frees the memory; refused (`BufferExportedError`) while a DLPack export of it is alive.
    fn free(&self, py: Python<'_>) -> Result<()> {
        let bufs = [Backing::Pinned(self.b.clone())];
        py.detach(|| unexported(&bufs, "free", || Ok(self.p.free_pinned(&self.b)?)))
    }
    /// A typed view for DLPack export (pinned memory is host memory on every backend).
    #[pyo3(signature = (dtype, shape, offset=0))]
    fn view(&self, dtype: &str, shape: Vec<usize>, offset: usize) -> Result<TensorView> {
        TensorView::of_pinned(&self.p, &self.b, dtype.parse::<DType>()?, shape, offset)
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.b)
    }
}

/// Whether this platform's device memory is plain host memory (so DLPack can name it `kDLCPU`).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPlatform>()?;
    m.add_class::<PyStream>()?;
    m.add_class::<PyEvent>()?;
    m.add_class::<PyDeviceBuffer>()?;
    m.add_class::<PyPinnedBuffer>()?;
    m.add_function(wrap_pyfunction!(get_platform, m)?)?;
    m.add_function(wrap_pyfunction!(platform_selection_reason, m)?)?;
    m.add_function(wrap_pyfunction!(open_platform, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_platform, m)?)?;
    Ok(())
}
