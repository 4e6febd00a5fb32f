//! The v2 codec as CUDA C for NVRTC (`kernels.cu`): histogram, table build, block encode, the
//! exclusive scan that places blocks, placement and prefix, and the three decode steps; and
//! [`CudaCodec`], which launches them on a platform stream through the backend's NVRTC
//! ([`Platform::launch_module_kernel`]: compiled once per device and cached, like the
//! platform's elementwise kernels). Launch shapes are in the source's header comment.
//! (Over 800 lines because the launcher and its host-compiled byte-equality tests belong with
//! the source they check.)
//!
//! The same source is compiled as host C++ by this module's test and must write exactly the
//! bytes of the CPU codec (the corpus of `data` and random bit patterns) and decode them back,
//! as the platform's elementwise kernels are checked; `compress/tests/device.rs` runs
//! [`CudaCodec`] on the cuda backend over the CUDA emulator, whose NVRTC compiles the source
//! as host C++ with real blocks and threads.

use hprt_platform::{
    Access, BufRef, DeviceBuffer, DeviceModule, KernelArg, LaunchShape, Mem, Platform, Stream,
};

use crate::codec::{v2, EncodeOptions};
use crate::device::{CompressedTensor, DeviceCodec, PendingDecode, PendingEncode};
use crate::error::{CompressError, Result};
use crate::format::CodecDType;

/// The CUDA C source of the v2 codec kernels.
pub const SOURCE: &str = include_str!("kernels.cu");
/// The module for NVRTC; its name keys the backend's per-device cache.
pub const MODULE: DeviceModule = DeviceModule {
    name: "hprt_codec_v2.cu",
    source: SOURCE,
};
/// The kernels, in stream order for an encode and then a decode.
pub const KERNELS: [&str; 9] = [
    "hprt_codec_histogram",
    "hprt_codec_table",
    "hprt_codec_encode_blocks",
    "hprt_codec_scan",
    "hprt_codec_place",
    "hprt_codec_finish",
    "hprt_codec_decode_prefix",
    "hprt_codec_decode_blocks",
    "hprt_codec_decode_check",
];

/// Symbols of the widest alphabet (f32: sign and exponent); the kernels' tables have this many.
const TABLE: usize = 512;
/// Most blocks of one launch; the kernels loop over the rest.
const MAX_GRID: usize = 4096;

/// What a non-zero decoder status word of the kernels means.
pub fn status_message(status: u32) -> &'static str {
    match status {
        0 => "ok",
        1 => "bad header",
        2 => "header/table/index checksum mismatch",
        3 => "frequencies do not sum to 2^prob_bits",
        4 => "impossible block length or total length",
        5 => "non-zero padding bits after the last mantissa",
        6 => "rANS state outside [2^15, 2^31)",
        7 => "rANS stream does not end where it should",
        8 => "decoded data fails the tensor checksum",
        9 => "dtype or element count differs from the expected tensor",
        10 => "format version 1, which only the CPU codec decodes",
        _ => "unknown decoder status",
    }
}

/// The decoder's status word as a result: 0 is fine, 10 is a valid version-1 encoding (which
/// only the CPU codec decodes), anything else is corrupt input.
pub(crate) fn status_result(status: u32) -> Result<()> {
    match status {
        0 => Ok(()),
        10 => Err(CompressError::UnsupportedFormat(
            "format version 1 is decoded by the CPU codec (HostCodec), not the CUDA kernels".into(),
        )),
        s => Err(CompressError::corrupt(
            0,
            format!("the CUDA decoder reports status {s}: {}", status_message(s)),
        )),
    }
}

/// The v2 codec's CUDA kernels on a platform stream: the CPU codec's bytes for the same
/// options, with every step queued on the stream and nothing waited for until `finish`.
/// Only the cuda backend launches them; elsewhere launching is a typed `Unsupported` error.
#[derive(Clone, Debug, Default)]
pub struct CudaCodec {
    /// Block size and probability resolution (threads are the GPU's).
    pub encode: EncodeOptions,
}

/// Consecutive 8-byte-aligned ranges of one device workspace.
#[derive(Default)]
struct Layout {
    len: usize,
}

