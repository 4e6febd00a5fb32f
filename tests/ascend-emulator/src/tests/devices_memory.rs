//! Lifecycle and devices (init and finalize, pre-initialised and malformed configurations,
//! device and memory info), then memory: malloc/free contracts, memcpy kinds and bounds.

use super::*;

#[test]
fn init_finalize_lifecycle() {
    let _g = setup();
    // SAFETY: every out-pointer is a live local; a null config path is the header's "no config
    // file".
    unsafe {
        reset_life(false);
        let mut p = null_mut();
        assert_eq!(aclrtSetDevice(0), ACL_ERROR_UNINITIALIZE);
        assert_eq!(aclrtMalloc(&mut p, 16, 0), ACL_ERROR_UNINITIALIZE);
        assert_eq!(aclFinalize(), ACL_ERROR_UNINITIALIZE);
        assert_eq!(aclInit(null()), ACL_SUCCESS);
        assert_eq!(aclInit(null()), ACL_ERROR_REPEAT_INITIALIZE);
        assert_eq!(aclrtSetDevice(1), ACL_SUCCESS);
        assert_eq!(aclFinalize(), ACL_SUCCESS);
        let mut n = 0;
        assert_eq!(aclrtGetDeviceCount(&mut n), ACL_ERROR_UNINITIALIZE);
        assert_eq!(aclFinalize(), ACL_ERROR_UNINITIALIZE);
        assert_eq!(aclInit(null()), ACL_SUCCESS);
        // Finalisation destroyed the thread's context.
        let mut d = -1;
        assert_eq!(aclrtGetDevice(&mut d), ACL_ERROR_INVALID_PARAM);
        let s = stats();
        assert_eq!((s.init_calls, s.finalize_calls), (3, 3));
    }
}

#[test]
fn preinit_means_someone_else_initialised() {
    let _g = setup();
    // SAFETY: a null config path is the header's "no config file"; `p` is our own allocation.
    unsafe {
        reset_life(true);
        assert_eq!(aclInit(null()), ACL_ERROR_REPEAT_INITIALIZE);
        assert_eq!(aclrtSetDevice(0), ACL_SUCCESS);
        let p = malloc(8);
        free(p);
    }
}

#[test]
fn malformed_configuration_fails_init() {
    let _g = setup();
    // SAFETY: a null config path is the header's "no config file"; no other pointers.
    unsafe {
        reset_life(false);
        with_config(|c| c.malformed = true);
        assert_eq!(aclInit(null()), ACL_ERROR_INVALID_PARAM);
        with_config(|c| c.malformed = false);
        assert_eq!(aclInit(null()), ACL_SUCCESS);
    }
}

