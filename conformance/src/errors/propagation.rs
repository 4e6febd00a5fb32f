//! Where an error goes: to waiters on a failed stream, to a device synchronize after a
//! destroyed stream, and to every rank of a communicator a failed collective aborts.

use super::*;

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