impl Layout {
    fn take(&mut self, bytes: usize) -> (usize, usize) {
        let at = self.len;
        self.len += bytes.div_ceil(8) * 8;
        (at, bytes)
    }
}

fn grid(work_items: usize) -> u32 {
    work_items.clamp(1, MAX_GRID) as u32
}

fn shape(grid: u32, block: u32) -> LaunchShape {
    LaunchShape { grid, block }
}

/// Runs one kernel of [`MODULE`].
fn launch(
    p: &dyn Platform,
    kernel: usize,
    shape: LaunchShape,
    args: &[KernelArg<BufRef<'_>>],
    s: &Stream,
) -> Result<()> {
    Ok(p.launch_module_kernel(&MODULE, KERNELS[kernel], shape, args, s)?)
}

fn ptr(buf: &DeviceBuffer, (at, bytes): (usize, usize), access: Access) -> KernelArg<BufRef<'_>> {
    KernelArg::Ptr {
        at: buf.at(at),
        bytes,
        access,
    }
}

/// A pinned word the stream copies `range` of `buf` into.
fn read_back(
    p: &dyn Platform,
    buf: &DeviceBuffer,
    (at, bytes): (usize, usize),
    s: &Stream,
) -> Result<hprt_platform::PinnedBuffer> {
    let word = p.alloc_pinned(bytes)?;
    p.copy_async(Mem::Pinned(&word), 0, Mem::Device(buf), at, bytes, s)?;
    Ok(word)
}

impl DeviceCodec for CudaCodec {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn max_encoded_len(&self, dtype: CodecDType, numel: usize) -> usize {
        v2::max_encoded_len(dtype, numel, self.encode.chunk_elems)
    }

    fn encode_async(
        &self,
        p: &dyn Platform,
        src: BufRef<'_>,
        dtype: CodecDType,
        numel: usize,
        scratch: &DeviceBuffer,
        s: &Stream,
    ) -> Result<PendingEncode> {
        use Access::{Read, ReadWrite, Write};
        use KernelArg::{U32, U64};
        self.encode.validate(v2::BLOCK_ALIGN)?;
        if numel >= v2::MAX_NUMEL {
            return Err(CompressError::InvalidArgument(format!(
                "{numel} elements: version 2 encodes fewer than 2^48"
            )));
        }
        let max = self.max_encoded_len(dtype, numel);
        if scratch.len() < max {
            return Err(CompressError::InvalidArgument(format!(
                "scratch buffer of {} bytes is below the worst case of {max}",
                scratch.len()
            )));
        }
        let (size, w, block) = (dtype.size(), dtype.mantissa_bits(), self.encode.chunk_elems);
        let alphabet = 1u32 << dtype.symbol_bits();
        let nblocks = numel.div_ceil(block);
        // A slot holds one block's payload (at most its raw bytes) until it is placed.
        let slot_bytes = block.min(numel) * size;
        let mut l = Layout::default();
        let (hist, terms) = (l.take(TABLE * 8), l.take(8));
        let (freq, cum) = (l.take(TABLE * 4), l.take(TABLE * 4));
        let (lens, offsets) = (l.take(nblocks * 4), l.take(nblocks * 8));
        let (total, prefix, out_len) = (l.take(8), l.take(8), l.take(8));
        let slots = l.take(nblocks * slot_bytes);
        let ws = p.alloc_device(l.len)?;
        let input = KernelArg::Ptr {
            at: src,
            bytes: numel * size,
            access: Read,
        };
        let out = ptr(scratch, (0, max), ReadWrite);
        let (pb, n, nb) = (self.encode.prob_bits, numel as u64, nblocks as u64);
        // The histogram accumulates into its counts and checksum terms.
        p.memset_async(&ws, hist.0, 0, terms.0 + terms.1 - hist.0, s)?;
        let hist_grid = grid(numel.div_ceil(256));
        launch(
            p,
            0,
            shape(hist_grid, 256),
            &[
                input,
                U64(n),
                U32(size as u32),
                U32(w),
                ptr(&ws, hist, ReadWrite),
                ptr(&ws, terms, ReadWrite),
            ],
            s,
        )?;
        launch(
            p,
            1,
            shape(1, 512),
            &[
                ptr(&ws, hist, Read),
                U32(alphabet),
                U32(pb),
                ptr(&ws, freq, Write),
                ptr(&ws, cum, Write),
            ],
            s,
        )?;
        launch(
            p,
            2,
            shape(grid(nblocks), 32),
            &[
                input,
                U64(n),
                U32(size as u32),
                U32(w),
                U32(pb),
                U32(block as u32),
                ptr(&ws, freq, Read),
                ptr(&ws, cum, Read),
                ptr(&ws, slots, Write),
                ptr(&ws, lens, Write),
            ],
            s,
        )?;
        launch(
            p,
            3,
            shape(1, 256),
            &[
                ptr(&ws, lens, Read),
                U64(nb),
                ptr(&ws, freq, Read),
                U32(alphabet),
                ptr(&ws, offsets, Write),
                ptr(&ws, total, Write),
                ptr(&ws, prefix, Write),
            ],
            s,
        )?;
        launch(
            p,
            4,
            shape(grid(nblocks), 256),
            &[
                ptr(&ws, slots, Read),
                U64(slot_bytes as u64),
                ptr(&ws, lens, Read),
                ptr(&ws, offsets, Read),
                U64(nb),
                out,
                ptr(&ws, prefix, Read),
            ],
            s,
        )?;
        launch(
            p,
            5,
            shape(1, 1),
            &[
                out,
                U32(dtype.code() as u32),
                U32(alphabet),
                U32(pb),
                U32(block as u32),
                U64(n),
                U32(size as u32),
                ptr(&ws, freq, Read),
                ptr(&ws, lens, Read),
                U64(nb),
                ptr(&ws, total, Read),
                ptr(&ws, terms, Read),
                ptr(&ws, prefix, Read),
                ptr(&ws, out_len, Write),
            ],
            s,
        )?;
        let len = read_back(p, &ws, out_len, s)?;
        let done = p.create_event(false)?;
        p.record_event(&done, s)?;
        Ok(PendingEncode::from_device(
            scratch,
            done,
            len,
            dtype,
            numel,
            vec![ws],
        ))
    }

