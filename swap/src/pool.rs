//! Pinned host blocks reused by exact byte size, with a host budget and accounting.

use hprt_platform::sync::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use hprt_platform::{Event, PinnedBuffer, PlatformHandle};

use crate::error::{Result, SwapError};

/// The completion mark of one batch of copies, shared by every tensor of the batch.
pub(crate) type Fence = Arc<Event>;

/// Settings of a [`PinnedPool`].
#[derive(Clone, Debug, Default)]
pub struct PoolConfig {
    /// Most pinned bytes the pool may hold (idle + handed out); `None` = unbounded.
    pub host_budget: Option<usize>,
}

/// Counters of a [`PinnedPool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pinned bytes the pool owns: handed out plus idle.
    pub bytes_held: usize,
    /// Bytes currently handed out.
    pub bytes_in_use: usize,
    /// Highest `bytes_held` since the last [`PinnedPool::reset`].
    pub high_water: usize,
    /// Acquisitions served from an idle block since the last reset.
    pub hits: u64,
    /// Acquisitions that allocated since the last reset.
    pub misses: u64,
    /// Idle blocks released to stay within the budget, since the last reset.
    pub evictions: u64,
}

impl PoolStats {
    /// Every counter under the name a swap front end's `stats()` gives it (`pinned_*`,
    /// `pool_*`), in declaration order (see `SwapEngine::stat_fields`).
    pub fn fields(&self) -> [(&'static str, u64); 6] {
        [
            ("pinned_bytes_held", self.bytes_held as u64),
            ("pinned_bytes_in_use", self.bytes_in_use as u64),
            ("pinned_high_water", self.high_water as u64),
            ("pool_hits", self.hits),
            ("pool_misses", self.misses),
            ("pool_evictions", self.evictions),
        ]
    }
}

struct Idle {
    buf: PinnedBuffer,
    last_use: Option<Fence>,
}

struct PoolInner {
    platform: PlatformHandle,
    budget: Option<usize>,
    idle: HashMap<usize, Vec<Idle>>,
    idle_bytes: usize,
    stats: PoolStats,
}

/// Pinned host memory for host copies: a block returns to the pool when dropped and is handed
/// out again, in O(1), to the next request of the same byte size (Megatron keys by shape and
/// dtype; the byte size is the coarser key that also lets different shapes share blocks).
///
/// A block remembers the last queued copy that touched it; whoever takes it next must order its
/// own copy after that one (the engine does, with a stream wait), so a block freed while its
/// reload is still queued is never overwritten early.
///
/// ```
/// use std::sync::Arc;
/// use hprt_platform::{CpuBackend, CpuConfig};
/// use hprt_swap::{PinnedPool, PoolConfig};
///
/// let pool = PinnedPool::new(hprt_swap::PlatformHandle::Shared(Arc::new(CpuBackend::new(CpuConfig::default()))),
///                            PoolConfig { host_budget: Some(1 << 20) });
/// drop(pool.acquire(4096).unwrap());
/// let again = pool.acquire(4096).unwrap(); // the same block, no allocation
/// let s = pool.stats();
/// assert_eq!((s.hits, s.misses, s.bytes_held, s.bytes_in_use), (1, 1, 4096, 4096));
/// assert!(pool.acquire(2 << 20).is_err()); // past the budget
/// # drop(again);
/// ```
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<Mutex<PoolInner>>,
}

/// A pinned block on loan from a [`PinnedPool`]; dropping it gives it back.
pub struct PinnedBlock {
    buf: Option<PinnedBuffer>,
    len: usize,
    last_use: Option<Fence>,
    pool: Weak<Mutex<PoolInner>>,
}

impl PinnedBlock {
    pub fn buffer(&self) -> &PinnedBuffer {
        self.buf
            .as_ref()
            .expect("a block holds its buffer until dropped")
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The fence of the last queued copy that read or wrote this block.
    pub(crate) fn last_use(&self) -> Option<&Fence> {
        self.last_use.as_ref()
    }
    pub(crate) fn set_last_use(&mut self, fence: &Fence) {
        self.last_use = Some(Arc::clone(fence));
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let Some(pool) = self.pool.upgrade() else {
            return; // the pool is gone: the buffer frees itself once its queued copies finish
        };
        let mut p = lock(&pool);
        p.stats.bytes_in_use -= self.len;
        p.idle_bytes += self.len;
        p.idle.entry(self.len).or_default().push(Idle {
            buf,
            last_use: self.last_use.take(),
        });
    }
}

impl PinnedPool {
    pub fn new(platform: impl Into<PlatformHandle>, config: PoolConfig) -> Self {
        let platform = platform.into();
        PinnedPool {
            inner: Arc::new(Mutex::new(PoolInner {
                platform,
                budget: config.host_budget,
                idle: HashMap::new(),
                idle_bytes: 0,
                stats: PoolStats::default(),
            })),
        }
    }

    /// A block of exactly `bytes` bytes: an idle one if there is one, else a new allocation
    /// (releasing idle blocks of other sizes first if the budget requires).
    pub fn acquire(&self, bytes: usize) -> Result<PinnedBlock> {
        let mut p = lock(&self.inner);
        if let Some(idle) = p.idle.get_mut(&bytes).and_then(Vec::pop) {
            p.idle_bytes -= bytes;
            p.stats.hits += 1;
            p.stats.bytes_in_use += bytes;
            return Ok(self.block(idle.buf, bytes, idle.last_use));
        }
        if let Some(budget) = p.budget {
            while p.stats.bytes_held + bytes > budget && p.idle_bytes > 0 {
                p.evict_one();
            }
            if p.stats.bytes_held + bytes > budget {
                return Err(SwapError::HostBudgetExceeded {
                    requested: bytes,
                    held: p.stats.bytes_held,
                    budget,
                });
            }
        }
        let buf = p.platform.alloc_pinned(bytes)?;
        p.stats.misses += 1;
        p.stats.bytes_held += bytes;
        p.stats.bytes_in_use += bytes;
        p.stats.high_water = p.stats.high_water.max(p.stats.bytes_held);
        Ok(self.block(buf, bytes, None))
    }

    fn block(&self, buf: PinnedBuffer, len: usize, last_use: Option<Fence>) -> PinnedBlock {
        PinnedBlock {
            buf: Some(buf),
            len,
            last_use,
            pool: Arc::downgrade(&self.inner),
        }
    }

    pub fn stats(&self) -> PoolStats {
        lock(&self.inner).stats
    }

    /// Starts a new iteration: hit/miss/eviction counters restart and the high-water mark
    /// restarts from what is held now. Blocks stay cached for reuse.
    pub fn reset(&self) {
        let mut p = lock(&self.inner);
        p.stats.hits = 0;
        p.stats.misses = 0;
        p.stats.evictions = 0;
        p.stats.high_water = p.stats.bytes_held;
    }

    /// Releases every idle block to the platform (blocks on loan are unaffected).
    pub fn clear(&self) {
        let mut p = lock(&self.inner);
        while p.idle_bytes > 0 {
            p.evict_one();
        }
    }
}

impl PoolInner {
    fn evict_one(&mut self) {
        let Some((&len, _)) = self.idle.iter().find(|(_, v)| !v.is_empty()) else {
            return;
        };
        let list = self.idle.get_mut(&len).expect("key just found");
        drop(list.pop());
        if list.is_empty() {
            self.idle.remove(&len);
        }
        // Dropping the last handle frees the pinned memory once its queued copies finished.
        self.idle_bytes -= len;
        self.stats.bytes_held -= len;
        self.stats.evictions += 1;
    }
}
