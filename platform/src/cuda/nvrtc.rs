//! NVRTC, loaded at run time: compiles kernel sources for one device, to a cubin where NVRTC
//! knows the device's architecture, else to PTX the driver compiles.

use std::ffi::{c_char, c_int, c_void, CString};

use super::check::{cuda_err, nvrtc_error};
use super::dynlib::dyn_table;
use crate::error::{Error, ErrorKind, Result};

type Program = *mut c_void;

dyn_table! {
    /// The NVRTC functions hprt uses (cubins need NVRTC 11.1, the arch list 11.2).
    pub(crate) struct NvrtcApi {
        required {
            fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int;
            fn nvrtcCreateProgram(prog: *mut Program, src: *const c_char, name: *const c_char, num_headers: c_int, headers: *const *const c_char, include_names: *const *const c_char) -> c_int;
            fn nvrtcCompileProgram(prog: Program, num_options: c_int, options: *const *const c_char) -> c_int;
            fn nvrtcGetProgramLogSize(prog: Program, size: *mut usize) -> c_int;
            fn nvrtcGetProgramLog(prog: Program, log: *mut c_char) -> c_int;
            fn nvrtcGetPTXSize(prog: Program, size: *mut usize) -> c_int;
            fn nvrtcGetPTX(prog: Program, ptx: *mut c_char) -> c_int;
            fn nvrtcDestroyProgram(prog: *mut Program) -> c_int;
        }
        optional {
            fn nvrtcGetCUBINSize(prog: Program, size: *mut usize) -> c_int;
            fn nvrtcGetCUBIN(prog: Program, cubin: *mut c_char) -> c_int;
            fn nvrtcGetNumSupportedArchs(num: *mut c_int) -> c_int;
            fn nvrtcGetSupportedArchs(archs: *mut c_int) -> c_int;
        }
    }
}

/// Options every hprt kernel is compiled with: no contraction of `a + b * c` into an FMA, no
/// flushing of subnormals, IEEE division, so results match the host reference bit for bit.
pub(crate) const EXACT_MATH_OPTIONS: [&str; 4] = [
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// A compiled module image for `cuModuleLoadData` (NUL-terminated when it is PTX).
pub(crate) struct Image {
    pub bytes: Vec<u8>,
    pub kind: &'static str,
}

pub(crate) struct Nvrtc {
    pub api: NvrtcApi,
    pub version: (i32, i32),
    pub path: String,
}

/// A program that is destroyed however compilation ends.
struct ProgramGuard<'a>(&'a NvrtcApi, Program);

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by this NVRTC and is destroyed once.
        unsafe { (self.0.nvrtcDestroyProgram)(&mut self.1) };
    }
}

