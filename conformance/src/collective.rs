//! collective: every collective over worlds of 1, 2, 3, 4 and 8 ranks (threads), against the
//! scalar reference in [`crate::reference`].
//!
//! Each case builds a plan per world on the host — every rank's initial buffer images, the
//! calls in issue order and the expected contents — then runs every rank in its own thread with
//! its own communicator, stream and buffers. A rank issues all its calls, synchronizes once and
//! verifies, so a mismatch never leaves a peer waiting in a collective. Results sit in regions
//! separated by guard bytes that must keep their initial value.
//!
//! (Over 800 lines because it holds one plan builder per collective kind over one runner.)

use std::sync::{Barrier, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use hprt_platform::{
    BackendKind, Collective, Communicator, DType, DeviceBuffer, Platform, ReduceOp, Stream,
};

use crate::reference::{self, Expected};
use crate::util::{check_bytes, download, hash, panic_message, pattern, upload, Arena, Skipped};

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
        handles
            .into_iter()
            .enumerate()
            .filter_map(|(rank, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("rank {rank}: {e:#}")),
                Err(panic) => Some(format!("rank {rank} panicked: {}", panic_message(&*panic))),
            })
            .collect()
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

fn all_reduce_plans(world: usize) -> Vec<RankPlan> {
    let (mut sa, mut ra) = (Arena::default(), Arena::default());
    let mut send_parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
    let mut regions = Vec::new();
    let mut steps = Vec::new();
    // Counts are not multiples of the world size (for world > 1).
    let sized = sized_combos(|j| world * (125 + j % 3) + 1, 2 * 4096 * world + 5);
    for (j, (op, dtype, count)) in sized.into_iter().enumerate() {
        let bytes = count * dtype.size();
        let (so, ro) = (sa.take(bytes), ra.take(bytes));
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|r| reference::input(dtype, Some(op), seed(1, world, j, r), count))
            .collect();
        regions.push(Region {
            off: ro,
            len: bytes,
            dtype,
            expected: Some(reference::reduce(dtype, op, &refs(&inputs))),
            label: format!("all_reduce {dtype} {op} count {count}"),
        });
        for (r, input) in inputs.into_iter().enumerate() {
            send_parts[r].push((so, input));
        }
        steps.push(Step::Call(Collective::AllReduce {
            send: At::Send(so),
            recv: At::Recv(ro),
            count,
            dtype,
            op,
        }));
    }
    send_parts
        .iter()
        .map(|parts| {
            let parts: Vec<(usize, &[u8])> =
                parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
            RankPlan {
                send: image(sa.total(), &parts),
                recv: vec![FILL; ra.total()],
                regions: regions.clone(),
                steps: steps.clone(),
            }
        })
        .collect()
}

/// all_reduce × every op × every dtype, counts not divisible by the world size.
pub(crate) fn all_reduce(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |w| run_plans(p, all_reduce_plans(w)))
}

fn reduce_scatter_plans(world: usize) -> Vec<RankPlan> {
    let (mut sa, mut ra) = (Arena::default(), Arena::default());
    let mut plans = vec![RankPlan::default(); world];
    let mut send_parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
    let sized = sized_combos(|j| 37 + world + j % 3, 9001);
    for (j, (op, dtype, count)) in sized.into_iter().enumerate() {
        let sz = dtype.size();
        let (so, ro) = (sa.take(world * count * sz), ra.take(count * sz));
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|r| reference::input(dtype, Some(op), seed(2, world, j, r), world * count))
            .collect();
        for (r, plan) in plans.iter_mut().enumerate() {
            let blocks: Vec<&[u8]> = inputs
                .iter()
                .map(|v| &v[r * count * sz..(r + 1) * count * sz])
                .collect();
            plan.regions.push(Region {
                off: ro,
                len: count * sz,
                dtype,
                expected: Some(reference::reduce(dtype, op, &blocks)),
                label: format!("reduce_scatter {dtype} {op} count {count}"),
            });
            plan.steps.push(Step::Call(Collective::ReduceScatter {
                send: At::Send(so),
                recv: At::Recv(ro),
                count,
                dtype,
                op,
            }));
        }
        for (r, input) in inputs.into_iter().enumerate() {
            send_parts[r].push((so, input));
        }
    }
    for (plan, parts) in plans.iter_mut().zip(&send_parts) {
        let parts: Vec<(usize, &[u8])> = parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
        plan.send = image(sa.total(), &parts);
        plan.recv = vec![FILL; ra.total()];
    }
    plans
}

