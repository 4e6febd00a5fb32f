//! collective: every collective over worlds of 1, 2, 3, 4 and 8 ranks (threads), against the
//! scalar reference in [`crate::reference`].
//!
//! Each case builds a plan per world on the host — every rank's initial buffer images, the
//! calls in issue order and the expected contents — then runs every rank in its own thread with
//! its own communicator, stream and buffers. A rank issues all its calls, synchronizes once and
//! verifies, so a mismatch never leaves a peer waiting in a collective. Results sit in regions
//! separated by guard bytes that must keep their initial value.
//!
//! The runner and the plan types are here; the plan builders, one module per family of
//! collectives, are its submodules.

use std::sync::{Barrier, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use hprt_platform::{
    BackendKind, Collective, Communicator, DType, DeviceBuffer, Platform, ReduceOp, Stream,
};

use crate::reference::{self, Expected};
use crate::util::{check_bytes, download, hash, pattern, upload, Arena, Skipped};

mod composed;
mod exchanges;
mod reductions;
mod split;
pub(crate) use composed::{chained, in_place, zero_count};
pub(crate) use exchanges::{all_to_all, all_to_all_v, barrier, send_recv_pairs, send_recv_ring};
pub(crate) use reductions::{all_gather, all_reduce, broadcast, reduce_scatter};
pub(crate) use split::comm_split;

/// World sizes every collective runs on.
pub(crate) const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

/// Initial value of bytes no collective should write.
pub(crate) const FILL: u8 = 0xA5;

/// One rank of a world: its communicator and stream.
pub(crate) struct Rank<'a> {
    pub p: &'a dyn Platform,
    pub comm: Communicator,
    pub stream: Stream,
    pub rank: usize,
}

/// Runs `f` on every rank of a new world of `world` threads: rank 0 makes the unique id, every
/// rank selects device `rank % device_count`, joins the communicator and creates its own stream.
/// Errors name the world and rank.
pub(crate) fn run_world<F>(p: &dyn Platform, world: usize, f: F) -> Result<()>
where
    F: Fn(&Rank<'_>) -> Result<()> + Sync,
{
    if !world_fits(p, world) {
        return Err(Skipped(format!(
            "world {world} needs {world} devices, {} present",
            p.device_count()
        ))
        .into());
    }
    let id = OnceLock::new();
    let id_ready = Barrier::new(world);
    let f = &f;
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (id, id_ready) = (&id, &id_ready);
                scope.spawn(move || -> Result<()> {
                    if rank == 0 {
                        let _ = id.set(p.unique_id().map_err(|e| e.to_string()));
                    }
                    id_ready.wait();
                    let id = id
                        .get()
                        .expect("rank 0 set the id")
                        .clone()
                        .map_err(|e| anyhow!("unique_id on rank 0: {e}"))?;
                    p.set_device(rank % p.device_count().max(1))?;
                    let comm = p.comm_init(&id, rank, world).context("comm_init")?;
                    ensure!(
                        comm.rank() == rank && comm.world() == world,
                        "comm_init gave rank {} of {}",
                        comm.rank(),
                        comm.world()
                    );
                    let stream = p.create_stream()?;
                    let r = Rank {
                        p,
                        comm,
                        stream,
                        rank,
                    };
                    let outcome = f(&r);
                    let sync = p.synchronize_stream(&r.stream);
                    p.destroy_stream(&r.stream)?;
                    p.destroy_comm(&r.comm)?;
                    outcome?;
                    sync.context("final synchronize")?;
                    Ok(())
                })
            })
            .collect();
        crate::util::join_failures(handles, "rank")
    });
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("world {world}: {}", errors.join(" | "))
    }
}

/// Whether `world` ranks fit on `p`. NCCL refuses two ranks of one communicator on the same GPU,
/// so cuda worlds are bounded by the device count (a single GPU runs world 1 only; the larger
/// worlds are reported as skipped). Other backends host any number per device.
pub(crate) fn world_fits(p: &dyn Platform, world: usize) -> bool {
    p.backend() != BackendKind::Cuda || world <= p.device_count()
}

