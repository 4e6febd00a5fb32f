//! hprt-compress's lossless codec on numpy / torch tensors (by DLPack) and raw bytes.

use hprt_compress::codec::{self, DecodeOptions, EncodeOptions};
use hprt_compress::CodecDType;
use hprt_platform::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::dtype;
use crate::error::{alloc_refused, invalid, py_bytes, Result};

/// A DLPack producer's host memory, kept alive while it is read or written.
struct HostTensor {
    imported: dlpark::python::ImportedDlpack,
    ptr: usize,
    nbytes: usize,
    dtype: hprt_platform::DType,
}

impl HostTensor {
    fn import(obj: &Bound<'_, PyAny>) -> Result<Self> {
        let imported = dlpark::python::from_dlpack(obj.as_borrowed(), None, None)
            .map_err(|e| invalid(format!("DLPack import failed: {e}")))?;
        let t = imported
            .validate()
            .map_err(|e| invalid(format!("invalid DLPack tensor: {e}")))?;
        let dev = t.device().device_type;
        if !matches!(
            dev,
            dlpark::ffi::DLDeviceType::CPU | dlpark::ffi::DLDeviceType::CUDAHOST
        ) {
            return Err(invalid(format!(
                "the codec reads host memory; this tensor is on DLPack device type {}",
                dev.0
            )));
        }
        if !t.is_compact().map_err(|e| invalid(e.to_string()))? {
            return Err(invalid(
                "only dense row-major tensors; call .contiguous() first",
            ));
        }
        let dtype = dtype::from_dlpack(t.dtype())?;
        let nbytes = t.num_bytes();
        let ptr = t.data_ptr() as usize + t.byte_offset() as usize;
        Ok(HostTensor {
            imported,
            ptr,
            nbytes,
            dtype,
        })
    }

    fn bytes(&self) -> &[u8] {
        if self.nbytes == 0 {
            return &[];
        }
        // SAFETY: the validated dense host range of the imported tensor, alive while
        // `self.imported` is.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.nbytes) }
    }

    fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        if self
            .imported
            .flags()
            .contains(dlpark::DlpackFlags::READ_ONLY)
        {
            return Err(invalid("the output tensor is read-only"));
        }
        if self.nbytes == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `bytes`; the producer exported it writable, and the caller hands the
        // tensor over for the duration of the call.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.nbytes) })
    }
}

fn encode_options(chunk_elems: Option<usize>, threads: usize) -> EncodeOptions {
    let mut o = EncodeOptions::single_threaded();
    if let Some(c) = chunk_elems {
        o.chunk_elems = c;
    }
    o.threads = threads.max(1);
    o
}

fn decode_options(threads: usize, max_output: Option<usize>) -> DecodeOptions {
    DecodeOptions {
        threads: threads.max(1),
        max_output,
        ..Default::default()
    }
}

/// Compresses a f32 / f16 / bf16 tensor (numpy array, torch CPU tensor: anything with
/// `__dlpack__` in host memory) losslessly; returns the self-describing encoding.
#[pyfunction]
#[pyo3(signature = (tensor, chunk_elems=None, threads=1))]
pub fn compress<'py>(
    py: Python<'py>,
    tensor: &Bound<'py, PyAny>,
    chunk_elems: Option<usize>,
    threads: usize,
) -> Result<Bound<'py, PyBytes>> {
    let t = HostTensor::import(tensor)?;
    let dt = CodecDType::try_from(t.dtype)?;
    let opts = encode_options(chunk_elems, threads);
    let data = t.bytes();
    let out = py.detach(|| codec::encode(dt, data, &opts))?;
    py_bytes(py, &out, "the encoding")
}

/// Compresses raw little-endian bytes of `dtype` (`"f32"`, `"f16"`, `"bf16"`).
#[pyfunction]
#[pyo3(signature = (data, dtype, chunk_elems=None, threads=1))]
pub fn compress_bytes<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
    dtype: &str,
    chunk_elems: Option<usize>,
    threads: usize,
) -> Result<Bound<'py, PyBytes>> {
    let dt = CodecDType::try_from(dtype.parse::<DType>()?)?;
    let opts = encode_options(chunk_elems, threads);
    let bytes = data.as_bytes();
    let out = py.detach(|| codec::encode(dt, bytes, &opts))?;
    py_bytes(py, &out, "the encoding")
}

