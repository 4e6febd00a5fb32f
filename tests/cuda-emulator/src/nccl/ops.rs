//! The operations on the streams: what each rank queues, the rendezvous per call number where
//! the last rank to arrive moves every rank's data, receives that wait for their message, and
//! the validation every call shares.

use super::*;

pub(super) enum Op {
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
    pub(super) fn is_send(&self) -> bool {
        matches!(self, Op::Send { .. })
    }

    fn comm(&self) -> &Comm {
        match self {
            Op::Collective { comm, .. } | Op::Send { comm, .. } | Op::Recv { comm, .. } => comm,
        }
    }

    /// Runs on the stream; `Err` fails the stream and sets the communicator's async error.
    pub(super) fn run(self) -> Result<(), CuResult> {
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

pub(super) fn receive(
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
pub(super) unsafe fn bytes_at(p: usize, len: usize) -> Vec<u8> {
    // SAFETY: caller's contract.
    unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec()
}

/// # Safety
/// `p` is valid for `data.len()` bytes.
pub(super) unsafe fn write_at(p: usize, data: &[u8]) {
    // SAFETY: caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, data.len()) };
}

/// Moves the data of a collective whose ranks all arrived (with their buffers, held by their
/// stream jobs and checked against the agreed description at the call).
pub(super) fn perform(d: &Desc, ptrs: &[(usize, usize)]) {
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

pub(super) fn run_collective(
    comm: &Comm,
    seq: u64,
    send: usize,
    recv: usize,
) -> Result<(), NcclResult> {
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

pub(super) fn leave(st: &mut GroupState, seq: u64, world: usize) {
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
pub(super) fn register(comm: &Comm, desc: Desc) -> u64 {
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
pub(super) fn stream_for(comm: &Comm, h: *mut c_void) -> Result<Arc<Stream>, NcclResult> {
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
pub(super) fn device_range(p: *const c_void, bytes: usize, what: &str) -> Result<Held, NcclResult> {
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
pub(super) fn submit(s: Arc<Stream>, op: Op) {
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
pub(super) fn broken(comm: &Comm) -> Option<NcclResult> {
    lock(&comm.clique.state).failed
}
