//! Memory: buffers are `auxil::uses::TrackedMem` (use events, stream-ordered frees) over the
//! driver calls below.

use super::*;

impl MemObj {
    pub(super) fn at(&self, offset: usize) -> u64 {
        (self.ptr + offset) as u64
    }
}

/// Streams are told apart by (handle, device): a stream handle value can come back for another
/// device's stream. Frees go through the reaper: the last handle may die in a host function.
impl UseEvents for Shared {
    type Stream = (result::Stream, usize);
    type Event = result::Event;
    const NAME: &'static str = "cuda";

    fn bind_for(&self, (_, device): (result::Stream, usize)) -> Result<()> {
        self.bind(device)
    }
    fn create_event(&self) -> Result<result::Event> {
        result::event::create(CU_EVENT_DISABLE_TIMING)
    }
    fn record_event(
        &self,
        event: result::Event,
        (stream, _): (result::Stream, usize),
    ) -> Result<()> {
        result::event::record(event, stream)
    }
    fn event_complete(&self, event: result::Event) -> Option<bool> {
        result::event::query(event).ok()
    }
    fn wait_event(&self, event: result::Event) -> bool {
        result::event::synchronize(event).is_ok()
    }
    fn destroy_event(&self, event: result::Event) {
        // SAFETY: an event use tracking created, destroyed once, no longer waited on.
        unsafe { result::event::destroy(event) };
    }
    fn drain(&self, (stream, _): (result::Stream, usize)) {
        let _ = result::stream::synchronize(stream);
    }
    fn may_call_driver(&self) -> bool {
        !host_fn::in_host_fn()
    }
    fn free_device(&self, d: usize, ptr: usize, len: usize) {
        if self.bind(d).is_ok() {
            // SAFETY: allocated by cuMemAlloc; no queued work uses it any more.
            let _ = unsafe { result::mem::free(ptr as u64) };
        }
        self.devices[d].memory.release(len);
    }
    fn free_pinned(&self, d: usize, ptr: usize, len: usize) {
        if self.bind(d).is_ok() {
            // SAFETY: allocated by cuMemHostAlloc; no queued work uses it any more.
            let _ = unsafe { result::mem::free_host(ptr as *mut c_void) };
        }
        self.pinned.release(len);
    }
    fn frees(&self) -> &Weak<DeferredFrees> {
        &self.frees
    }
    fn hand_over(self: &Arc<Self>, job: Box<dyn FnOnce() + Send>) {
        self.reaper.run_or_defer(job);
    }
}
