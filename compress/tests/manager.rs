//! The activation manager on the cpu backend: simulated training steps with realistic saved
//! tensors, forward windows that encode the previous layer, backward windows that decode the
//! next one; bit-exact results with and without stream jitter, originals really freed, shared
//! scratch buffers reused, per-layer ratios and window predictions reported.

use std::sync::Arc;
use std::time::Duration;

use hprt_compress::data::{generate, DataKind};
use hprt_compress::LayerId;
use hprt_compress::{ActivationManager, ManagerConfig, TensorFilter, TensorKey};
use hprt_compress::{CodecDType, CompressError};
use hprt_compress::{CompressedTensor, DeviceCodec, HostCodec, PendingDecode, PendingEncode};
use hprt_compress::{CostModel, CostTable, Op};
use hprt_platform::{DType, DeviceBuffer, Kernel, Place, Platform, Stream};

mod common;
use common::{model, platform, produce, saved};

const LAYERS: usize = 4;

/// A manager with the default config on a fresh [`platform`], with that platform and the
/// stream it was made with.
fn manager(jitter: Option<u64>) -> (Arc<dyn Platform>, Stream, ActivationManager) {
    let p = platform(jitter);
    let s = p.create_stream().unwrap();
    let m = ActivationManager::new(p.clone(), s.clone(), ManagerConfig::new(model())).unwrap();
    (p, s, m)
}

/// The tensors one layer saves: (kind, dtype, numel).
fn layer_tensors(layer: usize) -> Vec<(DataKind, CodecDType, usize)> {
    vec![
        (DataKind::Gelu, CodecDType::BF16, 60_000 + 8 * layer),
        (DataKind::Softmax, CodecDType::BF16, 65_536),
        (DataKind::LayerNorm, CodecDType::F32, 40_000),
        (DataKind::Weights, CodecDType::F16, 1000), // below the size filter
    ]
}

/// Some operator work on the compute stream (the "matmul" of the window).
fn operator(p: &dyn Platform, s: &Stream, work: &DeviceBuffer) {
    p.launch_kernel(
        Kernel::Scale {
            buf: work.at(0),
            dtype: DType::F32,
            count: work.len() / 4,
            factor: 1.0001,
        },
        s,
    )
    .unwrap();
}

struct Step {
    saved: Vec<(LayerId, TensorKey, Vec<u8>)>,
    kept: Vec<(LayerId, DeviceBuffer, Vec<u8>)>,
}

fn run_step(
    m: &mut ActivationManager,
    p: &dyn Platform,
    s: &Stream,
    work: &DeviceBuffer,
    window: Duration,
    step: u64,
) -> Step {
    let mut st = Step {
        saved: vec![],
        kept: vec![],
    };
    for l in 0..LAYERS {
        let layer = LayerId(l);
        m.forward_start(layer).unwrap();
        // The layer's first operator: encodes the previous layer's tensors.
        m.window(&Op::Fixed(window), || operator(p, s, work))
            .unwrap();
        for (i, (kind, dtype, n)) in layer_tensors(l).into_iter().enumerate() {
            let data = generate(kind, dtype, n, step * 100 + (l * 10 + i) as u64);
            let buf = produce(p, s, &data);
            let t = saved(buf.clone(), dtype.dtype(), n);
            match m.save(layer, t).unwrap() {
                Some(key) => st.saved.push((layer, key, data)),
                None => st.kept.push((layer, buf, data)),
            }
        }
        m.window(&Op::Fixed(window), || operator(p, s, work))
            .unwrap();
    }
    st
}

fn backward(
    m: &mut ActivationManager,
    p: &dyn Platform,
    s: &Stream,
    work: &DeviceBuffer,
    window: Duration,
    st: &Step,
) {
    for l in (0..LAYERS).rev() {
        let layer = LayerId(l);
        m.backward_start(layer).unwrap();
        // Decodes the next backward layer (l - 1) in the window.
        m.window(&Op::Fixed(window), || operator(p, s, work))
            .unwrap();
        for (tl, key, data) in st.saved.iter().filter(|(tl, ..)| *tl == layer) {
            assert_eq!(*tl, layer);
            let buf = m.take(*key).unwrap();
            let mut back = vec![0u8; data.len()];
            p.read_device_sync(&buf, 0, &mut back, s).unwrap();
            assert!(
                back == *data,
                "layer {l} tensor {}: not bit-exact",
                key.index
            );
        }
        for (_, buf, data) in st.kept.iter().filter(|(tl, ..)| *tl == layer) {
            let mut back = vec![0u8; data.len()];
            p.read_device_sync(buf, 0, &mut back, s).unwrap();
            assert!(back == *data, "unmanaged tensor was touched");
        }
    }
}

