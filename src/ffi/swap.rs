//! C entry points of hyper_parallel's layer-group swap: what a framework's module hooks call,
//! with its per-group names (`add_storage`, `launch_offload`, `wait_offload`, `launch_load`,
//! `wait_load`, current group name), compress-then-swap, and framework tensors as borrowed
//! payloads (`hprt_swap_add_borrowed` with an [`HprtAllocator`]).

use std::ffi::{c_char, c_void, CStr};
use std::sync::Arc;

use hprt_platform::{DType, DeviceBuffer};
use hprt_swap::{
    Allocator, Compression, DeviceTensor, PoolConfig, Reacquired, Saved, SavedRef, SwapError,
    SwapManager, TensorKey, VersionCounter,
};

use super::handle::{handle_kind, Exclusive};
use super::platform::{dtype_arg, HprtDeviceBuffer, HprtPlatform, HprtStream};
use super::{
    arg, arg_mut, c_enum, c_stats, guard, out, publish, release, FfiError, FfiResult, HprtStatus,
};

/// A layer-group swap manager with its own copy stream and pinned pool.
pub struct HprtSwapManager {
    manager: SwapManager,
}

/// Where a saved tensor lives in its manager; `generation` tells iterations apart, so a
/// reference kept past its iteration is refused.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtSavedRef {
    pub layer: usize,
    pub index: usize,
    pub generation: u64,
}

/// How offloaded tensors travel (compress-then-swap; f32/f16/bf16 tensors only).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HprtCompression {
    Off = 0,
    /// Encoded by the platform's device codec: only the encoding crosses the link.
    Device = 1,
    /// Encoded on the host after the copy, in stream order; kept compressed in host memory.
    HostStage = 2,
    /// Device where a device codec exists, else the host stage.
    Auto = 3,
}

/// A framework's allocator for borrowed tensors. `allocate` makes new framework memory of
/// `bytes` (returns 0 on success, anything else for "out of memory") and writes its device
/// address and an owner token; `release` says hprt no longer references the memory of
/// `owner` (it may run on any thread, once queued copies finished). `ready_on`, when not NULL,
/// is the stream a caching allocator hands its memory out on (PyTorch's c10 allocator with the
/// current stream: a block freed by kernels still queued there is handed out again at once);
/// hprt's reload writes new memory only after the work queued on it so far. It must stay live
/// while the allocator is used; NULL when new memory is free at once.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HprtAllocator {
    pub user_data: *mut c_void,
    pub allocate: Option<
        unsafe extern "C" fn(
            user_data: *mut c_void,
            bytes: usize,
            out_ptr: *mut usize,
            out_owner: *mut *mut c_void,
        ) -> i32,
    >,
    pub release: Option<unsafe extern "C" fn(user_data: *mut c_void, owner: *mut c_void)>,
    pub ready_on: *const HprtStream,
}

/// The C allocator as hprt-swap sees it.
struct CAllocator {
    c: HprtAllocator,
    platform: hprt_swap::PlatformHandle,
}

// SAFETY: the C contract of `HprtAllocator`: its callbacks and `user_data` may be used from
// any thread.
unsafe impl Send for CAllocator {}
// SAFETY: as above.
unsafe impl Sync for CAllocator {}

/// The owner token of a borrowed buffer, for `hprt_swap_get_borrowed`.
struct Owner(*mut c_void);
// SAFETY: an opaque token the framework gave; hprt never dereferences it.
unsafe impl Send for Owner {}
// SAFETY: as above.
unsafe impl Sync for Owner {}

impl CAllocator {
    /// Borrows framework memory; `release(owner)` runs once hprt no longer references it.
    fn borrow(&self, ptr: usize, bytes: usize, owner: *mut c_void) -> FfiResult<DeviceBuffer> {
        let (user, release) = (Owner(self.c.user_data), self.c.release);
        let token = Owner(owner);
        let on_release = Box::new(move || {
            let (user, token) = (&user, &token);
            if let Some(release) = release {
                // SAFETY: the C contract of `HprtAllocator`.
                unsafe { release(user.0, token.0) };
            }
        });
        // SAFETY: the C contract: `ptr..ptr + bytes` is framework device memory of this
        // platform, valid until `release(owner)` runs.
        Ok(unsafe {
            self.platform
                .wrap_device_memory(ptr, bytes, Some(on_release))
        }?)
    }
}

