//! error: typed errors for freed, destroyed and foreign handles, bad ranges and arguments, and
//! collectives the ranks disagree on (an error on every rank, never a hang).
//!
//! (Over 800 lines because it holds one case per error class of the `Platform` contract.)

use anyhow::{ensure, Context, Result};
use hprt_platform::{Collective, DType, ErrorKind, Platform, ReduceOp};

use crate::collective::run_world;
use crate::util::{check_bytes, expect_err, expect_kind, pattern, pinned_with};

pub(crate) fn use_after_free(p: &dyn Platform) -> Result<()> {
    const N: usize = 1 << 20;
    let s = p.create_stream()?;
    // Freeing with work queued: the queued work still completes.
    let data = pattern(110, N);
    let src = pinned_with(p, &data)?;
    let out = p.alloc_pinned(N)?;
    let d = p.alloc_device(N)?;
    p.copy_async((&d).into(), 0, (&src).into(), 0, N, &s)?;
    p.copy_async((&out).into(), 0, (&d).into(), 0, N, &s)?;
    p.free_device(&d)?;
    p.synchronize_stream(&s)
        .context("synchronize after freeing a buffer with queued work")?;
    check_bytes("copies queued before free_device", &data, &out.to_vec()?)?;

    let clone = d.clone();
    ensure!(clone.is_freed(), "a clone of a freed buffer is not freed");
    let h = p.alloc_pinned(64)?;
    expect_kind(
        p.copy_async((&clone).into(), 0, (&h).into(), 0, 64, &s),
        ErrorKind::InvalidHandle,
        "H2D into a freed device buffer",
    )?;
    expect_kind(
        p.copy_async((&h).into(), 0, (&d).into(), 0, 64, &s),
        ErrorKind::InvalidHandle,
        "D2H from a freed device buffer",
    )?;
    expect_kind(
        p.copy_async((&h).into(), 0, (&d).into(), 0, 0, &s),
        ErrorKind::InvalidHandle,
        "0-byte D2H from a freed device buffer",
    )?;
    expect_kind(
        p.memset_async(&d, 0, 0, 64, &s),
        ErrorKind::InvalidHandle,
        "memset of a freed buffer",
    )?;
    expect_kind(
        p.resize_device(&d, 64),
        ErrorKind::InvalidHandle,
        "resize_device of a freed buffer",
    )?;
    expect_kind(
        p.free_device(&clone),
        ErrorKind::InvalidHandle,
        "free_device twice",
    )?;

    let h2 = p.alloc_pinned(64)?;
    p.free_pinned(&h2)?;
    let d2 = p.alloc_device(64)?;
    expect_kind(
        p.copy_async((&d2).into(), 0, (&h2).into(), 0, 64, &s),
        ErrorKind::InvalidHandle,
        "H2D from a freed pinned buffer",
    )?;
    expect_kind(
        p.copy_async((&h2).into(), 0, (&d2).into(), 0, 64, &s),
        ErrorKind::InvalidHandle,
        "D2H into a freed pinned buffer",
    )?;
    expect_kind(
        p.copy_async((&h).into(), 0, (&h2).into(), 0, 64, &s),
        ErrorKind::InvalidHandle,
        "H2H from a freed pinned buffer",
    )?;
    expect_kind(
        p.free_pinned(&h2),
        ErrorKind::InvalidHandle,
        "free_pinned twice",
    )?;
    // The stream is unaffected by the refused operations.
    p.write_device_sync(&d2, 0, &[1; 64], &s)?;
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn out_of_range(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let d = p.alloc_device(1000)?;
    let d2 = p.alloc_device(1000)?;
    let h = p.alloc_pinned(1000)?;
    let h2 = p.alloc_pinned(1000)?;
    let cases: [(&str, hprt_platform::Result<()>); 10] = [
        (
            "H2D past the device end",
            p.copy_async((&d).into(), 990, (&h).into(), 0, 11, &s),
        ),
        (
            "H2D past the pinned end",
            p.copy_async((&d).into(), 0, (&h).into(), 500, 501, &s),
        ),
        (
            "D2H past the device end",
            p.copy_async((&h).into(), 0, (&d).into(), 1, 1000, &s),
        ),
        (
            "D2H past the pinned end",
            p.copy_async((&h).into(), 999, (&d).into(), 0, 2, &s),
        ),
        (
            "D2D past the source end",
            p.copy_async((&d2).into(), 0, (&d).into(), 500, 600, &s),
        ),
        (
            "H2H past the destination end",
            p.copy_async((&h2).into(), 900, (&h).into(), 0, 101, &s),
        ),
        (
            "copy longer than both buffers",
            p.copy_async((&d).into(), 0, (&h).into(), 0, 1001, &s),
        ),
        (
            "offset + length overflowing usize",
            p.copy_async((&d).into(), usize::MAX, (&h).into(), 0, 2, &s),
        ),
        ("memset past the end", p.memset_async(&d, 999, 0, 2, &s)),
        (
            "memset at an offset overflowing usize",
            p.memset_async(&d, usize::MAX - 1, 0, 4, &s),
        ),
    ];
    for (what, r) in cases {
        expect_kind(r, ErrorKind::OutOfRange, what)?;
    }
    expect_kind(
        p.write_device_sync(&d, 998, &[0; 3], &s),
        ErrorKind::OutOfRange,
        "write_device_sync past the end",
    )?;
    expect_kind(
        p.read_device_sync(&d, 998, &mut [0; 3], &s),
        ErrorKind::OutOfRange,
        "read_device_sync past the end",
    )?;
    // In-range work on the same buffers still runs.
    p.copy_async((&d).into(), 999, (&h).into(), 999, 1, &s)?;
    p.synchronize_stream(&s)
        .context("synchronize after refused out-of-range copies")?;
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn destroyed_stream(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let clone = s.clone();
    p.destroy_stream(&s)?;
    ensure!(
        !s.is_live() && !clone.is_live(),
        "a destroyed stream or its clone reports is_live"
    );
    let d = p.alloc_device(64)?;
    let h = p.alloc_pinned(64)?;
    let e = p.create_event(false)?;
    expect_kind(
        p.copy_async((&d).into(), 0, (&h).into(), 0, 64, &clone),
        ErrorKind::InvalidHandle,
        "copy on a destroyed stream",
    )?;
    expect_kind(
        p.memset_async(&d, 0, 0, 64, &s),
        ErrorKind::InvalidHandle,
        "memset on a destroyed stream",
    )?;
    expect_kind(
        p.synchronize_stream(&s),
        ErrorKind::InvalidHandle,
        "synchronize a destroyed stream",
    )?;
    expect_kind(
        p.query_stream(&clone),
        ErrorKind::InvalidHandle,
        "query a destroyed stream",
    )?;
    expect_kind(
        p.record_event(&e, &s),
        ErrorKind::InvalidHandle,
        "record an event on a destroyed stream",
    )?;
    expect_kind(
        p.stream_wait_event(&s, &e),
        ErrorKind::InvalidHandle,
        "stream_wait_event on a destroyed stream",
    )?;
    expect_kind(
        p.write_device_sync(&d, 0, &[0; 8], &s),
        ErrorKind::InvalidHandle,
        "write_device_sync on a destroyed stream",
    )?;
    // Collectives on a destroyed stream are refused before any rank waits.
    let id = p.unique_id()?;
    let comm = p.comm_init(&id, 0, 1)?;
    expect_kind(
        p.barrier(&comm, &s),
        ErrorKind::InvalidHandle,
        "barrier on a destroyed stream",
    )?;
    p.destroy_comm(&comm)?;
    p.synchronize_device()
        .context("synchronize_device with a destroyed stream around")?;
    Ok(())
}

pub(crate) fn destroyed_event(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let e = p.create_event(true)?;
    let t = p.create_event(true)?;
    p.record_event(&e, &s)?;
    p.record_event(&t, &s)?;
    p.synchronize_stream(&s)?;
    let clone = e.clone();
    p.destroy_event(&e)?;
    ensure!(
        !e.is_live() && !clone.is_live(),
        "a destroyed event or its clone reports is_live"
    );
    expect_kind(
        p.query_event(&clone),
        ErrorKind::InvalidHandle,
        "query a destroyed event",
    )?;
    expect_kind(
        p.synchronize_event(&e),
        ErrorKind::InvalidHandle,
        "synchronize a destroyed event",
    )?;
    expect_kind(
        p.record_event(&e, &s),
        ErrorKind::InvalidHandle,
        "record a destroyed event",
    )?;
    expect_kind(
        p.stream_wait_event(&s, &e),
        ErrorKind::InvalidHandle,
        "stream_wait_event on a destroyed event",
    )?;
    expect_kind(
        p.event_elapsed_ms(&e, &t),
        ErrorKind::InvalidHandle,
        "elapsed_ms from a destroyed event",
    )?;
    expect_kind(
        p.event_elapsed_ms(&t, &e),
        ErrorKind::InvalidHandle,
        "elapsed_ms to a destroyed event",
    )?;
    p.synchronize_stream(&s)?;
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn double_destroy(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    // SAFETY: `s` is live while the wrapper is used.
    let w = unsafe { p.wrap_external_stream(s.raw()) }?;
    p.destroy_stream(&w)?;
    expect_kind(
        p.destroy_stream(&w),
        ErrorKind::InvalidHandle,
        "destroying a stream wrapper twice",
    )?;
    p.destroy_stream(&s)?;
    expect_kind(
        p.destroy_stream(&s),
        ErrorKind::InvalidHandle,
        "destroying a stream twice",
    )?;
    let e = p.create_event(false)?;
    p.destroy_event(&e)?;
    expect_kind(
        p.destroy_event(&e.clone()),
        ErrorKind::InvalidHandle,
        "destroying an event twice",
    )?;
    let id = p.unique_id()?;
    let comm = p.comm_init(&id, 0, 1)?;
    p.destroy_comm(&comm)?;
    ensure!(!comm.is_live(), "a destroyed communicator reports is_live");
    expect_kind(
        p.destroy_comm(&comm),
        ErrorKind::InvalidHandle,
        "destroying a communicator twice",
    )?;
    let s2 = p.create_stream()?;
    expect_kind(
        p.barrier(&comm, &s2),
        ErrorKind::InvalidHandle,
        "barrier on a destroyed communicator",
    )?;
    expect_kind(
        p.comm_split(&comm, &[vec![0]]),
        ErrorKind::InvalidHandle,
        "comm_split of a destroyed communicator",
    )?;
    let d = p.alloc_device(16)?;
    p.free_device(&d)?;
    expect_kind(
        p.free_device(&d),
        ErrorKind::InvalidHandle,
        "free_device twice",
    )?;
    let h = p.alloc_pinned(16)?;
    p.free_pinned(&h)?;
    expect_kind(
        p.free_pinned(&h),
        ErrorKind::InvalidHandle,
        "free_pinned twice",
    )?;
    p.destroy_stream(&s2)?;
    Ok(())
}

pub(crate) fn pinned_host_access(p: &dyn Platform) -> Result<()> {
    let h = p.alloc_pinned(100)?;
    h.write(0, &[7; 100])?;
    expect_kind(
        h.write(99, &[0; 2]),
        ErrorKind::OutOfRange,
        "pinned write past the end",
    )?;
    expect_kind(
        h.read(50, &mut [0; 51]),
        ErrorKind::OutOfRange,
        "pinned read past the end",
    )?;
    expect_kind(
        h.read(usize::MAX, &mut [0; 2]),
        ErrorKind::OutOfRange,
        "pinned read at an overflowing offset",
    )?;
    crate::util::check_fill("pinned buffer after refused writes", &h.to_vec()?, 7)?;
    let clone = h.clone();
    p.free_pinned(&h)?;
    ensure!(
        clone.is_freed(),
        "a clone of a freed pinned buffer is not freed"
    );
    expect_kind(
        clone.read(0, &mut [0; 1]),
        ErrorKind::InvalidHandle,
        "pinned read after free",
    )?;
    expect_kind(
        clone.write(0, &[0; 1]),
        ErrorKind::InvalidHandle,
        "pinned write after free",
    )?;
    expect_kind(
        clone.to_vec(),
        ErrorKind::InvalidHandle,
        "pinned to_vec after free",
    )?;
    Ok(())
}

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

/// Collectives the ranks disagree on fail (a queued error) everywhere but on real cuda, where
/// NCCL does not notice and hangs: cases that need one are skipped there (not on the emulator).
fn mismatches_are_detected(p: &dyn Platform) -> Result<()> {
    if p.backend() == hprt_platform::BackendKind::Cuda && !crate::cuda_emulator::is_emulated(p) {
        return Err(crate::util::Skipped(
            "NCCL does not detect ranks that disagree; a mismatch hangs instead of failing (the CUDA emulator does)".into(),
        )
        .into());
    }
    Ok(())
}

/// An all-reduce of 4 elements on rank 0 and 8 on the others: a queued error on every rank.
fn disagreeing_all_reduce(
    r: &crate::collective::Rank<'_>,
    b: &hprt_platform::DeviceBuffer,
) -> hprt_platform::Result<()> {
    disagreeing_all_reduce_on(r, b, &r.stream)
}

/// [`disagreeing_all_reduce`] on stream `s`.
fn disagreeing_all_reduce_on(
    r: &crate::collective::Rank<'_>,
    b: &hprt_platform::DeviceBuffer,
    s: &hprt_platform::Stream,
) -> hprt_platform::Result<()> {
    let count = if r.rank == 0 { 4 } else { 8 };
    r.p.all_reduce(
        b.at(0),
        b.at(64),
        count,
        DType::F32,
        ReduceOp::Sum,
        &r.comm,
        s,
    )
}

/// A disagreeing all-reduce queued on the rank's stream (into the returned buffer), an event
/// recorded after it, and a new stream that waits on that event.
fn failed_with_a_waiter(
    r: &crate::collective::Rank<'_>,
) -> Result<(
    hprt_platform::DeviceBuffer,
    hprt_platform::Event,
    hprt_platform::Stream,
)> {
    let b = r.p.alloc_device(256)?;
    disagreeing_all_reduce(r, &b)?;
    let after = r.p.create_event(false)?;
    r.p.record_event(&after, &r.stream)?;
    let waiter = r.p.create_stream()?;
    r.p.stream_wait_event(&waiter, &after)?;
    Ok((b, after, waiter))
}

/// A queued error reaches everything ordered after the failed work, as a GPU's sticky errors
/// do: events recorded after it, streams that waited on such an event (directly or through
/// another stream's event), and a device synchronize. Once reported, later work is clean again.
pub(crate) fn queued_error_reaches_waiters(p: &dyn Platform) -> Result<()> {
    mismatches_are_detected(p)?;
    let phase = std::sync::Barrier::new(2);
    run_world(p, 2, |r| {
        let (_b, after, waiter) = failed_with_a_waiter(r)?;
        let d = r.p.alloc_device(64)?;
        r.p.memset_async(&d, 0, 1, 64, &waiter)?;
        let later = r.p.create_event(false)?;
        r.p.record_event(&later, &waiter)?;
        let third = r.p.create_stream()?;
        r.p.stream_wait_event(&third, &later)?;
        r.p.memset_async(&d, 0, 2, 64, &third)?;
        expect_err(
            r.p.synchronize_event(&after),
            "an event recorded after the failed collective",
        )?;
        expect_err(
            r.p.synchronize_event(&later),
            "an event recorded on a stream after it waited on the failed work",
        )?;
        expect_err(
            r.p.synchronize_stream(&third),
            "a stream that waited on the failed work through two events",
        )?;
        expect_err(
            r.p.synchronize_stream(&waiter),
            "a stream that waited on an event recorded after the failed collective",
        )?;
        // Device synchronizes see every rank's streams of a shared platform: one rank checks,
        // between barriers, while each rank's collective stream still holds its error.
        phase.wait();
        if r.rank == 0 {
            let e = expect_err(
                r.p.synchronize_device(),
                "a device synchronize after the failed collective",
            );
            phase.wait();
            e?;
        } else {
            phase.wait();
        }
        // Reported: a wait on a point recorded after the report is clean.
        r.p.synchronize_stream(&r.stream).ok();
        r.p.record_event(&after, &r.stream)?;
        r.p.stream_wait_event(&waiter, &after)?;
        r.p.memset_async(&d, 0, 3, 64, &waiter)?;
        r.p.synchronize_stream(&waiter)
            .context("a wait on an event recorded after the error was reported")?;
        r.p.destroy_stream(&waiter)?;
        r.p.destroy_stream(&third)?;
        Ok(())
    })
}

/// A stream that waited on failed work reports the error even when the failed stream's own
/// synchronize reported it first: each waiter learns of it, whatever the order of the reports.
pub(crate) fn waiter_reports_error_its_source_reported(p: &dyn Platform) -> Result<()> {
    mismatches_are_detected(p)?;
    run_world(p, 2, |r| {
        let (b, after, waiter) = failed_with_a_waiter(r)?;
        r.p.memset_async(&b, 0, 1, 64, &waiter)?;
        expect_err(r.p.synchronize_stream(&r.stream), "the failed collective")?;
        expect_err(
            r.p.synchronize_event(&after),
            "an event recorded after the failed collective, once its stream reported it",
        )?;
        expect_err(
            r.p.synchronize_stream(&waiter),
            "a stream that waited on the failed work, once the failed stream reported it",
        )?;
        r.p.synchronize_stream(&waiter)
            .context("a second synchronize of the waiter (it reported the error)")?;
        r.p.destroy_stream(&waiter)?;
        Ok(())
    })
}

/// An error left on a stream destroyed before any synchronize reported it is reported by the
/// next device synchronize, once: destroying the stream does not drop it.
pub(crate) fn destroyed_stream_error_reaches_device_synchronize(p: &dyn Platform) -> Result<()> {
    mismatches_are_detected(p)?;
    let phase = std::sync::Barrier::new(2);
    run_world(p, 2, |r| {
        let b = r.p.alloc_device(256)?;
        let s = r.p.create_stream()?;
        disagreeing_all_reduce_on(r, &b, &s)?;
        r.p.destroy_stream(&s)?;
        // One rank checks, between barriers, the device synchronize seeing every rank's streams.
        phase.wait();
        let checked = if r.rank == 0 {
            expect_err(
                r.p.synchronize_device(),
                "a device synchronize after the stream of a failed collective was destroyed",
            )
            .map(drop)
            .and_then(|()| {
                r.p.synchronize_device()
                    .context("a second device synchronize (the error was reported)")
            })
        } else {
            Ok(())
        };
        phase.wait();
        checked
    })
}

/// A failed collective aborts its communicator on every rank, as `ncclCommAbort` does: the
/// collectives queued behind it and those issued later fail at once, instead of each waiting
/// out the timeout or (worse) running on a communicator whose ranks are out of step.
pub(crate) fn failed_collective_aborts_communicator(p: &dyn Platform) -> Result<()> {
    mismatches_are_detected(p)?;
    run_world(p, 2, |r| {
        let b = r.p.alloc_device(256)?;
        r.p.memset_async(&b, 0, 0x3F, 256, &r.stream)?;
        let out = r.p.alloc_device(64)?;
        r.p.memset_async(&out, 0, 0, 64, &r.stream)?;
        disagreeing_all_reduce(r, &b)?;
        let all_reduce = || {
            r.p.all_reduce(
                b.at(0),
                out.at(0),
                4,
                DType::F32,
                ReduceOp::Sum,
                &r.comm,
                &r.stream,
            )
        };
        for _ in 0..4 {
            // Matching on both ranks: would run, out of step, on a communicator left as it was.
            all_reduce()?;
        }
        expect_err(r.p.synchronize_stream(&r.stream), "the failed collective")?;
        check_bytes(
            "the output of collectives queued behind a failed one",
            &[0u8; 64],
            &crate::util::download(r.p, &out, 0, 64, &r.stream)?,
        )?;
        all_reduce()?;
        expect_err(
            r.p.synchronize_stream(&r.stream),
            "a collective issued after the communicator failed",
        )?;
        Ok(())
    })
}