    fn decode_async(
        &self,
        p: &dyn Platform,
        src: &CompressedTensor,
        dst: BufRef<'_>,
        s: &Stream,
    ) -> Result<PendingDecode> {
        use Access::{Read, ReadWrite, Write};
        use KernelArg::{U32, U64};
        let (dtype, numel, enc_len) = (src.dtype(), src.numel(), src.byte_len());
        let (size, w) = (dtype.size(), dtype.mantissa_bits());
        // Every block holds at least 32 elements and has a 4-byte index entry: this bounds the
        // blocks the decoder accepts whatever the header declares.
        let max_blocks = numel.div_ceil(v2::BLOCK_ALIGN).min(enc_len / 4);
        let mut l = Layout::default();
        let (freq, cum) = (l.take(TABLE * 4), l.take(TABLE * 4));
        let offsets = l.take(max_blocks.max(1) * 8);
        let (data_check, terms, status) = (l.take(8), l.take(8), l.take(4));
        let ws = p.alloc_device(l.len)?;
        let enc = KernelArg::Ptr {
            at: src.device_buffer().at(0),
            bytes: enc_len,
            access: Read,
        };
        let out = KernelArg::Ptr {
            at: dst,
            bytes: src.original_len(),
            access: Write,
        };
        let (n, el) = (numel as u64, enc_len as u64);
        p.memset_async(&ws, terms.0, 0, 8, s)?;
        launch(
            p,
            6,
            shape(1, 1),
            &[
                enc,
                U64(el),
                U32(dtype.code() as u32),
                U32(1 << dtype.symbol_bits()),
                U32(size as u32),
                U32(w),
                U64(n),
                U64(max_blocks as u64),
                ptr(&ws, freq, Write),
                ptr(&ws, cum, Write),
                ptr(&ws, offsets, Write),
                ptr(&ws, data_check, Write),
                ptr(&ws, status, Write),
            ],
            s,
        )?;
        launch(
            p,
            7,
            shape(grid(max_blocks), 32),
            &[
                enc,
                U64(el),
                U32(size as u32),
                U32(w),
                U64(n),
                ptr(&ws, freq, Read),
                ptr(&ws, cum, Read),
                ptr(&ws, offsets, Read),
                out,
                ptr(&ws, terms, ReadWrite),
                ptr(&ws, status, ReadWrite),
            ],
            s,
        )?;
        launch(
            p,
            8,
            shape(1, 1),
            &[
                ptr(&ws, terms, Read),
                U64(src.original_len() as u64),
                ptr(&ws, data_check, Read),
                ptr(&ws, status, ReadWrite),
            ],
            s,
        )?;
        let status = read_back(p, &ws, status, s)?;
        let done = p.create_event(false)?;
        p.record_event(&done, s)?;
        Ok(PendingDecode::from_device(done, status, vec![ws]))
    }
}

