//! Process-wide state shared by every module: configuration from the environment, the ACL
//! lifecycle (initialised or not, and an epoch that invalidates per-thread devices across
//! `aclFinalize`), the calling thread's current device, handle encoding, and the entry guards that
//! every exported function runs its body through.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use hprt_emulator_common::env::EnvReader;
use hprt_emulator_common::guarded;

use crate::codes::*;
use crate::faults;

pub(crate) use hprt_emulator_common::lock;

// ---- configuration ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
pub(crate) struct Config {
    /// `HP_EMU_DEVICES` (default 1).
    pub devices: u32,
    /// `HP_EMU_DEVICE_MEMORY`, bytes per device (default 8 GiB).
    pub device_memory: u64,
    /// `HP_EMU_DELAY_SEED`: stream workers sleep 0–2 ms before each job when set.
    pub delay_seed: Option<u64>,
    /// `HP_EMU_HCCL_TIMEOUT_MS` (default 120 000); `hprtEmuSetHcclTimeoutMs` overrides it.
    pub hccl_timeout_ms: u64,
    /// `HP_EMU_PREINIT=1`: ACL counts as initialised by someone else before our first call.
    pub preinit: bool,
    /// Some `HP_EMU_*` variable could not be parsed; `aclInit` fails instead of guessing.
    pub malformed: bool,
}

impl Config {
    fn from_env() -> Config {
        let mut env = EnvReader::default();
        let devices = env.num("HP_EMU_DEVICES", 1);
        let device_memory = env.num("HP_EMU_DEVICE_MEMORY", 8 << 30);
        let hccl_timeout_ms = env.num("HP_EMU_HCCL_TIMEOUT_MS", 120_000);
        let delay_seed = env.delay_seed();
        let mut malformed = env.malformed;
        let preinit = match std::env::var("HP_EMU_PREINIT").as_deref() {
            Ok("1") => true,
            Ok("0") | Ok("") | Err(std::env::VarError::NotPresent) => false,
            _ => {
                malformed = true;
                false
            }
        };
        let devices = u32::try_from(devices).unwrap_or_else(|_| {
            malformed = true;
            1
        });
        Config {
            devices,
            device_memory,
            delay_seed,
            hccl_timeout_ms,
            preinit,
            malformed,
        }
    }
}

fn config_cell() -> &'static Mutex<Config> {
    static CONFIG: OnceLock<Mutex<Config>> = OnceLock::new();
    CONFIG.get_or_init(|| Mutex::new(Config::from_env()))
}

pub(crate) fn config() -> Config {
    *lock(config_cell())
}

pub(crate) fn set_hccl_timeout_ms(ms: u64) {
    lock(config_cell()).hccl_timeout_ms = ms;
}

pub(crate) fn hccl_timeout() -> Duration {
    Duration::from_millis(config().hccl_timeout_ms)
}

// ---- ACL lifecycle ----------------------------------------------------------------------------

pub(crate) struct Life {
    pub initialized: bool,
    /// Bumped by every successful `aclInit`: a thread's current device belongs to one epoch, so
    /// after `aclFinalize` + `aclInit` every thread must call `aclrtSetDevice` again, as on real
    /// hardware where finalisation destroys the contexts.
    pub epoch: u64,
    pub init_calls: u64,
    pub finalize_calls: u64,
}

pub(crate) fn life() -> MutexGuard<'static, Life> {
    static LIFE: OnceLock<Mutex<Life>> = OnceLock::new();
    lock(LIFE.get_or_init(|| {
        let preinit = config().preinit;
        Mutex::new(Life {
            initialized: preinit,
            epoch: u64::from(preinit),
            init_calls: 0,
            finalize_calls: 0,
        })
    }))
}

// ---- current device ---------------------------------------------------------------------------

thread_local! {
    /// (epoch, device); epoch 0 never matches, so a fresh thread has no device.
    static CURRENT: Cell<(u64, i32)> = const { Cell::new((0, 0)) };
}

