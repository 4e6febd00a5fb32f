//! The codec on platform streams (cpu backend, with and without jitter), compress-then-swap
//! the way a swap engine moves a compressed tensor, and the cost model's predictions against measurements.

use std::sync::Arc;
use std::time::Duration;

use hprt_compress::codec::EncodeOptions;
use hprt_compress::data::{generate, DataKind};
use hprt_compress::{
    check_codec_predictions, measure_codec, measure_collective, CollectiveKind, CostModel,
    CostOverrides, Op,
};
use hprt_compress::{codec, CodecDType, CompressError};
use hprt_compress::{codec_for, CompressedTensor, CudaCodec, DeviceCodec, HostCodec};
use hprt_platform::{CpuBackend, CpuConfig, Memory, Platform};

fn platform(jitter: Option<u64>) -> Arc<dyn Platform> {
    Arc::new(CpuBackend::new(CpuConfig {
        device_memory: 256 << 20,
        jitter,
        ..Default::default()
    }))
}

#[test]
fn device_encoding_is_the_cpu_codec_bytes_and_decodes_bit_exact_under_jitter() {
    for jitter in [None, Some(1), Some(2), Some(3)] {
        encodes_the_cpu_codec_bytes_and_decodes_bit_exact(
            &platform(jitter),
            &HostCodec::default(),
            &EncodeOptions::default(),
            &format!("jitter {jitter:?}"),
        );
    }
}

/// The cuda backend over the CUDA emulator (built on first use), and
/// its process-wide lock: fault injection and statistics are global to the emulator.
fn cuda_emulator() -> (std::sync::MutexGuard<'static, ()>, Arc<dyn Platform>) {
    let serial = hprt_conformance::emulator::serial();
    let p = hprt_conformance::cuda_emulator::open().expect("cuda on the emulator");
    (serial, Arc::new(p))
}

/// `n` bf16 elements of `kind` (seeded) in device memory, and a scratch buffer `codec` can
/// encode them into.
fn upload(
    p: &dyn Platform,
    s: &hprt_platform::Stream,
    codec: &dyn DeviceCodec,
    kind: DataKind,
    n: usize,
    seed: u64,
) -> (
    Vec<u8>,
    hprt_platform::DeviceBuffer,
    hprt_platform::DeviceBuffer,
) {
    let data = generate(kind, CodecDType::BF16, n, seed);
    let src = p.alloc_device(data.len()).unwrap();
    p.write_device_sync(&src, 0, &data, s).unwrap();
    let scratch = p
        .alloc_device(codec.max_encoded_len(CodecDType::BF16, n))
        .unwrap();
    (data, src, scratch)
}

/// The host fallback on the cuda backend over the CUDA emulator (`cargo build -p
/// hprt-cuda-emulator` first), with its streams' real asynchrony.
#[test]
fn device_encoding_round_trips_on_the_cuda_emulator() {
    let (_serial, p) = cuda_emulator();
    let codec = HostCodec::default();
    encodes_the_cpu_codec_bytes_and_decodes_bit_exact(&p, &codec, &codec.encode, "host fallback");
}

/// The v2 CUDA kernels, launched by the cuda backend through its NVRTC (the emulator's
/// compiles them as host C++ and runs every block's 32 or 256 threads as fibers that meet at
/// each barrier): the CPU codec's bytes, decoded bit-exact, for the default blocks and for
/// small ones (many blocks, several per launch's block), under `HP_EMU_DELAY_SEED` in CI.
#[test]
fn cuda_kernels_write_the_cpu_codec_bytes_on_the_cuda_emulator() {
    let (_serial, p) = cuda_emulator();
    let codec = codec_for(p.as_ref());
    assert_eq!(codec.name(), "cuda");
    encodes_the_cpu_codec_bytes_and_decodes_bit_exact(
        &p,
        codec.as_ref(),
        &EncodeOptions::default(),
        "cuda kernels",
    );
    let small = CudaCodec::new(EncodeOptions {
        chunk_elems: 1024,
        prob_bits: 11,
        ..Default::default()
    });
    encodes_the_cpu_codec_bytes_and_decodes_bit_exact(&p, &small, &small.encode, "small blocks");
}