/// Runs `f` for every world size in `worlds`, collecting the failures of all of them; the case
/// is skipped only when every world was.
fn for_worlds(worlds: &[usize], f: impl Fn(usize) -> Result<()>) -> Result<()> {
    let mut errors = Vec::new();
    let mut skipped = Vec::new();
    for &w in worlds {
        match f(w) {
            Ok(()) => {}
            Err(e) => match e.downcast_ref::<Skipped>() {
                Some(s) => skipped.push(s.0.clone()),
                None => errors.push(format!("{e:#}")),
            },
        }
    }
    if !errors.is_empty() {
        bail!("{}", errors.join("\n"))
    }
    if skipped.len() == worlds.len() {
        return Err(Skipped(skipped.join("; ")).into());
    }
    Ok(())
}

/// A place in a rank's two buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) enum At {
    Send(usize),
    Recv(usize),
}

/// One thing a rank issues on its stream.
#[derive(Clone, Debug)]
pub(crate) enum Step {
    Call(Collective<At>),
    GroupStart,
    GroupEnd,
    /// A device-to-device copy on the same stream (`dst`, `src`, bytes).
    Copy(At, At, usize),
}

/// Expected contents of `len` bytes at `off` of the recv buffer (`None`: unspecified).
#[derive(Clone, Debug)]
pub(crate) struct Region {
    pub off: usize,
    pub len: usize,
    pub dtype: DType,
    pub expected: Option<Expected>,
    pub label: String,
}

/// What one rank does and expects.
#[derive(Clone, Debug, Default)]
pub(crate) struct RankPlan {
    /// Initial image of the send buffer, which must be unchanged at the end.
    pub send: Vec<u8>,
    /// Initial image of the recv buffer; bytes outside every region must keep it.
    pub recv: Vec<u8>,
    pub regions: Vec<Region>,
    pub steps: Vec<Step>,
}

/// A buffer image of `len` bytes of [`FILL`] with `parts` copied in.
fn image(len: usize, parts: &[(usize, &[u8])]) -> Vec<u8> {
    let mut v = vec![FILL; len];
    for (off, bytes) in parts {
        v[*off..*off + bytes.len()].copy_from_slice(bytes);
    }
    v
}

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(Vec::as_slice).collect()
}

fn summarize(what: &str, errors: Vec<String>) -> Result<()> {
    if errors.is_empty() {
        return Ok(());
    }
    let n = errors.len();
    let shown: Vec<String> = errors.into_iter().take(4).collect();
    let more = if n > 4 {
        format!("; and {} more", n - 4)
    } else {
        String::new()
    };
    bail!("{what}: {n} problem(s): {}{more}", shown.join("; "))
}

/// Checks `actual` against the regions; bytes outside them must equal `initial`.
fn verify(what: &str, actual: &[u8], initial: &[u8], regions: &[Region]) -> Result<()> {
    let mut covered = vec![false; actual.len()];
    let mut errors = Vec::new();
    for reg in regions {
        covered[reg.off..reg.off + reg.len].fill(true);
        if let Some(exp) = &reg.expected {
            if let Err(m) = reference::compare(reg.dtype, exp, &actual[reg.off..reg.off + reg.len])
            {
                errors.push(format!("{}: {m}", reg.label));
            }
        }
    }
    if let Some(i) = (0..actual.len()).find(|&i| !covered[i] && actual[i] != initial[i]) {
        errors.push(format!(
            "byte {i} outside every result region changed from {:#04x} to {:#04x}",
            initial[i], actual[i]
        ));
    }
    summarize(what, errors)
}

