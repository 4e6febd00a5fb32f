//! Device and pinned-host memory on real host allocations, with registries that classify every
//! pointer, so `aclrtMemcpy` kinds, `destMax` and collective buffers can be checked the way the
//! hardware would reject them.
//!
//! Queued work refers to memory by `Range` (allocation identity + offset) and re-checks it when
//! it runs: work whose buffer was freed in the meantime fails with `ACL_ERROR_RT_INTERNAL_ERROR`
//! on its stream instead of touching freed memory.

use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use hprt_emulator_common::block::{containing, Allocations, Block, Span};

use crate::codes::*;
use crate::state::{self, acl_entry, lock, put};
use crate::stream;

pub(crate) struct Alloc {
    id: u64,
    base: usize,
    size: usize,
    device: Option<i32>,
    /// The memory itself, freed when the last holder lets go.
    _mem: Block,
}

impl Span for Alloc {
    fn span(&self) -> (usize, usize) {
        (self.base, self.size)
    }
}

impl Alloc {
    fn new(size: usize, device: Option<i32>) -> Result<Arc<Alloc>, AclError> {
        let mem = Block::new(size).ok_or(ACL_ERROR_RT_MEMORY_ALLOCATION)?;
        Ok(Arc::new(Alloc {
            id: state::next_id(),
            base: mem.base,
            size,
            device,
            _mem: mem,
        }))
    }
}

fn mem() -> MutexGuard<'static, Allocations<Alloc>> {
    static MEM: LazyLock<Mutex<Allocations<Alloc>>> = LazyLock::new(Default::default);
    lock(&MEM)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Space {
    Device,
    Pinned,
}

/// `len` bytes at `ptr`, inside one registered allocation.
#[derive(Clone, Debug)]
pub(crate) struct Range {
    space: Space,
    alloc_id: u64,
    base: usize,
    pub ptr: usize,
    pub len: usize,
}

impl Range {
    /// The allocation, if it is still registered; holding the `Arc` keeps the memory alive while
    /// the bytes are used, even if `aclrtFree` runs concurrently.
    pub(crate) fn pin(&self) -> Result<Arc<Alloc>, AclError> {
        let m = mem();
        let map = match self.space {
            Space::Device => &m.device,
            Space::Pinned => &m.pinned,
        };
        map.get(&self.base)
            .filter(|a| a.id == self.alloc_id)
            .cloned()
            .ok_or(ACL_ERROR_RT_INTERNAL_ERROR)
    }
}

/// Where a pointer argument points.
#[derive(Clone, Debug)]
pub(crate) enum Loc {
    /// Not in any registered allocation: plain host memory, the caller's responsibility.
    Host(usize),
    Reg(Range),
}

impl Loc {
    fn is_device(&self) -> bool {
        matches!(self, Loc::Reg(r) if r.space == Space::Device)
    }
    fn addr(&self) -> usize {
        match self {
            Loc::Host(p) => *p,
            Loc::Reg(r) => r.ptr,
        }
    }
    fn pin(&self) -> Result<Option<Arc<Alloc>>, AclError> {
        match self {
            Loc::Host(_) => Ok(None),
            Loc::Reg(r) => r.pin().map(Some),
        }
    }
}

/// Classifies `[ptr, ptr + len)`; a range that starts inside an allocation and runs past its end
/// is an error whatever the allocation's kind.
pub(crate) fn locate(ptr: usize, len: usize) -> Result<Loc, AclError> {
    let m = mem();
    for (space, map) in [(Space::Device, &m.device), (Space::Pinned, &m.pinned)] {
        if let Some(a) = containing(map, ptr) {
            let end = ptr.checked_add(len).ok_or(ACL_ERROR_INVALID_PARAM)?;
            if end > a.base + a.size {
                return Err(ACL_ERROR_INVALID_PARAM);
            }
            return Ok(Loc::Reg(Range {
                space,
                alloc_id: a.id,
                base: a.base,
                ptr,
                len,
            }));
        }
    }
    Ok(Loc::Host(ptr))
}

