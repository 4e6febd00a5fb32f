//! Device and pinned memory on host allocations, in registries that classify every pointer, so
//! out-of-bounds copies, frees of unknown pointers and pointers of another context are refused
//! the way the driver refuses them. Device memory is counted against the device's capacity
//! (`HP_EMU_DEVICE_MEMORY`); pinned memory is separate from it.
//!
//! Queued work holds its allocations (`Held`): the memory outlives the work, and `cuMemFree`
//! of an allocation that queued work still uses is counted and reported (stderr,
//! `hprtEmuGetStats`) before it waits for that work, as `cuMemFree`'s implicit synchronisation
//! would. Pointers that are in no allocation are pageable host memory, which copies accept.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};

use hprt_emulator_common::block::{containing, Allocations, Block, Span};

use crate::codes::*;
use crate::context;
use crate::state::{self, cu_entry, lock, put};
use crate::stream;

pub(crate) struct Alloc {
    pub base: usize,
    pub size: usize,
    pub ctx: u64,
    /// `None` for pinned host memory.
    pub device: Option<i32>,
    inflight: Mutex<u64>,
    idle: Condvar,
    /// The memory itself, freed when the last holder lets go.
    _mem: Block,
}

impl Span for Alloc {
    fn span(&self) -> (usize, usize) {
        (self.base, self.size)
    }
}

impl Alloc {
    fn new(size: usize, ctx: u64, device: Option<i32>) -> Result<Arc<Alloc>, CuResult> {
        let mem = Block::new(size).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        Ok(Arc::new(Alloc {
            base: mem.base,
            size,
            ctx,
            device,
            inflight: Mutex::new(0),
            idle: Condvar::new(),
            _mem: mem,
        }))
    }

    /// Waits until no queued work holds this allocation; `true` when some did.
    fn wait_idle(&self) -> bool {
        let mut n = lock(&self.inflight);
        let busy = *n > 0;
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        busy
    }
}

/// An allocation that queued work uses: counted from enqueue until the work is done.
pub(crate) struct Held(pub Arc<Alloc>);

impl Held {
    pub(crate) fn new(a: Arc<Alloc>) -> Held {
        *lock(&a.inflight) += 1;
        Held(a)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut n = lock(&self.0.inflight);
        *n -= 1;
        if *n == 0 {
            self.0.idle.notify_all();
        }
    }
}

fn mem() -> MutexGuard<'static, Allocations<Alloc>> {
    static MEM: LazyLock<Mutex<Allocations<Alloc>>> = LazyLock::new(Default::default);
    lock(&MEM)
}

