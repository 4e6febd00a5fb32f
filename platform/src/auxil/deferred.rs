//! Frees in stream order without a host wait, for backends whose driver free is not stream
//! ordered (`cuMemFree`, `aclrtFree` wait for the device or must not run under queued work).
//!
//! Memory whose queued work has not finished when its last handle goes is kept on a list and
//! freed once that work is seen finished (an event query at the next allocation, statistics
//! query or free), the way a GPU caching allocator defers frees. Memory whose work cannot be
//! shown finished is leaked (logged, still counted), never freed under it. A platform waits
//! for what is left when it is dropped, and an allocation that runs out of memory waits for the
//! list before it gives up.

use std::sync::{Arc, Mutex, Weak};

use crate::error::{ErrorKind, Result};

/// What is known of the work queued on memory waiting to be freed.
pub(crate) enum Progress {
    Finished,
    Pending,
    /// The driver cannot say (a failed query or wait): the memory must not be freed.
    Unknown,
}

/// Memory to free once its queued work finished.
pub(crate) trait DeferredFree: Send {
    /// Whether the queued work finished; with `wait`, blocks until it did.
    fn progress(&mut self, wait: bool) -> Progress;
    /// Frees (or hands back) the memory: its queued work finished.
    fn free(self: Box<Self>);
    /// Gives the memory up without freeing it: its queued work cannot be shown finished.
    fn leak(self: Box<Self>);
}

/// The memory of one platform value waiting for its queued work.
#[derive(Default)]
pub struct DeferredFrees {
    waiting: Mutex<Vec<Box<dyn DeferredFree>>>,
}

impl DeferredFrees {
    /// Frees `item` now if its work finished, or later; reclaims what else finished meanwhile.
    pub(crate) fn release(&self, item: Box<dyn DeferredFree>) {
        let mut items = self.take();
        items.push(item);
        self.settle(items, false);
    }

    /// Frees what finished; with `wait`, waits for all of it first.
    pub(crate) fn reclaim(&self, wait: bool) {
        let items = self.take();
        if !items.is_empty() {
            self.settle(items, wait);
        }
    }

    /// Runs `alloc`; when it runs out of memory while frees are waiting, waits for them and
    /// tries once more.
    pub(crate) fn retrying<T>(&self, mut alloc: impl FnMut() -> Result<T>) -> Result<T> {
        self.reclaim(false);
        match alloc() {
            Err(e) if e.kind == ErrorKind::OutOfMemory && !self.is_empty() => {
                self.reclaim(true);
                alloc()
            }
            r => r,
        }
    }

    fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Box<dyn DeferredFree>>> {
        // Items are whole boxes pushed or taken at once: a poisoned list is still consistent.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self) -> Vec<Box<dyn DeferredFree>> {
        std::mem::take(&mut *self.lock())
    }

    /// Queried and freed outside the lock: a free may run a borrowed buffer's release
    /// function, which may drop more memory.
    fn settle(&self, items: Vec<Box<dyn DeferredFree>>, wait: bool) {
        let mut pending = Vec::new();
        for mut item in items {
            match item.progress(wait) {
                Progress::Finished => item.free(),
                Progress::Pending => pending.push(item),
                Progress::Unknown => item.leak(),
            }
        }
        self.lock().extend(pending);
    }
}

impl Drop for DeferredFrees {
    fn drop(&mut self) {
        self.reclaim(true);
    }
}

/// Hands `item` to the list of a live platform value, or, once the platform is gone, frees it
/// after waiting for its work (no later point would reclaim it).
pub(crate) fn release_to(frees: &Weak<DeferredFrees>, item: Box<dyn DeferredFree>) {
    match frees.upgrade() {
        Some(list) => list.release(item),
        None => {
            let mut item = item;
            match item.progress(true) {
                Progress::Finished => item.free(),
                Progress::Pending | Progress::Unknown => item.leak(),
            }
        }
    }
}

/// A fresh list and the weak reference memory objects keep to it.
pub(crate) fn new_list() -> (Arc<DeferredFrees>, Weak<DeferredFrees>) {
    let list = Arc::new(DeferredFrees::default());
    let weak = Arc::downgrade(&list);
    (list, weak)
}
