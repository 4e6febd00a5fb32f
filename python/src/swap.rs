//! The three hprt-swap front ends on hprt device memory: `SwapManager` (hyper_parallel layer groups),
//! `KeyedSwap` (keyed pack/unpack), `PipelineOffload` (Megatron-LM chunked groups), and
//! `DeviceTensor`, the tensor description they take.
//!
//! (Over 800 lines because the three front ends share `DeviceTensor`, its conversion from Python
//! and the allocator callback; each front end is one section.)

use hprt_platform::sync::lock;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hprt_platform::{DType, DeviceBuffer};
use hprt_swap::{
    Compression, DeviceTensor, InflightWindow, KeyedSwap, LayerProfile, OffloadTag, Packed,
    PipelineConfig, PipelineOffload, PlanTarget, PlatformHandle, PoolConfig, Saved, SavedRef,
    SwapContext, SwapManager, TensorKey, TensorKeyManager,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::borrowed::{handle_object, PyBorrowedTensor};
use crate::dlpack::{unexported, Backing, TensorView};
use crate::error::{invalid, BindError, Result};
use crate::platform::{PyDeviceBuffer, PyPlatform, PyStream};

/// A device tensor as swap sees it: `nbytes` at `offset` in a `DeviceBuffer`, with a dtype, a
/// shape and a version counter (bump it on in-place writes; a reload refuses a changed tensor).
///
/// ```python
/// buf = p.alloc_device(4096)
/// t = hprt.DeviceTensor(buf, "f32", [1024])
/// ```
#[pyclass(name = "DeviceTensor", module = "hprt._native", frozen)]
pub struct PyDeviceTensor {
    pub(crate) p: PlatformHandle,
    pub(crate) t: DeviceTensor,
}

impl PyDeviceTensor {
    pub(crate) fn from_parts(
        p: &PlatformHandle,
        storage: DeviceBuffer,
        offset: usize,
        dtype: DType,
        shape: Vec<usize>,
        is_parameter: bool,
    ) -> Result<Self> {
        let mut t = DeviceTensor::view(storage, offset, dtype, shape)?;
        t.is_parameter = is_parameter;
        Ok(PyDeviceTensor { p: p.clone(), t })
    }
}

#[pymethods]
impl PyDeviceTensor {
    #[new]
    #[pyo3(signature = (buffer, dtype, shape, offset=0, is_parameter=false))]
    fn new(
        buffer: &PyDeviceBuffer,
        dtype: &str,
        shape: Vec<usize>,
        offset: usize,
        is_parameter: bool,
    ) -> Result<Self> {
        Self::from_parts(
            &buffer.p,
            buffer.b.clone(),
            offset,
            dtype.parse::<DType>()?,
            shape,
            is_parameter,
        )
    }
    #[getter]
    fn buffer(&self) -> PyDeviceBuffer {
        PyDeviceBuffer {
            p: self.p.clone(),
            b: self.t.storage.clone(),
        }
    }
    #[getter]
    fn offset(&self) -> usize {
        self.t.offset
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.t.len
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.t.dtype.name()
    }
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.t.shape.clone()
    }
    #[getter]
    fn is_parameter(&self) -> bool {
        self.t.is_parameter
    }
    #[getter]
    fn version(&self) -> u64 {
        self.t.version.get()
    }
    /// Notes an in-place modification (what torch's `_version` counts).
    fn bump_version(&self) {
        self.t.version.bump()
    }
    /// The tensor as a DLPack-exportable view (cpu backend).
    fn view(&self) -> Result<TensorView> {
        TensorView::of_device(
            &self.p,
            &self.t.storage,
            self.t.dtype,
            self.t.shape.clone(),
            self.t.offset,
        )
    }
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let view = Bound::new(py, self.view()?)?;
        view.call_method(
            "__dlpack__",
            (),
            Some(&{
                let kw = PyDict::new(py);
                kw.set_item("stream", stream)?;
                kw.set_item("max_version", max_version)?;
                kw.set_item("dl_device", dl_device)?;
                kw.set_item("copy", copy)?;
                kw
            }),
        )
        .map(Bound::unbind)
    }
    fn __dlpack_device__(&self) -> (u32, i32) {
        (dlpark::ffi::DLDeviceType::CPU.0, 0)
    }
    fn __repr__(&self) -> String {
        format!(
            "DeviceTensor(dtype={}, shape={:?}, nbytes={}, offset={})",
            self.t.dtype, self.t.shape, self.t.len, self.t.offset
        )
    }
}