/// The kernels' device workspace is fixed tables (512-symbol counts and frequencies, counters)
/// and 12 bytes a block, never a copy of the tensor: the codec keeps it per stream, so a
/// tensor-sized one would stay on the device for good (swap's emulator test caught that).
#[test]
fn cuda_codec_workspace_is_bounded_by_the_tensor_on_the_cuda_emulator() {
    let (_serial, p) = cuda_emulator();
    let s = p.create_stream().unwrap();
    let codec = codec_for(p.as_ref());
    let n = 4_096;
    let (data, src, scratch) = upload(p.as_ref(), &s, codec.as_ref(), DataKind::Gelu, n, 3);
    let dst = p.alloc_device(data.len()).unwrap();
    p.synchronize_stream(&s).unwrap();
    let before = p.memory_stats().device_current;
    p.reset_peak_memory();
    let ct = codec
        .encode_async(p.as_ref(), src.at(0), CodecDType::BF16, n, &scratch, &s)
        .unwrap()
        .finish_in_place(p.as_ref())
        .unwrap();
    codec
        .decode_async(p.as_ref(), &ct, dst.at(0), &s)
        .unwrap()
        .finish(p.as_ref())
        .unwrap();
    let extra = p.memory_stats().device_peak - before;
    assert!(
        extra <= 16 << 10,
        "{extra} bytes of workspace for a {}-byte tensor",
        data.len()
    );
}

/// A finished encode or decode keeps none of the caller's buffers: the swap engine lets a
/// tensor's memory go right after its encode (held handles kept it on the device until the next
/// call on the stream, and swap's emulator test saw compress-then-swap's peak reach no swap's).
#[test]
fn finished_cuda_codec_calls_hold_no_caller_memory_on_the_cuda_emulator() {
    let (_serial, p) = cuda_emulator();
    let s = p.create_stream().unwrap();
    let codec = codec_for(p.as_ref());
    let n = 8_192;
    let round = || {
        let (data, src, scratch) = upload(p.as_ref(), &s, codec.as_ref(), DataKind::Gelu, n, 4);
        let dst = p.alloc_device(data.len()).unwrap();
        let ct = codec
            .encode_async(p.as_ref(), src.at(0), CodecDType::BF16, n, &scratch, &s)
            .unwrap()
            .finish_in_place(p.as_ref())
            .unwrap();
        codec
            .decode_async(p.as_ref(), &ct, dst.at(0), &s)
            .unwrap()
            .finish(p.as_ref())
            .unwrap();
        (ct, src, scratch, dst)
    };
    // The workspace and the pinned slot are made here; these buffers stay alive throughout.
    let _warm = round();
    p.synchronize_stream(&s).unwrap();
    let before = p.memory_stats().device_current;
    drop(round());
    p.synchronize_stream(&s).unwrap();
    // Frees of memory whose work finished run at the next platform call.
    drop(p.alloc_device(1).unwrap());
    assert_eq!(
        p.memory_stats().device_current,
        before,
        "memory of a finished round trip is still held"
    );
}

