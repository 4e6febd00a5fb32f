//! The cpu backend: the reference implementation every other backend is checked against, and the
//! embedded default.
//!
//! "Device" memory is host memory behind a capacity, so out-of-memory and peak accounting are
//! real; freed blocks are cached for reuse like a GPU framework's caching allocator (and, like
//! `cudaMalloc`, new allocations are not guaranteed zeroed); every created stream is a worker
//! thread, and raw stream 0 ([`HOST_STREAM`]) is the host itself (work queued on it runs in the
//! calling thread: CPU tensors' compute, which is done when its call returns); ranks of a world
//! are threads of one process that share one `CpuBackend` value.

mod comm;
mod copy;
mod memory;
mod reduce;
mod stream;

use crate::sync::lock;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::capabilities::Capabilities;
use crate::collective::Collective;
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::{CopyKind, RawStream, ReleaseFn, UniqueId};
use crate::info::{DeviceInfo, PlatformInfo};
use crate::kernel::{run_on_host, HostFn, Kernel};
use crate::memory::{MemInfo, MemoryCounter, MemoryStats};
use crate::place::{Memory, Place};

use comm::{CommMember, CommShared, CpuComm, Issued};
use memory::{BlockCache, CpuMem, MemRef};
use stream::{CpuEvent, EventCore, StreamCore, StreamRef};

/// Settings of a cpu platform value. [`CpuConfig::from_env`] reads the `HP_CPU_*` variables.
#[derive(Clone, Debug)]
pub struct CpuConfig {
    /// Capacity of each device in bytes (`HP_CPU_DEVICE_MEMORY`).
    pub device_memory: usize,
    /// Number of devices (`HP_CPU_DEVICES`).
    pub devices: usize,
    /// Limit on pinned host memory in bytes, if any (`HP_CPU_PINNED_MEMORY`).
    pub pinned_memory: Option<usize>,
    /// Seed for random delays of stream work (`HP_CPU_JITTER`).
    pub jitter: Option<u64>,
    /// How long a rank waits for its peers (`HP_CPU_COLLECTIVE_TIMEOUT_MS`, else
    /// `HP_COLLECTIVE_TIMEOUT_MS`).
    pub collective_timeout: Duration,
    /// Bytes of freed device blocks kept for reuse, like a GPU framework's caching allocator
    /// (`HP_CPU_ALLOC_CACHE`; 0 turns it off). Cached bytes do not count as allocated.
    pub alloc_cache: usize,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            device_memory: default_device_memory(),
            devices: 1,
            pinned_memory: None,
            jitter: None,
            collective_timeout: crate::collective::DEFAULT_COLLECTIVE_TIMEOUT,
            alloc_cache: 1 << 30,
        }
    }
}

/// Half the machine's RAM (from `/proc/meminfo`), or 8 GiB where that cannot be read.
fn default_device_memory() -> usize {
    let total_kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
    });
    total_kib.map_or(8 << 30, |k| k * 1024 / 2)
}

/// Parses a byte count: a plain integer, or one with a K/M/G/T (powers of 1024) suffix.
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits_end);
    let n: usize = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1usize << shift)
}

fn env_value<T>(name: &str, parse: impl Fn(&str) -> Option<T>, expect: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => parse(&v).map(Some).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidValue,
                BackendKind::Cpu,
                "configure",
                format!("{name}={v:?} is not {expect}"),
            )
        }),
        Err(_) => Ok(None),
    }
}

/// cbindgen:ignore
///
/// (The C header is generated from hprt-platform too, for `HprtStatus`; these limits are not C API.)
impl CpuConfig {
    /// The most devices a cpu platform models (each is a memory counter and a block cache).
    pub const MAX_DEVICES: usize = 1024;
    /// The largest world a cpu communicator accepts: its ranks are threads of this process.
    pub const MAX_WORLD: usize = 1 << 16;

    /// Checks the settings before anything is sized from them.
    pub fn validate(&self) -> Result<()> {
        if !(1..=Self::MAX_DEVICES).contains(&self.devices) {
            return Err(cpu_err(
                ErrorKind::InvalidValue,
                "configure",
                format!(
                    "a cpu platform has 1 to {} devices, not {} (HP_CPU_DEVICES)",
                    Self::MAX_DEVICES,
                    self.devices
                ),
            ));
        }
        Ok(())
    }

