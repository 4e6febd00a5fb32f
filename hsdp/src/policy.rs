//! Mixed precision and offload policies of a sharded parameter.

use hprt_platform::{DType, DeviceBuffer, Kernel, Place, Platform, Stream};

use crate::error::{HsdpError, Result};

/// Which dtypes a sharded parameter communicates and computes in. `None` keeps the dtype of the
/// stage before: the parameter's own dtype for `param_dtype`, `param_dtype` for `reduce_dtype`.
///
/// ```
/// use hprt_hsdp::MixedPrecisionPolicy;
/// use hprt_platform::DType;
/// // bf16 all-gather and compute, f32 gradient reduction, f32 stored shard.
/// let mp = MixedPrecisionPolicy {
///     param_dtype: Some(DType::BF16),
///     reduce_dtype: Some(DType::F32),
///     output_dtype: None,
/// };
/// assert_eq!(mp.param_dtype_for(DType::F32), DType::BF16);
/// assert_eq!(mp.reduce_dtype_for(DType::F32), DType::F32);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MixedPrecisionPolicy {
    /// The dtype of the all-gather and of the unsharded parameter.
    pub param_dtype: Option<DType>,
    /// The dtype gradients are accumulated unsharded and reduced in.
    pub reduce_dtype: Option<DType>,
    /// The dtype a module's outputs are cast to ([`MixedPrecisionPolicy::cast_output`]).
    pub output_dtype: Option<DType>,
}

impl MixedPrecisionPolicy {
    pub fn param_dtype_for(&self, orig: DType) -> DType {
        self.param_dtype.unwrap_or(orig)
    }
    pub fn reduce_dtype_for(&self, orig: DType) -> DType {
        self.reduce_dtype.unwrap_or(self.param_dtype_for(orig))
    }

    /// Casts `count` elements of an output from `src_dtype` into `dst` in the output dtype
    /// (a copy when there is none or it equals `src_dtype`), on `stream`. Returns the dtype
    /// written.
    pub fn cast_output(
        &self,
        platform: &dyn Platform,
        src: Place<&DeviceBuffer>,
        src_dtype: DType,
        dst: Place<&DeviceBuffer>,
        count: usize,
        stream: &Stream,
    ) -> Result<DType> {
        let dst_dtype = self.output_dtype.unwrap_or(src_dtype);
        platform.launch_kernel(
            Kernel::Cast {
                src,
                src_dtype,
                dst,
                dst_dtype,
                count,
            },
            stream,
        )?;
        Ok(dst_dtype)
    }

    pub(crate) fn check(&self, orig: DType) -> Result<()> {
        for (what, d) in [
            ("parameter", Some(orig)),
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
            ("output_dtype", self.output_dtype),
        ] {
            if let Some(d) = d {
                if !d.is_float() {
                    return Err(HsdpError::UnsupportedDType {
                        operation: "mixed precision policy",
                        dtype: d,
                        why: match what {
                            "parameter" => "sharded parameters are floating point",
                            _ => "policy dtypes are floating point",
                        },
                    });
                }
            }
        }
        Ok(())
    }
}

/// Where the sharded parameter and its sharded gradient live between uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadPolicy {
    /// In device memory.
    #[default]
    None,
    /// In pinned host memory; copied to the device for the all-gather and for gradient
    /// accumulation, so only the gathered parameter occupies device memory.
    PinnedHost,
}

// The names the bindings take (`offload_policy="pinned_host"`).
hprt_platform::named_enum!(OffloadPolicy, "offload policy", {
    None => "none",
    PinnedHost => "pinned_host",
});