fn simulate(jitter: Option<u64>, window: Duration, steps: u64) -> ActivationManager {
    simulate_with(jitter, window, steps, ManagerConfig::new(model()))
}

fn simulate_with(
    jitter: Option<u64>,
    window: Duration,
    steps: u64,
    config: ManagerConfig,
) -> ActivationManager {
    let p = platform(jitter);
    let s = p.create_stream().unwrap();
    let work = p.alloc_device(1 << 16).unwrap();
    p.memset_async(&work, 0, 0, 1 << 16, &s).unwrap();
    let mut m = ActivationManager::new(p.clone(), s.clone(), config).unwrap();
    for step in 0..steps {
        let st = run_step(&mut m, p.as_ref(), &s, &work, window, step);
        backward(&mut m, p.as_ref(), &s, &work, window, &st);
    }
    m
}

#[test]
fn training_steps_are_bit_exact_and_compress_every_layer_but_the_last() {
    let mut m = simulate(None, Duration::from_millis(2), 2);
    let (fwd, bwd) = m.layer_orders();
    assert_eq!(fwd, &[LayerId(0), LayerId(1), LayerId(2), LayerId(3)]);
    assert_eq!(bwd, &[LayerId(3), LayerId(2), LayerId(1), LayerId(0)]);
    for (layer, s) in m.layer_stats() {
        eprintln!(
            "layer {}: saved {}, compressed {}, ratio {:.3}, decoded in window {}, recovered sync {}",
            layer.0, s.saved, s.compressed, s.ratio(), s.decoded_in_window, s.recovered_sync
        );
        assert_eq!(s.saved, 6, "3 tensors pass the filter, 2 steps");
        if layer.0 < LAYERS - 1 {
            assert_eq!(
                s.compressed, 6,
                "a 2 ms window at 1 GB/s fits the whole previous layer"
            );
            assert!(s.ratio() > 1.2, "ratio {}", s.ratio());
            // The first step learns the backward order, so its backward windows know no next
            // layer and every tensor is recovered at its layer's backward start; in the second
            // step each layer is decoded in the window of the layer before it in backward.
            assert_eq!(s.recovered_sync, 3);
            assert_eq!(s.decoded_in_window, 3);
        } else {
            assert_eq!(s.compressed, 0, "no window follows the last layer");
        }
    }
    // One scratch buffer per (numel, dtype) in flight, reused by every later window and step.
    assert!(
        m.scratch_allocations() <= 3 * 3,
        "{} scratch allocations",
        m.scratch_allocations()
    );
    let records = m.window_records().unwrap();
    assert_eq!(records.len(), 2 * (3 * LAYERS));
    for r in records.iter().filter(|r| r.encoded + r.decoded > 0) {
        eprintln!(
            "{}: predicted {:?}, measured {:?}, {} enc / {} dec, {} bytes",
            r.op, r.predicted, r.measured, r.encoded, r.decoded, r.bytes
        );
        assert!(r.measured.is_some());
        assert!(r.bytes <= 2_000_000, "planned more than the window holds");
    }
}

#[test]
fn bit_exact_under_stream_jitter() {
    for seed in [1, 2, 3, 4] {
        let m = simulate(Some(seed), Duration::from_millis(2), 1);
        let compressed: usize = m.layer_stats().iter().map(|(_, s)| s.compressed).sum();
        assert_eq!(compressed, 9);
    }
}

