//! hsdp bindings: `DeviceMesh`, `DataParallelMesh` (FSDP / HSDP / DDP), `GroupCache` and
//! `ProcessGroup`, `HsdpStreams`, `MixedPrecisionPolicy`, and `ShardedParam` with its
//! `UnshardHandle`.
//!
//! Ranks are whatever the platform's communicators connect: on the cpu backend, Python threads
//! that each call `Platform.comm_init`. Each rank builds one `GroupCache` over its world
//! communicator and its parameters in the same order as every other rank; every call that can
//! wait for the other ranks (sub-communicator splits) releases the GIL.
//!
//! This file holds the meshes, groups, streams and precision policy; `ShardedParam` and its
//! `UnshardHandle` are in `hsdp/param.rs`.

use hprt_platform::sync::lock;
use std::sync::Mutex;

use hprt_hsdp::{
    DataParallelMesh, DeviceMesh, GradInput, GroupCache, HsdpStreams, MixedPrecisionPolicy,
    OffloadPolicy, ParamConfig, ParamSpec, Placement, ProcessGroup, ReduceOptions, ShardRef,
    ShardedParam, UnshardHandle,
};
use hprt_platform::{DType, DeviceBuffer, Platform, TensorRef};
use hprt_swap::PlatformHandle;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::dlpack::{unexported, Backing, TensorView};
use crate::dtype;
use crate::error::{invalid, py_bytes, Result};
use crate::handles::{resolve, PyCommunicator, PyDeviceTensor, PyEvent, PyPlatform, PyStream};

mod param;
pub use param::{PyShardedParam, PyUnshardHandle};

fn opt_dtype(name: Option<&str>) -> Result<Option<DType>> {
    Ok(name.map(str::parse).transpose()?)
}

/// A tensor argument (where it lies: hsdp keeps no swap state): an hprt `DeviceTensor`, or a
/// DLPack producer (numpy array, torch tensor) whose memory this platform can address, borrowed
/// without a copy.
fn tensor_arg(p: &PlatformHandle, obj: &Bound<'_, PyAny>) -> Result<TensorRef> {
    if let Ok(t) = obj.cast::<PyDeviceTensor>() {
        return Ok(t.get().t.tensor.clone());
    }
    let platform = PyPlatform { p: p.clone() };
    Ok(crate::dlpack::import(&platform, obj, false)?.t.tensor)
}

/// The data-parallel mesh and the role of its dims: `DataParallelMesh.fsdp(mesh)` (1-D, shard),
/// `.hsdp(mesh)` (2-D, dim 0 replicates, dim 1 shards) or `.ddp(mesh)` (1-D, replicate).
#[pyclass(name = "DataParallelMesh", module = "hprt._native", frozen)]
pub struct PyDataParallelMesh {
    dp: DataParallelMesh,
}

#[pymethods]
impl PyDataParallelMesh {
    #[staticmethod]
    fn fsdp(mesh: &PyDeviceMesh) -> Result<Self> {
        Ok(PyDataParallelMesh {
            dp: DataParallelMesh::fsdp(mesh.m.clone())?,
        })
    }
    #[staticmethod]
    fn hsdp(mesh: &PyDeviceMesh) -> Result<Self> {
        Ok(PyDataParallelMesh {
            dp: DataParallelMesh::hsdp(mesh.m.clone())?,
        })
    }
    #[staticmethod]
    fn ddp(mesh: &PyDeviceMesh) -> Result<Self> {
        Ok(PyDataParallelMesh {
            dp: DataParallelMesh::ddp(mesh.m.clone())?,
        })
    }
    /// `"fsdp"`, `"hsdp"` or `"ddp"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match (&self.dp, self.dp.replicate_dim()) {
            (DataParallelMesh::Replicated { .. }, _) => "ddp",
            (_, Some(_)) => "hsdp",
            (_, None) => "fsdp",
        }
    }
    #[getter]
    fn mesh(&self) -> PyDeviceMesh {
        PyDeviceMesh {
            m: self.dp.mesh().clone(),
        }
    }
    #[getter]
    fn shard_size(&self) -> usize {
        self.dp.shard_size()
    }
    #[getter]
    fn replicate_size(&self) -> usize {
        self.dp.replicate_size()
    }
    fn __repr__(&self) -> String {
        format!(
            "DataParallelMesh.{}(shape={:?})",
            self.kind(),
            self.dp.mesh().shape()
        )
    }
}

/// One rank's membership in a group (its rank within it is its shard index).
#[pyclass(name = "ProcessGroup", module = "hprt._native", frozen)]
pub struct PyProcessGroup {
    p: PlatformHandle,
    g: ProcessGroup,
}

