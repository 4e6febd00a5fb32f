//! Calls before `cuInit`, per-thread contexts that die with their last release, and destroyed
//! and foreign handles.

use super::*;

#[test]
fn calls_before_cuinit_are_refused() {
    let _g = setup();
    state::testing::set_initialized(false);
    let mut n = 0;
    assert_eq!(
        // SAFETY: out-pointer to a local.
        unsafe { cuDeviceGetCount(&mut n) },
        CUDA_ERROR_NOT_INITIALIZED
    );
    let mut v = 0;
    // SAFETY: as above. The driver version is answered before cuInit, as in CUDA.
    assert_eq!(unsafe { cuDriverGetVersion(&mut v) }, CUDA_SUCCESS);
    assert_eq!(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(cuInit(0), CUDA_SUCCESS);
    // SAFETY: as above.
    assert_eq!(unsafe { cuDeviceGetCount(&mut n) }, CUDA_SUCCESS);
    assert_eq!(n, 2);
}

#[test]
fn contexts_are_per_thread_and_die_with_their_last_release() {
    let _g = setup();
    let mut p = 0;
    let ctx;
    // SAFETY: out-pointers to locals.
    unsafe {
        assert_eq!(
            cuMemAlloc_v2(&mut p, 64),
            CUDA_ERROR_INVALID_CONTEXT,
            "no current context"
        );
        ctx = bind(0);
        let mut again = null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut again, 0), CUDA_SUCCESS);
        assert_eq!(again, ctx, "the primary context is one per device");
        assert_eq!(cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
    }
    // Another thread has no current context until it sets one.
    std::thread::spawn(|| {
        let mut p = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { cuMemAlloc_v2(&mut p, 64) };
        assert_eq!(r, CUDA_ERROR_INVALID_CONTEXT);
    })
    .join()
    .unwrap();
    // SAFETY: out-pointers to locals.
    unsafe {
        let leaked = alloc(64);
        let _s = stream();
        let before = state::RECLAIMED_AT_CONTEXT_DESTROY.load(Ordering::Relaxed);
        assert_eq!(cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
        assert_eq!(
            state::RECLAIMED_AT_CONTEXT_DESTROY.load(Ordering::Relaxed),
            before + 2,
            "the allocation and the stream went with the context, and were counted"
        );
        assert_eq!(cuMemAlloc_v2(&mut p, 64), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        assert_eq!(cuMemFree_v2(leaked), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        assert_eq!(cuCtxSetCurrent(null_mut()), CUDA_SUCCESS);
        assert_eq!(
            cuDevicePrimaryCtxRelease_v2(0),
            CUDA_ERROR_INVALID_CONTEXT,
            "not retained"
        );
        let mut pushed = null_mut();
        assert_eq!(cuCtxPopCurrent_v2(&mut pushed), CUDA_ERROR_INVALID_CONTEXT);
    }
}

#[test]
fn destroyed_and_foreign_handles_are_refused() {
    let (_g, s) = on_device0();
    let mut e = null_mut();
    // SAFETY: out-pointers to locals.
    unsafe {
        assert_eq!(cuEventCreate(&mut e, 0), CUDA_SUCCESS);
        assert_eq!(
            cuStreamSynchronize(e),
            CUDA_ERROR_INVALID_HANDLE,
            "an event is no stream"
        );
        assert_eq!(
            cuEventRecord(s, s),
            CUDA_ERROR_INVALID_HANDLE,
            "a stream is no event"
        );
        assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
        assert_eq!(cuEventDestroy_v2(e), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
        assert_eq!(cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            cuStreamDestroy_v2(null_mut()),
            CUDA_ERROR_INVALID_HANDLE,
            "default stream"
        );
        assert_eq!(
            cuModuleUnload(0x1234 as *mut c_void),
            CUDA_ERROR_INVALID_HANDLE
        );
    }
    unbind(0);
}
