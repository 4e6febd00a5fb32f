//! C entry points of sharded data parallelism (FSDP, HSDP, DDP): what a framework's
//! per-parameter hooks call on one rank. Every rank thread makes one `HprtHsdp` over its world
//! communicator, then its parameters in the same order as every other rank.

use std::ffi::{c_char, CStr};
use std::sync::Arc;

use hprt_hsdp::{
    DataParallelMesh, DeviceMesh, GradInput, GroupCache, HsdpStreams, MixedPrecisionPolicy,
    OffloadPolicy, ParamConfig, ParamSpec, ParamState, Placement, ReduceOptions, ShardRef,
    ShardedParam,
};
use hprt_platform::{DType, ReduceOp};

use super::handle::{handle_kind, Exclusive};
use super::platform::{
    dtype_arg, op_arg, HprtComm, HprtDeviceBuffer, HprtDtype, HprtPlatform, HprtStream,
};
use super::{arg, arg_mut, guard, opt_arg, out, publish, release, FfiError, FfiResult, HprtStatus};

/// The data-parallel layouts `hprt_hsdp_create` builds (passed as `int32_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HprtDpMode {
    /// 1-D mesh `{world}`: parameters sharded over every rank.
    Fsdp = 0,
    /// 2-D mesh `{replicas, shards}`: sharded within a replica, gradients all-reduced across
    /// replicas.
    Hsdp = 1,
    /// 1-D mesh `{world}`: parameters replicated, gradients all-reduced.
    Ddp = 2,
}

/// "Not set" for the optional fields of `HprtHsdpParamConfig`.
pub const HPRT_HSDP_UNSET: i32 = -1;

/// How to shard one parameter; pass null to `hprt_hsdp_param_create` for all defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HprtHsdpParamConfig {
    /// The tensor dim data parallelism shards along (`HPRT_HSDP_UNSET`: dim 0).
    pub shard_dim: i32,
    /// `HprtDtype` of the all-gather and unsharded parameter (`HPRT_HSDP_UNSET`: the
    /// parameter's dtype).
    pub param_dtype: i32,
    /// `HprtDtype` gradients are reduced in (`HPRT_HSDP_UNSET`: `param_dtype`).
    pub reduce_dtype: i32,
    /// Parameters with fewer elements stay replicated (gradients all-reduced).
    pub threshold: usize,
    /// Keep the shard and sharded gradient in pinned host memory between uses.
    pub offload_to_host: bool,
}

impl Default for HprtHsdpParamConfig {
    fn default() -> Self {
        HprtHsdpParamConfig {
            shard_dim: HPRT_HSDP_UNSET,
            param_dtype: HPRT_HSDP_UNSET,
            reduce_dtype: HPRT_HSDP_UNSET,
            threshold: 0,
            offload_to_host: false,
        }
    }
}

/// Where a sharded parameter is in its lifecycle (`HprtHsdpParamInfo::state`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HprtParamState {
    Sharded = 0,
    /// An all-gather was started and not yet waited for.
    Unsharding = 1,
    Unsharded = 2,
}

/// A parameter's sharding: which part of it this rank holds and in which dtypes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HprtHsdpParamInfo {
    pub state: HprtParamState,
    /// Whether data parallelism shards it (false for DDP and below the threshold).
    pub is_sharded: bool,
    pub numel: usize,
    pub shard_dim: usize,
    /// This rank's shard index and the number of shards.
    pub shard_index: usize,
    pub shard_count: usize,
    /// Rows of `shard_dim` per shard (the dim is padded to `shard_count * rows_per_shard`).
    pub rows_per_shard: usize,
    /// Elements of this rank's shard, padding included.
    pub shard_numel: usize,
    /// `HprtDtype`s: stored shard and sharded gradient, all-gather, gradient reduction.
    pub dtype: i32,
    pub param_dtype: i32,
    pub reduce_dtype: i32,
}

