//! Memory: buffers are `auxil::uses::TrackedMem` (use events, stream-ordered frees) over the
//! ACL calls below; pinned staging buffers for host steps.

use super::*;

/// ACL binds one device per thread: events and streams need no more than `bind`.
impl UseEvents for Shared {
    type Stream = result::Stream;
    type Event = result::Event;
    const NAME: &'static str = "npu";

    fn bind_for(&self, _: result::Stream) -> Result<()> {
        self.bind().map(drop)
    }
    fn create_event(&self) -> Result<result::Event> {
        result::event::create(&self.api, ACL_EVENT_SYNC)
    }
    fn record_event(&self, event: result::Event, stream: result::Stream) -> Result<()> {
        result::event::record(&self.api, event, stream)
    }
    fn event_complete(&self, event: result::Event) -> Option<bool> {
        result::event::query(&self.api, event).ok()
    }
    fn wait_event(&self, event: result::Event) -> bool {
        result::event::synchronize(&self.api, event).is_ok()
    }
    fn destroy_event(&self, event: result::Event) {
        // SAFETY: an event use tracking created, destroyed once, no longer waited on.
        unsafe { result::event::destroy(&self.api, event) };
    }
    fn drain(&self, stream: result::Stream) {
        let _ = result::stream::synchronize(&self.api, stream);
    }
    fn free_device(&self, d: usize, ptr: usize, len: usize) {
        // SAFETY: allocated by aclrtMalloc; no queued work uses it any more.
        let _ = unsafe { result::mem::free(&self.api, ptr) };
        self.devices[d].release(len);
    }
    fn free_pinned(&self, _: usize, ptr: usize, len: usize) {
        // SAFETY: allocated by aclrtMallocHost; no queued work uses it any more.
        let _ = unsafe { result::mem::free_host(&self.api, ptr) };
        self.pinned.release(len);
    }
    fn frees(&self) -> &Weak<DeferredFrees> {
        &self.frees
    }
}

impl NpuBackend {
    pub(super) fn take_staging(&self, bytes: usize) -> Result<usize> {
        if let Some(p) = lock(&self.shared.staging)
            .get_mut(&bytes)
            .and_then(Vec::pop)
        {
            return Ok(p);
        }
        self.frees
            .retrying(|| result::mem::alloc_host(self.api(), bytes))
    }
}
