//! Stream traces: a [`Platform`] decorator that records when each stream actually ran each copy,
//! kernel and collective, and writes them as a Chrome / Perfetto trace or a terminal timeline.
//!
//! [`TracingPlatform`] wraps any platform and delegates every call. Around each piece of stream
//! work it records two marks of the platform's [`StreamClock`] (timing events, put on the host's
//! monotonic clock: hprt's one stream clock, which `hprt.fsdp.StreamTrace` uses too), so the
//! spans are backend-neutral: the same code traces the cpu backend's worker threads, CUDA streams
//! and Ascend streams, without a host function stalling the stream between its pieces of work. A
//! span is known once its stream reached its end mark ([`Recorder::spans`] resolves those). Streams are named with a
//! [`Role`] (compute, d2h, h2d, codec, comm) and belong to the rank of the thread that made them
//! ([`set_thread_rank`]); the tensor a piece of work belongs to comes from the calling thread's
//! [`scope`]. Byte counts per track are kept even when timing markers are off
//! ([`Recorder::new`]), which is how `hprt demo` measures host-link traffic.
//!
//! With markers on, the platform's device memory in use ([`Platform::memory_stats`]'s
//! `device_current` on the calling thread's device) is sampled after every call that allocates,
//! frees or enqueues work, and written as a counter track per rank and section ("device memory
//! in use", in MiB) beside the stream tracks, so a trace shows where on the step the peak falls
//! and which copies and kernels ran around it. Memory freed by a dropped buffer (or in stream
//! order, once its queued work finished) shows at the next sampled call.
//!
//! ```
//! use std::sync::Arc;
//! use hprt_platform::{CopyKind, CpuBackend, CpuConfig, Platform};
//! use hprt_platform::PlatformHandle;
//! use hprt_cli::trace::{chrome_trace, scope, Recorder, Role, TracingPlatform};
//!
//! let inner: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
//! let rec = Recorder::new(true);
//! let p = TracingPlatform::new(PlatformHandle::from(inner), Arc::clone(&rec));
//! let s = p.create_stream()?;
//! p.name_stream(&s, Role::D2h, "d2h");
//! let (dev, host) = (p.alloc_device(4096)?, p.alloc_pinned(4096)?);
//! {
//!     let _g = scope(Some(0), "L0.x");
//!     p.copy_async((&host).into(), 0, (&dev).into(), 0, 4096, &s)?;
//! }
//! p.synchronize_stream(&s)?;
//! assert_eq!(rec.bytes(None, Some(Role::D2h), CopyKind::DeviceToHost), 4096);
//! let json = chrome_trace(&rec);
//! assert!(json["traceEvents"].as_array().unwrap().iter().any(|e| e["name"] == "L0.x"));
//! # Ok::<(), hprt_platform::Error>(())
//! ```

use hprt_platform::sync::lock;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hprt_platform::PlatformHandle;
use hprt_platform::{
    host_seconds, BackendKind, Collective, Communicator, CopyKind, DeviceBuffer, Event, HostFn,
    Kernel, MemInfo, Memory, MemoryStats, PinnedBuffer, Place, Platform, PlatformInfo, RawStream,
    ReleaseFn, Result, Stream, StreamClock, StreamMark, UniqueId,
};
use serde_json::{json, Value};

/// What a stream is for; one trace track per stream, named after its role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Compute,
    D2h,
    H2d,
    Codec,
    Comm,
    /// A stream nobody named (created through the tracing platform, never given a role).
    Other,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Compute,
        Role::D2h,
        Role::H2d,
        Role::Codec,
        Role::Comm,
        Role::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::Compute => "compute",
            Role::D2h => "d2h",
            Role::H2d => "h2d",
            Role::Codec => "codec",
            Role::Comm => "comm",
            Role::Other => "other",
        }
    }
}

/// One stream of one rank, within one section (a configuration of a run).
#[derive(Clone, Debug, PartialEq)]
pub struct Track {
    pub rank: usize,
    pub role: Role,
    /// The track's name in a trace: the role, and which stream of that role when a rank has
    /// several (`comm all-gather`, `comm reduce`).
    pub label: String,
    pub section: String,
}

