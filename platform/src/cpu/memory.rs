//! cpu "device" and pinned memory: host allocations with their own accounting.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::ReleaseFn;
use crate::memory::MemoryCounter;
use crate::sync::lock;

/// Alignment of every allocation, as `cudaMalloc` gives.
pub(crate) const ALIGN: usize = 256;

/// Freed device blocks kept for reuse, as a GPU framework's caching allocator keeps them:
/// re-acquiring a storage (activation swap's resize-back) then costs no page faults. Cached
/// bytes are not "current" in the accounting, and the cache holds at most `cap` bytes.
pub(crate) struct BlockCache {
    cap: usize,
    inner: Mutex<CachedBlocks>,
}

#[derive(Default)]
struct CachedBlocks {
    bytes: usize,
    by_size: HashMap<usize, Vec<usize>>,
}

impl BlockCache {
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        Arc::new(BlockCache {
            cap,
            inner: Mutex::new(CachedBlocks::default()),
        })
    }

    fn take(&self, layout: Layout) -> Option<*mut u8> {
        let mut c = lock(&self.inner);
        let base = c.by_size.get_mut(&layout.size())?.pop()?;
        c.bytes -= layout.size();
        Some(base as *mut u8)
    }

    /// Keeps the block if it fits under the cap; false means the caller frees it.
    fn put(&self, base: *mut u8, layout: Layout) -> bool {
        let mut c = lock(&self.inner);
        if c.bytes + layout.size() > self.cap {
            return false;
        }
        c.bytes += layout.size();
        c.by_size
            .entry(layout.size())
            .or_default()
            .push(base as usize);
        true
    }
}

impl Drop for BlockCache {
    fn drop(&mut self) {
        let c = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        for (&size, blocks) in &c.by_size {
            for &base in blocks {
                // SAFETY: every cached block came from `alloc_zeroed` with this size and
                // `BLOCK_ALIGN`, and is freed once, here.
                unsafe { alloc::dealloc(base as *mut u8, block_layout(size)) };
            }
        }
    }
}

const BLOCK_ALIGN: usize = 16;

/// What a reused device block holds in jitter mode before its new owner writes it.
pub(crate) const POISON: u8 = 0xDB;

fn block_layout(size: usize) -> Layout {
    // `size` was a valid layout size with this alignment when the block was made.
    Layout::from_size_align(size, BLOCK_ALIGN).unwrap_or(Layout::new::<u8>())
}

enum Origin {
    Owned {
        base: *mut u8,
        layout: Layout,
        counter: Arc<MemoryCounter>,
        cache: Option<Arc<BlockCache>>,
    },
    Borrowed {
        release: Mutex<Option<ReleaseFn>>,
    },
}

/// One allocation. Queued jobs hold clones, so the bytes outlive every operation on them;
/// accounting drops when the last clone does.
pub struct CpuMem {
    ptr: usize,
    len: usize,
    origin: Origin,
}

// SAFETY: the allocation is plain bytes; access is ordered by streams and events, as on a GPU.
unsafe impl Send for CpuMem {}
// SAFETY: `&CpuMem` hands out only the address and length (plain integers) and the release
// hook behind a mutex; the raw `base` is used by `Drop` alone (`&mut self`); the bytes
// themselves are read and written by stream jobs, which streams and events order, as on a GPU.
unsafe impl Sync for CpuMem {}

pub(crate) type MemRef = Arc<CpuMem>;

impl CpuMem {
    /// `ALIGN`-aligned memory of `len > 0` bytes, charged to `counter`: a block from `cache`
    /// when one of the size is there (its old bytes, as `cudaMalloc` gives no zeroing either, or
    /// [`POISON`] when `poison_reused`), else fresh zero-filled memory.
    pub(crate) fn alloc(
        counter: &Arc<MemoryCounter>,
        cache: Option<&Arc<BlockCache>>,
        poison_reused: bool,
        op: &'static str,
        len: usize,
    ) -> Result<MemRef> {
        counter.reserve(BackendKind::Cpu, op, len)?;
        // calloc-backed so large blocks arrive as lazily zeroed pages; aligned by hand.
        let layout = len
            .checked_add(ALIGN)
            .and_then(|n| Layout::from_size_align(n, BLOCK_ALIGN).ok());
        let base = match layout {
            Some(l) => match cache.and_then(|c| c.take(l)) {
                Some(b) if poison_reused => {
                    // Race hunting (jitter): a stale read of a reused block must not find the
                    // bytes an earlier owner left, which could equal what the reader expects.
                    // SAFETY: the cached block spans `l.size()` bytes and is ours now.
                    unsafe { std::ptr::write_bytes(b, POISON, l.size()) };
                    b
                }
                Some(b) => b,
                // SAFETY: the layout has non-zero size.
                None => unsafe { alloc::alloc_zeroed(l) },
            },
            None => std::ptr::null_mut(),
        };
        let (Some(layout), false) = (layout, base.is_null()) else {
            counter.release(len);
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                BackendKind::Cpu,
                op,
                format!("the host allocator refused {len} bytes"),
            ));
        };
        let ptr = (base as usize).next_multiple_of(ALIGN);
        Ok(Arc::new(CpuMem {
            ptr,
            len,
            origin: Origin::Owned {
                base,
                layout,
                counter: Arc::clone(counter),
                cache: cache.cloned(),
            },
        }))
    }

    pub(crate) fn borrowed(ptr: usize, len: usize, release: Option<ReleaseFn>) -> MemRef {
        Arc::new(CpuMem {
            ptr,
            len,
            origin: Origin::Borrowed {
                release: Mutex::new(release),
            },
        })
    }

    pub(crate) fn ptr(&self) -> usize {
        self.ptr
    }

    /// Address of byte `offset`; callers have bounds-checked the range they touch.
    pub(crate) fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        (self.ptr + offset) as *mut u8
    }
}

impl Drop for CpuMem {
    fn drop(&mut self) {
        match &mut self.origin {
            Origin::Owned {
                base,
                layout,
                counter,
                cache,
            } => {
                if !cache.as_ref().is_some_and(|c| c.put(*base, *layout)) {
                    // SAFETY: `base` came from `alloc_zeroed(layout)` and is freed once, here.
                    unsafe { alloc::dealloc(*base, *layout) };
                }
                counter.release(self.len);
            }
            Origin::Borrowed { release } => {
                if let Some(f) = release.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
                    f();
                }
            }
        }
    }
}