#[pymethods]
impl PyProcessGroup {
    #[getter]
    fn name(&self) -> &str {
        self.g.name()
    }
    #[getter]
    fn size(&self) -> usize {
        self.g.size()
    }
    #[getter]
    fn rank(&self) -> usize {
        self.g.rank()
    }
    /// The members' global ranks, sorted.
    #[getter]
    fn ranks(&self) -> Vec<usize> {
        self.g.ranks().to_vec()
    }
    /// The group of one rank: no communicator, collectives over it are local.
    #[getter]
    fn is_noop(&self) -> bool {
        self.g.is_noop()
    }
    /// The group's communicator (`None` for the no-op group).
    #[getter]
    fn communicator(&self) -> Option<PyCommunicator> {
        self.g.communicator().map(|c| PyCommunicator {
            p: self.p.clone(),
            c: c.clone(),
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "ProcessGroup({:?}, ranks={:?})",
            self.g.name(),
            self.g.ranks()
        )
    }
}

/// The sub-communicators one rank made, cached by sorted rank list (`GroupCache(world_comm)`).
/// Every method that may split is collective over the world: all ranks call it in the same
/// order with the same arguments.
#[pyclass(name = "GroupCache", module = "hprt._native", frozen)]
pub struct PyGroupCache {
    cache: GroupCache,
}

#[pymethods]
impl PyGroupCache {
    #[new]
    fn new(world: &PyCommunicator) -> Self {
        PyGroupCache {
            cache: GroupCache::new(world.p.clone(), world.c.clone()),
        }
    }
    #[getter]
    fn rank(&self) -> usize {
        self.cache.rank()
    }
    #[getter]
    fn world_size(&self) -> usize {
        self.cache.world_size()
    }
    /// How many `comm_split` calls the cache made (cache hits make none).
    #[getter]
    fn split_calls(&self) -> usize {
        self.cache.split_calls()
    }
    /// The group among `rank_lists` holding this rank (the no-op group when none does or its
    /// list has one rank). Collective over the world.
    fn group(
        &self,
        py: Python<'_>,
        name: &str,
        rank_lists: Vec<Vec<usize>>,
    ) -> Result<PyProcessGroup> {
        let g = py.detach(|| self.cache.group(name, &rank_lists))?;
        Ok(PyProcessGroup {
            p: self.cache.platform().clone(),
            g,
        })
    }
    /// This rank's group along `axes` of `mesh`. Collective over the world.
    fn group_along(
        &self,
        py: Python<'_>,
        name: &str,
        mesh: &PyDeviceMesh,
        axes: Vec<usize>,
    ) -> Result<PyProcessGroup> {
        let g = py.detach(|| self.cache.group_along(name, &mesh.m, &axes))?;
        Ok(PyProcessGroup {
            p: self.cache.platform().clone(),
            g,
        })
    }
}

/// The three streams one rank's parameters use: `compute` (forward, backward, optimizer),
/// `all_gather` and `reduce`.
#[pyclass(name = "HsdpStreams", module = "hprt._native", frozen)]
pub struct PyHsdpStreams {
    p: PlatformHandle,
    s: HsdpStreams,
}

#[pymethods]
impl PyHsdpStreams {
    /// New streams of `platform` (the process-wide one by default); `compute` may be an
    /// existing stream (a framework's, wrapped with `Platform.unsafe_wrap_stream`).
    #[new]
    #[pyo3(signature = (platform=None, compute=None))]
    fn new(platform: Option<&PyPlatform>, compute: Option<&PyStream>) -> Result<Self> {
        let p = resolve(platform)?;
        let s = match compute {
            Some(c) => HsdpStreams::with_compute(&*p, c.s.clone())?,
            None => HsdpStreams::new(&*p)?,
        };
        Ok(PyHsdpStreams { p, s })
    }
    #[getter]
    fn compute(&self) -> PyStream {
        self.stream(&self.s.compute)
    }
    #[getter]
    fn all_gather(&self) -> PyStream {
        self.stream(&self.s.all_gather)
    }
    #[getter]
    fn reduce(&self) -> PyStream {
        self.stream(&self.s.reduce)
    }
}

impl PyHsdpStreams {
    fn stream(&self, s: &hprt_platform::Stream) -> PyStream {
        PyStream {
            p: self.p.clone(),
            s: s.clone(),
        }
    }
}

/// Which dtypes a sharded parameter communicates and computes in; `None` keeps the stage
/// before's (the parameter's dtype for `param_dtype`, `param_dtype` for `reduce_dtype`).
///
/// ```python
/// mp = hprt.MixedPrecisionPolicy(param_dtype="bf16", reduce_dtype="f32")
/// ```
#[pyclass(name = "MixedPrecisionPolicy", module = "hprt._native", frozen)]
pub struct PyMixedPrecisionPolicy {
    mp: MixedPrecisionPolicy,
}

#[pymethods]
impl PyMixedPrecisionPolicy {
    #[new]
    #[pyo3(signature = (param_dtype=None, reduce_dtype=None, output_dtype=None))]
    fn new(
        param_dtype: Option<&str>,
        reduce_dtype: Option<&str>,
        output_dtype: Option<&str>,
    ) -> Result<Self> {
        Ok(PyMixedPrecisionPolicy {
            mp: MixedPrecisionPolicy {
                param_dtype: opt_dtype(param_dtype)?,
                reduce_dtype: opt_dtype(reduce_dtype)?,
                output_dtype: opt_dtype(output_dtype)?,
            },
        })
    }
    #[getter]
    fn param_dtype(&self) -> Option<&'static str> {
        self.mp.param_dtype.map(DType::name)
    }
    #[getter]
    fn reduce_dtype(&self) -> Option<&'static str> {
        self.mp.reduce_dtype.map(DType::name)
    }
    #[getter]
    fn output_dtype(&self) -> Option<&'static str> {
        self.mp.output_dtype.map(DType::name)
    }
    /// `output` cast to the output dtype (a copy when there is none) in new device memory, on
    /// `stream`.
    fn cast_output(&self, output: &PyDeviceTensor, stream: &PyStream) -> Result<PyDeviceTensor> {
        let (p, src) = (&output.p, &output.t);
        let numel = src.shape.iter().product::<usize>();
        let dst_dtype = self.mp.output_dtype.unwrap_or(src.dtype);
        let dst = p.alloc_device(dtype::nbytes(dst_dtype, &src.shape)?)?;
        self.mp.cast_output(
            &**p,
            src.storage.at(src.offset),
            src.dtype,
            dst.at(0),
            numel,
            &stream.s,
        )?;
        PyDeviceTensor::from_parts(p, dst, 0, dst_dtype, src.shape.clone(), false)
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.mp)
    }
}

