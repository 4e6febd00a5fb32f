//! `cuInit`, devices, and contexts: each device has one primary context, created by the first
//! `cuDevicePrimaryCtxRetain` and destroyed (with every stream, event, module and allocation
//! still in it) by the release that drops its count to zero. The current context is per thread
//! (a stack, for push/pop), and is checked on every use: a destroyed one is
//! `CUDA_ERROR_CONTEXT_IS_DESTROYED`, none `CUDA_ERROR_INVALID_CONTEXT`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use crate::codes::*;
use crate::state::{self, cu_entry, decode, encode, lock, put, CTX_TAG};
use crate::{memory, module, stream};

pub(crate) struct Ctx {
    pub id: u64,
    pub device: i32,
}

#[derive(Default)]
struct Contexts {
    live: HashMap<u64, Arc<Ctx>>,
    /// device → (primary context id, retain count)
    primary: HashMap<i32, (u64, u32)>,
}

fn contexts() -> MutexGuard<'static, Contexts> {
    static CONTEXTS: LazyLock<Mutex<Contexts>> = LazyLock::new(Default::default);
    lock(&CONTEXTS)
}

thread_local! {
    /// The thread's context stack (ids); the top is current.
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's current context.
pub(crate) fn current() -> Result<Arc<Ctx>, CuResult> {
    let top = STACK
        .with(|s| s.borrow().last().copied())
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    contexts()
        .live
        .get(&top)
        .cloned()
        .ok_or(CUDA_ERROR_CONTEXT_IS_DESTROYED)
}

/// Whether context `id` still exists.
pub(crate) fn alive(id: u64) -> bool {
    contexts().live.contains_key(&id)
}

fn resolve(h: *mut c_void) -> Result<Arc<Ctx>, CuResult> {
    let id = decode(CTX_TAG, h as usize).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    contexts()
        .live
        .get(&id)
        .cloned()
        .ok_or(CUDA_ERROR_CONTEXT_IS_DESTROYED)
}

fn check_device(dev: c_int) -> Result<(), CuResult> {
    if dev < 0 || dev >= state::config().devices {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(())
}

pub(crate) fn live() -> u64 {
    contexts().live.len() as u64
}

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CuResult {
    std::panic::catch_unwind(|| {
        if let Some(code) = state::FAULTS.hit("cuInit") {
            return code as CuResult;
        }
        if flags != 0 || state::config().malformed || state::FAULTS.env_malformed() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        state::set_initialized();
        CUDA_SUCCESS
    })
    .unwrap_or(CUDA_ERROR_UNKNOWN)
}

/// Works before `cuInit`, as in CUDA.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CuResult {
    std::panic::catch_unwind(|| {
        if let Some(code) = state::FAULTS.hit("cuDriverGetVersion") {
            return code as CuResult;
        }
        // SAFETY: API contract.
        state::status(unsafe { put(version, 12080, CUDA_ERROR_INVALID_VALUE) })
    })
    .unwrap_or(CUDA_ERROR_UNKNOWN)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    cu_entry("cuDeviceGetCount", || {
        // SAFETY: API contract.
        unsafe { put(count, state::config().devices, CUDA_ERROR_INVALID_VALUE) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CuResult {
    cu_entry("cuDeviceGet", || {
        check_device(ordinal)?;
        // SAFETY: API contract.
        unsafe { put(device, ordinal, CUDA_ERROR_INVALID_VALUE) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    cu_entry("cuDeviceGetName", || {
        check_device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("hprt CUDA emulator device {dev}");
        let n = text.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes; we write n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            *name.add(n) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CuResult {
    cu_entry("cuDeviceTotalMem_v2", || {
        check_device(dev)?;
        // SAFETY: API contract.
        unsafe {
            put(
                bytes,
                state::config().device_memory as usize,
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

/// The attributes the emulated device answers (an sm_80-like part); others are
/// `CUDA_ERROR_INVALID_VALUE` rather than a made-up number.
pub(crate) const MAX_THREADS_PER_BLOCK: u32 = 1024;
pub(crate) const MAX_BLOCK_DIM: [u32; 3] = [1024, 1024, 64];
pub(crate) const MAX_GRID_DIM: [u32; 3] = [i32::MAX as u32, 65535, 65535];
pub(crate) const MAX_SHARED_PER_BLOCK: u32 = 48 * 1024;
pub(crate) const COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attr: c_int,
    dev: c_int,
) -> CuResult {
    cu_entry("cuDeviceGetAttribute", || {
        check_device(dev)?;
        let v = match attr {
            1 => MAX_THREADS_PER_BLOCK as i32,
            2..=4 => MAX_BLOCK_DIM[(attr - 2) as usize] as i32,
            5..=7 => MAX_GRID_DIM[(attr - 5) as usize] as i32,
            8 => MAX_SHARED_PER_BLOCK as i32,
            10 => 32, // warp size
            16 => 8,  // multiprocessors
            41 => 1,  // unified addressing
            75 => COMPUTE_CAPABILITY.0,
            76 => COMPUTE_CAPABILITY.1,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: API contract.
        unsafe { put(value, v, CUDA_ERROR_INVALID_VALUE) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut *mut c_void, dev: c_int) -> CuResult {
    cu_entry("cuDevicePrimaryCtxRetain", || {
        check_device(dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut c = contexts();
        let id = match c.primary.get_mut(&dev) {
            Some((id, count)) => {
                *count += 1;
                *id
            }
            None => {
                let id = state::next_id();
                c.primary.insert(dev, (id, 1));
                c.live.insert(id, Arc::new(Ctx { id, device: dev }));
                id
            }
        };
        // SAFETY: checked non-null.
        unsafe {
            put(
                pctx,
                encode(CTX_TAG, id) as *mut c_void,
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CuResult {
    cu_entry("cuDevicePrimaryCtxRelease_v2", || {
        check_device(dev)?;
        let destroyed = {
            let mut c = contexts();
            let Some((id, count)) = c.primary.get_mut(&dev) else {
                // Releasing a context that was never retained.
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            };
            *count -= 1;
            if *count > 0 {
                return Ok(());
            }
            let id = *id;
            c.primary.remove(&dev);
            c.live.remove(&id);
            id
        };
        destroy_resources(destroyed);
        Ok(())
    })
}

/// Frees what a destroyed context still held, counting each for the leak statistics.
fn destroy_resources(ctx: u64) {
    let n = stream::destroy_context(ctx)
        + stream::destroy_context_events(ctx)
        + module::destroy_context(ctx)
        + memory::destroy_context(ctx);
    state::RECLAIMED_AT_CONTEXT_DESTROY.fetch_add(n, Ordering::Relaxed);
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut *mut c_void) -> CuResult {
    cu_entry("cuCtxGetCurrent", || {
        // A destroyed context still reads back as current (as in CUDA); none is null.
        let top = STACK.with(|s| s.borrow().last().copied());
        let h = top.map_or(0, |id| encode(CTX_TAG, id));
        // SAFETY: API contract.
        unsafe { put(pctx, h as *mut c_void, CUDA_ERROR_INVALID_VALUE) }
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CuResult {
    cu_entry("cuCtxSetCurrent", || {
        let id = if ctx.is_null() {
            None
        } else {
            Some(resolve(ctx)?.id)
        };
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            s.extend(id);
        });
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: *mut c_void) -> CuResult {
    cu_entry("cuCtxPushCurrent_v2", || {
        let id = resolve(ctx)?.id;
        STACK.with(|s| s.borrow_mut().push(id));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut *mut c_void) -> CuResult {
    cu_entry("cuCtxPopCurrent_v2", || {
        let id = STACK
            .with(|s| s.borrow_mut().pop())
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            // SAFETY: non-null, API contract.
            unsafe { *pctx = encode(CTX_TAG, id) as *mut c_void };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> CuResult {
    cu_entry("cuCtxGetDevice", || {
        let c = current()?;
        // SAFETY: API contract.
        unsafe { put(device, c.device, CUDA_ERROR_INVALID_VALUE) }
    })
}

/// Waits for every stream of the current context; returns the first asynchronous error.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    cu_entry("cuCtxSynchronize", || {
        stream::synchronize_context(current()?.id)
    })
}
