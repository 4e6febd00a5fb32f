//! Backend-neutral handles: what modules above `platform` hold instead of driver types.
//!
//! Every handle is a cheap clone of one shared slot. Destroying or freeing through any clone
//! empties the slot, so every later use through any clone is a typed `InvalidHandle` error instead
//! of undefined behaviour — the same contract the C ABI exposes. Dropping the last clone releases
//! the backend object.

use std::any::Any;
use std::cell::Cell;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{BackendKind, Error, ErrorKind, Result};
pub use crate::place::CopyKind;
use crate::place::{Memory, Place};

type Erased = Box<dyn Any + Send + Sync>;

/// Which platform value a handle belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Owner {
    pub platform: u64,
    pub backend: BackendKind,
}

struct Slot<S> {
    owner: Owner,
    what: &'static str,
    state: Mutex<S>,
}

impl<S> Slot<S> {
    fn lock(&self) -> MutexGuard<'_, S> {
        crate::sync::lock(&self.state)
    }

    fn check_owner(&self, owner: Owner, op: &'static str) -> Result<()> {
        if self.owner == owner {
            return Ok(());
        }
        let msg = if self.owner.backend != owner.backend {
            format!(
                "this {} belongs to the {} backend, not {}",
                self.what, self.owner.backend, owner.backend
            )
        } else {
            format!("this {} belongs to another platform value", self.what)
        };
        Err(Error::new(ErrorKind::InvalidHandle, owner.backend, op, msg))
    }
}

fn downcast<T: Clone + 'static>(value: &Erased) -> T {
    value
        .downcast_ref::<T>()
        .expect("a slot holds the object type of the backend that made it")
        .clone()
}

fn destroyed(owner: Owner, op: &'static str, what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidHandle,
        owner.backend,
        op,
        format!("the {what} was already destroyed or freed"),
    )
}

/// A handle to one backend object that can be destroyed explicitly (streams, events, communicators).
#[derive(Clone)]
pub(crate) struct ObjectHandle(Arc<Slot<Option<Erased>>>);

impl ObjectHandle {
    pub(crate) fn new<T: Send + Sync + 'static>(owner: Owner, what: &'static str, obj: T) -> Self {
        ObjectHandle(Arc::new(Slot {
            owner,
            what,
            state: Mutex::new(Some(Box::new(obj))),
        }))
    }

    pub(crate) fn get<T: Clone + 'static>(&self, owner: Owner, op: &'static str) -> Result<T> {
        self.0.check_owner(owner, op)?;
        match &*self.0.lock() {
            Some(v) => Ok(downcast(v)),
            None => Err(destroyed(owner, op, self.0.what)),
        }
    }

    pub(crate) fn take<T: 'static>(&self, owner: Owner, op: &'static str) -> Result<T> {
        self.0.check_owner(owner, op)?;
        match self.0.lock().take() {
            Some(v) => Ok(*v.downcast::<T>().expect("slot holds its backend's type")),
            None => Err(destroyed(owner, op, self.0.what)),
        }
    }

    pub(crate) fn is_live(&self) -> bool {
        self.0.lock().is_some()
    }

    pub(crate) fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The raw driver handle of a stream: a `CUstream` or `aclrtStream` pointer, or the cpu backend's
/// stream number. Pass it to frameworks, or wrap one from a framework with
/// [`crate::Platform::wrap_external_stream`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawStream(pub usize);

/// An ordered queue of device work.
#[derive(Clone)]
pub struct Stream {
    pub(crate) handle: ObjectHandle,
    pub(crate) raw: RawStream,
    pub(crate) external: bool,
}

impl Stream {
    /// The driver handle (see [`RawStream`]).
    pub fn raw(&self) -> RawStream {
        self.raw
    }
    /// Whether this stream wraps one owned by someone else (destroying it leaves theirs alone).
    pub fn is_external(&self) -> bool {
        self.external
    }
    pub fn is_live(&self) -> bool {
        self.handle.is_live()
    }
    /// Whether two handles name the same stream object.
    pub fn same_as(&self, other: &Stream) -> bool {
        self.handle.same(&other.handle)
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({:#x})", self.raw.0)
    }
}

/// A completion mark recorded on a stream.
#[derive(Clone)]
pub struct Event {
    pub(crate) handle: ObjectHandle,
    pub(crate) timing: bool,
}

impl Event {
    /// Whether [`crate::Platform::event_elapsed_ms`] may be used with this event.
    pub fn has_timing(&self) -> bool {
        self.timing
    }
    pub fn is_live(&self) -> bool {
        self.handle.is_live()
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event(timing: {})", self.timing)
    }
}

/// Bytes produced by rank 0 and handed to every rank by the caller's own rendezvous
/// (`ncclUniqueId`, `HcclRootInfo`, or the cpu backend's rendezvous key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct UniqueId(pub Vec<u8>);

/// One rank's membership in a group of ranks that run collectives together.
#[derive(Clone)]
pub struct Communicator {
    pub(crate) handle: ObjectHandle,
    pub(crate) rank: usize,
    pub(crate) world: usize,
}

impl Communicator {
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }
    pub fn is_live(&self) -> bool {
        self.handle.is_live()
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.rank, self.world)
    }
}

