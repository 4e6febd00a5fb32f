//! Where a shard or a sharded gradient lives (device or pinned host memory): below both the
//! parameters (`param.rs`) and their gradients (`grad.rs`, `grad_state.rs`).

use hprt_platform::{DeviceBuffer, PinnedBuffer, Place};

/// Device or pinned host memory holding a shard or a sharded gradient.
#[derive(Clone, Copy, Debug)]
pub enum ShardRef<'a> {
    Device(Place<&'a DeviceBuffer>),
    /// Read or write it on the host only after synchronizing the compute stream.
    Pinned(&'a PinnedBuffer),
}

#[derive(Clone, Debug)]
pub(crate) enum Storage {
    Device(DeviceBuffer),
    Pinned(PinnedBuffer),
}

impl Storage {
    pub(crate) fn as_ref(&self) -> ShardRef<'_> {
        match self {
            Storage::Device(b) => ShardRef::Device(b.into()),
            Storage::Pinned(p) => ShardRef::Pinned(p),
        }
    }
}
