//! The data of the Python classes the other modules hand one another: a platform, its streams,
//! events and buffers, a device tensor and a communicator. Each class's methods live in the module
//! of its concern (`platform.rs`, `swap.rs`, `collective.rs`); keeping the definitions here, below
//! all of them, lets a platform method return a communicator or a device tensor without those
//! modules importing one another.

use hprt_platform::{Communicator, DType, DeviceBuffer, Event, PinnedBuffer, Platform, Stream};
use hprt_swap::{DeviceTensor, PlatformHandle};
use pyo3::prelude::*;

use crate::error::{BindError, Result};

/// A platform: the process-wide one ([`crate::platform::get_platform`]) or a private cpu one
/// ([`crate::platform::cpu_platform`]).
///
/// ```python
/// p = hprt.cpu_platform(device_memory=1 << 20)
/// s = p.create_stream()
/// buf = p.alloc_device(1024)
/// p.write(buf, b"\x01" * 1024, s)
/// assert p.read(buf, 1024, s) == b"\x01" * 1024
/// ```
#[pyclass(name = "Platform", module = "hprt._native", frozen)]
pub struct PyPlatform {
    pub(crate) p: PlatformHandle,
}

/// The given platform's handle, or the process-wide platform's.
pub(crate) fn resolve(platform: Option<&PyPlatform>) -> Result<PlatformHandle> {
    match platform {
        Some(p) => Ok(p.p.clone()),
        None => Ok(PlatformHandle::Static(hprt_platform::get_platform()?)),
    }
}

/// A stream of this platform.
#[pyclass(name = "Stream", module = "hprt._native", frozen)]
pub struct PyStream {
    pub(crate) p: PlatformHandle,
    pub(crate) s: Stream,
}

/// A completion mark recorded on a stream.
#[pyclass(name = "Event", module = "hprt._native", frozen)]
pub struct PyEvent {
    pub(crate) p: PlatformHandle,
    pub(crate) e: Event,
}

/// Device memory: allocated by hprt, or borrowed from a framework.
#[pyclass(name = "DeviceBuffer", module = "hprt._native", frozen)]
pub struct PyDeviceBuffer {
    pub(crate) p: PlatformHandle,
    pub(crate) b: DeviceBuffer,
}

/// Page-locked host memory, the host end of asynchronous copies.
#[pyclass(name = "PinnedBuffer", module = "hprt._native", frozen)]
pub struct PyPinnedBuffer {
    pub(crate) p: PlatformHandle,
    pub(crate) b: PinnedBuffer,
}

impl PyPlatform {
    pub(crate) fn stream(&self, s: Stream) -> PyStream {
        PyStream {
            p: self.p.clone(),
            s,
        }
    }
    pub(crate) fn device_buffer(&self, b: DeviceBuffer) -> PyDeviceBuffer {
        PyDeviceBuffer {
            p: self.p.clone(),
            b,
        }
    }
}

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

/// One rank's membership in a group; collectives are queued on a stream like copies.
///
/// ```python
/// def rank(r, uid):
///     comm = p.comm_init(uid, r, 2)
///     comm.all_reduce(buf, buf, n, "f32", "sum", stream)
/// ```
#[pyclass(name = "Communicator", module = "hprt._native", frozen)]
pub struct PyCommunicator {
    pub(crate) p: PlatformHandle,
    pub(crate) c: Communicator,
}

pub(crate) fn device_is_host(p: &dyn Platform) -> bool {
    p.capabilities().device_memory_is_host
}

pub(crate) fn unsupported(msg: impl Into<String>) -> BindError {
    BindError::Unsupported(msg.into())
}