/// An injected launch failure in the middle of an encoding and of a decoding (the emulator's
/// `HP_EMU_FAULTS`): a typed error naming the CUDA status, no memory kept, and the next
/// encoding and decoding work.
#[test]
fn a_failed_codec_kernel_launch_is_a_typed_error_without_leaks_on_the_cuda_emulator() {
    let (_serial, p) = cuda_emulator();
    let control =
        hprt_conformance::emulator::Control::open(&hprt_conformance::cuda_emulator::library_path());
    let s = p.create_stream().unwrap();
    let codec = codec_for(p.as_ref());
    let n = 4_096;
    let (data, src, scratch) = upload(p.as_ref(), &s, codec.as_ref(), DataKind::Gelu, n, 2);
    let dst = p.alloc_device(data.len()).unwrap();
    let round_trip = || -> hprt_compress::Result<()> {
        let ct = codec
            .encode_async(p.as_ref(), src.at(0), CodecDType::BF16, n, &scratch, &s)?
            .finish_in_place(p.as_ref())?;
        codec
            .decode_async(p.as_ref(), &ct, dst.at(0), &s)?
            .finish(p.as_ref())
    };
    round_trip().unwrap();
    p.synchronize_stream(&s).unwrap();
    let baseline = p.memory_stats();
    // Three launches encode (the second measures the blocks, after the first counted symbols
    // and checksum terms into counters that the failed sequence leaves non-zero), one decodes.
    for spec in [
        "cuLaunchKernel:1:701",
        "cuLaunchKernel:2:701",
        "cuLaunchKernel:3:701",
        "cuLaunchKernel:4:701",
    ] {
        control.faults(spec);
        let err = round_trip().unwrap_err();
        control.faults("");
        assert!(
            matches!(&err, CompressError::Platform(e)
                if e.code_name == "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
            "{spec}: {err}"
        );
        let _ = p.synchronize_stream(&s);
        let now = p.memory_stats();
        assert_eq!(
            (now.device_current, now.pinned_current),
            (baseline.device_current, baseline.pinned_current),
            "{spec}: memory kept"
        );
        round_trip().unwrap_or_else(|e| panic!("{spec}: the next round trip failed: {e}"));
        let mut back = vec![0u8; data.len()];
        p.read_device_sync(&dst, 0, &mut back, &s).unwrap();
        assert!(back == data, "{spec}: decoded bytes differ");
    }
}

/// The CUDA emulator's per-function driver call counts (`hprtEmuGetCallCount`, restarted by
/// `hprtEmuSetFaults("")`).
struct DriverCalls(libloading::Library);

impl DriverCalls {
    fn open() -> Self {
        let path = hprt_conformance::cuda_emulator::library_path();
        // SAFETY: the emulator library, already loaded by the backend.
        DriverCalls(unsafe { libloading::Library::new(path) }.unwrap())
    }
    fn reset(&self) {
        // SAFETY: the emulator's export, `int(const char*)`: no faults, counts restarted.
        let rc = unsafe {
            self.0
                .get::<unsafe extern "C" fn(*const std::ffi::c_char) -> i32>(b"hprtEmuSetFaults\0")
                .unwrap()(c"".as_ptr())
        };
        assert_eq!(rc, 0);
    }
    /// The calls of each function of interest since the last reset.
    fn counts(&self) -> std::collections::BTreeMap<&'static str, u64> {
        // SAFETY: the emulator's export, `u64(const char*)`.
        let f = unsafe {
            self.0
                .get::<unsafe extern "C" fn(*const std::ffi::c_char) -> u64>(
                    b"hprtEmuGetCallCount\0",
                )
                .unwrap()
        };
        [
            "cuLaunchKernel",
            "cuMemAlloc_v2",
            "cuMemHostAlloc",
            "cuMemFree_v2",
            "cuMemFreeHost",
            "cuMemsetD8Async",
            "cuMemcpyAsync",
            "cuEventCreate",
            "cuStreamSynchronize",
            "cuEventSynchronize",
            "cuCtxSynchronize",
            "cuStreamQuery",
            "cuLaunchHostFunc",
        ]
        .into_iter()
        .map(|name| {
            let c = std::ffi::CString::new(name).unwrap();
            // SAFETY: a NUL-terminated name.
            (name, unsafe { f(c.as_ptr()) })
        })
        .collect()
    }
}