impl Allocator for CAllocator {
    fn allocate(&self, like: &DeviceTensor) -> hprt_swap::Result<Reacquired> {
        let allocate = self
            .c
            .allocate
            .ok_or_else(|| SwapError::Order("the HprtAllocator has no allocate callback".into()))?;
        let (mut ptr, mut owner) = (0usize, std::ptr::null_mut());
        // SAFETY: the C contract of `HprtAllocator`.
        let rc = unsafe { allocate(self.c.user_data, like.len, &mut ptr, &mut owner) };
        if rc != 0 {
            return Err(hprt_platform::Error::new(
                hprt_platform::ErrorKind::OutOfMemory,
                self.platform.backend(),
                "HprtAllocator.allocate",
                format!(
                    "the framework allocator returned {rc} for {} bytes",
                    like.len
                ),
            )
            .into());
        }
        let storage = self
            .borrow(ptr, like.len, owner)
            .map_err(|e| SwapError::Order(e.message))?;
        let ready_on = if self.c.ready_on.is_null() {
            None
        } else {
            let s = arg(self.c.ready_on, "HprtAllocator.ready_on")
                .map_err(|e| SwapError::Order(e.message))?;
            Some(s.0.clone())
        };
        Ok(Reacquired {
            storage,
            offset: 0,
            handle: Some(Arc::new(Owner(owner))),
            version: VersionCounter::new(),
            ready_on,
        })
    }
}

c_enum!(HprtCompression <=> Compression, fn compression, {
    Off <=> Off,
    Device <=> Device,
    HostStage <=> HostStage,
    Auto <=> Auto,
});

/// A NUL-terminated UTF-8 group name.
///
/// # Safety
/// `name` null or NUL-terminated.
pub(crate) unsafe fn name_arg<'a>(name: *const c_char) -> FfiResult<&'a str> {
    if name.is_null() {
        return Err(FfiError::null("group_name"));
    }
    // SAFETY: non-null, NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| FfiError::invalid("group_name is not UTF-8"))
}

fn c_ref(r: SavedRef) -> HprtSavedRef {
    HprtSavedRef {
        layer: r.key.layer.index(),
        index: r.key.index,
        generation: r.generation,
    }
}

/// A tensor of `bytes` at `offset` in `storage`.
/// `storage` as a tensor for `engine`, which copies it with its own platform: a buffer of
/// another platform value (or backend), or one already freed, is refused here rather than at
/// its offload.
pub(crate) fn view(
    engine: &hprt_swap::SwapEngine,
    storage: &DeviceBuffer,
    offset: usize,
    bytes: usize,
    dtype: i32,
) -> FfiResult<DeviceTensor> {
    // An empty memset queues nothing: it only runs the platform's checks of the buffer.
    engine
        .platform()
        .memset_async(storage, 0, 0, 0, engine.d2h_stream())
        .map_err(|e| FfiError {
            status: e.kind().status(),
            message: format!("storage: {}", e.message),
        })?;
    let dtype: DType = dtype_arg(dtype)?;
    if bytes % dtype.size() != 0 {
        return Err(FfiError::invalid(format!(
            "{bytes} bytes are not whole {dtype} elements"
        )));
    }
    Ok(DeviceTensor::view(
        storage.clone(),
        offset,
        dtype,
        vec![bytes / dtype.size()],
    )?)
}

/// Bytes moved by a swap manager and the state of its pinned pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtSwapStats {
    pub offloaded_tensors: u64,
    pub offloaded_bytes: u64,
    pub reloaded_tensors: u64,
    pub reloaded_bytes: u64,
    /// Bytes over the host link (compressed bytes for compressed tensors).
    pub link_d2h_bytes: u64,
    pub link_h2d_bytes: u64,
    pub compressed_tensors: u64,
    pub codec_ns: u64,
    pub pinned_bytes_held: usize,
    pub pinned_high_water: usize,
    pub pool_hits: u64,
    pub pool_misses: u64,
}

impl HprtSwapManager {
    fn layer(&self, index: usize) -> FfiResult<hprt_swap::LayerId> {
        Ok(self.manager.layer_id(index)?)
    }

    fn saved_ref(&self, r: HprtSavedRef) -> FfiResult<SavedRef> {
        Ok(SavedRef {
            key: TensorKey {
                layer: self.layer(r.layer)?,
                index: r.index,
            },
            generation: r.generation,
        })
    }
}

handle_kind!(exclusive HprtSwapManager, 10, "swap manager");

/// Resolves a manager argument for mutation (one call at a time).
fn manager_mut<'a>(m: *mut HprtSwapManager) -> FfiResult<&'a mut HprtSwapManager> {
    arg_mut(m, "manager")
}

