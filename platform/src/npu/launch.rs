//! Compute this ACL subset has no kernel for, done on the host in stream order (host steps),
//! and the `Avg` scale step built on it.

use super::*;

/// Divides `count` elements at `ptr` (host memory) by `n`, rounding once per element.
///
/// # Safety
/// `ptr` must address `count` elements of `dtype`, not touched by anyone else meanwhile.
pub(super) unsafe fn divide_in_place(ptr: usize, count: usize, dtype: DType, n: usize) {
    unsafe fn each<T: Copy>(ptr: usize, count: usize, f: impl Fn(T) -> T) {
        let p = ptr as *mut T;
        for i in 0..count {
            p.add(i).write_unaligned(f(p.add(i).read_unaligned()));
        }
    }
    match dtype {
        DType::F32 => each::<f32>(ptr, count, |x| x / n as f32),
        DType::F64 => each::<f64>(ptr, count, |x| x / n as f64),
        DType::F16 => each::<f16>(ptr, count, |x| f16::from_f32(x.to_f32() / n as f32)),
        DType::BF16 => each::<bf16>(ptr, count, |x| bf16::from_f32(x.to_f32() / n as f32)),
        DType::I8 => each::<i8>(ptr, count, |x| (i64::from(x) / n as i64) as i8),
        DType::U8 => each::<u8>(ptr, count, |x| (u64::from(x) / n as u64) as u8),
        DType::I32 => each::<i32>(ptr, count, |x| (i64::from(x) / n as i64) as i32),
        DType::I64 => each::<i64>(ptr, count, |x| (i128::from(x) / n as i128) as i64),
    }
}

impl NpuBackend {
    /// `buf = buf / n` on the stream (the scale step of `Avg`).
    pub(super) fn divide_on_stream(
        &self,
        place: &Place<Arc<MemObj>>,
        count: usize,
        dtype: DType,
        n: usize,
        stream: &StreamObj,
    ) -> Result<()> {
        let bytes = count * dtype.size();
        if bytes == 0 || n == 1 {
            return Ok(());
        }
        self.host_step(
            "all_reduce(avg)",
            vec![(place.clone(), bytes, Access::ReadWrite)],
            stream,
            // SAFETY: the staging copy holds `count` elements of `dtype`.
            move |staged| unsafe { divide_in_place(staged[0], count, dtype, n) },
        )
    }

    /// Device compute this ACL subset has no kernel for, done on the host in stream order:
    /// each place is copied D2H into pinned staging (unless only written), `compute` runs on the
    /// staging copies in a blocking host function, written places are copied back H2D, and the
    /// staging buffers return to the pool once the stream passed them.
    pub(super) fn host_step(
        &self,
        op: &'static str,
        places: Vec<(Place<Arc<MemObj>>, usize, Access)>,
        stream: &StreamObj,
        compute: impl FnOnce(&[usize]) + Send + 'static,
    ) -> Result<()> {
        if !stream.host_fns_ready() {
            return Err(host_fn_unsupported(op));
        }
        let api = self.api();
        let mut staged = Vec::with_capacity(places.len());
        let give_back = |staged: &[(usize, usize)]| {
            let mut pool = lock(&self.shared.staging);
            for &(p, b) in staged {
                pool.entry(b).or_default().push(p);
            }
        };
        for (_, bytes, _) in &places {
            match self.take_staging(*bytes) {
                Ok(p) => staged.push((p, *bytes)),
                Err(e) => {
                    give_back(&staged);
                    return Err(e);
                }
            }
        }
        for ((Place { mem, offset: off }, bytes, access), &(st, _)) in places.iter().zip(&staged) {
            if *access != Access::Write {
                let kind = memcpy_kind(CopyKind::DeviceToHost);
                // SAFETY: the device range is live and bounds-checked; staging is ours.
                unsafe {
                    result::mem::copy_async(
                        api,
                        st,
                        *bytes,
                        mem.ptr + off,
                        *bytes,
                        kind,
                        stream.raw,
                    )
                }?;
            }
        }
        let ptrs: Vec<usize> = staged.iter().map(|&(p, _)| p).collect();
        host_fn::launch(
            api,
            stream.raw.addr(),
            true,
            Box::new(move || compute(&ptrs)),
        )?;
        for ((Place { mem, offset: off }, bytes, access), &(st, _)) in places.iter().zip(&staged) {
            if *access != Access::Read {
                let (dst, dst_max) = (mem.ptr + off, mem.len - off);
                let kind = memcpy_kind(CopyKind::HostToDevice);
                // SAFETY: as above.
                unsafe {
                    result::mem::copy_async(api, dst, dst_max, st, *bytes, kind, stream.raw)
                }?;
            }
            mem.used_on(stream.raw)?;
        }
        // Only the pool travels into the callback: the report thread must never hold the last
        // reference to `Shared`, whose drop joins that thread.
        let pool = Arc::clone(&self.shared.staging);
        host_fn::launch(
            api,
            stream.raw.addr(),
            false,
            Box::new(move || {
                let mut pool = lock(&pool);
                for (p, b) in staged {
                    pool.entry(b).or_default().push(p);
                }
            }),
        )
    }
}

pub(super) fn host_fn_unsupported(op: &'static str) -> Error {
    let missing: Vec<&str> = OPTIONAL_SYMBOLS
        .iter()
        .copied()
        .filter(|s| s.contains("Report") || s.contains("Callback"))
        .collect();
    npu_err(
        ErrorKind::Unsupported,
        op,
        format!("{op} needs a host-function step on the stream ({missing:?}), unavailable on this stream or ACL build"),
    )
}
