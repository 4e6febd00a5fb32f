//! Chunked pipeline offload (Megatron-LM): per micro-batch and virtual-pipeline-stage chunk
//! handlers, group start/commit markers, bulk offload and reload of whole groups.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;

use hprt_platform::{DeviceBuffer, Stream};

use crate::engine::{EngineConfig, EngineStats, InflightWindow, PlatformHandle, SwapEngine};
use crate::error::{Result, SwapError, SwapState};
use crate::payload::Compression;
use crate::payload::SwapTensor;
use crate::pool::{PoolConfig, PoolStats};
use crate::tensor::{DeviceTensor, Saved};

/// Settings of a [`PipelineOffload`].
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// Tensors with fewer elements stay on the device (Megatron's default: 1024 × 1024).
    pub min_tensor_elems: usize,
    /// Groups whose offload may be in flight at once; committing one more first waits for the
    /// oldest and releases its device bytes.
    pub max_inflight_offloads: usize,
    /// After the warm-up iteration, the last this-many groups of every chunk stay on the device
    /// (they are the first needed by the chunk's backward).
    pub keep_last_groups: usize,
    pub pool: PoolConfig,
    /// Compress-then-swap for every offloaded tensor (per tensor: `set_compression_policy`).
    pub compression: Compression,
    /// The engine's bounds in bytes (beside `max_inflight_offloads`, which counts groups).
    pub window: InflightWindow,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            min_tensor_elems: 1024 * 1024,
            max_inflight_offloads: 1,
            keep_last_groups: 1,
            pool: PoolConfig::default(),
            compression: Compression::Off,
            window: InflightWindow::default(),
        }
    }
}

/// One chunk handler: a micro-batch's forward through one virtual-pipeline stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkId(usize);

/// What [`PipelineOffload::save`] returned: the value itself, or where its host copy is.
#[derive(Debug)]
pub enum OffloadTag {
    Kept(Saved),
    Offloaded {
        chunk: ChunkId,
        group: usize,
        index: usize,
    },
}

struct Group {
    name: String,
    /// `None` once [`PipelineOffload::take`] handed the value over.
    tensors: Vec<Option<SwapTensor>>,
    /// Buffers the framework would not free itself: released once the group's offload completed.
    forced_release: Vec<DeviceBuffer>,
    launched: bool,
}

impl Group {
    fn bytes(&self) -> u64 {
        self.tensors
            .iter()
            .flatten()
            .map(|t| t.swap_bytes() as u64)
            .sum()
    }
}

struct Chunk {
    stage: usize,
    groups: Vec<Group>,
    open: Option<usize>,
    /// Index of the group whose backward comes next (groups run backward in reverse order).
    backward_next: Option<usize>,
    offloadable: bool,
    /// Megatron-LM's `set_last_layer`: the groups committed now belong to the chunk's last layer.
    last_layer: bool,
}

fn chunk_in(chunks: &mut [Option<Chunk>], id: ChunkId) -> Result<&mut Chunk> {
    chunks
        .get_mut(id.0)
        .and_then(Option::as_mut)
        .ok_or_else(|| SwapError::unknown("chunk", id.0))
}

