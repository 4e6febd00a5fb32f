//! The dyn layer: every [`Backend`] is a [`Platform`]. Neutral handles are resolved to backend
//! objects here, after the checks that need no driver.

use crate::backend::Backend;
use crate::capabilities::Capabilities;
use crate::collective::Collective;
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::{
    run_host_fn, BufferHandle, BufferState, Communicator, CopyKind, DeviceBuffer, Event,
    ObjectHandle, Owner, PinnedBuffer, QueuedUse, RawStream, ReleaseFn, Stream, UniqueId,
};
use crate::info::PlatformInfo;
use crate::kernel::{Access, DeviceModule, HostFn, HostMemoryFn, Kernel, KernelArg, LaunchShape};
use crate::memory::{MemInfo, MemoryStats};
use crate::place::{Memory, Place};
use crate::platform::Platform;

fn owner<B: Backend>(b: &B) -> Owner {
    Owner {
        platform: b.instance(),
        backend: b.kind(),
    }
}

fn stream_obj<B: Backend>(b: &B, s: &Stream, op: &'static str) -> Result<B::Stream> {
    s.handle.get(owner(b), op)
}

fn event_obj<B: Backend>(b: &B, e: &Event, op: &'static str) -> Result<B::Event> {
    e.handle.get(owner(b), op)
}

fn buffer_state(mem: Option<ErasedMem>, len: usize, ptr: usize, borrowed: bool) -> BufferState {
    BufferState {
        mem,
        len,
        ptr,
        freed: false,
        borrowed,
        queued: Vec::new(),
    }
}
type ErasedMem = Box<dyn std::any::Any + Send + Sync>;

fn wait_erased<B: Backend>(event: &(dyn std::any::Any + Send + Sync)) -> Result<()> {
    B::wait_event(
        event
            .downcast_ref::<B::Event>()
            .expect("a queued use holds the event type of the backend that recorded it"),
    )
}

/// Notes that a copy just queued on `stream` touches pinned buffer `buf`, so host access of it
/// waits for the copy (`PinnedBuffer::read`). When the mark cannot be recorded, the stream is
/// drained before the error returns: host access would otherwise not wait for the copy.
///
/// No driver call is made, and nothing waited for, under the buffer's lock: a host function
/// queued on `stream` before the copy may take it (a host-stage decode writing the block), and
/// draining the stream, or a queue that is full, would then wait on it for ever.
fn note_pinned_use<B: Backend>(
    b: &B,
    buf: &PinnedBuffer,
    stream: &Stream,
    s: &B::Stream,
) -> Result<()> {
    let known = buf
        .handle
        .unlocked()
        .queued
        .iter()
        .find(|u| u.stream.same(&stream.handle))
        .and_then(|u| u.event.downcast_ref::<B::Event>().cloned());
    let recorded = match known {
        Some(e) => Backend::record_event(b, &e, s),
        // A new mark joins the buffer's list once recorded: before, a host access would wait
        // on an event that marks nothing yet.
        None => Backend::create_event(b, false).and_then(|e| {
            Backend::record_event(b, &e, s)?;
            let mut st = buf.handle.unlocked();
            if !st.freed {
                st.queued.push(QueuedUse {
                    stream: stream.handle.clone(),
                    event: std::sync::Arc::new(e),
                    wait: wait_erased::<B>,
                });
            }
            Ok(())
        }),
    };
    if recorded.is_err() {
        let _ = Backend::synchronize_stream(b, s);
    }
    recorded
}

/// The backend's memory behind `bytes` at a place in a device buffer, after the ownership,
/// liveness and bounds checks; `None` while the buffer holds no storage.
fn device_place<B: Backend>(
    b: &B,
    place: Place<&DeviceBuffer>,
    op: &'static str,
    bytes: usize,
) -> Result<Option<Place<B::DeviceMemory>>> {
    let m = place
        .mem
        .handle
        .mem_for(owner(b), op, place.offset, bytes)?;
    Ok(m.map(|m| Place::new(m, place.offset)))
}

