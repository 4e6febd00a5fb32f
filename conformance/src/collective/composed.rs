//! Calls that share or reuse buffers: in place, with zero counts, and chained on one stream.

use super::reductions::Parts;
use super::*;

/// In place: all_reduce (send = recv), all_gather (send = recv + rank block) and reduce_scatter
/// (recv = send + rank block), all in one buffer.
pub(crate) fn in_place(p: &dyn Platform) -> Result<()> {
    const AR: [(DType, ReduceOp); 7] = [
        (DType::F32, ReduceOp::Sum),
        (DType::BF16, ReduceOp::Sum),
        (DType::I32, ReduceOp::Prod),
        (DType::F64, ReduceOp::Max),
        (DType::U8, ReduceOp::Min),
        (DType::F16, ReduceOp::Avg),
        (DType::I8, ReduceOp::Avg),
    ];
    const AG: [DType; 3] = [DType::F32, DType::I8, DType::F16];
    const RS: [(DType, ReduceOp); 3] = [
        (DType::F32, ReduceOp::Sum),
        (DType::I64, ReduceOp::Sum),
        (DType::BF16, ReduceOp::Max),
    ];
    for_worlds(&WORLDS, |world| {
        let mut ra = Arena::default();
        let mut plans = vec![RankPlan::default(); world];
        let mut parts = Parts::new(world);
        for (j, (dtype, op)) in AR.into_iter().enumerate() {
            let count = 100 * world + 1;
            let bytes = count * dtype.size();
            let off = ra.take(bytes);
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, Some(op), seed(9, world, j, r), count))
                .collect();
            let expected = reference::reduce(dtype, op, &refs(&inputs));
            for (r, plan) in plans.iter_mut().enumerate() {
                plan.regions.push(Region {
                    off,
                    len: bytes,
                    dtype,
                    expected: Some(expected.clone()),
                    label: format!("in-place all_reduce {dtype} {op} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllReduce {
                    send: At::Recv(off),
                    recv: At::Recv(off),
                    count,
                    dtype,
                    op,
                }));
                parts.push(r, off, inputs[r].clone());
            }
        }
        for (j, dtype) in AG.into_iter().enumerate() {
            let count = 41 + j;
            let blk = count * dtype.size();
            let off = ra.take(world * blk);
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(10, world, j, r), count))
                .collect();
            let gathered = Expected::exact(inputs.concat());
            for (r, plan) in plans.iter_mut().enumerate() {
                plan.regions.push(Region {
                    off,
                    len: world * blk,
                    dtype,
                    expected: Some(gathered.clone()),
                    label: format!("in-place all_gather {dtype} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllGather {
                    send: At::Recv(off + r * blk),
                    recv: At::Recv(off),
                    count,
                    dtype,
                }));
                // Other ranks' blocks start as this rank's noise.
                let mut init = pattern(seed(11, world, j, r), world * blk);
                init[r * blk..(r + 1) * blk].copy_from_slice(&inputs[r]);
                parts.push(r, off, init);
            }
        }
        for (j, (dtype, op)) in RS.into_iter().enumerate() {
            let count = 29 + j;
            let blk = count * dtype.size();
            let off = ra.take(world * blk);
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, Some(op), seed(12, world, j, r), world * count))
                .collect();
            for (r, plan) in plans.iter_mut().enumerate() {
                let blocks: Vec<&[u8]> =
                    inputs.iter().map(|v| &v[r * blk..(r + 1) * blk]).collect();
                // The rest of the send blocks is unspecified after an in-place reduce_scatter.
                plan.regions.push(Region {
                    off,
                    len: world * blk,
                    dtype,
                    expected: None,
                    label: String::new(),
                });
                plan.regions.push(Region {
                    off: off + r * blk,
                    len: blk,
                    dtype,
                    expected: Some(reference::reduce(dtype, op, &blocks)),
                    label: format!("in-place reduce_scatter {dtype} {op} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::ReduceScatter {
                    send: At::Recv(off),
                    recv: At::Recv(off + r * blk),
                    count,
                    dtype,
                    op,
                }));
                parts.push(r, off, inputs[r].clone());
            }
        }
        parts.fill_recvs(&mut plans, ra.total());
        run_plans(p, plans)
    })
}