/// Decodes an encoding: `(data, dtype, numel)` with `data` the raw little-endian bytes.
/// `max_output` (bytes) refuses an encoding declaring more before anything is allocated
/// (`CompressError` with status `HP_COMPRESS_OUTPUT_TOO_LARGE`); set it for untrusted bytes.
/// The bytes object is decoded into directly: peak memory is the output once, plus scratch; its
/// pages are zero until a chunk is decoded into them, so an encoding refused at its first chunk
/// costs no resident memory. An output the allocator refuses is a `MemoryError` naming its size.
#[pyfunction]
#[pyo3(signature = (blob, threads=1, max_output=None))]
pub fn decompress<'py>(
    py: Python<'py>,
    blob: &Bound<'py, PyBytes>,
    threads: usize,
    max_output: Option<usize>,
) -> Result<(Bound<'py, PyBytes>, &'static str, usize)> {
    let bytes = blob.as_bytes();
    let opts = decode_options(threads, max_output);
    let h = codec::inspect(bytes)?.header;
    let len = codec::checked_output_len(&h, max_output)?;
    let out = zeroed_bytes(py, len)?;
    // SAFETY: `out` is a bytes object of `len` initialized (zero) bytes that this function made
    // and alone references (checked in `zeroed_bytes`); it is written only here, before anyone
    // else can see it, as `PyBytes::new_with` does.
    let dst =
        unsafe { std::slice::from_raw_parts_mut(ffi::PyBytes_AsString(out.as_ptr()).cast(), len) };
    py.detach(|| codec::decode_into(bytes, dst, &opts))?;
    Ok((out, h.dtype.dtype().name(), h.numel))
}

/// Outputs from this size on come from `bytes(len)`, which CPython allocates with `calloc`:
/// fresh pages, untouched (no resident memory) until written. Below it `PyBytes::new_with`
/// zero-fills, which costs nothing that matters.
const LAZY_ZERO_BYTES: usize = 1 << 20;

/// A new bytes object of `len` zero bytes, referenced only by the caller; a refused allocation is
/// a `MemoryError` naming the size.
fn zeroed_bytes(py: Python<'_>, len: usize) -> Result<Bound<'_, PyBytes>> {
    let refused = |e: PyErr| {
        let oom = e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py)
            || e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py);
        if oom {
            alloc_refused(
                len,
                "the decoded output (decompress(blob, max_output=...) refuses it before allocating)",
            )
        } else {
            e.into()
        }
    };
    if len >= LAZY_ZERO_BYTES {
        let made = py.get_type::<PyBytes>().call1((len,)).map_err(refused)?;
        // SAFETY: `made` is a live object; reading its reference count has no effect.
        if unsafe { ffi::Py_REFCNT(made.as_ptr()) } == 1 {
            if let Ok(b) = made.cast_into_exact::<PyBytes>() {
                if b.as_bytes().len() == len {
                    return Ok(b);
                }
            }
        }
    }
    PyBytes::new_with(py, len, |_| Ok(())).map_err(refused)
}

/// Decodes into `out`: a writable host tensor of exactly the encoded dtype (f16 and bf16 are
/// different dtypes of the same size) and byte length.
#[pyfunction]
#[pyo3(signature = (blob, out, threads=1))]
pub fn decompress_into(
    py: Python<'_>,
    blob: &Bound<'_, PyBytes>,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> Result<()> {
    let mut t = HostTensor::import(out)?;
    let header = codec::inspect(blob.as_bytes())?.header;
    if header.dtype.dtype() != t.dtype {
        return Err(invalid(format!(
            "the encoding holds {} elements, the output tensor is {}",
            header.dtype, t.dtype
        )));
    }
    let bytes = blob.as_bytes();
    let opts = decode_options(threads, None);
    let dst = t.bytes_mut()?;
    py.detach(|| codec::decode_into(bytes, dst, &opts))?;
    Ok(())
}

/// The header of an encoding: format version, dtype, numel, block (v1: chunk) size, encoded
/// and raw sizes.
#[pyfunction]
pub fn compressed_info<'py>(
    py: Python<'py>,
    blob: &Bound<'py, PyBytes>,
) -> Result<Bound<'py, PyDict>> {
    let p = codec::inspect(blob.as_bytes())?;
    let h = p.header;
    let d = PyDict::new(py);
    d.set_item("version", p.version)?;
    d.set_item("dtype", h.dtype.dtype().name())?;
    d.set_item("numel", h.numel)?;
    d.set_item("chunk_elems", h.chunk_elems)?;
    d.set_item("raw_bytes", h.output_len())?;
    d.set_item("encoded_bytes", blob.as_bytes().len())?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compress, m)?)?;
    m.add_function(wrap_pyfunction!(compress_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(decompress, m)?)?;
    m.add_function(wrap_pyfunction!(decompress_into, m)?)?;
    m.add_function(wrap_pyfunction!(compressed_info, m)?)?;
    Ok(())
}
