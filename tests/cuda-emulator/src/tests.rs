//! The emulator's contracts, called the way the cuda backend calls them (the exported functions
//! themselves). The emulator's state is process-global: every test takes one lock, and the
//! emulated machine has two devices so cross-context misuse can be provoked. The tests are
//! grouped by area in this module's submodules, its helpers shared through `super::*`.

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

mod comms;
mod contexts;
mod kernels;
mod memory_streams;

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

/// How most tests start: the lock, device 0's context current, and a stream on it.
fn on_device0() -> (MutexGuard<'static, ()>, *mut c_void) {
    let g = setup();
    bind(0);
    (g, stream())
}

/// How those tests end: their stream destroyed, device 0's context released.
fn done_on_device0(s: *mut c_void) {
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    unbind(0);
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