/// The work model of the CUDA codec, counted at the driver on the emulator after a warm-up
/// call: an encode queues three kernel launches, a decode one, each with one upload of its
/// descriptors and one read-back of its result words, and neither allocates, frees, fills
/// memory or waits on the host; the host waits once (for one event) when it asks for the
/// length or the status, and once for a whole batch, whose encode is still three launches.
#[test]
fn cuda_codec_work_model_on_the_cuda_emulator() {
    use hprt_compress::{DecodeItem, EncodeItem};
    let (_serial, p) = cuda_emulator();
    let calls = DriverCalls::open();
    let s = p.create_stream().unwrap();
    let codec = CudaCodec::new(EncodeOptions {
        chunk_elems: 4096,
        ..Default::default()
    });
    let n = 40_000;
    let tensors: Vec<_> = (0..4)
        .map(|i| {
            upload(
                p.as_ref(),
                &s,
                &codec,
                DataKind::Gelu,
                n - 1000 * i,
                i as u64,
            )
        })
        .collect();
    let dsts: Vec<_> = tensors
        .iter()
        .map(|(d, _, _)| p.alloc_device(d.len()).unwrap())
        .collect();
    let expect = |counts: std::collections::BTreeMap<&'static str, u64>,
                  launches: u64,
                  waits: u64,
                  what: &str| {
        let mut want: std::collections::BTreeMap<&'static str, u64> =
            counts.keys().map(|k| (*k, 0)).collect();
        want.insert("cuLaunchKernel", launches);
        want.insert("cuMemcpyAsync", if launches > 0 { 2 } else { 0 });
        want.insert("cuEventSynchronize", waits);
        assert_eq!(counts, want, "{what}");
    };
    let round = |check: bool| {
        let (data, src, scratch) = &tensors[0];
        let numel = data.len() / 2;
        calls.reset();
        let pending = codec
            .encode_async(p.as_ref(), src.at(0), CodecDType::BF16, numel, scratch, &s)
            .unwrap();
        if check {
            expect(calls.counts(), 3, 0, "encode_async");
        }
        calls.reset();
        let ct = pending.finish_in_place(p.as_ref()).unwrap();
        if check {
            expect(calls.counts(), 0, 1, "the encoding's length");
        }
        calls.reset();
        let pending = codec
            .decode_async(p.as_ref(), &ct, dsts[0].at(0), &s)
            .unwrap();
        if check {
            expect(calls.counts(), 1, 0, "decode_async");
        }
        calls.reset();
        pending.finish(p.as_ref()).unwrap();
        if check {
            expect(calls.counts(), 0, 1, "the decoder's status");
        }
    };
    let batch = |check: bool| {
        let items: Vec<EncodeItem<'_>> = tensors
            .iter()
            .map(|(d, src, scratch)| EncodeItem {
                src: src.at(0),
                dtype: CodecDType::BF16,
                numel: d.len() / 2,
                scratch,
            })
            .collect();
        calls.reset();
        let pending = codec.encode_batch_async(p.as_ref(), &items, &s).unwrap();
        if check {
            expect(calls.counts(), 3, 0, "encode_batch_async of 4");
        }
        calls.reset();
        let cts: Vec<CompressedTensor> = pending
            .into_iter()
            .map(|e| e.finish_in_place(p.as_ref()).unwrap())
            .collect();
        if check {
            expect(calls.counts(), 0, 1, "four lengths");
        }
        let items: Vec<DecodeItem<'_>> = cts
            .iter()
            .zip(&dsts)
            .map(|(src, dst)| DecodeItem {
                src,
                dst: dst.at(0),
            })
            .collect();
        calls.reset();
        let pending = codec.decode_batch_async(p.as_ref(), &items, &s).unwrap();
        if check {
            expect(calls.counts(), 1, 0, "decode_batch_async of 4");
        }
        calls.reset();
        for d in pending {
            d.finish(p.as_ref()).unwrap();
        }
        if check {
            expect(calls.counts(), 0, 1, "four statuses");
        }
        for ((data, _, _), dst) in tensors.iter().zip(&dsts) {
            let mut back = vec![0u8; data.len()];
            p.read_device_sync(dst, 0, &mut back, &s).unwrap();
            assert!(back == *data, "a batch-decoded tensor differs");
        }
        for ((data, _, _), ct) in tensors.iter().zip(&cts) {
            let mut bytes = vec![0u8; ct.byte_len()];
            p.read_device_sync(ct.device_buffer(), 0, &mut bytes, &s)
                .unwrap();
            assert!(bytes == codec::encode(CodecDType::BF16, data, &codec.encode).unwrap());
        }
    };
    // Warm-up: the workspace and the pinned slot are allocated (grown for the batch) here.
    round(false);
    batch(false);
    let ws = codec.workspace_bytes();
    for _ in 0..2 {
        round(true);
        batch(true);
    }
    assert_eq!(
        codec.workspace_bytes(),
        ws,
        "the workspace grew after warm-up"
    );
    codec.release_workspaces();
    assert_eq!(codec.workspace_bytes(), 0);
}

