//! What a sharded parameter keeps of its gradient between calls (the accumulated unsharded
//! gradient, the sharded one, the reduction in flight): a field of every `ShardedParam`, its
//! methods in `grad.rs`, so that the parameter's module does not depend on the gradient's.

use hprt_platform::{DeviceBuffer, Event, Platform, ReduceOp};

use crate::error::Result;
use crate::storage::Storage;

/// Where a reduction leaves the reduced shard.
pub(crate) enum ReducedInto {
    /// Directly in the sharded gradient (first gradient, same dtype, on the device).
    ShardedGrad,
    /// In a buffer that is accumulated into the sharded gradient when applied.
    Buffer(DeviceBuffer, usize),
}

pub(crate) struct PendingReduce {
    pub(crate) done: Event,
    pub(crate) out: ReducedInto,
    pub(crate) op: ReduceOp,
    pub(crate) scale: Option<f64>,
    /// Whether [`crate::ShardedParam::all_reduce_grad`] ran (or the parameter has no replicas).
    pub(crate) all_reduced: bool,
    pub(crate) _staging: Vec<DeviceBuffer>,
}

pub(crate) struct GradState {
    /// Unsharded gradients accumulated across micro-batches, in the reduce dtype; released
    /// while empty. Holds the padded all-gather layout when that is the parameter's own.
    pub(crate) unsharded: DeviceBuffer,
    pub(crate) has_unsharded: bool,
    pub(crate) sharded: Option<Storage>,
    pub(crate) has_sharded: bool,
    pub(crate) pending: Option<PendingReduce>,
    pub(crate) ready: Event,
}

impl GradState {
    pub(crate) fn new(platform: &dyn Platform) -> Result<Self> {
        Ok(GradState {
            unsharded: platform.alloc_device(0)?,
            has_unsharded: false,
            sharded: None,
            has_sharded: false,
            pending: None,
            ready: platform.create_event(false)?,
        })
    }
}
