//! What a framework hands to swap: a device tensor description, and the [`SwapTensor`] that
//! tracks one saved value through device → d2h → host → h2d → device.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hprt_platform::{DType, DeviceBuffer, Event};

use crate::error::{Result, SwapError, SwapState};
use crate::payload::{Allocator, FrameworkHandle, HostCopy, Origin, ReloadCheck};

/// A tensor's in-place modification counter: swap compares it between offload and reload.
///
/// Either a counter shared with the framework (which bumps it on every in-place write), or the
/// framework's own counter read through a function (torch's `tensor._version`). A framework
/// counter is read only while the engine still references the tensor: see [`Origin::Borrowed`].
#[derive(Clone, Default)]
pub struct VersionCounter(VersionSource);

#[derive(Clone)]
enum VersionSource {
    Shared(Arc<AtomicU64>),
    Framework(Arc<dyn Fn() -> u64 + Send + Sync>),
}

impl Default for VersionSource {
    fn default() -> Self {
        VersionSource::Shared(Arc::default())
    }
}

impl VersionCounter {
    pub fn new() -> Self {
        Self::default()
    }
    /// The framework's own counter, read by calling `read`.
    pub fn framework(read: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        VersionCounter(VersionSource::Framework(Arc::new(read)))
    }
    pub fn get(&self) -> u64 {
        match &self.0 {
            VersionSource::Shared(c) => c.load(Ordering::Acquire),
            VersionSource::Framework(read) => read(),
        }
    }
    /// Notes one in-place modification (of a shared counter; a framework counter is moved by
    /// its framework, so this does nothing to it).
    pub fn bump(&self) {
        if let VersionSource::Shared(c) = &self.0 {
            c.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl std::fmt::Debug for VersionCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            VersionSource::Shared(c) => write!(f, "VersionCounter({})", c.load(Ordering::Acquire)),
            VersionSource::Framework(_) => f.write_str("VersionCounter(framework)"),
        }
    }
}

/// A device tensor as a framework describes it: `len` bytes at `offset` in `storage`.
///
/// A tensor covering its whole storage swaps the storage; a view (a smaller range) copies only
/// its own bytes. As in hyper_parallel and Megatron-LM, offloading a view still releases the whole storage, and
/// reloading re-acquires the whole storage and restores the view's bytes only: bytes of the
/// storage outside every saved view are unspecified after reload.
///
/// ```
/// use std::sync::Arc;
/// use hprt_platform::{CpuBackend, CpuConfig, DType, Platform};
/// use hprt_swap::DeviceTensor;
///
/// let p = CpuBackend::new(CpuConfig::default());
/// let storage = p.alloc_device(4096).unwrap();
/// let whole = DeviceTensor::whole(storage.clone(), DType::F32, vec![1024]);
/// let view = DeviceTensor::view(storage, 1024, DType::F32, vec![16, 16]).unwrap();
/// assert!(!whole.is_view() && view.is_view());
/// assert_eq!(view.len, 1024);
/// ```
#[derive(Clone, Debug)]
pub struct DeviceTensor {
    pub storage: DeviceBuffer,
    /// Byte offset of the first element in `storage`.
    pub offset: usize,
    /// Bytes of the tensor (`numel * dtype.size()`).
    pub len: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub version: VersionCounter,
    /// A trainable parameter (or a view of one): never swapped by the keyed front end.
    pub is_parameter: bool,
    /// Who owns the memory, and so how swap releases and re-acquires it.
    pub origin: Origin,
    /// The framework's object for this memory (a torch tensor), handed back after a reload.
    pub handle: Option<FrameworkHandle>,
}

impl DeviceTensor {
    /// A tensor spanning all of `storage`.
    pub fn whole(storage: DeviceBuffer, dtype: DType, shape: Vec<usize>) -> Self {
        let len = storage.len();
        DeviceTensor {
            storage,
            offset: 0,
            len,
            dtype,
            shape,
            version: VersionCounter::new(),
            is_parameter: false,
            origin: Origin::Owned,
            handle: None,
        }
    }

    /// A framework's tensor: `storage` is borrowed memory (see
    /// `Platform::wrap_device_memory`, whose release callback hands it back to the framework),
    /// `handle` the framework's object for it, and `allocator` how to get new memory for it
    /// after swap released it.
    pub fn borrowed(
        storage: DeviceBuffer,
        dtype: DType,
        shape: Vec<usize>,
        handle: Option<FrameworkHandle>,
        allocator: Arc<dyn Allocator>,
    ) -> Result<Self> {
        let mut t = Self::view(storage, 0, dtype, shape)?;
        t.origin = Origin::Borrowed(allocator);
        t.handle = handle;
        Ok(t)
    }

    /// A view of `shape` starting `offset` bytes into `storage`.
    pub fn view(
        storage: DeviceBuffer,
        offset: usize,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<Self> {
        let len = shape
            .iter()
            .try_fold(dtype.size(), |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| SwapError::InvalidTensor(format!("shape {shape:?} overflows")))?;
        let t = DeviceTensor {
            storage,
            offset,
            len,
            dtype,
            shape,
            version: VersionCounter::new(),
            is_parameter: false,
            origin: Origin::Owned,
            handle: None,
        };
        t.check_fits()?;
        Ok(t)
    }

    pub fn numel(&self) -> usize {
        self.len / self.dtype.size()
    }

    /// Whether the tensor covers less than its whole storage.
    pub fn is_view(&self) -> bool {
        self.offset != 0 || self.len != self.storage.len()
    }

    /// Whether swap re-acquires the memory through a framework's allocator.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.origin, Origin::Borrowed(_))
    }

