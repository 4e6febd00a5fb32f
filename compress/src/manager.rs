//! The per-layer activation manager (MindSpeed): saved tensors are registered per layer; during
//! each asynchronous operator's window the previous layer's tensors that fit are encoded on a
//! side stream and their originals freed; in backward the next layer's tensors are decoded in
//! the window; whatever is still compressed when its layer's backward starts is recovered
//! synchronously (`windows.rs`). Without windows, `save` queues each encode and `take` decodes
//! ahead (`eager.rs`). This file holds what both schedules share: the registered tensors and
//! their states, the scratch pool, launching and finishing an encode, failures, statistics.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use hprt_compress::{CostModel, CostTable, Op};
//! use hprt_compress::data::{generate, DataKind};
//! use hprt_compress::{ActivationManager, ManagerConfig};
//! use hprt_compress::LayerId;
//! use hprt_compress::CodecDType;
//! use hprt_platform::{CpuBackend, CpuConfig, DType, Platform, TensorRef};
//!
//! let p: Arc<dyn Platform> = Arc::new(CpuBackend::new(CpuConfig::default()));
//! let compute = p.create_stream()?;
//! let mut table = CostTable::default();
//! (table.encode_gbps, table.decode_gbps) = (1.0, 1.0);
//! let config = ManagerConfig::new(CostModel::from_table(table));
//! let mut m = ActivationManager::new(p.clone(), compute.clone(), config)?;
//!
//! let data = generate(DataKind::Gelu, CodecDType::BF16, 1 << 16, 1);
//! let buf = p.alloc_device(data.len())?;
//! p.write_device_sync(&buf, 0, &data, &compute)?;
//! m.forward_start(LayerId(0))?;
//! let saved = TensorRef::view(buf, 0, DType::BF16, vec![1 << 16])?;
//! let key = m.save(LayerId(0), saved)?.unwrap();
//! m.forward_start(LayerId(1))?;
//! m.begin_window(&Op::Fixed(Duration::from_millis(10)))?; // encodes layer 0's tensor
//! m.end_window()?;                                        // ... and frees the original
//! assert!(m.is_compressed(key));
//!
//! m.backward_start(LayerId(1))?;
//! m.backward_start(LayerId(0))?; // recovered here
//! let back = m.take(key)?;
//! let mut bytes = vec![0u8; data.len()];
//! p.read_device_sync(&back, 0, &mut bytes, &compute)?;
//! assert_eq!(bytes, data);
//! # Ok::<(), hprt_compress::CompressError>(())
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use hprt_platform::{DeviceBuffer, Event, Platform, PlatformHandle, Stream, TensorRef};

use crate::cost::CostModel;
use crate::device::{CompressedTensor, DeviceCodec, PendingDecode, PendingEncode};
use crate::error::{CompressError, Result};
use crate::format::CodecDType;
use crate::planner::{LayerId, LayerOrder};
use crate::select::codec_for;

mod eager;
mod windows;

pub use windows::WindowRecord;
use windows::{OpenWindow, Phase};

/// Window records kept (`ActivationManager::window_records`).
pub const RECORDS_KEPT: usize = 1024;

type Predicate = Arc<dyn Fn(&TensorRef) -> bool + Send + Sync>;

/// Which saved tensors are managed: codec dtypes, a minimum size, and custom predicates (all
/// must accept).
#[derive(Clone)]
pub struct TensorFilter {
    pub dtypes: Vec<CodecDType>,
    pub min_numel: usize,
    predicates: Vec<Predicate>,
}

impl Default for TensorFilter {
    /// Every codec dtype, at least 32768 elements (below that the launch costs more than it
    /// saves; MindSpeed uses the same floor).
    fn default() -> Self {
        TensorFilter {
            dtypes: CodecDType::ALL.to_vec(),
            min_numel: 32768,
            predicates: Vec::new(),
        }
    }
}

impl TensorFilter {
    pub fn with_predicate(
        mut self,
        f: impl Fn(&TensorRef) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.predicates.push(Arc::new(f));
        self
    }
    pub fn accepts(&self, t: &TensorRef) -> bool {
        CodecDType::try_from(t.dtype).is_ok_and(|d| self.dtypes.contains(&d))
            && t.numel() >= self.min_numel
            && self.predicates.iter().all(|p| p(t))
    }
}