/// One piece of stream work, from when its stream reached it to when it completed.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Index into [`Recorder::tracks`].
    pub track: usize,
    /// The tensor or step it belongs to (the calling thread's [`scope`]), else the operation.
    pub name: String,
    pub op: String,
    pub layer: Option<usize>,
    pub bytes: u64,
    /// Microseconds since the recorder was made.
    pub start_us: f64,
    pub end_us: f64,
}

/// A span whose marks were recorded, kept until its stream reached the end mark.
struct PendingSpan {
    started: SpanStart,
    end: StreamMark,
}

/// Pending spans resolved as they are added, every this many: bounds the events a long run keeps
/// alive between reads of [`Recorder::spans`].
const RESOLVE_EVERY: usize = 256;

/// The device memory in use on one rank, sampled after a platform call.
#[derive(Clone, Debug, PartialEq)]
pub struct MemorySample {
    pub rank: usize,
    pub section: String,
    /// Microseconds since the recorder was made.
    pub at_us: f64,
    /// `device_current` of the rank's device: bytes hprt's platform has allocated there.
    pub device_bytes: u64,
}

#[derive(Default)]
struct MemoryTrack {
    samples: Vec<MemorySample>,
    /// The last value per (rank, section): only changes are kept.
    last: HashMap<(usize, String), u64>,
}

/// Bytes a track moved, by direction.
#[derive(Debug, Default)]
struct Counters {
    by_kind: [AtomicU64; 4],
}

fn kind_index(k: CopyKind) -> usize {
    match k {
        CopyKind::HostToDevice => 0,
        CopyKind::DeviceToHost => 1,
        CopyKind::DeviceToDevice => 2,
        CopyKind::HostToHost => 3,
    }
}

#[derive(Default)]
struct Registry {
    tracks: Vec<Track>,
    counters: Vec<Arc<Counters>>,
    by_stream: HashMap<RawStream, usize>,
}

/// Where spans and byte counts go; shared by every rank's [`TracingPlatform`] calls.
pub struct Recorder {
    /// [`host_seconds`] when the recorder was made: the zero of spans and memory samples.
    epoch_s: f64,
    markers: bool,
    section: Mutex<String>,
    registry: Mutex<Registry>,
    spans: Mutex<Vec<Span>>,
    pending: Mutex<Vec<PendingSpan>>,
    memory: Mutex<MemoryTrack>,
}

impl Recorder {
    /// `markers`: time every piece of stream work (two timing events each); without, only
    /// bytes are counted, which costs nothing on the streams.
    pub fn new(markers: bool) -> Arc<Self> {
        Arc::new(Recorder {
            epoch_s: host_seconds(),
            markers,
            section: Mutex::new(String::new()),
            registry: Mutex::default(),
            spans: Mutex::default(),
            pending: Mutex::default(),
            memory: Mutex::default(),
        })
    }

    pub fn records_spans(&self) -> bool {
        self.markers
    }

    /// Microseconds since the recorder was made (the spans' clock).
    pub fn now_us(&self) -> f64 {
        self.us(host_seconds())
    }

    /// [`host_seconds`] `s` as microseconds since the recorder was made.
    fn us(&self, s: f64) -> f64 {
        (s - self.epoch_s) * 1e6
    }

    /// Streams named from now on belong to `section` (e.g. one configuration of a demo).
    pub fn set_section(&self, section: &str) {
        *lock(&self.section) = section.to_string();
    }

    pub fn tracks(&self) -> Vec<Track> {
        lock(&self.registry).tracks.clone()
    }

    /// Every completed span so far (its stream reached its end), in no particular order.
    pub fn spans(&self) -> Vec<Span> {
        self.resolve();
        lock(&self.spans).clone()
    }

    fn add_pending(&self, span: PendingSpan) {
        let due = {
            let mut pending = lock(&self.pending);
            pending.push(span);
            pending.len() % RESOLVE_EVERY == 0
        };
        if due {
            self.resolve();
        }
    }

