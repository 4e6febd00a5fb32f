//! A framework's own tensors as hprt-swap payloads: borrowed memory, released by dropping
//! hprt's references and re-acquired through an allocator the framework gives (for torch,
//! `torch.empty_strided` with the saved shape and strides), so the front ends of [`crate::swap`]
//! reload straight into framework tensors.
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

use crate::error::{invalid, BindError, Result};
use crate::platform::{PyPlatform, PyStream};

#[derive(Default)]
struct Counters {
    current: AtomicUsize,
    peak: AtomicUsize,
}

struct Shared {
    p: PlatformHandle,
    counters: Counters,
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
        allocate: Py<PyAny>,
        dtype: DType,
    ) -> Result<DeviceTensor> {
        let (ptr, nbytes) = framework_memory(obj)?;
        if nbytes % dtype.size() != 0 {
            return Err(invalid(format!(
                "{nbytes} bytes are no whole number of {dtype}"
            )));
        }
        let storage = self.borrow(ptr, nbytes, obj.clone().unbind())?;
        let allocator = Arc::new(PyAllocator {
            shared: Arc::clone(self),
            allocate,
        });
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
            if nbytes != like.len {
                return Err(invalid(format!(
                    "the allocator gave a {nbytes}-byte tensor for {} saved bytes",
                    like.len
                )));
            }
            Ok(Reacquired {
                storage: self.shared.borrow(ptr, nbytes, out.clone().unbind())?,
                offset: 0,
                handle: Some(Arc::new(out.clone().unbind())),
                version: framework_version(py, &out),
                ready_on,
            })
        });
        made.map_err(|e| match e {
            BindError::Swap(s) => s,
            BindError::Platform(p) => hprt_swap::SwapError::Platform(p),
            other => {
                hprt_swap::SwapError::Order(format!("the framework allocator failed: {other}"))
            }
        })
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
    #[new]
    #[pyo3(signature = (platform=None))]
    fn new(platform: Option<&PyPlatform>) -> Result<Self> {
        Ok(PyFrameworkMemory {
            shared: Arc::new(Shared {
                p: crate::platform::resolve(platform)?,
                counters: Counters::default(),
            }),
        })
    }

    /// `t` (a framework tensor with `data_ptr()` and `nbytes`, dense) as a swap payload;
    /// `allocate()` must return a new tensor of `t`'s shape, strides, dtype and device, or
    /// `(tensor, stream)` where a caching allocator (torch's on a GPU) handed its memory out for
    /// use in `stream`'s order: the reload then writes it after the work queued there.
    /// `dtype` (hprt's name: `f32`, `bf16`, ...) lets compress-then-swap encode it.
    #[pyo3(signature = (t, allocate, dtype="u8"))]
    fn tensor(
        &self,
        py: Python<'_>,
        t: &Bound<'_, PyAny>,
        allocate: Py<PyAny>,
        dtype: &str,
    ) -> Result<PyBorrowedTensor> {
        Ok(PyBorrowedTensor {
            t: self
                .shared
                .tensor(py, t, allocate, crate::dtype::parse(dtype)?)?,
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
