//! Plan builders for the exchanges: all-to-all (even and with counts and displacements),
//! send/recv on a ring and in pairs, and barrier.

use super::reductions::Parts;
use super::*;

/// all_to_all: block q of rank r's send lands in block r of rank q's recv.
pub(crate) fn all_to_all(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::I32,
        DType::U8,
        DType::I64,
        DType::F64,
    ];
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts = Parts::new(world);
        for (j, dtype) in DTYPES.into_iter().enumerate() {
            let count = 3 + 2 * j + world;
            let sz = dtype.size();
            let blk = count * sz;
            let (so, ro) = (sa.take(world * blk), ra.take(world * blk));
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(5, world, j, r), world * count))
                .collect();
            for (r, plan) in plans.iter_mut().enumerate() {
                let want: Vec<u8> = inputs
                    .iter()
                    .flat_map(|v| v[r * blk..(r + 1) * blk].iter().copied())
                    .collect();
                plan.regions.push(Region {
                    off: ro,
                    len: world * blk,
                    dtype,
                    expected: Some(Expected::exact(want)),
                    label: format!("all_to_all {dtype} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllToAll {
                    send: At::Send(so),
                    recv: At::Recv(ro),
                    count,
                    dtype,
                }));
            }
            send_parts.push_each(so, inputs);
        }
        send_parts.fill_sends(&mut plans, sa.total(), ra.total());
        run_plans(p, plans)
    })
}

/// Elements spanned by blocks of `counts` at `displs` (empty blocks ignored).
fn extent(counts: &[usize], displs: &[usize]) -> usize {
    counts
        .iter()
        .zip(displs)
        .filter(|(c, _)| **c > 0)
        .map(|(c, d)| c + d)
        .max()
        .unwrap_or(0)
}

/// all_to_all_v with uneven (some zero) counts; send blocks packed with one-element gaps, recv
/// blocks in reverse peer order with two-element gaps.
pub(crate) fn all_to_all_v(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 4] = [DType::F64, DType::I8, DType::BF16, DType::I32];
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts = Parts::new(world);
        for (j, dtype) in DTYPES.into_iter().enumerate() {
            let sz = dtype.size();
            // cnt[r][q]: elements rank r sends to rank q.
            let cnt: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    (0..world)
                        .map(|q| ((r + 2 * q + j) % 4) * 5 + (r * q + j) % 3)
                        .collect()
                })
                .collect();
            let sd: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    (0..world)
                        .map(|q| (0..q).map(|k| cnt[r][k] + 1).sum())
                        .collect()
                })
                .collect();
            let rc: Vec<Vec<usize>> = (0..world)
                .map(|r| (0..world).map(|q| cnt[q][r]).collect())
                .collect();
            let rd: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    (0..world)
                        .map(|q| (q + 1..world).map(|k| rc[r][k] + 2).sum())
                        .collect()
                })
                .collect();
            // Every rank uses the same region offsets, sized for the largest extent.
            let send_ext = (0..world)
                .map(|r| extent(&cnt[r], &sd[r]))
                .max()
                .unwrap_or(0);
            let recv_ext = (0..world)
                .map(|r| extent(&rc[r], &rd[r]))
                .max()
                .unwrap_or(0);
            let (so, ro) = (sa.take(send_ext * sz), ra.take(recv_ext * sz));
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(6, world, j, r), send_ext))
                .collect();
            for (r, plan) in plans.iter_mut().enumerate() {
                for q in 0..world {
                    let n = rc[r][q];
                    if n == 0 {
                        continue;
                    }
                    let from = &inputs[q][sd[q][r] * sz..(sd[q][r] + n) * sz];
                    plan.regions.push(Region {
                        off: ro + rd[r][q] * sz,
                        len: n * sz,
                        dtype,
                        expected: Some(Expected::exact(from.to_vec())),
                        label: format!("all_to_all_v {dtype}: {n} elements from rank {q}"),
                    });
                }
                plan.steps.push(Step::Call(Collective::AllToAllV {
                    send: At::Send(so),
                    recv: At::Recv(ro),
                    send_counts: cnt[r].clone(),
                    send_displs: sd[r].clone(),
                    recv_counts: rc[r].clone(),
                    recv_displs: rd[r].clone(),
                    dtype,
                }));
            }
            send_parts.push_each(so, inputs);
        }
        send_parts.fill_sends(&mut plans, sa.total(), ra.total());
        run_plans(p, plans)
    })
}