/// A context's layout and this rank's place in it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HprtHsdpInfo {
    pub mode: HprtDpMode,
    /// This rank in the world communicator, and its size.
    pub rank: usize,
    pub world_size: usize,
    /// Ranks along the replicate dim (1 for FSDP) and along the shard dim (1 for DDP).
    pub replicate_size: usize,
    pub shard_size: usize,
}

/// A shard or sharded gradient: `bytes` at `address`, in device memory or (`host`) pinned host
/// memory. Valid in compute-stream order; host memory is readable after synchronizing it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HprtShardView {
    pub address: usize,
    pub bytes: usize,
    pub host: bool,
}

/// One rank's data-parallel context: the mesh, the sub-communicators split from the world
/// communicator, and the all-gather and reduce streams beside the caller's compute stream.
pub struct HprtHsdp {
    /// Holds the platform; every parameter keeps its own handle to it.
    cache: GroupCache,
    mode: HprtDpMode,
    dp: DataParallelMesh,
    streams: HsdpStreams,
    /// Cloned into every parameter, which runs on `streams`: destroy refuses while any lives.
    params: Arc<()>,
}

/// One rank's sharded parameter.
pub struct HprtHsdpParam {
    param: ShardedParam,
    _context: Arc<()>,
}

fn c_dtype(d: DType) -> i32 {
    HprtDtype::from(d) as i32
}

fn optional_dtype(v: i32) -> FfiResult<Option<DType>> {
    if v == HPRT_HSDP_UNSET {
        Ok(None)
    } else {
        dtype_arg(v).map(Some)
    }
}

/// Most dims of a mesh `hprt_hsdp_create` reads (a larger `mesh_ndim` is refused unread).
pub const HPRT_HSDP_MAX_MESH_DIMS: usize = 8;
/// Most dims of a parameter shape `hprt_hsdp_param_create` reads.
pub const HPRT_HSDP_MAX_PARAM_DIMS: usize = 32;

