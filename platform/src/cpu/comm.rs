//! cpu collectives: ranks are threads of one process that meet in rendezvous rounds.
//!
//! Each collective takes a sequence number on its communicator when issued; the stream job of
//! every rank arrives at the round of that number with its buffers, the last arrival checks that
//! all ranks asked for the same operation, then each rank moves its share of the data and waits
//! until every rank finished (so no one reuses a buffer a peer still reads). Sends and receives
//! meet in per-pair mailboxes instead, matched in order.

use crate::sync::lock;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::memory::MemRef;
use super::reduce::reduce;
use crate::collective::Collective;
use crate::dtype::DType;
use crate::error::{BackendKind, Error, ErrorKind, Result};
use crate::place::Place;

pub(crate) type Op = Collective<Option<Place<MemRef>>>;

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

struct Rounds<T> {
    by_seq: HashMap<u64, Round<T>>,
    /// Set once the communicator is aborted: every round not yet complete fails with it.
    aborted: Option<Error>,
    /// Ranks whose communicator is gone: a round still waiting for one of them fails.
    departed: Vec<bool>,
}

/// Numbered meeting points of the `world` ranks of one communicator.
pub(crate) struct Rendezvous<T> {
    world: usize,
    rounds: Mutex<Rounds<T>>,
    cv: Condvar,
}

/// The error a collective issued on an aborted communicator reports: the first cause, named.
fn aborted(op: &'static str, cause: &Error) -> Error {
    Error {
        operation: op.into(),
        message: format!(
            "the communicator was aborted by an earlier failure ({}: {})",
            cause.operation, cause.message
        ),
        ..cause.clone()
    }
}

impl<T> Rendezvous<T> {
    fn new(world: usize) -> Self {
        Rendezvous {
            world,
            rounds: Mutex::new(Rounds {
                by_seq: HashMap::new(),
                aborted: None,
                departed: vec![false; world],
            }),
            cv: Condvar::new(),
        }
    }

    fn round(rounds: &mut Rounds<T>, seq: u64, world: usize) -> &mut Round<T> {
        rounds.by_seq.entry(seq).or_insert_with(|| Round {
            arrivals: (0..world).map(|_| None).collect(),
            arrived: 0,
            outcome: None,
            left: 0,
        })
    }

    /// Fails every round not yet complete, now and later, with `cause` (the first one kept).
    fn abort(&self, cause: &Error) {
        let mut rounds = lock(&self.rounds);
        if rounds.aborted.is_none() {
            rounds.aborted = Some(cause.clone());
        }
        self.cv.notify_all();
    }

    fn depart(&self, rank: usize) {
        lock(&self.rounds).departed[rank] = true;
        self.cv.notify_all();
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
        let world = self.world;
        let round = Self::round(&mut rounds, seq, world);
        if let Some(outcome) = &round.outcome {
            // The round already failed (a peer timed out waiting for this rank).
            return outcome.clone();
        }
        if let Some(cause) = &rounds.aborted {
            return Err(aborted(op, cause));
        }
        let round = Self::round(&mut rounds, seq, world);
        round.arrivals[rank] = Some(value);
        round.arrived += 1;
        if round.arrived == world {
            let all: Vec<T> = round
                .arrivals
                .iter_mut()
                .map(|a| a.take().expect("arrived"))
                .collect();
            round.outcome = Some(check(&all).map(|()| Arc::new(all)));
            self.cv.notify_all();
        }
        let gone = |r: &Rounds<T>| {
            let round = r.by_seq.get(&seq)?;
            (0..world).find(|&q| round.arrivals[q].is_none() && r.departed[q] && q != rank)
        };
        let (mut rounds, timed_out) = wait_until(&self.cv, rounds, deadline, |r| {
            r.aborted.is_some()
                || r.by_seq.get(&seq).is_some_and(|r| r.outcome.is_some())
                || gone(r).is_some()
        });
        let cause = rounds.aborted.clone();
        let departed = gone(&rounds);
        let round = Self::round(&mut rounds, seq, world);
        if let Some(outcome) = &round.outcome {
            return outcome.clone();
        }
        let e = match (cause, departed) {
            (Some(cause), _) => aborted(op, &cause),
            (None, Some(q)) => err(
                ErrorKind::Internal,
                op,
                format!("rank {q} destroyed its communicator before reaching this collective"),
            ),
            (None, None) => {
                debug_assert!(timed_out);
                let missing: Vec<usize> = (0..world)
                    .filter(|&r| round.arrivals[r].is_none() && r != rank)
                    .collect();
                err(
                    ErrorKind::Timeout,
                    op,
                    format!("ranks {missing:?} did not reach this collective within {timeout:?}"),
                )
            }
        };
        round.outcome = Some(Err(e.clone()));
        self.cv.notify_all();
        Err(e)
    }

    /// Marks this rank done with round `seq` without waiting for the others.
    fn leave(&self, seq: u64) {
        let mut rounds = lock(&self.rounds);
        let round = Self::round(&mut rounds, seq, self.world);
        round.left += 1;
        if round.left == self.world {
            rounds.by_seq.remove(&seq);
            self.cv.notify_all();
        }
    }

