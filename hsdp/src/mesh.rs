//! `DeviceMesh`: an n-D arrangement of global ranks with optional dim names, and the rank-list
//! math every group choice rests on. Pure: nothing here talks to a platform.

use std::collections::HashSet;

use crate::error::{HsdpError, Result};

/// An n-dimensional grid of global ranks, stored row-major, with optional names per dim.
///
/// ```
/// use hprt_hsdp::DeviceMesh;
/// // 2 replicas × 4 shards: ranks 0..4 form replica 0, ranks 4..8 replica 1.
/// let mesh = DeviceMesh::contiguous(&[2, 4])?.with_dim_names(&["dp_replicate", "dp_shard"])?;
/// assert_eq!(mesh.rank_list_for_axes(5, &[1])?, vec![4, 5, 6, 7]); // rank 5's shard group
/// assert_eq!(mesh.rank_list_for_axes(5, &[0])?, vec![1, 5]); // rank 5's replicate group
/// assert_eq!(
///     mesh.split_rank_lists_for_axes(&[0])?,
///     vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
/// );
/// # Ok::<(), hprt_hsdp::HsdpError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMesh {
    shape: Vec<usize>,
    ranks: Vec<usize>,
    dim_names: Option<Vec<String>>,
    origin: Option<Box<Origin>>,
}

/// Where a sub-mesh came from: its root mesh, which root axes it spans (in its own dim order),
/// and the root coordinates it was cut at on the axes it does not span.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Origin {
    root: DeviceMesh,
    axes: Vec<usize>,
    fixed: Vec<usize>,
}

/// The most ranks a mesh may hold (2^20, beyond any cluster hprt targets): a mesh stores every
/// rank, so the bound keeps a mistaken or hostile shape from allocating without limit.
pub const MAX_MESH_RANKS: usize = 1 << 20;

/// The rank count of `shape`, checked: no empty or missing dim, no overflow, within
/// [`MAX_MESH_RANKS`]. Nothing is allocated before this passes.
fn checked_size(shape: &[usize]) -> Result<usize> {
    if shape.is_empty() {
        return Err(bad("a mesh needs at least one dim"));
    }
    if shape.contains(&0) {
        return Err(bad(format!("shape {shape:?} has an empty dim")));
    }
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= MAX_MESH_RANKS)
        .ok_or_else(|| {
            bad(format!(
                "shape {shape:?} holds more than {MAX_MESH_RANKS} ranks (the mesh size limit)"
            ))
        })
}

fn bad(msg: impl Into<String>) -> HsdpError {
    HsdpError::InvalidMesh(msg.into())
}

impl DeviceMesh {
    /// A mesh of `shape` holding `ranks` in row-major order; every rank appears once.
    pub fn new(shape: &[usize], ranks: Vec<usize>) -> Result<Self> {
        let size = checked_size(shape)?;
        if size != ranks.len() {
            return Err(bad(format!(
                "shape {shape:?} holds {size} ranks but {} were given",
                ranks.len()
            )));
        }
        let mut seen = HashSet::with_capacity(ranks.len());
        if let Some(dup) = ranks.iter().find(|r| !seen.insert(**r)) {
            return Err(bad(format!("rank {dup} appears twice in {ranks:?}")));
        }
        Ok(DeviceMesh {
            shape: shape.to_vec(),
            ranks,
            dim_names: None,
            origin: None,
        })
    }

    /// The mesh of `shape` over ranks `0..product(shape)` in row-major order.
    pub fn contiguous(shape: &[usize]) -> Result<Self> {
        Self::new(shape, (0..checked_size(shape)?).collect())
    }

    /// Names the dims (one distinct, non-empty name per dim).
    pub fn with_dim_names(mut self, names: &[&str]) -> Result<Self> {
        if names.len() != self.ndim() {
            return Err(bad(format!(
                "{} dim names for a {}-D mesh",
                names.len(),
                self.ndim()
            )));
        }
        let mut seen = HashSet::new();
        for n in names {
            if n.is_empty() || !seen.insert(*n) {
                return Err(bad(format!(
                    "dim names {names:?} must be distinct and non-empty"
                )));
            }
        }
        self.dim_names = Some(names.iter().map(|s| s.to_string()).collect());
        Ok(self)
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of ranks in the mesh.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// The ranks in row-major order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    pub fn dim_names(&self) -> Option<&[String]> {
        self.dim_names.as_deref()
    }
    pub fn contains(&self, rank: usize) -> bool {
        self.ranks.contains(&rank)
    }

