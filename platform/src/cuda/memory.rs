//! Memory: buffers are `auxil::uses::TrackedMem` (use events, stream-ordered frees) over the
//! driver calls below.

use super::*;

impl MemObj {
    pub(super) fn at(&self, offset: usize) -> u64 {
        (self.ptr + offset) as u64
    }
}

/// A newly created event of the bound context, for use tracking.
pub(super) fn new_use_event() -> Result<usize> {
    let mut e = std::ptr::null_mut();
    // SAFETY: plain driver call into a local.
    cu_call!(cuEventCreate(&mut e, CU_EVENT_DISABLE_TIMING))?;
    Ok(e as usize)
}

/// Streams are told apart by (handle, device): a stream handle value can come back for another
/// device's stream. Frees go through the reaper: the last handle may die in a host function.
impl UseEvents for Shared {
    type Stream = (usize, usize);
    type Event = usize;
    type Origin = Origin;
    const NAME: &'static str = "cuda";

    fn bind_for(&self, (_, device): (usize, usize)) -> Result<()> {
        self.bind(device)
    }
    fn create_event(&self) -> Result<usize> {
        new_use_event()
    }
    fn record_event(&self, event: usize, (stream, _): (usize, usize)) -> Result<()> {
        // SAFETY: live event and stream of the bound context.
        cu_call!(cuEventRecord(event as cu::CUevent, stream as cu::CUstream))
    }
    fn event_complete(&self, event: usize) -> Option<bool> {
        // SAFETY: an event use tracking created and has not destroyed.
        match unsafe { cu::cuEventQuery(event as cu::CUevent) } {
            cu::CUresult::CUDA_SUCCESS => Some(true),
            cu::CUresult::CUDA_ERROR_NOT_READY => Some(false),
            _ => None,
        }
    }
    fn wait_event(&self, event: usize) -> bool {
        // SAFETY: as above.
        (unsafe { cu::cuEventSynchronize(event as cu::CUevent) }) == cu::CUresult::CUDA_SUCCESS
    }
    fn destroy_event(&self, event: usize) {
        // SAFETY: as above; destroyed once.
        unsafe { cu::cuEventDestroy_v2(event as cu::CUevent) };
    }
    fn drain(&self, (stream, _): (usize, usize)) {
        // SAFETY: a live stream of the bound context.
        let _ = cu_call!(cuStreamSynchronize(stream as cu::CUstream));
    }
    fn may_call_driver(&self) -> bool {
        !host_fn::in_host_fn()
    }
    fn free(&self, origin: Origin, ptr: usize, len: usize) {
        match origin {
            Origin::Device(d) => {
                if self.bind(d).is_ok() {
                    // SAFETY: allocated by cuMemAlloc; no queued work uses it any more.
                    let _ = cu_call!(cuMemFree_v2(ptr as cu::CUdeviceptr));
                }
                self.devices[d].memory.release(len);
            }
            Origin::Pinned(d) => {
                if self.bind(d).is_ok() {
                    // SAFETY: allocated by cuMemHostAlloc; no queued work uses it any more.
                    let _ = cu_call!(cuMemFreeHost(ptr as *mut c_void));
                }
                self.pinned.release(len);
            }
            Origin::Borrowed(release) => {
                if let Some(f) = release {
                    f();
                }
            }
        }
    }
    fn describe(origin: &Origin) -> &'static str {
        match origin {
            Origin::Device(_) => "device",
            Origin::Pinned(_) => "pinned",
            Origin::Borrowed(_) => "borrowed (its release is not run)",
        }
    }
    fn frees(&self) -> &Weak<DeferredFrees> {
        &self.frees
    }
    fn hand_over(self: &Arc<Self>, job: Box<dyn FnOnce() + Send>) {
        self.reaper.run_or_defer(job);
    }
}
