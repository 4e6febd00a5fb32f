//! Raw-driver baselines for `hprt bench`: the copies and event records hprt issues, made with
//! bare cudarc calls on driver objects no hprt layer wraps, so the bench can report hprt's
//! overhead as a ratio measured in the same run.

use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::check::{cu, cuda_err};
use super::{
    CudaBackend, CU_EVENT_DISABLE_TIMING, CU_MEMHOSTALLOC_PORTABLE, CU_STREAM_NON_BLOCKING,
};
use crate::error::{ErrorKind, Result};
use crate::handle::CopyKind;

/// A raw stream, device buffer and pinned buffer, released on drop.
struct Raw {
    stream: cu::CUstream,
    device: cu::CUdeviceptr,
    host: *mut std::ffi::c_void,
    event: cu::CUevent,
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: objects created by `Raw::new` (null / 0 when not created); the stream is
        // synchronized first so nothing queued still uses the memory.
        unsafe {
            if !self.stream.is_null() {
                cu::cuStreamSynchronize(self.stream);
            }
            if !self.event.is_null() {
                cu::cuEventDestroy_v2(self.event);
            }
            if self.device != 0 {
                cu::cuMemFree_v2(self.device);
            }
            if !self.host.is_null() {
                cu::cuMemFreeHost(self.host);
            }
            if !self.stream.is_null() {
                cu::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

impl Raw {
    fn new(bytes: usize) -> Result<Raw> {
        let mut r = Raw {
            stream: std::ptr::null_mut(),
            device: 0,
            host: std::ptr::null_mut(),
            event: std::ptr::null_mut(),
        };
        // SAFETY: plain driver calls into fields that `Drop` releases.
        unsafe {
            cu(
                cu::cuStreamCreate(&mut r.stream, CU_STREAM_NON_BLOCKING),
                "cuStreamCreate",
            )?;
            cu(
                cu::cuEventCreate(&mut r.event, CU_EVENT_DISABLE_TIMING),
                "cuEventCreate",
            )?;
            if bytes > 0 {
                cu(cu::cuMemAlloc_v2(&mut r.device, bytes), "cuMemAlloc_v2")?;
                cu(
                    cu::cuMemHostAlloc(&mut r.host, bytes, CU_MEMHOSTALLOC_PORTABLE),
                    "cuMemHostAlloc",
                )?;
                // Real bytes in the source, as the hprt measurement writes them.
                std::ptr::write_bytes(r.host.cast::<u8>(), 0x5a, bytes);
            }
        }
        Ok(r)
    }
}

impl CudaBackend {
    /// Wall time of `reps` back-to-back `cuMemcpyAsync` of `bytes` between page-locked
    /// (portable, as hprt's) and device memory on a raw non-blocking stream, after one warm-up
    /// copy, up to the stream being synchronized: what `hprt bench` times for hprt's copies.
    /// `kind` is `HostToDevice` or `DeviceToHost`; the current device is used.
    pub fn raw_copy_time(&self, kind: CopyKind, bytes: usize, reps: usize) -> Result<Duration> {
        self.shared.bind_current()?;
        let r = Raw::new(bytes)?;
        let (dst, src) = match kind {
            CopyKind::HostToDevice => (r.device, r.host as u64),
            CopyKind::DeviceToHost => (r.host as u64, r.device),
            other => {
                return Err(cuda_err(
                    ErrorKind::InvalidValue,
                    "raw_copy_time",
                    format!("baselines exist for H2D and D2H, not {other:?}"),
                ))
            }
        };
        // SAFETY: both ranges hold `bytes`; the stream is live until `r` drops.
        unsafe {
            cu(
                cu::cuMemcpyAsync(dst, src, bytes, r.stream),
                "cuMemcpyAsync",
            )?;
            cu(cu::cuStreamSynchronize(r.stream), "cuStreamSynchronize")?;
            let t = Instant::now();
            for _ in 0..reps {
                cu(
                    cu::cuMemcpyAsync(dst, src, bytes, r.stream),
                    "cuMemcpyAsync",
                )?;
            }
            cu(cu::cuStreamSynchronize(r.stream), "cuStreamSynchronize")?;
            Ok(t.elapsed())
        }
    }

    /// Host time to enqueue `n` `cuEventRecord` of one non-timing event on a raw stream (the
    /// enqueue only; the stream is synchronized afterwards, outside the measurement).
    pub fn raw_event_record_time(&self, n: usize) -> Result<Duration> {
        self.shared.bind_current()?;
        let r = Raw::new(0)?;
        // SAFETY: live event and stream owned by `r`.
        unsafe {
            let t = Instant::now();
            for _ in 0..n {
                cu(cu::cuEventRecord(r.event, r.stream), "cuEventRecord")?;
            }
            let e = t.elapsed();
            cu(cu::cuStreamSynchronize(r.stream), "cuStreamSynchronize")?;
            Ok(e)
        }
    }
}
