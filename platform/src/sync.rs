//! Locking shared by hprt's crates.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poison: every writer in hprt replaces whole fields under its locks, so a
/// panic while one was held (caught at the C or Python boundary, or in a test) leaves the state
/// consistent, and must not turn every later call into a second panic.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
