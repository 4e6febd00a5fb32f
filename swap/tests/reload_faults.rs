//! A failed reload loses nothing (README: "a failed reload keeps the host or compressed copy and
//! can be retried"): on the CUDA emulator, each driver call a reload makes fails once, for every
//! payload (hprt's own storage, a framework's borrowed memory; raw, device codec, host stage),
//! and the retry brings the bytes back. The engine used to re-acquire the storage before the
//! copy was queued and keep it when a later step failed: the tensor stayed in `host` with its
//! storage re-acquired, and every retry was refused.

use std::sync::Arc;

use hprt_conformance::{cuda_emulator, emulator::Control};
use hprt_platform::{DType, DeviceBuffer, Platform, Stream};
use hprt_swap::{
    Compression, DeviceTensor, EngineConfig, Reacquired, Saved, SwapEngine, SwapManager, SwapState,
    SwapTensor,
};

mod common;
use common::{reacquired, read};

const NUMEL: usize = 16 << 10;

/// The emulator's fault table is global to the process: one test at a time sets it.
static FAULT_TABLE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    FAULT_TABLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// How each test starts: the fault table to itself, the cuda backend on the emulator, the
/// emulator's fault controls and a stream.
fn on_the_emulator() -> (
    std::sync::MutexGuard<'static, ()>,
    Arc<dyn Platform>,
    Control,
    Stream,
) {
    let only = exclusive();
    let p: Arc<dyn Platform> = Arc::new(cuda_emulator::open().expect("cuda on the emulator"));
    let control = Control::open(&cuda_emulator::library_path());
    let s = p.create_stream().unwrap();
    (only, p, control, s)
}

/// What a reload calls, by driver entry point (the emulator's fault table names them).
const FAULTS: [&str; 6] = [
    "cuMemcpyAsync",
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuMemAlloc_v2",
    "cuLaunchKernel",
    "cuLaunchHostFunc",
];

fn data() -> Vec<u8> {
    // bf16 activations the codec compresses (a smooth ramp with small noise).
    (0..NUMEL)
        .flat_map(|i| {
            let v = half::bf16::from_f32(((i % 977) as f32 - 488.0) / 300.0);
            v.to_le_bytes()
        })
        .collect()
}

fn borrowed(p: &Arc<dyn Platform>, mem: DeviceBuffer) -> DeviceTensor {
    let (ptr, len) = (mem.device_ptr(), mem.len());
    // SAFETY: `mem` is live device memory of `p`, kept by the release callback.
    let storage = unsafe {
        p.wrap_device_memory(ptr, len, Some(Box::new(move || drop(mem))))
            .unwrap()
    };
    let q = Arc::clone(p);
    let alloc = move |like: &DeviceTensor| -> hprt_swap::Result<Reacquired> {
        let mem = q.alloc_device(like.len)?;
        let (ptr, len) = (mem.device_ptr(), mem.len());
        // SAFETY: as above.
        let storage = unsafe { q.wrap_device_memory(ptr, len, Some(Box::new(move || drop(mem)))) }?;
        Ok(reacquired(storage))
    };
    DeviceTensor::borrowed(storage, DType::BF16, vec![NUMEL], None, Arc::new(alloc)).unwrap()
}

