//! Placements and the layout-driven choice of communication groups.
//!
//! A parameter's layout is a mesh plus one [`Placement`] per mesh dim. The data-parallel mesh
//! ([`DataParallelMesh`]: FSDP, HSDP or DDP) contributes its dims; a parameter that already
//! carries a distributed layout (tensor parallel, …) contributes its own. From the final layout:
//! - the *sharded group* all-gathers the parameter and reduce-scatters its gradient: the
//!   data-parallel shard dim's group when the parameter is sharded, else the no-op group;
//! - the *unsharded group* all-reduces what the reduce-scatter leaves: every mesh dim whose
//!   placement is `Replicate`, except the shard dim of a sharded parameter;
//! - *partial groups* sum (or otherwise reduce) a gradient that is `Partial` on some dims first.

use hprt_platform::ReduceOp;

use crate::error::{HsdpError, Result};
use crate::group::{GroupCache, ProcessGroup};
use crate::mesh::DeviceMesh;

/// How a tensor is laid out along one mesh dim.
///
/// ```
/// use hprt_hsdp::Placement;
/// assert!(Placement::Shard(1).is_shard());
/// assert_eq!(Placement::Shard(1).shard_dim(), Some(1));
/// assert!(Placement::Replicate.is_replicate());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split along tensor dim `0`-based `dim` across the mesh dim's ranks.
    Shard(usize),
    /// A full copy on every rank of the mesh dim.
    Replicate,
    /// Every rank holds a partial value; the tensor is `op` over them.
    Partial(ReduceOp),
}

impl Placement {
    pub fn is_shard(&self) -> bool {
        matches!(self, Placement::Shard(_))
    }
    pub fn is_replicate(&self) -> bool {
        matches!(self, Placement::Replicate)
    }
    pub fn is_partial(&self) -> bool {
        matches!(self, Placement::Partial(_))
    }
    pub fn shard_dim(&self) -> Option<usize> {
        match self {
            Placement::Shard(d) => Some(*d),
            _ => None,
        }
    }
}

/// The data-parallel mesh and the role of its dims.
///
/// ```
/// use hprt_hsdp::{DataParallelMesh, DeviceMesh};
/// let hsdp = DataParallelMesh::hsdp(DeviceMesh::contiguous(&[2, 4])?)?;
/// assert_eq!((hsdp.replicate_size(), hsdp.shard_size()), (2, 4));
/// # Ok::<(), hprt_hsdp::HsdpError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataParallelMesh {
    /// Parameters are sharded along `shard_dim`; with a `replicate_dim` this is HSDP
    /// (replicate × shard), without it FSDP.
    Sharded {
        mesh: DeviceMesh,
        shard_dim: usize,
        replicate_dim: Option<usize>,
    },
    /// DDP: parameters are replicated along `replicate_dim`, gradients all-reduced.
    Replicated {
        mesh: DeviceMesh,
        replicate_dim: usize,
    },
}

impl DataParallelMesh {
    /// FSDP over a 1-D mesh.
    pub fn fsdp(mesh: DeviceMesh) -> Result<Self> {
        expect_ndim(&mesh, 1, "FSDP")?;
        Ok(DataParallelMesh::Sharded {
            mesh,
            shard_dim: 0,
            replicate_dim: None,
        })
    }
    /// HSDP over a 2-D mesh: dim 0 replicates, dim 1 shards.
    pub fn hsdp(mesh: DeviceMesh) -> Result<Self> {
        expect_ndim(&mesh, 2, "HSDP")?;
        Ok(DataParallelMesh::Sharded {
            mesh,
            shard_dim: 1,
            replicate_dim: Some(0),
        })
    }
    /// DDP over a 1-D mesh.
    pub fn ddp(mesh: DeviceMesh) -> Result<Self> {
        expect_ndim(&mesh, 1, "DDP")?;
        Ok(DataParallelMesh::Replicated {
            mesh,
            replicate_dim: 0,
        })
    }