/// What the CUDA decoder refuses: flipped bytes anywhere (header, table, index, payload), a
/// truncated encoding, another tensor's shape, and version 1 (which only the CPU codec reads).
#[test]
fn cuda_kernels_refuse_corrupt_and_foreign_input_on_the_cuda_emulator() {
    let (_serial, p) = cuda_emulator();
    let s = p.create_stream().unwrap();
    let codec = CudaCodec::new(EncodeOptions {
        chunk_elems: 256,
        ..Default::default()
    });
    let n = 3_000;
    let data = generate(DataKind::Gelu, CodecDType::BF16, n, 5);
    let good = codec::encode(CodecDType::BF16, &data, &codec.encode).unwrap();
    let decode = |bytes: &[u8], dtype: CodecDType, numel: usize| {
        let buf = p.alloc_device(bytes.len().max(1)).unwrap();
        p.write_device_sync(&buf, 0, bytes, &s).unwrap();
        let ct = CompressedTensor::from_device_bytes(buf, bytes.len(), dtype, numel).unwrap();
        let dst = p.alloc_device(numel * dtype.size()).unwrap();
        let r = codec
            .decode_async(p.as_ref(), &ct, dst.at(0), &s)
            .unwrap()
            .finish(p.as_ref());
        let mut back = vec![0u8; numel * dtype.size()];
        p.read_device_sync(&dst, 0, &mut back, &s).unwrap();
        r.map(|()| back)
    };
    assert!(decode(&good, CodecDType::BF16, n).unwrap() == data);
    let prefix = codec::inspect(&good).unwrap().offsets[0];
    for at in [
        0,
        6,
        17,
        50,
        prefix - 1,
        prefix,
        prefix + 40,
        good.len() - 1,
    ] {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        let err = decode(&bad, CodecDType::BF16, n).unwrap_err();
        assert!(
            matches!(err, CompressError::Corrupt { .. }),
            "byte {at}: {err}"
        );
    }
    assert!(decode(&good[..good.len() - 3], CodecDType::BF16, n).is_err());
    assert!(decode(&good, CodecDType::BF16, n - 1).is_err());
    assert!(decode(&good, CodecDType::F16, n).is_err());
    let v1 = codec::encode_v1(CodecDType::BF16, &data, &EncodeOptions::default()).unwrap();
    let err = decode(&v1, CodecDType::BF16, n).unwrap_err();
    assert!(matches!(err, CompressError::UnsupportedFormat(_)), "{err}");
    // The cpu backend has no CUDA C compiler: a typed error, not a fallback.
    let cpu = platform(None);
    let cs = cpu.create_stream().unwrap();
    let src = cpu.alloc_device(data.len()).unwrap();
    let scratch = cpu
        .alloc_device(codec.max_encoded_len(CodecDType::BF16, n))
        .unwrap();
    let err = codec
        .encode_async(cpu.as_ref(), src.at(0), CodecDType::BF16, n, &scratch, &cs)
        .err()
        .expect("launching CUDA C on the cpu backend");
    assert!(
        matches!(&err, CompressError::Platform(e) if e.kind == hprt_platform::ErrorKind::Unsupported),
        "{err}"
    );
}

