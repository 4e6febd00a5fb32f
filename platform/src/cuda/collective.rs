//! Collectives over NCCL: issuing each one under the watchdog, all-to-all as grouped sends
//! and receives, `comm_split`, communicator lifetimes.

use super::*;

impl CommObj {
    pub(super) fn ident(&self) -> watchdog::Ident {
        watchdog::Ident {
            raw: self.raw,
            rank: self.rank,
            world: self.world,
        }
    }
}

impl Drop for CommObj {
    fn drop(&mut self) {
        let watch = std::mem::take(self.watch.get_mut().unwrap_or_else(|p| p.into_inner()));
        let (shared, device, ident) = (Arc::clone(&self.shared), self.device, self.ident());
        self.shared.reaper.run_or_defer(move || {
            if let (Ok(n), Ok(())) = (shared.nccl(), shared.bind(device)) {
                watch.close(n, ident, shared.watchdog.timeout());
            }
        });
    }
}

impl CudaBackend {
    pub(super) fn new_comm(
        &self,
        raw: nccl::Comm,
        device: usize,
        rank: usize,
        world: usize,
    ) -> Result<Arc<CommObj>> {
        let scratch = Backend::alloc_device(self, 4)?.0;
        Ok(Arc::new(CommObj {
            shared: Arc::clone(&self.shared),
            raw,
            device,
            rank,
            world,
            scratch,
            watch: Mutex::default(),
        }))
    }

    /// [`Backend::abort_comm`]: `ncclCommAbort` now, its unfinished collectives failing with
    /// the abort as their cause (the communicator is then done: its drop destroys nothing).
    pub(super) fn abort_comm_now(&self, comm: &Arc<CommObj>) -> Result<()> {
        let n = self.shared.nccl()?;
        self.shared.bind(comm.device)?;
        let mut watch = lock(&comm.watch);
        if watch.aborted.is_none() {
            let ident = comm.ident();
            let cause = cuda_err(
                ErrorKind::Internal,
                "abort_comm",
                format!(
                    "rank {} of {} aborted its NCCL communicator (the rank failed)",
                    ident.rank, ident.world
                ),
            );
            watchdog::abort(n, ident, &mut watch, cause);
        }
        Ok(())
    }

    /// [`Backend::comm_split`] by leader id over an all-gather (any NCCL).
    pub(super) fn split_comm(
        &self,
        comm: &Arc<CommObj>,
        rank_lists: &[Vec<usize>],
    ) -> Result<Option<(Arc<CommObj>, usize, usize)>> {
        // The communicator's device is current while the gather's stream and the new
        // communicator are made.
        let on_comm_device = |f: &mut dyn FnMut()| {
            let previous = self.shared.current_device();
            CURRENT.with(|m| m.borrow_mut().insert(self.shared.instance, comm.device));
            f();
            CURRENT.with(|m| m.borrow_mut().insert(self.shared.instance, previous));
        };
        let gather = |mine: &[u8]| {
            let mut stream = None;
            on_comm_device(&mut || stream = Some(Backend::create_stream(self)));
            let stream = stream.expect("set above")?.0;
            auxil::comm::host_all_gather(self, comm, comm.world, mine, &stream)
        };
        let init = |id: &UniqueId, rank: usize, size: usize| {
            let mut sub = None;
            on_comm_device(&mut || sub = Some(Backend::comm_init(self, id, rank, size)));
            sub.expect("set above")
        };
        auxil::comm::split_by_leader(
            self,
            UNIQUE_ID_BYTES,
            comm.rank,
            comm.world,
            rank_lists,
            gather,
            init,
        )
    }

