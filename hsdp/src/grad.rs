//! Gradients of sharded parameters: accumulation of unsharded gradients across micro-batches
//! (in the reduce dtype), reduce-scatter over the sharded group, all-reduce over the unsharded
//! group (HSDP's replicate dim, DDP, replicated parameters), optional scaling, and accumulation
//! into the sharded gradient (in the parameter's dtype) — asynchronously, with an ordered queue.

use std::collections::VecDeque;

use hprt_platform::{DType, DeviceBuffer, Kernel, PinnedBuffer, Place, ReduceOp, TensorRef};

use crate::error::{HsdpError, Result};
use crate::grad_state::{PendingReduce, ReducedInto};
use crate::param::{ParamState, ShardedParam};
use crate::policy::OffloadPolicy;
use crate::storage::{ShardRef, Storage};

/// An unsharded gradient as backward produced it: the full local parameter shape in `dtype`.
///
/// Not a [`TensorRef`] itself: a gradient is lent for one call (`Copy`, borrowing the buffer),
/// and its shape is the parameter's, so callers that have no shape to give (the C ABI passes a
/// buffer, an offset and a dtype) need not invent one. A `TensorRef` lends itself as one
/// (`GradInput::from(&t)`: its place and dtype).
#[derive(Clone, Copy, Debug)]
pub struct GradInput<'a> {
    pub buf: Place<&'a DeviceBuffer>,
    pub dtype: DType,
}

impl<'a> From<&'a TensorRef> for GradInput<'a> {
    fn from(t: &'a TensorRef) -> Self {
        GradInput {
            buf: t.place(),
            dtype: t.dtype,
        }
    }
}

/// How gradients are reduced across ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReduceOptions {
    /// `Sum`, or `Avg` (the mean over every rank the gradient is reduced across).
    pub op: ReduceOp,
    /// Multiplies the reduced shard (e.g. `1 / loss_scale`, or `1 / micro_batches`).
    pub scale: Option<f64>,
}

impl Default for ReduceOptions {
    fn default() -> Self {
        ReduceOptions {
            op: ReduceOp::Avg,
            scale: None,
        }
    }
}

fn check_reduce_op(op: ReduceOp) -> Result<()> {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => Ok(()),
        other => Err(HsdpError::Unsupported(format!(
            "gradient reduction with {other}: only sum and avg are defined for gradients"
        ))),
    }
}

impl ShardedParam {
    fn check_grad(&self, grad: &GradInput<'_>) -> Result<()> {
        if !grad.dtype.is_float() {
            return Err(HsdpError::UnsupportedDType {
                operation: "gradient",
                dtype: grad.dtype,
                why: "gradients are floating point",
            });
        }
        let n = self.geom.numel();
        let end = grad.buf.offset + n * grad.dtype.size();
        if end > grad.buf.mem.len() {
            return Err(HsdpError::InvalidParam {
                param: self.name.clone(),
                message: format!(
                    "the gradient buffer holds {} bytes, {end} are needed",
                    grad.buf.mem.len()
                ),
            });
        }
        Ok(())
    }

    /// Elements of the unsharded accumulation buffer: the padded gathered layout when the
    /// parameter gathers in place (so it can be reduce-scattered directly), else the parameter.
    fn accumulation_numel(&self) -> usize {
        if self.geom.gathers_in_place() {
            self.geom.padded_numel()
        } else {
            self.geom.numel()
        }
    }

