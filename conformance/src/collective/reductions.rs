//! Plan builders for the reducing and gathering collectives: all-reduce, reduce-scatter,
//! all-gather and broadcast.

use super::*;

/// Per rank, the byte runs a buffer image holds at their offsets: what every plan builder
/// collects while it lays out its regions, then turns into each rank's send or recv image.
pub(super) struct Parts(Vec<Vec<(usize, Vec<u8>)>>);

impl Parts {
    pub(super) fn new(world: usize) -> Parts {
        Parts(vec![Vec::new(); world])
    }

    /// `bytes` at `off` in `rank`'s image.
    pub(super) fn push(&mut self, rank: usize, off: usize, bytes: Vec<u8>) {
        self.0[rank].push((off, bytes));
    }

    /// `per_rank[r]` at `off` in rank r's image, for every rank.
    pub(super) fn push_each(&mut self, off: usize, per_rank: Vec<Vec<u8>>) {
        for (r, bytes) in per_rank.into_iter().enumerate() {
            self.push(r, off, bytes);
        }
    }

    /// `rank`'s image, `len` bytes.
    pub(super) fn image(&self, rank: usize, len: usize) -> Vec<u8> {
        let parts: Vec<(usize, &[u8])> = self.0[rank]
            .iter()
            .map(|(o, v)| (*o, v.as_slice()))
            .collect();
        image(len, &parts)
    }

    /// Each plan's recv buffer: its rank's image of `len` bytes.
    pub(super) fn fill_recvs(&self, plans: &mut [RankPlan], len: usize) {
        for (r, plan) in plans.iter_mut().enumerate() {
            plan.recv = self.image(r, len);
        }
    }

    /// Each plan's send buffer: its rank's image of `send_len` bytes; its recv buffer:
    /// `recv_len` bytes of [`FILL`].
    pub(super) fn fill_sends(&self, plans: &mut [RankPlan], send_len: usize, recv_len: usize) {
        for (r, plan) in plans.iter_mut().enumerate() {
            plan.send = self.image(r, send_len);
            plan.recv = vec![FILL; recv_len];
        }
    }
}

fn all_reduce_plans(world: usize) -> Vec<RankPlan> {
    let (mut sa, mut ra) = (Arena::default(), Arena::default());
    let mut send_parts = Parts::new(world);
    let mut regions = Vec::new();
    let mut steps = Vec::new();
    // Counts are not multiples of the world size (for world > 1).
    let sized = sized_combos(|j| world * (125 + j % 3) + 1, 2 * 4096 * world + 5);
    for (j, (op, dtype, count)) in sized.into_iter().enumerate() {
        let bytes = count * dtype.size();
        let (so, ro) = (sa.take(bytes), ra.take(bytes));
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|r| reference::input(dtype, Some(op), seed(1, world, j, r), count))
            .collect();
        regions.push(Region {
            off: ro,
            len: bytes,
            dtype,
            expected: Some(reference::reduce(dtype, op, &refs(&inputs))),
            label: format!("all_reduce {dtype} {op} count {count}"),
        });
        send_parts.push_each(so, inputs);
        steps.push(Step::Call(Collective::AllReduce {
            send: At::Send(so),
            recv: At::Recv(ro),
            count,
            dtype,
            op,
        }));
    }
    (0..world)
        .map(|r| RankPlan {
            send: send_parts.image(r, sa.total()),
            recv: vec![FILL; ra.total()],
            regions: regions.clone(),
            steps: steps.clone(),
        })
        .collect()
}

/// all_reduce × every op × every dtype, counts not divisible by the world size.
pub(crate) fn all_reduce(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |w| run_plans(p, all_reduce_plans(w)))
}

fn reduce_scatter_plans(world: usize) -> Vec<RankPlan> {
    let (mut sa, mut ra) = (Arena::default(), Arena::default());
    let mut plans = vec![RankPlan::default(); world];
    let mut send_parts = Parts::new(world);
    let sized = sized_combos(|j| 37 + world + j % 3, 9001);
    for (j, (op, dtype, count)) in sized.into_iter().enumerate() {
        let sz = dtype.size();
        let (so, ro) = (sa.take(world * count * sz), ra.take(count * sz));
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|r| reference::input(dtype, Some(op), seed(2, world, j, r), world * count))
            .collect();
        for (r, plan) in plans.iter_mut().enumerate() {
            let blocks: Vec<&[u8]> = inputs
                .iter()
                .map(|v| &v[r * count * sz..(r + 1) * count * sz])
                .collect();
            plan.regions.push(Region {
                off: ro,
                len: count * sz,
                dtype,
                expected: Some(reference::reduce(dtype, op, &blocks)),
                label: format!("reduce_scatter {dtype} {op} count {count}"),
            });
            plan.steps.push(Step::Call(Collective::ReduceScatter {
                send: At::Send(so),
                recv: At::Recv(ro),
                count,
                dtype,
                op,
            }));
        }
        send_parts.push_each(so, inputs);
    }
    send_parts.fill_sends(&mut plans, sa.total(), ra.total());
    plans
}

/// reduce_scatter × every op × every dtype.
pub(crate) fn reduce_scatter(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |w| run_plans(p, reduce_scatter_plans(w)))
}

/// all_gather × every dtype.
pub(crate) fn all_gather(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts = Parts::new(world);
        for (j, dtype) in DType::ALL.into_iter().enumerate() {
            let count = 53 + world + j;
            let sz = dtype.size();
            let (so, ro) = (sa.take(count * sz), ra.take(world * count * sz));
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(3, world, j, r), count))
                .collect();
            let gathered = Expected::exact(inputs.concat());
            for plan in plans.iter_mut() {
                plan.regions.push(Region {
                    off: ro,
                    len: world * count * sz,
                    dtype,
                    expected: Some(gathered.clone()),
                    label: format!("all_gather {dtype} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllGather {
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

/// broadcast from every root, a few dtypes.
pub(crate) fn broadcast(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::I8, DType::I64];
    for_worlds(&WORLDS, |world| {
        let mut ra = Arena::default();
        let mut plans = vec![RankPlan::default(); world];
        let mut parts = Parts::new(world);
        for root in 0..world {
            for (j, dtype) in DTYPES.into_iter().enumerate() {
                let count = 77 + 3 * root + j;
                let combo = root * DTYPES.len() + j;
                let off = ra.take(count * dtype.size());
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|r| reference::input(dtype, None, seed(4, world, combo, r), count))
                    .collect();
                for (r, plan) in plans.iter_mut().enumerate() {
                    plan.regions.push(Region {
                        off,
                        len: count * dtype.size(),
                        dtype,
                        expected: Some(Expected::exact(inputs[root].clone())),
                        label: format!("broadcast {dtype} count {count} from root {root}"),
                    });
                    plan.steps.push(Step::Call(Collective::Broadcast {
                        buf: At::Recv(off),
                        count,
                        dtype,
                        root,
                    }));
                    parts.push(r, off, inputs[r].clone());
                }
            }
        }
        parts.fill_recvs(&mut plans, ra.total());
        run_plans(p, plans)
    })
}