fn encodes_the_cpu_codec_bytes_and_decodes_bit_exact(
    p: &Arc<dyn Platform>,
    codec: &dyn DeviceCodec,
    opts: &EncodeOptions,
    what: &str,
) {
    let s = p.create_stream().unwrap();
    let mut rng = hprt_compress::data::SplitMix64::new(7);
    let random: Vec<u8> = (0..2 * 9_001).map(|_| rng.next_u64() as u8).collect();
    for (dtype, data) in [
        (
            CodecDType::BF16,
            generate(DataKind::Gelu, CodecDType::BF16, 50_000, 4),
        ),
        (
            CodecDType::F32,
            generate(DataKind::Weights, CodecDType::F32, 50_000, 4),
        ),
        (
            CodecDType::F16,
            generate(DataKind::Softmax, CodecDType::F16, 50_000, 4),
        ),
        // Every symbol, raw blocks, NaN payloads; an odd element count.
        (CodecDType::BF16, random.clone()),
        (CodecDType::F32, random[..4 * 3_001].to_vec()),
        (CodecDType::F16, Vec::new()),
    ] {
        let n = data.len() / dtype.size();
        let src = p.alloc_device(data.len() + 64).unwrap();
        // Produced asynchronously: a codec that does not wait for it reads stale bytes.
        let staging = p.alloc_pinned(data.len().max(1)).unwrap();
        staging.write(0, &data).unwrap();
        p.copy_async(
            Memory::Device(&src),
            64,
            Memory::Pinned(&staging),
            0,
            data.len(),
            &s,
        )
        .unwrap();
        let scratch = p.alloc_device(codec.max_encoded_len(dtype, n)).unwrap();
        let ct = codec
            .encode_async(p.as_ref(), src.at(64), dtype, n, &scratch, &s)
            .unwrap()
            .finish(p.as_ref(), &s)
            .unwrap();
        let mut bytes = vec![0u8; ct.byte_len()];
        p.read_device_sync(ct.device_buffer(), 0, &mut bytes, &s)
            .unwrap();
        assert!(
            bytes == codec::encode(dtype, &data, opts).unwrap(),
            "{dtype} x {n} {what}: not the CPU codec's bytes"
        );
        // Decode into a buffer that the stream overwrites just before (ordering check).
        let dst = p.alloc_device(data.len().max(1)).unwrap();
        p.memset_async(&dst, 0, 0xAB, data.len(), &s).unwrap();
        codec
            .decode_async(p.as_ref(), &ct, dst.at(0), &s)
            .unwrap()
            .finish(p.as_ref())
            .unwrap();
        let mut back = vec![0u8; data.len()];
        p.read_device_sync(&dst, 0, &mut back, &s).unwrap();
        assert!(back == data, "{dtype} x {n} {what}: decoded bytes differ");
    }
}

#[test]
fn corrupt_device_bytes_are_reported_at_finish() {
    let p = platform(None);
    let s = p.create_stream().unwrap();
    let codec = codec_for(p.as_ref());
    let (_, src, scratch) = upload(
        p.as_ref(),
        &s,
        codec.as_ref(),
        DataKind::Gaussian,
        10_000,
        1,
    );
    let ct = codec
        .encode_async(
            p.as_ref(),
            src.at(0),
            CodecDType::BF16,
            10_000,
            &scratch,
            &s,
        )
        .unwrap()
        .finish_in_place(p.as_ref())
        .unwrap();
    p.memset_async(ct.device_buffer(), 100, 0x55, 8, &s)
        .unwrap();
    let err = codec
        .decode_async(p.as_ref(), &ct, src.at(0), &s)
        .unwrap()
        .finish(p.as_ref())
        .unwrap_err();
    assert!(matches!(err, CompressError::Corrupt { .. }), "{err}");
    // A payload declared as another dtype is refused.
    let wrong = CompressedTensor::from_device_bytes(
        ct.device_buffer().clone(),
        ct.byte_len(),
        CodecDType::F16,
        10_000,
    )
    .unwrap();
    assert!(codec
        .decode_async(p.as_ref(), &wrong, src.at(0), &s)
        .unwrap()
        .finish(p.as_ref())
        .is_err());
    assert!(
        CompressedTensor::from_device_bytes(src.clone(), src.len() + 1, CodecDType::BF16, 1)
            .is_err()
    );
    let small = p.alloc_device(16).unwrap();
    assert!(codec
        .encode_async(p.as_ref(), src.at(0), CodecDType::BF16, 10_000, &small, &s)
        .is_err());
}

