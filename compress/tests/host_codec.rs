//! The host codec where device memory is host memory (the cpu backend): it codes the device
//! memory in place, with no pinned staging, and a free right after the call loses nothing.

use std::sync::Arc;

use hprt_compress::codec::EncodeOptions;
use hprt_compress::data::{generate, DataKind};
use hprt_compress::{codec, CodecDType, DeviceCodec, HostCodec};
use hprt_platform::{CpuBackend, CpuConfig, Platform};

#[test]
fn on_host_memory_the_host_codec_stages_nothing_and_outlives_a_free() {
    for jitter in [None, Some(5), Some(11)] {
        let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig {
            device_memory: 64 << 20,
            jitter,
            ..Default::default()
        }));
        let s = p.create_stream().unwrap();
        let codec = HostCodec::default();
        let (dtype, n) = (CodecDType::BF16, 1 << 18);
        let data = generate(DataKind::Gelu, dtype, n, 3);
        let src = p.alloc_device(data.len() + 128).unwrap();
        p.write_device_sync(&src, 128, &data, &s).unwrap();
        p.synchronize_stream(&s).unwrap();
        p.reset_peak_memory();
        let staged = |p: &Arc<dyn Platform>| p.memory_stats().pinned_peak;
        assert_eq!(staged(&p), 0, "jitter {jitter:?}: pinned memory in use");
        let scratch = p.alloc_device(codec.max_encoded_len(dtype, n)).unwrap();
        let pending = codec
            .encode_async(p.as_ref(), src.at(128), dtype, n, &scratch, &s)
            .unwrap();
        p.free_device(&src).unwrap(); // queued work on it still completes
        let ct = pending.finish(p.as_ref(), &s).unwrap();
        p.synchronize_stream(&s).unwrap();
        assert_eq!(
            staged(&p),
            0,
            "jitter {jitter:?}: the encode staged through pinned memory"
        );
        let mut bytes = vec![0u8; ct.byte_len()];
        p.read_device_sync(ct.device_buffer(), 0, &mut bytes, &s)
            .unwrap();
        assert!(
            bytes == codec::encode(dtype, &data, &EncodeOptions::default()).unwrap(),
            "jitter {jitter:?}: not the CPU codec's bytes"
        );
        let dst = p.alloc_device(data.len() + 64).unwrap();
        p.synchronize_stream(&s).unwrap();
        p.reset_peak_memory(); // the read above stages through pinned memory
        let pending = codec.decode_async(p.as_ref(), &ct, dst.at(64), &s).unwrap();
        drop(ct); // the encoding too stays readable until the decode ran
        pending.finish(p.as_ref()).unwrap();
        assert_eq!(
            staged(&p),
            0,
            "jitter {jitter:?}: the decode staged through pinned memory"
        );
        let mut back = vec![0u8; data.len()];
        p.read_device_sync(&dst, 64, &mut back, &s).unwrap();
        assert!(back == data, "jitter {jitter:?}: decoded bytes differ");
    }
}
