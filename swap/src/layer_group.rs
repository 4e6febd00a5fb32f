//! Layer-group swap (hyper_parallel): each layer's saved tensors form a group; linked layers offload
//! after their forward and prefetch their predecessor before their backward, on one copy stream.

use std::collections::HashMap;

use hprt_compress::{LayerId, TensorKey};
use hprt_platform::Stream;

use crate::engine::{EngineConfig, PlatformHandle, SwapEngine};
use crate::error::{Result, SwapError, SwapState};
use crate::payload::SwapTensor;
use crate::pool::PoolConfig;
use crate::tensor::Saved;

/// A value saved into a layer's group: where to find it at backward (a layer of the
/// [`SwapManager`] — its index in registration order — and the value's place in the group).
/// `generation` counts the group's iterations, so a reference kept past its iteration is refused,
/// not misread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SavedRef {
    pub key: TensorKey,
    pub generation: u64,
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
    name: String,
    prev: Option<LayerId>,
    next: Option<LayerId>,
    phase: Phase,
    /// `None` once [`SwapManager::take`] handed the value out.
    saved: Vec<Option<SwapTensor>>,
    generation: u64,
}

/// hyper_parallel's swap manager on explicit layer handles.
///
/// Link consecutive layers with [`SwapManager::set_forward_prefetch_layer`] (idempotent: a
/// layer's first link in each direction wins) and call the four entry points where a framework
/// registers module hooks:
/// - [`SwapManager::forward_pre`]: the layer becomes the group that [`SwapManager::save`] fills;
/// - [`SwapManager::forward_post`]: if a next layer exists, offload this group; if a previous
///   one exists, wait for its offload and release its device bytes;
/// - [`SwapManager::backward_pre`]: if a previous layer exists, prefetch it; if a next one
///   exists (so this group was offloaded), make the compute stream wait for this group's load;
/// - [`SwapManager::backward_post`]: the layer is done with backward; its group is emptied.
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
    names: HashMap<String, LayerId>,
    /// The group `save` fills (hyper_parallel's current group name).
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
            names: HashMap::new(),
            current: None,
        })
    }

    engine_accessors!();

    /// A new layer with an empty group, named `swap_group_<n>`.
    pub fn new_layer(&mut self) -> LayerId {
        let name = format!("swap_group_{}", self.layers.len());
        self.group(&name)
    }

    /// The layer (group) named `name`, made on first use.
    pub fn group(&mut self, name: &str) -> LayerId {
        if let Some(id) = self.names.get(name) {
            return *id;
        }
        self.layers.push(Layer {
            name: name.to_owned(),
            prev: None,
            next: None,
            phase: Phase::Forward,
            saved: Vec::new(),
            generation: 0,
        });
        let id = LayerId(self.layers.len() - 1);
        self.names.insert(name.to_owned(), id);
        id
    }

    /// The layer numbered `index` (in creation order).
    pub fn layer_id(&self, index: usize) -> Result<LayerId> {
        if index < self.layers.len() {
            Ok(LayerId(index))
        } else {
            Err(SwapError::unknown("layer", index))
        }
    }

    fn named(&self, name: &str) -> Result<LayerId> {
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| SwapError::unknown("swap group", name))
    }

    /// The name of the group `save` fills now (hyper_parallel's `get_current_group_name`).
    pub fn get_current_group_name(&self) -> Option<&str> {
        self.current.map(|id| self.layers[id.0].name.as_str())
    }

    /// Makes `name` the group `save` / `add_storage` fill (made on first use).
    pub fn set_current_group_name(&mut self, name: &str) {
        self.current = Some(self.group(name));
    }

    /// hyper_parallel's `is_last_group`: whether group `group_name` ends the chain of linked
    /// layers (it was linked by [`SwapManager::set_forward_prefetch_layer`] and has no next
    /// layer, so it is never offloaded). Unknown or unlinked groups are not.
    pub fn is_last_group(&self, group_name: &str) -> bool {
        self.names.get(group_name).is_some_and(|id| {
            let l = &self.layers[id.0];
            l.next.is_none() && l.prev.is_some()
        })
    }

    /// Where a saved value is now (`Host` once its group's offload was waited for).
    pub fn state(&mut self, r: SavedRef) -> Result<SwapState> {
        Ok(self
            .slot(r)?
            .as_ref()
            .ok_or_else(|| SwapError::Order(format!("{r:?} was already taken")))?
            .state())
    }

    /// Adds a value to group `group_name` (hyper_parallel's `add_storage`).
    pub fn add_storage(&mut self, group_name: &str, value: Saved) -> Result<SavedRef> {
        let id = self.group(group_name);
        self.save_into(id, value)
    }

    /// Queues the offload of group `group_name` after the work queued on `compute`.
    pub fn launch_offload(&mut self, group_name: &str, compute: &Stream) -> Result<()> {
        let id = self.named(group_name)?;
        self.engine
            .offload(self.layers[id.0].saved.iter_mut().flatten(), compute)
    }

    /// Waits for group `group_name`'s offload and releases its device memory.
    pub fn wait_offload(&mut self, group_name: &str) -> Result<()> {
        let id = self.named(group_name)?;
        self.finish_offload(id)
    }

    /// Waits on the host for `layer`'s offload copies (also where the framework took the
    /// memory back when they were queued: it cannot reuse it before they finished, so this is
    /// what bounds the device memory in flight to a layer), then releases its device memory.
    fn finish_offload(&mut self, layer: LayerId) -> Result<()> {
        let group = &mut self.layers[layer.0].saved;
        self.engine.wait_copies(group.iter().flatten())?;
        self.engine.finish_offload(group.iter_mut().flatten())
    }

    /// Starts reloading group `group_name` (an offload still queued is waited for first).
    pub fn launch_load(&mut self, group_name: &str) -> Result<()> {
        let id = self.named(group_name)?;
        self.load(id)
    }

    /// Makes `compute` wait for group `group_name`'s reload.
    pub fn wait_load(&mut self, group_name: &str, compute: &Stream) -> Result<()> {
        let id = self.named(group_name)?;
        self.engine
            .finish_reload(self.layers[id.0].saved.iter_mut().flatten(), compute)
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
        self.layer(first)?;
        // A link the other way round (or any chain back to `first`) would make a cycle: the
        // schedule would wait on itself.
        let mut at = Some(second);
        while let Some(l) = at {
            if l == first {
                return Err(SwapError::Order(format!(
                    "set_forward_prefetch_layer({}, {}): layer {} already runs after layer {}",
                    first.0, second.0, first.0, second.0
                )));
            }
            at = self.layers[l.0].next;
        }
        self.layers[first.0].next.get_or_insert(second);
        self.layers[second.0].prev.get_or_insert(first);
        Ok(())
    }

    /// Forgets where `layer` runs in forward (its links both ways, and its neighbours' links
    /// to it), so that it can be linked anew, in another order; between iterations only (its
    /// group must be empty).
    pub fn unlink(&mut self, layer: LayerId) -> Result<()> {
        let l = self.layer(layer)?;
        if l.saved.iter().any(Option::is_some) {
            return Err(SwapError::Order(format!(
                "unlink of layer {} while its group holds saved values (end the iteration first)",
                layer.0
            )));
        }
        let (prev, next) = (l.prev.take(), l.next.take());
        if let Some(p) = prev {
            let p = &mut self.layers[p.0];
            if p.next == Some(layer) {
                p.next = None;
            }
        }
        if let Some(n) = next {
            let n = &mut self.layers[n.0];
            if n.prev == Some(layer) {
                n.prev = None;
            }
        }
        Ok(())
    }

    /// The layer's forward begins: values saved from now on join its group. A layer whose
    /// backward finished starts a new iteration: its previous group is dropped. (A forward
    /// during the layer's backward is a checkpointed recomputation: nothing changes.)
    pub fn forward_pre(&mut self, layer: LayerId) -> Result<()> {
        let l = self.layer(layer)?;
        match l.phase {
            Phase::PreBackward => return Ok(()),
            Phase::Backward => {
                l.saved.clear();
                l.generation += 1;
                l.phase = Phase::Forward;
            }
            Phase::Forward => {}
        }
        self.current = Some(layer);
        Ok(())
    }

    /// Adds a saved value to the current layer's group (between its `forward_pre` and
    /// `forward_post`).
    pub fn save(&mut self, value: Saved) -> Result<SavedRef> {
        let layer = self.current.ok_or_else(|| {
            SwapError::Order(
                "save outside a forward (no forward_pre without its forward_post)".into(),
            )
        })?;
        self.save_into(layer, value)
    }

    fn save_into(&mut self, layer: LayerId, value: Saved) -> Result<SavedRef> {
        let t = SwapTensor::new(value)?;
        let l = self.layer(layer)?;
        l.saved.push(Some(t));
        Ok(SavedRef {
            key: TensorKey {
                layer,
                index: l.saved.len() - 1,
            },
            generation: l.generation,
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
        if self.current != Some(layer) {
            // Groups do not nest: a forward_pre inside this layer's forward moved the saves to
            // its own group (a forward abandoned half-way must not block every later one).
            let open = match self.current {
                Some(other) => format!("layer {}'s forward is the open one", other.0),
                None => "no layer's forward is open".into(),
            };
            return Err(SwapError::Order(format!(
                "forward_post of layer {} without its forward_pre, or after another layer's \
                 forward_pre inside its forward ({open}): layer groups do not nest, so each \
                 layer's forward_post must come before the next layer's forward_pre",
                layer.0
            )));
        }
        self.current = None;
        if next.is_some() {
            let group = &mut self.layers[layer.0].saved;
            self.engine.offload(group.iter_mut().flatten(), compute)?;
        }
        if let Some(prev) = prev {
            self.finish_offload(prev)?;
        }
        Ok(())
    }

    /// The layer's backward is about to run on `compute`: prefetch the previous layer's group,
    /// and make `compute` wait for this layer's group if it was offloaded. A failed prefetch
    /// (device out of memory) leaves that group on the host for its own `backward_pre`; a
    /// failed load of this layer's group leaves it on the host, and the call can be retried.
    pub fn backward_pre(&mut self, layer: LayerId, compute: &Stream) -> Result<()> {
        let l = self.layer(layer)?;
        l.phase = Phase::PreBackward;
        let (prev, next) = (l.prev, l.next);
        if next.is_some() {
            // Normally prefetched at the next layer's backward_pre; loaded here if that failed
            // or the schedule skipped it (both calls skip what is already loading).
            self.load(layer)?;
        }
        if let Some(prev) = prev {
            // A prefetch is an optimization: one that fails (device out of memory, a driver
            // fault) leaves its layer on the host, where that layer's own backward_pre loads it
            // or reports the error; this layer's backward goes on.
            if let Err(e) = self.prefetch(prev) {
                tracing::debug!(layer = prev.0, error = %e, "prefetch deferred");
            }
        }
        if next.is_some() {
            let group = &mut self.layers[layer.0].saved;
            self.engine
                .finish_reload(group.iter_mut().flatten(), compute)?;
        }
        Ok(())
    }

    /// Starts reloading the layer's group; an offload still queued is waited for first, and
    /// values already reloading are left alone.
    fn load(&mut self, layer: LayerId) -> Result<()> {
        self.bring_back(layer, false)
    }

    /// [`SwapManager::load`] ahead of need, within the engine's reload window: what does not
    /// fit waits for the layer's own `backward_pre`.
    fn prefetch(&mut self, layer: LayerId) -> Result<()> {
        self.bring_back(layer, true)
    }

    fn bring_back(&mut self, layer: LayerId, ahead: bool) -> Result<()> {
        let group = &mut self.layers[layer.0].saved;
        let in_flight = group
            .iter_mut()
            .flatten()
            .filter(|t| t.state() == SwapState::D2h);
        self.engine.finish_offload(in_flight)?;
        let group = group.iter_mut().flatten();
        if ahead {
            self.engine.prefetch(group).map(drop)
        } else {
            self.engine.start_reload(group)
        }
    }

    /// The layer's backward was queued (after its `backward_pre`). Values it did not take
    /// stay in the group until the layer's next forward (or `end_iteration`): a framework may
    /// report a module's backward before its saved values were read (torch does for a module
    /// whose inputs need no gradient).
    pub fn backward_post(&mut self, layer: LayerId) -> Result<()> {
        let l = self.layer(layer)?;
        if l.phase != Phase::PreBackward {
            return Err(SwapError::Order(format!(
                "backward_post of layer {} whose backward did not begin (no backward_pre)",
                layer.0
            )));
        }
        l.phase = Phase::Backward;
        Ok(())
    }

    /// Whether `save` fills `layer`'s group now (false during a checkpointed recomputation).
    pub fn is_recording(&self, layer: LayerId) -> bool {
        self.current == Some(layer)
    }

    fn slot(&mut self, r: SavedRef) -> Result<&mut Option<SwapTensor>> {
        let stale = || SwapError::unknown("saved value of this iteration", format!("{r:?}"));
        let l = self.layers.get_mut(r.key.layer.0).ok_or_else(stale)?;
        if l.generation != r.generation {
            return Err(stale());
        }
        l.saved.get_mut(r.key.index).ok_or_else(stale)
    }

    /// A saved value, once its group is on the device.
    pub fn get(&mut self, r: SavedRef) -> Result<&Saved> {
        self.slot(r)?
            .as_ref()
            .ok_or_else(|| SwapError::Order(format!("{r:?} was already taken")))?
            .get()
    }

    /// Hands a saved value out of its group (once its group is on the device): the group holds
    /// no reference to it any more, so its memory goes when the caller drops it. A second take
    /// is an error.
    pub fn take(&mut self, r: SavedRef) -> Result<Saved> {
        let slot = self.slot(r)?;
        let t = slot
            .as_ref()
            .ok_or_else(|| SwapError::Order(format!("{r:?} was already taken")))?;
        t.get()?;
        slot.take().expect("checked above").into_saved()
    }

    /// Empties the layer's group (after its backward), handing back the values not taken.
    pub fn release(&mut self, layer: LayerId) -> Result<Vec<Saved>> {
        let group = std::mem::take(&mut self.layer(layer)?.saved);
        group
            .into_iter()
            .flatten()
            .map(SwapTensor::into_saved)
            .collect()
    }

    /// Ends an iteration, also one aborted midway (an exception in forward or backward): drops
    /// every group's values whatever their state, and every layer starts the next iteration
    /// in forward.
    pub fn end_iteration(&mut self) -> Result<()> {
        self.engine.synchronize()?;
        for l in &mut self.layers {
            l.saved.clear();
            l.generation += 1;
            l.phase = Phase::Forward;
        }
        self.current = None;
        self.engine.end_iteration()?;
        Ok(())
    }
}
