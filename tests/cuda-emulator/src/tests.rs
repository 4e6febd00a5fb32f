//! The emulator's contracts, called the way the cuda backend calls them (the exported functions
//! themselves). The emulator's state is process-global: every test takes one lock, and the
//! emulated machine has two devices so cross-context misuse can be provoked.
//! (Over 800 lines because that one process-global state makes one file of them.)

use std::ffi::{c_void, CString};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, Once};

use crate::codes::*;
use crate::context::*;
use crate::memory::*;
use crate::module::*;
use crate::nccl::*;
use crate::nvrtc::*;
use crate::state;
use crate::stream::*;

fn setup() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    static ONCE: Once = Once::new();
    let g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    ONCE.call_once(|| {
        std::env::set_var("HP_EMU_DEVICES", "2");
        std::env::set_var("HP_EMU_NCCL_TIMEOUT_MS", "5000");
        assert_eq!(cuInit(0), CUDA_SUCCESS);
    });
    g
}

/// Retains device `dev`'s primary context and makes it current on this thread.
fn bind(dev: i32) -> *mut c_void {
    let mut ctx = null_mut();
    assert_eq!(
        // SAFETY: out-pointer to a local.
        unsafe { cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        CUDA_SUCCESS
    );
    assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    ctx
}

fn unbind(dev: i32) {
    assert_eq!(cuCtxSetCurrent(null_mut()), CUDA_SUCCESS);
    assert_eq!(cuDevicePrimaryCtxRelease_v2(dev), CUDA_SUCCESS);
}

fn stream() -> *mut c_void {
    let mut s = null_mut();
    assert_eq!(
        // SAFETY: out-pointer to a local.
        unsafe { cuStreamCreate(&mut s, CU_STREAM_NON_BLOCKING) },
        CUDA_SUCCESS
    );
    s
}

fn alloc(bytes: usize) -> u64 {
    let mut p = 0;
    // SAFETY: out-pointer to a local.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, bytes) }, CUDA_SUCCESS);
    p
}

fn upload(dst: u64, data: &[u8], s: *mut c_void) {
    assert_eq!(
        cuMemcpyAsync(dst, data.as_ptr() as u64, data.len(), s),
        CUDA_SUCCESS
    );
}

fn download(src: u64, len: usize, s: *mut c_void) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // Pageable destination: the copy is synchronous with the host.
    assert_eq!(
        cuMemcpyAsync(out.as_mut_ptr() as u64, src, len, s),
        CUDA_SUCCESS
    );
    out
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

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
    let _g = setup();
    bind(0);
    let s = stream();
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

#[test]
fn memory_contracts() {
    let _g = setup();
    bind(0);
    let s = stream();
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
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    unbind(0);
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
    let _g = setup();
    bind(0);
    let s = stream();
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
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    unbind(0);
}

#[test]
fn events_time_and_refuse_what_cuda_refuses() {
    let _g = setup();
    bind(0);
    let s = stream();
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
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    unbind(0);
}

/// Compiles `src` with the emulator's NVRTC for sm_80, loads it, returns the module.
fn load(src: &str) -> *mut c_void {
    let (src, name) = (CString::new(src).unwrap(), CString::new("test.cu").unwrap());
    let opts = [
        CString::new("--gpu-architecture=sm_80").unwrap(),
        CString::new("--fmad=false").unwrap(),
    ];
    let opt_ptrs: Vec<_> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog = null_mut();
    let mut module = null_mut();
    // SAFETY: NUL-terminated strings and out-pointers to locals; buffers sized as NVRTC says.
    unsafe {
        assert_eq!(
            nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null()
            ),
            0
        );
        let r = nvrtcCompileProgram(prog, 2, opt_ptrs.as_ptr());
        let mut n = 0;
        assert_eq!(nvrtcGetProgramLogSize(prog, &mut n), 0);
        let mut log = vec![0u8; n];
        assert_eq!(nvrtcGetProgramLog(prog, log.as_mut_ptr().cast()), 0);
        assert_eq!(r, 0, "{}", String::from_utf8_lossy(&log));
        assert_eq!(nvrtcGetCUBINSize(prog, &mut n), 0);
        let mut cubin = vec![0u8; n];
        assert_eq!(nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()), 0);
        assert_eq!(
            cuModuleLoadData(&mut module, cubin.as_ptr().cast()),
            CUDA_SUCCESS
        );
        assert_eq!(nvrtcDestroyProgram(&mut prog), 0);
    }
    module
}

