//! NCCL: ranks are threads of this process. `ncclCommInitRank` rendezvouses on the unique id
//! (every rank must pass the same `nranks` and a distinct rank, else `ncclInvalidArgument`, and
//! sit on a device of its own, else `ncclInvalidUsage` as NCCL's "Duplicate GPU detected");
//! collectives meet per call number: the n-th collective of every rank of a communicator is one
//! operation, and when the ranks' n-th calls disagree (kind, count, dtype, op, root) the
//! operation fails on every rank's stream (`CUDA_ERROR_LAUNCH_FAILED` at the next
//! synchronisation, `ncclCommGetAsyncError` says `ncclInvalidUsage`) — an error where NCCL
//! would hang or corrupt data.
//!
//! A collective or receive whose peer never comes (a rank that died, skipped the call or
//! destroyed its communicator) stays pending, as on NCCL: its stream does not finish and
//! `ncclCommGetAsyncError` says `ncclSuccess`, without end, until `ncclCommAbort`. The abort ends
//! that rank's pending and queued operations without an error on their streams and without
//! touching their outputs, as NCCL's aborted kernels exit; its peers' `ncclCommGetAsyncError`
//! then says `ncclRemoteError` (a peer gone), while their own operations stay pending until they
//! abort too. Only `ncclCommInitRank` gives up on its own, after `HP_EMU_NCCL_TIMEOUT_MS`.
//!
//! A failed operation breaks its communicator on every rank: the operations queued behind it and
//! those issued later fail at once with the first cause (their outputs untouched), and every
//! rank's `ncclCommGetAsyncError` reports it. On NCCL they would hang until the application
//! reacted to the async error with `ncclCommAbort`; the emulator fails them instead of hanging.
//!
//! Data moves on the streams: the last rank to reach a collective on its stream reads every
//! rank's input and writes every rank's output. Sends are buffered (the bytes are taken when the
//! send runs on its stream), receives wait for their message; between `ncclGroupStart` and
//! `ncclGroupEnd` operations are held and queued at the end, sends first, so a group never
//! deadlocks on its own order. Buffers must be device memory (`ncclInvalidArgument` otherwise).
//!
//! Communicators and their lifecycle are here; the operations on the streams are in `ops`, the
//! collective, point-to-point and group entry points in `calls`.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::Instant;

use hprt_emulator_common::reduce::{reduce, DType, ReduceOp};

use crate::codes::*;
use crate::context;
use crate::memory::{self, Held};
use crate::state::{self, decode, encode, lock, nccl_entry, COMM_TAG};
use crate::stream::{self, Stream};

mod calls;
mod ops;
pub use calls::{
    ncclAllGather, ncclAllReduce, ncclBroadcast, ncclGroupEnd, ncclGroupStart, ncclRecv,
    ncclReduceScatter, ncclSend,
};
use ops::*;

/// NCCL 2.21.5, so the backend uses `ncclAvg` and bf16.
const VERSION: c_int = 22105;
const ID_MAGIC: &[u8; 16] = b"hprt-emu-nccl-id";

/// Operations held in a group, with the stream each goes on.
type GroupOps = Vec<(Arc<Stream>, Op)>;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// The nesting depth of ncclGroupStart, and the operations held until the group ends.
    static GROUP: RefCell<(u32, GroupOps)> = const { RefCell::new((0, Vec::new())) };
}

/// Fails with `code`, keeping `why` for `ncclGetLastError`.
fn fail<T>(code: NcclResult, why: impl Into<String>) -> Result<T, NcclResult> {
    let why = why.into();
    LAST_ERROR.with(|e| *e.borrow_mut() = why);
    Err(code)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
}

/// What every rank's n-th collective must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Desc {
    kind: Kind,
    count: usize,
    dtype: c_int,
    op: Option<c_int>,
    root: Option<c_int>,
}

struct Slot {
    desc: Desc,
    first_rank: usize,
    /// Each rank's (send, recv) once its stream reached the operation.
    arrived: Vec<Option<(usize, usize)>>,
    done: bool,
    poisoned: Option<(NcclResult, String)>,
    /// Ranks finished with the slot (ran, failed or refused); it goes when all have.
    left: usize,
}

struct Msg {
    count: usize,
    dtype: c_int,
    data: Vec<u8>,
}

