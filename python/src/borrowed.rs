//! A framework's own tensors as hprt-swap payloads: borrowed memory, released by dropping
//! hprt's references and re-acquired through an allocator the framework gives (for torch,
//! `torch.empty_strided` with the saved shape and strides), so the front ends of [`crate::swap`]
//! reload straight into framework tensors.
//!
//! On the cpu backend a reload can skip the framework's allocator: [`HostReload`] takes the
//! platform's device memory (its caching allocator reuses the blocks earlier reloads freed) and
//! hands it over through DLPack in the saved layout.
//!
//! [`PyFrameworkMemory`] counts the framework bytes hprt references (saved tensors not yet
//! released, reloads in flight), so a program can compare how much of its saved memory stayed
//! on the device with and without swap.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hprt_platform::{DType, DeviceBuffer, ReleaseFn};
use hprt_swap::{Allocator, DeviceTensor, PlatformHandle, Reacquired, VersionCounter};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack::HostLayout;
use crate::error::{invalid, BindError, Result};
use crate::platform::{device_is_host, unsupported, PyPlatform, PyStream};

#[derive(Default)]
struct Counters {
    current: AtomicUsize,
    peak: AtomicUsize,
}

struct Shared {
    p: PlatformHandle,
    counters: Counters,
    /// `host_reload(capsule, layout)`: the framework tensor of a DLPack capsule of platform
    /// memory (see [`HostReload`]); `capsule` is None when the platform has no room, and the
    /// function then allocates the tensor itself.
    host_reload: Option<Py<PyAny>>,
}

impl Shared {
    /// Borrows `nbytes` at `ptr`, kept alive by `owner` until hprt drops its last reference.
    fn borrow(
        self: &Arc<Self>,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
    ) -> Result<DeviceBuffer> {
        if ptr == 0 && nbytes > 0 {
            return Err(invalid("cannot borrow a null pointer"));
        }
        let me = Arc::clone(self);
        let release: ReleaseFn = Box::new(move || {
            // Without the GIL pyo3 defers the decref to the next holder of the GIL (this may run
            // on a stream thread while the GIL's holder waits on that stream).
            drop(owner);
            me.counters.current.fetch_sub(nbytes, Ordering::AcqRel);
        });
        let now = self.counters.current.fetch_add(nbytes, Ordering::AcqRel) + nbytes;
        self.counters.peak.fetch_max(now, Ordering::AcqRel);
        // SAFETY: the Python API's documented contract: `ptr`/`nbytes` are the memory of a live
        // framework tensor of this backend, and `owner` (that tensor) keeps it alive until the
        // release callback runs.
        Ok(unsafe { self.p.wrap_device_memory(ptr, nbytes, Some(release))? })
    }

    /// A framework tensor as a borrowed swap payload.
    fn tensor(
        self: &Arc<Self>,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        allocator: Arc<dyn Allocator>,
        dtype: DType,
    ) -> Result<DeviceTensor> {
        let (ptr, nbytes) = framework_memory(obj)?;
        if nbytes % dtype.size() != 0 {
            return Err(invalid(format!(
                "{nbytes} bytes are no whole number of {dtype}"
            )));
        }
        let storage = self.borrow(ptr, nbytes, obj.clone().unbind())?;
        let mut t = DeviceTensor::borrowed(
            storage,
            dtype,
            vec![nbytes / dtype.size()],
            Some(Arc::new(obj.clone().unbind())),
            allocator,
        )?;
        t.version = framework_version(py, obj);
        Ok(t)
    }
}

/// `data_ptr()` and `nbytes` of a framework tensor.
fn framework_memory(obj: &Bound<'_, PyAny>) -> Result<(usize, usize)> {
    let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
    let nbytes: usize = obj.getattr("nbytes")?.extract()?;
    Ok((ptr, nbytes))
}

/// The framework's in-place write counter (`tensor._version`), when it has one.
fn framework_version(py: Python<'_>, obj: &Bound<'_, PyAny>) -> VersionCounter {
    if !obj.hasattr("_version").unwrap_or(false) {
        return VersionCounter::new();
    }
    let obj = obj.clone().unbind();
    let _ = py;
    VersionCounter::framework(move || {
        Python::attach(|py| {
            obj.bind(py)
                .getattr("_version")
                .and_then(|v| v.extract::<u64>())
                .unwrap_or(u64::MAX)
        })
    })
}

