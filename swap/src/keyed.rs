//! Keyed tensor swap (a `saved_tensors_hooks` design): every saved tensor gets a (layer, index) key; packing offloads it
//! and releases the previous layer, unpacking waits for it and prefetches the proportional slice
//! of the previous layer; separate d2h and h2d streams.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use hprt_compress::TensorKey;
use hprt_platform::Stream;

use crate::engine::{EngineConfig, PlatformHandle, SwapEngine};
use crate::error::{Result, SwapError, SwapState};
use crate::payload::SwapTensor;
use crate::pool::PoolConfig;
use crate::tensor::{DeviceTensor, Saved};

/// Hands out (layer, index) keys in save order and maps backward tensors onto the previous
/// layer's tensors.
#[derive(Clone, Debug, Default)]
pub struct TensorKeyManager {
    current: Option<usize>,
    counts: HashMap<usize, usize>,
}

impl TensorKeyManager {
    pub fn new() -> Self {
        Self::default()
    }

    /// The key of the next tensor saved by `layer`, and whether `layer` starts a new layer after
    /// layer `layer - 1` (whose device copies may then be released). A layer index below the
    /// current one starts a new step: every count restarts.
    pub fn get_key(&mut self, layer: usize) -> (TensorKey, bool) {
        let mut previous_done = false;
        match self.current {
            Some(cur) if layer == cur => *self.counts.entry(layer).or_insert(0) += 1,
            Some(cur) if layer < cur => self.counts = HashMap::from([(layer, 1)]),
            _ => {
                self.counts.insert(layer, 1);
                previous_done = layer != 0;
            }
        }
        self.current = Some(layer);
        (
            TensorKey::new(layer, self.counts[&layer] - 1),
            previous_done,
        )
    }

    /// Tensors of `layer` counted in this step.
    pub fn count(&self, layer: usize) -> usize {
        self.counts.get(&layer).copied().unwrap_or(0)
    }

    /// The keys of layer `layer - 1` that tensor `(layer, index)` prefetches: its proportional
    /// share, so that all of `layer`'s tensors together prefetch each of the previous layer's
    /// tensors exactly once.
    pub fn get_prefetch_keys(&self, key: TensorKey) -> Vec<TensorKey> {
        let layer = key.layer.index();
        let Some(prev) = layer.checked_sub(1) else {
            return Vec::new();
        };
        proportional_slice(key.index, self.count(layer), self.count(prev))
            .map(|i| TensorKey::new(prev, i))
            .collect()
    }
}

/// The indices `[i·prev/cur, (i+1)·prev/cur)` of a `prev`-element layer that element `i` of a
/// `cur`-element layer covers (empty when `cur` is 0 or `i` is out of range).
pub fn proportional_slice(i: usize, cur: usize, prev: usize) -> Range<usize> {
    if cur == 0 || i >= cur {
        return 0..0;
    }
    (i * prev / cur)..((i + 1) * prev / cur)
}

/// A module tag: a dotted module path where `*` stands for any one path component (a layer
/// number), naming one role across layers, e.g. `model.layer.*.mlp.experts.0.up_proj`.
///
/// ```
/// use hprt_swap::ModuleTag;
/// let tag = ModuleTag::new("model.layer.*.mlp");
/// assert!(tag.matches("model.layer.7.mlp"));
/// assert!(!tag.matches("model.layer.7.attn"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModuleTag(String);

impl ModuleTag {
    pub fn new(pattern: &str) -> Self {
        ModuleTag(pattern.to_owned())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// Whether `module` (a dotted path) fits the pattern component by component.
    pub fn matches(&self, module: &str) -> bool {
        let mut pat = self.0.split('.');
        let mut name = module.split('.');
        loop {
            match (pat.next(), name.next()) {
                (None, None) => return true,
                (Some(p), Some(n)) if p == "*" || p == n => {}
                _ => return false,
            }
        }
    }
}

/// A layer registered under a tag: hyper_parallel's `TensorSwapContext`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwapContext {
    tag: usize,
    /// The layer's index among the layers of its tag.
    pub layer: usize,
}

/// What packing returned: the value itself (not swapped), or the key to unpack it with.
#[derive(Debug)]
pub enum Packed {
    Kept(Saved),
    Swapped(TensorKey),
}

/// Which tensors the keyed front end swaps.
pub type SwapPredicate = Box<dyn Fn(&DeviceTensor) -> bool + Send + Sync>;