    /// Moves the pending spans whose stream reached their end mark to the spans. A span whose
    /// marks cannot be read (its stream failed before them) is dropped: the failure is the
    /// stream's error, reported where the work was waited for, and it never ran to be timed.
    fn resolve(&self) {
        // Held throughout, so a concurrent `spans()` never sees a span in neither list.
        let mut pending_guard = lock(&self.pending);
        let pending = std::mem::take(&mut *pending_guard);
        let mut waiting = Vec::new();
        let mut done = Vec::new();
        for p in pending {
            match p.end.try_seconds() {
                Ok(None) => waiting.push(p),
                Ok(Some(end_s)) => {
                    let s = p.started;
                    if let Ok(start_s) = s.start.seconds() {
                        done.push(Span {
                            track: s.track,
                            name: s.name,
                            op: s.op,
                            layer: s.layer,
                            bytes: s.bytes,
                            start_us: self.us(start_s),
                            end_us: self.us(end_s),
                        });
                    }
                }
                Err(_) => {}
            }
        }
        *pending_guard = waiting;
        lock(&self.spans).extend(done);
    }

    /// The device-memory samples so far (only changes, per rank and section), in time order
    /// per rank.
    pub fn memory_samples(&self) -> Vec<MemorySample> {
        lock(&self.memory).samples.clone()
    }

    /// Records `device_bytes` in use on `rank`'s device now, when it changed since the last
    /// sample of that rank in the current section (with markers only).
    pub fn sample_memory(&self, rank: usize, device_bytes: u64) {
        if !self.markers {
            return;
        }
        let section = lock(&self.section).clone();
        let at_us = self.now_us();
        let mut m = lock(&self.memory);
        if m.last.get(&(rank, section.clone())) == Some(&device_bytes) {
            return;
        }
        m.last.insert((rank, section.clone()), device_bytes);
        m.samples.push(MemorySample {
            rank,
            section,
            at_us,
            device_bytes,
        });
    }

    /// Bytes copied in direction `kind` on tracks of `section` and `role` (`None`: any).
    pub fn bytes(&self, section: Option<&str>, role: Option<Role>, kind: CopyKind) -> u64 {
        let reg = lock(&self.registry);
        reg.tracks
            .iter()
            .zip(&reg.counters)
            .filter(|(t, _)| section.is_none_or(|s| t.section == s))
            .filter(|(t, _)| role.is_none_or(|r| t.role == r))
            .map(|(_, c)| c.by_kind[kind_index(kind)].load(Ordering::Relaxed))
            .sum()
    }

    fn register(&self, stream: &Stream, rank: usize, role: Role, label: &str) {
        self.register_track(stream, rank, role, label, false);
    }

    /// `fresh`: a stream just created gets a track of its own even when its raw handle had
    /// one (a driver may hand a destroyed stream's address out again, and the cuda backend
    /// hands out the streams it parked for a framework), so one stream's bytes never count for
    /// another.
    fn register_track(&self, stream: &Stream, rank: usize, role: Role, label: &str, fresh: bool) {
        let section = lock(&self.section).clone();
        let mut reg = lock(&self.registry);
        let track = Track {
            rank,
            role,
            label: label.to_string(),
            section,
        };
        match reg.by_stream.get(&stream.raw()).copied() {
            // A stream is renamed (its role given after creation): same track, same counters.
            Some(i) if !fresh => reg.tracks[i] = track,
            _ => {
                let i = reg.tracks.len();
                reg.tracks.push(track);
                reg.counters.push(Arc::default());
                reg.by_stream.insert(stream.raw(), i);
            }
        }
    }

    /// The track of `stream`, registering it (role `Other`) when nobody named it.
    fn track_of(&self, stream: &Stream) -> (usize, Arc<Counters>) {
        {
            let reg = lock(&self.registry);
            if let Some(&i) = reg.by_stream.get(&stream.raw()) {
                return (i, Arc::clone(&reg.counters[i]));
            }
        }
        self.register(stream, thread_rank(), Role::Other, "other");
        let reg = lock(&self.registry);
        let i = reg.by_stream[&stream.raw()];
        (i, Arc::clone(&reg.counters[i]))
    }
}

thread_local! {
    static RANK: RefCell<usize> = const { RefCell::new(0) };
    static SCOPE: RefCell<Option<(Option<usize>, String)>> = const { RefCell::new(None) };
}

/// Streams this thread creates or names belong to `rank` (ranks are threads on the cpu backend,
/// and one thread drives one device elsewhere).
pub fn set_thread_rank(rank: usize) {
    RANK.with(|r| *r.borrow_mut() = rank);
}

fn thread_rank() -> usize {
    RANK.with(|r| *r.borrow())
}