    /// Defaults overridden by `HP_CPU_DEVICE_MEMORY`, `HP_CPU_DEVICES`, `HP_CPU_PINNED_MEMORY`,
    /// `HP_CPU_JITTER` and `HP_CPU_COLLECTIVE_TIMEOUT_MS` (else `HP_COLLECTIVE_TIMEOUT_MS`, the
    /// setting every backend reads); a malformed value is an error.
    pub fn from_env() -> Result<Self> {
        let mut c = CpuConfig::default();
        let bytes = "a byte count (e.g. 8589934592 or 8G)";
        if let Some(v) = env_value("HP_CPU_DEVICE_MEMORY", parse_bytes, bytes)? {
            c.device_memory = v;
        }
        if let Some(v) = env_value(
            "HP_CPU_DEVICES",
            |s| s.trim().parse().ok().filter(|n| *n > 0),
            "a positive integer",
        )? {
            c.devices = v;
        }
        c.pinned_memory = env_value("HP_CPU_PINNED_MEMORY", parse_bytes, bytes)?;
        c.jitter = env_value(
            "HP_CPU_JITTER",
            |s| s.trim().parse().ok(),
            "an unsigned integer seed",
        )?;
        if let Some(t) = crate::collective::collective_timeout_from_env(
            BackendKind::Cpu,
            Some("HP_CPU_COLLECTIVE_TIMEOUT_MS"),
        )? {
            c.collective_timeout = t;
        }
        if let Some(v) = env_value("HP_CPU_ALLOC_CACHE", parse_bytes, bytes)? {
            c.alloc_cache = v;
        }
        c.validate()?;
        Ok(c)
    }
}

fn cpu_err(kind: ErrorKind, op: &'static str, msg: impl Into<String>) -> Error {
    Error::new(kind, BackendKind::Cpu, op, msg)
}

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// (platform instance → current device) of this thread.
    static CURRENT_DEVICE: RefCell<HashMap<u64, usize>> = RefCell::new(HashMap::new());
    /// (platform instance → open group) of this thread.
    static GROUPS: RefCell<HashMap<u64, Group>> = RefCell::new(HashMap::new());
}

#[derive(Default)]
struct Group {
    depth: usize,
    pending: Vec<(CpuStream, Issued)>,
}

struct PendingInit {
    world: usize,
    joined: Vec<bool>,
    shared: Arc<CommShared>,
}

/// A cpu stream as handles hold it.
pub type CpuStream = Arc<StreamRef>;

/// The cpu reference backend (see the module docs).
pub struct CpuBackend {
    config: CpuConfig,
    instance: u64,
    devices: Vec<Arc<MemoryCounter>>,
    /// One per device: a block freed on one device is reused only there.
    caches: Vec<Arc<BlockCache>>,
    pinned: Arc<MemoryCounter>,
    /// Streams whose worker still runs (destroyed ones until their queue drained).
    streams: Mutex<HashMap<usize, Weak<StreamCore>>>,
    /// Raw stream 0: the host's own stream (see `stream`), for CPU tensors' compute.
    host: Arc<StreamCore>,
    orphans: stream::Orphans,
    next_stream: AtomicUsize,
    next_id: AtomicU64,
    inits: Mutex<HashMap<Vec<u8>, PendingInit>>,
    inits_cv: Condvar,
}

const ID_MAGIC: &[u8; 8] = b"hprt-cpu";

/// The raw handle of the host stream: work queued on it runs in the calling thread before the
/// call returns (created streams are numbered from 1).
pub const HOST_STREAM: usize = 0;

