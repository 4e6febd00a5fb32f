//! C entry points of the keyed swap (`hprt_keyed_*`: `swap_out_cur_and_release_prev` /
//! `wait_cur_and_prefetch_next`) and of Megatron-LM's chunked pipeline offload
//! (`hprt_pipeline_*`: chunk handlers, `group_start` / `group_commit`, `set_last_layer`,
//! backward group marks, prefetch, the CUDA-graph stream marks, the summary), and hyper_parallel's `TensorKeyManager` (`hprt_tensor_key_manager_*`).
//! Both take hprt device storage; framework tensors as borrowed payloads go through the layer
//! groups' `hprt_swap_add_borrowed`.

use std::ffi::c_char;

use hprt_swap::{
    offload_summary_table, KeyedSwap, OffloadTag, Packed, PipelineConfig, PipelineOffload,
    PoolConfig, Saved, SwapContext, SwapEngine, TensorKey, TensorKeyManager,
};

use super::handle::{handle_kind, Exclusive};
use super::platform::{HprtDeviceBuffer, HprtPlatform, HprtStream};
use super::swap::{compression, name_arg, stats_of, view, write_text, HprtSwapStats};
use super::{arg, arg_mut, guard, out, publish, release, FfiError, FfiResult, HprtStatus};

/// Keyed swap: layers registered per module tag, tensors packed and unpacked by key.
pub struct HprtKeyedSwap {
    swap: KeyedSwap,
    /// Registered layers: C names one by this index.
    layers: Vec<SwapContext>,
}

/// What `hprt_keyed_swap_out_cur_and_release_prev` returned: `swapped` = 0 when the tensor
/// stayed on the device (not eligible, or its tag's last layer keeps it: read it directly).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtTensorKey {
    pub swapped: i32,
    pub layer: usize,
    pub index: usize,
}

/// Megatron-LM's pipeline offload.
pub struct HprtPipelineOffload {
    offload: PipelineOffload,
    /// Tags handed out this iteration: C names one by this index.
    tags: Vec<OffloadTag>,
}

/// hyper_parallel's `TensorKeyManager`: (layer, index) keys in save order.
pub struct HprtTensorKeyManager(TensorKeyManager);

handle_kind!(exclusive HprtKeyedSwap, 11, "keyed swap");
handle_kind!(exclusive HprtPipelineOffload, 12, "pipeline offload");
handle_kind!(exclusive HprtTensorKeyManager, 13, "tensor key manager");

fn pool(host_budget: usize) -> PoolConfig {
    PoolConfig {
        host_budget: (host_budget > 0).then_some(host_budget),
    }
}

/// # Safety
/// `out_stats` valid for writing.
unsafe fn write_stats(engine: &SwapEngine, out_stats: *mut HprtSwapStats) -> FfiResult {
    // SAFETY: the caller's contract.
    unsafe { out(out_stats, "out_stats", stats_of(engine)) }
}

/// A keyed swap on `platform`: tensors below `min_bytes` stay on the device; `host_budget`
/// bounds the pinned pool (0 = unbounded).
///
/// # Safety
/// `platform` live; `out_swap` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_create(
    platform: *const HprtPlatform,
    host_budget: usize,
    min_bytes: usize,
    out_swap: *mut *mut HprtKeyedSwap,
) -> HprtStatus {
    guard("hprt_keyed_create", || {
        let p = arg(platform, "platform")?;
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_swap, "out_swap", || {
                let mut swap = KeyedSwap::with_pool(p.handle(), pool(host_budget))?;
                swap.set_min_bytes(min_bytes);
                Ok(Exclusive::new(HprtKeyedSwap {
                    swap,
                    layers: Vec::new(),
                }))
            })
        }
    })
}

/// Synchronizes the copies and releases the swap (values not unpacked are dropped).
/// While another call uses it, the destroy is `HPRT_STATUS_ERROR_WRONG_STATE` and the handle
/// stays valid: destroy it again once that call returned.
///
/// # Safety
/// `swap` from `hprt_keyed_create`; afterwards the handle is invalid.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_destroy(swap: *mut HprtKeyedSwap) -> HprtStatus {
    guard("hprt_keyed_destroy", || {
        let k = arg_mut(swap, "swap")?;
        release(swap, "swap")?;
        k.swap.end_iteration()?;
        Ok(())
    })
}

