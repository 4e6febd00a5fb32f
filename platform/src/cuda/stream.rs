//! Streams and events: their objects' lifetimes and the backend's stream bookkeeping.

use super::*;

impl StreamObj {
    /// What use tracking tells streams apart by.
    pub(super) fn key(&self) -> (result::Stream, usize) {
        (self.raw, self.device)
    }
}

impl Drop for StreamObj {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if self.lent.load(Ordering::Acquire) {
            // Parked until the platform goes (see `Device::parked_streams`); queued work still
            // completes.
            lock(&self.shared.devices[self.device].parked_streams).push(self.raw);
            return;
        }
        let (shared, raw, device) = (Arc::clone(&self.shared), self.raw, self.device);
        self.shared.reaper.run_or_defer(move || {
            if shared.bind(device).is_ok() {
                // SAFETY: we created this stream, destroyed once; queued work still completes.
                let _ = unsafe { result::stream::destroy(raw) };
            }
        });
    }
}

impl Drop for EventObj {
    fn drop(&mut self) {
        let (shared, raw, device) = (Arc::clone(&self.shared), self.raw, self.device);
        self.shared.reaper.run_or_defer(move || {
            if shared.bind(device).is_ok() {
                // SAFETY: we created this event, destroyed once.
                unsafe { result::event::destroy(raw) };
            }
        });
    }
}

impl CudaBackend {
    pub(super) fn stream_obj(
        &self,
        raw: result::Stream,
        device: usize,
        owned: bool,
    ) -> Arc<StreamObj> {
        let s = Arc::new(StreamObj {
            shared: Arc::clone(&self.shared),
            raw,
            device,
            owned,
            lent: AtomicBool::new(false),
            errors: StreamErrors::default(),
        });
        self.shared.register(&s);
        s
    }
}

#[cfg(test)]
impl StreamObj {
    /// How many other streams' error spans this stream keeps from its waits (`host_errors`).
    pub(crate) fn waited_sources(&self) -> usize {
        self.errors.upstream_len()
    }
}
