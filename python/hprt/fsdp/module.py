"""``fully_shard`` and the methods it adds to a module (``FSDPModule``): which parameters a module
shards, on which dim, and the FSDP2 / hyper_parallel knobs that change its state at runtime."""

from torch import nn

import hprt

from .mesh import init_device_mesh
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state import _FSDPState


class FSDPModule:
    """The methods ``fully_shard`` adds to a module (FSDP2's ``FSDPModule``, hyper_parallel's
    fully_shard module methods)."""

    def _fsdp_states(self, recurse=True):
        if not recurse:
            return [self._hprt_fsdp]
        return [m._hprt_fsdp for m in self.modules() if getattr(m, "_hprt_fsdp", None) is not None]

    def unshard(self, async_op=False):
        """All-gathers this module's parameters. With ``async_op`` returns a handle whose
        ``wait()`` makes them usable (the next forward waits for it too)."""
        st = self._hprt_fsdp
        if async_op:
            st.unshard_async()
            return _UnshardHandle(st)
        st.unshard()
        return None

    def reshard(self):
        """Frees the gathered parameters (the shards stay registered)."""
        self._hprt_fsdp.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """Off: gradients are accumulated unsharded (in the reduce dtype) without communication;
        the next backward with it on reduces the sum."""
        for st in self._fsdp_states(recurse):
            st.requires_gradient_sync = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward):
        """Off: the next backward leaves its last gradient reductions in flight (they overlap
        what comes next, e.g. the next micro-batch's forward) and does not set ``.grad``; the
        backward after it applies them first. Set it back on for the micro-batch whose
        backward precedes the optimizer step."""
        for st in self._fsdp_states(True):
            st.is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP off: gradients are reduce-scattered within each replica but not all-reduced
        across the replicas; the partial sums accumulate (``.grad`` is not set) until a backward
        with it on all-reduces them. Start such an accumulation with no gradient
        (``zero_grad()``); not with ``CPUOffloadPolicy``."""
        states = self._fsdp_states(recurse)
        if not requires_all_reduce:
            for st in states:
                if len(st.mesh.shape) == 2 and isinstance(st.offload_policy, CPUOffloadPolicy):
                    raise hprt.UnsupportedError(
                        "set_requires_all_reduce(False) with CPUOffloadPolicy: the partial sums "
                        "would be all-reduced in pinned host memory, which hprt's collectives "
                        "do not read"
                    )
        for st in states:
            st.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward, *, recurse=True):
        """Changes ``reshard_after_forward`` at runtime (e.g. ``True`` on the root, which
        otherwise keeps its parameters gathered for backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for st in self._fsdp_states(recurse):
            st.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        for st in self._fsdp_states(recurse):
            st.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules):
        """The modules whose all-gather starts when this module's forward starts."""
        self._hprt_fsdp.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        """The modules whose all-gather starts when this module's backward starts."""
        self._hprt_fsdp.backward_prefetch = [_state_of(m) for m in modules]

    def zero_grads(self):
        """Drops the sharded gradients of this module and every fully_shard module under it."""
        for st in self._fsdp_states(True):
            for p in st.params:
                p.apply_pending()
                p.sharded.grad = None
                p.unpublished = p.partial = False
                p.sp.clear_grad()

    def forward(self, *args, **kwargs):
        st = self._hprt_fsdp
        args, kwargs = st.pre_forward(self, args, kwargs)
        try:
            out = st.orig_forward(self, *args, **kwargs)
        except BaseException:
            st.abort_forward()
            raise
        return st.post_forward(self, out)


class _UnshardHandle:
    def __init__(self, state):
        self._state = state

    def wait(self):
        self._state.unshard()


def _state_of(module):
    st = getattr(module, "_hprt_fsdp", None)
    if st is None:
        raise ValueError(f"{type(module).__name__} is not a fully_shard module")
    return st


_classes = {}


def _shard_dim(shard_placement_fn, fqn, param):
    """The dim ``shard_placement_fn(param)`` shards on: FSDP2's ``Shard(dim)`` (torch's
    ``torch.distributed.tensor.Shard``, or anything with an int ``dim``), ``None`` = dim 0;
    a negative dim counts from the end."""
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return 0
    dim = getattr(placement, "dim", None)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(
            f"shard_placement_fn returned {placement!r} for {fqn!r}: fully_shard takes a "
            "Shard(dim) or None"
        )
    if not -param.ndim <= dim < param.ndim:
        raise ValueError(f"shard_placement_fn: Shard({dim}) of {fqn!r}, a {param.ndim}-D parameter")
    return dim % param.ndim


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), ignored_params=None):
    """Shards ``module``'s parameters (those not already managed by a ``fully_shard`` module
    under it, and not in ``ignored_params``) over ``mesh`` (default: 1-D over the rank's world)
    and returns ``module``, whose class now also derives from ``FSDPModule``. Apply it to each
    block, then to the root. Collective: every rank shards the same modules in the same order.

    ``reshard_after_forward``: ``True`` frees the gathered parameters after forward (gathered
    again for backward), ``False`` keeps them, ``None`` (the default) is ``True`` except on the
    root, whose parameters backward needs first (FSDP2's rule).

    ``shard_placement_fn(param)`` may return ``Shard(dim)`` to shard a parameter on another dim
    than 0 (its registered shard is then a slice along ``dim``, padded there)."""
    if isinstance(module, (list, tuple, nn.ModuleList)) and not isinstance(module, nn.Module):
        return [fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                            shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                            offload_policy=offload_policy, ignored_params=ignored_params) for m in module]
    if getattr(module, "_hprt_fsdp", None) is not None:
        raise ValueError(f"{type(module).__name__} was already passed to fully_shard")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise hprt.UnsupportedError(
            f"reshard_after_forward={reshard_after_forward!r}: resharding to a smaller world "
            "after forward (FSDP2's int) is not supported; use True, False or None"
        )
    mesh = mesh if mesh is not None else init_device_mesh()
    ignored = {id(p) for p in (ignored_params or ())}
    managed = set()
    for m in module.modules():
        st = getattr(m, "_hprt_fsdp", None)
        if st is not None:
            managed.update(id(p.sharded) for p in st.params)
    params = {}
    by_id = {}
    for mod_name, m in module.named_modules():
        for attr, p in list(m._parameters.items()):
            if p is None or id(p) in ignored or id(p) in managed:
                continue
            if getattr(p, "_hprt_fsdp_param", None) is not None:
                continue
            if id(p) in by_id:
                by_id[id(p)][1].append((m, attr))  # a tied parameter: one shard, several homes
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            if p.ndim == 0:
                # FSDP2 refuses them too, with this message (an AssertionError there).
                raise ValueError(
                    f"fully_shard: Shard dim 0 is invalid for 0D tensor: {p.shape} (parameter "
                    f"{fqn!r}); a 0-D parameter cannot be sharded: make it a 1-element tensor "
                    "or leave it out with ignored_params"
                )
            by_id[id(p)] = params[fqn] = (p, [(m, attr)], _shard_dim(shard_placement_fn, fqn, p))
    state = _FSDPState(mesh, reshard_after_forward, mp_policy, offload_policy, params)
    cls = type(module)
    state.orig_forward = cls.forward
    new_cls = _classes.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _classes[cls] = new_cls
    module.__class__ = new_cls
    module._hprt_fsdp = state
    return module