/// Count 0 for every collective (from a zero-size send buffer), then a real all_reduce to show
/// the ranks still agree on what comes next.
pub(crate) fn zero_count(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |world| {
        let mut ra = Arena::default();
        let a = ra.take(256);
        let count = 5;
        let last = ra.take(count * 4);
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                reference::input(
                    DType::I32,
                    Some(ReduceOp::Sum),
                    seed(13, world, 0, r),
                    count,
                )
            })
            .collect();
        let expected = reference::reduce(DType::I32, ReduceOp::Sum, &refs(&inputs));
        let plans = (0..world)
            .map(|r| {
                let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
                let dtype = DType::F32;
                let steps = vec![
                    Step::Call(Collective::AllReduce {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype,
                        op: ReduceOp::Sum,
                    }),
                    Step::Call(Collective::AllGather {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype: DType::I8,
                    }),
                    Step::Call(Collective::ReduceScatter {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype: DType::BF16,
                        op: ReduceOp::Max,
                    }),
                    Step::Call(Collective::Broadcast {
                        buf: At::Recv(a),
                        count: 0,
                        dtype,
                        root: world - 1,
                    }),
                    Step::Call(Collective::AllToAll {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype,
                    }),
                    Step::Call(Collective::AllToAllV {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        send_counts: vec![0; world],
                        send_displs: vec![0; world],
                        recv_counts: vec![0; world],
                        recv_displs: vec![0; world],
                        dtype,
                    }),
                    Step::GroupStart,
                    Step::Call(Collective::Send {
                        send: At::Send(0),
                        count: 0,
                        dtype,
                        peer: next,
                    }),
                    Step::Call(Collective::Recv {
                        recv: At::Recv(a),
                        count: 0,
                        dtype,
                        peer: prev,
                    }),
                    Step::GroupEnd,
                    Step::Call(Collective::AllReduce {
                        send: At::Recv(last),
                        recv: At::Recv(last),
                        count,
                        dtype: DType::I32,
                        op: ReduceOp::Sum,
                    }),
                ];
                RankPlan {
                    send: Vec::new(),
                    recv: image(ra.total(), &[(last, &inputs[r])]),
                    regions: vec![Region {
                        off: last,
                        len: count * 4,
                        dtype: DType::I32,
                        expected: Some(expected.clone()),
                        label: "all_reduce after the count-0 collectives".into(),
                    }],
                    steps,
                }
            })
            .collect();
        run_plans(p, plans)
    })
}

/// Six dependent all_reduces with device copies between them on one stream: x -> y, y -> x, ...
pub(crate) fn chained(p: &dyn Platform) -> Result<()> {
    const OPS: [ReduceOp; 6] = [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Prod,
        ReduceOp::Sum,
    ];
    for_worlds(&WORLDS, |world| {
        let count = 100;
        let bytes = count * 8;
        let mut ra = Arena::default();
        let (x, y) = (ra.take(bytes), ra.take(bytes));
        let mut current: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                (0..count as i64)
                    .flat_map(|i| (r as i64 + 1 + i).to_le_bytes())
                    .collect()
            })
            .collect();
        let initial = current.clone();
        let mut steps = Vec::new();
        for op in OPS {
            let out = reference::reduce(DType::I64, op, &refs(&current)).bytes;
            current = vec![out; world];
            steps.push(Step::Call(Collective::AllReduce {
                send: At::Recv(x),
                recv: At::Recv(y),
                count,
                dtype: DType::I64,
                op,
            }));
            steps.push(Step::Copy(At::Recv(x), At::Recv(y), bytes));
        }
        let final_ = Expected::exact(current[0].clone());
        let plans = (0..world)
            .map(|r| RankPlan {
                send: Vec::new(),
                recv: image(ra.total(), &[(x, &initial[r])]),
                regions: [x, y]
                    .into_iter()
                    .map(|off| Region {
                        off,
                        len: bytes,
                        dtype: DType::I64,
                        expected: Some(final_.clone()),
                        label: "after 6 chained all_reduces".into(),
                    })
                    .collect(),
                steps: steps.clone(),
            })
            .collect();
        run_plans(p, plans)
    })
}
