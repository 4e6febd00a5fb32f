//! hsdp bindings: `DeviceMesh`, the n-D grid of ranks with named dims.

use hprt_hsdp::DeviceMesh;
use pyo3::prelude::*;

use crate::error::Result;

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
    m.add_class::<PyDeviceMesh>()
}