    /// The index of the dim called `name`.
    pub fn dim_index(&self, name: &str) -> Result<usize> {
        self.dim_names
            .as_ref()
            .and_then(|names| names.iter().position(|n| n == name))
            .ok_or_else(|| {
                bad(format!(
                    "no dim is named {name:?} (names: {:?})",
                    self.dim_names
                ))
            })
    }

    /// The coordinates of `rank`, or `None` when it is not in the mesh.
    pub fn coords_of(&self, rank: usize) -> Option<Vec<usize>> {
        let flat = self.ranks.iter().position(|&r| r == rank)?;
        Some(self.unflatten(flat))
    }

    /// The rank at `coords`.
    pub fn rank_at(&self, coords: &[usize]) -> Result<usize> {
        if coords.len() != self.ndim() || coords.iter().zip(&self.shape).any(|(c, d)| c >= d) {
            return Err(bad(format!(
                "coordinates {coords:?} lie outside shape {:?}",
                self.shape
            )));
        }
        Ok(self.ranks[self.flatten(coords)])
    }

    fn flatten(&self, coords: &[usize]) -> usize {
        coords
            .iter()
            .zip(&self.shape)
            .fold(0, |acc, (c, d)| acc * d + c)
    }

    fn unflatten(&self, mut flat: usize) -> Vec<usize> {
        let mut coords = vec![0; self.ndim()];
        for (c, d) in coords.iter_mut().zip(&self.shape).rev() {
            *c = flat % d;
            flat /= d;
        }
        coords
    }

    fn check_axes(&self, axes: &[usize]) -> Result<()> {
        let mut seen = HashSet::new();
        for &a in axes {
            if a >= self.ndim() || !seen.insert(a) {
                return Err(bad(format!(
                    "axes {axes:?} must be distinct dims of a {}-D mesh",
                    self.ndim()
                )));
            }
        }
        Ok(())
    }

    /// Every combination of coordinates over `axes`, `axes[0]` varying slowest.
    fn coords_over(&self, axes: &[usize]) -> Vec<Vec<usize>> {
        let mut out = vec![vec![]];
        for &a in axes {
            out = out
                .into_iter()
                .flat_map(|prefix| {
                    (0..self.shape[a]).map(move |i| {
                        let mut p = prefix.clone();
                        p.push(i);
                        p
                    })
                })
                .collect();
        }
        out
    }

    /// The ranks that share `rank`'s coordinates on every dim outside `axes`, ordered by their
    /// coordinates on `axes` (`axes[0]` slowest). These ranks form `rank`'s group along `axes`.
    pub fn rank_list_for_axes(&self, rank: usize, axes: &[usize]) -> Result<Vec<usize>> {
        self.check_axes(axes)?;
        let base = self
            .coords_of(rank)
            .ok_or_else(|| HsdpError::RankNotInMesh {
                rank,
                what: format!("mesh {:?}", self.ranks),
            })?;
        Ok(self.ranks_through(&base, axes))
    }

    /// The ranks at `base`'s coordinates on every dim outside `axes`, every coordinate on
    /// `axes`, ordered by those (`axes[0]` slowest).
    fn ranks_through(&self, base: &[usize], axes: &[usize]) -> Vec<usize> {
        self.coords_over(axes)
            .into_iter()
            .map(|sub| {
                let mut c = base.to_vec();
                for (&a, &i) in axes.iter().zip(&sub) {
                    c[a] = i;
                }
                self.ranks[self.flatten(&c)]
            })
            .collect()
    }

