//! Streams and events: their objects' lifetimes and the backend's stream bookkeeping.

use super::*;

impl StreamObj {
    /// What use tracking tells streams apart by.
    pub(super) fn key(&self) -> (usize, usize) {
        (self.raw, self.device)
    }
}

impl Drop for StreamObj {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (shared, raw, device) = (Arc::clone(&self.shared), self.raw, self.device);
        self.shared.reaper.run_or_defer(move || {
            if shared.bind(device).is_ok() {
                // SAFETY: we created this stream; queued work still completes.
                let _ = cu_call!(cuStreamDestroy_v2(raw as cu::CUstream));
            }
        });
    }
}

impl Drop for EventObj {
    fn drop(&mut self) {
        let (shared, raw, device) = (Arc::clone(&self.shared), self.raw, self.device);
        self.shared.reaper.run_or_defer(move || {
            if shared.bind(device).is_ok() {
                // SAFETY: we created this event.
                let _ = cu_call!(cuEventDestroy_v2(raw as cu::CUevent));
            }
        });
    }
}

impl CudaBackend {
    pub(super) fn stream_obj(&self, raw: usize, device: usize, owned: bool) -> Arc<StreamObj> {
        let s = Arc::new(StreamObj {
            shared: Arc::clone(&self.shared),
            raw,
            device,
            owned,
            errors: StreamErrors::default(),
        });
        self.shared.register(&s);
        s
    }
}

pub(super) fn is_ready(r: cu::CUresult, function: &'static str) -> Result<bool> {
    match r {
        cu::CUresult::CUDA_SUCCESS => Ok(true),
        cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => cu(other, function).map(|()| true),
    }
}
