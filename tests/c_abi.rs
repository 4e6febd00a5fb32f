//! The C ABI from Rust, through the same `extern "C"` functions a C program links: status codes,
//! the thread-local message, panics stopped at the boundary, and data really moving. One test
//! binary for the whole C surface except hsdp (`c_abi_hsdp.rs`); its sections, in `c_abi/`,
//! follow src/ffi's modules.

use std::ffi::CStr;
use std::ptr;

use hprt::ffi::*;

mod common;
use common::*;
mod c_abi_common;
use c_abi_common::*;

#[path = "c_abi/group_swap.rs"]
mod group_swap;
#[path = "c_abi/pipeline.rs"]
mod pipeline;
#[path = "c_abi/transfers.rs"]
mod transfers;

#[test]
fn a_panic_becomes_a_status_and_a_message() {
    assert_eq!(hprt_debug_forced_panic(), HprtStatus::ErrorPanic);
    let msg = last_error();
    assert!(msg.contains("hprt_debug_forced_panic"), "{msg}");
    // The thread keeps working after the caught panic.
    let p = open_cpu();
    // SAFETY: `p` is live and closed once.
    ok(unsafe { hprt_platform_close(p) });
}

/// ISSUE 31 item 2: a C program asks what the platform can do, not which backend it is.
#[test]
fn capabilities_of_the_cpu_backend() {
    let p = open_cpu();
    let mut c = std::mem::MaybeUninit::<HprtCapabilities>::uninit();
    // SAFETY: live platform, valid out-pointer (written on success).
    let c = unsafe {
        ok(hprt_platform_capabilities(p, c.as_mut_ptr()));
        c.assume_init()
    };
    assert!(c.device_memory_is_host && c.host_stream && c.configurable_devices);
    assert!(c.checked_stream_handles);
    assert!(c.ranks_are_threads && c.ranks_share_device && !c.kernel_compiler);
    // SAFETY: a static NUL-terminated string.
    let device = unsafe { CStr::from_ptr(c.framework_device) };
    assert_eq!(device.to_str().unwrap(), "cpu");
    // SAFETY: a null out-pointer is refused; `p` is live and closed once.
    unsafe {
        expect(
            hprt_platform_capabilities(p, ptr::null_mut()),
            HprtStatus::ErrorNullArgument,
        );
        ok(hprt_platform_close(p));
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    let mut out = ptr::null_mut();
    // SAFETY: null request (HP_PLATFORM) is allowed; a bogus name is an error, not UB.
    let s = unsafe { hprt_platform_open(c"gpu9000".as_ptr(), &mut out) };
    assert_eq!(s, HprtStatus::ErrorInvalidValue);
    assert!(last_error().contains("gpu9000"), "{}", last_error());
    assert!(out.is_null(), "out-pointers are written only on success");
    for name in [c"", c"CPU ", c" cpu"] {
        // SAFETY: as above.
        let s = unsafe { hprt_platform_open(name.as_ptr(), &mut out) };
        assert_eq!(s, HprtStatus::ErrorInvalidValue, "{name:?}");
        assert!(out.is_null());
    }

    let p = open_cpu();
    // SAFETY: null out-pointer and null handles must be reported, not dereferenced.
    unsafe {
        assert_eq!(
            hprt_stream_create(p, ptr::null_mut()),
            HprtStatus::ErrorNullArgument
        );
        assert_eq!(
            hprt_stream_synchronize(p, ptr::null()),
            HprtStatus::ErrorNullArgument
        );
        let mut b = ptr::null_mut();
        ok(hprt_device_alloc(p, 64, &mut b));
        let s = stream(p);
        let comm = solo_comm(p);
        // 42 is no HprtDtype: rejected before anything is queued.
        let st = hprt_all_reduce(p, comm, b, 0, b, 0, 4, 42, HprtReduceOp::Sum as i32, s);
        assert_eq!(st, HprtStatus::ErrorInvalidValue);
        assert!(last_error().contains("42"), "{}", last_error());
        // Past the end of the buffer: the platform's own typed error comes through.
        let st = hprt_all_reduce(
            p,
            comm,
            b,
            0,
            b,
            0,
            17,
            HprtDtype::F32 as i32,
            HprtReduceOp::Sum as i32,
            s,
        );
        assert_eq!(st, HprtStatus::ErrorOutOfRange, "{}", last_error());
        let name = CStr::from_ptr(hprt_status_name(st as i32));
        assert_eq!(name.to_str().unwrap(), "HPRT_STATUS_ERROR_OUT_OF_RANGE");
        assert_eq!(
            CStr::from_ptr(hprt_status_name(999)).to_str().unwrap(),
            "HPRT_STATUS_UNKNOWN"
        );
        ok(hprt_comm_destroy(p, comm));
        ok(hprt_device_free(p, b));
        close_with_stream(p, s);
    }
}

#[test]
fn messages_are_per_thread() {
    // SAFETY: null out-pointer is reported.
    let s = unsafe { hprt_platform_open(c"cpu".as_ptr(), ptr::null_mut()) };
    assert_eq!(s, HprtStatus::ErrorNullArgument);
    let here = last_error();
    let there = std::thread::spawn(last_error).join().unwrap();
    assert!(here.contains("out_platform"), "{here}");
    assert_eq!(there, "", "another thread's message leaked");
}
