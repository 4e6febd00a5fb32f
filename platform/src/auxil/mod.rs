//! Code the driver backends (cuda, npu) share, as wgpu-hal's `auxil`: what is written over
//! [`crate::Backend`] operations alone, or over the few driver calls a small trait names, lives
//! here once instead of once per backend.
//!
//! - [`deferred`] — the list of memory waiting for its queued work before it is freed;
//! - [`uses`] — use tracking: the events that mark the last work each stream queued on a buffer,
//!   and the stream-ordered free built on them ([`uses::TrackedMem`]);
//! - [`comm`] — communicator helpers over `Backend` collectives: the host all-gather,
//!   `comm_split` by leader id and digest, the barrier's scratch word, `Avg` post-scaling.

pub(crate) mod comm;
pub(crate) mod deferred;
pub(crate) mod uses;