/// The keyed swap: `pack` where autograd saves a tensor, `unpack` where it reads it back.
///
/// Layers are registered per tag before the step ([`KeyedSwap::register_layer`]); a tag's
/// layer count is how many layers registered under it, and its last layer is never offloaded
/// (its backward comes first). Eligible tensors: not parameters, non-empty storage, at least
/// `min_bytes`, and accepted by the custom predicate.
///
/// ```
/// use std::sync::Arc;
/// use hprt_platform::{CpuBackend, CpuConfig, DType, Platform};
/// use hprt_swap::{DeviceTensor, KeyedSwap, Packed, Saved, TensorKey};
///
/// let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
/// let s = p.create_stream().unwrap();
/// let mut swap = KeyedSwap::new(Arc::clone(&p)).unwrap();
/// let layers = [swap.register_layer("model.layer.*"), swap.register_layer("model.layer.*")];
/// let buf = p.alloc_device(64).unwrap();
/// let packed = swap.pack(&layers[0], Saved::Tensor(DeviceTensor::whole(buf, DType::U8, vec![64])), &s).unwrap();
/// assert!(matches!(packed, Packed::Swapped(k) if k == TensorKey::new(0, 0)));
/// let back = swap.unpack(packed, &s).unwrap();
/// assert!(back.tensor().is_some());
/// ```
pub struct KeyedSwap {
    engine: SwapEngine,
    keys: TensorKeyManager,
    tensors: BTreeMap<TensorKey, SwapTensor>,
    tags: Vec<(ModuleTag, usize)>,
    min_bytes: usize,
    predicate: Option<SwapPredicate>,
}

impl KeyedSwap {
    pub fn new(platform: impl Into<PlatformHandle>) -> Result<Self> {
        Self::with_pool(platform, PoolConfig::default())
    }

    pub fn with_pool(platform: impl Into<PlatformHandle>, pool: PoolConfig) -> Result<Self> {
        let config = EngineConfig {
            single_copy_stream: false,
            pool,
            ..EngineConfig::default()
        };
        Ok(KeyedSwap {
            engine: SwapEngine::new(platform, config)?,
            keys: TensorKeyManager::new(),
            tensors: BTreeMap::new(),
            tags: Vec::new(),
            min_bytes: 0,
            predicate: None,
        })
    }

    engine_accessors!();

    /// Tensors smaller than this are kept on the device.
    pub fn set_min_bytes(&mut self, bytes: usize) {
        self.min_bytes = bytes;
    }

    /// An extra eligibility test (hyper_parallel's `custom_check_fn`).
    pub fn set_predicate(&mut self, predicate: Option<SwapPredicate>) {
        self.predicate = predicate;
    }

    /// Registers the next layer under `tag` (a [`ModuleTag`] pattern; each distinct tag counts
    /// its own layers from 0).
    pub fn register_layer(&mut self, tag: &str) -> SwapContext {
        let tag = match self.tags.iter().position(|(t, _)| t.as_str() == tag) {
            Some(i) => i,
            None => {
                self.tags.push((ModuleTag::new(tag), 0));
                self.tags.len() - 1
            }
        };
        let layer = self.tags[tag].1;
        self.tags[tag].1 += 1;
        SwapContext { tag, layer }
    }

    /// Registers the module named `module` under the first registered tag whose pattern it
    /// matches.
    pub fn register_module(&mut self, module: &str) -> Result<SwapContext> {
        let tag = self
            .tags
            .iter()
            .find(|(t, _)| t.matches(module))
            .map(|(t, _)| t.as_str().to_owned())
            .ok_or_else(|| SwapError::unknown("module tag matching", module))?;
        Ok(self.register_layer(&tag))
    }

    /// Adds a tag pattern with no layers yet (for [`KeyedSwap::register_module`]).
    pub fn add_tag(&mut self, pattern: &str) {
        if !self.tags.iter().any(|(t, _)| t.as_str() == pattern) {
            self.tags.push((ModuleTag::new(pattern), 0));
        }
    }

    /// Layers registered under the context's tag.
    pub fn layer_count(&self, ctx: &SwapContext) -> usize {
        self.tags.get(ctx.tag).map_or(0, |t| t.1)
    }

    fn eligible(&self, t: &DeviceTensor) -> bool {
        !t.is_parameter
            && !t.storage.is_empty()
            && t.len > 0
            && t.len >= self.min_bytes
            && self.predicate.as_ref().is_none_or(|p| p(t))
    }

    /// [`KeyedSwap::swap_out_cur_and_release_prev`], the pack hook's short name.
    pub fn pack(&mut self, ctx: &SwapContext, value: Saved, compute: &Stream) -> Result<Packed> {
        self.swap_out_cur_and_release_prev(ctx, value, compute)
    }