    /// All groups along `axes`: one rank list per combination of coordinates on the other dims
    /// (row-major over those dims), each ordered as [`DeviceMesh::rank_list_for_axes`]. The lists
    /// partition the mesh; every rank passes the same lists to a collective split.
    pub fn split_rank_lists_for_axes(&self, axes: &[usize]) -> Result<Vec<Vec<usize>>> {
        self.check_axes(axes)?;
        let others: Vec<usize> = (0..self.ndim()).filter(|a| !axes.contains(a)).collect();
        self.coords_over(&others)
            .into_iter()
            .map(|fixed| {
                let mut c = vec![0; self.ndim()];
                for (&a, &i) in others.iter().zip(&fixed) {
                    c[a] = i;
                }
                let anchor = self.ranks[self.flatten(&c)];
                self.rank_list_for_axes(anchor, axes)
            })
            .collect()
    }

    /// The groups along `axes` over the whole root mesh this mesh was cut from (its own
    /// [`DeviceMesh::split_rank_lists_for_axes`] when it is a root). A sub-mesh only holds the
    /// ranks of one cut, but a collective split needs every rank's group, and ranks in other
    /// cuts hold other sub-meshes: the root's lists are the same on all of them.
    pub fn global_split_rank_lists_for_axes(&self, axes: &[usize]) -> Result<Vec<Vec<usize>>> {
        self.check_axes(axes)?;
        match &self.origin {
            None => self.split_rank_lists_for_axes(axes),
            Some(o) => {
                let root_axes: Vec<usize> = axes.iter().map(|&a| o.axes[a]).collect();
                o.root.split_rank_lists_for_axes(&root_axes)
            }
        }
    }

    /// The sub-mesh over `axes` (in that order) through `rank`: what a framework's
    /// `mesh["dp_shard"]` gives. It remembers its root so sub-meshes can be concatenated again.
    pub fn submesh(&self, rank: usize, axes: &[usize]) -> Result<DeviceMesh> {
        if axes.is_empty() {
            return Err(bad("a sub-mesh needs at least one dim"));
        }
        let ranks = self.rank_list_for_axes(rank, axes)?;
        let coords = self.coords_of(rank).expect("checked by rank_list_for_axes");
        let (root, root_axes, root_fixed) = match &self.origin {
            None => (self.clone(), axes.to_vec(), coords_without(&coords, axes)),
            Some(o) => {
                // Map this mesh's axes back to root axes; the root coordinates of `rank` on
                // everything outside the new axes become the fixed cut.
                let root_axes: Vec<usize> = axes.iter().map(|&a| o.axes[a]).collect();
                let root_coords = o
                    .root
                    .coords_of(rank)
                    .expect("a sub-mesh rank is a root rank");
                (
                    o.root.clone(),
                    root_axes.clone(),
                    coords_without(&root_coords, &root_axes),
                )
            }
        };
        let mut sub = DeviceMesh::new(
            &axes.iter().map(|&a| self.shape[a]).collect::<Vec<_>>(),
            ranks,
        )?;
        if let Some(names) = &self.dim_names {
            sub.dim_names = Some(axes.iter().map(|&a| names[a].clone()).collect());
        }
        sub.origin = Some(Box::new(Origin {
            root,
            axes: root_axes,
            fixed: root_fixed,
        }));
        Ok(sub)
    }

    /// [`DeviceMesh::submesh`] with the dims named.
    pub fn submesh_by_names(&self, rank: usize, names: &[&str]) -> Result<DeviceMesh> {
        let axes = names
            .iter()
            .map(|n| self.dim_index(n))
            .collect::<Result<Vec<_>>>()?;
        self.submesh(rank, &axes)
    }