/// A C array of dims, at most `max` long. The length cannot be checked against the array, so
/// the bound turns a garbage count into an error instead of a read far past the array.
///
/// # Safety
/// `p` null or valid for reads of `n` elements when `n <= max`.
unsafe fn shape_arg(p: *const usize, n: usize, max: usize, what: &str) -> FfiResult<Vec<usize>> {
    if p.is_null() {
        return Err(FfiError::null(what));
    }
    if n > max {
        return Err(FfiError::invalid(format!(
            "{what}: {n} dims, at most {max} are accepted"
        )));
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
}

handle_kind!(HprtHsdp, 20, "hsdp context");
handle_kind!(exclusive HprtHsdpParam, 21, "hsdp parameter");

/// Resolves a parameter argument (one call at a time).
fn param_mut<'a>(p: *const HprtHsdpParam) -> FfiResult<&'a mut HprtHsdpParam> {
    arg_mut(p, "param")
}

fn view(r: ShardRef<'_>, bytes: usize) -> HprtShardView {
    match r {
        ShardRef::Device(b) => HprtShardView {
            address: b.mem.device_ptr() + b.offset,
            bytes,
            host: false,
        },
        ShardRef::Pinned(h) => HprtShardView {
            // SAFETY: only the address is taken; the caller's accesses follow the view's
            // documented stream-order contract.
            address: unsafe { h.as_ptr() } as usize,
            bytes,
            host: true,
        },
    }
}

/// A data-parallel context for this rank of `world` (whose ranks the mesh names): `mode` is an
/// `HprtDpMode`, `mesh_shape` its `mesh_ndim` dims (`{world}` for FSDP and DDP,
/// `{replicas, shards}` for HSDP) covering every rank of `world`. Gathers and reductions are
/// ordered against `compute`, the stream the framework computes on. `world` and `compute` must
/// stay live until the context is destroyed.
///
/// # Safety
/// `mesh_shape` readable for `mesh_ndim` elements (the one thing hprt cannot check: a
/// `mesh_ndim` above `HPRT_HSDP_MAX_MESH_DIMS` is refused before the array is read, a mesh of
/// more than 2^20 ranks before anything is allocated); `out_hsdp` valid for writing. Handles are
/// checked (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_create(
    platform: *const HprtPlatform,
    world: *const HprtComm,
    mode: i32,
    mesh_shape: *const usize,
    mesh_ndim: usize,
    compute: *const HprtStream,
    out_hsdp: *mut *mut HprtHsdp,
) -> HprtStatus {
    guard("hprt_hsdp_create", || {
        // SAFETY: the caller's contract.
        let (p, c, s, shape) = unsafe {
            (
                arg(platform, "platform")?,
                arg(world, "world")?,
                arg(compute, "compute")?,
                shape_arg(mesh_shape, mesh_ndim, HPRT_HSDP_MAX_MESH_DIMS, "mesh_shape")?,
            )
        };
        if out_hsdp.is_null() {
            return Err(FfiError::null("out_hsdp"));
        }
        let mesh = DeviceMesh::contiguous(&shape)?;
        if mesh.size() != c.0.world() {
            return Err(FfiError::invalid(format!(
                "the mesh {shape:?} holds {} ranks, the world communicator {}",
                mesh.size(),
                c.0.world()
            )));
        }
        let mode = [HprtDpMode::Fsdp, HprtDpMode::Hsdp, HprtDpMode::Ddp]
            .into_iter()
            .find(|m| *m as i32 == mode)
            .ok_or_else(|| FfiError::invalid(format!("{mode} is not an HprtDpMode")))?;
        let dp = match mode {
            HprtDpMode::Fsdp => DataParallelMesh::fsdp(mesh)?,
            HprtDpMode::Hsdp => DataParallelMesh::hsdp(mesh)?,
            HprtDpMode::Ddp => DataParallelMesh::ddp(mesh)?,
        };
        let platform = p.handle();
        let h = HprtHsdp {
            streams: HsdpStreams::with_compute(&*platform, s.0.clone())?,
            cache: GroupCache::new(platform, c.0.clone()),
            mode,
            dp,
            params: Arc::new(()),
        };
        // SAFETY: the caller's contract.
        unsafe { publish(out_hsdp, "out_hsdp", || Ok(h)) }
    })
}

/// The context's mode, mesh sizes and this rank.
///
/// # Safety
/// `hsdp` live; `out_info` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_info(
    hsdp: *const HprtHsdp,
    out_info: *mut HprtHsdpInfo,
) -> HprtStatus {
    guard("hprt_hsdp_info", || {
        let h = arg(hsdp, "hsdp")?;
        let info = HprtHsdpInfo {
            mode: h.mode,
            rank: h.cache.rank(),
            world_size: h.cache.world_size(),
            replicate_size: h.dp.replicate_size(),
            shard_size: h.dp.shard_size(),
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_info, "out_info", info) }
    })
}

/// Releases the context and the streams it made (their queued work still completes).
/// `HPRT_STATUS_ERROR_WRONG_STATE` while any of its parameters is alive (the context stays
/// valid then).
///
/// # Safety
/// `hsdp` from `hprt_hsdp_create`; afterwards (unless this call failed) the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_destroy(hsdp: *mut HprtHsdp) -> HprtStatus {
    guard("hprt_hsdp_destroy", || {
        // SAFETY: the caller's contract.
        let live = Arc::strong_count(&arg(hsdp, "hsdp")?.params) - 1;
        if live > 0 {
            return Err(FfiError {
                status: HprtStatus::ErrorWrongState,
                message: format!("{live} parameters of this context are still alive"),
            });
        }
        let h = arg(hsdp, "hsdp")?;
        release(hsdp, "hsdp")?;
        let p = h.cache.platform();
        p.destroy_stream(&h.streams.all_gather)?;
        p.destroy_stream(&h.streams.reduce)?;
        Ok(())
    })
}

