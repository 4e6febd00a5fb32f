//! `PipelineOffload` (Megatron-LM chunked pipeline offload) and the `OffloadTag` its `save`
//! returns.

use super::*;

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
        let p = crate::handles::resolve(platform)?;
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
        super::set_window(lock(&self.inner).engine_mut(), offload_bytes, reload_bytes)
    }
    /// Per-tensor compression: `policy(tensor) -> "off" | "device" | "host_stage" | "auto"`.
    fn set_compression_policy(&self, policy: Option<Py<PyAny>>) {
        super::set_compression_policy(lock(&self.inner).engine_mut(), &self.p, policy)
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