/// reduce_scatter × every op × every dtype.
pub(crate) fn reduce_scatter(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |w| run_plans(p, reduce_scatter_plans(w)))
}

/// all_gather × every dtype.
pub(crate) fn all_gather(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
        for (j, dtype) in DType::ALL.into_iter().enumerate() {
            let count = 53 + world + j;
            let sz = dtype.size();
            let (so, ro) = (sa.take(count * sz), ra.take(world * count * sz));
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(3, world, j, r), count))
                .collect();
            let gathered = Expected::exact(inputs.concat());
            for plan in plans.iter_mut() {
                plan.regions.push(Region {
                    off: ro,
                    len: world * count * sz,
                    dtype,
                    expected: Some(gathered.clone()),
                    label: format!("all_gather {dtype} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllGather {
                    send: At::Send(so),
                    recv: At::Recv(ro),
                    count,
                    dtype,
                }));
            }
            for (r, input) in inputs.into_iter().enumerate() {
                send_parts[r].push((so, input));
            }
        }
        for (plan, parts) in plans.iter_mut().zip(&send_parts) {
            let parts: Vec<(usize, &[u8])> =
                parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
            plan.send = image(sa.total(), &parts);
            plan.recv = vec![FILL; ra.total()];
        }
        run_plans(p, plans)
    })
}

/// broadcast from every root, a few dtypes.
pub(crate) fn broadcast(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::I8, DType::I64];
    for_worlds(&WORLDS, |world| {
        let mut ra = Arena::default();
        let mut plans = vec![RankPlan::default(); world];
        let mut parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
        for root in 0..world {
            for (j, dtype) in DTYPES.into_iter().enumerate() {
                let count = 77 + 3 * root + j;
                let combo = root * DTYPES.len() + j;
                let off = ra.take(count * dtype.size());
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|r| reference::input(dtype, None, seed(4, world, combo, r), count))
                    .collect();
                for (r, plan) in plans.iter_mut().enumerate() {
                    plan.regions.push(Region {
                        off,
                        len: count * dtype.size(),
                        dtype,
                        expected: Some(Expected::exact(inputs[root].clone())),
                        label: format!("broadcast {dtype} count {count} from root {root}"),
                    });
                    plan.steps.push(Step::Call(Collective::Broadcast {
                        buf: At::Recv(off),
                        count,
                        dtype,
                        root,
                    }));
                    parts[r].push((off, inputs[r].clone()));
                }
            }
        }
        for (plan, parts) in plans.iter_mut().zip(&parts) {
            let parts: Vec<(usize, &[u8])> =
                parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
            plan.recv = image(ra.total(), &parts);
        }
        run_plans(p, plans)
    })
}

/// all_to_all: block q of rank r's send lands in block r of rank q's recv.
pub(crate) fn all_to_all(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::I32,
        DType::U8,
        DType::I64,
        DType::F64,
    ];
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
        for (j, dtype) in DTYPES.into_iter().enumerate() {
            let count = 3 + 2 * j + world;
            let sz = dtype.size();
            let blk = count * sz;
            let (so, ro) = (sa.take(world * blk), ra.take(world * blk));
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(5, world, j, r), world * count))
                .collect();
            for (r, plan) in plans.iter_mut().enumerate() {
                let want: Vec<u8> = inputs
                    .iter()
                    .flat_map(|v| v[r * blk..(r + 1) * blk].iter().copied())
                    .collect();
                plan.regions.push(Region {
                    off: ro,
                    len: world * blk,
                    dtype,
                    expected: Some(Expected::exact(want)),
                    label: format!("all_to_all {dtype} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllToAll {
                    send: At::Send(so),
                    recv: At::Recv(ro),
                    count,
                    dtype,
                }));
            }
            for (r, input) in inputs.into_iter().enumerate() {
                send_parts[r].push((so, input));
            }
        }
        for (plan, parts) in plans.iter_mut().zip(&send_parts) {
            let parts: Vec<(usize, &[u8])> =
                parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
            plan.send = image(sa.total(), &parts);
            plan.recv = vec![FILL; ra.total()];
        }
        run_plans(p, plans)
    })
}