/// send/recv in a ring inside one group (each rank sends two messages per dtype to rank+1 and
/// receives from rank-1, recvs issued before sends), then the reverse ring in a second group.
pub(crate) fn send_recv_ring(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 3] = [DType::F32, DType::I64, DType::U8];
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts = Parts::new(world);
        for (dir, shift) in [(0usize, 1usize), (1, world - 1)] {
            // Each message: (dtype, count, send offset, recv offset).
            let mut msgs = Vec::new();
            for (j, dtype) in DTYPES.into_iter().enumerate() {
                for m in 0..2 {
                    let count = 31 + 7 * j + 5 * m + dir;
                    let bytes = count * dtype.size();
                    msgs.push((j * 2 + m, dtype, count, sa.take(bytes), ra.take(bytes)));
                }
            }
            for (r, plan) in plans.iter_mut().enumerate() {
                let to = (r + shift) % world;
                let from = (r + world - shift) % world;
                plan.steps.push(Step::GroupStart);
                for &(k, dtype, count, so, ro) in &msgs {
                    plan.steps.push(Step::Call(Collective::Recv {
                        recv: At::Recv(ro),
                        count,
                        dtype,
                        peer: from,
                    }));
                    plan.steps.push(Step::Call(Collective::Send {
                        send: At::Send(so),
                        count,
                        dtype,
                        peer: to,
                    }));
                    let combo = dir * 100 + k;
                    send_parts.push(
                        r,
                        so,
                        reference::input(dtype, None, seed(7, world, combo, r), count),
                    );
                    plan.regions.push(Region {
                        off: ro,
                        len: count * dtype.size(),
                        dtype,
                        expected: Some(Expected::exact(reference::input(
                            dtype,
                            None,
                            seed(7, world, combo, from),
                            count,
                        ))),
                        label: format!(
                            "{} ring: message {} ({dtype} count {count}) from rank {from}",
                            if dir == 0 { "forward" } else { "backward" },
                            k % 2
                        ),
                    });
                }
                plan.steps.push(Step::GroupEnd);
            }
        }
        send_parts.fill_sends(&mut plans, sa.total(), ra.total());
        run_plans(p, plans)
    })
}

/// Ungrouped send/recv between pairs (2k, 2k+1): even ranks send then receive, odd ranks
/// receive then send.
pub(crate) fn send_recv_pairs(p: &dyn Platform) -> Result<()> {
    for_worlds(&[2, 4, 8], |world| {
        let count = |from: usize, to: usize| 500 + 10 * from + to;
        let data = |from: usize, to: usize| {
            reference::input(
                DType::I32,
                None,
                seed(8, world, from * 16 + to, from),
                count(from, to),
            )
        };
        let plans = (0..world)
            .map(|r| {
                let peer = r ^ 1;
                let (mut sa, mut ra) = (Arena::default(), Arena::default());
                let so = sa.take(count(r, peer) * 4);
                let ro = ra.take(count(peer, r) * 4);
                let send = Step::Call(Collective::Send {
                    send: At::Send(so),
                    count: count(r, peer),
                    dtype: DType::I32,
                    peer,
                });
                let recv = Step::Call(Collective::Recv {
                    recv: At::Recv(ro),
                    count: count(peer, r),
                    dtype: DType::I32,
                    peer,
                });
                RankPlan {
                    send: image(sa.total(), &[(so, &data(r, peer))]),
                    recv: vec![FILL; ra.total()],
                    regions: vec![Region {
                        off: ro,
                        len: count(peer, r) * 4,
                        dtype: DType::I32,
                        expected: Some(Expected::exact(data(peer, r))),
                        label: format!("message from rank {peer}"),
                    }],
                    steps: if r % 2 == 0 {
                        vec![send, recv]
                    } else {
                        vec![recv, send]
                    },
                }
            })
            .collect();
        run_plans(p, plans)
    })
}

/// A barrier completes only once every rank issued it: ranks arrive staggered and mark their
/// arrival on the host before issuing; after synchronizing, every rank must see all marks.
pub(crate) fn barrier(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |world| {
        let arrived = Mutex::new(vec![false; world]);
        run_world(p, world, |r| {
            std::thread::sleep(Duration::from_millis(3 * r.rank as u64));
            arrived.lock().unwrap()[r.rank] = true;
            r.p.barrier(&r.comm, &r.stream)?;
            r.p.synchronize_stream(&r.stream)?;
            let seen = arrived.lock().unwrap().clone();
            if let Some(q) = seen.iter().position(|a| !a) {
                bail!("the barrier completed before rank {q} issued it");
            }
            // Back-to-back barriers.
            for _ in 0..3 {
                r.p.barrier(&r.comm, &r.stream)?;
            }
            r.p.synchronize_stream(&r.stream)?;
            Ok(())
        })
    })
}
