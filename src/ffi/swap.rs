//! C entry points of layer-group swap (seed 000): what a framework's module hooks call.

use hprt_swap::{DeviceTensor, LayerId, PoolConfig, Saved, SavedRef, SwapError, SwapManager};

use super::handle::{handle_kind, Exclusive};
use super::platform::{dtype_arg, HprtDeviceBuffer, HprtPlatform, HprtStream};
use super::{arg, arg_mut, guard, out, publish, release, FfiError, FfiResult, HprtStatus};

impl From<SwapError> for FfiError {
    fn from(e: SwapError) -> Self {
        let status = match &e {
            SwapError::Platform(p) => return p.clone().into(),
            SwapError::WrongState { .. } | SwapError::Order(_) => HprtStatus::ErrorWrongState,
            SwapError::ModifiedSinceOffload { .. } | SwapError::StorageResized { .. } => {
                HprtStatus::ErrorModifiedSinceOffload
            }
            SwapError::HostBudgetExceeded { .. } => HprtStatus::ErrorOutOfMemory,
            _ => HprtStatus::ErrorInvalidValue,
        };
        FfiError {
            status,
            message: e.to_string(),
        }
    }
}

/// A layer-group swap manager with its own copy stream and pinned pool.
pub struct HprtSwapManager {
    manager: SwapManager,
    /// Layers in creation order: C names a layer by this index.
    layers: Vec<LayerId>,
}

/// Where a saved tensor lives in its manager.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtSavedRef {
    pub layer: usize,
    pub index: usize,
}

/// Bytes moved by a swap manager and the state of its pinned pool.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtSwapStats {
    pub offloaded_tensors: u64,
    pub offloaded_bytes: u64,
    pub reloaded_tensors: u64,
    pub reloaded_bytes: u64,
    pub pinned_bytes_held: usize,
    pub pinned_high_water: usize,
    pub pool_hits: u64,
    pub pool_misses: u64,
}

impl HprtSwapManager {
    fn layer(&self, index: usize) -> FfiResult<LayerId> {
        self.layers.get(index).copied().ok_or_else(|| {
            FfiError::invalid(format!(
                "layer {index} was not made by hprt_swap_new_layer ({} layers)",
                self.layers.len()
            ))
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
                    layers: Vec::new(),
                }))
            })
        }
    })
}

/// Synchronizes the manager's copies and releases it (saved values are dropped).
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
        m.layers.push(id);
        // SAFETY: the caller's contract.
        unsafe { out(out_layer, "out_layer", m.layers.len() - 1) }
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
/// (resized to 0) and re-acquired on reload, as the seed does: read the tensor's new address
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
        let dtype = dtype_arg(dtype)?;
        if bytes % dtype.size() != 0 {
            return Err(FfiError::invalid(format!(
                "{bytes} bytes are not whole {dtype} elements"
            )));
        }
        let t = DeviceTensor::view(s.0.clone(), offset, dtype, vec![bytes / dtype.size()])?;
        let r = m.manager.save(Saved::Tensor(t))?;
        let c = HprtSavedRef {
            layer: r.layer.index(),
            index: r.index,
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_ref, "out_ref", c) }
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
        let r = SavedRef {
            layer: m.layer(saved.layer)?,
            index: saved.index,
        };
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
        let (e, p) = (m.manager.engine().stats(), m.manager.engine().pool_stats());
        let s = HprtSwapStats {
            offloaded_tensors: e.offloaded_tensors,
            offloaded_bytes: e.offloaded_bytes,
            reloaded_tensors: e.reloaded_tensors,
            reloaded_bytes: e.reloaded_bytes,
            pinned_bytes_held: p.bytes_held,
            pinned_high_water: p.high_water,
            pool_hits: p.hits,
            pool_misses: p.misses,
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_stats, "out_stats", s) }
    })
}
