//! The contracts across ranks and queued work: failed sends and collectives, buffers never
//! freed under queued work, and collectives whose peer never comes.

use super::*;

/// A send that fails (an injected `ncclSend` fault inside an all-to-all's group) is a typed error
/// naming the NCCL status on its rank; the peer's receive, which NCCL would leave pending, fails
/// after the collective timeout (the watchdog) instead of hanging; a fresh communicator then
/// works on both ranks.
#[test]
fn a_failed_send_is_an_error_on_both_ranks_never_a_hang() {
    let _g = serial();
    let emu = Emu::open();
    let p = open_with_timeout(300);
    let all_to_all = |p: &dyn Platform, rank: usize, id: &hprt_platform::UniqueId| {
        p.set_device(rank)?;
        let s = p.create_stream()?;
        let c = p.comm_init(id, rank, 2)?;
        let b = p.alloc_device(256)?;
        let op = Collective::AllToAll {
            send: b.at(0),
            recv: b.at(128),
            count: 16,
            dtype: DType::F32,
        };
        p.collective(&c, op, &s)?;
        p.synchronize_stream(&s)
    };
    let frees_under_work = emu.stats().frees_under_queued_work;
    emu.faults("ncclSend:1:4");
    let id = p.unique_id().unwrap();
    let results: Vec<hprt_platform::Result<()>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (p, id) = (&p, &id);
                sc.spawn(move || all_to_all(p, rank, id))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    emu.faults("");
    assert_eq!(
        emu.stats().frees_under_queued_work,
        frees_under_work,
        "a buffer was freed while the failed all-to-all's queued work still used it"
    );
    let names: Vec<String> = results
        .iter()
        .map(|r| {
            r.as_ref()
                .map_or_else(|e| e.code_name.to_string(), |()| "ok".into())
        })
        .collect();
    assert!(
        names.contains(&"ncclInvalidArgument".to_string())
            && names.contains(&"HP_ERROR_TIMEOUT".to_string()),
        "{names:?}"
    );
    let id = p.unique_id().unwrap();
    std::thread::scope(|sc| {
        for rank in 0..2 {
            let (p, id) = (&p, &id);
            sc.spawn(move || all_to_all(p, rank, id).unwrap());
        }
    });
    assert_eq!(emu.stats().live_comms, 0);
}

/// When the backend cannot record that queued work uses a buffer (its use event cannot be
/// created or recorded), the call fails and the buffers are still never freed under that work.
#[test]
fn a_use_that_cannot_be_recorded_never_lets_a_buffer_be_freed_under_queued_work() {
    let _g = serial();
    let emu = Emu::open();
    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    let before = emu.stats().frees_under_queued_work;
    for spec in [
        "cuEventCreate:1:2",
        "cuEventRecord:1:999",
        "cuEventCreate:2:2",
    ] {
        let d = p.alloc_device(1 << 16).unwrap();
        let h = p.alloc_pinned(1 << 16).unwrap();
        // Keeps the copy queued while the buffers are dropped.
        p.launch_host_fn(
            &s,
            Box::new(|| std::thread::sleep(std::time::Duration::from_millis(30))),
        )
        .unwrap();
        emu.faults(spec);
        let e = p
            .copy_async((&d).into(), 0, (&h).into(), 0, 1 << 16, &s)
            .expect_err(spec);
        emu.faults("");
        assert!(e.message.contains("cuEvent"), "{spec}: {e}");
        drop((d, h));
        p.synchronize_stream(&s).unwrap();
        assert_eq!(
            emu.stats().frees_under_queued_work,
            before,
            "{spec}: a buffer was freed while the copy still used it"
        );
    }
}