/// A Python value as swap holds it: hprt tensors and borrowed framework tensors swap, anything
/// else passes through.
fn to_saved(value: &Bound<'_, PyAny>) -> Saved {
    if let Ok(t) = value.cast::<PyDeviceTensor>() {
        return Saved::Tensor(t.get().t.clone());
    }
    if let Ok(t) = value.cast::<PyBorrowedTensor>() {
        return Saved::Tensor(t.get().t.clone());
    }
    Saved::Other(Arc::new(value.clone().unbind()))
}

/// The value handed back: a borrowed tensor comes back as its framework tensor (the one the
/// allocator made, after a reload), an hprt tensor as a `DeviceTensor`.
fn from_saved(py: Python<'_>, p: &PlatformHandle, saved: Saved) -> Result<Py<PyAny>> {
    match saved {
        Saved::Tensor(t) if t.is_borrowed() => handle_object(py, &t)
            .ok_or_else(|| invalid("a borrowed tensor without its framework object")),
        Saved::Tensor(t) => Ok(Py::new(py, PyDeviceTensor { p: p.clone(), t })?.into_any()),
        Saved::Other(any) => match any.downcast_ref::<Py<PyAny>>() {
            Some(obj) => Ok(obj.clone_ref(py)),
            None => Err(invalid("a saved value that did not come from Python")),
        },
    }
}

/// A front end's `stats()`: the engine's one field list ([`hprt_swap::SwapEngine::stat_fields`],
/// which the C `HprtSwapStats` is filled from too).
fn stats_dict<'py>(
    py: Python<'py>,
    engine: &hprt_swap::SwapEngine,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in engine.stat_fields() {
        d.set_item(name, value)?;
    }
    Ok(d)
}

fn pool(host_budget: Option<usize>) -> PoolConfig {
    PoolConfig { host_budget }
}

/// A swap offload releases an hprt-owned tensor's storage only while no DLPack export of it is
/// alive (the same rule as `free` and `resize`): the offload is refused with a
/// `BufferExportedError` and the tensor stays in flight, to be finished once the view is gone.
struct NoLiveExports;

impl hprt_swap::ReleaseGuard for NoLiveExports {
    fn release(
        &self,
        storage: &DeviceBuffer,
        release: &mut dyn FnMut() -> hprt_swap::Result<()>,
    ) -> hprt_swap::Result<()> {
        let bufs = [Backing::Device(storage.clone())];
        match unexported(&bufs, "swap offload", || Ok(release()?)) {
            Ok(()) => Ok(()),
            Err(crate::error::BindError::Swap(e)) => Err(e),
            Err(e) => Err(hprt_swap::SwapError::StorageInUse(e.to_string())),
        }
    }
}

/// The engine's in-flight bounds from the constructors' and `set_window`'s keywords.
fn window(offload_bytes: Option<usize>, reload_bytes: Option<usize>) -> InflightWindow {
    InflightWindow {
        offload_bytes,
        reload_bytes,
    }
}

/// hyper_parallel layer-group swap: link layers with `set_forward_prefetch_layer(a, b)` and call the
/// four hook entry points around each layer's forward and backward.
#[pyclass(name = "SwapManager", module = "hprt._native", frozen)]
pub struct PySwapManager {
    p: PlatformHandle,
    inner: Mutex<SwapManager>,
}

type Ref = (usize, usize, u64);

fn saved_ref(r: SavedRef) -> Ref {
    (r.key.layer.index(), r.key.index, r.generation)
}

impl PySwapManager {
    fn saved_ref(m: &SwapManager, (layer, index, generation): Ref) -> Result<SavedRef> {
        Ok(SavedRef {
            key: TensorKey {
                layer: m.layer_id(layer)?,
                index,
            },
            generation,
        })
    }
}

