//! All-gather and reduce-scatter through hsdp against the direct platform collective.

use hprt_platform::Platform;

use crate::error::{HsdpError, Result};

/// Markdown rows comparing hsdp's all-gather / reduce-scatter with the direct collective.
pub fn bench(_platform: &dyn Platform, _max_bytes: usize) -> Result<String, HsdpError> {
    Err(HsdpError::Unsupported("bench is being written".into()))
}
