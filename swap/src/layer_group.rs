//! Layer-group swap (seed 000): each layer's saved tensors form a group; linked layers offload
//! after their forward and prefetch their predecessor before their backward, on one copy stream.

use hprt_platform::Stream;

use crate::engine::{EngineConfig, Faults, PlatformHandle, SwapEngine};
use crate::error::{Result, SwapError, SwapState};
use crate::pool::PoolConfig;
use crate::tensor::{Saved, SwapTensor};

/// A layer (module) known to a [`SwapManager`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerId(usize);

impl LayerId {
    pub fn index(self) -> usize {
        self.0
    }
}

/// A value saved into a layer's group: where to find it at backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SavedRef {
    pub layer: LayerId,
    pub index: usize,
}

/// Where a layer is in the step; forward hooks are skipped once its backward began (a
/// checkpointed layer re-runs its forward during backward and must not offload again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Forward,
    PreBackward,
    Backward,
}

struct Layer {
    prev: Option<LayerId>,
    next: Option<LayerId>,
    phase: Phase,
    saved: Vec<SwapTensor>,
}

/// The seed-000 swap manager on explicit layer handles.
///
/// Link consecutive layers with [`SwapManager::set_forward_prefetch_layer`] (idempotent: a
/// layer's first link in each direction wins) and call the four entry points where a framework
/// registers module hooks:
/// - [`SwapManager::forward_pre`]: the layer becomes the group that [`SwapManager::save`] fills;
/// - [`SwapManager::forward_post`]: if a next layer exists, offload this group; if a previous
///   one exists, wait for its offload and release its device bytes;
/// - [`SwapManager::backward_pre`]: if a previous layer exists, prefetch it; if a next one
///   exists (so this group was offloaded), make the compute stream wait for this group's load;
/// - [`SwapManager::backward_post`]: marks the layer as done with backward.
///
/// ```
/// use std::sync::Arc;
/// use hprt_platform::{CpuBackend, CpuConfig, DType, Platform};
/// use hprt_swap::{DeviceTensor, Saved, SwapManager};
///
/// let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
/// let compute = p.create_stream().unwrap();
/// let mut m = SwapManager::new(Arc::clone(&p)).unwrap();
/// let (l0, l1) = (m.new_layer(), m.new_layer());
/// m.set_forward_prefetch_layer(l0, l1).unwrap();
///
/// let buf = p.alloc_device(256).unwrap();
/// p.write_device_sync(&buf, 0, &[9u8; 256], &compute).unwrap();
/// m.forward_pre(l0).unwrap();
/// let r = m.save(Saved::Tensor(DeviceTensor::whole(buf.clone(), DType::U8, vec![256]))).unwrap();
/// m.forward_post(l0, &compute).unwrap();    // l0 offloads
/// m.forward_pre(l1).unwrap();
/// m.forward_post(l1, &compute).unwrap();    // waits l0's offload: its bytes are released
/// assert_eq!(buf.len(), 0);
/// m.backward_pre(l1, &compute).unwrap();    // prefetches l0
/// m.backward_post(l1).unwrap();
/// m.backward_pre(l0, &compute).unwrap();    // waits for l0's load
/// assert!(m.get(r).is_ok());
/// ```
pub struct SwapManager {
    engine: SwapEngine,
    layers: Vec<Layer>,
    current: Option<LayerId>,
}

impl SwapManager {
    /// A manager with its own copy stream and an unbounded pinned pool.
    pub fn new(platform: impl Into<PlatformHandle>) -> Result<Self> {
        Self::with_pool(platform, PoolConfig::default())
    }

    pub fn with_pool(platform: impl Into<PlatformHandle>, pool: PoolConfig) -> Result<Self> {
        let config = EngineConfig {
            single_copy_stream: true,
            pool,
            ..EngineConfig::default()
        };
        Ok(SwapManager {
            engine: SwapEngine::new(platform, config)?,
            layers: Vec::new(),
            current: None,
        })
    }

    pub fn engine(&self) -> &SwapEngine {
        &self.engine
    }

    /// The engine, to choose compression (`set_compression`, `set_compression_policy`).
    pub fn engine_mut(&mut self) -> &mut SwapEngine {
        &mut self.engine
    }

    #[doc(hidden)]
    pub fn set_faults(&mut self, faults: Faults) {
        self.engine.set_faults(faults);
    }

    /// A new layer with an empty group.
    pub fn new_layer(&mut self) -> LayerId {
        self.layers.push(Layer {
            prev: None,
            next: None,
            phase: Phase::Forward,
            saved: Vec::new(),
        });
        LayerId(self.layers.len() - 1)
    }