/// Registers the next layer under `module_tag` (`*` matches one path component); `*out_layer`
/// names it in the other calls.
///
/// # Safety
/// `swap` live; `module_tag` NUL-terminated; `out_layer` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_register_layer(
    swap: *mut HprtKeyedSwap,
    module_tag: *const c_char,
    out_layer: *mut usize,
) -> HprtStatus {
    guard("hprt_keyed_register_layer", || {
        let k = arg_mut(swap, "swap")?;
        // SAFETY: the caller's contract.
        let tag = unsafe { name_arg(module_tag) }?;
        let ctx = k.swap.register_layer(tag);
        k.layers.push(ctx);
        // SAFETY: the caller's contract.
        unsafe { out(out_layer, "out_layer", k.layers.len() - 1) }
    })
}

/// The pack hook: saves `bytes` of `storage` from `offset` in `layer` (its producer queued on
/// `compute`); a new layer first releases the previous one's device bytes.
///
/// # Safety
/// `swap`, `storage`, `compute` live; `out_key` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_swap_out_cur_and_release_prev(
    swap: *mut HprtKeyedSwap,
    layer: usize,
    storage: *const HprtDeviceBuffer,
    offset: usize,
    bytes: usize,
    dtype: i32,
    compute: *const HprtStream,
    out_key: *mut HprtTensorKey,
) -> HprtStatus {
    guard("hprt_keyed_swap_out_cur_and_release_prev", || {
        let (k, s, c) = (
            arg_mut(swap, "swap")?,
            arg(storage, "storage")?,
            arg(compute, "compute")?,
        );
        let ctx = k
            .layers
            .get(layer)
            .ok_or_else(|| FfiError::invalid(format!("layer {layer} was not registered")))?
            .clone();
        let t = Saved::Tensor(view(k.swap.engine(), &s.0, offset, bytes, dtype)?);
        let key = match k.swap.swap_out_cur_and_release_prev(&ctx, t, &c.0)? {
            Packed::Kept(_) => HprtTensorKey::default(),
            Packed::Swapped(key) => HprtTensorKey {
                swapped: 1,
                layer: key.layer.index(),
                index: key.index,
            },
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_key, "out_key", key) }
    })
}

/// The unpack hook: waits for the tensor's reload (`compute` waits for it), then (with
/// `prefetch`) starts its share of the previous layer; `*out_ptr` is its device address.
///
/// # Safety
/// `swap`, `compute` live; `out_ptr` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_wait_cur_and_prefetch_next(
    swap: *mut HprtKeyedSwap,
    key: HprtTensorKey,
    compute: *const HprtStream,
    prefetch: bool,
    out_ptr: *mut usize,
) -> HprtStatus {
    guard("hprt_keyed_wait_cur_and_prefetch_next", || {
        let (k, c) = (arg_mut(swap, "swap")?, arg(compute, "compute")?);
        if key.swapped == 0 {
            return Err(FfiError::invalid(
                "the key is of a tensor that was not swapped",
            ));
        }
        let packed = Packed::Swapped(TensorKey::new(key.layer, key.index));
        let v = k.swap.wait_cur_and_prefetch_next(packed, &c.0, prefetch)?;
        let ptr = v
            .tensor()
            .map(|t| t.storage.device_ptr() + t.offset)
            .ok_or_else(|| FfiError::invalid("the saved value is not a tensor"))?;
        // SAFETY: the caller's contract.
        unsafe { out(out_ptr, "out_ptr", ptr) }
    })
}

/// Compress-then-swap for the tensors packed from now on. `mode` is an `HprtCompression`
/// (another value is `HPRT_STATUS_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `swap` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_set_compression(
    swap: *mut HprtKeyedSwap,
    mode: i32,
) -> HprtStatus {
    guard("hprt_keyed_set_compression", || {
        let mode = compression(mode)?;
        let k = arg_mut(swap, "swap")?;
        k.swap.engine_mut().set_compression(mode);
        Ok(())
    })
}

/// Ends the iteration: waits for the copies and drops what was not unpacked.
///
/// # Safety
/// `swap` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_end_iteration(swap: *mut HprtKeyedSwap) -> HprtStatus {
    guard("hprt_keyed_end_iteration", || {
        arg_mut(swap, "swap")?.swap.end_iteration()?;
        Ok(())
    })
}