/// What a swap engine does with a payload: copy its bytes to pinned memory, release the device
/// storage, later re-acquire and copy back. The decoded tensor must be bit-exact, and fewer bytes
/// cross the host link than the original tensor has.
#[test]
fn compressed_payload_offloads_and_reloads_as_the_swap_engine_moves_it() {
    for jitter in [None, Some(5)] {
        let p = platform(jitter);
        let s = p.create_stream().unwrap();
        let codec = codec_for(p.as_ref());
        let n = 65_536;
        let (data, src, scratch) =
            upload(p.as_ref(), &s, codec.as_ref(), DataKind::LayerNorm, n, 8);
        let ct = codec
            .encode_async(p.as_ref(), src.at(0), CodecDType::BF16, n, &scratch, &s)
            .unwrap()
            .finish(p.as_ref(), &s)
            .unwrap();

        fn offload(
            p: &dyn Platform,
            payload: &CompressedTensor,
            s: &hprt_platform::Stream,
        ) -> hprt_platform::PinnedBuffer {
            let host = p.alloc_pinned(payload.byte_len()).unwrap();
            p.copy_async(
                Memory::Pinned(&host),
                0,
                Memory::Device(payload.device_buffer()),
                0,
                payload.byte_len(),
                s,
            )
            .unwrap();
            let ev = p.create_event(false).unwrap();
            p.record_event(&ev, s).unwrap();
            p.synchronize_event(&ev).unwrap();
            p.resize_device(payload.device_buffer(), 0).unwrap();
            host
        }
        let moved = ct.byte_len();
        assert!(
            moved * 10 < data.len() * 8,
            "offloaded {moved} of {} bytes",
            data.len()
        );
        let host = offload(p.as_ref(), &ct, &s);
        assert_eq!(ct.device_buffer().len(), 0);
        p.resize_device(ct.device_buffer(), moved).unwrap();
        p.copy_async(
            Memory::Device(ct.device_buffer()),
            0,
            Memory::Pinned(&host),
            0,
            moved,
            &s,
        )
        .unwrap();
        let dst = p.alloc_device(data.len()).unwrap();
        codec
            .decode_async(p.as_ref(), &ct, dst.at(0), &s)
            .unwrap()
            .finish(p.as_ref())
            .unwrap();
        let mut back = vec![0u8; data.len()];
        p.read_device_sync(&dst, 0, &mut back, &s).unwrap();
        assert!(back == data);
    }
}

#[test]
fn cost_model_is_measured_cached_overridable_and_predicts_codec_time() {
    let p = platform(None);
    let codec = codec_for(p.as_ref());
    let m = CostModel::for_platform(p.as_ref(), codec.as_ref()).unwrap();
    let t = m.table();
    assert!(t.encode_gbps > 0.0 && t.decode_gbps > 0.0, "{t:?}");
    // Cached: the same figures again without measuring.
    let again = CostModel::for_platform(p.as_ref(), codec.as_ref()).unwrap();
    assert_eq!(again.table(), t);
    // A fresh measurement lands in the same range as the cached one (same machine).
    let fresh = measure_codec(p.as_ref(), codec.as_ref(), 1 << 18).unwrap();
    assert!(fresh.encode_gbps > t.encode_gbps / 20.0 && fresh.encode_gbps < t.encode_gbps * 20.0);
    // Predictions against measurements: within an order of magnitude on a shared machine.
    let checks =
        check_codec_predictions(p.as_ref(), codec.as_ref(), &m, &[1 << 18, 1 << 20]).unwrap();
    for c in &checks {
        eprintln!(
            "{}: predicted {:?}, measured {:?} ({:.2}x)",
            c.what,
            c.predicted,
            c.measured,
            c.ratio()
        );
        assert!(c.ratio() > 0.05 && c.ratio() < 20.0, "{c:?}");
    }
    // Overrides win; capacity follows.
    let mut o = m.clone();
    o.set_overrides(CostOverrides {
        encode_gbps: Some(4.0),
        decode_gbps: Some(8.0),
        matmul_flops: Some(1e12),
        collective_gbps: None,
    });
    assert_eq!(o.table().encode_gbps, 4.0);
    let window = o
        .predict(&Op::Matmul {
            m: 512,
            n: 512,
            k: 512,
        })
        .unwrap();
    assert_eq!(window, Duration::from_secs_f64(2.0 * 512f64.powi(3) / 1e12));
    let cap = o.encodable_numel(
        Duration::from_millis(1) + o.table().codec_launch,
        CodecDType::BF16,
    );
    assert_eq!(cap, 2_000_000);
    assert!(
        matches!(
            m.predict(&Op::Matmul { m: 1, n: 1, k: 1 }),
            Err(CompressError::CostUnknown(_))
        ) || m.table().matmul_flops.is_some()
    );
    // Learning from a timed matmul.
    let mut learn = CostModel::from_table(Default::default());
    learn.observe(
        &Op::Matmul {
            m: 100,
            n: 100,
            k: 100,
        },
        Duration::from_millis(1),
    );
    assert_eq!(
        learn
            .predict(&Op::Matmul {
                m: 100,
                n: 100,
                k: 100
            })
            .unwrap(),
        Duration::from_millis(1)
    );
}

