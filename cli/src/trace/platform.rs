//! [`TracingPlatform`]: every `Platform` call delegated, stream work timed with two
//! [`StreamClock`] marks, bytes counted per track, device memory sampled.

use super::*;

/// A platform that records what its streams run (see the module docs).
pub struct TracingPlatform {
    inner: PlatformHandle,
    rec: Arc<Recorder>,
    /// Made at the first traced work (it calibrates on the device, which only a recorder with
    /// markers needs).
    clock: Mutex<Option<StreamClock>>,
}

impl TracingPlatform {
    pub fn new(inner: PlatformHandle, rec: Arc<Recorder>) -> Self {
        TracingPlatform {
            inner,
            rec,
            clock: Mutex::new(None),
        }
    }

    fn clock(&self) -> Result<StreamClock> {
        let mut clock = lock(&self.clock);
        if let Some(c) = &*clock {
            return Ok(c.clone());
        }
        let c = StreamClock::new(self.inner.clone())?;
        *clock = Some(c.clone());
        Ok(c)
    }

    pub fn recorder(&self) -> &Arc<Recorder> {
        &self.rec
    }

    /// Samples the device memory in use on the calling thread's device for its rank's
    /// counter track (see the module docs).
    fn sample_memory(&self) {
        if self.rec.markers {
            let bytes = self.inner.memory_stats().device_current as u64;
            self.rec.sample_memory(thread_rank(), bytes);
        }
    }

    /// Gives `stream` its role and track name, for the calling thread's rank.
    pub fn name_stream(&self, stream: &Stream, role: Role, label: &str) {
        self.rec.register(stream, thread_rank(), role, label);
    }

    /// Records everything `enqueue` queues on `stream` as one span named `op` (for work made of
    /// several platform calls, such as an encode through the host codec). Spans of the calls
    /// inside nest within it.
    pub fn range<R>(
        &self,
        stream: &Stream,
        op: &str,
        bytes: u64,
        enqueue: impl FnOnce() -> R,
    ) -> Result<R> {
        let end = self.begin(stream, op, bytes)?;
        let out = enqueue();
        self.end(stream, end)?;
        Ok(out)
    }

    /// With markers, marks the start of a span on `stream`; returns what [`Self::end`] needs.
    fn begin(&self, stream: &Stream, op: &str, bytes: u64) -> Result<Option<SpanStart>> {
        if !self.rec.markers {
            return Ok(None);
        }
        let (track, _) = self.rec.track_of(stream);
        let (layer, name) = current_scope().unwrap_or((None, op.to_string()));
        let clock = self.clock()?;
        let start = clock.mark(stream)?;
        Ok(Some(SpanStart {
            clock,
            track,
            name,
            op: op.to_string(),
            layer,
            bytes,
            start,
        }))
    }

    /// Marks the end of the span `begin` started; the recorder times it once the stream gets
    /// there.
    fn end(&self, stream: &Stream, started: Option<SpanStart>) -> Result<()> {
        let Some(s) = started else {
            return Ok(());
        };
        let end = s.clock.mark(stream)?;
        self.rec.add_pending(PendingSpan { started: s, end });
        Ok(())
    }

    /// Runs `work` (one enqueue on `stream`) between markers; the end marker is only queued
    /// when the work was.
    fn traced(
        &self,
        stream: &Stream,
        op: &str,
        bytes: u64,
        work: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.sample_memory();
        let end = self.begin(stream, op, bytes)?;
        work()?;
        self.end(stream, end)
    }
}

fn copy_op(kind: CopyKind) -> &'static str {
    match kind {
        CopyKind::HostToDevice => "copy h2d",
        CopyKind::DeviceToHost => "copy d2h",
        CopyKind::DeviceToDevice => "copy d2d",
        CopyKind::HostToHost => "copy h2h",
    }
}

