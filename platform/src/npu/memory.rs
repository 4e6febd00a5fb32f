//! Memory: buffers are `auxil::uses::TrackedMem` (use events, stream-ordered frees) over the
//! ACL calls below; pinned staging buffers for host steps.

use super::*;

/// ACL binds one device per thread: events and streams need no more than `bind`.
impl UseEvents for Shared {
    type Stream = usize;
    type Event = usize;
    const NAME: &'static str = "npu";

    fn bind_for(&self, _: usize) -> Result<()> {
        self.bind().map(drop)
    }
    fn create_event(&self) -> Result<usize> {
        let mut e = std::ptr::null_mut();
        // SAFETY: plain ACL call.
        acl_call!(self.api, aclrtCreateEventWithFlag(&mut e, ACL_EVENT_SYNC))?;
        Ok(e as usize)
    }
    fn record_event(&self, event: usize, stream: usize) -> Result<()> {
        // SAFETY: live handles.
        acl_call!(self.api, aclrtRecordEvent(event as _, stream as _))
    }
    fn event_complete(&self, event: usize) -> Option<bool> {
        let mut status = aclrtEventRecordedStatus(0);
        // SAFETY: an event use tracking created and has not destroyed.
        let queried = unsafe { self.api.acl.aclrtQueryEventStatus(event as _, &mut status) };
        (queried == 0).then_some(status.0 == 1)
    }
    fn wait_event(&self, event: usize) -> bool {
        // SAFETY: as above.
        (unsafe { self.api.acl.aclrtSynchronizeEvent(event as _) }) == 0
    }
    fn destroy_event(&self, event: usize) {
        // SAFETY: as above; destroyed once.
        unsafe { self.api.acl.aclrtDestroyEvent(event as _) };
    }
    fn drain(&self, stream: usize) {
        // SAFETY: a live stream.
        let _ = acl_call!(self.api, aclrtSynchronizeStream(stream as _));
    }
    fn free_device(&self, d: usize, ptr: usize, len: usize) {
        // SAFETY: allocated by aclrtMalloc; no queued work uses it any more.
        let _ = acl(unsafe { self.api.acl.aclrtFree(ptr as _) }, "aclrtFree");
        self.devices[d].release(len);
    }
    fn free_pinned(&self, _: usize, ptr: usize, len: usize) {
        // SAFETY: allocated by aclrtMallocHost; no queued work uses it any more.
        let _ = acl(
            unsafe { self.api.acl.aclrtFreeHost(ptr as _) },
            "aclrtFreeHost",
        );
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
        let mut p = std::ptr::null_mut();
        // SAFETY: plain ACL call.
        self.frees
            .retrying(|| acl_call!(self.api(), aclrtMallocHost(&mut p, bytes)))?;
        Ok(p as usize)
    }
}
