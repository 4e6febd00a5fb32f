//! Timeouts and failures across ranks: a missing rank at init, another process id, a rank
//! that never issues a collective, a dead peer, and huge device counts and worlds.

use super::*;

fn short_timeout() -> CpuBackend {
    cpu(CpuConfig {
        collective_timeout: Duration::from_millis(200),
        ..CpuConfig::default()
    })
}

#[test]
fn comm_init_times_out_naming_the_missing_rank() {
    let p = short_timeout();
    let id = p.unique_id().unwrap();
    let start = Instant::now();
    let e = p
        .comm_init(&id, 0, 2)
        .expect_err("comm_init without rank 1 succeeded");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(
        e.message.contains("[1]"),
        "the timeout does not name rank 1: {e}"
    );
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(10),
        "comm_init gave up after {waited:?} with a 200 ms timeout"
    );
}

/// Queues ten all-reduces of 4 f32 on a new stream; returns it and the buffer they use.
fn ten_all_reduces(
    p: &dyn Platform,
    comm: &hprt_platform::Communicator,
) -> (hprt_platform::Stream, hprt_platform::DeviceBuffer) {
    let s = p.create_stream().unwrap();
    let b = p.alloc_device(64).unwrap();
    for _ in 0..10 {
        p.all_reduce(b.at(0), b.at(32), 4, DType::F32, ReduceOp::Sum, comm, &s)
            .unwrap();
    }
    (s, b)
}

#[test]
fn comm_init_with_another_process_id_says_ranks_are_threads() {
    // Ranks of the cpu backend are threads of one process: an id that crossed a process
    // boundary (its bytes name another process) used to wait for peers until the timeout.
    let p = cpu(CpuConfig {
        collective_timeout: Duration::from_secs(60),
        ..CpuConfig::default()
    });
    let mut id = p.unique_id().unwrap();
    let n = id.0.len();
    let other = u64::from(std::process::id()) + 1;
    id.0[n - 8..].copy_from_slice(&other.to_le_bytes());
    let start = Instant::now();
    let e = p
        .comm_init(&id, 0, 2)
        .expect_err("a foreign process's id was accepted");
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.message.contains("threads of one process"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "it waited {:?}",
        start.elapsed()
    );
}

#[test]
fn collective_times_out_when_a_rank_never_issues_it() {
    let p = short_timeout();
    let id = p.unique_id().unwrap();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (p, id) = (&p, &id);
    std::thread::scope(|scope| {
        let peer = scope.spawn(move || {
            let comm = p.comm_init(id, 1, 2).unwrap();
            // Joined, but never issues the all_reduce; stays alive until rank 0 is done.
            let _ = done_rx.recv();
            drop(comm);
        });
        let comm = p.comm_init(id, 0, 2).unwrap();
        let start = Instant::now();
        // Ten queued behind the first cost one timeout, not ten: the first failure aborts the
        // communicator, and the first cause is what every later one reports.
        let (s, b) = ten_all_reduces(p, &comm);
        let e = p
            .synchronize_stream(&s)
            .expect_err("all_reduce without rank 1 succeeded");
        let waited = start.elapsed();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(
            e.message.contains("[1]"),
            "the timeout does not name rank 1: {e}"
        );
        assert!(
            waited < Duration::from_millis(1000),
            "10 queued all-reduces took {waited:?} at a 200 ms timeout"
        );

        // Issued later, a recv fails at once with the first cause.
        let start = Instant::now();
        p.collective(
            &comm,
            hprt_platform::Collective::Recv {
                recv: b.at(0),
                count: 4,
                dtype: DType::F32,
                peer: 1,
            },
            &s,
        )
        .unwrap();
        let e = p
            .synchronize_stream(&s)
            .expect_err("recv without a sender succeeded");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.message.contains("aborted"), "{e}");
        assert!(start.elapsed() < Duration::from_millis(150));
        done_tx.send(()).unwrap();
        peer.join().unwrap();
    });
}

/// A rank whose thread failed (its communicator dropped) costs its peers no timeout at all:
/// collectives and receives waiting for it fail at once; sends between other ranks go on.
#[test]
fn a_dead_peer_fails_collectives_at_once() {
    let p = cpu(CpuConfig {
        collective_timeout: Duration::from_secs(60),
        ..CpuConfig::default()
    });
    let id = p.unique_id().unwrap();
    let (p, id) = (&p, &id);
    std::thread::scope(|scope| {
        let peer = scope.spawn(move || {
            let _comm = p.comm_init(id, 1, 2).unwrap();
            // Fails (returns) before issuing anything.
        });
        let comm = p.comm_init(id, 0, 2).unwrap();
        peer.join().unwrap();
        let start = Instant::now();
        let (s, b) = ten_all_reduces(p, &comm);
        let e = p.synchronize_stream(&s).expect_err("all_reduce succeeded");
        assert!(e.message.contains("rank 1"), "{e}");
        let recv = hprt_platform::Collective::Recv {
            recv: b.at(0),
            count: 4,
            dtype: DType::F32,
            peer: 1,
        };
        p.collective(&comm, recv, &s).unwrap();
        p.synchronize_stream(&s).expect_err("recv from a dead peer");
        let waited = start.elapsed();
        assert!(
            waited < Duration::from_secs(5),
            "a dead peer cost {waited:?} at a 60 s timeout"
        );
    });
}

/// Sizes are checked before anything is sized from them: a device count or a world past what a
/// cpu platform models is a typed error, not an abort allocating per-device or per-rank state.
#[test]
fn huge_device_counts_and_worlds_are_typed_errors() {
    let e = CpuBackend::try_new(CpuConfig {
        devices: 1 << 40,
        ..CpuConfig::default()
    })
    .err()
    .expect("2^40 devices accepted");
    assert_eq!(e.kind(), ErrorKind::InvalidValue, "{e}");
    let p = cpu(CpuConfig::default());
    let id = p.unique_id().unwrap();
    for world in [1usize << 40, usize::MAX] {
        let e = p
            .comm_init(&id, 0, world)
            .expect_err("a huge world accepted");
        assert_eq!(e.kind(), ErrorKind::InvalidValue, "{world}: {e}");
    }
    // Reading more than the buffer holds is refused before any staging is allocated.
    let b = p.alloc_device(64).unwrap();
    let s = p.create_stream().unwrap();
    let e = b.check_range("read", 0, 1 << 45).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    let mut small = [0u8; 65];
    let e = p.read_device_sync(&b, 0, &mut small, &s).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    assert_eq!(
        p.memory_stats().pinned_allocations,
        0,
        "staging allocated first"
    );
}