#[pymethods]
impl PySwapManager {
    #[new]
    #[pyo3(signature = (platform=None, host_budget=None, compression="off", max_inflight_offload_bytes=None, max_inflight_reload_bytes=None))]
    fn new(
        platform: Option<&PyPlatform>,
        host_budget: Option<usize>,
        compression: &str,
        max_inflight_offload_bytes: Option<usize>,
        max_inflight_reload_bytes: Option<usize>,
    ) -> Result<Self> {
        let p = crate::platform::resolve(platform)?;
        let mut m = SwapManager::with_pool(p.clone(), pool(host_budget))?;
        m.engine_mut()
            .set_compression(compression.parse::<Compression>()?);
        m.engine_mut().set_window(window(
            max_inflight_offload_bytes,
            max_inflight_reload_bytes,
        ));
        m.engine_mut()
            .set_release_guard(Some(Arc::new(NoLiveExports)));
        Ok(PySwapManager {
            p: p.clone(),
            inner: Mutex::new(m),
        })
    }
    /// Bounds the bytes in flight (None: unbounded): offloads whose copy is not known to have
    /// finished (an offload past it waits for the oldest), reloads prefetched and not yet
    /// handed to the compute stream (a prefetch past it is left to its layer's own load).
    #[pyo3(signature = (offload_bytes=None, reload_bytes=None))]
    fn set_window(&self, offload_bytes: Option<usize>, reload_bytes: Option<usize>) {
        lock(&self.inner)
            .engine_mut()
            .set_window(window(offload_bytes, reload_bytes));
    }
    /// A new layer (group); returns its number.
    fn new_layer(&self) -> usize {
        lock(&self.inner).new_layer().index()
    }
    /// The number of group `name` (made on first use).
    fn group(&self, name: &str) -> usize {
        lock(&self.inner).group(name).index()
    }
    fn set_forward_prefetch_layer(&self, first: usize, second: usize) -> Result<()> {
        let mut g = lock(&self.inner);
        let (a, b) = (g.layer_id(first)?, g.layer_id(second)?);
        Ok(g.set_forward_prefetch_layer(a, b)?)
    }
    /// Forgets the layer's links (between iterations), so it can be linked in another order.
    fn unlink(&self, layer: usize) -> Result<()> {
        let mut g = lock(&self.inner);
        let l = g.layer_id(layer)?;
        Ok(g.unlink(l)?)
    }
    /// Returns whether the layer's saved values join its group (false for a checkpointed
    /// recomputation during its backward).
    fn forward_pre(&self, layer: usize) -> Result<bool> {
        let mut g = lock(&self.inner);
        let l = g.layer_id(layer)?;
        g.forward_pre(l)?;
        Ok(g.is_recording(l))
    }
    /// Adds a value to the current layer's group; returns the reference `get` takes.
    fn save(&self, value: &Bound<'_, PyAny>) -> Result<Ref> {
        let saved = to_saved(value);
        Ok(saved_ref(lock(&self.inner).save(saved)?))
    }
    /// hyper_parallel's `add_storage(group_name, storage)`: adds a value to a named group.
    fn add_storage(&self, group_name: &str, value: &Bound<'_, PyAny>) -> Result<Ref> {
        let saved = to_saved(value);
        Ok(saved_ref(lock(&self.inner).add_storage(group_name, saved)?))
    }
    fn launch_offload(&self, py: Python<'_>, group_name: &str, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).launch_offload(group_name, &stream.s)?))
    }
    fn wait_offload(&self, py: Python<'_>, group_name: &str) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).wait_offload(group_name)?))
    }
    fn launch_load(&self, py: Python<'_>, group_name: &str) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).launch_load(group_name)?))
    }
    fn wait_load(&self, py: Python<'_>, group_name: &str, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).wait_load(group_name, &stream.s)?))
    }
    /// hyper_parallel's `is_last_group`: group `group_name` ends the chain of linked layers.
    fn is_last_group(&self, group_name: &str) -> bool {
        lock(&self.inner).is_last_group(group_name)
    }
    /// Where a saved value is: `device`, `d2h`, `host`, `h2d` or `non_tensor`.
    fn state(&self, saved: Ref) -> Result<&'static str> {
        let mut g = lock(&self.inner);
        let r = Self::saved_ref(&g, saved)?;
        Ok(g.state(r)?.name())
    }
    fn get_current_group_name(&self) -> Option<String> {
        lock(&self.inner)
            .get_current_group_name()
            .map(str::to_owned)
    }
    fn set_current_group_name(&self, name: &str) {
        lock(&self.inner).set_current_group_name(name)
    }
    fn forward_post(&self, py: Python<'_>, layer: usize, stream: &PyStream) -> Result<()> {
        py.detach(|| {
            let mut g = lock(&self.inner);
            let l = g.layer_id(layer)?;
            Ok(g.forward_post(l, &stream.s)?)
        })
    }
    fn backward_pre(&self, py: Python<'_>, layer: usize, stream: &PyStream) -> Result<()> {
        py.detach(|| {
            let mut g = lock(&self.inner);
            let l = g.layer_id(layer)?;
            Ok(g.backward_pre(l, &stream.s)?)
        })
    }
    fn backward_post(&self, layer: usize) -> Result<()> {
        let mut g = lock(&self.inner);
        let l = g.layer_id(layer)?;
        Ok(g.backward_post(l)?)
    }
    /// A saved value, once its group is back on the device.
    fn get(&self, py: Python<'_>, saved: Ref) -> Result<Py<PyAny>> {
        let mut g = lock(&self.inner);
        let r = Self::saved_ref(&g, saved)?;
        let v = g.get(r)?.clone();
        drop(g);
        from_saved(py, &self.p, v)
    }
    /// Hands a saved value out of its group (the group keeps no reference to it).
    fn take(&self, py: Python<'_>, saved: Ref) -> Result<Py<PyAny>> {
        let mut g = lock(&self.inner);
        let r = Self::saved_ref(&g, saved)?;
        let v = g.take(r)?;
        drop(g);
        from_saved(py, &self.p, v)
    }
    fn release(&self, py: Python<'_>, layer: usize) -> Result<Vec<Py<PyAny>>> {
        let mut g = lock(&self.inner);
        let l = g.layer_id(layer)?;
        let values = g.release(l)?;
        drop(g);
        values
            .into_iter()
            .map(|v| from_saved(py, &self.p, v))
            .collect()
    }
    fn end_iteration(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).end_iteration()?))
    }
    /// `off`, `device`, `host_stage` or `auto`: compress-then-swap for tensors offloaded from
    /// now on.
    fn set_compression(&self, compression: &str) -> Result<()> {
        lock(&self.inner)
            .engine_mut()
            .set_compression(compression.parse::<Compression>()?);
        Ok(())
    }
    /// Per-tensor compression: `policy(tensor) -> "off" | "device" | "host_stage" | "auto"`
    /// (`None` removes it).
    fn set_compression_policy(&self, policy: Option<Py<PyAny>>) {
        let policy = py_policy(&self.p, policy);
        lock(&self.inner)
            .engine_mut()
            .set_compression_policy(policy)
    }
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, lock(&self.inner).engine())
    }
}

