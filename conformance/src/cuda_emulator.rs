//! Finding and opening the CUDA emulator (`tests/cuda-emulator`) from test binaries of any crate.
//! `cargo test` does not link the cdylib: [`library_path`] builds it on first use
//! (`hprt_emulator_common::library`), next to the test binaries in `target/<profile>/`.

use hprt_platform::cuda::{CudaBackend, CudaSearch};
use hprt_platform::{DeviceBuffer, Platform, Stream};

/// The device name the emulator reports, so cases can tell it from a GPU.
const DEVICE_NAME: &str = "hprt CUDA emulator";

pub use hprt_emulator_common::library::cuda_emulator as library_path;

/// Library search settings naming the emulator for the driver, NCCL and NVRTC.
pub fn search() -> CudaSearch {
    let lib = library_path();
    CudaSearch {
        cuda_lib: Some(lib.clone()),
        nccl_lib: Some(lib.clone()),
        nvrtc_lib: Some(lib),
    }
}

/// The cuda backend on the emulator.
pub fn open() -> hprt_platform::Result<CudaBackend> {
    CudaBackend::open_with(&search())
}

/// Whether `p` runs on the emulator rather than on a GPU (for cases only the emulator can
/// check, such as collectives whose ranks disagree, which real NCCL answers with a hang).
pub fn is_emulated(p: &dyn Platform) -> bool {
    p.info()
        .devices
        .first()
        .is_some_and(|d| d.name.contains(DEVICE_NAME))
}

/// How many `cuMemAlloc_v2` and `cuMemFree_v2` calls succeeded in this process so far (the
/// emulator's `hprtEmuGetDeviceMemoryCalls`; process-wide, so a test that compares two readings
/// runs alone in its binary or under one lock with every other user of the emulator).
pub fn device_memory_calls() -> (u64, u64) {
    // SAFETY: the emulator library (already loaded by the backend: the same handle).
    let lib = unsafe { libloading::Library::new(library_path()) }.expect("open the emulator");
    let (mut allocs, mut frees) = (0u64, 0u64);
    // SAFETY: the export's documented signature, into locals.
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn(*mut u64, *mut u64) -> i32> = lib
            .get(b"hprtEmuGetDeviceMemoryCalls\0")
            .expect("hprtEmuGetDeviceMemoryCalls (rebuild the emulator: cargo build -p hprt-cuda-emulator)");
        assert_eq!(f(&mut allocs, &mut frees), 0);
    }
    (allocs, frees)
}

/// Calls of the emulator's exported function `name` (e.g. `cuEventCreate`) in this process so far
/// (`hprtEmuGetCallCount`; restarted by every fault-list change, and process-wide as
/// [`device_memory_calls`]).
pub fn driver_calls(name: &str) -> u64 {
    // SAFETY: the emulator library (already loaded by the backend: the same handle).
    let lib = unsafe { libloading::Library::new(library_path()) }.expect("open the emulator");
    let name = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: the export's documented signature.
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char) -> u64> =
            lib.get(b"hprtEmuGetCallCount\0").expect(
                "hprtEmuGetCallCount (rebuild the emulator: cargo build -p hprt-cuda-emulator)",
            );
        f(name.as_ptr())
    }
}

/// The allocation-cache tests' tensors: device buffers of sizes that are and are not multiples
/// of the cache's rounding, each written with its own bytes (returned too, for
/// [`assert_reloaded`]).
pub fn cache_test_buffers(p: &dyn Platform, s: &Stream) -> (Vec<Vec<u8>>, Vec<DeviceBuffer>) {
    let sizes = [64 << 10, 64 << 10, 1000, 4096 + 3, 1 << 20, 256, 256, 77];
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (i * 31 + j * 7) as u8).collect())
        .collect();
    let bufs = data
        .iter()
        .map(|d| {
            let b = p.alloc_device(d.len()).unwrap();
            p.write_device_sync(&b, 0, d, s).unwrap();
            b
        })
        .collect();
    (data, bufs)
}

/// Panics unless every buffer of [`cache_test_buffers`] holds its own bytes again.
pub fn assert_reloaded(p: &dyn Platform, s: &Stream, bufs: &[DeviceBuffer], data: &[Vec<u8>]) {
    for (b, d) in bufs.iter().zip(data) {
        let mut back = vec![0u8; d.len()];
        p.read_device_sync(b, 0, &mut back, s).unwrap();
        assert_eq!(&back, d);
    }
}