#[test]
fn small_windows_compress_less_and_leftovers_are_recovered_synchronously() {
    // 0.15 ms at 1 GB/s = 150 kB: one 120 kB bf16 tensor per window, never the 160 kB f32 one.
    let m = simulate(Some(9), Duration::from_micros(150), 1);
    let stats = m.layer_stats();
    let compressed: usize = stats.iter().map(|(_, s)| s.compressed).sum();
    let in_window: usize = stats.iter().map(|(_, s)| s.decoded_in_window).sum();
    let sync: usize = stats.iter().map(|(_, s)| s.recovered_sync).sum();
    assert!(compressed > 0 && compressed < 9, "compressed {compressed}");
    assert_eq!(in_window + sync, compressed);
}

#[test]
fn originals_are_freed_while_compressed() {
    let (p, s, mut m) = manager(None);
    let n = 1 << 18;
    let data = generate(DataKind::Gelu, CodecDType::BF16, n, 2);
    m.forward_start(LayerId(0)).unwrap();
    let buf = produce(p.as_ref(), &s, &data);
    let key = m
        .save(LayerId(0), saved(buf.clone(), DType::BF16, n))
        .unwrap()
        .unwrap();
    p.synchronize_device().unwrap();
    let before = p.memory_stats().device_current;
    m.forward_start(LayerId(1)).unwrap();
    m.window(&Op::Fixed(Duration::from_millis(5)), || ())
        .unwrap();
    assert!(m.is_compressed(key));
    assert_eq!(buf.len(), 0, "original storage released");
    let after = p.memory_stats().device_current;
    // The scratch buffer stays pooled (worst-case size); the original is gone, the compressed
    // copy is smaller than it.
    let scratch = hprt_compress::codec::max_encoded_len(CodecDType::BF16, n, &Default::default());
    assert!(after < before + scratch, "before {before}, after {after}");
    assert!(
        ((after - scratch) as f64) < before as f64 * 0.85,
        "compressed copy not smaller"
    );
    m.backward_start(LayerId(1)).unwrap();
    m.backward_start(LayerId(0)).unwrap();
    let back = m.take(key).unwrap();
    let mut bytes = vec![0u8; data.len()];
    p.read_device_sync(&back, 0, &mut bytes, &s).unwrap();
    assert!(bytes == data);
}

#[test]
fn filters_and_misuse_are_typed() {
    let p = platform(None);
    let s = p.create_stream().unwrap();
    let mut cfg = ManagerConfig::new(model());
    let mut filter = TensorFilter::default().with_predicate(|t| t.numel() % 2 == 0);
    filter.min_numel = 8;
    cfg.filter = filter;
    let mut m = ActivationManager::new(p.clone(), s.clone(), cfg).unwrap();
    let b = p.alloc_device(64).unwrap();
    m.forward_start(LayerId(0)).unwrap();
    assert!(m
        .save(LayerId(0), saved(b.clone(), DType::F32, 15))
        .unwrap()
        .is_none());
    assert!(m
        .save(LayerId(0), saved(b.clone(), DType::I32, 16))
        .unwrap()
        .is_none());
    assert!(matches!(
        m.save(LayerId(0), saved(b.clone(), DType::F32, 32)),
        Err(CompressError::InvalidArgument(_))
    ));
    let key = m
        .save(LayerId(0), saved(b.clone(), DType::F32, 16))
        .unwrap()
        .unwrap();
    assert!(matches!(
        m.end_window(),
        Err(CompressError::InvalidState(_))
    ));
    m.begin_window(&Op::Fixed(Duration::from_millis(1)))
        .unwrap();
    assert!(matches!(
        m.begin_window(&Op::Fixed(Duration::ZERO)),
        Err(CompressError::InvalidState(_))
    ));
    m.end_window().unwrap();
    // A layer entered again before its tensors were taken.
    assert!(matches!(
        m.forward_start(LayerId(0)),
        Err(CompressError::InvalidState(_))
    ));
    m.take(key).unwrap();
    assert!(m.take(key).is_err());
    m.forward_start(LayerId(0)).unwrap();
    // An operator the model cannot predict gets no codec work, but still a record.
    m.begin_window(&Op::Matmul { m: 8, n: 8, k: 8 }).unwrap();
    m.end_window().unwrap();
    assert_eq!(m.window_records().unwrap().last().unwrap().predicted, None);
}