impl std::fmt::Debug for TensorFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorFilter")
            .field("dtypes", &self.dtypes)
            .field("min_numel", &self.min_numel)
            .field("predicates", &self.predicates.len())
            .finish()
    }
}

/// When the manager encodes and decodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Schedule {
    /// MindSpeed's: the framework wraps operators in windows (`begin_window` / `end_window`);
    /// a forward window encodes the previous layer's tensors and a backward window decodes the
    /// next layer's, as many as the cost model fits in the operator's time.
    #[default]
    Windows,
    /// No windows and no layer phases: each tensor's encode is queued by `save` on the side
    /// stream, after the work the compute stream holds then, and its original is let go once
    /// the encode finished (seen at a later `save` or `take`); each `take` queues the decodes
    /// of up to `decode_ahead` more compressed tensors, the latest saved first (the order
    /// backward reads them). What a saved-tensor hook without layer boundaries wants.
    Eager { decode_ahead: usize },
}

/// Settings of a manager.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    pub filter: TensorFilter,
    pub cost: CostModel,
    /// The device codec; `None` = [`codec_for`] the platform.
    pub codec: Option<Arc<dyn DeviceCodec>>,
    pub schedule: Schedule,
}

impl ManagerConfig {
    pub fn new(cost: CostModel) -> Self {
        ManagerConfig {
            filter: TensorFilter::default(),
            cost,
            codec: None,
            schedule: Schedule::Windows,
        }
    }
}

pub use crate::key::TensorKey;

/// Compression figures of one layer, summed over steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerStats {
    /// Tensors registered.
    pub saved: usize,
    /// Tensors encoded in a window.
    pub compressed: usize,
    /// Original and compressed bytes of the encoded tensors.
    pub original_bytes: usize,
    pub compressed_bytes: usize,
    /// Tensors decoded in a backward window, and synchronously (at the layer's backward start,
    /// or by the `take` that needed it).
    pub decoded_in_window: usize,
    pub recovered_sync: usize,
    /// Tensors whose decode an earlier `take` began ahead of theirs ([`Schedule::Eager`]).
    pub decoded_ahead: usize,
    /// Tensors whose encode failed (at launch or when it finished): kept uncompressed, nothing
    /// lost ([`ActivationManager::take_encode_failures`] says why).
    pub encode_failures: usize,
}

impl LayerStats {
    pub fn ratio(&self) -> f64 {
        self.original_bytes as f64 / self.compressed_bytes.max(1) as f64
    }

    /// Every counter with its name, in declaration order (what the Python `layer_stats()`
    /// dicts hold, beside `ratio`).
    pub fn fields(&self) -> [(&'static str, usize); 8] {
        [
            ("saved", self.saved),
            ("compressed", self.compressed),
            ("original_bytes", self.original_bytes),
            ("compressed_bytes", self.compressed_bytes),
            ("decoded_in_window", self.decoded_in_window),
            ("recovered_sync", self.recovered_sync),
            ("decoded_ahead", self.decoded_ahead),
            ("encode_failures", self.encode_failures),
        ]
    }
}

enum State {
    Normal,
    /// Its encode is queued ([`Schedule::Eager`]); the original is untouched until it finished.
    Encoding,
    Compressed(CompressedTensor),
    /// Its decode into its re-acquired memory is queued ([`Schedule::Eager`]).
    Decoding(CompressedTensor, PendingDecode),
}

impl State {
    /// Held compressed: encoded, and not yet decoded.
    fn compressed(&self) -> bool {
        matches!(self, State::Compressed(_) | State::Decoding(..))
    }
}

struct Entry {
    index: usize,
    tensor: TensorRef,
    /// The buffer's size when registered: what to re-acquire before decoding.
    alloc_len: usize,
    state: State,
    /// Its encode failed: it stays uncompressed, not tried again in a later window.
    encode_failed: bool,
}

impl Entry {
    /// Lets go of the original once it is encoded: hprt's own buffer is released (resized to
    /// 0, kept for its decode); a borrowed one is freed, which hands it back to its owner once
    /// the work queued on it ran.
    fn release(&self, p: &dyn Platform) -> Result<()> {
        if self.tensor.storage.is_borrowed() {
            p.free_device(&self.tensor.storage)?;
        } else {
            p.resize_device(&self.tensor.storage, 0)?;
        }
        Ok(())
    }

