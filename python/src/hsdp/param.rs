//! `ShardedParam` (one rank's view of a sharded parameter: unshard, reshard, gradient
//! accumulation and reduction) and the `UnshardHandle` its asynchronous all-gather returns.

use super::*;

/// A started all-gather (what `ShardedParam.unshard(async_op=True)` returns); wait for it with
/// `ShardedParam.wait_for_unshard()`.
#[pyclass(name = "UnshardHandle", module = "hprt._native", frozen)]
pub struct PyUnshardHandle {
    p: PlatformHandle,
    h: UnshardHandle,
}

#[pymethods]
impl PyUnshardHandle {
    /// Whether the all-gather (and the copies after it) finished.
    fn is_complete(&self) -> Result<bool> {
        Ok(self.h.is_complete(&*self.p)?)
    }
    /// Recorded on the all-gather stream once the gathered parameter is complete.
    #[getter]
    fn event(&self) -> PyEvent {
        PyEvent {
            p: self.p.clone(),
            e: self.h.event().clone(),
        }
    }
}

struct ParamInner {
    param: ShardedParam,
    /// The gradient an issued reduction may still read directly; kept until it was applied.
    reducing: Option<DeviceBuffer>,
    /// The sharded gradient's device buffer as last handed to Python (a view or a
    /// `DeviceTensor`): `free_grad` releases it even after `clear_grad` hid it.
    grad_out: Option<DeviceBuffer>,
}

/// One rank's view of a sharded parameter (hyper_parallel's `HSDPParam`): FSDP on a 1-D mesh, HSDP on
/// a 2-D one; uneven dims padded; parameters below `threshold` elements stay replicated.
///
/// ```python
/// cache = hprt.GroupCache(comm)
/// streams = hprt.HsdpStreams(p)
/// dp = hprt.DataParallelMesh.fsdp(hprt.DeviceMesh([world]))
/// w = hprt.ShardedParam(cache, streams, dp, "w", numpy_weight)
/// h = w.unshard(async_op=True)      # prefetch
/// w.wait_for_unshard()              # the compute stream orders after the all-gather
/// full = w.unsharded()              # DeviceTensor of the whole parameter
/// w.shard()
/// w.reduce_grad(numpy_grad, op="avg")
/// g = w.read_sharded_grad()
/// ```
#[pyclass(name = "ShardedParam", module = "hprt._native", frozen)]
pub struct PyShardedParam {
    p: PlatformHandle,
    inner: Mutex<ParamInner>,
}

impl PyShardedParam {
    fn with<R>(&self, f: impl FnOnce(&ShardedParam) -> R) -> R {
        f(&lock(&self.inner).param)
    }

    /// `shard()`: releases the gathered parameter unless a DLPack export of it is alive (only
    /// while unsharded can it be exported: `unsharded()`).
    fn release_unsharded(&self, py: Python<'_>, op: &str) -> Result<()> {
        py.detach(|| {
            let mut g = lock(&self.inner);
            let bufs: Vec<Backing> = match g.param.unsharded() {
                Ok(full) => vec![Backing::Device(full.mem.clone())],
                Err(_) => Vec::new(),
            };
            unexported(&bufs, op, || Ok(g.param.shard()?))
        })
    }

    /// A shard-shaped view of `r` (the shard or the sharded gradient).
    fn shard_view(&self, param: &ShardedParam, r: ShardRef<'_>) -> Result<TensorView> {
        let shape = param.geometry().shard_shape();
        match r {
            ShardRef::Device(b) => {
                TensorView::of_device(&self.p, b.mem, param.dtype(), shape, b.offset)
            }
            ShardRef::Pinned(h) => TensorView::of_pinned(&self.p, h, param.dtype(), shape, 0),
        }
    }

    /// `r` as a shard-shaped `DeviceTensor` when it is device memory.
    fn device_tensor(
        &self,
        param: &ShardedParam,
        r: ShardRef<'_>,
    ) -> Result<Option<PyDeviceTensor>> {
        match r {
            ShardRef::Device(b) => PyDeviceTensor::from_parts(
                &self.p,
                b.mem.clone(),
                b.offset,
                param.dtype(),
                param.geometry().shard_shape(),
                false,
            )
            .map(Some),
            ShardRef::Pinned(_) => Ok(None),
        }
    }