/// The backend's memory behind `bytes` at `offset` of one end of a copy, after the same checks
/// as [`device_place`].
fn copy_memory<B: Backend>(
    b: &B,
    mem: Memory<&DeviceBuffer, &PinnedBuffer>,
    op: &'static str,
    offset: usize,
    bytes: usize,
) -> Result<Option<Memory<B::DeviceMemory, B::PinnedMemory>>> {
    Ok(match mem {
        Memory::Device(d) => d
            .handle
            .mem_for(owner(b), op, offset, bytes)?
            .map(Memory::Device),
        Memory::Pinned(p) => p
            .handle
            .mem_for(owner(b), op, offset, bytes)?
            .map(Memory::Pinned),
    })
}

/// A written range may share bytes with another place only when both are the same range start
/// (in place) and the kernel allows that; anything else would make the result depend on the
/// order elements are visited.
fn check_kernel_overlap<B: Backend>(b: &B, k: &Kernel<Place<&DeviceBuffer>>) -> Result<()> {
    let places = k.places();
    for (i, (w, wbytes, wa)) in places.iter().enumerate() {
        if *wa == Access::Read {
            continue;
        }
        for (j, (o, obytes, _)) in places.iter().enumerate() {
            let in_place = w.offset == o.offset && k.allows_in_place();
            if i == j || !w.mem.same_as(o.mem) || in_place {
                continue;
            }
            if w.offset < o.offset + obytes && o.offset < w.offset + wbytes {
                return Err(Error::new(
                    ErrorKind::InvalidValue,
                    b.kind(),
                    k.name(),
                    format!(
                        "bytes {}..+{} overlap bytes {}..+{} of the same buffer other than in place",
                        w.offset, wbytes, o.offset, obytes
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Rejects overlapping send/recv ranges except the in-place layouts each collective defines.
fn check_overlap<B: Backend>(
    b: &B,
    op: &Collective<Place<&DeviceBuffer>>,
    rank: usize,
    world: usize,
) -> Result<()> {
    let places = op.places(world);
    if places.len() != 2 {
        return Ok(());
    }
    let ((s, sb), (r, rb)) = (places[0], places[1]);
    if !s.mem.same_as(r.mem) || sb == 0 || rb == 0 {
        return Ok(());
    }
    // Saturating: sizes past any buffer are refused by the bounds check that follows.
    let end = |offset: usize, bytes: usize| offset.saturating_add(bytes);
    let disjoint = end(s.offset, sb) <= r.offset || end(r.offset, rb) <= s.offset;
    let in_place = match op {
        Collective::AllReduce { .. } => s.offset == r.offset,
        Collective::AllGather { .. } => s.offset == end(r.offset, rank.saturating_mul(sb)),
        Collective::ReduceScatter { .. } => r.offset == end(s.offset, rank.saturating_mul(rb)),
        _ => false,
    };
    if disjoint || in_place {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::InvalidValue,
        b.kind(),
        op.name(),
        "send and recv overlap in a way this collective does not support in place",
    ))
}

impl<B: Backend> Platform for B {
    fn backend(&self) -> BackendKind {
        self.kind()
    }
    fn info(&self) -> PlatformInfo {
        Backend::info(self)
    }
    fn capabilities(&self) -> Capabilities {
        Backend::capabilities(self)
    }

    fn device_count(&self) -> usize {
        Backend::device_count(self)
    }
    fn set_device(&self, ordinal: usize) -> Result<()> {
        Backend::set_device(self, ordinal)
    }
    fn current_device(&self) -> usize {
        Backend::current_device(self)
    }
    fn mem_info(&self) -> Result<MemInfo> {
        Backend::reclaim_frees(self);
        Backend::mem_info(self)
    }
    fn memory_stats(&self) -> MemoryStats {
        Backend::reclaim_frees(self);
        Backend::memory_stats(self)
    }
    fn reset_peak_memory(&self) {
        Backend::reset_peak_memory(self)
    }

    fn create_stream(&self) -> Result<Stream> {
        let (obj, raw) = Backend::create_stream(self)?;
        Ok(Stream {
            handle: ObjectHandle::new(owner(self), "stream", obj),
            raw,
            external: false,
        })
    }
    unsafe fn wrap_external_stream(&self, raw: RawStream) -> Result<Stream> {
        let obj = Backend::wrap_stream(self, raw)?;
        Ok(Stream {
            handle: ObjectHandle::new(owner(self), "stream", obj),
            raw,
            external: true,
        })
    }
    fn destroy_stream(&self, stream: &Stream) -> Result<()> {
        let obj = stream
            .handle
            .take::<B::Stream>(owner(self), "destroy_stream")?;
        Backend::destroy_stream(self, obj)
    }
    fn synchronize_stream(&self, stream: &Stream) -> Result<()> {
        let r = Backend::synchronize_stream(self, &stream_obj(self, stream, "synchronize_stream")?);
        Backend::reclaim_frees(self);
        r
    }
    fn query_stream(&self, stream: &Stream) -> Result<bool> {
        Backend::query_stream(self, &stream_obj(self, stream, "query_stream")?)
    }
    fn lend_stream_to_framework(&self, stream: &Stream) -> Result<()> {
        Backend::lend_stream_to_framework(
            self,
            &stream_obj(self, stream, "lend_stream_to_framework")?,
        )
    }
    fn synchronize_device(&self) -> Result<()> {
        let r = Backend::synchronize_device(self);
        Backend::reclaim_frees(self);
        r
    }

    fn create_event(&self, timing: bool) -> Result<Event> {
        let obj = Backend::create_event(self, timing)?;
        Ok(Event {
            handle: ObjectHandle::new(owner(self), "event", obj),
            timing,
        })
    }
    fn destroy_event(&self, event: &Event) -> Result<()> {
        let obj = event
            .handle
            .take::<B::Event>(owner(self), "destroy_event")?;
        Backend::destroy_event(self, obj)
    }
    fn record_event(&self, event: &Event, stream: &Stream) -> Result<()> {
        let e = event_obj(self, event, "record_event")?;
        Backend::record_event(self, &e, &stream_obj(self, stream, "record_event")?)
    }
    fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        let e = event_obj(self, event, "stream_wait_event")?;
        Backend::stream_wait_event(self, &stream_obj(self, stream, "stream_wait_event")?, &e)
    }
    fn query_event(&self, event: &Event) -> Result<bool> {
        Backend::query_event(self, &event_obj(self, event, "query_event")?)
    }
    fn synchronize_event(&self, event: &Event) -> Result<()> {
        let r = Backend::synchronize_event(self, &event_obj(self, event, "synchronize_event")?);
        Backend::reclaim_frees(self);
        r
    }
    fn event_elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32> {
        for e in [start, end] {
            if !e.timing {
                return Err(Error::new(
                    ErrorKind::InvalidValue,
                    self.kind(),
                    "event_elapsed_ms",
                    "the event was created without timing",
                ));
            }
        }
        let s = event_obj(self, start, "event_elapsed_ms")?;
        Backend::event_elapsed_ms(self, &s, &event_obj(self, end, "event_elapsed_ms")?)
    }

    fn alloc_device(&self, bytes: usize) -> Result<DeviceBuffer> {
        let state = if bytes == 0 {
            buffer_state(None, 0, 0, false)
        } else {
            let (mem, ptr) = Backend::alloc_device(self, bytes)?;
            buffer_state(Some(Box::new(mem)), bytes, ptr, false)
        };
        Ok(DeviceBuffer {
            handle: BufferHandle::new(owner(self), "device buffer", state),
        })
    }
    unsafe fn wrap_device_memory(
        &self,
        ptr: usize,
        bytes: usize,
        release: Option<ReleaseFn>,
    ) -> Result<DeviceBuffer> {
        if ptr == 0 && bytes > 0 {
            return Err(Error::new(
                ErrorKind::InvalidValue,
                self.kind(),
                "wrap_device_memory",
                "null pointer",
            ));
        }
        let mem = Backend::wrap_device_memory(self, ptr, bytes, release)?;
        Ok(DeviceBuffer {
            handle: BufferHandle::new(
                owner(self),
                "device buffer",
                buffer_state(Some(Box::new(mem)), bytes, ptr, true),
            ),
        })
    }
    fn free_device(&self, buf: &DeviceBuffer) -> Result<()> {
        let mut st = buf.handle.state(owner(self), "free_device")?;
        st.freed = true;
        st.len = 0;
        st.ptr = 0;
        drop(st.mem.take());
        Ok(())
    }
    fn resize_device(&self, buf: &DeviceBuffer, bytes: usize) -> Result<()> {
        let mut st = buf.handle.state(owner(self), "resize_device")?;
        if st.borrowed {
            return Err(Error::new(
                ErrorKind::Unsupported,
                self.kind(),
                "resize_device",
                "borrowed memory belongs to its framework and cannot be resized by hprt",
            ));
        }
        if bytes == st.len {
            return Ok(());
        }
        // Allocate before releasing so a failure leaves the buffer as it was.
        let next = if bytes == 0 {
            None
        } else {
            Some(Backend::alloc_device(self, bytes)?)
        };
        drop(st.mem.take());
        match next {
            Some((mem, ptr)) => {
                st.mem = Some(Box::new(mem));
                st.ptr = ptr;
            }
            None => st.ptr = 0,
        }
        st.len = bytes;
        Ok(())
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        let state = if bytes == 0 {
            buffer_state(None, 0, 0, false)
        } else {
            let (mem, ptr) = Backend::alloc_pinned(self, bytes)?;
            buffer_state(Some(Box::new(mem)), bytes, ptr, false)
        };
        Ok(PinnedBuffer {
            handle: BufferHandle::new(owner(self), "pinned buffer", state),
        })
    }
    fn free_pinned(&self, buf: &PinnedBuffer) -> Result<()> {
        let mut st = buf.handle.state(owner(self), "free_pinned")?;
        st.freed = true;
        st.len = 0;
        st.ptr = 0;
        st.queued.clear();
        drop(st.mem.take());
        Ok(())
    }

    fn copy_async(
        &self,
        dst: Memory<&DeviceBuffer, &PinnedBuffer>,
        dst_offset: usize,
        src: Memory<&DeviceBuffer, &PinnedBuffer>,
        src_offset: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "copy_async";
        let s = stream_obj(self, stream, OP)?;
        let d = copy_memory(self, dst, OP, dst_offset, bytes)?;
        let r = copy_memory(self, src, OP, src_offset, bytes)?;
        let (Some(d), Some(r)) = (d, r) else {
            // Bounds checks passed with no storage: the copy is empty.
            return Ok(());
        };
        let (d, r) = (Place::new(d, dst_offset), Place::new(r, src_offset));
        Backend::copy(self, CopyKind::between(&dst, &src), d, r, bytes, &s)?;
        match (dst, src) {
            (Memory::Pinned(a), Memory::Pinned(b)) if a.same_as(b) => {
                note_pinned_use(self, a, stream, &s)
            }
            (Memory::Pinned(a), Memory::Pinned(b)) => {
                note_pinned_use(self, a, stream, &s)?;
                note_pinned_use(self, b, stream, &s)
            }
            (Memory::Pinned(p), _) | (_, Memory::Pinned(p)) => note_pinned_use(self, p, stream, &s),
            _ => Ok(()),
        }
    }
    fn memset_async(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        value: u8,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "memset_async";
        let s = stream_obj(self, stream, OP)?;
        match dst
            .handle
            .mem_for::<B::DeviceMemory>(owner(self), OP, offset, bytes)?
        {
            Some(m) if bytes > 0 => Backend::memset(self, Place::new(m, offset), value, bytes, &s),
            _ => Ok(()),
        }
    }

    fn launch_kernel(&self, kernel: Kernel<Place<&DeviceBuffer>>, stream: &Stream) -> Result<()> {
        let name = kernel.name();
        let s = stream_obj(self, stream, name)?;
        kernel.validate(self.kind())?;
        check_kernel_overlap(self, &kernel)?;
        let sizes: Vec<usize> = kernel.places().iter().map(|p| p.1).collect();
        let mut i = 0;
        let resolved = kernel.try_map(|r| {
            let bytes = sizes[i];
            i += 1;
            device_place(self, r, name, bytes)
        })?;
        if kernel.count() == 0 {
            return Ok(());
        }
        // Every place of a non-empty kernel has bytes, so each resolved to memory.
        let resolved = resolved.try_map(|p| {
            p.ok_or_else(|| {
                Error::new(
                    ErrorKind::Internal,
                    self.kind(),
                    name,
                    "a non-empty place has no memory",
                )
            })
        })?;
        Backend::kernel(self, resolved, &s)
    }
    fn launch_module_kernel(
        &self,
        module: &DeviceModule,
        kernel: &str,
        shape: LaunchShape,
        args: &[KernelArg<Place<&DeviceBuffer>>],
        stream: &Stream,
    ) -> Result<()> {
        const OP: &str = "launch_module_kernel";
        let s = stream_obj(self, stream, OP)?;
        if shape.grid == 0 || shape.block == 0 {
            return Err(Error::new(
                ErrorKind::InvalidValue,
                self.kind(),
                OP,
                format!(
                    "{}.{kernel}: a launch of {} blocks of {} threads runs nothing",
                    module.name, shape.grid, shape.block
                ),
            ));
        }
        let resolved = args
            .iter()
            .map(|a| {
                Ok(match *a {
                    KernelArg::Ptr { at, bytes, access } => KernelArg::Ptr {
                        at: device_place(self, at, OP, bytes)?,
                        bytes,
                        access,
                    },
                    KernelArg::U32(v) => KernelArg::U32(v),
                    KernelArg::U64(v) => KernelArg::U64(v),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Backend::module_kernel(self, module, kernel, shape, &resolved, &s)
    }
    fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()> {
        let s = stream_obj(self, stream, "launch_host_fn")?;
        Backend::host_fn(self, &s, Box::new(move || run_host_fn(f)))
    }
    fn launch_host_fn_on_memory(
        &self,
        stream: &Stream,
        dst: (Place<&DeviceBuffer>, usize),
        src: (Place<&DeviceBuffer>, usize),
        f: HostMemoryFn,
    ) -> Result<()> {
        const OP: &str = "launch_host_fn_on_memory";
        if !Backend::capabilities(self).device_memory_is_host {
            return Err(Error::new(
                ErrorKind::Unsupported,
                self.kind(),
                OP,
                "this backend's device memory is not host memory: copy it to pinned memory",
            ));
        }
        let s = stream_obj(self, stream, OP)?;
        let ((d, dst_len), (r, src_len)) = (dst, src);
        let (d_mem, d_ptr) =
            d.mem
                .handle
                .mem_and_ptr_for::<B::DeviceMemory>(owner(self), OP, d.offset, dst_len)?;
        let (r_mem, r_ptr) =
            r.mem
                .handle
                .mem_and_ptr_for::<B::DeviceMemory>(owner(self), OP, r.offset, src_len)?;
        let apart = d.offset + dst_len <= r.offset || r.offset + src_len <= d.offset;
        if d.mem.same_as(r.mem) && dst_len > 0 && src_len > 0 && !apart {
            return Err(Error::new(
                ErrorKind::InvalidValue,
                self.kind(),
                OP,
                format!(
                    "the range written ({} bytes at {}) shares bytes with the range read ({} \
                     bytes at {})",
                    dst_len, d.offset, src_len, r.offset
                ),
            ));
        }
        let (d_addr, r_addr) = (d_ptr + d.offset, r_ptr + r.offset);
        let run: HostFn = Box::new(move || {
            // Held until `f` returned: a free meanwhile leaves the bytes allocated.
            let _alive = (d_mem, r_mem);
            let out: &mut [u8] = if dst_len == 0 {
                &mut []
            } else {
                // SAFETY: device memory is host memory on this backend, so the address is the
                // host's; the range was bounds-checked against the allocation `_alive` holds;
                // stream order puts this after the work queued before it, and the range read
                // does not overlap it (checked above).
                unsafe { std::slice::from_raw_parts_mut(d_addr as *mut u8, dst_len) }
            };
            let inp: &[u8] = if src_len == 0 {
                &[]
            } else {
                // SAFETY: as for `out`, for the range read.
                unsafe { std::slice::from_raw_parts(r_addr as *const u8, src_len) }
            };
            f(out, inp)
        });
        Backend::host_fn(self, &s, Box::new(move || run_host_fn(run)))
    }

    fn unique_id(&self) -> Result<UniqueId> {
        Backend::unique_id(self)
    }
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator> {
        if world == 0 || rank >= world {
            return Err(Error::new(
                ErrorKind::InvalidValue,
                self.kind(),
                "comm_init",
                format!("rank {rank} is not a rank of a world of {world}"),
            ));
        }
        // NCCL counts ranks in an `int`, HCCL in a `uint32_t`: a larger world would wrap.
        if i32::try_from(world).is_err() {
            return Err(Error::new(
                ErrorKind::InvalidValue,
                self.kind(),
                "comm_init",
                format!("a world of {world} ranks is more than any backend counts"),
            ));
        }
        let obj = Backend::comm_init(self, id, rank, world)?;
        Ok(Communicator {
            handle: ObjectHandle::new(owner(self), "communicator", obj),
            rank,
            world,
        })
    }
    fn comm_split(
        &self,
        comm: &Communicator,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<Communicator>> {
        const OP: &str = "comm_split";
        let mut seen = vec![false; comm.world];
        for &r in rank_lists.iter().flatten() {
            if r >= comm.world || std::mem::replace(&mut seen[r], true) {
                return Err(Error::new(
                    ErrorKind::InvalidValue,
                    self.kind(),
                    OP,
                    format!(
                        "rank lists must hold distinct ranks below {}: {rank_lists:?}",
                        comm.world
                    ),
                ));
            }
        }
        let parent = comm.handle.get::<B::Comm>(owner(self), OP)?;
        Ok(
            Backend::comm_split(self, &parent, rank_lists)?.map(|(obj, rank, world)| {
                Communicator {
                    handle: ObjectHandle::new(owner(self), "communicator", obj),
                    rank,
                    world,
                }
            }),
        )
    }
    fn destroy_comm(&self, comm: &Communicator) -> Result<()> {
        let obj = comm.handle.take::<B::Comm>(owner(self), "destroy_comm")?;
        Backend::destroy_comm(self, obj)
    }
    fn abort_comm(&self, comm: &Communicator) -> Result<()> {
        let obj = comm.handle.take::<B::Comm>(owner(self), "abort_comm")?;
        Backend::abort_comm(self, obj)
    }
    fn collective(
        &self,
        comm: &Communicator,
        op: Collective<Place<&DeviceBuffer>>,
        stream: &Stream,
    ) -> Result<()> {
        let name = op.name();
        let (rank, world) = (comm.rank, comm.world);
        let c = comm.handle.get::<B::Comm>(owner(self), name)?;
        let s = stream_obj(self, stream, name)?;
        op.validate(self.kind(), world)?;
        check_overlap(self, &op, rank, world)?;
        let sizes: Vec<usize> = op.places(world).iter().map(|p| p.1).collect();
        let mut i = 0;
        let resolved = op.try_map(|r| {
            let bytes = sizes[i];
            i += 1;
            Ok(device_place(self, r, name, bytes)?.filter(|_| bytes > 0))
        })?;
        Backend::collective(self, &c, resolved, &s)
    }
    fn group_start(&self) -> Result<()> {
        Backend::group_start(self)
    }
    fn group_end(&self) -> Result<()> {
        Backend::group_end(self)
    }
}
