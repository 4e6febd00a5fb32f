//! The calls the fault tables of both emulator binaries (`cuda_emulator.rs`, `npu_backend.rs`)
//! make, one per call class: each a `FaultCase`'s call, so the two tables run the same code
//! and differ only in the driver function, status and name they expect.
#![allow(dead_code)] // each binary's table uses its own subset

use hprt_platform::{Communicator, DType, DeviceBuffer, Platform, ReduceOp, Result, Stream};

pub fn alloc_device(p: &dyn Platform, _: &Stream) -> Result<()> {
    p.alloc_device(64).map(drop)
}

pub fn alloc_pinned(p: &dyn Platform, _: &Stream) -> Result<()> {
    p.alloc_pinned(64).map(drop)
}

pub fn create_stream(p: &dyn Platform, _: &Stream) -> Result<()> {
    p.create_stream().map(drop)
}

pub fn create_timing_event(p: &dyn Platform, _: &Stream) -> Result<()> {
    p.create_event(true).map(drop)
}

pub fn record_event(p: &dyn Platform, s: &Stream) -> Result<()> {
    let e = p.create_event(false)?;
    p.record_event(&e, s)
}

pub fn copy_pinned_to_device(p: &dyn Platform, s: &Stream) -> Result<()> {
    let d = p.alloc_device(64)?;
    let h = p.alloc_pinned(64)?;
    p.copy_async((&d).into(), 0, (&h).into(), 0, 64, s)
}

pub fn memset(p: &dyn Platform, s: &Stream) -> Result<()> {
    let d = p.alloc_device(64)?;
    p.memset_async(&d, 0, 1, 64, s)
}

pub fn synchronize_stream(p: &dyn Platform, s: &Stream) -> Result<()> {
    p.synchronize_stream(s)
}

pub fn unique_id(p: &dyn Platform, _: &Stream) -> Result<()> {
    p.unique_id().map(drop)
}

pub fn comm_init(p: &dyn Platform, _: &Stream) -> Result<()> {
    solo_comm(p).map(drop)
}

pub fn all_reduce_sum(p: &dyn Platform, s: &Stream) -> Result<()> {
    all_reduce(p, s, ReduceOp::Sum)
}

pub fn all_reduce_avg(p: &dyn Platform, s: &Stream) -> Result<()> {
    all_reduce(p, s, ReduceOp::Avg)
}

pub fn all_gather(p: &dyn Platform, s: &Stream) -> Result<()> {
    let (c, d) = comm_and_buffer(p)?;
    p.all_gather((&d).into(), (&d).into(), 16, DType::F32, &c, s)
}

pub fn reduce_scatter_sum(p: &dyn Platform, s: &Stream) -> Result<()> {
    let (c, d) = comm_and_buffer(p)?;
    let op = ReduceOp::Sum;
    p.reduce_scatter((&d).into(), (&d).into(), 16, DType::F32, op, &c, s)
}

pub fn broadcast(p: &dyn Platform, s: &Stream) -> Result<()> {
    let (c, d) = comm_and_buffer(p)?;
    p.broadcast((&d).into(), 16, DType::F32, 0, &c, s)
}

pub fn group(p: &dyn Platform, _: &Stream) -> Result<()> {
    p.group_start()?;
    p.group_end()
}

fn all_reduce(p: &dyn Platform, s: &Stream, op: ReduceOp) -> Result<()> {
    let (c, d) = comm_and_buffer(p)?;
    p.all_reduce((&d).into(), (&d).into(), 16, DType::F32, op, &c, s)
}

/// A world of one.
fn solo_comm(p: &dyn Platform) -> Result<Communicator> {
    let id = p.unique_id()?;
    p.comm_init(&id, 0, 1)
}

/// A world of one and 64 device bytes (16 f32s) for its collective.
fn comm_and_buffer(p: &dyn Platform) -> Result<(Communicator, DeviceBuffer)> {
    Ok((solo_comm(p)?, p.alloc_device(64)?))
}
