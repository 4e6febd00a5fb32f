//! The crate's one error, and how it becomes a Python exception.
//!
//! Every failure reaches Python as `hprt.HprtError` (or one of its subclasses per kind), whose
//! message starts with the status name (`HP_ERROR_OUT_OF_MEMORY`, a driver's own name such as
//! `ACL_ERROR_RT_MEMORY_ALLOCATION`, or a swap error's name) and whose attributes `status`,
//! `code`, `kind`, `backend` and `operation` carry the same facts for programs.

use hprt_platform::ErrorKind;
use pyo3::exceptions::{PyBufferError, PyException};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

pyo3::create_exception!(hprt, HprtError, PyException, "An hprt operation failed.");
pyo3::create_exception!(
    hprt,
    CompressError,
    HprtError,
    "Compressed bytes are corrupt or of an unsupported format."
);
pyo3::create_exception!(
    hprt,
    OutOfMemoryError,
    HprtError,
    "Device or pinned memory is exhausted."
);
pyo3::create_exception!(
    hprt,
    InvalidHandleError,
    HprtError,
    "A handle was destroyed, freed or belongs elsewhere."
);
pyo3::create_exception!(
    hprt,
    InvalidValueError,
    HprtError,
    "An argument is outside what the operation accepts."
);
pyo3::create_exception!(
    hprt,
    UnavailableError,
    HprtError,
    "The backend cannot be used here."
);
pyo3::create_exception!(
    hprt,
    UnsupportedError,
    HprtError,
    "The backend or binding does not implement this."
);
pyo3::create_exception!(
    hprt,
    SwapStateError,
    HprtError,
    "A swap call came in a state or order it does not accept."
);

/// Everything a binding call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error(transparent)]
    Platform(#[from] hprt_platform::Error),
    #[error(transparent)]
    Swap(#[from] hprt_swap::SwapError),
    #[error(transparent)]
    Hsdp(#[from] hprt_hsdp::HsdpError),
    #[error(transparent)]
    Compress(#[from] hprt_compress::CompressError),
    /// A Python value that cannot stand for what the call needs (unknown dtype, shape mismatch,
    /// a tensor on a device this platform cannot address, …).
    #[error("HP_ERROR_INVALID_VALUE: {0}")]
    InvalidArgument(String),
    /// Something this binding does not do on the selected backend.
    #[error("HP_ERROR_UNSUPPORTED: {0}")]
    Unsupported(String),
    /// Memory a live DLPack export reads cannot be freed or resized (Python's `BufferError`
    /// for a `bytearray` with exports).
    #[error("HP_ERROR_BUFFER_EXPORTED: {0}")]
    Exported(String),
    /// An exception raised by Python code the binding called; it reaches the caller unchanged.
    #[error(transparent)]
    Python(#[from] PyErr),
}

pub type Result<T, E = BindError> = std::result::Result<T, E>;

pub fn invalid(msg: impl Into<String>) -> BindError {
    BindError::InvalidArgument(msg.into())
}

/// The `MemoryError` of a refused host allocation of `bytes` for `what`: Python's own has an
/// empty message, which names neither the size nor the call.
pub fn alloc_refused(bytes: usize, what: &str) -> BindError {
    BindError::Python(pyo3::exceptions::PyMemoryError::new_err(format!(
        "HP_ERROR_OUT_OF_MEMORY: cannot allocate {bytes} host bytes for {what}"
    )))
}

/// `data` as a Python `bytes` object; a refused allocation is [`alloc_refused`] (pyo3's
/// `PyBytes::new` would panic).
pub fn py_bytes<'py>(
    py: Python<'py>,
    data: &[u8],
    what: &str,
) -> Result<Bound<'py, pyo3::types::PyBytes>> {
    pyo3::types::PyBytes::new_with(py, data.len(), |dst| {
        dst.copy_from_slice(data);
        Ok(())
    })
    .map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py) {
            alloc_refused(data.len(), what)
        } else {
            e.into()
        }
    })
}

/// The status name, numeric code, kind name, backend and operation of an error, as Python sees
/// them.
struct Facts {
    status: String,
    code: i64,
    kind: &'static str,
    backend: Option<&'static str>,
    operation: Option<String>,
}

fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::InvalidValue => "invalid_value",
        ErrorKind::InvalidHandle => "invalid_handle",
        ErrorKind::OutOfRange => "out_of_range",
        ErrorKind::OutOfMemory => "out_of_memory",
        ErrorKind::NotReady => "not_ready",
        ErrorKind::Mismatch => "mismatch",
        ErrorKind::Timeout => "timeout",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::Internal => "internal",
    }
}

