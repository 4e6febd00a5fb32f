//! A simulated training step: N layers whose forward saves random activations (a whole storage,
//! two views of a second storage, and a non-tensor value) and whose backward reads them back,
//! driven through any front end. Every byte read back is compared with what was saved, and the
//! device memory peak is measured; tests and the benchmark build on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hprt_platform::{DType, DeviceBuffer, Platform, Stream};

use crate::engine::{Faults, PlatformHandle};
use crate::error::{Result, SwapError};
use crate::keyed::{KeyedSwap, Packed, SwapContext};
use crate::layer_group::{LayerId, SavedRef, SwapManager};
use crate::pipeline::{OffloadTag, PipelineConfig, PipelineOffload};
use crate::pool::PoolStats;
use crate::tensor::{DeviceTensor, Saved};

/// Which front end drives the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontEnd {
    /// No swap: every activation stays on the device (the baseline).
    NoSwap,
    LayerGroup,
    Keyed,
    Pipeline,
}

impl FrontEnd {
    pub const SWAPPING: [FrontEnd; 3] = [FrontEnd::LayerGroup, FrontEnd::Keyed, FrontEnd::Pipeline];
}

/// Shape of a simulated step.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub layers: usize,
    /// Bytes of the whole-storage activation; each layer holds 3× this on the device.
    pub tensor_bytes: usize,
    /// Seed of the activation bytes.
    pub seed: u64,
    pub iterations: usize,
    /// Bytes of simulated compute (a memset on the compute stream) per layer and direction.
    pub compute_bytes: usize,
    #[doc(hidden)]
    pub faults: Faults,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            layers: 4,
            tensor_bytes: 4096,
            seed: 1,
            iterations: 1,
            compute_bytes: 0,
            faults: Faults::default(),
        }
    }
}

/// What a simulated run observed.
#[derive(Clone, Debug)]
pub struct SimReport {
    /// Saved tensors whose bytes came back different (0 = every byte matched).
    pub mismatched_tensors: usize,
    pub first_mismatch: Option<String>,
    /// Device memory peak over the run, from the platform's accounting.
    pub device_peak: usize,
    /// Device bytes of one layer's activations.
    pub layer_bytes: usize,
    /// A hash of every byte read back in backward (equal across front ends for equal seeds).
    pub digest: u64,
    pub elapsed: Duration,
    pub pool: PoolStats,
}