/// # Safety
/// `swap` live; `out_stats` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_keyed_stats(
    swap: *mut HprtKeyedSwap,
    out_stats: *mut HprtSwapStats,
) -> HprtStatus {
    guard("hprt_keyed_stats", || {
        let k = arg_mut(swap, "swap")?;
        // SAFETY: the caller's contract.
        unsafe { write_stats(k.swap.engine(), out_stats) }
    })
}

/// Megatron-LM's pipeline offload on `platform`: tensors under `min_tensor_elems` elements stay
/// on the device, at most `max_inflight_offloads` groups are in flight, and after warm-up the
/// last `keep_last_groups` groups of each chunk stay on the device. `mode` is an
/// `HprtCompression` (another value is `HPRT_STATUS_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `platform` live; `out_offload` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_create(
    platform: *const HprtPlatform,
    min_tensor_elems: usize,
    max_inflight_offloads: usize,
    keep_last_groups: usize,
    host_budget: usize,
    mode: i32,
    out_offload: *mut *mut HprtPipelineOffload,
) -> HprtStatus {
    guard("hprt_pipeline_create", || {
        let p = arg(platform, "platform")?;
        let mode = compression(mode)?;
        let cfg = PipelineConfig {
            min_tensor_elems,
            max_inflight_offloads,
            keep_last_groups,
            pool: pool(host_budget),
            compression: mode,
            ..PipelineConfig::default()
        };
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_offload, "out_offload", || {
                Ok(Exclusive::new(HprtPipelineOffload {
                    offload: PipelineOffload::new(p.handle(), cfg)?,
                    tags: Vec::new(),
                }))
            })
        }
    })
}

/// Synchronizes the copies and releases the offload manager.
/// While another call uses it, the destroy is `HPRT_STATUS_ERROR_WRONG_STATE` and the handle
/// stays valid: destroy it again once that call returned.
///
/// # Safety
/// `offload` from `hprt_pipeline_create`; afterwards the handle is invalid.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_destroy(offload: *mut HprtPipelineOffload) -> HprtStatus {
    guard("hprt_pipeline_destroy", || {
        let o = arg_mut(offload, "offload")?;
        release(offload, "offload")?;
        o.offload.reset()?;
        Ok(())
    })
}

/// A micro-batch's forward through virtual-pipeline stage `vp_stage` of `vp_size` begins
/// (Megatron's `init_chunk_handler`).
///
/// # Safety
/// `offload` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_init_chunk(
    offload: *mut HprtPipelineOffload,
    vp_size: usize,
    vp_stage: usize,
) -> HprtStatus {
    guard("hprt_pipeline_init_chunk", || {
        let o = arg_mut(offload, "offload")?;
        o.offload.init_chunk(vp_size, Some(vp_stage))?;
        Ok(())
    })
}

/// Megatron-LM's `set_last_layer`: whether the current chunk's forward is in its last layer
/// (groups committed there stay on the device while this chunk's backward is the next to run).
///
/// # Safety
/// `offload` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_set_last_layer(
    offload: *mut HprtPipelineOffload,
    is_last_layer: bool,
) -> HprtStatus {
    guard("hprt_pipeline_set_last_layer", || {
        arg_mut(offload, "offload")?
            .offload
            .set_last_layer(is_last_layer)?;
        Ok(())
    })
}

/// `group_start(name)`: a layer group's forward begins in the current chunk.
///
/// # Safety
/// `offload` live; `name` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_group_start(
    offload: *mut HprtPipelineOffload,
    name: *const c_char,
) -> HprtStatus {
    guard("hprt_pipeline_group_start", || {
        let o = arg_mut(offload, "offload")?;
        // SAFETY: the caller's contract.
        let name = unsafe { name_arg(name) }?;
        o.offload.group_start(name)?;
        Ok(())
    })
}