fn platform_facts(e: &hprt_platform::Error) -> Facts {
    Facts {
        status: e.code_name.to_string(),
        code: e.code,
        kind: kind_name(e.kind),
        backend: Some(e.backend.name()),
        operation: Some(e.operation.to_string()),
    }
}

fn swap_status(e: &hprt_swap::SwapError) -> &'static str {
    use hprt_swap::SwapError as S;
    match e {
        S::Platform(e) => e.kind.code_name(),
        S::WrongState { .. } => "HP_SWAP_WRONG_STATE",
        S::ModifiedSinceOffload { .. } => "HP_SWAP_MODIFIED_SINCE_OFFLOAD",
        S::StorageResized { .. } => "HP_SWAP_STORAGE_RESIZED",
        S::ReacquiredOutsideSwap => "HP_SWAP_REACQUIRED_OUTSIDE_SWAP",
        S::Codec(_) => "HP_SWAP_CODEC",
        S::InvalidTensor(_) => "HP_SWAP_INVALID_TENSOR",
        S::StorageInUse(_) => "HP_ERROR_BUFFER_EXPORTED",
        S::HostBudgetExceeded { .. } => "HP_SWAP_HOST_BUDGET_EXCEEDED",
        S::Unknown { .. } => "HP_SWAP_UNKNOWN",
        S::Order(_) => "HP_SWAP_ORDER",
    }
}

impl BindError {
    fn facts(&self) -> Facts {
        match self {
            BindError::Platform(e) | BindError::Swap(hprt_swap::SwapError::Platform(e)) => {
                platform_facts(e)
            }
            BindError::Swap(hprt_swap::SwapError::StorageInUse(_)) => {
                BindError::Exported(String::new()).facts()
            }
            BindError::Swap(e) => Facts {
                status: swap_status(e).into(),
                code: -1,
                kind: "swap",
                backend: None,
                operation: None,
            },
            BindError::Hsdp(hprt_hsdp::HsdpError::Platform(p)) => platform_facts(p),
            BindError::Hsdp(e) => Facts {
                status: hsdp_status(e).into(),
                code: -1,
                kind: "hsdp",
                backend: None,
                operation: None,
            },
            BindError::Compress(hprt_compress::CompressError::Platform(p)) => platform_facts(p),
            BindError::Compress(e) => Facts {
                status: compress_status(e).into(),
                code: -1,
                kind: "compress",
                backend: None,
                operation: None,
            },
            BindError::InvalidArgument(_) => Facts {
                status: ErrorKind::InvalidValue.code_name().into(),
                code: ErrorKind::InvalidValue.code().into(),
                kind: kind_name(ErrorKind::InvalidValue),
                backend: None,
                operation: None,
            },
            BindError::Exported(_) => Facts {
                status: "HP_ERROR_BUFFER_EXPORTED".into(),
                code: -1,
                kind: "exported",
                backend: None,
                operation: None,
            },
            BindError::Unsupported(_) | BindError::Python(_) => Facts {
                status: ErrorKind::Unsupported.code_name().into(),
                code: ErrorKind::Unsupported.code().into(),
                kind: kind_name(ErrorKind::Unsupported),
                backend: None,
                operation: None,
            },
        }
    }

    fn exception_type<'py>(&self, py: Python<'py>, kind: &str) -> Bound<'py, pyo3::types::PyType> {
        use pyo3::PyTypeInfo;
        match (self, kind) {
            (
                BindError::Exported(_) | BindError::Swap(hprt_swap::SwapError::StorageInUse(_)),
                _,
            ) => match BUFFER_EXPORTED.get(py) {
                Some(t) => t.bind(py).clone(),
                None => HprtError::type_object(py),
            },
            (_, "out_of_memory") => OutOfMemoryError::type_object(py),
            (_, "invalid_handle") => InvalidHandleError::type_object(py),
            (_, "invalid_value" | "out_of_range") => InvalidValueError::type_object(py),
            (_, "unavailable") => UnavailableError::type_object(py),
            (_, "unsupported") => UnsupportedError::type_object(py),
            (BindError::Swap(hprt_swap::SwapError::HostBudgetExceeded { .. }), _) => {
                OutOfMemoryError::type_object(py)
            }
            (BindError::Swap(_), _) => SwapStateError::type_object(py),
            (BindError::Compress(hprt_compress::CompressError::InvalidArgument(_)), _) => {
                InvalidValueError::type_object(py)
            }
            (BindError::Compress(hprt_compress::CompressError::OutOfMemory { .. }), _) => {
                OutOfMemoryError::type_object(py)
            }
            (BindError::Compress(_), _) => CompressError::type_object(py),
            _ => HprtError::type_object(py),
        }
    }
}