/// Restores the previous scope when dropped.
#[must_use = "the scope ends when the guard is dropped"]
pub struct ScopeGuard {
    previous: Option<(Option<usize>, String)>,
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let prev = self.previous.take();
        SCOPE.with(|s| *s.borrow_mut() = prev);
    }
}

/// Stream work this thread enqueues until the guard drops is named `name` (a tensor such as
/// `L3.hidden`, or a step such as `L3 fwd`) and attributed to `layer`.
pub fn scope(layer: Option<usize>, name: impl Into<String>) -> ScopeGuard {
    let previous = SCOPE.with(|s| s.borrow_mut().replace((layer, name.into())));
    ScopeGuard { previous }
}

fn current_scope() -> Option<(Option<usize>, String)> {
    SCOPE.with(|s| s.borrow().clone())
}

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

/// A span between [`TracingPlatform::begin`] and [`TracingPlatform::end`]: its start mark and
/// what it will be recorded as.
struct SpanStart {
    clock: StreamClock,
    track: usize,
    name: String,
    op: String,
    layer: Option<usize>,
    bytes: u64,
    start: StreamMark,
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

/// The recorder's spans as Chrome trace JSON (`traceEvents` of complete events, one process per
/// rank, one thread per stream track, tracks named by `thread_name` metadata), which Perfetto
/// and `chrome://tracing` open.
pub fn chrome_trace(rec: &Recorder) -> Value {
    let tracks = rec.tracks();
    let mut events = Vec::new();
    let samples = rec.memory_samples();
    let mut ranks: Vec<usize> = tracks
        .iter()
        .map(|t| t.rank)
        .chain(samples.iter().map(|m| m.rank))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in ranks {
        events.push(
            json!({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
            "args": {"name": format!("rank {r}")}}),
        );
        events.push(
            json!({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
            "args": {"sort_index": r}}),
        );
    }
    // Tracks sorted by section (run order), then role, so each configuration reads top-down.
    let mut sections: Vec<&str> = Vec::new();
    for t in &tracks {
        if !sections.contains(&t.section.as_str()) {
            sections.push(&t.section);
        }
    }
    for (i, t) in tracks.iter().enumerate() {
        let name = if t.section.is_empty() {
            t.label.clone()
        } else {
            format!("{} [{}]", t.label, t.section)
        };
        let section_order = sections.iter().position(|s| *s == t.section).unwrap_or(0);
        let role_order = Role::ALL.iter().position(|r| *r == t.role).unwrap_or(0);
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": t.rank, "tid": i + 1,
            "args": {"name": name}}),
        );
        events.push(
            json!({"name": "thread_sort_index", "ph": "M", "pid": t.rank, "tid": i + 1,
            "args": {"sort_index": section_order * 1000 + role_order * 100 + i}}),
        );
    }
    // The memory counter tracks, one per rank and section, beside that rank's stream tracks.
    for m in samples {
        let name = if m.section.is_empty() {
            "device memory in use".to_string()
        } else {
            format!("device memory in use [{}]", m.section)
        };
        events.push(json!({
            "name": name,
            "ph": "C",
            "ts": m.at_us,
            "pid": m.rank,
            "args": {"MiB": m.device_bytes as f64 / (1u64 << 20) as f64},
        }));
    }
    let mut spans = rec.spans();
    spans.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    for s in spans {
        let t = &tracks[s.track];
        let mut args = json!({"bytes": s.bytes, "op": s.op, "stream": t.label});
        if let Some(l) = s.layer {
            args["layer"] = json!(l);
        }
        if s.name != s.op {
            args["tensor"] = json!(s.name);
        }
        events.push(json!({
            "name": s.name,
            "cat": t.role.name(),
            "ph": "X",
            "ts": s.start_us,
            "dur": (s.end_us - s.start_us).max(0.0),
            "pid": t.rank,
            "tid": s.track + 1,
            "args": args,
        }));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// Writes [`chrome_trace`] to `path`.
pub fn write_chrome_trace(rec: &Recorder, path: &std::path::Path) -> std::io::Result<()> {
    let text = serde_json::to_string(&chrome_trace(rec)).map_err(std::io::Error::other)?;
    std::fs::write(path, text)
}

/// A compact ASCII picture of `rank`'s tracks in `section` between two recorder times: one row
/// per track, `width` columns; a column shows the layer (mod 10) of the span that covers most
/// of it, `*` for work outside any layer, `.` when the stream was idle.
pub fn timeline(
    rec: &Recorder,
    rank: usize,
    section: &str,
    from_us: f64,
    to_us: f64,
    width: usize,
) -> String {
    let tracks = rec.tracks();
    let spans = rec.spans();
    let mut rows: Vec<(usize, &Track)> = tracks
        .iter()
        .enumerate()
        .filter(|(_, t)| t.rank == rank && t.section == section)
        .collect();
    rows.sort_by_key(|(i, t)| (t.role, *i));
    let width = width.max(10);
    let bucket = (to_us - from_us).max(1.0) / width as f64;
    let label_w = rows.iter().map(|(_, t)| t.label.len()).max().unwrap_or(5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:label_w$} |0 ms{:>w$}|",
        "",
        format!("{:.1} ms", (to_us - from_us) / 1e3),
        w = width - 4
    );
    for (i, t) in rows {
        let mine: Vec<&Span> = spans
            .iter()
            .filter(|s| s.track == i && s.end_us > from_us && s.start_us < to_us)
            .collect();
        if mine.is_empty() && t.role == Role::Other {
            continue;
        }
        let mut line = String::with_capacity(width);
        for c in 0..width {
            let (lo, hi) = (
                from_us + c as f64 * bucket,
                from_us + (c + 1) as f64 * bucket,
            );
            let best = mine
                .iter()
                .map(|s| (s.end_us.min(hi) - s.start_us.max(lo), s))
                .filter(|(overlap, _)| *overlap > 0.0)
                .max_by(|a, b| a.0.total_cmp(&b.0));
            line.push(match best {
                None => '.',
                Some((_, s)) => s.layer.map_or('*', |l| {
                    char::from_digit((l % 10) as u32, 10).unwrap_or('*')
                }),
            });
        }
        let _ = writeln!(out, "{:label_w$} |{line}|", t.label);
    }
    if let Some(row) = memory_row(rec, rank, section, from_us, to_us, width) {
        let _ = writeln!(out, "{:label_w$} |{row}|", "memory");
    }
    out
}

