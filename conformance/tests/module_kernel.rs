//! `Platform::launch_module_kernel`: CUDA C that a crate above the platform brings (the codec's
//! kernels), on the cuda backend over the CUDA emulator (built on first
//! use), and refused with a typed error where no CUDA C compiler exists.

use hprt_platform::{
    Access, CpuBackend, CpuConfig, DeviceModule, ErrorKind, KernelArg, LaunchShape, Memory,
    Platform,
};

const MODULE: DeviceModule = DeviceModule {
    name: "hprt_test_add_k.cu",
    source: r#"
extern "C" __global__ void hprt_test_add_k(const unsigned int* a, unsigned int* out,
                                           unsigned long long n, unsigned int k) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride)
        out[i] = a[i] + k;
}
"#,
};

fn words(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

#[test]
fn module_kernels_run_in_stream_order_with_checked_arguments_on_the_cuda_emulator() {
    let p = hprt_conformance::cuda_emulator::open().expect("cuda on the emulator");
    let s = p.create_stream().unwrap();
    let n = 10_000usize;
    let input: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let (a, out) = (
        p.alloc_device(4 * n).unwrap(),
        p.alloc_device(4 * n).unwrap(),
    );
    // The input arrives asynchronously just before the launch: the kernel must run after it.
    let staging = p.alloc_pinned(4 * n).unwrap();
    staging.write(0, &words(&input)).unwrap();
    p.copy_async(
        Memory::Device(&a),
        0,
        Memory::Pinned(&staging),
        0,
        4 * n,
        &s,
    )
    .unwrap();
    let args = |bytes: usize| {
        [
            KernelArg::Ptr {
                at: a.at(0),
                bytes,
                access: Access::Read,
            },
            KernelArg::Ptr {
                at: out.at(0),
                bytes,
                access: Access::Write,
            },
            KernelArg::U64(n as u64),
            KernelArg::U32(7),
        ]
    };
    let shape = LaunchShape {
        grid: 3,
        block: 128,
    };
    p.launch_module_kernel(&MODULE, "hprt_test_add_k", shape, &args(4 * n), &s)
        .unwrap();
    let mut back = vec![0u8; 4 * n];
    p.read_device_sync(&out, 0, &mut back, &s).unwrap();
    let want: Vec<u32> = input.iter().map(|x| x.wrapping_add(7)).collect();
    assert!(back == words(&want), "the kernel computed other words");

    // A pointer argument beyond its buffer, an empty launch, an unknown kernel: typed errors.
    let err = p
        .launch_module_kernel(&MODULE, "hprt_test_add_k", shape, &args(4 * n + 4), &s)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfRange, "{err}");
    let empty = LaunchShape { grid: 0, block: 1 };
    let err = p
        .launch_module_kernel(&MODULE, "hprt_test_add_k", empty, &args(4 * n), &s)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidValue, "{err}");
    assert!(p
        .launch_module_kernel(&MODULE, "no_such_kernel", shape, &args(4 * n), &s)
        .is_err());
    // A module that does not compile: NVRTC's log in the error.
    let broken = DeviceModule {
        name: "hprt_test_broken.cu",
        source: "extern \"C\" __global__ void f(int* x) { x[0] = undeclared; }",
    };
    let err = p
        .launch_module_kernel(&broken, "f", shape, &[], &s)
        .unwrap_err();
    assert!(err.message.contains("undeclared"), "{err}");
    p.synchronize_stream(&s).unwrap();
}

#[test]
fn backends_without_a_cuda_c_compiler_refuse_module_kernels() {
    let p = CpuBackend::new(CpuConfig::default());
    let s = p.create_stream().unwrap();
    let a = p.alloc_device(16).unwrap();
    let err = p
        .launch_module_kernel(
            &MODULE,
            "hprt_test_add_k",
            LaunchShape { grid: 1, block: 1 },
            &[
                KernelArg::Ptr {
                    at: a.at(0),
                    bytes: 16,
                    access: Access::Read,
                },
                KernelArg::Ptr {
                    at: a.at(0),
                    bytes: 16,
                    access: Access::Write,
                },
                KernelArg::U64(4),
                KernelArg::U32(1),
            ],
            &s,
        )
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
}