impl CpuBackend {
    /// A cpu platform with these settings, checked first ([`CpuConfig::validate`]).
    pub fn try_new(config: CpuConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self::new(config))
    }

    /// [`CpuBackend::try_new`] for settings known to be valid.
    ///
    /// # Panics
    /// If [`CpuConfig::validate`] rejects `config` (say, `devices` past
    /// [`CpuConfig::MAX_DEVICES`]), rather than sizing anything from it.
    pub fn new(config: CpuConfig) -> Self {
        if let Err(e) = config.validate() {
            panic!("{e}");
        }
        let devices = (0..config.devices.max(1))
            .map(|_| Arc::new(MemoryCounter::new(Some(config.device_memory))))
            .collect();
        let caches = (0..config.devices.max(1))
            .map(|_| BlockCache::new(config.alloc_cache))
            .collect();
        CpuBackend {
            caches,
            pinned: Arc::new(MemoryCounter::new(config.pinned_memory)),
            devices,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            streams: Mutex::new(HashMap::new()),
            host: StreamCore::host(),
            orphans: Arc::default(),
            next_stream: AtomicUsize::new(1),
            next_id: AtomicU64::new(0),
            inits: Mutex::new(HashMap::new()),
            inits_cv: Condvar::new(),
            config,
        }
    }

    /// A cpu platform configured from the environment.
    pub fn from_env() -> Result<Self> {
        Self::try_new(CpuConfig::from_env()?)
    }

    pub fn config(&self) -> &CpuConfig {
        &self.config
    }

    fn device(&self) -> &Arc<MemoryCounter> {
        &self.devices[Backend::current_device(self)]
    }

    fn issue(&self, stream: &CpuStream, issued: Issued) -> Result<()> {
        let grouped = GROUPS.with(|g| {
            let mut g = g.borrow_mut();
            match g.get_mut(&self.instance) {
                Some(group) if group.depth > 0 => {
                    group.pending.push((Arc::clone(stream), issued));
                    None
                }
                _ => Some(issued),
            }
        });
        match grouped {
            None => Ok(()),
            Some(issued) => {
                let name = issued.op.name();
                stream.core.enqueue(
                    name,
                    Box::new(move |_: &StreamCore| comm::run_group(vec![issued])),
                )?;
                Ok(())
            }
        }
    }
}

