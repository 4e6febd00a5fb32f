//! Kernels of CUDA C modules that crates above the platform bring ([`DeviceModule`]): compiled
//! and cached per device by the same NVRTC path as the elementwise kernels, launched with the
//! caller's shape, and every buffer they point into marked as used by the stream, so it is not
//! freed under the launch.

use std::ffi::c_void;
use std::sync::Arc;

use super::{result, CudaBackend, MemObj, StreamObj};
use crate::backend::Place;
use crate::error::Result;
use crate::kernel::{DeviceModule, KernelArg, LaunchShape};

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
        // One 8-byte word per parameter; the driver reads as many bytes as the parameter has,
        // from the word's start (native byte order, so a u32 is its first four bytes).
        let mut words: Vec<[u8; 8]> = args
            .iter()
            .map(|a| match a {
                KernelArg::Ptr {
                    at: Some((m, off)), ..
                } => m.at(*off).to_ne_bytes(),
                KernelArg::Ptr { at: None, .. } => 0u64.to_ne_bytes(),
                KernelArg::U64(v) => v.to_ne_bytes(),
                KernelArg::U32(v) => {
                    let mut w = [0u8; 8];
                    w[..4].copy_from_slice(&v.to_ne_bytes());
                    w
                }
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = words.iter_mut().map(|w| w.as_mut_ptr().cast()).collect();
        // SAFETY: one word per kernel parameter, alive for the call (the driver copies them);
        // pointer arguments were bounds-checked by the dispatch layer; the context is bound.
        unsafe {
            result::module::launch(
                function,
                (shape.grid, 1, 1),
                (shape.block, 1, 1),
                0,
                stream.raw,
                &mut ptrs,
            )
        }?;
        for a in args {
            if let KernelArg::Ptr {
                at: Some((m, _)), ..
            } = a
            {
                m.used_on(stream.key())?;
            }
        }
        Ok(())
    }
}