/// Shards a parameter: `full` (at `full_offset`) holds the whole `shape` (`ndim` dims) tensor of
/// `dtype`, identical on every rank and ready in compute-stream order; this rank keeps its
/// shard. `config` may be null (defaults). Collective: every rank of the world makes its
/// parameters in the same order. `full` may be reused once the compute stream passed this call.
///
/// # Safety
/// `name` NUL-terminated; `shape` readable for `ndim` elements (at most
/// `HPRT_HSDP_MAX_PARAM_DIMS`, a larger `ndim` is refused unread); `config` null or
/// readable; `out_param` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_create(
    hsdp: *const HprtHsdp,
    name: *const c_char,
    shape: *const usize,
    ndim: usize,
    dtype: i32,
    config: *const HprtHsdpParamConfig,
    full: *const HprtDeviceBuffer,
    full_offset: usize,
    out_param: *mut *mut HprtHsdpParam,
) -> HprtStatus {
    guard("hprt_hsdp_param_create", || {
        // SAFETY: the caller's contract.
        let (h, shape, full) = unsafe {
            (
                arg(hsdp, "hsdp")?,
                shape_arg(shape, ndim, HPRT_HSDP_MAX_PARAM_DIMS, "shape")?,
                arg(full, "full")?,
            )
        };
        if name.is_null() {
            return Err(FfiError::null("name"));
        }
        // SAFETY: non-null, NUL-terminated by the caller's contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| FfiError::invalid("name is not UTF-8"))?;
        if out_param.is_null() {
            return Err(FfiError::null("out_param"));
        }
        // SAFETY: null or readable by the caller's contract.
        let c = unsafe { config.as_ref() }.copied().unwrap_or_default();
        let shard = match c.shard_dim {
            HPRT_HSDP_UNSET => None,
            d => Some(Placement::Shard(usize::try_from(d).map_err(|_| {
                FfiError::invalid(format!("shard_dim {d} is negative"))
            })?)),
        };
        let cfg = ParamConfig {
            shard,
            mp: MixedPrecisionPolicy {
                param_dtype: optional_dtype(c.param_dtype)?,
                reduce_dtype: optional_dtype(c.reduce_dtype)?,
                output_dtype: None,
            },
            offload: if c.offload_to_host {
                OffloadPolicy::PinnedHost
            } else {
                OffloadPolicy::None
            },
            threshold: c.threshold,
        };
        let spec = ParamSpec::new(name, &shape, dtype_arg(dtype)?);
        let param = ShardedParam::new(
            &h.cache,
            &h.streams,
            &h.dp,
            spec,
            &cfg,
            full.0.at(full_offset),
        )?;
        let p = HprtHsdpParam {
            param,
            _context: Arc::clone(&h.params),
        };
        // SAFETY: the caller's contract.
        unsafe { publish(out_param, "out_param", || Ok(Exclusive::new(p))) }
    })
}

/// Releases a parameter: its shard, gradients and gathered storage (work already queued on
/// them still completes).
/// While another call uses it, the destroy is `HPRT_STATUS_ERROR_WRONG_STATE` and the handle
/// stays valid: destroy it again once that call returned.
///
/// # Safety
/// `param` from `hprt_hsdp_param_create`; afterwards the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_destroy(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_destroy", || {
        param_mut(param)?;
        release(param, "param")?;
        Ok(())
    })
}

/// Starts all-gathering the full parameter on the all-gather stream (after the compute
/// stream's queued work). With `async_op` the compute stream is ordered after it only by
/// `hprt_hsdp_param_wait_for_unshard` (prefetch); without, this call does that itself. A no-op
/// while unsharding or unsharded. Collective over the parameter's shard group.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_unshard(
    param: *mut HprtHsdpParam,
    async_op: bool,
) -> HprtStatus {
    guard("hprt_hsdp_param_unshard", || {
        param_mut(param)?.param.unshard(async_op)?;
        Ok(())
    })
}