/// The framework's allocator: `allocate()` returns a new framework tensor of the saved shape,
/// strides, dtype and device, or `(tensor, stream)` when a caching allocator handed the memory
/// out in the order of `stream` (an hprt `Stream`: torch's current stream on an accelerator),
/// which the reload then waits for (see `hprt_swap::Reacquired::ready_on`).
struct PyAllocator {
    shared: Arc<Shared>,
    allocate: Py<PyAny>,
}

impl Allocator for PyAllocator {
    fn allocate(&self, like: &DeviceTensor) -> hprt_swap::Result<Reacquired> {
        let made = Python::attach(|py| -> Result<Reacquired> {
            let mut out = self.allocate.call0(py)?.into_bound(py);
            let mut ready_on = None;
            if let Ok((tensor, stream)) = out.extract::<(Bound<'_, PyAny>, PyRef<'_, PyStream>)>() {
                ready_on = Some(stream.s.clone());
                out = tensor;
            }
            let (ptr, nbytes) = framework_memory(&out)?;
            reacquired(py, &self.shared, out, ptr, nbytes, like, ready_on)
        });
        made.map_err(swap_error)
    }
}

/// What an allocator made (`out`, `nbytes` at `ptr`) as the reacquired memory of `like`.
fn reacquired(
    py: Python<'_>,
    shared: &Arc<Shared>,
    out: Bound<'_, PyAny>,
    ptr: usize,
    nbytes: usize,
    like: &DeviceTensor,
    ready_on: Option<hprt_platform::Stream>,
) -> Result<Reacquired> {
    if nbytes != like.len {
        return Err(invalid(format!(
            "the allocator gave a {nbytes}-byte tensor for {} saved bytes",
            like.len
        )));
    }
    Ok(Reacquired {
        storage: shared.borrow(ptr, nbytes, out.clone().unbind())?,
        offset: 0,
        handle: Some(Arc::new(out.clone().unbind())),
        version: framework_version(py, &out),
        ready_on,
    })
}

/// A failed allocation as the swap engine's error.
fn swap_error(e: BindError) -> hprt_swap::SwapError {
    match e {
        BindError::Swap(s) => s,
        BindError::Platform(p) => hprt_swap::SwapError::Platform(p),
        other => hprt_swap::SwapError::Order(format!("the framework allocator failed: {other}")),
    }
}

/// A reload into the cpu platform's device memory without a call into the framework's
/// allocator: the memory comes from the platform (its caching allocator) and goes to the
/// framework as a DLPack capsule of the saved layout, which `host_reload(capsule, layout)`
/// imports (`torch.from_dlpack`, restrided when the layout has a storage offset or the dtype
/// travels as bytes).
struct HostReload {
    shared: Arc<Shared>,
    /// The FrameworkMemory's `host_reload`.
    host_reload: Py<PyAny>,
    /// What `host_reload` is given back: `(shape, strides, offset, dtype, itemsize)`.
    layout: Py<PyAny>,
    host: HostLayout,
}

impl Allocator for HostReload {
    fn allocate(&self, like: &DeviceTensor) -> hprt_swap::Result<Reacquired> {
        let made = Python::attach(|py| -> Result<Reacquired> {
            let made = self.host.alloc_capsule(py, &self.shared.p, like.dtype)?;
            let (capsule, ptr) = made.unzip();
            let out = self
                .host_reload
                .bind(py)
                .call1((capsule, self.layout.bind(py)))?;
            // The tensor must be the capsule's memory (which it keeps alive): the reload writes
            // there. Without a capsule the framework allocated it.
            let (got, nbytes) = framework_memory(&out)?;
            if ptr.is_some_and(|ptr| ptr != got) {
                return Err(invalid(
                    "host_reload returned a tensor that is not the capsule's memory",
                ));
            }
            reacquired(py, &self.shared, out, got, nbytes, like, None)
        });
        made.map_err(swap_error)
    }
}

/// Framework memory seen by hprt: makes framework tensors into swap payloads
/// (`FrameworkMemory.tensor(t, allocate)`) and counts the bytes hprt references.
///
/// ```python
/// mem = hprt.FrameworkMemory(p)
/// v = mem.tensor(t, lambda: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))
/// ref = manager.save(v)          # any swap front end takes it
/// ...
/// back = manager.get(ref)        # the tensor `allocate` made, holding t's bytes
/// ```
#[pyclass(name = "FrameworkMemory", module = "hprt._native", frozen)]
pub struct PyFrameworkMemory {
    shared: Arc<Shared>,
}