impl Nvrtc {
    fn check(&self, code: c_int, function: &'static str) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(nvrtc_error(code, function, ""))
        }
    }

    /// The architectures this NVRTC can target (`None` before NVRTC 11.2, which cannot say).
    fn supported_archs(&self) -> Option<Vec<i32>> {
        let (num, get) = (
            self.api.nvrtcGetNumSupportedArchs?,
            self.api.nvrtcGetSupportedArchs?,
        );
        let mut n = 0;
        // SAFETY: NVRTC writes one `c_int` through the out-pointer, a live local.
        if unsafe { num(&mut n) } != 0 || n <= 0 {
            return None;
        }
        let mut archs = vec![0; n as usize];
        // SAFETY: NVRTC writes the `n` architectures it just counted into a buffer of `n`.
        (unsafe { get(archs.as_mut_ptr()) } == 0).then_some(archs)
    }

    /// Compiles `source` for a device of compute capability `cc` (major, minor).
    pub(crate) fn compile(&self, source: &str, name: &str, cc: (i32, i32)) -> Result<Image> {
        let device_arch = cc.0 * 10 + cc.1;
        let supported = self.supported_archs();
        let knows_device = supported
            .as_ref()
            .is_none_or(|archs| archs.contains(&device_arch));
        let has_cubin = self.api.nvrtcGetCUBINSize.is_some() && self.api.nvrtcGetCUBIN.is_some();
        let mut cubin_error = None;
        if knows_device && has_cubin {
            match self.compile_for(source, name, &format!("sm_{device_arch}"), true) {
                Ok(image) => return Ok(image),
                Err(e) => cubin_error = Some(e),
            }
        }
        let virtual_arch = supported
            .and_then(|archs| archs.into_iter().filter(|a| *a <= device_arch).max())
            .unwrap_or(device_arch);
        self.compile_for(source, name, &format!("compute_{virtual_arch}"), false)
            .map_err(|e| match cubin_error {
                // NVRTC's status code and name stay those of the last attempt.
                Some(c) => Error {
                    message: format!("{}; the cubin attempt before it: {}", e.message, c.message),
                    ..e
                },
                None => e,
            })
    }

    fn compile_for(&self, source: &str, name: &str, arch: &str, cubin: bool) -> Result<Image> {
        let api = &self.api;
        let src = CString::new(source)
            .map_err(|_| cuda_err(ErrorKind::InvalidValue, "nvrtc_compile", "NUL in source"))?;
        let cname = CString::new(name)
            .map_err(|_| cuda_err(ErrorKind::InvalidValue, "nvrtc_compile", "NUL in name"))?;
        let mut prog: Program = std::ptr::null_mut();
        self.check(
            // SAFETY: NUL-terminated strings that outlive the call; no headers (count 0, null
            // arrays); the out-pointer is a live local.
            unsafe {
                (api.nvrtcCreateProgram)(
                    &mut prog,
                    src.as_ptr(),
                    cname.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            },
            "nvrtcCreateProgram",
        )?;
        let guard = ProgramGuard(api, prog);
        let options: Vec<CString> = std::iter::once(format!("--gpu-architecture={arch}"))
            .chain(EXACT_MATH_OPTIONS.iter().map(|s| s.to_string()))
            .map(|s| CString::new(s).expect("options have no NUL"))
            .collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: a live program and option strings that outlive the call.
        let code = unsafe {
            (api.nvrtcCompileProgram)(guard.1, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        if code != 0 {
            let log = self.log(guard.1);
            return Err(nvrtc_error(
                code,
                "nvrtcCompileProgram",
                &format!("{name} for {arch}:\n{log}"),
            ));
        }
        let (size_fn, get_fn, what) = if cubin {
            (
                api.nvrtcGetCUBINSize.expect("checked by the caller"),
                api.nvrtcGetCUBIN.expect("checked by the caller"),
                "cubin",
            )
        } else {
            (api.nvrtcGetPTXSize, api.nvrtcGetPTX, "ptx")
        };
        let mut size = 0usize;
        self.check(
            // SAFETY: a live, compiled program (`guard` destroys it only on return); the
            // out-pointer is a live local.
            unsafe { size_fn(guard.1, &mut size) },
            "nvrtcGetCUBINSize/PTXSize",
        )?;
        let mut bytes = vec![0u8; size];
        self.check(
            // SAFETY: the same program; NVRTC writes the `size` bytes it just reported into a
            // buffer of `size` bytes.
            unsafe { get_fn(guard.1, bytes.as_mut_ptr().cast()) },
            "nvrtcGetCUBIN/PTX",
        )?;
        Ok(Image { bytes, kind: what })
    }

    fn log(&self, prog: Program) -> String {
        let mut size = 0usize;
        // SAFETY: a live program (the caller's `ProgramGuard` holds it); the out-pointer is a
        // live local.
        if unsafe { (self.api.nvrtcGetProgramLogSize)(prog, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size];
        // SAFETY: the same program; NVRTC writes the `size` bytes it just reported (the NUL
        // included) into a buffer of `size` bytes.
        if unsafe { (self.api.nvrtcGetProgramLog)(prog, log.as_mut_ptr().cast()) } != 0 {
            return String::new();
        }
        String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .to_string()
    }
}