/// Orders the compute stream after the pending all-gather (the host does not block). A no-op
/// when unsharded; `HPRT_STATUS_ERROR_WRONG_STATE` when no unshard was started.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_wait_for_unshard(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_wait_for_unshard", || {
        param_mut(param)?.param.wait_for_unshard()?;
        Ok(())
    })
}

/// The full parameter's device address and bytes (its shape, in the param dtype), valid in
/// compute-stream order until `hprt_hsdp_param_shard`. `HPRT_STATUS_ERROR_WRONG_STATE` unless
/// unsharded and waited for.
///
/// # Safety
/// `param` live; out-pointers valid for writing (either may be null).
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_unsharded(
    param: *const HprtHsdpParam,
    out_ptr: *mut usize,
    out_bytes: *mut usize,
) -> HprtStatus {
    guard("hprt_hsdp_param_unsharded", || {
        // SAFETY: the caller's contract.
        let w = &param_mut(param)?.param;
        let b = w.unsharded()?;
        if !out_ptr.is_null() {
            // SAFETY: non-null, valid by contract.
            unsafe { out_ptr.write(b.mem.device_ptr() + b.offset) };
        }
        if !out_bytes.is_null() {
            // SAFETY: as above.
            unsafe { out_bytes.write(w.geometry().numel() * w.param_dtype().size()) };
        }
        Ok(())
    })
}

/// Back to sharded: releases the gathered storage (after a pending unshard; work queued on it
/// still completes). A no-op when sharded.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_shard(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_shard", || {
        param_mut(param)?.param.shard()?;
        Ok(())
    })
}

/// hyper_parallel's `to_sharded`: `hprt_hsdp_param_shard`.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_to_sharded(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_to_sharded", || {
        param_mut(param)?.param.to_sharded()?;
        Ok(())
    })
}

/// hyper_parallel's `to_unsharded`: unsharded from any state (an all-gather is started if
/// none is pending), the compute stream ordered after it. Collective over the shard group.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_to_unsharded(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_to_unsharded", || {
        param_mut(param)?.param.to_unsharded()?;
        Ok(())
    })
}

/// hyper_parallel's `alloc_all_gather_outputs`: sizes the all-gather output to full capacity
/// (`hprt_hsdp_param_unshard` does this itself). `HPRT_STATUS_ERROR_WRONG_STATE` while an
/// all-gather is pending.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_alloc_all_gather_outputs(
    param: *mut HprtHsdpParam,
) -> HprtStatus {
    guard("hprt_hsdp_param_alloc_all_gather_outputs", || {
        param_mut(param)?.param.alloc_all_gather_outputs()?;
        Ok(())
    })
}

/// hyper_parallel's `free_unsharded_param`: releases the all-gather output; only while sharded
/// (`HPRT_STATUS_ERROR_WRONG_STATE` otherwise).
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_free_unsharded_param(
    param: *mut HprtHsdpParam,
) -> HprtStatus {
    guard("hprt_hsdp_param_free_unsharded_param", || {
        param_mut(param)?.param.free_unsharded_param()?;
        Ok(())
    })
}

/// Adds an unsharded gradient (the full parameter shape in `grad_dtype`, at `grad_offset`) to
/// the one accumulated for the next reduction, on the compute stream: micro-batches of a step
/// that reduces once.
///
/// # Safety
/// Handles live; `param` used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_accumulate_grad(
    param: *mut HprtHsdpParam,
    grad: *const HprtDeviceBuffer,
    grad_offset: usize,
    grad_dtype: i32,
) -> HprtStatus {
    guard("hprt_hsdp_param_accumulate_grad", || {
        let (w, g) = (param_mut(param)?, arg(grad, "grad")?);
        w.param.accumulate_grad(GradInput {
            buf: g.0.at(grad_offset),
            dtype: dtype_arg(grad_dtype)?,
        })?;
        Ok(())
    })
}