/// What a Python callback sees of a tensor: the framework's own object for a borrowed payload,
/// else a `DeviceTensor`.
fn tensor_object(py: Python<'_>, p: &PlatformHandle, t: &DeviceTensor) -> PyResult<Py<PyAny>> {
    match handle_object(py, t) {
        Some(obj) => Ok(obj),
        None => Py::new(
            py,
            PyDeviceTensor {
                p: p.clone(),
                t: t.clone(),
            },
        )
        .map(Py::into_any),
    }
}

/// A per-tensor compression policy from Python: `policy(t)` returns a mode name (`t` the
/// framework tensor of a borrowed payload, else a `DeviceTensor`); a policy that raises or
/// returns something else means `off`, its exception reported as unraisable.
fn py_policy(
    p: &PlatformHandle,
    policy: Option<Py<PyAny>>,
) -> Option<hprt_swap::CompressionPolicy> {
    let p = p.clone();
    policy.map(|f| {
        Arc::new(move |t: &DeviceTensor| {
            Python::attach(|py| {
                let chosen = tensor_object(py, &p, t)
                    .and_then(|a| f.call1(py, (a,)))
                    .and_then(|r| r.extract::<String>(py));
                match chosen.map(|name| name.parse::<Compression>()) {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        PyErr::from(BindError::from(e)).write_unraisable(py, None);
                        Compression::Off
                    }
                    Err(e) => {
                        e.write_unraisable(py, None);
                        Compression::Off
                    }
                }
            })
        }) as hprt_swap::CompressionPolicy
    })
}

/// A layer registered under a module tag (hyper_parallel's `TensorSwapContext` position).
#[pyclass(name = "SwapContext", module = "hprt._native", frozen)]
pub struct PySwapContext {
    ctx: SwapContext,
}

#[pymethods]
impl PySwapContext {
    /// The layer's index among the layers of its tag.
    #[getter]
    fn layer(&self) -> usize {
        self.ctx.layer
    }
}

/// What `KeyedSwap.pack` returned.
#[pyclass(name = "Packed", module = "hprt._native", frozen)]
pub struct PyPacked {
    kept: Option<Saved>,
    key: Option<TensorKey>,
}

/// A key as Python sees it: `(layer, index)`.
type PyKey = (usize, usize);

fn py_key(k: TensorKey) -> PyKey {
    (k.layer.index(), k.index)
}

#[pymethods]
impl PyPacked {
    /// `(layer, index)` when the value was swapped, `None` when it was kept.
    #[getter]
    fn key(&self) -> Option<PyKey> {
        self.key.map(py_key)
    }
}

/// Keyed swap: `pack` where a value is saved, `unpack` where it is read back.
#[pyclass(name = "KeyedSwap", module = "hprt._native", frozen)]
pub struct PyKeyedSwap {
    p: PlatformHandle,
    inner: Mutex<KeyedSwap>,
}