/// A framework without a hook per backward operator keeps one window open over a layer's
/// whole backward: the next layer in backward decodes in it while the layer's own tensors are
/// taken; a tensor of the layer the window is decoding is refused until the window ends.
#[test]
fn a_layers_tensors_are_taken_in_a_window_that_decodes_the_next_layer() {
    let (p, s, mut m) = manager(Some(7));
    let n = 1 << 16;
    let data: Vec<Vec<u8>> = (0..2)
        .map(|l| generate(DataKind::Gelu, CodecDType::BF16, n, 10 + l))
        .collect();
    let forward = |m: &mut ActivationManager| -> Vec<TensorKey> {
        (0..2)
            .map(|l| {
                m.forward_start(LayerId(l)).unwrap();
                // Encodes the previous layer's tensors while this layer runs.
                m.window(&Op::Fixed(Duration::from_millis(5)), || ())
                    .unwrap();
                let buf = produce(p.as_ref(), &s, &data[l]);
                let t = saved(buf, DType::BF16, n);
                m.save(LayerId(l), t).unwrap().unwrap()
            })
            .collect()
    };
    let check = |buf: &DeviceBuffer, l: usize| {
        let mut back = vec![0u8; data[l].len()];
        p.read_device_sync(buf, 0, &mut back, &s).unwrap();
        assert!(back == data[l], "layer {l}: not bit-exact");
    };
    // The first step learns the backward order.
    let keys = forward(&mut m);
    for l in [1, 0] {
        m.backward_start(LayerId(l)).unwrap();
        check(&m.take(keys[l]).unwrap(), l);
    }
    let keys = forward(&mut m);
    assert!(m.is_compressed(keys[0]));
    m.backward_start(LayerId(1)).unwrap();
    m.begin_window(&Op::Fixed(Duration::from_millis(5)))
        .unwrap();
    check(&m.take(keys[1]).unwrap(), 1);
    assert!(m.window_open());
    m.end_window().unwrap();
    assert!(!m.is_compressed(keys[0]), "decoded in layer 1's window");
    m.backward_start(LayerId(0)).unwrap();
    check(&m.take(keys[0]).unwrap(), 0);
    let stats = m.layer_stats();
    assert_eq!(stats[0].1.decoded_in_window, 1, "{stats:?}");
    assert_eq!(
        stats[0].1.recovered_sync, 1,
        "the first step's only: {stats:?}"
    );

    // Autograd reads a tensor of the layer being decoded before that layer's backward start:
    // the take ends the window (its decodes waited for) instead of reading half-decoded bytes.
    let keys = forward(&mut m);
    m.backward_start(LayerId(1)).unwrap();
    m.begin_window(&Op::Fixed(Duration::from_millis(5)))
        .unwrap();
    check(&m.take(keys[0]).unwrap(), 0);
    assert!(!m.window_open());
    check(&m.take(keys[1]).unwrap(), 1);

    // A take of a tensor the open window is encoding is refused.
    m.forward_start(LayerId(0)).unwrap();
    let t = saved(produce(p.as_ref(), &s, &data[0]), DType::BF16, n);
    let k0 = m.save(LayerId(0), t).unwrap().unwrap();
    m.forward_start(LayerId(1)).unwrap();
    m.begin_window(&Op::Fixed(Duration::from_millis(5)))
        .unwrap();
    assert!(matches!(m.take(k0), Err(CompressError::InvalidState(_))));
    m.end_window().unwrap();
    check(&m.take(k0).unwrap(), 0);
}

