//! DLPack both ways, through `dlpark`: hprt memory out as `TensorView` (`__dlpack__`), framework
//! tensors in as borrowed device memory (`Platform.from_dlpack`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use hprt_platform::PlatformHandle;
use hprt_platform::{DType, DeviceBuffer, ErrorKind, PinnedBuffer};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;

use crate::dtype;
use crate::error::{invalid, BindError, Result};
use crate::handles::{device_is_host, unsupported, PyDeviceTensor, PyPlatform};

/// The buffer a view names; a handle clone travels inside every DLPack capsule.
#[derive(Clone)]
pub(crate) enum Backing {
    Device(DeviceBuffer),
    Pinned(PinnedBuffer),
}

impl Backing {
    fn same_as(&self, other: &Backing) -> bool {
        match (self, other) {
            (Backing::Device(a), Backing::Device(b)) => a.same_as(b),
            (Backing::Pinned(a), Backing::Pinned(b)) => a.same_as(b),
            _ => false,
        }
    }

    /// Where the live memory starts (0 while released or freed), and which kind of memory.
    fn key(&self) -> (bool, usize) {
        match self {
            Backing::Device(b) => (false, b.device_ptr()),
            // SAFETY: only the address is taken; nothing is read or written through it here.
            Backing::Pinned(b) => (true, unsafe { b.as_ptr() } as usize),
        }
    }
}

/// The live DLPack exports, by the memory they name: a handle clone keeps a buffer's handle but
/// not its memory (a free or resize through any clone releases it), so an export registers here
/// for as long as its consumer holds it, and every free or resize made through the bindings
/// ([`unexported`]) is refused while one is registered. Exports are keyed by kind and address
/// (stable while an export holds it), one handle per export.
#[derive(Default)]
struct Registry {
    leases: HashMap<(bool, usize), Vec<Backing>>,
    /// Buffers an [`unexported`] call is freeing or resizing: no export of them may start. (The
    /// release runs outside the lock: it may drop the last reference to an import of one of
    /// our own exports, whose lease then unregisters.)
    releasing: Vec<Backing>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn registry() -> MutexGuard<'static, Option<Registry>> {
    // A poisoned lock still holds a consistent registry: every update is one push or removal.
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

fn remove_one(v: &mut Vec<Backing>, b: &Backing) {
    if let Some(i) = v.iter().position(|x| x.same_as(b)) {
        v.swap_remove(i);
    }
}

/// Runs `f`, which frees or resizes the memory of `bufs`, unless a DLPack export of one of them is
/// alive: then a `BufferExportedError` (Python's `BufferError` too) naming `op`. No export of
/// them can start while `f` runs.
pub(crate) fn unexported<T>(
    bufs: &[Backing],
    op: &str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    {
        let mut reg = registry();
        let reg = reg.get_or_insert_with(Registry::default);
        for b in bufs {
            let key = b.key();
            let n = reg
                .leases
                .get(&key)
                .filter(|_| key.1 != 0)
                .map_or(0, |v| v.iter().filter(|x| x.same_as(b)).count());
            if n > 0 {
                let what = match b {
                    Backing::Device(_) => "device buffer",
                    Backing::Pinned(_) => "pinned buffer",
                };
                return Err(BindError::Exported(format!(
                    "{op}: {n} DLPack export(s) of this {what} are alive (numpy / torch tensors \
                     over its memory); they would read and write freed memory. Drop them (and \
                     their views) first, or copy what you keep"
                )));
            }
        }
        reg.releasing.extend(bufs.iter().cloned());
    }
    /// Takes `bufs` off the releasing list however `f` ends.
    struct Done<'a>(&'a [Backing]);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            if let Some(reg) = registry().as_mut() {
                for b in self.0 {
                    remove_one(&mut reg.releasing, b);
                }
            }
        }
    }
    let _done = Done(bufs);
    f()
}

