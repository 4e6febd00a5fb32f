//! The one error type of `hprt-swap`.

use std::fmt;

use hprt_platform::HprtStatus;

/// Where a [`crate::SwapTensor`] is in its life cycle (see [`crate::SwapTensor`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SwapState {
    /// The bytes live on the device (the initial state of a device tensor).
    Device,
    /// A device-to-host copy was queued; the device bytes are still held.
    D2h,
    /// The copy completed and the device bytes were released; only the host copy exists.
    Host,
    /// A host-to-device copy was queued into re-acquired device storage.
    H2d,
    /// Not a device tensor: passed through untouched.
    NonTensor,
}

hprt_platform::named_enum!(SwapState, "swap state", {
    Device => "device",
    D2h => "d2h",
    Host => "host",
    H2d => "h2d",
    NonTensor => "non_tensor",
});

/// Everything that can go wrong in swap.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// A platform call failed (device out of memory on reload, a destroyed handle, …).
    #[error(transparent)]
    Platform(#[from] hprt_platform::Error),
    /// An operation was asked of a tensor in a state it does not accept.
    #[error("{operation} needs a tensor in state {expected}, this one is in state {actual}")]
    WrongState {
        operation: &'static str,
        expected: &'static str,
        actual: SwapState,
    },
    /// The framework changed the tensor (its version counter moved) after it was offloaded, so
    /// the host copy no longer matches what autograd saved.
    #[error("the tensor was modified after it was offloaded: version {saved} at offload, {current} at reload")]
    ModifiedSinceOffload { saved: u64, current: u64 },
    /// The codec failed (a corrupt encoding on decode, or a platform error inside it).
    #[error(transparent)]
    Codec(#[from] hprt_compress::CompressError),
    /// The owned storage was re-acquired (resized back) by someone other than swap after the
    /// offload released it, and may have been written: the host copy is not restored over it.
    #[error("the storage was re-acquired outside swap after it was offloaded; refusing to reload over it")]
    ReacquiredOutsideSwap,
    /// Someone resized the storage after it was offloaded.
    #[error(
        "the storage was resized after offload: expected 0 or {expected} bytes, found {actual}"
    )]
    StorageResized { expected: usize, actual: usize },
    /// A tensor description does not fit its storage.
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// An owned storage's memory was not released because a view of it is alive
    /// ([`crate::ReleaseGuard`]); the reason says whose.
    #[error("{0}")]
    StorageInUse(String),
    /// The pinned pool would grow past its configured host budget.
    #[error(
        "pinned host budget exceeded: {requested} more bytes asked, {held} of {budget} bytes held"
    )]
    HostBudgetExceeded {
        requested: usize,
        held: usize,
        budget: usize,
    },
    /// A layer, key, chunk or tag this front end does not know.
    #[error("unknown {what}: {id}")]
    Unknown { what: &'static str, id: String },
    /// Front-end calls out of the order the schedule needs (e.g. a group commit without a start).
    #[error("{0}")]
    Order(String),
}

hprt_platform::status_report! {
    /// How this error reports, the one table both bindings use: the C ABI's status
    /// (`hprt_platform::HprtStatus`) and the status name Python's `HprtError.status` carries
    /// (`HP_SWAP_WRONG_STATE`, …; a platform error reports its own, a codec error its status
    /// under the name `HP_SWAP_CODEC`).
    SwapError {
        Self::Codec(e) => (e.status(), "HP_SWAP_CODEC"),
        Self::WrongState { .. } => (HprtStatus::ErrorWrongState, "HP_SWAP_WRONG_STATE"),
        Self::Order(_) => (HprtStatus::ErrorWrongState, "HP_SWAP_ORDER"),
        Self::ModifiedSinceOffload { .. } => (
            HprtStatus::ErrorModifiedSinceOffload,
            "HP_SWAP_MODIFIED_SINCE_OFFLOAD",
        ),
        Self::StorageResized { .. } => (
            HprtStatus::ErrorModifiedSinceOffload,
            "HP_SWAP_STORAGE_RESIZED",
        ),
        Self::ReacquiredOutsideSwap => (
            HprtStatus::ErrorModifiedSinceOffload,
            "HP_SWAP_REACQUIRED_OUTSIDE_SWAP",
        ),
        Self::HostBudgetExceeded { .. } => (
            HprtStatus::ErrorOutOfMemory,
            "HP_SWAP_HOST_BUDGET_EXCEEDED",
        ),
        Self::InvalidTensor(_) => (HprtStatus::ErrorInvalidValue, "HP_SWAP_INVALID_TENSOR"),
        // As the bindings' own refusal of a free under a live export.
        Self::StorageInUse(_) => (HprtStatus::ErrorWrongState, "HP_ERROR_BUFFER_EXPORTED"),
        Self::Unknown { .. } => (HprtStatus::ErrorInvalidValue, "HP_SWAP_UNKNOWN"),
    }
}

impl SwapError {
    pub(crate) fn unknown(what: &'static str, id: impl fmt::Display) -> Self {
        SwapError::Unknown {
            what,
            id: id.to_string(),
        }
    }

    /// The platform error kind, when this is a platform error.
    pub fn platform_kind(&self) -> Option<hprt_platform::ErrorKind> {
        match self {
            SwapError::Platform(e) => Some(e.kind()),
            _ => None,
        }
    }
}

pub type Result<T, E = SwapError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Compression, EngineStats, PoolStats};

    #[test]
    fn each_error_reports_one_status_and_name() {
        let unknown = SwapError::unknown("layer", 3);
        assert_eq!(unknown.status(), HprtStatus::ErrorInvalidValue);
        assert_eq!(unknown.status_name(), "HP_SWAP_UNKNOWN");
        let budget = SwapError::HostBudgetExceeded {
            requested: 1,
            held: 2,
            budget: 2,
        };
        assert_eq!(budget.status(), HprtStatus::ErrorOutOfMemory);
        let codec = SwapError::Codec(hprt_compress::CompressError::Corrupt {
            at: 0,
            what: "x".into(),
        });
        assert_eq!(codec.status(), HprtStatus::ErrorCorruptData);
        assert_eq!(codec.status_name(), "HP_SWAP_CODEC");
        let platform = SwapError::Platform(hprt_platform::Error::new(
            hprt_platform::ErrorKind::OutOfMemory,
            hprt_platform::BackendKind::Cpu,
            "alloc",
            "full",
        ));
        assert_eq!(platform.status(), HprtStatus::ErrorOutOfMemory);
        assert_eq!(platform.status_name(), "HP_ERROR_OUT_OF_MEMORY");
    }

    #[test]
    fn names_parse_exactly() {
        for c in Compression::ALL {
            assert_eq!(c.to_string().parse::<Compression>(), Ok(c));
        }
        assert!("Auto".parse::<Compression>().is_err());
        assert!("host-stage".parse::<Compression>().is_err());
        assert_eq!("h2d".parse::<SwapState>(), Ok(SwapState::H2d));
    }

    #[test]
    fn stat_field_names_are_distinct() {
        let mut names: Vec<_> = EngineStats::default()
            .fields()
            .iter()
            .chain(PoolStats::default().fields().iter())
            .map(|(n, _)| *n)
            .collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
    }
}
