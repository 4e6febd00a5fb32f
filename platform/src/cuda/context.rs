//! Devices and their primary contexts: opening the backend (library probes, driver and
//! device discovery), binding a device's context to a thread, NVRTC modules, teardown.

use super::*;

impl Shared {
    pub(super) fn ctx(&self, device: usize) -> Result<result::Context> {
        let d = &self.devices[device];
        if let Some(&ctx) = d.ctx.get() {
            return Ok(ctx);
        }
        let _init = lock(&d.ctx_init);
        if let Some(&ctx) = d.ctx.get() {
            return Ok(ctx);
        }
        let ctx = result::ctx::primary_retain(d.handle)?;
        Ok(*d.ctx.get_or_init(|| ctx))
    }

    /// Makes `device`'s primary context current on this thread (nothing when it already is).
    pub(super) fn bind(&self, device: usize) -> Result<()> {
        let ctx = self.ctx(device)?;
        if result::ctx::current()? != Some(ctx) {
            result::ctx::set_current(Some(ctx))?;
        }
        Ok(())
    }

    pub(super) fn current_device(&self) -> usize {
        // `try_with`: handles may be dropped while this thread's locals are torn down.
        CURRENT
            .try_with(|m| m.borrow().get(&self.instance).copied())
            .ok()
            .flatten()
            .unwrap_or(0)
    }

    /// Binds the calling thread's current device; returns it.
    pub(super) fn bind_current(&self) -> Result<usize> {
        let d = self.current_device();
        self.bind(d)?;
        Ok(d)
    }

    pub(super) fn nccl(&self) -> Result<&Nccl> {
        self.nccl.as_ref().map_err(Clone::clone)
    }

    /// The function `name` of module `module` on `device`, compiling the module from `source`
    /// on first use. The caller has bound `device`.
    pub(super) fn function(
        &self,
        device: usize,
        module: &'static str,
        source: impl FnOnce() -> String,
        name: &str,
    ) -> Result<result::Function> {
        let d = &self.devices[device];
        let m = {
            let mut modules = lock(&d.modules);
            match modules.get(module) {
                Some(m) => Arc::clone(m),
                None => {
                    let m = self.compile(d, module, source())?;
                    modules.insert(module, Arc::clone(&m));
                    m
                }
            }
        };
        let mut functions = lock(&m.functions);
        if let Some(&f) = functions.get(name) {
            return Ok(f);
        }
        let cname = CString::new(name).map_err(|_| {
            cuda_err(
                ErrorKind::InvalidValue,
                "cuModuleGetFunction",
                "NUL in name",
            )
        })?;
        let f = result::module::function(m.raw, &cname)?;
        functions.insert(name.to_string(), f);
        Ok(f)
    }

    pub(super) fn compile(
        &self,
        d: &Device,
        module: &'static str,
        source: String,
    ) -> Result<Arc<Module>> {
        let nvrtc = self.nvrtc.as_ref().map_err(Clone::clone)?;
        let image = nvrtc.compile(&source, module, d.compute_capability)?;
        // The context is added to the driver's error, whose status code and name it keeps.
        let raw = result::module::load_data(&image.bytes).map_err(|e| Error {
            message: format!(
                "{} ({} of {module}, NVRTC {}.{})",
                e.message, image.kind, nvrtc.version.0, nvrtc.version.1
            ),
            ..e
        })?;
        tracing::debug!(module, kind = image.kind, device = %d.name, "kernel module loaded");
        Ok(Arc::new(Module {
            raw,
            functions: Mutex::new(HashMap::new()),
        }))
    }

    pub(super) fn register(&self, s: &Arc<StreamObj>) {
        let mut streams = lock(&self.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(s));
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        type Work = (
            usize,
            result::Context,
            Vec<result::Module>,
            Vec<u64>,
            Vec<result::Event>,
            Vec<result::Stream>,
        );
        let mut work: Vec<Work> = Vec::new();
        for (i, d) in self.devices.iter_mut().enumerate() {
            let modules: Vec<result::Module> = d
                .modules
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .drain()
                .map(|(_, m)| m.raw)
                .collect();
            // The allocation cache: every buffer is gone, so this is all the memory left.
            let cached = d.pool.drain();
            let events = d.events.drain();
            let streams = std::mem::take(
                d.parked_streams
                    .get_mut()
                    .unwrap_or_else(|p| p.into_inner()),
            );
            if let Some(&ctx) = d.ctx.get() {
                work.push((i, ctx, modules, cached, events, streams));
            }
        }
        let handles: Vec<cu::CUdevice> = self.devices.iter().map(|d| d.handle).collect();
        let release = move || {
            for (i, ctx, modules, cached, events, streams) in work {
                let _ = result::ctx::set_current(Some(ctx));
                // SAFETY: the context is ours (retained once); the modules were loaded in it,
                // the cached blocks allocated, the pooled events and parked streams created in
                // it, and nothing of this platform uses them.
                unsafe {
                    for p in cached {
                        let _ = result::mem::free(p);
                    }
                    for e in events {
                        result::event::destroy(e);
                    }
                    for st in streams {
                        let _ = result::stream::destroy(st);
                    }
                    for m in modules {
                        result::module::unload(m);
                    }
                    result::ctx::primary_release(handles[i]);
                }
            }
        };
        if host_fn::in_host_fn() {
            // The last handle died in a host function, where the driver may not be called.
            std::thread::spawn(release);
        } else {
            release();
        }
    }
}

