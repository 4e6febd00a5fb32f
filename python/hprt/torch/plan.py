"""A swap mode offloads every layer but the last unless told otherwise; with a memory budget (or
Megatron-LM's offload fraction) it offloads only the layers ``hprt.plan_offload`` picks from what
a profiling pass measured (``attach(..., budget=...)`` / ``offload_fraction=...``)."""

import time
import warnings

import torch

import hprt

from .passes import _in_backward


class _OffloadPlan:
    """``attach(..., budget=...)`` / ``offload_fraction=...``: which layers the swap modes
    offload, chosen by ``hprt.plan_offload`` from a profiling pass. The first forward pass with
    grad offloads every layer while it measures each layer's swappable saved bytes and forward
    time (the compute stream synchronized at each layer's edges, in that pass only); the
    backward is taken as twice the forward (a transformer layer's usual ratio) and the link is
    ``Runtime.link_gbps()``. From the next pass on, a layer the plan keeps saves into autograd
    as without hprt. The choice is in ``stats()["plan"]``."""

    def __init__(self, rt, layers, budget, offload_fraction, user_predicate):
        self.rt, self.n = rt, layers
        self.budget = None if budget == "auto" else budget
        self.fraction, self.user_predicate = offload_fraction, user_predicate
        self.saved_bytes, self.forward_s = [0] * layers, [0.0] * layers
        self.chosen, self.result, self.current = None, None, None
        self.profiling, self.profiled, self.started = False, False, None

    def _sync(self):
        self.rt.compute_stream(None).synchronize()

    def pre(self, i):
        self.current = i
        if self.chosen is not None or not torch.is_grad_enabled() or _in_backward():
            return
        if i == 0:
            if self.profiled:
                self._decide()
                return
            self.profiling = True
        if self.profiling:
            self._sync()
            self.started = time.perf_counter()

    def post(self, i):
        self.current = None
        if self.profiling and self.started is not None:
            self._sync()
            self.forward_s[i] = time.perf_counter() - self.started
            self.started = None
            if i == self.n - 1:
                self.profiling, self.profiled = False, True

    def takes(self, t):
        """The swap modes' predicate: the user's, and the plan's layer choice."""
        if self.user_predicate is not None and not self.user_predicate(t):
            return False
        i = self.current
        if i is None:
            return True
        if self.chosen is None:
            if self.profiling:
                self.saved_bytes[i] += t.nbytes
            return True
        return i in self.chosen

    def _decide(self):
        link = self.rt.link_gbps()
        result = hprt.plan_offload(self.saved_bytes, self.forward_s,
                                   [2 * f for f in self.forward_s], link,
                                   budget=self.budget, offload_fraction=self.fraction)
        result.update(link_gbps=link, layer_saved_bytes=list(self.saved_bytes),
                      layer_forward_s=list(self.forward_s))
        self.chosen = {i for i, o in enumerate(result["offload"]) if o}
        self.result = result
        if not result["meets_target"]:
            warnings.warn(
                f"hprt.torch: the budget of {self.budget} bytes is out of reach (predicted peak "
                f"{result['predicted_peak_bytes']} bytes with every layer but the last "
                "offloaded); every offloadable layer is offloaded", RuntimeWarning, stacklevel=3)

    def stats(self):
        return {"plan": self.result}


def _check_plan_args(mode, budget, offload_fraction):
    if budget is None and offload_fraction is None:
        return
    if mode not in ("swap", "keyed", "pipeline"):
        raise ValueError(f"hprt.torch mode {mode!r} takes no budget or offload_fraction (the "
                         "swap modes do)")
    if budget is not None and offload_fraction is not None:
        raise ValueError("hprt.torch.attach: give a budget or an offload_fraction, not both")
    if budget is not None and budget != "auto" and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"hprt.torch.attach: budget must be a number of bytes (int >= 0) or "
                         f"'auto', not {budget!r}")
    if offload_fraction is not None and (isinstance(offload_fraction, bool) or not isinstance(
            offload_fraction, (int, float)) or not 0 <= offload_fraction <= 1):
        raise ValueError(f"hprt.torch.attach: offload_fraction must lie in [0, 1], not "
                         f"{offload_fraction!r}")