    /// Memory to decode into: the released buffer re-acquired, or (for borrowed memory, given
    /// back) a new buffer of hprt's of the same size, which `take` then hands out.
    fn reacquire(&mut self, p: &dyn Platform) -> Result<()> {
        if self.tensor.storage.is_freed() {
            self.tensor.storage = p.alloc_device(self.alloc_len)?;
        } else {
            p.resize_device(&self.tensor.storage, self.alloc_len)?;
        }
        Ok(())
    }
}

/// The manager: one per model replica, driven by the framework's hooks.
pub struct ActivationManager {
    p: PlatformHandle,
    codec: Arc<dyn DeviceCodec>,
    cost: CostModel,
    filter: TensorFilter,
    compute: Stream,
    side: Stream,
    fwd: LayerOrder,
    bwd: LayerOrder,
    phase: Option<Phase>,
    layers: HashMap<LayerId, Vec<Entry>>,
    next_index: usize,
    pool: HashMap<(usize, CodecDType), Vec<DeviceBuffer>>,
    pool_allocations: usize,
    window: Option<OpenWindow>,
    /// Windows whose operator time is not yet read: (window number, start, end).
    pending_events: VecDeque<(usize, Event, Event)>,
    /// The last `RECORDS_KEPT` windows; `records_dropped` older ones were forgotten.
    records: VecDeque<WindowRecord>,
    records_dropped: usize,
    stats: BTreeMap<LayerId, LayerStats>,
    /// Encodes that failed since the last `take_encode_failures`, with why (the last
    /// `RECORDS_KEPT`).
    encode_failures: Vec<(LayerId, CompressError)>,
    schedule: Schedule,
    /// [`Schedule::Eager`]'s queued encodes, in the order they run on the side stream.
    encoding: VecDeque<QueuedEncode>,
}

/// An encode queued on the side stream: the tensor's layer and index, and its scratch buffer.
struct QueuedEncode {
    layer: LayerId,
    index: usize,
    pending: PendingEncode,
    scratch: DeviceBuffer,
}

impl ActivationManager {
    /// A manager whose operators run on `compute`; it creates its own side stream.
    pub fn new(
        p: impl Into<PlatformHandle>,
        compute: Stream,
        config: ManagerConfig,
    ) -> Result<Self> {
        let p = p.into();
        let side = p.create_stream()?;
        let codec = config.codec.unwrap_or_else(|| codec_for(p.as_ref()));
        Ok(ActivationManager {
            p,
            codec,
            cost: config.cost,
            filter: config.filter,
            compute,
            side,
            fwd: LayerOrder::default(),
            bwd: LayerOrder::default(),
            phase: None,
            layers: HashMap::new(),
            next_index: 0,
            pool: HashMap::new(),
            pool_allocations: 0,
            window: None,
            pending_events: VecDeque::new(),
            records: VecDeque::new(),
            records_dropped: 0,
            stats: BTreeMap::new(),
            encode_failures: Vec::new(),
            schedule: config.schedule,
            encoding: VecDeque::new(),
        })
    }

    /// Whether an operator window is open (between `begin_window` and `end_window`).
    pub fn window_open(&self) -> bool {
        self.window.is_some()
    }