fn function(module: *mut c_void, name: &str) -> *mut c_void {
    let mut f = null_mut();
    let name = CString::new(name).unwrap();
    assert_eq!(
        // SAFETY: a loaded module and a NUL-terminated name.
        unsafe { cuModuleGetFunction(&mut f, module, name.as_ptr()) },
        CUDA_SUCCESS
    );
    f
}

/// Launches `f` with `args` (pointers to the argument values).
fn launch(
    f: *mut c_void,
    grid: u32,
    block: u32,
    shared: u32,
    s: *mut c_void,
    args: &mut [*mut c_void],
) -> u32 {
    // SAFETY: `args` point at live locals matching the kernel's parameters.
    unsafe {
        cuLaunchKernel(
            f,
            grid,
            1,
            1,
            block,
            1,
            1,
            shared,
            s,
            args.as_mut_ptr(),
            null_mut(),
        )
    }
}

const COOPERATIVE: &str = r#"
// One sum per block: a shared-memory tree with barriers, the last 32 by warp shuffles.
extern "C" __global__ void block_sum(const float* in, float* out, unsigned long long n) {
    __shared__ float part[256];
    unsigned t = threadIdx.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + t;
    part[t] = i < n ? in[i] : 0.0f;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s >= 32; s /= 2) {
        if (t < s) part[t] += part[t + s];
        __syncthreads();
    }
    if (t < 32) {
        float v = part[t];
        for (int d = 16; d > 0; d /= 2) v += __shfl_down_sync(0xffffffffu, v, d);
        if (t == 0) out[blockIdx.x] = v;
    }
}

// Per warp: the ballot of odd inputs, and each lane's value from the lane above (wrapping).
extern "C" __global__ void votes(const int* in, unsigned* ballots, int* rotated) {
    extern __shared__ int staged[];
    unsigned t = threadIdx.x;
    staged[t] = in[t];
    __syncthreads();
    unsigned b = __ballot_sync(0xffffffffu, staged[t] & 1);
    if (t % 32 == 0) ballots[t / 32] = b;
    rotated[t] = __shfl_sync(0xffffffffu, staged[t], (t + 1) % 32);
}

// Threads that never reach the barrier the others wait at.
extern "C" __global__ void divergent(int* out) {
    if (threadIdx.x < 16) __syncthreads();
    else __syncwarp();
    out[threadIdx.x] = 1;
}
"#;