    /// Adds an unsharded gradient into the accumulated one (converted to the reduce dtype), on
    /// the compute stream: the micro-batches of a step that reduces only once.
    pub fn accumulate_grad(&mut self, grad: GradInput<'_>) -> Result<()> {
        self.check_grad(&grad)?;
        if self.grad.pending.is_some() {
            return Err(self.state_error("accumulate a gradient while its reduction is pending"));
        }
        let p = self.platform.clone();
        let cs = &self.streams.compute;
        let (n, rdt) = (self.geom.numel(), self.reduce_dtype);
        let acc = &self.grad.unsharded;
        if self.grad.has_unsharded {
            return self.kernel(
                Kernel::Axpy {
                    src: grad.buf,
                    src_dtype: grad.dtype,
                    dst: acc.into(),
                    dst_dtype: rdt,
                    count: n,
                    alpha: 1.0,
                },
                cs,
            );
        }
        let total = self.accumulation_numel();
        p.resize_device(acc, total * rdt.size())?;
        if total > n {
            p.memset_async(acc, n * rdt.size(), 0, (total - n) * rdt.size(), cs)?;
        }
        self.kernel(
            Kernel::Cast {
                src: grad.buf,
                src_dtype: grad.dtype,
                dst: acc.into(),
                dst_dtype: rdt,
                count: n,
            },
            cs,
        )?;
        self.grad.has_unsharded = true;
        Ok(())
    }

    /// Whether a reduction was issued and not yet applied.
    pub fn reduce_pending(&self) -> bool {
        self.grad.pending.is_some()
    }

    /// Starts reducing the gradient on the reduce stream: `grad` (if given) plus whatever was
    /// accumulated is reduce-scattered over the sharded group, all-reduced over the unsharded
    /// group, and scaled. Apply it with [`ShardedParam::wait_for_reduce`].
    ///
    /// `grad` must stay untouched until then: when no staging is needed (same dtype, nothing
    /// accumulated, no padding or re-layout) the collectives read it, and for a parameter that
    /// is not sharded they reduce it in place.
    pub fn reduce_grad_async(
        &mut self,
        grad: Option<GradInput<'_>>,
        opts: ReduceOptions,
    ) -> Result<()> {
        self.reduce_scatter_grad(grad, opts)?;
        self.all_reduce_grad()
    }

    /// The first half of [`ShardedParam::reduce_grad_async`] (hyper_parallel's
    /// `reduce_scatter_grad`): reduce-scatter over the sharded group (after any `Partial`
    /// all-reduces), on the reduce stream. [`ShardedParam::all_reduce_grad`] may follow (HSDP's
    /// replicas); [`ShardedParam::wait_for_reduce`] applies the result either way, scaled.
    pub fn reduce_scatter_grad(
        &mut self,
        grad: Option<GradInput<'_>>,
        opts: ReduceOptions,
    ) -> Result<()> {
        check_reduce_op(opts.op)?;
        if let Some(g) = &grad {
            self.check_grad(g)?;
        }
        if self.grad.pending.is_some() {
            return Err(self.state_error("reduce a gradient while another reduction is pending"));
        }
        if let (Some(g), true) = (grad, self.grad.has_unsharded) {
            self.accumulate_grad(g)?;
        }
        let p = self.platform.clone();
        let rs = &self.streams.reduce.clone();
        self.order_after(&self.grad.ready, &self.streams.compute, rs)?;
        let (rdt, rsz) = (self.reduce_dtype, self.reduce_dtype.size());
        let geom = self.geom.clone();
        let (shard_numel, padded) = (geom.shard_numel(), geom.padded_numel());
        let mut staging = Vec::new();

        // The send buffer in the gathered layout (shard k at k * shard_numel), padding zeroed.
        let direct = grad.filter(|g| {
            !self.grad.has_unsharded
                && g.dtype == rdt
                && geom.gathers_in_place()
                && padded == geom.numel()
        });
        let (send_buf, send_off) = if self.grad.has_unsharded && geom.gathers_in_place() {
            (self.grad.unsharded.clone(), 0)
        } else if let Some(g) = direct {
            (g.buf.mem.clone(), g.buf.offset)
        } else {
            let (src, src_dtype) = if self.grad.has_unsharded {
                ((&self.grad.unsharded).into(), rdt)
            } else if let Some(g) = grad {
                (g.buf, g.dtype)
            } else {
                return Err(
                    self.state_error("reduce a gradient when none was given or accumulated")
                );
            };
            let stage = p.alloc_device(padded * rsz)?;
            if padded > geom.numel() {
                p.memset_async(&stage, 0, 0, padded * rsz, rs)?;
            }
            for k in 0..geom.group_size() {
                for run in geom.runs(k) {
                    self.kernel(
                        Kernel::Cast {
                            src: Place {
                                mem: src.mem,
                                offset: src.offset + run.full * src_dtype.size(),
                            },
                            src_dtype,
                            dst: stage.at((k * shard_numel + run.shard) * rsz),
                            dst_dtype: rdt,
                            count: run.len,
                        },
                        rs,
                    )?;
                }
            }
            staging.push(stage.clone());
            (stage, 0)
        };
        let send = send_buf.at(send_off);

        for (group, op) in &self.groups.partial {
            if let Some(comm) = group.communicator() {
                p.all_reduce(send, send, padded, rdt, *op, comm, rs)?;
            }
        }

        let out = match self.groups.sharded.communicator() {
            None => ReducedInto::Buffer(send_buf.clone(), send_off),
            Some(comm) => {
                let comm = &comm.clone();
                let into_grad = !self.grad.has_sharded
                    && rdt == self.dtype
                    && self.offload == OffloadPolicy::None;
                let (out, target) = if into_grad {
                    let g = self.sharded_grad_device()?;
                    (ReducedInto::ShardedGrad, g)
                } else {
                    let b = p.alloc_device(shard_numel * rsz)?;
                    (ReducedInto::Buffer(b.clone(), 0), b)
                };
                p.reduce_scatter(send, (&target).into(), shard_numel, rdt, opts.op, comm, rs)?;
                out
            }
        };
        let done = p.create_event(false)?;
        p.record_event(&done, rs)?;
        self.grad.pending = Some(PendingReduce {
            done,
            out,
            op: opts.op,
            scale: opts.scale,
            all_reduced: self.groups.unsharded.communicator().is_none(),
            _staging: staging,
        });
        Ok(())
    }

