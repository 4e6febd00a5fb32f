"""Every mode must give torch's own results under the patterns training uses (a tensor written in
place after it was saved, ``retain_graph``, a graph dropped without backward, a second forward
before the backward). The pieces here do that once for every front end: torch's in-place check
for the tensors hprt takes or leaves to autograd, one tensor per saved tensor however often it
is read, and following one forward pass and its backward at a time."""

import threading
import warnings
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks


def _in_backward():
    """Whether autograd is executing a backward on this thread (a checkpoint's recomputation
    runs its forward there: torch keeps those tensors only until they are used)."""
    return torch._C._current_graph_task_id() != -1


_lock = threading.Lock()


class _Witness:
    """torch's check that a saved tensor was not modified in place, for a tensor hprt no longer
    references: its version at save time, and weak references to it and to its base (which
    share its version counter; any view that could still write it keeps the base alive).

    The base class of what the pack hooks return (one object per saved tensor: each object
    that lives from a forward to its backward is work for Python's collector, whose full
    collections cost tens of ms in a training process), holding nothing the collector must
    follow but the weak references (the shape as a plain tuple of ints, which it untracks)."""

    __slots__ = ("version", "_t", "_base", "shape", "grad_fn", "output_nr")

    def __init__(self, t):
        self.version = t._version
        base = t._base
        self._t = weakref.ref(t)
        self._base = None if base is None else weakref.ref(base)
        fn = t.grad_fn
        # The node's class name is its name(); the node itself would be a reference cycle.
        self.shape, self.grad_fn = tuple(t.shape), fn and type(fn).__name__
        self.output_nr = t.output_nr

    def modified(self):
        t = self._alive()
        return t is not None and t._version != self.version

    def _alive(self):
        t = self._t()
        if t is None and self._base is not None:
            t = self._base()
        return t

    def check(self):
        """Raises torch's error (same class and message shape) if the tensor was modified."""
        # ``modified()`` inline: this runs for every saved tensor read in backward.
        t = self._t()
        if t is None and self._base is not None:
            t = self._base()
        if t is not None and t._version != self.version:
            raise _modified(t, self.shape, self.version, self.grad_fn, self.output_nr)


def _modified(t, shape, version, grad_fn, output_nr):
    """torch's error for a saved tensor modified in place (its message's shape: ``which is
    output N of NODE,`` only for a tensor some node made)."""
    what = f", which is output {output_nr} of {grad_fn}," if grad_fn else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.type()} {list(shape)}]{what} is at version {t._version}; "
        f"expected version {version} instead. Hint: the tensor was saved through hprt.torch; "
        "enable anomaly detection to find the operation that failed to compute its gradient, "
        "with torch.autograd.set_detect_anomaly(True).")


class _Declined:
    """What a pack hook returns for a tensor hprt leaves to autograd (under ``min_bytes``,
    refused by a predicate, a parameter or a view of one, not on this platform's device, not
    dense): the tensor as torch itself would save it and its version at save time, checked at
    unpack as torch checks a saved tensor.

    Returning ``t`` itself lost both: torch checks no version of what a hook returned (a
    weight or an activation changed in place between forward and backward gave a different
    gradient without an error), and a saved *output* holds its ``grad_fn``, which held what
    the hook returned: a reference cycle through autograd's C++ nodes that Python's collector
    cannot see, so a graph dropped without backward (an evaluation with grad on) stayed alive
    for good, and with it the pass the front end follows. So a tensor some node made is held
    as ``t.detach()`` (the same memory and version counter, not the node), as torch holds a
    saved output; a leaf (a parameter, an input) has no node and is held itself, as torch
    holds it, so a parameter whose ``.data`` is replaced between forward and backward (a
    sharded data-parallel unshard) is read as it is then."""

    __slots__ = ("t", "version", "grad_fn", "output_nr")

    def __init__(self, t):
        fn = t.grad_fn
        self.t, self.version = t if fn is None else t.detach(), t._version
        # The node's class name is its name(); the node itself would be the cycle.
        self.grad_fn = fn and type(fn).__name__
        self.output_nr = t.output_nr

    def read(self, load=None):
        t = self.t
        if t._version != self.version:
            raise _modified(t, t.shape, self.version, self.grad_fn, self.output_nr)
        return t


def _declined(t):
    """What a pack hook returns for ``t`` left to autograd (see ``_Declined``). An inference
    tensor has no version counter (torch checks none) and no autograd node: itself."""
    return t if t.is_inference() else _Declined(t)


class _Pass:
    """The saved tensors of one forward pass a front end follows: how many are still referenced
    by autograd (read ones and those of dropped graphs are gone)."""

    __slots__ = ("live", "begun", "by_layer")

    def __init__(self):
        self.live = 0
        self.begun = set()  # layers whose backward began
        self.by_layer = {}  # layer -> weak references to its packed tensors not yet loaded

    def add(self):
        with _lock:
            self.live += 1

    def drop(self):
        with _lock:
            self.live -= 1


