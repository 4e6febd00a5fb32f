//! Kernel launches: the generated elementwise kernels (`kernels.rs`) compiled by NVRTC.

use super::*;

impl CudaBackend {
    /// Launches `function` with one 8-byte word per kernel parameter: the driver reads as many
    /// bytes as the parameter has, from the word's start (native byte order, so an `int` or a
    /// `u32` is its first four bytes). Used by the elementwise and the module kernels alike.
    pub(super) fn launch_words(
        &self,
        stream: &StreamObj,
        function: result::Function,
        (grid, block): (u32, u32),
        words: &mut [[u8; 8]],
    ) -> Result<()> {
        let mut ptrs: Vec<*mut c_void> = words.iter_mut().map(|w| w.as_mut_ptr().cast()).collect();
        // SAFETY: one word per kernel parameter, alive for the call (the driver copies them);
        // the stream's context is bound; the places were bounds-checked by the dispatch layer
        // and are kept live by their use events.
        unsafe {
            result::module::launch(
                function,
                (grid, 1, 1),
                (block, 1, 1),
                0,
                stream.raw,
                &mut ptrs,
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
        let n = (kernel.count() as u64).to_ne_bytes();
        let aligned = word32(aligned.to_ne_bytes());
        let mut words = match *kernel {
            Kernel::Fill {
                dst: (ref d, off),
                value,
                ..
            } => vec![d.at(off).to_ne_bytes(), n, value.to_ne_bytes(), aligned],
            Kernel::Cast {
                src: (ref s, so),
                dst: (ref d, doff),
                ..
            } => vec![s.at(so).to_ne_bytes(), d.at(doff).to_ne_bytes(), n, aligned],
            Kernel::Scale {
                buf: (ref b, off),
                factor,
                ..
            } => vec![b.at(off).to_ne_bytes(), n, factor.to_ne_bytes(), aligned],
            Kernel::Axpy {
                src: (ref s, so),
                dst: (ref d, doff),
                alpha,
                ..
            } => vec![
                s.at(so).to_ne_bytes(),
                d.at(doff).to_ne_bytes(),
                n,
                alpha.to_ne_bytes(),
                aligned,
            ],
            Kernel::Matmul {
                a: (ref a, ao),
                b: (ref b, bo),
                c: (ref c, co),
                m,
                n: cols,
                k,
                ..
            } => vec![
                a.at(ao).to_ne_bytes(),
                b.at(bo).to_ne_bytes(),
                c.at(co).to_ne_bytes(),
                (m as u64).to_ne_bytes(),
                (cols as u64).to_ne_bytes(),
                (k as u64).to_ne_bytes(),
                aligned,
            ],
        };
        let shape = (kernels::grid_for(kernel.count()), kernels::BLOCK);
        self.launch_words(stream, function, shape, &mut words)?;
        for ((m, _), _, _) in places {
            m.used_on(stream.key())?;
        }
        Ok(())
    }
}

/// A 4-byte kernel parameter (its native-order bytes) in its launch word.
pub(super) fn word32(bytes: [u8; 4]) -> [u8; 8] {
    let mut w = [0u8; 8];
    w[..4].copy_from_slice(&bytes);
    w
}

pub(super) fn kernel_name_is_copy<B>(k: &Kernel<B>) -> bool {
    kernels::kernel_name(k).is_none()
}

pub(super) fn ptr(place: &Option<Place<Arc<MemObj>>>) -> *mut c_void {
    place
        .as_ref()
        .map_or(std::ptr::null_mut(), |(m, o)| (m.ptr + o) as *mut c_void)
}