/// Called once when borrowed device memory is no longer referenced by hprt (the last handle is
/// dropped or freed and every queued operation on it has finished).
pub type ReleaseFn = Box<dyn FnOnce() + Send>;

thread_local! {
    static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, a host function a stream reached, marked as one: host access of pinned memory
/// refuses to wait there (a host function waiting for a copy queued after it on its own stream
/// never returns, and CUDA forbids the driver call).
pub(crate) fn run_host_fn(f: crate::kernel::HostFn) {
    let outer = IN_HOST_FN.try_with(|c| c.replace(true)).unwrap_or(false);
    // Unwinds pass through: the backends' own host-function runners catch them.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = IN_HOST_FN.try_with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(outer);
    f()
}

/// The last copy one stream queued on a pinned buffer: an event recorded after it (re-recorded
/// after each later copy on that stream, so waiting for it covers them all, streams being FIFO).
#[derive(Clone)]
pub(crate) struct QueuedUse {
    /// The stream's handle, compared by identity.
    pub stream: ObjectHandle,
    /// The backend's event.
    pub event: Arc<dyn Any + Send + Sync>,
    /// Waits for `event` on the host ([`crate::Backend::wait_event`] of the backend that made it).
    pub wait: fn(&(dyn Any + Send + Sync)) -> Result<()>,
}

pub(crate) struct BufferState {
    /// `None` while the storage is released (size 0) or after `free`.
    pub mem: Option<Erased>,
    pub len: usize,
    /// Device pointer for device buffers, host address for pinned buffers; 0 when released.
    pub ptr: usize,
    pub freed: bool,
    pub borrowed: bool,
    /// Pinned buffers: the copies queued on them, which host access waits for.
    pub queued: Vec<QueuedUse>,
}

#[derive(Clone)]
pub(crate) struct BufferHandle(Arc<Slot<BufferState>>);

impl BufferHandle {
    pub(crate) fn new(owner: Owner, what: &'static str, state: BufferState) -> Self {
        BufferHandle(Arc::new(Slot {
            owner,
            what,
            state: Mutex::new(state),
        }))
    }

    /// The locked state after the ownership and liveness checks every operation makes.
    pub(crate) fn state(
        &self,
        owner: Owner,
        op: &'static str,
    ) -> Result<MutexGuard<'_, BufferState>> {
        self.0.check_owner(owner, op)?;
        let st = self.0.lock();
        if st.freed {
            return Err(destroyed(owner, op, self.0.what));
        }
        Ok(st)
    }

    /// The liveness and bounds checks of an access to `offset..offset + bytes`.
    pub(crate) fn check(&self, op: &'static str, offset: usize, bytes: usize) -> Result<()> {
        let owner = self.0.owner;
        let st = self.state(owner, op)?;
        check_range(owner.backend, op, self.0.what, offset, bytes, st.len)
    }

    /// The backend memory object behind `offset..offset + bytes`, after a bounds check.
    pub(crate) fn mem_for<T: Clone + 'static>(
        &self,
        owner: Owner,
        op: &'static str,
        offset: usize,
        bytes: usize,
    ) -> Result<Option<T>> {
        Ok(self.mem_and_ptr_for(owner, op, offset, bytes)?.0)
    }

    /// `mem_for`, with the buffer's address read under the same lock (a resize between the two
    /// would pair one allocation with another's address).
    pub(crate) fn mem_and_ptr_for<T: Clone + 'static>(
        &self,
        owner: Owner,
        op: &'static str,
        offset: usize,
        bytes: usize,
    ) -> Result<(Option<T>, usize)> {
        let st = self.state(owner, op)?;
        check_range(owner.backend, op, self.0.what, offset, bytes, st.len)?;
        Ok((st.mem.as_ref().map(downcast), st.ptr))
    }

    pub(crate) fn unlocked(&self) -> MutexGuard<'_, BufferState> {
        self.0.lock()
    }

    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

pub(crate) fn check_range(
    backend: BackendKind,
    op: &'static str,
    what: &str,
    offset: usize,
    bytes: usize,
    len: usize,
) -> Result<()> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::new(
            ErrorKind::OutOfRange,
            backend,
            op,
            format!("bytes {offset}..{offset}+{bytes} lie outside the {len}-byte {what}"),
        )),
    }
}

