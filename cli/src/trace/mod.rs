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
//!
//! Files: this one holds the [`Recorder`] and the calling thread's rank and scope;
//! `platform.rs` the [`TracingPlatform`] decorator; `output.rs` the Chrome trace and the
//! terminal timeline.

mod output;
mod platform;
#[cfg(test)]
mod tests;

pub use output::{chrome_trace, timeline, trace_path_from_env, write_chrome_trace};
pub use platform::TracingPlatform;

use hprt_platform::sync::lock;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hprt_platform::PlatformHandle;
use hprt_platform::{
    host_seconds, BackendKind, Collective, Communicator, CopyKind, DeviceBuffer, Event, HostFn,
    HostMemoryFn, Kernel, MemInfo, Memory, MemoryStats, PinnedBuffer, Place, Platform,
    PlatformInfo, RawStream, ReleaseFn, Result, Stream, StreamClock, StreamMark, UniqueId,
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
