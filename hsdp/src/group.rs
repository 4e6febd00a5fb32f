//! Process groups: sub-communicators made collectively through
//! [`Platform::comm_split`](hprt_platform::Platform::comm_split) and cached by their sorted rank
//! list. A group of one rank is the explicit no-op group: it has no
//! communicator and every collective over it is a local copy (or nothing).

use hprt_platform::sync::lock;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use hprt_platform::{Communicator, PlatformHandle};

use crate::error::{HsdpError, Result};
use crate::mesh::DeviceMesh;

/// One rank's membership in a group of ranks that reduce or gather together.
///
/// The rank of this member within the group (its shard index) is its position in the sorted
/// global rank list.
#[derive(Clone, Debug)]
pub struct ProcessGroup {
    name: String,
    ranks: Vec<usize>,
    rank: usize,
    comm: Option<Communicator>,
}

impl ProcessGroup {
    /// The group of `global_rank` alone: collectives over it do nothing across ranks.
    pub fn noop(name: &str, global_rank: usize) -> Self {
        ProcessGroup {
            name: format!("{name}_invalid"),
            ranks: vec![global_rank],
            rank: 0,
            comm: None,
        }
    }

    /// `{name}` for a real group, `{name}_invalid` for the no-op group (hyper_parallel's naming).
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// Whether this is the group of one rank (no communicator, nothing to exchange).
    pub fn is_noop(&self) -> bool {
        self.comm.is_none()
    }
    /// This member's rank within the group.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The members' global ranks, sorted.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    pub fn communicator(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }
}

/// The sub-communicators one rank made, keyed by sorted rank list, so a group asked for twice
/// (by many parameters) is split once. Communicators are released when the last handle to them
/// (the cache's or a [`ProcessGroup`]'s) is dropped.
///
/// Every method that may split is collective over the world communicator: all ranks call it in
/// the same order with the same arguments, as
/// [`Platform::comm_split`](hprt_platform::Platform::comm_split) requires.
pub struct GroupCache {
    platform: PlatformHandle,
    world: Communicator,
    /// Every list ever split, whether or not this rank is in it (`None` then), so that all ranks
    /// make the same decision about whether a split is needed.
    entries: Mutex<HashMap<Vec<usize>, Option<Communicator>>>,
    splits: Mutex<usize>,
}

impl GroupCache {
    /// A cache over `world`, whose ranks are the global ranks meshes name.
    pub fn new(platform: impl Into<PlatformHandle>, world: Communicator) -> Self {
        GroupCache {
            platform: platform.into(),
            world,
            entries: Mutex::new(HashMap::new()),
            splits: Mutex::new(0),
        }
    }

    /// The platform the cache splits on; parameters built over the cache keep a clone of it.
    pub fn platform(&self) -> &PlatformHandle {
        &self.platform
    }
    /// This rank in the world communicator.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }
    pub fn world_size(&self) -> usize {
        self.world.world()
    }
    pub fn world(&self) -> &Communicator {
        &self.world
    }
    /// How many `comm_split` calls this cache made (cache hits make none).
    pub fn split_calls(&self) -> usize {
        *lock(&self.splits)
    }

    /// The group among `rank_lists` (disjoint lists of world ranks) that holds this rank, or the
    /// no-op group when none does or its list has one rank. Collective over the world.
    pub fn group(&self, name: &str, rank_lists: &[Vec<usize>]) -> Result<ProcessGroup> {
        let me = self.rank();
        let world = self.world_size();
        let mut seen = HashSet::new();
        let mut sorted: Vec<Vec<usize>> = Vec::with_capacity(rank_lists.len());
        for list in rank_lists {
            let mut l = list.clone();
            l.sort_unstable();
            for &r in &l {
                if r >= world {
                    return Err(HsdpError::RankNotInMesh {
                        rank: r,
                        what: format!("the world of {world} ranks"),
                    });
                }
                if !seen.insert(r) {
                    return Err(HsdpError::InvalidMesh(format!(
                        "rank {r} appears in two of the rank lists {rank_lists:?}"
                    )));
                }
            }
            sorted.push(l);
        }
        let multi: Vec<Vec<usize>> = sorted.into_iter().filter(|l| l.len() > 1).collect();
        let mut entries = lock(&self.entries);
        let missing: Vec<Vec<usize>> = multi
            .iter()
            .filter(|l| !entries.contains_key(*l))
            .cloned()
            .collect();
        if !missing.is_empty() {
            let comm = self.platform.comm_split(&self.world, &missing)?;
            *lock(&self.splits) += 1;
            for l in &missing {
                let mine = l.contains(&me);
                entries.insert(l.clone(), if mine { comm.clone() } else { None });
            }
        }
        let Some(list) = multi.iter().find(|l| l.contains(&me)) else {
            return Ok(ProcessGroup::noop(name, me));
        };
        let comm =
            entries.get(list).cloned().flatten().ok_or_else(|| {
                HsdpError::InvalidMesh(format!("no communicator for ranks {list:?}"))
            })?;
        Ok(ProcessGroup {
            name: name.to_string(),
            rank: list
                .iter()
                .position(|&r| r == me)
                .expect("list holds this rank"),
            ranks: list.clone(),
            comm: Some(comm),
        })
    }

    /// This rank's group along `axes` of `mesh` (collective over the world; for a sub-mesh
    /// the split covers its whole root mesh, see
    /// [`DeviceMesh::global_split_rank_lists_for_axes`]).
    pub fn group_along(
        &self,
        name: &str,
        mesh: &DeviceMesh,
        axes: &[usize],
    ) -> Result<ProcessGroup> {
        let lists = mesh.global_split_rank_lists_for_axes(axes)?;
        self.group(name, &lists)
    }
}
