//! stream: FIFO order on one stream, cross-stream dependencies through events, queries and
//! device-wide synchronization.

use anyhow::{ensure, Context, Result};
use hprt_platform::Platform;

use crate::util::{check_bytes, check_pinned, download, pattern, pinned_with, RoundTrip};

/// A chain of 50 copies and memsets on one stream whose result depends on running in order:
/// block i is a copy of block i-1 with byte i set to i, so block i ends up as block 0 with bytes
/// 1..=i replaced by their own index.
pub(crate) fn ordering_chain(p: &dyn Platform) -> Result<()> {
    const K: usize = 64;
    const STEPS: usize = 50;
    let stream = p.create_stream()?;
    let block0 = pattern(41, K);
    let src = pinned_with(p, &block0)?;
    let d = p.alloc_device(K * (STEPS + 1))?;
    p.copy_async((&d).into(), 0, (&src).into(), 0, K, &stream)?;
    for i in 1..=STEPS {
        p.copy_async((&d).into(), i * K, (&d).into(), (i - 1) * K, K, &stream)?;
        p.memset_async(&d, i * K + i, i as u8, 1, &stream)?;
    }
    let mut want = Vec::with_capacity(K * (STEPS + 1));
    let mut block = block0.clone();
    want.extend_from_slice(&block);
    for i in 1..=STEPS {
        block[i] = i as u8;
        want.extend_from_slice(&block);
    }
    let got = download(p, &d, 0, d.len(), &stream)?;
    check_bytes("blocks after the 100-step chain", &want, &got)?;
    ensure!(
        p.query_stream(&stream)?,
        "query_stream is false after read_device_sync"
    );
    p.destroy_stream(&stream)?;
    Ok(())
}

/// Stream A uploads, B waits for A's event and downloads; then A waits for B's event before
/// overwriting the buffer (write-after-read). No host synchronization until the end.
pub(crate) fn cross_stream_wait(p: &dyn Platform) -> Result<()> {
    const N: usize = 4 << 20;
    const ROUNDS: usize = 3;
    let a = p.create_stream()?;
    let b = p.create_stream()?;
    let dev = p.alloc_device(N)?;
    let srcs: Vec<Vec<u8>> = (0..ROUNDS).map(|k| pattern(50 + k as u64, N)).collect();
    let pinned_srcs = srcs
        .iter()
        .map(|s| pinned_with(p, s))
        .collect::<Result<Vec<_>>>()?;
    let outs = (0..ROUNDS)
        .map(|_| p.alloc_pinned(N))
        .collect::<hprt_platform::Result<Vec<_>>>()?;
    let uploaded = p.create_event(false)?;
    let read = p.create_event(false)?;
    for k in 0..ROUNDS {
        if k > 0 {
            p.stream_wait_event(&a, &read)?;
        }
        p.copy_async((&dev).into(), 0, (&pinned_srcs[k]).into(), 0, N, &a)?;
        p.record_event(&uploaded, &a)?;
        p.stream_wait_event(&b, &uploaded)?;
        p.copy_async((&outs[k]).into(), 0, (&dev).into(), 0, N, &b)?;
        p.record_event(&read, &b)?;
    }
    p.synchronize_stream(&b)?;
    for k in 0..ROUNDS {
        check_pinned(
            &format!("round {k}: data stream B downloaded after waiting on A's event"),
            &srcs[k],
            &outs[k],
        )?;
    }
    p.synchronize_stream(&a)?;
    p.destroy_event(&uploaded)?;
    p.destroy_event(&read)?;
    p.destroy_stream(&a)?;
    p.destroy_stream(&b)?;
    Ok(())
}

pub(crate) fn query_after_synchronize(p: &dyn Platform) -> Result<()> {
    let s = p.create_stream()?;
    ensure!(
        p.query_stream(&s)?,
        "query_stream is false on a new, empty stream"
    );
    let d = p.alloc_device(1 << 20)?;
    let h = p.alloc_pinned(1 << 20)?;
    for _ in 0..8 {
        p.memset_async(&d, 0, 7, 1 << 20, &s)?;
        p.copy_async((&h).into(), 0, (&d).into(), 0, 1 << 20, &s)?;
    }
    // May be true or false; it must not fail.
    p.query_stream(&s)
        .context("query_stream while work may be queued")?;
    p.synchronize_stream(&s)?;
    ensure!(
        p.query_stream(&s)?,
        "query_stream is false after synchronize_stream"
    );
    ensure!(
        p.query_stream(&s)?,
        "query_stream is false on a second query"
    );
    crate::util::check_fill("pinned buffer after synchronize", &h.to_vec()?, 7)?;
    p.destroy_stream(&s)?;
    Ok(())
}

/// Work on four streams, then one `synchronize_device`: every stream is idle and every result
/// visible to the host.
pub(crate) fn synchronize_device_all(p: &dyn Platform) -> Result<()> {
    const N: usize = 256 << 10;
    let streams = (0..4)
        .map(|_| p.create_stream())
        .collect::<hprt_platform::Result<Vec<_>>>()?;
    let mut keep = Vec::new();
    for (i, s) in streams.iter().enumerate() {
        let rt = RoundTrip::new(p, 60 + i as u64, N)?;
        for _ in 0..4 {
            rt.queue(p, s, s)?;
        }
        keep.push(rt);
    }
    p.synchronize_device()?;
    for (i, s) in streams.iter().enumerate() {
        ensure!(
            p.query_stream(s)?,
            "stream {i} is busy after synchronize_device"
        );
        keep[i].check(&format!("stream {i}'s download after synchronize_device"))?;
    }
    for s in &streams {
        p.destroy_stream(s)?;
    }
    Ok(())
}

/// Work queued before `destroy_stream` still completes; an event recorded before it tells when.
pub(crate) fn destroy_with_pending_work(p: &dyn Platform) -> Result<()> {
    const N: usize = 1 << 20;
    let s = p.create_stream()?;
    let rt = RoundTrip::new(p, 70, N)?;
    let done = p.create_event(false)?;
    rt.queue(p, &s, &s)?;
    p.record_event(&done, &s)?;
    p.destroy_stream(&s)?;
    ensure!(!s.is_live(), "a destroyed stream reports is_live");
    p.synchronize_event(&done)
        .context("synchronize_event on an event recorded before destroy_stream")?;
    rt.check("download queued before destroy_stream")?;
    Ok(())
}