#[derive(Default)]
struct GroupState {
    slots: HashMap<u64, Slot>,
    /// (from, to) → messages in send order
    mail: HashMap<(usize, usize), VecDeque<Msg>>,
    /// The first failure of any rank's operation: the communicator is broken on every rank.
    failed: Option<NcclResult>,
    /// A rank aborted its communicator: its peers' `ncclCommGetAsyncError` says so.
    aborted_rank: Option<usize>,
}

/// What the ranks of one communicator share.
struct Clique {
    world: usize,
    state: Mutex<GroupState>,
    cv: Condvar,
}

struct Comm {
    clique: Arc<Clique>,
    rank: usize,
    ctx: u64,
    next_seq: Mutex<u64>,
    async_error: Mutex<NcclResult>,
    /// `ncclCommAbort` ran: this rank's pending and queued operations end at once.
    aborted: AtomicBool,
}

fn comms() -> MutexGuard<'static, HashMap<u64, Arc<Comm>>> {
    static COMMS: LazyLock<Mutex<HashMap<u64, Arc<Comm>>>> = LazyLock::new(Default::default);
    lock(&COMMS)
}

pub(crate) fn live() -> u64 {
    comms().len() as u64
}

fn comm(h: *mut c_void) -> Result<Arc<Comm>, NcclResult> {
    match decode(COMM_TAG, h as usize).and_then(|id| comms().get(&id).cloned()) {
        Some(c) => Ok(c),
        None => fail(NCCL_INVALID_ARGUMENT, "not a live communicator"),
    }
}

fn dtype_of(d: c_int) -> Result<DType, NcclResult> {
    Ok(match d {
        0 => DType::I8,
        1 => DType::U8,
        2 => DType::I32,
        3 => DType::U32,
        4 => DType::I64,
        5 => DType::U64,
        6 => DType::F16,
        7 => DType::F32,
        8 => DType::F64,
        9 => DType::BF16,
        _ => return fail(NCCL_INVALID_ARGUMENT, format!("invalid ncclDataType_t {d}")),
    })
}

