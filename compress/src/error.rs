//! The one error type of `hprt-compress`.

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

impl CompressError {
    pub(crate) fn corrupt(at: usize, what: impl Into<String>) -> Self {
        CompressError::Corrupt {
            at,
            what: what.into(),
        }
    }
}

pub type Result<T, E = CompressError> = std::result::Result<T, E>;
