//! NCCL: ranks are threads of this process. `ncclCommInitRank` rendezvouses on the unique id
//! (every rank must pass the same `nranks` and a distinct rank, else `ncclInvalidArgument`, and
//! sit on a device of its own, else `ncclInvalidUsage` as NCCL's "Duplicate GPU detected");
//! collectives meet per call number: the n-th collective of every rank of a communicator is one
//! operation, and when the ranks' n-th calls disagree (kind, count, dtype, op, root) the
//! operation fails on every rank's stream (`CUDA_ERROR_LAUNCH_FAILED` at the next
//! synchronisation, `ncclCommGetAsyncError` says `ncclInvalidUsage`) — an error where NCCL
//! would hang or corrupt data. (Over 800 lines: one validated entry point per NCCL call the
//! backend makes, around one rendezvous.)
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

// ---- operations -----------------------------------------------------------------------------

enum Op {
    Collective {
        comm: Arc<Comm>,
        seq: u64,
        send: usize,
        recv: usize,
        held: Vec<Held>,
    },
    Send {
        comm: Arc<Comm>,
        peer: usize,
        src: usize,
        count: usize,
        dtype: c_int,
        held: Held,
    },
    Recv {
        comm: Arc<Comm>,
        peer: usize,
        dst: usize,
        count: usize,
        dtype: c_int,
        held: Held,
    },
}

impl Op {
    fn is_send(&self) -> bool {
        matches!(self, Op::Send { .. })
    }

    fn comm(&self) -> &Comm {
        match self {
            Op::Collective { comm, .. } | Op::Send { comm, .. } | Op::Recv { comm, .. } => comm,
        }
    }

    /// Runs on the stream; `Err` fails the stream and sets the communicator's async error.
    fn run(self) -> Result<(), CuResult> {
        if self.comm().aborted.load(Ordering::Acquire) {
            return Ok(());
        }
        let (comm, r) = match self {
            Op::Collective {
                comm,
                seq,
                send,
                recv,
                held,
            } => {
                let r = run_collective(&comm, seq, send, recv);
                drop(held);
                (comm, r)
            }
            Op::Send {
                comm,
                peer,
                src,
                count,
                dtype,
                held,
            } => {
                if let Some(code) = broken(&comm) {
                    drop(held);
                    return Self::failed(&comm, code);
                }
                let size = dtype_of(dtype).map(DType::size).unwrap_or(1);
                // SAFETY: a held device range of `count` elements.
                let data =
                    unsafe { std::slice::from_raw_parts(src as *const u8, count * size) }.to_vec();
                drop(held);
                let c = &comm.clique;
                lock(&c.state)
                    .mail
                    .entry((comm.rank, peer))
                    .or_default()
                    .push_back(Msg { count, dtype, data });
                c.cv.notify_all();
                (comm, Ok(()))
            }
            Op::Recv {
                comm,
                peer,
                dst,
                count,
                dtype,
                held,
            } => {
                let r = receive(&comm, peer, dst, count, dtype);
                drop(held);
                (comm, r)
            }
        };
        r.or_else(|code| Self::failed(&comm, code))
    }

    /// Breaks the communicator on every rank, keeping the first cause; fails the stream.
    fn failed(comm: &Comm, code: NcclResult) -> Result<(), CuResult> {
        let first = *lock(&comm.clique.state).failed.get_or_insert(code);
        comm.clique.cv.notify_all();
        *lock(&comm.async_error) = first;
        Err(CUDA_ERROR_LAUNCH_FAILED)
    }
}

