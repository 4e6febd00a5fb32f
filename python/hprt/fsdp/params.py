"""One managed parameter (``_FSDPParam``, hyper_parallel's ``HSDPParamV2`` names over hprt's
``ShardedParam``): the shard torch's optimizer updates, the gathered copy forward and backward
read, and its gradient's reduction as autograd accumulates it."""

import torch
from torch import nn

import hprt


class _FSDPParam:
    """One managed parameter: the hprt ``ShardedParam``, the shard torch sees as the registered
    parameter, and the persistent unsharded leaf whose data is rebound to each gathered copy."""

    def __init__(self, state, fqn, param, locations, dim):
        self.state, self.fqn, self.locations = state, fqn, locations
        self.requires_grad = param.requires_grad
        mesh = state.mesh
        self.memory = mesh.memory
        data = self.memory.hprt_input(param.detach(), mesh.streams)
        self.sp = hprt.ShardedParam(
            mesh.cache, mesh.streams, mesh.dp, fqn, data, shard_dim=dim,
            mp_policy=state.mp_policy._hprt(), offload_policy=state.offload_policy._hprt,
        )
        self._source = data  # read by the queued shard copy; dropped after a synchronize
        self.shape = param.shape
        shard, self.shard_buf = self.memory.shard(self.sp, mesh.streams)
        self.sharded = nn.Parameter(shard, requires_grad=param.requires_grad)
        self.sharded._hprt_fsdp_param = self
        self.grad_t = self.grad_buf = None  # the copied memory's sharded gradient
        self.param_dtype = state.mp_policy.param_dtype or param.dtype
        self.unsharded = None
        self.base = None  # the gathered tensor while unsharded
        self.reduced = False  # a reduction was issued in this backward
        self.pending = False  # a reduction was issued and not applied yet (wait_for_reduce)
        self.unpublished = False  # hprt's sharded gradient is ahead of .grad (not last backward)
        # set_requires_all_reduce(False): the sharded gradient holds this replica's partial sum;
        # the reduction that closes it all-reduces the sum across the replicas once applied.
        self.partial = self.close_partial = False
        self.has_replicas = len(self.sp.unsharded_group_ranks) > 1
        self.keep = []  # gradients hprt's streams may still read
        mesh._ctx.track(self)

    # the upstream HSDPParamV2 names, over hprt's ShardedParam
    def unshard(self, async_op=False):
        if self.sp.state == "sharded":  # else a pending all-gather may be reading hprt's shard
            self.memory.upload_shard(self)
        return self.sp.unshard(async_op=async_op)

    def wait_for_unshard(self):
        self.sp.wait_for_unshard()

    def bind_unsharded(self, view):
        """Points the unsharded leaf (and the module attributes) at ``view``, torch's tensor of
        the gathered parameter (``memory.gathered``, after ``memory.host_wait``)."""
        if self.unsharded is None:
            self.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            if self.requires_grad:
                self.unsharded.register_post_accumulate_grad_hook(self._on_grad)
        elif self.base is None or self.unsharded.data_ptr() != view.data_ptr():
            self.unsharded.data = view
        self.base = view
        self.state.live[view.untyped_storage().data_ptr()] = self
        for module, attr in self.locations:
            module._parameters[attr] = self.unsharded

    def bind_sharded(self):
        for module, attr in self.locations:
            module._parameters[attr] = self.sharded
        if self.base is not None:
            self.state.live.pop(self.base.untyped_storage().data_ptr(), None)
            self.base = None
            # Nothing may keep pointing at memory that shard() frees.
            self.unsharded.data = torch.zeros((), dtype=self.param_dtype).expand(self.shape)

    def apply_pending(self):
        """Applies the reduction in flight into the sharded gradient: stream-ordered, no host
        wait."""
        if self.pending:
            self.sp.wait_for_reduce()
            self.pending = False
            self.keep.clear()  # the compute stream is ordered after the reduction's reads
            if self.close_partial:
                self._all_reduce_partial()

    def check_partial_start(self):
        st = self.state
        starts = self.has_replicas and not st.requires_all_reduce and not self.partial
        if starts and st.requires_gradient_sync and (
                self.sharded.grad is not None or self.unpublished or self.reduced):
            raise hprt.UnsupportedError(
                f"set_requires_all_reduce(False) on {self.fqn!r}, whose sharded gradient holds "
                "reduced gradients: hprt accumulates the replicas' partial sums in the sharded "
                "gradient itself, so start the accumulation with no gradient (zero_grad() "
                "before it)"
            )

    def _all_reduce_partial(self):
        """FSDP2's HSDP accumulation without all-reduce: the partial sum (every reduce-scatter
        since the partial began, this one included) averaged across the replicas, on the
        reduce stream where hprt issues its own collectives (same order on every rank)."""
        st = self.state
        s = st.streams
        dev = self.sp.sharded_grad_device_tensor()
        s.reduce.wait_stream(s.compute)  # after the apply into the sharded gradient
        st.mesh.replicate_group.communicator.all_reduce(
            dev.buffer, dev.buffer, self.sp.shard_numel, self.sp.dtype, "avg", s.reduce,
            send_offset=dev.offset, recv_offset=dev.offset,
        )
        s.compute.wait_stream(s.reduce)
        self.partial = self.close_partial = False

    def _on_grad(self, leaf):
        grad, leaf.grad = leaf.grad, None
        st = self.state
        self.keep.append(grad)
        self.apply_pending()
        if st.requires_gradient_sync:
            defer = self.has_replicas and not st.requires_all_reduce
            if defer and not self.partial:
                self.check_partial_start()
                self.sp.clear_grad()
            elif not self.reduced and not self.unpublished and not self.partial:
                if self.sharded.grad is None:
                    self.sp.clear_grad()  # the user dropped .grad (zero_grad): start a new one
                else:
                    self.memory.upload_grad(self)
            trace, rs = st.mesh.trace, st.streams.reduce
            start = trace.begin(rs) if trace else None
            all_reduce = not (defer or self.partial)
            self.sp.reduce_grad(self.memory.hprt_input(grad, st.streams), op="avg", async_op=True,
                                all_reduce=all_reduce)
            if trace:
                trace.end("reduce", rs, start)
            self.close_partial = self.partial and not defer
            self.partial = self.partial or defer
            self.reduced = self.pending = True
        else:
            self.sp.accumulate_grad(self.memory.hprt_input(grad, st.streams))
        st._grad_arrived()

    def full_tensor(self):
        """The whole parameter in its own dtype (a collective over the shard group), from the
        shard torch holds."""
        st = self.state
        mesh, sp = st.mesh, self.sp
        self.memory.host_wait(mesh.streams)
        shard = self.sharded.detach()
        dim, rows = sp.shard_dim, self.shape[sp.shard_dim]
        if sp.group_size == 1:
            return shard.narrow(dim, 0, rows).clone()
        p = mesh.platform
        group = mesh._ctx.group_along("fsdp_shard", mesh.mesh, [mesh.shard_axis])
        host = shard.cpu().contiguous().reshape(-1)
        nbytes = host.numel() * host.element_size()
        send, recv = p.alloc_device(nbytes), p.alloc_device(nbytes * sp.group_size)
        s = mesh.streams.compute
        p.write(send, host.view(torch.uint8).numpy().tobytes(), s)
        group.communicator.all_gather(send, recv, sp.shard_numel, sp.dtype, s)
        data = bytearray(p.read(recv, nbytes * sp.group_size, s))
        send.free()
        recv.free()
        shards = torch.frombuffer(data, dtype=shard.dtype).reshape([sp.group_size] + list(sp.shard_shape))
        return torch.cat(list(shards), dim).narrow(dim, 0, rows).clone().to(shard.device)

    def shard_of(self, full):
        """This rank's padded shard of a whole parameter."""
        sp = self.sp
        dim = sp.shard_dim
        out = torch.zeros(sp.shard_shape, dtype=self.sharded.dtype)
        rows = sp.valid_rows(sp.shard_index)
        if rows:
            start = sp.shard_index * sp.shard_shape[dim]
            out.narrow(dim, 0, rows).copy_(full.reshape(self.shape).narrow(dim, start, rows))
        return out