    /// Starts the reduce-scatter of `grad` (and with `all_reduce` the all-reduce across
    /// replicas), keeping `grad`'s memory until the reduction is applied.
    fn start_reduce(
        &self,
        py: Python<'_>,
        grad: Option<&Bound<'_, PyAny>>,
        op: &str,
        scale: Option<f64>,
        all_reduce: bool,
    ) -> Result<()> {
        let g = grad.map(|g| tensor_arg(&self.p, g)).transpose()?;
        let opts = ReduceOptions {
            op: op.parse()?,
            scale,
        };
        py.detach(|| {
            let mut inner = lock(&self.inner);
            let input = g.as_ref().map(GradInput::from);
            let w = &mut inner.param;
            w.reduce_scatter_grad(input, opts)?;
            if all_reduce {
                w.all_reduce_grad()?;
            }
            inner.reducing = g.map(|g| g.storage);
            Ok(())
        })
    }

    /// The bytes of `r` once the compute stream's work so far completed.
    fn read_shard_ref(p: &dyn Platform, param: &ShardedParam, r: ShardRef<'_>) -> Result<Vec<u8>> {
        let n = param.geometry().shard_numel() * param.dtype().size();
        let mut out = vec![0u8; n];
        let cs = &param.streams().compute;
        match r {
            ShardRef::Device(b) => p.read_device_sync(b.mem, b.offset, &mut out, cs)?,
            ShardRef::Pinned(h) => {
                p.synchronize_stream(cs)?;
                h.read(0, &mut out)?;
            }
        }
        Ok(out)
    }
}

