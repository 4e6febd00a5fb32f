//! cpu "device" and pinned memory: host allocations with their own accounting.

use std::alloc::{self, Layout};
use std::sync::{Arc, Mutex};

use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::handle::ReleaseFn;
use crate::memory::MemoryCounter;

/// Alignment of every allocation, as `cudaMalloc` gives.
pub(crate) const ALIGN: usize = 256;

enum Origin {
    Owned {
        base: *mut u8,
        layout: Layout,
        counter: Arc<MemoryCounter>,
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
unsafe impl Sync for CpuMem {}

pub(crate) type MemRef = Arc<CpuMem>;

impl CpuMem {
    /// Zero-filled, `ALIGN`-aligned memory of `len > 0` bytes, charged to `counter`.
    pub(crate) fn alloc(
        counter: &Arc<MemoryCounter>,
        op: &'static str,
        len: usize,
    ) -> Result<MemRef> {
        counter.reserve(BackendKind::Cpu, op, len)?;
        // calloc-backed (alignment 16) so large blocks arrive as lazily zeroed pages; aligned by hand.
        let layout = len
            .checked_add(ALIGN)
            .and_then(|n| Layout::from_size_align(n, 16).ok());
        // SAFETY: a layout, when there is one, has non-zero size.
        let base = layout.map_or(std::ptr::null_mut(), |l| unsafe { alloc::alloc_zeroed(l) });
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
            } => {
                // SAFETY: `base` came from `alloc_zeroed(layout)` and is freed once, here.
                unsafe { alloc::dealloc(*base, *layout) };
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