fn compress_status(e: &hprt_compress::CompressError) -> &'static str {
    use hprt_compress::CompressError as C;
    match e {
        C::Corrupt { .. } => "HP_COMPRESS_CORRUPT",
        C::UnsupportedFormat(_) => "HP_COMPRESS_UNSUPPORTED_FORMAT",
        C::OutputTooLarge { .. } => "HP_COMPRESS_OUTPUT_TOO_LARGE",
        C::OutOfMemory { .. } => "HP_COMPRESS_OUT_OF_MEMORY",
        C::InvalidArgument(_) => "HP_COMPRESS_INVALID_ARGUMENT",
        C::InvalidState(_) => "HP_COMPRESS_INVALID_STATE",
        C::CostUnknown(_) => "HP_COMPRESS_COST_UNKNOWN",
        C::Platform(e) => e.kind.code_name(),
        C::Io { .. } => "HP_COMPRESS_IO",
    }
}

fn hsdp_status(e: &hprt_hsdp::HsdpError) -> &'static str {
    use hprt_hsdp::HsdpError as H;
    match e {
        H::InvalidMesh(_) => "HP_HSDP_INVALID_MESH",
        H::InvalidPlacement(_) => "HP_HSDP_INVALID_PLACEMENT",
        H::InvalidParam { .. } => "HP_HSDP_INVALID_PARAM",
        H::InvalidState { .. } => "HP_HSDP_INVALID_STATE",
        H::UnsupportedDType { .. } => "HP_HSDP_UNSUPPORTED_DTYPE",
        H::RankNotInMesh { .. } => "HP_HSDP_RANK_NOT_IN_MESH",
        H::Unsupported(_) => "HP_HSDP_UNSUPPORTED",
        H::Platform(e) => e.kind.code_name(),
    }
}

impl From<BindError> for PyErr {
    fn from(e: BindError) -> PyErr {
        if let BindError::Python(err) = e {
            return err;
        }
        let facts = e.facts();
        let text = e.to_string();
        // Platform errors already print their status name; others get it in front.
        let message = if text.contains(&facts.status) {
            text
        } else {
            format!("{}: {text}", facts.status)
        };
        Python::attach(|py| build_exception(py, &e, &facts, message).unwrap_or_else(|err| err))
    }
}

/// The exception object with its attributes set; a failure while building it is reported
/// instead (it is still a Python exception, never a panic).
fn build_exception(
    py: Python<'_>,
    e: &BindError,
    facts: &Facts,
    message: String,
) -> PyResult<PyErr> {
    let exc = e.exception_type(py, facts.kind).call1((message,))?;
    exc.setattr("status", &facts.status)?;
    exc.setattr("code", facts.code)?;
    exc.setattr("kind", facts.kind)?;
    exc.setattr("backend", facts.backend)?;
    exc.setattr("operation", facts.operation.as_deref())?;
    Ok(PyErr::from_value(exc))
}

/// `hprt.BufferExportedError`: an `HprtError` and a `BufferError` (made at import: a class with
/// two exception bases).
static BUFFER_EXPORTED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let bases = PyTuple::new(
        py,
        [
            py.get_type::<HprtError>().into_any(),
            py.get_type::<PyBufferError>().into_any(),
        ],
    )?;
    let ns = PyDict::new(py);
    ns.set_item(
        "__doc__",
        "Memory that a live DLPack export (a numpy array, a torch tensor) reads cannot be freed \
         or resized.",
    )?;
    ns.set_item("__module__", "hprt")?;
    let exported = py
        .get_type::<PyType>()
        .call1(("BufferExportedError", bases, ns))?
        .cast_into::<PyType>()?;
    m.add("BufferExportedError", &exported)?;
    let _ = BUFFER_EXPORTED.set(py, exported.unbind());
    m.add("HprtError", py.get_type::<HprtError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add("InvalidHandleError", py.get_type::<InvalidHandleError>())?;
    m.add("InvalidValueError", py.get_type::<InvalidValueError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("SwapStateError", py.get_type::<SwapStateError>())?;
    m.add("CompressError", py.get_type::<CompressError>())?;
    Ok(())
}