/// One export's registration, travelling in its capsule; dropped when the consumer releases it.
struct Lease {
    backing: Backing,
    key: Option<(bool, usize)>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Never unwinds (DLPack deleters must not): no panicking call below.
        let Some(key) = self.key else { return };
        let mut reg = registry();
        let Some(reg) = reg.as_mut() else { return };
        if let Some(v) = reg.leases.get_mut(&key) {
            remove_one(v, &self.backing);
            if v.is_empty() {
                reg.leases.remove(&key);
            }
        }
    }
}

/// A typed window on hprt memory that numpy and torch can import without a copy
/// (`numpy.from_dlpack(view)`, `torch.from_dlpack(view)`): dense row-major, or with the element
/// strides of a framework tensor a reload recreates (see `HostLayout::alloc_capsule`).
///
/// The consumer reads the memory directly. A view of pinned memory is exported once the copies
/// queued on the buffer finished; device memory (host memory on the cpu backend) is the
/// caller's to synchronize first.
/// While a consumer holds an export, the memory stays: freeing or resizing the buffer (`free`,
/// `resize`, `ShardedParam.shard`, ...) is refused with a `BufferExportedError` until the
/// consumer releases it (as `bytearray` refuses a resize while a `memoryview` of it lives); every
/// export re-checks the bounds.
#[pyclass(name = "TensorView", module = "hprt._native", frozen)]
pub struct TensorView {
    backing: Backing,
    offset: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Element strides; row-major when absent.
    strides: Option<Vec<usize>>,
}

/// `b` as exportable memory: only the cpu backend's device memory is host memory.
fn host_device_backing(p: &PlatformHandle, b: &DeviceBuffer) -> Result<Backing> {
    if !device_is_host(&**p) {
        return Err(unsupported(format!(
            "DLPack export of {} device memory: only the cpu backend's device memory is \
             host-addressable; copy into a PinnedBuffer and export that",
            p.backend()
        )));
    }
    Ok(Backing::Device(b.clone()))
}

impl TensorView {
    pub(crate) fn of_device(
        p: &PlatformHandle,
        b: &DeviceBuffer,
        dtype: DType,
        shape: Vec<usize>,
        offset: usize,
    ) -> Result<Self> {
        Self::dense(host_device_backing(p, b)?, dtype, shape, offset)
    }

    pub(crate) fn of_pinned(
        _p: &PlatformHandle,
        b: &PinnedBuffer,
        dtype: DType,
        shape: Vec<usize>,
        offset: usize,
    ) -> Result<Self> {
        Self::dense(Backing::Pinned(b.clone()), dtype, shape, offset)
    }

    /// A row-major view of `backing` from `offset`; fails if it does not fit (`address`
    /// checks the bounds).
    fn dense(backing: Backing, dtype: DType, shape: Vec<usize>, offset: usize) -> Result<Self> {
        let v = TensorView {
            backing,
            offset,
            dtype,
            shape,
            strides: None,
        };
        v.address()?;
        Ok(v)
    }

    /// Bytes from the first element to the end of the last one.
    fn span(&self) -> Result<usize> {
        match &self.strides {
            None => dtype::nbytes(self.dtype, &self.shape),
            Some(strides) => dtype::strided_nbytes(self.dtype, &self.shape, strides),
        }
    }