/// Elements spanned by blocks of `counts` at `displs` (empty blocks ignored).
fn extent(counts: &[usize], displs: &[usize]) -> usize {
    counts
        .iter()
        .zip(displs)
        .filter(|(c, _)| **c > 0)
        .map(|(c, d)| c + d)
        .max()
        .unwrap_or(0)
}

/// all_to_all_v with uneven (some zero) counts; send blocks packed with one-element gaps, recv
/// blocks in reverse peer order with two-element gaps.
pub(crate) fn all_to_all_v(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 4] = [DType::F64, DType::I8, DType::BF16, DType::I32];
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
        for (j, dtype) in DTYPES.into_iter().enumerate() {
            let sz = dtype.size();
            // cnt[r][q]: elements rank r sends to rank q.
            let cnt: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    (0..world)
                        .map(|q| ((r + 2 * q + j) % 4) * 5 + (r * q + j) % 3)
                        .collect()
                })
                .collect();
            let sd: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    (0..world)
                        .map(|q| (0..q).map(|k| cnt[r][k] + 1).sum())
                        .collect()
                })
                .collect();
            let rc: Vec<Vec<usize>> = (0..world)
                .map(|r| (0..world).map(|q| cnt[q][r]).collect())
                .collect();
            let rd: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    (0..world)
                        .map(|q| (q + 1..world).map(|k| rc[r][k] + 2).sum())
                        .collect()
                })
                .collect();
            // Every rank uses the same region offsets, sized for the largest extent.
            let send_ext = (0..world)
                .map(|r| extent(&cnt[r], &sd[r]))
                .max()
                .unwrap_or(0);
            let recv_ext = (0..world)
                .map(|r| extent(&rc[r], &rd[r]))
                .max()
                .unwrap_or(0);
            let (so, ro) = (sa.take(send_ext * sz), ra.take(recv_ext * sz));
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(6, world, j, r), send_ext))
                .collect();
            for (r, plan) in plans.iter_mut().enumerate() {
                for q in 0..world {
                    let n = rc[r][q];
                    if n == 0 {
                        continue;
                    }
                    let from = &inputs[q][sd[q][r] * sz..(sd[q][r] + n) * sz];
                    plan.regions.push(Region {
                        off: ro + rd[r][q] * sz,
                        len: n * sz,
                        dtype,
                        expected: Some(Expected::exact(from.to_vec())),
                        label: format!("all_to_all_v {dtype}: {n} elements from rank {q}"),
                    });
                }
                plan.steps.push(Step::Call(Collective::AllToAllV {
                    send: At::Send(so),
                    recv: At::Recv(ro),
                    send_counts: cnt[r].clone(),
                    send_displs: sd[r].clone(),
                    recv_counts: rc[r].clone(),
                    recv_displs: rd[r].clone(),
                    dtype,
                }));
            }
            for (r, input) in inputs.into_iter().enumerate() {
                send_parts[r].push((so, input));
            }
        }
        for (plan, parts) in plans.iter_mut().zip(&send_parts) {
            let parts: Vec<(usize, &[u8])> =
                parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
            plan.send = image(sa.total(), &parts);
            plan.recv = vec![FILL; ra.total()];
        }
        run_plans(p, plans)
    })
}