/// A manager on `platform`; `host_budget` bounds its pinned pool in bytes (0 = unbounded).
/// One manager belongs to one thread at a time.
///
/// # Safety
/// `platform` live; `out_manager` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_manager_create(
    platform: *const HprtPlatform,
    host_budget: usize,
    out_manager: *mut *mut HprtSwapManager,
) -> HprtStatus {
    guard("hprt_swap_manager_create", || {
        let p = arg(platform, "platform")?;
        let pool = PoolConfig {
            host_budget: (host_budget > 0).then_some(host_budget),
        };
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_manager, "out_manager", || {
                Ok(Exclusive::new(HprtSwapManager {
                    manager: SwapManager::with_pool(p.handle(), pool)?,
                }))
            })
        }
    })
}

/// Synchronizes the manager's copies and releases it (saved values are dropped).
/// While another call uses it, the destroy is `HPRT_STATUS_ERROR_WRONG_STATE` and the handle
/// stays valid: destroy it again once that call returned.
///
/// # Safety
/// `manager` from `hprt_swap_manager_create`; afterwards the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_manager_destroy(manager: *mut HprtSwapManager) -> HprtStatus {
    guard("hprt_swap_manager_destroy", || {
        let m = manager_mut(manager)?;
        release(manager, "manager")?;
        m.manager.end_iteration()?;
        Ok(())
    })
}

/// Registers a layer (module); `*out_layer` is its index for the other calls.
///
/// # Safety
/// `manager` live; `out_layer` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_new_layer(
    manager: *mut HprtSwapManager,
    out_layer: *mut usize,
) -> HprtStatus {
    guard("hprt_swap_new_layer", || {
        let m = manager_mut(manager)?;
        let id = m.manager.new_layer();
        // SAFETY: the caller's contract.
        unsafe { out(out_layer, "out_layer", id.index()) }
    })
}

/// Links `first` → `second` (forward order); idempotent, a layer's first link wins.
///
/// # Safety
/// `manager` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_set_forward_prefetch_layer(
    manager: *mut HprtSwapManager,
    first: usize,
    second: usize,
) -> HprtStatus {
    guard("hprt_swap_set_forward_prefetch_layer", || {
        let m = manager_mut(manager)?;
        let (a, b) = (m.layer(first)?, m.layer(second)?);
        m.manager.set_forward_prefetch_layer(a, b)?;
        Ok(())
    })
}

/// Forward pre-hook: `layer` becomes the group `hprt_swap_save` fills.
///
/// # Safety
/// `manager` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_forward_pre(
    manager: *mut HprtSwapManager,
    layer: usize,
) -> HprtStatus {
    guard("hprt_swap_forward_pre", || {
        let m = manager_mut(manager)?;
        let l = m.layer(layer)?;
        m.manager.forward_pre(l)?;
        Ok(())
    })
}

/// Saves `bytes` of `storage` from `offset` (a view of `numel = bytes / dtype size` elements)
/// into the current layer's group. On offload the whole storage's device bytes are released
/// (resized to 0) and re-acquired on reload, as hyper_parallel does: read the tensor's new address
/// with `hprt_swap_get` after the layer's backward pre-hook.
///
/// # Safety
/// `manager` and `storage` live; `out_ref` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_save(
    manager: *mut HprtSwapManager,
    storage: *const HprtDeviceBuffer,
    offset: usize,
    bytes: usize,
    dtype: i32,
    out_ref: *mut HprtSavedRef,
) -> HprtStatus {
    guard("hprt_swap_save", || {
        let (m, s) = (manager_mut(manager)?, arg(storage, "storage")?);
        let r = m.manager.save(Saved::Tensor(view(
            m.manager.engine(),
            &s.0,
            offset,
            bytes,
            dtype,
        )?))?;
        // SAFETY: the caller's contract.
        unsafe { out(out_ref, "out_ref", c_ref(r)) }
    })
}

/// Forward post-hook: offloads the group on the copy stream (after the work queued on
/// `compute`) if a next layer is linked, and waits for the previous layer's offload.
///
/// # Safety
/// `manager`, `compute` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_forward_post(
    manager: *mut HprtSwapManager,
    layer: usize,
    compute: *const HprtStream,
) -> HprtStatus {
    guard("hprt_swap_forward_post", || {
        let (m, s) = (manager_mut(manager)?, arg(compute, "compute")?);
        let l = m.layer(layer)?;
        m.manager.forward_post(l, &s.0)?;
        Ok(())
    })
}