/// A tensor whose graph was dropped (a forward without backward): `discard` forgets it,
/// compressed copy included, and the layer's next forward starts; without it the next step
/// is refused.
#[test]
fn discarded_tensors_free_their_layer_for_the_next_step() {
    let (p, s, mut m) = manager(None);
    let n = 1 << 16;
    let data = generate(DataKind::Gelu, CodecDType::BF16, n, 3);
    let saved = |m: &mut ActivationManager, layer| {
        let buf = produce(p.as_ref(), &s, &data);
        let t = saved(buf, DType::BF16, n);
        m.save(LayerId(layer), t).unwrap().unwrap()
    };
    m.forward_start(LayerId(0)).unwrap();
    let k0 = saved(&mut m, 0);
    m.forward_start(LayerId(1)).unwrap();
    m.window(&Op::Fixed(Duration::from_millis(5)), || ())
        .unwrap();
    let k1 = saved(&mut m, 1);
    assert!(m.is_compressed(k0));
    // The graph is dropped: the next step's forward is refused while the layers hold tensors.
    assert!(matches!(
        m.forward_start(LayerId(0)),
        Err(CompressError::InvalidState(_))
    ));
    m.discard(k0).unwrap();
    m.discard(k1).unwrap();
    m.discard(k1).unwrap(); // already gone: nothing to do
    p.synchronize_device().unwrap();
    m.forward_start(LayerId(0)).unwrap();
    let k = saved(&mut m, 0);
    m.backward_start(LayerId(0)).unwrap();
    let back = m.take(k).unwrap();
    let mut bytes = vec![0u8; data.len()];
    p.read_device_sync(&back, 0, &mut bytes, &s).unwrap();
    assert!(bytes == data);
    assert!(matches!(m.take(k0), Err(CompressError::InvalidState(_))));
}

/// An unbounded window (a framework layer's whole forward) encodes every candidate of the
/// previous layer, however slow the cost model says the codec is.
#[test]
fn an_unbounded_window_encodes_every_candidate_whatever_the_throughput() {
    let p = platform(None);
    let s = p.create_stream().unwrap();
    let slow = CostModel::from_table(CostTable {
        encode_gbps: 1e-6,
        decode_gbps: 1e-6,
        ..Default::default()
    });
    let mut m = ActivationManager::new(p.clone(), s.clone(), ManagerConfig::new(slow)).unwrap();
    m.forward_start(LayerId(0)).unwrap();
    let keys: Vec<TensorKey> = layer_tensors(0)
        .into_iter()
        .filter_map(|(kind, dtype, numel)| {
            let data = generate(kind, dtype, numel, 1);
            let buf = produce(p.as_ref(), &s, &data);
            m.save(LayerId(0), saved(buf, dtype.dtype(), numel))
                .unwrap()
        })
        .collect();
    m.forward_start(LayerId(1)).unwrap();
    m.window(&Op::Fixed(Duration::from_millis(5)), || ())
        .unwrap();
    assert!(
        keys.iter().all(|k| !m.is_compressed(*k)),
        "nothing fits 5 ms"
    );
    m.window(&Op::Unbounded, || ()).unwrap();
    assert!(keys.iter().all(|k| m.is_compressed(*k)));
    assert_eq!(m.window_records().unwrap()[1].predicted, None);
}

/// A training loop opens windows forever: the manager keeps the last `RECORDS_KEPT` records
/// (and their events), not every one.
#[test]
fn window_records_stay_bounded() {
    let p = platform(None);
    let s = p.create_stream().unwrap();
    let mut m = ActivationManager::new(p.clone(), s, ManagerConfig::new(model())).unwrap();
    m.forward_start(LayerId(0)).unwrap();
    let kept = hprt_compress::RECORDS_KEPT;
    for i in 0..kept + 10 {
        m.window(&Op::Fixed(Duration::from_micros(i as u64)), || ())
            .unwrap();
    }
    let records = m.window_records().unwrap();
    assert_eq!(records.len(), kept);
    assert_eq!(
        records[kept - 1].predicted,
        Some(Duration::from_micros(kept as u64 + 9))
    );
    assert!(records.iter().all(|r| r.measured.is_some()));
}

/// The host codec, except that f32 encodes fail when they finish (the CPU codec refuses its
/// options there) and the encodes of 65,536 bf16 elements fail at launch.
struct FailingSome {
    good: HostCodec,
    bad: HostCodec,
}