impl Platform for TracingPlatform {
    fn backend(&self) -> BackendKind {
        self.inner.backend()
    }
    fn info(&self) -> PlatformInfo {
        self.inner.info()
    }
    fn capabilities(&self) -> hprt_platform::Capabilities {
        self.inner.capabilities()
    }
    fn device_count(&self) -> usize {
        self.inner.device_count()
    }
    fn set_device(&self, ordinal: usize) -> Result<()> {
        self.inner.set_device(ordinal)
    }
    fn current_device(&self) -> usize {
        self.inner.current_device()
    }
    fn mem_info(&self) -> Result<MemInfo> {
        self.inner.mem_info()
    }
    fn memory_stats(&self) -> MemoryStats {
        self.inner.memory_stats()
    }
    fn reset_peak_memory(&self) {
        self.inner.reset_peak_memory()
    }
    fn create_stream(&self) -> Result<Stream> {
        let s = self.inner.create_stream()?;
        self.rec
            .register_track(&s, thread_rank(), Role::Other, "other", true);
        Ok(s)
    }
    unsafe fn wrap_external_stream(&self, raw: RawStream) -> Result<Stream> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.wrap_external_stream(raw) }
    }
    fn destroy_stream(&self, stream: &Stream) -> Result<()> {
        self.inner.destroy_stream(stream)
    }
    fn synchronize_stream(&self, stream: &Stream) -> Result<()> {
        self.inner.synchronize_stream(stream)
    }
    fn query_stream(&self, stream: &Stream) -> Result<bool> {
        self.inner.query_stream(stream)
    }
    fn lend_stream_to_framework(&self, stream: &Stream) -> Result<()> {
        self.inner.lend_stream_to_framework(stream)
    }
    fn synchronize_device(&self) -> Result<()> {
        self.inner.synchronize_device()
    }
    fn create_event(&self, timing: bool) -> Result<Event> {
        self.inner.create_event(timing)
    }
    fn destroy_event(&self, event: &Event) -> Result<()> {
        self.inner.destroy_event(event)
    }
    fn record_event(&self, event: &Event, stream: &Stream) -> Result<()> {
        self.inner.record_event(event, stream)
    }
    fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        self.inner.stream_wait_event(stream, event)
    }
    fn query_event(&self, event: &Event) -> Result<bool> {
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: &Event) -> Result<()> {
        self.inner.synchronize_event(event)
    }
    fn event_elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32> {
        self.inner.event_elapsed_ms(start, end)
    }
    fn alloc_device(&self, bytes: usize) -> Result<DeviceBuffer> {
        let buf = self.inner.alloc_device(bytes)?;
        self.sample_memory();
        Ok(buf)
    }
    unsafe fn wrap_device_memory(
        &self,
        ptr: usize,
        bytes: usize,
        release: Option<ReleaseFn>,
    ) -> Result<DeviceBuffer> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.wrap_device_memory(ptr, bytes, release) }
    }
    fn free_device(&self, buf: &DeviceBuffer) -> Result<()> {
        let freed = self.inner.free_device(buf);
        self.sample_memory();
        freed
    }
    fn resize_device(&self, buf: &DeviceBuffer, bytes: usize) -> Result<()> {
        let resized = self.inner.resize_device(buf, bytes);
        self.sample_memory();
        resized
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        self.inner.alloc_pinned(bytes)
    }
    fn free_pinned(&self, buf: &PinnedBuffer) -> Result<()> {
        self.inner.free_pinned(buf)
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
        let kind = CopyKind::between(&dst, &src);
        self.traced(stream, copy_op(kind), bytes as u64, || {
            self.inner
                .copy_async(dst, dst_offset, src, src_offset, bytes, stream)
        })?;
        // Counted once queued: a copy the platform refused moved nothing.
        let (_, counters) = self.rec.track_of(stream);
        counters.by_kind[kind_index(kind)].fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(())
    }
    fn memset_async(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        value: u8,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.traced(stream, "memset", bytes as u64, || {
            self.inner.memset_async(dst, offset, value, bytes, stream)
        })
    }
    fn launch_kernel(&self, kernel: Kernel<Place<&DeviceBuffer>>, stream: &Stream) -> Result<()> {
        let written: usize = kernel
            .places()
            .iter()
            .filter(|p| p.2 != hprt_platform::Access::Read)
            .map(|p| p.1)
            .sum();
        let op = kernel.name();
        self.traced(stream, op, written as u64, || {
            self.inner.launch_kernel(kernel, stream)
        })
    }
    fn launch_module_kernel(
        &self,
        module: &hprt_platform::DeviceModule,
        kernel: &str,
        shape: hprt_platform::LaunchShape,
        args: &[hprt_platform::KernelArg<Place<&DeviceBuffer>>],
        stream: &Stream,
    ) -> Result<()> {
        let written: usize = args
            .iter()
            .map(|a| match a {
                hprt_platform::KernelArg::Ptr { bytes, access, .. }
                    if *access != hprt_platform::Access::Read =>
                {
                    *bytes
                }
                _ => 0,
            })
            .sum();
        self.traced(stream, "module_kernel", written as u64, || {
            self.inner
                .launch_module_kernel(module, kernel, shape, args, stream)
        })
    }
    fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()> {
        self.inner.launch_host_fn(stream, f)
    }
    fn launch_host_fn_on_memory(
        &self,
        stream: &Stream,
        dst: (Place<&DeviceBuffer>, usize),
        src: (Place<&DeviceBuffer>, usize),
        f: HostMemoryFn,
    ) -> Result<()> {
        self.inner.launch_host_fn_on_memory(stream, dst, src, f)
    }

    fn unique_id(&self) -> Result<UniqueId> {
        self.inner.unique_id()
    }
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator> {
        self.inner.comm_init(id, rank, world)
    }
    fn comm_split(
        &self,
        comm: &Communicator,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<Communicator>> {
        self.inner.comm_split(comm, rank_lists)
    }
    fn destroy_comm(&self, comm: &Communicator) -> Result<()> {
        self.inner.destroy_comm(comm)
    }
    fn abort_comm(&self, comm: &Communicator) -> Result<()> {
        self.inner.abort_comm(comm)
    }
    fn collective(
        &self,
        comm: &Communicator,
        op: Collective<Place<&DeviceBuffer>>,
        stream: &Stream,
    ) -> Result<()> {
        // What this rank receives: the size that says how much crossed the interconnect.
        let bytes = op.places(comm.world()).last().map_or(0, |p| p.1);
        let name = op.name();
        self.traced(stream, name, bytes as u64, || {
            self.inner.collective(comm, op, stream)
        })
    }
    fn group_start(&self) -> Result<()> {
        self.inner.group_start()
    }
    fn group_end(&self) -> Result<()> {
        self.inner.group_end()
    }
}