    pub fn mesh(&self) -> &DeviceMesh {
        match self {
            DataParallelMesh::Sharded { mesh, .. } | DataParallelMesh::Replicated { mesh, .. } => {
                mesh
            }
        }
    }
    pub fn shard_dim(&self) -> Option<usize> {
        match self {
            DataParallelMesh::Sharded { shard_dim, .. } => Some(*shard_dim),
            DataParallelMesh::Replicated { .. } => None,
        }
    }
    pub fn replicate_dim(&self) -> Option<usize> {
        match self {
            DataParallelMesh::Sharded { replicate_dim, .. } => *replicate_dim,
            DataParallelMesh::Replicated { replicate_dim, .. } => Some(*replicate_dim),
        }
    }
    /// Ranks along the shard dim (1 for DDP).
    pub fn shard_size(&self) -> usize {
        self.shard_dim().map_or(1, |d| self.mesh().shape()[d])
    }
    /// Ranks along the replicate dim (1 without one).
    pub fn replicate_size(&self) -> usize {
        self.replicate_dim().map_or(1, |d| self.mesh().shape()[d])
    }
}

fn expect_ndim(mesh: &DeviceMesh, n: usize, what: &str) -> Result<()> {
    if mesh.ndim() == n {
        Ok(())
    } else {
        Err(HsdpError::InvalidMesh(format!(
            "{what} needs a {n}-D mesh, got shape {:?}",
            mesh.shape()
        )))
    }
}

/// A layout a parameter already carries before data parallelism is applied (e.g. tensor
/// parallel): its mesh and one placement per mesh dim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistLayout {
    pub mesh: DeviceMesh,
    pub placements: Vec<Placement>,
}

/// How a pre-existing layout combines with the data-parallel mesh (hyper_parallel's param modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutMode {
    /// The data-parallel dims come first, then the layout's own dims: the final mesh is the
    /// concatenation of the two (they must be cut from one root mesh).
    Unified,
    /// The layout's mesh already contains the data-parallel dims (found by name); the final
    /// mesh is the layout's mesh.
    Compat,
}

/// The final layout of one parameter and which of its mesh dims play the data-parallel roles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpmdLayout {
    pub mesh: DeviceMesh,
    pub placements: Vec<Placement>,
    /// The final-mesh dim the parameter is sharded along by data parallelism, if any.
    pub shard_mesh_dim: Option<usize>,
    pub replicate_mesh_dim: Option<usize>,
    /// Whether data parallelism shards this parameter (false below the size threshold and for DDP).
    pub uses_param_shard: bool,
}

impl SpmdLayout {
    /// Resolves the final layout (hyper_parallel's `_get_base_spmd_placements` then
    /// `_apply_data_parallel_placements`).
    ///
    /// `shard` is the placement data parallelism applies on its shard dim; `uses_param_shard`
    /// is false for parameters kept replicated (below the threshold).
    pub fn resolve(
        dp: &DataParallelMesh,
        existing: Option<(&DistLayout, LayoutMode)>,
        shard: Placement,
        uses_param_shard: bool,
    ) -> Result<Self> {
        if !shard.is_shard() {
            return Err(HsdpError::InvalidPlacement(format!(
                "data parallelism shards with Shard(dim), not {shard:?}"
            )));
        }
        let dp_mesh = dp.mesh();
        let (mesh, mut placements, shard_mesh_dim, replicate_mesh_dim) = match existing {
            None => (
                dp_mesh.clone(),
                vec![Placement::Replicate; dp_mesh.ndim()],
                dp.shard_dim(),
                dp.replicate_dim(),
            ),
            Some((layout, mode)) => {
                if layout.placements.len() != layout.mesh.ndim() {
                    return Err(HsdpError::InvalidPlacement(format!(
                        "{} placements for a {}-D mesh",
                        layout.placements.len(),
                        layout.mesh.ndim()
                    )));
                }
                match mode {
                    LayoutMode::Unified => {
                        let mesh =
                            DeviceMesh::concatenate(&[dp_mesh.clone(), layout.mesh.clone()])?;
                        let mut p = vec![Placement::Replicate; dp_mesh.ndim()];
                        p.extend(layout.placements.iter().copied());
                        (mesh, p, dp.shard_dim(), dp.replicate_dim())
                    }
                    LayoutMode::Compat => {
                        let find = |d: Option<usize>| -> Result<Option<usize>> {
                            let Some(d) = d else { return Ok(None) };
                            let name = dp_mesh.dim_names().map(|n| n[d].clone()).ok_or_else(|| {
                                HsdpError::InvalidMesh(
                                    "compat layouts find the data-parallel dims by name; name the data-parallel mesh's dims".into(),
                                )
                            })?;
                            layout.mesh.dim_index(&name).map(Some)
                        };
                        let s = find(dp.shard_dim())?;
                        let r = find(dp.replicate_dim())?;
                        (layout.mesh.clone(), layout.placements.clone(), s, r)
                    }
                }
            }
        };
        // DDP replicates along its dim unless the parameter brought its own layout.
        if matches!(dp, DataParallelMesh::Replicated { .. }) && existing.is_none() {
            if let Some(r) = replicate_mesh_dim {
                placements[r] = Placement::Replicate;
            }
        }
        let uses_param_shard = uses_param_shard && dp.shard_dim().is_some();
        if uses_param_shard {
            if let Some(s) = shard_mesh_dim {
                placements[s] = shard;
            }
        }
        Ok(SpmdLayout {
            mesh,
            placements,
            shard_mesh_dim,
            replicate_mesh_dim,
            uses_param_shard,
        })
    }

