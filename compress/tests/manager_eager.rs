//! The activation manager without windows (`Schedule::Eager`) on the cpu backend: `save`
//! queues each encode after the tensor's producer, `take` decodes ahead in the order backward
//! reads; bit-exact with and without stream jitter, with producers that trail the host,
//! borrowed memory given back once encoded, failures and early takes costing nothing.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hprt_compress::data::{generate, DataKind};
use hprt_compress::{ActivationManager, CodecDType, CompressError, LayerId, ManagerConfig, Op};
use hprt_compress::{Schedule, TensorKey};
use hprt_platform::{DType, DeviceBuffer, Platform, Stream};

mod common;
use common::{model, platform, platform_with, produce, saved};

fn eager(p: &Arc<dyn Platform>, decode_ahead: usize) -> (Stream, ActivationManager) {
    let s = p.create_stream().unwrap();
    let mut config = ManagerConfig::new(model());
    config.schedule = Schedule::Eager { decode_ahead };
    (
        s.clone(),
        ActivationManager::new(p.clone(), s, config).unwrap(),
    )
}

/// Holds the compute stream for `ms` (a producer queued behind it trails the host).
fn stall(p: &dyn Platform, s: &Stream, ms: u64) {
    p.launch_host_fn(
        s,
        Box::new(move || std::thread::sleep(Duration::from_millis(ms))),
    )
    .unwrap();
}

fn read(p: &dyn Platform, s: &Stream, buf: &DeviceBuffer, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    p.read_device_sync(buf, 0, &mut bytes, s).unwrap();
    bytes
}

/// One "forward": `n` activations, each produced on the compute stream behind a stall (so
/// the host is ahead of the stream when it saves them), registered as they come.
fn forward(
    p: &dyn Platform,
    s: &Stream,
    m: &mut ActivationManager,
    n: usize,
    seed: u64,
) -> Vec<(TensorKey, Vec<u8>)> {
    let kinds = [
        (DataKind::Gelu, CodecDType::BF16),
        (DataKind::Softmax, CodecDType::F16),
        (DataKind::LayerNorm, CodecDType::F32),
    ];
    (0..n)
        .map(|i| {
            let (kind, dtype) = kinds[i % kinds.len()];
            let numel = 40_000 + 64 * i;
            let data = generate(kind, dtype, numel, seed + i as u64);
            stall(p, s, 2);
            let buf = produce(p, s, &data);
            let key = m
                .save(LayerId(i / 4), saved(buf, dtype.dtype(), numel))
                .unwrap()
                .expect("the default filter takes 40,000 elements");
            (key, data)
        })
        .collect()
}

/// Takes every saved tensor, the latest saved first (backward's order), each bit-exact.
fn backward(
    p: &dyn Platform,
    s: &Stream,
    m: &mut ActivationManager,
    saved: &[(TensorKey, Vec<u8>)],
    what: &str,
) {
    for (key, data) in saved.iter().rev() {
        let back = m.take(*key).unwrap();
        assert!(
            read(p, s, &back, data.len()) == *data,
            "{what}, tensor {}: not bit-exact",
            key.index
        );
    }
}

/// Every tensor is encoded after its producer, the originals go once encoded, and backward's
/// takes (latest saved first) find their decodes begun by the takes before: no synchronous
/// decode, bit-exact, under jitter too.
#[test]
fn saves_encode_and_takes_decode_ahead_bit_exact() {
    for jitter in [None, Some(5)] {
        let p = platform(jitter);
        let (s, mut m) = eager(&p, 2);
        for step in 0..2 {
            let saved = forward(p.as_ref(), &s, &mut m, 12, 100 * step);
            let raw: usize = saved.iter().map(|(_, d)| d.len()).sum();
            p.synchronize_device().unwrap();
            backward(
                p.as_ref(),
                &s,
                &mut m,
                &saved,
                &format!("jitter {jitter:?}, step {step}"),
            );
            let stats = m.layer_stats();
            let sum = |f: fn(&hprt_compress::LayerStats) -> usize| -> usize {
                stats.iter().map(|(_, s)| f(s)).sum()
            };
            // The last tensor saved is taken first, its original still there (no later save
            // let it go): it comes back as it is. The first take finishes the other encodes
            // and begins the next two decodes, every later take the one after.
            let steps = step as usize + 1;
            assert_eq!(sum(|s| s.compressed), 11 * steps, "{stats:?}");
            assert_eq!(sum(|s| s.recovered_sync), 0, "{stats:?}");
            assert_eq!(sum(|s| s.decoded_ahead), 11 * steps, "{stats:?}");
            assert!(
                sum(|s| s.compressed_bytes) * 5 < raw * 4 * steps,
                "{stats:?}"
            );
        }
    }
}