#[pymethods]
impl PyKeyedSwap {
    #[new]
    #[pyo3(signature = (platform=None, min_bytes=0, host_budget=None, compression="off", max_inflight_offload_bytes=None, max_inflight_reload_bytes=None))]
    fn new(
        platform: Option<&PyPlatform>,
        min_bytes: usize,
        host_budget: Option<usize>,
        compression: &str,
        max_inflight_offload_bytes: Option<usize>,
        max_inflight_reload_bytes: Option<usize>,
    ) -> Result<Self> {
        let p = crate::platform::resolve(platform)?;
        let mut k = KeyedSwap::with_pool(p.clone(), pool(host_budget))?;
        k.set_min_bytes(min_bytes);
        k.engine_mut()
            .set_compression(compression.parse::<Compression>()?);
        k.engine_mut().set_window(window(
            max_inflight_offload_bytes,
            max_inflight_reload_bytes,
        ));
        k.engine_mut()
            .set_release_guard(Some(Arc::new(NoLiveExports)));
        Ok(PyKeyedSwap {
            p: p.clone(),
            inner: Mutex::new(k),
        })
    }
    /// Registers the next layer under `module_tag` (`*` matches one path component).
    fn register_layer(&self, module_tag: &str) -> PySwapContext {
        PySwapContext {
            ctx: lock(&self.inner).register_layer(module_tag),
        }
    }
    fn add_tag(&self, pattern: &str) {
        lock(&self.inner).add_tag(pattern)
    }
    /// Registers `module` (a dotted path) under the first tag pattern it matches.
    fn register_module(&self, module: &str) -> Result<PySwapContext> {
        Ok(PySwapContext {
            ctx: lock(&self.inner).register_module(module)?,
        })
    }
    fn layer_count(&self, ctx: &PySwapContext) -> usize {
        lock(&self.inner).layer_count(&ctx.ctx)
    }
    /// Tensors smaller than this stay on the device.
    fn set_min_bytes(&self, bytes: usize) {
        lock(&self.inner).set_min_bytes(bytes)
    }
    /// Bounds the bytes in flight (see `SwapManager.set_window`).
    #[pyo3(signature = (offload_bytes=None, reload_bytes=None))]
    fn set_window(&self, offload_bytes: Option<usize>, reload_bytes: Option<usize>) {
        lock(&self.inner)
            .engine_mut()
            .set_window(window(offload_bytes, reload_bytes));
    }
    /// Per-tensor compression: `policy(tensor) -> "off" | "device" | "host_stage" | "auto"`.
    fn set_compression_policy(&self, policy: Option<Py<PyAny>>) {
        let policy = py_policy(&self.p, policy);
        lock(&self.inner)
            .engine_mut()
            .set_compression_policy(policy)
    }
    /// `off`, `device`, `host_stage` or `auto`.
    fn set_compression(&self, compression: &str) -> Result<()> {
        lock(&self.inner)
            .engine_mut()
            .set_compression(compression.parse::<Compression>()?);
        Ok(())
    }
    /// An extra eligibility test (the upstream `custom_check_fn`): `predicate(t) -> bool` with
    /// `t` the framework tensor of a borrowed payload or a `DeviceTensor` (`None` removes it).
    /// A predicate that raises counts as "not eligible"; its exception is reported as
    /// unraisable.
    #[pyo3(signature = (predicate))]
    fn set_predicate(&self, predicate: Option<Py<PyAny>>) {
        let p = self.p.clone();
        let boxed = predicate.map(|f| {
            Box::new(move |t: &DeviceTensor| {
                Python::attach(|py| {
                    match tensor_object(py, &p, t)
                        .and_then(|a| f.call1(py, (a,)))
                        .and_then(|r| r.is_truthy(py))
                    {
                        Ok(b) => b,
                        Err(e) => {
                            e.write_unraisable(py, None);
                            false
                        }
                    }
                })
            }) as hprt_swap::SwapPredicate
        });
        lock(&self.inner).set_predicate(boxed)
    }
    /// The upstream name of `pack`.
    fn swap_out_cur_and_release_prev(
        &self,
        py: Python<'_>,
        ctx: &PySwapContext,
        value: &Bound<'_, PyAny>,
        stream: &PyStream,
    ) -> Result<PyPacked> {
        self.pack(py, ctx, value, stream)
    }
    /// The upstream name of `unpack`.
    #[pyo3(signature = (packed, stream, prefetch=true))]
    fn wait_cur_and_prefetch_next(
        &self,
        py: Python<'_>,
        packed: &PyPacked,
        stream: &PyStream,
        prefetch: bool,
    ) -> Result<Py<PyAny>> {
        self.unpack(py, packed, stream, prefetch)
    }
    fn pack(
        &self,
        py: Python<'_>,
        ctx: &PySwapContext,
        value: &Bound<'_, PyAny>,
        stream: &PyStream,
    ) -> Result<PyPacked> {
        let saved = to_saved(value);
        let packed = py.detach(|| lock(&self.inner).pack(&ctx.ctx, saved, &stream.s))?;
        Ok(match packed {
            Packed::Kept(v) => PyPacked {
                kept: Some(v),
                key: None,
            },
            Packed::Swapped(k) => PyPacked {
                kept: None,
                key: Some(k),
            },
        })
    }
    #[pyo3(signature = (packed, stream, prefetch=true))]
    fn unpack(
        &self,
        py: Python<'_>,
        packed: &PyPacked,
        stream: &PyStream,
        prefetch: bool,
    ) -> Result<Py<PyAny>> {
        let p = match (&packed.kept, packed.key) {
            (Some(v), _) => Packed::Kept(v.clone()),
            (None, Some(k)) => Packed::Swapped(k),
            (None, None) => return Err(invalid("an empty Packed value")),
        };
        let v = py.detach(|| lock(&self.inner).unpack_with(p, &stream.s, prefetch))?;
        from_saved(py, &self.p, v)
    }
    fn end_iteration(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).end_iteration()?))
    }
    /// Values packed and not yet unpacked.
    fn pending(&self) -> usize {
        lock(&self.inner).pending()
    }
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, lock(&self.inner).engine())
    }
}

