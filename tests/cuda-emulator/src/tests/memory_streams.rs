//! Memory contracts, a free under queued work, and events that time and refuse what CUDA
//! refuses.

use super::*;

#[test]
fn memory_contracts() {
    let (_g, s) = on_device0();
    let d = alloc(64);
    let mut host = vec![0u8; 128];
    assert_eq!(
        cuMemcpyAsync(d, host.as_ptr() as u64, 65, s),
        CUDA_ERROR_INVALID_VALUE,
        "a copy past the allocation's end"
    );
    assert_eq!(cuMemcpyAsync(d + 60, d, 8, s), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(cuMemsetD8Async(d + 1, 0, 64, s), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(
        cuMemsetD8Async(host.as_mut_ptr() as u64, 0, 8, s),
        CUDA_ERROR_INVALID_VALUE,
        "memset of host memory"
    );
    assert_eq!(
        cuMemFree_v2(d + 8),
        CUDA_ERROR_INVALID_VALUE,
        "not an allocation's start"
    );
    assert_eq!(cuMemFree_v2(host.as_ptr() as u64), CUDA_ERROR_INVALID_VALUE);
    let mut pinned = null_mut();
    // SAFETY: out-pointer to a local.
    unsafe {
        assert_eq!(
            cuMemHostAlloc(&mut pinned, 64, 0x8),
            CUDA_ERROR_INVALID_VALUE,
            "unknown flag"
        );
        assert_eq!(
            cuMemHostAlloc(&mut pinned, 64, CU_MEMHOSTALLOC_PORTABLE),
            CUDA_SUCCESS
        );
    }
    assert_eq!(
        cuMemFree_v2(pinned as u64),
        CUDA_ERROR_INVALID_VALUE,
        "pinned is not device memory"
    );
    assert_eq!(cuMemFreeHost(pinned), CUDA_SUCCESS);
    assert_eq!(
        cuMemFreeHost(pinned),
        CUDA_ERROR_INVALID_VALUE,
        "double free"
    );
    let mut too_much = 0;
    assert_eq!(
        // SAFETY: out-pointer to a local.
        unsafe { cuMemAlloc_v2(&mut too_much, (state::config().device_memory + 1) as usize) },
        CUDA_ERROR_OUT_OF_MEMORY
    );
    // Memory of device 0's context used from device 1's.
    bind(1);
    let s1 = stream();
    assert_eq!(
        cuMemFree_v2(d),
        CUDA_ERROR_INVALID_VALUE,
        "freed from another context"
    );
    assert_eq!(cuMemsetD8Async(d, 0, 8, s1), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(
        cuMemcpyAsync(d, d, 8, s),
        CUDA_ERROR_INVALID_CONTEXT,
        "a stream of another context"
    );
    assert_eq!(cuStreamDestroy_v2(s1), CUDA_SUCCESS);
    unbind(1);
    bind(0);
    assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
    assert_eq!(cuMemFree_v2(d), CUDA_ERROR_INVALID_VALUE, "double free");
    host[0] = 1;
    done_on_device0(s);
    unbind(0);
}

extern "C" fn block_until_flag(flag: *mut c_void) {
    // SAFETY: the test's AtomicBool, alive until the stream is synchronized.
    let flag = unsafe { &*(flag as *const std::sync::atomic::AtomicBool) };
    while !flag.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
}

extern "C" fn calls_the_driver(out: *mut c_void) {
    let mut s = null_mut();
    // SAFETY: out-pointer to a local; the result goes to the test's u32.
    let r = unsafe { cuStreamCreate(&mut s, 0) };
    // SAFETY: the test's u32, alive until the stream is synchronized.
    unsafe { *(out as *mut u32) = r };
}

#[test]
fn a_free_under_queued_work_is_reported_and_waits_for_it() {
    let (_g, s) = on_device0();
    let d = alloc(64);
    let flag = std::sync::atomic::AtomicBool::new(false);
    let before = state::FREES_UNDER_QUEUED_WORK.load(Ordering::Relaxed);
    // SAFETY: the host function and its argument outlive the stream's work.
    unsafe {
        assert_eq!(
            cuLaunchHostFunc(s, Some(block_until_flag), &flag as *const _ as *mut c_void),
            CUDA_SUCCESS
        );
    }
    assert_eq!(cuMemsetD8Async(d, 7, 64, s), CUDA_SUCCESS);
    assert_eq!(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            flag.store(true, Ordering::Release);
        });
        let t0 = std::time::Instant::now();
        assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
        assert!(
            t0.elapsed().as_millis() >= 40,
            "the free did not wait for the work"
        );
    });
    assert_eq!(
        state::FREES_UNDER_QUEUED_WORK.load(Ordering::Relaxed),
        before + 1
    );
    // No driver calls inside a host function.
    let mut r = 0u32;
    // SAFETY: as above.
    unsafe {
        assert_eq!(
            cuLaunchHostFunc(s, Some(calls_the_driver), &mut r as *mut u32 as *mut c_void),
            CUDA_SUCCESS
        );
    }
    assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
    assert_eq!(r, CUDA_ERROR_NOT_PERMITTED);
    done_on_device0(s);
}

