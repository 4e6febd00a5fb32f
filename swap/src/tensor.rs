//! What a framework hands to swap: a device tensor description, its version counter and who
//! owns its memory ([`Origin`]: hprt, or the framework and its [`Allocator`]).

use std::any::Any;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hprt_platform::{DType, DeviceBuffer, Stream, TensorRef};

use crate::error::{Result, SwapError};

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

/// A device tensor as a framework describes it: where it lies ([`TensorRef`]: `len` bytes at
/// `offset` in `storage`, its dtype and shape) and what swap needs besides.
///
/// A tensor covering its whole storage swaps the storage; a view (a smaller range) copies only
/// its own bytes. As in hyper_parallel and Megatron-LM, offloading a view still releases the whole storage, and
/// reloading re-acquires the whole storage and restores the view's bytes only: bytes of the
/// storage outside every saved view are unspecified after reload.
///
/// `DeviceTensor` dereferences to its [`TensorRef`] (`t.storage`, `t.offset`, `t.len`,
/// `t.dtype`, `t.shape`, `t.numel()`, `t.is_view()`): the tensor *is* that description plus
/// swap's bookkeeping, and the engine reads and moves those fields in many places (a reload
/// points the tensor at new storage through `DerefMut`).
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
    /// Where the tensor lies: storage, byte offset and length, dtype, shape.
    pub tensor: TensorRef,
    pub version: VersionCounter,
    /// A trainable parameter (or a view of one): never swapped by the keyed front end.
    pub is_parameter: bool,
    /// Who owns the memory, and so how swap releases and re-acquires it.
    pub origin: Origin,
    /// The framework's object for this memory (a torch tensor), handed back after a reload.
    pub handle: Option<FrameworkHandle>,
}

impl Deref for DeviceTensor {
    type Target = TensorRef;
    fn deref(&self) -> &TensorRef {
        &self.tensor
    }
}

impl DerefMut for DeviceTensor {
    fn deref_mut(&mut self) -> &mut TensorRef {
        &mut self.tensor
    }
}

impl From<TensorRef> for DeviceTensor {
    /// hprt's own memory, no framework object, not a parameter, a fresh version counter.
    fn from(tensor: TensorRef) -> Self {
        DeviceTensor {
            tensor,
            version: VersionCounter::new(),
            is_parameter: false,
            origin: Origin::Owned,
            handle: None,
        }
    }
}

impl DeviceTensor {
    /// A tensor spanning all of `storage` ([`TensorRef::whole`]).
    pub fn whole(storage: DeviceBuffer, dtype: DType, shape: Vec<usize>) -> Self {
        TensorRef::whole(storage, dtype, shape).into()
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

    /// A view of `shape` starting `offset` bytes into `storage` ([`TensorRef::view`]; its
    /// refusals are [`SwapError::InvalidTensor`]).
    pub fn view(
        storage: DeviceBuffer,
        offset: usize,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<Self> {
        TensorRef::view(storage, offset, dtype, shape)
            .map(Self::from)
            .map_err(invalid_tensor)
    }

    /// Whether swap re-acquires the memory through a framework's allocator.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.origin, Origin::Borrowed(_))
    }

    /// [`TensorRef::check_fits`], refused as [`SwapError::InvalidTensor`].
    pub(crate) fn check_fits(&self) -> Result<()> {
        self.tensor.check_fits().map_err(invalid_tensor)
    }
}

/// A tensor description swap cannot use is the caller's error, whatever the platform calls it.
fn invalid_tensor(e: hprt_platform::Error) -> SwapError {
    SwapError::InvalidTensor(e.message)
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

/// A framework's object for some memory (a torch tensor), opaque to swap.
pub type FrameworkHandle = Arc<dyn Any + Send + Sync>;

/// New framework memory for a borrowed tensor whose memory swap released.
pub struct Reacquired {
    /// Borrowed memory (`Platform::wrap_device_memory`) holding at least `offset + len` bytes.
    pub storage: DeviceBuffer,
    /// Byte offset of the tensor in `storage`.
    pub offset: usize,
    /// The framework's object for the new memory, handed back with the reloaded tensor.
    pub handle: Option<FrameworkHandle>,
    /// The new memory's version counter.
    pub version: VersionCounter,
    /// The stream in whose order the allocator handed the memory out, when it is a caching
    /// allocator's (torch's: a block freed by work queued on its stream is handed out again at
    /// once, for use in that stream's order, while that work may still be running). The reload
    /// writes the memory only after the work queued on this stream so far. `None`: nothing
    /// queued uses the memory (a platform allocation; memory of the host's own stream).
    pub ready_on: Option<Stream>,
}

/// The framework's allocator: how a borrowed tensor gets memory back for its reload.
pub trait Allocator: Send + Sync {
    /// Memory for a tensor like `like` (its dtype, shape and byte length; the framework keeps
    /// strides itself). An error (out of memory) leaves the host copy in place for a retry.
    fn allocate(&self, like: &DeviceTensor) -> Result<Reacquired>;

    /// Hands `t`'s memory back to the framework now: the framework orders its reuse after the
    /// work queued so far on `streams` (torch's `Tensor.record_stream`), so the engine may drop
    /// its references at once instead of when it later sees that work finished (on a GPU the
    /// host runs far ahead of the device: holding on until then keeps many layers alive).
    /// `streams` may be empty: every use of the memory is already ordered after hprt's work on
    /// the framework's own stream (a reload the compute stream waits for).
    /// Returns whether the framework took it; `false` (the default: a framework that cannot
    /// order reuse by streams, or an allocator without that knowledge) leaves the memory to
    /// the platform, which releases it once the work on it finished.
    fn hand_over(&self, t: &DeviceTensor, streams: &[&Stream]) -> Result<bool> {
        let _ = (t, streams);
        Ok(false)
    }
}

/// A plain function allocates; it cannot take memory back early.
impl<F> Allocator for F
where
    F: Fn(&DeviceTensor) -> Result<Reacquired> + Send + Sync,
{
    fn allocate(&self, like: &DeviceTensor) -> Result<Reacquired> {
        self(like)
    }
}

/// Who owns a tensor's device memory.
#[derive(Clone, Default)]
pub enum Origin {
    /// hprt storage: release = resize to zero, re-acquire = resize back.
    #[default]
    Owned,
    /// A framework's memory: release = drop the engine's references, re-acquire = the allocator.
    Borrowed(Arc<dyn Allocator>),
}

impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Origin::Owned => "Owned",
            Origin::Borrowed(_) => "Borrowed",
        })
    }
}
