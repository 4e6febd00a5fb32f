//! Modules and kernel launches. `cuModuleLoadData` takes an image from the emulator's NVRTC (the
//! shared object as a "cubin", or its hex "PTX" text) and loads it; `cuLaunchKernel` checks the
//! launch against the device's limits, copies the parameters (sizes from the module's launcher
//! table, as the driver takes them from the cubin) and queues the grid on the stream. A grid
//! whose threads cannot all reach a barrier fails with `CUDA_ERROR_LAUNCH_FAILED` at the next
//! synchronisation.

use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void, CStr};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use libloading::Library;

use crate::codes::*;
use crate::context::{
    self, MAX_BLOCK_DIM, MAX_GRID_DIM, MAX_SHARED_PER_BLOCK, MAX_THREADS_PER_BLOCK,
};
use crate::memory::{self, Held};
use crate::nvrtc::{MODULE_MARKER, PTX_HEADER};
use crate::state::{self, cu_entry, decode, encode, lock, put, FUNCTION_TAG, MODULE_TAG};
use crate::stream;

type Launch = unsafe extern "C" fn(*mut *mut c_void, *const c_uint, c_uint) -> i32;
type Params = unsafe extern "C" fn() -> *const u64;

struct Module {
    ctx: u64,
    lib: Library,
}

struct Function {
    module: u64,
    ctx: u64,
    launch: Launch,
    sizes: Vec<usize>,
    /// Keeps the library mapped while queued launches use `launch`.
    owner: Arc<Module>,
}

#[derive(Default)]
struct Registry {
    modules: HashMap<u64, Arc<Module>>,
    functions: HashMap<u64, Arc<Function>>,
    /// (module, name) → function id, so a name looked up twice is the same handle.
    names: HashMap<(u64, String), u64>,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Default::default);
    lock(&REGISTRY)
}

pub(crate) fn live() -> u64 {
    registry().modules.len() as u64
}

pub(crate) fn destroy_context(ctx: u64) -> u64 {
    let mut r = registry();
    let before = r.modules.len();
    r.modules.retain(|_, m| m.ctx != ctx);
    r.functions.retain(|_, f| f.ctx != ctx);
    let live: Vec<u64> = r.modules.keys().copied().collect();
    r.names.retain(|(m, _), _| live.contains(m));
    (before - r.modules.len()) as u64
}