/// Reduces the gradient into this rank's sharded gradient: `grad` (may be null when one was
/// accumulated) plus the accumulated one is reduce-scattered over the shard group, all-reduced
/// across replicas, multiplied by `scale` (1.0 for none) and added to the sharded gradient.
/// `op` is `HPRT_REDUCE_OP_SUM` or `HPRT_REDUCE_OP_AVG` (the mean over every rank reduced
/// across). With `async_op` the work runs on the reduce stream and is applied (the compute
/// stream ordered after it) by `hprt_hsdp_param_wait_for_reduce`; `grad` must stay untouched
/// until then. Collective over the parameter's groups.
///
/// # Safety
/// Handles live or `grad` null; `param` used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_reduce_grad(
    param: *mut HprtHsdpParam,
    grad: *const HprtDeviceBuffer,
    grad_offset: usize,
    grad_dtype: i32,
    op: i32,
    scale: f64,
    async_op: bool,
) -> HprtStatus {
    guard("hprt_hsdp_param_reduce_grad", || {
        let w = param_mut(param)?;
        let (grad, opts) = reduce_args(grad, grad_offset, grad_dtype, op, scale)?;
        if async_op {
            w.param.reduce_grad_async(grad, opts)?;
        } else {
            w.param.reduce_grad(grad, opts)?;
        }
        Ok(())
    })
}

/// The gradient and options of the reduce entry points.
fn reduce_args<'a>(
    grad: *const HprtDeviceBuffer,
    grad_offset: usize,
    grad_dtype: i32,
    op: i32,
    scale: f64,
) -> FfiResult<(Option<GradInput<'a>>, ReduceOptions)> {
    let grad = match opt_arg(grad, "grad")? {
        None => None,
        Some(g) => Some(GradInput {
            buf: g.0.at(grad_offset),
            dtype: dtype_arg(grad_dtype)?,
        }),
    };
    let op = match op_arg(op) {
        Ok(o @ (ReduceOp::Sum | ReduceOp::Avg)) => o,
        _ => {
            return Err(FfiError::invalid(format!(
                "gradients reduce with HPRT_REDUCE_OP_SUM or _AVG, not {op}"
            )))
        }
    };
    if !scale.is_finite() {
        return Err(FfiError::invalid(format!("scale {scale} is not finite")));
    }
    let opts = ReduceOptions {
        op,
        scale: (scale != 1.0).then_some(scale),
    };
    Ok((grad, opts))
}

/// hyper_parallel's `reduce_scatter_grad`: the first half of `hprt_hsdp_param_reduce_grad`
/// (asynchronous): `grad` plus the accumulated gradient reduce-scattered over the shard group
/// on the reduce stream. `hprt_hsdp_param_all_reduce_grad` may follow (replicas);
/// `hprt_hsdp_param_wait_for_reduce` applies the result, scaled. `grad` must stay untouched
/// until then. Collective over the shard group.
///
/// # Safety
/// Handles live or `grad` null; `param` used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_reduce_scatter_grad(
    param: *mut HprtHsdpParam,
    grad: *const HprtDeviceBuffer,
    grad_offset: usize,
    grad_dtype: i32,
    op: i32,
    scale: f64,
) -> HprtStatus {
    guard("hprt_hsdp_param_reduce_scatter_grad", || {
        let w = param_mut(param)?;
        let (grad, opts) = reduce_args(grad, grad_offset, grad_dtype, op, scale)?;
        w.param.reduce_scatter_grad(grad, opts)?;
        Ok(())
    })
}