fn receive(
    comm: &Comm,
    peer: usize,
    dst: usize,
    count: usize,
    dtype: c_int,
) -> Result<(), NcclResult> {
    let c = &comm.clique;
    let mut st = lock(&c.state);
    let msg = loop {
        if comm.aborted.load(Ordering::Acquire) {
            return Ok(());
        }
        if let Some(code) = st.failed {
            return Err(code);
        }
        if let Some(m) = st
            .mail
            .get_mut(&(peer, comm.rank))
            .and_then(VecDeque::pop_front)
        {
            break m;
        }
        st = c.cv.wait(st).unwrap_or_else(|e| e.into_inner());
    };
    drop(st);
    if msg.count != count || msg.dtype != dtype {
        eprintln!(
            "hprt CUDA emulator: rank {} received {} elements of type {} from rank {peer} but posted {count} of type {dtype}",
            comm.rank, msg.count, msg.dtype
        );
        return Err(NCCL_INVALID_USAGE);
    }
    // SAFETY: `dst` is a held device range of `count` elements, as long as the message.
    unsafe { std::ptr::copy_nonoverlapping(msg.data.as_ptr(), dst as *mut u8, msg.data.len()) };
    Ok(())
}

/// # Safety
/// `p` is valid for `len` bytes.
unsafe fn bytes_at(p: usize, len: usize) -> Vec<u8> {
    // SAFETY: caller's contract.
    unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec()
}

/// # Safety
/// `p` is valid for `data.len()` bytes.
unsafe fn write_at(p: usize, data: &[u8]) {
    // SAFETY: caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, data.len()) };
}

/// Moves the data of a collective whose ranks all arrived (with their buffers, held by their
/// stream jobs and checked against the agreed description at the call).
fn perform(d: &Desc, ptrs: &[(usize, usize)]) {
    let world = ptrs.len();
    let dtype = dtype_of(d.dtype).expect("checked at the call");
    let size = dtype.size();
    let n = d.count * size;
    // SAFETY: (all below) every buffer was bounds-checked at the call for the extent used here
    // and is held by its rank's stream job, which is waiting for this to finish.
    unsafe {
        match d.kind {
            Kind::AllReduce => {
                let inputs: Vec<Vec<u8>> = ptrs.iter().map(|(s, _)| bytes_at(*s, n)).collect();
                let out = reduce(
                    &inputs,
                    dtype,
                    op_of(d.op.expect("reduce op")).expect("checked"),
                );
                for (_, r) in ptrs {
                    write_at(*r, &out);
                }
            }
            Kind::ReduceScatter => {
                let inputs: Vec<Vec<u8>> =
                    ptrs.iter().map(|(s, _)| bytes_at(*s, n * world)).collect();
                let out = reduce(
                    &inputs,
                    dtype,
                    op_of(d.op.expect("reduce op")).expect("checked"),
                );
                for (q, (_, r)) in ptrs.iter().enumerate() {
                    write_at(*r, &out[q * n..(q + 1) * n]);
                }
            }
            Kind::AllGather => {
                let all: Vec<u8> = ptrs.iter().flat_map(|(s, _)| bytes_at(*s, n)).collect();
                for (_, r) in ptrs {
                    write_at(*r, &all);
                }
            }
            Kind::Broadcast => {
                let data = bytes_at(ptrs[d.root.expect("root") as usize].0, n);
                for (_, r) in ptrs {
                    write_at(*r, &data);
                }
            }
        }
    }
}

fn run_collective(comm: &Comm, seq: u64, send: usize, recv: usize) -> Result<(), NcclResult> {
    let c = &comm.clique;
    let mut st = lock(&c.state);
    let result = loop {
        if comm.aborted.load(Ordering::Acquire) {
            break Ok(());
        }
        let failed = st.failed;
        let slot = st.slots.get_mut(&seq).expect("registered at the call");
        if let Some((code, _)) = &slot.poisoned {
            break Err(*code);
        }
        if let (Some(code), false) = (failed, slot.done) {
            break Err(code);
        }
        if slot.done {
            break Ok(());
        }
        if slot.arrived[comm.rank].is_none() {
            slot.arrived[comm.rank] = Some((send, recv));
            if slot.arrived.iter().all(Option::is_some) {
                let ptrs: Vec<(usize, usize)> = slot
                    .arrived
                    .iter()
                    .map(|a| a.expect("all arrived"))
                    .collect();
                perform(&slot.desc, &ptrs);
                slot.done = true;
                c.cv.notify_all();
                continue;
            }
        }
        st = c.cv.wait(st).unwrap_or_else(|e| e.into_inner());
    };
    leave(&mut st, seq, c.world);
    result
}