/// The `(layer - 1)` tensor indices tensor `index` of a `cur`-tensor layer prefetches from a
/// `prev`-tensor layer.
#[pyfunction]
pub fn proportional_slice(index: usize, cur: usize, prev: usize) -> (usize, usize) {
    let r = hprt_swap::proportional_slice(index, cur, prev);
    (r.start, r.end)
}

/// The keyed swap's (layer, index) keys: `get_key(layer)` gives the next saved tensor's key and
/// whether it starts a new layer; `get_prefetch_keys(key)` the previous layer's keys that
/// tensor's unpack prefetches (its proportional share). `KeyedSwap` keeps one of its own.
#[pyclass(name = "TensorKeyManager", module = "hprt._native", frozen)]
#[derive(Default)]
pub struct PyTensorKeyManager {
    inner: Mutex<TensorKeyManager>,
}

#[pymethods]
impl PyTensorKeyManager {
    #[new]
    fn new() -> Self {
        Self::default()
    }
    fn get_key(&self, layer: usize) -> (PyKey, bool) {
        let (key, previous_done) = lock(&self.inner).get_key(layer);
        (py_key(key), previous_done)
    }
    fn get_prefetch_keys(&self, key: PyKey) -> Vec<PyKey> {
        let keys = lock(&self.inner).get_prefetch_keys(TensorKey::new(key.0, key.1));
        keys.into_iter().map(py_key).collect()
    }
    /// Tensors of `layer` counted in this step.
    fn count(&self, layer: usize) -> usize {
        lock(&self.inner).count(layer)
    }
}

/// What `PipelineOffload.save` returned.
#[pyclass(name = "OffloadTag", module = "hprt._native", frozen)]
pub struct PyOffloadTag {
    tag: OffloadTag,
}

#[pymethods]
impl PyOffloadTag {
    #[getter]
    fn offloaded(&self) -> bool {
        matches!(self.tag, OffloadTag::Offloaded { .. })
    }
}

/// Megatron-LM chunked pipeline offload: `init_chunk`, then per layer group `group_start`,
/// `save`…, `group_commit`; in backward `backward_group_begin`, `get`…, `backward_group_end`.
#[pyclass(name = "PipelineOffload", module = "hprt._native", frozen)]
pub struct PyPipelineOffload {
    p: PlatformHandle,
    inner: Mutex<PipelineOffload>,
}