/// A failed collective (ranks disagree on the count, which the emulator reports as NCCL's
/// `ncclInvalidUsage`) makes the backend abort the communicator on each rank
/// (`ncclCommGetAsyncError`, then `ncclCommAbort`) at its next operation, which fails on its
/// stream with that first cause instead of being handed to a broken communicator; dropping the
/// aborted communicator does not destroy it a second time.
#[test]
fn a_failed_collective_aborts_the_communicator_on_every_rank() {
    let _g = serial();
    let emu = Emu::open();
    let p = open().unwrap();
    let id = p.unique_id().unwrap();
    let comms_before = emu.stats().live_comms;
    let both = std::sync::Barrier::new(2);
    let live_while_held = Mutex::new(None);
    let rank_run = |rank: usize| -> hprt_platform::Result<(String, String)> {
        p.set_device(rank)?;
        let s = p.create_stream()?;
        let c = p.comm_init(&id, rank, 2)?;
        let b = p.alloc_device(256)?;
        let all_reduce =
            |count| p.all_reduce(b.at(0), b.at(64), count, DType::F32, ReduceOp::Sum, &c, &s);
        all_reduce(if rank == 0 { 4 } else { 8 })?;
        let first = p.synchronize_stream(&s).unwrap_err();
        all_reduce(4)?;
        let later = p.synchronize_stream(&s).unwrap_err();
        both.wait();
        if rank == 0 {
            *live_while_held.lock().unwrap() = Some(emu.stats().live_comms);
        }
        both.wait();
        Ok((first.code_name.to_string(), later.code_name.to_string()))
    };
    let results: Vec<(String, String)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| sc.spawn(move || rank_run(rank)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    for (first, later) in &results {
        assert_eq!(first, "CUDA_ERROR_LAUNCH_FAILED", "{results:?}");
        assert_eq!(later, "ncclInvalidUsage", "{results:?}");
    }
    assert_eq!(
        *live_while_held.lock().unwrap(),
        Some(comms_before),
        "the failed communicator was not aborted on every rank"
    );
    assert_eq!(emu.stats().live_comms, comms_before);
}

/// A buffer with a memset queued on `s` behind a host function that holds the stream until the
/// returned sender sends (at most 10 s, so a free that waits shows up as slow, not as a hang).
fn queued_memset(
    p: &dyn Platform,
    s: &hprt_platform::Stream,
) -> (hprt_platform::DeviceBuffer, std::sync::mpsc::Sender<()>) {
    let d = p.alloc_device(1 << 16).unwrap();
    let (release, held) = std::sync::mpsc::channel::<()>();
    p.launch_host_fn(
        s,
        Box::new(move || {
            let _ = held.recv_timeout(std::time::Duration::from_secs(10));
        }),
    )
    .unwrap();
    p.memset_async(&d, 0, 1, 1 << 16, s).unwrap();
    (d, release)
}

/// Frees are stream ordered: dropping a buffer that queued work still uses returns at once, and
/// its memory is freed only once that work finished (no `cuMemFree` under queued work, the
/// allocation gone after a synchronize). When the backend cannot show that the work finished
/// (the query on its use event fails), the buffer is leaked (logged) instead of freed under work
/// that may still use it.
#[test]
fn a_free_waits_for_no_queued_work_and_a_buffer_whose_last_use_cannot_be_shown_finished_is_leaked()
{
    let _g = serial();
    let emu = Emu::open();
    let frees_under_work = emu.stats().frees_under_queued_work;
    let allocations = emu.stats().live_device_allocations;
    let reclaimed = emu.stats().reclaimed_at_context_destroy;
    // Dropping the platform waits for the memory still waiting for its queued work, then frees
    // it.
    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    let (d, release) = queued_memset(&p, &s);
    drop(d);
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let _ = release.send(());
    });
    drop((s, p));
    releaser.join().unwrap();
    assert_eq!(
        emu.stats().frees_under_queued_work,
        frees_under_work,
        "the platform's teardown freed memory under queued work"
    );
    assert_eq!(
        (
            emu.stats().live_device_allocations,
            emu.stats().reclaimed_at_context_destroy
        ),
        (allocations, reclaimed),
        "the platform's teardown did not free the memory waiting for its queued work"
    );

    let p = open().unwrap();
    let s = p.create_stream().unwrap();
    for query_fault in ["", "cuEventQuery:1:999"] {
        let (d, release) = queued_memset(&p, &s);
        emu.faults(query_fault);
        let started = std::time::Instant::now();
        drop(d);
        let took = started.elapsed();
        emu.faults("");
        assert!(
            took < std::time::Duration::from_secs(5),
            "{query_fault:?}: the free waited for the queued memset ({took:?})"
        );
        let _ = release.send(());
        p.synchronize_stream(&s).unwrap();
        assert_eq!(
            emu.stats().frees_under_queued_work,
            frees_under_work,
            "{query_fault:?}: a buffer was freed while queued work still used it"
        );
    }
    assert_eq!(
        emu.stats().live_device_allocations,
        allocations + 1,
        "not exactly the buffer whose last use could not be shown finished was kept (leaked)"
    );
}

/// The cuda backend on the emulator with a collective timeout of `ms` (`HP_COLLECTIVE_TIMEOUT_MS`
/// is read when a platform opens; callers hold `serial()`).
fn open_with_timeout(ms: u64) -> hprt_platform::CudaBackend {
    std::env::set_var("HP_COLLECTIVE_TIMEOUT_MS", ms.to_string());
    let p = open();
    std::env::remove_var("HP_COLLECTIVE_TIMEOUT_MS");
    p.unwrap()
}