/// Levels of the timeline's memory row, lowest to highest.
const MEMORY_LEVELS: &[u8; 10] = b" .:-=+*#%@";

/// The timeline's memory row: per column, the most device memory in use during it (the last
/// sample before it counts from the column's start), as a level of the highest value in the
/// window; `None` without samples of `rank` in `section`.
fn memory_row(
    rec: &Recorder,
    rank: usize,
    section: &str,
    from_us: f64,
    to_us: f64,
    width: usize,
) -> Option<String> {
    let mut mine: Vec<(f64, u64)> = rec
        .memory_samples()
        .into_iter()
        .filter(|m| m.rank == rank && m.section == section && m.at_us < to_us)
        .map(|m| (m.at_us, m.device_bytes))
        .collect();
    mine.sort_by(|a, b| a.0.total_cmp(&b.0));
    let bucket = (to_us - from_us).max(1.0) / width as f64;
    let columns: Vec<u64> = (0..width)
        .map(|c| {
            let (lo, hi) = (
                from_us + c as f64 * bucket,
                from_us + (c + 1) as f64 * bucket,
            );
            let before = mine.iter().rev().find(|m| m.0 <= lo).map(|m| m.1);
            let during = mine.iter().filter(|m| m.0 > lo && m.0 < hi).map(|m| m.1);
            before.into_iter().chain(during).max().unwrap_or(0)
        })
        .collect();
    let top = *columns.iter().max()?;
    if top == 0 {
        return None;
    }
    Some(
        columns
            .iter()
            .map(|&v| {
                let level = (v as f64 / top as f64 * 9.0).round() as usize;
                MEMORY_LEVELS[level.min(9)] as char
            })
            .collect(),
    )
}