/// An n-D grid of ranks (`DeviceMesh([2, 4], dim_names=["dp", "fsdp"])`).
#[pyclass(name = "DeviceMesh", module = "hprt._native", frozen)]
pub struct PyDeviceMesh {
    m: DeviceMesh,
}

#[pymethods]
impl PyDeviceMesh {
    /// `ranks` defaults to `0..prod(shape)` in row-major order.
    #[new]
    #[pyo3(signature = (shape, ranks=None, dim_names=None))]
    fn new(
        shape: Vec<usize>,
        ranks: Option<Vec<usize>>,
        dim_names: Option<Vec<String>>,
    ) -> Result<Self> {
        let mut m = match ranks {
            Some(r) => DeviceMesh::new(&shape, r)?,
            None => DeviceMesh::contiguous(&shape)?,
        };
        if let Some(names) = dim_names {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            m = m.with_dim_names(&names)?;
        }
        Ok(PyDeviceMesh { m })
    }
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.m.shape().to_vec()
    }
    #[getter]
    fn ndim(&self) -> usize {
        self.m.ndim()
    }
    #[getter]
    fn size(&self) -> usize {
        self.m.size()
    }
    #[getter]
    fn ranks(&self) -> Vec<usize> {
        self.m.ranks().to_vec()
    }
    #[getter]
    fn dim_names(&self) -> Option<Vec<String>> {
        self.m.dim_names().map(<[String]>::to_vec)
    }
    fn __contains__(&self, rank: usize) -> bool {
        self.m.contains(rank)
    }
    fn dim_index(&self, name: &str) -> Result<usize> {
        Ok(self.m.dim_index(name)?)
    }
    fn coords_of(&self, rank: usize) -> Option<Vec<usize>> {
        self.m.coords_of(rank)
    }
    fn rank_at(&self, coords: Vec<usize>) -> Result<usize> {
        Ok(self.m.rank_at(&coords)?)
    }
    /// The ranks that share `rank`'s coordinates off `axes` (its group along those axes).
    fn rank_list_for_axes(&self, rank: usize, axes: Vec<usize>) -> Result<Vec<usize>> {
        Ok(self.m.rank_list_for_axes(rank, &axes)?)
    }
    /// Every group along `axes` (the rank lists a `comm_split` takes).
    fn split_rank_lists_for_axes(&self, axes: Vec<usize>) -> Result<Vec<Vec<usize>>> {
        Ok(self.m.split_rank_lists_for_axes(&axes)?)
    }
    fn submesh(&self, rank: usize, axes: Vec<usize>) -> Result<PyDeviceMesh> {
        Ok(PyDeviceMesh {
            m: self.m.submesh(rank, &axes)?,
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "DeviceMesh(shape={:?}, ranks={:?})",
            self.m.shape(),
            self.m.ranks()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDeviceMesh>()?;
    m.add_class::<PyDataParallelMesh>()?;
    m.add_class::<PyProcessGroup>()?;
    m.add_class::<PyGroupCache>()?;
    m.add_class::<PyHsdpStreams>()?;
    m.add_class::<PyMixedPrecisionPolicy>()?;
    m.add_class::<PyUnshardHandle>()?;
    m.add_class::<PyShardedParam>()
}