pub(super) fn unavailable(op: &'static str, msg: impl Into<String>) -> Error {
    cuda_err(ErrorKind::Unavailable, op, msg)
}

/// Any failure while opening means the backend cannot be used here.
pub(super) fn as_unavailable(e: Error) -> Error {
    Error {
        kind: ErrorKind::Unavailable,
        ..e
    }
}

pub(super) fn load_nccl(
    search_path: Option<&std::path::PathBuf>,
    probes: &mut Vec<LibraryProbe>,
) -> Result<Nccl> {
    let s = search(&LibrarySpec::nccl(), search_path);
    probes.extend(s.tried.iter().cloned());
    let missing = s.missing_message();
    let found = s
        .found
        .ok_or_else(|| unavailable("nccl", format!("collectives are unavailable: {missing}")))?;
    let api = NcclApi::load(found.lib)
        .map_err(|m| unavailable("nccl", format!("{} lacks {}", found.path, m.join(", "))))?;
    let mut version: c_int = 0;
    // SAFETY: plain NCCL call into a local.
    let code = unsafe { (api.ncclGetVersion)(&mut version) };
    let nccl = Nccl {
        api,
        version,
        path: found.path,
    };
    nccl.check(code, "ncclGetVersion").map_err(as_unavailable)?;
    Ok(nccl)
}

pub(super) fn load_nvrtc(
    search_path: Option<&std::path::PathBuf>,
    probes: &mut Vec<LibraryProbe>,
) -> Result<Nvrtc> {
    let s = search(&LibrarySpec::nvrtc(), search_path);
    probes.extend(s.tried.iter().cloned());
    let missing = s.missing_message();
    let found = s
        .found
        .ok_or_else(|| unavailable("nvrtc", format!("kernels are unavailable: {missing}")))?;
    let api = NvrtcApi::load(found.lib)
        .map_err(|m| unavailable("nvrtc", format!("{} lacks {}", found.path, m.join(", "))))?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain NVRTC call into locals.
    if unsafe { (api.nvrtcVersion)(&mut major, &mut minor) } != 0 {
        return Err(unavailable(
            "nvrtc",
            format!("nvrtcVersion failed in {}", found.path),
        ));
    }
    Ok(Nvrtc {
        api,
        version: (major, minor),
        path: found.path,
    })
}

/// The address of `symbol` in `lib`, or 0.
pub(super) fn symbol_address(lib: &libloading::Library, symbol: &str) -> usize {
    // SAFETY: the symbol is only compared by address, never called through this type.
    unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }
        .map(|s| *s as usize)
        .unwrap_or(0)
}

impl CudaBackend {
    /// Opens the backend with the library search the environment describes ([`CudaSearch`]).
    pub fn open() -> Result<Self> {
        Self::open_with(&CudaSearch::from_process())
    }

