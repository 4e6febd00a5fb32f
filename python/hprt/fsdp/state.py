"""What ``fully_shard`` keeps per module (``_FSDPState``): gathering and freeing its parameters
around forward and backward with the next module's gather prefetched, the saved-tensor hooks
that keep references into gathered memory instead of the memory itself, and the end of backward
that applies the reductions."""

import time

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .params import _FSDPParam
from .ranks import _tls


class _SavedParamRef:
    """What autograd keeps instead of a tensor living in gathered memory."""

    __slots__ = ("param", "size", "stride", "offset")

    def __init__(self, param, t, base):
        self.param = param
        self.size, self.stride = t.size(), t.stride()
        self.offset = (t.data_ptr() - base.data_ptr()) // t.element_size()


class _OuterPacked:
    """A value packed by saved-tensor hooks that were active before ours."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _FSDPState:
    def __init__(self, mesh, reshard_after_forward, mp_policy, offload_policy, params):
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward  # None: True except on the root
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.is_last_backward = True  # read on the root
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.live = {}
        self.params = []
        self.forward_prefetch = None
        self.backward_prefetch = None
        self.root = None  # set by the root's lazy init
        self.order = []  # FSDP states in forward order (on the root)
        self.states = []  # every state under the root, root included (on the root)
        self.hooks_pushed = False
        self.outer_hooks = None
        self.backward_started = False
        self.callback_queued = False
        self.grads_arrived = 0
        self.in_flight = []  # (on the root) modules whose reductions were not applied yet
        self.initialized = False
        self.order_frozen = False
        for fqn, (param, locations, dim) in params.items():
            self.params.append(_FSDPParam(self, fqn, param, locations, dim))
        for p in self.params:
            for m, attr in p.locations:
                m._parameters[attr] = p.sharded
        mesh.streams.compute.synchronize()
        for p in self.params:
            p._source = None

    @property
    def streams(self):
        return self.mesh.streams

    # --- unshard / reshard
    def unshard_async(self):
        trace, ag = self.mesh.trace, self.streams.all_gather
        start = trace.begin(ag) if trace else None
        for p in self.params:
            p.unshard(async_op=True)
        if trace:
            trace.end("all-gather", ag, start)

    def unshard(self):
        if self.params and all(p.base is not None for p in self.params):
            return
        self.unshard_async()
        t0 = time.perf_counter()
        for p in self.params:
            p.wait_for_unshard()
        memory = self.mesh.memory
        views = [memory.gathered(p) for p in self.params]
        memory.host_wait(self.streams)  # torch reads the gathered memory from here on
        if self.mesh.trace:
            self.mesh.trace.wait(t0, time.perf_counter())
        for p, view in zip(self.params, views):
            p.bind_unsharded(view)

    def reshard(self):
        for p in self.params:
            p.bind_sharded()
            p.sp.shard()

    # --- forward
    def pre_forward(self, module, args, kwargs):
        if getattr(_tls, "active", None) is None:
            self._lazy_init(module)
            for st in (self.states or [self]) if torch.is_grad_enabled() else ():
                for p in st.params:
                    p.check_partial_start()  # refused before anything starts
            _tls.active = self
            self._push_hooks()
            if not self.order_frozen:
                self.order.clear()
        active_root = _tls.active
        if not active_root.order_frozen and self not in active_root.order:
            active_root.order.append(self)
        self.unshard()
        for nxt in self._forward_next(active_root):
            nxt.unshard_async()
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            cast = lambda t: t.to(mp.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def _forward_next(self, root):
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = root.order if root.order_frozen else []
        if self in order:
            i = order.index(self)
            return order[i + 1:i + 2]
        return []

    def _backward_next(self):
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        root = self.root or self
        order = root.order
        if self in order:
            i = order.index(self)
            return order[i - 1:i] if i > 0 else []
        return []

    def post_forward(self, module, output):
        is_root = _tls.active is self
        reshard = self.reshard_after_forward
        if reshard if reshard is not None else not is_root:
            self.reshard()
        mp = self.mp_policy
        if mp.output_dtype is not None:
            cast = lambda t: t.to(mp.output_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            output = tree_map(cast, output)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        if is_root:
            self._end_forward()
        return output

    def _end_forward(self):
        self._pop_hooks()
        _tls.active = None
        self.order_frozen = True

    def abort_forward(self):
        if getattr(_tls, "active", None) is self:
            self._pop_hooks()
            _tls.active = None

    def _lazy_init(self, module):
        if self.root is not None and self.root is not self:
            return  # called on its own: acts as its own root for this forward
        if self.initialized:
            return
        self.initialized = True
        self.root = self
        self.order_frozen = False
        self.states = [self]
        for m in module.modules():
            st = getattr(m, "_hprt_fsdp", None)
            if st is not None and st is not self:
                st.root = self
                st.order_frozen = True
                self.states.append(st)

    # --- saved tensors: references into gathered memory are re-gathered for backward
    def _push_hooks(self):
        self.outer_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self.hooks_pushed = True

    def _pop_hooks(self):
        if self.hooks_pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.hooks_pushed = False

    def _pack(self, t):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, subclasses)
            ptr = None
        for st in self.states if ptr is not None else ():
            p = st.live.get(ptr) if st.live else None
            if p is not None:
                return _SavedParamRef(p, t, p.base)
        if self.outer_hooks is not None:
            return _OuterPacked(self.outer_hooks[0](t))
        return t

    def _unpack(self, x):
        if isinstance(x, _SavedParamRef):
            p = x.param
            if p.base is None:
                p.state.unshard()  # not prefetched (e.g. a second backward): gather now
            base = p.base
            return base.as_strided(x.size, x.stride, base.storage_offset() + x.offset)
        if isinstance(x, _OuterPacked):
            return self.outer_hooks[1](x.value)
        return x

    # --- backward
    def _pre_backward_hook(self, grad):
        if not self.backward_started:
            self.backward_started = True
            root = self.root or self
            if not root.callback_queued:
                root.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(root._final_callback)
            self.unshard()
            for nxt in self._backward_next():
                nxt.unshard_async()
        return grad

    def _grad_arrived(self):
        self.grads_arrived += 1
        if self.grads_arrived == sum(p.requires_grad for p in self.params):
            root = self.root or self
            if self.reshard_after_backward and self is not root:
                self.reshard()
            # FSDP2's bound on reductions in flight: this module's, and no earlier ones (their
            # staging and gradient memory is released once applied; stream-ordered, no host
            # wait). Without it every module's staged gradients lived until the end of backward.
            for st in root.in_flight:
                for p in st.params:
                    p.apply_pending()
            root.in_flight = [self]

    def _final_callback(self):
        states = self.states or [self]
        last = self.is_last_backward
        if last:
            t0 = time.perf_counter()
            for st in states:
                for p in st.params:
                    p.apply_pending()
            self.in_flight = []
            self.mesh.memory.host_wait(self.streams)
            if self.mesh.trace:
                self.mesh.trace.wait(t0, time.perf_counter())
        for st in states:
            for p in st.params:
                if last and (p.reduced or p.unpublished) and not p.partial:
                    g = p.memory.sharded_grad(p)
                    if p.sharded.grad is None or p.sharded.grad.data_ptr() != g.data_ptr():
                        p.sharded.grad = g
                    p.unpublished = False
                elif p.reduced:
                    p.unpublished = True  # in flight; the next backward applies it
                p.reduced = False
                if last:
                    p.keep.clear()  # the host waited for every stream (torch's: ordered)
            if st.reshard_after_backward:
                st.reshard()
            st.backward_started = False
            st.grads_arrived = 0
        self.callback_queued = False