class _Packed(_Witness):
    """What a pack hook returns for a tensor hprt took: the front end's reference, torch's
    in-place check (it is the tensor's witness), and the tensor once read (a retained graph's
    second backward gets the same one). Its death (read, or its graph dropped) is counted in
    its pass."""

    __slots__ = ("ref", "out", "layer", "pass_", "__weakref__")

    def __init__(self, ref, t, layer=None, pass_=None):
        _Witness.__init__(self, t)
        self.ref, self.out, self.layer = ref, None, layer
        self.pass_ = pass_
        if pass_ is not None:
            pass_.add()
            if layer is not None:
                pass_.by_layer.setdefault(layer, []).append(weakref.ref(self))

    def __del__(self):
        if self.pass_ is not None:
            self.pass_.drop()

    def read(self, load):
        self.check()
        if self.out is None:
            self.out = load(self)
        return self.out


class _Kept(_Packed):
    """A tensor left on the device but counted by the runtime's accounting (a borrowed payload
    hprt only holds)."""

    __slots__ = ()

    def read(self, load):
        self.check()
        return self.ref.tensor


def _load_layer(packed, load_one, start=None, ahead=None):
    """Loads ``packed`` and every other tensor of its layer still referenced in its pass. First
    ``start(packed)`` queues the layer's reload and ``ahead()`` the work behind it (a prefetch of
    the layer before), so that on the cpu backend, where a load blocks the host, the prefetch is
    already queued while the host waits."""
    if start is not None:
        start(packed)
    if ahead is not None:
        ahead()
    pass_ = packed.pass_
    group = pass_.by_layer.pop(packed.layer, ()) if pass_ is not None else ()
    for ref in group:
        other = ref()
        # A modified one is left to its own read, which raises torch's error for it.
        if other is not None and other is not packed and other.out is None and (
                not other.modified()):
            other.out = load_one(other)
    return load_one(packed)


def _unpack_with(load):
    def unpack(packed):
        # What the pack hooks return: a _Packed, a _Declined, or an inference tensor.
        return packed if isinstance(packed, torch.Tensor) else packed.read(load)
    return unpack


class OverlappingForwardWarning(UserWarning):
    """A forward pass overlapped a live one: its saved tensors were left to autograd."""


class _Flow:
    """The forward passes a front end sees. Its rules follow one forward and then its backward;
    a forward that starts while an earlier pass's saved tensors are still referenced (a second
    forward before the backward, DPO-style; a metric computed with grad on; a graph kept for
    ``retain_graph``) is left to autograd (its tensors stay where torch put them, unswapped), so
    the front end never sees two passes interleaved. Once none of a pass's tensors is referenced
    (all read, or the graph dropped: a forward without backward, a partial backward, an
    exception), the front end's ``end_iteration`` frees what it still holds, at the next pass or
    ``settle()``."""

    def __init__(self, end_iteration):
        self.end_iteration = end_iteration
        self.current = None
        self.active = False
        self.warned = False

    def start(self):
        """A forward pass begins (its first layer); returns whether the front end takes it."""
        self.active = False
        if not torch.is_grad_enabled() or _in_backward():
            return False  # nothing is saved (no_grad), or a checkpoint recomputes in backward
        if self.current is not None:
            if self.current.live > 0:
                self._warn_overlap()
                return False
            self.settle()
        self.current = _Pass()
        self.active = True
        return True

    def _warn_overlap(self):
        if not self.warned:
            self.warned = True
            warnings.warn(
                "hprt.torch: a forward pass began while the previous pass's saved tensors were "
                "still referenced (two forwards then one backward, DPO-style; a metric computed "
                "with grad enabled; a graph kept by retain_graph): that pass's saved tensors stay "
                "where torch put them, neither swapped nor compressed, so their device memory is "
                "not saved (gradients are exact; warned once per front end)",
                OverlappingForwardWarning, stacklevel=4)

    def taking(self):
        """Whether the layer running now belongs to the pass the front end takes."""
        return self.active and torch.is_grad_enabled() and not _in_backward()

    def settle(self):
        """Ends the current pass in the front end if none of its tensors is referenced."""
        cur = self.current
        if cur is not None and cur.live == 0:
            self.current, self.active = None, False
            self.end_iteration()


def _pushed(pack, unpack):
    ctx = saved_tensors_hooks(pack, unpack)
    ctx.__enter__()
    return ctx


def _on_output_grad(output, fn):
    """Calls ``fn()`` when the gradient of ``output`` (a layer's output: its backward begins)
    is computed, once."""
    if isinstance(output, (tuple, list)):
        output = next((o for o in output if isinstance(o, torch.Tensor)), None)
    elif not isinstance(output, torch.Tensor):
        output = getattr(output, "last_hidden_state", None)
    if isinstance(output, torch.Tensor) and output.requires_grad:
        fired = []

        def hook(grad):
            if not fired:
                fired.append(True)
                fn()

        output.register_hook(hook)
