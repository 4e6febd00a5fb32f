//! `CUresult`, `ncclResult_t` and `nvrtcResult` → [`Error`], with the library's own code and name.

use cudarc::driver::sys::CUresult;

use crate::error::{BackendKind, Error, ErrorKind, Result};

pub(crate) fn cuda_err(kind: ErrorKind, op: &'static str, msg: impl Into<String>) -> Error {
    Error::new(kind, BackendKind::Cuda, op, msg)
}

/// The hprt classification of a driver status code.
pub(crate) fn cu_kind(code: u32) -> ErrorKind {
    match code {
        1 | 101 | 201 | 709 => ErrorKind::InvalidValue, // INVALID_VALUE, INVALID_DEVICE, INVALID_CONTEXT, CONTEXT_IS_DESTROYED
        2 => ErrorKind::OutOfMemory,
        // NOT_INITIALIZED, DEINITIALIZED, STUB_LIBRARY, NO_DEVICE, SYSTEM_DRIVER_MISMATCH,
        // COMPAT_NOT_SUPPORTED_ON_DEVICE, DEVICE_UNAVAILABLE
        3 | 4 | 34 | 46 | 100 | 803 | 804 => ErrorKind::Unavailable,
        400 => ErrorKind::InvalidHandle,
        600 => ErrorKind::NotReady,
        // NO_BINARY_FOR_GPU, UNSUPPORTED_PTX_VERSION, NOT_SUPPORTED, NOT_PERMITTED
        209 | 222 | 800 | 801 => ErrorKind::Unsupported,
        909 => ErrorKind::Timeout, // TIMEOUT
        _ => ErrorKind::Internal,
    }
}

/// The error for a driver status code, naming the code and the driver function.
pub(crate) fn cu_error(code: u32, name: &str, function: &'static str) -> Error {
    Error::driver(
        cu_kind(code),
        BackendKind::Cuda,
        function,
        code.into(),
        name.to_string(),
        format!("{function} returned {name} ({code})"),
    )
}

/// `Ok` for `CUDA_SUCCESS`, else a typed error naming the code and the driver function.
pub(crate) fn cu(r: CUresult, function: &'static str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    // cudarc's enum names the codes exactly as cuda.h does.
    Err(cu_error(r as u32, &format!("{r:?}"), function))
}

pub(crate) fn nccl_result_name(code: i32) -> Option<&'static str> {
    Some(match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => return None,
    })
}

pub(crate) fn nccl_kind(code: i32) -> ErrorKind {
    match code {
        4 | 5 => ErrorKind::InvalidValue,
        7 => ErrorKind::NotReady,
        8 => ErrorKind::Timeout,
        _ => ErrorKind::Internal,
    }
}

/// The error for an NCCL status code; `detail` is NCCL's own text (`ncclGetLastError`) if any.
pub(crate) fn nccl_error(code: i32, function: &'static str, detail: &str) -> Error {
    let name = nccl_result_name(code).map_or_else(|| format!("ncclResult_t {code}"), String::from);
    let mut message = format!("{function} returned {name} ({code})");
    if !detail.is_empty() {
        message += ": ";
        message += detail;
    }
    Error::driver(
        nccl_kind(code),
        BackendKind::Cuda,
        function,
        code.into(),
        name,
        message,
    )
}

pub(crate) fn nvrtc_result_name(code: i32) -> Option<&'static str> {
    Some(match code {
        0 => "NVRTC_SUCCESS",
        1 => "NVRTC_ERROR_OUT_OF_MEMORY",
        2 => "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
        3 => "NVRTC_ERROR_INVALID_INPUT",
        4 => "NVRTC_ERROR_INVALID_PROGRAM",
        5 => "NVRTC_ERROR_INVALID_OPTION",
        6 => "NVRTC_ERROR_COMPILATION",
        7 => "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
        8 => "NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
        9 => "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
        10 => "NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
        11 => "NVRTC_ERROR_INTERNAL_ERROR",
        12 => "NVRTC_ERROR_TIME_FILE_WRITE_FAILED",
        _ => return None,
    })
}

/// The error for an NVRTC status code; `detail` carries the compile log where there is one.
pub(crate) fn nvrtc_error(code: i32, function: &'static str, detail: &str) -> Error {
    let name = nvrtc_result_name(code).map_or_else(|| format!("nvrtcResult {code}"), String::from);
    let kind = match code {
        1 => ErrorKind::OutOfMemory,
        3 | 5 => ErrorKind::InvalidValue,
        _ => ErrorKind::Internal,
    };
    let mut message = format!("{function} returned {name} ({code})");
    if !detail.is_empty() {
        message += ":\n";
        message += detail;
    }
    Error::driver(
        kind,
        BackendKind::Cuda,
        function,
        code.into(),
        name,
        message,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_codes_map_to_kinds_and_keep_their_names() {
        let e = cu(CUresult::CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc_v2").unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert_eq!(e.code, 2);
        assert_eq!(e.code_name, "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(e.operation, "cuMemAlloc_v2");
        assert_eq!(e.backend, BackendKind::Cuda);
        for (r, kind) in [
            (CUresult::CUDA_ERROR_NOT_READY, ErrorKind::NotReady),
            (
                CUresult::CUDA_ERROR_INVALID_HANDLE,
                ErrorKind::InvalidHandle,
            ),
            (CUresult::CUDA_ERROR_NO_DEVICE, ErrorKind::Unavailable),
            (CUresult::CUDA_ERROR_INVALID_VALUE, ErrorKind::InvalidValue),
            (CUresult::CUDA_ERROR_NOT_SUPPORTED, ErrorKind::Unsupported),
            (
                CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
                ErrorKind::Unsupported,
            ),
            (CUresult::CUDA_ERROR_LAUNCH_FAILED, ErrorKind::Internal),
        ] {
            let e = cu(r, "f").unwrap_err();
            assert_eq!(e.kind, kind, "{r:?}");
            assert_eq!(e.code_name, format!("{r:?}"));
            assert_eq!(e.code, r as u32 as i64);
        }
        assert!(cu(CUresult::CUDA_SUCCESS, "f").is_ok());
    }

    #[test]
    fn nccl_codes_map_to_kinds_and_names() {
        let e = nccl_error(5, "ncclGroupEnd", "no group is open");
        assert_eq!(e.kind, ErrorKind::InvalidValue);
        assert_eq!(e.code_name, "ncclInvalidUsage");
        assert!(e.message.contains("no group is open"), "{}", e.message);
        assert_eq!(nccl_error(8, "f", "").kind, ErrorKind::Timeout);
        assert_eq!(nccl_error(2, "f", "").kind, ErrorKind::Internal);
        assert_eq!(nccl_error(77, "f", "").code_name, "ncclResult_t 77");
        for code in 0..=8 {
            assert!(nccl_result_name(code).is_some());
        }
    }

    #[test]
    fn nvrtc_codes_map_to_kinds_and_carry_the_log() {
        let e = nvrtc_error(6, "nvrtcCompileProgram", "error: expected a ;");
        assert_eq!(e.code_name, "NVRTC_ERROR_COMPILATION");
        assert_eq!(e.kind, ErrorKind::Internal);
        assert!(e.message.contains("expected a ;"));
        assert_eq!(nvrtc_error(5, "f", "").kind, ErrorKind::InvalidValue);
        assert_eq!(nvrtc_error(99, "f", "").code_name, "nvrtcResult 99");
    }
}
