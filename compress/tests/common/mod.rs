//! Helpers of the activation manager's tests: a cpu platform, a cost model, saved tensors
//! written asynchronously on the compute stream.

#![allow(dead_code)] // each test crate uses some of these

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hprt_compress::{CostModel, CostTable};
use hprt_platform::{
    CpuBackend, CpuConfig, DType, DeviceBuffer, Memory, Platform, Stream, TensorRef,
};

pub fn platform(jitter: Option<u64>) -> Arc<dyn Platform> {
    platform_with(jitter, 512 << 20)
}

pub fn platform_with(jitter: Option<u64>, device_memory: usize) -> Arc<dyn Platform> {
    Arc::new(CpuBackend::new(CpuConfig {
        device_memory,
        jitter,
        ..Default::default()
    }))
}

/// Encode/decode at 1 GB/s (bytes of original tensor), so a 1 ms window fits ~1 MB.
pub fn model() -> CostModel {
    CostModel::from_table(CostTable {
        encode_gbps: 1.0,
        decode_gbps: 1.0,
        ..Default::default()
    })
}

/// The first `numel` elements of `buf`, built field by field (unchecked: one test hands the
/// manager a tensor larger than its buffer).
pub fn saved(buf: DeviceBuffer, dtype: DType, numel: usize) -> TensorRef {
    TensorRef {
        len: numel * dtype.size(),
        storage: buf,
        offset: 0,
        dtype,
        shape: vec![numel],
    }
}

/// An activation written asynchronously on the compute stream (so a missing wait reads garbage).
pub fn produce(p: &dyn Platform, s: &Stream, data: &[u8]) -> DeviceBuffer {
    let buf = p.alloc_device(data.len()).unwrap();
    let staging = p.alloc_pinned(data.len()).unwrap();
    staging.write(0, data).unwrap();
    p.copy_async(
        Memory::Device(&buf),
        0,
        Memory::Pinned(&staging),
        0,
        data.len(),
        s,
    )
    .unwrap();
    buf
}

/// `data` written on `s` into a buffer of hprt's, then lent back as borrowed memory (a
/// framework's tensor): the flag turns true once the borrow is released.
pub fn borrowed(p: &dyn Platform, s: &Stream, data: &[u8]) -> (DeviceBuffer, Arc<AtomicBool>) {
    let owner = produce(p, s, data);
    let released = Arc::new(AtomicBool::new(false));
    let (flag, keep) = (released.clone(), owner.clone());
    // SAFETY: the release callback holds `owner`, so its memory outlives the borrow.
    let buf = unsafe {
        p.wrap_device_memory(
            owner.device_ptr(),
            data.len(),
            Some(Box::new(move || {
                drop(keep);
                flag.store(true, Ordering::SeqCst);
            })),
        )
    }
    .unwrap();
    (buf, released)
}