/// `[ptr, ptr + len)` when it lies inside one device allocation (`len` > 0).
pub(crate) fn device_range(ptr: usize, len: usize) -> Option<Range> {
    match locate(ptr, len) {
        Ok(Loc::Reg(r)) if r.space == Space::Device => Some(r),
        _ => None,
    }
}

/// Reads `len` bytes from registered memory.
///
/// # Safety
/// `r` was pinned by the caller (the allocation is alive) and lies inside it.
pub(crate) unsafe fn read(r: &Range) -> Vec<u8> {
    let mut v = vec![0u8; r.len];
    // SAFETY: caller's contract; `v` is a fresh buffer, so no overlap.
    unsafe { std::ptr::copy_nonoverlapping(r.ptr as *const u8, v.as_mut_ptr(), r.len) };
    v
}

/// Writes `data` at `ptr`.
///
/// # Safety
/// `[ptr, ptr + data.len())` lies inside a pinned allocation.
pub(crate) unsafe fn write(ptr: usize, data: &[u8]) {
    // SAFETY: caller's contract; `data` is an owned temporary, so no overlap.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
}

// ---- malloc / free ----------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(
    dev_ptr: *mut *mut c_void,
    size: usize,
    policy: u32,
) -> AclError {
    acl_entry("aclrtMalloc", || {
        let dev = state::require_device()?;
        if dev_ptr.is_null() || size == 0 || policy > ACL_MEM_MALLOC_MAX_POLICY {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        let cap = state::config().device_memory;
        let mut m = mem();
        let used = m.used.get(&dev).copied().unwrap_or(0);
        if (size as u64)
            .checked_add(used)
            .is_none_or(|total| total > cap)
        {
            return Err(ACL_ERROR_RT_MEMORY_ALLOCATION);
        }
        let a = Alloc::new(size, Some(dev))?;
        let base = a.base;
        m.device.insert(base, a);
        *m.used.entry(dev).or_insert(0) += size as u64;
        drop(m);
        // SAFETY: header contract; checked non-null above.
        unsafe { put(dev_ptr, base as *mut c_void) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> AclError {
    acl_entry("aclrtFree", || {
        state::require_device()?;
        let mut m = mem();
        let a = m
            .device
            .remove(&(dev_ptr as usize))
            .ok_or(ACL_ERROR_INVALID_PARAM)?;
        if let Some(used) = a.device.and_then(|d| m.used.get_mut(&d)) {
            *used -= a.size as u64;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> AclError {
    acl_entry("aclrtMallocHost", || {
        state::require_device()?;
        if host_ptr.is_null() || size == 0 {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        let a = Alloc::new(size, None)?;
        let base = a.base;
        mem().pinned.insert(base, a);
        // SAFETY: header contract; checked non-null above.
        unsafe { put(host_ptr, base as *mut c_void) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtFreeHost(host_ptr: *mut c_void) -> AclError {
    acl_entry("aclrtFreeHost", || {
        state::require_device()?;
        mem()
            .pinned
            .remove(&(host_ptr as usize))
            .map(drop)
            .ok_or(ACL_ERROR_INVALID_PARAM)
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetMemInfo(
    attr: u32,
    free: *mut usize,
    total: *mut usize,
) -> AclError {
    acl_entry("aclrtGetMemInfo", || {
        let dev = state::require_device()?;
        if free.is_null() || total.is_null() || !matches!(attr, ACL_DDR_MEM | ACL_HBM_MEM) {
            return Err(ACL_ERROR_INVALID_PARAM);
        }
        let cap = state::config().device_memory;
        let used = mem().used.get(&dev).copied().unwrap_or(0);
        // SAFETY: header contract; both checked non-null above.
        unsafe {
            put(free, cap.saturating_sub(used) as usize)?;
            put(total, cap as usize)
        }
    })
}

// ---- memcpy / memset --------------------------------------------------------------------------

/// A validated copy; `None` from [`check_copy`] means there is nothing to move (`count` = 0).
struct CopyJob {
    dst: Loc,
    src: Loc,
    count: usize,
}

impl CopyJob {
    fn run(&self) -> Result<(), AclError> {
        let _dst = self.dst.pin()?;
        let _src = self.src.pin()?;
        // SAFETY: registered ranges are pinned and in bounds; host ranges are the caller's
        // contract. `copy` (memmove) because a same-buffer copy may overlap.
        unsafe {
            std::ptr::copy(
                self.src.addr() as *const u8,
                self.dst.addr() as *mut u8,
                self.count,
            )
        };
        Ok(())
    }
}

fn check_copy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: u32,
) -> Result<Option<CopyJob>, AclError> {
    if kind > ACL_MEMCPY_DEFAULT || count > dest_max {
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    if count == 0 {
        return Ok(None);
    }
    if dst.is_null() || src.is_null() {
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    let dst = locate(dst as usize, count)?;
    let src = locate(src as usize, count)?;
    let ok = match kind {
        ACL_MEMCPY_HOST_TO_HOST => !src.is_device() && !dst.is_device(),
        ACL_MEMCPY_HOST_TO_DEVICE => !src.is_device() && dst.is_device(),
        ACL_MEMCPY_DEVICE_TO_HOST => src.is_device() && !dst.is_device(),
        ACL_MEMCPY_DEVICE_TO_DEVICE => src.is_device() && dst.is_device(),
        _ => true,
    };
    if !ok {
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    Ok(Some(CopyJob { dst, src, count }))
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: u32,
) -> AclError {
    acl_entry("aclrtMemcpy", || {
        state::require_device()?;
        match check_copy(dst, dest_max, src, count, kind)? {
            Some(c) => c.run(),
            None => Ok(()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: u32,
    stream: *mut c_void,
) -> AclError {
    acl_entry("aclrtMemcpyAsync", || {
        state::require_device()?;
        let s = stream::resolve(stream)?;
        if let Some(c) = check_copy(dst, dest_max, src, count, kind)? {
            s.enqueue(Box::new(move || c.run()));
        }
        Ok(())
    })
}

fn check_set(ptr: *mut c_void, max: usize, count: usize) -> Result<Option<Range>, AclError> {
    if ptr.is_null() || count > max {
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    if count == 0 {
        return Ok(None);
    }
    match locate(ptr as usize, count)? {
        Loc::Reg(r) if r.space == Space::Device => Ok(Some(r)),
        _ => Err(ACL_ERROR_INVALID_PARAM),
    }
}

fn run_set(r: &Range, value: i32) -> Result<(), AclError> {
    let _keep = r.pin()?;
    // SAFETY: pinned and in bounds.
    unsafe { std::ptr::write_bytes(r.ptr as *mut u8, value as u8, r.len) };
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemset(
    dev_ptr: *mut c_void,
    max_count: usize,
    value: i32,
    count: usize,
) -> AclError {
    acl_entry("aclrtMemset", || {
        state::require_device()?;
        match check_set(dev_ptr, max_count, count)? {
            Some(r) => run_set(&r, value),
            None => Ok(()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemsetAsync(
    dev_ptr: *mut c_void,
    max_count: usize,
    value: i32,
    count: usize,
    stream: *mut c_void,
) -> AclError {
    acl_entry("aclrtMemsetAsync", || {
        state::require_device()?;
        let s = stream::resolve(stream)?;
        if let Some(r) = check_set(dev_ptr, max_count, count)? {
            s.enqueue(Box::new(move || run_set(&r, value)));
        }
        Ok(())
    })
}

/// (live device allocations, live device bytes, live pinned host allocations)
pub(crate) fn stats() -> (u64, u64, u64) {
    let m = mem();
    let bytes = m.device.values().map(|a| a.size as u64).sum();
    (m.device.len() as u64, bytes, m.pinned.len() as u64)
}