/// Megatron-style fine-grained activation offload on any platform.
///
/// Forward, per chunk: [`PipelineOffload::init_chunk`], then per layer group
/// [`PipelineOffload::group_start`], [`PipelineOffload::save`] for each saved tensor,
/// [`PipelineOffload::group_commit`] (launches the group's bulk offload on the d2h stream, or
/// queues it for [`PipelineOffload::flush_delayed_groups`]). Backward, per group in reverse:
/// [`PipelineOffload::backward_group_begin`] (the commit marker's backward in Megatron: the
/// compute stream waits for the group's reload), [`PipelineOffload::get`] for each tensor,
/// [`PipelineOffload::backward_group_end`] (the start marker's backward: reloads the next group,
/// or pre-reloads the next chunk's last offloaded group). [`PipelineOffload::reset`] ends an
/// iteration; [`PipelineOffload::post_warmup`] after the first one enables the keep-last-group
/// margin and the per-group summary.
///
/// ```
/// use std::sync::Arc;
/// use hprt_platform::{CpuBackend, CpuConfig, DType, Platform};
/// use hprt_swap::{DeviceTensor, OffloadTag, PipelineConfig, PipelineOffload, Saved};
///
/// let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
/// let s = p.create_stream().unwrap();
/// let cfg = PipelineConfig { min_tensor_elems: 16, ..Default::default() };
/// let mut off = PipelineOffload::new(Arc::clone(&p), cfg).unwrap();
/// off.init_chunk(1, None).unwrap();
/// off.group_start("attn").unwrap();
/// let buf = p.alloc_device(256).unwrap();
/// let tag = off.save(Saved::Tensor(DeviceTensor::whole(buf.clone(), DType::F32, vec![64]))).unwrap();
/// assert!(matches!(tag, OffloadTag::Offloaded { .. }));
/// off.group_commit(&s, Vec::new(), false).unwrap();
/// off.backward_group_begin("attn", &s).unwrap();
/// assert!(off.get(&tag, &s).is_ok());
/// off.backward_group_end().unwrap();
/// off.reset().unwrap();
/// ```
pub struct PipelineOffload {
    engine: SwapEngine,
    config: PipelineConfig,
    chunks: Vec<Option<Chunk>>,
    staged: Vec<ChunkId>,
    backward_queue: VecDeque<ChunkId>,
    forward: Option<ChunkId>,
    backward: Option<ChunkId>,
    delayed: Vec<(ChunkId, usize)>,
    inflight: VecDeque<(ChunkId, usize)>,
    enabled: bool,
    not_offloadable: Vec<(DeviceBuffer, usize)>,
    warmed_up: bool,
    /// Most groups seen in a chunk of each virtual-pipeline stage.
    groups_per_stage: HashMap<usize, usize>,
    iteration_bytes: BTreeMap<String, u64>,
    summary: BTreeMap<String, u64>,
}

impl PipelineOffload {
    pub fn new(platform: impl Into<PlatformHandle>, config: PipelineConfig) -> Result<Self> {
        if config.max_inflight_offloads == 0 {
            return Err(SwapError::Order(
                "max_inflight_offloads must be at least 1".into(),
            ));
        }
        let engine = SwapEngine::new(
            platform,
            EngineConfig {
                single_copy_stream: false,
                pool: config.pool.clone(),
                compression: config.compression,
                compression_policy: None,
                codec_stream: None,
                window: config.window,
            },
        )?;
        Ok(PipelineOffload {
            engine,
            config,
            chunks: Vec::new(),
            staged: Vec::new(),
            backward_queue: VecDeque::new(),
            forward: None,
            backward: None,
            delayed: Vec::new(),
            inflight: VecDeque::new(),
            enabled: true,
            not_offloadable: Vec::new(),
            warmed_up: false,
            groups_per_stage: HashMap::new(),
            iteration_bytes: BTreeMap::new(),
            summary: BTreeMap::new(),
        })
    }

    engine_accessors!();

    fn chunk(&mut self, id: ChunkId) -> Result<&mut Chunk> {
        chunk_in(&mut self.chunks, id)
    }

    fn forward_chunk(&mut self) -> Result<(ChunkId, &mut Chunk)> {
        let id = self
            .forward
            .ok_or_else(|| SwapError::Order("no chunk: call init_chunk first".into()))?;
        Ok((id, self.chunk(id)?))
    }

