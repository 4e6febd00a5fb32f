//! A framework's own tensors as hprt-swap payloads: borrowed memory, released by dropping
//! hprt's references and re-acquired through an allocator the framework gives (for torch,
//! `torch.empty_strided` with the saved shape and strides on an accelerator, the cpu platform's
//! device memory through DLPack on the cpu backend), so the front ends of [`crate::swap`]
//! reload straight into framework tensors. One reload path on every backend: only where the
//! allocator takes its memory from differs.
//!
//! Where the framework orders its memory's reuse after other streams itself (torch's
//! `Tensor.record_stream`: `FrameworkMemory(record_stream=...)`), hprt hands memory back as
//! soon as its copy is queued ([`hprt_swap::Allocator::hand_over`]): an offloaded tensor's
//! memory when its device-to-host copy is queued, a reloaded one's when the compute stream
//! waits for its copy. Without it the platform keeps hprt's reference until it sees the copy
//! finished.
//!
//! [`PyFrameworkMemory`] counts the framework bytes hprt references (saved tensors not yet
//! released, reloads in flight), so a program can compare how much of its saved memory stayed
//! on the device with and without swap.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hprt_platform::{DType, DeviceBuffer, ReleaseFn, Stream};
use hprt_swap::{Allocator, DeviceTensor, PlatformHandle, Reacquired, VersionCounter};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::{invalid, BindError, Result};
use crate::handles::{resolve, PyPlatform, PyStream};

#[derive(Default)]
struct Counters {
    current: AtomicUsize,
    peak: AtomicUsize,
}

struct Shared {
    p: PlatformHandle,
    counters: Counters,
    /// `record_stream(tensor, raw_stream)`: the framework orders the reuse of `tensor`'s memory
    /// after the work queued on `raw_stream` so far.
    record_stream: Option<Py<PyAny>>,
}

/// hprt's reference to a framework object whose memory it borrows: what keeps the memory
/// alive for hprt, dropped (and uncounted) once, by the platform's release or by a hand-over.
struct Keeper {
    obj: Mutex<Option<Py<PyAny>>>,
    nbytes: usize,
    shared: Arc<Shared>,
}

impl Keeper {
    fn let_go(&self) {
        let obj = self.obj.lock().unwrap_or_else(|p| p.into_inner()).take();
        if obj.is_some() {
            // Without the GIL pyo3 defers the decref to the next holder of the GIL (this may run
            // on a stream thread while the GIL's holder waits on that stream).
            drop(obj);
            self.shared
                .counters
                .current
                .fetch_sub(self.nbytes, Ordering::AcqRel);
        }
    }
}

/// A borrowed tensor's framework object (what a reload hands back), with hprt's keeper of its
/// memory: the [`hprt_swap::FrameworkHandle`] of this binding's payloads.
struct Borrowed {
    obj: Py<PyAny>,
    keeper: Arc<Keeper>,
}

impl Shared {
    /// Borrows `nbytes` at `ptr`, kept alive by `owner` until hprt lets go of it.
    fn borrow(
        self: &Arc<Self>,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
    ) -> Result<(DeviceBuffer, Arc<dyn std::any::Any + Send + Sync>)> {
        if ptr == 0 && nbytes > 0 {
            return Err(invalid("cannot borrow a null pointer"));
        }
        let obj = Python::attach(|py| owner.clone_ref(py));
        let keeper = Arc::new(Keeper {
            obj: Mutex::new(Some(owner)),
            nbytes,
            shared: Arc::clone(self),
        });
        let released = Arc::clone(&keeper);
        let release: ReleaseFn = Box::new(move || released.let_go());
        let now = self.counters.current.fetch_add(nbytes, Ordering::AcqRel) + nbytes;
        self.counters.peak.fetch_max(now, Ordering::AcqRel);
        // SAFETY: the Python API's documented contract: `ptr`/`nbytes` are the memory of a live
        // framework tensor of this backend, and `owner` (that tensor) keeps it alive until the
        // release callback runs, or until the framework took the memory over (`hand_over`),
        // ordering its reuse after hprt's queued work itself.
        let storage = unsafe { self.p.wrap_device_memory(ptr, nbytes, Some(release))? };
        Ok((storage, Arc::new(Borrowed { obj, keeper })))
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
        let (storage, handle) = self.borrow(ptr, nbytes, obj.clone().unbind())?;
        let mut t = DeviceTensor::borrowed(
            storage,
            dtype,
            vec![nbytes / dtype.size()],
            Some(handle),
            allocator,
        )?;
        t.version = framework_version(py, obj);
        Ok(t)
    }

    /// The framework takes `t`'s memory over (see the module docs): its reuse is ordered after
    /// `streams`, and hprt's keeper lets go.
    fn hand_over(&self, t: &DeviceTensor, streams: &[&Stream]) -> Result<bool> {
        let (Some(record), Some(b)) = (
            self.record_stream.as_ref(),
            t.handle.as_ref().and_then(|h| h.downcast_ref::<Borrowed>()),
        ) else {
            return Ok(false);
        };
        Python::attach(|py| -> Result<()> {
            for s in streams {
                // The framework may record on the stream after hprt let go of it.
                self.p.lend_stream_to_framework(s)?;
                record.call1(py, (b.obj.clone_ref(py), s.raw().0))?;
            }
            Ok(())
        })?;
        b.keeper.let_go();
        Ok(true)
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
            let (storage, handle) = self.shared.borrow(ptr, nbytes, out.clone().unbind())?;
            Ok(Reacquired {
                storage,
                offset: 0,
                handle: Some(handle),
                version: framework_version(py, &out),
                ready_on,
            })
        });
        made.map_err(swap_error)
    }

    fn hand_over(&self, t: &DeviceTensor, streams: &[&Stream]) -> hprt_swap::Result<bool> {
        self.shared.hand_over(t, streams).map_err(swap_error)
    }
}

/// A failed allocation as the swap engine's error.
fn swap_error(e: BindError) -> hprt_swap::SwapError {
    match e {
        BindError::Swap(s) => s,
        BindError::Platform(p) => hprt_swap::SwapError::Platform(p),
        other => hprt_swap::SwapError::Order(format!("the framework allocator failed: {other}")),
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
        .and_then(|h| h.downcast_ref::<Borrowed>())
        .map(|b| b.obj.clone_ref(py))
}

#[pymethods]
impl PyFrameworkMemory {
    /// `record_stream(tensor, raw_stream)`, where the framework can order the reuse of a
    /// tensor's memory after the work queued on a stream (torch's
    /// `tensor.record_stream(torch.cuda.ExternalStream(raw_stream))`): hprt then lets go of a
    /// saved tensor as soon as its offload is queued and of a reloaded one as soon as the
    /// compute stream waits for it, instead of when the host later sees the copy finished.
    #[new]
    #[pyo3(signature = (platform=None, record_stream=None))]
    fn new(platform: Option<&PyPlatform>, record_stream: Option<Py<PyAny>>) -> Result<Self> {
        let p = resolve(platform)?;
        Ok(PyFrameworkMemory {
            shared: Arc::new(Shared {
                p,
                counters: Counters::default(),
                record_stream,
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
        let allocator = Arc::new(PyAllocator {
            shared: Arc::clone(&self.shared),
            allocate,
        });
        let dtype = dtype.parse::<DType>()?;
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
