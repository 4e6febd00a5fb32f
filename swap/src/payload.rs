//! What the engine moves: a payload knows its source bytes ([`DeviceTensor`]: storage, offset,
//! length), how its device memory is released and re-acquired ([`crate::Origin`]), its version,
//! and in which form its bytes travel ([`Compression`]); the [`SwapTensor`] that tracks one saved
//! value through device → d2h → host → h2d → device, and where its host copy is.
//!
//! Kinds:
//! - *owned* ([`crate::Origin::Owned`]): hprt device storage, released by resizing it to zero and
//!   re-acquired by resizing it back;
//! - *borrowed* ([`crate::Origin::Borrowed`]): a framework's memory, released by dropping every
//!   reference the engine holds (the borrowed buffer's release callback then hands the memory
//!   back to the framework) and re-acquired through the framework's [`crate::Allocator`] (for torch:
//!   `torch.empty_strided` with the saved shape and strides), so a reload lands in a new
//!   framework tensor;
//! - *compressed* (any origin with [`Compression::Device`] or [`Compression::HostStage`]): only
//!   the codec's bytes are kept on the host.
//!
//! A borrowed payload's version is read only while the engine references the memory: at the
//! offload and when the copy completed, just before release. A write in between (racing the
//! copy) is reported by the reload. Once released, the memory is the framework's again and what
//! it does with other references to it is the framework's business (torch checks its own
//! saved-tensor versions).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use hprt_compress::CodecDType;
use hprt_compress::PendingDecode;
use hprt_platform::DType;

use crate::error::{Result, SwapError, SwapState};
use crate::pool::{Fence, PinnedBlock};
use crate::tensor::{DeviceTensor, Saved};
use hprt_platform::sync::lock;

/// In which form a tensor's bytes go to the host (compress-then-swap).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Compression {
    /// The raw bytes.
    #[default]
    Off,
    /// Encoded on the device by the platform's device codec (`hprt_compress::codec_for`); only the
    /// encoding crosses the link and occupies pinned memory. The offload waits on the host for
    /// the encode (its length sizes the copy) and the reload checks the decode on the host.
    Device,
    /// The raw bytes cross the link into a pinned staging block; the codec runs on the host in
    /// stream order (encode after the device-to-host copy, decode before the host-to-device
    /// copy) and the host copy is kept compressed in ordinary memory, so pinned memory is only
    /// held while a copy is in flight.
    HostStage,
    /// `Device` where the platform has a device codec, `HostStage` where the codec is the host
    /// fallback (running the host codec as a "device" codec would move more bytes, not fewer).
    Auto,
}

// The names the bindings take (`set_compression("host_stage")`).
hprt_platform::named_enum!(Compression, "compression", {
    Off => "off",
    Device => "device",
    HostStage => "host_stage",
    Auto => "auto",
});

/// Chooses the compression per tensor (e.g. by size or dtype); the front end's setting applies
/// where there is no policy.
pub type CompressionPolicy = Arc<dyn Fn(&DeviceTensor) -> Compression + Send + Sync>;

/// The codec's element type of a swap dtype (only floating-point tensors are compressed).
pub(crate) fn codec_dtype(dtype: DType) -> Option<CodecDType> {
    CodecDType::of(dtype)
}

/// The encoding a host-stage function produced (or its error), filled in stream order.
pub(crate) type Slot<T> = Arc<Mutex<Option<Result<T>>>>;

pub(crate) fn take<T>(slot: &Slot<T>) -> Option<Result<T>> {
    lock(slot).take()
}

/// Where a tensor's offloaded bytes are.
pub(crate) enum HostCopy {
    /// Raw bytes in a pinned block.
    Plain(PinnedBlock),
    /// `len` bytes of the device codec's encoding in a pinned block.
    Device { block: PinnedBlock, len: usize },
    /// Host stage: the raw bytes in a pinned staging block until the host encoded them (in
    /// stream order, into `slot`), then only the encoding, in ordinary memory.
    Staged {
        staging: Option<PinnedBlock>,
        slot: Slot<Vec<u8>>,
        encoded: Option<Arc<Vec<u8>>>,
        raw_len: usize,
    },
}

impl HostCopy {
    pub(crate) fn link_bytes(&self) -> usize {
        match self {
            HostCopy::Plain(b) => b.len(),
            HostCopy::Device { len, .. } => *len,
            HostCopy::Staged { raw_len, .. } => *raw_len,
        }
    }

    /// Bytes the host copy keeps (the encoding's once a compressed copy is complete).
    pub(crate) fn host_bytes(&self) -> usize {
        match self {
            HostCopy::Plain(b) => b.len(),
            HostCopy::Device { len, .. } => *len,
            HostCopy::Staged {
                encoded, raw_len, ..
            } => encoded.as_ref().map_or(*raw_len, |e| e.len()),
        }
    }

    /// The pinned block a queued copy uses.
    pub(crate) fn block_mut(&mut self) -> Option<&mut PinnedBlock> {
        match self {
            HostCopy::Plain(b) | HostCopy::Device { block: b, .. } => Some(b),
            HostCopy::Staged { staging, .. } => staging.as_mut(),
        }
    }
}