    /// Queues `op` on `stream` under the watchdog ([`Backend::collective`]).
    pub(super) fn issue_collective(
        &self,
        comm: &Arc<CommObj>,
        op: Collective<Option<Place<Arc<MemObj>>>>,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        let n = self.shared.nccl()?;
        let name = op.name();
        if let Some(dtype) = op.dtype() {
            let reduce = match &op {
                Collective::AllReduce { op, .. } | Collective::ReduceScatter { op, .. } => {
                    Some(*op)
                }
                _ => None,
            };
            check_supported(n, dtype, reduce, name)?;
        }
        self.shared.bind(comm.device)?;
        // Held until the collective is queued and watched: the watchdog aborts only between
        // calls, never under one.
        let mut watch = lock(&comm.watch);
        if watch.aborted.is_none() {
            if let Some(e) = watchdog::async_error(n, comm.ident()) {
                watchdog::abort(n, comm.ident(), &mut watch, e);
            }
        }
        if let Some(e) = &watch.aborted {
            stream.errors.queue(e.clone());
            return Ok(());
        }
        let op = match op {
            Collective::Barrier => auxil::comm::barrier_as_all_reduce(Arc::clone(&comm.scratch)),
            op => op,
        };
        let a = &n.api;
        let (c, s) = (comm.raw.sys(), stream.raw.sys().cast::<c_void>());
        // Avg without ncclAvg: a sum, then the scale kernel below.
        let emulate_avg = !n.has_avg_and_bf16();
        let red = |op: ReduceOp| {
            if emulate_avg && op == ReduceOp::Avg {
                nccl_op(ReduceOp::Sum)
            } else {
                nccl_op(op)
            }
        };
        let count_of = |x: &Collective<_>| match x {
            Collective::AllReduce { count, .. }
            | Collective::AllGather { count, .. }
            | Collective::ReduceScatter { count, .. }
            | Collective::Broadcast { count, .. }
            | Collective::AllToAll { count, .. }
            | Collective::Send { count, .. }
            | Collective::Recv { count, .. } => *count,
            Collective::AllToAllV { .. } | Collective::Barrier => 1,
        };
        if count_of(&op) == 0 {
            // Every rank passes the same count: skipping on all of them keeps them paired.
            return Ok(());
        }
        let issued = (|| -> Result<()> {
            // SAFETY: (every call below) places were bounds-checked by the dispatch layer for
            // the extent NCCL touches; the communicator and stream are live (`comm` and `stream`
            // own them and are borrowed for the call); NCCL only queues the work on `s`.
            unsafe {
                match &op {
                    Collective::AllReduce {
                        send,
                        recv,
                        count,
                        dtype,
                        op,
                    } => n.check(
                        (a.ncclAllReduce)(
                            ptr(send),
                            ptr(recv),
                            *count,
                            nccl_dtype(*dtype),
                            red(*op),
                            c,
                            s,
                        ),
                        "ncclAllReduce",
                    )?,
                    Collective::ReduceScatter {
                        send,
                        recv,
                        count,
                        dtype,
                        op,
                    } => n.check(
                        (a.ncclReduceScatter)(
                            ptr(send),
                            ptr(recv),
                            *count,
                            nccl_dtype(*dtype),
                            red(*op),
                            c,
                            s,
                        ),
                        "ncclReduceScatter",
                    )?,
                    Collective::AllGather {
                        send,
                        recv,
                        count,
                        dtype,
                    } => n.check(
                        (a.ncclAllGather)(ptr(send), ptr(recv), *count, nccl_dtype(*dtype), c, s),
                        "ncclAllGather",
                    )?,
                    Collective::Broadcast {
                        buf,
                        count,
                        dtype,
                        root,
                    } => n.check(
                        (a.ncclBroadcast)(
                            ptr(buf),
                            ptr(buf),
                            *count,
                            nccl_dtype(*dtype),
                            *root as c_int,
                            c,
                            s,
                        ),
                        "ncclBroadcast",
                    )?,
                    Collective::AllToAll {
                        send,
                        recv,
                        count,
                        dtype,
                    } => {
                        let blocks: Vec<(usize, usize, usize, usize)> = (0..comm.world)
                            .map(|q| (*count, q * count, *count, q * count))
                            .collect();
                        self.exchange(n, comm, send, recv, &blocks, *dtype, stream)?
                    }
                    Collective::AllToAllV {
                        send,
                        recv,
                        send_counts,
                        send_displs,
                        recv_counts,
                        recv_displs,
                        dtype,
                    } => {
                        let blocks: Vec<(usize, usize, usize, usize)> = (0..comm.world)
                            .map(|q| {
                                (
                                    send_counts[q],
                                    send_displs[q],
                                    recv_counts[q],
                                    recv_displs[q],
                                )
                            })
                            .collect();
                        self.exchange(n, comm, send, recv, &blocks, *dtype, stream)?
                    }
                    Collective::Send {
                        send,
                        count,
                        dtype,
                        peer,
                    } => n.check(
                        (a.ncclSend)(ptr(send), *count, nccl_dtype(*dtype), *peer as c_int, c, s),
                        "ncclSend",
                    )?,
                    Collective::Recv {
                        recv,
                        count,
                        dtype,
                        peer,
                    } => n.check(
                        (a.ncclRecv)(ptr(recv), *count, nccl_dtype(*dtype), *peer as c_int, c, s),
                        "ncclRecv",
                    )?,
                    Collective::Barrier => unreachable!("issued as an all-reduce above"),
                }
            }
            Ok(())
        })();
        // Recorded even when issuing failed part-way (an all-to-all's own block may be queued
        // before a send fails): the places must never be freed under what was queued, nor a
        // hang in it go unwatched.
        let grouped = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            (g.0 > 0).then(|| {
                g.1.push(Grouped {
                    comm: Arc::clone(comm),
                    op: name,
                    stream: Arc::clone(stream),
                })
            })
        });
        let watched = match grouped {
            Some(()) => {
                watch.in_group += 1;
                Ok(())
            }
            None => self.shared.watchdog.watch(comm, &mut watch, name, stream),
        };
        drop(watch);
        for (place, _) in op.places(comm.world) {
            if let Some(p) = place {
                p.mem.used_on(stream.key())?;
            }
        }
        issued?;
        watched?;
        match auxil::comm::avg_to_scale(op, comm.world) {
            Some((buf, count, dtype)) if emulate_avg => self.run_kernel(
                &Kernel::Scale {
                    buf,
                    dtype,
                    count,
                    factor: 1.0 / comm.world as f64,
                },
                stream,
            ),
            _ => Ok(()),
        }
    }
}