pub(crate) fn current_device() -> Option<i32> {
    let (epoch, dev) = CURRENT.with(Cell::get);
    let life = life();
    (life.initialized && epoch == life.epoch).then_some(dev)
}

/// The emulator's stand-in for "this thread has no context": stream, event and memory calls
/// from such a thread fail with `ACL_ERROR_INVALID_PARAM`.
pub(crate) fn require_device() -> Result<i32, AclError> {
    current_device().ok_or(ACL_ERROR_INVALID_PARAM)
}

pub(crate) fn set_current_device(dev: i32) {
    let epoch = life().epoch;
    CURRENT.with(|c| c.set((epoch, dev)));
}

// ---- handles ----------------------------------------------------------------------------------

pub(crate) use hprt_emulator_common::handle::{decode as handle_id, encode as handle, next_id};

pub(crate) const STREAM_TAG: usize = 0x5000_0000_0000;
pub(crate) const EVENT_TAG: usize = 0x6000_0000_0000;
pub(crate) const COMM_TAG: usize = 0x7000_0000_0000;

// ---- entry guards -----------------------------------------------------------------------------

pub(crate) fn status(r: Result<(), AclError>) -> AclError {
    r.err().unwrap_or(ACL_SUCCESS)
}

/// Runs an exported ACL function: counts the call for fault injection, refuses work before
/// `aclInit`, and turns a panic into `ACL_ERROR_RT_INTERNAL_ERROR` instead of unwinding into C.
pub(crate) fn acl_entry(
    name: &'static str,
    body: impl FnOnce() -> Result<(), AclError>,
) -> AclError {
    acl_guard(|| {
        if let Some(code) = faults::hit(name) {
            return code;
        }
        if !life().initialized {
            return ACL_ERROR_UNINITIALIZE;
        }
        status(body())
    })
}

/// Panic barrier only; for the lifecycle functions, which do their own checks.
pub(crate) fn acl_guard(body: impl FnOnce() -> AclError) -> AclError {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(ACL_ERROR_RT_INTERNAL_ERROR)
}

/// Runs an exported HCCL function: fault injection and the panic barrier (`HCCL_E_INTERNAL`).
/// HCCL does not check `aclInit` itself; what it needs from ACL (streams, device memory) is
/// validated through those handles.
pub(crate) fn hccl_entry(
    name: &'static str,
    body: impl FnOnce() -> Result<(), HcclResult>,
) -> HcclResult {
    guarded(HCCL_SUCCESS, HCCL_E_INTERNAL, || match faults::hit(name) {
        Some(code) => Err(code as HcclResult),
        None => body(),
    })
}

/// [`hccl_entry`] for calls that, in CANN, start by asking the runtime for the calling thread's
/// device: without `aclrtSetDevice` on this thread they fail before any other check (even a count
/// of 0). CANN passes the runtime's failure on; the emulator answers `HCCL_E_RUNTIME`.
pub(crate) fn hccl_device_entry(
    name: &'static str,
    body: impl FnOnce() -> Result<(), HcclResult>,
) -> HcclResult {
    hccl_entry(name, || {
        current_device().ok_or(HCCL_E_RUNTIME)?;
        body()
    })
}

/// Writes through a caller's out-pointer, refusing null.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, v: T) -> Result<(), AclError> {
    if out.is_null() {
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    // SAFETY: non-null, and the caller's contract (the C header) makes it writable.
    unsafe { out.write(v) };
    Ok(())
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Back to "never initialised" (or "initialised by someone else" with `preinit`), as at
    /// process start; the call counters restart too.
    pub(crate) fn reset_life(preinit: bool) {
        let mut l = life();
        l.initialized = preinit;
        l.epoch += 1;
        l.init_calls = 0;
        l.finalize_calls = 0;
    }

    pub(crate) fn with_config(f: impl FnOnce(&mut Config)) {
        f(&mut lock(config_cell()));
    }
}
