//! `aclError` / `HcclResult` → [`Error`], with the driver's code and name.

use hprt_sys::{acl_error_name, hccl_result_name};

use crate::error::{BackendKind, Error, ErrorKind, Result};

fn acl_kind(code: i32) -> ErrorKind {
    match code {
        100000 | 107000 => ErrorKind::InvalidValue,
        200000 | 207001 => ErrorKind::OutOfMemory,
        207000 => ErrorKind::Unsupported,
        507012 => ErrorKind::Timeout,
        _ => ErrorKind::Internal,
    }
}

fn hccl_kind(code: i32) -> ErrorKind {
    match code {
        1 | 2 => ErrorKind::InvalidValue,
        3 => ErrorKind::OutOfMemory,
        5 => ErrorKind::Unsupported,
        9 => ErrorKind::Timeout,
        _ => ErrorKind::Internal,
    }
}

/// `Ok` for `ACL_SUCCESS`, else a typed error naming the code and the ACL function.
pub(crate) fn acl(code: i32, function: &'static str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let name = acl_error_name(code).map_or_else(|| format!("aclError {code}"), str::to_string);
    Err(Error::driver(
        acl_kind(code),
        BackendKind::Npu,
        function,
        code.into(),
        name,
        format!("{function} returned {code}"),
    ))
}

/// `Ok` for `HCCL_SUCCESS`, else a typed error naming the code and the HCCL function.
pub(crate) fn hccl(code: i32, function: &'static str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let name = hccl_result_name(code).map_or_else(|| format!("HcclResult {code}"), str::to_string);
    Err(Error::driver(
        hccl_kind(code),
        BackendKind::Npu,
        function,
        code.into(),
        name,
        format!("{function} returned {code}"),
    ))
}

pub(crate) fn npu_err(kind: ErrorKind, op: &'static str, msg: impl Into<String>) -> Error {
    Error::new(kind, BackendKind::Npu, op, msg)
}