/// NCCL never times a collective out: a peer that skips one, or never calls it at all, leaves it
/// pending (the emulator models that) and every wait on it blocked. The backend's watchdog aborts
/// the communicator once the collective has been outstanding for the collective timeout: the
/// waiting synchronize fails within the bound with a `Timeout` naming the collective and the
/// communicator, the collectives queued behind it and those issued later fail at once with the
/// same cause, and the aborted communicator can still be destroyed. Without the watchdog the
/// rank's synchronize never returns, which the outer bound turns into a failure, not a hang.
#[test]
fn a_collective_whose_peer_never_comes_fails_within_the_collective_timeout() {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};
    type Outcome = (
        hprt_platform::Error,
        Duration,
        hprt_platform::Error,
        Duration,
    );
    let _g = serial();
    let emu = Emu::open();
    let p = std::sync::Arc::new(open_with_timeout(1000));
    let comms_before = emu.stats().live_comms;
    // Rank 1 issues this many of rank 0's three all-reduces (one: it skips the second; none: it
    // never calls any), then destroys its communicator; rank 0 issues them one by one, or in one
    // NCCL group (queued, and watched, at its end), or destroys its communicator before it
    // synchronizes (the destroy waits for them as NCCL's would, but only as long as the timeout).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Rank0 {
        Plain,
        Grouped,
        DestroysFirst,
    }
    for (issued_by_peer, rank0) in [
        (1usize, Rank0::Plain),
        (0, Rank0::Plain),
        (0, Rank0::Grouped),
        (0, Rank0::DestroysFirst),
    ] {
        let id = p.unique_id().unwrap();
        let (report, reports) = mpsc::channel();
        for rank in 0..2 {
            let (p, id, report) = (p.clone(), id.clone(), report.clone());
            std::thread::spawn(move || {
                let run = || -> hprt_platform::Result<Option<Outcome>> {
                    p.set_device(rank)?;
                    let s = p.create_stream()?;
                    let c = p.comm_init(&id, rank, 2)?;
                    let b = p.alloc_device(256)?;
                    let all_reduce =
                        || p.all_reduce(b.at(0), b.at(64), 4, DType::F32, ReduceOp::Sum, &c, &s);
                    if rank == 1 {
                        for _ in 0..issued_by_peer {
                            all_reduce()?;
                        }
                        p.synchronize_stream(&s)?;
                        return Ok(None);
                    }
                    if rank0 == Rank0::Grouped {
                        p.group_start()?;
                    }
                    for _ in 0..3 {
                        all_reduce()?;
                    }
                    if rank0 == Rank0::Grouped {
                        p.group_end()?;
                    }
                    let start = Instant::now();
                    if rank0 == Rank0::DestroysFirst {
                        p.destroy_comm(&c)?;
                    }
                    let Err(first) = p.synchronize_stream(&s) else {
                        panic!("a collective no peer joined succeeded");
                    };
                    let waited = start.elapsed();
                    if rank0 == Rank0::DestroysFirst {
                        return Ok(Some((first.clone(), waited, first, Duration::ZERO)));
                    }
                    let start = Instant::now();
                    all_reduce()?;
                    let Err(later) = p.synchronize_stream(&s) else {
                        panic!("a collective issued after the abort succeeded");
                    };
                    let at_once = start.elapsed();
                    p.destroy_comm(&c)?;
                    Ok(Some((first, waited, later, at_once)))
                };
                let _ = report.send((rank, run()));
            });
        }
        let mut outcome = None;
        for _ in 0..2 {
            let (rank, r) = reports
                .recv_timeout(Duration::from_secs(10))
                .expect("a rank hung: nothing ended the collective its peer never joined");
            let r = r.unwrap_or_else(|e| {
                panic!("rank {rank} (peer issued {issued_by_peer}, rank 0 {rank0:?}): {e}")
            });
            outcome = outcome.or(r);
        }
        let (first, waited, later, at_once) = outcome.expect("rank 0 reported");
        assert_eq!(first.kind, ErrorKind::Timeout, "{rank0:?}: {first}");
        assert!(
            first
                .message
                .contains(&format!("all_reduce #{}", issued_by_peer + 1))
                && first.message.contains("rank 0 of 2"),
            "{first}"
        );
        assert!(
            waited >= Duration::from_millis(900) && waited < Duration::from_secs(3),
            "the synchronize failed after {waited:?}, with a collective timeout of 1 s"
        );
        assert_eq!(later.message, first.message, "{later}");
        assert!(at_once < Duration::from_millis(500), "{at_once:?}");
    }
    assert_eq!(emu.stats().live_comms, comms_before);
}
