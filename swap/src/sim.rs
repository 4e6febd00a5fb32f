//! A simulated training step: N layers whose forward saves random activations (a whole storage,
//! two views of a second storage, and a non-tensor value) and whose backward reads them back,
//! driven through any front end. Every byte read back is compared with what was saved, and the
//! device memory peak is measured; tests and the benchmark build on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hprt_compress::CompressError;
use hprt_platform::{DType, DeviceBuffer, Platform, Stream};

use crate::engine::{EngineStats, Faults, PlatformHandle, SwapEngine};
use crate::error::{Result, SwapError};
use crate::keyed::{KeyedSwap, Packed, SwapContext};
use crate::layer_group::{SavedRef, SwapManager};
use crate::payload::Compression;
use crate::pipeline::{OffloadTag, PipelineConfig, PipelineOffload};
use crate::pool::PoolStats;
use crate::tensor::{Allocator, DeviceTensor, Reacquired, Saved, VersionCounter};
use crate::LayerId;

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

/// Which payload the step saves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PayloadKind {
    /// hprt storages (released by resizing).
    Owned,
    /// A simulated framework's memory, borrowed: the framework drops its own references once
    /// the value is saved, and gives new memory through an [`crate::Allocator`] on reload.
    Borrowed,
}

impl PayloadKind {
    pub const ALL: [PayloadKind; 2] = [PayloadKind::Owned, PayloadKind::Borrowed];
}

/// Every payload kind × compression the engine supports, for tests that cover them all.
pub const PAYLOADS: [(PayloadKind, Compression); 6] = [
    (PayloadKind::Owned, Compression::Off),
    (PayloadKind::Borrowed, Compression::Off),
    (PayloadKind::Owned, Compression::Device),
    (PayloadKind::Borrowed, Compression::Device),
    (PayloadKind::Owned, Compression::HostStage),
    (PayloadKind::Borrowed, Compression::HostStage),
];

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
    pub payload: PayloadKind,
    /// Compress-then-swap (the activations are then f32, from random bits: NaNs, infinities
    /// and subnormals included).
    pub compression: Compression,
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
            payload: PayloadKind::Owned,
            compression: Compression::Off,
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
    /// The front end's engine counters (bytes over the link, codec time, ...).
    pub engine: EngineStats,
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
    Pipeline(Box<PipelineOffload>),
}

impl Driver {
    fn new(p: &PlatformHandle, front: FrontEnd, cfg: &SimConfig) -> Result<Self> {
        let (layers, faults) = (cfg.layers, cfg.faults);
        let mut driver = match front {
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
                Driver::Pipeline(Box::new(o))
            }
        };
        if let Some(e) = driver.engine_mut() {
            e.set_compression(cfg.compression);
        }
        Ok(driver)
    }

    fn engine_mut(&mut self) -> Option<&mut SwapEngine> {
        match self {
            Driver::NoSwap => None,
            Driver::LayerGroup(m, _) => Some(m.engine_mut()),
            Driver::Keyed(k, _) => Some(k.engine_mut()),
            Driver::Pipeline(o) => Some(o.engine_mut()),
        }
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
                let values = refs.iter().map(|r| m.take(*r)).collect::<Result<_>>()?;
                m.backward_post(ids[layer])?;
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

    fn end_iteration(&mut self, iteration: usize) -> Result<Option<(PoolStats, EngineStats)>> {
        let Some(e) = self.engine_mut() else {
            return Ok(None);
        };
        let stats = (e.pool_stats(), e.stats());
        match self {
            Driver::NoSwap => {}
            Driver::LayerGroup(m, _) => m.end_iteration()?,
            Driver::Keyed(k, _) => k.end_iteration()?,
            Driver::Pipeline(o) => {
                if iteration == 0 {
                    o.post_warmup();
                }
                o.reset()?;
            }
        }
        Ok(Some(stats))
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
    let mut driver = Driver::new(&platform, front, cfg)?;
    let dtype = match cfg.compression {
        Compression::Off => DType::U8,
        _ if tb % 8 == 0 => DType::F32,
        _ => {
            return Err(SwapError::Order(
                "compressed simulations need tensor_bytes divisible by 8".into(),
            ))
        }
    };
    let tensor = |buf: &DeviceBuffer, offset: usize, len: usize| -> Result<Saved> {
        let shape = vec![len / dtype.size()];
        Ok(Saved::Tensor(match cfg.payload {
            PayloadKind::Owned => DeviceTensor::view(buf.clone(), offset, dtype, shape)?,
            PayloadKind::Borrowed => DeviceTensor::borrowed(
                borrow(p, buf, offset, len)?,
                dtype,
                shape,
                None,
                Arc::new(FrameworkAllocator(platform.clone())),
            )?,
        }))
    };
    let start = Instant::now();
    p.synchronize_device()?;
    p.reset_peak_memory();
    let (mut mismatched, mut first_mismatch, mut digest) = (0, None, 0xcbf2_9ce4_8422_2325u64);
    let mut pool = PoolStats::default();
    let mut engine = EngineStats::default();
    'run: for iteration in 0..cfg.iterations {
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
                tensor(&a, 0, tb)?,
                tensor(&b, 0, tb / 2)?,
                tensor(&b, tb, tb)?,
                Saved::Other(Arc::new(layer)),
            ];
            let handles = driver.forward(layer, values, &compute)?;
            // A framework keeps no reference of its own to borrowed saved memory.
            let owned = (cfg.payload == PayloadKind::Owned).then_some((a, b));
            saved.push((handles, owned));
        }
        for layer in (0..cfg.layers).rev() {
            let (handles, owned) = saved.pop().expect("one entry per layer");
            let values = match driver.backward(layer, handles, &compute) {
                Ok(values) => values,
                // A reload whose decode fails its checksum did not bring the bytes back: a
                // mismatch (what an encode reading a tensor still being written gives, where
                // the host codec codes device memory in place), which ends the run.
                Err(e @ SwapError::Codec(CompressError::Corrupt { .. })) => {
                    mismatched += 1;
                    first_mismatch.get_or_insert(format!(
                        "iteration {iteration}, layer {layer}: the reload failed its check: {e}"
                    ));
                    break 'run;
                }
                Err(e) => return Err(e),
            };
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
            if let Some((a, b)) = owned {
                p.free_device(&a)?;
                p.free_device(&b)?;
            }
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
            (pool, engine) = s;
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
        engine,
    })
}

/// `len` bytes at `offset` of `owner` as borrowed memory that keeps `owner` alive until swap
/// (and everything else in hprt) dropped it: how a framework hands its tensors to swap.
pub fn borrow(
    p: &dyn Platform,
    owner: &DeviceBuffer,
    offset: usize,
    len: usize,
) -> Result<DeviceBuffer> {
    let keep = owner.clone();
    // SAFETY: `owner` is live device memory of `p` covering `offset..offset + len`, kept alive
    // by the release callback until nothing references the borrowed range.
    Ok(unsafe {
        p.wrap_device_memory(
            owner.device_ptr() + offset,
            len,
            Some(Box::new(move || drop(keep))),
        )?
    })
}

/// The simulated framework's allocator: fresh device memory, borrowed like the original.
pub struct FrameworkAllocator(pub PlatformHandle);

impl Allocator for FrameworkAllocator {
    fn allocate(&self, like: &DeviceTensor) -> Result<Reacquired> {
        let mem = self.0.alloc_device(like.len)?;
        Ok(Reacquired {
            storage: borrow(&*self.0, &mem, 0, like.len)?,
            offset: 0,
            handle: None,
            version: VersionCounter::new(),
            ready_on: None,
        })
    }
}
