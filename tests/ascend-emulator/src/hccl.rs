//! HCCL across ranks that are threads of this process. (Over 800 lines: one validated entry
//! point per HCCL call the backend makes, around one rendezvous.)
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

// ---- operations -------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    AlltoAll,
    AlltoAllV,
}

/// One rank's view of a collective; every field but the buffers must agree across ranks.
struct Desc {
    kind: Kind,
    count: u64,
    dtype: DType,
    op: Option<ReduceOp>,
    root: u32,
    send: Option<Range>,
    recv: Option<Range>,
    v: Option<VCounts>,
}

/// All-to-all-v counts and displacements, in elements, one per peer.
struct VCounts {
    scounts: Vec<u64>,
    sdispls: Vec<u64>,
    rcounts: Vec<u64>,
    rdispls: Vec<u64>,
}

struct PDesc {
    buf: Option<Range>,
    count: u64,
    dtype: DType,
}

enum Op {
    Coll {
        shared: Arc<Shared>,
        rank: u32,
        seq: u64,
        desc: Desc,
    },
    Send {
        shared: Arc<Shared>,
        key: P2pKey,
        desc: PDesc,
    },
    Recv {
        shared: Arc<Shared>,
        key: P2pKey,
        desc: PDesc,
    },
}

const ASYNC_ERR: AclError = ACL_ERROR_RT_INTERNAL_ERROR;

impl Shared {
    fn wait<'a>(
        &self,
        g: MutexGuard<'a, Meetings>,
        deadline: Instant,
    ) -> Option<MutexGuard<'a, Meetings>> {
        let now = Instant::now();
        (now < deadline).then(|| {
            self.cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0
        })
    }

    fn collective(&self, rank: u32, seq: u64, desc: Desc) -> Result<(), AclError> {
        let deadline = Instant::now() + state::hccl_timeout();
        let mut st = lock(&self.st);
        let n = self.n;
        let m = st.colls.entry(seq).or_insert_with(|| Meeting {
            descs: (0..n).map(|_| None).collect(),
            arrived: 0,
            left: 0,
            result: None,
        });
        if m.result.is_none() {
            if let Some(code) = st.broken {
                let m = st.colls.get_mut(&seq).expect("just inserted");
                m.result = Some(Err(code));
                self.cv.notify_all();
            }
        }
        let m = st.colls.get_mut(&seq).expect("just inserted");
        // A meeting that already failed (a peer timed out) is not joined, only left.
        if m.result.is_none() {
            m.descs[rank as usize] = Some(desc);
            m.arrived += 1;
            if m.arrived == n {
                let r = perform(&m.descs);
                m.result = Some(r);
                if let Err(code) = r {
                    st.broken.get_or_insert(code);
                }
                self.cv.notify_all();
            }
        }
        loop {
            let broken = st.broken;
            let m = st
                .colls
                .get_mut(&seq)
                .expect("meeting lives until every rank left");
            if m.result.is_none() {
                m.result = broken.map(Err);
            }
            if let Some(r) = m.result {
                m.left += 1;
                if m.left == n {
                    st.colls.remove(&seq);
                }
                return r;
            }
            st = match self.wait(st, deadline) {
                Some(g) => g,
                None => {
                    st = lock(&self.st);
                    let m = st.colls.get_mut(&seq).expect("meeting lives");
                    m.result.get_or_insert(Err(ASYNC_ERR));
                    st.broken.get_or_insert(ASYNC_ERR);
                    self.cv.notify_all();
                    st
                }
            };
        }
    }

    fn p2p_post(&self, key: P2pKey, is_send: bool, desc: PDesc) {
        let mut st = lock(&self.st);
        let broken = st.broken;
        let p = st.p2p.entry(key).or_default();
        if p.result.is_some() {
            return;
        }
        if let Some(code) = broken {
            p.result = Some(Err(code));
            self.cv.notify_all();
            return;
        }
        *(if is_send { &mut p.send } else { &mut p.recv }) = Some(desc);
        if let (Some(s), Some(r)) = (&p.send, &p.recv) {
            let r = transfer(s, r);
            p.result = Some(r);
            if let Err(code) = r {
                st.broken.get_or_insert(code);
            }
            self.cv.notify_all();
        }
    }

    fn p2p_wait(&self, key: P2pKey) -> Result<(), AclError> {
        let deadline = Instant::now() + state::hccl_timeout();
        let mut st = lock(&self.st);
        loop {
            let p = st.p2p.entry(key).or_default();
            if let Some(r) = p.result {
                p.left += 1;
                if p.left == 2 {
                    st.p2p.remove(&key);
                }
                return r;
            }
            st = match self.wait(st, deadline) {
                Some(g) => g,
                None => {
                    st = lock(&self.st);
                    st.p2p
                        .entry(key)
                        .or_default()
                        .result
                        .get_or_insert(Err(ASYNC_ERR));
                    st.broken.get_or_insert(ASYNC_ERR);
                    self.cv.notify_all();
                    st
                }
            };
        }
    }
}

