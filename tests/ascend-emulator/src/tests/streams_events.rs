//! Streams (asynchronous and ordered under delays, handle errors, the default stream) and
//! events (status and elapsed time).

use super::*;

#[test]
fn streams_are_asynchronous_and_ordered_under_delays() {
    let _g = setup();
    with_config(|c| c.delay_seed = Some(0x5EED));
    // SAFETY: `out` (32 slots of 64 bytes) and `host` (64 bytes) stay alive until the `sync` after
    // the copies into them; each copy writes 64 bytes at a slot's start, so `add` stays inside
    // `out`.
    unsafe {
        let s = new_stream();
        let d = malloc(64);
        let mut out = vec![0u8; 64 * 32];
        let tx = hold(s);
        for i in 0..32u8 {
            assert_eq!(aclrtMemsetAsync(d, 64, i as i32, 64, s), 0);
            let dst = out.as_mut_ptr().add(64 * i as usize).cast();
            assert_eq!(
                aclrtMemcpyAsync(dst, 64, d, 64, ACL_MEMCPY_DEVICE_TO_HOST, s),
                0
            );
        }
        // Nothing ran yet: the stream is held.
        assert!(out.iter().all(|&b| b == 0));
        let t0 = Instant::now();
        drop(tx);
        assert_eq!(sync(s), 0);
        // 64 jobs with 0-2 ms each: the delays are really there.
        assert!(
            t0.elapsed() >= Duration::from_millis(20),
            "{:?}",
            t0.elapsed()
        );
        for i in 0..32 {
            assert!(
                out[64 * i..64 * (i + 1)].iter().all(|&b| b == i as u8),
                "slot {i}"
            );
        }

        // Cross-stream dependency through an event.
        let s2 = new_stream();
        let ev = new_event(ACL_EVENT_SYNC);
        let mut host = [0u8; 64];
        for round in 1..20u8 {
            assert_eq!(aclrtMemsetAsync(d, 64, round as i32, 64, s), 0);
            assert_eq!(aclrtRecordEvent(ev, s), 0);
            assert_eq!(aclrtStreamWaitEvent(s2, ev), 0);
            let hp = host.as_mut_ptr().cast();
            assert_eq!(
                aclrtMemcpyAsync(hp, 64, d, 64, ACL_MEMCPY_DEVICE_TO_HOST, s2),
                0
            );
            assert_eq!(sync(s2), 0);
            assert_eq!(host, [round; 64]);
        }
        assert_eq!(aclrtDestroyEvent(ev), 0);
        destroy_stream(s2);
        destroy_stream(s);
        free(d);
    }
}

#[test]
fn stream_handles_errors_and_default_stream() {
    let _g = setup();
    // SAFETY: the host buffer `h` (16 bytes) outlives the `sync` that reports its copy's failure;
    // out-pointers are live locals or null (refused); destroyed and null stream handles are
    // registry-checked (module doc).
    unsafe {
        let inv = ACL_ERROR_INVALID_PARAM;
        assert_eq!(aclrtCreateStream(null_mut()), inv);
        assert_eq!(aclrtDestroyStream(null_mut()), inv);
        let s = new_stream();
        let d = malloc(16);

        // An asynchronous failure (the buffer was freed before the copy ran) is reported by
        // the next synchronize, once.
        let mut h = [0u8; 16];
        let tx = hold(s);
        assert_eq!(
            aclrtMemcpyAsync(
                h.as_mut_ptr().cast(),
                16,
                d,
                16,
                ACL_MEMCPY_DEVICE_TO_HOST,
                s
            ),
            0
        );
        free(d);
        drop(tx);
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(sync(s), 0);

        // Destroying lets queued work finish; the handle is dead at once.
        let d = malloc(16);
        let tx = hold(s);
        assert_eq!(aclrtMemsetAsync(d, 16, 9, 16, s), 0);
        destroy_stream(s);
        assert_eq!(aclrtDestroyStream(s), inv);
        assert_eq!(sync(s), inv);
        drop(tx);
        let t0 = Instant::now();
        while download::<u8>(d, 1)[0] != 9 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "queued work never ran"
            );
            std::thread::sleep(Duration::from_millis(1));
        }

        // aclrtStreamQuery: busy while work is queued, idle after; errors stay for synchronize.
        let s = new_stream();
        let mut st = 99u32;
        assert_eq!(aclrtStreamQuery(s, &mut st), 0);
        assert_eq!(st, ACL_STREAM_STATUS_COMPLETE);
        let tx = hold(s);
        assert_eq!(aclrtStreamQuery(s, &mut st), 0);
        assert_eq!(st, ACL_STREAM_STATUS_NOT_READY);
        assert_eq!(aclrtStreamQuery(s, null_mut()), inv);
        drop(tx);
        assert_eq!(sync(s), 0);
        assert_eq!(aclrtStreamQuery(s, &mut st), 0);
        assert_eq!(st, ACL_STREAM_STATUS_COMPLETE);
        destroy_stream(s);
        assert_eq!(aclrtStreamQuery(s, &mut st), inv);

        // The null stream is the device's default stream.
        assert_eq!(aclrtMemsetAsync(d, 16, 4, 16, null_mut()), 0);
        assert_eq!(sync(null_mut()), 0);
        assert_eq!(download::<u8>(d, 16), [4u8; 16]);
        free(d);
    }
}