    pub(crate) fn check_fits(&self) -> Result<()> {
        let storage = self.storage.len();
        match self.offset.checked_add(self.len) {
            Some(end) if end <= storage => Ok(()),
            _ => Err(SwapError::InvalidTensor(format!(
                "bytes {}..+{} lie outside the {storage}-byte storage",
                self.offset, self.len
            ))),
        }
    }
}

/// A value autograd saved: a device tensor (swappable) or anything else (passed through).
#[derive(Clone)]
pub enum Saved {
    Tensor(DeviceTensor),
    Other(Arc<dyn Any + Send + Sync>),
}

impl Saved {
    pub fn tensor(&self) -> Option<&DeviceTensor> {
        match self {
            Saved::Tensor(t) => Some(t),
            Saved::Other(_) => None,
        }
    }
}

impl std::fmt::Debug for Saved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Saved::Tensor(t) => t.fmt(f),
            Saved::Other(_) => f.write_str("Saved::Other(..)"),
        }
    }
}

/// The completion mark of one batch of copies, shared by every tensor of the batch.
pub(crate) type Fence = Arc<Event>;

/// Bytes a tensor counts against one of the engine's in-flight windows, uncounted when it goes
/// (handed over, or dropped with its tensor whatever the state).
pub(crate) struct Charge {
    bytes: usize,
    counter: Arc<std::sync::atomic::AtomicUsize>,
}

impl Charge {
    pub(crate) fn new(counter: &Arc<std::sync::atomic::AtomicUsize>, bytes: usize) -> Self {
        counter.fetch_add(bytes, Ordering::AcqRel);
        Charge {
            bytes,
            counter: Arc::clone(counter),
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One saved value and where its bytes are.
///
/// States: `device → d2h` (offload queued) `→ host` (copy completed, device bytes released)
/// `→ h2d` (storage re-acquired, reload queued) `→ device`; a non-tensor value stays in
/// `non_tensor`. Transitions are made by [`crate::SwapEngine`]; asking for the value in any state
/// but `device`/`non_tensor` is a [`SwapError::WrongState`].
///
/// ```
/// use std::sync::Arc;
/// use hprt_swap::{Saved, SwapState, SwapTensor};
///
/// let t = SwapTensor::new(Saved::Other(Arc::new(3.5f32))).unwrap();
/// assert_eq!(t.state(), SwapState::NonTensor);
/// assert!(t.get().is_ok());
/// ```
pub struct SwapTensor {
    pub(crate) saved: Saved,
    pub(crate) state: SwapState,
    /// The storage's size when saved: what a reload re-acquires.
    pub(crate) storage_len: usize,
    pub(crate) version_at_offload: u64,
    /// The version seen when the device bytes were released, if it had moved since the
    /// offload began (a write raced the copy): the reload reports it.
    pub(crate) modified: Option<u64>,
    /// The storage's address when the engine released it (its key among released storages).
    pub(crate) release_key: usize,
    pub(crate) host: Option<HostCopy>,
    pub(crate) d2h: Option<Fence>,
    pub(crate) h2d: Option<Fence>,
    pub(crate) check: ReloadCheck,
    /// The device memory went back to its framework when the offload was queued
    /// ([`crate::Allocator::hand_over`]): the copy may still be running, so a reload waits for
    /// `d2h` on its stream, and the offload can no longer be taken back.
    pub(crate) handed_back: bool,
    /// The bytes of a reload started and not yet handed to the compute stream.
    pub(crate) reload_charge: Option<Charge>,
}

impl SwapTensor {
    /// Tracks `saved`; a device tensor must fit its storage.
    pub fn new(saved: Saved) -> Result<Self> {
        let (state, storage_len) = match &saved {
            Saved::Tensor(t) => {
                t.check_fits()?;
                (SwapState::Device, t.storage.len())
            }
            Saved::Other(_) => (SwapState::NonTensor, 0),
        };
        Ok(SwapTensor {
            saved,
            state,
            storage_len,
            version_at_offload: 0,
            modified: None,
            release_key: 0,
            host: None,
            d2h: None,
            h2d: None,
            check: ReloadCheck::None,
            handed_back: false,
            reload_charge: None,
        })
    }

    pub fn state(&self) -> SwapState {
        self.state
    }

    /// The saved value; only while it is usable (`device` or `non_tensor`).
    pub fn get(&self) -> Result<&Saved> {
        match self.state {
            SwapState::Device | SwapState::NonTensor => Ok(&self.saved),
            actual => Err(SwapError::WrongState {
                operation: "get",
                expected: "device or non_tensor",
                actual,
            }),
        }
    }

    /// The saved value, consuming the tracker; only while it is usable.
    pub fn into_saved(self) -> Result<Saved> {
        self.get()?;
        Ok(self.saved)
    }

    /// The tensor description whatever the state (for bookkeeping, not for reading bytes).
    pub fn describe(&self) -> Option<&DeviceTensor> {
        self.saved.tensor()
    }

    /// Bytes this tensor moves per direction (0 for a non-tensor value).
    pub fn swap_bytes(&self) -> usize {
        self.saved.tensor().map_or(0, |t| t.len)
    }

    /// Bytes the last offload moved over the host link (compressed bytes for a compressed
    /// payload; 0 before an offload).
    pub fn link_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, HostCopy::link_bytes)
    }

    /// Bytes the host copy keeps: the encoding's for a compressed payload whose offload
    /// finished (0 before an offload).
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, HostCopy::host_bytes)
    }

    pub(crate) fn wrong(&self, operation: &'static str, expected: &'static str) -> SwapError {
        SwapError::WrongState {
            operation,
            expected,
            actual: self.state,
        }
    }
}

impl std::fmt::Debug for SwapTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwapTensor(state: {}, {:?})", self.state, self.saved)
    }
}
