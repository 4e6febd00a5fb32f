//! Shared by the swap test binaries.
#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;

use hprt_platform::{DeviceBuffer, Platform, Stream};
use hprt_swap::{Reacquired, Saved, SwapError, SwapTensor, VersionCounter};

/// The jitter seeds a race test runs: 0..20, plus the seeds `HP_CPU_JITTER` names
/// (comma-separated), so a failure seen elsewhere can be replayed and the variable widens the
/// search.
pub fn jitter_seeds() -> Vec<u64> {
    let mut seeds: Vec<u64> = (0..20).collect();
    if let Ok(v) = std::env::var("HP_CPU_JITTER") {
        for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let seed = s
                .parse()
                .unwrap_or_else(|_| panic!("HP_CPU_JITTER={v:?}: {s:?} is not a seed"));
            if !seeds.contains(&seed) {
                seeds.push(seed);
            }
        }
    }
    seeds
}

/// The seeds a fault test searches until one shows the removed wait: the race tests' seeds,
/// then 80 more. On a quiet machine an early seed shows it, so the search stops there; a host
/// slowed by other work (CI beside a build) can finish its part after the stream in every one
/// of the first twenty, hiding the race (one CI run lost a reload wait's proof that way).
pub fn fault_seeds() -> Vec<u64> {
    let mut seeds = jitter_seeds();
    seeds.extend(
        (1000..1080)
            .filter(|s| !seeds.contains(s))
            .collect::<Vec<_>>(),
    );
    seeds
}

/// Some jitter seed makes `caught` see the fault that removes a wait: a race test's proof that
/// the wait is needed. `what` names the removed wait.
pub fn assert_some_seed_catches(caught: impl FnMut(u64) -> bool, what: &str) {
    assert!(
        fault_seeds().into_iter().any(caught),
        "{what} went unnoticed"
    );
}

/// `owner`'s memory borrowed (`wrap_device_memory`), as a framework's tensor is: `owner` is
/// dropped, then `on_release` runs, when the borrow is released.
pub fn borrow_then(
    p: &dyn Platform,
    owner: DeviceBuffer,
    on_release: impl FnOnce() + Send + 'static,
) -> DeviceBuffer {
    let (ptr, len) = (owner.device_ptr(), owner.len());
    // SAFETY: `owner` is live device memory of `p`, kept alive by the release callback.
    unsafe {
        p.wrap_device_memory(
            ptr,
            len,
            Some(Box::new(move || {
                drop(owner);
                on_release();
            })),
        )
        .unwrap()
    }
}

/// What an allocator hands back for `storage` with nothing else to say: no offset, handle or
/// stream, a fresh version.
pub fn reacquired(storage: DeviceBuffer) -> Reacquired {
    Reacquired {
        storage,
        offset: 0,
        handle: None,
        version: VersionCounter::new(),
        ready_on: None,
    }
}

/// The bytes of a saved tensor, read after `s`'s queued work.
pub fn bytes_of(p: &Arc<dyn Platform>, s: &Stream, v: &Saved) -> Vec<u8> {
    let t = v.tensor().unwrap();
    let mut out = vec![0; t.len];
    p.read_device_sync(&t.storage, t.offset, &mut out, s)
        .unwrap();
    out
}

/// The bytes of a swap tensor's current tensor (see [`bytes_of`]).
pub fn read(p: &Arc<dyn Platform>, s: &Stream, t: &SwapTensor) -> Vec<u8> {
    bytes_of(p, s, t.get().unwrap())
}

/// `e` is the refusal of a reload whose tensor was written once after its offload began;
/// `context` leads the failure message.
pub fn assert_modified_once_since_offload(e: &SwapError, context: &str) {
    assert!(
        matches!(
            e,
            SwapError::ModifiedSinceOffload {
                saved: 0,
                current: 1
            }
        ),
        "{context}{e}"
    );
}
