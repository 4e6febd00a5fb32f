//! The sharded parameter: each rank keeps one padded shard; `unshard` all-gathers the full
//! parameter into one buffer, `shard` frees it again; gradients are reduced back to the shard
//! (see [`crate::grad`]).
//!
//! Stream discipline (what a GPU needs and `HP_CPU_JITTER` checks): the all-gather stream waits
//! for the compute stream before reading the shard; the compute stream waits for the all-gather
//! in [`ShardedParam::wait_for_unshard`]; reductions run on the reduce stream after the compute
//! stream's gradient is ready and are applied on the compute stream in
//! [`ShardedParam::wait_for_reduce`].

use hprt_platform::{DType, DeviceBuffer, Event, Kernel, Place, Platform, PlatformHandle, Stream};

use crate::error::{HsdpError, Result};
use crate::group::GroupCache;
use crate::placement::{
    DataParallelMesh, DistLayout, GroupInfos, LayoutMode, Placement, SpmdLayout,
};
use crate::policy::{MixedPrecisionPolicy, OffloadPolicy};
use crate::storage::{shard_ref, ShardRef, Storage};

/// The three streams one rank's parameters use.
#[derive(Clone, Debug)]
pub struct HsdpStreams {
    /// Where forward/backward compute, gradient accumulation and optimizer updates run.
    pub compute: Stream,
    /// Where all-gathers (and the copies and casts feeding them) run.
    pub all_gather: Stream,
    /// Where gradient reduce-scatters and all-reduces run.
    pub reduce: Stream,
}

impl HsdpStreams {
    /// Three new streams.
    pub fn new(platform: &dyn Platform) -> Result<Self> {
        Self::with_compute(platform, platform.create_stream()?)
    }
    /// New communication streams beside an existing compute stream (e.g. a framework's).
    pub fn with_compute(platform: &dyn Platform, compute: Stream) -> Result<Self> {
        Ok(HsdpStreams {
            compute,
            all_gather: platform.create_stream()?,
            reduce: platform.create_stream()?,
        })
    }
}

/// Where a sharded parameter is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamState {
    /// Only the local shard exists.
    Sharded,
    /// An all-gather was issued and not yet waited for.
    Unsharding,
    /// The full parameter is available ([`ShardedParam::unsharded`]).
    Unsharded,
}

hprt_platform::named_enum!(ParamState, "parameter state", {
    Sharded => "sharded",
    Unsharding => "unsharding",
    Unsharded => "unsharded",
});

/// How a parameter of `shape` is cut into `group_size` shards along `dim`.
///
/// The dim is padded up to a multiple of the group size; shard `k` holds rows
/// `k * chunk .. (k + 1) * chunk` of that dim (zeros past the end), stored contiguously as a
/// tensor of [`ShardGeometry::shard_shape`]. The all-gather places shard `k` at
/// `k * shard_numel`; for `dim == 0` (or any dim with only size-1 dims before it) that buffer's
/// prefix *is* the parameter, otherwise the rows are re-interleaved with strided copies.
///
/// ```
/// use hprt_hsdp::ShardGeometry;
/// let g = ShardGeometry::new(&[5, 3], 0, 2, 1)?; // 5 rows over 2 ranks: 3 + 2 (+1 pad)
/// assert_eq!((g.chunk(), g.shard_numel(), g.valid_rows(1)), (3, 9, 2));
/// # Ok::<(), hprt_hsdp::HsdpError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardGeometry {
    shape: Vec<usize>,
    dim: usize,
    group_size: usize,
    index: usize,
    chunk: usize,
    outer: usize,
    inner: usize,
}

/// One contiguous run of elements shared by the full parameter and a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Element offset in the full parameter.
    pub full: usize,
    /// Element offset in the shard.
    pub shard: usize,
    pub len: usize,
}

