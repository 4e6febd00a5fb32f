//! event: never-recorded events, record/synchronize/query, re-recording, timing and its errors,
//! and deterministic "not yet" states behind a collective gate.

use std::sync::mpsc;

use anyhow::{anyhow, ensure, Context, Result};
use hprt_platform::{ErrorKind, Platform};

use crate::util::{check_pinned, expect_kind, panic_message, pattern, pinned_with, RoundTrip};

pub(crate) fn never_recorded(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    for timing in [false, true] {
        let e = p.create_event(timing)?;
        ensure!(
            e.has_timing() == timing,
            "has_timing is {} for create_event({timing})",
            e.has_timing()
        );
        ensure!(
            p.query_event(&e)?,
            "query_event is false for a never-recorded event (timing {timing})"
        );
        p.synchronize_event(&e).with_context(|| {
            format!("synchronize_event on a never-recorded event (timing {timing})")
        })?;
        // Waiting on it is a no-op: later work still runs.
        p.stream_wait_event(&s, &e)?;
        let d = p.alloc_device(64)?;
        p.memset_async(&d, 0, 3, 64, &s)?;
        p.synchronize_stream(&s)
            .context("synchronize after waiting on a never-recorded event")?;
        p.destroy_event(&e)?;
    }
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn record_synchronize_query(p: &dyn Platform) -> Result<()> {
    const N: usize = 1 << 20;
    let s = p.create_stream()?;
    let rt = RoundTrip::new(p, 80, N)?;
    let e = p.create_event(false)?;
    rt.queue(p, &s, &s)?;
    p.record_event(&e, &s)?;
    p.query_event(&e)
        .context("query_event right after record")?;
    p.synchronize_event(&e)?;
    ensure!(
        p.query_event(&e)?,
        "query_event is false after synchronize_event"
    );
    rt.check("download before the event, read after synchronize_event")?;
    p.destroy_event(&e)?;
    p.destroy_stream(&s)?;
    Ok(())
}

/// A wait targets the event's latest record: B waits on an event A recorded twice and must see
/// the work queued before the second record.
pub(crate) fn rerecord_waits_for_latest(p: &dyn Platform) -> Result<()> {
    const N: usize = 2 << 20;
    let a = p.create_stream()?;
    let b = p.create_stream()?;
    let (x, y) = (pattern(81, N), pattern(82, N));
    let (px, py) = (pinned_with(p, &x)?, pinned_with(p, &y)?);
    let (dx, dy) = (p.alloc_device(N)?, p.alloc_device(N)?);
    let (ox, oy) = (p.alloc_pinned(N)?, p.alloc_pinned(N)?);
    let e = p.create_event(false)?;
    p.copy_async((&dx).into(), 0, (&px).into(), 0, N, &a)?;
    p.record_event(&e, &a)?;
    p.copy_async((&dy).into(), 0, (&py).into(), 0, N, &a)?;
    p.record_event(&e, &a)?;
    p.stream_wait_event(&b, &e)?;
    p.copy_async((&ox).into(), 0, (&dx).into(), 0, N, &b)?;
    p.copy_async((&oy).into(), 0, (&dy).into(), 0, N, &b)?;
    p.synchronize_stream(&b)?;
    check_pinned("upload before the first record", &x, &ox)?;
    check_pinned("upload before the second record", &y, &oy)?;
    p.synchronize_event(&e)?;
    ensure!(
        p.query_event(&e)?,
        "query_event false after synchronize_event"
    );
    p.destroy_stream(&a)?;
    p.destroy_stream(&b)?;
    Ok(())
}

pub(crate) fn elapsed_time(p: &dyn Platform) -> Result<()> {
    const N: usize = 1 << 20;
    let s = p.create_stream()?;
    let start = p.create_event(true)?;
    let end = p.create_event(true)?;
    let d = p.alloc_device(N)?;
    let h = p.alloc_pinned(N)?;
    p.record_event(&start, &s)?;
    for i in 0..8 {
        p.memset_async(&d, 0, i, N, &s)?;
        p.copy_async((&h).into(), 0, (&d).into(), 0, N, &s)?;
    }
    p.record_event(&end, &s)?;
    p.synchronize_event(&end)?;
    p.synchronize_event(&start)?;
    let ms = p.event_elapsed_ms(&start, &end)?;
    ensure!(
        ms.is_finite() && ms >= 0.0,
        "elapsed time between start and end is {ms} ms"
    );
    ensure!(
        ms < 60_000.0,
        "elapsed time {ms} ms is implausible for 16 MiB of work"
    );
    let same = p.event_elapsed_ms(&end, &end)?;
    ensure!(
        same.abs() < 1e-3,
        "elapsed time from an event to itself is {same} ms"
    );
    p.destroy_event(&start)?;
    p.destroy_event(&end)?;
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn elapsed_without_timing(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let plain = p.create_event(false)?;
    let timed = p.create_event(true)?;
    p.record_event(&plain, &s)?;
    p.record_event(&timed, &s)?;
    p.synchronize_stream(&s)?;
    expect_kind(
        p.event_elapsed_ms(&plain, &timed),
        ErrorKind::InvalidValue,
        "elapsed_ms from an event created with timing=false",
    )?;
    expect_kind(
        p.event_elapsed_ms(&timed, &plain),
        ErrorKind::InvalidValue,
        "elapsed_ms to an event created with timing=false",
    )?;
    p.destroy_stream(&s)?;
    Ok(())
}

pub(crate) fn elapsed_not_ready(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    let a = p.create_event(true)?;
    let b = p.create_event(true)?;
    expect_kind(
        p.event_elapsed_ms(&a, &b),
        ErrorKind::NotReady,
        "elapsed_ms between two never-recorded events",
    )?;
    p.record_event(&a, &s)?;
    p.synchronize_event(&a)?;
    expect_kind(
        p.event_elapsed_ms(&a, &b),
        ErrorKind::NotReady,
        "elapsed_ms to a never-recorded event",
    )?;
    expect_kind(
        p.event_elapsed_ms(&b, &a),
        ErrorKind::NotReady,
        "elapsed_ms from a never-recorded event",
    )?;
    p.destroy_stream(&s)?;
    Ok(())
}

/// A two-rank barrier whose second rank is held back by the host keeps stream S busy, so the
/// pending states can be checked deterministically: the event after the barrier is not reached,
/// elapsed time is NotReady, S and a stream waiting on the event are busy. Then the gate opens.
pub(crate) fn pending_while_gated(p: &dyn Platform) -> Result<()> {
    if !crate::collective::world_fits(p, 2) {
        return pending_behind_host_fn(p);
    }
    let id = p.unique_id()?;
    let (open_tx, open_rx) = mpsc::channel::<()>();
    let id = &id;
    std::thread::scope(|scope| {
        let peer = scope.spawn(move || -> Result<()> {
            // One device per rank where there are several (NCCL wants distinct GPUs).
            p.set_device(1 % p.device_count().max(1))?;
            let comm = p.comm_init(id, 1, 2).context("rank 1 comm_init")?;
            let s = p.create_stream()?;
            // Held until rank 0 checked the pending states (or gave up).
            let _ = open_rx.recv();
            p.barrier(&comm, &s)?;
            p.synchronize_stream(&s).context("rank 1 barrier")?;
            p.destroy_stream(&s)?;
            p.destroy_comm(&comm)?;
            Ok(())
        });
        let mut open_tx = Some(open_tx);
        let mine = (|| -> Result<()> {
            p.set_device(0)?;
            let comm = p.comm_init(id, 0, 2).context("rank 0 comm_init")?;
            let g = behind_gate(p, |s| p.barrier(&comm, s))?;
            let gated = g.pending(p, &BARRIER);
            if let Some(tx) = open_tx.take() {
                let _ = tx.send(());
            }
            g.released(p, &BARRIER)?;
            p.destroy_comm(&comm)?;
            gated
        })();
        drop(open_tx);
        let theirs = peer
            .join()
            .map_err(|e| anyhow!("rank 1 panicked: {}", panic_message(&*e)))?;
        mine.context("rank 0")?;
        theirs.context("rank 1")
    })
}

/// [`pending_while_gated`] where two ranks do not fit (one GPU under NCCL): the gate is a host
/// function that blocks its stream until released.
fn pending_behind_host_fn(p: &dyn Platform) -> Result<()> {
    let (open_tx, open_rx) = mpsc::channel::<()>();
    let g = behind_gate(p, |s| {
        p.launch_host_fn(
            s,
            Box::new(move || {
                // Bounded, so a failing case cannot hang the suite.
                let _ = open_rx.recv_timeout(std::time::Duration::from_secs(30));
            }),
        )
    })?;
    let gated = g.pending(p, &HOST_FN);
    drop(open_tx);
    g.released(p, &HOST_FN)?;
    gated
}

/// How a gate reads in the failure messages of [`Gated`]'s checks.
struct Gate {
    /// What the event after the gate is behind while it is closed.
    behind: &'static str,
    /// The closed gate, as elapsed time's end is behind it.
    closed: &'static str,
    /// What the gated stream waits in.
    waits_in: &'static str,
    /// The gate once open.
    opened: &'static str,
    /// What the elapsed time spans.
    across: &'static str,
    /// The context of the gated stream's synchronize.
    sync: &'static str,
}

const BARRIER: Gate = Gate {
    behind: "a barrier a peer has not reached",
    closed: "an open barrier",
    waits_in: "a barrier",
    opened: "the barrier completed",
    across: "the barrier",
    sync: "rank 0 barrier",
};

const HOST_FN: Gate = Gate {
    behind: "a host function that has not returned",
    closed: "a blocked host function",
    waits_in: "a host function",
    opened: "the host function returned",
    across: "the host function",
    sync: "the gated stream",
};

/// Stream `s` held in a gate between events `start` and `end`, and stream `t` waiting on `end`
/// before a memset of `_d`.
struct Gated {
    s: hprt_platform::Stream,
    t: hprt_platform::Stream,
    start: hprt_platform::Event,
    end: hprt_platform::Event,
    _d: hprt_platform::DeviceBuffer,
}

/// Queues [`Gated`]'s work, with `gate` (work that does not finish until its gate opens) queued
/// on `s`.
fn behind_gate(
    p: &dyn Platform,
    gate: impl FnOnce(&hprt_platform::Stream) -> Result<(), hprt_platform::Error>,
) -> Result<Gated> {
    let s = p.create_stream()?;
    let t = p.create_stream()?;
    let start = p.create_event(true)?;
    let end = p.create_event(true)?;
    let d = p.alloc_device(256)?;
    p.record_event(&start, &s)?;
    gate(&s)?;
    p.record_event(&end, &s)?;
    p.stream_wait_event(&t, &end)?;
    p.memset_async(&d, 0, 9, 256, &t)?;
    Ok(Gated {
        s,
        t,
        start,
        end,
        _d: d,
    })
}

impl Gated {
    /// While the gate is closed: everything behind it is pending.
    fn pending(&self, p: &dyn Platform, gate: &Gate) -> Result<()> {
        ensure!(
            !p.query_event(&self.end)?,
            "query_event is true for an event behind {}",
            gate.behind
        );
        expect_kind(
            p.event_elapsed_ms(&self.start, &self.end),
            ErrorKind::NotReady,
            &format!("elapsed_ms to an event behind {}", gate.closed),
        )?;
        ensure!(
            !p.query_stream(&self.s)?,
            "query_stream is true while the stream waits in {}",
            gate.waits_in
        );
        ensure!(
            !p.query_stream(&self.t)?,
            "query_stream is true for a stream waiting on a pending event"
        );
        Ok(())
    }

    /// Once the gate opened: both streams finish, `end` is reached after `start`; the streams
    /// are destroyed.
    fn released(self, p: &dyn Platform, gate: &Gate) -> Result<()> {
        p.synchronize_stream(&self.s).context(gate.sync)?;
        p.synchronize_stream(&self.t)?;
        ensure!(
            p.query_event(&self.end)?,
            "query_event false after {}",
            gate.opened
        );
        let ms = p.event_elapsed_ms(&self.start, &self.end)?;
        ensure!(ms >= 0.0, "elapsed time across {} is {ms} ms", gate.across);
        p.destroy_stream(&self.s)?;
        p.destroy_stream(&self.t)?;
        Ok(())
    }
}