/// Backward pre-hook: prefetches the previous layer and makes `compute` wait for this layer's
/// reload.
///
/// # Safety
/// `manager`, `compute` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_backward_pre(
    manager: *mut HprtSwapManager,
    layer: usize,
    compute: *const HprtStream,
) -> HprtStatus {
    guard("hprt_swap_backward_pre", || {
        let (m, s) = (manager_mut(manager)?, arg(compute, "compute")?);
        let l = m.layer(layer)?;
        m.manager.backward_pre(l, &s.0)?;
        Ok(())
    })
}

/// Backward post-hook.
///
/// # Safety
/// `manager` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_backward_post(
    manager: *mut HprtSwapManager,
    layer: usize,
) -> HprtStatus {
    guard("hprt_swap_backward_post", || {
        let m = manager_mut(manager)?;
        let l = m.layer(layer)?;
        m.manager.backward_post(l)?;
        Ok(())
    })
}

/// The device address of a saved tensor's first byte, once it is back on the device
/// (`HPRT_STATUS_ERROR_WRONG_STATE` while it is offloaded or in flight).
///
/// # Safety
/// `manager` live; `out_ptr` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_get(
    manager: *mut HprtSwapManager,
    saved: HprtSavedRef,
    out_ptr: *mut usize,
) -> HprtStatus {
    guard("hprt_swap_get", || {
        let m = manager_mut(manager)?;
        let r = m.saved_ref(saved)?;
        let ptr = match m.manager.get(r)? {
            Saved::Tensor(t) => t.storage.device_ptr() + t.offset,
            Saved::Other(_) => return Err(FfiError::invalid("the saved value is not a tensor")),
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_ptr, "out_ptr", ptr) }
    })
}

/// Ends the step: synchronizes the copies, drops every group and starts the pool's next
/// iteration.
///
/// # Safety
/// `manager` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_end_iteration(manager: *mut HprtSwapManager) -> HprtStatus {
    guard("hprt_swap_end_iteration", || {
        manager_mut(manager)?.manager.end_iteration()?;
        Ok(())
    })
}

/// # Safety
/// `manager` live; `out_stats` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_stats(
    manager: *mut HprtSwapManager,
    out_stats: *mut HprtSwapStats,
) -> HprtStatus {
    guard("hprt_swap_stats", || {
        let m = manager_mut(manager)?;
        let s = stats_of(m.manager.engine());
        // SAFETY: the caller's contract.
        unsafe { out(out_stats, "out_stats", s) }
    })
}

/// A front end's counters for C.
pub(crate) fn stats_of(engine: &hprt_swap::SwapEngine) -> HprtSwapStats {
    c_stats!(HprtSwapStats {
        offloaded_tensors,
        offloaded_bytes,
        reloaded_tensors,
        reloaded_bytes,
        link_d2h_bytes,
        link_h2d_bytes,
        compressed_tensors,
        codec_ns,
        pinned_bytes_held,
        pinned_high_water,
        pool_hits,
        pool_misses,
    } from engine.stat_fields())
}

/// Compress-then-swap for the tensors offloaded from now on. `mode` is an `HprtCompression`
/// (another value is `HPRT_STATUS_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `manager` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_set_compression(
    manager: *mut HprtSwapManager,
    mode: i32,
) -> HprtStatus {
    guard("hprt_swap_set_compression", || {
        let mode = compression(mode)?;
        let m = manager_mut(manager)?;
        m.manager.engine_mut().set_compression(mode);
        Ok(())
    })
}

/// hyper_parallel's `set_current_group_name`: the group `hprt_swap_save` fills (made on
/// first use).
///
/// # Safety
/// `manager` live; `group_name` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_set_current_group_name(
    manager: *mut HprtSwapManager,
    group_name: *const c_char,
) -> HprtStatus {
    guard("hprt_swap_set_current_group_name", || {
        let m = manager_mut(manager)?;
        // SAFETY: the caller's contract.
        let name = unsafe { name_arg(group_name) }?;
        m.manager.set_current_group_name(name);
        Ok(())
    })
}

