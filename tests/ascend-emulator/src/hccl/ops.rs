//! The operations on the streams: the meeting per sequence number where the last rank to arrive
//! checks and performs the operation for every rank, send/recv per (src, dst) pair, and groups
//! that become one job per stream.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    AlltoAll,
    AlltoAllV,
}

/// One rank's view of a collective; every field but the buffers must agree across ranks.
pub(super) struct Desc {
    pub(super) kind: Kind,
    pub(super) count: u64,
    pub(super) dtype: DType,
    pub(super) op: Option<ReduceOp>,
    pub(super) root: u32,
    pub(super) send: Option<Range>,
    pub(super) recv: Option<Range>,
    pub(super) v: Option<VCounts>,
}

/// All-to-all-v counts and displacements, in elements, one per peer.
pub(super) struct VCounts {
    pub(super) scounts: Vec<u64>,
    pub(super) sdispls: Vec<u64>,
    pub(super) rcounts: Vec<u64>,
    pub(super) rdispls: Vec<u64>,
}

pub(super) struct PDesc {
    pub(super) buf: Option<Range>,
    pub(super) count: u64,
    pub(super) dtype: DType,
}

pub(super) enum Op {
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

pub(super) const ASYNC_ERR: AclError = ACL_ERROR_RT_INTERNAL_ERROR;

impl Shared {
    pub(super) fn wait<'a>(
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

    pub(super) fn collective(&self, rank: u32, seq: u64, desc: Desc) -> Result<(), AclError> {
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

    pub(super) fn p2p_post(&self, key: P2pKey, is_send: bool, desc: PDesc) {
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

    pub(super) fn p2p_wait(&self, key: P2pKey) -> Result<(), AclError> {
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

pub(super) fn transfer(s: &PDesc, r: &PDesc) -> Result<(), AclError> {
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
pub(super) fn perform(descs: &[Option<Desc>]) -> Result<(), AclError> {
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
pub(super) fn run_ops(ops: Vec<Op>) -> Result<(), AclError> {
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
pub(super) struct Group {
    pub(super) depth: u32,
    pub(super) ops: Vec<(Arc<Stream>, Op)>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::default();
}

pub(super) fn submit(stream: Arc<Stream>, op: Op) {
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
