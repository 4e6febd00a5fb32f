//! Sub-communicators from `comm_split`, each running its own plan.

use super::*;

/// Plan for a collective over a sub-communicator whose members are `members` (global ranks in
/// sub-rank order): an i32 sum all_reduce and an f32 all_gather of rank-specific inputs.
fn split_plan(tag: usize, members: &[usize], me: usize) -> RankPlan {
    let n = members.len();
    let mut ra = Arena::default();
    let (count_r, count_g) = (50, 20);
    let (a_in, a_out, g_out) = (
        ra.take(count_r * 4),
        ra.take(count_r * 4),
        ra.take(n * count_g * 4),
    );
    let sum_in = |g: usize| {
        reference::input(
            DType::I32,
            Some(ReduceOp::Sum),
            seed(14, tag, 0, g),
            count_r,
        )
    };
    let gat_in = |g: usize| reference::input(DType::F32, None, seed(14, tag, 1, g), count_g);
    let sub_rank = members.iter().position(|&g| g == me).expect("member");
    let all_sum: Vec<Vec<u8>> = members.iter().map(|&g| sum_in(g)).collect();
    let all_gat: Vec<Vec<u8>> = members.iter().map(|&g| gat_in(g)).collect();
    let g_send = g_out + sub_rank * count_g * 4;
    RankPlan {
        send: Vec::new(),
        recv: image(ra.total(), &[(a_in, &sum_in(me)), (g_send, &gat_in(me))]),
        regions: vec![
            Region {
                off: a_out,
                len: count_r * 4,
                dtype: DType::I32,
                expected: Some(reference::reduce(
                    DType::I32,
                    ReduceOp::Sum,
                    &refs(&all_sum),
                )),
                label: format!("all_reduce over ranks {members:?}"),
            },
            Region {
                off: g_out,
                len: n * count_g * 4,
                dtype: DType::F32,
                expected: Some(Expected::exact(all_gat.concat())),
                label: format!("all_gather over ranks {members:?} (blocks in list order)"),
            },
        ],
        steps: vec![
            Step::Call(Collective::AllReduce {
                send: At::Recv(a_in),
                recv: At::Recv(a_out),
                count: count_r,
                dtype: DType::I32,
                op: ReduceOp::Sum,
            }),
            Step::Call(Collective::AllGather {
                send: At::Recv(g_send),
                recv: At::Recv(g_out),
                count: count_g,
                dtype: DType::F32,
            }),
        ],
    }
}

/// comm_split on a world of 4: [[0,2],[1,3]] gives each pair its own communicator; [[3,1,0]]
/// leaves rank 2 without one and numbers the others in list order; the parent keeps working.
pub(crate) fn comm_split(p: &dyn Platform) -> Result<()> {
    run_world(p, 4, |r| {
        let lists = [vec![0, 2], vec![1, 3]];
        let sub = r
            .p
            .comm_split(&r.comm, &lists)?
            .ok_or_else(|| anyhow!("comm_split({lists:?}) gave rank {} no communicator", r.rank))?;
        let members = &lists[r.rank % 2];
        ensure!(
            sub.world() == 2 && sub.rank() == r.rank / 2,
            "comm_split({lists:?}) gave rank {} sub-rank {} of {}, expected {} of 2",
            r.rank,
            sub.rank(),
            sub.world(),
            r.rank / 2
        );
        execute(r, &sub, &split_plan(1, members, r.rank)).context("in sub-communicator 1")?;

        let lists = [vec![3, 1, 0]];
        let sub2 = r.p.comm_split(&r.comm, &lists)?;
        match (r.rank, &sub2) {
            (2, None) => {}
            (2, Some(c)) => bail!("rank 2 is in no list of {lists:?} but got {c:?}"),
            (_, None) => bail!("rank {} is in {lists:?} but got no communicator", r.rank),
            (_, Some(c)) => {
                let want = lists[0].iter().position(|&g| g == r.rank).unwrap();
                ensure!(
                    c.world() == 3 && c.rank() == want,
                    "comm_split({lists:?}) gave rank {} sub-rank {} of {}, expected {want} of 3",
                    r.rank,
                    c.rank(),
                    c.world()
                );
                execute(r, c, &split_plan(2, &lists[0], r.rank))
                    .context("in sub-communicator 2")?;
            }
        }
        // The parent still works after the splits.
        execute(r, &r.comm, &split_plan(3, &[0, 1, 2, 3], r.rank))
            .context("in the parent after splitting")?;
        r.p.destroy_comm(&sub)?;
        if let Some(c) = sub2 {
            r.p.destroy_comm(&c)?;
        }
        Ok(())
    })
}