// ---- events -----------------------------------------------------------------------------------

#[test]
fn events_status_and_elapsed_time() {
    let _g = setup();
    // SAFETY: out-pointers are live locals or null (refused, asserted); destroyed handles, and a
    // stream passed as an event, are registry-checked and refused (module doc).
    unsafe {
        let inv = ACL_ERROR_INVALID_PARAM;
        let mut e = null_mut();
        assert_eq!(aclrtCreateEventWithFlag(&mut e, 2), inv);
        assert_eq!(aclrtCreateEventWithFlag(null_mut(), 1), inv);
        let plain = new_event(ACL_EVENT_SYNC);
        let t0 = new_event(ACL_EVENT_TIME_LINE | ACL_EVENT_SYNC);
        let t1 = new_event(ACL_EVENT_TIME_LINE);
        let s = new_stream();

        let mut st = 99u32;
        assert_eq!(aclrtQueryEventStatus(t0, &mut st), 0);
        assert_eq!(
            st, ACL_EVENT_RECORDED_STATUS_COMPLETE,
            "never recorded counts as complete"
        );
        assert_eq!(aclrtQueryEventStatus(t0, null_mut()), inv);
        assert_eq!(aclrtSynchronizeEvent(t0), 0);
        assert_eq!(aclrtStreamWaitEvent(s, t0), 0);
        assert_eq!(sync(s), 0);

        let mut ms = 0f32;
        assert_eq!(aclrtEventElapsedTime(&mut ms, t0, t1), inv, "not recorded");
        assert_eq!(aclrtRecordEvent(t0, s), 0);
        let tx = hold(s);
        assert_eq!(aclrtRecordEvent(t1, s), 0);
        assert_eq!(aclrtQueryEventStatus(t1, &mut st), 0);
        assert_eq!(st, ACL_EVENT_RECORDED_STATUS_NOT_READY);
        assert_eq!(
            aclrtEventElapsedTime(&mut ms, t0, t1),
            inv,
            "end not complete"
        );
        std::thread::sleep(Duration::from_millis(30));
        drop(tx);
        assert_eq!(aclrtSynchronizeEvent(t1), 0);
        assert_eq!(aclrtQueryEventStatus(t1, &mut st), 0);
        assert_eq!(st, ACL_EVENT_RECORDED_STATUS_COMPLETE);
        assert_eq!(aclrtEventElapsedTime(&mut ms, t0, t1), 0);
        assert!((25.0..5000.0).contains(&ms), "{ms}");
        assert_eq!(aclrtEventElapsedTime(null_mut(), t0, t1), inv);
        assert_eq!(aclrtRecordEvent(plain, s), 0);
        assert_eq!(aclrtSynchronizeEvent(plain), 0);
        assert_eq!(
            aclrtEventElapsedTime(&mut ms, plain, t1),
            inv,
            "no TIME_LINE flag"
        );

        // Re-recording replaces what later waiters see.
        let tx = hold(s);
        assert_eq!(aclrtRecordEvent(t0, s), 0);
        assert_eq!(aclrtQueryEventStatus(t0, &mut st), 0);
        assert_eq!(st, ACL_EVENT_RECORDED_STATUS_NOT_READY);
        drop(tx);
        assert_eq!(aclrtSynchronizeEvent(t0), 0);

        for ev in [plain, t0, t1] {
            assert_eq!(aclrtDestroyEvent(ev), 0);
            assert_eq!(aclrtDestroyEvent(ev), inv);
        }
        assert_eq!(aclrtRecordEvent(t0, s), inv);
        assert_eq!(aclrtRecordEvent(s, s), inv, "a stream is not an event");
        destroy_stream(s);
    }
}