    /// Where the pending reduction's reduced shard is.
    fn pending_target(&mut self) -> Result<(DeviceBuffer, usize)> {
        let out = match &self.grad.pending {
            Some(pending) => match &pending.out {
                ReducedInto::ShardedGrad => None,
                ReducedInto::Buffer(b, o) => Some((b.clone(), *o)),
            },
            None => return Err(self.state_error("reduce a gradient that was not reduce-scattered")),
        };
        match out {
            None => Ok((self.sharded_grad_device()?, 0)),
            Some(b) => Ok(b),
        }
    }

    /// The second half of [`ShardedParam::reduce_grad_async`] (hyper_parallel's
    /// `all_reduce_grad`): all-reduces the reduce-scattered shard across the unsharded group
    /// (HSDP's replicate dim, DDP, replicated parameters) on the reduce stream. A no-op for a
    /// parameter without replicas or when already done; an error before
    /// [`ShardedParam::reduce_scatter_grad`].
    pub fn all_reduce_grad(&mut self) -> Result<()> {
        let (op, done) = match &self.grad.pending {
            Some(p) if p.all_reduced => return Ok(()),
            Some(p) => (p.op, p.done.clone()),
            None => {
                return Err(self.state_error("all-reduce a gradient that was not reduce-scattered"))
            }
        };
        let (buf, off) = self.pending_target()?;
        let target = buf.at(off);
        let p = self.platform.clone();
        let rs = &self.streams.reduce;
        if let Some(comm) = self.groups.unsharded.communicator() {
            let n = self.geom.shard_numel();
            p.all_reduce(target, target, n, self.reduce_dtype, op, comm, rs)?;
            p.record_event(&done, rs)?;
        }
        if let Some(pending) = &mut self.grad.pending {
            pending.all_reduced = true;
        }
        Ok(())
    }

