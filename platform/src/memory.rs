//! Memory accounting every backend keeps the same way.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{BackendKind, Error, ErrorKind, Result};

/// `free` and `total` bytes of the current device, as `cudaMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub free: usize,
    pub total: usize,
}

/// hprt's own accounting of what it allocated on the current device and in pinned host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub device_current: usize,
    pub device_peak: usize,
    pub device_allocations: usize,
    pub pinned_current: usize,
    pub pinned_peak: usize,
    pub pinned_allocations: usize,
}

impl MemoryStats {
    /// The counters of one device's pool and of pinned memory, as the stats report them.
    pub(crate) fn of(device: &MemoryCounter, pinned: &MemoryCounter) -> Self {
        MemoryStats {
            device_current: device.current(),
            device_peak: device.peak(),
            device_allocations: device.allocations(),
            pinned_current: pinned.current(),
            pinned_peak: pinned.peak(),
            pinned_allocations: pinned.allocations(),
        }
    }

    /// Every counter with its name, in declaration order: the one list the Python
    /// `memory_stats()` dict and the C `HprtMemoryStats` are filled from.
    pub fn fields(&self) -> [(&'static str, usize); 6] {
        [
            ("device_current", self.device_current),
            ("device_peak", self.device_peak),
            ("device_allocations", self.device_allocations),
            ("pinned_current", self.pinned_current),
            ("pinned_peak", self.pinned_peak),
            ("pinned_allocations", self.pinned_allocations),
        ]
    }
}

/// Current / peak bytes of one memory pool, with an optional capacity that turns into a typed
/// out-of-memory error. Lock-free: allocation paths call it from many threads.
#[derive(Debug)]
pub struct MemoryCounter {
    current: AtomicUsize,
    peak: AtomicUsize,
    allocations: AtomicUsize,
    capacity: Option<usize>,
}

impl MemoryCounter {
    pub fn new(capacity: Option<usize>) -> Self {
        MemoryCounter {
            current: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            allocations: AtomicUsize::new(0),
            capacity,
        }
    }

    /// Reserves `bytes`, or fails with `OutOfMemory` naming what was asked and what is left.
    pub fn reserve(&self, backend: BackendKind, op: &'static str, bytes: usize) -> Result<()> {
        let mut cur = self.current.load(Ordering::Relaxed);
        loop {
            let next = cur
                .checked_add(bytes)
                .filter(|n| self.capacity.is_none_or(|c| *n <= c));
            let Some(next) = next else {
                let cap = self.capacity.unwrap_or(usize::MAX);
                return Err(Error::new(
                    ErrorKind::OutOfMemory,
                    backend,
                    op,
                    format!(
                        "cannot allocate {bytes} bytes: {cur} of {cap} bytes in use, {} free",
                        cap.saturating_sub(cur)
                    ),
                ));
            };
            match self
                .current
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    self.allocations.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(seen) => cur = seen,
            }
        }
    }

    pub fn release(&self, bytes: usize) {
        self.current.fetch_sub(bytes, Ordering::AcqRel);
        self.allocations.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn current(&self) -> usize {
        self.current.load(Ordering::Acquire)
    }
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Acquire)
    }
    pub fn allocations(&self) -> usize {
        self.allocations.load(Ordering::Acquire)
    }
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }
    /// Starts a new peak measurement from the current usage.
    pub fn reset_peak(&self) {
        self.peak.store(self.current(), Ordering::Release);
    }
}
