//! Modules and kernels: barriers, warp intrinsics and shared memory, and NVRTC's compile errors
//! with the log.

use super::*;

/// Compiles `src` with the emulator's NVRTC for sm_80, loads it, returns the module.
fn load(src: &str) -> *mut c_void {
    let opts = [
        CString::new("--gpu-architecture=sm_80").unwrap(),
        CString::new("--fmad=false").unwrap(),
    ];
    let opt_ptrs: Vec<_> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut module = null_mut();
    // SAFETY: NUL-terminated strings and out-pointers to locals; buffers sized as NVRTC says.
    unsafe {
        let mut prog = program(src, "test.cu");
        let r = nvrtcCompileProgram(prog, 2, opt_ptrs.as_ptr());
        let log = program_log(prog);
        assert_eq!(r, 0, "{log}");
        let mut n = 0;
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

/// A new NVRTC program of `src`, named `name`.
///
/// # Safety
/// The emulator is set up.
unsafe fn program(src: &str, name: &str) -> *mut c_void {
    let (src, name) = (CString::new(src).unwrap(), CString::new(name).unwrap());
    let mut prog = null_mut();
    // SAFETY: NUL-terminated strings and an out-pointer to a local.
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
    }
    prog
}

/// `prog`'s compile log.
///
/// # Safety
/// `prog` is a live program.
unsafe fn program_log(prog: *mut c_void) -> String {
    let mut n = 0;
    // SAFETY: the caller's contract; the log buffer has the size NVRTC reports.
    unsafe {
        assert_eq!(nvrtcGetProgramLogSize(prog, &mut n), 0);
        let mut log = vec![0u8; n];
        assert_eq!(nvrtcGetProgramLog(prog, log.as_mut_ptr().cast()), 0);
        String::from_utf8_lossy(&log).into_owned()
    }
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
    let (_g, s) = on_device0();
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
    done_on_device0(s);
}

#[test]
fn nvrtc_reports_compile_errors_with_the_log() {
    let _g = setup();
    // SAFETY: as in `load`.
    unsafe {
        let mut prog = program(
            "extern \"C\" __global__ void k() { undeclared(); }",
            "bad.cu",
        );
        assert_eq!(
            nvrtcCompileProgram(prog, 0, std::ptr::null()),
            NVRTC_ERROR_COMPILATION
        );
        assert!(program_log(prog).contains("undeclared"));
        let mut n = 0;
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