/// hyper_parallel's `get_current_group_name`: the group `hprt_swap_save` fills, written to
/// `out_name` with a terminating NUL; `*out_len` is the name's length without it (0 and an
/// empty string when none was set). A `capacity` below `*out_len + 1` is
/// `HPRT_STATUS_ERROR_BUFFER_TOO_SMALL` (`*out_len` is still set, to size the buffer).
///
/// # Safety
/// `manager` live; `out_name` valid for `capacity` bytes; `out_len` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_get_current_group_name(
    manager: *mut HprtSwapManager,
    out_name: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> HprtStatus {
    guard("hprt_swap_get_current_group_name", || {
        let m = manager_mut(manager)?;
        let name = m.manager.get_current_group_name().unwrap_or("");
        // SAFETY: the caller's contract.
        unsafe { write_text(name, "the group name", out_name, capacity, out_len) }
    })
}

/// Writes `text` and a NUL to `out_text` (capacity `capacity`) and its length without the NUL
/// to `*out_len`, which is set even when the capacity is too small (to size the buffer).
///
/// # Safety
/// `out_text` valid for `capacity` bytes; `out_len` valid for writing.
pub(super) unsafe fn write_text(
    text: &str,
    what: &str,
    out_text: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> FfiResult {
    if out_text.is_null() {
        return Err(FfiError::null("out_text"));
    }
    // SAFETY: the caller's contract.
    unsafe { out(out_len, "out_len", text.len()) }?;
    if text.len() >= capacity {
        return Err(FfiError {
            status: HprtStatus::ErrorBufferTooSmall,
            message: format!(
                "{what} needs {} bytes with its NUL, the buffer has {capacity}",
                text.len() + 1
            ),
        });
    }
    // SAFETY: `out_text` holds `capacity > len` bytes by contract.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), out_text, text.len());
        out_text.add(text.len()).write(0);
    }
    Ok(())
}

/// hyper_parallel's `add_storage`: saves `bytes` of `storage` from `offset` into group
/// `group_name` (made on first use).
///
/// # Safety
/// `manager`, `storage` live; `group_name` NUL-terminated; `out_ref` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_add_storage(
    manager: *mut HprtSwapManager,
    group_name: *const c_char,
    storage: *const HprtDeviceBuffer,
    offset: usize,
    bytes: usize,
    dtype: i32,
    out_ref: *mut HprtSavedRef,
) -> HprtStatus {
    guard("hprt_swap_add_storage", || {
        let (m, s) = (manager_mut(manager)?, arg(storage, "storage")?);
        // SAFETY: the caller's contract.
        let name = unsafe { name_arg(group_name) }?;
        let r = m.manager.add_storage(
            name,
            Saved::Tensor(view(m.manager.engine(), &s.0, offset, bytes, dtype)?),
        )?;
        // SAFETY: the caller's contract.
        unsafe { out(out_ref, "out_ref", c_ref(r)) }
    })
}

/// Saves a framework tensor (`bytes` of device memory at `ptr`, kept alive by the framework
/// until `allocator.release(owner)`) into group `group_name` as a borrowed payload: its memory
/// is released to the framework after the offload, and the reload lands in memory from
/// `allocator.allocate` (read its address and owner with `hprt_swap_get_borrowed`).
///
/// # Safety
/// `manager`, `platform` live; `group_name` NUL-terminated; `ptr..ptr + bytes` device memory of
/// the manager's platform valid until `release(owner)`; `out_ref` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_add_borrowed(
    manager: *mut HprtSwapManager,
    platform: *const HprtPlatform,
    group_name: *const c_char,
    ptr: usize,
    bytes: usize,
    dtype: i32,
    owner: *mut c_void,
    allocator: HprtAllocator,
    out_ref: *mut HprtSavedRef,
) -> HprtStatus {
    guard("hprt_swap_add_borrowed", || {
        let (m, p) = (manager_mut(manager)?, arg(platform, "platform")?);
        // SAFETY: the caller's contract.
        let name = unsafe { name_arg(group_name) }?;
        let dtype: DType = dtype_arg(dtype)?;
        if bytes % dtype.size() != 0 {
            return Err(FfiError::invalid(format!(
                "{bytes} bytes are not whole {dtype} elements"
            )));
        }
        let alloc = Arc::new(CAllocator {
            c: allocator,
            platform: p.handle(),
        });
        let storage = alloc.borrow(ptr, bytes, owner)?;
        let t = DeviceTensor::borrowed(
            storage,
            dtype,
            vec![bytes / dtype.size()],
            Some(Arc::new(Owner(owner))),
            alloc,
        )?;
        let r = m.manager.add_storage(name, Saved::Tensor(t))?;
        // SAFETY: the caller's contract.
        unsafe { out(out_ref, "out_ref", c_ref(r)) }
    })
}

