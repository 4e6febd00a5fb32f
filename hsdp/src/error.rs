//! The one error type of `hprt-hsdp`.

use hprt_platform::{DType, HprtStatus};

/// What can go wrong while building meshes and groups or sharding, gathering and reducing.
#[derive(Debug, thiserror::Error)]
pub enum HsdpError {
    /// A platform operation failed (backend, operation, status code and name inside).
    #[error(transparent)]
    Platform(#[from] hprt_platform::Error),
    /// A mesh was described inconsistently (shape, rank list, dim names, axes).
    #[error("invalid device mesh: {0}")]
    InvalidMesh(String),
    /// A placement does not fit the parameter or the mesh.
    #[error("invalid placement: {0}")]
    InvalidPlacement(String),
    /// A parameter description or buffer does not fit what the operation needs.
    #[error("invalid parameter {param:?}: {message}")]
    InvalidParam { param: String, message: String },
    /// An operation was called in a state that does not allow it.
    #[error("parameter {param:?}: cannot {operation} while {state}")]
    InvalidState {
        param: String,
        operation: &'static str,
        state: &'static str,
    },
    /// A dtype combination that the operation does not support.
    #[error("{operation}: dtype {dtype} is not supported ({why})")]
    UnsupportedDType {
        operation: &'static str,
        dtype: DType,
        why: &'static str,
    },
    /// A rank is not part of the mesh or group it was used with.
    #[error("rank {rank} is not in {what}")]
    RankNotInMesh { rank: usize, what: String },
    /// Something the task describes but this crate does not implement.
    #[error("not implemented: {0}")]
    Unsupported(String),
}

hprt_platform::status_report! {
    /// How this error reports, the one table both bindings use: the C ABI's status and the
    /// status name Python's `HprtError.status` carries (`HP_HSDP_INVALID_MESH`, …; a platform
    /// error reports its own).
    HsdpError {
        Self::InvalidMesh(_) => (HprtStatus::ErrorInvalidValue, "HP_HSDP_INVALID_MESH"),
        Self::InvalidPlacement(_) => (HprtStatus::ErrorInvalidValue, "HP_HSDP_INVALID_PLACEMENT"),
        Self::InvalidParam { .. } => (HprtStatus::ErrorInvalidValue, "HP_HSDP_INVALID_PARAM"),
        Self::InvalidState { .. } => (HprtStatus::ErrorWrongState, "HP_HSDP_INVALID_STATE"),
        Self::UnsupportedDType { .. } => (
            HprtStatus::ErrorUnsupported,
            "HP_HSDP_UNSUPPORTED_DTYPE",
        ),
        Self::RankNotInMesh { .. } => (HprtStatus::ErrorInvalidValue, "HP_HSDP_RANK_NOT_IN_MESH"),
        Self::Unsupported(_) => (HprtStatus::ErrorUnsupported, "HP_HSDP_UNSUPPORTED"),
    }
}

pub type Result<T, E = HsdpError> = std::result::Result<T, E>;
