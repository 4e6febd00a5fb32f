//! What the engine moves: a payload knows its source bytes ([`DeviceTensor`]: storage, offset,
//! length), how its device memory is released and re-acquired ([`Origin`]), its version, and in
//! which form its bytes travel ([`Compression`]).
//!
//! Kinds:
//! - *owned* ([`Origin::Owned`]): hprt device storage, released by resizing it to zero and
//!   re-acquired by resizing it back;
//! - *borrowed* ([`Origin::Borrowed`]): a framework's memory, released by dropping every
//!   reference the engine holds (the borrowed buffer's release callback then hands the memory
//!   back to the framework) and re-acquired through the framework's [`Allocator`] (for torch:
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

use std::any::Any;
use std::sync::{Arc, Mutex};

use hprt_compress::CodecDType;
use hprt_compress::PendingDecode;
use hprt_platform::{DType, DeviceBuffer, Stream};

use crate::error::Result;
use crate::pool::PinnedBlock;
use crate::tensor::{DeviceTensor, VersionCounter};
use hprt_platform::sync::lock;

/// A framework's object for some memory (a torch tensor), opaque to swap.
pub type FrameworkHandle = Arc<dyn Any + Send + Sync>;

/// New framework memory for a borrowed tensor whose memory swap released.
pub struct Reacquired {
    /// Borrowed memory (`Platform::wrap_device_memory`) holding at least `offset + len` bytes.
    pub storage: DeviceBuffer,
    /// Byte offset of the tensor in `storage`.
    pub offset: usize,
    /// The framework's object for the new memory, handed back with the reloaded tensor.
    pub handle: Option<FrameworkHandle>,
    /// The new memory's version counter.
    pub version: VersionCounter,
    /// The stream in whose order the allocator handed the memory out, when it is a caching
    /// allocator's (torch's: a block freed by work queued on its stream is handed out again at
    /// once, for use in that stream's order, while that work may still be running). The reload
    /// writes the memory only after the work queued on this stream so far. `None`: nothing
    /// queued uses the memory (a platform allocation; memory of the host's own stream).
    pub ready_on: Option<Stream>,
}

/// The framework's allocator: how a borrowed tensor gets memory back for its reload.
pub trait Allocator: Send + Sync {
    /// Memory for a tensor like `like` (its dtype, shape and byte length; the framework keeps
    /// strides itself). An error (out of memory) leaves the host copy in place for a retry.
    fn allocate(&self, like: &DeviceTensor) -> Result<Reacquired>;

    /// Hands `t`'s memory back to the framework now: the framework orders its reuse after the
    /// work queued so far on `streams` (torch's `Tensor.record_stream`), so the engine may drop
    /// its references at once instead of when it later sees that work finished (on a GPU the
    /// host runs far ahead of the device: holding on until then keeps many layers alive).
    /// `streams` may be empty: every use of the memory is already ordered after hprt's work on
    /// the framework's own stream (a reload the compute stream waits for).
    /// Returns whether the framework took it; `false` (the default: a framework that cannot
    /// order reuse by streams, or an allocator without that knowledge) leaves the memory to
    /// the platform, which releases it once the work on it finished.
    fn hand_over(&self, t: &DeviceTensor, streams: &[&Stream]) -> Result<bool> {
        let _ = (t, streams);
        Ok(false)
    }
}

/// A plain function allocates; it cannot take memory back early.
impl<F> Allocator for F
where
    F: Fn(&DeviceTensor) -> Result<Reacquired> + Send + Sync,
{
    fn allocate(&self, like: &DeviceTensor) -> Result<Reacquired> {
        self(like)
    }
}

/// Who owns a tensor's device memory.
#[derive(Clone, Default)]
pub enum Origin {
    /// hprt storage: release = resize to zero, re-acquire = resize back.
    #[default]
    Owned,
    /// A framework's memory: release = drop the engine's references, re-acquire = the allocator.
    Borrowed(Arc<dyn Allocator>),
}

impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Origin::Owned => "Owned",
            Origin::Borrowed(_) => "Borrowed",
        })
    }
}

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
