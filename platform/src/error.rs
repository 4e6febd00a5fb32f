//! The one error type of `hprt-platform`.

use std::borrow::Cow;
use std::ffi::CStr;

/// Which backend produced a value or an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Cpu,
    Cuda,
    Npu,
}

// The names `HP_PLATFORM` and the bindings' `open` accept.
crate::named_enum!(BackendKind, "backend", { Cpu => "cpu", Cuda => "cuda", Npu => "npu" });

/// A backend-neutral classification of what went wrong; the driver's own code and name travel
/// beside it in [`Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A backend was asked for but cannot be used here (library missing, not compiled in, no device).
    Unavailable,
    /// An argument is outside what the operation accepts.
    InvalidValue,
    /// A handle was destroyed, freed, released, or belongs to another platform or backend.
    InvalidHandle,
    /// A copy, memset or collective would touch bytes outside its buffer.
    OutOfRange,
    /// Device or pinned memory is exhausted.
    OutOfMemory,
    /// The queried work has not completed yet.
    NotReady,
    /// Ranks of one collective disagreed on its kind, size, dtype, op or root.
    Mismatch,
    /// A rendezvous did not complete within the configured timeout.
    Timeout,
    /// The backend does not implement this operation.
    Unsupported,
    /// Any other failure reported by a driver.
    Internal,
}

// The kind's name in Python errors (`HprtError.kind`).
crate::named_enum!(ErrorKind, "error kind", {
    Unavailable => "unavailable",
    InvalidValue => "invalid_value",
    InvalidHandle => "invalid_handle",
    OutOfRange => "out_of_range",
    OutOfMemory => "out_of_memory",
    NotReady => "not_ready",
    Mismatch => "mismatch",
    Timeout => "timeout",
    Unsupported => "unsupported",
    Internal => "internal",
});

impl ErrorKind {
    /// The status this kind reports as (the one mapping; [`HprtStatus::kind`] is its inverse).
    pub fn status(self) -> HprtStatus {
        match self {
            ErrorKind::Unavailable => HprtStatus::ErrorUnavailable,
            ErrorKind::InvalidValue => HprtStatus::ErrorInvalidValue,
            ErrorKind::InvalidHandle => HprtStatus::ErrorInvalidHandle,
            ErrorKind::OutOfRange => HprtStatus::ErrorOutOfRange,
            ErrorKind::OutOfMemory => HprtStatus::ErrorOutOfMemory,
            ErrorKind::NotReady => HprtStatus::ErrorNotReady,
            ErrorKind::Mismatch => HprtStatus::ErrorCollectiveMismatch,
            ErrorKind::Timeout => HprtStatus::ErrorTimeout,
            ErrorKind::Unsupported => HprtStatus::ErrorUnsupported,
            ErrorKind::Internal => HprtStatus::ErrorInternal,
        }
    }

    /// hprt's own status code for this kind (what the cpu backend and the C ABI report).
    pub fn code(self) -> i32 {
        self.status() as i32
    }

    /// The name of [`ErrorKind::code`] in Rust and Python errors (`HP_ERROR_OUT_OF_MEMORY`; the C
    /// ABI spells the same status `HPRT_STATUS_ERROR_OUT_OF_MEMORY`).
    pub fn code_name(self) -> &'static str {
        self.status().short_name()
    }
}

/// Status of every C entry point.
///
/// hprt's one table of status numbers: platform error kinds report theirs (`ErrorKind::code`),
/// the C ABI returns them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HprtStatus {
    Ok = 0,
    ErrorUnavailable = 1,
    ErrorInvalidValue = 2,
    ErrorInvalidHandle = 3,
    ErrorOutOfRange = 4,
    ErrorOutOfMemory = 5,
    ErrorNotReady = 6,
    ErrorCollectiveMismatch = 7,
    ErrorTimeout = 8,
    ErrorUnsupported = 9,
    ErrorInternal = 10,
    /// A required pointer argument was null.
    ErrorNullArgument = 11,
    /// hprt panicked; the message says where. The process may continue, the object involved
    /// should not be used again.
    ErrorPanic = 12,
    /// A swap call in the wrong state (e.g. reading a tensor that is offloaded).
    ErrorWrongState = 13,
    /// A saved tensor was modified or resized between offload and reload.
    ErrorModifiedSinceOffload = 14,
    /// Compressed bytes failed to decode (corrupt, truncated, or of another format version).
    ErrorCorruptData = 15,
    /// A caller-provided output buffer is smaller than the result; the message says how many
    /// bytes are needed.
    ErrorBufferTooSmall = 16,
}