/// Saves `bytes` of `storage` from `offset` in the open group; `*out_tag` names it for
/// `hprt_pipeline_get` (`*out_offloaded` = 0: it stays on the device).
///
/// # Safety
/// `offload`, `storage` live; `out_tag`, `out_offloaded` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_save(
    offload: *mut HprtPipelineOffload,
    storage: *const HprtDeviceBuffer,
    offset: usize,
    bytes: usize,
    dtype: i32,
    out_tag: *mut usize,
    out_offloaded: *mut i32,
) -> HprtStatus {
    guard("hprt_pipeline_save", || {
        let (o, s) = (arg_mut(offload, "offload")?, arg(storage, "storage")?);
        let tag = o.offload.save(Saved::Tensor(view(
            o.offload.engine(),
            &s.0,
            offset,
            bytes,
            dtype,
        )?))?;
        let offloaded = i32::from(matches!(tag, OffloadTag::Offloaded { .. }));
        o.tags.push(tag);
        // SAFETY: the caller's contract.
        unsafe {
            out(out_tag, "out_tag", o.tags.len() - 1)?;
            out(out_offloaded, "out_offloaded", offloaded)
        }
    })
}

/// `group_commit`: the open group's forward was queued on `compute`; its offload is launched
/// (or, with `delay`, at `hprt_pipeline_flush_delayed_groups`). The `n_forced` storages of
/// `forced_release` (Megatron's forced released tensors: buffers the group's tensors were
/// computed from) are released once the group's offload completed.
///
/// # Safety
/// `offload`, `compute` live; `forced_release` valid for `n_forced` live storages (may be null
/// when `n_forced` is 0).
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_group_commit(
    offload: *mut HprtPipelineOffload,
    compute: *const HprtStream,
    forced_release: *const *const HprtDeviceBuffer,
    n_forced: usize,
    delay: bool,
) -> HprtStatus {
    guard("hprt_pipeline_group_commit", || {
        let (o, c) = (arg_mut(offload, "offload")?, arg(compute, "compute")?);
        let forced = if n_forced == 0 {
            Vec::new()
        } else {
            if forced_release.is_null() {
                return Err(FfiError::null("forced_release"));
            }
            // SAFETY: `forced_release` holds `n_forced` pointers by contract.
            let storages = unsafe { std::slice::from_raw_parts(forced_release, n_forced) };
            storages
                .iter()
                .map(|&b| Ok(arg(b, "forced_release[i]")?.0.clone()))
                .collect::<FfiResult<Vec<_>>>()?
        };
        o.offload.group_commit(&c.0, forced, delay)?;
        Ok(())
    })
}

/// Launches every delayed group's offload.
///
/// # Safety
/// `offload`, `compute` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_flush_delayed_groups(
    offload: *mut HprtPipelineOffload,
    compute: *const HprtStream,
) -> HprtStatus {
    guard("hprt_pipeline_flush_delayed_groups", || {
        let (o, c) = (arg_mut(offload, "offload")?, arg(compute, "compute")?);
        o.offload.flush_delayed_groups(&c.0)?;
        Ok(())
    })
}

/// Group `name`'s backward is about to run on `compute` (the commit mark's backward).
///
/// # Safety
/// `offload`, `compute` live; `name` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_backward_group_begin(
    offload: *mut HprtPipelineOffload,
    name: *const c_char,
    compute: *const HprtStream,
) -> HprtStatus {
    guard("hprt_pipeline_backward_group_begin", || {
        let (o, c) = (arg_mut(offload, "offload")?, arg(compute, "compute")?);
        // SAFETY: the caller's contract.
        let name = unsafe { name_arg(name) }?;
        o.offload.backward_group_begin(name, &c.0)?;
        Ok(())
    })
}

/// Starts reloading `tag`'s group ahead of its backward (a framework's own prefetch);
/// `*out_started` is the number of its tensors whose reload this started.
///
/// # Safety
/// `offload` live; `out_started` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_prefetch(
    offload: *mut HprtPipelineOffload,
    tag: usize,
    out_started: *mut usize,
) -> HprtStatus {
    guard("hprt_pipeline_prefetch", || {
        let o = arg_mut(offload, "offload")?;
        let tag = o
            .tags
            .get(tag)
            .ok_or_else(|| FfiError::invalid(format!("tag {tag} was not handed out")))?;
        let n = o.offload.prefetch(tag)?;
        // SAFETY: the caller's contract.
        unsafe { out(out_started, "out_started", n) }
    })
}

