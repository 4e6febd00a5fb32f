//! Use tracking and stream-ordered frees, one type for every driver backend.
//!
//! A buffer keeps one event per stream that queued work on it, re-recorded after every such
//! operation, so the event covers all of them (streams are FIFO). When its last handle goes,
//! the memory is handed to the platform's [`DeferredFrees`] list with those events and freed
//! once they are complete: never under queued work (as `cudaFree` guarantees), and without a
//! host wait (as `cuMemFreeAsync` / torch's `record_stream`). Memory whose work cannot be shown
//! finished (a failed event query) is leaked, logged and still counted.

use std::sync::{Arc, Mutex, Weak};

use super::deferred::{self, DeferredFree, DeferredFrees, Progress};
use crate::error::Result;
use crate::handle::ReleaseFn;
use crate::sync::lock;

/// How a buffer's memory was obtained, and so how it is freed.
pub enum Origin {
    /// The driver's device memory, of this device.
    Device(usize),
    /// The driver's page-locked host memory, allocated with this device's context current.
    Pinned(usize),
    /// A framework's memory: its release (if any) runs instead of a free.
    Borrowed(Option<ReleaseFn>),
}

impl Origin {
    fn describe(&self) -> &'static str {
        match self {
            Origin::Device(_) => "device",
            Origin::Pinned(_) => "pinned",
            Origin::Borrowed(_) => "borrowed (its release is not run)",
        }
    }
}

/// The driver calls use tracking needs, implemented by a backend's shared state.
pub trait UseEvents: Send + Sync + Sized + 'static {
    /// Tells streams apart (with the device where a stream handle value can repeat across
    /// devices).
    type Stream: Copy + Eq + Send + Sync;
    type Event: Copy + Send + Sync;
    /// The backend's name, for logs.
    const NAME: &'static str;

    /// Makes calls about `stream`'s events valid on this thread (binds its device).
    fn bind_for(&self, stream: Self::Stream) -> Result<()>;
    fn create_event(&self) -> Result<Self::Event>;
    fn record_event(&self, event: Self::Event, stream: Self::Stream) -> Result<()>;
    /// `Some(complete)`, or `None` when the driver cannot say.
    fn event_complete(&self, event: Self::Event) -> Option<bool>;
    /// Blocks until the event completed; false when the wait failed.
    fn wait_event(&self, event: Self::Event) -> bool;
    fn destroy_event(&self, event: Self::Event);
    /// Waits for everything queued on `stream` (after a use could not be recorded).
    fn drain(&self, stream: Self::Stream);
    /// Whether driver calls are allowed on this thread now (never inside a host function).
    fn may_call_driver(&self) -> bool {
        true
    }
    /// Frees device memory of `device` whose queued work finished, and uncounts it.
    fn free_device(&self, device: usize, ptr: usize, len: usize);
    /// Frees pinned memory whose queued work finished, and uncounts it.
    fn free_pinned(&self, device: usize, ptr: usize, len: usize);
    /// The platform's list of memory waiting for its queued work.
    fn frees(&self) -> &Weak<DeferredFrees>;
    /// Runs the hand-over of dropped memory (a backend whose drops may run where driver calls
    /// are not allowed defers it).
    fn hand_over(self: &Arc<Self>, job: Box<dyn FnOnce() + Send>) {
        job();
    }
}

/// Device, pinned or borrowed memory of a driver backend, with its uses.
pub struct TrackedMem<S: UseEvents> {
    pub(crate) shared: Arc<S>,
    pub(crate) ptr: usize,
    pub(crate) len: usize,
    origin: Mutex<Option<Origin>>,
    uses: Mutex<Vec<(S::Stream, S::Event)>>,
}

impl<S: UseEvents> TrackedMem<S> {
    pub(crate) fn new(shared: &Arc<S>, ptr: usize, len: usize, origin: Origin) -> Arc<Self> {
        Arc::new(TrackedMem {
            shared: Arc::clone(shared),
            ptr,
            len,
            origin: Mutex::new(Some(origin)),
            uses: Mutex::new(Vec::new()),
        })
    }

    /// Notes that work just queued on `stream` (whose device is bound) uses this memory. When
    /// the use cannot be recorded (no event could be created or recorded), the stream is
    /// drained before the error returns: the free would otherwise not wait for the work just
    /// queued.
    pub(crate) fn used_on(&self, stream: S::Stream) -> Result<()> {
        let recorded = self.record_use(stream);
        if recorded.is_err() {
            self.shared.drain(stream);
        }
        recorded
    }

    fn record_use(&self, stream: S::Stream) -> Result<()> {
        let mut uses = lock(&self.uses);
        let event = match uses.iter().find(|(s, _)| *s == stream) {
            Some(&(_, e)) => e,
            None => {
                let e = self.shared.create_event()?;
                uses.push((stream, e));
                e
            }
        };
        self.shared.record_event(event, stream)
    }
}

impl<S: UseEvents> Drop for TrackedMem<S> {
    fn drop(&mut self) {
        let origin = self
            .origin
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(origin) = origin else { return };
        let pending = PendingFree {
            shared: Arc::clone(&self.shared),
            uses: std::mem::take(self.uses.get_mut().unwrap_or_else(|p| p.into_inner())),
            origin,
            ptr: self.ptr,
            len: self.len,
        };
        let frees = self.shared.frees().clone();
        self.shared.hand_over(Box::new(move || {
            deferred::release_to(&frees, Box::new(pending))
        }));
    }
}

/// Memory whose last handle went, freed once the work queued on it finished.
struct PendingFree<S: UseEvents> {
    shared: Arc<S>,
    uses: Vec<(S::Stream, S::Event)>,
    origin: Origin,
    ptr: usize,
    len: usize,
}

impl<S: UseEvents> DeferredFree for PendingFree<S> {
    /// A failed wait may only report failed work queued before the mark (then the query says
    /// complete), or the wait itself failing: then nothing is known.
    fn progress(&mut self, wait: bool) -> Progress {
        let s = &*self.shared;
        while let Some(&(stream, event)) = self.uses.last() {
            if !s.may_call_driver() {
                return Progress::Pending;
            }
            if s.bind_for(stream).is_err() {
                return Progress::Unknown;
            }
            let finished = match s.event_complete(event) {
                Some(true) => true,
                Some(false) if !wait => return Progress::Pending,
                Some(false) => s.wait_event(event) || s.event_complete(event) == Some(true),
                None => false,
            };
            if !finished {
                tracing::error!(
                    "{}: cannot tell whether queued work on {} bytes at {:#x} finished",
                    S::NAME,
                    self.len,
                    self.ptr
                );
                return Progress::Unknown;
            }
            s.destroy_event(event);
            self.uses.pop();
        }
        Progress::Finished
    }

    fn free(self: Box<Self>) {
        let PendingFree {
            shared,
            origin,
            ptr,
            len,
            ..
        } = *self;
        match origin {
            Origin::Device(d) => shared.free_device(d, ptr, len),
            Origin::Pinned(d) => shared.free_pinned(d, ptr, len),
            Origin::Borrowed(release) => {
                if let Some(f) = release {
                    f();
                }
            }
        }
    }

    /// Leaked, reported and still counted rather than freed under work that may use it.
    fn leak(self: Box<Self>) {
        tracing::error!(
            bytes = self.len,
            "{}: leaking {} memory whose queued work is not known to have finished",
            S::NAME,
            self.origin.describe()
        );
    }
}
