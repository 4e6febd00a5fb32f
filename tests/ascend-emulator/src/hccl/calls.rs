//! The collective and send/recv entry points with their call-time validation (the rules of
//! CANN's `op_base.cc`), and the enums decoded from their raw values.

use super::*;

pub(super) fn bytes(elems: u64, es: usize) -> Result<usize, HcclResult> {
    elems
        .checked_mul(es as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or(HCCL_E_PARA)
}

/// `len` bytes at `ptr` inside one device allocation; nothing when `len` is 0.
pub(super) fn device_buf(ptr: *const c_void, len: usize) -> Result<Option<Range>, HcclResult> {
    if len == 0 {
        return Ok(None);
    }
    if ptr.is_null() {
        return Err(HCCL_E_PTR);
    }
    memory::device_range(ptr as usize, len)
        .map(Some)
        .ok_or(HCCL_E_PARA)
}

pub(super) fn nonnull(count: u64, ptrs: &[*const c_void]) -> Result<(), HcclResult> {
    if count > 0 && ptrs.iter().any(|p| p.is_null()) {
        return Err(HCCL_E_PTR);
    }
    Ok(())
}

/// HCCL has no default stream: CANN rejects a null one with `HCCL_E_PTR`.
pub(super) fn stream_of(h: *mut c_void) -> Result<Arc<Stream>, HcclResult> {
    if h.is_null() {
        return Err(HCCL_E_PTR);
    }
    stream::resolve(h).map_err(|_| HCCL_E_PARA)
}

/// The common path of every collective but all-to-all-v. As in CANN, a count of 0 returns
/// success before any check and takes no part in the sequence (it is not a collective at all).
#[allow(clippy::too_many_arguments)]
pub(super) fn collective(
    kind: Kind,
    comm: *mut c_void,
    stream: *mut c_void,
    send: *const c_void,
    recv: *const c_void,
    count: u64,
    dtype: u32,
    op: Option<u32>,
    root: u32,
) -> Result<(), HcclResult> {
    if count == 0 {
        return Ok(());
    }
    let c = comm_of(comm)?;
    nonnull(count, &[send, recv])?;
    let dtype = dtype_from_raw(dtype)?;
    let op = op.map(op_from_raw).transpose()?;
    let n = u64::from(c.shared.n);
    if root >= c.shared.n {
        return Err(HCCL_E_PARA);
    }
    let es = dtype.size();
    let per_rank = bytes(count, es)?;
    let all_ranks = bytes(count.checked_mul(n).ok_or(HCCL_E_PARA)?, es)?;
    let (send_len, recv_len) = match kind {
        Kind::AllReduce | Kind::Broadcast => (per_rank, per_rank),
        Kind::ReduceScatter => (all_ranks, per_rank),
        Kind::AllGather => (per_rank, all_ranks),
        Kind::AlltoAll => (all_ranks, all_ranks),
        Kind::AlltoAllV => unreachable!("has its own path"),
    };
    let send = device_buf(send, send_len)?;
    let recv = device_buf(recv, recv_len)?;
    let s = stream_of(stream)?;
    let desc = Desc {
        kind,
        count,
        dtype,
        op,
        root,
        send,
        recv,
        v: None,
    };
    submit_coll(&c, s, desc);
    Ok(())
}

pub(super) fn submit_coll(c: &Comm, s: Arc<Stream>, desc: Desc) {
    let seq = {
        let mut q = lock(&c.seqs);
        q.coll += 1;
        q.coll
    };
    submit(
        s,
        Op::Coll {
            shared: c.shared.clone(),
            rank: c.rank,
            seq,
            desc,
        },
    );
}

#[no_mangle]
pub unsafe extern "C" fn HcclAllReduce(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    count: u64,
    data_type: u32,
    op: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAllReduce", || {
        collective(
            Kind::AllReduce,
            comm,
            stream,
            send_buf,
            recv_buf,
            count,
            data_type,
            Some(op),
            0,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclReduceScatter(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    recv_count: u64,
    data_type: u32,
    op: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclReduceScatter", || {
        let k = Kind::ReduceScatter;
        collective(
            k,
            comm,
            stream,
            send_buf,
            recv_buf,
            recv_count,
            data_type,
            Some(op),
            0,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclAllGather(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    send_count: u64,
    data_type: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAllGather", || {
        collective(
            Kind::AllGather,
            comm,
            stream,
            send_buf,
            recv_buf,
            send_count,
            data_type,
            None,
            0,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclBroadcast(
    buf: *mut c_void,
    count: u64,
    data_type: u32,
    root: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclBroadcast", || {
        collective(
            Kind::Broadcast,
            comm,
            stream,
            buf,
            buf,
            count,
            data_type,
            None,
            root,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclAlltoAll(
    send_buf: *const c_void,
    send_count: u64,
    send_type: u32,
    recv_buf: *const c_void,
    recv_count: u64,
    recv_type: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAlltoAll", || {
        if send_count == 0 && recv_count == 0 {
            return Ok(());
        }
        nonnull(1, &[send_buf, recv_buf])?;
        if send_type != recv_type || send_count != recv_count {
            return Err(HCCL_E_PARA);
        }
        collective(
            Kind::AlltoAll,
            comm,
            stream,
            send_buf,
            recv_buf,
            send_count,
            send_type,
            None,
            0,
        )
    })
}

/// # Safety
/// The four count/displacement pointers each point at `nRanks` `uint64_t`s.
pub(super) unsafe fn read_counts(p: *const c_void, n: usize) -> Vec<u64> {
    // SAFETY: caller's contract (checked non-null).
    unsafe { std::slice::from_raw_parts(p.cast::<u64>(), n) }.to_vec()
}

/// Bytes from the buffer start to the end of the furthest non-empty block.
pub(super) fn extent(counts: &[u64], displs: &[u64], es: usize) -> Result<usize, HcclResult> {
    let mut end = 0u64;
    for (&c, &d) in counts.iter().zip(displs) {
        if c > 0 {
            end = end.max(d.checked_add(c).ok_or(HCCL_E_PARA)?);
        }
    }
    bytes(end, es)
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn HcclAlltoAllV(
    send_buf: *const c_void,
    send_counts: *const c_void,
    sdispls: *const c_void,
    send_type: u32,
    recv_buf: *const c_void,
    recv_counts: *const c_void,
    rdispls: *const c_void,
    recv_type: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAlltoAllV", || {
        let c = comm_of(comm)?;
        if [send_counts, sdispls, recv_counts, rdispls]
            .iter()
            .any(|p| p.is_null())
        {
            return Err(HCCL_E_PTR);
        }
        if send_type != recv_type {
            return Err(HCCL_E_PARA);
        }
        let dtype = dtype_from_raw(send_type)?;
        let n = c.shared.n as usize;
        // SAFETY: header contract, checked non-null.
        let v = unsafe {
            VCounts {
                scounts: read_counts(send_counts, n),
                sdispls: read_counts(sdispls, n),
                rcounts: read_counts(recv_counts, n),
                rdispls: read_counts(rdispls, n),
            }
        };
        let es = dtype.size();
        let send_len = extent(&v.scounts, &v.sdispls, es)?;
        let recv_len = extent(&v.rcounts, &v.rdispls, es)?;
        nonnull(send_len as u64, &[send_buf])?;
        nonnull(recv_len as u64, &[recv_buf])?;
        let send = device_buf(send_buf, send_len)?;
        let recv = device_buf(recv_buf, recv_len)?;
        let s = stream_of(stream)?;
        let desc = Desc {
            kind: Kind::AlltoAllV,
            count: 0,
            dtype,
            op: None,
            root: 0,
            send,
            recv,
            v: Some(v),
        };
        submit_coll(&c, s, desc);
        Ok(())
    })
}

/// Count 0 succeeds at once (as in CANN). A rank may send to itself: inside a group that pairs
/// with its own receive; outside one it waits for a receive queued behind it, and times out.
pub(super) fn p2p(
    comm: *mut c_void,
    stream: *mut c_void,
    buf: *const c_void,
    count: u64,
    dtype: u32,
    peer: u32,
    is_send: bool,
) -> Result<(), HcclResult> {
    if count == 0 {
        return Ok(());
    }
    let c = comm_of(comm)?;
    nonnull(count, &[buf])?;
    let dtype = dtype_from_raw(dtype)?;
    if peer >= c.shared.n {
        return Err(HCCL_E_PARA);
    }
    let buf = device_buf(buf, bytes(count, dtype.size())?)?;
    let s = stream_of(stream)?;
    let desc = PDesc { buf, count, dtype };
    let shared = c.shared.clone();
    let mut q = lock(&c.seqs);
    let op = if is_send {
        let seq = &mut q.send[peer as usize];
        *seq += 1;
        Op::Send {
            shared,
            key: (c.rank, peer, *seq),
            desc,
        }
    } else {
        let seq = &mut q.recv[peer as usize];
        *seq += 1;
        Op::Recv {
            shared,
            key: (peer, c.rank, *seq),
            desc,
        }
    };
    drop(q);
    submit(s, op);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn HcclSend(
    send_buf: *mut c_void,
    count: u64,
    data_type: u32,
    dest_rank: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclSend", || {
        p2p(comm, stream, send_buf, count, data_type, dest_rank, true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclRecv(
    recv_buf: *mut c_void,
    count: u64,
    data_type: u32,
    src_rank: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclRecv", || {
        p2p(comm, stream, recv_buf, count, data_type, src_rank, false)
    })
}

/// An `HcclDataType`; INT128 is a valid enum value the emulator (like several CANN releases)
/// does not support.
pub(super) fn dtype_from_raw(v: u32) -> Result<DType, HcclResult> {
    use DType::*;
    Ok(match v {
        0 => I8,
        1 => I16,
        2 => I32,
        3 => F16,
        4 => F32,
        5 => I64,
        6 => U64,
        7 => U8,
        8 => U16,
        9 => U32,
        10 => F64,
        11 => BF16,
        HCCL_DATA_TYPE_INT128 => return Err(HCCL_E_NOT_SUPPORT),
        _ => return Err(HCCL_E_PARA),
    })
}

pub(super) fn op_from_raw(v: u32) -> Result<ReduceOp, HcclResult> {
    match v {
        HCCL_REDUCE_SUM => Ok(ReduceOp::Sum),
        HCCL_REDUCE_PROD => Ok(ReduceOp::Prod),
        HCCL_REDUCE_MAX => Ok(ReduceOp::Max),
        HCCL_REDUCE_MIN => Ok(ReduceOp::Min),
        _ => Err(HCCL_E_PARA),
    }
}

#[cfg(test)]
mod enum_tests {
    use super::*;

    #[test]
    fn enums() {
        assert_eq!(dtype_from_raw(12), Err(HCCL_E_NOT_SUPPORT));
        assert_eq!(dtype_from_raw(13), Err(HCCL_E_PARA));
        assert_eq!(dtype_from_raw(11).map(DType::size), Ok(2));
        assert_eq!(op_from_raw(4), Err(HCCL_E_PARA));
    }
}