/// A stream mark of Megatron-LM's CUDA-graph path (events only, no host wait).
unsafe fn stream_mark(
    name: &'static str,
    offload: *mut HprtPipelineOffload,
    compute: *const HprtStream,
    mark: fn(&PipelineOffload, &hprt_platform::Stream) -> hprt_swap::Result<()>,
) -> HprtStatus {
    guard(name, || {
        let (o, c) = (arg_mut(offload, "offload")?, arg(compute, "compute")?);
        mark(&o.offload, &c.0)?;
        Ok(())
    })
}

/// Offloads queued from now on wait for the work queued on `compute` so far.
///
/// # Safety
/// `offload`, `compute` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_record_forward(
    offload: *mut HprtPipelineOffload,
    compute: *const HprtStream,
) -> HprtStatus {
    // SAFETY: the caller's contract.
    unsafe {
        stream_mark(
            "hprt_pipeline_record_forward",
            offload,
            compute,
            PipelineOffload::record_forward,
        )
    }
}

/// Megatron-LM's `forward_record`: offloads queued from now on wait for `compute`'s work so
/// far, and work queued on `compute` from now on waits for every offload queued so far.
///
/// # Safety
/// `offload`, `compute` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_join_offloads(
    offload: *mut HprtPipelineOffload,
    compute: *const HprtStream,
) -> HprtStatus {
    // SAFETY: the caller's contract.
    unsafe {
        stream_mark(
            "hprt_pipeline_join_offloads",
            offload,
            compute,
            PipelineOffload::join_offloads,
        )
    }
}

/// Megatron-LM's `backward_record`: work queued on `compute` from now on waits for every reload
/// queued so far.
///
/// # Safety
/// `offload`, `compute` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_record_backward(
    offload: *mut HprtPipelineOffload,
    compute: *const HprtStream,
) -> HprtStatus {
    // SAFETY: the caller's contract.
    unsafe {
        stream_mark(
            "hprt_pipeline_record_backward",
            offload,
            compute,
            PipelineOffload::record_backward,
        )
    }
}

/// A saved tensor's device address for backward work queued on `compute`.
///
/// # Safety
/// `offload`, `compute` live; `out_ptr` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_get(
    offload: *mut HprtPipelineOffload,
    tag: usize,
    compute: *const HprtStream,
    out_ptr: *mut usize,
) -> HprtStatus {
    guard("hprt_pipeline_get", || {
        let (o, c) = (arg_mut(offload, "offload")?, arg(compute, "compute")?);
        let tag = o
            .tags
            .get(tag)
            .ok_or_else(|| FfiError::invalid(format!("tag {tag} was not handed out")))?;
        let v = o.offload.get(tag, &c.0)?;
        let ptr = v
            .tensor()
            .map(|t| t.storage.device_ptr() + t.offset)
            .ok_or_else(|| FfiError::invalid("the saved value is not a tensor"))?;
        // SAFETY: the caller's contract.
        unsafe { out(out_ptr, "out_ptr", ptr) }
    })
}

/// The current backward group finished (the start mark's backward): the next group reloads.
///
/// # Safety
/// `offload` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_backward_group_end(
    offload: *mut HprtPipelineOffload,
) -> HprtStatus {
    guard("hprt_pipeline_backward_group_end", || {
        arg_mut(offload, "offload")?.offload.backward_group_end()?;
        Ok(())
    })
}

/// Ends the iteration (Megatron's `reset`); after the first, call `hprt_pipeline_post_warmup`.
///
/// # Safety
/// `offload` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_reset(offload: *mut HprtPipelineOffload) -> HprtStatus {
    guard("hprt_pipeline_reset", || {
        let o = arg_mut(offload, "offload")?;
        o.offload.reset()?;
        o.tags.clear();
        Ok(())
    })
}

/// Ends the warm-up: the keep-last margin applies and iterations feed the summary.
///
/// # Safety
/// `offload` live.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_post_warmup(
    offload: *mut HprtPipelineOffload,
) -> HprtStatus {
    guard("hprt_pipeline_post_warmup", || {
        arg_mut(offload, "offload")?.offload.post_warmup();
        Ok(())
    })
}

