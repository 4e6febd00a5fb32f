//! HCCL across ranks that are threads of this process: communicators and their rendezvous here,
//! the operations on the streams in `ops`, the validated entry points in `calls`.
//!
//! Calls validate what one rank can see (handles, enums, pointers, buffer ranges inside device
//! allocations) and return at once; the work is a job on the rank's stream. Ranks meet per
//! communicator by sequence number, assigned in call order: the last to arrive checks that every
//! rank issued the same operation and performs it for all of them, so no rank's job finishes
//! before every rank's buffers have been read and written (the completion barrier). A mismatch, or
//! a peer that does not arrive within the HCCL timeout, fails every participant's stream with
//! `ACL_ERROR_RT_INTERNAL_ERROR` instead of hanging. The communicator is broken from then on, as
//! HCCL is after a failed operation: everything queued behind it or issued later, on every rank,
//! fails at once (one timeout for a dead peer, not one per queued operation).
//!
//! Call-time rules follow CANN's `op_base.cc`: the calling thread needs a device, checked before
//! anything else (CANN passes on its runtime query's failure; the emulator answers
//! `HCCL_E_RUNTIME`); a count of 0 then returns success at once;
//! null pointers (buffers, communicator, stream: HCCL has no default stream) are `HCCL_E_PTR`;
//! bad enums, ranks, roots and buffer ranges are `HCCL_E_PARA`; INT128 is `HCCL_E_NOT_SUPPORT`.
//!
//! Send/recv meet per (src, dst) pair, in order. Inside `HcclGroupStart`/`HcclGroupEnd` a rank's
//! operations become one job per stream that posts its sends first, then runs receives and
//! collectives in order, then waits for its sends to be consumed, so paired send/recv between two
//! ranks cannot deadlock.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::Instant;

use crate::codes::*;
use crate::memory::{self, Range};
use crate::state::{self, hccl_device_entry, hccl_entry, lock, COMM_TAG};
use crate::stream::{self, Stream};
use hprt_emulator_common::reduce::{reduce, DType, ReduceOp};

mod calls;
mod ops;
pub use calls::{
    HcclAllGather, HcclAllReduce, HcclAlltoAll, HcclAlltoAllV, HcclBroadcast, HcclRecv,
    HcclReduceScatter, HcclSend,
};
use ops::*;
pub use ops::{HcclGroupEnd, HcclGroupStart};

// ---- communicators ----------------------------------------------------------------------------

/// What the ranks of one communicator share.
struct Shared {
    n: u32,
    st: Mutex<Meetings>,
    cv: Condvar,
}

#[derive(Default)]
struct Meetings {
    colls: HashMap<u64, Meeting>,
    p2p: HashMap<P2pKey, P2p>,
    /// The first failure on this communicator: HCCL is unusable after a failed operation, so
    /// every operation not yet complete, on every rank, fails at once with it.
    broken: Option<AclError>,
}

/// (src rank, dst rank, n-th transfer between them)
type P2pKey = (u32, u32, u64);

struct Meeting {
    descs: Vec<Option<Desc>>,
    arrived: u32,
    left: u32,
    result: Option<Result<(), AclError>>,
}

#[derive(Default)]
struct P2p {
    send: Option<PDesc>,
    recv: Option<PDesc>,
    left: u8,
    result: Option<Result<(), AclError>>,
}

/// One rank's handle on a communicator.
struct Comm {
    rank: u32,
    shared: Arc<Shared>,
    seqs: Mutex<Seqs>,
}

struct Seqs {
    coll: u64,
    send: Vec<u64>,
    recv: Vec<u64>,
}

fn comms() -> MutexGuard<'static, HashMap<u64, Arc<Comm>>> {
    static COMMS: LazyLock<Mutex<HashMap<u64, Arc<Comm>>>> = LazyLock::new(Default::default);
    lock(&COMMS)
}

/// Null is `HCCL_E_PTR`, as in CANN; a non-null handle that is not a live communicator (which
/// real HCCL would dereference) is `HCCL_E_PARA`.
fn comm_of(h: *mut c_void) -> Result<Arc<Comm>, HcclResult> {
    if h.is_null() {
        return Err(HCCL_E_PTR);
    }
    let id = state::handle_id(COMM_TAG, h as usize).ok_or(HCCL_E_PARA)?;
    comms().get(&id).cloned().ok_or(HCCL_E_PARA)
}

pub(crate) fn live() -> u64 {
    comms().len() as u64
}

// ---- root info and rendezvous -----------------------------------------------------------------

const MAGIC: &[u8; 8] = b"HPEMURI1";
type RootKey = [u8; 24];

