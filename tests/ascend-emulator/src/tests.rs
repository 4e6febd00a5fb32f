//! Tests through the exported functions, as the backend calls them. The emulator's state is
//! process-wide, so every test takes [`setup`]'s lock and starts from a known configuration.
//! (Over 800 lines for the same reason: one process-wide state, one lock, one file.)
//!
//! The exported functions are `unsafe` for what the C header leaves to the caller: out-pointers
//! (here live locals, or null, which the emulator refuses) and host buffers (live locals of at
//! least the count, kept alive until the work on them ran). Handles and device pointers it looks
//! up in its registries, so the stale, bogus and out-of-range ones these tests pass are refused
//! with the asserted codes, never dereferenced. The SAFETY comments below say which of these
//! each block relies on.

use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::callback::*;
use crate::codes::*;
use crate::control::*;
use crate::device::*;
use crate::event::*;
use crate::hccl::*;
use crate::memory::*;
use crate::state::testing::{reset_life, with_config};
use crate::stream::{self, *};

const CAPACITY: u64 = 1 << 30;

/// Serialises tests and resets the emulator: 4 devices of 1 GiB, no delays, no faults, a 10 s
/// HCCL timeout, ACL initialised and device 0 current on the calling thread.
fn setup() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    with_config(|c| {
        c.devices = 4;
        c.device_memory = CAPACITY;
        c.delay_seed = None;
        c.hccl_timeout_ms = 10_000;
        c.preinit = false;
        c.malformed = false;
    });
    // SAFETY: `hprtEmuSetFaults` reads a NUL-terminated literal; a null config path is the header's
    // "no config file"; the rest take no pointers.
    unsafe {
        assert_eq!(hprtEmuSetFaults(c"".as_ptr()), 0);
        reset_life(false);
        assert_eq!(aclInit(null()), 0);
        assert_eq!(aclrtSetDevice(0), 0);
    }
    g
}

fn stats() -> HprtEmuStats {
    let mut s = HprtEmuStats::default();
    // SAFETY: the out-pointer is a live local `HprtEmuStats`.
    assert_eq!(unsafe { hprtEmuGetStats(&mut s) }, 0);
    s
}

fn malloc(size: usize) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: the out-pointer is a live local.
    assert_eq!(unsafe { aclrtMalloc(&mut p, size, 0) }, 0);
    p
}

fn free(p: *mut c_void) {
    // SAFETY: the emulator looks `p` up in its allocation registry (module doc); the callers pass
    // their own allocations.
    assert_eq!(unsafe { aclrtFree(p) }, 0);
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data test values.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// A device buffer holding `v`.
fn upload<T: Copy>(v: &[T]) -> *mut c_void {
    let b = as_bytes(v);
    let p = malloc(b.len().max(1));
    // SAFETY: `b` is a live host slice of `b.len()` bytes and `p` a fresh device allocation of at
    // least that size.
    let rc = unsafe {
        aclrtMemcpy(
            p,
            b.len(),
            b.as_ptr().cast(),
            b.len(),
            ACL_MEMCPY_HOST_TO_DEVICE,
        )
    };
    assert_eq!(rc, 0);
    p
}

fn download<T: Copy + Default>(p: *const c_void, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    let bytes = std::mem::size_of_val(v.as_slice());
    // SAFETY: `v` is a live Vec of `bytes` bytes; `p..p + bytes` is checked against the allocation
    // registry (module doc).
    let rc = unsafe {
        aclrtMemcpy(
            v.as_mut_ptr().cast(),
            bytes,
            p,
            bytes,
            ACL_MEMCPY_DEVICE_TO_HOST,
        )
    };
    assert_eq!(rc, 0);
    v
}

fn new_stream() -> *mut c_void {
    let mut s = null_mut();
    // SAFETY: the out-pointer is a live local.
    assert_eq!(unsafe { aclrtCreateStream(&mut s) }, 0);
    s
}

fn destroy_stream(s: *mut c_void) {
    // SAFETY: a stream handle, checked against the emulator's registry (module doc).
    assert_eq!(unsafe { aclrtDestroyStream(s) }, 0);
}

fn sync(s: *mut c_void) -> AclError {
    // SAFETY: a stream handle, checked against the emulator's registry (module doc).
    unsafe { aclrtSynchronizeStream(s) }
}

/// Blocks `s` until the returned sender is dropped or sent to.
fn hold(s: *mut c_void) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    stream::resolve(s).unwrap().enqueue(Box::new(move || {
        let _ = rx.recv();
        Ok(())
    }));
    tx
}