    fn layer(&mut self, id: LayerId) -> Result<&mut Layer> {
        self.layers
            .get_mut(id.0)
            .ok_or_else(|| SwapError::unknown("layer", id.0))
    }

    /// `second` runs after `first` in forward. Only the first link of each layer in each
    /// direction counts, so calling this again (or for every step) changes nothing.
    pub fn set_forward_prefetch_layer(&mut self, first: LayerId, second: LayerId) -> Result<()> {
        if first == second {
            return Err(SwapError::Order(format!(
                "layer {} cannot prefetch itself",
                first.0
            )));
        }
        self.layer(second)?;
        let a = self.layer(first)?;
        a.next.get_or_insert(second);
        self.layer(second)?.prev.get_or_insert(first);
        Ok(())
    }

    /// The layer's forward begins: values saved from now on join its group.
    pub fn forward_pre(&mut self, layer: LayerId) -> Result<()> {
        if self.layer(layer)?.phase != Phase::PreBackward {
            self.current = Some(layer);
        }
        Ok(())
    }

    /// Adds a saved value to the current layer's group.
    pub fn save(&mut self, value: Saved) -> Result<SavedRef> {
        let layer = self
            .current
            .ok_or_else(|| SwapError::Order("save called before any forward_pre".into()))?;
        let t = SwapTensor::new(value)?;
        let group = &mut self.layer(layer)?.saved;
        group.push(t);
        Ok(SavedRef {
            layer,
            index: group.len() - 1,
        })
    }

    /// The layer's forward was queued on `compute`: offload its group if a next layer exists,
    /// then wait for the previous layer's offload and release its device bytes.
    pub fn forward_post(&mut self, layer: LayerId, compute: &Stream) -> Result<()> {
        let l = self.layer(layer)?;
        if l.phase == Phase::PreBackward {
            return Ok(());
        }
        let (prev, next) = (l.prev, l.next);
        if next.is_some() {
            let group = &mut self.layers[layer.0].saved;
            self.engine.offload(group.iter_mut(), compute)?;
        }
        if let Some(prev) = prev {
            let group = &mut self.layers[prev.0].saved;
            self.engine.finish_offload(group.iter_mut())?;
        }
        Ok(())
    }

    /// The layer's backward is about to run on `compute`: prefetch the previous layer's group,
    /// and make `compute` wait for this layer's group if it was offloaded. A failed prefetch
    /// (device out of memory) leaves the group on the host and can be retried by calling again.
    pub fn backward_pre(&mut self, layer: LayerId, compute: &Stream) -> Result<()> {
        let l = self.layer(layer)?;
        l.phase = Phase::PreBackward;
        let (prev, next) = (l.prev, l.next);
        if next.is_some() {
            // Normally prefetched at the next layer's backward_pre; loaded here if that failed
            // or the schedule skipped it (both calls skip what is already loading).
            self.launch_load(layer)?;
        }
        if let Some(prev) = prev {
            self.launch_load(prev)?;
        }
        if next.is_some() {
            let group = &mut self.layers[layer.0].saved;
            self.engine.finish_reload(group.iter_mut(), compute)?;
        }
        Ok(())
    }

    /// Starts reloading the layer's group; an offload still queued is waited for first, and
    /// values already reloading are left alone.
    fn launch_load(&mut self, layer: LayerId) -> Result<()> {
        let group = &mut self.layers[layer.0].saved;
        let in_flight = group.iter_mut().filter(|t| t.state() == SwapState::D2h);
        self.engine.finish_offload(in_flight)?;
        self.engine.start_reload(group.iter_mut())
    }

    /// The layer's backward was queued.
    pub fn backward_post(&mut self, layer: LayerId) -> Result<()> {
        self.layer(layer)?.phase = Phase::Backward;
        Ok(())
    }

    /// A saved value, once its group is on the device.
    pub fn get(&self, r: SavedRef) -> Result<&Saved> {
        self.layers
            .get(r.layer.0)
            .and_then(|l| l.saved.get(r.index))
            .ok_or_else(|| SwapError::unknown("saved value", format!("{r:?}")))?
            .get()
    }

    /// Empties the layer's group (after its backward), handing back the saved values.
    pub fn release(&mut self, layer: LayerId) -> Result<Vec<Saved>> {
        let group = std::mem::take(&mut self.layer(layer)?.saved);
        group.into_iter().map(SwapTensor::into_saved).collect()
    }

    /// Drops every group's values (whatever their state) and starts a new iteration of the pool.
    pub fn end_iteration(&mut self) -> Result<()> {
        self.engine.synchronize()?;
        for l in &mut self.layers {
            l.saved.clear();
        }
        self.current = None;
        self.engine.end_iteration()?;
        Ok(())
    }
}