/// # Safety
/// `offload` live; `out_stats` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_stats(
    offload: *mut HprtPipelineOffload,
    out_stats: *mut HprtSwapStats,
) -> HprtStatus {
    guard("hprt_pipeline_stats", || {
        let o = arg_mut(offload, "offload")?;
        // SAFETY: the caller's contract.
        unsafe { write_stats(o.offload.engine(), out_stats) }
    })
}

/// Megatron's offload summary: a table of the bytes offloaded per group in the last iteration
/// after warm-up (this process's row), written to `out_text` with a NUL; `*out_len` is its
/// length (set also when `capacity` is too small, to size the buffer).
///
/// # Safety
/// `offload` live; `out_text` valid for `capacity` bytes; `out_len` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_pipeline_summary_table(
    offload: *mut HprtPipelineOffload,
    out_text: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> HprtStatus {
    guard("hprt_pipeline_summary_table", || {
        let o = arg_mut(offload, "offload")?;
        let table = offload_summary_table(std::slice::from_ref(o.offload.offload_summary_bytes()));
        // SAFETY: the caller's contract.
        unsafe { write_text(&table, "the summary table", out_text, capacity, out_len) }
    })
}

/// hyper_parallel's `TensorKeyManager`.
///
/// # Safety
/// `out_manager` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_tensor_key_manager_create(
    out_manager: *mut *mut HprtTensorKeyManager,
) -> HprtStatus {
    guard("hprt_tensor_key_manager_create", || {
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_manager, "out_manager", || {
                Ok(Exclusive::new(
                    HprtTensorKeyManager(TensorKeyManager::new()),
                ))
            })
        }
    })
}

/// Releases the key manager.
/// While another call uses it, the destroy is `HPRT_STATUS_ERROR_WRONG_STATE` and the handle
/// stays valid: destroy it again once that call returned.
///
/// # Safety
/// `manager` from `hprt_tensor_key_manager_create`; afterwards the handle is invalid.
#[no_mangle]
pub unsafe extern "C" fn hprt_tensor_key_manager_destroy(
    manager: *mut HprtTensorKeyManager,
) -> HprtStatus {
    guard("hprt_tensor_key_manager_destroy", || {
        release(manager, "manager")?;
        Ok(())
    })
}

/// `get_key(layer)`: the key `(layer, *out_index)` of the next tensor `layer` saves, and
/// whether it starts a new layer after layer `layer - 1` (`*out_previous_done`: that layer's
/// device copies may be released). A layer below the current one starts a new step.
///
/// # Safety
/// `manager` live; out-pointers valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_tensor_key_manager_get_key(
    manager: *mut HprtTensorKeyManager,
    layer: usize,
    out_index: *mut usize,
    out_previous_done: *mut bool,
) -> HprtStatus {
    guard("hprt_tensor_key_manager_get_key", || {
        let m = arg_mut(manager, "manager")?;
        if out_index.is_null() || out_previous_done.is_null() {
            return Err(FfiError::null("out_index / out_previous_done"));
        }
        let (key, previous_done) = m.0.get_key(layer);
        // SAFETY: the caller's contract.
        unsafe {
            out(out_index, "out_index", key.index)?;
            out(out_previous_done, "out_previous_done", previous_done)
        }
    })
}

/// `get_prefetch_keys((layer, index))`: the keys of layer `layer - 1` that tensor
/// `(layer, index)` prefetches are `(layer - 1, i)` for `i` in `[*out_first, *out_end)` (its
/// proportional share; empty for layer 0).
///
/// # Safety
/// `manager` live; out-pointers valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_tensor_key_manager_get_prefetch_keys(
    manager: *mut HprtTensorKeyManager,
    layer: usize,
    index: usize,
    out_first: *mut usize,
    out_end: *mut usize,
) -> HprtStatus {
    guard("hprt_tensor_key_manager_get_prefetch_keys", || {
        let m = arg_mut(manager, "manager")?;
        if out_first.is_null() || out_end.is_null() {
            return Err(FfiError::null("out_first / out_end"));
        }
        let keys = m.0.get_prefetch_keys(TensorKey::new(layer, index));
        let first = keys.first().map_or(0, |k| k.index);
        // SAFETY: the caller's contract.
        unsafe {
            out(out_first, "out_first", first)?;
            out(out_end, "out_end", first + keys.len())
        }
    })
}
