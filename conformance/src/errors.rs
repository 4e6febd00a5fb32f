//! error: typed errors for freed, destroyed and foreign handles, bad ranges and arguments, and
//! collectives the ranks disagree on (an error on every rank, never a hang). The handle cases
//! are here; the collective ones are in `collectives`, where errors reach in `propagation`.

use anyhow::{ensure, Context, Result};
use hprt_platform::{Collective, DType, ErrorKind, Platform, ReduceOp};

use crate::collective::run_world;
use crate::util::{check_bytes, check_pinned, expect_err, expect_kind, pattern, pinned_with};

mod collectives;
mod propagation;
pub(crate) use collectives::{
    collective_bad_arguments, comm_init_bad_rank, group_end_unopened, mismatched_collective,
    overlapping_all_to_all, split_bad_rank_lists,
};
pub(crate) use propagation::{
    destroyed_stream_error_reaches_device_synchronize, failed_collective_aborts_communicator,
    queued_error_reaches_waiters, waiter_reports_error_its_source_reported,
};

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
    check_pinned("copies queued before free_device", &data, &out)?;

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
