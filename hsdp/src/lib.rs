//! hprt-hsdp: sharded data parallelism (FSDP, HSDP, DDP) written once against
//! `hprt_platform::Platform`.
//!
//! - [`mesh`] — [`DeviceMesh`]: n-D grids of ranks with named dims, rank lists along any axes,
//!   sub-meshes and concatenation (pure).
//! - [`group`] — [`ProcessGroup`] and [`GroupCache`]: sub-communicators split collectively and
//!   cached by sorted rank list; a group of one rank is the explicit no-op group.
//! - [`placement`] — [`Placement`] (`Shard`, `Replicate`, `Partial`), [`DataParallelMesh`]
//!   (FSDP / HSDP / DDP), [`SpmdLayout`] and the layout-driven [`GroupInfos`].
//! - [`error`] — [`HsdpError`], the crate's one error.

pub mod error;
pub mod group;
pub mod mesh;
pub mod placement;

pub use error::{HsdpError, Result};
pub use group::{GroupCache, ProcessGroup};
pub use mesh::DeviceMesh;
pub use placement::{DataParallelMesh, DistLayout, GroupInfos, LayoutMode, Placement, SpmdLayout};