/// What a reload must check on the host before its tensor is used.
#[derive(Default)]
pub(crate) enum ReloadCheck {
    #[default]
    None,
    /// The device codec's decode.
    Decode(PendingDecode),
    /// The host stage's decode, run in stream order before the copy.
    Staged(Slot<()>, PinnedBlock),
}

/// The pinned block size for `bytes` of encoded data: rounded up to 1/16 of the next power of
/// two, so that encodings of similar size reuse each other's blocks.
pub(crate) fn size_class(bytes: usize) -> usize {
    if bytes <= 4096 {
        return 4096;
    }
    let step = bytes.next_power_of_two() / 16;
    bytes.div_ceil(step) * step
}

/// Bytes a tensor counts against one of the engine's in-flight windows, uncounted when it goes
/// (handed over, or dropped with its tensor whatever the state).
pub(crate) struct Charge {
    bytes: usize,
    counter: Arc<std::sync::atomic::AtomicUsize>,
}

impl Charge {
    pub(crate) fn new(counter: &Arc<std::sync::atomic::AtomicUsize>, bytes: usize) -> Self {
        counter.fetch_add(bytes, Ordering::AcqRel);
        Charge {
            bytes,
            counter: Arc::clone(counter),
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One saved value and where its bytes are.
///
/// States: `device → d2h` (offload queued) `→ host` (copy completed, device bytes released)
/// `→ h2d` (storage re-acquired, reload queued) `→ device`; a non-tensor value stays in
/// `non_tensor`. Transitions are made by [`crate::SwapEngine`]; asking for the value in any state
/// but `device`/`non_tensor` is a [`SwapError::WrongState`].
///
/// ```
/// use std::sync::Arc;
/// use hprt_swap::{Saved, SwapState, SwapTensor};
///
/// let t = SwapTensor::new(Saved::Other(Arc::new(3.5f32))).unwrap();
/// assert_eq!(t.state(), SwapState::NonTensor);
/// assert!(t.get().is_ok());
/// ```
pub struct SwapTensor {
    pub(crate) saved: Saved,
    pub(crate) state: SwapState,
    /// The storage's size when saved: what a reload re-acquires.
    pub(crate) storage_len: usize,
    pub(crate) version_at_offload: u64,
    /// The version seen when the device bytes were released, if it had moved since the
    /// offload began (a write raced the copy): the reload reports it.
    pub(crate) modified: Option<u64>,
    /// The storage's address when the engine released it (its key among released storages).
    pub(crate) release_key: usize,
    pub(crate) host: Option<HostCopy>,
    pub(crate) d2h: Option<Fence>,
    pub(crate) h2d: Option<Fence>,
    pub(crate) check: ReloadCheck,
    /// The device memory went back to its framework when the offload was queued
    /// ([`crate::Allocator::hand_over`]): the copy may still be running, so a reload waits for
    /// `d2h` on its stream, and the offload can no longer be taken back.
    pub(crate) handed_back: bool,
    /// The bytes of a reload started and not yet handed to the compute stream.
    pub(crate) reload_charge: Option<Charge>,
}

impl SwapTensor {
    /// Tracks `saved`; a device tensor must fit its storage.
    pub fn new(saved: Saved) -> Result<Self> {
        let (state, storage_len) = match &saved {
            Saved::Tensor(t) => {
                t.check_fits()?;
                (SwapState::Device, t.storage.len())
            }
            Saved::Other(_) => (SwapState::NonTensor, 0),
        };
        Ok(SwapTensor {
            saved,
            state,
            storage_len,
            version_at_offload: 0,
            modified: None,
            release_key: 0,
            host: None,
            d2h: None,
            h2d: None,
            check: ReloadCheck::None,
            handed_back: false,
            reload_charge: None,
        })
    }

    pub fn state(&self) -> SwapState {
        self.state
    }

    /// The saved value; only while it is usable (`device` or `non_tensor`).
    pub fn get(&self) -> Result<&Saved> {
        match self.state {
            SwapState::Device | SwapState::NonTensor => Ok(&self.saved),
            actual => Err(SwapError::WrongState {
                operation: "get",
                expected: "device or non_tensor",
                actual,
            }),
        }
    }

    /// The saved value, consuming the tracker; only while it is usable.
    pub fn into_saved(self) -> Result<Saved> {
        self.get()?;
        Ok(self.saved)
    }

    /// The tensor description whatever the state (for bookkeeping, not for reading bytes).
    pub fn describe(&self) -> Option<&DeviceTensor> {
        self.saved.tensor()
    }

    /// Bytes this tensor moves per direction (0 for a non-tensor value).
    pub fn swap_bytes(&self) -> usize {
        self.saved.tensor().map_or(0, |t| t.len)
    }

    /// Bytes the last offload moved over the host link (compressed bytes for a compressed
    /// payload; 0 before an offload).
    pub fn link_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, HostCopy::link_bytes)
    }

    /// Bytes the host copy keeps: the encoding's for a compressed payload whose offload
    /// finished (0 before an offload).
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, HostCopy::host_bytes)
    }

    pub(crate) fn wrong(&self, operation: &'static str, expected: &'static str) -> SwapError {
        SwapError::WrongState {
            operation,
            expected,
            actual: self.state,
        }
    }
}

impl std::fmt::Debug for SwapTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwapTensor(state: {}, {:?})", self.state, self.saved)
    }
}