    /// The first element's address, after checking the window lies inside the live memory.
    fn address(&self) -> Result<usize> {
        let nbytes = self.span()?;
        let (base, len) = match &self.backing {
            Backing::Device(b) => (b.device_ptr(), b.len()),
            // SAFETY: only the address is taken; nothing is read or written through it here.
            Backing::Pinned(b) => (unsafe { b.as_ptr() } as usize, b.len()),
        };
        match self.offset.checked_add(nbytes) {
            Some(end) if end <= len && (base != 0 || nbytes == 0) => Ok(base + self.offset),
            _ => Err(invalid(format!(
                "a {nbytes}-byte view at offset {} does not fit the {len}-byte buffer",
                self.offset
            ))),
        }
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        // Checked and registered under the registry's lock: no free can slip in between. The
        // lock is released before anything can drop a lease (which takes it).
        let (addr, registered) = {
            let mut guard = registry();
            let reg = guard.get_or_insert_with(Registry::default);
            if reg.releasing.iter().any(|b| b.same_as(&self.backing)) {
                return Err(BindError::Exported(
                    "the buffer is being freed or resized by another thread".into(),
                )
                .into());
            }
            let addr = self.address()?;
            let key = self.backing.key();
            let registered = (self.span()? > 0 && key.1 != 0).then_some(key);
            if let Some(key) = registered {
                reg.leases
                    .entry(key)
                    .or_default()
                    .push(self.backing.clone());
            }
            (addr, registered)
        };
        let lease = Lease {
            backing: self.backing.clone(),
            key: registered,
        };
        let shape: Vec<i64> = self.shape.iter().map(|d| *d as i64).collect();
        let ctx = Box::new(lease);
        let mut init = match &self.strides {
            None => Dynamic::compact(shape).initialize_as::<M>(ctx),
            Some(strides) => {
                let strides: Vec<i64> = strides.iter().map(|s| *s as i64).collect();
                Dynamic::new(shape, strides).initialize_as::<M>(ctx)
            }
        }
        .map_err(|e| PyBufferError::new_err(e.to_string()))?;
        init.set_data(addr as *mut c_void)
            .set_dtype(dtype::to_dlpack(self.dtype))
            .set_device(DLDevice::CPU);
        // SAFETY: every element the shape and strides reach (`addr..addr + nbytes`) was just
        // checked to lie in the live buffer, whose export is registered (the lease in the
        // tensor's context) so that no free or resize through the bindings releases it until
        // the consumer drops the tensor; the strides are explicit (given, or row-major from the
        // `compact` builder) and no flags are asserted.
        Ok(unsafe { init.finish() })
    }
}

impl DlpackExporter for TensorView {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }
    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }
    fn prepare_export(&self, py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        match &self.backing {
            Backing::Pinned(b) => py
                .detach(|| b.wait_queued())
                .map_err(|e| PyErr::from(BindError::from(e))),
            Backing::Device(_) => Ok(()),
        }
    }
    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }
    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl TensorView {
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    pub(crate) fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let stream = stream.filter(|s| !s.is_none());
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        (DLDeviceType::CPU.0, 0)
    }

    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }
    #[getter]
    fn nbytes(&self) -> Result<usize> {
        dtype::nbytes(self.dtype, &self.shape)
    }
}

/// A framework tensor's layout, in elements, as a reload into the cpu platform's device memory
/// recreates it: `(shape, strides, storage offset, dtype, itemsize)` from Python (`dtype` the
/// framework's own, not read here).
pub(crate) struct HostLayout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    itemsize: usize,
    /// Elements from the storage's start to the end of the last one.
    span: usize,
}