    /// Marks this rank done with round `seq` and waits until every rank is.
    fn finish(&self, seq: u64, timeout: Duration, op: &'static str) -> Result<()> {
        self.leave(seq);
        let rounds = lock(&self.rounds);
        let (_guard, timed_out) = wait_until(&self.cv, rounds, Instant::now() + timeout, |r| {
            !r.by_seq.contains_key(&seq)
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

#[derive(Default)]
struct Mail {
    /// (from, to) → sends not yet received.
    queues: HashMap<(usize, usize), VecDeque<Deposit>>,
    /// Set once the communicator is aborted: receives fail with it instead of waiting.
    aborted: Option<Error>,
    /// Ranks whose communicator is gone: nothing more comes from them or reaches them.
    departed: HashSet<usize>,
}

/// A sub-communicator being handed out, and how many of its members took it.
type PendingSplit = (Arc<CommShared>, usize);

/// State shared by every rank of one communicator.
pub(crate) struct CommShared {
    world: usize,
    timeout: Duration,
    streams: Rendezvous<Arrival>,
    host: Rendezvous<Vec<Vec<usize>>>,
    mail: Mutex<Mail>,
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
            mail: Mutex::new(Mail::default()),
            mail_cv: Condvar::new(),
            splits: Mutex::new(HashMap::new()),
        })
    }
}

impl CommShared {
    /// Aborts the communicator as `ncclCommAbort` does, on every rank at once: collectives
    /// queued or issued later fail with `cause` (the first cause is kept) instead of each
    /// waiting out the timeout for a peer that will never come.
    pub(crate) fn abort(&self, cause: &Error) {
        self.streams.abort(cause);
        self.host.abort(cause);
        let mut mail = lock(&self.mail);
        let cause = mail.aborted.get_or_insert_with(|| cause.clone()).clone();
        for d in mail.queues.values_mut().flat_map(|q| q.drain(..)) {
            *lock(&d.ack.outcome) = Some(Err(aborted("send", &cause)));
            d.ack.cv.notify_all();
        }
        self.mail_cv.notify_all();
    }

    /// `rank` will never issue anything again: rounds and receives waiting for it, and sends
    /// to it, fail at once. (Pairs of other ranks keep exchanging messages.)
    fn depart(&self, rank: usize) {
        self.streams.depart(rank);
        self.host.depart(rank);
        let mut mail = lock(&self.mail);
        mail.departed.insert(rank);
        for ((_, to), queue) in mail.queues.iter_mut() {
            if *to == rank {
                for d in queue.drain(..) {
                    *lock(&d.ack.outcome) = Some(Err(gone_peer("send", rank)));
                    d.ack.cv.notify_all();
                }
            }
        }
        self.mail_cv.notify_all();
    }
}

fn gone_peer(op: &'static str, rank: usize) -> Error {
    err(
        ErrorKind::Internal,
        op,
        format!("rank {rank} destroyed its communicator (its thread failed or finished)"),
    )
}

/// One rank's communicator.
pub struct CommMember {
    pub(crate) shared: Arc<CommShared>,
    pub(crate) rank: usize,
    next_seq: AtomicU64,
    next_split: AtomicU64,
}

pub(crate) type CpuComm = Arc<CommMember>;

/// A rank whose last handle is gone (its thread failed, or it finished) will never reach
/// another collective: its peers fail at once instead of waiting for it.
impl Drop for CommMember {
    fn drop(&mut self) {
        self.shared.depart(self.rank);
    }
}

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
        if let Err(e) = outcome {
            sh.abort(&e);
            return Err(e);
        }
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
            issued.comm.shared.abort(&e);
            first_error.get_or_insert(e);
        }
    }
    for (comm, ack) in acks {
        if let Err(e) = wait_send(&comm, &ack) {
            comm.shared.abort(&e);
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
    let mut mail = lock(&sh.mail);
    if let Some(cause) = &mail.aborted {
        *lock(&ack.outcome) = Some(Err(aborted("send", cause)));
        return ack;
    }
    if mail.departed.contains(&peer) {
        *lock(&ack.outcome) = Some(Err(gone_peer("send", peer)));
        return ack;
    }
    mail.queues
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
    for queue in mail.queues.values_mut() {
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
        m.aborted.is_some()
            || m.queues.get(&key).is_some_and(|q| !q.is_empty())
            || m.departed.contains(&peer)
    });
    if let Some(cause) = &mail.aborted {
        return Err(aborted("recv", cause));
    }
    let Some(deposit) = mail.queues.get_mut(&key).and_then(VecDeque::pop_front) else {
        if mail.departed.contains(&peer) {
            return Err(gone_peer("recv", peer));
        }
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
        if let (Some(src), Some(dst)) = (&deposit.data, &recv) {
            let (s, d) = (src.mem.at(src.offset), dst.mem.at(dst.offset));
            // SAFETY: both ranges were bounds-checked at issue; the sender waits for the ack.
            unsafe { std::ptr::copy(s, d, count * dtype.size()) };
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
        Some(p) => p.mem.at(p.offset + elem_offset * size),
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
