//! Kernels of CUDA C modules that crates above the platform bring ([`DeviceModule`]): compiled
//! and cached per device by the same NVRTC path as the elementwise kernels, launched with the
//! caller's shape, and every buffer they point into marked as used by the stream, so it is not
//! freed under the launch.

use std::sync::Arc;

use super::launch::word32;
use super::memory::addr;
use super::{CudaBackend, MemObj, StreamObj};
use crate::error::Result;
use crate::kernel::{DeviceModule, KernelArg, LaunchShape};
use crate::place::Place;

impl CudaBackend {
    pub(super) fn run_module_kernel(
        &self,
        module: &DeviceModule,
        kernel: &str,
        shape: LaunchShape,
        args: &[KernelArg<Option<Place<Arc<MemObj>>>>],
        stream: &StreamObj,
    ) -> Result<()> {
        self.shared.bind(stream.device)?;
        let function = self.shared.function(
            stream.device,
            module.name,
            || module.source.to_string(),
            kernel,
        )?;
        let mut words: Vec<[u8; 8]> = args
            .iter()
            .map(|a| match a {
                KernelArg::Ptr { at: Some(p), .. } => addr(p).to_ne_bytes(),
                KernelArg::Ptr { at: None, .. } => 0u64.to_ne_bytes(),
                KernelArg::U64(v) => v.to_ne_bytes(),
                KernelArg::U32(v) => word32(v.to_ne_bytes()),
            })
            .collect();
        self.launch_words(stream, function, (shape.grid, shape.block), &mut words)?;
        for a in args {
            if let KernelArg::Ptr { at: Some(p), .. } = a {
                p.mem.used_on(stream.key())?;
            }
        }
        Ok(())
    }
}