fn new_event(flag: u32) -> *mut c_void {
    let mut e = null_mut();
    // SAFETY: the out-pointer is a live local.
    assert_eq!(unsafe { aclrtCreateEventWithFlag(&mut e, flag) }, 0);
    e
}

fn on_new_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().unwrap())
}

// ---- lifecycle and devices --------------------------------------------------------------------

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

// ---- streams ----------------------------------------------------------------------------------

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

// ---- callbacks --------------------------------------------------------------------------------

struct CbState {
    log: Mutex<Vec<&'static str>>,
    release: Mutex<Option<mpsc::Receiver<()>>>,
}

unsafe extern "C" fn slow_cb(user: *mut c_void) {
    // SAFETY: `user` is `Arc::as_ptr` of the test's `CbState`, which outlives every callback
    // launched with it (each ran, or failed its stream, before the test returns).
    let st = unsafe { &*(user as *const CbState) };
    std::thread::sleep(Duration::from_millis(30));
    st.log.lock().unwrap().push("callback");
}

unsafe extern "C" fn gated_cb(user: *mut c_void) {
    // SAFETY: `user` is `Arc::as_ptr` of the test's `CbState`, which outlives every callback
    // launched with it (each ran, or failed its stream, before the test returns).
    let st = unsafe { &*(user as *const CbState) };
    if let Some(rx) = st.release.lock().unwrap().take() {
        let _ = rx.recv();
    }
    st.log.lock().unwrap().push("gated");
}

extern "C" {
    fn pthread_self() -> usize;
}

