//! hprt-python: the `hprt._native` extension module behind the `hprt` Python package.
//!
//! - [`handles`] — the data of the classes the modules hand one another (their methods live
//!   with their concern), at the bottom of the module graph.
//! - [`platform`] — `get_platform()`, `cpu_platform()`, `Platform`, `Stream`, `Event`,
//!   `DeviceBuffer`, `PinnedBuffer`: the platform layer as Python objects.
//! - [`dlpack`] — `TensorView` (`__dlpack__` out of hprt memory) and `Platform.from_dlpack`
//!   (numpy / torch memory in, zero-copy), through `dlpark`.
//! - [`collective`] — `Communicator`: all-reduce, all-gather, reduce-scatter, broadcast,
//!   barrier, split.
//! - [`swap`] — `DeviceTensor` and the three hprt-swap front ends: `SwapManager` (layer
//!   groups), `KeyedSwap` (keyed pack/unpack), `PipelineOffload` (chunked groups).
//! - [`borrowed`] — `FrameworkMemory` / `BorrowedTensor`: a framework's own tensors as borrowed
//!   swap payloads for those front ends (what `hprt.torch` uses), with accounting of the
//!   framework bytes hprt keeps on the device.
//! - [`compress`] — `compress` / `decompress` / `decompress_into` / `compressed_info`: the
//!   hprt-compress lossless codec on host tensors (DLPack) and bytes.
//! - [`manager`] — `ActivationManager`: hprt-compress's per-layer activation manager (saved
//!   tensors per layer, operator windows, per-layer ratio statistics).
//! - [`hsdp`] — `DeviceMesh`, `DataParallelMesh`, `GroupCache`, `HsdpStreams`,
//!   `MixedPrecisionPolicy`, `ShardedParam`: sharded parameters (FSDP / HSDP).
//! - [`error`] — `BindError` and the `HprtError` exception family; every failure becomes one,
//!   carrying the backend's status name.
//! - [`trace`] — `StreamClock` / `StreamMark`: when a stream reached a point, on
//!   `time.perf_counter()`'s clock (hprt-platform's stream clock; `hprt.fsdp.StreamTrace` uses it).
//! - [`wait`] — blocking calls Ctrl-C can interrupt (`comm_init`, synchronize).

pub mod borrowed;
pub mod collective;
pub mod compress;
pub mod dlpack;
pub mod dtype;
pub mod error;
pub mod handles;
pub mod hsdp;
pub mod manager;
pub mod platform;
pub mod swap;
pub mod trace;
pub mod wait;

pub use error::{BindError, Result};

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    platform::register(m)?;
    dlpack::register(m)?;
    collective::register(m)?;
    compress::register(m)?;
    swap::register(m)?;
    borrowed::register(m)?;
    hsdp::register(m)?;
    manager::register(m)?;
    trace::register(m)?;
    Ok(())
}