#[test]
fn events_time_and_refuse_what_cuda_refuses() {
    let (_g, s) = on_device0();
    let (mut a, mut b, mut plain) = (null_mut(), null_mut(), null_mut());
    let flag = std::sync::atomic::AtomicBool::new(false);
    let mut ms = 0f32;
    // SAFETY: out-pointers to locals; the host function's flag outlives the stream's work.
    unsafe {
        assert_eq!(cuEventCreate(&mut a, 0), CUDA_SUCCESS);
        assert_eq!(cuEventCreate(&mut b, 0), CUDA_SUCCESS);
        assert_eq!(
            cuEventCreate(&mut plain, CU_EVENT_DISABLE_TIMING),
            CUDA_SUCCESS
        );
        assert_eq!(cuEventCreate(&mut plain, 0x40), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cuEventElapsedTime(&mut ms, a, b),
            CUDA_ERROR_INVALID_HANDLE,
            "never recorded"
        );
        assert_eq!(cuEventRecord(a, s), CUDA_SUCCESS);
        assert_eq!(
            cuLaunchHostFunc(s, Some(block_until_flag), &flag as *const _ as *mut c_void),
            CUDA_SUCCESS
        );
        assert_eq!(cuEventRecord(b, s), CUDA_SUCCESS);
        assert_eq!(cuEventQuery(b), CUDA_ERROR_NOT_READY);
        assert_eq!(cuEventElapsedTime(&mut ms, a, b), CUDA_ERROR_NOT_READY);
        std::thread::sleep(std::time::Duration::from_millis(20));
        flag.store(true, Ordering::Release);
        assert_eq!(cuEventSynchronize(b), CUDA_SUCCESS);
        assert_eq!(cuEventElapsedTime(&mut ms, a, b), CUDA_SUCCESS);
        assert!(ms >= 15.0, "{ms} ms");
        assert_eq!(cuEventRecord(plain, s), CUDA_SUCCESS);
        assert_eq!(cuEventSynchronize(plain), CUDA_SUCCESS);
        assert_eq!(
            cuEventElapsedTime(&mut ms, a, plain),
            CUDA_ERROR_INVALID_HANDLE,
            "no timing"
        );
        assert_eq!(
            cuStreamWaitEvent(s, a, 1),
            CUDA_ERROR_INVALID_VALUE,
            "flags"
        );
        // An event of another context can be waited on, not recorded there.
        bind(1);
        let s1 = stream();
        assert_eq!(cuStreamWaitEvent(s1, a, 0), CUDA_SUCCESS);
        assert_eq!(cuEventRecord(a, s1), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cuStreamSynchronize(s1), CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s1), CUDA_SUCCESS);
        unbind(1);
        for e in [a, b, plain] {
            assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
        }
    }
    done_on_device0(s);
}