    /// [`CudaBackend::open`] with the library search given explicitly. Fails with
    /// `Unavailable` (naming the library and every name or path tried) when the driver cannot
    /// be loaded or initialised or has no device; NCCL and NVRTC are optional.
    pub fn open_with(search_env: &CudaSearch) -> Result<Self> {
        let timeout = crate::collective::collective_timeout_from_env(BackendKind::Cuda, None)?
            .unwrap_or(crate::collective::DEFAULT_COLLECTIVE_TIMEOUT);
        let driver = search(&LibrarySpec::driver(), search_env.cuda_lib.as_ref());
        let mut probes = driver.tried.clone();
        let missing = driver.missing_message();
        let found = driver.found.ok_or_else(|| unavailable("open", missing))?;
        let absent: Vec<&str> = DRIVER_SYMBOLS
            .iter()
            .copied()
            .filter(|s| symbol_address(&found.lib, s) == 0)
            .collect();
        if !absent.is_empty() {
            return Err(unavailable(
                "open",
                format!("{} lacks {}", found.path, absent.join(", ")),
            ));
        }
        // cudarc loads the driver by name on its own; make sure that resolves, and to the same
        // library (an HP_CUDA_LIB override must not lose against another libcuda on the path).
        // SAFETY: only opens libraries by name, as the probe above did.
        if !unsafe { cu::is_culib_present() } {
            return Err(unavailable(
                "open",
                format!(
                    "{} loaded, but none of the names cudarc resolves the driver by ({}) leads to it",
                    found.path,
                    LibrarySpec::driver().names.join(", ")
                ),
            ));
        }
        // SAFETY: present, checked just above, so this does not panic.
        let cudarc_lib = unsafe { cu::culib() };
        // SAFETY: compared by address only.
        let theirs = unsafe { cudarc_lib.get::<unsafe extern "C" fn()>(b"cuInit") }
            .map(|s| *s as usize)
            .unwrap_or(0);
        if theirs != symbol_address(&found.lib, "cuInit") {
            return Err(unavailable(
                "open",
                format!(
                    "cudarc resolved the driver to another library than {} (set by {}); remove the other libcuda from the loader path or unset the override",
                    found.path,
                    if search_env.cuda_lib.is_some() { "HP_CUDA_LIB" } else { "the loader search" }
                ),
            ));
        }
        result::init().map_err(as_unavailable)?;
        let version = result::driver_version().map_err(as_unavailable)?;
        let count = result::device::count().map_err(as_unavailable)?;
        if count <= 0 {
            return Err(unavailable(
                "open",
                format!("the CUDA driver ({}) reports no device", found.path),
            ));
        }
        let alloc_cache = memory::alloc_cache_from_env()?;
        let devices = (0..count)
            .map(|i| Self::describe_device(i, alloc_cache).map_err(as_unavailable))
            .collect::<Result<Vec<_>>>()?;
        let nccl = load_nccl(search_env.nccl_lib.as_ref(), &mut probes);
        let nvrtc = load_nvrtc(search_env.nvrtc_lib.as_ref(), &mut probes);
        for (what, r) in [
            ("nccl", nccl.as_ref().err()),
            ("nvrtc", nvrtc.as_ref().err()),
        ] {
            if let Some(e) = r {
                tracing::warn!(library = what, error = %e, "cuda backend without {what}");
            }
        }
        let (frees, frees_ref) = deferred::new_list();
        Ok(CudaBackend {
            frees,
            shared: Arc::new(Shared {
                instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
                driver_path: found.path,
                driver_version: version,
                emulated: crate::capabilities::is_emulator(&found.lib),
                devices,
                pinned: MemoryCounter::new(None),
                streams: Mutex::new(Vec::new()),
                nccl,
                nvrtc,
                probes,
                reaper: Reaper::new(),
                watchdog: Arc::new(Watchdog::new(timeout)),
                frees: frees_ref,
                _driver: found.lib,
            }),
            retired: Retired::default(),
        })
    }

    pub(super) fn describe_device(ordinal: c_int, alloc_cache: usize) -> Result<Device> {
        let handle = result::device::get(ordinal)?;
        let name = result::device::name(handle)?;
        let total = result::device::total_mem(handle)?;
        let attr = |a| result::device::attribute(handle, a);
        let major = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok(Device {
            handle,
            name,
            total,
            compute_capability: (major, minor),
            ctx: OnceLock::new(),
            ctx_init: Mutex::new(()),
            memory: MemoryCounter::new(None),
            pool: memory::DevicePool::new(alloc_cache),
            events: memory::EventPool::default(),
            parked_streams: Mutex::new(Vec::new()),
            modules: Mutex::new(HashMap::new()),
        })
    }

    /// The device whose primary context `ctx` is (a stream from another context is refused:
    /// hprt's memory lives in primary contexts).
    pub(super) fn device_of_context(&self, ctx: result::Context) -> Result<usize> {
        let dev = result::ctx::device_of(ctx)?;
        let ordinal = self
            .shared
            .devices
            .iter()
            .position(|d| d.handle == dev)
            .ok_or_else(|| {
                cuda_err(
                    ErrorKind::InvalidValue,
                    "wrap_external_stream",
                    format!("the stream's device {dev} is not one of this platform's"),
                )
            })?;
        if self.shared.ctx(ordinal)? != ctx {
            return Err(cuda_err(
                ErrorKind::Unsupported,
                "wrap_external_stream",
                "the stream belongs to a context other than the device's primary context",
            ));
        }
        Ok(ordinal)
    }
}
