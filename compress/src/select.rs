//! Which device codec a platform gets ([`codec_for`]): the one place that chooses between the
//! device codecs of `device.rs` (the CPU codec in host functions, the CUDA kernels' launcher).

use std::sync::Arc;

use hprt_platform::Platform;

use crate::device::{CudaCodec, DeviceCodec, HostCodec};

/// The device codec for `platform`, chosen by its capabilities: a platform with a run-time
/// kernel compiler ([`Capabilities::kernel_compiler`], CUDA C) gets the CUDA kernels
/// ([`CudaCodec`], named `"cuda"`); the others (cpu, whose device memory is host memory; npu,
/// until an Ascend kernel exists) get the CPU codec through [`HostCodec`] (`"host"`).
///
/// [`Capabilities::kernel_compiler`]: hprt_platform::Capabilities::kernel_compiler
pub fn codec_for(platform: &dyn Platform) -> Arc<dyn DeviceCodec> {
    if platform.capabilities().kernel_compiler {
        Arc::new(CudaCodec::default())
    } else {
        Arc::new(HostCodec::default())
    }
}