    /// Starts the forward of a micro-batch through virtual-pipeline stage `vp_stage` (`None` =
    /// stage 0) of `vp_size`. When the last stage starts, the micro-batch's chunks join the
    /// backward queue in reverse stage order (its backward runs the last stage first).
    pub fn init_chunk(&mut self, vp_size: usize, vp_stage: Option<usize>) -> Result<ChunkId> {
        let stage = vp_stage.unwrap_or(0);
        if stage >= vp_size.max(1) {
            return Err(SwapError::Order(format!(
                "virtual pipeline stage {stage} of {vp_size}"
            )));
        }
        let id = ChunkId(self.chunks.len());
        self.chunks.push(Some(Chunk {
            stage,
            groups: Vec::new(),
            open: None,
            backward_next: None,
            offloadable: true,
            last_layer: false,
        }));
        self.forward = Some(id);
        self.staged.push(id);
        if stage + 1 >= vp_size {
            self.backward_queue.extend(self.staged.drain(..).rev());
        }
        Ok(id)
    }

    /// Offloading off: tensors saved from now on stay on the device.
    pub fn disable(&mut self) {
        self.enabled = false;
    }
    pub fn enable(&mut self) {
        self.enabled = true;
    }

    /// Nothing saved in the current forward chunk is offloaded.
    pub fn mark_chunk_not_offloadable(&mut self) -> Result<()> {
        self.forward_chunk()?.1.offloadable = false;
        Ok(())
    }

    /// This tensor (same storage and offset) stays on the device when saved.
    pub fn mark_not_offloadable(&mut self, tensor: &DeviceTensor) {
        self.not_offloadable
            .push((tensor.storage.clone(), tensor.offset));
    }

    /// Megatron-LM's `set_last_layer`: whether the current chunk's forward is in its last layer.
    /// Groups committed there stay on the device while this chunk's backward is the next to run
    /// (it needs them first: offloading them would only make it wait for their reload).
    pub fn set_last_layer(&mut self, is_last_layer: bool) -> Result<()> {
        self.forward_chunk()?.1.last_layer = is_last_layer;
        Ok(())
    }

    /// A layer group's forward begins in the current chunk.
    pub fn group_start(&mut self, name: &str) -> Result<()> {
        let (_, chunk) = self.forward_chunk()?;
        if let Some(open) = chunk.open {
            return Err(SwapError::Order(format!(
                "group {name:?} started while {:?} is open",
                chunk.groups[open].name
            )));
        }
        chunk.groups.push(Group {
            name: name.to_owned(),
            tensors: Vec::new(),
            forced_release: Vec::new(),
            launched: false,
        });
        chunk.open = Some(chunk.groups.len() - 1);
        let (stage, n) = (chunk.stage, chunk.groups.len());
        let seen = self.groups_per_stage.entry(stage).or_insert(0);
        *seen = (*seen).max(n);
        Ok(())
    }

    fn wants(&self, t: &DeviceTensor) -> bool {
        self.enabled
            && !t.is_parameter
            && t.numel() >= self.config.min_tensor_elems
            && !self
                .not_offloadable
                .iter()
                .any(|(s, off)| s.same_as(&t.storage) && *off == t.offset)
    }

    /// Autograd saves `value` in the open group of the current chunk.
    pub fn save(&mut self, value: Saved) -> Result<OffloadTag> {
        let keep = match (&value, self.forward) {
            (Saved::Tensor(t), Some(_)) => !self.wants(t),
            _ => true,
        };
        if keep {
            return Ok(OffloadTag::Kept(value));
        }
        let (chunk_id, chunk) = self.forward_chunk()?;
        let (Some(group), true) = (chunk.open, chunk.offloadable) else {
            return Ok(OffloadTag::Kept(value));
        };
        let tensors = &mut chunk.groups[group].tensors;
        tensors.push(Some(SwapTensor::new(value)?));
        Ok(OffloadTag::Offloaded {
            chunk: chunk_id,
            group,
            index: tensors.len() - 1,
        })
    }

