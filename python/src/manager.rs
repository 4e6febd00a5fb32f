//! `hprt.ActivationManager`: hprt-compress's per-layer activation manager (MindSpeed). Saved
//! tensors are registered per layer; during each operator window the previous layer's tensors
//! that fit are encoded on a side stream and their device memory released; in backward the
//! next layer's are decoded in the window, and whatever is still compressed when its layer's
//! backward starts is recovered synchronously.

use hprt_platform::sync::lock;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use hprt_compress::CodecDType;
use hprt_compress::LayerId;
use hprt_compress::{ActivationManager, ManagerConfig, Schedule, TensorKey};
use hprt_compress::{CollectiveKind, CostModel, CostOverrides, CostTable, Op};
use hprt_platform::DType;
use hprt_platform::PlatformHandle;
use hprt_platform::TensorRef;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dtype;
use crate::error::{invalid, Result};
use crate::handles::{PyDeviceTensor, PyPlatform, PyStream};

struct Inner {
    m: ActivationManager,
    /// Dtypes and shapes of the registered tensors (the manager keeps element counts only).
    shapes: HashMap<(usize, usize), (DType, Vec<usize>)>,
}

/// The activation manager of one model replica, driven by the framework's hooks.
///
/// ```python
/// m = hprt.ActivationManager(stream, platform=p, encode_gbps=1.0, decode_gbps=1.0, min_numel=0)
/// m.forward_start(0)
/// key = m.save(0, activation)            # a DeviceTensor or a host DLPack tensor
/// m.forward_start(1)
/// with m.window(fixed_ms=5):             # layer 0's tensors are encoded in this window
///     ...                                # the operator, queued on `stream`
/// m.backward_start(1); m.backward_start(0)
/// back = m.take(key)                     # a DeviceTensor with the original bytes
/// m.layer_stats()[0]["ratio"]
///
/// e = hprt.ActivationManager(stream, platform=p, schedule="eager", decode_ahead=2)
/// keys = [e.save(0, a, borrow=True) for a in activations]   # each encode queued at once
/// backs = [e.take(k) for k in reversed(keys)]                # decodes begun two ahead
/// ```
#[pyclass(name = "ActivationManager", module = "hprt._native", frozen)]
pub struct PyActivationManager {
    p: PlatformHandle,
    compute: hprt_platform::Stream,
    inner: Mutex<Inner>,
}

fn op_of(
    matmul: Option<(usize, usize, usize)>,
    collective: Option<(String, usize, usize)>,
    fixed_ms: Option<f64>,
    unbounded: bool,
) -> Result<Op> {
    let given = matmul.is_some() as u8
        + collective.is_some() as u8
        + fixed_ms.is_some() as u8
        + unbounded as u8;
    if given != 1 {
        return Err(invalid(
            "describe the operator with exactly one of matmul=(m, n, k), \
             collective=(kind, bytes, group), fixed_ms=... or unbounded=True",
        ));
    }
    if unbounded {
        return Ok(Op::Unbounded);
    }
    if let Some((m, n, k)) = matmul {
        return Ok(Op::Matmul { m, n, k });
    }
    if let Some((kind, bytes, group)) = collective {
        let kind = match kind.as_str() {
            "all_gather" => CollectiveKind::AllGather,
            "all_to_all" => CollectiveKind::AllToAll,
            other => {
                return Err(invalid(format!(
                    "unknown collective {other:?}; expected all_gather or all_to_all"
                )))
            }
        };
        return Ok(Op::Collective { kind, bytes, group });
    }
    let ms = fixed_ms.unwrap_or_default();
    let d = Duration::try_from_secs_f64(ms / 1e3)
        .map_err(|_| invalid(format!("fixed_ms={ms} is not a duration")))?;
    Ok(Op::Fixed(d))
}

fn key_of((layer, index): (usize, usize)) -> TensorKey {
    TensorKey::new(layer, index)
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64() * 1e3)
}

impl PyActivationManager {
    fn begin(&self, py: Python<'_>, op: Op) -> Result<()> {
        Ok(py.detach(|| lock(&self.inner).m.begin_window(&op))?)
    }
    /// Ends the window, then warns of each encode that failed in it.
    fn end(&self, py: Python<'_>) -> Result<()> {
        let failures = py.detach(|| {
            let mut inner = lock(&self.inner);
            inner.m.end_window()?;
            Ok::<_, hprt_compress::CompressError>(inner.m.take_encode_failures())
        })?;
        warn_failures(py, failures)
    }

