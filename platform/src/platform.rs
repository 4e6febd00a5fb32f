//! The object-safe `Platform` trait: what swap, compress, hsdp and the bindings program against.

use std::ops::Deref;
use std::sync::Arc;

use crate::capabilities::Capabilities;
use crate::collective::Collective;
use crate::dtype::{DType, ReduceOp};
use crate::error::{BackendKind, Result};
use crate::handle::{
    Communicator, DeviceBuffer, Event, PinnedBuffer, RawStream, ReleaseFn, Stream, UniqueId,
};
use crate::info::PlatformInfo;
use crate::kernel::{DeviceModule, HostFn, HostMemoryFn, Kernel, KernelArg, LaunchShape};
use crate::memory::{MemInfo, MemoryStats};
use crate::place::{Memory, Place};

/// One backend, chosen at run time (see [`crate::get_platform`]).
///
/// Everything that moves data is asynchronous and ordered by the stream it is issued on: the call
/// returns once the work is queued. An error of queued work reaches everything ordered after it,
/// as a GPU's sticky errors do: the next synchronize of its stream, every event recorded after
/// it, every stream that waited on such an event (and events recorded there after the wait), and
/// a device synchronize; each reports it once and later work is clean again. A collective that
/// fails aborts its communicator on every rank (as `ncclCommAbort` does): what is queued behind it
/// and issued later fails at once with the first cause. No wait on a collective blocks past the
/// collective timeout (`HP_COLLECTIVE_TIMEOUT_MS`, default 120 s; the cpu backend's
/// `HP_CPU_COLLECTIVE_TIMEOUT_MS` overrides it there): a peer that died, skipped the collective or
/// disagrees on it makes the wait fail with a `Timeout` (on cuda, the NCCL watchdog aborts the
/// communicator, as torch's does; on npu, HCCL's own timeout applies).
pub trait Platform: Send + Sync {
    fn backend(&self) -> BackendKind;
    fn info(&self) -> PlatformInfo;
    /// What this platform can do: the facts the layers above branch on instead of the
    /// backend's name ([`Capabilities`] lists each backend's).
    fn capabilities(&self) -> Capabilities;

    // --- devices -------------------------------------------------------------------------
    fn device_count(&self) -> usize;
    /// Makes `ordinal` the calling thread's current device (streams and memory go there).
    fn set_device(&self, ordinal: usize) -> Result<()>;
    fn current_device(&self) -> usize;
    fn mem_info(&self) -> Result<MemInfo>;
    fn memory_stats(&self) -> MemoryStats;
    fn reset_peak_memory(&self);

    // --- streams -------------------------------------------------------------------------
    fn create_stream(&self) -> Result<Stream>;
    /// Wraps a stream owned by someone else (a framework's current stream) without taking
    /// ownership: destroying the wrapper leaves the stream alone.
    ///
    /// # Safety
    /// `raw` must name a live stream of this backend for as long as the wrapper is used.
    unsafe fn wrap_external_stream(&self, raw: RawStream) -> Result<Stream>;
    /// Destroys the stream; queued work still completes. Later use of any clone is an error.
    fn destroy_stream(&self, stream: &Stream) -> Result<()>;
    /// Blocks until all work queued on `stream` completed; reports the first error it hit.
    fn synchronize_stream(&self, stream: &Stream) -> Result<()>;
    /// Whether all work queued on `stream` completed.
    fn query_stream(&self, stream: &Stream) -> Result<bool>;
    /// A framework may record events on `stream`'s raw handle after hprt lets go of the stream
    /// (torch's `Tensor.record_stream`: its caching allocator records on every such stream
    /// when it frees the block, however late): the backend keeps the driver's stream alive
    /// until the platform goes, and hands it out again to a later `create_stream`.
    fn lend_stream_to_framework(&self, stream: &Stream) -> Result<()>;
    /// Blocks until all work on every stream of this platform completed; reports the first error
    /// not yet reported, including one left on a stream destroyed since.
    fn synchronize_device(&self) -> Result<()>;

    // --- events --------------------------------------------------------------------------
    /// `timing` enables [`Platform::event_elapsed_ms`].
    fn create_event(&self, timing: bool) -> Result<Event>;
    fn destroy_event(&self, event: &Event) -> Result<()>;
    /// Marks the point in `stream` reached by the work queued so far.
    fn record_event(&self, event: &Event, stream: &Stream) -> Result<()>;
    /// Work queued on `stream` after this call waits for the event's last recorded point; an
    /// error queued before that point becomes `stream`'s error too.
    fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()>;
    /// Whether the last recorded point was reached (true for a never-recorded event).
    fn query_event(&self, event: &Event) -> Result<bool>;
    fn synchronize_event(&self, event: &Event) -> Result<()>;
    /// Milliseconds between two completed timing events.
    fn event_elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32>;

