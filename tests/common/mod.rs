//! Helpers the C ABI tests share: the thread's last message and status assertions.
#![allow(dead_code)] // each test crate uses its own subset

use std::ffi::CStr;
use std::ptr;

use hprt::ffi::*;

pub fn last_error() -> String {
    // SAFETY: never null, valid until this thread's next failing call.
    unsafe { CStr::from_ptr(hprt_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

pub fn ok(status: HprtStatus) {
    assert_eq!(status, HprtStatus::Ok, "{}", last_error());
}

pub fn expect(status: HprtStatus, want: HprtStatus) {
    assert_eq!(status, want, "{}", last_error());
}

pub fn open_cpu() -> *mut HprtPlatform {
    let mut p = ptr::null_mut();
    // SAFETY: a NUL-terminated request and a valid out-pointer.
    ok(unsafe { hprt_platform_open(c"cpu".as_ptr(), &mut p) });
    p
}