    /// The open group's forward was queued on `compute`: its tensors are bulk-offloaded now (or,
    /// with `delay`, at the next [`PipelineOffload::flush_delayed_groups`]) unless the group is
    /// in the keep-last margin or the last layer (see [`PipelineOffload::set_last_layer`]).
    /// `forced_release` buffers (Megatron-LM's forced released tensors: memory the group's saved
    /// tensors came from that the framework would not free itself) are released once the
    /// offload completed: an owned buffer is resized to zero; a borrowed one is freed, so hprt
    /// holds it no more (its framework then releases its memory, as hprt.torch does with
    /// `untyped_storage().resize_(0)`). A group that stays on the device, or whose backward
    /// begins before its offload completed, releases nothing.
    pub fn group_commit(
        &mut self,
        compute: &Stream,
        forced_release: Vec<DeviceBuffer>,
        delay: bool,
    ) -> Result<()> {
        let (id, chunk) = self.forward_chunk()?;
        let g = chunk
            .open
            .take()
            .ok_or_else(|| SwapError::Order("group_commit without group_start".into()))?;
        let (stage, last_layer) = (chunk.stage, chunk.last_layer);
        let expected = self.groups_per_stage.get(&stage).copied().unwrap_or(0);
        let in_margin = self.warmed_up && g + self.config.keep_last_groups >= expected;
        let backward_next = self.backward_queue.front() == Some(&id);
        let group = &mut self.chunk(id)?.groups[g];
        if in_margin || (last_layer && backward_next) || group.tensors.is_empty() {
            return Ok(());
        }
        group.forced_release = forced_release;
        if delay {
            self.delayed.push((id, g));
            Ok(())
        } else {
            self.launch(id, g, compute)
        }
    }

    /// Launches every delayed group's offload.
    pub fn flush_delayed_groups(&mut self, compute: &Stream) -> Result<()> {
        for (id, g) in std::mem::take(&mut self.delayed) {
            self.launch(id, g, compute)?;
        }
        Ok(())
    }

    fn launch(&mut self, id: ChunkId, g: usize, compute: &Stream) -> Result<()> {
        let group = &mut chunk_in(&mut self.chunks, id)?.groups[g];
        group.launched = true;
        let (name, bytes) = (group.name.clone(), group.bytes());
        let tensors = group.tensors.iter_mut().flatten();
        self.engine.offload(tensors, compute)?;
        *self.iteration_bytes.entry(name).or_insert(0) += bytes;
        self.inflight.push_back((id, g));
        self.retire()
    }

    /// Releases the device bytes of finished offloads, and of the oldest ones past the cap.
    fn retire(&mut self) -> Result<()> {
        while let Some(&(id, g)) = self.inflight.front() {
            let over_cap = self.inflight.len() > self.config.max_inflight_offloads;
            let group = &chunk_in(&mut self.chunks, id)?.groups[g];
            let mut done = true;
            for t in group.tensors.iter().flatten() {
                done &= self.engine.offload_done(t)?;
            }
            if !(over_cap || done) {
                break;
            }
            if over_cap {
                // Megatron-LM's cap: the oldest group's copies finish before one more starts
                // (its memory may be the framework's already, but is not reusable before).
                self.engine.wait_copies(group.tensors.iter().flatten())?;
            }
            self.inflight.pop_front();
            self.finish_offload(id, g)?;
        }
        Ok(())
    }

    fn finish_offload(&mut self, id: ChunkId, g: usize) -> Result<()> {
        let platform = self.engine.platform().clone();
        let group = &mut chunk_in(&mut self.chunks, id)?.groups[g];
        self.engine
            .finish_offload(group.tensors.iter_mut().flatten())?;
        for buf in group.forced_release.drain(..) {
            if buf.is_borrowed() {
                platform.free_device(&buf)?;
            } else {
                platform.resize_device(&buf, 0)?;
            }
        }
        Ok(())
    }

