//! The one error type of `hprt-platform`.

use std::borrow::Cow;
use std::fmt;

/// Which backend produced a value or an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Cpu,
    Cuda,
    Npu,
}

impl BackendKind {
    pub const ALL: [BackendKind; 3] = [BackendKind::Cpu, BackendKind::Cuda, BackendKind::Npu];

    /// The name `HP_PLATFORM` accepts.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Npu => "npu",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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

impl ErrorKind {
    /// hprt's own status code for this kind (what the cpu backend and the C ABI report).
    pub fn code(self) -> i32 {
        match self {
            ErrorKind::Unavailable => 1,
            ErrorKind::InvalidValue => 2,
            ErrorKind::InvalidHandle => 3,
            ErrorKind::OutOfRange => 4,
            ErrorKind::OutOfMemory => 5,
            ErrorKind::NotReady => 6,
            ErrorKind::Mismatch => 7,
            ErrorKind::Timeout => 8,
            ErrorKind::Unsupported => 9,
            ErrorKind::Internal => 10,
        }
    }

    /// The name of [`ErrorKind::code`].
    pub fn code_name(self) -> &'static str {
        match self {
            ErrorKind::Unavailable => "HP_ERROR_UNAVAILABLE",
            ErrorKind::InvalidValue => "HP_ERROR_INVALID_VALUE",
            ErrorKind::InvalidHandle => "HP_ERROR_INVALID_HANDLE",
            ErrorKind::OutOfRange => "HP_ERROR_OUT_OF_RANGE",
            ErrorKind::OutOfMemory => "HP_ERROR_OUT_OF_MEMORY",
            ErrorKind::NotReady => "HP_ERROR_NOT_READY",
            ErrorKind::Mismatch => "HP_ERROR_COLLECTIVE_MISMATCH",
            ErrorKind::Timeout => "HP_ERROR_TIMEOUT",
            ErrorKind::Unsupported => "HP_ERROR_UNSUPPORTED",
            ErrorKind::Internal => "HP_ERROR_INTERNAL",
        }
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
        Error {
            kind,
            backend,
            operation: operation.into(),
            code: kind.code().into(),
            code_name: Cow::Borrowed(kind.code_name()),
            message: message.into(),
        }
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
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