/// The host ahead of the stream: an encode that did not wait for its producer would read the
/// bytes before the copy wrote them. Checked against the producer's data once it has run.
#[test]
fn an_encode_waits_for_a_producer_that_trails_the_host() {
    for jitter in [None, Some(7)] {
        let p = platform(jitter);
        let (s, mut m) = eager(&p, 0);
        let data = generate(DataKind::Gelu, CodecDType::BF16, 1 << 16, 3);
        stall(p.as_ref(), &s, 30);
        let buf = produce(p.as_ref(), &s, &data);
        let key = m
            .save(LayerId(0), saved(buf, DType::BF16, 1 << 16))
            .unwrap()
            .unwrap();
        // A second save after the first encode ran lets its original go.
        p.synchronize_device().unwrap();
        let other = produce(p.as_ref(), &s, &data);
        let second = m
            .save(LayerId(0), saved(other, DType::BF16, 1 << 16))
            .unwrap()
            .unwrap();
        assert!(m.is_compressed(key), "jitter {jitter:?}");
        let back = m.take(key).unwrap();
        assert!(
            read(p.as_ref(), &s, &back, data.len()) == data,
            "jitter {jitter:?}: the encode read the tensor before its producer wrote it"
        );
        m.discard(second).unwrap();
    }
}

/// A tensor taken before its encode was seen to finish comes back as it was, no decode: the
/// encoding is dropped, nothing counted compressed.
#[test]
fn a_take_right_after_its_save_returns_the_original() {
    for jitter in [None, Some(4)] {
        let p = platform(jitter);
        let (s, mut m) = eager(&p, 4);
        let data = generate(DataKind::Softmax, CodecDType::BF16, 1 << 16, 8);
        let buf = produce(p.as_ref(), &s, &data);
        let key = m
            .save(LayerId(0), saved(buf.clone(), DType::BF16, 1 << 16))
            .unwrap()
            .unwrap();
        let back = m.take(key).unwrap();
        assert_eq!(back.device_ptr(), buf.device_ptr(), "jitter {jitter:?}");
        assert!(read(p.as_ref(), &s, &back, data.len()) == data);
        let s0 = m.layer_stats()[0].1;
        assert_eq!(
            (s0.compressed, s0.recovered_sync, s0.decoded_ahead),
            (0, 0, 0)
        );
    }
}

/// A framework's memory goes back to it once its encode finished, long before backward; the
/// decode lands in a new buffer of hprt's.
#[test]
fn borrowed_memory_goes_back_once_encoded() {
    for jitter in [None, Some(9)] {
        let p = platform(jitter);
        let (s, mut m) = eager(&p, 1);
        let n = 1 << 16;
        let data = generate(DataKind::Gelu, CodecDType::BF16, n, 1);
        let (borrowed, released) = common::borrowed(p.as_ref(), &s, &data);
        let key = m
            .save(LayerId(0), saved(borrowed, DType::BF16, n))
            .unwrap()
            .unwrap();
        p.synchronize_device().unwrap();
        assert!(
            !released.load(Ordering::SeqCst),
            "given back before encoded"
        );
        let later = produce(p.as_ref(), &s, &data);
        let second = m
            .save(LayerId(1), saved(later, DType::BF16, n))
            .unwrap()
            .unwrap();
        p.synchronize_device().unwrap();
        assert!(
            released.load(Ordering::SeqCst),
            "jitter {jitter:?}: the owner's memory is held while compressed"
        );
        m.discard(second).unwrap();
        let back = m.take(key).unwrap();
        assert!(!back.is_borrowed());
        assert!(read(p.as_ref(), &s, &back, data.len()) == data);
    }
}