    /// Brings group `g` of `id` on its way back: an offload still queued is taken back without
    /// copying (its device bytes were never released), a finished one is reloaded.
    fn start_group_reload(&mut self, id: ChunkId, g: usize) -> Result<()> {
        if let Some(pos) = self.inflight.iter().position(|x| *x == (id, g)) {
            self.inflight.remove(pos);
            let group = &mut chunk_in(&mut self.chunks, id)?.groups[g];
            self.engine
                .cancel_offload(group.tensors.iter_mut().flatten())?;
            group.forced_release.clear();
            // Tensors whose memory went back to the framework at the offload were not taken
            // back: they reload.
            return self.engine.start_reload(group.tensors.iter_mut().flatten());
        }
        self.delayed.retain(|x| *x != (id, g));
        let group = &mut chunk_in(&mut self.chunks, id)?.groups[g];
        self.engine.start_reload(group.tensors.iter_mut().flatten())
    }

    /// [`PipelineOffload::start_group_reload`] ahead of need: within the engine's reload
    /// window (an offload still in flight is taken back as there).
    fn prefetch_group(&mut self, id: ChunkId, g: usize) -> Result<()> {
        if self.inflight.contains(&(id, g)) {
            return self.start_group_reload(id, g);
        }
        self.delayed.retain(|x| *x != (id, g));
        let group = &mut chunk_in(&mut self.chunks, id)?.groups[g];
        self.engine
            .prefetch(group.tensors.iter_mut().flatten())
            .map(drop)
    }

    fn backward_chunk(&mut self) -> Result<ChunkId> {
        if let Some(id) = self.backward {
            return Ok(id);
        }
        let id = self
            .backward_queue
            .pop_front()
            .ok_or_else(|| SwapError::Order("no chunk is waiting for its backward".into()))?;
        let chunk = self.chunk(id)?;
        chunk.backward_next = chunk.groups.len().checked_sub(1);
        self.backward = Some(id);
        Ok(id)
    }

    /// Group `name`'s backward is about to run on `compute`: its reload is started if it was not
    /// prefetched, and `compute` waits for it.
    pub fn backward_group_begin(&mut self, name: &str, compute: &Stream) -> Result<()> {
        let id = self.backward_chunk()?;
        let chunk = self.chunk(id)?;
        let g = chunk
            .backward_next
            .ok_or_else(|| SwapError::Order(format!("chunk {} has no group left", id.0)))?;
        if chunk.groups[g].name != name {
            return Err(SwapError::Order(format!(
                "backward reached group {name:?}, expected {:?}",
                chunk.groups[g].name
            )));
        }
        self.start_group_reload(id, g)?;
        let group = &mut chunk_in(&mut self.chunks, id)?.groups[g];
        self.engine
            .finish_reload(group.tensors.iter_mut().flatten(), compute)
    }

    /// A saved tensor for backward work about to be queued on `compute` (reloaded on the spot if
    /// its group's reload was not started). The group keeps its reference until the group's
    /// backward ends ([`PipelineOffload::backward_group_end`]) or the iteration's reset.
    pub fn get(&mut self, tag: &OffloadTag, compute: &Stream) -> Result<Saved> {
        self.read(tag, compute, false)
    }

    /// [`PipelineOffload::get`], handing the value over: the group references it no more, so
    /// its device memory goes with the caller's last reference (as Megatron-LM's handler pops a
    /// tensor when autograd unpacks it). Without it a front end that reads values one by one
    /// and never ends groups (hprt.torch) holds every reloaded tensor of a pass until the
    /// reset. A later `get` or `take` of the tag is an error.
    pub fn take(&mut self, tag: &OffloadTag, compute: &Stream) -> Result<Saved> {
        self.read(tag, compute, true)
    }

