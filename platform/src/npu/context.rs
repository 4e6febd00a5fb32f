//! Opening the backend (ACL and HCCL loaded, ACL initialised or adopted), the thread's
//! device binding, the host-function report thread, teardown.

use super::*;

impl Shared {
    /// Binds the calling thread to its device (ACL keeps the device per thread).
    pub(super) fn bind(&self) -> Result<i32> {
        // `try_with`: handles may be dropped while this thread's locals are being torn down.
        if let Ok(Some(d)) = BOUND.try_with(|b| b.borrow().get(&self.instance).copied()) {
            return Ok(d);
        }
        // SAFETY: plain ACL call.
        acl(unsafe { self.api.acl.aclrtSetDevice(0) }, "aclrtSetDevice")?;
        let _ = BOUND.try_with(|b| b.borrow_mut().insert(self.instance, 0));
        Ok(0)
    }

    pub(super) fn reporter(&self) -> Option<&Reporter> {
        if let Some(r) = self.reporter.get() {
            return Some(r);
        }
        if !host_fn::available(&self.api) {
            return None;
        }
        let _one_at_a_time = lock(&self.reporter_start);
        if self.reporter.get().is_none() {
            match Reporter::start(Arc::clone(&self.api), 0) {
                Ok(r) => drop(self.reporter.set(r)),
                Err(e) => {
                    tracing::warn!(error = %e, "npu host-function thread unavailable (retried at next use)");
                    return None;
                }
            }
        }
        self.reporter.get()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let watched = std::mem::take(self.watched.get_mut().unwrap_or_else(|p| p.into_inner()));
        if !watched.is_empty() && self.bind().is_ok() {
            for w in watched {
                // SAFETY: bound; the platform is going, nothing waits on the marks.
                unsafe { w.destroy(&self.api) };
            }
        }
        for (_, bufs) in lock(&self.staging).drain() {
            for p in bufs {
                // SAFETY: pool buffers came from aclrtMallocHost and are no longer referenced.
                let _ = unsafe { result::mem::free_host(&self.api, p) };
            }
        }
        if self.owns_acl {
            // SAFETY: hprt initialised ACL and nothing of this platform is left.
            unsafe { self.api.acl.aclFinalize() };
        }
    }
}

impl NpuBackend {
    /// Loads ACL and HCCL, initialises ACL (or adopts someone else's initialisation), and
    /// counts devices. Every failure is a typed `Unavailable` error saying what is missing.
    pub fn open() -> Result<Self> {
        Self::open_with(&SearchEnv::from_process())
    }

    /// [`NpuBackend::open`] with the library search settings given explicitly.
    pub fn open_with(env: &SearchEnv) -> Result<Self> {
        let api = hprt_sys::load_with(env)
            .map_err(|e| npu_err(ErrorKind::Unavailable, "load", e.to_string()))?;
        Self::with_api(api)
    }

    pub(super) fn with_api(api: Ascend) -> Result<Self> {
        let api = Arc::new(api);
        // SAFETY: aclInit with no config file.
        let code = unsafe { api.acl.aclInit(std::ptr::null()) };
        let owns_acl = code != ACL_ERROR_REPEAT_INITIALIZE as i32;
        if owns_acl {
            acl(code, "aclInit")?;
        } else {
            tracing::info!(
                "ACL already initialised by another component; hprt will not finalize it"
            );
        }
        let finalize = |e| {
            if owns_acl {
                // SAFETY: undo our own initialisation on the way out.
                unsafe { api.acl.aclFinalize() };
            }
            e
        };
        let mut count = 0u32;
        // SAFETY: ACL writes one `u32` through the out-pointer, a live local.
        acl_call!(api, aclrtGetDeviceCount(&mut count)).map_err(finalize)?;
        if count == 0 {
            return Err(finalize(npu_err(
                ErrorKind::Unavailable,
                "open",
                "ACL reports no NPU device",
            )));
        }
        let timeout = crate::collective::collective_timeout_from_env(BackendKind::Npu, None)
            .map_err(finalize)?
            .unwrap_or(crate::collective::DEFAULT_COLLECTIVE_TIMEOUT);
        let (frees, frees_ref) = deferred::new_list();
        let shared = Arc::new(Shared {
            frees: frees_ref,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            owns_acl,
            // SAFETY: the library is loaded already (ACL came from it); reopening only counts a
            // reference, its initialisers do not run again.
            emulated: unsafe { libloading::Library::new(&api.acl_path) }
                .is_ok_and(|lib| crate::capabilities::is_emulator(&lib)),
            devices: (0..count)
                .map(|_| Arc::new(MemoryCounter::new(None)))
                .collect(),
            pinned: Arc::new(MemoryCounter::new(None)),
            streams: Mutex::new(HashMap::new()),
            reporter: OnceLock::new(),
            reporter_start: Mutex::new(()),
            staging: Arc::new(Mutex::new(HashMap::new())),
            watched: Mutex::default(),
            collective_timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            api,
        });
        Ok(NpuBackend {
            shared,
            device_count: count as usize,
            retired: Retired::default(),
            frees,
        })
    }

    pub(super) fn api(&self) -> &Ascend {
        &self.shared.api
    }
}