fn transfer(s: &PDesc, r: &PDesc) -> Result<(), AclError> {
    if s.count != r.count || s.dtype != r.dtype {
        return Err(ASYNC_ERR);
    }
    if let (Some(sb), Some(rb)) = (&s.buf, &r.buf) {
        let _keep = (sb.pin()?, rb.pin()?);
        // SAFETY: both pinned; equal byte lengths since count and dtype agree.
        unsafe { memory::write(rb.ptr, &memory::read(sb)) };
    }
    Ok(())
}

/// Runs a collective once every rank's descriptor is in (called by the last to arrive).
fn perform(descs: &[Option<Desc>]) -> Result<(), AclError> {
    let d: Vec<&Desc> = descs
        .iter()
        .map(|x| x.as_ref().expect("all arrived"))
        .collect();
    let f = d[0];
    let agree = d.iter().all(|x| {
        (x.kind, x.count, x.dtype, x.op, x.root) == (f.kind, f.count, f.dtype, f.op, f.root)
    });
    if !agree {
        return Err(ASYNC_ERR);
    }
    let n = d.len();
    if f.kind == Kind::AlltoAllV {
        let v = |r: usize| d[r].v.as_ref().expect("all-to-all-v counts");
        let consistent = (0..n).all(|i| (0..n).all(|j| v(i).scounts[j] == v(j).rcounts[i]));
        if !consistent {
            return Err(ASYNC_ERR);
        }
    }
    let mut keep = Vec::new();
    for x in &d {
        for r in [&x.send, &x.recv].into_iter().flatten() {
            keep.push(r.pin()?);
        }
    }
    // Every input is read into owned memory before any output is written, so in-place
    // operations and overlapping buffers across ranks see the inputs as issued.
    // SAFETY (all reads and writes below): ranges are pinned above and were validated against
    // their allocation's bounds at call time, for exactly these counts.
    let inputs: Vec<Vec<u8>> = d
        .iter()
        .map(|x| {
            x.send
                .as_ref()
                // SAFETY: `r` is a send range pinned in `keep` above and validated at the call
                // for exactly this count.
                .map_or_else(Vec::new, |r| unsafe { memory::read(r) })
        })
        .collect();
    let es = f.dtype.size();
    let recv_ptr = |r: usize| d[r].recv.as_ref().map(|x| x.ptr);
    let put = |r: usize, off: usize, data: &[u8]| {
        if let (Some(p), false) = (recv_ptr(r), data.is_empty()) {
            // SAFETY: `p + off .. + data.len()` lies inside rank `r`'s receive range, pinned in
            // `keep` above and validated at the call for the extent each case below writes.
            unsafe { memory::write(p + off, data) };
        }
    };
    match f.kind {
        Kind::AllReduce | Kind::ReduceScatter => {
            if inputs[0].is_empty() {
                return Ok(());
            }
            let out = reduce(&inputs, f.dtype, f.op.expect("reduction op"));
            if f.kind == Kind::AllReduce {
                (0..n).for_each(|r| put(r, 0, &out));
            } else {
                let blk = out.len() / n;
                (0..n).for_each(|r| put(r, 0, &out[r * blk..(r + 1) * blk]));
            }
        }
        Kind::AllGather => {
            let all = inputs.concat();
            (0..n).for_each(|r| put(r, 0, &all));
        }
        Kind::Broadcast => {
            let root = f.root as usize;
            (0..n)
                .filter(|&r| r != root)
                .for_each(|r| put(r, 0, &inputs[root]));
        }
        Kind::AlltoAll => {
            let blk = inputs[0].len() / n;
            for j in 0..n {
                let out: Vec<u8> = (0..n)
                    .flat_map(|i| &inputs[i][j * blk..(j + 1) * blk])
                    .copied()
                    .collect();
                put(j, 0, &out);
            }
        }
        Kind::AlltoAllV => {
            for (i, src) in d.iter().enumerate() {
                let vi = src.v.as_ref().expect("counts");
                for (j, dst) in d.iter().enumerate() {
                    let vj = dst.v.as_ref().expect("counts");
                    let (cnt, sd, rd) = (
                        vi.scounts[j] as usize,
                        vi.sdispls[j] as usize,
                        vj.rdispls[i] as usize,
                    );
                    if cnt > 0 {
                        put(j, rd * es, &inputs[i][sd * es..(sd + cnt) * es]);
                    }
                }
            }
        }
    }
    drop(keep);
    Ok(())
}

