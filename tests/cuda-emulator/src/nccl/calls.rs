//! The collective, point-to-point and group entry points, each validated before it queues an
//! operation.

use super::*;

#[allow(clippy::too_many_arguments)]
pub(super) fn collective(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: Option<c_int>,
    root: Option<c_int>,
    h: *mut c_void,
    hstream: *mut c_void,
) -> Result<(), NcclResult> {
    let comm = comm(h)?;
    let size = dtype_of(dtype)?.size();
    if let Some(op) = op {
        op_of(op)?;
    }
    if root.is_some_and(|r| r < 0 || r as usize >= comm.clique.world) {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("root {root:?} of {} ranks", comm.clique.world),
        );
    }
    let s = stream_for(&comm, hstream)?;
    let world = comm.clique.world;
    let (send_n, recv_n) = match kind {
        Kind::AllReduce | Kind::Broadcast => (count, count),
        Kind::ReduceScatter => (count * world, count),
        Kind::AllGather => (count, count * world),
    };
    let needs_send = kind != Kind::Broadcast || root == Some(comm.rank as c_int);
    let mut held = Vec::new();
    if count > 0 {
        if needs_send {
            held.push(device_range(send, send_n * size, "send")?);
        }
        held.push(device_range(recv, recv_n * size, "recv")?);
    }
    let desc = Desc {
        kind,
        count,
        dtype,
        op,
        root,
    };
    let seq = register(&comm, desc);
    submit(
        s,
        Op::Collective {
            comm,
            seq,
            send: send as usize,
            recv: recv as usize,
            held,
        },
    );
    Ok(())
}

#[no_mangle]
pub extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclAllReduce", || {
        collective(
            Kind::AllReduce,
            send,
            recv,
            count,
            dtype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recv_count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclReduceScatter", || {
        collective(
            Kind::ReduceScatter,
            send,
            recv,
            recv_count,
            dtype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    send_count: usize,
    dtype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclAllGather", || {
        collective(
            Kind::AllGather,
            send,
            recv,
            send_count,
            dtype,
            None,
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclBroadcast", || {
        collective(
            Kind::Broadcast,
            send,
            recv,
            count,
            dtype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

pub(super) fn peer_of(comm: &Comm, peer: c_int) -> Result<usize, NcclResult> {
    if peer < 0 || peer as usize >= comm.clique.world {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("peer {peer} of {} ranks", comm.clique.world),
        );
    }
    Ok(peer as usize)
}

#[no_mangle]
pub extern "C" fn ncclSend(
    send: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    h: *mut c_void,
    hstream: *mut c_void,
) -> NcclResult {
    let p2p = PeerCall {
        name: "ncclSend",
        what: "send",
        buf: send,
        count,
        dtype,
        peer,
    };
    p2p.queue(h, hstream, |comm, peer, held| Op::Send {
        comm,
        peer,
        src: send as usize,
        count,
        dtype,
        held,
    })
}

#[no_mangle]
pub extern "C" fn ncclRecv(
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    h: *mut c_void,
    hstream: *mut c_void,
) -> NcclResult {
    let p2p = PeerCall {
        name: "ncclRecv",
        what: "recv",
        buf: recv,
        count,
        dtype,
        peer,
    };
    p2p.queue(h, hstream, |comm, peer, held| Op::Recv {
        comm,
        peer,
        dst: recv as usize,
        count,
        dtype,
        held,
    })
}

/// What ncclSend and ncclRecv check alike; they differ only in the op they queue.
struct PeerCall {
    name: &'static str,
    what: &'static str,
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
}

impl PeerCall {
    fn queue(
        self,
        h: *mut c_void,
        hstream: *mut c_void,
        op: impl FnOnce(Arc<Comm>, usize, Held) -> Op,
    ) -> NcclResult {
        nccl_entry(self.name, || {
            let comm = comm(h)?;
            let size = dtype_of(self.dtype)?.size();
            let peer = peer_of(&comm, self.peer)?;
            let s = stream_for(&comm, hstream)?;
            if self.count == 0 {
                return Ok(());
            }
            let held = device_range(self.buf, self.count * size, self.what)?;
            submit(s, op(comm, peer, held));
            Ok(())
        })
    }
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    nccl_entry("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().0 += 1);
        Ok(())
    })
}

/// Queues the held operations, per stream in call order except that sends go first. A failing
/// group end (an injected fault) still closes the group, dropping its operations, as NCCL
/// resets its group state when a group fails.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    let fault = state::FAULTS.hit("ncclGroupEnd");
    state::nccl_guard(|| {
        let ops = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.0 == 0 {
                return None;
            }
            g.0 -= 1;
            Some(if g.0 == 0 {
                std::mem::take(&mut g.1)
            } else {
                Vec::new()
            })
        });
        let Some(ops) = ops else {
            return fail(NCCL_INVALID_USAGE, "ncclGroupEnd without ncclGroupStart");
        };
        if let Some(code) = fault {
            return fail(code, "injected fault (HP_EMU_FAULTS)");
        }
        let mut per_stream: Vec<(Arc<Stream>, Vec<Op>)> = Vec::new();
        for (s, op) in ops {
            match per_stream.iter_mut().find(|(t, _)| Arc::ptr_eq(t, &s)) {
                Some((_, v)) => v.push(op),
                None => per_stream.push((s, vec![op])),
            }
        }
        for (s, mut ops) in per_stream {
            ops.sort_by_key(|op| !op.is_send());
            s.enqueue(Box::new(move || {
                let mut first = Ok(());
                for op in ops {
                    if let Err(e) = op.run() {
                        first = first.and(Err(e));
                    }
                }
                first
            }));
        }
        Ok(())
    })
}