/// hyper_parallel's `all_reduce_grad`: all-reduces the reduce-scattered gradient across the
/// replicas (HSDP) on the reduce stream. A no-op without replicas or when done;
/// `HPRT_STATUS_ERROR_WRONG_STATE` before `hprt_hsdp_param_reduce_scatter_grad`. Collective
/// over the replica group.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_all_reduce_grad(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_all_reduce_grad", || {
        param_mut(param)?.param.all_reduce_grad()?;
        Ok(())
    })
}

/// Applies the pending asynchronous reduction into the sharded gradient, ordering the compute
/// stream after it (the host does not block). `HPRT_STATUS_ERROR_WRONG_STATE` when none is
/// pending.
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_wait_for_reduce(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_wait_for_reduce", || {
        param_mut(param)?.param.wait_for_reduce()?;
        Ok(())
    })
}

/// Forgets the sharded gradient: the next reduction starts a new one (an optimizer step's
/// `zero_grad`).
///
/// # Safety
/// `param` live, used by one thread at a time.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_clear_grad(param: *mut HprtHsdpParam) -> HprtStatus {
    guard("hprt_hsdp_param_clear_grad", || {
        param_mut(param)?.param.clear_grad()?;
        Ok(())
    })
}

/// This rank's shard (`shard_numel` elements of the parameter's dtype, padding included): what
/// an optimizer updates, in compute-stream order.
///
/// # Safety
/// `param` live; `out_view` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_sharded_data(
    param: *const HprtHsdpParam,
    out_view: *mut HprtShardView,
) -> HprtStatus {
    guard("hprt_hsdp_param_sharded_data", || {
        // SAFETY: the caller's contract.
        let w = &param_mut(param)?.param;
        let bytes = w.geometry().shard_numel() * w.dtype().size();
        // SAFETY: the caller's contract.
        unsafe { out(out_view, "out_view", view(w.sharded_data(), bytes)) }
    })
}

/// The sharded gradient (the shard's shape and dtype), in compute-stream order.
/// `HPRT_STATUS_ERROR_WRONG_STATE` before the first applied reduction or after
/// `hprt_hsdp_param_clear_grad`.
///
/// # Safety
/// `param` live; `out_view` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_sharded_grad(
    param: *const HprtHsdpParam,
    out_view: *mut HprtShardView,
) -> HprtStatus {
    guard("hprt_hsdp_param_sharded_grad", || {
        // SAFETY: the caller's contract.
        let w = &param_mut(param)?.param;
        let g = w.sharded_grad().ok_or_else(|| FfiError {
            status: HprtStatus::ErrorWrongState,
            message: format!("parameter {:?} has no sharded gradient", w.name()),
        })?;
        let bytes = w.geometry().shard_numel() * w.dtype().size();
        // SAFETY: the caller's contract.
        unsafe { out(out_view, "out_view", view(g, bytes)) }
    })
}

/// The parameter's state, shard geometry and dtypes.
///
/// # Safety
/// `param` live; `out_info` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_hsdp_param_info(
    param: *const HprtHsdpParam,
    out_info: *mut HprtHsdpParamInfo,
) -> HprtStatus {
    guard("hprt_hsdp_param_info", || {
        // SAFETY: the caller's contract.
        let w = &param_mut(param)?.param;
        let g = w.geometry();
        let state = match w.state() {
            ParamState::Sharded => HprtParamState::Sharded,
            ParamState::Unsharding => HprtParamState::Unsharding,
            ParamState::Unsharded => HprtParamState::Unsharded,
        };
        let info = HprtHsdpParamInfo {
            state,
            is_sharded: w.is_sharded_param(),
            numel: g.numel(),
            shard_dim: g.dim(),
            shard_index: g.index(),
            shard_count: g.group_size(),
            rows_per_shard: g.chunk(),
            shard_numel: g.shard_numel(),
            dtype: c_dtype(w.dtype()),
            param_dtype: c_dtype(w.param_dtype()),
            reduce_dtype: c_dtype(w.reduce_dtype()),
        };
        // SAFETY: the caller's contract.
        unsafe { out(out_info, "out_info", info) }
    })
}