    /// Joins meshes cut from one root mesh into the mesh over all their dims, in the order given
    /// (e.g. a data-parallel mesh and a tensor-parallel mesh into the mesh a parameter's full
    /// layout lives on). The meshes must span disjoint root dims and agree on where the root is
    /// cut on the dims none of them spans.
    pub fn concatenate(meshes: &[DeviceMesh]) -> Result<DeviceMesh> {
        let Some(first) = meshes.first() else {
            return Err(bad("concatenate needs at least one mesh"));
        };
        if meshes.len() == 1 {
            return Ok(first.clone());
        }
        let view = |m: &DeviceMesh| -> (DeviceMesh, Vec<usize>, Vec<Option<usize>>) {
            match &m.origin {
                None => (m.clone(), (0..m.ndim()).collect(), vec![None; m.ndim()]),
                Some(o) => {
                    let mut fixed = vec![None; o.root.ndim()];
                    let others = (0..o.root.ndim()).filter(|a| !o.axes.contains(a));
                    for (a, &c) in others.zip(&o.fixed) {
                        fixed[a] = Some(c);
                    }
                    (o.root.clone(), o.axes.clone(), fixed)
                }
            }
        };
        let (root, _, _) = view(first);
        let mut axes: Vec<usize> = Vec::new();
        let mut cut: Vec<Option<usize>> = vec![None; root.ndim()];
        let mut names: Option<Vec<String>> = Some(Vec::new());
        for m in meshes {
            let (r, m_axes, m_fixed) = view(m);
            if r != root {
                return Err(bad("meshes to concatenate must be cut from one root mesh"));
            }
            for &a in &m_axes {
                if axes.contains(&a) {
                    return Err(bad(format!("root dim {a} appears in two meshes")));
                }
                axes.push(a);
            }
            names = match (names, m.dim_names()) {
                (Some(mut acc), Some(n)) => {
                    acc.extend(n.iter().cloned());
                    Some(acc)
                }
                _ => None,
            };
            for (a, f) in m_fixed.into_iter().enumerate() {
                if let Some(c) = f {
                    match cut[a] {
                        Some(prev) if prev != c => {
                            return Err(bad(format!(
                                "the meshes are cut at different coordinates ({prev} and {c}) of root dim {a}"
                            )))
                        }
                        _ => cut[a] = Some(c),
                    }
                }
            }
        }
        let others: Vec<usize> = (0..root.ndim()).filter(|a| !axes.contains(a)).collect();
        let mut base = vec![0; root.ndim()];
        for &a in &others {
            base[a] = cut[a].ok_or_else(|| bad(format!("root dim {a} has no cut coordinate")))?;
        }
        let ranks = root.ranks_through(&base, &axes);
        let shape: Vec<usize> = axes.iter().map(|&a| root.shape[a]).collect();
        let mut out = DeviceMesh::new(&shape, ranks)?;
        if let Some(n) = names {
            out.dim_names = Some(n);
        }
        let is_whole_root = others.is_empty() && axes.iter().enumerate().all(|(i, &a)| i == a);
        if !is_whole_root {
            out.origin = Some(Box::new(Origin {
                fixed: others.iter().map(|&a| base[a]).collect(),
                root,
                axes,
            }));
        }
        Ok(out)
    }
}