/// send/recv in a ring inside one group (each rank sends two messages per dtype to rank+1 and
/// receives from rank-1, recvs issued before sends), then the reverse ring in a second group.
pub(crate) fn send_recv_ring(p: &dyn Platform) -> Result<()> {
    const DTYPES: [DType; 3] = [DType::F32, DType::I64, DType::U8];
    for_worlds(&WORLDS, |world| {
        let (mut sa, mut ra) = (Arena::default(), Arena::default());
        let mut plans = vec![RankPlan::default(); world];
        let mut send_parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
        for (dir, shift) in [(0usize, 1usize), (1, world - 1)] {
            // Each message: (dtype, count, send offset, recv offset).
            let mut msgs = Vec::new();
            for (j, dtype) in DTYPES.into_iter().enumerate() {
                for m in 0..2 {
                    let count = 31 + 7 * j + 5 * m + dir;
                    let bytes = count * dtype.size();
                    msgs.push((j * 2 + m, dtype, count, sa.take(bytes), ra.take(bytes)));
                }
            }
            for (r, plan) in plans.iter_mut().enumerate() {
                let to = (r + shift) % world;
                let from = (r + world - shift) % world;
                plan.steps.push(Step::GroupStart);
                for &(k, dtype, count, so, ro) in &msgs {
                    plan.steps.push(Step::Call(Collective::Recv {
                        recv: At::Recv(ro),
                        count,
                        dtype,
                        peer: from,
                    }));
                    plan.steps.push(Step::Call(Collective::Send {
                        send: At::Send(so),
                        count,
                        dtype,
                        peer: to,
                    }));
                    let combo = dir * 100 + k;
                    send_parts[r].push((
                        so,
                        reference::input(dtype, None, seed(7, world, combo, r), count),
                    ));
                    plan.regions.push(Region {
                        off: ro,
                        len: count * dtype.size(),
                        dtype,
                        expected: Some(Expected::exact(reference::input(
                            dtype,
                            None,
                            seed(7, world, combo, from),
                            count,
                        ))),
                        label: format!(
                            "{} ring: message {} ({dtype} count {count}) from rank {from}",
                            if dir == 0 { "forward" } else { "backward" },
                            k % 2
                        ),
                    });
                }
                plan.steps.push(Step::GroupEnd);
            }
        }
        for (plan, parts) in plans.iter_mut().zip(&send_parts) {
            let parts: Vec<(usize, &[u8])> =
                parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
            plan.send = image(sa.total(), &parts);
            plan.recv = vec![FILL; ra.total()];
        }
        run_plans(p, plans)
    })
}

/// Ungrouped send/recv between pairs (2k, 2k+1): even ranks send then receive, odd ranks
/// receive then send.
pub(crate) fn send_recv_pairs(p: &dyn Platform) -> Result<()> {
    for_worlds(&[2, 4, 8], |world| {
        let count = |from: usize, to: usize| 500 + 10 * from + to;
        let data = |from: usize, to: usize| {
            reference::input(
                DType::I32,
                None,
                seed(8, world, from * 16 + to, from),
                count(from, to),
            )
        };
        let plans = (0..world)
            .map(|r| {
                let peer = r ^ 1;
                let (mut sa, mut ra) = (Arena::default(), Arena::default());
                let so = sa.take(count(r, peer) * 4);
                let ro = ra.take(count(peer, r) * 4);
                let send = Step::Call(Collective::Send {
                    send: At::Send(so),
                    count: count(r, peer),
                    dtype: DType::I32,
                    peer,
                });
                let recv = Step::Call(Collective::Recv {
                    recv: At::Recv(ro),
                    count: count(peer, r),
                    dtype: DType::I32,
                    peer,
                });
                RankPlan {
                    send: image(sa.total(), &[(so, &data(r, peer))]),
                    recv: vec![FILL; ra.total()],
                    regions: vec![Region {
                        off: ro,
                        len: count(peer, r) * 4,
                        dtype: DType::I32,
                        expected: Some(Expected::exact(data(peer, r))),
                        label: format!("message from rank {peer}"),
                    }],
                    steps: if r % 2 == 0 {
                        vec![send, recv]
                    } else {
                        vec![recv, send]
                    },
                }
            })
            .collect();
        run_plans(p, plans)
    })
}

/// A barrier completes only once every rank issued it: ranks arrive staggered and mark their
/// arrival on the host before issuing; after synchronizing, every rank must see all marks.
pub(crate) fn barrier(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |world| {
        let arrived = Mutex::new(vec![false; world]);
        run_world(p, world, |r| {
            std::thread::sleep(Duration::from_millis(3 * r.rank as u64));
            arrived.lock().unwrap()[r.rank] = true;
            r.p.barrier(&r.comm, &r.stream)?;
            r.p.synchronize_stream(&r.stream)?;
            let seen = arrived.lock().unwrap().clone();
            if let Some(q) = seen.iter().position(|a| !a) {
                bail!("the barrier completed before rank {q} issued it");
            }
            // Back-to-back barriers.
            for _ in 0..3 {
                r.p.barrier(&r.comm, &r.stream)?;
            }
            r.p.synchronize_stream(&r.stream)?;
            Ok(())
        })
    })
}