#[test]
fn callbacks_block_and_no_block() {
    let _g = setup();
    static STOP: AtomicBool = AtomicBool::new(false);
    STOP.store(false, Ordering::SeqCst);
    let state = Arc::new(CbState {
        log: Mutex::new(Vec::new()),
        release: Mutex::new(None),
    });
    let user = Arc::as_ptr(&state) as *mut c_void;
    let user_addr = user as usize;
    // SAFETY: `user` points at `state`, alive to the end of the test, after every callback launched
    // with it ran or was dropped with its failed stream; both callbacks have the header's
    // signature; `pthread_self` has no preconditions; stream handles are registry-checked (module
    // doc).
    unsafe {
        let inv = ACL_ERROR_INVALID_PARAM;
        let s = new_stream();
        assert_eq!(
            aclrtLaunchCallback(Some(slow_cb), user, 1, s),
            inv,
            "not subscribed"
        );
        assert_eq!(aclrtProcessReport(10), ACL_ERROR_RT_REPORT_TIMEOUT);
        assert_eq!(aclrtProcessReport(-2), inv);

        std::thread::scope(|scope| {
            let (tid_tx, tid_rx) = mpsc::channel();
            scope.spawn(move || {
                assert_eq!(aclrtSetDevice(0), 0);
                tid_tx.send(pthread_self() as u64).unwrap();
                while !STOP.load(Ordering::SeqCst) {
                    let rc = aclrtProcessReport(5);
                    assert!(rc == 0 || rc == ACL_ERROR_RT_REPORT_TIMEOUT, "{rc}");
                }
            });
            let tid = tid_rx.recv().unwrap();
            assert_eq!(aclrtSubscribeReport(tid, s), 0);
            assert_eq!(aclrtSubscribeReport(tid, s), inv, "already subscribed");
            assert_eq!(aclrtLaunchCallback(None, user, 1, s), inv);
            assert_eq!(aclrtLaunchCallback(Some(slow_cb), user, 2, s), inv);

            // BLOCK: work after the callback waits for it.
            assert_eq!(
                aclrtLaunchCallback(Some(slow_cb), user, ACL_CALLBACK_BLOCK, s),
                0
            );
            let st = state.clone();
            stream::resolve(s).unwrap().enqueue(Box::new(move || {
                st.log.lock().unwrap().push("after");
                Ok(())
            }));
            assert_eq!(sync(s), 0);
            assert_eq!(*state.log.lock().unwrap(), ["callback", "after"]);

            // NO_BLOCK: the stream runs on while the callback is still pending.
            let (rel_tx, rel_rx) = mpsc::channel();
            *state.release.lock().unwrap() = Some(rel_rx);
            let u = user_addr as *mut c_void;
            assert_eq!(
                aclrtLaunchCallback(Some(gated_cb), u, ACL_CALLBACK_NO_BLOCK, s),
                0
            );
            assert_eq!(sync(s), 0);
            assert_eq!(state.log.lock().unwrap().len(), 2);
            rel_tx.send(()).unwrap();
            let t0 = Instant::now();
            while state.log.lock().unwrap().len() < 3 {
                assert!(t0.elapsed() < Duration::from_secs(5));
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(aclrtUnSubscribeReport(tid + 1, s), inv);
            assert_eq!(aclrtUnSubscribeReport(tid, s), 0);
            assert_eq!(aclrtUnSubscribeReport(tid, s), inv);
            STOP.store(true, Ordering::SeqCst);
        });

        // A blocking callback nobody will run fails the stream when its binding goes away.
        assert_eq!(aclrtSubscribeReport(0xDEAD, s), 0);
        assert_eq!(
            aclrtLaunchCallback(Some(slow_cb), user, ACL_CALLBACK_BLOCK, s),
            0
        );
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(aclrtUnSubscribeReport(0xDEAD, s), 0);
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        destroy_stream(s);
    }
}

// ---- HCCL -------------------------------------------------------------------------------------

fn root_info() -> Vec<u8> {
    let mut root = vec![0u8; HCCL_ROOT_INFO_BYTES];
    // SAFETY: the emulator writes `HCCL_ROOT_INFO_BYTES` into a Vec of that length.
    assert_eq!(unsafe { HcclGetRootInfo(root.as_mut_ptr().cast()) }, 0);
    root
}

/// Runs `f(rank, comm, stream)` on `n` rank threads sharing one communicator.
fn ranks(n: u32, f: impl Fn(u32, *mut c_void, *mut c_void) + Sync) {
    let root = root_info();
    let (root, f) = (&root, &f);
    std::thread::scope(|sc| {
        for r in 0..n {
            // SAFETY: `root` holds `HCCL_ROOT_INFO_BYTES`, which the init reads; the out-pointer is
            // a live local; the communicator and stream are destroyed only after `f` returned.
            sc.spawn(move || unsafe {
                assert_eq!(aclrtSetDevice((r % 4) as i32), 0);
                let mut comm = null_mut();
                assert_eq!(
                    HcclCommInitRootInfo(n, root.as_ptr().cast(), r, &mut comm),
                    0
                );
                let s = new_stream();
                f(r, comm, s);
                assert_eq!(HcclCommDestroy(comm), 0);
                destroy_stream(s);
            });
        }
    });
}

const F32: u32 = 4;
const I32: u32 = 2;

#[test]
fn all_reduce_all_gather_reduce_scatter() {
    let _g = setup();
    with_config(|c| c.delay_seed = Some(3));
    for n in [2u32, 4] {
        // SAFETY: every device buffer comes from `upload` / `malloc` sized for the count its
        // collective moves (and the emulator checks each against its allocation); `comm` and `s`
        // live for the closure (`ranks`).
        ranks(n, |r, comm, s| unsafe {
            let len = 10usize;
            let mine: Vec<f32> = (0..len).map(|i| (r * 100) as f32 + i as f32).collect();
            let send = upload(&mine);
            let recv = malloc(len * 4);
            assert_eq!(
                HcclAllReduce(send, recv, len as u64, F32, HCCL_REDUCE_SUM, comm, s),
                0
            );
            // In place, integer max.
            let ints = upload(&[r as i32, -(r as i32), 7]);
            assert_eq!(
                HcclAllReduce(ints, ints, 3, I32, HCCL_REDUCE_MAX, comm, s),
                0
            );
            assert_eq!(sync(s), 0);
            let want: Vec<f32> = (0..len)
                .map(|i| (0..n).map(|q| (q * 100) as f32 + i as f32).sum())
                .collect();
            assert_eq!(download::<f32>(recv, len), want);
            assert_eq!(download::<i32>(ints, 3), [n as i32 - 1, 0, 7]);

            let gathered = malloc(len * 4 * n as usize);
            assert_eq!(HcclAllGather(send, gathered, len as u64, F32, comm, s), 0);
            assert_eq!(sync(s), 0);
            let want: Vec<f32> = (0..n)
                .flat_map(|q| (0..len).map(move |i| (q * 100) as f32 + i as f32))
                .collect();
            assert_eq!(download::<f32>(gathered, want.len()), want);

            // Reduce-scatter of the gathered buffer: block r summed over ranks = n * block r.
            let part = malloc(len * 4);
            assert_eq!(
                HcclReduceScatter(gathered, part, len as u64, F32, HCCL_REDUCE_SUM, comm, s),
                0
            );
            assert_eq!(sync(s), 0);
            let want: Vec<f32> = mine.iter().map(|x| x * n as f32).collect();
            assert_eq!(download::<f32>(part, len), want);
            for p in [send, recv, ints, gathered, part] {
                free(p);
            }
        });
    }
}

#[test]
fn broadcast_alltoall_alltoallv() {
    let _g = setup();
    with_config(|c| c.delay_seed = Some(11));
    for n in [2u32, 4] {
        // SAFETY: the count and displacement arrays each hold the world size's u64s, as the
        // all-to-all-v reads them; every device buffer is sized for what its collective moves (and
        // registry-checked); `comm` and `s` live for the closure (`ranks`).
        ranks(n, |r, comm, s| unsafe {
            let nn = n as usize;
            let b = upload(&[r as i32; 5]);
            assert_eq!(HcclBroadcast(b, 5, I32, n - 1, comm, s), 0);

            // all-to-all: rank r sends value 10*r + j to rank j (2 elements each).
            let send: Vec<i32> = (0..nn)
                .flat_map(|j| [10 * r as i32 + j as i32; 2])
                .collect();
            let sp = upload(&send);
            let rp = malloc(send.len() * 4);
            assert_eq!(HcclAlltoAll(sp, 2, I32, rp, 2, I32, comm, s), 0);

            // all-to-all-v: rank r sends j + 1 elements to rank j, valued 100*r + j.
            let scounts: Vec<u64> = (0..n).map(|j| u64::from(j) + 1).collect();
            let sdispls: Vec<u64> = scounts
                .iter()
                .scan(0, |a, c| Some(std::mem::replace(a, *a + c)))
                .collect();
            let vsend: Vec<i32> = (0..n)
                .flat_map(|j| std::iter::repeat_n(100 * r as i32 + j as i32, j as usize + 1))
                .collect();
            let rcounts = vec![u64::from(r) + 1; nn];
            // Gaps of one element between blocks: displacements need not be dense.
            let rdispls: Vec<u64> = (0..n).map(|i| u64::from(i) * (u64::from(r) + 2)).collect();
            let rlen = nn * (r as usize + 2);
            let vsp = upload(&vsend);
            let vrp = upload(&vec![-1i32; rlen]);
            let rc = HcclAlltoAllV(
                vsp,
                scounts.as_ptr().cast(),
                sdispls.as_ptr().cast(),
                I32,
                vrp,
                rcounts.as_ptr().cast(),
                rdispls.as_ptr().cast(),
                I32,
                comm,
                s,
            );
            assert_eq!(rc, 0);
            assert_eq!(sync(s), 0);

            assert_eq!(download::<i32>(b, 5), [n as i32 - 1; 5]);
            let want: Vec<i32> = (0..nn)
                .flat_map(|i| [10 * i as i32 + r as i32; 2])
                .collect();
            assert_eq!(download::<i32>(rp, want.len()), want);
            let got = download::<i32>(vrp, rlen);
            for i in 0..nn {
                let at = i * (r as usize + 2);
                let blk = &got[at..at + r as usize + 2];
                assert!(blk[..r as usize + 1]
                    .iter()
                    .all(|&x| x == 100 * i as i32 + r as i32));
                assert_eq!(blk[r as usize + 1], -1, "gap untouched");
            }
            for p in [b, sp, rp, vsp, vrp] {
                free(p);
            }
        });
    }
}

#[test]
fn send_recv_pairs_and_groups() {
    let _g = setup();
    with_config(|c| c.delay_seed = Some(5));
    // SAFETY: `mine` and `got` are 32-byte device buffers, 8 i32 as each call moves; `comm` and `s`
    // live for the closure (`ranks`).
    ranks(4, |r, comm, s| unsafe {
        let mine = upload(&[r as i32; 8]);
        let got = malloc(32);
        // A ring inside a group: every rank sends before it receives, which would deadlock
        // without the group.
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclSend(mine, 8, I32, (r + 1) % 4, comm, s), 0);
        assert_eq!(HcclRecv(got, 8, I32, (r + 3) % 4, comm, s), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(sync(s), 0);
        assert_eq!(download::<i32>(got, 8), [((r + 3) % 4) as i32; 8]);

        // Ungrouped, in matching order: evens send then receive, odds the reverse.
        let peer = r ^ 1;
        let order: [bool; 2] = if r % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for send_first in order {
            if send_first {
                assert_eq!(HcclSend(mine, 8, I32, peer, comm, s), 0);
            } else {
                assert_eq!(HcclRecv(got, 8, I32, peer, comm, s), 0);
            }
        }
        assert_eq!(sync(s), 0);
        assert_eq!(download::<i32>(got, 8), [peer as i32; 8]);
        free(mine);
        free(got);
    });
}

#[test]
fn hccl_mismatch_and_missing_peer_fail_the_stream() {
    let _g = setup();
    crate::control::hprtEmuSetHcclTimeoutMs(300);
    // Each failure on its own communicator: after one, the communicator is broken.
    // SAFETY: `buf` is a 64-byte device buffer, at least the 8 f32 any call here moves;
    // out-pointers are live locals; `comm` and `s` live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        let count = if r == 0 { 4 } else { 8 };
        assert_eq!(
            HcclAllReduce(buf, buf, count, F32, HCCL_REDUCE_SUM, comm, s),
            0
        );
        // The failure reaches what is ordered after it through an event: the event's
        // synchronize and a stream that waited on it, as a GPU's sticky errors do.
        let mut ev = null_mut();
        assert_eq!(aclrtCreateEvent(&mut ev), 0);
        assert_eq!(aclrtRecordEvent(ev, s), 0);
        let mut b = null_mut();
        assert_eq!(aclrtCreateStream(&mut b), 0);
        assert_eq!(aclrtStreamWaitEvent(b, ev), 0);
        assert_eq!(aclrtSynchronizeEvent(ev), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(sync(b), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(sync(b), 0, "reported once");
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        assert_eq!(aclrtRecordEvent(ev, s), 0);
        assert_eq!(aclrtStreamWaitEvent(b, ev), 0);
        assert_eq!(sync(b), 0, "a record after the report is clean");
        assert_eq!(aclrtDestroyStream(b), 0);
        assert_eq!(aclrtDestroyEvent(ev), 0);
        free(buf);
    });
    // SAFETY: `buf` is a 64-byte device buffer, more than the 4 f32 the call moves; `comm` and `s`
    // live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        // Different ops also disagree.
        let op = if r == 0 {
            HCCL_REDUCE_SUM
        } else {
            HCCL_REDUCE_MAX
        };
        assert_eq!(HcclAllReduce(buf, buf, 4, F32, op, comm, s), 0);
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        free(buf);
    });
    // SAFETY: `buf` is a 64-byte device buffer, at least the 4 f32 either call moves; `comm` and
    // `s` live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        // Send/recv whose counts disagree.
        if r == 0 {
            assert_eq!(HcclSend(buf, 4, F32, 1, comm, s), 0);
        } else {
            assert_eq!(HcclRecv(buf, 2, F32, 0, comm, s), 0);
        }
        assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
        free(buf);
    });
    // SAFETY: `buf` is a 64-byte device buffer, more than the 4 f32 the call moves; `comm` and `s`
    // live for the closure (`ranks`).
    ranks(2, |r, comm, s| unsafe {
        let buf = malloc(64);
        // Rank 1 never joins: rank 0 times out instead of hanging, once; the communicator is
        // broken then, so what was queued behind and what comes later fails at once.
        if r == 0 {
            let t0 = Instant::now();
            for _ in 0..5 {
                assert_eq!(HcclAllReduce(buf, buf, 4, F32, HCCL_REDUCE_SUM, comm, s), 0);
            }
            assert_eq!(sync(s), ACL_ERROR_RT_INTERNAL_ERROR);
            let waited = t0.elapsed();
            assert!(waited >= Duration::from_millis(250), "{waited:?}");
            assert!(waited < Duration::from_millis(1000), "{waited:?}");
        }
        free(buf);
    });
}