/// The shared object an image holds: an ELF file (its length from the section header table,
/// which the linker puts last) or the hex "PTX" text; anything else is not an image.
///
/// # Safety
/// `image` points at a complete image (cuModuleLoadData's contract).
unsafe fn image_bytes(image: *const u8) -> Result<Vec<u8>, CuResult> {
    // SAFETY: every image starts with at least a 64-byte ELF header or the PTX header.
    let head = unsafe { std::slice::from_raw_parts(image, 4) };
    if head == b"\x7fELF" {
        // SAFETY: a 64-bit ELF header is 64 bytes.
        let h = unsafe { std::slice::from_raw_parts(image, 64) };
        if h[4] != 2 {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        let shoff = u64::from_le_bytes(h[0x28..0x30].try_into().expect("8 bytes")) as usize;
        let shentsize = u16::from_le_bytes([h[0x3a], h[0x3b]]) as usize;
        let shnum = u16::from_le_bytes([h[0x3c], h[0x3d]]) as usize;
        let len = shoff + shentsize * shnum;
        // SAFETY: the image extends to the end of its section header table.
        return Ok(unsafe { std::slice::from_raw_parts(image, len) }.to_vec());
    }
    // SAFETY: otherwise it must be NUL-terminated text.
    let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_bytes();
    let hex = text
        .strip_prefix(PTX_HEADER.as_bytes())
        .ok_or(CUDA_ERROR_INVALID_IMAGE)?;
    if hex.len() % 2 != 0 {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    hex.chunks(2)
        .map(|p| {
            std::str::from_utf8(p)
                .ok()
                .and_then(|s| u8::from_str_radix(s, 16).ok())
                .ok_or(CUDA_ERROR_INVALID_IMAGE)
        })
        .collect()
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(out: *mut *mut c_void, image: *const c_void) -> CuResult {
    cu_entry("cuModuleLoadData", || {
        let ctx = context::current()?;
        if out.is_null() || image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: API contract.
        let bytes = unsafe { image_bytes(image.cast()) }?;
        let id = state::next_id();
        let dir = std::env::temp_dir().join(format!("hprt-cuda-emu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|_| CUDA_ERROR_UNKNOWN)?;
        let path = dir.join(format!("module-{id}.so"));
        std::fs::write(&path, &bytes).map_err(|_| CUDA_ERROR_UNKNOWN)?;
        // SAFETY: a shared object from this emulator's NVRTC (checked by its marker below);
        // its initialisers are the C++ runtime's.
        let lib = unsafe { Library::new(&path) };
        let _ = std::fs::remove_file(&path);
        let lib = lib.map_err(|_| CUDA_ERROR_INVALID_IMAGE)?;
        // SAFETY: looked up by name only.
        if unsafe {
            lib.get::<unsafe extern "C" fn() -> i32>(format!("{MODULE_MARKER}\0").as_bytes())
        }
        .is_err()
        {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        registry()
            .modules
            .insert(id, Arc::new(Module { ctx: ctx.id, lib }));
        // SAFETY: checked non-null.
        unsafe {
            put(
                out,
                encode(MODULE_TAG, id) as *mut c_void,
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(h: *mut c_void) -> CuResult {
    cu_entry("cuModuleUnload", || {
        let id = decode(MODULE_TAG, h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut r = registry();
        r.modules.remove(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        r.functions.retain(|_, f| f.module != id);
        r.names.retain(|(m, _), _| *m != id);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    out: *mut *mut c_void,
    h: *mut c_void,
    name: *const c_char,
) -> CuResult {
    cu_entry("cuModuleGetFunction", || {
        let ctx = context::current()?;
        if out.is_null() || name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: NUL-terminated by contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let mid = decode(MODULE_TAG, h as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut r = registry();
        let m = r
            .modules
            .get(&mid)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if m.ctx != ctx.id {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        let id = match r.names.get(&(mid, name.clone())) {
            Some(&id) => id,
            None => {
                // SAFETY: the launcher and parameter table the emulator's NVRTC generated,
                // with the signatures it gives them.
                let (launch, params) = unsafe {
                    let launch = m
                        .lib
                        .get::<Launch>(format!("hprt_emu_launch_{name}\0").as_bytes())
                        .map_err(|_| CUDA_ERROR_NOT_FOUND)?;
                    let params = m
                        .lib
                        .get::<Params>(format!("hprt_emu_params_{name}\0").as_bytes())
                        .map_err(|_| CUDA_ERROR_NOT_FOUND)?;
                    (*launch, *params)
                };
                // SAFETY: the table is [count, size...] with `count` sizes.
                let sizes = unsafe {
                    let t = params();
                    std::slice::from_raw_parts(t.add(1), *t as usize)
                        .iter()
                        .map(|&s| s as usize)
                        .collect()
                };
                let id = state::next_id();
                r.functions.insert(
                    id,
                    Arc::new(Function {
                        module: mid,
                        ctx: m.ctx,
                        launch,
                        sizes,
                        owner: m,
                    }),
                );
                r.names.insert((mid, name), id);
                id
            }
        };
        // SAFETY: checked non-null.
        unsafe {
            put(
                out,
                encode(FUNCTION_TAG, id) as *mut c_void,
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

/// Checks a launch's dimensions against the device's limits (`CUDA_ERROR_INVALID_VALUE`).
fn check_dims(grid: [c_uint; 3], block: [c_uint; 3], shared: c_uint) -> Result<(), CuResult> {
    let threads = block.iter().map(|&b| b as u64).product::<u64>();
    let ok = grid
        .iter()
        .zip(MAX_GRID_DIM)
        .all(|(&g, m)| g >= 1 && g <= m)
        && block
            .iter()
            .zip(MAX_BLOCK_DIM)
            .all(|(&b, m)| b >= 1 && b <= m)
        && threads <= MAX_THREADS_PER_BLOCK as u64
        && shared <= MAX_SHARED_PER_BLOCK;
    if ok {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

/// `extra` (the packed-buffer way of passing parameters) is not supported:
/// `CUDA_ERROR_NOT_SUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    hstream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    cu_entry("cuLaunchKernel", || {
        let id = decode(FUNCTION_TAG, f as usize).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let func = registry()
            .functions
            .get(&id)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let s = stream::resolve_current(hstream)?;
        if func.ctx != s.ctx {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        check_dims([gx, gy, gz], [bx, by, bz], shared)?;
        if !extra.is_null() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if params.is_null() && !func.sizes.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // The driver copies the parameters at the call; 8-byte words keep them aligned.
        let mut copies: Vec<Vec<u64>> = Vec::with_capacity(func.sizes.len());
        let mut held = Vec::new();
        for (i, &size) in func.sizes.iter().enumerate() {
            let mut word = vec![0u64; size.div_ceil(8).max(1)];
            // SAFETY: params[i] points at the i-th argument, `size` bytes (API contract).
            unsafe {
                let p = *params.add(i);
                if p.is_null() {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                std::ptr::copy_nonoverlapping(p.cast::<u8>(), word.as_mut_ptr().cast::<u8>(), size);
            }
            if size == 8 {
                // A pointer into device or pinned memory: the kernel uses that allocation.
                held.extend(memory::pointee(word[0]).map(Held::new));
            }
            copies.push(word);
        }
        let dims = [gx, gy, gz, bx, by, bz];
        s.enqueue(Box::new(move || {
            let _keep = held;
            let mut copies = copies;
            let mut args: Vec<*mut c_void> =
                copies.iter_mut().map(|w| w.as_mut_ptr().cast()).collect();
            // SAFETY: the launcher generated for this kernel, with one pointer per parameter.
            let failed = unsafe { (func.launch)(args.as_mut_ptr(), dims.as_ptr(), shared) };
            let _owner = &func.owner;
            if failed != 0 {
                return Err(CUDA_ERROR_LAUNCH_FAILED);
            }
            Ok(())
        }));
        Ok(())
    })
}
