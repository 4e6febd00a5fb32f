//! Fault injection: `HP_EMU_FAULTS="name:n:code[,name:n:code...]"` makes the n-th call (1-based,
//! counted per function across the process) of `name` return `code` without doing anything (the
//! table and its syntax: `hprt_emulator_common::faults`).

use hprt_emulator_common::faults::FaultTable;

/// Every entry point a fault can target (the header's functions).
const KNOWN: &[&str] = &[
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtGetDevice",
    "aclrtGetDeviceCount",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtStreamQuery",
    "aclrtCreateEvent",
    "aclrtCreateEventWithFlag",
    "aclrtDestroyEvent",
    "aclrtRecordEvent",
    "aclrtStreamWaitEvent",
    "aclrtSynchronizeEvent",
    "aclrtQueryEventStatus",
    "aclrtEventElapsedTime",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
    "aclrtMemset",
    "aclrtMemsetAsync",
    "aclrtGetMemInfo",
    "aclrtSubscribeReport",
    "aclrtUnSubscribeReport",
    "aclrtLaunchCallback",
    "aclrtProcessReport",
    "HcclGetRootInfo",
    "HcclCommInitRootInfo",
    "HcclCommDestroy",
    "HcclAllGather",
    "HcclReduceScatter",
    "HcclAllReduce",
    "HcclBroadcast",
    "HcclAlltoAll",
    "HcclAlltoAllV",
    "HcclSend",
    "HcclRecv",
    "HcclGroupStart",
    "HcclGroupEnd",
];

static TABLE: FaultTable = FaultTable::new(KNOWN);

/// Counts a call of `name`; `Some(code)` when this call is one that must fail.
pub(crate) fn hit(name: &'static str) -> Option<i32> {
    TABLE.hit(name)
}

pub(crate) fn env_malformed() -> bool {
    TABLE.env_malformed()
}

/// Replaces the rules and restarts every call count; a malformed spec changes nothing.
pub(crate) fn replace(spec: &str) -> Result<(), ()> {
    TABLE.replace(spec).map_err(drop)
}