    /// Warns of the encodes that failed in the last call (an eager manager's `save`, `take`
    /// and `discard` finish encodes).
    fn warn_new_failures(&self, py: Python<'_>) -> Result<()> {
        let failures = lock(&self.inner).m.take_encode_failures();
        warn_failures(py, failures)
    }
}

/// A `RuntimeWarning` for each encode that failed: the tensor was kept uncompressed, nothing
/// lost (an "error" warnings filter makes it raise).
fn warn_failures(
    py: Python<'_>,
    failures: Vec<(LayerId, hprt_compress::CompressError)>,
) -> Result<()> {
    let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
    for (layer, err) in failures {
        let message = format!(
            "hprt: a saved tensor's encode failed ({err}); it is kept uncompressed (layer {})",
            layer.0
        );
        let message =
            std::ffi::CString::new(message.replace('\0', " ")).expect("NULs were replaced");
        PyErr::warn(py, category.as_any(), &message, 1)?;
    }
    Ok(())
}

#[pymethods]
impl PyActivationManager {
    /// A manager whose operators run on `stream`. Codec throughputs are measured on the
    /// platform at first use (and `HP_COST_*` overrides applied) unless both `encode_gbps` and
    /// `decode_gbps` are given; `matmul_tflops` and `collective_gbps` let windows of those
    /// operators be predicted. Tensors of `dtypes` (default f32, f16, bf16) with at least
    /// `min_numel` elements are managed.
    ///
    /// `schedule="windows"` (the default) is MindSpeed's: operator windows encode and decode.
    /// `schedule="eager"` has no windows or layer phases: `save` queues each encode after the
    /// work the stream holds, and `take` begins the decodes of the next `decode_ahead` tensors
    /// backward reads (the latest saved first) — what a saved-tensor hook wants.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, platform=None, *, encode_gbps=None, decode_gbps=None, matmul_tflops=None, collective_gbps=None, min_numel=32768, dtypes=None, schedule="windows", decode_ahead=4))]
    fn new(
        py: Python<'_>,
        stream: &PyStream,
        platform: Option<&PyPlatform>,
        encode_gbps: Option<f64>,
        decode_gbps: Option<f64>,
        matmul_tflops: Option<f64>,
        collective_gbps: Option<f64>,
        min_numel: usize,
        dtypes: Option<Vec<String>>,
        schedule: &str,
        decode_ahead: usize,
    ) -> Result<Self> {
        let schedule = match schedule {
            "windows" => Schedule::Windows,
            "eager" => Schedule::Eager { decode_ahead },
            other => {
                return Err(invalid(format!(
                    "unknown schedule {other:?}; expected \"windows\" or \"eager\""
                )))
            }
        };
        let p = match platform {
            Some(p) => p.p.clone(),
            None => stream.p.clone(),
        };
        let mut overrides = CostOverrides::from_env()?;
        for (slot, value, scale) in [
            (&mut overrides.encode_gbps, encode_gbps, 1.0),
            (&mut overrides.decode_gbps, decode_gbps, 1.0),
            (&mut overrides.matmul_flops, matmul_tflops, 1e12),
            (&mut overrides.collective_gbps, collective_gbps, 1.0),
        ] {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return Err(invalid(format!("{v} is not a positive throughput")));
                }
                *slot = Some(v * scale);
            }
        }
        let mut cost = if encode_gbps.is_some() && decode_gbps.is_some() {
            CostModel::from_table(CostTable::default())
        } else {
            let codec = hprt_compress::codec_for(&*p);
            py.detach(|| CostModel::for_platform(&*p, codec.as_ref()))?
        };
        cost.set_overrides(overrides);
        let mut config = ManagerConfig::new(cost);
        config.schedule = schedule;
        config.filter.min_numel = min_numel;
        if let Some(names) = dtypes {
            config.filter.dtypes = names
                .iter()
                .map(|n| Ok(CodecDType::try_from(n.parse::<DType>()?)?))
                .collect::<Result<_>>()?;
        }
        let m = ActivationManager::new(p.clone(), stream.s.clone(), config)?;
        Ok(PyActivationManager {
            p,
            compute: stream.s.clone(),
            inner: Mutex::new(Inner {
                m,
                shapes: HashMap::new(),
            }),
        })
    }

    /// The layer's forward begins; its tensors of the previous step must all have been taken.
    fn forward_start(&self, layer: usize) -> Result<()> {
        Ok(lock(&self.inner).m.forward_start(LayerId(layer))?)
    }

    /// Registers a tensor saved by `layer`; returns its key `(layer, index)`, or `None` when
    /// the filter leaves it to the caller (wrong dtype, below `min_numel`).
    ///
    /// An hprt-allocated `DeviceTensor` at offset 0 is registered as it is (the manager
    /// releases and re-acquires its memory). Anything else (a borrowed buffer, a numpy array or
    /// torch tensor by DLPack) is first copied into new device memory on the stream; a DLPack
    /// source is read before `save` returns. With `borrow=True` a DLPack source or borrowed
    /// buffer at its start is registered as it is instead: no copy, the manager holds it until
    /// it is encoded and then gives it back (its owner must not write it until `take`, which
    /// returns the decoded bytes in new memory) — what an autograd hook wants.
    #[pyo3(signature = (layer, tensor, *, borrow=false))]
    fn save(
        &self,
        py: Python<'_>,
        layer: usize,
        tensor: &Bound<'_, PyAny>,
        borrow: bool,
    ) -> Result<Option<(usize, usize)>> {
        let (t, imported) = match tensor.cast::<PyDeviceTensor>() {
            Ok(t) => (t.get().t.clone(), false),
            Err(_) => {
                let platform = PyPlatform { p: self.p.clone() };
                (crate::dlpack::import(&platform, tensor, false)?.t, true)
            }
        };
        let nbytes = dtype::nbytes(t.dtype, &t.shape)?;
        let buf = if (borrow || !t.storage.is_borrowed()) && t.offset == 0 {
            t.storage.clone()
        } else {
            py.detach(|| -> Result<_> {
                let b = self.p.alloc_device(nbytes)?;
                self.p.copy_async(
                    (&b).into(),
                    0,
                    (&t.storage).into(),
                    t.offset,
                    nbytes,
                    &self.compute,
                )?;
                if imported {
                    // The caller owns that memory again once save returns.
                    self.p.synchronize_stream(&self.compute)?;
                }
                Ok(b)
            })?
        };
        // Field by field: the manager itself refuses a buffer too small for the tensor (one
        // released since it was described) with its own typed error.
        let saved = TensorRef {
            storage: buf,
            offset: 0,
            len: nbytes,
            dtype: t.dtype,
            shape: t.shape.clone(),
        };
        let key = py.detach(|| -> Result<_> {
            let mut g = lock(&self.inner);
            let Some(key) = g.m.save(LayerId(layer), saved)? else {
                return Ok(None);
            };
            let k = (key.layer.0, key.index);
            g.shapes.insert(k, (t.dtype, t.shape.clone()));
            Ok(Some(k))
        })?;
        self.warn_new_failures(py)?;
        Ok(key)
    }

    /// The layer's backward begins: its tensors still compressed are decoded now.
    fn backward_start(&self, py: Python<'_>, layer: usize) -> Result<()> {
        Ok(py.detach(|| lock(&self.inner).m.backward_start(LayerId(layer)))?)
    }

    /// Hands a registered tensor back (decoding it first if needed) as a `DeviceTensor` of its
    /// original dtype and shape, valid in stream order; the manager forgets it. An eager
    /// manager also begins the decodes ahead; a tensor whose encode it has not yet seen finish
    /// comes back as it is (the last one saved, typically: backward's first read).
    fn take(&self, py: Python<'_>, key: (usize, usize)) -> Result<PyDeviceTensor> {
        let (buf, (dtype, shape)) = py.detach(|| -> Result<_> {
            let mut g = lock(&self.inner);
            let buf = g.m.take(key_of(key))?;
            let meta = g.shapes.remove(&key).ok_or_else(|| {
                invalid(format!(
                    "tensor {key:?} was not registered through this binding"
                ))
            })?;
            Ok((buf, meta))
        })?;
        self.warn_new_failures(py)?;
        PyDeviceTensor::from_parts(&self.p, buf, 0, dtype, shape, false)
    }

    /// Forgets a registered tensor that will never be taken (its graph was dropped).
    fn discard(&self, py: Python<'_>, key: (usize, usize)) -> Result<()> {
        py.detach(|| {
            let mut g = lock(&self.inner);
            g.shapes.remove(&key);
            g.m.discard(key_of(key))
        })?;
        self.warn_new_failures(py)
    }

    /// Whether an operator window is open (between `begin_window` and `end_window`; a `take`
    /// of a tensor the window was decoding ends it).
    #[getter]
    fn window_open(&self) -> bool {
        lock(&self.inner).m.window_open()
    }

    /// Whether the tensor is currently held compressed.
    fn is_compressed(&self, key: (usize, usize)) -> bool {
        lock(&self.inner).m.is_compressed(key_of(key))
    }

    /// Opens an operator window before the operator is queued on the stream: predicts its
    /// duration and starts encoding (forward) or decoding (backward) what fits. Exactly one of
    /// `matmul=(m, n, k)`, `collective=("all_gather" | "all_to_all", bytes, group)`, `fixed_ms`,
    /// `unbounded=True` (an operator nobody predicts, a layer's whole forward: every candidate
    /// is coded in it, whatever the measured throughputs).
    #[pyo3(signature = (*, matmul=None, collective=None, fixed_ms=None, unbounded=false))]
    fn begin_window(
        &self,
        py: Python<'_>,
        matmul: Option<(usize, usize, usize)>,
        collective: Option<(String, usize, usize)>,
        fixed_ms: Option<f64>,
        unbounded: bool,
    ) -> Result<()> {
        self.begin(py, op_of(matmul, collective, fixed_ms, unbounded)?)
    }

    /// Closes the window after the operator was queued: the stream waits for the codec work,
    /// encoded originals are released, decoded tensors become usable.
    fn end_window(&self, py: Python<'_>) -> Result<()> {
        self.end(py)
    }

    /// `with manager.window(matmul=(m, n, k)): ...` — `begin_window` / `end_window` around a
    /// block.
    #[pyo3(signature = (*, matmul=None, collective=None, fixed_ms=None, unbounded=false))]
    fn window(
        slf: Py<Self>,
        matmul: Option<(usize, usize, usize)>,
        collective: Option<(String, usize, usize)>,
        fixed_ms: Option<f64>,
        unbounded: bool,
    ) -> Result<PyWindow> {
        Ok(PyWindow {
            manager: slf,
            op: op_of(matmul, collective, fixed_ms, unbounded)?,
        })
    }

    /// Per-layer figures, summed over steps: `{layer: {"saved", "compressed", "original_bytes",
    /// "compressed_bytes", "ratio", "decoded_in_window", "recovered_sync", "decoded_ahead",
    /// "encode_failures"}}` (a failed encode keeps its tensor uncompressed and warns when its
    /// window ends, or, eager, in the call that saw it fail).
    fn layer_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (layer, s) in lock(&self.inner).m.layer_stats() {
            let d = PyDict::new(py);
            for (name, value) in s.fields() {
                d.set_item(name, value)?;
            }
            d.set_item("ratio", s.ratio())?;
            out.set_item(layer.0, d)?;
        }
        Ok(out)
    }

    /// The last 1,024 windows: operator, predicted and measured milliseconds, tensors encoded and
    /// decoded in it, bytes (waits for windows whose operator has not finished).
    fn window_records<'py>(&self, py: Python<'py>) -> Result<Vec<Bound<'py, PyDict>>> {
        let records = py.detach(|| lock(&self.inner).m.window_records())?;
        records
            .into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("op", r.op)?;
                d.set_item("predicted_ms", ms(r.predicted))?;
                d.set_item("measured_ms", ms(r.measured))?;
                d.set_item("encoded", r.encoded)?;
                d.set_item("decoded", r.decoded)?;
                d.set_item("bytes", r.bytes)?;
                Ok(d)
            })
            .collect()
    }

    /// Scratch buffers ever allocated for encodings (later windows reuse them).
    #[getter]
    fn scratch_allocations(&self) -> usize {
        lock(&self.inner).m.scratch_allocations()
    }

    /// The learned `(forward, backward)` layer orders.
    #[getter]
    fn layer_orders(&self) -> (Vec<usize>, Vec<usize>) {
        let g = lock(&self.inner);
        let (f, b) = g.m.layer_orders();
        (
            f.iter().map(|l| l.0).collect(),
            b.iter().map(|l| l.0).collect(),
        )
    }

    /// The cost model's throughputs: `encode_gbps`, `decode_gbps`, `matmul_tflops` (or None).
    fn cost<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = lock(&self.inner);
        let t = g.m.cost_model().table();
        let d = PyDict::new(py);
        d.set_item("encode_gbps", t.encode_gbps)?;
        d.set_item("decode_gbps", t.decode_gbps)?;
        d.set_item("matmul_tflops", t.matmul_flops.map(|f| f / 1e12))?;
        Ok(d)
    }
}

/// An operator window as a context manager (`ActivationManager.window(...)`).
#[pyclass(name = "ActivationWindow", module = "hprt._native", frozen)]
pub struct PyWindow {
    manager: Py<PyActivationManager>,
    op: Op,
}

#[pymethods]
impl PyWindow {
    fn __enter__(&self, py: Python<'_>) -> Result<()> {
        self.manager.get().begin(py, self.op.clone())
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> Result<bool> {
        self.manager.get().end(py)?;
        Ok(false)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyActivationManager>()?;
    m.add_class::<PyWindow>()
}