    /// `tag`'s value, its reload finished for `compute`; `hand_over` empties its slot.
    fn read(&mut self, tag: &OffloadTag, compute: &Stream, hand_over: bool) -> Result<Saved> {
        let (chunk, group, index) = match tag {
            OffloadTag::Kept(v) => return Ok(v.clone()),
            &OffloadTag::Offloaded {
                chunk,
                group,
                index,
            } => (chunk, group, index),
        };
        let state = self
            .chunk(chunk)?
            .groups
            .get(group)
            .and_then(|g| g.tensors.get(index))
            .ok_or_else(|| SwapError::unknown("offload tag", format!("{tag:?}")))?
            .as_ref()
            .ok_or_else(|| SwapError::Order(format!("{tag:?} was already taken")))?
            .state();
        if matches!(state, SwapState::D2h | SwapState::Host) {
            self.start_group_reload(chunk, group)?;
        }
        let slot = &mut chunk_in(&mut self.chunks, chunk)?.groups[group].tensors[index];
        let t = slot.as_mut().expect("checked above");
        self.engine.finish_reload([&mut *t], compute)?;
        if hand_over {
            slot.take().expect("checked above").into_saved()
        } else {
            Ok(t.get()?.clone())
        }
    }

    /// Starts reloading `tag`'s group before its backward asks for it (a framework driving
    /// groups by its own hooks prefetches the next layer this way); returns the number of its
    /// tensors whose reload this started (0 when it had begun, or for a kept tensor).
    pub fn prefetch(&mut self, tag: &OffloadTag) -> Result<usize> {
        let &OffloadTag::Offloaded { chunk, group, .. } = tag else {
            return Ok(0);
        };
        let tensors = &self
            .chunk(chunk)?
            .groups
            .get(group)
            .ok_or_else(|| SwapError::unknown("offload tag", format!("{tag:?}")))?
            .tensors;
        let waiting = tensors
            .iter()
            .flatten()
            .filter(|t| matches!(t.state(), SwapState::D2h | SwapState::Host))
            .count();
        if waiting > 0 {
            self.prefetch_group(chunk, group)?;
        }
        Ok(waiting)
    }

    /// The current backward group finished: the next group of the chunk starts reloading, or,
    /// after the chunk's first group, the next chunk's last offloaded group does.
    pub fn backward_group_end(&mut self) -> Result<()> {
        let id = self
            .backward
            .ok_or_else(|| SwapError::Order("backward_group_end without a begin".into()))?;
        let chunk = self.chunk(id)?;
        let g = chunk
            .backward_next
            .ok_or_else(|| SwapError::Order("backward_group_end without a begin".into()))?;
        chunk.backward_next = g.checked_sub(1);
        // The group's values were handed out: its references go now, so borrowed memory goes
        // back to the framework as soon as the framework is done with it.
        chunk.groups[g].tensors.clear();
        if let Some(next) = chunk.backward_next {
            return self.prefetch_group(id, next);
        }
        // The chunk is done: its values were handed out, its host blocks go back to the pool.
        self.chunks[id.0] = None;
        self.backward = None;
        let Some(&next_chunk) = self.backward_queue.front() else {
            return Ok(());
        };
        let last = self
            .chunk(next_chunk)?
            .groups
            .iter()
            .rposition(|g| g.launched);
        match last {
            Some(g) => self.prefetch_group(next_chunk, g),
            None => Ok(()),
        }
    }

    /// Graph-capture-safe forward mark: offloads queued from now on wait for the work queued on
    /// `compute` so far (an event, no host synchronization).
    pub fn record_forward(&self, compute: &Stream) -> Result<()> {
        self.engine.order_offloads_after(compute)
    }

    /// Megatron-LM's `forward_record` (the end of a layer captured in a CUDA graph): offloads
    /// queued from now on wait for the work queued on `compute` so far, and work queued on
    /// `compute` from now on waits for every offload queued so far (events only).
    pub fn join_offloads(&self, compute: &Stream) -> Result<()> {
        self.engine.order_offloads_after(compute)?;
        self.engine.wait_offloads_on(compute)
    }

    /// Graph-capture-safe backward mark: work queued on `compute` from now on waits for every
    /// reload queued so far (an event, no host synchronization).
    pub fn record_backward(&self, compute: &Stream) -> Result<()> {
        self.engine.wait_reloads_on(compute)
    }

