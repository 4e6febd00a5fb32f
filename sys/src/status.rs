//! Status codes by name, for errors people can search for.

use crate::types::*;

macro_rules! names {
    ($code:expr, $($name:ident),* $(,)?) => {
        $( if $code == $name as i64 { return Some(stringify!($name)); } )*
    };
}

/// The name of an `aclError` value of the header (`None` for codes it does not list).
pub fn acl_error_name(code: i32) -> Option<&'static str> {
    let code = i64::from(code);
    names!(
        code,
        ACL_SUCCESS,
        ACL_ERROR_INVALID_PARAM,
        ACL_ERROR_UNINITIALIZE,
        ACL_ERROR_REPEAT_INITIALIZE,
        ACL_ERROR_RT_PARAM_INVALID,
        ACL_ERROR_BAD_ALLOC,
        ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
        ACL_ERROR_RT_MEMORY_ALLOCATION,
        ACL_ERROR_RT_INTERNAL_ERROR,
        ACL_ERROR_RT_REPORT_TIMEOUT,
    );
    None
}

/// The name of an `HcclResult` value (`None` for codes the header does not list).
pub fn hccl_result_name(code: i32) -> Option<&'static str> {
    macro_rules! hccl {
        ($($name:ident),* $(,)?) => {
            $( if code == HcclResult::$name.0 as i32 { return Some(stringify!($name)); } )*
        };
    }
    hccl!(
        HCCL_SUCCESS,
        HCCL_E_PARA,
        HCCL_E_PTR,
        HCCL_E_MEMORY,
        HCCL_E_INTERNAL,
        HCCL_E_NOT_SUPPORT,
        HCCL_E_NOT_FOUND,
        HCCL_E_UNAVAIL,
        HCCL_E_SYSCALL,
        HCCL_E_TIMEOUT,
        HCCL_E_OPEN_FILE_FAILURE,
        HCCL_E_TCP_CONNECT,
        HCCL_E_ROCE_CONNECT,
        HCCL_E_TCP_TRANSFER,
        HCCL_E_ROCE_TRANSFER,
        HCCL_E_RUNTIME,
        HCCL_E_DRV,
        HCCL_E_PROFILING,
        HCCL_E_CCE,
        HCCL_E_NETWORK,
        HCCL_E_AGAIN,
        HCCL_E_REMOTE,
        HCCL_E_SUSPENDING,
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code the header defines must have its name: parse the header itself, so a code added
    /// there without a name here fails.
    #[test]
    fn every_header_code_has_its_name() {
        let header = include_str!("../include/hprt_ascend.h");
        let mut checked = 0;
        for line in header.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("#define ACL_") {
                let mut parts = rest.split_whitespace();
                let (name, value) = (parts.next().unwrap(), parts.next().unwrap());
                if name == "SUCCESS" || name.starts_with("ERROR_") {
                    let code: i32 = value.parse().unwrap();
                    assert_eq!(acl_error_name(code), Some(format!("ACL_{name}").as_str()));
                    checked += 1;
                }
            } else if let Some(rest) = line.strip_prefix("HCCL_") {
                if let Some((name, value)) = rest.trim_end_matches(',').split_once(" = ") {
                    if name == "SUCCESS" || name.starts_with("E_") {
                        let code: i32 = value.parse().unwrap();
                        assert_eq!(
                            hccl_result_name(code),
                            Some(format!("HCCL_{name}").as_str())
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 10 + 23, "header codes found");
        assert_eq!(acl_error_name(12345), None);
        assert_eq!(hccl_result_name(99), None);
    }
}
