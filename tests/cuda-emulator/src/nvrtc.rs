//! NVRTC: "compiles" CUDA C with the host C++ compiler (`$CXX`, default `c++`) against
//! `platform/src/cuda/host_shim.h` (CUDA's device names as host C++, shared with the cuda
//! backend's own host-compiled check) into a shared object, and appends one launcher per
//! `extern "C" __global__` kernel, which `cuLaunchKernel` calls with the grid's dimensions.
//!
//! The image handed out is the shared object itself (as a "cubin", for an `sm_XX` target) or a
//! NUL-terminated text wrapping it in hex (as "PTX", for any target); `cuModuleLoadData` accepts
//! both. Options are honoured or refused: `--fmad=false` is `-ffp-contract=off` (`true`:
//! `fast`); `--ftz=true`, `--prec-div=false`, `--prec-sqrt=false` and `--use_fast_math` change
//! numerics the host cannot reproduce and fail with `NVRTC_ERROR_INVALID_OPTION`, as does any
//! option the emulator does not know. Only `extern "C"` kernels get launchers (a mangled name
//! could not be looked up by `cuModuleGetFunction` here anyway).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{LazyLock, Mutex, MutexGuard};

use crate::codes::*;
use crate::state::{self, decode, encode, lock, nvrtc_entry, PROGRAM_TAG};

pub(crate) const SHIM: &str = include_str!("../../../platform/src/cuda/host_shim.h");

/// Marks a shared object as a module of this emulator (checked by `cuModuleLoadData`).
pub(crate) const MODULE_MARKER: &str = "hprt_emu_module";
/// The prefix of the "PTX" text form of an image.
pub(crate) const PTX_HEADER: &str = "//hprt-emu-ptx\n";

/// The architectures the emulator's NVRTC can target (its device is `sm_80`).
const ARCHS: [c_int; 10] = [50, 60, 61, 70, 75, 80, 86, 87, 89, 90];

struct Program {
    source: String,
    name: String,
    headers: Vec<(String, String)>,
    log: String,
    /// The shared object, and whether it was compiled for a real (`sm_`) architecture.
    image: Option<(Vec<u8>, bool)>,
}

fn programs() -> MutexGuard<'static, HashMap<u64, Program>> {
    static PROGRAMS: LazyLock<Mutex<HashMap<u64, Program>>> = LazyLock::new(Default::default);
    lock(&PROGRAMS)
}