/// In place: all_reduce (send = recv), all_gather (send = recv + rank block) and reduce_scatter
/// (recv = send + rank block), all in one buffer.
pub(crate) fn in_place(p: &dyn Platform) -> Result<()> {
    const AR: [(DType, ReduceOp); 7] = [
        (DType::F32, ReduceOp::Sum),
        (DType::BF16, ReduceOp::Sum),
        (DType::I32, ReduceOp::Prod),
        (DType::F64, ReduceOp::Max),
        (DType::U8, ReduceOp::Min),
        (DType::F16, ReduceOp::Avg),
        (DType::I8, ReduceOp::Avg),
    ];
    const AG: [DType; 3] = [DType::F32, DType::I8, DType::F16];
    const RS: [(DType, ReduceOp); 3] = [
        (DType::F32, ReduceOp::Sum),
        (DType::I64, ReduceOp::Sum),
        (DType::BF16, ReduceOp::Max),
    ];
    for_worlds(&WORLDS, |world| {
        let mut ra = Arena::default();
        let mut plans = vec![RankPlan::default(); world];
        let mut parts: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); world];
        for (j, (dtype, op)) in AR.into_iter().enumerate() {
            let count = 100 * world + 1;
            let bytes = count * dtype.size();
            let off = ra.take(bytes);
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, Some(op), seed(9, world, j, r), count))
                .collect();
            let expected = reference::reduce(dtype, op, &refs(&inputs));
            for (r, plan) in plans.iter_mut().enumerate() {
                plan.regions.push(Region {
                    off,
                    len: bytes,
                    dtype,
                    expected: Some(expected.clone()),
                    label: format!("in-place all_reduce {dtype} {op} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllReduce {
                    send: At::Recv(off),
                    recv: At::Recv(off),
                    count,
                    dtype,
                    op,
                }));
                parts[r].push((off, inputs[r].clone()));
            }
        }
        for (j, dtype) in AG.into_iter().enumerate() {
            let count = 41 + j;
            let blk = count * dtype.size();
            let off = ra.take(world * blk);
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, None, seed(10, world, j, r), count))
                .collect();
            let gathered = Expected::exact(inputs.concat());
            for (r, plan) in plans.iter_mut().enumerate() {
                plan.regions.push(Region {
                    off,
                    len: world * blk,
                    dtype,
                    expected: Some(gathered.clone()),
                    label: format!("in-place all_gather {dtype} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::AllGather {
                    send: At::Recv(off + r * blk),
                    recv: At::Recv(off),
                    count,
                    dtype,
                }));
                // Other ranks' blocks start as this rank's noise.
                let mut init = pattern(seed(11, world, j, r), world * blk);
                init[r * blk..(r + 1) * blk].copy_from_slice(&inputs[r]);
                parts[r].push((off, init));
            }
        }
        for (j, (dtype, op)) in RS.into_iter().enumerate() {
            let count = 29 + j;
            let blk = count * dtype.size();
            let off = ra.take(world * blk);
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| reference::input(dtype, Some(op), seed(12, world, j, r), world * count))
                .collect();
            for (r, plan) in plans.iter_mut().enumerate() {
                let blocks: Vec<&[u8]> =
                    inputs.iter().map(|v| &v[r * blk..(r + 1) * blk]).collect();
                // The rest of the send blocks is unspecified after an in-place reduce_scatter.
                plan.regions.push(Region {
                    off,
                    len: world * blk,
                    dtype,
                    expected: None,
                    label: String::new(),
                });
                plan.regions.push(Region {
                    off: off + r * blk,
                    len: blk,
                    dtype,
                    expected: Some(reference::reduce(dtype, op, &blocks)),
                    label: format!("in-place reduce_scatter {dtype} {op} count {count}"),
                });
                plan.steps.push(Step::Call(Collective::ReduceScatter {
                    send: At::Recv(off),
                    recv: At::Recv(off + r * blk),
                    count,
                    dtype,
                    op,
                }));
                parts[r].push((off, inputs[r].clone()));
            }
        }
        for (plan, parts) in plans.iter_mut().zip(&parts) {
            let parts: Vec<(usize, &[u8])> =
                parts.iter().map(|(o, v)| (*o, v.as_slice())).collect();
            plan.recv = image(ra.total(), &parts);
        }
        run_plans(p, plans)
    })
}