/// A framework tensor wrapped as a borrowed swap payload (what `FrameworkMemory.tensor` made).
#[pyclass(name = "BorrowedTensor", module = "hprt._native", frozen)]
pub struct PyBorrowedTensor {
    pub(crate) t: DeviceTensor,
}

#[pymethods]
impl PyBorrowedTensor {
    #[getter]
    fn nbytes(&self) -> usize {
        self.t.len
    }
    /// The framework tensor.
    #[getter]
    fn tensor(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        handle_object(py, &self.t)
    }
}

/// The framework object of a borrowed tensor.
pub(crate) fn handle_object(py: Python<'_>, t: &DeviceTensor) -> Option<Py<PyAny>> {
    t.handle
        .as_ref()
        .and_then(|h| h.downcast_ref::<Py<PyAny>>())
        .map(|o| o.clone_ref(py))
}

#[pymethods]
impl PyFrameworkMemory {
    /// `host_reload(capsule, layout)` (cpu backend only) lets `tensor(t, layout=...)` reload
    /// into the platform's device memory: it returns the framework tensor of a DLPack capsule
    /// holding the saved layout (or, where `capsule` is None because the platform had no room,
    /// a tensor of that layout it allocated itself).
    #[new]
    #[pyo3(signature = (platform=None, host_reload=None))]
    fn new(platform: Option<&PyPlatform>, host_reload: Option<Py<PyAny>>) -> Result<Self> {
        let p = crate::platform::resolve(platform)?;
        if host_reload.is_some() && !device_is_host(&*p) {
            return Err(unsupported(format!(
                "host_reload: the {} backend's device memory is not host memory",
                p.backend()
            )));
        }
        Ok(PyFrameworkMemory {
            shared: Arc::new(Shared {
                p,
                counters: Counters::default(),
                host_reload,
            }),
        })
    }

    /// `t` (a framework tensor with `data_ptr()` and `nbytes`, dense) as a swap payload;
    /// `allocate()` must return a new tensor of `t`'s shape, strides, dtype and device, or
    /// `(tensor, stream)` where a caching allocator (torch's on a GPU) handed its memory out for
    /// use in `stream`'s order: the reload then writes it after the work queued there.
    /// `dtype` (hprt's name: `f32`, `bf16`, ...) lets compress-then-swap encode it.
    ///
    /// With `host_reload` (see the constructor), `layout` (`(shape, strides, storage offset,
    /// dtype, itemsize)`, in elements; `dtype` the framework's, passed back to `host_reload`)
    /// replaces `allocate`: the reload takes the platform's device memory.
    #[pyo3(signature = (t, allocate=None, dtype="u8", layout=None))]
    fn tensor(
        &self,
        py: Python<'_>,
        t: &Bound<'_, PyAny>,
        allocate: Option<Py<PyAny>>,
        dtype: &str,
        layout: Option<&Bound<'_, PyAny>>,
    ) -> Result<PyBorrowedTensor> {
        let allocator: Arc<dyn Allocator> = match (allocate, layout) {
            (Some(allocate), None) => Arc::new(PyAllocator {
                shared: Arc::clone(&self.shared),
                allocate,
            }),
            (None, Some(layout)) => match &self.shared.host_reload {
                Some(host_reload) => Arc::new(HostReload {
                    shared: Arc::clone(&self.shared),
                    host_reload: host_reload.clone_ref(py),
                    layout: layout.clone().unbind(),
                    host: HostLayout::parse(layout)?,
                }),
                None => {
                    return Err(invalid(
                        "a layout needs a FrameworkMemory made with host_reload",
                    ))
                }
            },
            _ => return Err(invalid("give either allocate or layout")),
        };
        let dtype = crate::dtype::parse(dtype)?;
        Ok(PyBorrowedTensor {
            t: self.shared.tensor(py, t, allocator, dtype)?,
        })
    }

    /// `device_current` / `device_peak`: framework bytes hprt references.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.shared.counters;
        let d = PyDict::new(py);
        d.set_item("device_current", c.current.load(Ordering::Acquire))?;
        d.set_item("device_peak", c.peak.load(Ordering::Acquire))?;
        Ok(d)
    }

    /// Starts a new peak measurement from the current usage.
    fn reset_peak(&self) {
        let c = &self.shared.counters;
        c.peak
            .store(c.current.load(Ordering::Acquire), Ordering::Release);
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFrameworkMemory>()?;
    m.add_class::<PyBorrowedTensor>()?;
    Ok(())
}
