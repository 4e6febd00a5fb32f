"""The keyed swap on torch (the ``keyed`` mode): the with-block of ``hprt.TensorSwapContext``,
which hands torch's saved tensors to the context's ``KeyedSwap``. The class itself lives in
``hprt``, which must not import torch (it also swaps hprt's own values)."""

import hprt

from .passes import _Flow, _Packed, _declined, _load_layer, _pushed, _unpack_with
from .runtimes import is_swappable, runtime


TensorSwapContext = hprt.TensorSwapContext  # one class: its with-block is below


def _keyed_enter(ctx):
    """``with ctx:`` of a ``TensorSwapContext``: around one layer's forward, torch's saved
    tensors go to the context's ``KeyedSwap`` (entering the tag's first layer begins a forward
    pass); returns the hooks pushed, or None when the pass is left to autograd."""
    rt = ctx.runtime_ if ctx.runtime_ is not None else runtime(ctx.platform)
    swap = ctx.swap
    if not any(front is swap for front in rt._fronts):
        rt._fronts.append(swap)  # its counters join the runtime's stats
    flow = ctx._flow or TensorSwapContext._flows.get(id(swap))
    if flow is None:
        flow = TensorSwapContext._flows[id(swap)] = _Flow(swap.end_iteration)
    layer = ctx._ctx

    def pack(t):
        if not is_swappable(t, rt):
            return _declined(t)
        ref = swap.swap_out_cur_and_release_prev(layer, rt.borrow(t), rt.compute_stream(t.device))
        return _Packed(ref, t, layer.layer, flow.current)

    def load_one(packed):
        return swap.wait_cur_and_prefetch_next(packed.ref, rt.compute_stream(), ctx.prefetch)

    if layer.layer == 0:
        flow.start()
    if not flow.taking():
        return None
    return _pushed(pack, _unpack_with(lambda packed: _load_layer(packed, load_one)))
