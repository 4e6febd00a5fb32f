//! `SwapManager`: hyper_parallel layer-group swap.

use super::*;

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
        let p = crate::handles::resolve(platform)?;
        let mut m = SwapManager::with_pool(p.clone(), pool(host_budget))?;
        configure(
            m.engine_mut(),
            compression.parse::<Compression>()?,
            window(max_inflight_offload_bytes, max_inflight_reload_bytes),
        );
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
        super::set_window(lock(&self.inner).engine_mut(), offload_bytes, reload_bytes)
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
        super::set_compression(lock(&self.inner).engine_mut(), compression)
    }
    /// Per-tensor compression: `policy(tensor) -> "off" | "device" | "host_stage" | "auto"`
    /// (`None` removes it).
    fn set_compression_policy(&self, policy: Option<Py<PyAny>>) {
        super::set_compression_policy(lock(&self.inner).engine_mut(), &self.p, policy)
    }
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, lock(&self.inner).engine())
    }
}