impl HostLayout {
    pub(crate) fn parse(layout: &Bound<'_, PyAny>) -> Result<Self> {
        type Tuple<'py> = (Vec<usize>, Vec<usize>, usize, Bound<'py, PyAny>, usize);
        let (shape, strides, offset, _, itemsize): Tuple<'_> = layout.extract().map_err(|_| {
            invalid("layout must be (shape, strides, storage offset, dtype, itemsize)")
        })?;
        let reach = dtype::strided_nbytes(DType::U8, &shape, &strides)?;
        let span = offset
            .checked_add(reach)
            .filter(|s| s.checked_mul(itemsize).is_some())
            .ok_or_else(|| invalid("the layout's span overflows"))?;
        if reach == 0 || itemsize == 0 {
            return Err(invalid("an empty tensor has no layout to allocate"));
        }
        Ok(HostLayout {
            shape,
            strides,
            offset,
            itemsize,
            span,
        })
    }

    /// Allocates the layout's span in `p`'s device memory (the cpu backend's: host memory) and
    /// returns a DLPack capsule of it and the first element's address, or None when the
    /// platform has no room. The capsule (versioned, as `__dlpack__(max_version=(1, 0))` makes
    /// it) holds the layout itself where `dtype`, the payload's, has the tensor's itemsize and
    /// the storage offset is 0; otherwise the span as one row, of `dtype` or of bytes, that the
    /// importer restrides.
    pub(crate) fn alloc_capsule(
        &self,
        py: Python<'_>,
        p: &PlatformHandle,
        dtype: DType,
    ) -> Result<Option<(Py<PyAny>, usize)>> {
        let buf = match p.alloc_device(self.span * self.itemsize) {
            Ok(buf) => buf,
            Err(e) if e.kind() == ErrorKind::OutOfMemory => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let (dtype, shape, strides) = if dtype.size() != self.itemsize {
            (DType::U8, vec![self.span * self.itemsize], None)
        } else if self.offset != 0 {
            (dtype, vec![self.span], None)
        } else if dtype::row_major(&self.shape) == self.strides {
            (dtype, self.shape.clone(), None)
        } else {
            (dtype, self.shape.clone(), Some(self.strides.clone()))
        };
        let view = TensorView {
            backing: host_device_backing(p, &buf)?,
            offset: 0,
            dtype,
            shape,
            strides,
        };
        view.address()?;
        let request = ExportRequest::parse(None, Some((1, 0)), None, None)?;
        let capsule = export_dlpack(&view, py, request)?;
        Ok(Some((
            capsule,
            buf.device_ptr() + self.offset * self.itemsize,
        )))
    }
}

/// Wraps what a DLPack producer exports as borrowed device memory; the imported tensor (and so
/// the producer's storage) lives until hprt releases the memory.
pub(crate) fn import(
    platform: &PyPlatform,
    obj: &Bound<'_, PyAny>,
    is_parameter: bool,
) -> Result<PyDeviceTensor> {
    let imported = dlpark::python::from_dlpack(obj.as_borrowed(), None, None)
        .map_err(|e| invalid(format!("DLPack import failed: {e}")))?;
    let t = imported
        .validate()
        .map_err(|e| invalid(format!("invalid DLPack tensor: {e}")))?;
    let device = t.device();
    let host_tensor = matches!(
        device.device_type,
        DLDeviceType::CPU | DLDeviceType::CUDAHOST
    );
    if !(host_tensor && device_is_host(&*platform.p)) {
        return Err(unsupported(format!(
            "a DLPack tensor on device type {} cannot be wrapped by the {} backend; use \
             unsafe_wrap_device_memory(ptr, nbytes, owner) with a pointer of this backend",
            device.device_type.0,
            platform.p.backend()
        )));
    }
    let compact = t
        .is_compact()
        .map_err(|e| invalid(format!("invalid DLPack strides: {e}")))?;
    if !compact {
        return Err(invalid(
            "only dense row-major tensors can be wrapped; call .contiguous() first",
        ));
    }
    let dtype = dtype::from_dlpack(t.dtype())?;
    let shape = t
        .shape()
        .iter()
        .map(|d| usize::try_from(*d).map_err(|_| invalid("negative DLPack dimension")))
        .collect::<Result<Vec<_>>>()?;
    let nbytes = dtype::nbytes(dtype, &shape)?;
    let ptr = (t.data_ptr() as usize)
        .checked_add(t.byte_offset() as usize)
        .ok_or_else(|| invalid("DLPack data pointer overflows"))?;
    let release: hprt_platform::ReleaseFn = Box::new(move || drop(imported));
    // SAFETY: the range is the imported tensor's own (validated dense, `nbytes` long) host
    // memory, addressable as device memory by the cpu backend; the managed tensor that keeps it
    // alive moves into the release callback.
    let storage = unsafe { platform.p.wrap_device_memory(ptr, nbytes, Some(release))? };
    PyDeviceTensor::from_parts(&platform.p, storage, 0, dtype, shape, is_parameter)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TensorView>()
}