#[pymethods]
impl PyPipelineOffload {
    #[new]
    #[pyo3(signature = (platform=None, min_tensor_elems=1024 * 1024, max_inflight_offloads=1, keep_last_groups=1, host_budget=None, compression="off", max_inflight_offload_bytes=None, max_inflight_reload_bytes=None))]
    #[allow(clippy::too_many_arguments)] // Python keywords
    fn new(
        platform: Option<&PyPlatform>,
        min_tensor_elems: usize,
        max_inflight_offloads: usize,
        keep_last_groups: usize,
        host_budget: Option<usize>,
        compression: &str,
        max_inflight_offload_bytes: Option<usize>,
        max_inflight_reload_bytes: Option<usize>,
    ) -> Result<Self> {
        let p = crate::platform::resolve(platform)?;
        let cfg = PipelineConfig {
            min_tensor_elems,
            max_inflight_offloads,
            keep_last_groups,
            pool: pool(host_budget),
            compression: compression.parse::<Compression>()?,
            window: window(max_inflight_offload_bytes, max_inflight_reload_bytes),
        };
        let mut pipeline = PipelineOffload::new(p.clone(), cfg)?;
        pipeline
            .engine_mut()
            .set_release_guard(Some(Arc::new(NoLiveExports)));
        Ok(PyPipelineOffload {
            p: p.clone(),
            inner: Mutex::new(pipeline),
        })
    }
    #[pyo3(signature = (vp_size=1, vp_stage=None))]
    fn init_chunk(&self, vp_size: usize, vp_stage: Option<usize>) -> Result<()> {
        lock(&self.inner).init_chunk(vp_size, vp_stage)?;
        Ok(())
    }
    fn disable(&self) {
        lock(&self.inner).disable()
    }
    fn enable(&self) {
        lock(&self.inner).enable()
    }
    fn mark_chunk_not_offloadable(&self) -> Result<()> {
        Ok(lock(&self.inner).mark_chunk_not_offloadable()?)
    }
    fn mark_not_offloadable(&self, tensor: &PyDeviceTensor) {
        lock(&self.inner).mark_not_offloadable(&tensor.t)
    }
    fn group_start(&self, name: &str) -> Result<()> {
        Ok(lock(&self.inner).group_start(name)?)
    }
    /// Megatron-LM's `set_last_layer`: groups committed from now on stay on the device while
    /// the current chunk's backward is the next to run.
    fn set_last_layer(&self, is_last_layer: bool) -> Result<()> {
        Ok(lock(&self.inner).set_last_layer(is_last_layer)?)
    }
    fn save(&self, value: &Bound<'_, PyAny>) -> Result<PyOffloadTag> {
        let saved = to_saved(value);
        Ok(PyOffloadTag {
            tag: lock(&self.inner).save(saved)?,
        })
    }
    #[pyo3(signature = (stream, forced_release=Vec::new(), delay=false))]
    fn group_commit(
        &self,
        py: Python<'_>,
        stream: &PyStream,
        forced_release: Vec<PyRef<'_, PyDeviceBuffer>>,
        delay: bool,
    ) -> Result<()> {
        let bufs: Vec<DeviceBuffer> = forced_release.iter().map(|b| b.b.clone()).collect();
        py.detach(|| Ok(lock(&self.inner).group_commit(&stream.s, bufs, delay)?))
    }
    fn flush_delayed_groups(&self, py: Python<'_>, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).flush_delayed_groups(&stream.s)?))
    }
    fn backward_group_begin(&self, py: Python<'_>, name: &str, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).backward_group_begin(name, &stream.s)?))
    }
    fn get(&self, py: Python<'_>, tag: &PyOffloadTag, stream: &PyStream) -> Result<Py<PyAny>> {
        let v = py.detach(|| lock(&self.inner).get(&tag.tag, &stream.s))?;
        from_saved(py, &self.p, v)
    }
    /// `get`, handing the value over: the offload references it no more (its memory goes with
    /// the caller's last reference); the tag cannot be read again.
    fn take(&self, py: Python<'_>, tag: &PyOffloadTag, stream: &PyStream) -> Result<Py<PyAny>> {
        let v = py.detach(|| lock(&self.inner).take(&tag.tag, &stream.s))?;
        from_saved(py, &self.p, v)
    }
    fn backward_group_end(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).backward_group_end()?))
    }
    /// Starts reloading `tag`'s group ahead of its backward; returns how many tensors' reloads
    /// this started.
    fn prefetch(&self, py: Python<'_>, tag: &PyOffloadTag) -> Result<usize> {
        py.detach(|| Ok(lock(&self.inner).prefetch(&tag.tag)?))
    }
    fn record_forward(&self, py: Python<'_>, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).record_forward(&stream.s)?))
    }
    /// Megatron-LM's `forward_record`: offloads after `stream`'s work so far, and `stream`
    /// after every offload queued so far.
    fn join_offloads(&self, py: Python<'_>, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).join_offloads(&stream.s)?))
    }
    fn record_backward(&self, py: Python<'_>, stream: &PyStream) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).record_backward(&stream.s)?))
    }
    fn post_warmup(&self) {
        lock(&self.inner).post_warmup()
    }
    /// Bounds the bytes in flight (see `SwapManager.set_window`).
    #[pyo3(signature = (offload_bytes=None, reload_bytes=None))]
    fn set_window(&self, offload_bytes: Option<usize>, reload_bytes: Option<usize>) {
        lock(&self.inner)
            .engine_mut()
            .set_window(window(offload_bytes, reload_bytes));
    }
    /// Per-tensor compression: `policy(tensor) -> "off" | "device" | "host_stage" | "auto"`.
    fn set_compression_policy(&self, policy: Option<Py<PyAny>>) {
        let policy = py_policy(&self.p, policy);
        lock(&self.inner)
            .engine_mut()
            .set_compression_policy(policy)
    }
    fn reset(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| Ok(lock(&self.inner).reset()?))
    }
    /// Bytes offloaded per group name in the last iteration after warm-up.
    fn offload_summary_bytes(&self) -> std::collections::BTreeMap<String, u64> {
        lock(&self.inner).offload_summary_bytes().clone()
    }
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, lock(&self.inner).engine())
    }
}

