//! Collectives over HCCL, communicator lifetimes.

use super::*;

impl Drop for CommObj {
    fn drop(&mut self) {
        // SAFETY: we created this communicator.
        let _ = hccl(
            unsafe { self.shared.api.hccl.HcclCommDestroy(self.raw.sys()) }.0 as i32,
            "HcclCommDestroy",
        );
    }
}

pub(super) fn hccl_dtype(d: DType) -> HcclDataType {
    HcclDataType(match d {
        DType::I8 => 0,
        DType::I32 => 2,
        DType::F16 => 3,
        DType::F32 => 4,
        DType::I64 => 5,
        DType::U8 => 7,
        DType::F64 => 10,
        DType::BF16 => 11,
    })
}

pub(super) fn hccl_op(op: ReduceOp) -> HcclReduceOp {
    HcclReduceOp(match op {
        ReduceOp::Sum | ReduceOp::Avg => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    })
}

impl NpuBackend {
    pub(super) fn new_comm(
        &self,
        raw: result::Comm,
        rank: usize,
        world: usize,
    ) -> Result<Arc<CommObj>> {
        let scratch = Backend::alloc_device(self, 4)?.0;
        Ok(Arc::new(CommObj {
            shared: Arc::clone(&self.shared),
            raw,
            rank,
            world,
            scratch,
        }))
    }

    /// Queues `op` on `stream` ([`Backend::collective`]).
    pub(super) fn issue_collective(
        &self,
        comm: &Arc<CommObj>,
        op: Collective<Option<Place<Arc<MemObj>>>>,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        self.shared.bind()?;
        let h = &self.api().hccl;
        let op = match op {
            Collective::Barrier => auxil::comm::barrier_as_all_reduce(Arc::clone(&comm.scratch)),
            op => op,
        };
        let (c, s) = (comm.raw.sys(), stream.raw.sys());
        // SAFETY (every call below): places were bounds-checked for the extent HCCL touches;
        // handles are live; HCCL only queues the work on `s`.
        let (code, name) = unsafe {
            match &op {
                Collective::AllReduce {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => (
                    h.HcclAllReduce(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        hccl_op(*op),
                        c,
                        s,
                    ),
                    "HcclAllReduce",
                ),
                Collective::ReduceScatter {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => (
                    h.HcclReduceScatter(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        hccl_op(*op),
                        c,
                        s,
                    ),
                    "HcclReduceScatter",
                ),
                Collective::AllGather {
                    send,
                    recv,
                    count,
                    dtype,
                } => (
                    h.HcclAllGather(
                        ptr(send),
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        c,
                        s,
                    ),
                    "HcclAllGather",
                ),
                Collective::Broadcast {
                    buf,
                    count,
                    dtype,
                    root,
                } => (
                    h.HcclBroadcast(
                        ptr(buf),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *root as u32,
                        c,
                        s,
                    ),
                    "HcclBroadcast",
                ),
                Collective::AllToAll {
                    send,
                    recv,
                    count,
                    dtype,
                } => {
                    let dt = hccl_dtype(*dtype);
                    (
                        h.HcclAlltoAll(
                            ptr(send),
                            *count as u64,
                            dt,
                            ptr(recv),
                            *count as u64,
                            dt,
                            c,
                            s,
                        ),
                        "HcclAlltoAll",
                    )
                }
                Collective::AllToAllV {
                    send,
                    recv,
                    send_counts,
                    send_displs,
                    recv_counts,
                    recv_displs,
                    dtype,
                } => {
                    let v = |x: &[usize]| x.iter().map(|&n| n as u64).collect::<Vec<u64>>();
                    let (sc, sd, rc, rd) = (
                        v(send_counts),
                        v(send_displs),
                        v(recv_counts),
                        v(recv_displs),
                    );
                    let dt = hccl_dtype(*dtype);
                    (
                        h.HcclAlltoAllV(
                            ptr(send),
                            sc.as_ptr().cast(),
                            sd.as_ptr().cast(),
                            dt,
                            ptr(recv),
                            rc.as_ptr().cast(),
                            rd.as_ptr().cast(),
                            dt,
                            c,
                            s,
                        ),
                        "HcclAlltoAllV",
                    )
                }
                Collective::Send {
                    send,
                    count,
                    dtype,
                    peer,
                } => (
                    h.HcclSend(
                        ptr(send),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *peer as u32,
                        c,
                        s,
                    ),
                    "HcclSend",
                ),
                Collective::Recv {
                    recv,
                    count,
                    dtype,
                    peer,
                } => (
                    h.HcclRecv(
                        ptr(recv),
                        *count as u64,
                        hccl_dtype(*dtype),
                        *peer as u32,
                        c,
                        s,
                    ),
                    "HcclRecv",
                ),
                Collective::Barrier => unreachable!("issued as an all-reduce above"),
            }
        };
        hccl(code.0 as i32, name)?;
        for (place, _) in op.places(comm.world) {
            if let Some((m, _)) = place {
                m.used_on(stream.raw)?;
            }
        }
        match auxil::comm::avg_to_scale(op, comm.world) {
            Some((recv, count, dtype)) => {
                self.divide_on_stream(&recv, count, dtype, comm.world, stream)
            }
            None => Ok(()),
        }
    }
}