/// Magic, then pid, a process-wide counter and the clock: unique across processes and calls.
#[no_mangle]
pub unsafe extern "C" fn HcclGetRootInfo(root_info: *mut c_void) -> HcclResult {
    hccl_device_entry("HcclGetRootInfo", || {
        if root_info.is_null() {
            return Err(HCCL_E_PTR);
        }
        static COUNTER: AtomicU64 = AtomicU64::new(1);
        let mut info = [0u8; HCCL_ROOT_INFO_BYTES];
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        info[..8].copy_from_slice(MAGIC);
        info[8..16].copy_from_slice(&u64::from(std::process::id()).to_ne_bytes());
        info[16..24].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_ne_bytes());
        info[24..32].copy_from_slice(&nanos.to_ne_bytes());
        // SAFETY: the header's HcclRootInfo is HCCL_ROOT_INFO_BYTES bytes.
        unsafe { memory::write(root_info as usize, &info) };
        Ok(())
    })
}

struct Rendezvous {
    n: u32,
    joined: Vec<bool>,
    waiting: u32,
    taken: u32,
    shared: Option<Arc<Shared>>,
    failed: Option<HcclResult>,
}

fn rendezvous(key: RootKey, n: u32, rank: u32) -> Result<Arc<Shared>, HcclResult> {
    static RDV: LazyLock<(Mutex<HashMap<RootKey, Rendezvous>>, Condvar)> =
        LazyLock::new(Default::default);
    let (m, cv) = &*RDV;
    let deadline = Instant::now() + state::hccl_timeout();
    let mut map = lock(m);
    let fresh = || Rendezvous {
        n,
        joined: vec![false; n as usize],
        waiting: 0,
        taken: 0,
        shared: None,
        failed: None,
    };
    let e = map.entry(key).or_insert_with(fresh);
    if e.failed.is_some() && e.waiting == 0 && e.shared.is_none() {
        *e = fresh();
    }
    // Disagreeing on the size or claiming a taken rank dooms the whole group, not just this call.
    if e.n != n || e.joined[rank as usize] {
        e.failed.get_or_insert(HCCL_E_PARA);
        cv.notify_all();
        return Err(HCCL_E_PARA);
    }
    e.joined[rank as usize] = true;
    e.waiting += 1;
    if e.waiting == n {
        e.shared = Some(Arc::new(Shared {
            n,
            st: Mutex::new(Meetings::default()),
            cv: Condvar::new(),
        }));
        cv.notify_all();
    }
    loop {
        let e = map
            .get_mut(&key)
            .expect("entry lives while a rank waits in it");
        if let Some(s) = e.shared.clone() {
            e.taken += 1;
            if e.taken == n {
                map.remove(&key);
            }
            return Ok(s);
        }
        if let Some(code) = e.failed {
            e.waiting -= 1;
            e.joined[rank as usize] = false;
            if e.waiting == 0 {
                map.remove(&key);
            }
            return Err(code);
        }
        let now = Instant::now();
        if now >= deadline {
            e.failed = Some(HCCL_E_TIMEOUT);
            cv.notify_all();
            continue;
        }
        map = cv
            .wait_timeout(map, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommInitRootInfo(
    n_ranks: u32,
    root_info: *const c_void,
    rank: u32,
    comm: *mut *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclCommInitRootInfo", || {
        if root_info.is_null() || comm.is_null() {
            return Err(HCCL_E_PTR);
        }
        if n_ranks == 0 || rank >= n_ranks {
            return Err(HCCL_E_PARA);
        }
        let mut head = [0u8; 32];
        // SAFETY: the header's HcclRootInfo is HCCL_ROOT_INFO_BYTES (> 32) bytes.
        unsafe { std::ptr::copy_nonoverlapping(root_info.cast::<u8>(), head.as_mut_ptr(), 32) };
        if &head[..8] != MAGIC {
            return Err(HCCL_E_PARA);
        }
        let key: RootKey = head[8..].try_into().expect("24 bytes");
        let shared = rendezvous(key, n_ranks, rank)?;
        let id = state::next_id();
        let n = n_ranks as usize;
        let c = Comm {
            rank,
            shared,
            seqs: Mutex::new(Seqs {
                coll: 0,
                send: vec![0; n],
                recv: vec![0; n],
            }),
        };
        comms().insert(id, Arc::new(c));
        // SAFETY: checked non-null; header contract.
        unsafe { comm.write(state::handle(COMM_TAG, id) as *mut c_void) };
        Ok(())
    })
}

/// Operations already queued keep the communicator's shared state alive and still complete.
/// Null is skipped with success, as in CANN.
#[no_mangle]
pub unsafe extern "C" fn HcclCommDestroy(comm: *mut c_void) -> HcclResult {
    hccl_device_entry("HcclCommDestroy", || {
        if comm.is_null() {
            return Ok(());
        }
        let id = state::handle_id(COMM_TAG, comm as usize).ok_or(HCCL_E_PARA)?;
        comms().remove(&id).map(drop).ok_or(HCCL_E_PARA)
    })
}
