//! Helpers shared by the cases: typed-error expectations, byte patterns, staging through pinned
//! memory, and byte-exact comparisons with useful messages.

use std::any::Any;

use anyhow::{bail, Context, Result};
use hprt_platform::{DeviceBuffer, Error, ErrorKind, PinnedBuffer, Platform, Stream};

/// Text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// Checks that `r` failed with `kind`; returns the error for further checks.
pub(crate) fn expect_kind<T>(
    r: hprt_platform::Result<T>,
    kind: ErrorKind,
    what: &str,
) -> Result<Error> {
    match r {
        Ok(_) => bail!("{what}: expected {kind:?}, but it succeeded"),
        Err(e) if e.kind() == kind => Ok(e),
        Err(e) => bail!("{what}: expected {kind:?}, got {:?}: {e}", e.kind()),
    }
}

/// Checks that `r` failed (with any kind).
pub(crate) fn expect_err<T>(r: hprt_platform::Result<T>, what: &str) -> Result<Error> {
    match r {
        Ok(_) => bail!("{what}: expected an error, but it succeeded"),
        Err(e) => Ok(e),
    }
}

/// splitmix64: the suite's one source of deterministic pseudo-random numbers.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes several values into one.
pub(crate) fn hash(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5EED_u64, |acc, &p| {
        mix(acc ^ p.wrapping_mul(0xA24B_AED4_963E_E407))
    })
}

/// `len` pseudo-random bytes determined by `seed`, never a run of one value.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut state = mix(seed ^ 0xC0FF_EE00);
    while out.len() < len {
        state = mix(state);
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A pinned buffer holding `data`.
pub(crate) fn pinned_with(p: &dyn Platform, data: &[u8]) -> Result<PinnedBuffer> {
    let b = p
        .alloc_pinned(data.len())
        .with_context(|| format!("alloc_pinned({})", data.len()))?;
    b.write(0, data).context("pinned write")?;
    Ok(b)
}

/// A device buffer holding `data` (uploaded and synchronized on `stream`).
pub(crate) fn upload(p: &dyn Platform, data: &[u8], stream: &Stream) -> Result<DeviceBuffer> {
    let b = p
        .alloc_device(data.len())
        .with_context(|| format!("alloc_device({})", data.len()))?;
    if !data.is_empty() {
        p.write_device_sync(&b, 0, data, stream)
            .context("write_device_sync")?;
    }
    Ok(b)
}

/// `len` bytes of `buf` from `offset`, after the work queued on `stream` before it.
pub(crate) fn download(
    p: &dyn Platform,
    buf: &DeviceBuffer,
    offset: usize,
    len: usize,
    stream: &Stream,
) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    if len > 0 {
        p.read_device_sync(buf, offset, &mut out, stream)
            .with_context(|| format!("read_device_sync({offset}, {len})"))?;
    }
    Ok(out)
}

/// Byte-exact comparison naming the first differing index and how many differ.
pub(crate) fn check_bytes(what: &str, expected: &[u8], actual: &[u8]) -> Result<()> {
    if expected.len() != actual.len() {
        bail!(
            "{what}: expected {} bytes, got {}",
            expected.len(),
            actual.len()
        );
    }
    let mut diffs = expected
        .iter()
        .zip(actual)
        .enumerate()
        .filter(|(_, (e, a))| e != a);
    if let Some((i, (e, a))) = diffs.next() {
        let more = diffs.count();
        bail!(
            "{what}: byte {i} is {a:#04x}, expected {e:#04x} ({} of {} bytes differ)",
            more + 1,
            expected.len()
        );
    }
    Ok(())
}

/// [`check_bytes`] against what `actual` holds now: most cases end by reading a download's
/// pinned destination on the host.
pub(crate) fn check_pinned(what: &str, expected: &[u8], actual: &PinnedBuffer) -> Result<()> {
    check_bytes(what, expected, &actual.to_vec()?)
}

/// The pieces of a host -> device -> host round trip of `len` bytes: `data` (pattern `seed`),
/// pinned `src` holding it, the device buffer `dev` and the pinned `out` to download into.
pub(crate) struct RoundTrip {
    pub(crate) data: Vec<u8>,
    pub(crate) src: PinnedBuffer,
    pub(crate) dev: DeviceBuffer,
    pub(crate) out: PinnedBuffer,
}

impl RoundTrip {
    pub(crate) fn new(p: &dyn Platform, seed: u64, len: usize) -> Result<Self> {
        let data = pattern(seed, len);
        let src = pinned_with(p, &data)?;
        let dev = p.alloc_device(len)?;
        let out = p.alloc_pinned(len)?;
        Ok(RoundTrip {
            data,
            src,
            dev,
            out,
        })
    }

    /// Queues the upload on `up` and the download on `down` (the same stream or not: the case
    /// decides what orders them).
    pub(crate) fn queue(&self, p: &dyn Platform, up: &Stream, down: &Stream) -> Result<()> {
        let n = self.data.len();
        p.copy_async((&self.dev).into(), 0, (&self.src).into(), 0, n, up)?;
        p.copy_async((&self.out).into(), 0, (&self.dev).into(), 0, n, down)?;
        Ok(())
    }

    /// Checks that the download brought `data` back; the caller has waited for it.
    pub(crate) fn check(&self, what: &str) -> Result<()> {
        check_pinned(what, &self.data, &self.out)
    }
}

/// Joins `handles`, one message per thread that failed or panicked, each naming it as
/// `{who} {index}`; empty when all succeeded.
pub(crate) fn join_failures(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<()>>>,
    who: &str,
) -> Vec<String> {
    handles
        .into_iter()
        .enumerate()
        .filter_map(|(i, h)| match h.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{who} {i}: {e:#}")),
            Err(panic) => Some(format!("{who} {i} panicked: {}", panic_message(&*panic))),
        })
        .collect()
}

/// Checks that every byte of `actual` is `value`.
pub(crate) fn check_fill(what: &str, actual: &[u8], value: u8) -> Result<()> {
    if let Some(i) = actual.iter().position(|&b| b != value) {
        bail!(
            "{what}: byte {i} is {:#04x}, expected {value:#04x}",
            actual[i]
        );
    }
    Ok(())
}

/// Lays out regions in one buffer with guard gaps between them (aligned offsets, never 0).
#[derive(Default)]
pub(crate) struct Arena {
    len: usize,
}

impl Arena {
    pub(crate) const ALIGN: usize = 64;

    /// Offset of a new region of `bytes`, preceded by at least one guard block.
    pub(crate) fn take(&mut self, bytes: usize) -> usize {
        let off = (self.len + Self::ALIGN).next_multiple_of(Self::ALIGN);
        self.len = off + bytes;
        off
    }

    /// Total size including a trailing guard.
    pub(crate) fn total(&self) -> usize {
        self.len + Self::ALIGN
    }
}

/// A case (or one world of it) that cannot run on this platform, with the reason; reported as
/// "skip", never as a pass.
#[derive(Debug)]
pub(crate) struct Skipped(pub String);

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipped: {}", self.0)
    }
}

impl std::error::Error for Skipped {}
