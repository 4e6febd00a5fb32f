//! Collectives the ranks disagree on, overlapping and bad arguments, bad ranks at init and
//! split, and an unopened group end: an error on every rank, never a hang.

use super::*;

/// Two ranks that disagree on a collective get an error from synchronize on both ranks, never a
/// hang: `Mismatch` on cpu, whose rendezvous can name it; drivers report their own code (the
/// Ascend runtime a generic runtime error). Each disagreement runs on a fresh world so no case
/// depends on a communicator's state after one.
///
/// Not on real cuda: NCCL does not check that ranks agree, so a mismatch there hangs or corrupts
/// instead of failing (the CUDA emulator reports it, as `ncclInvalidUsage`).
pub(crate) fn mismatched_collective(p: &dyn Platform) -> Result<()> {
    mismatches_are_detected(p)?;
    type Issue =
        fn(&crate::collective::Rank<'_>, &hprt_platform::DeviceBuffer) -> hprt_platform::Result<()>;
    let variants: [(&str, Issue); 5] = [
        ("all_reduce count 4 vs 8", disagreeing_all_reduce),
        ("all_reduce sum vs max", |r, b| {
            let op = if r.rank == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            r.p.all_reduce(b.at(0), b.at(64), 4, DType::F32, op, &r.comm, &r.stream)
        }),
        ("all_reduce f32 vs i32", |r, b| {
            let dtype = if r.rank == 0 { DType::F32 } else { DType::I32 };
            r.p.all_reduce(
                b.at(0),
                b.at(64),
                4,
                dtype,
                ReduceOp::Sum,
                &r.comm,
                &r.stream,
            )
        }),
        ("all_reduce vs all_gather", |r, b| {
            if r.rank == 0 {
                r.p.all_reduce(
                    b.at(0),
                    b.at(64),
                    4,
                    DType::F32,
                    ReduceOp::Sum,
                    &r.comm,
                    &r.stream,
                )
            } else {
                r.p.all_gather(b.at(0), b.at(64), 4, DType::F32, &r.comm, &r.stream)
            }
        }),
        ("broadcast root 0 vs root 1", |r, b| {
            r.p.broadcast(b.at(0), 4, DType::F32, r.rank, &r.comm, &r.stream)
        }),
    ];
    for (what, issue) in variants {
        run_world(p, 2, |r| {
            let b = r.p.alloc_device(256)?;
            issue(r, &b).with_context(|| format!("{what}: issuing"))?;
            let synced = r.p.synchronize_stream(&r.stream);
            let what = format!("{what}: synchronize_stream");
            if r.p.backend() == hprt_platform::BackendKind::Cpu {
                expect_kind(synced, ErrorKind::Mismatch, &what)?;
            } else {
                expect_err(synced, &what)?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Overlapping send and recv ranges that are not a supported in-place layout are refused at
/// issue on every rank; the communicator keeps working.
pub(crate) fn overlapping_all_to_all(p: &dyn Platform) -> Result<()> {
    run_world(p, 2, |r| {
        let b = r.p.alloc_device(1024)?;
        let (comm, s) = (&r.comm, &r.stream);
        // all_to_all of 16 f32 per peer: 128 bytes each side; recv starts inside send.
        expect_kind(
            r.p.collective(
                comm,
                Collective::AllToAll {
                    send: b.at(0),
                    recv: b.at(64),
                    count: 16,
                    dtype: DType::F32,
                },
                s,
            ),
            ErrorKind::InvalidValue,
            "all_to_all with recv overlapping send",
        )?;
        expect_kind(
            r.p.collective(
                comm,
                Collective::AllToAll {
                    send: b.at(0),
                    recv: b.at(0),
                    count: 16,
                    dtype: DType::F32,
                },
                s,
            ),
            ErrorKind::InvalidValue,
            "all_to_all with send == recv",
        )?;
        expect_kind(
            r.p.all_reduce(b.at(0), b.at(8), 16, DType::F32, ReduceOp::Sum, comm, s),
            ErrorKind::InvalidValue,
            "all_reduce with partially overlapping send and recv",
        )?;
        // all_gather in place must put send at recv + rank * block; rank 1 uses the wrong block.
        let wrong = (1 - r.rank) * 64;
        expect_kind(
            r.p.all_gather(b.at(wrong), b.at(0), 16, DType::F32, comm, s),
            ErrorKind::InvalidValue,
            "all_gather with send at another rank's block",
        )?;
        // Nothing was issued: a barrier and a real all_to_all still pair up.
        r.p.barrier(comm, s)?;
        r.p.collective(
            comm,
            Collective::AllToAll {
                send: b.at(0),
                recv: b.at(512),
                count: 16,
                dtype: DType::F32,
            },
            s,
        )?;
        r.p.synchronize_stream(s)
            .context("collectives after the refused ones")?;
        Ok(())
    })
}

/// Arguments one rank can check alone are refused at issue, on every rank.
pub(crate) fn collective_bad_arguments(p: &dyn Platform) -> Result<()> {
    run_world(p, 2, |r| {
        let b = r.p.alloc_device(256)?;
        let (comm, s) = (&r.comm, &r.stream);
        expect_kind(
            r.p.broadcast(b.at(0), 4, DType::F32, 2, comm, s),
            ErrorKind::InvalidValue,
            "broadcast from root 2 in a world of 2",
        )?;
        expect_kind(
            r.p.collective(
                comm,
                Collective::Send {
                    send: b.at(0),
                    count: 4,
                    dtype: DType::F32,
                    peer: 2,
                },
                s,
            ),
            ErrorKind::InvalidValue,
            "send to peer 2 in a world of 2",
        )?;
        expect_kind(
            r.p.collective(
                comm,
                Collective::Recv {
                    recv: b.at(0),
                    count: 4,
                    dtype: DType::F32,
                    peer: 9,
                },
                s,
            ),
            ErrorKind::InvalidValue,
            "recv from peer 9 in a world of 2",
        )?;
        expect_kind(
            r.p.collective(
                comm,
                Collective::AllToAllV {
                    send: b.at(0),
                    recv: b.at(128),
                    send_counts: vec![1, 1, 1],
                    send_displs: vec![0, 1, 2],
                    recv_counts: vec![1, 1],
                    recv_displs: vec![0, 1],
                    dtype: DType::F32,
                },
                s,
            ),
            ErrorKind::InvalidValue,
            "all_to_all_v with 3 send counts in a world of 2",
        )?;
        let small = r.p.alloc_device(128)?;
        expect_kind(
            r.p.all_reduce(b.at(0), small.at(0), 64, DType::F32, ReduceOp::Sum, comm, s),
            ErrorKind::OutOfRange,
            "all_reduce of 64 f32 into a 128-byte buffer",
        )?;
        expect_kind(
            r.p.all_reduce(
                b.at(200),
                small.at(0),
                16,
                DType::F32,
                ReduceOp::Sum,
                comm,
                s,
            ),
            ErrorKind::OutOfRange,
            "all_reduce of 16 f32 read from offset 200 of a 256-byte buffer",
        )?;
        expect_kind(
            r.p.all_gather(b.at(0), small.at(0), 20, DType::F32, comm, s),
            ErrorKind::OutOfRange,
            "all_gather of 2 x 20 f32 into a 128-byte buffer",
        )?;
        expect_kind(
            r.p.reduce_scatter(b.at(0), small.at(0), 20, DType::F64, ReduceOp::Sum, comm, s),
            ErrorKind::OutOfRange,
            "reduce_scatter reading 2 x 20 f64 from a 256-byte buffer",
        )?;
        r.p.barrier(comm, s)?;
        r.p.synchronize_stream(s)
            .context("a barrier after the refused collectives")?;
        Ok(())
    })
}

pub(crate) fn comm_init_bad_rank(p: &dyn Platform) -> Result<()> {
    let id = p.unique_id()?;
    for (rank, world) in [(1, 1), (2, 2), (5, 2), (0, 0)] {
        expect_kind(
            p.comm_init(&id, rank, world),
            ErrorKind::InvalidValue,
            &format!("comm_init(rank {rank}, world {world})"),
        )?;
    }
    // The id is still good for a valid init.
    let comm = p
        .comm_init(&id, 0, 1)
        .context("a valid comm_init after refused ones")?;
    p.destroy_comm(&comm)?;
    Ok(())
}

pub(crate) fn group_end_unopened(p: &dyn Platform) -> Result<()> {
    // A fresh thread, so no group another case left open can interfere.
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<()> {
                expect_err(p.group_end(), "group_end without group_start")?;
                p.group_start()?;
                p.group_end().context("group_end after group_start")?;
                expect_err(p.group_end(), "a second group_end")?;
                p.group_start()?;
                p.group_start()?;
                p.group_end().context("inner group_end of a nested group")?;
                p.group_end().context("outer group_end of a nested group")?;
                expect_err(p.group_end(), "group_end after the nested group closed")?;
                Ok(())
            })
            .join()
            .map_err(|e| anyhow::anyhow!("panicked: {}", crate::util::panic_message(&*e)))?
    })
}

pub(crate) fn split_bad_rank_lists(p: &dyn Platform) -> Result<()> {
    run_world(p, 2, |r| {
        for lists in [
            vec![vec![0, 0]],
            vec![vec![0], vec![0, 1]],
            vec![vec![0, 2]],
            vec![vec![1, 0, 1]],
        ] {
            expect_kind(
                r.p.comm_split(&r.comm, &lists),
                ErrorKind::InvalidValue,
                &format!("comm_split({lists:?}) in a world of 2"),
            )?;
        }
        // A valid split still works afterwards.
        let sub =
            r.p.comm_split(&r.comm, &[vec![1, 0]])
                .context("a valid comm_split after refused ones")?
                .ok_or_else(|| anyhow::anyhow!("a valid comm_split gave no communicator"))?;
        ensure!(
            sub.rank() == 1 - r.rank && sub.world() == 2,
            "sub-rank {} of {}",
            sub.rank(),
            sub.world()
        );
        r.p.barrier(&sub, &r.stream)?;
        r.p.synchronize_stream(&r.stream)?;
        r.p.destroy_comm(&sub)?;
        Ok(())
    })
}