    // --- memory --------------------------------------------------------------------------
    /// Device memory on the current device; `bytes == 0` gives a buffer without storage.
    fn alloc_device(&self, bytes: usize) -> Result<DeviceBuffer>;
    /// Borrows device memory owned by someone else (a framework tensor). hprt never frees it;
    /// `release` runs once nothing in hprt references it any more.
    ///
    /// # Safety
    /// `ptr..ptr + bytes` must be device memory of this backend, valid until `release` runs.
    unsafe fn wrap_device_memory(
        &self,
        ptr: usize,
        bytes: usize,
        release: Option<ReleaseFn>,
    ) -> Result<DeviceBuffer>;
    /// Frees the storage now, in stream order: queued work on it still completes, and until it
    /// has, the memory stays counted and is not handed out again; the call does not wait for it.
    /// Later use of the buffer is an error.
    fn free_device(&self, buf: &DeviceBuffer) -> Result<()>;
    /// Resizes the storage, keeping the handle: 0 releases the bytes, a size on a released buffer
    /// re-acquires them. Contents are not preserved unless the size is unchanged. On failure the
    /// buffer keeps what it had.
    fn resize_device(&self, buf: &DeviceBuffer, bytes: usize) -> Result<()>;
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer>;
    fn free_pinned(&self, buf: &PinnedBuffer) -> Result<()>;

    // --- data movement -------------------------------------------------------------------
    /// Enqueues a copy of `bytes` from `src[src_offset..]` to `dst[dst_offset..]`; the kind
    /// (H2D, D2H, D2D, H2H) follows from the two ends.
    fn copy_async(
        &self,
        dst: Memory<&DeviceBuffer, &PinnedBuffer>,
        dst_offset: usize,
        src: Memory<&DeviceBuffer, &PinnedBuffer>,
        src_offset: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()>;
    fn memset_async(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        value: u8,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()>;

    // --- compute -------------------------------------------------------------------------
    /// Enqueues an elementwise kernel (casts, fills, scaling, accumulation; see [`Kernel`] for
    /// the exact semantics, identical on every backend). A written range may overlap a read
    /// range only in place (same buffer and offset).
    fn launch_kernel(&self, kernel: Kernel<Place<&DeviceBuffer>>, stream: &Stream) -> Result<()>;
    /// Enqueues kernel `kernel` of a CUDA C module (compiled once per device and cached) on
    /// `grid` blocks of `block` threads. Pointer arguments are bounds-checked and their memory
    /// outlives the launch; what the kernel computes is the module's own contract. Backends
    /// without a CUDA C compiler (cpu, npu) return `Unsupported`.
    fn launch_module_kernel(
        &self,
        module: &DeviceModule,
        kernel: &str,
        shape: LaunchShape,
        args: &[KernelArg<Place<&DeviceBuffer>>],
        stream: &Stream,
    ) -> Result<()>;
    /// Runs `f` on a host thread in stream order, like `cuLaunchHostFunc`: after the work queued
    /// on `stream` before it and before the work queued after it. `f` must not wait on `stream`.
    fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()>;
    /// Where device memory is host memory ([`Capabilities::device_memory_is_host`]): runs `f`
    /// as [`Platform::launch_host_fn`] does, handing it the `dst.1` bytes at `dst.0` to write
    /// and the `src.1` bytes at `src.0` to read, with no copy through pinned memory. Both stay
    /// allocated until `f` ran, even if freed meanwhile (as for a queued copy); the two ranges
    /// may not share a byte. Elsewhere `Unsupported`: the host cannot address device memory.
    fn launch_host_fn_on_memory(
        &self,
        stream: &Stream,
        dst: (Place<&DeviceBuffer>, usize),
        src: (Place<&DeviceBuffer>, usize),
        f: HostMemoryFn,
    ) -> Result<()>;

    // --- collectives ---------------------------------------------------------------------
    /// A new rendezvous key; rank 0 makes it and hands it to the others.
    fn unique_id(&self) -> Result<UniqueId>;
    /// Joins a communicator; blocks until all `world` ranks joined (or the backend's timeout).
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator>;
    /// Collective over `comm` (every rank calls it with the same disjoint rank lists): the
    /// communicator of the list holding this rank, or `None` when no list holds it.
    fn comm_split(
        &self,
        comm: &Communicator,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<Communicator>>;
    /// Releases this rank's membership once its queued collectives ran. A rank whose
    /// communicator is gone (destroyed, or dropped when its thread failed) will never reach
    /// another collective: on the cpu backend, peers' collectives and receives waiting for it
    /// fail at once.
    fn destroy_comm(&self, comm: &Communicator) -> Result<()>;
    /// What a rank that failed does: ends its membership now, without waiting for its queued
    /// collectives (they fail), so that peers waiting for it in a collective fail at once
    /// rather than at the collective timeout. On the cpu backend it is [`destroy_comm`]; on
    /// cuda, `ncclCommAbort` (peers see it as a remote error, which their watchdog turns into
    /// the failure of their waiting collectives); HCCL has no abort, so on npu it is
    /// `HcclCommDestroy` and peers fail at HCCL's timeout.
    ///
    /// [`destroy_comm`]: Platform::destroy_comm
    fn abort_comm(&self, comm: &Communicator) -> Result<()>;
    /// Enqueues one collective on `stream`.
    fn collective(
        &self,
        comm: &Communicator,
        op: Collective<Place<&DeviceBuffer>>,
        stream: &Stream,
    ) -> Result<()>;
    /// Collectives issued by this thread until `group_end` are launched together (needed for
    /// send/recv pairs that would otherwise wait on each other).
    fn group_start(&self) -> Result<()>;
    fn group_end(&self) -> Result<()>;

    // --- conveniences built on the above -------------------------------------------------
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        send: Place<&DeviceBuffer>,
        recv: Place<&DeviceBuffer>,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        comm: &Communicator,
        stream: &Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            Collective::AllReduce {
                send,
                recv,
                count,
                dtype,
                op,
            },
            stream,
        )
    }

    /// `count` elements per rank into one buffer of `world * count` elements.
    fn all_gather(
        &self,
        send: Place<&DeviceBuffer>,
        recv: Place<&DeviceBuffer>,
        count: usize,
        dtype: DType,
        comm: &Communicator,
        stream: &Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            Collective::AllGather {
                send,
                recv,
                count,
                dtype,
            },
            stream,
        )
    }

