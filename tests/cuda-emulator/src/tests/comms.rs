//! NCCL ranks that disagree (an error, never a hang), injected faults firing once on the named
//! call, and a record racing a wait on its own stream.

use super::*;

/// Ranks of one communicator on threads; `f(rank, comm, stream)`.
fn world(n: usize, f: impl Fn(usize, *mut c_void, *mut c_void) + Sync) {
    let mut id = [0u8; 128];
    // SAFETY: out-pointer to a local.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, 0);
    std::thread::scope(|sc| {
        for rank in 0..n {
            let f = &f;
            sc.spawn(move || {
                bind(rank as i32);
                let mut comm = null_mut();
                let uid = UniqueId::from_bytes(id);
                assert_eq!(
                    // SAFETY: out-pointer to a local; the id is passed by value.
                    unsafe { ncclCommInitRank(&mut comm, n as i32, uid, rank as i32) },
                    0
                );
                let s = stream();
                f(rank, comm, s);
                assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
                assert_eq!(ncclCommDestroy(comm), 0);
                unbind(rank as i32);
            });
        }
    });
}

#[test]
fn nccl_ranks_that_disagree_get_errors_never_a_hang() {
    let _g = setup();
    // Counts differ: every rank's stream fails, the communicator says why.
    world(2, |rank, comm, s| {
        let d = alloc(64);
        let count = if rank == 0 { 4 } else { 8 };
        assert_eq!(ncclAllReduce(d as _, d as _, count, 7, 0, comm, s), 0);
        assert_eq!(cuStreamSynchronize(s), CUDA_ERROR_LAUNCH_FAILED);
        let mut e = 0;
        // SAFETY: out-pointer to a local.
        assert_eq!(unsafe { ncclCommGetAsyncError(comm, &mut e) }, 0);
        assert_eq!(e, NCCL_INVALID_USAGE);
        assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
    });
    // A send and a receive of different sizes.
    world(2, |rank, comm, s| {
        let d = alloc(64);
        if rank == 0 {
            assert_eq!(ncclSend(d as _, 4, 7, 1, comm, s), 0);
            assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
        } else {
            assert_eq!(ncclRecv(d as _, 8, 7, 0, comm, s), 0);
            assert_eq!(cuStreamSynchronize(s), CUDA_ERROR_LAUNCH_FAILED);
        }
        assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
    });
    // Arguments refused at the call.
    world(2, |rank, comm, s| {
        let d = alloc(64);
        let host = [0u8; 64];
        assert_eq!(
            ncclAllReduce(d as _, d as _, 4, 42, 0, comm, s),
            NCCL_INVALID_ARGUMENT,
            "dtype"
        );
        assert_eq!(
            ncclAllReduce(d as _, d as _, 4, 7, 9, comm, s),
            NCCL_INVALID_ARGUMENT,
            "op"
        );
        assert_eq!(
            ncclAllReduce(d as _, d as _, 32, 7, 0, comm, s),
            NCCL_INVALID_ARGUMENT,
            "bounds"
        );
        assert_eq!(
            ncclAllReduce(host.as_ptr().cast(), d as _, 4, 7, 0, comm, s),
            NCCL_INVALID_ARGUMENT,
            "host"
        );
        assert_eq!(
            ncclBroadcast(d as _, d as _, 4, 7, 2, comm, s),
            NCCL_INVALID_ARGUMENT,
            "root"
        );
        assert_eq!(
            ncclSend(d as _, 4, 7, 5, comm, s),
            NCCL_INVALID_ARGUMENT,
            "peer"
        );
        assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE, "no group open");
        // Still usable: a correct all-reduce sums the ranks.
        upload(d, &f32s(&[rank as f32 + 1.0; 4]), s);
        assert_eq!(ncclAllReduce(d as _, d as _, 4, 7, 0, comm, s), 0);
        assert_eq!(from_f32s(&download(d, 16, s)), vec![3.0; 4]);
        assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
    });
    // Two ranks on one device are refused, as NCCL does.
    let mut id = [0u8; 128];
    // SAFETY: out-pointer to a local.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, 0);
    state::set_nccl_timeout_ms(300);
    std::thread::scope(|sc| {
        let results: Vec<_> = (0..2)
            .map(|rank| {
                sc.spawn(move || {
                    bind(0);
                    let mut comm = null_mut();
                    // SAFETY: as in `world`.
                    let r =
                        unsafe { ncclCommInitRank(&mut comm, 2, UniqueId::from_bytes(id), rank) };
                    if r == 0 {
                        assert_eq!(ncclCommDestroy(comm), 0);
                    }
                    unbind(0);
                    r
                })
            })
            .collect();
        let codes: Vec<i32> = results.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(codes.contains(&NCCL_INVALID_USAGE), "{codes:?}");
    });
    state::set_nccl_timeout_ms(0);
}

#[test]
fn injected_faults_fire_once_on_the_named_call() {
    let _g = setup();
    bind(0);
    assert!(state::FAULTS.replace("cuStreamCreate:2:999").is_ok());
    let s = stream();
    let mut t = null_mut();
    // SAFETY: out-pointer to a local.
    unsafe {
        assert_eq!(cuStreamCreate(&mut t, 0), CUDA_ERROR_UNKNOWN);
        assert_eq!(cuStreamCreate(&mut t, 0), CUDA_SUCCESS);
    }
    assert!(
        state::FAULTS.replace("cuStreamCreat:1:1").is_err(),
        "unknown names are refused"
    );
    assert!(state::FAULTS.replace("").is_ok());
    for h in [s, t] {
        assert_eq!(cuStreamDestroy_v2(h), CUDA_SUCCESS);
    }
    unbind(0);
}

/// ISSUE 32 item 16: one thread records an event on a stream while another makes the same
/// stream wait on it. The record published its mark before queueing the mark's completion, so
/// a wait queued in between sat ahead of the completion it waits for: the stream hung.
#[test]
fn a_record_racing_a_wait_on_its_own_stream_never_hangs() {
    let (_g, s) = on_device0();
    let mut e = null_mut();
    assert_eq!(
        // SAFETY: out-pointer to a local.
        unsafe { cuEventCreate(&mut e, CU_EVENT_DISABLE_TIMING) },
        CUDA_SUCCESS
    );
    let (su, eu) = (s as usize, e as usize);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        bind(0);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                bind(0);
                for _ in 0..30_000 {
                    assert_eq!(cuEventRecord(eu as *mut c_void, su as *mut c_void), 0);
                }
                unbind(0);
            });
            sc.spawn(|| {
                bind(0);
                for _ in 0..30_000 {
                    assert_eq!(
                        cuStreamWaitEvent(su as *mut c_void, eu as *mut c_void, 0),
                        0
                    );
                }
                unbind(0);
            });
        });
        let _ = tx.send(cuStreamSynchronize(su as *mut c_void));
        unbind(0);
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the stream hung: a wait queued ahead of the record it waits for");
    assert_eq!(r, CUDA_SUCCESS);
    assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
    done_on_device0(s);
}