/// The allocation `[ptr, ptr + len)` lies in, `None` for pageable host memory; a range that
/// starts in an allocation and runs past its end is `CUDA_ERROR_INVALID_VALUE`.
pub(crate) fn locate(ptr: usize, len: usize) -> Result<Option<Arc<Alloc>>, CuResult> {
    let m = mem();
    for map in [&m.device, &m.pinned] {
        if let Some(a) = containing(map, ptr) {
            let end = ptr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if end > a.base + a.size {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            return Ok(Some(a.clone()));
        }
    }
    Ok(None)
}

/// The allocation holding the 8-byte value `v`, if it is a device or pinned pointer (for kernel
/// arguments, whose types the driver does not know).
pub(crate) fn pointee(v: u64) -> Option<Arc<Alloc>> {
    let m = mem();
    let p = v as usize;
    containing(&m.device, p)
        .or_else(|| containing(&m.pinned, p))
        .cloned()
}

/// Successful `cuMemAlloc_v2` / `cuMemFree_v2` calls since the process started, for tests of how
/// often a caching allocator goes to the driver (`hprtEmuGetDeviceMemoryCalls`).
static DEVICE_ALLOC_CALLS: AtomicU64 = AtomicU64::new(0);
static DEVICE_FREE_CALLS: AtomicU64 = AtomicU64::new(0);

/// Emulator-only: how many `cuMemAlloc_v2` and `cuMemFree_v2` calls succeeded in this process
/// (never reset: callers compare two readings). Returns 0, or 1 for a null pointer.
#[no_mangle]
pub unsafe extern "C" fn hprtEmuGetDeviceMemoryCalls(allocs: *mut u64, frees: *mut u64) -> i32 {
    // SAFETY: the caller's out-pointers, checked for null.
    let r = unsafe {
        put(allocs, DEVICE_ALLOC_CALLS.load(Ordering::Relaxed), ())
            .and_then(|()| put(frees, DEVICE_FREE_CALLS.load(Ordering::Relaxed), ()))
    };
    i32::from(r.is_err())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CuResult {
    cu_entry("cuMemAlloc_v2", || {
        let ctx = context::current()?;
        if dptr.is_null() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let cap = state::config().device_memory;
        let mut m = mem();
        let used = m.used.get(&ctx.device).copied().unwrap_or(0);
        if (size as u64).checked_add(used).is_none_or(|t| t > cap) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let a = Alloc::new(size, ctx.id, Some(ctx.device))?;
        let base = a.base;
        m.device.insert(base, a);
        *m.used.entry(ctx.device).or_insert(0) += size as u64;
        drop(m);
        DEVICE_ALLOC_CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: checked non-null.
        unsafe { put(dptr, base as u64, CUDA_ERROR_INVALID_VALUE) }
    })
}

/// Reports a free that queued work still uses, then waits for that work.
fn retire(a: &Alloc, what: &str) {
    if *lock(&a.inflight) > 0 {
        state::FREES_UNDER_QUEUED_WORK.fetch_add(1, Ordering::Relaxed);
        eprintln!(
            "hprt CUDA emulator: {what}(0x{:x}) while queued work still uses it; waiting for that work",
            a.base
        );
    }
    a.wait_idle();
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CuResult {
    cu_entry("cuMemFree_v2", || {
        let ctx = context::current()?;
        let a = {
            let mut m = mem();
            let a = m
                .device
                .get(&(dptr as usize))
                .cloned()
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if a.ctx != ctx.id {
                // Not from the current context.
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            m.device.remove(&a.base);
            if let Some(u) = a.device.and_then(|d| m.used.get_mut(&d)) {
                *u -= a.size as u64;
            }
            a
        };
        DEVICE_FREE_CALLS.fetch_add(1, Ordering::Relaxed);
        retire(&a, "cuMemFree_v2");
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: u32) -> CuResult {
    cu_entry("cuMemHostAlloc", || {
        let ctx = context::current()?;
        let known =
            CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
        if pp.is_null() || size == 0 || flags & !known != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let a = Alloc::new(size, ctx.id, None)?;
        let base = a.base;
        mem().pinned.insert(base, a);
        // SAFETY: checked non-null.
        unsafe { put(pp, base as *mut c_void, CUDA_ERROR_INVALID_VALUE) }
    })
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CuResult {
    cu_entry("cuMemFreeHost", || {
        context::current()?;
        let a = mem()
            .pinned
            .remove(&(p as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        retire(&a, "cuMemFreeHost");
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    cu_entry("cuMemGetInfo_v2", || {
        let ctx = context::current()?;
        let cap = state::config().device_memory;
        let used = mem().used.get(&ctx.device).copied().unwrap_or(0);
        // SAFETY: API contract.
        unsafe {
            put(
                free,
                cap.saturating_sub(used) as usize,
                CUDA_ERROR_INVALID_VALUE,
            )?;
            put(total, cap as usize, CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyAsync(
    dst: u64,
    src: u64,
    bytes: usize,
    hstream: *mut c_void,
) -> CuResult {
    cu_entry("cuMemcpyAsync", || {
        let s = stream::resolve_current(hstream)?;
        if bytes == 0 {
            return Ok(());
        }
        if dst == 0 || src == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (d, sa) = (locate(dst as usize, bytes)?, locate(src as usize, bytes)?);
        let (dst, src) = (dst as usize, src as usize);
        match (d, sa) {
            (Some(d), Some(sa)) => {
                let keep = (Held::new(d), Held::new(sa));
                s.enqueue(Box::new(move || {
                    let _keep = keep;
                    // SAFETY: both ranges lie in held allocations; memmove, as a copy within
                    // one buffer may overlap.
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                    Ok(())
                }));
            }
            (Some(d), None) => {
                // From pageable memory: staged at the call, as the driver does, so the caller
                // may reuse its buffer once the call returns.
                // SAFETY: the caller's pageable range, by the API's contract.
                let staged =
                    unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec();
                let keep = Held::new(d);
                s.enqueue(Box::new(move || {
                    let _keep = keep;
                    // SAFETY: the destination lies in a held allocation.
                    unsafe {
                        std::ptr::copy_nonoverlapping(staged.as_ptr(), dst as *mut u8, bytes)
                    };
                    Ok(())
                }));
            }
            (None, sa) => {
                // To pageable memory (or pageable to pageable): synchronous with the host.
                let keep = sa.map(Held::new);
                let (tx, rx) = std::sync::mpsc::channel();
                s.enqueue(Box::new(move || {
                    let _keep = keep;
                    // SAFETY: the source is held or the caller's; the caller is blocked below
                    // until this ran, so its destination is alive.
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                    let _ = tx.send(());
                    Ok(())
                }));
                rx.recv().map_err(|_| CUDA_ERROR_UNKNOWN)?;
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(
    dst: u64,
    value: u8,
    bytes: usize,
    hstream: *mut c_void,
) -> CuResult {
    cu_entry("cuMemsetD8Async", || {
        let s = stream::resolve_current(hstream)?;
        if bytes == 0 {
            return Ok(());
        }
        let a = locate(dst as usize, bytes)?.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if a.device.is_none() || a.ctx != s.ctx {
            // Host memory, or device memory of another context.
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let keep = Held::new(a);
        s.enqueue(Box::new(move || {
            let _keep = keep;
            // SAFETY: in a held device allocation.
            unsafe { std::ptr::write_bytes(dst as *mut u8, value, bytes) };
            Ok(())
        }));
        Ok(())
    })
}

/// Frees what context `ctx` still holds; returns how many allocations that was.
pub(crate) fn destroy_context(ctx: u64) -> u64 {
    let mut guard = mem();
    let m = &mut *guard;
    let mut n = 0;
    for map in [&mut m.device, &mut m.pinned] {
        let before = map.len();
        map.retain(|_, a| a.ctx != ctx);
        n += (before - map.len()) as u64;
    }
    let sizes: Vec<(i32, u64)> = m
        .device
        .values()
        .filter_map(|a| a.device.map(|d| (d, a.size as u64)))
        .collect();
    m.used.clear();
    for (d, size) in sizes {
        *m.used.entry(d).or_default() += size;
    }
    n
}

/// (live device allocations, live device bytes, live pinned allocations)
pub(crate) fn stats() -> (u64, u64, u64) {
    let m = mem();
    let bytes = m.device.values().map(|a| a.size as u64).sum();
    (m.device.len() as u64, bytes, m.pinned.len() as u64)
}