#[test]
fn every_failed_reload_step_keeps_the_host_copy_and_the_retry_succeeds() {
    let (_only, p, control, s) = on_the_emulator();
    let want = data();
    let mut failed = Vec::new();
    for compression in [
        Compression::Off,
        Compression::Device,
        Compression::HostStage,
    ] {
        for borrow in [false, true] {
            for fault in FAULTS {
                let what = format!("{compression:?} borrowed={borrow} {fault}");
                let config = EngineConfig {
                    compression,
                    ..EngineConfig::default()
                };
                let mut engine = SwapEngine::new(Arc::clone(&p), config).unwrap();
                // Two tensors a call: the device codec decodes them with one launch, and its
                // failure must give both back.
                let mut pair: Vec<SwapTensor> = (0..2)
                    .map(|_| {
                        let mem = p.alloc_device(want.len()).unwrap();
                        p.write_device_sync(&mem, 0, &want, &s).unwrap();
                        let tensor = if borrow {
                            borrowed(&p, mem)
                        } else {
                            DeviceTensor::whole(mem, DType::BF16, vec![NUMEL])
                        };
                        SwapTensor::new(Saved::Tensor(tensor)).unwrap()
                    })
                    .collect();
                engine.offload(pair.iter_mut(), &s).unwrap();
                engine.finish_offload(pair.iter_mut()).unwrap();
                control.faults(&format!("{fault}:1:2"));
                let started = engine.start_reload(pair.iter_mut());
                if compression == Compression::Device && fault == "cuLaunchKernel" {
                    // The pair's one decode launch failed: both go back to the host.
                    assert!(started.is_err(), "{what}");
                    assert!(pair.iter().all(|t| t.state() == SwapState::Host), "{what}");
                }
                let first = started.and_then(|()| engine.finish_reload(pair.iter_mut(), &s));
                control.faults("");
                if first.is_ok() {
                    // This payload's reload does not call it.
                    assert!(pair.iter().all(|t| read(&p, &s, t) == want), "{what}");
                    continue;
                }
                // Failed before its copy was queued: back on the host; after (the compute
                // stream's wait): still reloading, for `finish_reload` again.
                for t in &pair {
                    assert!(
                        matches!(t.state(), SwapState::Host | SwapState::H2d),
                        "{what}: {first:?} left {}",
                        t.state()
                    );
                }
                let retry = engine
                    .start_reload(pair.iter_mut())
                    .and_then(|()| engine.finish_reload(pair.iter_mut(), &s));
                match retry {
                    Ok(()) => assert!(pair.iter().all(|t| read(&p, &s, t) == want), "{what}"),
                    Err(e) => failed.push(format!("{what}: {e}")),
                }
                engine.synchronize().unwrap();
            }
        }
    }
    assert!(failed.is_empty(), "retries refused:\n{}", failed.join("\n"));
}

#[test]
fn a_failed_prefetch_does_not_stop_the_layer_whose_backward_begins() {
    let (_only, p, control, s) = on_the_emulator();
    let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
    let layers = [m.new_layer(), m.new_layer(), m.new_layer()];
    m.set_forward_prefetch_layer(layers[0], layers[1]).unwrap();
    m.set_forward_prefetch_layer(layers[1], layers[2]).unwrap();
    let want = data();
    let mut refs = Vec::new();
    for &l in &layers {
        m.forward_pre(l).unwrap();
        let mem = p.alloc_device(want.len()).unwrap();
        p.write_device_sync(&mem, 0, &want, &s).unwrap();
        refs.push(
            m.save(Saved::Tensor(DeviceTensor::whole(
                mem,
                DType::BF16,
                vec![NUMEL],
            )))
            .unwrap(),
        );
        m.forward_post(l, &s).unwrap();
    }
    m.backward_pre(layers[2], &s).unwrap();
    m.backward_post(layers[2]).unwrap();
    // Layer 1 is loaded on demand here (its prefetch ran above); its backward_pre prefetches
    // layer 0, whose copy fails: layer 1 goes on, layer 0 loads at its own backward_pre.
    control.faults("cuMemcpyAsync:1:2");
    m.backward_pre(layers[1], &s).unwrap();
    control.faults("");
    assert_eq!(m.state(refs[1]).unwrap(), SwapState::Device);
    assert_eq!(m.state(refs[0]).unwrap(), SwapState::Host);
    m.backward_post(layers[1]).unwrap();
    m.backward_pre(layers[0], &s).unwrap();
    for r in refs {
        let v = m.take(r).unwrap();
        let t = v.tensor().unwrap();
        let mut out = vec![0; t.len];
        p.read_device_sync(&t.storage, 0, &mut out, &s).unwrap();
        assert!(out == want);
    }
}