    /// Mesh dims whose placement is `Replicate`, minus the data-parallel shard dim of a sharded
    /// parameter: the dims the unsharded gradient is all-reduced over (hyper_parallel's
    /// `_build_layout_driven_group_info`).
    pub fn unsharded_axes(&self) -> Vec<usize> {
        self.placements
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_replicate())
            .map(|(a, _)| a)
            .filter(|&a| !(self.uses_param_shard && Some(a) == self.shard_mesh_dim))
            .collect()
    }

    /// Mesh dims on which the parameter (and so its gradient) is `Partial`, with their op.
    pub fn partial_axes(&self) -> Vec<(usize, ReduceOp)> {
        self.placements
            .iter()
            .enumerate()
            .filter_map(|(a, p)| match p {
                Placement::Partial(op) => Some((a, *op)),
                _ => None,
            })
            .collect()
    }
}

/// The groups one parameter communicates over.
#[derive(Clone, Debug)]
pub struct GroupInfos {
    /// All-gathers the parameter, reduce-scatters its gradient.
    pub sharded: ProcessGroup,
    /// All-reduces the gradient after the reduce-scatter (HSDP's replicate dim, DDP, replicated
    /// parameters).
    pub unsharded: ProcessGroup,
    /// Reduce a `Partial` gradient before anything else, one group per partial mesh dim.
    pub partial: Vec<(ProcessGroup, ReduceOp)>,
}

impl GroupInfos {
    /// `sharded.size() * unsharded.size()`: the ranks one gradient element is reduced over.
    pub fn rank_size(&self) -> usize {
        (self.sharded.size() * self.unsharded.size()).max(1)
    }