impl ShardGeometry {
    /// Shard `index` of `group_size` along `dim` of `shape`.
    pub fn new(shape: &[usize], dim: usize, group_size: usize, index: usize) -> Result<Self> {
        let invalid = |m: String| HsdpError::InvalidPlacement(m);
        if dim >= shape.len() {
            return Err(invalid(format!(
                "Shard({dim}) of a {}-D parameter",
                shape.len()
            )));
        }
        if group_size == 0 || index >= group_size {
            return Err(invalid(format!("shard {index} of a group of {group_size}")));
        }
        if shape.contains(&0) {
            return Err(invalid(format!("shape {shape:?} is empty")));
        }
        let product = |s: &[usize]| s.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let numel = product(shape).ok_or_else(|| invalid(format!("shape {shape:?} overflows")))?;
        let chunk = shape[dim].div_ceil(group_size);
        let outer = product(&shape[..dim]).unwrap_or(usize::MAX);
        let inner = product(&shape[dim + 1..]).unwrap_or(usize::MAX);
        // The padded tensor must be addressable too, in bytes of the widest element (8), so
        // no byte size derived from it can overflow later.
        let padded = outer
            .checked_mul(chunk)
            .and_then(|n| n.checked_mul(inner))
            .and_then(|n| n.checked_mul(group_size))
            .filter(|n| n.checked_mul(8).is_some());
        if padded.is_none() || numel == 0 {
            return Err(invalid(format!(
                "shape {shape:?} padded to {group_size} shards overflows"
            )));
        }
        Ok(ShardGeometry {
            shape: shape.to_vec(),
            dim,
            group_size,
            index,
            chunk,
            outer,
            inner,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
    pub fn group_size(&self) -> usize {
        self.group_size
    }
    /// This rank's shard index.
    pub fn index(&self) -> usize {
        self.index
    }
    /// Rows of the sharded dim per shard (padded size / group size).
    pub fn chunk(&self) -> usize {
        self.chunk
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn shard_numel(&self) -> usize {
        self.outer * self.chunk * self.inner
    }
    /// Elements of the all-gather buffer: every shard, padding included.
    pub fn padded_numel(&self) -> usize {
        self.shard_numel() * self.group_size
    }
    pub fn shard_shape(&self) -> Vec<usize> {
        let mut s = self.shape.clone();
        s[self.dim] = self.chunk;
        s
    }
    /// Rows of the sharded dim that shard `k` holds data for (the rest is padding).
    pub fn valid_rows(&self, k: usize) -> usize {
        self.shape[self.dim]
            .saturating_sub(k * self.chunk)
            .min(self.chunk)
    }
    /// Whether the gathered shards, in order, are the parameter followed by padding.
    pub fn gathers_in_place(&self) -> bool {
        self.outer == 1 || self.group_size == 1
    }
    /// The runs shard `k` shares with the full parameter (empty for an all-padding shard).
    pub fn runs(&self, k: usize) -> Vec<Run> {
        let rows = self.valid_rows(k);
        if rows == 0 {
            return vec![];
        }
        let len_d = self.shape[self.dim];
        (0..self.outer)
            .map(|o| Run {
                full: (o * len_d + k * self.chunk) * self.inner,
                shard: o * self.chunk * self.inner,
                len: rows * self.inner,
            })
            .collect()
    }
}

/// What [`ShardedParam::new`] shards.
#[derive(Clone, Debug)]
pub struct ParamSpec {
    pub name: String,
    /// The local tensor's shape (for a parameter with a [`DistLayout`], its local part).
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// A layout the parameter already carries (e.g. tensor parallel), and how it combines with
    /// the data-parallel mesh.
    pub layout: Option<(DistLayout, LayoutMode)>,
}

impl ParamSpec {
    pub fn new(name: &str, shape: &[usize], dtype: DType) -> Self {
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype,
            layout: None,
        }
    }
}

/// How to shard one parameter.
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamConfig {
    /// The data-parallel shard placement; `None` is `Shard(0)`.
    pub shard: Option<Placement>,
    pub mp: MixedPrecisionPolicy,
    pub offload: OffloadPolicy,
    /// Parameters with fewer elements stay replicated (gradients all-reduced, never sharded).
    pub threshold: usize,
}

/// A started all-gather: query it, or wait through [`ShardedParam::wait_for_unshard`].
#[derive(Clone, Debug)]
pub struct UnshardHandle {
    event: Event,
}

impl UnshardHandle {
    /// Whether the all-gather (and the copies after it) finished.
    pub fn is_complete(&self, platform: &dyn Platform) -> Result<bool> {
        Ok(platform.query_event(&self.event)?)
    }
    /// Recorded on the all-gather stream after the gathered parameter is complete.
    pub fn event(&self) -> &Event {
        &self.event
    }
}

struct PendingUnshard {
    done: Event,
    /// Staging buffers the queued all-gather reads; released once it was waited for.
    _staging: Vec<DeviceBuffer>,
}

/// One rank's view of a sharded parameter (hyper_parallel's `HSDPParam`).
///
/// ```no_run
/// # use hprt_hsdp::*;
/// # use hprt_platform::{DType, Platform};
/// # fn demo(p: &dyn Platform, cache: &GroupCache, dp: &DataParallelMesh,
/// #         full: &hprt_platform::DeviceBuffer) -> Result<()> {
/// let streams = HsdpStreams::new(p)?;
/// let spec = ParamSpec::new("w", &[1024, 256], DType::F32);
/// let mut w = ShardedParam::new(cache, &streams, dp, spec, &ParamConfig::default(), full.into())?;
/// w.unshard(true)?; // prefetch
/// w.wait_for_unshard()?; // compute stream now orders after the all-gather
/// let _full_weight = w.unsharded()?; // 1024 × 256 f32 on the device
/// w.shard()?; // gathered storage released
/// # Ok(()) }
/// ```
pub struct ShardedParam {
    /// A clone of the cache's handle: the parameter keeps its platform alive by itself.
    pub(crate) platform: PlatformHandle,
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) param_dtype: DType,
    pub(crate) reduce_dtype: DType,
    pub(crate) offload: OffloadPolicy,
    pub(crate) layout: SpmdLayout,
    pub(crate) groups: GroupInfos,
    pub(crate) geom: ShardGeometry,
    pub(crate) streams: HsdpStreams,
    pub(crate) shard: Storage,
    /// All shards side by side in `param_dtype`; released while sharded.
    gathered: DeviceBuffer,
    /// The re-interleaved parameter when the gathered buffer is not already it.
    interleaved: DeviceBuffer,
    pub(crate) state: ParamState,
    pending: Option<PendingUnshard>,
    ready: Event,
    pub(crate) grad: crate::grad_state::GradState,
}

fn elems_fit(buf: &Place<&DeviceBuffer>, count: usize, dtype: DType) -> bool {
    count
        .checked_mul(dtype.size())
        .and_then(|b| b.checked_add(buf.offset))
        .is_some_and(|end| end <= buf.mem.len())
}

impl ShardedParam {
    /// Shards `full` (the whole local parameter in `spec.dtype`, identical on every rank, ready
    /// in compute-stream order) and keeps this rank's shard. Collective over the cache's world:
    /// every rank creates its parameters in the same order.
    pub fn new(
        cache: &GroupCache,
        streams: &HsdpStreams,
        dp: &DataParallelMesh,
        spec: ParamSpec,
        config: &ParamConfig,
        full: Place<&DeviceBuffer>,
    ) -> Result<Self> {
        let platform = cache.platform().clone();
        let invalid = |m: String| HsdpError::InvalidParam {
            param: spec.name.clone(),
            message: m,
        };
        config.mp.check(spec.dtype)?;
        let numel = spec.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let numel = match numel {
            Some(n) if n > 0 && !spec.shape.is_empty() => n,
            None => {
                return Err(invalid(format!(
                    "shape {:?} has more elements than a usize holds",
                    spec.shape
                )))
            }
            _ => return Err(invalid(format!("shape {:?} has no elements", spec.shape))),
        };
        let shard = config.shard.unwrap_or(Placement::Shard(0));
        if let Some(d) = shard.shard_dim() {
            if d >= spec.shape.len() {
                return Err(HsdpError::InvalidPlacement(format!(
                    "{shard:?} of {:?} parameter {:?}",
                    spec.shape, spec.name
                )));
            }
        }
        if !elems_fit(&full, numel, spec.dtype) {
            return Err(invalid(format!(
                "the source buffer holds {} bytes past offset {}, the parameter needs {}",
                full.mem.len().saturating_sub(full.offset),
                full.offset,
                numel * spec.dtype.size()
            )));
        }
        let existing = spec.layout.as_ref().map(|(l, m)| (l, *m));
        let layout = SpmdLayout::resolve(dp, existing, shard, numel >= config.threshold)?;
        let groups = GroupInfos::build(cache, dp, &layout)?;
        let geom = if layout.uses_param_shard {
            ShardGeometry::new(
                &spec.shape,
                shard.shard_dim().unwrap_or(0),
                groups.sharded.size(),
                groups.sharded.rank(),
            )?
        } else {
            ShardGeometry::new(&spec.shape, 0, 1, 0)?
        };

        let sz = spec.dtype.size();
        let shard_bytes = geom.shard_numel() * sz;
        let cs = &streams.compute;
        let dev = platform.alloc_device(shard_bytes)?;
        if geom.valid_rows(geom.index()) < geom.chunk() {
            platform.memset_async(&dev, 0, 0, shard_bytes, cs)?;
        }
        for run in geom.runs(geom.index()) {
            platform.copy_async(
                (&dev).into(),
                run.shard * sz,
                full.mem.into(),
                full.offset + run.full * sz,
                run.len * sz,
                cs,
            )?;
        }
        let shard_storage = match config.offload {
            OffloadPolicy::None => Storage::Device(dev),
            OffloadPolicy::PinnedHost => {
                let host = platform.alloc_pinned(shard_bytes)?;
                platform.copy_async((&host).into(), 0, (&dev).into(), 0, shard_bytes, cs)?;
                // The device copy is freed once the queued copy out of it completed.
                platform.free_device(&dev)?;
                Storage::Pinned(host)
            }
        };

        Ok(ShardedParam {
            param_dtype: config.mp.param_dtype_for(spec.dtype),
            reduce_dtype: config.mp.reduce_dtype_for(spec.dtype),
            dtype: spec.dtype,
            name: spec.name,
            offload: config.offload,
            layout,
            groups,
            geom,
            streams: streams.clone(),
            shard: shard_storage,
            gathered: platform.alloc_device(0)?,
            interleaved: platform.alloc_device(0)?,
            state: ParamState::Sharded,
            pending: None,
            ready: platform.create_event(false)?,
            grad: crate::grad_state::GradState::new(&*platform)?,
            platform,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn state(&self) -> ParamState {
        self.state
    }
    /// The dtype of the stored shard and sharded gradient.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The dtype of the all-gather and the unsharded parameter.
    pub fn param_dtype(&self) -> DType {
        self.param_dtype
    }
    /// The dtype gradients are accumulated and reduced in.
    pub fn reduce_dtype(&self) -> DType {
        self.reduce_dtype
    }
    pub fn geometry(&self) -> &ShardGeometry {
        &self.geom
    }
    pub fn layout(&self) -> &SpmdLayout {
        &self.layout
    }
    pub fn groups(&self) -> &GroupInfos {
        &self.groups
    }
    /// Whether data parallelism shards this parameter (false for DDP and below the threshold).
    pub fn is_sharded_param(&self) -> bool {
        self.layout.uses_param_shard
    }
    pub fn streams(&self) -> &HsdpStreams {
        &self.streams
    }
    /// This rank's shard ([`ShardGeometry::shard_shape`], padding included) in [`Self::dtype`]:
    /// what an optimizer updates (on the compute stream).
    pub fn sharded_data(&self) -> ShardRef<'_> {
        shard_ref(&self.shard)
    }

    pub(crate) fn state_error(&self, operation: &'static str) -> HsdpError {
        HsdpError::InvalidState {
            param: self.name.clone(),
            operation,
            state: self.state.name(),
        }
    }

    pub(crate) fn kernel(&self, k: Kernel<Place<&DeviceBuffer>>, stream: &Stream) -> Result<()> {
        Ok(self.platform.launch_kernel(k, stream)?)
    }

    /// Makes `waiter` order after the work queued on `on` so far.
    pub(crate) fn order_after(&self, event: &Event, on: &Stream, waiter: &Stream) -> Result<()> {
        self.platform.record_event(event, on)?;
        self.platform.stream_wait_event(waiter, event)?;
        Ok(())
    }

    /// Starts the all-gather of the full parameter into one buffer. With `async_op` it returns
    /// the handle to wait on later (prefetch); without, it waits itself. While an unshard is
    /// pending or the parameter is unsharded this is a no-op returning `None`.
    pub fn unshard(&mut self, async_op: bool) -> Result<Option<UnshardHandle>> {
        if self.state != ParamState::Sharded {
            return Ok(None);
        }
        self.alloc_all_gather_outputs()?;
        let p = self.platform.clone();
        let ag = &self.streams.all_gather;
        self.order_after(&self.ready, &self.streams.compute, ag)?;
        let g = &self.geom;
        let (sz, psz) = (self.dtype.size(), self.param_dtype.size());
        let shard_numel = g.shard_numel();
        let mut staging = Vec::new();

        let src = match &self.shard {
            Storage::Device(b) => b.clone(),
            Storage::Pinned(h) => {
                let d = p.alloc_device(shard_numel * sz)?;
                p.copy_async((&d).into(), 0, h.into(), 0, shard_numel * sz, ag)?;
                staging.push(d.clone());
                d
            }
        };
        match self.groups.sharded.communicator() {
            None => self.kernel(
                Kernel::Cast {
                    src: (&src).into(),
                    src_dtype: self.dtype,
                    dst: (&self.gathered).into(),
                    dst_dtype: self.param_dtype,
                    count: shard_numel,
                },
                ag,
            )?,
            Some(comm) => {
                let input = if self.param_dtype == self.dtype {
                    src
                } else {
                    let c = p.alloc_device(shard_numel * psz)?;
                    self.kernel(
                        Kernel::Cast {
                            src: (&src).into(),
                            src_dtype: self.dtype,
                            dst: (&c).into(),
                            dst_dtype: self.param_dtype,
                            count: shard_numel,
                        },
                        ag,
                    )?;
                    staging.push(c.clone());
                    c
                };
                p.all_gather(
                    (&input).into(),
                    (&self.gathered).into(),
                    shard_numel,
                    self.param_dtype,
                    comm,
                    ag,
                )?;
            }
        }
        if !g.gathers_in_place() {
            for k in 0..g.group_size() {
                for run in g.runs(k) {
                    p.copy_async(
                        (&self.interleaved).into(),
                        run.full * psz,
                        (&self.gathered).into(),
                        (k * shard_numel + run.shard) * psz,
                        run.len * psz,
                        ag,
                    )?;
                }
            }
        }
        let done = p.create_event(false)?;
        p.record_event(&done, ag)?;
        self.pending = Some(PendingUnshard {
            done: done.clone(),
            _staging: staging,
        });
        self.state = ParamState::Unsharding;
        if async_op {
            Ok(Some(UnshardHandle { event: done }))
        } else {
            self.wait_for_unshard()?;
            Ok(None)
        }
    }

    /// Orders the compute stream after the pending all-gather and marks the parameter
    /// unsharded (no host blocking). A no-op when already unsharded; an error when no unshard
    /// was started.
    pub fn wait_for_unshard(&mut self) -> Result<()> {
        match self.state {
            ParamState::Unsharded => Ok(()),
            ParamState::Sharded => {
                Err(self.state_error("wait for an unshard that was not started"))
            }
            ParamState::Unsharding => {
                let pending = self
                    .pending
                    .take()
                    .expect("unsharding has a pending all-gather");
                self.platform
                    .stream_wait_event(&self.streams.compute, &pending.done)?;
                self.state = ParamState::Unsharded;
                Ok(())
            }
        }
    }

    /// The full parameter (shape [`ShardGeometry::shape`], [`Self::param_dtype`]), valid in
    /// compute-stream order while unsharded.
    pub fn unsharded(&self) -> Result<Place<&DeviceBuffer>> {
        if self.state != ParamState::Unsharded {
            return Err(self.state_error("read the unsharded parameter"));
        }
        Ok(if self.geom.gathers_in_place() {
            (&self.gathered).into()
        } else {
            (&self.interleaved).into()
        })
    }

    /// Back to sharded: waits for a pending unshard, then releases the gathered storage (work
    /// already queued on it still completes). A no-op when sharded.
    pub fn shard(&mut self) -> Result<()> {
        if self.state == ParamState::Unsharding {
            self.wait_for_unshard()?;
        }
        if self.state == ParamState::Unsharded {
            self.state = ParamState::Sharded;
            self.free_unsharded_param()?;
        }
        Ok(())
    }

    /// hyper_parallel's `to_sharded`: [`ShardedParam::shard`].
    pub fn to_sharded(&mut self) -> Result<()> {
        self.shard()
    }

    /// hyper_parallel's `to_unsharded`: unsharded from any state, the compute stream ordered
    /// after the all-gather (an all-gather is started if none is pending).
    pub fn to_unsharded(&mut self) -> Result<()> {
        self.unshard(false)?;
        self.wait_for_unshard()
    }

    /// Sizes the all-gather output (and the re-interleaved parameter for a `Shard(dim > 0)`
    /// layout) to full capacity in `param_dtype`; [`ShardedParam::unshard`] does this itself.
    /// Idempotent; allowed only while no all-gather is pending.
    pub fn alloc_all_gather_outputs(&mut self) -> Result<()> {
        if self.state == ParamState::Unsharding {
            return Err(self.state_error("resize the all-gather outputs of a pending unshard"));
        }
        let (g, psz) = (&self.geom, self.param_dtype.size());
        self.platform
            .resize_device(&self.gathered, g.padded_numel() * psz)?;
        if !g.gathers_in_place() {
            self.platform
                .resize_device(&self.interleaved, g.numel() * psz)?;
        }
        Ok(())
    }

    /// Releases the all-gather outputs (work already queued on them still completes). Only
    /// while sharded: [`ShardedParam::shard`] (`to_sharded`) is the transition that calls it.
    pub fn free_unsharded_param(&mut self) -> Result<()> {
        if self.state != ParamState::Sharded {
            return Err(self.state_error("free the unsharded parameter while it is in use"));
        }
        self.platform.resize_device(&self.gathered, 0)?;
        self.platform.resize_device(&self.interleaved, 0)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn geometry_refuses_shapes_whose_bytes_overflow() {
        // 2^61 f64 elements are 2^64 bytes: every byte size computed from it would wrap.
        for shape in [vec![1usize << 61], vec![1 << 31, 1 << 30], vec![usize::MAX]] {
            assert!(
                matches!(
                    ShardGeometry::new(&shape, 0, 1, 0),
                    Err(HsdpError::InvalidPlacement(_))
                ),
                "{shape:?}"
            );
        }
        assert!(ShardGeometry::new(&[1 << 40], 0, 4, 0).is_ok());
    }

    #[test]
    fn geometry_pads_uneven_dims() {
        let g = ShardGeometry::new(&[5, 3], 0, 4, 3).unwrap();
        assert_eq!(g.chunk(), 2);
        assert_eq!(g.padded_numel(), 24);
        assert_eq!(g.valid_rows(2), 1);
        assert_eq!(g.valid_rows(3), 0);
        assert!(g.runs(3).is_empty());
        assert_eq!(
            g.runs(2),
            vec![Run {
                full: 12,
                shard: 0,
                len: 3
            }]
        );
        assert!(g.gathers_in_place());
        let g1 = ShardGeometry::new(&[2, 5], 1, 2, 1).unwrap();
        assert_eq!(g1.shard_shape(), vec![2, 3]);
        assert!(!g1.gathers_in_place());
        assert_eq!(
            g1.runs(1),
            vec![
                Run {
                    full: 3,
                    shard: 0,
                    len: 2
                },
                Run {
                    full: 8,
                    shard: 3,
                    len: 2
                }
            ]
        );
        assert!(ShardGeometry::new(&[2], 1, 2, 0).is_err());
        assert!(ShardGeometry::new(&[2], 0, 2, 2).is_err());
        assert!(ShardGeometry::new(&[0, 2], 0, 1, 0).is_err());
    }

    proptest! {
        #[test]
        fn shards_cover_every_element_once(
            shape in proptest::collection::vec(1usize..6, 1..4),
            group in 1usize..6,
            dim_pick in 0usize..3,
        ) {
            let dim = dim_pick % shape.len();
            let numel: usize = shape.iter().product();
            let mut seen = vec![0u8; numel];
            for k in 0..group {
                let g = ShardGeometry::new(&shape, dim, group, k).unwrap();
                prop_assert_eq!(g.shard_numel() * group, g.padded_numel());
                for r in g.runs(k) {
                    prop_assert!(r.shard + r.len <= g.shard_numel());
                    for (i, count) in seen.iter_mut().enumerate().skip(r.full).take(r.len) {
                        *count += 1;
                        // Element i's index along `dim` falls in shard k's rows.
                        let inner: usize = shape[dim + 1..].iter().product();
                        let row = (i / inner) % shape[dim];
                        prop_assert_eq!(row / g.chunk(), k);
                    }
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1));
        }
    }
}
