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
            src: s,
            dst: d,
            src_dtype,
            ..
        } = kernel
        {
            if kernel_name_is_copy(kernel) {
                if addr(s) != addr(d) {
                    let bytes = kernel.count() * src_dtype.size();
                    // SAFETY: both ranges were bounds-checked and do not overlap.
                    unsafe { result::mem::copy_async(addr(d), addr(s), bytes, stream.raw) }?;
                    s.mem.used_on(stream.key())?;
                    d.mem.used_on(stream.key())?;
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
            .all(|((p, _, _), dt)| addr(p) % dt.size() as u64 == 0)
            .into();
        let n = (kernel.count() as u64).to_ne_bytes();
        let aligned = word32(aligned.to_ne_bytes());
        let mut words = match *kernel {
            Kernel::Fill {
                dst: ref d, value, ..
            } => vec![addr(d).to_ne_bytes(), n, value.to_ne_bytes(), aligned],
            Kernel::Cast {
                src: ref s,
                dst: ref d,
                ..
            } => vec![addr(s).to_ne_bytes(), addr(d).to_ne_bytes(), n, aligned],
            Kernel::Scale {
                buf: ref b, factor, ..
            } => vec![addr(b).to_ne_bytes(), n, factor.to_ne_bytes(), aligned],
            Kernel::Axpy {
                src: ref s,
                dst: ref d,
                alpha,
                ..
            } => vec![
                addr(s).to_ne_bytes(),
                addr(d).to_ne_bytes(),
                n,
                alpha.to_ne_bytes(),
                aligned,
            ],
            Kernel::Matmul {
                ref a,
                ref b,
                ref c,
                m,
                n: cols,
                k,
                ..
            } => vec![
                addr(a).to_ne_bytes(),
                addr(b).to_ne_bytes(),
                addr(c).to_ne_bytes(),
                (m as u64).to_ne_bytes(),
                (cols as u64).to_ne_bytes(),
                (k as u64).to_ne_bytes(),
                aligned,
            ],
        };
        let shape = (kernels::grid_for(kernel.count()), kernels::BLOCK);
        self.launch_words(stream, function, shape, &mut words)?;
        for (p, _, _) in places {
            p.mem.used_on(stream.key())?;
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
        .map_or(std::ptr::null_mut(), |p| addr(p) as *mut c_void)
}