/// No memory for an encoding: the tensor stays as it is, counted and reported, and reads back
/// exact; the next one that fits is compressed.
#[test]
fn an_encode_without_memory_keeps_its_tensor() {
    let big = 1 << 20; // bf16 elements: 2 MiB raw, a worst-case scratch of more
    let p = platform_with(Some(3), 3 << 20);
    let (s, mut m) = eager(&p, 1);
    let data = generate(DataKind::Gelu, CodecDType::BF16, big, 4);
    let buf = produce(p.as_ref(), &s, &data);
    let key = m
        .save(LayerId(0), saved(buf, DType::BF16, big))
        .unwrap()
        .unwrap();
    let failures = m.take_encode_failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        matches!(failures[0].1, CompressError::Platform(_)),
        "{failures:?}"
    );
    assert_eq!(m.layer_stats()[0].1.encode_failures, 1);
    let back = m.take(key).unwrap();
    assert!(read(p.as_ref(), &s, &back, data.len()) == data);
    drop(back);
    let small = generate(DataKind::Gelu, CodecDType::BF16, 1 << 16, 5);
    let buf = produce(p.as_ref(), &s, &small);
    let key = m
        .save(LayerId(0), saved(buf, DType::BF16, 1 << 16))
        .unwrap()
        .unwrap();
    p.synchronize_device().unwrap();
    m.discard(TensorKey::new(7, 7)).unwrap(); // unknown: ignored
    let other = produce(p.as_ref(), &s, &small);
    let k2 = m
        .save(LayerId(0), saved(other, DType::BF16, 1 << 16))
        .unwrap()
        .unwrap();
    assert!(m.is_compressed(key));
    assert!(read(p.as_ref(), &s, &m.take(key).unwrap(), small.len()) == small);
    m.discard(k2).unwrap();
}

/// Discarding tensors whose encode or decode is queued waits for that work first; every
/// buffer then goes.
#[test]
fn discards_of_queued_work_free_everything() {
    let p = platform(Some(2));
    let (s, mut m) = eager(&p, 3);
    let saved = forward(p.as_ref(), &s, &mut m, 6, 40);
    p.synchronize_device().unwrap();
    let (last, data) = saved.last().unwrap();
    // Finishes the encodes and begins decodes of three more.
    let back = m.take(*last).unwrap();
    assert!(read(p.as_ref(), &s, &back, data.len()) == *data);
    drop(back);
    for (key, _) in &saved[..5] {
        m.discard(*key).unwrap();
    }
    let more = forward(p.as_ref(), &s, &mut m, 2, 50);
    for (key, _) in &more {
        m.discard(*key).unwrap(); // still encoding
    }
    drop(saved);
    drop(m);
    p.synchronize_device().unwrap();
    drop(more);
    assert_eq!(p.memory_stats().device_current, 0);
}

/// Windows and layer phases belong to the windowed schedule: refused by name.
#[test]
fn window_calls_are_refused_without_windows() {
    let p = platform(None);
    let (_, mut m) = eager(&p, 1);
    for r in [
        m.forward_start(LayerId(0)),
        m.backward_start(LayerId(0)),
        m.begin_window(&Op::Unbounded),
        m.window(&Op::Unbounded, || ()),
    ] {
        let err = r.unwrap_err();
        assert!(
            matches!(err, CompressError::InvalidState(_))
                && err.to_string().contains("no operator windows"),
            "{err}"
        );
    }
    assert!(m.end_window().is_err());
}

/// The same on the cuda backend over the CUDA emulator, with the CUDA kernels (the emulator's
/// NVRTC compiles them as host C++): completion seen through events and device words, not host
/// slots; producers that trail the host; under `HP_EMU_DELAY_SEED` in CI.
#[test]
fn saves_encode_and_takes_decode_ahead_on_the_cuda_emulator() {
    let _serial = hprt_conformance::emulator::serial();
    let p: Arc<dyn Platform> =
        Arc::new(hprt_conformance::cuda_emulator::open().expect("cuda on the emulator"));
    let (s, mut m) = eager(&p, 2);
    // Two steps of the same shapes: the second finds its scratch buffers pooled and its
    // allocations in the backend's cache, so no allocation synchronizes the device and hides
    // a missing wait.
    for step in 0..2 {
        let saved = forward(p.as_ref(), &s, &mut m, 6, 70 + step);
        p.synchronize_device().unwrap();
        backward(p.as_ref(), &s, &mut m, &saved, &format!("step {step}"));
    }
    let stats = m.layer_stats();
    let total = |f: fn(&hprt_compress::LayerStats) -> usize| -> usize {
        stats.iter().map(|(_, s)| f(s)).sum()
    };
    assert_eq!(
        (total(|s| s.compressed), total(|s| s.decoded_ahead)),
        (10, 10),
        "{stats:?}"
    );
    assert_eq!(
        total(|s| s.encode_failures),
        0,
        "{:?}",
        m.take_encode_failures()
    );
}