#[pymethods]
impl PyShardedParam {
    /// Shards `full` (the whole local parameter: a `DeviceTensor` or a host DLPack tensor,
    /// identical on every rank) and keeps this rank's shard. Collective over the cache's world:
    /// every rank creates its parameters in the same order.
    ///
    /// `shard_dim` is the data-parallel `Shard(dim)`; `offload_policy` is `"none"` or
    /// `"pinned_host"` (the shard and its gradient live in pinned host memory).
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (cache, streams, dp_mesh, name, full, *, shard_dim=0, mp_policy=None, offload_policy="none", threshold=0))]
    fn new(
        py: Python<'_>,
        cache: &PyGroupCache,
        streams: &PyHsdpStreams,
        dp_mesh: &PyDataParallelMesh,
        name: &str,
        full: &Bound<'_, PyAny>,
        shard_dim: usize,
        mp_policy: Option<&PyMixedPrecisionPolicy>,
        offload_policy: &str,
        threshold: usize,
    ) -> Result<Self> {
        let full = tensor_arg(cache.cache.platform(), full)?;
        let config = ParamConfig {
            shard: Some(Placement::Shard(shard_dim)),
            mp: mp_policy.map(|m| m.mp).unwrap_or_default(),
            offload: offload_policy.parse()?,
            threshold,
        };
        let spec = ParamSpec::new(name, &full.shape, full.dtype);
        let numel_bytes = dtype::nbytes(full.dtype, &full.shape)?;
        if numel_bytes > full.len {
            return Err(invalid(format!(
                "the tensor spans {} bytes, its shape needs {numel_bytes}",
                full.len
            )));
        }
        let dp = &dp_mesh.dp;
        let s = &streams.s;
        let param = py.detach(|| {
            ShardedParam::new(
                &cache.cache,
                s,
                dp,
                spec,
                &config,
                full.storage.at(full.offset),
            )
        })?;
        Ok(PyShardedParam {
            p: cache.cache.platform().clone(),
            inner: Mutex::new(ParamInner {
                param,
                reducing: None,
                grad_out: None,
            }),
        })
    }

    #[getter]
    fn name(&self) -> String {
        self.with(|w| w.name().to_string())
    }
    /// `"sharded"`, `"unsharding"` (an all-gather not yet waited for) or `"unsharded"`.
    #[getter]
    fn state(&self) -> &'static str {
        self.with(|w| w.state().name())
    }
    /// The dtype of the stored shard and the sharded gradient.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.with(|w| w.dtype().name())
    }
    /// The dtype of the all-gather and the unsharded parameter.
    #[getter]
    fn param_dtype(&self) -> &'static str {
        self.with(|w| w.param_dtype().name())
    }
    /// The dtype gradients are accumulated and reduced in.
    #[getter]
    fn reduce_dtype(&self) -> &'static str {
        self.with(|w| w.reduce_dtype().name())
    }
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.with(|w| w.geometry().shape().to_vec())
    }
    /// The shard's shape, padding included.
    #[getter]
    fn shard_shape(&self) -> Vec<usize> {
        self.with(|w| w.geometry().shard_shape())
    }
    #[getter]
    fn shard_dim(&self) -> usize {
        self.with(|w| w.geometry().dim())
    }
    /// Elements of the shard, padding included.
    #[getter]
    fn shard_numel(&self) -> usize {
        self.with(|w| w.geometry().shard_numel())
    }
    /// This rank's shard index and the number of shards.
    #[getter]
    fn shard_index(&self) -> usize {
        self.with(|w| w.geometry().index())
    }
    #[getter]
    fn group_size(&self) -> usize {
        self.with(|w| w.geometry().group_size())
    }
    /// Rows of the sharded dim that hold data in shard `k` (the rest is padding).
    fn valid_rows(&self, k: usize) -> usize {
        self.with(|w| w.geometry().valid_rows(k))
    }
    /// Whether data parallelism shards this parameter (false for DDP and below the threshold).
    #[getter]
    fn is_sharded_param(&self) -> bool {
        self.with(|w| w.is_sharded_param())
    }
    /// The global ranks the parameter is gathered from and its gradient reduce-scattered over.
    #[getter]
    fn sharded_group_ranks(&self) -> Vec<usize> {
        self.with(|w| w.groups().sharded.ranks().to_vec())
    }
    /// The global ranks the reduce-scattered gradient is all-reduced over (HSDP's replicas).
    #[getter]
    fn unsharded_group_ranks(&self) -> Vec<usize> {
        self.with(|w| w.groups().unsharded.ranks().to_vec())
    }
    #[getter]
    fn offload_policy(&self) -> &'static str {
        self.with(|w| match w.sharded_data() {
            ShardRef::Device(_) => OffloadPolicy::None,
            ShardRef::Pinned(_) => OffloadPolicy::PinnedHost,
        })
        .name()
    }
    #[getter]
    fn reduce_pending(&self) -> bool {
        self.with(|w| w.reduce_pending())
    }

    /// Starts the all-gather of the full parameter. With `async_op` it returns an
    /// `UnshardHandle` to wait on later (prefetch); without, it waits itself (in stream order)
    /// and returns `None`. A no-op returning `None` while unsharding or unsharded.
    #[pyo3(signature = (async_op=false))]
    fn unshard(&self, py: Python<'_>, async_op: bool) -> Result<Option<PyUnshardHandle>> {
        let h = py.detach(|| lock(&self.inner).param.unshard(async_op))?;
        Ok(h.map(|h| PyUnshardHandle {
            p: self.p.clone(),
            h,
        }))
    }
    /// Orders the compute stream after the pending all-gather (the host does not block).
    fn wait_for_unshard(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| lock(&self.inner).param.wait_for_unshard())?)
    }
    /// Back to sharded; the gathered storage is released. Refused (`BufferExportedError`, the
    /// parameter stays unsharded) while a DLPack export of the gathered parameter is alive.
    fn shard(&self, py: Python<'_>) -> Result<()> {
        self.release_unsharded(py, "shard")
    }
    /// hyper_parallel's name for `shard()`.
    fn to_sharded(&self, py: Python<'_>) -> Result<()> {
        self.release_unsharded(py, "to_sharded")
    }
    /// Unsharded from any state (an all-gather is started if none is pending), the compute
    /// stream ordered after it.
    fn to_unsharded(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| lock(&self.inner).param.to_unsharded())?)
    }
    /// Sizes the all-gather output to full capacity (`unshard` does this itself).
    fn alloc_all_gather_outputs(&self) -> Result<()> {
        Ok(lock(&self.inner).param.alloc_all_gather_outputs()?)
    }
    /// Releases the all-gather output; only while sharded (`shard()` calls it).
    fn free_unsharded_param(&self) -> Result<()> {
        Ok(lock(&self.inner).param.free_unsharded_param()?)
    }
    /// The full parameter in `param_dtype`, valid in compute-stream order while unsharded.
    /// Its memory is released by `shard()`: read it (or export it by DLPack) before that.
    fn unsharded(&self) -> Result<PyDeviceTensor> {
        let g = lock(&self.inner);
        let w = &g.param;
        let full = w.unsharded()?;
        PyDeviceTensor::from_parts(
            &self.p,
            full.mem.clone(),
            full.offset,
            w.param_dtype(),
            w.geometry().shape().to_vec(),
            true,
        )
    }
    /// The bytes of the full parameter once the compute stream's work so far completed.
    fn read_unsharded<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyBytes>> {
        let bytes = py.detach(|| -> Result<Vec<u8>> {
            let g = lock(&self.inner);
            let w = &g.param;
            let full = w.unsharded()?;
            let mut out = vec![0u8; w.geometry().numel() * w.param_dtype().size()];
            self.p
                .read_device_sync(full.mem, full.offset, &mut out, &w.streams().compute)?;
            Ok(out)
        })?;
        py_bytes(py, &bytes, "the parameter's bytes")
    }

    /// This rank's shard as a DLPack view (`shard_shape`, `dtype`; device memory of the cpu
    /// backend, or pinned memory under the offload policy). Synchronize the compute stream
    /// before reading or writing it on the host.
    fn sharded_data(&self) -> Result<TensorView> {
        let g = lock(&self.inner);
        let w = &g.param;
        self.shard_view(w, w.sharded_data())
    }
    /// This rank's shard as a `DeviceTensor` over hprt's device memory, for stream-ordered
    /// copies to and from memory torch allocated (`Platform.copy`); `None` under the offload
    /// policy, where the shard is pinned host memory (`sharded_data()`).
    fn sharded_device_tensor(&self) -> Result<Option<PyDeviceTensor>> {
        let g = lock(&self.inner);
        let w = &g.param;
        self.device_tensor(w, w.sharded_data())
    }
    /// The shard's bytes once the compute stream's work so far completed.
    fn read_sharded<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyBytes>> {
        let bytes = py.detach(|| {
            let g = lock(&self.inner);
            let w = &g.param;
            Self::read_shard_ref(&*self.p, w, w.sharded_data())
        })?;
        py_bytes(py, &bytes, "the parameter's bytes")
    }
    /// Replaces the shard (e.g. after an optimizer step on the host), in compute-stream order.
    fn write_sharded(&self, py: Python<'_>, data: &Bound<'_, PyBytes>) -> Result<()> {
        let data = data.as_bytes().to_vec();
        py.detach(|| {
            let g = lock(&self.inner);
            let w = &g.param;
            let n = w.geometry().shard_numel() * w.dtype().size();
            if data.len() != n {
                return Err(invalid(format!(
                    "the shard holds {n} bytes, {} were given",
                    data.len()
                )));
            }
            let cs = &w.streams().compute;
            match w.sharded_data() {
                ShardRef::Device(b) => self.p.write_device_sync(b.mem, b.offset, &data, cs)?,
                ShardRef::Pinned(h) => {
                    self.p.synchronize_stream(cs)?;
                    h.write(0, &data)?;
                }
            }
            Ok(())
        })
    }

    /// Adds an unsharded gradient (the parameter's full shape, any float dtype) into the one
    /// accumulated across micro-batches, on the compute stream.
    fn accumulate_grad(&self, py: Python<'_>, grad: &Bound<'_, PyAny>) -> Result<()> {
        let g = tensor_arg(&self.p, grad)?;
        py.detach(|| {
            let mut inner = lock(&self.inner);
            inner.param.accumulate_grad(GradInput::from(&g))?;
            Ok(())
        })
    }

    /// Reduces the gradient: `grad` (if given) plus whatever was accumulated is
    /// reduce-scattered over the sharded group (`op` = `"sum"` or `"avg"`), all-reduced over the
    /// unsharded group, multiplied by `scale`, and accumulated into the sharded gradient. With
    /// `async_op` it only starts (apply it with `wait_for_reduce()`); `grad` must stay
    /// untouched until then.
    ///
    /// `all_reduce=False` skips the all-reduce across replicas (HSDP micro-batches that only
    /// reduce-scatter).
    #[pyo3(signature = (grad=None, op="avg", scale=None, async_op=false, all_reduce=true))]
    fn reduce_grad(
        &self,
        py: Python<'_>,
        grad: Option<&Bound<'_, PyAny>>,
        op: &str,
        scale: Option<f64>,
        async_op: bool,
        all_reduce: bool,
    ) -> Result<()> {
        self.start_reduce(py, grad, op, scale, all_reduce)?;
        if !async_op {
            self.wait_for_reduce(py)?;
        }
        Ok(())
    }
    /// hyper_parallel's first half of `reduce_grad`: starts the reduce-scatter of `grad` (plus
    /// the accumulated gradient) over the sharded group; `all_reduce_grad()` may follow, then
    /// `wait_for_reduce()`. `grad` must stay untouched until then.
    #[pyo3(signature = (grad=None, op="avg", scale=None))]
    fn reduce_scatter_grad(
        &self,
        py: Python<'_>,
        grad: Option<&Bound<'_, PyAny>>,
        op: &str,
        scale: Option<f64>,
    ) -> Result<()> {
        self.start_reduce(py, grad, op, scale, false)
    }
    /// hyper_parallel's second half: all-reduces the reduce-scattered gradient across the
    /// replicas (HSDP); a no-op without replicas.
    fn all_reduce_grad(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| lock(&self.inner).param.all_reduce_grad())?)
    }
    /// Orders the compute stream after the pending reduction and accumulates its result into
    /// the sharded gradient.
    fn wait_for_reduce(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| {
            let mut inner = lock(&self.inner);
            inner.param.wait_for_reduce()?;
            inner.reducing = None;
            Ok(())
        })
    }
    /// The sharded gradient as a DLPack view (like `sharded_data()`), `None` before the first
    /// reduction.
    fn sharded_grad(&self) -> Result<Option<TensorView>> {
        let mut g = lock(&self.inner);
        let out = match g.param.sharded_grad() {
            Some(ShardRef::Device(b)) => Some(b.mem.clone()),
            _ => None,
        };
        if out.is_some() {
            g.grad_out = out;
        }
        let w = &g.param;
        w.sharded_grad().map(|r| self.shard_view(w, r)).transpose()
    }
    /// The sharded gradient as a `DeviceTensor` (like `sharded_device_tensor()`); `None`
    /// before the first reduction and under the offload policy.
    fn sharded_grad_device_tensor(&self) -> Result<Option<PyDeviceTensor>> {
        let mut g = lock(&self.inner);
        if let Some(ShardRef::Device(b)) = g.param.sharded_grad() {
            let b = b.mem.clone();
            g.grad_out = Some(b);
        }
        let w = &g.param;
        match w.sharded_grad() {
            Some(r) => self.device_tensor(w, r),
            None => Ok(None),
        }
    }
    /// The sharded gradient's bytes once the compute stream's work so far completed (`None`
    /// before the first reduction).
    fn read_sharded_grad<'py>(&self, py: Python<'py>) -> Result<Option<Bound<'py, PyBytes>>> {
        let bytes = py.detach(|| {
            let g = lock(&self.inner);
            let w = &g.param;
            w.sharded_grad()
                .map(|r| Self::read_shard_ref(&*self.p, w, r))
                .transpose()
        })?;
        bytes
            .map(|b| py_bytes(py, &b, "the gradient's bytes"))
            .transpose()
    }
    /// Forgets the sharded gradient (the next reduction starts a new one).
    fn clear_grad(&self) -> Result<()> {
        Ok(lock(&self.inner).param.clear_grad()?)
    }
    /// Releases the sharded gradient's storage too; refused (`BufferExportedError`) while a
    /// DLPack export of it is alive.
    fn free_grad(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| {
            let mut g = lock(&self.inner);
            let mut bufs: Vec<Backing> = g.grad_out.iter().cloned().map(Backing::Device).collect();
            if let Some(ShardRef::Device(b)) = g.param.sharded_grad() {
                bufs.push(Backing::Device(b.mem.clone()));
            }
            unexported(&bufs, "free_grad", || Ok(g.param.free_grad()?))?;
            g.grad_out = None;
            Ok(())
        })
    }
    /// Aborts this rank's communicators of the parameter's groups (sharded and replica,
    /// shared by every parameter over the same ranks; one ended already is skipped): a peer
    /// waiting for this rank in a collective over them fails at once instead of at the
    /// collective timeout (`Platform::abort_comm`: not on npu, where HCCL has no abort). What
    /// a failed rank does (`hprt.torch.run_on_ranks`); collectives of these groups fail
    /// afterwards.
    fn destroy_groups(&self, py: Python<'_>) -> Result<()> {
        let comms: Vec<hprt_platform::Communicator> = self.with(|w| {
            let g = w.groups();
            let partial = g.partial.iter().map(|(group, _)| group);
            [&g.sharded, &g.unsharded]
                .into_iter()
                .chain(partial)
                .filter_map(|group| group.communicator().cloned())
                .collect()
        });
        py.detach(|| {
            for c in &comms {
                match self.p.abort_comm(c) {
                    Err(e) if e.kind != hprt_platform::ErrorKind::InvalidHandle => {
                        return Err(e.into())
                    }
                    _ => {}
                }
            }
            Ok(())
        })
    }
    fn __repr__(&self) -> String {
        self.with(|w| {
            format!(
                "ShardedParam({:?}, shape={:?}, {}, shard {} of {})",
                w.name(),
                w.geometry().shape(),
                w.state().name(),
                w.geometry().index(),
                w.geometry().group_size()
            )
        })
    }
}
