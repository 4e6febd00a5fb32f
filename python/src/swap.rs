//! The three hprt-swap front ends on hprt device memory: `SwapManager` (hyper_parallel layer groups),
//! `KeyedSwap` (keyed pack/unpack), `PipelineOffload` (Megatron-LM chunked groups), and
//! `DeviceTensor`, the tensor description they take.
//!
//! This file holds `DeviceTensor`'s methods (its data is in [`crate::handles`]), the conversions and helpers the front ends share, and the
//! planning and summary functions; each front end is one file: `swap/layer_group.rs`
//! (`SwapManager`), `swap/keyed.rs` (`KeyedSwap`), `swap/pipeline.rs` (`PipelineOffload`).

use hprt_platform::sync::lock;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hprt_platform::{DType, DeviceBuffer};
use hprt_swap::{
    Compression, DeviceTensor, InflightWindow, KeyedSwap, LayerProfile, OffloadTag, Packed,
    PipelineConfig, PipelineOffload, PlanTarget, PlatformHandle, PoolConfig, Saved, SavedRef,
    SwapContext, SwapEngine, SwapManager, TensorKey, TensorKeyManager,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::borrowed::{handle_object, PyBorrowedTensor};
use crate::dlpack::{unexported, Backing, TensorView};
use crate::error::{invalid, BindError, Result};
use crate::handles::{PyDeviceBuffer, PyDeviceTensor, PyPlatform, PyStream};

mod keyed;
mod layer_group;
mod pipeline;
pub use keyed::{proportional_slice, PyKeyedSwap, PyPacked, PySwapContext, PyTensorKeyManager};
pub use layer_group::PySwapManager;
pub use pipeline::{PyOffloadTag, PyPipelineOffload};

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
    /// The export of its view, with `TensorView.__dlpack__`'s keywords and checks.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        self.view()?
            .__dlpack__(py, stream, max_version, dl_device, copy)
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

/// The engine settings the keyed and layer-group front ends take from their constructors'
/// keywords, and the DLPack export guard on every release.
fn configure(engine: &mut SwapEngine, compression: Compression, window: InflightWindow) {
    engine.set_compression(compression);
    engine.set_window(window);
    engine.set_release_guard(Some(Arc::new(NoLiveExports)));
}

/// The engine's in-flight bounds from the constructors' and `set_window`'s keywords.
fn window(offload_bytes: Option<usize>, reload_bytes: Option<usize>) -> InflightWindow {
    InflightWindow {
        offload_bytes,
        reload_bytes,
    }
}

// The settings every front end's Python class exposes alike; each method locks its front end
// and hands these its engine.

fn set_window(engine: &mut SwapEngine, offload_bytes: Option<usize>, reload_bytes: Option<usize>) {
    engine.set_window(window(offload_bytes, reload_bytes));
}

fn set_compression(engine: &mut SwapEngine, compression: &str) -> Result<()> {
    engine.set_compression(compression.parse::<Compression>()?);
    Ok(())
}

fn set_compression_policy(engine: &mut SwapEngine, p: &PlatformHandle, policy: Option<Py<PyAny>>) {
    engine.set_compression_policy(py_policy(p, policy));
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