#[cfg(test)]
mod host_compiled {
    use super::*;
    use crate::codec::{encode, v2, EncodeOptions};
    use crate::data::{generate, DataKind, SplitMix64};
    use crate::CodecDType;

    /// CUDA's launch variables and primitives for a one-thread launch (see `kernels.cu`).
    const SHIM: &str = r#"
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct HprtDim { unsigned int x; };
static const HprtDim blockIdx = {0}, threadIdx = {0}, blockDim = {1}, gridDim = {1};
static inline void __syncthreads() {}
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { unsigned int o = *p; *p += v; return o; }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { unsigned long long o = *p; *p += v; return o; }
static inline unsigned int atomicOr(unsigned int* p, unsigned int v) { unsigned int o = *p; *p |= v; return o; }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
"#;

    /// The compiled source, built once per process; the lock serialises the tests, because
    /// the host build's `__shared__` arrays are statics.
    fn library() -> std::sync::MutexGuard<'static, libloading::Library> {
        static LIB: std::sync::OnceLock<std::sync::Mutex<libloading::Library>> =
            std::sync::OnceLock::new();
        hprt_platform::sync::lock(LIB.get_or_init(|| std::sync::Mutex::new(compile())))
    }

    fn compile() -> libloading::Library {
        let dir = std::env::temp_dir().join(format!("hprt-codec-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, lib) = (dir.join("codec.cpp"), dir.join("libcodec.so"));
        std::fs::write(&src, format!("{SHIM}\n{SOURCE}")).unwrap();
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = std::process::Command::new(&cxx)
            .args([
                "-std=c++14",
                "-O2",
                "-shared",
                "-fPIC",
                "-Wall",
                "-Werror",
                "-o",
            ])
            .arg(&lib)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the C++ compiler {cxx:?}: {e}"));
        assert!(
            out.status.success(),
            "the codec kernel source does not compile:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: a library we just built from our own source.
        unsafe { libloading::Library::new(&lib) }.unwrap()
    }

    type Hist = unsafe extern "C" fn(*const u8, u64, u32, u32, *mut u64, *mut u64);
    type Table = unsafe extern "C" fn(*const u64, u32, u32, *mut u32, *mut u32);
    type EncodeBlocks = unsafe extern "C" fn(
        *const u8,
        u64,
        u32,
        u32,
        u32,
        u32,
        *const u32,
        *const u32,
        *mut u8,
        *mut u32,
    );
    type Scan =
        unsafe extern "C" fn(*const u32, u64, *const u32, u32, *mut u64, *mut u64, *mut u64);
    type Place =
        unsafe extern "C" fn(*const u8, u64, *const u32, *const u64, u64, *mut u8, *const u64);
    type Finish = unsafe extern "C" fn(
        *mut u8,
        u32,
        u32,
        u32,
        u32,
        u64,
        u32,
        *const u32,
        *const u32,
        u64,
        *const u64,
        *const u64,
        *const u64,
        *mut u64,
    );
    type DecodePrefix = unsafe extern "C" fn(
        *const u8,
        u64,
        u32,
        u32,
        u32,
        u32,
        u64,
        u64,
        *mut u32,
        *mut u32,
        *mut u64,
        *mut u64,
        *mut u32,
    );
    type DecodeBlocks = unsafe extern "C" fn(
        *const u8,
        u64,
        u32,
        u32,
        u64,
        *const u32,
        *const u32,
        *const u64,
        *mut u8,
        *mut u64,
        *mut u32,
    );
    type DecodeCheck = unsafe extern "C" fn(*const u64, u64, *const u64, *mut u32);

    fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> T {
        // SAFETY: the types above are the signatures `kernels.cu` defines.
        unsafe { *lib.get::<T>(format!("{name}\0").as_bytes()).unwrap() }
    }

    /// The encode kernels in stream order on host memory.
    fn kernel_encode(
        lib: &libloading::Library,
        dtype: CodecDType,
        data: &[u8],
        pb: u32,
        block: usize,
    ) -> Vec<u8> {
        let (size, w) = (dtype.size() as u32, dtype.mantissa_bits());
        let numel = data.len() / dtype.size();
        let alphabet = 1u32 << dtype.symbol_bits();
        let nblocks = numel.div_ceil(block);
        let slot_bytes = block.min(numel) * dtype.size();
        let (mut hist, mut terms) = (vec![0u64; 512], 0u64);
        let (mut freq, mut cum) = (vec![0u32; 512], vec![0u32; 512]);
        let mut slots = vec![0u8; nblocks * slot_bytes];
        let mut lens = vec![0u32; nblocks];
        let (mut offsets, mut total) = (vec![0u64; nblocks], 0u64);
        let mut out = vec![0u8; v2::max_encoded_len(dtype, numel, block)];
        let (mut prefix_len, mut out_len) = (0u64, 0u64);
        // SAFETY: every buffer has the size the kernels index (see `kernels.cu`).
        unsafe {
            sym::<Hist>(lib, KERNELS[0])(
                data.as_ptr(),
                numel as u64,
                size,
                w,
                hist.as_mut_ptr(),
                &mut terms,
            );
            sym::<Table>(lib, KERNELS[1])(
                hist.as_ptr(),
                alphabet,
                pb,
                freq.as_mut_ptr(),
                cum.as_mut_ptr(),
            );
            sym::<EncodeBlocks>(lib, KERNELS[2])(
                data.as_ptr(),
                numel as u64,
                size,
                w,
                pb,
                block as u32,
                freq.as_ptr(),
                cum.as_ptr(),
                slots.as_mut_ptr(),
                lens.as_mut_ptr(),
            );
            sym::<Scan>(lib, KERNELS[3])(
                lens.as_ptr(),
                nblocks as u64,
                freq.as_ptr(),
                alphabet,
                offsets.as_mut_ptr(),
                &mut total,
                &mut prefix_len,
            );
            sym::<Place>(lib, KERNELS[4])(
                slots.as_ptr(),
                slot_bytes as u64,
                lens.as_ptr(),
                offsets.as_ptr(),
                nblocks as u64,
                out.as_mut_ptr(),
                &prefix_len,
            );
            sym::<Finish>(lib, KERNELS[5])(
                out.as_mut_ptr(),
                dtype.code() as u32,
                alphabet,
                pb,
                block as u32,
                numel as u64,
                size,
                freq.as_ptr(),
                lens.as_ptr(),
                nblocks as u64,
                &total,
                &terms,
                &prefix_len,
                &mut out_len,
            );
        }
        out.truncate(out_len as usize);
        out
    }

    /// The decode kernels in stream order; the decoded bytes and the status word.
    fn kernel_decode(
        lib: &libloading::Library,
        dtype: CodecDType,
        numel: usize,
        enc: &[u8],
    ) -> (Vec<u8>, u32) {
        let (size, w) = (dtype.size() as u32, dtype.mantissa_bits());
        let alphabet = 1u32 << dtype.symbol_bits();
        let max_blocks = numel.div_ceil(v2::BLOCK_ALIGN).min(enc.len() / 4);
        let (mut freq, mut cum) = (vec![0u32; 512], vec![0u32; 512]);
        let mut offsets = vec![0u64; max_blocks.max(1)];
        let (mut data_check, mut status, mut terms) = (0u64, 0u32, 0u64);
        let mut out = vec![0u8; numel * dtype.size()];
        // SAFETY: as above; decode_prefix bounds the blocks by `max_blocks`.
        unsafe {
            sym::<DecodePrefix>(lib, KERNELS[6])(
                enc.as_ptr(),
                enc.len() as u64,
                dtype.code() as u32,
                alphabet,
                size,
                w,
                numel as u64,
                max_blocks as u64,
                freq.as_mut_ptr(),
                cum.as_mut_ptr(),
                offsets.as_mut_ptr(),
                &mut data_check,
                &mut status,
            );
            sym::<DecodeBlocks>(lib, KERNELS[7])(
                enc.as_ptr(),
                enc.len() as u64,
                size,
                w,
                numel as u64,
                freq.as_ptr(),
                cum.as_ptr(),
                offsets.as_ptr(),
                out.as_mut_ptr(),
                &mut terms,
                &mut status,
            );
            sym::<DecodeCheck>(lib, KERNELS[8])(&terms, out.len() as u64, &data_check, &mut status);
        }
        (out, status)
    }

    fn corpus() -> Vec<(CodecDType, Vec<u8>)> {
        let mut rng = SplitMix64::new(99);
        let mut out = Vec::new();
        for dtype in CodecDType::ALL {
            for kind in DataKind::ALL {
                out.push((dtype, generate(kind, dtype, 20_000 + 13, 3)));
            }
            // Random bit patterns: every symbol, NaN payloads, subnormals.
            let n = 5_000 * dtype.size() + dtype.size() * 7;
            out.push((dtype, (0..n).map(|_| rng.next_u64() as u8).collect()));
            // Skewed random patterns: few symbols, random mantissas.
            out.push((
                dtype,
                (0..4_001)
                    .flat_map(|_| {
                        let r = rng.next_u64();
                        let v = (r >> 40) as u32 & 0x3 | (r as u32) << 2;
                        v.to_le_bytes()[..dtype.size()].to_vec()
                    })
                    .collect(),
            ));
        }
        out
    }

    #[test]
    fn table_kernel_normalises_as_the_cpu_codec_with_ties_either_way() {
        let lib = library();
        let mut r = SplitMix64::new(11);
        let mut cases: Vec<(u32, u32, Vec<u64>)> = Vec::new();
        for pb in [9, 12, 14] {
            for alphabet in [64u32, 512] {
                let a = alphabet as usize;
                let counts = |f: &mut dyn FnMut(usize) -> u64| -> Vec<u64> {
                    (0..512).map(|s| if s < a { f(s) } else { 0 }).collect()
                };
                // Equal counts (every unit moved is a tie), few distinct counts (rounding
                // pushes the sum over or under M), skewed, random, a lone and no symbol.
                cases.push((pb, alphabet, counts(&mut |_| 3)));
                cases.push((
                    pb,
                    alphabet,
                    counts(&mut |s| if s % 3 == 0 { 7 } else { 0 }),
                ));
                cases.push((pb, alphabet, counts(&mut |_| 1 + r.next_u64() % 3)));
                cases.push((pb, alphabet, counts(&mut |s| 1_000_000 >> (s / 2).min(19))));
                cases.push((pb, alphabet, counts(&mut |_| r.next_u64() % 1000)));
                cases.push((pb, alphabet, counts(&mut |s| (s == 5) as u64 * 9)));
                cases.push((pb, alphabet, counts(&mut |_| 0)));
            }
        }
        for (pb, alphabet, counts) in cases {
            let (mut freq, mut cum) = (vec![0u32; 512], vec![0u32; 512]);
            // SAFETY: 512 entries each, as the kernel indexes below `alphabet`.
            unsafe {
                sym::<Table>(&lib, KERNELS[1])(
                    counts.as_ptr(),
                    alphabet,
                    pb,
                    freq.as_mut_ptr(),
                    cum.as_mut_ptr(),
                )
            };
            let a = alphabet as usize;
            assert_eq!(
                freq[..a],
                v2::normalize(&counts[..a], pb)[..],
                "{pb} bits, {counts:?}"
            );
            let mut c = 0;
            for s in 0..a {
                assert_eq!(cum[s], c);
                c += freq[s];
            }
        }
    }

    #[test]
    fn kernels_write_the_cpu_codecs_bytes_and_decode_them() {
        let lib = library();
        for (dtype, data) in corpus() {
            for (pb, block) in [(12, v2::DEFAULT_BLOCK_ELEMS), (11, 1024), (14, 96)] {
                let opts = EncodeOptions {
                    chunk_elems: block,
                    prob_bits: pb,
                    threads: 1,
                };
                let cpu = encode(dtype, &data, &opts).unwrap();
                let dev = kernel_encode(&lib, dtype, &data, pb, block);
                assert!(
                    dev == cpu,
                    "{dtype}, {pb} bits, blocks of {block}: the bytes differ"
                );
                let numel = data.len() / dtype.size();
                let (back, status) = kernel_decode(&lib, dtype, numel, &cpu);
                assert_eq!(status, 0, "{dtype}: {}", status_message(status));
                assert!(back == data, "{dtype}: the kernels decode other bytes");
            }
        }
    }

    /// Differential check: on mutated encodings (random bytes anywhere; table, index and
    /// header fields rewritten with the prefix checksum resealed) the kernels accept exactly
    /// what the CPU decoder accepts for the expected tensor, and decode the same bytes.
    #[test]
    fn kernel_decoder_agrees_with_the_cpu_decoder_on_mutated_encodings() {
        let lib = library();
        let mut rng = SplitMix64::new(2026);
        let random: Vec<u8> = (0..4 * 1_000).map(|_| rng.next_u64() as u8).collect();
        let cases = [
            (
                CodecDType::BF16,
                generate(DataKind::Gelu, CodecDType::BF16, 3_000, 1),
                256,
            ),
            (
                CodecDType::F16,
                generate(DataKind::Softmax, CodecDType::F16, 2_000, 2),
                512,
            ),
            (CodecDType::F32, random, 96),
        ];
        let (mut accepted, mut rejected) = (0, 0);
        for (dtype, data, block) in cases {
            let opts = EncodeOptions {
                chunk_elems: block,
                prob_bits: 12,
                threads: 1,
            };
            let enc = encode(dtype, &data, &opts).unwrap();
            let prefix = crate::codec::inspect(&enc).unwrap().offsets[0];
            let numel = data.len() / dtype.size();
            for i in 0..1_500 {
                let mut m = enc.clone();
                let r = rng.next_u64();
                let at = (r >> 8) as usize % m.len();
                match i % 3 {
                    0 => m[at] ^= 1 << (r % 8),
                    1 => m[at] = (r >> 40) as u8,
                    _ => {
                        // A prefix field rewritten by someone who knows the checksum.
                        m[at % prefix] = (r >> 40) as u8;
                        v2::seal(&mut m[..prefix]);
                    }
                }
                let cpu = crate::codec::decode(&m)
                    .ok()
                    .filter(|d| d.dtype == dtype && d.numel == numel)
                    .map(|d| d.data);
                let (back, status) = kernel_decode(&lib, dtype, numel, &m);
                match cpu {
                    Some(d) => {
                        assert_eq!(
                            status,
                            0,
                            "{dtype} mutation {i}: {}",
                            status_message(status)
                        );
                        assert!(
                            back == d,
                            "{dtype} mutation {i}: other bytes than the CPU's"
                        );
                        accepted += 1;
                    }
                    None => {
                        assert_ne!(
                            status, 0,
                            "{dtype} mutation {i}: the CPU decoder refuses it"
                        );
                        rejected += 1;
                    }
                }
            }
        }
        assert!(
            accepted > 0 && rejected > 0,
            "{accepted} accepted, {rejected} rejected"
        );
    }

    #[test]
    fn kernel_decoder_rejects_or_survives_every_bit_flip() {
        let lib = library();
        let data = generate(DataKind::Gelu, CodecDType::BF16, 700, 3);
        let opts = EncodeOptions {
            chunk_elems: 256,
            prob_bits: 12,
            threads: 1,
        };
        let enc = encode(CodecDType::BF16, &data, &opts).unwrap();
        for bit in 0..enc.len() * 8 {
            let mut m = enc.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            let (back, status) = kernel_decode(&lib, CodecDType::BF16, 700, &m);
            assert!(
                status != 0 || back == data,
                "flip of bit {bit} silently changed the data"
            );
        }
        for len in 0..enc.len() {
            assert_ne!(
                kernel_decode(&lib, CodecDType::BF16, 700, &enc[..len]).1,
                0,
                "truncated to {len}"
            );
        }
        assert_eq!(kernel_decode(&lib, CodecDType::BF16, 701, &enc).1, 9);
    }
}