impl DeviceCodec for FailingSome {
    fn name(&self) -> &'static str {
        "failing-some"
    }
    fn max_encoded_len(&self, dtype: CodecDType, numel: usize) -> usize {
        self.good.max_encoded_len(dtype, numel)
    }
    fn encode_async(
        &self,
        p: &dyn Platform,
        src: Place<&DeviceBuffer>,
        dtype: CodecDType,
        numel: usize,
        scratch: &DeviceBuffer,
        stream: &Stream,
    ) -> hprt_compress::Result<PendingEncode> {
        match (dtype, numel) {
            (CodecDType::BF16, 65_536) => Err(CompressError::InvalidState(
                "test: no encode for this one".into(),
            )),
            (CodecDType::F32, _) => self.bad.encode_async(p, src, dtype, numel, scratch, stream),
            _ => self
                .good
                .encode_async(p, src, dtype, numel, scratch, stream),
        }
    }
    fn decode_async(
        &self,
        p: &dyn Platform,
        src: &CompressedTensor,
        dst: Place<&DeviceBuffer>,
        stream: &Stream,
    ) -> hprt_compress::Result<PendingDecode> {
        self.good.decode_async(p, src, dst, stream)
    }
}

/// An encode that fails, at launch or when it finishes, costs its tensor nothing: it stays
/// uncompressed and reads back bit-exact, the window's other tensors are compressed as before,
/// and the failures are counted per layer and handed to the front end with their reasons.
#[test]
fn a_failed_encode_keeps_its_tensor_and_the_window_goes_on() {
    for jitter in [None, Some(3)] {
        let mut bad = HostCodec::default();
        bad.encode.prob_bits = 3; // outside 9..=14: the CPU codec refuses it
        let mut config = ManagerConfig::new(model());
        config.codec = Some(Arc::new(FailingSome {
            good: HostCodec::default(),
            bad,
        }));
        // `backward` checks every saved tensor bit-exact.
        let mut m = simulate_with(jitter, Duration::from_millis(2), 2, config);
        for (layer, s) in m.layer_stats() {
            if layer.0 < LAYERS - 1 {
                // Per step: the gelu tensor compressed, the f32 and the 65,536-element one not.
                assert_eq!(
                    (s.compressed, s.encode_failures),
                    (2, 4),
                    "{layer:?}: {s:?}"
                );
            } else {
                assert_eq!(
                    (s.compressed, s.encode_failures),
                    (0, 0),
                    "{layer:?}: {s:?}"
                );
            }
        }
        let failures = m.take_encode_failures();
        assert_eq!(failures.len(), 4 * (LAYERS - 1), "{failures:?}");
        assert!(
            failures
                .iter()
                .any(|(_, e)| e.to_string().contains("no encode for this one")),
            "{failures:?}"
        );
        assert!(m.take_encode_failures().is_empty(), "taken once");
    }
}

/// A borrowed tensor (a framework's memory) goes back to its owner once it is encoded, not
/// when backward takes it; its decode lands in a new buffer of hprt's, bit-exact.
#[test]
fn a_borrowed_tensor_goes_back_to_its_owner_while_compressed() {
    use std::sync::atomic::Ordering;
    for jitter in [None, Some(9)] {
        let (p, s, mut m) = manager(jitter);
        let n = 65_536;
        let data = generate(DataKind::Gelu, CodecDType::BF16, n, 1);
        let (borrowed, released) = common::borrowed(p.as_ref(), &s, &data);
        m.forward_start(LayerId(0)).unwrap();
        let key = m
            .save(LayerId(0), saved(borrowed, DType::BF16, n))
            .unwrap()
            .unwrap();
        m.forward_start(LayerId(1)).unwrap();
        m.window(&Op::Unbounded, || ()).unwrap(); // encodes layer 0
        assert!(m.is_compressed(key));
        p.synchronize_device().unwrap();
        assert!(
            released.load(Ordering::SeqCst),
            "jitter {jitter:?}: the owner's memory is held while compressed"
        );
        m.backward_start(LayerId(1)).unwrap();
        m.backward_start(LayerId(0)).unwrap(); // recovered here
        let back = m.take(key).unwrap();
        assert!(!back.is_borrowed());
        let mut bytes = vec![0u8; data.len()];
        p.read_device_sync(&back, 0, &mut bytes, &s).unwrap();
        assert!(bytes == data, "jitter {jitter:?}: not bit-exact");
    }
}