fn leave(st: &mut GroupState, seq: u64, world: usize) {
    if let Some(slot) = st.slots.get_mut(&seq) {
        slot.left += 1;
        if slot.left == world {
            st.slots.remove(&seq);
        }
    }
}

/// Host-side part of a collective: its call number, and agreement with the ranks that already
/// made their call of that number. A disagreement fails the operation on every rank's stream
/// (the call itself succeeds, as NCCL's calls only queue work).
fn register(comm: &Comm, desc: Desc) -> u64 {
    let seq = {
        let mut n = lock(&comm.next_seq);
        *n += 1;
        *n
    };
    let c = &comm.clique;
    let mut st = lock(&c.state);
    let slot = st.slots.entry(seq).or_insert_with(|| Slot {
        desc,
        first_rank: comm.rank,
        arrived: vec![None; c.world],
        done: false,
        poisoned: None,
        left: 0,
    });
    if slot.poisoned.is_none() && slot.desc != desc {
        let why = format!(
            "collective #{seq}: rank {} called {:?} with count {}, dtype {}, op {:?}, root {:?}; rank {} called {:?} with count {}, dtype {}, op {:?}, root {:?}",
            comm.rank, desc.kind, desc.count, desc.dtype, desc.op, desc.root,
            slot.first_rank, slot.desc.kind, slot.desc.count, slot.desc.dtype, slot.desc.op, slot.desc.root
        );
        eprintln!("hprt CUDA emulator: {why}");
        slot.poisoned = Some((NCCL_INVALID_USAGE, why));
        c.cv.notify_all();
    }
    seq
}

/// The stream an operation of `comm` goes on: a live stream of the communicator's context.
fn stream_for(comm: &Comm, h: *mut c_void) -> Result<Arc<Stream>, NcclResult> {
    match stream::resolve(h) {
        Ok(s) if s.ctx == comm.ctx => Ok(s),
        Ok(_) => fail(
            NCCL_INVALID_ARGUMENT,
            "the stream belongs to another context than the communicator",
        ),
        Err(code) => fail(
            NCCL_INVALID_ARGUMENT,
            format!("invalid stream (CUresult {code})"),
        ),
    }
}

/// `[p, p + bytes)` in device memory, held for the operation.
fn device_range(p: *const c_void, bytes: usize, what: &str) -> Result<Held, NcclResult> {
    match memory::locate(p as usize, bytes) {
        Ok(Some(a)) if a.device.is_some() => Ok(Held::new(a)),
        Ok(_) => fail(
            NCCL_INVALID_ARGUMENT,
            format!("{what} buffer {p:?} is not device memory"),
        ),
        Err(_) => fail(
            NCCL_INVALID_ARGUMENT,
            format!("{what} buffer {p:?} + {bytes} bytes leaves its allocation"),
        ),
    }
}

/// Queues `op` on `s`, or holds it for `ncclGroupEnd`.
fn submit(s: Arc<Stream>, op: Op) {
    let held = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 > 0 {
            g.1.push((s.clone(), op));
            None
        } else {
            Some(op)
        }
    });
    if let Some(op) = held {
        s.enqueue(Box::new(move || op.run()));
    }
}

/// The first failure of the communicator on any rank, if any.
fn broken(comm: &Comm) -> Option<NcclResult> {
    lock(&comm.clique.state).failed
}

#[allow(clippy::too_many_arguments)]
fn collective(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: Option<c_int>,
    root: Option<c_int>,
    h: *mut c_void,
    hstream: *mut c_void,
) -> Result<(), NcclResult> {
    let comm = comm(h)?;
    let size = dtype_of(dtype)?.size();
    if let Some(op) = op {
        op_of(op)?;
    }
    if root.is_some_and(|r| r < 0 || r as usize >= comm.clique.world) {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("root {root:?} of {} ranks", comm.clique.world),
        );
    }
    let s = stream_for(&comm, hstream)?;
    let world = comm.clique.world;
    let (send_n, recv_n) = match kind {
        Kind::AllReduce | Kind::Broadcast => (count, count),
        Kind::ReduceScatter => (count * world, count),
        Kind::AllGather => (count, count * world),
    };
    let needs_send = kind != Kind::Broadcast || root == Some(comm.rank as c_int);
    let mut held = Vec::new();
    if count > 0 {
        if needs_send {
            held.push(device_range(send, send_n * size, "send")?);
        }
        held.push(device_range(recv, recv_n * size, "recv")?);
    }
    let desc = Desc {
        kind,
        count,
        dtype,
        op,
        root,
    };
    let seq = register(&comm, desc);
    submit(
        s,
        Op::Collective {
            comm,
            seq,
            send: send as usize,
            recv: recv as usize,
            held,
        },
    );
    Ok(())
}