#[test]
fn hccl_call_time_validation() {
    let _g = setup();
    crate::control::hprtEmuSetHcclTimeoutMs(300);
    // SAFETY: root infos are `HCCL_ROOT_INFO_BYTES` buffers alive for each call; out-pointers are
    // live locals or null (refused); the bogus communicator and stream handles, the host buffer
    // passed as device memory and the counts past an allocation's end are refused by registry
    // checks at call time (module doc); `counts` and `displs` hold one u64 each, for a one-rank
    // communicator.
    unsafe {
        let mut comm = null_mut();
        let root = root_info();
        let rp = root.as_ptr().cast();
        assert_eq!(HcclGetRootInfo(null_mut()), HCCL_E_PTR);
        // HCCL needs the calling thread's device, before any other check.
        on_new_thread(|| {
            let mut r = vec![0u8; HCCL_ROOT_INFO_BYTES];
            assert_eq!(HcclGetRootInfo(r.as_mut_ptr().cast()), HCCL_E_RUNTIME);
            let mut c = null_mut();
            let rp = root.as_ptr().cast();
            assert_eq!(HcclCommInitRootInfo(1, rp, 0, &mut c), HCCL_E_RUNTIME);
            let n = null_mut();
            assert_eq!(HcclAllReduce(n, n, 0, F32, 0, n, n), HCCL_E_RUNTIME);
            assert_eq!(HcclGroupStart(), 0);
            assert_eq!(HcclGroupEnd(), 0);
        });
        assert_ne!(root_info()[16..24], root[16..24], "root infos are unique");
        assert_eq!(HcclCommInitRootInfo(2, null(), 0, &mut comm), HCCL_E_PTR);
        assert_eq!(HcclCommInitRootInfo(2, rp, 0, null_mut()), HCCL_E_PTR);
        assert_eq!(HcclCommInitRootInfo(0, rp, 0, &mut comm), HCCL_E_PARA);
        assert_eq!(HcclCommInitRootInfo(2, rp, 2, &mut comm), HCCL_E_PARA);
        let junk = vec![0u8; HCCL_ROOT_INFO_BYTES];
        assert_eq!(
            HcclCommInitRootInfo(1, junk.as_ptr().cast(), 0, &mut comm),
            HCCL_E_PARA
        );
        // Nobody else joins.
        assert_eq!(HcclCommInitRootInfo(2, rp, 0, &mut comm), HCCL_E_TIMEOUT);
        // Ranks that disagree on the size, or claim the same rank.
        for (n1, r1) in [(3u32, 1u32), (2, 0)] {
            let root = root_info();
            let root = &root;
            let rcs: Vec<u32> = std::thread::scope(|sc| {
                let a = sc.spawn(|| {
                    assert_eq!(aclrtSetDevice(1), 0);
                    let mut c = null_mut();
                    let rc = HcclCommInitRootInfo(2, root.as_ptr().cast(), 0, &mut c);
                    (rc, c as usize)
                });
                std::thread::sleep(Duration::from_millis(50));
                let mut c = null_mut();
                let rc_b = HcclCommInitRootInfo(n1, root.as_ptr().cast(), r1, &mut c);
                vec![a.join().unwrap().0, rc_b]
            });
            assert_eq!(rcs, [HCCL_E_PARA, HCCL_E_PARA], "n={n1} rank={r1}");
        }

        // A single-rank communicator for the per-call checks.
        assert_eq!(
            HcclCommInitRootInfo(1, root_info().as_ptr().cast(), 0, &mut comm),
            0
        );
        let s = new_stream();
        let d = malloc(64);
        let mut host = [0f32; 16];
        let hp: *mut c_void = host.as_mut_ptr().cast();
        let bogus = 0x7FFF_FFFF_0010usize as *mut c_void;
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, bogus, s), HCCL_E_PARA);
        assert_eq!(
            HcclAllReduce(null_mut(), d, 16, F32, 0, comm, s),
            HCCL_E_PTR
        );
        assert_eq!(HcclAllReduce(null_mut(), null_mut(), 0, F32, 0, comm, s), 0);
        assert_eq!(HcclAllReduce(d, d, 16, 12, 0, comm, s), HCCL_E_NOT_SUPPORT);
        assert_eq!(HcclAllReduce(d, d, 16, 13, 0, comm, s), HCCL_E_PARA);
        assert_eq!(HcclAllReduce(d, d, 16, F32, 4, comm, s), HCCL_E_PARA);
        assert_eq!(
            HcclAllReduce(hp, d, 16, F32, 0, comm, s),
            HCCL_E_PARA,
            "host buffer"
        );
        assert_eq!(
            HcclAllReduce(d, d, 17, F32, 0, comm, s),
            HCCL_E_PARA,
            "past the end"
        );
        assert_eq!(
            HcclAllReduce(d, d, 16, F32, 0, comm, 0x5FFF_FFFF_0010usize as _),
            HCCL_E_PARA
        );
        assert_eq!(HcclBroadcast(d, 16, F32, 1, comm, s), HCCL_E_PARA);
        assert_eq!(HcclAllGather(d, d, 16, F32, comm, s), 0);
        assert_eq!(HcclAlltoAll(d, 16, F32, d, 16, I32, comm, s), HCCL_E_PARA);
        assert_eq!(HcclAlltoAll(d, 16, F32, d, 8, F32, comm, s), HCCL_E_PARA);
        let counts = [16u64];
        let displs = [1u64];
        let cp = counts.as_ptr().cast();
        let dp = displs.as_ptr().cast();
        assert_eq!(
            HcclAlltoAllV(d, cp, null(), F32, d, cp, dp, F32, comm, s),
            HCCL_E_PTR
        );
        assert_eq!(
            HcclAlltoAllV(d, cp, dp, F32, d, cp, dp, I32, comm, s),
            HCCL_E_PARA
        );
        assert_eq!(
            HcclAlltoAllV(d, cp, dp, F32, d, cp, dp, F32, comm, s),
            HCCL_E_PARA,
            "1 + 16 > 16"
        );
        assert_eq!(
            HcclAllReduce(d, d, 16, F32, 0, comm, null_mut()),
            HCCL_E_PTR,
            "no default stream"
        );
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, null_mut(), s), HCCL_E_PTR);
        assert_eq!(HcclSend(d, 4, F32, 0, null_mut(), s), HCCL_E_PTR);
        assert_eq!(HcclSend(d, 0, 99, 5, null_mut(), null_mut()), 0, "count 0");
        assert_eq!(
            HcclAlltoAll(null(), 0, F32, null(), 0, I32, null_mut(), null_mut()),
            0
        );
        assert_eq!(HcclAlltoAll(d, 1, F32, null(), 1, F32, comm, s), HCCL_E_PTR);
        // A rank may send to itself inside a group.
        let half = (d as usize + 32) as *mut c_void;
        // Work still queued on `s` (the calls above) must not land after the host-side memset.
        assert_eq!(sync(s), 0);
        assert_eq!(aclrtMemset(d, 64, 0x11, 32), 0);
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclSend(d, 8, F32, 0, comm, s), 0);
        assert_eq!(HcclRecv(half, 8, F32, 0, comm, s), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(sync(s), 0);
        assert_eq!(download::<u8>(d, 64), [0x11u8; 64]);
        assert_eq!(HcclRecv(d, 4, F32, 1, comm, s), HCCL_E_PARA, "no such rank");
        assert_eq!(HcclGroupEnd(), HCCL_E_PARA);
        // Nested groups submit at the outermost end.
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclGroupStart(), 0);
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, comm, s), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(HcclGroupEnd(), 0);
        assert_eq!(HcclGroupEnd(), HCCL_E_PARA);
        assert_eq!(sync(s), 0);

        assert_eq!(HcclCommDestroy(comm), 0);
        assert_eq!(HcclCommDestroy(comm), HCCL_E_PARA);
        assert_eq!(
            HcclCommDestroy(null_mut()),
            0,
            "null is skipped, as in CANN"
        );
        assert_eq!(HcclAllReduce(d, d, 16, F32, 0, comm, s), HCCL_E_PARA);
        free(d);
        destroy_stream(s);
    }
}

// ---- faults, stats, panics --------------------------------------------------------------------

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