/// splitmix64: a few random bytes without a dependency.
fn fill_random(seed: u64, out: &mut [u8]) {
    let mut x = seed;
    for chunk in out.chunks_mut(8) {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(hash, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The saved-value handles of one layer, as each front end hands them out.
enum Handles {
    Plain(Vec<Saved>),
    Group(Vec<SavedRef>),
    Keyed(Vec<Packed>),
    Pipeline(Vec<OffloadTag>),
}

enum Driver {
    NoSwap,
    LayerGroup(SwapManager, Vec<LayerId>),
    Keyed(KeyedSwap, Vec<SwapContext>),
    Pipeline(PipelineOffload),
}

impl Driver {
    fn new(p: &PlatformHandle, front: FrontEnd, layers: usize, faults: Faults) -> Result<Self> {
        Ok(match front {
            FrontEnd::NoSwap => Driver::NoSwap,
            FrontEnd::LayerGroup => {
                let mut m = SwapManager::new(p.clone())?;
                m.set_faults(faults);
                let ids: Vec<LayerId> = (0..layers).map(|_| m.new_layer()).collect();
                for w in ids.windows(2) {
                    m.set_forward_prefetch_layer(w[0], w[1])?;
                }
                Driver::LayerGroup(m, ids)
            }
            FrontEnd::Keyed => {
                let mut k = KeyedSwap::new(p.clone())?;
                k.set_faults(faults);
                let ctx = (0..layers)
                    .map(|_| k.register_layer("model.layer.*"))
                    .collect();
                Driver::Keyed(k, ctx)
            }
            FrontEnd::Pipeline => {
                let cfg = PipelineConfig {
                    min_tensor_elems: 1,
                    ..PipelineConfig::default()
                };
                let mut o = PipelineOffload::new(p.clone(), cfg)?;
                o.set_faults(faults);
                Driver::Pipeline(o)
            }
        })
    }

    fn begin_forward(&mut self) -> Result<()> {
        if let Driver::Pipeline(o) = self {
            o.init_chunk(1, None)?;
        }
        Ok(())
    }

    fn forward(&mut self, layer: usize, values: Vec<Saved>, s: &Stream) -> Result<Handles> {
        Ok(match self {
            Driver::NoSwap => Handles::Plain(values),
            Driver::LayerGroup(m, ids) => {
                m.forward_pre(ids[layer])?;
                let refs = values
                    .into_iter()
                    .map(|v| m.save(v))
                    .collect::<Result<_>>()?;
                m.forward_post(ids[layer], s)?;
                Handles::Group(refs)
            }
            Driver::Keyed(k, ctx) => Handles::Keyed(
                values
                    .into_iter()
                    .map(|v| k.pack(&ctx[layer], v, s))
                    .collect::<Result<_>>()?,
            ),
            Driver::Pipeline(o) => {
                o.group_start(&format!("layer{layer}"))?;
                let tags = values
                    .into_iter()
                    .map(|v| o.save(v))
                    .collect::<Result<_>>()?;
                o.group_commit(s, Vec::new(), false)?;
                Handles::Pipeline(tags)
            }
        })
    }

    fn backward(&mut self, layer: usize, handles: Handles, s: &Stream) -> Result<Vec<Saved>> {
        match (self, handles) {
            (Driver::NoSwap, Handles::Plain(v)) => Ok(v),
            (Driver::LayerGroup(m, ids), Handles::Group(refs)) => {
                m.backward_pre(ids[layer], s)?;
                let values = refs
                    .iter()
                    .map(|r| m.get(*r).cloned())
                    .collect::<Result<_>>()?;
                m.backward_post(ids[layer])?;
                m.release(ids[layer])?;
                Ok(values)
            }
            // Autograd reads saved values back in reverse order.
            (Driver::Keyed(k, _), Handles::Keyed(packed)) => {
                let mut v = packed
                    .into_iter()
                    .rev()
                    .map(|p| k.unpack(p, s))
                    .collect::<Result<Vec<_>>>()?;
                v.reverse();
                Ok(v)
            }
            (Driver::Pipeline(o), Handles::Pipeline(tags)) => {
                o.backward_group_begin(&format!("layer{layer}"), s)?;
                let v = tags.iter().map(|t| o.get(t, s)).collect::<Result<_>>()?;
                o.backward_group_end()?;
                Ok(v)
            }
            _ => unreachable!("handles come from the same driver"),
        }
    }

    fn end_iteration(&mut self, iteration: usize) -> Result<Option<PoolStats>> {
        Ok(match self {
            Driver::NoSwap => None,
            Driver::LayerGroup(m, _) => {
                let stats = m.engine().pool_stats();
                m.end_iteration()?;
                Some(stats)
            }
            Driver::Keyed(k, _) => {
                let stats = k.engine().pool_stats();
                k.end_iteration()?;
                Some(stats)
            }
            Driver::Pipeline(o) => {
                let stats = o.engine().pool_stats();
                if iteration == 0 {
                    o.post_warmup();
                }
                o.reset()?;
                Some(stats)
            }
        })
    }
}

/// Runs `cfg.iterations` simulated steps through `front` on `platform` and checks every byte.
pub fn simulate(
    platform: impl Into<PlatformHandle>,
    front: FrontEnd,
    cfg: &SimConfig,
) -> Result<SimReport> {
    let platform = platform.into();
    let p: &dyn Platform = &*platform;
    let tb = cfg.tensor_bytes;
    if tb < 2 || cfg.layers == 0 {
        return Err(SwapError::Order(
            "the simulation needs at least one layer and 2-byte tensors".into(),
        ));
    }
    let compute = p.create_stream()?;
    // Per layer: storage A (tb) then storage B (2·tb); views of B: [0, tb/2) and [tb, 2tb).
    let per_layer_src = 3 * tb;
    let readback_per_layer = tb + tb / 2 + tb;
    let scratch = match cfg.compute_bytes {
        0 => None,
        n => Some(p.alloc_device(n)?),
    };
    let mut driver = Driver::new(&platform, front, cfg.layers, cfg.faults)?;
    let start = Instant::now();
    p.synchronize_device()?;
    p.reset_peak_memory();
    let (mut mismatched, mut first_mismatch, mut digest) = (0, None, 0xcbf2_9ce4_8422_2325u64);
    let mut pool = PoolStats::default();
    for iteration in 0..cfg.iterations {
        let mut src_bytes = vec![0u8; per_layer_src * cfg.layers];
        fill_random(
            cfg.seed.wrapping_mul(1000).wrapping_add(iteration as u64),
            &mut src_bytes,
        );
        let src = p.alloc_pinned(src_bytes.len())?;
        src.write(0, &src_bytes)?;
        let readback = p.alloc_pinned(readback_per_layer * cfg.layers)?;

        driver.begin_forward()?;
        let mut saved = Vec::with_capacity(cfg.layers);
        for layer in 0..cfg.layers {
            let a = p.alloc_device(tb)?;
            let b = p.alloc_device(2 * tb)?;
            let base = layer * per_layer_src;
            p.copy_async((&a).into(), 0, (&src).into(), base, tb, &compute)?;
            p.copy_async((&b).into(), 0, (&src).into(), base + tb, 2 * tb, &compute)?;
            if let Some(s) = &scratch {
                p.memset_async(s, 0, layer as u8, s.len(), &compute)?;
            }
            let values = vec![
                Saved::Tensor(DeviceTensor::whole(a.clone(), DType::U8, vec![tb])),
                Saved::Tensor(DeviceTensor::view(b.clone(), 0, DType::U8, vec![tb / 2])?),
                Saved::Tensor(DeviceTensor::view(b.clone(), tb, DType::U8, vec![tb])?),
                Saved::Other(Arc::new(layer)),
            ];
            saved.push((driver.forward(layer, values, &compute)?, a, b));
        }
        for layer in (0..cfg.layers).rev() {
            let (handles, a, b): (Handles, DeviceBuffer, DeviceBuffer) =
                saved.pop().expect("one entry per layer");
            let values = driver.backward(layer, handles, &compute)?;
            let mut at = layer * readback_per_layer;
            for v in &values {
                match v {
                    Saved::Tensor(t) => {
                        p.copy_async(
                            (&readback).into(),
                            at,
                            (&t.storage).into(),
                            t.offset,
                            t.len,
                            &compute,
                        )?;
                        at += t.len;
                    }
                    Saved::Other(x) => {
                        if x.downcast_ref::<usize>() != Some(&layer) {
                            mismatched += 1;
                            first_mismatch
                                .get_or_insert(format!("layer {layer}: non-tensor value changed"));
                        }
                    }
                }
            }
            if let Some(s) = &scratch {
                p.memset_async(s, 0, !(layer as u8), s.len(), &compute)?;
            }
            drop(values);
            // The framework drops the layer's activations once its backward is queued, and
            // paces its host with the device per layer: the platform counts freed bytes until
            // the queued work on them ran, so a host far ahead would show as device memory.
            p.free_device(&a)?;
            p.free_device(&b)?;
            p.synchronize_stream(&compute)?;
        }
        p.synchronize_stream(&compute)?;
        let got = readback.to_vec()?;
        for layer in 0..cfg.layers {
            let src = &src_bytes[layer * per_layer_src..];
            let expected = [&src[..tb], &src[tb..tb + tb / 2], &src[2 * tb..3 * tb]];
            let mut at = layer * readback_per_layer;
            for (i, want) in expected.iter().enumerate() {
                let have = &got[at..at + want.len()];
                if have != *want {
                    mismatched += 1;
                    let bad = have.iter().zip(want.iter()).filter(|(x, y)| x != y).count();
                    first_mismatch.get_or_insert(format!(
                        "iteration {iteration}, layer {layer}, tensor {i}: {bad} of {} bytes differ",
                        want.len()
                    ));
                }
                at += want.len();
            }
        }
        digest = fnv(digest, &got);
        if let Some(s) = driver.end_iteration(iteration)? {
            pool = s;
        }
    }
    p.synchronize_device()?;
    Ok(SimReport {
        mismatched_tensors: mismatched,
        first_mismatch,
        device_peak: p.memory_stats().device_peak,
        layer_bytes: 3 * tb,
        digest,
        elapsed: start.elapsed(),
        pool,
    })
}
