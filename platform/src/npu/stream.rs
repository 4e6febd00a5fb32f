//! Streams and events: their objects' lifetimes and the backend's stream bookkeeping.

use super::*;

impl StreamObj {
    pub(super) fn host_fns_ready(&self) -> bool {
        if self.subscribed.load(Ordering::Acquire) {
            return true;
        }
        let ok = self
            .shared
            .reporter()
            .is_some_and(|r| r.subscribe(self.raw.addr()).is_ok());
        if ok {
            self.subscribed.store(true, Ordering::Release);
        }
        ok
    }
}

impl Drop for StreamObj {
    fn drop(&mut self) {
        lock(&self.shared.streams).remove(&self.raw.addr());
        if self.subscribed.load(Ordering::Acquire) {
            if let Some(r) = self.shared.reporter.get() {
                let _ = r.unsubscribe(self.raw.addr());
            }
        }
        if self.owned && self.shared.bind().is_ok() {
            // SAFETY: we created this stream, destroyed once; ACL lets queued work finish.
            let _ = unsafe { result::stream::destroy(&self.shared.api, self.raw) };
        }
    }
}

impl Drop for EventObj {
    fn drop(&mut self) {
        if self.shared.bind().is_ok() {
            // SAFETY: we created this event, destroyed once.
            unsafe { result::event::destroy(&self.shared.api, self.raw) };
        }
    }
}

impl NpuBackend {
    pub(super) fn stream_obj(&self, raw: result::Stream, owned: bool) -> Arc<StreamObj> {
        let s = Arc::new(StreamObj {
            shared: Arc::clone(&self.shared),
            raw,
            owned,
            subscribed: AtomicBool::new(false),
            errors: StreamErrors::default(),
        });
        s.host_fns_ready();
        lock(&self.shared.streams).insert(raw.addr(), Arc::downgrade(&s));
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