    /// The sharded gradient's device buffer, allocated on first use (never for offload).
    fn sharded_grad_device(&mut self) -> Result<DeviceBuffer> {
        let bytes = self.geom.shard_numel() * self.dtype.size();
        match &self.grad.sharded {
            Some(Storage::Device(b)) => {
                self.platform.resize_device(b, bytes)?;
                Ok(b.clone())
            }
            _ => {
                let b = self.platform.alloc_device(bytes)?;
                self.grad.sharded = Some(Storage::Device(b.clone()));
                Ok(b)
            }
        }
    }

    fn sharded_grad_pinned(&mut self) -> Result<PinnedBuffer> {
        if let Some(Storage::Pinned(h)) = &self.grad.sharded {
            return Ok(h.clone());
        }
        let h = self
            .platform
            .alloc_pinned(self.geom.shard_numel() * self.dtype.size())?;
        self.grad.sharded = Some(Storage::Pinned(h.clone()));
        Ok(h)
    }

    /// Orders the compute stream after the pending reduction and accumulates its result into
    /// the sharded gradient (converted to the parameter's dtype; copied in and out of pinned
    /// memory under the offload policy). Releases the accumulated unsharded gradient.
    pub fn wait_for_reduce(&mut self) -> Result<()> {
        let scale = match &self.grad.pending {
            Some(pending) => pending.scale,
            None => {
                return Err(self.state_error("wait for a gradient reduction that was not started"))
            }
        };
        if let Some(factor) = scale {
            let (buf, off) = self.pending_target()?;
            let rs = &self.streams.reduce;
            self.kernel(
                Kernel::Scale {
                    buf: buf.at(off),
                    dtype: self.reduce_dtype,
                    count: self.geom.shard_numel(),
                    factor,
                },
                rs,
            )?;
        }
        let pending = self.grad.pending.take().expect("checked above");
        let p = self.platform.clone();
        let cs = self.streams.compute.clone();
        if scale.is_some() {
            p.record_event(&pending.done, &self.streams.reduce)?;
        }
        p.stream_wait_event(&cs, &pending.done)?;
        let n = self.geom.shard_numel();
        let (dt, rdt) = (self.dtype, self.reduce_dtype);
        if let ReducedInto::Buffer(buf, off) = &pending.out {
            let src = buf.at(*off);
            let accumulate = self.grad.has_sharded;
            let combine = |this: &Self, dst: &DeviceBuffer| -> Result<()> {
                let k = if accumulate {
                    Kernel::Axpy {
                        src,
                        src_dtype: rdt,
                        dst: dst.into(),
                        dst_dtype: dt,
                        count: n,
                        alpha: 1.0,
                    }
                } else {
                    Kernel::Cast {
                        src,
                        src_dtype: rdt,
                        dst: dst.into(),
                        dst_dtype: dt,
                        count: n,
                    }
                };
                this.kernel(k, &cs)
            };
            match self.offload {
                OffloadPolicy::None => {
                    let dst = self.sharded_grad_device()?;
                    combine(self, &dst)?;
                }
                OffloadPolicy::PinnedHost => {
                    let host = self.sharded_grad_pinned()?;
                    let bytes = n * dt.size();
                    let dev = p.alloc_device(bytes)?;
                    if accumulate {
                        p.copy_async((&dev).into(), 0, (&host).into(), 0, bytes, &cs)?;
                    }
                    combine(self, &dev)?;
                    p.copy_async((&host).into(), 0, (&dev).into(), 0, bytes, &cs)?;
                }
            }
        }
        self.grad.has_sharded = true;
        if self.grad.has_unsharded {
            p.resize_device(&self.grad.unsharded, 0)?;
            self.grad.has_unsharded = false;
        }
        Ok(())
    }

    /// [`ShardedParam::reduce_grad_async`] then [`ShardedParam::wait_for_reduce`].
    pub fn reduce_grad(&mut self, grad: Option<GradInput<'_>>, opts: ReduceOptions) -> Result<()> {
        self.reduce_grad_async(grad, opts)?;
        self.wait_for_reduce()
    }

