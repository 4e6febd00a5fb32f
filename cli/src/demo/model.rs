//! One rank's training steps under one [`Strategy`]: the model, its sharded weights, and where
//! its saved activations wait for the backward.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hprt_compress::CodecDType;
use hprt_compress::{codec_for, CompressedTensor, DeviceCodec, PendingDecode, PendingEncode};
use hprt_hsdp::{
    DataParallelMesh, DeviceMesh, GradInput, GradQueue, GroupCache, HsdpStreams, ParamConfig,
    ParamSpec, ReduceOptions, ShardRef, ShardedParam,
};
use hprt_platform::{Communicator, DType, DeviceBuffer, Event, Kernel, Place, Platform, Stream};
use hprt_swap::{Compression, DeviceTensor, EngineConfig, Saved, SwapEngine, SwapTensor};

use super::{DemoConfig, DemoError, Result, Strategy};
use crate::trace::{scope, Role, TracingPlatform};

/// The two activations each layer saves for its backward.
pub(crate) const SAVED: [&str; 2] = ["input", "hidden"];

const LEARNING_RATE: f64 = 1e-3;

/// What one rank ends a strategy's run with.
#[derive(Clone, Debug)]
pub(crate) struct RankResult {
    pub rank: usize,
    /// Every parameter's final shard, in parameter order.
    pub weights: Vec<u8>,
    /// Every parameter's reduced gradient shard of the last step.
    pub grads: Vec<u8>,
    /// The model's output of the last step.
    pub output: Vec<u8>,
    pub step_times: Vec<Duration>,
    /// Highest device memory in use during the steps (of this rank's device).
    pub peak_device: usize,
    /// Device memory in use when a step starts (shards, their gradients, buffers kept).
    pub resident_device: usize,
    /// Original and encoded bytes of every compressed activation, by [`SAVED`] kind.
    pub encoded: [(u64, u64); 2],
    /// The last step's start and end on the trace clock.
    pub last_step_us: (f64, f64),
}

pub(crate) fn mesh_name(ranks: usize) -> String {
    if ranks >= 4 && ranks % 2 == 0 {
        format!("HSDP 2 x {} (replicate x shard)", ranks / 2)
    } else {
        format!("FSDP over {ranks}")
    }
}

fn data_parallel(ranks: usize) -> Result<DataParallelMesh> {
    Ok(if ranks >= 4 && ranks % 2 == 0 {
        DataParallelMesh::hsdp(DeviceMesh::contiguous(&[2, ranks / 2])?)?
    } else {
        DataParallelMesh::fsdp(DeviceMesh::contiguous(&[ranks])?)?
    })
}

/// Deterministic values in `[-scale, scale)`, a different sequence per `seed`.
fn values(seed: u64, n: usize, scale: f32) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(4 * n);
    for _ in 0..n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let unit = (s >> 40) as f32 / (1u64 << 24) as f32;
        out.extend_from_slice(&((2.0 * unit - 1.0) * scale).to_le_bytes());
    }
    out
}

fn codec_dtype(d: DType) -> Result<CodecDType> {
    CodecDType::of(d).ok_or_else(|| {
        DemoError::InvalidOption(format!("activations of dtype {d} cannot be compressed"))
    })
}

/// Where one layer's saved activations are.
#[derive(Default)]
struct LayerSaves {
    /// The activations in the activation dtype; resized to 0 while they are away.
    acts: Vec<DeviceBuffer>,
    numel: [usize; 2],
    encoding: Vec<PendingEncode>,
    packed: Vec<CompressedTensor>,
    decoding: Vec<PendingDecode>,
    /// The swap trackers over `acts` (the engine compresses them for compress-then-swap).
    swapped: Vec<SwapTensor>,
}

/// One rank's run of one strategy.
struct Rank<'p> {
    tp: &'p TracingPlatform,
    p: &'p dyn Platform,
    rank: usize,
    config: &'p DemoConfig,
    strategy: Strategy,
    streams: HsdpStreams,
    params: Vec<ShardedParam>,
    engine: Option<SwapEngine>,
    codec: Arc<dyn DeviceCodec>,
    codec_stream: Option<Stream>,
    /// Encode scratch, one per saved kind, reused layer after layer on the codec stream.
    scratch: Vec<DeviceBuffer>,
    /// Cross-stream ordering mark (a wait binds to the record just before it).
    mark: Event,
    saves: Vec<LayerSaves>,
    encoded: [(u64, u64); 2],
}

