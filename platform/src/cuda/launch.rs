//! Kernel launches: the generated elementwise kernels (`kernels.rs`) compiled by NVRTC.

use super::*;

impl CudaBackend {
    pub(super) fn launch(
        &self,
        stream: &StreamObj,
        function: result::Function,
        count: usize,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: `args` point at locals of the caller matching the kernel's parameters, alive
        // for the call (the driver copies them); the stream's context is bound; the places
        // were bounds-checked and are kept live by their use events.
        unsafe {
            result::module::launch(
                function,
                (kernels::grid_for(count), 1, 1),
                (kernels::BLOCK, 1, 1),
                0,
                stream.raw,
                args,
            )
        }
    }

    /// Enqueues an elementwise kernel whose places were checked by the dispatch layer.
    pub(super) fn run_kernel(
        &self,
        kernel: &Kernel<Place<Arc<MemObj>>>,
        stream: &StreamObj,
    ) -> Result<()> {
        let op = kernel.name();
        self.shared.bind(stream.device)?;
        let places = kernel.places();
        if let Kernel::Cast {
            src: (s, so),
            dst: (d, doff),
            src_dtype,
            ..
        } = kernel
        {
            if kernel_name_is_copy(kernel) {
                if s.at(*so) != d.at(*doff) {
                    let bytes = kernel.count() * src_dtype.size();
                    // SAFETY: both ranges were bounds-checked and do not overlap.
                    unsafe { result::mem::copy_async(d.at(*doff), s.at(*so), bytes, stream.raw) }?;
                    s.used_on(stream.key())?;
                    d.used_on(stream.key())?;
                }
                return Ok(());
            }
        }
        let name = kernels::kernel_name(kernel).ok_or_else(|| {
            cuda_err(
                ErrorKind::Internal,
                op,
                "no device kernel for this operation",
            )
        })?;
        let function =
            self.shared
                .function(stream.device, kernels::MODULE, kernels::source, &name)?;
        let aligned: c_int = places
            .iter()
            .zip(kernel.place_dtypes())
            .all(|(((m, off), _, _), dt)| m.at(*off) % dt.size() as u64 == 0)
            .into();
        let mut n = kernel.count() as u64;
        let n_ptr: *mut c_void = (&mut n as *mut u64).cast();
        let a_ptr: *mut c_void = (&aligned as *const c_int).cast_mut().cast();
        match *kernel {
            Kernel::Fill {
                dst: (ref d, off),
                mut value,
                ..
            } => {
                let mut p = d.at(off);
                let mut args = [
                    (&mut p as *mut u64).cast(),
                    n_ptr,
                    (&mut value as *mut f64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Cast {
                src: (ref s, so),
                dst: (ref d, doff),
                ..
            } => {
                let (mut sp, mut dp) = (s.at(so), d.at(doff));
                let mut args = [
                    (&mut sp as *mut u64).cast(),
                    (&mut dp as *mut u64).cast(),
                    n_ptr,
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Scale {
                buf: (ref b, off),
                mut factor,
                ..
            } => {
                let mut p = b.at(off);
                let mut args = [
                    (&mut p as *mut u64).cast(),
                    n_ptr,
                    (&mut factor as *mut f64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Axpy {
                src: (ref s, so),
                dst: (ref d, doff),
                mut alpha,
                ..
            } => {
                let (mut sp, mut dp) = (s.at(so), d.at(doff));
                let mut args = [
                    (&mut sp as *mut u64).cast(),
                    (&mut dp as *mut u64).cast(),
                    n_ptr,
                    (&mut alpha as *mut f64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
            Kernel::Matmul {
                a: (ref a, ao),
                b: (ref b, bo),
                c: (ref c, co),
                m,
                n: cols,
                k,
                ..
            } => {
                let (mut ap, mut bp, mut cp) = (a.at(ao), b.at(bo), c.at(co));
                let (mut m64, mut n64, mut k64) = (m as u64, cols as u64, k as u64);
                let mut args = [
                    (&mut ap as *mut u64).cast(),
                    (&mut bp as *mut u64).cast(),
                    (&mut cp as *mut u64).cast(),
                    (&mut m64 as *mut u64).cast(),
                    (&mut n64 as *mut u64).cast(),
                    (&mut k64 as *mut u64).cast(),
                    a_ptr,
                ];
                self.launch(stream, function, kernel.count(), &mut args)?;
            }
        }
        for ((m, _), _, _) in places {
            m.used_on(stream.key())?;
        }
        Ok(())
    }
}

pub(super) fn kernel_name_is_copy<B>(k: &Kernel<B>) -> bool {
    kernels::kernel_name(k).is_none()
}

pub(super) fn ptr(place: &Option<Place<Arc<MemObj>>>) -> *mut c_void {
    place
        .as_ref()
        .map_or(std::ptr::null_mut(), |(m, o)| (m.ptr + o) as *mut c_void)
}