    /// The accumulated sharded gradient ([`ShardedParam::sharded_data`]'s shape and dtype), or
    /// `None` before the first reduction (or after [`ShardedParam::clear_grad`]).
    pub fn sharded_grad(&self) -> Option<ShardRef<'_>> {
        match (&self.grad.sharded, self.grad.has_sharded) {
            (Some(Storage::Device(b)), true) => Some(ShardRef::Device(b.into())),
            (Some(Storage::Pinned(h)), true) => Some(ShardRef::Pinned(h)),
            _ => None,
        }
    }

    /// Forgets the sharded gradient (the next reduction starts a new one; storage is reused).
    pub fn clear_grad(&mut self) -> Result<()> {
        if self.grad.pending.is_some() {
            return Err(self.state_error("clear the gradient while a reduction is pending"));
        }
        self.grad.has_sharded = false;
        Ok(())
    }

    /// Releases the sharded gradient's storage too.
    pub fn free_grad(&mut self) -> Result<()> {
        self.clear_grad()?;
        if let Some(Storage::Device(b)) = self.grad.sharded.take() {
            self.platform.resize_device(&b, 0)?;
        }
        Ok(())
    }

    /// Whether the parameter is unsharded (the state gradients are usually produced in).
    pub fn is_unsharded(&self) -> bool {
        self.state == ParamState::Unsharded
    }
}

/// Reductions issued in backward order and applied first-in first-out, as a backward pass
/// produces gradients layer by layer while the reduce stream works behind it.
///
/// ```no_run
/// # use hprt_hsdp::*;
/// # fn demo(params: &mut [ShardedParam], grads: &[hprt_platform::DeviceBuffer]) -> Result<()> {
/// let mut queue = GradQueue::default();
/// for i in (0..params.len()).rev() {
///     let g = GradInput { buf: (&grads[i]).into(), dtype: params[i].param_dtype() };
///     queue.issue(params, i, Some(g), ReduceOptions::default())?;
/// }
/// queue.finish(params)?; // applied in the order issued
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct GradQueue {
    order: VecDeque<usize>,
    applied: Vec<usize>,
}

impl GradQueue {
    /// Starts `params[index]`'s reduction and queues it.
    pub fn issue(
        &mut self,
        params: &mut [ShardedParam],
        index: usize,
        grad: Option<GradInput<'_>>,
        opts: ReduceOptions,
    ) -> Result<()> {
        param_at(params, index, "index")?.reduce_grad_async(grad, opts)?;
        self.order.push_back(index);
        Ok(())
    }

    /// Applies the oldest queued reduction; returns its parameter index (`None` when empty).
    pub fn apply_next(&mut self, params: &mut [ShardedParam]) -> Result<Option<usize>> {
        let Some(index) = self.order.pop_front() else {
            return Ok(None);
        };
        param_at(params, index, "queued index")?.wait_for_reduce()?;
        self.applied.push(index);
        Ok(Some(index))
    }

    /// Applies everything queued, in order; returns how many were applied.
    pub fn finish(&mut self, params: &mut [ShardedParam]) -> Result<usize> {
        let mut count = 0;
        while self.apply_next(params)?.is_some() {
            count += 1;
        }
        Ok(count)
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
    /// The parameter indices applied so far, in application order.
    pub fn applied(&self) -> &[usize] {
        &self.applied
    }
}

/// `params[index]`, or the error naming the index (`what` says which one it was).
fn param_at<'p>(
    params: &'p mut [ShardedParam],
    index: usize,
    what: &str,
) -> Result<&'p mut ShardedParam> {
    let n = params.len();
    params
        .get_mut(index)
        .ok_or_else(|| HsdpError::InvalidParam {
            param: format!("#{index}"),
            message: format!("{what} outside the {n} parameters given"),
        })
}
