//! Fault injection, statistics of live resources, panics stopped at the boundary, and a record
//! racing a wait on its own stream.

use super::*;

#[test]
fn fault_injection() {
    let _g = setup();
    // SAFETY: fault specs are NUL-terminated literals or null (refused); out-pointers are live
    // locals; the null handles of the count-0 calls are never used.
    unsafe {
        assert_eq!(
            hprtEmuSetFaults(c"aclrtMalloc:2:207001,HcclAllReduce:1:9".as_ptr()),
            0
        );
        let a = malloc(16);
        let mut p = null_mut();
        assert_eq!(aclrtMalloc(&mut p, 16, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
        let b = malloc(16);
        assert_eq!(
            HcclAllReduce(null_mut(), null_mut(), 0, 99, 99, null_mut(), null_mut()),
            9
        );
        // Count 0 is a no-op that succeeds before any check, as in CANN.
        assert_eq!(
            HcclAllReduce(null_mut(), null_mut(), 0, 99, 99, null_mut(), null_mut()),
            0
        );
        // Malformed: rejected, previous rules and counts kept.
        assert_eq!(
            hprtEmuSetFaults(c"aclrtMalloc:x:1".as_ptr()),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(hprtEmuSetFaults(null()), ACL_ERROR_INVALID_PARAM);
        // Counters restart with a new spec.
        assert_eq!(
            hprtEmuSetFaults(c"aclrtFree:1:507000, aclInit:1:100000".as_ptr()),
            0
        );
        assert_eq!(aclrtFree(a), ACL_ERROR_RT_INTERNAL_ERROR);
        free(a);
        free(b);
        assert_eq!(
            aclInit(null()),
            ACL_ERROR_INVALID_PARAM,
            "injected, not REPEAT"
        );
        assert_eq!(aclInit(null()), ACL_ERROR_REPEAT_INITIALIZE);
        // Faults fire before the init check.
        assert_eq!(hprtEmuSetFaults(c"aclrtSetDevice:1:42".as_ptr()), 0);
        reset_life(false);
        assert_eq!(aclrtSetDevice(0), 42);
        assert_eq!(aclrtSetDevice(0), ACL_ERROR_UNINITIALIZE);
    }
}

#[test]
fn stats_track_live_resources() {
    let _g = setup();
    // SAFETY: out-pointers are live locals or null (refused); `root` holds `HCCL_ROOT_INFO_BYTES`.
    unsafe {
        let before = stats();
        let d = malloc(1000);
        let mut h = null_mut();
        assert_eq!(aclrtMallocHost(&mut h, 10), 0);
        let s = new_stream();
        let e = new_event(0);
        let root = root_info();
        let mut comm = null_mut();
        assert_eq!(
            HcclCommInitRootInfo(1, root.as_ptr().cast(), 0, &mut comm),
            0
        );
        // The default stream is the runtime's, not a leak.
        assert_eq!(aclrtSynchronizeStream(null_mut()), 0);
        let during = stats();
        assert_eq!(
            during.live_device_allocations,
            before.live_device_allocations + 1
        );
        assert_eq!(during.live_device_bytes, before.live_device_bytes + 1000);
        assert_eq!(
            during.live_host_allocations,
            before.live_host_allocations + 1
        );
        assert_eq!(during.live_streams, before.live_streams + 1);
        assert_eq!(during.live_events, before.live_events + 1);
        assert_eq!(during.live_comms, before.live_comms + 1);
        free(d);
        assert_eq!(aclrtFreeHost(h), 0);
        destroy_stream(s);
        assert_eq!(aclrtDestroyEvent(e), 0);
        assert_eq!(HcclCommDestroy(comm), 0);
        let after = stats();
        assert_eq!(
            after,
            HprtEmuStats {
                init_calls: after.init_calls,
                finalize_calls: after.finalize_calls,
                ..before
            }
        );
        assert_eq!(hprtEmuGetStats(null_mut()), ACL_ERROR_INVALID_PARAM);
    }
}

#[test]
fn panics_do_not_cross_the_boundary() {
    let _g = setup();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let acl = crate::state::acl_entry("aclrtMalloc", || panic!("boom"));
    let hccl = crate::state::hccl_entry("HcclAllReduce", || panic!("boom"));
    std::panic::set_hook(hook);
    assert_eq!(acl, ACL_ERROR_RT_INTERNAL_ERROR);
    assert_eq!(hccl, HCCL_E_INTERNAL);
}

/// ISSUE 32 item 16: one thread records an event on a stream while another makes the same
/// stream wait on it. The record published its mark before queueing the mark's completion, so
/// a wait queued in between sat ahead of the completion it waits for: the stream hung.
#[test]
fn a_record_racing_a_wait_on_its_own_stream_never_hangs() {
    let _g = setup();
    let s = new_stream();
    let e = new_event(ACL_EVENT_SYNC);
    let (su, eu) = (s as usize, e as usize);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: no pointer arguments.
        assert_eq!(unsafe { aclrtSetDevice(0) }, 0);
        std::thread::scope(|sc| {
            // SAFETY: no pointer arguments but the stream and event handles, which live until both
            // threads are joined (and are registry-checked, module doc).
            sc.spawn(|| unsafe {
                assert_eq!(aclrtSetDevice(0), 0);
                for _ in 0..30_000 {
                    assert_eq!(aclrtRecordEvent(eu as *mut c_void, su as *mut c_void), 0);
                }
            });
            // SAFETY: no pointer arguments but the stream and event handles, which live until both
            // threads are joined (and are registry-checked, module doc).
            sc.spawn(|| unsafe {
                assert_eq!(aclrtSetDevice(0), 0);
                for _ in 0..30_000 {
                    assert_eq!(
                        aclrtStreamWaitEvent(su as *mut c_void, eu as *mut c_void),
                        0
                    );
                }
            });
        });
        let _ = tx.send(sync(su as *mut c_void));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the stream hung: a wait queued ahead of the record it waits for");
    assert_eq!(r, 0);
    // SAFETY: an event handle, checked against the emulator's registry (module doc).
    assert_eq!(unsafe { aclrtDestroyEvent(e) }, 0);
    destroy_stream(s);
}