    /// `count` is the number of elements each rank receives.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        send: Place<&DeviceBuffer>,
        recv: Place<&DeviceBuffer>,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        comm: &Communicator,
        stream: &Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            Collective::ReduceScatter {
                send,
                recv,
                count,
                dtype,
                op,
            },
            stream,
        )
    }

    fn broadcast(
        &self,
        buf: Place<&DeviceBuffer>,
        count: usize,
        dtype: DType,
        root: usize,
        comm: &Communicator,
        stream: &Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            Collective::Broadcast {
                buf,
                count,
                dtype,
                root,
            },
            stream,
        )
    }

    fn barrier(&self, comm: &Communicator, stream: &Stream) -> Result<()> {
        self.collective(comm, Collective::Barrier, stream)
    }

    /// Copies `data` into device memory and waits for it (stages through pinned memory).
    fn write_device_sync(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        data: &[u8],
        stream: &Stream,
    ) -> Result<()> {
        dst.check_range("write_device_sync", offset, data.len())?;
        let staging = self.alloc_pinned(data.len())?;
        staging.write(0, data)?;
        self.copy_async(dst.into(), offset, (&staging).into(), 0, data.len(), stream)?;
        self.synchronize_stream(stream)
    }

    /// Copies device bytes into `out` once the work queued on `stream` before it completed.
    fn read_device_sync(
        &self,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
        stream: &Stream,
    ) -> Result<()> {
        src.check_range("read_device_sync", offset, out.len())?;
        let staging = self.alloc_pinned(out.len())?;
        self.copy_async((&staging).into(), 0, src.into(), offset, out.len(), stream)?;
        self.synchronize_stream(stream)?;
        staging.read(0, out)
    }
}

/// A platform an object keeps: shared (`Arc`), or the process-wide one from [`crate::get_platform`]
/// (`&'static`). Swap engines, the compression manager, the tracing decorator and hsdp's group
/// caches and sharded parameters hold one.
#[derive(Clone)]
pub enum PlatformHandle {
    Shared(Arc<dyn Platform>),
    Static(&'static dyn Platform),
}

impl Deref for PlatformHandle {
    type Target = dyn Platform;
    fn deref(&self) -> &(dyn Platform + 'static) {
        match self {
            PlatformHandle::Shared(p) => p.as_ref(),
            PlatformHandle::Static(p) => *p,
        }
    }
}

impl AsRef<dyn Platform> for PlatformHandle {
    fn as_ref(&self) -> &(dyn Platform + 'static) {
        &**self
    }
}

impl From<Arc<dyn Platform>> for PlatformHandle {
    fn from(p: Arc<dyn Platform>) -> Self {
        PlatformHandle::Shared(p)
    }
}

impl From<&Arc<dyn Platform>> for PlatformHandle {
    fn from(p: &Arc<dyn Platform>) -> Self {
        PlatformHandle::Shared(Arc::clone(p))
    }
}

impl From<&'static dyn Platform> for PlatformHandle {
    fn from(p: &'static dyn Platform) -> Self {
        PlatformHandle::Static(p)
    }
}