/// Device memory: allocated by a platform, or borrowed from a framework.
///
/// The storage can be released while the handle lives ([`crate::Platform::resize_device`] to 0)
/// and re-acquired later, the pattern activation swap relies on.
#[derive(Clone)]
pub struct DeviceBuffer {
    pub(crate) handle: BufferHandle,
}

impl DeviceBuffer {
    /// Whether `offset..offset + bytes` lies inside the live buffer: the typed error an access
    /// would give, before anything is sized from `bytes`.
    pub fn check_range(&self, op: &'static str, offset: usize, bytes: usize) -> Result<()> {
        self.handle.check(op, offset, bytes)
    }
    /// Current size in bytes (0 while released).
    pub fn len(&self) -> usize {
        self.handle.unlocked().len
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw device pointer (0 while released or freed), for handing to a framework or kernel.
    pub fn device_ptr(&self) -> usize {
        self.handle.unlocked().ptr
    }
    /// Whether the memory is borrowed (see [`crate::Platform::wrap_device_memory`]).
    pub fn is_borrowed(&self) -> bool {
        self.handle.unlocked().borrowed
    }
    pub fn is_freed(&self) -> bool {
        self.handle.unlocked().freed
    }
    /// Whether two handles name the same buffer.
    pub fn same_as(&self, other: &DeviceBuffer) -> bool {
        self.handle.same(&other.handle)
    }
    /// This buffer starting `offset` bytes in, for kernels and collectives.
    pub fn at(&self, offset: usize) -> Place<&DeviceBuffer> {
        Place::new(self, offset)
    }
    /// The backend whose memory this is (for the errors of checks made outside an access).
    pub(crate) fn backend(&self) -> BackendKind {
        self.handle.0.owner.backend
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.handle.unlocked();
        write!(f, "DeviceBuffer({} bytes at {:#x})", st.len, st.ptr)
    }
}

/// Page-locked host memory: the host end of every asynchronous device copy.
///
/// The platform records an event after every copy it queues on the buffer, and
/// [`PinnedBuffer::read`] / [`PinnedBuffer::write`] wait for those events first (as cudarc's
/// `PinnedHostSlice` does), so safe host access never races a queued copy: a read right after
/// a queued device-to-host copy sees the copied bytes. A copy that failed fails the access with
/// its error. The forms that do not wait are `unsafe`
/// ([`PinnedBuffer::read_unsynchronized`]), for host functions whose stream order already
/// guarantees the copies finished.
#[derive(Clone)]
pub struct PinnedBuffer {
    pub(crate) handle: BufferHandle,
}

impl PinnedBuffer {
    /// As [`DeviceBuffer::check_range`].
    pub fn check_range(&self, op: &'static str, offset: usize, bytes: usize) -> Result<()> {
        self.handle.check(op, offset, bytes)
    }
    pub fn len(&self) -> usize {
        self.handle.unlocked().len
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn is_freed(&self) -> bool {
        self.handle.unlocked().freed
    }
    pub fn same_as(&self, other: &PinnedBuffer) -> bool {
        self.handle.same(&other.handle)
    }

    fn host_range(
        &self,
        op: &'static str,
        offset: usize,
        bytes: usize,
    ) -> Result<MutexGuard<'_, BufferState>> {
        let st = self.handle.unlocked();
        let backend = self.handle.0.owner.backend;
        if st.freed {
            return Err(destroyed(self.handle.0.owner, op, "pinned buffer"));
        }
        check_range(backend, op, "pinned buffer", offset, bytes, st.len)?;
        Ok(st)
    }