#[test]
fn kernels_meet_at_barriers_and_use_warp_intrinsics_and_shared_memory() {
    let _g = setup();
    bind(0);
    let s = stream();
    let module = load(COOPERATIVE);
    let n: u64 = 1000;
    let input: Vec<f32> = (0..n).map(|i| (i % 17) as f32).collect();
    let (d_in, d_out) = (alloc(4 * n as usize), alloc(4 * 4));
    upload(d_in, &f32s(&input), s);
    let f = function(module, "block_sum");
    let (mut a, mut b, mut nn) = (d_in, d_out, n);
    let mut args = [
        (&mut a as *mut u64).cast(),
        (&mut b as *mut u64).cast(),
        (&mut nn as *mut u64).cast(),
    ];
    assert_eq!(launch(f, 4, 256, 0, s, &mut args), CUDA_SUCCESS);
    let got = from_f32s(&download(d_out, 16, s));
    for (blk, g) in got.iter().enumerate() {
        let want: f32 = input.iter().skip(blk * 256).take(256).sum();
        assert_eq!(*g, want, "block {blk}");
    }

    let ints: Vec<i32> = (0..64).map(|i| i * 7 + 3 * (i % 5)).collect();
    let d_ints = alloc(256);
    upload(
        d_ints,
        &ints
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<_>>(),
        s,
    );
    let (d_ballots, d_rot) = (alloc(8), alloc(256));
    let (mut x, mut y, mut z) = (d_ints, d_ballots, d_rot);
    let mut args = [
        (&mut x as *mut u64).cast(),
        (&mut y as *mut u64).cast(),
        (&mut z as *mut u64).cast(),
    ];
    assert_eq!(
        launch(function(module, "votes"), 1, 64, 256, s, &mut args),
        CUDA_SUCCESS
    );
    let ballots = download(d_ballots, 8, s);
    for w in 0..2 {
        let want = (0..32).fold(0u32, |acc, l| acc | (((ints[w * 32 + l] & 1) as u32) << l));
        assert_eq!(
            u32::from_le_bytes(ballots[w * 4..w * 4 + 4].try_into().unwrap()),
            want
        );
    }
    let rot = download(d_rot, 256, s);
    for t in 0..64 {
        let want = ints[(t / 32) * 32 + (t + 1) % 32];
        assert_eq!(
            i32::from_le_bytes(rot[t * 4..t * 4 + 4].try_into().unwrap()),
            want,
            "lane {t}"
        );
    }

    // A grid whose threads cannot all meet fails at the next synchronisation, once.
    let mut o = d_rot;
    let mut args = [(&mut o as *mut u64).cast()];
    assert_eq!(
        launch(function(module, "divergent"), 1, 32, 0, s, &mut args),
        CUDA_SUCCESS
    );
    assert_eq!(cuStreamSynchronize(s), CUDA_ERROR_LAUNCH_FAILED);
    assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);

    // Launch limits.
    let f = function(module, "block_sum");
    let mut args = [
        (&mut a as *mut u64).cast(),
        (&mut b as *mut u64).cast(),
        (&mut nn as *mut u64).cast(),
    ];
    for (grid, block, shared) in [(0, 32, 0), (1, 0, 0), (1, 2048, 0), (1, 32, 64 * 1024)] {
        assert_eq!(
            launch(f, grid, block, shared, s, &mut args),
            CUDA_ERROR_INVALID_VALUE,
            "grid {grid} block {block} shared {shared}"
        );
    }
    // SAFETY: extra is a non-null placeholder the emulator refuses before reading.
    let r = unsafe {
        cuLaunchKernel(
            f,
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            s,
            args.as_mut_ptr(),
            args.as_mut_ptr(),
        )
    };
    assert_eq!(r, CUDA_ERROR_NOT_SUPPORTED);
    let mut missing = null_mut();
    let bad = CString::new("no_such_kernel").unwrap();
    assert_eq!(
        // SAFETY: as in `function`.
        unsafe { cuModuleGetFunction(&mut missing, module, bad.as_ptr()) },
        CUDA_ERROR_NOT_FOUND
    );
    // A function of an unloaded module is dead.
    assert_eq!(cuModuleUnload(module), CUDA_SUCCESS);
    assert_eq!(launch(f, 1, 32, 0, s, &mut args), CUDA_ERROR_INVALID_HANDLE);
    for p in [d_in, d_out, d_ints, d_ballots, d_rot] {
        assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
    }
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    unbind(0);
}

#[test]
fn nvrtc_reports_compile_errors_with_the_log() {
    let _g = setup();
    let (src, name) = (
        CString::new("extern \"C\" __global__ void k() { undeclared(); }").unwrap(),
        CString::new("bad.cu").unwrap(),
    );
    let mut prog = null_mut();
    // SAFETY: as in `load`.
    unsafe {
        assert_eq!(
            nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null()
            ),
            0
        );
        assert_eq!(
            nvrtcCompileProgram(prog, 0, std::ptr::null()),
            NVRTC_ERROR_COMPILATION
        );
        let mut n = 0;
        assert_eq!(nvrtcGetProgramLogSize(prog, &mut n), 0);
        let mut log = vec![0u8; n];
        assert_eq!(nvrtcGetProgramLog(prog, log.as_mut_ptr().cast()), 0);
        assert!(String::from_utf8_lossy(&log).contains("undeclared"));
        assert_eq!(
            nvrtcGetPTXSize(prog, &mut n),
            NVRTC_ERROR_INVALID_PROGRAM,
            "nothing compiled"
        );
        let opt = CString::new("--use_fast_math").unwrap();
        assert_eq!(
            nvrtcCompileProgram(prog, 1, &opt.as_ptr()),
            NVRTC_ERROR_INVALID_OPTION
        );
        assert_eq!(nvrtcDestroyProgram(&mut prog), 0);
        assert_eq!(nvrtcDestroyProgram(&mut prog), NVRTC_ERROR_INVALID_PROGRAM);
    }
}

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
    let _g = setup();
    bind(0);
    let s = stream();
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
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    unbind(0);
}