/// Count 0 for every collective (from a zero-size send buffer), then a real all_reduce to show
/// the ranks still agree on what comes next.
pub(crate) fn zero_count(p: &dyn Platform) -> Result<()> {
    for_worlds(&WORLDS, |world| {
        let mut ra = Arena::default();
        let a = ra.take(256);
        let count = 5;
        let last = ra.take(count * 4);
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                reference::input(
                    DType::I32,
                    Some(ReduceOp::Sum),
                    seed(13, world, 0, r),
                    count,
                )
            })
            .collect();
        let expected = reference::reduce(DType::I32, ReduceOp::Sum, &refs(&inputs));
        let plans = (0..world)
            .map(|r| {
                let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
                let dtype = DType::F32;
                let steps = vec![
                    Step::Call(Collective::AllReduce {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype,
                        op: ReduceOp::Sum,
                    }),
                    Step::Call(Collective::AllGather {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype: DType::I8,
                    }),
                    Step::Call(Collective::ReduceScatter {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype: DType::BF16,
                        op: ReduceOp::Max,
                    }),
                    Step::Call(Collective::Broadcast {
                        buf: At::Recv(a),
                        count: 0,
                        dtype,
                        root: world - 1,
                    }),
                    Step::Call(Collective::AllToAll {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        count: 0,
                        dtype,
                    }),
                    Step::Call(Collective::AllToAllV {
                        send: At::Send(0),
                        recv: At::Recv(a),
                        send_counts: vec![0; world],
                        send_displs: vec![0; world],
                        recv_counts: vec![0; world],
                        recv_displs: vec![0; world],
                        dtype,
                    }),
                    Step::GroupStart,
                    Step::Call(Collective::Send {
                        send: At::Send(0),
                        count: 0,
                        dtype,
                        peer: next,
                    }),
                    Step::Call(Collective::Recv {
                        recv: At::Recv(a),
                        count: 0,
                        dtype,
                        peer: prev,
                    }),
                    Step::GroupEnd,
                    Step::Call(Collective::AllReduce {
                        send: At::Recv(last),
                        recv: At::Recv(last),
                        count,
                        dtype: DType::I32,
                        op: ReduceOp::Sum,
                    }),
                ];
                RankPlan {
                    send: Vec::new(),
                    recv: image(ra.total(), &[(last, &inputs[r])]),
                    regions: vec![Region {
                        off: last,
                        len: count * 4,
                        dtype: DType::I32,
                        expected: Some(expected.clone()),
                        label: "all_reduce after the count-0 collectives".into(),
                    }],
                    steps,
                }
            })
            .collect();
        run_plans(p, plans)
    })
}

/// Six dependent all_reduces with device copies between them on one stream: x -> y, y -> x, ...
pub(crate) fn chained(p: &dyn Platform) -> Result<()> {
    const OPS: [ReduceOp; 6] = [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Prod,
        ReduceOp::Sum,
    ];
    for_worlds(&WORLDS, |world| {
        let count = 100;
        let bytes = count * 8;
        let mut ra = Arena::default();
        let (x, y) = (ra.take(bytes), ra.take(bytes));
        let mut current: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                (0..count as i64)
                    .flat_map(|i| (r as i64 + 1 + i).to_le_bytes())
                    .collect()
            })
            .collect();
        let initial = current.clone();
        let mut steps = Vec::new();
        for op in OPS {
            let out = reference::reduce(DType::I64, op, &refs(&current)).bytes;
            current = vec![out; world];
            steps.push(Step::Call(Collective::AllReduce {
                send: At::Recv(x),
                recv: At::Recv(y),
                count,
                dtype: DType::I64,
                op,
            }));
            steps.push(Step::Copy(At::Recv(x), At::Recv(y), bytes));
        }
        let final_ = Expected::exact(current[0].clone());
        let plans = (0..world)
            .map(|r| RankPlan {
                send: Vec::new(),
                recv: image(ra.total(), &[(x, &initial[r])]),
                regions: [x, y]
                    .into_iter()
                    .map(|off| Region {
                        off,
                        len: bytes,
                        dtype: DType::I64,
                        expected: Some(final_.clone()),
                        label: "after 6 chained all_reduces".into(),
                    })
                    .collect(),
                steps: steps.clone(),
            })
            .collect();
        run_plans(p, plans)
    })
}

