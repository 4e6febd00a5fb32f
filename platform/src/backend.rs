//! The static per-backend trait (the "hal" layer).
//!
//! A backend implements [`Backend`] with its own object types and only the driver work; the
//! blanket [`crate::Platform`] implementation in `dispatch.rs` turns neutral handles into those
//! types and does every check that does not need a driver (ownership, liveness, bounds, sizes),
//! so no backend repeats them.

use crate::capabilities::Capabilities;
use crate::collective::Collective;
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::{CopyKind, RawStream, ReleaseFn, UniqueId};
use crate::info::PlatformInfo;
use crate::kernel::{DeviceModule, HostFn, Kernel, KernelArg, LaunchShape};
use crate::memory::{MemInfo, MemoryStats};
use crate::place::{Memory, Place};

pub trait Backend: Send + Sync + 'static {
    type Stream: Clone + Send + Sync + 'static;
    type Event: Clone + Send + Sync + 'static;
    /// Owned or borrowed device memory; dropping the last clone frees (or releases) it.
    type DeviceMemory: Clone + Send + Sync + 'static;
    type PinnedMemory: Clone + Send + Sync + 'static;
    type Comm: Clone + Send + Sync + 'static;

    fn kind(&self) -> BackendKind;
    /// Distinguishes platform values of one backend (handles may not cross between them).
    fn instance(&self) -> u64;
    fn info(&self) -> PlatformInfo;
    /// What this platform can do ([`Capabilities`]): what the layers above branch on.
    fn capabilities(&self) -> Capabilities;

    fn device_count(&self) -> usize;
    /// Makes `ordinal` the calling thread's current device.
    fn set_device(&self, ordinal: usize) -> Result<()>;
    fn current_device(&self) -> usize;
    fn mem_info(&self) -> Result<MemInfo>;
    fn memory_stats(&self) -> MemoryStats;
    fn reset_peak_memory(&self);
    /// Frees the memory whose last handle went while work was queued on it and whose work has
    /// finished since (a backend that frees in stream order by itself has nothing to do).
    fn reclaim_frees(&self) {}

    fn create_stream(&self) -> Result<(Self::Stream, RawStream)>;
    /// # Safety
    /// `raw` must be a live stream of this backend that outlives the returned object's use.
    unsafe fn wrap_stream(&self, raw: RawStream) -> Result<Self::Stream>;
    fn destroy_stream(&self, stream: Self::Stream) -> Result<()>;
    fn synchronize_stream(&self, stream: &Self::Stream) -> Result<()>;
    fn query_stream(&self, stream: &Self::Stream) -> Result<bool>;
    /// See [`crate::Platform::lend_stream_to_framework`]; nothing to do where streams are not
    /// recorded on by a framework (cpu, npu).
    fn lend_stream_to_framework(&self, _stream: &Self::Stream) -> Result<()> {
        Ok(())
    }
    fn synchronize_device(&self) -> Result<()>;

    fn create_event(&self, timing: bool) -> Result<Self::Event>;
    fn destroy_event(&self, event: Self::Event) -> Result<()>;
    fn record_event(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    fn stream_wait_event(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;
    fn query_event(&self, event: &Self::Event) -> Result<bool>;
    fn synchronize_event(&self, event: &Self::Event) -> Result<()>;
    /// `synchronize_event` for a caller that holds only the event: host access of a pinned
    /// buffer waits for the copies queued on it this way.
    fn wait_event(event: &Self::Event) -> Result<()>;
    /// Milliseconds between two completed timing events.
    fn event_elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f32>;

    /// Allocates `bytes > 0` on the current device; returns the memory and its device pointer.
    fn alloc_device(&self, bytes: usize) -> Result<(Self::DeviceMemory, usize)>;
    /// # Safety
    /// `ptr..ptr + bytes` must be device memory of this backend, valid until `release` runs.
    unsafe fn wrap_device_memory(
        &self,
        ptr: usize,
        bytes: usize,
        release: Option<ReleaseFn>,
    ) -> Result<Self::DeviceMemory>;
    /// Allocates `bytes > 0` of page-locked host memory; returns it and its host address.
    fn alloc_pinned(&self, bytes: usize) -> Result<(Self::PinnedMemory, usize)>;

    /// Enqueues a copy of `bytes > 0` between two places in device or pinned memory; bounds
    /// were checked by the caller.
    fn copy(
        &self,
        kind: CopyKind,
        dst: Place<Memory<Self::DeviceMemory, Self::PinnedMemory>>,
        src: Place<Memory<Self::DeviceMemory, Self::PinnedMemory>>,
        bytes: usize,
        stream: &Self::Stream,
    ) -> Result<()>;
    fn memset(
        &self,
        dst: Place<Self::DeviceMemory>,
        value: u8,
        bytes: usize,
        stream: &Self::Stream,
    ) -> Result<()>;

    /// Enqueues an elementwise kernel whose places were bounds- and overlap-checked by the
    /// caller; `count > 0`.
    fn kernel(
        &self,
        kernel: Kernel<Place<Self::DeviceMemory>>,
        stream: &Self::Stream,
    ) -> Result<()>;
    /// Enqueues a host closure in stream order.
    fn host_fn(&self, stream: &Self::Stream, f: HostFn) -> Result<()>;
    /// Enqueues kernel `kernel` of `module` with arguments the caller bounds-checked (a pointer
    /// to no bytes may have no memory). Only a backend with a CUDA C compiler has one.
    fn module_kernel(
        &self,
        module: &DeviceModule,
        kernel: &str,
        shape: LaunchShape,
        args: &[KernelArg<Option<Place<Self::DeviceMemory>>>],
        stream: &Self::Stream,
    ) -> Result<()> {
        let _ = (kernel, shape, args, stream);
        Err(Error::new(
            ErrorKind::Unsupported,
            self.kind(),
            "launch_module_kernel",
            format!(
                "the {} backend has no CUDA C compiler for module {}",
                self.kind(),
                module.name
            ),
        ))
    }

    fn unique_id(&self) -> Result<UniqueId>;
    /// Joins the communicator named by `id`; blocks until all `world` ranks joined.
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Self::Comm>;
    /// Collective over `comm`: every rank passes the same disjoint rank lists and receives a
    /// communicator for the list holding it (with its rank and size there), or `None`.
    fn comm_split(
        &self,
        comm: &Self::Comm,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<(Self::Comm, usize, usize)>>;
    fn destroy_comm(&self, comm: Self::Comm) -> Result<()>;
    /// Ends this rank's membership now, without waiting for its queued collectives
    /// ([`crate::Platform::abort_comm`]).
    fn abort_comm(&self, comm: Self::Comm) -> Result<()>;
    /// Enqueues a collective whose places were bounds-checked by the caller; places of zero bytes
    /// may have no memory (`None`).
    fn collective(
        &self,
        comm: &Self::Comm,
        op: Collective<Option<Place<Self::DeviceMemory>>>,
        stream: &Self::Stream,
    ) -> Result<()>;
    /// Opens a group on the calling thread: collectives until `group_end` are issued together.
    fn group_start(&self) -> Result<()>;
    fn group_end(&self) -> Result<()>;
}