    /// Ends the warm-up iteration: from the next one, the last `keep_last_groups` groups of each
    /// chunk stay on the device, and each iteration's offloaded bytes become the summary.
    pub fn post_warmup(&mut self) {
        self.warmed_up = true;
        self.iteration_bytes.clear();
    }

    pub fn is_warmed_up(&self) -> bool {
        self.warmed_up
    }

    /// Ends an iteration: waits for queued copies and drops every chunk.
    pub fn reset(&mut self) -> Result<()> {
        self.engine.synchronize()?;
        self.chunks.clear();
        self.staged.clear();
        self.backward_queue.clear();
        self.forward = None;
        self.backward = None;
        self.delayed.clear();
        self.inflight.clear();
        self.not_offloadable.clear();
        let bytes = std::mem::take(&mut self.iteration_bytes);
        if self.warmed_up {
            self.summary = bytes;
        }
        self.engine.end_iteration()?;
        Ok(())
    }

    /// Bytes offloaded per group name in the last iteration after warm-up.
    pub fn offload_summary_bytes(&self) -> &BTreeMap<String, u64> {
        &self.summary
    }

    pub fn offload_summary_total_bytes(&self) -> u64 {
        self.summary.values().sum()
    }
}

/// A table of what each rank's engine moved: offloaded bytes, bytes over the host link each
/// way (compressed bytes for compressed payloads), tensors compressed, the pinned pool's high
/// water and the codec's time.
///
/// ```
/// use hprt_swap::{EngineStats, PoolStats};
/// let s = EngineStats { offloaded_bytes: 4096, link_d2h_bytes: 2048, ..Default::default() };
/// let table = hprt_swap::link_summary_table(&[(s, PoolStats::default())]);
/// assert!(table.lines().any(|l| l.starts_with("| 0 | 4096 | 2048 |")));
/// ```
pub fn link_summary_table(per_rank: &[(EngineStats, PoolStats)]) -> String {
    let mut out = String::from(
        "| rank | offloaded bytes | link d2h bytes | link h2d bytes | compressed tensors | pinned high water | codec ms |\n|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (rank, (e, p)) in per_rank.iter().enumerate() {
        let _ = writeln!(
            out,
            "| {rank} | {} | {} | {} | {} | {} | {:.3} |",
            e.offloaded_bytes,
            e.link_d2h_bytes,
            e.link_h2d_bytes,
            e.compressed_tensors,
            p.high_water,
            e.codec_ns as f64 / 1e6
        );
    }
    out
}

/// An ASCII table of offloaded bytes: one row per rank, one column per group name (the union
/// of all ranks' names), plus a total column.
///
/// ```
/// use std::collections::BTreeMap;
/// let r0 = BTreeMap::from([("attn".to_string(), 2048u64), ("mlp".to_string(), 4096)]);
/// let r1 = BTreeMap::from([("attn".to_string(), 1024u64)]);
/// let table = hprt_swap::offload_summary_table(&[r0, r1]);
/// assert!(table.lines().any(|l| l.starts_with("| 1 ") && l.contains("1024")));
/// ```
pub fn offload_summary_table(per_rank: &[BTreeMap<String, u64>]) -> String {
    let mut names: Vec<&String> = per_rank.iter().flat_map(|m| m.keys()).collect();
    names.sort();
    names.dedup();
    let mut out = String::from("| rank |");
    for n in &names {
        let _ = write!(out, " {n} |");
    }
    out.push_str(" total |\n|---:|");
    out.push_str(&"---:|".repeat(names.len() + 1));
    out.push('\n');
    for (rank, m) in per_rank.iter().enumerate() {
        let _ = write!(out, "| {rank} |");
        for n in &names {
            let _ = write!(out, " {} |", m.get(*n).copied().unwrap_or(0));
        }
        let _ = writeln!(out, " {} |", m.values().sum::<u64>());
    }
    out
}