/// A rank's queued operations run as one stream job (see the module docs for the group order).
fn run_ops(ops: Vec<Op>) -> Result<(), AclError> {
    let mut first_err = None;
    let mut note = |r: Result<(), AclError>| {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    };
    let mut sends = Vec::new();
    let mut rest = Vec::new();
    for op in ops {
        match op {
            Op::Send { shared, key, desc } => {
                shared.p2p_post(key, true, desc);
                sends.push((shared, key));
            }
            other => rest.push(other),
        }
    }
    for op in rest {
        match op {
            Op::Recv { shared, key, desc } => {
                shared.p2p_post(key, false, desc);
                note(shared.p2p_wait(key));
            }
            Op::Coll {
                shared,
                rank,
                seq,
                desc,
            } => note(shared.collective(rank, seq, desc)),
            Op::Send { .. } => unreachable!("sends were posted first"),
        }
    }
    for (shared, key) in sends {
        note(shared.p2p_wait(key));
    }
    first_err.map_or(Ok(()), Err)
}

#[derive(Default)]
struct Group {
    depth: u32,
    ops: Vec<(Arc<Stream>, Op)>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::default();
}

fn submit(stream: Arc<Stream>, op: Op) {
    let op = GROUP.with_borrow_mut(|g| {
        if g.depth > 0 {
            g.ops.push((stream.clone(), op));
            None
        } else {
            Some(op)
        }
    });
    if let Some(op) = op {
        stream.enqueue(Box::new(move || run_ops(vec![op])));
    }
}