    /// Registers a tensor saved by `layer`; `None` when the filter leaves it to the caller.
    ///
    /// The manager releases the tensor's whole buffer once the tensor is encoded and re-acquires
    /// it to decode into at byte 0 (bytes past the tensor are unspecified afterwards), so a
    /// tensor not at byte 0 of its buffer is refused. Borrowed memory (a framework's) is freed
    /// instead, which hands it back to its owner, and decoded into a new buffer of hprt's.
    pub fn save(&mut self, layer: LayerId, tensor: TensorRef) -> Result<Option<TensorKey>> {
        if tensor.offset != 0 {
            return Err(CompressError::InvalidArgument(format!(
                "a tensor at byte {} of its buffer: the manager releases and re-acquires whole \
                 buffers, so a saved tensor must start at byte 0",
                tensor.offset
            )));
        }
        if tensor.storage.len() < tensor.len {
            return Err(CompressError::InvalidArgument(format!(
                "a {}-byte buffer cannot hold {} {} elements",
                tensor.storage.len(),
                tensor.numel(),
                tensor.dtype
            )));
        }
        if !self.filter.accepts(&tensor) {
            return Ok(None);
        }
        let index = self.next_index;
        self.next_index += 1;
        let alloc_len = tensor.storage.len();
        self.layers.entry(layer).or_default().push(Entry {
            index,
            tensor,
            alloc_len,
            state: State::Normal,
            encode_failed: false,
        });
        self.stats.entry(layer).or_default().saved += 1;
        if let Schedule::Eager { .. } = self.schedule {
            self.encode_on_save(layer, index)?;
        }
        Ok(Some(TensorKey { layer, index }))
    }

    fn entry_mut(&mut self, layer: LayerId, index: usize) -> Result<&mut Entry> {
        self.layers
            .get_mut(&layer)
            .and_then(|v| v.iter_mut().find(|e| e.index == index))
            .ok_or_else(|| {
                CompressError::InvalidState(format!(
                    "no tensor {index} registered in layer {}",
                    layer.0
                ))
            })
    }

    /// Hands a tensor back for backward (MindSpeed's `pop`), decoding it first if needed; the
    /// manager forgets it. Under [`Schedule::Eager`] it also begins the decodes ahead (and a
    /// tensor whose encode has not finished comes back as it is, its encoding dropped). Allowed in a window: a framework that cannot wrap each backward
    /// operator keeps one window open over a layer's whole backward (decoding the next layer)
    /// and takes the layer's tensors inside it. A take of a tensor of the layer the window is
    /// decoding (autograd went back to that layer early) ends the window first; one the window
    /// is encoding is refused.
    pub fn take(&mut self, key: TensorKey) -> Result<DeviceBuffer> {
        if let Schedule::Eager { decode_ahead } = self.schedule {
            return self.take_eager(key, decode_ahead);
        }
        self.take_windowed(key)
    }

    /// Removes a registered tensor's entry and hands its memory over (the end of `take`).
    fn forget(&mut self, key: TensorKey) -> Result<DeviceBuffer> {
        let v = self.layers.get_mut(&key.layer).ok_or_else(|| {
            CompressError::InvalidState(format!("no tensors registered in layer {}", key.layer.0))
        })?;
        let pos = v.iter().position(|e| e.index == key.index).ok_or_else(|| {
            CompressError::InvalidState(format!("tensor {key:?} is not registered"))
        })?;
        Ok(v.remove(pos).tensor.storage)
    }

    /// Forgets a registered tensor its framework will never read (the graph that saved it was
    /// dropped: a forward without backward, a partial backward): its buffer and any compressed
    /// copy go. Unknown keys are ignored (already taken or discarded).
    pub fn discard(&mut self, key: TensorKey) -> Result<()> {
        self.no_window("discard")?;
        // Nothing queued may still read or write its memory once it is gone.
        self.settle(key)?;
        if let Some(v) = self.layers.get_mut(&key.layer) {
            v.retain(|e| e.index != key.index);
        }
        Ok(())
    }

    /// Whether the tensor is currently held compressed.
    pub fn is_compressed(&self, key: TensorKey) -> bool {
        self.layers
            .get(&key.layer)
            .and_then(|v| v.iter().find(|e| e.index == key.index))
            .is_some_and(|e| e.state.compressed())
    }