/// `HP_TRACE`: where to write a trace, if set and not empty.
pub fn trace_path_from_env() -> Option<std::path::PathBuf> {
    std::env::var_os("HP_TRACE")
        .filter(|v| !v.is_empty())
        .map(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hprt_platform::{CpuBackend, CpuConfig};

    fn traced(markers: bool) -> (TracingPlatform, Arc<Recorder>) {
        let inner: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
        let rec = Recorder::new(markers);
        (
            TracingPlatform::new(PlatformHandle::from(inner), Arc::clone(&rec)),
            rec,
        )
    }

    /// The device memory in use is a counter track of the rank, per section, beside its stream
    /// tracks: a sample after each allocation, free and enqueue that changed it, in MiB.
    #[test]
    fn the_trace_has_a_device_memory_counter_track() {
        let (p, rec) = traced(true);
        set_thread_rank(1);
        rec.set_section("swap");
        let s = p.create_stream().unwrap();
        p.name_stream(&s, Role::D2h, "d2h");
        let host = p.alloc_pinned(1 << 20).unwrap();
        let a = p.alloc_device(1 << 20).unwrap();
        let b = p.alloc_device(2 << 20).unwrap();
        p.copy_async((&host).into(), 0, (&a).into(), 0, 1 << 20, &s)
            .unwrap();
        p.synchronize_stream(&s).unwrap(); // the copy no longer holds `a`
        p.resize_device(&a, 0).unwrap();
        drop(b); // seen at the next call
        p.copy_async((&host).into(), 0, (&host).into(), 1 << 19, 16, &s)
            .unwrap();
        p.synchronize_stream(&s).unwrap();
        let mib: Vec<u64> = rec
            .memory_samples()
            .iter()
            .inspect(|m| assert_eq!((m.rank, m.section.as_str()), (1, "swap")))
            .map(|m| m.device_bytes >> 20)
            .collect();
        assert_eq!(mib, [1, 3, 2, 0], "{:?}", rec.memory_samples());
        let json = chrome_trace(&rec);
        let counters: Vec<&Value> = json["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "C")
            .collect();
        assert_eq!(counters.len(), 4);
        for c in &counters {
            assert_eq!(c["name"], "device memory in use [swap]");
            assert_eq!(c["pid"], 1);
            assert!(c["ts"].as_f64().is_some());
        }
        let values: Vec<f64> = counters
            .iter()
            .map(|c| c["args"]["MiB"].as_f64().unwrap())
            .collect();
        assert_eq!(values, [1.0, 3.0, 2.0, 0.0]);
        // The terminal timeline shows it as a row of levels, highest where 3 MiB were in use.
        let t = timeline(&rec, 1, "swap", 0.0, rec.now_us(), 40);
        let row = t.lines().find(|l| l.starts_with("memory")).expect(&t);
        assert!(row.contains('@'), "{t}");
        set_thread_rank(0);
    }

    /// Spans take their times from the platform's stream clock: a copy queued behind a host
    /// function that waits is listed once its stream ran it, and starts after the wait.
    #[test]
    fn spans_are_timed_by_the_stream_clock() {
        let (p, rec) = traced(true);
        let s = p.create_stream().unwrap();
        p.name_stream(&s, Role::H2d, "h2d");
        let (dev, host) = (p.alloc_device(4096).unwrap(), p.alloc_pinned(4096).unwrap());
        p.copy_async((&dev).into(), 0, (&host).into(), 0, 4096, &s)
            .unwrap();
        let (go, gate) = std::sync::mpsc::channel::<()>();
        p.launch_host_fn(
            &s,
            Box::new(move || {
                let _ = gate.recv();
            }),
        )
        .unwrap();
        {
            let _g = scope(Some(2), "L2.x");
            p.copy_async((&dev).into(), 0, (&host).into(), 0, 4096, &s)
                .unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        let listed: Vec<String> = rec.spans().into_iter().map(|s| s.name).collect();
        assert_eq!(listed, ["copy h2d"], "the second copy has not run yet");
        let released_us = rec.now_us();
        go.send(()).unwrap();
        p.synchronize_stream(&s).unwrap();
        let mut spans = rec.spans();
        spans.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
        assert_eq!(spans.len(), 2);
        assert_eq!((spans[1].name.as_str(), spans[1].layer), ("L2.x", Some(2)));
        assert!(spans[0].end_us <= spans[1].start_us);
        assert!(
            spans[1].start_us >= released_us - 100.0,
            "{spans:?} {released_us}"
        );
        assert!(spans[1].end_us <= rec.now_us());
    }

    /// Without markers nothing is sampled (the demo's byte counting stays free).
    #[test]
    fn no_memory_samples_without_markers() {
        let (p, rec) = traced(false);
        let _a = p.alloc_device(4096).unwrap();
        assert!(rec.memory_samples().is_empty());
    }
}
