//! Communicator helpers written over [`Backend`] collectives, for the driver backends (NCCL and
//! HCCL lack or differ in these, so each backend used to spell them out).

use std::hash::{DefaultHasher, Hash, Hasher};

use crate::backend::Backend;
use crate::collective::Collective;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, ErrorKind, Result};
use crate::handle::{CopyKind, UniqueId};
use crate::place::{Memory, Place};

/// All-gathers `mine` (the same length on every rank of `comm`, of `world` ranks) through
/// device memory; returns every rank's bytes in rank order. Blocks.
pub(crate) fn host_all_gather<B: Backend>(
    b: &B,
    comm: &B::Comm,
    world: usize,
    mine: &[u8],
    stream: &B::Stream,
) -> Result<Vec<u8>> {
    let n = mine.len();
    let (send, _) = b.alloc_device(n)?;
    let (recv, _) = b.alloc_device(n * world)?;
    let (staging, host) = b.alloc_pinned(n * world)?;
    // SAFETY: the staging buffer holds n * world >= n bytes and nothing else uses it yet.
    unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr(), host as *mut u8, n) };
    b.copy(
        CopyKind::HostToDevice,
        Place::new(Memory::Device(send.clone()), 0),
        Place::new(Memory::Pinned(staging.clone()), 0),
        n,
        stream,
    )?;
    let op = Collective::AllGather {
        send: Some(Place::new(send, 0)),
        recv: Some(Place::new(recv.clone(), 0)),
        count: n,
        dtype: DType::U8,
    };
    b.collective(comm, op, stream)?;
    b.copy(
        CopyKind::DeviceToHost,
        Place::new(Memory::Pinned(staging.clone()), 0),
        Place::new(Memory::Device(recv), 0),
        n * world,
        stream,
    )?;
    b.synchronize_stream(stream)?;
    let mut out = vec![0u8; n * world];
    // SAFETY: the stream finished writing the staging buffer, which `staging` keeps alive.
    unsafe { std::ptr::copy_nonoverlapping(host as *const u8, out.as_mut_ptr(), out.len()) };
    drop(staging);
    Ok(out)
}

/// `comm_split` without a driver split call (`ncclCommSplit` needs NCCL 2.18; HCCL's subset has
/// none): each list's first rank makes a unique id; one all-gather over the parent (`gather`)
/// hands every rank its leader's id, with a digest of the lists so ranks that passed different
/// lists are caught; each rank then joins its list's communicator (`init(id, rank, size)`).
/// `id_bytes` is the size of the backend's unique id.
pub(crate) fn split_by_leader<B: Backend>(
    b: &B,
    id_bytes: usize,
    parent_rank: usize,
    world: usize,
    rank_lists: &[Vec<usize>],
    gather: impl FnOnce(&[u8]) -> Result<Vec<u8>>,
    init: impl FnOnce(&UniqueId, usize, usize) -> Result<B::Comm>,
) -> Result<Option<(B::Comm, usize, usize)>> {
    let digest = {
        let mut h = DefaultHasher::new();
        rank_lists.hash(&mut h);
        h.finish().to_le_bytes()
    };
    let here = rank_lists.iter().find_map(|list| {
        list.iter()
            .position(|&r| r == parent_rank)
            .map(|i| (list.clone(), i))
    });
    let block = id_bytes + digest.len();
    let mut mine = vec![0u8; block];
    if let Some((_, 0)) = &here {
        let id = b.unique_id()?.0;
        if id.len() != id_bytes {
            return Err(Error::new(
                ErrorKind::Internal,
                b.kind(),
                "comm_split",
                format!("a unique id has {} bytes, not {id_bytes}", id.len()),
            ));
        }
        mine[..id_bytes].copy_from_slice(&id);
    }
    mine[id_bytes..].copy_from_slice(&digest);
    let gathered = gather(&mine)?;
    for r in 0..world {
        if gathered[r * block + id_bytes..(r + 1) * block] != digest {
            return Err(Error::new(
                ErrorKind::Mismatch,
                b.kind(),
                "comm_split",
                format!("rank {r} passed different rank lists than rank {parent_rank}"),
            ));
        }
    }
    let Some((list, index)) = here else {
        return Ok(None);
    };
    let leader = list[0];
    let id = UniqueId(gathered[leader * block..leader * block + id_bytes].to_vec());
    let sub = init(&id, index, list.len())?;
    Ok(Some((sub, index, list.len())))
}

/// The barrier neither NCCL nor HCCL's subset has: an all-reduce of the communicator's scratch
/// word completes only once every rank reached it.
pub(crate) fn barrier_as_all_reduce<M>(scratch: M) -> Collective<Option<Place<M>>>
where
    M: Clone,
{
    Collective::AllReduce {
        send: Some(Place::new(scratch.clone(), 0)),
        recv: Some(Place::new(scratch, 0)),
        count: 1,
        dtype: DType::I32,
        op: ReduceOp::Sum,
    }
}

/// The place an `Avg` all-reduce or reduce-scatter over `world > 1` ranks leaves summed, for a
/// backend that reduces `Avg` as a sum and scales after: (place, element count, dtype).
pub(crate) fn avg_to_scale<M>(
    op: Collective<Option<Place<M>>>,
    world: usize,
) -> Option<(Place<M>, usize, DType)> {
    match op {
        Collective::AllReduce {
            recv: Some(recv),
            count,
            dtype,
            op: ReduceOp::Avg,
            ..
        }
        | Collective::ReduceScatter {
            recv: Some(recv),
            count,
            dtype,
            op: ReduceOp::Avg,
            ..
        } if world > 1 && count > 0 => Some((recv, count, dtype)),
        _ => None,
    }
}