fn op_of(op: c_int) -> Result<ReduceOp, NcclResult> {
    Ok(match op {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        _ => return fail(NCCL_INVALID_ARGUMENT, format!("invalid ncclRedOp_t {op}")),
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    nccl_entry("ncclGetVersion", || {
        // SAFETY: API contract.
        unsafe { state::put(v, VERSION, NCCL_INVALID_ARGUMENT) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut [u8; 128]) -> NcclResult {
    nccl_entry("ncclGetUniqueId", || {
        let mut bytes = [0u8; 128];
        bytes[..16].copy_from_slice(ID_MAGIC);
        bytes[16..24].copy_from_slice(&state::next_id().to_le_bytes());
        bytes[24..28].copy_from_slice(&std::process::id().to_le_bytes());
        // SAFETY: API contract.
        unsafe { state::put(id, bytes, NCCL_INVALID_ARGUMENT) }
    })
}

/// `ncclUniqueId`, passed by value.
#[repr(C)]
pub struct UniqueId {
    internal: [u8; 128],
}

#[cfg(test)]
impl UniqueId {
    pub(crate) fn from_bytes(internal: [u8; 128]) -> UniqueId {
        UniqueId { internal }
    }
}

struct Rendezvous {
    world: usize,
    joined: Vec<bool>,
    /// The device of each rank that joined: NCCL refuses two ranks on one GPU.
    devices: Vec<Option<i32>>,
    clique: Option<Arc<Clique>>,
    /// Ranks that took the clique; the entry goes when all have.
    taken: usize,
}

fn rendezvous() -> MutexGuard<'static, HashMap<[u8; 128], Rendezvous>> {
    static R: LazyLock<Mutex<HashMap<[u8; 128], Rendezvous>>> = LazyLock::new(Default::default);
    lock(&R)
}

static JOINED: Condvar = Condvar::new();

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    out: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> NcclResult {
    let id = id.internal;
    nccl_entry("ncclCommInitRank", || {
        if out.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
            return fail(NCCL_INVALID_ARGUMENT, format!("rank {rank} of {nranks}"));
        }
        if &id[..16] != ID_MAGIC {
            return fail(
                NCCL_INVALID_ARGUMENT,
                "not an ncclUniqueId from ncclGetUniqueId",
            );
        }
        let Ok(ctx) = context::current() else {
            return fail(1, "no current CUDA context on this thread");
        };
        let (world, rank) = (nranks as usize, rank as usize);
        let deadline = Instant::now() + state::nccl_timeout();
        let mut r = rendezvous();
        let entry = r.entry(id).or_insert_with(|| Rendezvous {
            world,
            joined: vec![false; world],
            devices: vec![None; world],
            clique: None,
            taken: 0,
        });
        if entry.world != world || entry.joined[rank] {
            let why = format!(
                "rank {rank} joined with nranks {world}; the communicator has {} ranks{}",
                entry.world,
                if entry.world == world {
                    " and this rank already joined"
                } else {
                    ""
                }
            );
            return fail(NCCL_INVALID_ARGUMENT, why);
        }
        if let Some(other) = entry.devices.iter().position(|d| *d == Some(ctx.device)) {
            let why = format!(
                "Duplicate GPU detected: rank {rank} and rank {other} both on CUDA device {}",
                ctx.device
            );
            return fail(NCCL_INVALID_USAGE, why);
        }
        entry.joined[rank] = true;
        entry.devices[rank] = Some(ctx.device);
        if entry.joined.iter().all(|j| *j) {
            entry.clique = Some(Arc::new(Clique {
                world,
                state: Mutex::new(GroupState::default()),
                cv: Condvar::new(),
            }));
            JOINED.notify_all();
        }
        let clique = loop {
            let e = r
                .get_mut(&id)
                .expect("our entry stays until every rank took the clique");
            if let Some(c) = e.clique.clone() {
                e.taken += 1;
                if e.taken == world {
                    r.remove(&id);
                }
                break c;
            }
            let now = Instant::now();
            if now >= deadline {
                e.joined[rank] = false;
                e.devices[rank] = None;
                if e.joined.iter().all(|j| !*j) {
                    r.remove(&id);
                }
                return fail(
                    NCCL_TIMEOUT,
                    format!("rank {rank}: not every rank of {world} joined in time"),
                );
            }
            r = JOINED
                .wait_timeout(r, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(r);
        let cid = state::next_id();
        comms().insert(
            cid,
            Arc::new(Comm {
                clique,
                rank,
                ctx: ctx.id,
                next_seq: Mutex::new(0),
                async_error: Mutex::new(NCCL_SUCCESS),
                aborted: AtomicBool::new(false),
            }),
        );
        // SAFETY: checked non-null.
        unsafe { *out = encode(COMM_TAG, cid) as *mut c_void };
        Ok(())
    })
}

fn destroy(h: *mut c_void) -> Result<(), NcclResult> {
    let id = decode(COMM_TAG, h as usize).ok_or(NCCL_INVALID_ARGUMENT)?;
    comms().remove(&id).map(drop).ok_or(NCCL_INVALID_ARGUMENT)
}

#[no_mangle]
pub extern "C" fn ncclCommDestroy(h: *mut c_void) -> NcclResult {
    nccl_entry("ncclCommDestroy", || destroy(h))
}

#[no_mangle]
pub extern "C" fn ncclCommAbort(h: *mut c_void) -> NcclResult {
    nccl_entry("ncclCommAbort", || {
        let c = comm(h)?;
        c.aborted.store(true, Ordering::Release);
        lock(&c.clique.state).aborted_rank.get_or_insert(c.rank);
        c.clique.cv.notify_all();
        destroy(h)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(h: *mut c_void, err: *mut NcclResult) -> NcclResult {
    nccl_entry("ncclCommGetAsyncError", || {
        let c = comm(h)?;
        let e = match *lock(&c.async_error) {
            NCCL_SUCCESS => {
                let st = lock(&c.clique.state);
                match (st.failed, st.aborted_rank) {
                    (Some(code), _) => code,
                    (None, Some(r)) if r != c.rank => NCCL_REMOTE_ERROR,
                    _ => NCCL_SUCCESS,
                }
            }
            own => own,
        };
        // SAFETY: API contract.
        unsafe { state::put(err, e, NCCL_INVALID_ARGUMENT) }
    })
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(code: NcclResult) -> *const c_char {
    let s: &'static CStr = match code {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        8 => c"NCCL timeout",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// The thread's last error text (the emulator's reason for its last failure).
#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    thread_local! {
        static OUT: RefCell<std::ffi::CString> = RefCell::new(std::ffi::CString::default());
    }
    let text = LAST_ERROR.with(|e| e.borrow().clone());
    OUT.with(|o| {
        *o.borrow_mut() = std::ffi::CString::new(text.replace('\0', " ")).unwrap_or_default();
        o.borrow().as_ptr()
    })
}
