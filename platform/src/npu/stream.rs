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
            .is_some_and(|r| r.subscribe(self.raw).is_ok());
        if ok {
            self.subscribed.store(true, Ordering::Release);
        }
        ok
    }
}

impl Drop for StreamObj {
    fn drop(&mut self) {
        lock(&self.shared.streams).remove(&self.raw);
        if self.subscribed.load(Ordering::Acquire) {
            if let Some(r) = self.shared.reporter.get() {
                let _ = r.unsubscribe(self.raw);
            }
        }
        if self.owned && self.shared.bind().is_ok() {
            // SAFETY: we created this stream; ACL lets queued work finish.
            let _ = acl_call!(self.shared.api, aclrtDestroyStream(self.raw as _));
        }
    }
}

impl Drop for EventObj {
    fn drop(&mut self) {
        if self.shared.bind().is_ok() {
            // SAFETY: we created this event.
            unsafe { self.shared.api.acl.aclrtDestroyEvent(self.raw as _) };
        }
    }
}

impl NpuBackend {
    pub(super) fn stream_obj(&self, raw: usize, owned: bool) -> Arc<StreamObj> {
        let s = Arc::new(StreamObj {
            shared: Arc::clone(&self.shared),
            raw,
            owned,
            subscribed: AtomicBool::new(false),
            errors: StreamErrors::default(),
        });
        s.host_fns_ready();
        lock(&self.shared.streams).insert(raw, Arc::downgrade(&s));
        s
    }
}
