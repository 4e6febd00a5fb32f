//! Tests through the exported functions, as the backend calls them. The emulator's state is
//! process-wide, so every test takes [`setup`]'s lock and starts from a known configuration; the
//! tests are grouped by area in this module's submodules, its helpers shared through `super::*`.
//!
//! The exported functions are `unsafe` for what the C header leaves to the caller: out-pointers
//! (here live locals, or null, which the emulator refuses) and host buffers (live locals of at
//! least the count, kept alive until the work on them ran). Handles and device pointers it looks
//! up in its registries, so the stale, bogus and out-of-range ones these tests pass are refused
//! with the asserted codes, never dereferenced. The SAFETY comments in the tests say which of these
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

mod callbacks;
mod collectives;
mod devices_memory;
mod faults;
mod streams_events;

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

/// A new HCCL root info.
fn root_info() -> Vec<u8> {
    let mut root = vec![0u8; HCCL_ROOT_INFO_BYTES];
    // SAFETY: the emulator writes `HCCL_ROOT_INFO_BYTES` into a Vec of that length.
    assert_eq!(unsafe { HcclGetRootInfo(root.as_mut_ptr().cast()) }, 0);
    root
}