#[no_mangle]
pub unsafe extern "C" fn HcclGroupStart() -> HcclResult {
    hccl_entry("HcclGroupStart", || {
        GROUP.with_borrow_mut(|g| g.depth += 1);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclGroupEnd() -> HcclResult {
    hccl_entry("HcclGroupEnd", || {
        let ops = GROUP.with_borrow_mut(|g| {
            if g.depth == 0 {
                return Err(HCCL_E_PARA);
            }
            g.depth -= 1;
            Ok(if g.depth == 0 {
                std::mem::take(&mut g.ops)
            } else {
                Vec::new()
            })
        })?;
        let mut per_stream: Vec<(Arc<Stream>, Vec<Op>)> = Vec::new();
        for (s, op) in ops {
            match per_stream.iter_mut().find(|(t, _)| Arc::ptr_eq(t, &s)) {
                Some((_, list)) => list.push(op),
                None => per_stream.push((s, vec![op])),
            }
        }
        for (s, list) in per_stream {
            s.enqueue(Box::new(move || run_ops(list)));
        }
        Ok(())
    })
}

// ---- call-time validation ---------------------------------------------------------------------

fn bytes(elems: u64, es: usize) -> Result<usize, HcclResult> {
    elems
        .checked_mul(es as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or(HCCL_E_PARA)
}

/// `len` bytes at `ptr` inside one device allocation; nothing when `len` is 0.
fn device_buf(ptr: *const c_void, len: usize) -> Result<Option<Range>, HcclResult> {
    if len == 0 {
        return Ok(None);
    }
    if ptr.is_null() {
        return Err(HCCL_E_PTR);
    }
    memory::device_range(ptr as usize, len)
        .map(Some)
        .ok_or(HCCL_E_PARA)
}

fn nonnull(count: u64, ptrs: &[*const c_void]) -> Result<(), HcclResult> {
    if count > 0 && ptrs.iter().any(|p| p.is_null()) {
        return Err(HCCL_E_PTR);
    }
    Ok(())
}

/// HCCL has no default stream: CANN rejects a null one with `HCCL_E_PTR`.
fn stream_of(h: *mut c_void) -> Result<Arc<Stream>, HcclResult> {
    if h.is_null() {
        return Err(HCCL_E_PTR);
    }
    stream::resolve(h).map_err(|_| HCCL_E_PARA)
}

/// The common path of every collective but all-to-all-v. As in CANN, a count of 0 returns
/// success before any check and takes no part in the sequence (it is not a collective at all).
#[allow(clippy::too_many_arguments)]
fn collective(
    kind: Kind,
    comm: *mut c_void,
    stream: *mut c_void,
    send: *const c_void,
    recv: *const c_void,
    count: u64,
    dtype: u32,
    op: Option<u32>,
    root: u32,
) -> Result<(), HcclResult> {
    if count == 0 {
        return Ok(());
    }
    let c = comm_of(comm)?;
    nonnull(count, &[send, recv])?;
    let dtype = dtype_from_raw(dtype)?;
    let op = op.map(op_from_raw).transpose()?;
    let n = u64::from(c.shared.n);
    if root >= c.shared.n {
        return Err(HCCL_E_PARA);
    }
    let es = dtype.size();
    let per_rank = bytes(count, es)?;
    let all_ranks = bytes(count.checked_mul(n).ok_or(HCCL_E_PARA)?, es)?;
    let (send_len, recv_len) = match kind {
        Kind::AllReduce | Kind::Broadcast => (per_rank, per_rank),
        Kind::ReduceScatter => (all_ranks, per_rank),
        Kind::AllGather => (per_rank, all_ranks),
        Kind::AlltoAll => (all_ranks, all_ranks),
        Kind::AlltoAllV => unreachable!("has its own path"),
    };
    let send = device_buf(send, send_len)?;
    let recv = device_buf(recv, recv_len)?;
    let s = stream_of(stream)?;
    let desc = Desc {
        kind,
        count,
        dtype,
        op,
        root,
        send,
        recv,
        v: None,
    };
    submit_coll(&c, s, desc);
    Ok(())
}

fn submit_coll(c: &Comm, s: Arc<Stream>, desc: Desc) {
    let seq = {
        let mut q = lock(&c.seqs);
        q.coll += 1;
        q.coll
    };
    submit(
        s,
        Op::Coll {
            shared: c.shared.clone(),
            rank: c.rank,
            seq,
            desc,
        },
    );
}

#[no_mangle]
pub unsafe extern "C" fn HcclAllReduce(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    count: u64,
    data_type: u32,
    op: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAllReduce", || {
        collective(
            Kind::AllReduce,
            comm,
            stream,
            send_buf,
            recv_buf,
            count,
            data_type,
            Some(op),
            0,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclReduceScatter(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    recv_count: u64,
    data_type: u32,
    op: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclReduceScatter", || {
        let k = Kind::ReduceScatter;
        collective(
            k,
            comm,
            stream,
            send_buf,
            recv_buf,
            recv_count,
            data_type,
            Some(op),
            0,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclAllGather(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    send_count: u64,
    data_type: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAllGather", || {
        collective(
            Kind::AllGather,
            comm,
            stream,
            send_buf,
            recv_buf,
            send_count,
            data_type,
            None,
            0,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclBroadcast(
    buf: *mut c_void,
    count: u64,
    data_type: u32,
    root: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclBroadcast", || {
        collective(
            Kind::Broadcast,
            comm,
            stream,
            buf,
            buf,
            count,
            data_type,
            None,
            root,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclAlltoAll(
    send_buf: *const c_void,
    send_count: u64,
    send_type: u32,
    recv_buf: *const c_void,
    recv_count: u64,
    recv_type: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAlltoAll", || {
        if send_count == 0 && recv_count == 0 {
            return Ok(());
        }
        nonnull(1, &[send_buf, recv_buf])?;
        if send_type != recv_type || send_count != recv_count {
            return Err(HCCL_E_PARA);
        }
        collective(
            Kind::AlltoAll,
            comm,
            stream,
            send_buf,
            recv_buf,
            send_count,
            send_type,
            None,
            0,
        )
    })
}

/// # Safety
/// The four count/displacement pointers each point at `nRanks` `uint64_t`s.
unsafe fn read_counts(p: *const c_void, n: usize) -> Vec<u64> {
    // SAFETY: caller's contract (checked non-null).
    unsafe { std::slice::from_raw_parts(p.cast::<u64>(), n) }.to_vec()
}

/// Bytes from the buffer start to the end of the furthest non-empty block.
fn extent(counts: &[u64], displs: &[u64], es: usize) -> Result<usize, HcclResult> {
    let mut end = 0u64;
    for (&c, &d) in counts.iter().zip(displs) {
        if c > 0 {
            end = end.max(d.checked_add(c).ok_or(HCCL_E_PARA)?);
        }
    }
    bytes(end, es)
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn HcclAlltoAllV(
    send_buf: *const c_void,
    send_counts: *const c_void,
    sdispls: *const c_void,
    send_type: u32,
    recv_buf: *const c_void,
    recv_counts: *const c_void,
    rdispls: *const c_void,
    recv_type: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclAlltoAllV", || {
        let c = comm_of(comm)?;
        if [send_counts, sdispls, recv_counts, rdispls]
            .iter()
            .any(|p| p.is_null())
        {
            return Err(HCCL_E_PTR);
        }
        if send_type != recv_type {
            return Err(HCCL_E_PARA);
        }
        let dtype = dtype_from_raw(send_type)?;
        let n = c.shared.n as usize;
        // SAFETY: header contract, checked non-null.
        let v = unsafe {
            VCounts {
                scounts: read_counts(send_counts, n),
                sdispls: read_counts(sdispls, n),
                rcounts: read_counts(recv_counts, n),
                rdispls: read_counts(rdispls, n),
            }
        };
        let es = dtype.size();
        let send_len = extent(&v.scounts, &v.sdispls, es)?;
        let recv_len = extent(&v.rcounts, &v.rdispls, es)?;
        nonnull(send_len as u64, &[send_buf])?;
        nonnull(recv_len as u64, &[recv_buf])?;
        let send = device_buf(send_buf, send_len)?;
        let recv = device_buf(recv_buf, recv_len)?;
        let s = stream_of(stream)?;
        let desc = Desc {
            kind: Kind::AlltoAllV,
            count: 0,
            dtype,
            op: None,
            root: 0,
            send,
            recv,
            v: Some(v),
        };
        submit_coll(&c, s, desc);
        Ok(())
    })
}

/// Count 0 succeeds at once (as in CANN). A rank may send to itself: inside a group that pairs
/// with its own receive; outside one it waits for a receive queued behind it, and times out.
fn p2p(
    comm: *mut c_void,
    stream: *mut c_void,
    buf: *const c_void,
    count: u64,
    dtype: u32,
    peer: u32,
    is_send: bool,
) -> Result<(), HcclResult> {
    if count == 0 {
        return Ok(());
    }
    let c = comm_of(comm)?;
    nonnull(count, &[buf])?;
    let dtype = dtype_from_raw(dtype)?;
    if peer >= c.shared.n {
        return Err(HCCL_E_PARA);
    }
    let buf = device_buf(buf, bytes(count, dtype.size())?)?;
    let s = stream_of(stream)?;
    let desc = PDesc { buf, count, dtype };
    let shared = c.shared.clone();
    let mut q = lock(&c.seqs);
    let op = if is_send {
        let seq = &mut q.send[peer as usize];
        *seq += 1;
        Op::Send {
            shared,
            key: (c.rank, peer, *seq),
            desc,
        }
    } else {
        let seq = &mut q.recv[peer as usize];
        *seq += 1;
        Op::Recv {
            shared,
            key: (peer, c.rank, *seq),
            desc,
        }
    };
    drop(q);
    submit(s, op);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn HcclSend(
    send_buf: *mut c_void,
    count: u64,
    data_type: u32,
    dest_rank: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclSend", || {
        p2p(comm, stream, send_buf, count, data_type, dest_rank, true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn HcclRecv(
    recv_buf: *mut c_void,
    count: u64,
    data_type: u32,
    src_rank: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> HcclResult {
    hccl_device_entry("HcclRecv", || {
        p2p(comm, stream, recv_buf, count, data_type, src_rank, false)
    })
}

/// An `HcclDataType`; INT128 is a valid enum value the emulator (like several CANN releases)
/// does not support.
fn dtype_from_raw(v: u32) -> Result<DType, HcclResult> {
    use DType::*;
    Ok(match v {
        0 => I8,
        1 => I16,
        2 => I32,
        3 => F16,
        4 => F32,
        5 => I64,
        6 => U64,
        7 => U8,
        8 => U16,
        9 => U32,
        10 => F64,
        11 => BF16,
        HCCL_DATA_TYPE_INT128 => return Err(HCCL_E_NOT_SUPPORT),
        _ => return Err(HCCL_E_PARA),
    })
}

fn op_from_raw(v: u32) -> Result<ReduceOp, HcclResult> {
    match v {
        HCCL_REDUCE_SUM => Ok(ReduceOp::Sum),
        HCCL_REDUCE_PROD => Ok(ReduceOp::Prod),
        HCCL_REDUCE_MAX => Ok(ReduceOp::Max),
        HCCL_REDUCE_MIN => Ok(ReduceOp::Min),
        _ => Err(HCCL_E_PARA),
    }
}

#[cfg(test)]
mod enum_tests {
    use super::*;

    #[test]
    fn enums() {
        assert_eq!(dtype_from_raw(12), Err(HCCL_E_NOT_SUPPORT));
        assert_eq!(dtype_from_raw(13), Err(HCCL_E_PARA));
        assert_eq!(dtype_from_raw(11).map(DType::size), Ok(2));
        assert_eq!(op_from_raw(4), Err(HCCL_E_PARA));
    }
}
