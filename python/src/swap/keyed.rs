//! `KeyedSwap` (keyed pack/unpack) with its `SwapContext` and `Packed`, and the keys it uses:
//! `TensorKeyManager` and `proportional_slice`.

use super::*;

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
        let p = crate::handles::resolve(platform)?;
        let mut k = KeyedSwap::with_pool(p.clone(), pool(host_budget))?;
        k.set_min_bytes(min_bytes);
        configure(
            k.engine_mut(),
            compression.parse::<Compression>()?,
            window(max_inflight_offload_bytes, max_inflight_reload_bytes),
        );
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
        super::set_window(lock(&self.inner).engine_mut(), offload_bytes, reload_bytes)
    }
    /// Per-tensor compression: `policy(tensor) -> "off" | "device" | "host_stage" | "auto"`.
    fn set_compression_policy(&self, policy: Option<Py<PyAny>>) {
        super::set_compression_policy(lock(&self.inner).engine_mut(), &self.p, policy)
    }
    /// `off`, `device`, `host_stage` or `auto`.
    fn set_compression(&self, compression: &str) -> Result<()> {
        super::set_compression(lock(&self.inner).engine_mut(), compression)
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
