//! cpu collectives: ranks are threads of one process that meet in rendezvous rounds.
//!
//! Each collective takes a sequence number on its communicator when issued; the stream job of
//! every rank arrives at the round of that number with its buffers, the last arrival checks that
//! all ranks asked for the same operation, then each rank moves its share of the data and waits
//! until every rank finished (so no one reuses a buffer a peer still reads). Sends and receives
//! meet in per-pair mailboxes instead, matched in order.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::memory::MemRef;
use super::reduce::reduce;
use crate::backend::Place;
use crate::collective::Collective;
use crate::dtype::DType;
use crate::error::{BackendKind, Error, ErrorKind, Result};

pub(crate) type Op = Collective<Option<Place<MemRef>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn err(kind: ErrorKind, op: &'static str, msg: impl Into<String>) -> Error {
    Error::new(kind, BackendKind::Cpu, op, msg)
}

/// Waits on `cv` until `done(state)` or the deadline; returns the guard and whether it timed out.
fn wait_until<'a, T>(
    cv: &Condvar,
    mut guard: MutexGuard<'a, T>,
    deadline: Instant,
    mut done: impl FnMut(&mut T) -> bool,
) -> (MutexGuard<'a, T>, bool) {
    loop {
        if done(&mut guard) {
            return (guard, false);
        }
        let now = Instant::now();
        if now >= deadline {
            return (guard, true);
        }
        guard = cv
            .wait_timeout(guard, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

struct Round<T> {
    arrivals: Vec<Option<T>>,
    arrived: usize,
    outcome: Option<Result<Arc<Vec<T>>>>,
    left: usize,
}

/// Numbered meeting points of the `world` ranks of one communicator.
pub(crate) struct Rendezvous<T> {
    world: usize,
    rounds: Mutex<HashMap<u64, Round<T>>>,
    cv: Condvar,
}

impl<T> Rendezvous<T> {
    fn new(world: usize) -> Self {
        Rendezvous {
            world,
            rounds: Mutex::new(HashMap::new()),
            cv: Condvar::new(),
        }
    }

    fn round(rounds: &mut HashMap<u64, Round<T>>, seq: u64, world: usize) -> &mut Round<T> {
        rounds.entry(seq).or_insert_with(|| Round {
            arrivals: (0..world).map(|_| None).collect(),
            arrived: 0,
            outcome: None,
            left: 0,
        })
    }

    /// Deposits this rank's value in round `seq` and returns every rank's once all arrived and
    /// `check` accepted them.
    fn arrive(
        &self,
        seq: u64,
        rank: usize,
        value: T,
        timeout: Duration,
        op: &'static str,
        check: impl FnOnce(&[T]) -> Result<()>,
    ) -> Result<Arc<Vec<T>>> {
        let deadline = Instant::now() + timeout;
        let mut rounds = lock(&self.rounds);
        let round = Self::round(&mut rounds, seq, self.world);
        if let Some(outcome) = &round.outcome {
            // The round already failed (a peer timed out waiting for this rank).
            return outcome.clone();
        }
        round.arrivals[rank] = Some(value);
        round.arrived += 1;
        if round.arrived == self.world {
            let all: Vec<T> = round
                .arrivals
                .iter_mut()
                .map(|a| a.take().expect("arrived"))
                .collect();
            round.outcome = Some(check(&all).map(|()| Arc::new(all)));
            self.cv.notify_all();
        }
        let (mut rounds, timed_out) = wait_until(&self.cv, rounds, deadline, |r| {
            r.get(&seq).is_some_and(|r| r.outcome.is_some())
        });
        let round = Self::round(&mut rounds, seq, self.world);
        if timed_out {
            let missing: Vec<usize> = (0..self.world)
                .filter(|&r| round.arrivals[r].is_none() && r != rank)
                .collect();
            let e = err(
                ErrorKind::Timeout,
                op,
                format!("ranks {missing:?} did not reach this collective within {timeout:?}"),
            );
            round.outcome = Some(Err(e.clone()));
            self.cv.notify_all();
            return Err(e);
        }
        round.outcome.clone().expect("outcome set")
    }

    /// Marks this rank done with round `seq` without waiting for the others.
    fn leave(&self, seq: u64) {
        let mut rounds = lock(&self.rounds);
        let round = Self::round(&mut rounds, seq, self.world);
        round.left += 1;
        if round.left == self.world {
            rounds.remove(&seq);
            self.cv.notify_all();
        }
    }

    /// Marks this rank done with round `seq` and waits until every rank is.
    fn finish(&self, seq: u64, timeout: Duration, op: &'static str) -> Result<()> {
        self.leave(seq);
        let rounds = lock(&self.rounds);
        let (_guard, timed_out) = wait_until(&self.cv, rounds, Instant::now() + timeout, |r| {
            !r.contains_key(&seq)
        });
        if timed_out {
            return Err(err(
                ErrorKind::Timeout,
                op,
                "peers did not finish the collective in time",
            ));
        }
        Ok(())
    }
}

/// What a rank contributes to a round: its view of the operation and its buffers.
#[derive(Clone)]
struct Arrival {
    signature: String,
    places: Vec<Option<Place<MemRef>>>,
    /// all_to_all_v: (send_counts, send_displs, recv_counts, recv_displs).
    v: Option<[Vec<usize>; 4]>,
}

struct Ack {
    outcome: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

struct Deposit {
    data: Option<Place<MemRef>>,
    count: usize,
    dtype: DType,
    ack: Arc<Ack>,
}

/// A sub-communicator being handed out, and how many of its members took it.
type PendingSplit = (Arc<CommShared>, usize);

/// State shared by every rank of one communicator.
pub(crate) struct CommShared {
    world: usize,
    timeout: Duration,
    streams: Rendezvous<Arrival>,
    host: Rendezvous<Vec<Vec<usize>>>,
    /// (from, to) → sends not yet received.
    mail: Mutex<HashMap<(usize, usize), VecDeque<Deposit>>>,
    mail_cv: Condvar,
    /// (split round, list index) → the sub-communicator and how many members took it.
    splits: Mutex<HashMap<(u64, usize), PendingSplit>>,
}

impl CommShared {
    pub(crate) fn new(world: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(CommShared {
            world,
            timeout,
            streams: Rendezvous::new(world),
            host: Rendezvous::new(world),
            mail: Mutex::new(HashMap::new()),
            mail_cv: Condvar::new(),
            splits: Mutex::new(HashMap::new()),
        })
    }
}

/// One rank's communicator.
pub struct CommMember {
    pub(crate) shared: Arc<CommShared>,
    pub(crate) rank: usize,
    next_seq: AtomicU64,
    next_split: AtomicU64,
}

pub(crate) type CpuComm = Arc<CommMember>;

impl CommMember {
    pub(crate) fn new(shared: Arc<CommShared>, rank: usize) -> CpuComm {
        Arc::new(CommMember {
            shared,
            rank,
            next_seq: AtomicU64::new(0),
            next_split: AtomicU64::new(0),
        })
    }

    /// Takes the next round number for a rendezvous collective (in issue order, as on NCCL).
    pub(crate) fn take_seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn split(
        &self,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<(CpuComm, usize, usize)>> {
        const OP: &str = "comm_split";
        let sh = &self.shared;
        let seq = self.next_split.fetch_add(1, Ordering::Relaxed);
        let mine = rank_lists.to_vec();
        let outcome = sh.host.arrive(seq, self.rank, mine, sh.timeout, OP, |all| {
            match all.iter().position(|l| *l != all[0]) {
                None => Ok(()),
                Some(r) => Err(err(
                    ErrorKind::Mismatch,
                    OP,
                    format!(
                        "rank 0 passed rank lists {:?} but rank {r} passed {:?}",
                        all[0], all[r]
                    ),
                )),
            }
        });
        sh.host.leave(seq);
        outcome?;
        let Some((index, list)) = rank_lists
            .iter()
            .enumerate()
            .find(|(_, l)| l.contains(&self.rank))
        else {
            return Ok(None);
        };
        let mut splits = lock(&sh.splits);
        let entry = splits
            .entry((seq, index))
            .or_insert_with(|| (CommShared::new(list.len(), sh.timeout), 0));
        let sub = Arc::clone(&entry.0);
        entry.1 += 1;
        if entry.1 == list.len() {
            splits.remove(&(seq, index));
        }
        let rank = list
            .iter()
            .position(|&r| r == self.rank)
            .expect("list holds this rank");
        Ok(Some((CommMember::new(sub, rank), rank, list.len())))
    }
}

/// A collective as queued: the round it meets in (none for send/recv) and its places.
pub(crate) struct Issued {
    pub comm: CpuComm,
    pub seq: Option<u64>,
    pub op: Op,
}

impl Issued {
    pub(crate) fn new(comm: &CpuComm, op: Op) -> Issued {
        let seq = match op {
            Collective::Send { .. } | Collective::Recv { .. } => None,
            _ => Some(comm.take_seq()),
        };
        Issued {
            comm: Arc::clone(comm),
            seq,
            op,
        }
    }
}

/// Runs collectives issued together (a group, or a single one): sends are posted first so
/// send/recv pairs in one group cannot wait on each other, then the rest run in issue order,
/// then the sends wait for their receivers.
pub(crate) fn run_group(ops: Vec<Issued>) -> Result<()> {
    let mut first_error = None;
    let mut acks = Vec::new();
    let mut rest = Vec::new();
    for issued in ops {
        match issued.op {
            Collective::Send {
                send,
                count,
                dtype,
                peer,
            } => {
                acks.push((
                    Arc::clone(&issued.comm),
                    post_send(&issued.comm, send, count, dtype, peer),
                ));
            }
            _ => rest.push(issued),
        }
    }
    for issued in rest {
        let outcome = match issued.op {
            Collective::Recv {
                recv,
                count,
                dtype,
                peer,
            } => receive(&issued.comm, recv, count, dtype, peer),
            op => run_collective(
                &issued.comm,
                issued.seq.expect("rendezvous op has a round"),
                op,
            ),
        };
        if let Err(e) = outcome {
            first_error.get_or_insert(e);
        }
    }
    for (comm, ack) in acks {
        if let Err(e) = wait_send(&comm, &ack) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

fn post_send(
    comm: &CommMember,
    data: Option<Place<MemRef>>,
    count: usize,
    dtype: DType,
    peer: usize,
) -> Arc<Ack> {
    let ack = Arc::new(Ack {
        outcome: Mutex::new(None),
        cv: Condvar::new(),
    });
    let sh = &comm.shared;
    lock(&sh.mail)
        .entry((comm.rank, peer))
        .or_default()
        .push_back(Deposit {
            data,
            count,
            dtype,
            ack: Arc::clone(&ack),
        });
    sh.mail_cv.notify_all();
    ack
}

fn wait_send(comm: &CommMember, ack: &Arc<Ack>) -> Result<()> {
    let sh = &comm.shared;
    let guard = lock(&ack.outcome);
    let (mut guard, timed_out) =
        wait_until(&ack.cv, guard, Instant::now() + sh.timeout, |o| o.is_some());
    if let Some(outcome) = guard.take() {
        return outcome;
    }
    debug_assert!(timed_out);
    drop(guard);
    // Withdraw the deposit so a late receiver cannot read a buffer the sender may reuse.
    let mut mail = lock(&sh.mail);
    for queue in mail.values_mut() {
        queue.retain(|d| !Arc::ptr_eq(&d.ack, ack));
    }
    drop(mail);
    // A receiver may have taken it just before the withdrawal; its answer wins.
    if let Some(outcome) = lock(&ack.outcome).take() {
        return outcome;
    }
    Err(err(
        ErrorKind::Timeout,
        "send",
        format!("no matching recv within {:?}", sh.timeout),
    ))
}

fn receive(
    comm: &CommMember,
    recv: Option<Place<MemRef>>,
    count: usize,
    dtype: DType,
    peer: usize,
) -> Result<()> {
    let sh = &comm.shared;
    let key = (peer, comm.rank);
    let mail = lock(&sh.mail);
    let (mut mail, _) = wait_until(&sh.mail_cv, mail, Instant::now() + sh.timeout, |m| {
        m.get(&key).is_some_and(|q| !q.is_empty())
    });
    let Some(deposit) = mail.get_mut(&key).and_then(VecDeque::pop_front) else {
        return Err(err(
            ErrorKind::Timeout,
            "recv",
            format!(
                "rank {peer} sent nothing to rank {} within {:?}",
                comm.rank, sh.timeout
            ),
        ));
    };
    drop(mail);
    let outcome = if deposit.count != count || deposit.dtype != dtype {
        Err(err(
            ErrorKind::Mismatch,
            "recv",
            format!(
                "rank {peer} sent {} x {} but rank {} expects {count} x {dtype}",
                deposit.count, deposit.dtype, comm.rank
            ),
        ))
    } else {
        if let (Some((src, so)), Some((dst, doff))) = (&deposit.data, &recv) {
            // SAFETY: both ranges were bounds-checked at issue; the sender waits for the ack.
            unsafe { std::ptr::copy(src.at(*so), dst.at(*doff), count * dtype.size()) };
        }
        Ok(())
    };
    *lock(&deposit.ack.outcome) = Some(outcome.clone());
    deposit.ack.cv.notify_all();
    outcome
}

fn describe(op: &Op) -> String {
    let extra = match op {
        Collective::AllReduce {
            count, dtype, op, ..
        }
        | Collective::ReduceScatter {
            count, dtype, op, ..
        } => {
            format!("count {count}, {dtype}, {op}")
        }
        Collective::AllGather { count, dtype, .. } | Collective::AllToAll { count, dtype, .. } => {
            format!("count {count}, {dtype}")
        }
        Collective::Broadcast {
            count, dtype, root, ..
        } => format!("count {count}, {dtype}, root {root}"),
        Collective::AllToAllV { dtype, .. } => format!("{dtype}"),
        Collective::Send { .. } | Collective::Recv { .. } | Collective::Barrier => String::new(),
    };
    format!("{}({extra})", op.name())
}

fn check_arrivals(op: &'static str, all: &[Arrival]) -> Result<()> {
    if let Some(r) = all.iter().position(|a| a.signature != all[0].signature) {
        return Err(err(
            ErrorKind::Mismatch,
            op,
            format!(
                "rank 0 called {} but rank {r} called {}",
                all[0].signature, all[r].signature
            ),
        ));
    }
    if all[0].v.is_some() {
        for (r, a) in all.iter().enumerate() {
            for (q, b) in all.iter().enumerate() {
                let (sends, recvs) = (&a.v.as_ref().expect("v")[0], &b.v.as_ref().expect("v")[2]);
                if sends[q] != recvs[r] {
                    return Err(err(
                        ErrorKind::Mismatch,
                        op,
                        format!(
                            "rank {r} sends {} elements to rank {q}, which expects {} from it",
                            sends[q], recvs[r]
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

fn ptr(place: &Option<Place<MemRef>>, elem_offset: usize, size: usize) -> *mut u8 {
    match place {
        Some((m, off)) => m.at(off + elem_offset * size),
        None => std::ptr::null_mut(),
    }
}

/// `lo..hi` of `count` elements owned by `rank` when split as evenly as possible.
fn share(count: usize, world: usize, rank: usize) -> (usize, usize) {
    let (base, extra) = (count / world, count % world);
    let lo = rank * base + rank.min(extra);
    (lo, lo + base + usize::from(rank < extra))
}

fn run_collective(comm: &CommMember, seq: u64, op: Op) -> Result<()> {
    let name = op.name();
    let sh = &comm.shared;
    let (rank, world) = (comm.rank, sh.world);
    let signature = describe(&op);
    let v = match &op {
        Collective::AllToAllV {
            send_counts,
            send_displs,
            recv_counts,
            recv_displs,
            ..
        } => Some([
            send_counts.clone(),
            send_displs.clone(),
            recv_counts.clone(),
            recv_displs.clone(),
        ]),
        _ => None,
    };
    let places: Vec<_> = op
        .places(world)
        .into_iter()
        .map(|(p, _)| p.clone())
        .collect();
    let arrival = Arrival {
        signature,
        places,
        v,
    };
    let all = match sh
        .streams
        .arrive(seq, rank, arrival, sh.timeout, name, |a| {
            check_arrivals(name, a)
        }) {
        Ok(all) => all,
        Err(e) => {
            sh.streams.leave(seq);
            return Err(e);
        }
    };
    // SAFETY: every place was bounds-checked at issue for the extent this operation touches;
    // ranks write disjoint ranges, and `finish` keeps every buffer in use until all are done.
    unsafe { move_data(&op, &all, rank, world) };
    sh.streams.finish(seq, sh.timeout, name)
}

unsafe fn move_data(op: &Op, all: &[Arrival], rank: usize, world: usize) {
    let sz = op.dtype().map_or(0, DType::size);
    let mine = &all[rank];
    match op {
        Collective::AllReduce {
            count, dtype, op, ..
        } => {
            let (lo, hi) = share(*count, world, rank);
            if hi > lo {
                let ins: Vec<*const u8> = all
                    .iter()
                    .map(|a| ptr(&a.places[0], lo, sz).cast_const())
                    .collect();
                let outs: Vec<*mut u8> = all.iter().map(|a| ptr(&a.places[1], lo, sz)).collect();
                reduce(*dtype, *op, &ins, &outs, hi - lo);
            }
        }
        Collective::ReduceScatter {
            count, dtype, op, ..
        } => {
            if *count > 0 {
                let ins: Vec<*const u8> = all
                    .iter()
                    .map(|a| ptr(&a.places[0], rank * count, sz).cast_const())
                    .collect();
                reduce(*dtype, *op, &ins, &[ptr(&mine.places[1], 0, sz)], *count);
            }
        }
        Collective::AllGather { count, .. } => {
            if *count > 0 {
                let src = ptr(&mine.places[0], 0, sz);
                for a in all {
                    std::ptr::copy(src, ptr(&a.places[1], rank * count, sz), count * sz);
                }
            }
        }
        Collective::Broadcast { count, root, .. } => {
            if *count > 0 && rank != *root {
                let src = ptr(&all[*root].places[0], 0, sz);
                std::ptr::copy_nonoverlapping(src, ptr(&mine.places[0], 0, sz), count * sz);
            }
        }
        Collective::AllToAll { count, .. } => {
            if *count > 0 {
                for (q, a) in all.iter().enumerate() {
                    let src = ptr(&a.places[0], rank * count, sz);
                    std::ptr::copy_nonoverlapping(
                        src,
                        ptr(&mine.places[1], q * count, sz),
                        count * sz,
                    );
                }
            }
        }
        Collective::AllToAllV { recv_displs, .. } => {
            for (q, a) in all.iter().enumerate() {
                let v = a.v.as_ref().expect("all_to_all_v counts");
                let n = v[0][rank];
                if n > 0 {
                    let src = ptr(&a.places[0], v[1][rank], sz);
                    std::ptr::copy_nonoverlapping(
                        src,
                        ptr(&mine.places[1], recv_displs[q], sz),
                        n * sz,
                    );
                }
            }
        }
        Collective::Send { .. } | Collective::Recv { .. } | Collective::Barrier => {}
    }
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn shares_cover_count_exactly() {
        for count in 0..40 {
            for world in 1..9 {
                let mut next = 0;
                for r in 0..world {
                    let (lo, hi) = share(count, world, r);
                    assert_eq!(lo, next);
                    next = hi;
                }
                assert_eq!(next, count);
            }
        }
    }
}