pub(crate) fn train(
    traced: &Arc<TracingPlatform>,
    comm: Communicator,
    config: &DemoConfig,
    strategy: Strategy,
    tick: &dyn Fn(u64),
) -> Result<RankResult> {
    let tp: &TracingPlatform = traced;
    let p: &dyn Platform = tp;
    let rank = comm.rank();
    let cache = GroupCache::new(Arc::clone(traced) as Arc<dyn Platform>, comm);
    let streams = HsdpStreams::new(p)?;
    tp.name_stream(&streams.compute, Role::Compute, "compute");
    tp.name_stream(&streams.all_gather, Role::Comm, "comm all-gather");
    tp.name_stream(&streams.reduce, Role::Comm, "comm reduce");
    let (h, f) = (config.hidden, config.ffn());
    let dp = data_parallel(config.ranks)?;
    let mut params = Vec::with_capacity(2 * config.layers);
    for l in 0..config.layers {
        for (i, shape) in [[h, f], [f, h]].into_iter().enumerate() {
            // Every rank starts from the same full weights, scaled so activations stay O(1).
            let full = p.alloc_device(4 * h * f)?;
            let init = values(
                1000 + (2 * l + i) as u64,
                h * f,
                1.0 / (shape[0] as f32).sqrt(),
            );
            p.write_device_sync(&full, 0, &init, &streams.compute)?;
            let spec = ParamSpec::new(&format!("L{l}.w{}", i + 1), &shape, DType::F32);
            let cfg = ParamConfig::default();
            params.push(ShardedParam::new(
                &cache,
                &streams,
                &dp,
                spec,
                &cfg,
                (&full).into(),
            )?);
        }
    }
    p.synchronize_stream(&streams.compute)?;
    let codec = codec_for(p);
    let codec_stream = if strategy.compresses() {
        let s = p.create_stream()?;
        tp.name_stream(&s, Role::Codec, "codec");
        Some(s)
    } else {
        None
    };
    // Compress alone encodes into scratch it keeps on the device; compress-then-swap is the
    // swap engine's own (the device codec on the codec stream, only encodings over the link).
    let scratch = if strategy == Strategy::Compress {
        let cdt = codec_dtype(config.act_dtype)?;
        [config.seq * h, config.seq * f]
            .into_iter()
            .map(|n| p.alloc_device(codec.max_encoded_len(cdt, n)))
            .collect::<hprt_platform::Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let engine = if strategy.swaps() {
        let compression = match strategy {
            Strategy::CompressSwap => Compression::Device,
            _ => Compression::Off,
        };
        let e = SwapEngine::new(
            Arc::clone(traced) as Arc<dyn Platform>,
            EngineConfig {
                single_copy_stream: false,
                compression,
                codec_stream: codec_stream.clone(),
                ..EngineConfig::default()
            },
        )?;
        tp.name_stream(e.d2h_stream(), Role::D2h, "d2h");
        tp.name_stream(e.h2d_stream(), Role::H2d, "h2d");
        Some(e)
    } else {
        None
    };
    let mark = p.create_event(false)?;
    let mut r = Rank {
        tp,
        p,
        rank,
        config,
        strategy,
        streams,
        params,
        engine,
        codec,
        codec_stream,
        scratch,
        mark,
        saves: Vec::new(),
        encoded: [(0, 0); 2],
    };
    let input = values(7 + rank as u64, config.seq * h, 1.0);
    let x = p.alloc_device(input.len())?;
    let mut step_times = Vec::with_capacity(config.steps);
    let (mut peak, mut resident, mut last_step_us) = (0, 0, (0.0, 0.0));
    let mut output = Vec::new();
    let mut grads = Vec::new();
    for step in 0..config.steps {
        // Ranks start together: the step time is then the slowest rank's.
        r.p.barrier(cache.world(), &r.streams.compute)?;
        r.sync()?;
        p.reset_peak_memory();
        resident = resident.max(p.memory_stats().device_current);
        let (t0, us0) = (Instant::now(), tp.recorder().now_us());
        let last = step + 1 == config.steps;
        p.write_device_sync(&x, 0, &input, &r.streams.compute)?;
        let g = r.forward(&x, tick)?;
        if last {
            output = r.download(&x, input.len())?;
        }
        r.backward(g, tick)?;
        grads = r.update(last)?;
        r.sync()?;
        step_times.push(t0.elapsed());
        last_step_us = (us0, tp.recorder().now_us());
        peak = peak.max(p.memory_stats().device_peak);
    }
    let mut weights = Vec::new();
    for i in 0..r.params.len() {
        if let ShardRef::Device(w) = r.params[i].sharded_data() {
            let n = r.params[i].geometry().shard_numel() * 4;
            weights.extend(r.download_ref(w, n)?);
        }
    }
    Ok(RankResult {
        rank,
        weights,
        grads,
        output,
        step_times,
        peak_device: peak,
        resident_device: resident,
        encoded: r.encoded,
        last_step_us,
    })
}

impl<'p> Rank<'p> {
    fn compute(&self) -> &Stream {
        &self.streams.compute
    }

    fn sync(&self) -> Result<()> {
        let s = &self.streams;
        for st in [&s.compute, &s.all_gather, &s.reduce] {
            self.p.synchronize_stream(st)?;
        }
        if let Some(c) = &self.codec_stream {
            self.p.synchronize_stream(c)?;
        }
        if let Some(e) = &self.engine {
            e.synchronize()?;
        }
        Ok(())
    }

    fn download(&self, buf: &DeviceBuffer, bytes: usize) -> Result<Vec<u8>> {
        self.download_ref(buf.at(0), bytes)
    }

    fn download_ref(&self, r: Place<&DeviceBuffer>, bytes: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; bytes];
        self.p
            .read_device_sync(r.mem, r.offset, &mut out, self.compute())?;
        Ok(out)
    }

    /// Work queued on `waiter` from now on runs after the work queued on `on` so far.
    fn order(&self, waiter: &Stream, on: &Stream) -> Result<()> {
        self.p.record_event(&self.mark, on)?;
        self.p.stream_wait_event(waiter, &self.mark)?;
        Ok(())
    }

    fn matmul(
        &self,
        a: Place<&DeviceBuffer>,
        b: Place<&DeviceBuffer>,
        c: &DeviceBuffer,
        mkn: [usize; 3],
    ) -> Result<()> {
        let [m, k, n] = mkn;
        self.p.launch_kernel(
            Kernel::Matmul {
                a,
                b,
                c: c.at(0),
                m,
                n,
                k,
                dtype: DType::F32,
            },
            self.compute(),
        )?;
        Ok(())
    }

    fn cast(
        &self,
        src: &DeviceBuffer,
        from: DType,
        dst: &DeviceBuffer,
        to: DType,
        count: usize,
    ) -> Result<()> {
        self.p.launch_kernel(
            Kernel::Cast {
                src: src.at(0),
                src_dtype: from,
                dst: dst.at(0),
                dst_dtype: to,
                count,
            },
            self.compute(),
        )?;
        Ok(())
    }

    fn axpy(&self, src: &DeviceBuffer, dst: &DeviceBuffer, count: usize, alpha: f64) -> Result<()> {
        self.p.launch_kernel(
            Kernel::Axpy {
                src: src.at(0),
                src_dtype: DType::F32,
                dst: dst.at(0),
                dst_dtype: DType::F32,
                count,
                alpha,
            },
            self.compute(),
        )?;
        Ok(())
    }

    fn unshard_async(&mut self, layer: usize) -> Result<()> {
        for i in [2 * layer, 2 * layer + 1] {
            let _ = self.params[i].unshard(true)?;
        }
        Ok(())
    }

    fn wait_unshard(&mut self, layer: usize) -> Result<()> {
        for i in [2 * layer, 2 * layer + 1] {
            self.params[i].wait_for_unshard()?;
        }
        Ok(())
    }

    fn reshard(&mut self, layer: usize) -> Result<()> {
        for i in [2 * layer, 2 * layer + 1] {
            self.params[i].shard()?;
        }
        Ok(())
    }

    /// Tokens, hidden width, feed-forward width and saved-activation dtype: forward and
    /// backward size every buffer by them.
    fn dims(&self) -> (usize, usize, usize, DType) {
        (
            self.config.seq,
            self.config.hidden,
            self.config.ffn(),
            self.config.act_dtype,
        )
    }

    /// Runs the forward on `x` (updated in place to the output); returns the loss gradient.
    fn forward(&mut self, x: &DeviceBuffer, tick: &dyn Fn(u64)) -> Result<DeviceBuffer> {
        let (s, h, f, act) = self.dims();
        let layers = self.config.layers;
        self.saves = (0..layers).map(|_| LayerSaves::default()).collect();
        self.unshard_async(0)?;
        for l in 0..layers {
            if l + 1 < layers {
                self.unshard_async(l + 1)?;
            }
            self.wait_unshard(l)?;
            let (xs, hs) = (
                self.p.alloc_device(s * h * act.size())?,
                self.p.alloc_device(s * f * act.size())?,
            );
            {
                let _g = scope(Some(l), format!("L{l} fwd"));
                let (w1, w2) = (
                    self.params[2 * l].unsharded()?,
                    self.params[2 * l + 1].unsharded()?,
                );
                self.cast(x, DType::F32, &xs, act, s * h)?;
                let hidden = self.p.alloc_device(4 * s * f)?;
                self.matmul(x.at(0), w1, &hidden, [s, h, f])?;
                self.cast(&hidden, DType::F32, &hs, act, s * f)?;
                let out = self.p.alloc_device(4 * s * h)?;
                self.matmul(hidden.at(0), w2, &out, [s, f, h])?;
                self.axpy(&out, x, s * h, 1.0)?;
            }
            self.reshard(l)?;
            self.saves[l].acts = vec![xs, hs];
            self.saves[l].numel = [s * h, s * f];
            self.after_forward(l)?;
            tick(1);
        }
        // d(0.5 |x|^2 / seq) / dx.
        let g = self.p.alloc_device(4 * s * h)?;
        self.p
            .copy_async((&g).into(), 0, x.into(), 0, 4 * s * h, self.compute())?;
        self.p.launch_kernel(
            Kernel::Scale {
                buf: g.at(0),
                dtype: DType::F32,
                count: s * h,
                factor: 1.0 / s as f64,
            },
            self.compute(),
        )?;
        Ok(g)
    }

    /// Moves layer `l`'s saved activations away as the strategy says (the last layer's stay).
    fn after_forward(&mut self, l: usize) -> Result<()> {
        let last = self.config.layers - 1;
        match self.strategy {
            Strategy::Baseline => {}
            Strategy::Swap | Strategy::CompressSwap => {
                if l < last {
                    let act = self.config.act_dtype;
                    let mut group = Vec::new();
                    for (k, buf) in self.saves[l].acts.iter().enumerate() {
                        let t = DeviceTensor::whole(buf.clone(), act, vec![self.saves[l].numel[k]]);
                        group.push(SwapTensor::new(Saved::Tensor(t))?);
                    }
                    let compute = self.streams.compute.clone();
                    let engine = self
                        .engine
                        .as_mut()
                        .expect("swap strategies have an engine");
                    for (k, t) in group.iter_mut().enumerate() {
                        let _g = scope(Some(l), format!("L{l}.{}", SAVED[k]));
                        engine.offload([t], &compute)?;
                    }
                    self.saves[l].swapped = group;
                }
                if l >= 1 {
                    self.finish_offload(l - 1)?;
                }
            }
            Strategy::Compress => {
                if l >= 1 {
                    self.finish_encode(l - 1)?;
                }
                if l < last {
                    self.start_encode(l)?;
                }
            }
        }
        Ok(())
    }

    fn finish_offload(&mut self, l: usize) -> Result<()> {
        let engine = self
            .engine
            .as_mut()
            .expect("swap strategies have an engine");
        engine.finish_offload(self.saves[l].swapped.iter_mut())?;
        Ok(())
    }

    fn codec_stream(&self) -> Stream {
        self.codec_stream
            .clone()
            .expect("compress strategies have a codec stream")
    }

    /// Queues the encoding of layer `l`'s activations on the codec stream, after their producer.
    fn start_encode(&mut self, l: usize) -> Result<()> {
        let codec_stream = self.codec_stream();
        self.order(&codec_stream, self.compute())?;
        let cdt = codec_dtype(self.config.act_dtype)?;
        let mut pending = Vec::new();
        for (k, buf) in self.saves[l].acts.iter().enumerate() {
            let numel = self.saves[l].numel[k];
            let _g = scope(Some(l), format!("L{l}.{}", SAVED[k]));
            let bytes = (numel * self.config.act_dtype.size()) as u64;
            let enc = self.tp.range(&codec_stream, "encode", bytes, || {
                self.codec.encode_async(
                    self.p,
                    buf.at(0),
                    cdt,
                    numel,
                    &self.scratch[k],
                    &codec_stream,
                )
            })??;
            pending.push(enc);
        }
        self.saves[l].encoding = pending;
        Ok(())
    }

    /// Waits for layer `l`'s encodings and releases the originals.
    fn finish_encode(&mut self, l: usize) -> Result<()> {
        let codec_stream = self.codec_stream();
        let pending = std::mem::take(&mut self.saves[l].encoding);
        for (k, enc) in pending.into_iter().enumerate() {
            let _g = scope(Some(l), format!("L{l}.{}", SAVED[k]));
            let packed = enc.finish(self.p, &codec_stream)?;
            self.encoded[k].0 += packed.original_len() as u64;
            self.encoded[k].1 += packed.byte_len() as u64;
            self.saves[l].packed.push(packed);
        }
        // The encode read the originals before its host step ran, so their bytes can go.
        for buf in &self.saves[l].acts {
            self.p.resize_device(buf, 0)?;
        }
        Ok(())
    }

    /// Brings layer `l`'s activations back (or starts to): reload on the h2d stream and / or
    /// decode on the codec stream, into the re-acquired original buffers.
    fn start_restore(&mut self, l: usize) -> Result<()> {
        match self.strategy {
            Strategy::Baseline => {}
            Strategy::Swap | Strategy::CompressSwap => {
                self.finish_offload(l)?;
                if self.strategy == Strategy::CompressSwap {
                    for (k, t) in self.saves[l].swapped.iter().enumerate() {
                        self.encoded[k].0 += t.swap_bytes() as u64;
                        self.encoded[k].1 += t.host_bytes() as u64;
                    }
                }
                let engine = self
                    .engine
                    .as_mut()
                    .expect("swap strategies have an engine");
                for (k, t) in self.saves[l].swapped.iter_mut().enumerate() {
                    let _g = scope(Some(l), format!("L{l}.{}", SAVED[k]));
                    engine.start_reload([t])?;
                }
            }
            Strategy::Compress => {
                let codec_stream = self.codec_stream();
                let act = self.config.act_dtype;
                let mut pending = Vec::new();
                for (k, kind) in SAVED.iter().enumerate() {
                    let saves = &self.saves[l];
                    let (buf, packed) = (&saves.acts[k], &saves.packed[k]);
                    self.p.resize_device(buf, saves.numel[k] * act.size())?;
                    let _g = scope(Some(l), format!("L{l}.{kind}"));
                    let bytes = buf.len() as u64;
                    let dec = self.tp.range(&codec_stream, "decode", bytes, || {
                        self.codec
                            .decode_async(self.p, packed, buf.at(0), &codec_stream)
                    })??;
                    pending.push(dec);
                }
                self.saves[l].decoding = pending;
            }
        }
        Ok(())
    }

    /// Makes the compute stream wait until layer `l`'s activations are on the device.
    fn finish_restore(&mut self, l: usize) -> Result<()> {
        match self.strategy {
            Strategy::Baseline => {}
            Strategy::Swap | Strategy::CompressSwap => {
                let compute = self.streams.compute.clone();
                let engine = self
                    .engine
                    .as_mut()
                    .expect("swap strategies have an engine");
                engine.finish_reload(self.saves[l].swapped.iter_mut(), &compute)?;
            }
            Strategy::Compress => {
                for dec in std::mem::take(&mut self.saves[l].decoding) {
                    dec.finish(self.p)?;
                }
                let codec_stream = self.codec_stream();
                self.order(self.compute(), &codec_stream)?;
            }
        }
        Ok(())
    }

    /// The backward from the loss gradient `g`: layer by layer in reverse, each layer's
    /// activations restored one layer ahead, gradients reduced behind it.
    fn backward(&mut self, g: DeviceBuffer, tick: &dyn Fn(u64)) -> Result<()> {
        let (s, h, f, act) = self.dims();
        let layers = self.config.layers;
        let last = layers - 1;
        let mut queue = GradQueue::default();
        let mut in_flight: VecDeque<DeviceBuffer> = VecDeque::new();
        // Marks each layer's backward on the compute stream: restoring layer l-1 waits (on the
        // host) for layer l+1's backward, so restores run one layer ahead of the streams, not
        // of the host thread, which would otherwise bring everything back at once.
        let done: Vec<Event> = (0..layers)
            .map(|_| self.p.create_event(false))
            .collect::<hprt_platform::Result<_>>()?;
        self.unshard_async(last)?;
        for l in (0..layers).rev() {
            if l >= 1 {
                self.unshard_async(l - 1)?;
            }
            // Layer l's activations were restored one layer ahead (the last layer's stayed).
            if l < last {
                self.finish_restore(l)?;
            }
            if l >= 1 {
                if l + 1 < layers {
                    self.p.synchronize_event(&done[l + 1])?;
                }
                self.start_restore(l - 1)?;
            }
            self.wait_unshard(l)?;
            let (dw1, dw2) = (
                self.p.alloc_device(4 * h * f)?,
                self.p.alloc_device(4 * f * h)?,
            );
            {
                let _g = scope(Some(l), format!("L{l} bwd"));
                let (w1, w2) = (
                    self.params[2 * l].unsharded()?,
                    self.params[2 * l + 1].unsharded()?,
                );
                let saves = &self.saves[l];
                let x32 = self.p.alloc_device(4 * s * h)?;
                self.cast(&saves.acts[0], act, &x32, DType::F32, s * h)?;
                let a32 = self.p.alloc_device(4 * s * f)?;
                self.cast(&saves.acts[1], act, &a32, DType::F32, s * f)?;
                // The real backward's transposes, as reshapes (see the module docs).
                self.matmul(a32.at(0), g.at(0), &dw2, [f, s, h])?;
                let da = self.p.alloc_device(4 * s * f)?;
                self.matmul(g.at(0), w2, &da, [s, h, f])?;
                self.matmul(x32.at(0), da.at(0), &dw1, [h, s, f])?;
                let dx = self.p.alloc_device(4 * s * h)?;
                self.matmul(da.at(0), w1, &dx, [s, f, h])?;
                self.axpy(&dx, &g, s * h, 1.0)?;
                self.p.record_event(&done[l], self.compute())?;
            }
            self.reshard(l)?;
            // Freed now; the queued kernels reading them still complete.
            self.saves[l] = LayerSaves::default();
            for (index, grad) in [(2 * l + 1, &dw2), (2 * l, &dw1)] {
                let input = GradInput {
                    buf: grad.at(0),
                    dtype: DType::F32,
                };
                queue.issue(
                    &mut self.params,
                    index,
                    Some(input),
                    ReduceOptions::default(),
                )?;
            }
            in_flight.push_back(dw2);
            in_flight.push_back(dw1);
            // Two layers of reductions in flight behind the backward.
            while queue.len() > 4 {
                queue.apply_next(&mut self.params)?;
                in_flight.pop_front();
            }
            tick(1);
        }
        queue.finish(&mut self.params)?;
        Ok(())
    }

    /// SGD on every shard; returns the reduced gradients when asked (the last step).
    fn update(&mut self, keep_grads: bool) -> Result<Vec<u8>> {
        let mut grads = Vec::new();
        for i in 0..self.params.len() {
            let n = self.params[i].geometry().shard_numel();
            let (ShardRef::Device(w), Some(ShardRef::Device(g))) =
                (self.params[i].sharded_data(), self.params[i].sharded_grad())
            else {
                return Err(DemoError::Rank {
                    rank: self.rank,
                    message: format!("parameter {i} has no device shard or gradient"),
                });
            };
            if keep_grads {
                grads.extend(self.download_ref(g, 4 * n)?);
            }
            self.p.launch_kernel(
                Kernel::Axpy {
                    src: g,
                    src_dtype: DType::F32,
                    dst: w,
                    dst_dtype: DType::F32,
                    count: n,
                    alpha: -LEARNING_RATE,
                },
                self.compute(),
            )?;
            self.params[i].clear_grad()?;
        }
        Ok(grads)
    }
}
