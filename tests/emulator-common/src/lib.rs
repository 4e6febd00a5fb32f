//! What the emulators of `tests/` (`ascend-emulator`, `cuda-emulator`) share, so a stream, a
//! fault spec or a reduction behaves the same whichever vendor API it is reached through.
//!
//! - [`worker`] — a stream as a worker thread draining a FIFO, with `HP_EMU_DELAY_SEED` delays;
//!   [`mark`] — event records on it.
//! - [`faults`] — `HP_EMU_FAULTS` fault tables over a list of entry points.
//! - [`reduce`] — element types and reductions of collectives.
//! - [`block`] — host memory standing in for device memory; [`env`](mod@env) — reading `HP_EMU_*`.
//! - [`library`] — for the tests of every crate: the emulator libraries' paths, built with
//!   `cargo build -p <emulator>` on first use.

#![warn(unsafe_op_in_unsafe_fn)]

pub mod block;
pub mod env;
pub mod faults;
pub mod library;
pub mod mark;
pub mod reduce;
pub mod worker;

use std::sync::{Mutex, MutexGuard};

/// Locks without propagating poison: a panic caught at the FFI boundary must not turn every later
/// call into a second panic.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The panic barrier of an exported function: `body`'s error code, `ok` when it succeeds and
/// `panicked` when it panics, since unwinding into C is undefined behaviour.
pub fn guarded<C>(ok: C, panicked: C, body: impl FnOnce() -> Result<(), C>) -> C {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body().err().unwrap_or(ok)))
        .unwrap_or(panicked)
}

/// Handles are tagged integers, never reused, so a destroyed or foreign handle is always
/// recognised (a freed heap address could come back for a new object). Each kind of object has
/// its own tag; ids come from [`handle::next_id`].
pub mod handle {
    use std::sync::atomic::{AtomicU64, Ordering};

    const TAG_SPAN: usize = 0x1000_0000_0000;

    /// A process-wide id, never 0 and never repeated.
    pub fn next_id() -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    pub fn encode(tag: usize, id: u64) -> usize {
        tag + (id as usize) * 16
    }

    /// The id a handle of kind `tag` carries, or `None` for anything else.
    pub fn decode(tag: usize, h: usize) -> Option<u64> {
        let off = h.checked_sub(tag)?;
        (off > 0 && off < TAG_SPAN && off % 16 == 0).then_some((off / 16) as u64)
    }
}
