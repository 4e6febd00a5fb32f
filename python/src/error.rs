//! The crate's one error, and how it becomes a Python exception.
//!
//! Every failure reaches Python as `hprt.HprtError` (or one of its subclasses per kind), whose
//! message starts with the status name (`HP_ERROR_OUT_OF_MEMORY`, a driver's own name such as
//! `ACL_ERROR_RT_MEMORY_ALLOCATION`, or a swap error's name) and whose attributes `status`,
//! `code`, `kind`, `backend` and `operation` carry the same facts for programs.

use hprt_platform::{ErrorKind, HprtStatus};
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

/// A name none of an enum's spellings (a dtype, reduce op, compression mode, …).
impl From<hprt_platform::UnknownName> for BindError {
    fn from(e: hprt_platform::UnknownName) -> Self {
        BindError::InvalidArgument(e.to_string())
    }
}

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

/// Which layer an error comes from: the exception class is chosen from it and the status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// A platform error (also one a swap, codec or hsdp error wraps) or the binding's own.
    Platform,
    Swap,
    Compress,
    Hsdp,
    /// Memory a live DLPack export reads.
    Exported,
}

/// The status name, numeric code, kind name, backend and operation of an error, as Python sees
/// them, with the C status it reports as (the crates' one table: `status()` / `status_name()`).
struct Facts {
    family: Family,
    status: HprtStatus,
    status_name: String,
    code: i64,
    kind: &'static str,
    backend: Option<&'static str>,
    operation: Option<String>,
}

impl Facts {
    fn platform(e: &hprt_platform::Error) -> Facts {
        Facts {
            family: Family::Platform,
            status: e.status(),
            status_name: e.code_name.to_string(),
            code: e.code,
            kind: e.kind.name(),
            backend: Some(e.backend.name()),
            operation: Some(e.operation.to_string()),
        }
    }

    /// A binding error of platform `kind` (hprt's own code, no backend or operation).
    fn binding(kind: ErrorKind) -> Facts {
        Facts {
            family: Family::Platform,
            status: kind.status(),
            status_name: kind.code_name().into(),
            code: kind.code().into(),
            kind: kind.name(),
            backend: None,
            operation: None,
        }
    }

    /// A swap, compress or hsdp error of its own (`kind` is the family's name).
    fn layer(family: Family, kind: &'static str, status: HprtStatus, name: String) -> Facts {
        Facts {
            family,
            status,
            status_name: name,
            code: -1,
            kind,
            backend: None,
            operation: None,
        }
    }
}

impl BindError {
    fn facts(&self) -> Facts {
        use hprt_compress::CompressError as C;
        use hprt_hsdp::HsdpError as H;
        use hprt_swap::SwapError as S;
        match self {
            BindError::Platform(e)
            | BindError::Swap(S::Platform(e))
            | BindError::Hsdp(H::Platform(e))
            | BindError::Compress(C::Platform(e)) => Facts::platform(e),
            // A swap release refused under a live DLPack export: the bindings' own refusal.
            BindError::Swap(S::StorageInUse(_)) => BindError::Exported(String::new()).facts(),
            BindError::Swap(e) => {
                Facts::layer(Family::Swap, "swap", e.status(), e.status_name().into())
            }
            BindError::Hsdp(e) => {
                Facts::layer(Family::Hsdp, "hsdp", e.status(), e.status_name().into())
            }
            BindError::Compress(e) => Facts::layer(
                Family::Compress,
                "compress",
                e.status(),
                e.status_name().into(),
            ),
            BindError::InvalidArgument(_) => Facts::binding(ErrorKind::InvalidValue),
            BindError::Unsupported(_) | BindError::Python(_) => {
                Facts::binding(ErrorKind::Unsupported)
            }
            BindError::Exported(_) => Facts::layer(
                Family::Exported,
                "exported",
                HprtStatus::ErrorWrongState,
                "HP_ERROR_BUFFER_EXPORTED".into(),
            ),
        }
    }
}

/// The one table of exception classes: by the error's family and the status it reports as.
fn exception_type(py: Python<'_>, family: Family, status: HprtStatus) -> Bound<'_, PyType> {
    use pyo3::PyTypeInfo;
    use HprtStatus as S;
    match (family, status) {
        (Family::Exported, _) => match BUFFER_EXPORTED.get(py) {
            Some(t) => t.bind(py).clone(),
            None => HprtError::type_object(py),
        },
        (_, S::ErrorOutOfMemory) => OutOfMemoryError::type_object(py),
        (Family::Swap, _) => SwapStateError::type_object(py),
        (Family::Compress, S::ErrorInvalidValue) => InvalidValueError::type_object(py),
        (Family::Compress, _) => CompressError::type_object(py),
        (Family::Hsdp, _) => HprtError::type_object(py),
        (Family::Platform, S::ErrorInvalidHandle) => InvalidHandleError::type_object(py),
        (Family::Platform, S::ErrorInvalidValue | S::ErrorOutOfRange) => {
            InvalidValueError::type_object(py)
        }
        (Family::Platform, S::ErrorUnavailable) => UnavailableError::type_object(py),
        (Family::Platform, S::ErrorUnsupported) => UnsupportedError::type_object(py),
        (Family::Platform, _) => HprtError::type_object(py),
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
        let message = if text.contains(&facts.status_name) {
            text
        } else {
            format!("{}: {text}", facts.status_name)
        };
        Python::attach(|py| build_exception(py, &facts, message).unwrap_or_else(|err| err))
    }
}

/// The exception object with its attributes set; a failure while building it is reported
/// instead (it is still a Python exception, never a panic).
fn build_exception(py: Python<'_>, facts: &Facts, message: String) -> PyResult<PyErr> {
    let exc = exception_type(py, facts.family, facts.status).call1((message,))?;
    exc.setattr("status", &facts.status_name)?;
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
