//! C entry points of the platform layer's collectives: rendezvous ids, communicators, and the
//! all-reduce, all-gather, reduce-scatter, broadcast and barrier on a stream.

use super::*;

/// Makes a rendezvous id on rank 0: `*out_len` bytes written to `out_id` (capacity
/// `capacity`, at most `HPRT_UNIQUE_ID_MAX_BYTES`); hand them to every rank's `hprt_comm_init`.
///
/// # Safety
/// `out_id` valid for `capacity` bytes; `out_len` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_unique_id(
    platform: *const HprtPlatform,
    out_id: *mut u8,
    capacity: usize,
    out_len: *mut usize,
) -> HprtStatus {
    guard("hprt_unique_id", || {
        let id = arg(platform, "platform")?.get().unique_id()?;
        if out_id.is_null() {
            return Err(FfiError::null("out_id"));
        }
        if id.0.len() > capacity {
            return Err(FfiError {
                status: HprtStatus::ErrorBufferTooSmall,
                message: format!(
                    "the unique id needs {} bytes, the buffer has {capacity}",
                    id.0.len()
                ),
            });
        }
        // SAFETY: `out_id` holds `capacity >= len` bytes by contract.
        unsafe { std::ptr::copy_nonoverlapping(id.0.as_ptr(), out_id, id.0.len()) };
        // SAFETY: the caller's contract.
        unsafe { out(out_len, "out_len", id.0.len()) }
    })
}

/// Joins rank `rank` of a world of `world`; blocks until every rank joined.
///
/// # Safety
/// `id` valid for `id_len` bytes; `out_comm` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn hprt_comm_init(
    platform: *const HprtPlatform,
    id: *const u8,
    id_len: usize,
    rank: usize,
    world: usize,
    out_comm: *mut *mut HprtComm,
) -> HprtStatus {
    guard("hprt_comm_init", || {
        let p = arg(platform, "platform")?.get();
        if id.is_null() {
            return Err(FfiError::null("id"));
        }
        // Ids are at most this long: a larger length is a caller's mistake, refused before it
        // is read or copied.
        if id_len > HPRT_UNIQUE_ID_MAX_BYTES {
            return Err(FfiError::invalid(format!(
                "id_len {id_len} is above HPRT_UNIQUE_ID_MAX_BYTES ({HPRT_UNIQUE_ID_MAX_BYTES})"
            )));
        }
        // SAFETY: `id` holds `id_len` bytes by contract.
        let id = UniqueId(unsafe { std::slice::from_raw_parts(id, id_len) }.to_vec());
        // SAFETY: the caller's contract.
        unsafe {
            publish(out_comm, "out_comm", || {
                Ok(HprtComm(p.comm_init(&id, rank, world)?))
            })
        }
    })
}

/// # Safety
/// `comm` from `hprt_comm_init` of `platform`; afterwards the handle is invalid (`HPRT_STATUS_ERROR_INVALID_HANDLE`).
#[no_mangle]
pub unsafe extern "C" fn hprt_comm_destroy(
    platform: *const HprtPlatform,
    comm: *mut HprtComm,
) -> HprtStatus {
    guard("hprt_comm_destroy", || {
        destroy_on(platform, comm, "comm", |p, c| p.destroy_comm(&c.0))
    })
}

/// The arguments every collective entry point resolves first.
fn collective_args<'a>(
    platform: *const HprtPlatform,
    comm: *const HprtComm,
    stream: *const HprtStream,
) -> FfiResult<(&'a dyn Platform, &'a Communicator, &'a Stream)> {
    Ok((
        arg(platform, "platform")?.get(),
        &arg(comm, "comm")?.0,
        &arg(stream, "stream")?.0,
    ))
}

fn device<'a>(b: *const HprtDeviceBuffer, what: &str) -> FfiResult<&'a DeviceBuffer> {
    Ok(&arg(b, what)?.0)
}

/// `recv[i] = op over ranks of send[i]` for `count` elements (in place when both are the same
/// buffer and offset).
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_all_reduce(
    platform: *const HprtPlatform,
    comm: *const HprtComm,
    send: *const HprtDeviceBuffer,
    send_offset: usize,
    recv: *const HprtDeviceBuffer,
    recv_offset: usize,
    count: usize,
    dtype: i32,
    op: i32,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_all_reduce", || {
        let (p, c, s) = collective_args(platform, comm, stream)?;
        let (a, b) = (device(send, "send")?, device(recv, "recv")?);
        p.all_reduce(
            a.at(send_offset),
            b.at(recv_offset),
            count,
            dtype_arg(dtype)?,
            op_arg(op)?,
            c,
            s,
        )?;
        Ok(())
    })
}

/// Every rank's `count` elements, concatenated in rank order into `recv`.
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_all_gather(
    platform: *const HprtPlatform,
    comm: *const HprtComm,
    send: *const HprtDeviceBuffer,
    send_offset: usize,
    recv: *const HprtDeviceBuffer,
    recv_offset: usize,
    count: usize,
    dtype: i32,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_all_gather", || {
        let (p, c, s) = collective_args(platform, comm, stream)?;
        let (a, b) = (device(send, "send")?, device(recv, "recv")?);
        p.all_gather(
            a.at(send_offset),
            b.at(recv_offset),
            count,
            dtype_arg(dtype)?,
            c,
            s,
        )?;
        Ok(())
    })
}

/// Reduces `world * count` elements and leaves rank r's `count`-element block in `recv`.
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_reduce_scatter(
    platform: *const HprtPlatform,
    comm: *const HprtComm,
    send: *const HprtDeviceBuffer,
    send_offset: usize,
    recv: *const HprtDeviceBuffer,
    recv_offset: usize,
    count: usize,
    dtype: i32,
    op: i32,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_reduce_scatter", || {
        let (p, c, s) = collective_args(platform, comm, stream)?;
        let (a, b) = (device(send, "send")?, device(recv, "recv")?);
        p.reduce_scatter(
            a.at(send_offset),
            b.at(recv_offset),
            count,
            dtype_arg(dtype)?,
            op_arg(op)?,
            c,
            s,
        )?;
        Ok(())
    })
}

/// Copies `root`'s `count` elements into every rank's buffer, in place.
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_broadcast(
    platform: *const HprtPlatform,
    comm: *const HprtComm,
    buffer: *const HprtDeviceBuffer,
    offset: usize,
    count: usize,
    dtype: i32,
    root: usize,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_broadcast", || {
        let (p, c, s) = collective_args(platform, comm, stream)?;
        let b = device(buffer, "buffer")?;
        p.broadcast(b.at(offset), count, dtype_arg(dtype)?, root, c, s)?;
        Ok(())
    })
}

/// Completes on `stream` once every rank reached it.
///
/// # Safety
/// All handles live.
#[no_mangle]
pub unsafe extern "C" fn hprt_barrier(
    platform: *const HprtPlatform,
    comm: *const HprtComm,
    stream: *const HprtStream,
) -> HprtStatus {
    guard("hprt_barrier", || {
        let (p, c, s) = collective_args(platform, comm, stream)?;
        p.barrier(c, s)?;
        Ok(())
    })
}