impl CudaBackend {
    /// All-to-all as one NCCL group of sends and receives (NCCL has no all-to-all of its own
    /// before 2.28): `blocks[q]` = (send count, send displacement, recv count, recv
    /// displacement) in elements for peer `q`. This rank's own block is a device copy.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn exchange(
        &self,
        n: &Nccl,
        comm: &Arc<CommObj>,
        send: &Option<Place<Arc<MemObj>>>,
        recv: &Option<Place<Arc<MemObj>>>,
        blocks: &[(usize, usize, usize, usize)],
        dtype: DType,
        stream: &Arc<StreamObj>,
    ) -> Result<()> {
        let size = dtype.size();
        let (sp, rp) = (ptr(send) as usize, ptr(recv) as usize);
        let (c, s) = (comm.raw.sys(), stream.raw.sys().cast::<c_void>());
        let me = comm.rank;
        let (sc, sd, rc, rd) = blocks[me];
        if sc != rc {
            return Err(cuda_err(
                ErrorKind::Mismatch,
                "all_to_all",
                format!("this rank sends itself {sc} elements but expects {rc}"),
            ));
        }
        if sc > 0 {
            let (dst, src) = ((rp + rd * size) as u64, (sp + sd * size) as u64);
            // SAFETY: both blocks lie inside the bounds-checked places.
            unsafe { result::mem::copy_async(dst, src, sc * size, stream.raw) }?;
        }
        // SAFETY: plain NCCL calls on bounds-checked blocks; the group is always closed.
        n.check(unsafe { (n.api.ncclGroupStart)() }, "ncclGroupStart")?;
        let mut issued = Ok(());
        for (q, &(sc, sd, rc, rd)) in blocks.iter().enumerate() {
            if q == me || issued.is_err() {
                continue;
            }
            let dt = nccl_dtype(dtype);
            if sc > 0 {
                issued = n.check(
                    // SAFETY: peer `q`'s send block lies inside the bounds-checked send place;
                    // `c` and `s` are live (owned by `comm` and `stream`); NCCL only queues the
                    // send on `s`, inside the group opened above.
                    unsafe {
                        (n.api.ncclSend)(
                            (sp + sd * size) as *const c_void,
                            sc,
                            dt,
                            q as c_int,
                            c,
                            s,
                        )
                    },
                    "ncclSend",
                );
            }
            if rc > 0 && issued.is_ok() {
                issued = n.check(
                    // SAFETY: peer `q`'s receive block lies inside the bounds-checked receive
                    // place; `c` and `s` are live; NCCL only queues the receive on `s`.
                    unsafe {
                        (n.api.ncclRecv)((rp + rd * size) as *mut c_void, rc, dt, q as c_int, c, s)
                    },
                    "ncclRecv",
                );
            }
        }
        // SAFETY: closes the group opened by the `ncclGroupStart` above (which succeeded, or
        // we returned), whatever happened to the calls in between.
        let closed = n.check(unsafe { (n.api.ncclGroupEnd)() }, "ncclGroupEnd");
        issued.and(closed)
    }
}
