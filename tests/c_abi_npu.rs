//! The C ABI on the npu backend over the Ascend emulator (`tests/ascend-emulator`, built on first
//! use by `hprt_emulator_common::library`): what a C program on
//! Ascend does, from `hprt_platform_open("npu")` through a communicator to a collective.
//!
//! The emulator is found through `HP_ACL_LIB` / `HP_HCCL_LIB`, set once for this test binary
//! before any platform is opened (its one test keeps the process-wide emulator to itself).

use std::ptr;

use hprt::ffi::*;

mod common;
use common::*;
mod c_abi_common;
use c_abi_common::*;

fn emulator() -> std::path::PathBuf {
    hprt_emulator_common::library::ascend_emulator()
}

fn open_npu() -> *mut HprtPlatform {
    let mut p = ptr::null_mut();
    // SAFETY: a NUL-terminated request and a valid out-pointer.
    ok(unsafe { hprt_platform_open(c"npu".as_ptr(), &mut p) });
    p
}

/// ISSUE 32 item 13: HCCL's root info is 4,108 bytes and `HPRT_UNIQUE_ID_MAX_BYTES` was 4,096,
/// so `hprt_unique_id` answered BUFFER_TOO_SMALL into a buffer of that size, and
/// `hprt_comm_init` refused the id's length: no communicator, collective or hsdp from C on
/// Ascend. A buffer of `HPRT_UNIQUE_ID_MAX_BYTES` now holds it, and two ranks all-reduce.
#[test]
fn a_c_program_makes_a_communicator_and_all_reduces_on_npu() {
    let lib = emulator();
    // Before any platform is opened and before this binary starts a thread of its own.
    std::env::set_var("HP_ACL_LIB", &lib);
    std::env::set_var("HP_HCCL_LIB", &lib);
    std::env::set_var("HP_EMU_DEVICES", "2");
    std::env::set_var("HP_EMU_HCCL_TIMEOUT_MS", "20000");
    let p = open_npu();
    let mut name = ptr::null();
    // SAFETY: live platform, valid out-pointer; the name is a static string.
    unsafe {
        ok(hprt_platform_backend_name(p, &mut name));
        assert_eq!(std::ffi::CStr::from_ptr(name).to_str().unwrap(), "npu");
    }
    // On the emulator no framework device addresses its memory, and ranks are threads.
    let mut caps = std::mem::MaybeUninit::<HprtCapabilities>::uninit();
    // SAFETY: live platform, valid out-pointer (written on success).
    let caps = unsafe {
        ok(hprt_platform_capabilities(p, caps.as_mut_ptr()));
        caps.assume_init()
    };
    assert!(caps.framework_device.is_null());
    assert!(caps.ranks_are_threads && !caps.ranks_share_device);
    assert!(!caps.device_memory_is_host && !caps.host_stream && !caps.kernel_compiler);
    let world = 2usize;
    let mut id = [0u8; HPRT_UNIQUE_ID_MAX_BYTES];
    let mut len = 0;
    // SAFETY: `id` has the capacity passed.
    ok(unsafe { hprt_unique_id(p, id.as_mut_ptr(), id.len(), &mut len) });
    assert_eq!(len, 4108, "an HcclRootInfo");
    // One byte short of it: the typed error that says how much is needed.
    // SAFETY: as above, with a smaller capacity.
    let st = unsafe { hprt_unique_id(p, id.as_mut_ptr(), len - 1, &mut len) };
    assert_eq!(st, HprtStatus::ErrorBufferTooSmall);
    assert!(last_error().contains("4108"), "{}", last_error());
    // A length past the maximum is refused before anything is read.
    let mut comm = ptr::null_mut();
    // SAFETY: `id` is valid for `len` bytes; the longer length is refused before any read.
    let st = unsafe {
        hprt_comm_init(
            p,
            id.as_ptr(),
            HPRT_UNIQUE_ID_MAX_BYTES + 1,
            0,
            world,
            &mut comm,
        )
    };
    assert_eq!(st, HprtStatus::ErrorInvalidValue);
    assert!(comm.is_null());

    let pa = p as usize;
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || {
                let p = pa as *const HprtPlatform;
                // SAFETY: the platform outlives the threads; `id` is its unique id.
                unsafe {
                    ok(hprt_set_device(p, rank));
                    all_reduce_rank(p, &id[..len], rank, world);
                }
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap();
    }
    // SAFETY: closed once, after every object made from it.
    unsafe {
        ok(hprt_platform_synchronize(p));
        ok(hprt_platform_close(p));
    }
}