#[no_mangle]
pub extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclAllReduce", || {
        collective(
            Kind::AllReduce,
            send,
            recv,
            count,
            dtype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recv_count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclReduceScatter", || {
        collective(
            Kind::ReduceScatter,
            send,
            recv,
            recv_count,
            dtype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    send_count: usize,
    dtype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclAllGather", || {
        collective(
            Kind::AllGather,
            send,
            recv,
            send_count,
            dtype,
            None,
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclBroadcast", || {
        collective(
            Kind::Broadcast,
            send,
            recv,
            count,
            dtype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

fn peer_of(comm: &Comm, peer: c_int) -> Result<usize, NcclResult> {
    if peer < 0 || peer as usize >= comm.clique.world {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("peer {peer} of {} ranks", comm.clique.world),
        );
    }
    Ok(peer as usize)
}

#[no_mangle]
pub extern "C" fn ncclSend(
    send: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    h: *mut c_void,
    hstream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclSend", || {
        let comm = comm(h)?;
        let size = dtype_of(dtype)?.size();
        let peer = peer_of(&comm, peer)?;
        let s = stream_for(&comm, hstream)?;
        if count == 0 {
            return Ok(());
        }
        let held = device_range(send, count * size, "send")?;
        submit(
            s,
            Op::Send {
                comm,
                peer,
                src: send as usize,
                count,
                dtype,
                held,
            },
        );
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclRecv(
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    h: *mut c_void,
    hstream: *mut c_void,
) -> NcclResult {
    nccl_entry("ncclRecv", || {
        let comm = comm(h)?;
        let size = dtype_of(dtype)?.size();
        let peer = peer_of(&comm, peer)?;
        let s = stream_for(&comm, hstream)?;
        if count == 0 {
            return Ok(());
        }
        let held = device_range(recv, count * size, "recv")?;
        submit(
            s,
            Op::Recv {
                comm,
                peer,
                dst: recv as usize,
                count,
                dtype,
                held,
            },
        );
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    nccl_entry("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().0 += 1);
        Ok(())
    })
}

/// Queues the held operations, per stream in call order except that sends go first. A failing
/// group end (an injected fault) still closes the group, dropping its operations, as NCCL
/// resets its group state when a group fails.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    let fault = state::FAULTS.hit("ncclGroupEnd");
    state::nccl_guard(|| {
        let ops = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.0 == 0 {
                return None;
            }
            g.0 -= 1;
            Some(if g.0 == 0 {
                std::mem::take(&mut g.1)
            } else {
                Vec::new()
            })
        });
        let Some(ops) = ops else {
            return fail(NCCL_INVALID_USAGE, "ncclGroupEnd without ncclGroupStart");
        };
        if let Some(code) = fault {
            return fail(code, "injected fault (HP_EMU_FAULTS)");
        }
        let mut per_stream: Vec<(Arc<Stream>, Vec<Op>)> = Vec::new();
        for (s, op) in ops {
            match per_stream.iter_mut().find(|(t, _)| Arc::ptr_eq(t, &s)) {
                Some((_, v)) => v.push(op),
                None => per_stream.push((s, vec![op])),
            }
        }
        for (s, mut ops) in per_stream {
            ops.sort_by_key(|op| !op.is_send());
            s.enqueue(Box::new(move || {
                let mut first = Ok(());
                for op in ops {
                    if let Err(e) = op.run() {
                        first = first.and(Err(e));
                    }
                }
                first
            }));
        }
        Ok(())
    })
}
