//! Where a shard or a sharded gradient lives (device or pinned host memory): below both the
//! parameters (`param.rs`) and their gradients (`grad.rs`, `grad_state.rs`).

use hprt_platform::{DeviceBuffer, Memory, PinnedBuffer, Place};

/// Device or pinned host memory holding a shard or a sharded gradient; read or write pinned
/// memory on the host only after synchronizing the compute stream.
pub type ShardRef<'a> = Memory<Place<&'a DeviceBuffer>, &'a PinnedBuffer>;

/// The memory a shard or a sharded gradient owns.
pub(crate) type Storage = Memory<DeviceBuffer, PinnedBuffer>;

/// The place of what `s` holds (the start of its device memory, or its pinned memory).
pub(crate) fn shard_ref(s: &Storage) -> ShardRef<'_> {
    s.as_ref().map(Place::from, |p| p)
}
