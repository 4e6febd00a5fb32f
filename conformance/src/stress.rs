//! stress: many streams chained through events, and concurrent allocation from many threads.

use anyhow::{bail, ensure, Result};
use hprt_platform::{DeviceBuffer, PinnedBuffer, Platform};

use crate::util::{check_pinned, mix, pattern, pinned_with, RoundTrip};

/// 32 streams in a ring, 8 rounds. In round k stream i copies the buffer stream i+1 wrote in
/// round k-1 into its own (double-buffered) and stamps byte k with k. It waits for stream i+1's
/// previous round (read after write) and stream i-1's previous round (write after read: i-1 read
/// the buffer i is about to overwrite). Afterwards stream i holds stream (i+8)'s initial
/// pattern with bytes 1..=8 stamped.
pub(crate) fn ring_of_32_queues(p: &dyn Platform) -> Result<()> {
    const N: usize = 32;
    const ROUNDS: usize = 8;
    const K: usize = 16 << 10;
    let streams = (0..N)
        .map(|_| p.create_stream())
        .collect::<hprt_platform::Result<Vec<_>>>()?;
    let initial: Vec<Vec<u8>> = (0..N).map(|i| pattern(200 + i as u64, K)).collect();
    let srcs = initial
        .iter()
        .map(|d| pinned_with(p, d))
        .collect::<Result<Vec<_>>>()?;
    let bufs: [Vec<DeviceBuffer>; 2] = [
        (0..N)
            .map(|_| p.alloc_device(K))
            .collect::<hprt_platform::Result<_>>()?,
        (0..N)
            .map(|_| p.alloc_device(K))
            .collect::<hprt_platform::Result<_>>()?,
    ];
    let outs = (0..N)
        .map(|_| p.alloc_pinned(K))
        .collect::<hprt_platform::Result<Vec<PinnedBuffer>>>()?;
    let events: Vec<Vec<_>> = (0..=ROUNDS)
        .map(|_| {
            (0..N)
                .map(|_| p.create_event(false))
                .collect::<hprt_platform::Result<Vec<_>>>()
        })
        .collect::<hprt_platform::Result<_>>()?;
    for i in 0..N {
        p.copy_async(
            (&bufs[0][i]).into(),
            0,
            (&srcs[i]).into(),
            0,
            K,
            &streams[i],
        )?;
        p.record_event(&events[0][i], &streams[i])?;
    }
    for k in 1..=ROUNDS {
        for i in 0..N {
            let (next, prev) = ((i + 1) % N, (i + N - 1) % N);
            let s = &streams[i];
            p.stream_wait_event(s, &events[k - 1][next])?;
            p.stream_wait_event(s, &events[k - 1][prev])?;
            let (src, dst) = (&bufs[(k - 1) % 2][next], &bufs[k % 2][i]);
            p.copy_async(dst.into(), 0, src.into(), 0, K, s)?;
            p.memset_async(dst, k, k as u8, 1, s)?;
            p.record_event(&events[k][i], s)?;
        }
    }
    for i in 0..N {
        p.copy_async(
            (&outs[i]).into(),
            0,
            (&bufs[ROUNDS % 2][i]).into(),
            0,
            K,
            &streams[i],
        )?;
    }
    for s in &streams {
        p.synchronize_stream(s)?;
    }
    for i in 0..N {
        let mut want = initial[(i + ROUNDS) % N].clone();
        for (k, b) in want.iter_mut().enumerate().take(ROUNDS + 1).skip(1) {
            *b = k as u8;
        }
        check_pinned(
            &format!("stream {i} after {ROUNDS} ring rounds"),
            &want,
            &outs[i],
        )?;
    }
    for s in &streams {
        p.destroy_stream(s)?;
    }
    Ok(())
}

/// Four threads allocate, resize, copy through and free device and pinned buffers at random;
/// afterwards accounting is back where it started.
pub(crate) fn alloc_storm(p: &dyn Platform) -> Result<()> {
    const THREADS: usize = 4;
    const ITERS: usize = 150;
    const MAX: u64 = 64 << 10;
    let base = p.memory_stats();
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                scope.spawn(move || -> Result<()> {
                    let s = p.create_stream()?;
                    let mut rng = mix(300 + t as u64);
                    let mut next = move || {
                        rng = mix(rng);
                        rng
                    };
                    let mut dev: Vec<DeviceBuffer> = Vec::new();
                    let mut pinned: Vec<PinnedBuffer> = Vec::new();
                    for it in 0..ITERS {
                        let r = next();
                        let size = 1 + (next() % MAX) as usize;
                        match r % 8 {
                            0..=2 => dev.push(p.alloc_device(size)?),
                            3 => pinned.push(p.alloc_pinned(size)?),
                            4 if !dev.is_empty() => {
                                let b = dev.swap_remove((next() as usize) % dev.len());
                                if next() % 2 == 0 {
                                    p.free_device(&b)?;
                                }
                            }
                            5 if !pinned.is_empty() => {
                                let b = pinned.swap_remove((next() as usize) % pinned.len());
                                if next() % 2 == 0 {
                                    p.free_pinned(&b)?;
                                }
                            }
                            6 if !dev.is_empty() => {
                                let i = (next() as usize) % dev.len();
                                let new = if next() % 3 == 0 { 0 } else { size };
                                p.resize_device(&dev[i], new)?;
                                ensure!(
                                    dev[i].len() == new,
                                    "resize to {new} left len {}",
                                    dev[i].len()
                                );
                            }
                            _ => {
                                // A round trip through a fresh pair of buffers.
                                let rt = RoundTrip::new(p, next(), size.min(4096))?;
                                rt.queue(p, &s, &s)?;
                                p.synchronize_stream(&s)?;
                                rt.check(&format!("thread {t} iteration {it} round trip"))?;
                            }
                        }
                        if dev.len() > 12 {
                            dev.remove(0);
                        }
                        if pinned.len() > 6 {
                            pinned.remove(0);
                        }
                    }
                    drop(dev);
                    drop(pinned);
                    p.synchronize_stream(&s)?;
                    p.destroy_stream(&s)?;
                    Ok(())
                })
            })
            .collect();
        crate::util::join_failures(handles, "thread")
    });
    if !errors.is_empty() {
        bail!("{}", errors.join(" | "));
    }
    let end = p.memory_stats();
    let kinds = [
        (
            "device",
            (base.device_current, base.device_allocations),
            (end.device_current, end.device_allocations),
        ),
        (
            "pinned",
            (base.pinned_current, base.pinned_allocations),
            (end.pinned_current, end.pinned_allocations),
        ),
    ];
    for (kind, (current0, allocations0), (current, allocations)) in kinds {
        ensure!(
            current == current0 && allocations == allocations0,
            "{kind} accounting did not return to its start: current {current0} -> {current}, \
             allocations {allocations0} -> {allocations}",
        );
    }
    ensure!(
        end.device_peak >= base.device_current,
        "device peak {} below the start",
        end.device_peak
    );
    Ok(())
}