/// The per-rank, per-group table of offloaded bytes.
#[pyfunction]
pub fn offload_summary_table(per_rank: Vec<std::collections::BTreeMap<String, u64>>) -> String {
    hprt_swap::offload_summary_table(&per_rank)
}

/// The per-rank table of link bytes, compressed tensors, pinned high water and codec time, from
/// each rank's front-end `stats()`.
#[pyfunction]
pub fn link_summary_table(per_rank: Vec<std::collections::HashMap<String, u64>>) -> String {
    let rows: Vec<_> = per_rank
        .iter()
        .map(|d| {
            let get = |k: &str| d.get(k).copied().unwrap_or(0);
            let e = hprt_swap::EngineStats {
                offloaded_bytes: get("offloaded_bytes"),
                link_d2h_bytes: get("link_d2h_bytes"),
                link_h2d_bytes: get("link_h2d_bytes"),
                compressed_tensors: get("compressed_tensors"),
                codec_ns: get("codec_ns"),
                ..Default::default()
            };
            let p = hprt_swap::PoolStats {
                high_water: get("pinned_high_water") as usize,
                ..Default::default()
            };
            (e, p)
        })
        .collect();
    hprt_swap::link_summary_table(&rows)
}

/// Which layers to offload (hprt-swap's `plan_offload`): per layer in forward order its saved
/// bytes and forward / backward seconds, the measured device-to-host link speed in GB/s, and
/// one target: `budget` (bytes of saved activations allowed on the device at the peak),
/// `offload_fraction` (0 to 1: that share of the offloadable layers, earliest first), or
/// neither (`auto`: what hides behind compute). Returns `offload` (a bool per layer),
/// `predicted_peak_bytes`, `unswapped_peak_bytes`, `exposed_s`, `meets_target` and `table`.
#[pyfunction]
#[pyo3(signature = (saved_bytes, forward_s, backward_s, link_gbps, budget=None, offload_fraction=None))]
fn plan_offload<'py>(
    py: Python<'py>,
    saved_bytes: Vec<u64>,
    forward_s: Vec<f64>,
    backward_s: Vec<f64>,
    link_gbps: f64,
    budget: Option<u64>,
    offload_fraction: Option<f64>,
) -> Result<Bound<'py, PyDict>> {
    if forward_s.len() != saved_bytes.len() || backward_s.len() != saved_bytes.len() {
        return Err(invalid(format!(
            "plan_offload: {} layers of saved bytes, {} forward and {} backward times",
            saved_bytes.len(),
            forward_s.len(),
            backward_s.len()
        )));
    }
    let seconds = |s: f64| {
        Duration::try_from_secs_f64(s)
            .map_err(|_| invalid(format!("plan_offload: {s} is no duration in seconds")))
    };
    let layers = saved_bytes
        .iter()
        .zip(forward_s.iter().zip(&backward_s))
        .map(|(&saved_bytes, (&f, &b))| {
            Ok(LayerProfile {
                saved_bytes,
                forward: seconds(f)?,
                backward: seconds(b)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let target = match (budget, offload_fraction) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "plan_offload: give a budget or an offload_fraction, not both",
            ))
        }
        (Some(b), None) => PlanTarget::Budget(b),
        (None, Some(f)) => PlanTarget::Fraction(f),
        (None, None) => PlanTarget::Auto,
    };
    let plan = hprt_swap::plan_offload(&layers, link_gbps, target)?;
    let d = PyDict::new(py);
    d.set_item("offload", plan.offload.clone())?;
    d.set_item("predicted_peak_bytes", plan.predicted_peak_bytes)?;
    d.set_item("unswapped_peak_bytes", plan.unswapped_peak_bytes)?;
    d.set_item("exposed_s", plan.exposed.as_secs_f64())?;
    d.set_item("meets_target", plan.meets_target)?;
    d.set_item("table", plan.table(&layers, link_gbps))?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_offload, m)?)?;
    m.add_class::<PyDeviceTensor>()?;
    m.add_class::<PySwapManager>()?;
    m.add_class::<PySwapContext>()?;
    m.add_class::<PyPacked>()?;
    m.add_class::<PyKeyedSwap>()?;
    m.add_class::<PyTensorKeyManager>()?;
    m.add_class::<PyOffloadTag>()?;
    m.add_class::<PyPipelineOffload>()?;
    m.add_function(wrap_pyfunction!(proportional_slice, m)?)?;
    m.add_function(wrap_pyfunction!(offload_summary_table, m)?)?;
    m.add_function(wrap_pyfunction!(link_summary_table, m)?)?;
    Ok(())
}