    /// Autograd saves `value` in `ctx`'s layer (its producer queued on `compute`): a new layer
    /// first releases the previous layer's device bytes (waiting for its offloads), then the
    /// tensor is offloaded unless its layer is its tag's last.
    pub fn swap_out_cur_and_release_prev(
        &mut self,
        ctx: &SwapContext,
        value: Saved,
        compute: &Stream,
    ) -> Result<Packed> {
        let Saved::Tensor(tensor) = &value else {
            return Ok(Packed::Kept(value));
        };
        if !self.eligible(tensor) {
            return Ok(Packed::Kept(value));
        }
        let (key, previous_done) = self.keys.get_key(ctx.layer);
        if previous_done {
            let prev = ctx.layer - 1;
            // The host waits for the previous layer's copies (its memory may be the
            // framework's already, but not reusable before they finished): at most a layer
            // of copies in flight.
            let range = TensorKey::layer_range(prev);
            self.engine
                .wait_copies(self.tensors.range(range.clone()).map(|(_, t)| t))?;
            let group = self.tensors.range_mut(range).map(|(_, t)| t);
            self.engine.finish_offload(group)?;
        }
        let mut t = SwapTensor::new(value)?;
        if ctx.layer + 1 < self.layer_count(ctx) {
            self.engine.offload([&mut t], compute)?;
        }
        if self.tensors.insert(key, t).is_some() {
            tracing::warn!(?key, "a tensor saved in an earlier step was never unpacked");
        }
        Ok(Packed::Swapped(key))
    }

    /// Autograd reads a saved value back for work about to be queued on `compute`: its reload is
    /// waited for (started first if it was not prefetched), then, if `prefetch`, this tensor's
    /// share of the previous layer starts reloading.
    pub fn unpack(&mut self, packed: Packed, compute: &Stream) -> Result<Saved> {
        self.unpack_with(packed, compute, true)
    }

    /// [`KeyedSwap::wait_cur_and_prefetch_next`] with prefetching on or off.
    pub fn unpack_with(
        &mut self,
        packed: Packed,
        compute: &Stream,
        prefetch: bool,
    ) -> Result<Saved> {
        self.wait_cur_and_prefetch_next(packed, compute, prefetch)
    }

    /// Autograd reads a saved value back for work about to be queued on `compute`: its reload
    /// is waited for (started first if it was not prefetched), then, if `prefetch`, this
    /// tensor's share of the previous layer (the next one backward reaches) starts reloading.
    pub fn wait_cur_and_prefetch_next(
        &mut self,
        packed: Packed,
        compute: &Stream,
        prefetch: bool,
    ) -> Result<Saved> {
        let key = match packed {
            Packed::Kept(v) => return Ok(v),
            Packed::Swapped(key) => key,
        };
        let t = self
            .tensors
            .get_mut(&key)
            .ok_or_else(|| SwapError::unknown("tensor key", format!("{key:?}")))?;
        if t.state() == SwapState::D2h {
            // Its layer was never released (no later layer saved anything): bytes never left
            // (unless the framework took its memory back at the offload: then it reloads).
            self.engine.cancel_offload([&mut *t])?;
        }
        if t.state() == SwapState::Host {
            self.engine.start_reload([&mut *t])?;
        }
        // The prefetch is queued before the wait: where the compute stream is the host (the cpu
        // backend's host stream) the wait blocks, and the next layer's copies should already
        // be running meanwhile.
        if prefetch {
            for k in self.keys.get_prefetch_keys(key) {
                if let Some(p) = self.tensors.get_mut(&k) {
                    // A prefetch that fails (device out of memory) or does not fit the reload
                    // window leaves the tensor on the host; its own unpack reloads it, or
                    // reports the error, later.
                    if let Err(e) = self.engine.prefetch([p]) {
                        tracing::debug!(?k, error = %e, "prefetch deferred");
                    }
                }
            }
        }
        let t = self.tensors.get_mut(&key).expect("present above");
        self.engine.finish_reload([&mut *t], compute)?;
        let t = self.tensors.remove(&key).expect("present above");
        t.into_saved()
    }

    /// Ends an iteration: waits for queued copies, drops tensors never unpacked, and starts a
    /// new iteration of the pinned pool.
    pub fn end_iteration(&mut self) -> Result<()> {
        self.engine.synchronize()?;
        self.tensors.clear();
        self.engine.end_iteration()?;
        Ok(())
    }

    /// Tensors packed and not yet unpacked.
    pub fn pending(&self) -> usize {
        self.tensors.len()
    }
}