    /// Waits on the host for every copy queued on this buffer so far; the error of a copy that
    /// failed, if one did.
    ///
    /// Refused (`Unsupported`) inside a host function: there stream order is what orders the
    /// access, so host functions use [`PinnedBuffer::read_unsynchronized`] and its kin.
    pub fn wait_queued(&self) -> Result<()> {
        if IN_HOST_FN.try_with(Cell::get).unwrap_or(false) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                self.handle.0.owner.backend,
                "pinned_wait",
                "a host function cannot wait for the copies queued on a pinned buffer (one \
                 queued after it would never finish); stream order orders its access, so it \
                 uses read_unsynchronized / write_unsynchronized",
            ));
        }
        // Waited for outside the lock: a host function queued before the copies may itself
        // need the buffer.
        let queued = self.handle.unlocked().queued.clone();
        for u in &queued {
            (u.wait)(&*u.event)?;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes starting at `offset` out of the buffer, once the copies queued
    /// on it finished.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        drop(self.host_range("pinned_read", offset, out.len())?);
        self.wait_queued()?;
        // SAFETY: the queued copies finished.
        unsafe { self.read_unsynchronized(offset, out) }
    }

    /// Copies `data` into the buffer starting at `offset`, once the copies queued on it
    /// finished (a queued host-to-device copy may still be reading the old bytes).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        drop(self.host_range("pinned_write", offset, data.len())?);
        self.wait_queued()?;
        // SAFETY: as in `read`.
        unsafe { self.write_unsynchronized(offset, data) }
    }

    /// [`PinnedBuffer::read`] without waiting for queued copies (no driver call: usable in a
    /// host function, where CUDA forbids them).
    ///
    /// # Safety
    /// No queued device copy may write `offset..offset + out.len()` while this runs (for example
    /// the caller runs in stream order after the copies that touch it).
    pub unsafe fn read_unsynchronized(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let st = self.host_range("pinned_read", offset, out.len())?;
        if !out.is_empty() {
            // SAFETY: the range was checked against the live allocation, which the held lock
            // keeps from being freed; device-side writers are excluded by the caller.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (st.ptr as *const u8).add(offset),
                    out.as_mut_ptr(),
                    out.len(),
                )
            };
        }
        Ok(())
    }

    /// [`PinnedBuffer::write`] without waiting for queued copies.
    ///
    /// # Safety
    /// No queued device copy may read or write `offset..offset + data.len()` while this runs.
    pub unsafe fn write_unsynchronized(&self, offset: usize, data: &[u8]) -> Result<()> {
        let st = self.host_range("pinned_write", offset, data.len())?;
        if !data.is_empty() {
            // SAFETY: as in `read_unsynchronized`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    (st.ptr as *mut u8).add(offset),
                    data.len(),
                )
            };
        }
        Ok(())
    }

    /// Runs `f` on `offset..offset + len` of the buffer in place, without waiting for queued
    /// copies and without copying the bytes out (a host function encoding what a copy just
    /// brought in). The buffer cannot be freed while `f` runs.
    ///
    /// # Safety
    /// As [`PinnedBuffer::read_unsynchronized`]: no queued device copy may write the range while
    /// `f` runs.
    pub unsafe fn with_unsynchronized<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        let st = self.host_range("pinned_read", offset, len)?;
        if len == 0 {
            return Ok(f(&[]));
        }
        // SAFETY: the range was checked against the live allocation, which the held lock keeps
        // from being freed; device-side writers are excluded by the caller.
        let bytes = unsafe { std::slice::from_raw_parts((st.ptr as *const u8).add(offset), len) };
        Ok(f(bytes))
    }

    /// As [`PinnedBuffer::with_unsynchronized`], writing: `f` fills the range in place (a host
    /// function decoding straight into the block a copy then takes to the device).
    ///
    /// # Safety
    /// As [`PinnedBuffer::write_unsynchronized`]: no queued device copy may read or write the
    /// range while `f` runs.
    pub unsafe fn with_unsynchronized_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        let st = self.host_range("pinned_write", offset, len)?;
        if len == 0 {
            return Ok(f(&mut []));
        }
        // SAFETY: as in `with_unsynchronized`; the held lock also keeps any other host access
        // through this handle out while `f` writes.
        let bytes = unsafe { std::slice::from_raw_parts_mut((st.ptr as *mut u8).add(offset), len) };
        Ok(f(bytes))
    }

    /// The whole buffer as a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// The host address, for zero-copy use by frameworks (null once freed).
    ///
    /// # Safety
    /// The pointer is valid for [`PinnedBuffer::len`] bytes until the buffer is freed or its last
    /// handle dropped; accesses must be synchronized with device work on the buffer (for
    /// example by [`PinnedBuffer::wait_queued`]).
    pub unsafe fn as_ptr(&self) -> *mut u8 {
        self.handle.unlocked().ptr as *mut u8
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuffer({} bytes)", self.len())
    }
}

impl<'a> From<&'a DeviceBuffer> for Memory<&'a DeviceBuffer, &'a PinnedBuffer> {
    fn from(b: &'a DeviceBuffer) -> Self {
        Memory::Device(b)
    }
}

impl<'a> From<&'a PinnedBuffer> for Memory<&'a DeviceBuffer, &'a PinnedBuffer> {
    fn from(b: &'a PinnedBuffer) -> Self {
        Memory::Pinned(b)
    }
}

impl Memory<&DeviceBuffer, &PinnedBuffer> {
    /// The buffer's size in bytes, whichever kind of memory it is.
    pub fn len(&self) -> usize {
        match self {
            Memory::Device(d) => d.len(),
            Memory::Pinned(p) => p.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