fn with_program<T>(
    prog: *mut std::ffi::c_void,
    f: impl FnOnce(&mut Program) -> Result<T, NvrtcResult>,
) -> Result<T, NvrtcResult> {
    let id = decode(PROGRAM_TAG, prog as usize).ok_or(NVRTC_ERROR_INVALID_PROGRAM)?;
    let mut p = programs();
    f(p.get_mut(&id).ok_or(NVRTC_ERROR_INVALID_PROGRAM)?)
}

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn text(p: *const c_char) -> Option<String> {
    // SAFETY: caller's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// # Safety
/// `out` is null or valid for a write.
unsafe fn out<T>(out: *mut T, v: T) -> Result<(), NvrtcResult> {
    // SAFETY: caller's contract.
    unsafe { state::put(out, v, NVRTC_ERROR_INVALID_INPUT) }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> NvrtcResult {
    nvrtc_entry(None, || {
        // SAFETY: API contract.
        unsafe {
            out(major, 12)?;
            out(minor, 8)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetNumSupportedArchs(n: *mut c_int) -> NvrtcResult {
    // SAFETY: API contract.
    nvrtc_entry(None, || unsafe { out(n, ARCHS.len() as c_int) })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetSupportedArchs(archs: *mut c_int) -> NvrtcResult {
    nvrtc_entry(None, || {
        if archs.is_null() {
            return Err(NVRTC_ERROR_INVALID_INPUT);
        }
        // SAFETY: the caller sized the buffer with nvrtcGetNumSupportedArchs.
        unsafe { std::ptr::copy_nonoverlapping(ARCHS.as_ptr(), archs, ARCHS.len()) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut *mut std::ffi::c_void,
    src: *const c_char,
    name: *const c_char,
    num_headers: c_int,
    headers: *const *const c_char,
    include_names: *const *const c_char,
) -> NvrtcResult {
    nvrtc_entry(Some("nvrtcCreateProgram"), || {
        if prog.is_null() {
            return Err(NVRTC_ERROR_INVALID_PROGRAM);
        }
        // SAFETY: API contract: NUL-terminated strings, `num_headers` entries in each array.
        let source = unsafe { text(src) }.ok_or(NVRTC_ERROR_INVALID_INPUT)?;
        // SAFETY: API contract: `name` is null (`text` gives `None`: the default name) or
        // NUL-terminated.
        let name = unsafe { text(name) }.unwrap_or_else(|| "default_program".into());
        if num_headers < 0 || (num_headers > 0 && (headers.is_null() || include_names.is_null())) {
            return Err(NVRTC_ERROR_INVALID_INPUT);
        }
        let mut hs = Vec::new();
        for i in 0..num_headers as usize {
            // SAFETY: as above.
            let (h, n) = unsafe { (text(*headers.add(i)), text(*include_names.add(i))) };
            hs.push((
                n.ok_or(NVRTC_ERROR_INVALID_INPUT)?,
                h.ok_or(NVRTC_ERROR_INVALID_INPUT)?,
            ));
        }
        let id = state::next_id();
        programs().insert(
            id,
            Program {
                source,
                name,
                headers: hs,
                log: String::new(),
                image: None,
            },
        );
        // SAFETY: checked non-null.
        unsafe { *prog = encode(PROGRAM_TAG, id) as *mut std::ffi::c_void };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut *mut std::ffi::c_void) -> NvrtcResult {
    nvrtc_entry(None, || {
        if prog.is_null() {
            return Err(NVRTC_ERROR_INVALID_PROGRAM);
        }
        // SAFETY: checked non-null.
        let h = unsafe { *prog };
        let id = decode(PROGRAM_TAG, h as usize).ok_or(NVRTC_ERROR_INVALID_PROGRAM)?;
        programs().remove(&id).ok_or(NVRTC_ERROR_INVALID_PROGRAM)?;
        // SAFETY: checked non-null.
        unsafe { *prog = std::ptr::null_mut() };
        Ok(())
    })
}

/// What the options ask of the host compiler.
struct Options {
    contract: &'static str,
    cubin: bool,
    std: String,
    extra: Vec<String>,
}

fn parse_options(opts: &[String]) -> Result<Options, String> {
    let mut o = Options {
        contract: "-ffp-contract=fast",
        cubin: false,
        std: "c++17".into(),
        extra: Vec::new(),
    };
    let mut arch = None;
    let mut it = opts.iter();
    while let Some(opt) = it.next() {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (opt.as_str(), None),
        };
        match (key, value.as_deref()) {
            ("--gpu-architecture" | "-arch", Some(v)) => arch = Some(v.to_string()),
            ("--gpu-architecture" | "-arch", None) => arch = it.next().cloned(),
            ("--fmad" | "-fmad", Some("false")) => o.contract = "-ffp-contract=off",
            ("--fmad" | "-fmad", Some("true")) => o.contract = "-ffp-contract=fast",
            ("--ftz" | "-ftz", Some("false"))
            | ("--prec-div" | "-prec-div", Some("true"))
            | ("--prec-sqrt" | "-prec-sqrt", Some("true")) => {}
            ("--std" | "-std", Some(v)) => o.std = v.to_string(),
            ("-lineinfo" | "--generate-line-info" | "-default-device" | "--device-as-default-execution-space", None) => {}
            _ if opt.starts_with("-D") || opt.starts_with("-I") => o.extra.push(opt.clone()),
            _ => {
                return Err(format!(
                    "hprt CUDA emulator: option {opt:?} is not supported (the host compiler cannot honour it)"
                ))
            }
        }
    }
    if let Some(a) = arch {
        let (real, num) = if let Some(n) = a.strip_prefix("sm_") {
            (true, n)
        } else if let Some(n) = a.strip_prefix("compute_") {
            (false, n)
        } else {
            return Err(format!("invalid architecture {a:?}"));
        };
        match num.parse::<c_int>() {
            Ok(n) if ARCHS.contains(&n) => o.cubin = real,
            _ => return Err(format!("architecture {a:?} is not supported")),
        }
    }
    Ok(o)
}

/// One `extern "C" __global__` kernel: its name and parameter types.
#[derive(Debug, PartialEq)]
pub(crate) struct KernelDecl {
    pub name: String,
    pub params: Vec<String>,
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

fn ident(s: &[u8], i: usize) -> (usize, &str) {
    let mut j = i;
    while j < s.len() && (s[j].is_ascii_alphanumeric() || s[j] == b'_') {
        j += 1;
    }
    (j, std::str::from_utf8(&s[i..j]).unwrap_or(""))
}

/// The index just past the parenthesis matching the one at `i`.
fn balanced(s: &[u8], i: usize) -> Option<usize> {
    let mut depth = 0;
    for (k, &c) in s.iter().enumerate().skip(i) {
        match c {
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The type of a parameter declaration (everything but its trailing name).
fn param_type(p: &str) -> String {
    let p = p.trim();
    let cut = p
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    p[..cut].trim().to_string()
}

/// The `extern "C" __global__` kernels of `source`.
pub(crate) fn kernels(source: &str) -> Vec<KernelDecl> {
    let s = source.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = source[from..].find("__global__").map(|k| k + from) {
        from = at + "__global__".len();
        let decl_start = source[..at].rfind([';', '}', '{']).map_or(0, |k| k + 1);
        if !source[decl_start..at].contains("extern \"C\"") {
            continue;
        }
        let mut i = skip_ws(s, from);
        let (j, word) = ident(s, i);
        if word != "void" {
            continue;
        }
        i = skip_ws(s, j);
        let (mut j, mut name) = ident(s, i);
        if name == "__launch_bounds__" {
            let Some(k) = balanced(s, skip_ws(s, j)) else {
                continue;
            };
            i = skip_ws(s, k);
            (j, name) = ident(s, i);
        }
        let open = skip_ws(s, j);
        if name.is_empty() || s.get(open) != Some(&b'(') {
            continue;
        }
        let Some(close) = balanced(s, open) else {
            continue;
        };
        let inner = &source[open + 1..close - 1];
        let params = if inner.trim().is_empty() || inner.trim() == "void" {
            Vec::new()
        } else {
            inner.split(',').map(param_type).collect()
        };
        out.push(KernelDecl {
            name: name.to_string(),
            params,
        });
    }
    out
}

/// Whether the module needs its blocks' threads to meet (fibers) rather than run as a loop.
fn cooperative(source: &str) -> bool {
    [
        "__syncthreads",
        "__syncwarp",
        "__shfl",
        "__ballot",
        "__any_sync",
        "__all_sync",
        "__shared__",
    ]
    .iter()
    .any(|w| source.contains(w))
}

/// `extern __shared__ T name[];` (the launch's dynamic shared memory) as a macro over the
/// launch's buffer, which works at file and at function scope.
fn dynamic_shared(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("extern __shared__") {
        out += &rest[..at];
        let tail = &rest[at + "extern __shared__".len()..];
        let Some(end) = tail.find(';') else {
            out += &rest[at..];
            return out;
        };
        let decl = tail[..end]
            .trim()
            .trim_end_matches(']')
            .trim_end()
            .trim_end_matches('[');
        let name_at = decl
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let (ty, name) = (decl[..name_at].trim(), &decl[name_at..]);
        let ty = ty.trim_start_matches("__align__").trim_start();
        let ty = if ty.starts_with('(') {
            ty.split_once(')').map_or(ty, |(_, t)| t.trim())
        } else {
            ty
        };
        let _ = write!(
            out,
            "\n#define {name} (reinterpret_cast<{ty}*>(::hprt_emu::g.dyn_smem))\n"
        );
        rest = &tail[end + 1..];
    }
    out += rest;
    out
}

/// The C++ translation unit for `source`: shim, source, one launcher per kernel.
pub(crate) fn translation_unit(source: &str, name: &str) -> String {
    let coop = cooperative(source);
    let mut tu = format!(
        "{SHIM}\nextern \"C\" int {MODULE_MARKER}() {{ return 1; }}\n#line 1 \"{name}\"\n{}\n",
        dynamic_shared(source)
    );
    for k in kernels(source) {
        let n = &k.name;
        let sizes: Vec<String> = k.params.iter().map(|t| format!("sizeof({t})")).collect();
        let args: Vec<String> = k
            .params
            .iter()
            .enumerate()
            .map(|(i, t)| format!("*reinterpret_cast<{t}*>(a[{i}])"))
            .collect();
        let _ = write!(
            tu,
            "extern \"C\" const unsigned long long* hprt_emu_params_{n}() {{\n\
             static const unsigned long long p[] = {{{}{}{}}}; return p; }}\n\
             static void hprt_emu_body_{n}(void* p) {{ void** a = static_cast<void**>(p); (void)a; {n}({}); }}\n\
             extern \"C\" int hprt_emu_launch_{n}(void** a, const unsigned* d, unsigned shmem) {{\n\
             return ::hprt_emu::run_grid(d, shmem, {coop}, hprt_emu_body_{n}, a); }}\n",
            k.params.len(),
            if sizes.is_empty() { "" } else { ", " },
            sizes.join(", "),
            args.join(", "),
        );
    }
    tu
}

fn work_dir() -> PathBuf {
    std::env::temp_dir().join(format!("hprt-cuda-emu-{}", std::process::id()))
}

/// Shared objects already built in this process, by everything that went into them: the
/// backend compiles the same module for every platform value it opens, and the host compiler
/// takes seconds where NVRTC takes milliseconds.
fn built() -> MutexGuard<'static, HashMap<u64, Vec<u8>>> {
    static BUILT: LazyLock<Mutex<HashMap<u64, Vec<u8>>>> = LazyLock::new(Default::default);
    lock(&BUILT)
}

/// Compiles `p` with the host compiler; the log is the compiler's output.
fn compile(p: &mut Program, opts: &Options) -> Result<(), NvrtcResult> {
    let tu = translation_unit(&p.source, &p.name);
    let key = {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut h = DefaultHasher::new();
        (&tu, &p.headers, opts.contract, &opts.std, &opts.extra).hash(&mut h);
        h.finish()
    };
    if let Some(so) = built().get(&key) {
        p.log.clear();
        p.image = Some((so.clone(), opts.cubin));
        return Ok(());
    }
    let dir = work_dir().join(format!("prog-{}", state::next_id()));
    std::fs::create_dir_all(&dir).map_err(|_| NVRTC_ERROR_INTERNAL_ERROR)?;
    for (name, text) in &p.headers {
        std::fs::write(dir.join(name), text).map_err(|_| NVRTC_ERROR_INTERNAL_ERROR)?;
    }
    let src = dir.join("kernel.cpp");
    let lib = dir.join("kernel.so");
    std::fs::write(&src, tu).map_err(|_| NVRTC_ERROR_INTERNAL_ERROR)?;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let result = std::process::Command::new(&cxx)
        .arg(format!("-std={}", opts.std.replace("c++03", "c++11")))
        .args(["-O1", "-shared", "-fPIC", "-frounding-math", opts.contract])
        .args(&opts.extra)
        .arg("-I")
        .arg(&dir)
        .arg("-o")
        .arg(&lib)
        .arg(&src)
        .output();
    let outcome = match result {
        Err(e) => {
            p.log = format!("hprt CUDA emulator: cannot run the host C++ compiler {cxx:?}: {e}");
            Err(NVRTC_ERROR_INTERNAL_ERROR)
        }
        Ok(o) if !o.status.success() => {
            p.log = String::from_utf8_lossy(&o.stderr).into_owned();
            Err(NVRTC_ERROR_COMPILATION)
        }
        Ok(o) => {
            p.log = String::from_utf8_lossy(&o.stderr).into_owned();
            let bytes = std::fs::read(&lib).map_err(|_| NVRTC_ERROR_INTERNAL_ERROR)?;
            built().insert(key, bytes.clone());
            p.image = Some((bytes, opts.cubin));
            Ok(())
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCompileProgram(
    prog: *mut std::ffi::c_void,
    num_options: c_int,
    options: *const *const c_char,
) -> NvrtcResult {
    nvrtc_entry(Some("nvrtcCompileProgram"), || {
        if num_options < 0 || (num_options > 0 && options.is_null()) {
            return Err(NVRTC_ERROR_INVALID_INPUT);
        }
        let mut opts = Vec::new();
        for i in 0..num_options as usize {
            // SAFETY: API contract: `num_options` NUL-terminated strings.
            opts.push(unsafe { text(*options.add(i)) }.ok_or(NVRTC_ERROR_INVALID_INPUT)?);
        }
        // The compiler runs outside the registry's lock.
        let id = decode(PROGRAM_TAG, prog as usize).ok_or(NVRTC_ERROR_INVALID_PROGRAM)?;
        let mut p = programs().remove(&id).ok_or(NVRTC_ERROR_INVALID_PROGRAM)?;
        p.image = None;
        let r = match parse_options(&opts) {
            Ok(o) => compile(&mut p, &o),
            Err(log) => {
                p.log = log;
                Err(NVRTC_ERROR_INVALID_OPTION)
            }
        };
        programs().insert(id, p);
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(
    prog: *mut std::ffi::c_void,
    size: *mut usize,
) -> NvrtcResult {
    nvrtc_entry(None, || {
        let n = with_program(prog, |p| Ok(p.log.len() + 1))?;
        // SAFETY: API contract.
        unsafe { out(size, n) }
    })
}

/// # Safety
/// `dst` holds `bytes.len() + 1` bytes.
unsafe fn put_text(dst: *mut c_char, bytes: &[u8]) -> Result<(), NvrtcResult> {
    if dst.is_null() {
        return Err(NVRTC_ERROR_INVALID_INPUT);
    }
    // SAFETY: caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.cast::<u8>(), bytes.len());
        *dst.add(bytes.len()) = 0;
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLog(
    prog: *mut std::ffi::c_void,
    log: *mut c_char,
) -> NvrtcResult {
    nvrtc_entry(None, || {
        // SAFETY: the caller sized `log` with nvrtcGetProgramLogSize.
        with_program(prog, |p| unsafe { put_text(log, p.log.as_bytes()) })
    })
}

fn ptx_of(so: &[u8]) -> String {
    let mut s = String::with_capacity(PTX_HEADER.len() + 2 * so.len());
    s += PTX_HEADER;
    for b in so {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTXSize(
    prog: *mut std::ffi::c_void,
    size: *mut usize,
) -> NvrtcResult {
    nvrtc_entry(None, || {
        let n = with_program(prog, |p| {
            let (so, _) = p.image.as_ref().ok_or(NVRTC_ERROR_INVALID_PROGRAM)?;
            Ok(PTX_HEADER.len() + 2 * so.len() + 1)
        })?;
        // SAFETY: API contract.
        unsafe { out(size, n) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTX(prog: *mut std::ffi::c_void, ptx: *mut c_char) -> NvrtcResult {
    nvrtc_entry(Some("nvrtcGetPTX"), || {
        with_program(prog, |p| {
            let (so, _) = p.image.as_ref().ok_or(NVRTC_ERROR_INVALID_PROGRAM)?;
            // SAFETY: the caller sized `ptx` with nvrtcGetPTXSize.
            unsafe { put_text(ptx, ptx_of(so).as_bytes()) }
        })
    })
}

/// A cubin exists only for a real architecture (`sm_XX`), as in NVRTC.
fn cubin(p: &Program) -> Result<&[u8], NvrtcResult> {
    match &p.image {
        Some((so, true)) => Ok(so),
        Some((_, false)) => Err(NVRTC_ERROR_INVALID_INPUT),
        None => Err(NVRTC_ERROR_INVALID_PROGRAM),
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBINSize(
    prog: *mut std::ffi::c_void,
    size: *mut usize,
) -> NvrtcResult {
    nvrtc_entry(None, || {
        let n = with_program(prog, |p| cubin(p).map(<[u8]>::len))?;
        // SAFETY: API contract.
        unsafe { out(size, n) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBIN(
    prog: *mut std::ffi::c_void,
    dst: *mut c_char,
) -> NvrtcResult {
    nvrtc_entry(Some("nvrtcGetCUBIN"), || {
        with_program(prog, |p| {
            let so = cubin(p)?;
            if dst.is_null() {
                return Err(NVRTC_ERROR_INVALID_INPUT);
            }
            // SAFETY: the caller sized `dst` with nvrtcGetCUBINSize.
            unsafe { std::ptr::copy_nonoverlapping(so.as_ptr(), dst.cast::<u8>(), so.len()) };
            Ok(())
        })
    })
}

#[no_mangle]
pub extern "C" fn nvrtcGetErrorString(code: NvrtcResult) -> *const c_char {
    let s: &'static CStr = match code {
        NVRTC_SUCCESS => c"NVRTC_SUCCESS",
        NVRTC_ERROR_OUT_OF_MEMORY => c"NVRTC_ERROR_OUT_OF_MEMORY",
        NVRTC_ERROR_INVALID_INPUT => c"NVRTC_ERROR_INVALID_INPUT",
        NVRTC_ERROR_INVALID_PROGRAM => c"NVRTC_ERROR_INVALID_PROGRAM",
        NVRTC_ERROR_INVALID_OPTION => c"NVRTC_ERROR_INVALID_OPTION",
        NVRTC_ERROR_COMPILATION => c"NVRTC_ERROR_COMPILATION",
        NVRTC_ERROR_INTERNAL_ERROR => c"NVRTC_ERROR_INTERNAL_ERROR",
        _ => c"NVRTC_ERROR unknown",
    };
    s.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_extern_c_kernels_and_their_parameter_types() {
        let src = r#"
template <typename T> __device__ T f(T x) { return x; }
extern "C" __global__ void a(const unsigned char* __restrict__ src, unsigned long long n, double v) {}
__global__ void mangled(int x) {}
extern "C" __global__ void __launch_bounds__(256) b(void) {}
"#;
        assert_eq!(
            kernels(src),
            vec![
                KernelDecl {
                    name: "a".into(),
                    params: vec![
                        "const unsigned char* __restrict__".into(),
                        "unsigned long long".into(),
                        "double".into()
                    ]
                },
                KernelDecl {
                    name: "b".into(),
                    params: vec![]
                }
            ]
        );
    }

    #[test]
    fn options_are_honoured_or_refused() {
        let o = parse_options(&["--gpu-architecture=sm_80".into(), "--fmad=false".into()]).unwrap();
        assert!(o.cubin);
        assert_eq!(o.contract, "-ffp-contract=off");
        assert!(
            !parse_options(&["--gpu-architecture=compute_80".into()])
                .unwrap()
                .cubin
        );
        for bad in [
            "--ftz=true",
            "--use_fast_math",
            "--gpu-architecture=sm_12",
            "--bogus",
        ] {
            assert!(parse_options(&[bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn dynamic_shared_memory_becomes_the_launch_buffer() {
        let s = dynamic_shared("extern __shared__ float buf[];\nint x;");
        assert!(
            s.contains("#define buf (reinterpret_cast<float*>(::hprt_emu::g.dyn_smem))"),
            "{s}"
        );
        assert!(s.ends_with("\nint x;"), "{s}");
    }
}
