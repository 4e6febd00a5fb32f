//! Process-wide state: configuration from the environment, whether `cuInit` ran, the entry
//! guards every exported function runs its body through (fault injection, init check, the
//! no-driver-calls-in-host-functions rule, panic barrier), and the leak/contract counters.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use hprt_emulator_common::env::EnvReader;
use hprt_emulator_common::faults::FaultTable;
use hprt_emulator_common::guarded;

use crate::codes::*;

pub(crate) use hprt_emulator_common::handle::{decode, encode, next_id};
pub(crate) use hprt_emulator_common::lock;

pub(crate) const CTX_TAG: usize = 0x8000_0000_0000;
pub(crate) const STREAM_TAG: usize = 0x5000_0000_0000;
pub(crate) const EVENT_TAG: usize = 0x6000_0000_0000;
pub(crate) const COMM_TAG: usize = 0x7000_0000_0000;
pub(crate) const MODULE_TAG: usize = 0x9000_0000_0000;
pub(crate) const FUNCTION_TAG: usize = 0xA000_0000_0000;
pub(crate) const PROGRAM_TAG: usize = 0xB000_0000_0000;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Config {
    /// `HP_EMU_DEVICES` (default 1).
    pub devices: i32,
    /// `HP_EMU_DEVICE_MEMORY`, bytes per device (default 8 GiB).
    pub device_memory: u64,
    /// `HP_EMU_DELAY_SEED`: stream workers sleep 0–2 ms before each job when set.
    pub delay_seed: Option<u64>,
    /// `HP_EMU_NCCL_TIMEOUT_MS` (default 120 000): how long `ncclCommInitRank` waits for every
    /// rank to join (collectives wait for their peers without end, as on NCCL).
    pub nccl_timeout_ms: u64,
    /// Some `HP_EMU_*` variable could not be parsed; `cuInit` fails instead of guessing.
    pub malformed: bool,
}

pub(crate) fn config() -> Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    *CONFIG.get_or_init(|| {
        let mut env = EnvReader::default();
        let devices = env.num("HP_EMU_DEVICES", 1);
        let device_memory = env.num("HP_EMU_DEVICE_MEMORY", 8 << 30);
        let nccl_timeout_ms = env.num("HP_EMU_NCCL_TIMEOUT_MS", 120_000);
        let delay_seed = env.delay_seed();
        let mut malformed = env.malformed;
        let devices = i32::try_from(devices).unwrap_or_else(|_| {
            malformed = true;
            1
        });
        Config {
            devices,
            device_memory,
            delay_seed,
            nccl_timeout_ms,
            malformed,
        }
    })
}

static NCCL_TIMEOUT_OVERRIDE: AtomicU64 = AtomicU64::new(0);

pub(crate) fn set_nccl_timeout_ms(ms: u64) {
    NCCL_TIMEOUT_OVERRIDE.store(ms, Ordering::Relaxed);
}

pub(crate) fn nccl_timeout() -> Duration {
    match NCCL_TIMEOUT_OVERRIDE.load(Ordering::Relaxed) {
        0 => Duration::from_millis(config().nccl_timeout_ms),
        ms => Duration::from_millis(ms),
    }
}

static INITIALIZED: AtomicBool = AtomicBool::new(false);

pub(crate) fn initialized() -> bool {
    INITIALIZED.load(Ordering::Acquire)
}

pub(crate) fn set_initialized() {
    INITIALIZED.store(true, Ordering::Release);
}

/// Every entry point a fault can target.
pub(crate) const KNOWN: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuStreamGetCtx",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyAsync",
    "cuMemsetD8Async",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuLaunchHostFunc",
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclAllReduce",
    "ncclReduceScatter",
    "ncclAllGather",
    "ncclBroadcast",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetPTX",
    "nvrtcGetCUBIN",
];

pub(crate) static FAULTS: FaultTable = FaultTable::new(KNOWN);

thread_local! {
    /// Set while a `cuLaunchHostFunc` function runs: CUDA forbids driver calls there.
    pub(crate) static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
}

fn in_host_fn() -> bool {
    IN_HOST_FN.try_with(Cell::get).unwrap_or(false)
}

/// Runs an exported driver function: the host-function rule (`CUDA_ERROR_NOT_PERMITTED`), fault
/// injection, the `cuInit` check (`CUDA_ERROR_NOT_INITIALIZED`), and a panic barrier
/// (`CUDA_ERROR_UNKNOWN`) so nothing unwinds into C.
pub(crate) fn cu_entry(
    name: &'static str,
    body: impl FnOnce() -> Result<(), CuResult>,
) -> CuResult {
    guarded(CUDA_SUCCESS, CUDA_ERROR_UNKNOWN, || {
        if in_host_fn() {
            return Err(CUDA_ERROR_NOT_PERMITTED);
        }
        if let Some(code) = FAULTS.hit(name) {
            return Err(code as CuResult);
        }
        if !initialized() {
            return Err(CUDA_ERROR_NOT_INITIALIZED);
        }
        body()
    })
}

/// Runs an exported NCCL function: fault injection and the panic barrier (`ncclInternalError`).
pub(crate) fn nccl_entry(
    name: &'static str,
    body: impl FnOnce() -> Result<(), NcclResult>,
) -> NcclResult {
    nccl_guard(|| match FAULTS.hit(name) {
        Some(code) => Err(code),
        None => body(),
    })
}

/// The panic barrier of [`nccl_entry`] alone, for a function that handles its fault itself.
pub(crate) fn nccl_guard(body: impl FnOnce() -> Result<(), NcclResult>) -> NcclResult {
    guarded(NCCL_SUCCESS, NCCL_INTERNAL_ERROR, body)
}

/// Runs an exported NVRTC function: fault injection (where named) and the panic barrier.
pub(crate) fn nvrtc_entry(
    name: Option<&'static str>,
    body: impl FnOnce() -> Result<(), NvrtcResult>,
) -> NvrtcResult {
    guarded(NVRTC_SUCCESS, NVRTC_ERROR_INTERNAL_ERROR, || {
        match name.and_then(|n| FAULTS.hit(n)) {
            Some(code) => Err(code),
            None => body(),
        }
    })
}

/// Writes through a caller's out-pointer, refusing null with `err`.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
pub(crate) unsafe fn put<T, E>(out: *mut T, v: T, err: E) -> Result<(), E> {
    if out.is_null() {
        return Err(err);
    }
    // SAFETY: non-null, and the API's contract makes it writable.
    unsafe { out.write(v) };
    Ok(())
}

/// Counters of contract breaches the emulator tolerates but reports (see `hprtEmuGetStats`).
pub(crate) static FREES_UNDER_QUEUED_WORK: AtomicU64 = AtomicU64::new(0);
/// Resources still alive when their context was destroyed (freed with it, as CUDA does).
pub(crate) static RECLAIMED_AT_CONTEXT_DESTROY: AtomicU64 = AtomicU64::new(0);

pub(crate) fn status<E: Default>(r: Result<(), E>) -> E {
    r.err().unwrap_or_default()
}

#[cfg(test)]
pub(crate) mod testing {
    /// Back to "cuInit not called", as at process start.
    pub(crate) fn set_initialized(on: bool) {
        super::INITIALIZED.store(on, super::Ordering::Release);
    }
}