/// Gives a crate's error type (an enum with a `Platform(hprt_platform::Error)` variant)
/// `status()` and `status_name()` from one table of its other variants, so that every crate's
/// errors report to the C ABI and Python alike: a platform error reports its own status and
/// name, every other arm the status and name the table gives it. The attributes given become
/// `status()`'s doc.
#[macro_export]
macro_rules! status_report {
    ($(#[$doc:meta])* $ty:ident { $($pat:pat => ($status:expr, $name:expr $(,)?),)* }) => {
        impl $ty {
            $(#[$doc])*
            pub fn status(&self) -> $crate::HprtStatus {
                self.report().0
            }

            #[doc = concat!("The status name (see [`", stringify!($ty), "::status`]).")]
            pub fn status_name(&self) -> ::std::borrow::Cow<'static, str> {
                self.report().1
            }

            fn report(&self) -> ($crate::HprtStatus, ::std::borrow::Cow<'static, str>) {
                let (status, name): ($crate::HprtStatus, &'static str) = match self {
                    $ty::Platform(e) => return (e.kind.status(), e.code_name.clone()),
                    $($pat => ($status, $name),)*
                };
                (status, ::std::borrow::Cow::Borrowed(name))
            }
        }
    };
}

/// Each status with the tail of its names: `HPRT_STATUS_<tail>` in C, `HP_<tail>` in Rust and
/// Python errors.
macro_rules! status_names {
    ($($status:ident => $tail:literal,)*) => {
        impl HprtStatus {
            pub const ALL: [HprtStatus; [$($tail),*].len()] = [$(HprtStatus::$status),*];

            /// The C constant's name (`HPRT_STATUS_ERROR_OUT_OF_MEMORY`).
            pub fn name(self) -> &'static CStr {
                match self {
                    $(HprtStatus::$status => const {
                        match CStr::from_bytes_with_nul(
                            concat!("HPRT_STATUS_", $tail, "\0").as_bytes(),
                        ) {
                            Ok(name) => name,
                            Err(_) => panic!("a status name holds a NUL"),
                        }
                    },)*
                }
            }

            fn short_name(self) -> &'static str {
                match self {
                    $(HprtStatus::$status => concat!("HP_", $tail),)*
                }
            }
        }
    };
}

status_names! {
    Ok => "OK",
    ErrorUnavailable => "ERROR_UNAVAILABLE",
    ErrorInvalidValue => "ERROR_INVALID_VALUE",
    ErrorInvalidHandle => "ERROR_INVALID_HANDLE",
    ErrorOutOfRange => "ERROR_OUT_OF_RANGE",
    ErrorOutOfMemory => "ERROR_OUT_OF_MEMORY",
    ErrorNotReady => "ERROR_NOT_READY",
    ErrorCollectiveMismatch => "ERROR_COLLECTIVE_MISMATCH",
    ErrorTimeout => "ERROR_TIMEOUT",
    ErrorUnsupported => "ERROR_UNSUPPORTED",
    ErrorInternal => "ERROR_INTERNAL",
    ErrorNullArgument => "ERROR_NULL_ARGUMENT",
    ErrorPanic => "ERROR_PANIC",
    ErrorWrongState => "ERROR_WRONG_STATE",
    ErrorModifiedSinceOffload => "ERROR_MODIFIED_SINCE_OFFLOAD",
    ErrorCorruptData => "ERROR_CORRUPT_DATA",
    ErrorBufferTooSmall => "ERROR_BUFFER_TOO_SMALL",
}

impl HprtStatus {
    /// The status numbered `code`, if any.
    pub fn from_code(code: i32) -> Option<HprtStatus> {
        HprtStatus::ALL.into_iter().find(|s| *s as i32 == code)
    }

    /// The platform error kind reported as this status; `None` for `Ok` and the statuses only
    /// the C ABI's own layers report.
    pub fn kind(self) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.status() == self)
    }
}

/// A failed platform operation: which backend, which operation, the status code and its name,
/// and a sentence for humans.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{backend} {operation}: {code_name} ({code}): {message}")]
pub struct Error {
    pub kind: ErrorKind,
    pub backend: BackendKind,
    pub operation: Cow<'static, str>,
    /// The driver's status code (`CUresult`, `aclError`, `HcclResult`, …) or hprt's own for cpu.
    pub code: i64,
    pub code_name: Cow<'static, str>,
    pub message: String,
}

impl Error {
    /// An error with hprt's own status code for `kind`.
    pub fn new(
        kind: ErrorKind,
        backend: BackendKind,
        operation: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Error::driver(
            kind,
            backend,
            operation,
            kind.code().into(),
            kind.code_name(),
            message,
        )
    }

    /// An error carrying a driver's own status code and name.
    pub fn driver(
        kind: ErrorKind,
        backend: BackendKind,
        operation: impl Into<Cow<'static, str>>,
        code: i64,
        code_name: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Error {
            kind,
            backend,
            operation: operation.into(),
            code,
            code_name: code_name.into(),
            message: message.into(),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The status this error reports as (its kind's: [`ErrorKind::status`]).
    pub fn status(&self) -> HprtStatus {
        self.kind.status()
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_kind_has_its_own_status_and_back() {
        let statuses: HashSet<HprtStatus> = ErrorKind::ALL.iter().map(|k| k.status()).collect();
        assert_eq!(
            statuses.len(),
            ErrorKind::ALL.len(),
            "two kinds share a status"
        );
        for kind in ErrorKind::ALL {
            let status = kind.status();
            assert_eq!(status.kind(), Some(kind));
            assert_eq!(HprtStatus::from_code(kind.code()), Some(status));
            assert_eq!(
                status.name().to_str().unwrap(),
                format!("HPRT_STATUS_{}", &kind.code_name()["HP_".len()..])
            );
        }
        assert_eq!(HprtStatus::Ok.kind(), None);
    }

    #[test]
    fn statuses_are_numbered_densely_with_distinct_names() {
        for (i, status) in HprtStatus::ALL.into_iter().enumerate() {
            assert_eq!(status as i32, i as i32, "{status:?}");
            assert_eq!(HprtStatus::from_code(i as i32), Some(status));
        }
        let n = HprtStatus::ALL.len() as i32;
        assert_eq!(HprtStatus::from_code(n), None);
        assert_eq!(HprtStatus::from_code(-1), None);
        let names: HashSet<&CStr> = HprtStatus::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(names.len(), HprtStatus::ALL.len());
    }
}