    /// Makes (or reuses) the groups `layout` needs, in a fixed order: sharded, unsharded, partial.
    /// Collective over the cache's world (hyper_parallel's `_init_group_infos`).
    pub fn build(cache: &GroupCache, dp: &DataParallelMesh, layout: &SpmdLayout) -> Result<Self> {
        let sharded = match (layout.uses_param_shard, dp.shard_dim()) {
            (true, Some(d)) => cache.group_along("fully_shard_sharded_group", dp.mesh(), &[d])?,
            _ => ProcessGroup::noop("fully_shard_sharded_group", cache.rank()),
        };
        let axes = layout.unsharded_axes();
        let unsharded = if axes.is_empty() {
            ProcessGroup::noop("fully_shard_unsharded_group", cache.rank())
        } else {
            cache.group_along("fully_shard_unsharded_group", &layout.mesh, &axes)?
        };
        let mut partial = Vec::new();
        for (axis, op) in layout.partial_axes() {
            let g = cache.group_along("fully_shard_partial_group", &layout.mesh, &[axis])?;
            partial.push((g, op));
        }
        Ok(GroupInfos {
            sharded,
            unsharded,
            partial,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(dp: &DataParallelMesh, shard: bool) -> SpmdLayout {
        SpmdLayout::resolve(dp, None, Placement::Shard(0), shard).unwrap()
    }

    #[test]
    fn fsdp_shards_and_needs_no_all_reduce() {
        let dp = DataParallelMesh::fsdp(DeviceMesh::contiguous(&[4]).unwrap()).unwrap();
        let l = resolve(&dp, true);
        assert_eq!(l.placements, vec![Placement::Shard(0)]);
        assert!(l.unsharded_axes().is_empty());
        // Below the threshold: replicated, all-reduced over the whole shard dim.
        let r = resolve(&dp, false);
        assert_eq!(r.placements, vec![Placement::Replicate]);
        assert_eq!(r.unsharded_axes(), vec![0]);
    }

    #[test]
    fn hsdp_all_reduces_across_the_replicate_dim() {
        let dp = DataParallelMesh::hsdp(DeviceMesh::contiguous(&[2, 4]).unwrap()).unwrap();
        let l = SpmdLayout::resolve(&dp, None, Placement::Shard(1), true).unwrap();
        assert_eq!(
            l.placements,
            vec![Placement::Replicate, Placement::Shard(1)]
        );
        assert_eq!(l.unsharded_axes(), vec![0]);
        assert_eq!(resolve(&dp, false).unsharded_axes(), vec![0, 1]);
    }

    #[test]
    fn ddp_all_reduces_only() {
        let dp = DataParallelMesh::ddp(DeviceMesh::contiguous(&[3]).unwrap()).unwrap();
        let l = resolve(&dp, true);
        assert!(!l.uses_param_shard);
        assert_eq!(l.placements, vec![Placement::Replicate]);
        assert_eq!(l.unsharded_axes(), vec![0]);
    }

    #[test]
    fn mesh_shapes_are_checked_per_mode() {
        assert!(DataParallelMesh::fsdp(DeviceMesh::contiguous(&[2, 2]).unwrap()).is_err());
        assert!(DataParallelMesh::hsdp(DeviceMesh::contiguous(&[4]).unwrap()).is_err());
        let dp = DataParallelMesh::fsdp(DeviceMesh::contiguous(&[4]).unwrap()).unwrap();
        assert!(SpmdLayout::resolve(&dp, None, Placement::Replicate, true).is_err());
    }

    fn dp_tp(rank: usize) -> (DataParallelMesh, DistLayout, DeviceMesh) {
        let root = DeviceMesh::contiguous(&[2, 2])
            .unwrap()
            .with_dim_names(&["dp", "tp"])
            .unwrap();
        let dp = DataParallelMesh::fsdp(root.submesh_by_names(rank, &["dp"]).unwrap()).unwrap();
        let tp = DistLayout {
            mesh: root.submesh_by_names(rank, &["tp"]).unwrap(),
            placements: vec![Placement::Shard(0)],
        };
        (dp, tp, root)
    }

    #[test]
    fn unified_layout_concatenates_dp_and_tensor_parallel_dims() {
        let (dp, tp, root) = dp_tp(3);
        let l = SpmdLayout::resolve(
            &dp,
            Some((&tp, LayoutMode::Unified)),
            Placement::Shard(0),
            true,
        )
        .unwrap();
        assert_eq!(l.mesh, root);
        assert_eq!(l.placements, vec![Placement::Shard(0), Placement::Shard(0)]);
        assert!(l.unsharded_axes().is_empty());
        // A tensor-parallel replicated parameter kept whole by data parallelism is all-reduced
        // over both dims; one sharded by data parallelism only over the tensor-parallel dim.
        let rep = DistLayout {
            placements: vec![Placement::Replicate],
            ..tp.clone()
        };
        let l = SpmdLayout::resolve(
            &dp,
            Some((&rep, LayoutMode::Unified)),
            Placement::Shard(0),
            false,
        )
        .unwrap();
        assert_eq!(l.unsharded_axes(), vec![0, 1]);
        let l = SpmdLayout::resolve(
            &dp,
            Some((&rep, LayoutMode::Unified)),
            Placement::Shard(0),
            true,
        )
        .unwrap();
        assert_eq!(l.unsharded_axes(), vec![1]);
        assert_eq!(
            l.mesh.split_rank_lists_for_axes(&[1]).unwrap(),
            vec![vec![0, 1], vec![2, 3]]
        );
    }

    #[test]
    fn compat_layout_finds_the_dp_dims_by_name_and_keeps_partials() {
        let (dp, _, root) = dp_tp(0);
        let existing = DistLayout {
            mesh: root.clone(),
            placements: vec![Placement::Replicate, Placement::Partial(ReduceOp::Sum)],
        };
        let l = SpmdLayout::resolve(
            &dp,
            Some((&existing, LayoutMode::Compat)),
            Placement::Shard(0),
            true,
        )
        .unwrap();
        assert_eq!(l.shard_mesh_dim, Some(0));
        assert_eq!(
            l.placements,
            vec![Placement::Shard(0), Placement::Partial(ReduceOp::Sum)]
        );
        assert!(l.unsharded_axes().is_empty());
        assert_eq!(l.partial_axes(), vec![(1, ReduceOp::Sum)]);
        let unnamed = DataParallelMesh::fsdp(DeviceMesh::contiguous(&[2]).unwrap()).unwrap();
        assert!(SpmdLayout::resolve(
            &unnamed,
            Some((&existing, LayoutMode::Compat)),
            Placement::Shard(0),
            true
        )
        .is_err());
    }
}