/// A borrowed tensor's device address and owner token, once it is back on the device (after
/// a reload: the memory `allocator.allocate` gave).
///
/// # Safety
/// `manager` live; `out_ptr`, `out_owner` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_swap_get_borrowed(
    manager: *mut HprtSwapManager,
    saved: HprtSavedRef,
    out_ptr: *mut usize,
    out_owner: *mut *mut c_void,
) -> HprtStatus {
    guard("hprt_swap_get_borrowed", || {
        let m = manager_mut(manager)?;
        let r = m.saved_ref(saved)?;
        let Saved::Tensor(t) = m.manager.get(r)? else {
            return Err(FfiError::invalid("the saved value is not a tensor"));
        };
        let owner = t
            .handle
            .as_ref()
            .and_then(|h| h.downcast_ref::<Owner>())
            .ok_or_else(|| FfiError::invalid("the saved tensor is not borrowed"))?
            .0;
        let ptr = t.storage.device_ptr() + t.offset;
        // SAFETY: the caller's contract.
        unsafe {
            out(out_ptr, "out_ptr", ptr)?;
            out(out_owner, "out_owner", owner)
        }
    })
}

macro_rules! group_call {
    ($(#[$doc:meta])* $name:ident, $method:ident $(, $compute:ident)?) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `manager` (and `compute`) live; `group_name` NUL-terminated.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            manager: *mut HprtSwapManager,
            group_name: *const c_char,
            $($compute: *const HprtStream,)?
        ) -> HprtStatus {
            guard(stringify!($name), || {
                let m = manager_mut(manager)?;
                // SAFETY: the caller's contract.
                let name = unsafe { name_arg(group_name) }?;
                $(let $compute = &arg($compute, "compute")?.0;)?
                m.manager.$method(name $(, $compute)?)?;
                Ok(())
            })
        }
    };
}

group_call!(
    /// hyper_parallel's `launch_offload`: queues the group's offload after the work queued on
    /// `compute`.
    hprt_swap_launch_offload, launch_offload, compute
);
group_call!(
    /// hyper_parallel's `wait_offload`: waits for the group's offload and releases its device
    /// memory.
    hprt_swap_wait_offload, wait_offload
);
group_call!(
    /// hyper_parallel's `launch_load`: starts reloading the group.
    hprt_swap_launch_load, launch_load
);
group_call!(
    /// hyper_parallel's `wait_load`: `compute` waits for the group's reload.
    hprt_swap_wait_load, wait_load, compute
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::platform::{hprt_platform_close, hprt_platform_open};
    use std::sync::mpsc;

    /// ISSUE 32 item 18, documented behaviour: a destroy racing a use of an exclusive object
    /// (here a swap manager) is `HPRT_STATUS_ERROR_WRONG_STATE` and leaves the handle valid;
    /// the destroy succeeds once the use returned.
    #[test]
    fn a_destroy_racing_a_use_is_wrong_state_and_leaves_the_handle_valid() {
        let (mut p, mut m) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid request and out-pointers; every handle is released once below.
        unsafe {
            assert_eq!(hprt_platform_open(c"cpu".as_ptr(), &mut p), HprtStatus::Ok);
            assert_eq!(hprt_swap_manager_create(p, 0, &mut m), HprtStatus::Ok);
        }
        let (using, release) = (mpsc::channel(), mpsc::channel::<()>());
        let id = m as usize;
        let user = std::thread::spawn(move || {
            guard("a use", || {
                manager_mut(id as *mut HprtSwapManager)?;
                using.0.send(()).unwrap();
                let _ = release.1.recv();
                Ok(())
            })
        });
        using.1.recv().unwrap();
        // SAFETY: a live handle (in use on the other thread).
        let raced = unsafe { hprt_swap_manager_destroy(m) };
        assert_eq!(raced, HprtStatus::ErrorWrongState);
        let mut layer = 0;
        drop(release.0);
        assert_eq!(user.join().unwrap(), HprtStatus::Ok);
        // SAFETY: the handle is still valid; released once, then the platform.
        unsafe {
            assert_eq!(hprt_swap_new_layer(m, &mut layer), HprtStatus::Ok);
            assert_eq!(hprt_swap_manager_destroy(m), HprtStatus::Ok);
            assert_eq!(hprt_swap_manager_destroy(m), HprtStatus::ErrorInvalidHandle);
            assert_eq!(hprt_platform_close(p), HprtStatus::Ok);
        }
    }
}