#[test]
fn devices_and_mem_info() {
    let _g = setup();
    // SAFETY: every out-pointer is a live local of this or the new thread, or null, which the
    // emulator refuses (asserted); handles are registry-checked (module doc).
    unsafe {
        let mut n = 0;
        assert_eq!(aclrtGetDeviceCount(&mut n), 0);
        assert_eq!(n, 4);
        assert_eq!(aclrtGetDeviceCount(null_mut()), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtSetDevice(-1), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtSetDevice(4), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtResetDevice(4), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtSetDevice(3), 0);
        let mut d = -1;
        assert_eq!(aclrtGetDevice(&mut d), 0);
        assert_eq!(d, 3);
        assert_eq!(aclrtResetDevice(3), 0);

        let (mut free_b, mut total) = (0usize, 0usize);
        assert_eq!(aclrtGetMemInfo(ACL_HBM_MEM, &mut free_b, &mut total), 0);
        assert_eq!(total as u64, CAPACITY);
        let p = malloc(1 << 20);
        let mut free_after = 0usize;
        assert_eq!(aclrtGetMemInfo(ACL_DDR_MEM, &mut free_after, &mut total), 0);
        assert_eq!(free_b - free_after, 1 << 20);
        free(p);
        assert_eq!(
            aclrtGetMemInfo(ACL_HBM_MEM, null_mut(), &mut total),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(
            aclrtGetMemInfo(7, &mut free_b, &mut total),
            ACL_ERROR_INVALID_PARAM
        );

        // A thread that never selected a device has no context.
        on_new_thread(|| {
            let mut d = 0;
            let mut p = null_mut();
            let mut s = null_mut();
            let mut e = null_mut();
            assert_eq!(aclrtGetDevice(&mut d), ACL_ERROR_INVALID_PARAM);
            assert_eq!(aclrtMalloc(&mut p, 16, 0), ACL_ERROR_INVALID_PARAM);
            assert_eq!(aclrtCreateStream(&mut s), ACL_ERROR_INVALID_PARAM);
            assert_eq!(aclrtCreateEvent(&mut e), ACL_ERROR_INVALID_PARAM);
            assert_eq!(aclrtSynchronizeStream(null_mut()), ACL_ERROR_INVALID_PARAM);
        });
    }
}

// ---- memory -----------------------------------------------------------------------------------

#[test]
fn malloc_free_contracts() {
    let _g = setup();
    // SAFETY: out-pointers are live locals or null (refused); the pointers that are not live
    // allocations of the right kind (an offset into one, a local, null, a freed one, pinned vs
    // device) are looked up in the registries and refused, never freed (module doc).
    unsafe {
        let mut p = null_mut();
        assert_eq!(aclrtMalloc(&mut p, 0, 0), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtMalloc(null_mut(), 16, 0), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtMalloc(&mut p, 16, 3), ACL_ERROR_INVALID_PARAM);
        assert_eq!(
            aclrtMalloc(&mut p, CAPACITY as usize + 1, 0),
            ACL_ERROR_RT_MEMORY_ALLOCATION
        );
        let big = malloc(CAPACITY as usize - 100);
        assert_eq!(aclrtMalloc(&mut p, 200, 2), ACL_ERROR_RT_MEMORY_ALLOCATION);
        free(big);

        let a = malloc(1000);
        assert_eq!(a as usize % 256, 0);
        assert!(download::<u8>(a, 1000).iter().all(|&b| b == 0));
        assert_eq!(
            aclrtFree((a as usize + 8) as *mut c_void),
            ACL_ERROR_INVALID_PARAM
        );
        let mut local = 0u64;
        assert_eq!(
            aclrtFree((&mut local as *mut u64).cast()),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(aclrtFree(null_mut()), ACL_ERROR_INVALID_PARAM);
        free(a);
        assert_eq!(aclrtFree(a), ACL_ERROR_INVALID_PARAM);

        let mut h = null_mut();
        assert_eq!(aclrtMallocHost(&mut h, 0), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtMallocHost(&mut h, 64), 0);
        let d = malloc(64);
        assert_eq!(aclrtFreeHost(d), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtFree(h), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtFreeHost(h), 0);
        assert_eq!(aclrtFreeHost(h), ACL_ERROR_INVALID_PARAM);
        free(d);
    }
}

#[test]
fn memcpy_kinds_and_bounds() {
    let _g = setup();
    // SAFETY: `h` and `pinned` are 256-byte host buffers alive to the end, and no call that runs
    // moves more than 256 bytes into or out of them (the ones that would, or that go past an
    // allocation, are refused at call time); every async call here is refused, so nothing queued
    // outlives the test.
    unsafe {
        let d = upload(&[1u8; 256]);
        let d2 = malloc(256);
        let mut h = [0u8; 256];
        let hp: *mut c_void = h.as_mut_ptr().cast();
        let mut pinned = null_mut();
        assert_eq!(aclrtMallocHost(&mut pinned, 256), 0);
        let c = |dst, max, src, n, kind| aclrtMemcpy(dst, max, src, n, kind);

        assert_eq!(c(hp, 256, d, 256, ACL_MEMCPY_DEVICE_TO_HOST), 0);
        assert_eq!(h, [1u8; 256]);
        assert_eq!(c(d2, 256, d, 256, ACL_MEMCPY_DEVICE_TO_DEVICE), 0);
        assert_eq!(c(pinned, 256, hp, 256, ACL_MEMCPY_HOST_TO_HOST), 0);
        assert_eq!(c(d2, 256, pinned, 256, ACL_MEMCPY_HOST_TO_DEVICE), 0);
        for (dst, src) in [(d2, d), (hp, d), (d, hp), (hp, pinned)] {
            assert_eq!(c(dst, 256, src, 256, ACL_MEMCPY_DEFAULT), 0);
        }
        // Kind that contradicts the pointers.
        let inv = ACL_ERROR_INVALID_PARAM;
        assert_eq!(c(d2, 256, d, 256, ACL_MEMCPY_HOST_TO_DEVICE), inv);
        assert_eq!(c(hp, 256, pinned, 256, ACL_MEMCPY_DEVICE_TO_HOST), inv);
        assert_eq!(c(d, 256, hp, 256, ACL_MEMCPY_DEVICE_TO_HOST), inv);
        assert_eq!(c(d, 256, hp, 256, ACL_MEMCPY_DEVICE_TO_DEVICE), inv);
        assert_eq!(c(hp, 256, d, 256, ACL_MEMCPY_HOST_TO_HOST), inv);
        assert_eq!(c(hp, 256, d, 256, 5), inv);
        // destMax and allocation bounds.
        assert_eq!(c(hp, 255, d, 256, ACL_MEMCPY_DEVICE_TO_HOST), inv);
        let tail = (d as usize + 200) as *mut c_void;
        assert_eq!(c(hp, 256, tail, 57, ACL_MEMCPY_DEVICE_TO_HOST), inv);
        assert_eq!(c(hp, 256, tail, 56, ACL_MEMCPY_DEVICE_TO_HOST), 0);
        assert_eq!(c(null_mut(), 256, d, 1, ACL_MEMCPY_DEVICE_TO_HOST), inv);
        assert_eq!(c(null_mut(), 0, null(), 0, ACL_MEMCPY_DEVICE_TO_HOST), 0);

        // Memset: device memory only, value's low byte, maxCount.
        assert_eq!(aclrtMemset(d, 256, 0x1AB, 100), 0);
        assert_eq!(download::<u8>(d, 101)[99..], [0xAB, 1]);
        assert_eq!(aclrtMemset(d, 99, 0, 100), inv);
        assert_eq!(aclrtMemset(hp, 256, 0, 100), inv);
        assert_eq!(aclrtMemset(pinned, 256, 0, 100), inv);
        assert_eq!(aclrtMemset(tail, 256, 0, 57), inv);

        // The async forms check the same at call time.
        let s = new_stream();
        assert_eq!(
            aclrtMemcpyAsync(hp, 255, d, 256, ACL_MEMCPY_DEVICE_TO_HOST, s),
            inv
        );
        assert_eq!(
            aclrtMemcpyAsync(d, 256, hp, 256, ACL_MEMCPY_DEVICE_TO_HOST, s),
            inv
        );
        assert_eq!(aclrtMemsetAsync(hp, 256, 0, 1, s), inv);
        assert_eq!(
            aclrtMemcpyAsync(hp, 256, d, 256, ACL_MEMCPY_DEVICE_TO_HOST, 0x1234 as _),
            inv
        );
        destroy_stream(s);
        assert_eq!(aclrtMemsetAsync(d, 256, 0, 1, s), inv);

        assert_eq!(aclrtFreeHost(pinned), 0);
        free(d);
        free(d2);
    }
}
