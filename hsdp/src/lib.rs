//! hprt-hsdp: sharded data parallelism (FSDP, HSDP, DDP) written once against
//! `hprt_platform::Platform`. The crate root is the API (the modules are private):
//!
//! - `mesh` — [`DeviceMesh`]: n-D grids of ranks with named dims, rank lists along any axes,
//!   sub-meshes and concatenation (pure).
//! - `group` — [`ProcessGroup`] and [`GroupCache`]: sub-communicators split collectively and
//!   cached by sorted rank list; a group of one rank is the explicit no-op group.
//! - `placement` — [`Placement`] (`Shard`, `Replicate`, `Partial`), [`DataParallelMesh`]
//!   (FSDP / HSDP / DDP), [`SpmdLayout`] and the layout-driven [`GroupInfos`].
//! - `policy` — [`MixedPrecisionPolicy`] and [`OffloadPolicy`].
//! - `param` — [`ShardedParam`]: padded shards, `unshard` (async all-gather, prefetch,
//!   [`UnshardHandle`]), `wait_for_unshard`, `shard`, and hyper_parallel's `HSDPParamV2` names
//!   `to_sharded`, `to_unsharded`, `alloc_all_gather_outputs`, `free_unsharded_param`;
//!   [`ShardGeometry`] for `Shard(dim)` layouts.
//! - `grad` — gradient accumulation, reduce-scatter + all-reduce ([`ReduceOptions`]; in two
//!   halves as `reduce_scatter_grad` / `all_reduce_grad`) and the ordered [`GradQueue`].
//! - `error` — [`HsdpError`], the crate's one error.
//!
//! Ranks are whatever the platform's communicators connect (threads of one process on the cpu
//! backend); each rank builds one [`GroupCache`] over its world communicator and its parameters
//! in the same order as every other rank. torch modules are sharded with these parameters by
//! `hprt.torch.fully_shard` (the Python package's `hprt/fsdp/`).

mod error;
mod grad;
mod grad_state;
mod group;
mod mesh;
mod param;
mod placement;
mod policy;
mod storage;

pub use error::{HsdpError, Result};
pub use grad::{GradInput, GradQueue, ReduceOptions};
pub use group::{GroupCache, ProcessGroup};
pub use mesh::{DeviceMesh, MAX_MESH_RANKS};
pub use param::{
    HsdpStreams, ParamConfig, ParamSpec, ParamState, Run, ShardGeometry, ShardedParam,
    UnshardHandle,
};
pub use placement::{DataParallelMesh, DistLayout, GroupInfos, LayoutMode, Placement, SpmdLayout};
pub use policy::{MixedPrecisionPolicy, OffloadPolicy};
pub use storage::ShardRef;
