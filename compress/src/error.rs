//! The one error type of `hprt-compress`.

use hprt_platform::HprtStatus;

/// Why a codec, cost-model, planner or manager operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CompressError {
    /// The bytes handed to the decoder are not a valid encoding (wrong magic, bad table,
    /// truncated, checksum mismatch, ...). `at` is the byte offset where the problem was seen.
    #[error("corrupt compressed data at byte {at}: {what}")]
    Corrupt { at: usize, what: String },
    /// A well-formed encoding of a format feature this build does not implement
    /// (a newer version, another interleave width).
    #[error("unsupported compressed data: {0}")]
    UnsupportedFormat(String),
    /// The encoding declares more output than the caller's limit allows
    /// (`DecodeOptions::max_output`, `hprt decompress --max-output`, `max_output=`).
    #[error("the encoding declares {declared} output bytes, above the limit of {limit}")]
    OutputTooLarge { declared: usize, limit: usize },
    /// The allocator refused the output buffer a (valid) encoding declares.
    #[error("cannot allocate the {bytes}-byte output the encoding declares")]
    OutOfMemory { bytes: usize },
    /// An argument the operation cannot accept (dtype without a codec, length not a whole
    /// number of elements, output buffer too small, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A tensor, layer or buffer was used in a state that does not allow the operation.
    #[error("invalid state: {0}")]
    InvalidState(String),
    /// The cost model has no figure for something it was asked to predict and no override.
    #[error("cost model: {0}")]
    CostUnknown(String),
    #[error(transparent)]
    Platform(#[from] hprt_platform::Error),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

hprt_platform::status_report! {
    /// How this error reports, the one table both bindings use: the C ABI's status and the
    /// status name Python's `HprtError.status` carries (`HP_COMPRESS_CORRUPT`, …; a platform
    /// error reports its own).
    CompressError {
        Self::Corrupt { .. } => (HprtStatus::ErrorCorruptData, "HP_COMPRESS_CORRUPT"),
        Self::UnsupportedFormat(_) => (
            HprtStatus::ErrorCorruptData,
            "HP_COMPRESS_UNSUPPORTED_FORMAT",
        ),
        Self::OutputTooLarge { .. } => (
            HprtStatus::ErrorBufferTooSmall,
            "HP_COMPRESS_OUTPUT_TOO_LARGE",
        ),
        Self::OutOfMemory { .. } => (HprtStatus::ErrorOutOfMemory, "HP_COMPRESS_OUT_OF_MEMORY"),
        Self::InvalidArgument(_) => (HprtStatus::ErrorInvalidValue, "HP_COMPRESS_INVALID_ARGUMENT"),
        Self::InvalidState(_) => (HprtStatus::ErrorWrongState, "HP_COMPRESS_INVALID_STATE"),
        Self::CostUnknown(_) => (HprtStatus::ErrorUnavailable, "HP_COMPRESS_COST_UNKNOWN"),
        Self::Io { .. } => (HprtStatus::ErrorInternal, "HP_COMPRESS_IO"),
    }
}

impl CompressError {
    pub(crate) fn corrupt(at: usize, what: impl Into<String>) -> Self {
        CompressError::Corrupt {
            at,
            what: what.into(),
        }
    }
}

pub type Result<T, E = CompressError> = std::result::Result<T, E>;