fn describe(c: &Collective<At>) -> String {
    match c {
        Collective::AllReduce {
            count, dtype, op, ..
        }
        | Collective::ReduceScatter {
            count, dtype, op, ..
        } => format!("{} {dtype} {op} count {count}", c.name()),
        Collective::AllGather { count, dtype, .. }
        | Collective::AllToAll { count, dtype, .. }
        | Collective::Send { count, dtype, .. }
        | Collective::Recv { count, dtype, .. } => format!("{} {dtype} count {count}", c.name()),
        Collective::Broadcast {
            count, dtype, root, ..
        } => format!("broadcast {dtype} count {count} root {root}"),
        Collective::AllToAllV { dtype, .. } => format!("all_to_all_v {dtype}"),
        Collective::Barrier => "barrier".into(),
    }
}

/// Issues `plan` on `comm` from rank `r`, synchronizes and verifies both buffers.
pub(crate) fn execute(r: &Rank<'_>, comm: &Communicator, plan: &RankPlan) -> Result<()> {
    let p = r.p;
    let send = upload(p, &plan.send, &r.stream).context("uploading the send image")?;
    let recv = upload(p, &plan.recv, &r.stream).context("uploading the recv image")?;
    let at = |a: At| match a {
        At::Send(o) => send.at(o),
        At::Recv(o) => recv.at(o),
    };
    let buf = |a: At| -> (&DeviceBuffer, usize) {
        match a {
            At::Send(o) => (&send, o),
            At::Recv(o) => (&recv, o),
        }
    };
    for step in &plan.steps {
        match step {
            Step::Call(c) => {
                let op = c.clone().try_map(|a| Ok(at(a)))?;
                p.collective(comm, op, &r.stream)
                    .with_context(|| format!("issuing {}", describe(c)))?;
            }
            Step::GroupStart => p.group_start()?,
            Step::GroupEnd => p.group_end()?,
            Step::Copy(dst, src, bytes) => {
                let ((d, doff), (s, soff)) = (buf(*dst), buf(*src));
                p.copy_async(d.into(), doff, s.into(), soff, *bytes, &r.stream)?;
            }
        }
    }
    p.synchronize_stream(&r.stream)
        .context("synchronize_stream after the collectives")?;
    let got = download(p, &recv, 0, recv.len(), &r.stream)?;
    verify("recv buffer", &got, &plan.recv, &plan.regions)?;
    let got = download(p, &send, 0, send.len(), &r.stream)?;
    check_bytes(
        "send buffer (collectives must not write it)",
        &plan.send,
        &got,
    )?;
    Ok(())
}

/// Runs per-rank plans on a new world.
fn run_plans(p: &dyn Platform, plans: Vec<RankPlan>) -> Result<()> {
    let world = plans.len();
    run_world(p, world, |r| execute(r, &r.comm, &plans[r.rank]))
}

fn seed(case: u64, world: usize, combo: usize, rank: usize) -> u64 {
    hash(&[case, world as u64, combo as u64, rank as u64])
}

fn combos() -> impl Iterator<Item = (ReduceOp, DType)> {
    ReduceOp::ALL
        .into_iter()
        .flat_map(|op| DType::ALL.into_iter().map(move |d| (op, d)))
}

/// A few combinations repeated with large counts (more than 8192 elements per rank's share), so
/// blocked or chunked implementations cross their block boundaries.
const LARGE: [(ReduceOp, DType); 3] = [
    (ReduceOp::Sum, DType::F32),
    (ReduceOp::Avg, DType::BF16),
    (ReduceOp::Prod, DType::I8),
];

/// Every (op, dtype) with its count: small counts for all, large ones for [`LARGE`].
fn sized_combos(small: impl Fn(usize) -> usize, large: usize) -> Vec<(ReduceOp, DType, usize)> {
    combos()
        .enumerate()
        .map(|(j, (op, d))| (op, d, small(j)))
        .chain(LARGE.into_iter().map(|(op, d)| (op, d, large)))
        .collect()
}