fn coords_without(coords: &[usize], axes: &[usize]) -> Vec<usize> {
    coords
        .iter()
        .enumerate()
        .filter(|(a, _)| !axes.contains(a))
        .map(|(_, &c)| c)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn construction_checks_shape_ranks_and_names() {
        assert!(DeviceMesh::new(&[], vec![]).is_err());
        assert!(DeviceMesh::new(&[2, 0], vec![]).is_err());
        assert!(DeviceMesh::new(&[2, 2], vec![0, 1, 2]).is_err());
        assert!(DeviceMesh::new(&[2, 2], vec![0, 1, 2, 2]).is_err());
        let m = DeviceMesh::contiguous(&[2, 3]).unwrap();
        assert!(m.clone().with_dim_names(&["a"]).is_err());
        assert!(m.clone().with_dim_names(&["a", "a"]).is_err());
        assert!(m.clone().with_dim_names(&["a", ""]).is_err());
        let m = m.with_dim_names(&["a", "b"]).unwrap();
        assert_eq!(m.dim_index("b").unwrap(), 1);
        assert!(m.dim_index("c").is_err());
        assert_eq!(m.size(), 6);
    }

    #[test]
    fn coordinates_round_trip_in_row_major_order() {
        let m = DeviceMesh::new(&[2, 3], vec![10, 11, 12, 13, 14, 15]).unwrap();
        assert_eq!(m.coords_of(14), Some(vec![1, 1]));
        assert_eq!(m.rank_at(&[1, 2]).unwrap(), 15);
        assert_eq!(m.coords_of(3), None);
        assert!(m.rank_at(&[2, 0]).is_err());
        assert!(m.rank_at(&[0]).is_err());
    }

    #[test]
    fn oversized_shapes_are_refused_before_allocating() {
        // 2^40 ranks would allocate 8 TiB; SIZE_MAX used to panic (capacity overflow); a
        // product that overflows in the middle; the largest mesh allowed still builds.
        for shape in [
            vec![1 << 40],
            vec![1 << 30],
            vec![usize::MAX],
            vec![1 << 33, 1 << 33],
            vec![MAX_MESH_RANKS, 2],
        ] {
            match DeviceMesh::contiguous(&shape) {
                Err(HsdpError::InvalidMesh(m)) => assert!(m.contains("mesh size limit"), "{m}"),
                other => panic!("{shape:?}: {other:?}"),
            }
        }
        assert_eq!(
            DeviceMesh::contiguous(&[MAX_MESH_RANKS]).unwrap().size(),
            MAX_MESH_RANKS
        );
    }

    #[test]
    fn one_d_mesh_groups() {
        let m = DeviceMesh::contiguous(&[4]).unwrap();
        assert_eq!(m.rank_list_for_axes(2, &[0]).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(m.rank_list_for_axes(2, &[]).unwrap(), vec![2]);
        assert_eq!(
            m.split_rank_lists_for_axes(&[0]).unwrap(),
            vec![vec![0, 1, 2, 3]]
        );
        assert_eq!(
            m.split_rank_lists_for_axes(&[]).unwrap(),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
    }

    #[test]
    fn two_d_mesh_groups_follow_the_layout() {
        // Replicate × shard, 2 × 4.
        let m = DeviceMesh::contiguous(&[2, 4]).unwrap();
        assert_eq!(m.rank_list_for_axes(6, &[1]).unwrap(), vec![4, 5, 6, 7]);
        assert_eq!(m.rank_list_for_axes(6, &[0]).unwrap(), vec![2, 6]);
        assert_eq!(
            m.rank_list_for_axes(6, &[0, 1]).unwrap(),
            (0..8).collect::<Vec<_>>()
        );
        // Axes order decides the list order: axis 1 slowest here.
        assert_eq!(
            m.rank_list_for_axes(6, &[1, 0]).unwrap(),
            vec![0, 4, 1, 5, 2, 6, 3, 7]
        );
        assert_eq!(
            m.split_rank_lists_for_axes(&[1]).unwrap(),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        // A permuted rank layout changes the groups, not the math.
        let p = DeviceMesh::new(&[2, 2], vec![0, 2, 1, 3]).unwrap();
        assert_eq!(
            p.split_rank_lists_for_axes(&[1]).unwrap(),
            vec![vec![0, 2], vec![1, 3]]
        );
        assert_eq!(
            p.split_rank_lists_for_axes(&[0]).unwrap(),
            vec![vec![0, 1], vec![2, 3]]
        );
        assert!(m.rank_list_for_axes(8, &[0]).is_err());
        assert!(m.rank_list_for_axes(0, &[2]).is_err());
        assert!(m.rank_list_for_axes(0, &[1, 1]).is_err());
    }

    #[test]
    fn three_d_mesh_split_over_two_axes() {
        let m = DeviceMesh::contiguous(&[2, 2, 2]).unwrap();
        assert_eq!(
            m.split_rank_lists_for_axes(&[0, 2]).unwrap(),
            vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
        );
        assert_eq!(m.rank_list_for_axes(7, &[0, 2]).unwrap(), vec![2, 3, 6, 7]);
    }

    #[test]
    fn submeshes_concatenate_back_to_the_root() {
        let root = DeviceMesh::contiguous(&[2, 2])
            .unwrap()
            .with_dim_names(&["dp", "tp"])
            .unwrap();
        for rank in 0..4 {
            let dp = root.submesh_by_names(rank, &["dp"]).unwrap();
            let tp = root.submesh_by_names(rank, &["tp"]).unwrap();
            let both = DeviceMesh::concatenate(&[dp.clone(), tp.clone()]).unwrap();
            assert_eq!(both, root, "rank {rank}");
            let swapped = DeviceMesh::concatenate(&[tp, dp]).unwrap();
            assert_eq!(swapped.ranks(), &[0, 2, 1, 3]);
            assert_eq!(
                swapped.dim_names().unwrap(),
                &["tp".to_string(), "dp".to_string()]
            );
        }
    }

    #[test]
    fn concatenation_keeps_the_cut_of_unspanned_dims() {
        let root = DeviceMesh::contiguous(&[2, 2, 2]).unwrap();
        // Rank 5 = coords (1, 0, 1): dims 0 and 2 through it, cut at dim 1 = 0.
        let a = root.submesh(5, &[0]).unwrap();
        let c = root.submesh(5, &[2]).unwrap();
        let ac = DeviceMesh::concatenate(&[a.clone(), c]).unwrap();
        assert_eq!(ac.shape(), &[2, 2]);
        assert_eq!(ac.ranks(), &[0, 1, 4, 5]);
        // A sub-mesh of a sub-mesh still knows the root.
        let plane = root.submesh(5, &[1, 2]).unwrap();
        let line = plane.submesh(5, &[0]).unwrap();
        assert_eq!(line.ranks(), &[5, 7]);
        assert_eq!(
            DeviceMesh::concatenate(&[a.clone(), line]).unwrap().ranks(),
            &[1, 3, 5, 7]
        );
        // Cut elsewhere: rank 2 = (0, 1, 0) cuts dim 1 at 1, rank 5 at 0.
        let other = root.submesh(2, &[2]).unwrap();
        assert!(DeviceMesh::concatenate(&[a.clone(), other]).is_err());
        // Overlapping dims, different roots.
        assert!(DeviceMesh::concatenate(&[a.clone(), a.clone()]).is_err());
        let unrelated = DeviceMesh::contiguous(&[2]).unwrap();
        assert_eq!(
            root.submesh(5, &[0])
                .unwrap()
                .global_split_rank_lists_for_axes(&[0])
                .unwrap(),
            root.split_rank_lists_for_axes(&[0]).unwrap()
        );
        assert!(DeviceMesh::concatenate(&[a, unrelated]).is_err());
        assert!(DeviceMesh::concatenate(&[]).is_err());
    }

    fn mesh_strategy() -> impl Strategy<Value = DeviceMesh> {
        proptest::collection::vec(1usize..4, 1..4).prop_flat_map(|shape| {
            let n: usize = shape.iter().product();
            Just((0..n).collect::<Vec<_>>())
                .prop_shuffle()
                .prop_map(move |ranks| DeviceMesh::new(&shape, ranks).unwrap())
        })
    }

    proptest! {
        #[test]
        fn split_lists_partition_the_mesh_into_rank_groups(
            mesh in mesh_strategy(),
            mask in 0u8..16,
        ) {
            let axes: Vec<usize> = (0..mesh.ndim()).filter(|a| mask & (1 << a) != 0).collect();
            let lists = mesh.split_rank_lists_for_axes(&axes).unwrap();
            let group: usize = axes.iter().map(|&a| mesh.shape()[a]).product();
            let mut all: Vec<usize> = lists.iter().flatten().copied().collect();
            all.sort_unstable();
            let mut expect = mesh.ranks().to_vec();
            expect.sort_unstable();
            prop_assert_eq!(all, expect);
            for list in &lists {
                prop_assert_eq!(list.len(), group);
                for &r in list {
                    prop_assert_eq!(&mesh.rank_list_for_axes(r, &axes).unwrap(), list);
                    // Members differ only on `axes`.
                    let c0 = mesh.coords_of(list[0]).unwrap();
                    let c = mesh.coords_of(r).unwrap();
                    for a in 0..mesh.ndim() {
                        if !axes.contains(&a) {
                            prop_assert_eq!(c[a], c0[a]);
                        }
                    }
                }
            }
        }
    }
}