impl Backend for CpuBackend {
    type Stream = CpuStream;
    type Event = CpuEvent;
    type DeviceMemory = MemRef;
    type PinnedMemory = MemRef;
    type Comm = CpuComm;

    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }
    fn instance(&self) -> u64 {
        self.instance
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::CPU
    }
    fn info(&self) -> PlatformInfo {
        let c = &self.config;
        PlatformInfo {
            backend: BackendKind::Cpu,
            devices: (0..self.devices.len())
                .map(|ordinal| DeviceInfo {
                    ordinal,
                    name: format!("cpu reference device {ordinal}"),
                    total_memory: c.device_memory,
                })
                .collect(),
            driver: format!("hprt cpu reference backend {}", env!("CARGO_PKG_VERSION")),
            libraries: vec![],
            settings: vec![
                ("HP_CPU_DEVICE_MEMORY".into(), c.device_memory.to_string()),
                ("HP_CPU_DEVICES".into(), c.devices.to_string()),
                (
                    "HP_CPU_PINNED_MEMORY".into(),
                    c.pinned_memory
                        .map_or("unlimited".into(), |v| v.to_string()),
                ),
                (
                    "HP_CPU_JITTER".into(),
                    c.jitter.map_or("off".into(), |v| v.to_string()),
                ),
                (
                    "HP_CPU_COLLECTIVE_TIMEOUT_MS".into(),
                    c.collective_timeout.as_millis().to_string(),
                ),
            ],
        }
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }
    fn set_device(&self, ordinal: usize) -> Result<()> {
        if ordinal >= self.devices.len() {
            return Err(cpu_err(
                ErrorKind::InvalidValue,
                "set_device",
                format!(
                    "device {ordinal} does not exist ({} devices; see HP_CPU_DEVICES)",
                    self.devices.len()
                ),
            ));
        }
        CURRENT_DEVICE.with(|c| c.borrow_mut().insert(self.instance, ordinal));
        Ok(())
    }
    fn current_device(&self) -> usize {
        CURRENT_DEVICE.with(|c| c.borrow().get(&self.instance).copied().unwrap_or(0))
    }
    fn mem_info(&self) -> Result<MemInfo> {
        let d = self.device();
        let total = d.capacity().unwrap_or(usize::MAX);
        Ok(MemInfo {
            free: total.saturating_sub(d.current()),
            total,
        })
    }
    fn memory_stats(&self) -> MemoryStats {
        MemoryStats::of(self.device(), &self.pinned)
    }
    fn reset_peak_memory(&self) {
        self.device().reset_peak();
        self.pinned.reset_peak();
    }

    fn create_stream(&self) -> Result<(CpuStream, RawStream)> {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let core = StreamCore::spawn(id, self.config.jitter, Arc::clone(&self.orphans))?;
        let mut streams = lock(&self.streams);
        streams.retain(|_, s| s.strong_count() > 0);
        streams.insert(id, Arc::downgrade(&core));
        Ok((Arc::new(StreamRef { core, owned: true }), RawStream(id)))
    }
    unsafe fn wrap_stream(&self, raw: RawStream) -> Result<CpuStream> {
        if raw.0 == HOST_STREAM {
            return Ok(Arc::new(StreamRef {
                core: Arc::clone(&self.host),
                owned: false,
            }));
        }
        let core = lock(&self.streams)
            .get(&raw.0)
            .and_then(Weak::upgrade)
            .filter(|c| c.is_open());
        match core {
            Some(core) => Ok(Arc::new(StreamRef { core, owned: false })),
            None => Err(cpu_err(
                ErrorKind::InvalidHandle,
                "wrap_external_stream",
                format!("no live cpu stream has raw handle {}", raw.0),
            )),
        }
    }
    fn destroy_stream(&self, stream: CpuStream) -> Result<()> {
        if stream.owned {
            // Stays in `streams` while its worker drains, so a device synchronize waits for it.
            stream.core.close();
        }
        Ok(())
    }
    fn synchronize_stream(&self, stream: &CpuStream) -> Result<()> {
        stream.core.synchronize()
    }
    fn query_stream(&self, stream: &CpuStream) -> Result<bool> {
        Ok(stream.core.query())
    }
    fn synchronize_device(&self) -> Result<()> {
        let mut live: Vec<Arc<StreamCore>> = lock(&self.streams)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        live.push(Arc::clone(&self.host));
        let mut first = Ok(());
        for s in live {
            if let Err(e) = s.synchronize() {
                first = first.and(Err(e));
            }
        }
        // Errors of destroyed streams nobody synchronized are reported here, once.
        for e in std::mem::take(&mut *lock(&self.orphans)) {
            first = first.and(Err(e));
        }
        first
    }

    fn create_event(&self, _timing: bool) -> Result<CpuEvent> {
        Ok(EventCore::new())
    }
    fn destroy_event(&self, _event: CpuEvent) -> Result<()> {
        Ok(())
    }
    fn record_event(&self, event: &CpuEvent, stream: &CpuStream) -> Result<()> {
        event.record(&stream.core)
    }
    fn stream_wait_event(&self, stream: &CpuStream, event: &CpuEvent) -> Result<()> {
        event.make_stream_wait(&stream.core)
    }
    fn query_event(&self, event: &CpuEvent) -> Result<bool> {
        Ok(event.query())
    }
    fn synchronize_event(&self, event: &CpuEvent) -> Result<()> {
        Self::wait_event(event)
    }
    fn wait_event(event: &CpuEvent) -> Result<()> {
        event.synchronize()
    }
    fn event_elapsed_ms(&self, start: &CpuEvent, end: &CpuEvent) -> Result<f32> {
        start.elapsed_ms(end)
    }

    fn alloc_device(&self, bytes: usize) -> Result<(MemRef, usize)> {
        let dev = Backend::current_device(self);
        let cache = Some(&self.caches[dev]).filter(|_| self.config.alloc_cache > 0);
        let poison = self.config.jitter.is_some();
        let m = CpuMem::alloc(&self.devices[dev], cache, poison, "alloc_device", bytes)?;
        let ptr = m.ptr();
        Ok((m, ptr))
    }
    unsafe fn wrap_device_memory(
        &self,
        ptr: usize,
        bytes: usize,
        release: Option<ReleaseFn>,
    ) -> Result<MemRef> {
        Ok(CpuMem::borrowed(ptr, bytes, release))
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<(MemRef, usize)> {
        let m = CpuMem::alloc(&self.pinned, None, false, "alloc_pinned", bytes)?;
        let ptr = m.ptr();
        Ok((m, ptr))
    }

    fn copy(
        &self,
        _kind: CopyKind, // every kind is a host memmove here
        dst: Place<Memory<MemRef, MemRef>>,
        src: Place<Memory<MemRef, MemRef>>,
        bytes: usize,
        stream: &CpuStream,
    ) -> Result<()> {
        // Bytes bound for host (pinned) memory wait there; device memory is read by the compute
        // that follows (see `copy`).
        let to_host = dst.mem.is_pinned();
        let (d, s) = (dst.map(Memory::into_inner), src.map(Memory::into_inner));
        stream.core.enqueue(
            "copy_async",
            Box::new(move |_: &StreamCore| {
                // SAFETY: ranges were bounds-checked at issue and the job holds both allocations.
                unsafe { copy::copy_bytes(s.mem.at(s.offset), d.mem.at(d.offset), bytes, to_host) };
                Ok(())
            }),
        )?;
        Ok(())
    }
    fn memset(
        &self,
        Place {
            mem: d,
            offset: off,
        }: Place<MemRef>,
        value: u8,
        bytes: usize,
        stream: &CpuStream,
    ) -> Result<()> {
        stream.core.enqueue(
            "memset_async",
            Box::new(move |_: &StreamCore| {
                // SAFETY: as in `copy`.
                unsafe { std::ptr::write_bytes(d.at(off), value, bytes) };
                Ok(())
            }),
        )?;
        Ok(())
    }

    fn kernel(&self, kernel: Kernel<Place<MemRef>>, stream: &CpuStream) -> Result<()> {
        let name = kernel.name();
        stream.core.enqueue(
            name,
            Box::new(move |_: &StreamCore| {
                let ptrs = kernel.clone().try_map(|p| Ok(p.mem.at(p.offset)))?;
                // SAFETY: places were bounds- and overlap-checked by the dispatch layer, and
                // the `MemRef`s in `kernel` keep the memory alive until the kernel ran.
                unsafe { run_on_host(&ptrs) };
                drop(kernel);
                Ok(())
            }),
        )?;
        Ok(())
    }
    fn host_fn(&self, stream: &CpuStream, f: HostFn) -> Result<()> {
        stream.core.enqueue(
            "launch_host_fn",
            Box::new(move |_: &StreamCore| {
                // A panicking closure must not take the stream's worker thread down with it.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|_| {
                    cpu_err(
                        ErrorKind::Internal,
                        "launch_host_fn",
                        "the host function panicked".to_string(),
                    )
                })
            }),
        )?;
        Ok(())
    }

    fn unique_id(&self) -> Result<UniqueId> {
        let mut id = ID_MAGIC.to_vec();
        id.extend_from_slice(&self.instance.to_le_bytes());
        id.extend_from_slice(&self.next_id.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        id.extend_from_slice(&u64::from(std::process::id()).to_le_bytes());
        Ok(UniqueId(id))
    }
    fn comm_init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<CpuComm> {
        const OP: &str = "comm_init";
        let pid = u64::from(std::process::id());
        if id.0.len() == 32 && &id.0[..8] == ID_MAGIC && id.0[24..32] != pid.to_le_bytes() {
            let from = u64::from_le_bytes(id.0[24..32].try_into().expect("8 bytes"));
            return Err(cpu_err(
                ErrorKind::Unsupported,
                OP,
                format!(
                    "the unique id was made in process {from}, this is process {pid}: the cpu \
                     backend's ranks are threads of one process (spawn them as threads, e.g. \
                     hprt.torch.run_on_ranks); one process per device needs cuda or npu"
                ),
            ));
        }
        if id.0.len() != 32 || &id.0[..8] != ID_MAGIC || id.0[8..16] != self.instance.to_le_bytes()
        {
            return Err(cpu_err(
                ErrorKind::InvalidValue,
                OP,
                "the unique id was not made by this cpu platform value (ranks must share one)",
            ));
        }
        if world > CpuConfig::MAX_WORLD {
            return Err(cpu_err(
                ErrorKind::InvalidValue,
                OP,
                format!(
                    "a cpu communicator has at most {} ranks (threads of this process), not {world}",
                    CpuConfig::MAX_WORLD
                ),
            ));
        }
        let timeout = self.config.collective_timeout;
        let mut inits = lock(&self.inits);
        let entry = inits.entry(id.0.clone()).or_insert_with(|| PendingInit {
            world,
            joined: vec![false; world],
            shared: CommShared::new(world, timeout),
        });
        if entry.world != world {
            return Err(cpu_err(
                ErrorKind::Mismatch,
                OP,
                format!(
                    "rank {rank} asked for a world of {world}, earlier ranks for {}",
                    entry.world
                ),
            ));
        }
        if std::mem::replace(&mut entry.joined[rank], true) {
            return Err(cpu_err(
                ErrorKind::InvalidValue,
                OP,
                format!("rank {rank} already joined this communicator"),
            ));
        }
        let shared = Arc::clone(&entry.shared);
        if entry.joined.iter().all(|j| *j) {
            inits.remove(&id.0);
            self.inits_cv.notify_all();
            return Ok(CommMember::new(shared, rank));
        }
        let deadline = Instant::now() + timeout;
        let complete = |m: &HashMap<Vec<u8>, PendingInit>| {
            m.get(&id.0)
                .is_none_or(|e| !Arc::ptr_eq(&e.shared, &shared))
        };
        let mut inits = inits;
        while !complete(&inits) {
            let now = Instant::now();
            if now >= deadline {
                let e = inits.get_mut(&id.0).expect("pending init present");
                e.joined[rank] = false;
                let missing: Vec<usize> =
                    (0..world).filter(|&r| !e.joined[r] && r != rank).collect();
                return Err(cpu_err(
                    ErrorKind::Timeout,
                    OP,
                    format!("ranks {missing:?} did not join within {timeout:?}"),
                ));
            }
            inits = self
                .inits_cv
                .wait_timeout(inits, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(CommMember::new(shared, rank))
    }
    fn comm_split(
        &self,
        comm: &CpuComm,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<(CpuComm, usize, usize)>> {
        comm.split(rank_lists)
    }
    fn destroy_comm(&self, _comm: CpuComm) -> Result<()> {
        Ok(())
    }
    /// A departure already fails the peers waiting for this rank at once.
    fn abort_comm(&self, comm: CpuComm) -> Result<()> {
        Backend::destroy_comm(self, comm)
    }
    fn collective(
        &self,
        comm: &CpuComm,
        op: Collective<Option<Place<MemRef>>>,
        stream: &CpuStream,
    ) -> Result<()> {
        self.issue(stream, Issued::new(comm, op))
    }
    fn group_start(&self) -> Result<()> {
        GROUPS.with(|g| g.borrow_mut().entry(self.instance).or_default().depth += 1);
        Ok(())
    }
    fn group_end(&self) -> Result<()> {
        let pending = GROUPS.with(|g| {
            let mut g = g.borrow_mut();
            match g.get_mut(&self.instance) {
                Some(group) if group.depth > 0 => {
                    group.depth -= 1;
                    Ok((group.depth == 0).then(|| std::mem::take(&mut group.pending)))
                }
                _ => Err(cpu_err(
                    ErrorKind::InvalidValue,
                    "group_end",
                    "no group is open on this thread",
                )),
            }
        })?;
        // One job per stream, holding that stream's share of the group in issue order.
        let mut per_stream: Vec<(CpuStream, Vec<Issued>)> = Vec::new();
        for (stream, issued) in pending.into_iter().flatten() {
            match per_stream
                .iter_mut()
                .find(|(s, _)| Arc::ptr_eq(&s.core, &stream.core))
            {
                Some((_, ops)) => ops.push(issued),
                None => per_stream.push((stream, vec![issued])),
            }
        }
        // The host stream's share runs in this thread as it is queued: the workers' shares are
        // queued first, so a group spanning both does not wait on work not yet queued.
        per_stream.sort_by_key(|(s, _)| s.core.is_inline());
        for (stream, ops) in per_stream {
            stream.core.enqueue(
                "group_end",
                Box::new(move |_: &StreamCore| comm::run_group(ops)),
            )?;
        }
        Ok(())
    }
}