/// Plan for a collective over a sub-communicator whose members are `members` (global ranks in
/// sub-rank order): an i32 sum all_reduce and an f32 all_gather of rank-specific inputs.
fn split_plan(tag: usize, members: &[usize], me: usize) -> RankPlan {
    let n = members.len();
    let mut ra = Arena::default();
    let (count_r, count_g) = (50, 20);
    let (a_in, a_out, g_out) = (
        ra.take(count_r * 4),
        ra.take(count_r * 4),
        ra.take(n * count_g * 4),
    );
    let sum_in = |g: usize| {
        reference::input(
            DType::I32,
            Some(ReduceOp::Sum),
            seed(14, tag, 0, g),
            count_r,
        )
    };
    let gat_in = |g: usize| reference::input(DType::F32, None, seed(14, tag, 1, g), count_g);
    let sub_rank = members.iter().position(|&g| g == me).expect("member");
    let all_sum: Vec<Vec<u8>> = members.iter().map(|&g| sum_in(g)).collect();
    let all_gat: Vec<Vec<u8>> = members.iter().map(|&g| gat_in(g)).collect();
    let g_send = g_out + sub_rank * count_g * 4;
    RankPlan {
        send: Vec::new(),
        recv: image(ra.total(), &[(a_in, &sum_in(me)), (g_send, &gat_in(me))]),
        regions: vec![
            Region {
                off: a_out,
                len: count_r * 4,
                dtype: DType::I32,
                expected: Some(reference::reduce(
                    DType::I32,
                    ReduceOp::Sum,
                    &refs(&all_sum),
                )),
                label: format!("all_reduce over ranks {members:?}"),
            },
            Region {
                off: g_out,
                len: n * count_g * 4,
                dtype: DType::F32,
                expected: Some(Expected::exact(all_gat.concat())),
                label: format!("all_gather over ranks {members:?} (blocks in list order)"),
            },
        ],
        steps: vec![
            Step::Call(Collective::AllReduce {
                send: At::Recv(a_in),
                recv: At::Recv(a_out),
                count: count_r,
                dtype: DType::I32,
                op: ReduceOp::Sum,
            }),
            Step::Call(Collective::AllGather {
                send: At::Recv(g_send),
                recv: At::Recv(g_out),
                count: count_g,
                dtype: DType::F32,
            }),
        ],
    }
}

/// comm_split on a world of 4: [[0,2],[1,3]] gives each pair its own communicator; [[3,1,0]]
/// leaves rank 2 without one and numbers the others in list order; the parent keeps working.
pub(crate) fn comm_split(p: &dyn Platform) -> Result<()> {
    run_world(p, 4, |r| {
        let lists = [vec![0, 2], vec![1, 3]];
        let sub = r
            .p
            .comm_split(&r.comm, &lists)?
            .ok_or_else(|| anyhow!("comm_split({lists:?}) gave rank {} no communicator", r.rank))?;
        let members = &lists[r.rank % 2];
        ensure!(
            sub.world() == 2 && sub.rank() == r.rank / 2,
            "comm_split({lists:?}) gave rank {} sub-rank {} of {}, expected {} of 2",
            r.rank,
            sub.rank(),
            sub.world(),
            r.rank / 2
        );
        execute(r, &sub, &split_plan(1, members, r.rank)).context("in sub-communicator 1")?;

        let lists = [vec![3, 1, 0]];
        let sub2 = r.p.comm_split(&r.comm, &lists)?;
        match (r.rank, &sub2) {
            (2, None) => {}
            (2, Some(c)) => bail!("rank 2 is in no list of {lists:?} but got {c:?}"),
            (_, None) => bail!("rank {} is in {lists:?} but got no communicator", r.rank),
            (_, Some(c)) => {
                let want = lists[0].iter().position(|&g| g == r.rank).unwrap();
                ensure!(
                    c.world() == 3 && c.rank() == want,
                    "comm_split({lists:?}) gave rank {} sub-rank {} of {}, expected {want} of 3",
                    r.rank,
                    c.rank(),
                    c.world()
                );
                execute(r, c, &split_plan(2, &lists[0], r.rank))
                    .context("in sub-communicator 2")?;
            }
        }
        // The parent still works after the splits.
        execute(r, &r.comm, &split_plan(3, &[0, 1, 2, 3], r.rank))
            .context("in the parent after splitting")?;
        r.p.destroy_comm(&sub)?;
        if let Some(c) = sub2 {
            r.p.destroy_comm(&c)?;
        }
        Ok(())
    })
}