    /// Queues the encode of a registered tensor on the side stream, into a scratch buffer.
    fn launch_encode(&mut self, layer: LayerId, index: usize) -> Result<QueuedEncode> {
        let t = self.entry_mut(layer, index)?.tensor.clone();
        let dtype = CodecDType::try_from(t.dtype)?;
        let scratch = self.scratch(t.numel(), dtype)?;
        let pending = self.codec.encode_async(
            self.p.as_ref(),
            t.place(),
            dtype,
            t.numel(),
            &scratch,
            &self.side,
        )?;
        Ok(QueuedEncode {
            layer,
            index,
            pending,
            scratch,
        })
    }

    /// A scratch buffer for encodings of (numel, dtype), reused across windows and steps.
    fn scratch(&mut self, numel: usize, dtype: CodecDType) -> Result<DeviceBuffer> {
        if let Some(b) = self.pool.get_mut(&(numel, dtype)).and_then(|v| v.pop()) {
            return Ok(b);
        }
        self.pool_allocations += 1;
        Ok(self
            .p
            .alloc_device(self.codec.max_encoded_len(dtype, numel))?)
    }

    /// Waits for a queued encode; once it is complete the original is let go and the entry
    /// holds the encoding. Returns the original's bytes, or `None` when the encode failed (the
    /// tensor stays as it was) or its tensor was discarded meanwhile.
    fn finish_encode(&mut self, q: QueuedEncode) -> Result<Option<usize>> {
        let QueuedEncode {
            layer,
            index,
            pending,
            scratch,
        } = q;
        let (dtype, numel) = (pending.dtype(), pending.numel());
        let finished = pending.finish(self.p.as_ref(), &self.side);
        // The scratch is reusable either way: `finish` queued its copy out.
        self.pool.entry((numel, dtype)).or_default().push(scratch);
        let ct = match finished {
            Ok(ct) => ct,
            Err(err) => {
                self.encode_failed(layer, index, err)?;
                return Ok(None);
            }
        };
        let (orig, packed) = (ct.original_len(), ct.byte_len());
        let p = self.p.clone();
        let e = self.entry_mut(layer, index)?;
        e.release(p.as_ref())?;
        e.state = State::Compressed(ct);
        let s = self.stats.entry(layer).or_default();
        s.compressed += 1;
        s.original_bytes += orig;
        s.compressed_bytes += packed;
        Ok(Some(orig))
    }

    /// An encode of `layer` that failed: its tensor stays uncompressed (its memory untouched),
    /// counted and kept for [`Self::take_encode_failures`]; the window's other tensors go on.
    fn encode_failed(&mut self, layer: LayerId, index: usize, err: CompressError) -> Result<()> {
        tracing::warn!(
            "an encode of layer {} failed; the tensor stays uncompressed: {err}",
            layer.0
        );
        self.entry_mut(layer, index)?.encode_failed = true;
        self.stats.entry(layer).or_default().encode_failures += 1;
        if self.encode_failures.len() == RECORDS_KEPT {
            // Nobody takes them (a loop failing every step): keep the recent ones, as records.
            self.encode_failures.remove(0);
        }
        self.encode_failures.push((layer, err));
        Ok(())
    }

    /// The encodes that failed since the last call (the last [`RECORDS_KEPT`]), with why (each
    /// tensor was kept uncompressed): what a front end reports to its user.
    pub fn take_encode_failures(&mut self) -> Vec<(LayerId, CompressError)> {
        std::mem::take(&mut self.encode_failures)
    }

    /// Per-layer statistics (layers in id order).
    pub fn layer_stats(&self) -> Vec<(LayerId, LayerStats)> {
        self.stats.iter().map(|(l, s)| (*l, *s)).collect()
    }

    /// Scratch buffers ever allocated (the rest of the windows reused them).
    pub fn scratch_allocations(&self) -> usize {
        self.pool_allocations
    }

    /// The learned forward and backward layer orders.
    pub fn layer_orders(&self) -> (&[LayerId], &[LayerId]) {
        (self.fwd.order(), self.bwd.order())
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }
}

impl Drop for ActivationManager {
    fn drop(&mut self) {
        // Queued side-stream work references buffers this manager owns.
        let _ = self.p.synchronize_stream(&self.side);
        let _ = self.p.destroy_stream(&self.side);
    }
}