/// A codec that counts its encodings (the host codec underneath, under another name).
struct Counting(HostCodec, std::sync::atomic::AtomicUsize);

impl DeviceCodec for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn max_encoded_len(&self, dtype: CodecDType, numel: usize) -> usize {
        self.0.max_encoded_len(dtype, numel)
    }
    fn encode_async(
        &self,
        p: &dyn Platform,
        src: hprt_platform::Place<&hprt_platform::DeviceBuffer>,
        dtype: CodecDType,
        numel: usize,
        scratch: &hprt_platform::DeviceBuffer,
        s: &hprt_platform::Stream,
    ) -> hprt_compress::Result<hprt_compress::PendingEncode> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0.encode_async(p, src, dtype, numel, scratch, s)
    }
    fn decode_async(
        &self,
        p: &dyn Platform,
        src: &CompressedTensor,
        dst: hprt_platform::Place<&hprt_platform::DeviceBuffer>,
        s: &hprt_platform::Stream,
    ) -> hprt_compress::Result<hprt_compress::PendingDecode> {
        self.0.decode_async(p, src, dst, s)
    }
}

/// The cached figures are the measured codec's: another codec on the same device (the CUDA
/// kernels after the host fallback, say) is measured, not given the first one's speeds.
#[test]
fn cost_model_cache_is_per_device_and_codec() {
    let p = platform(None);
    CostModel::for_platform(p.as_ref(), codec_for(p.as_ref()).as_ref()).unwrap();
    let counting = Counting(HostCodec::default(), Default::default());
    CostModel::for_platform(p.as_ref(), &counting).unwrap();
    let measured = counting.1.load(std::sync::atomic::Ordering::Relaxed);
    assert!(measured > 0, "the other codec's cached figures were used");
    CostModel::for_platform(p.as_ref(), &counting).unwrap();
    assert_eq!(
        counting.1.load(std::sync::atomic::Ordering::Relaxed),
        measured
    );
}

#[test]
fn collective_bandwidth_is_measured_by_group_size_and_predicts_the_collective() {
    let p = platform(None);
    let mut model = CostModel::from_table(Default::default());
    assert!(model
        .predict(&Op::Collective {
            kind: CollectiveKind::AllGather,
            bytes: 1 << 20,
            group: 2
        })
        .is_err());
    for world in [2usize, 4] {
        let id = p.unique_id().unwrap();
        let results: Vec<f64> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (p, id) = (p.clone(), id.clone());
                    sc.spawn(move || {
                        let comm = p.comm_init(&id, rank, world).unwrap();
                        let s = p.create_stream().unwrap();
                        measure_collective(
                            p.as_ref(),
                            &comm,
                            &s,
                            CollectiveKind::AllGather,
                            1 << 20,
                            3,
                        )
                        .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let gbps = results.iter().cloned().fold(f64::MAX, f64::min);
        assert!(gbps > 0.0);
        model.set_collective_gbps(CollectiveKind::AllGather, world, gbps);
    }
    let d2 = model
        .predict(&Op::Collective {
            kind: CollectiveKind::AllGather,
            bytes: 1 << 20,
            group: 2,
        })
        .unwrap();
    let d3 = model
        .predict(&Op::Collective {
            kind: CollectiveKind::AllGather,
            bytes: 1 << 20,
            group: 3,
        })
        .unwrap();
    assert!(d2 > Duration::ZERO && d3 > Duration::ZERO);
}

#[test]
fn the_device_codec_is_chosen_per_backend() {
    // cpu: the CPU codec through the host codec, writing its bytes (format v2); cuda: the
    // kernels (`cuda_kernels_write_the_cpu_codec_bytes_on_the_cuda_emulator`).
    let p = platform(None);
    let codec = codec_for(p.as_ref());
    assert_eq!(codec.name(), "host");
    encodes_the_cpu_codec_bytes_and_decodes_bit_exact(
        &p,
        codec.as_ref(),
        &EncodeOptions::default(),
        "codec_for(cpu)",
    );
}
