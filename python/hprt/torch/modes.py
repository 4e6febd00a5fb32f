"""``attach(model, mode=...)``: one mode on an ordinary model's layer list, without the model's
code changing. Its arguments are checked before anything is installed, a failure part way
removes what was, and the ``Attached`` handle removes it all again."""

import weakref

import torch
from torch import nn

from .compression import (
    _check_host_compression,
    _compress_stats,
    compress_saved_tensors,
    keep_saved_tensors,
)
from .keyed import TensorSwapContext
from .layer_groups import SwapManager
from .managed_compression import ManagedCompression, _managed_stats
from .passes import _Flow
from .pipeline import _PipelineFront
from .plan import _OffloadPlan, _check_plan_args
from .runtimes import _STREAM_ATTR, Runtime


# Modes of ``attach`` and what they are upstream.
MODES = ("keep", "keyed", "swap", "pipeline", "compress", "managed_compress")


_LAYER_PATHS = ("layers", "model.layers", "transformer.h", "transformer.layers", "gpt_neox.layers",
                "model.decoder.layers", "encoder.layer", "h", "blocks")


def find_layers(model, path=None):
    """The model's list of layers: ``path`` (dotted, e.g. ``"model.layers"``) or the first of
    the usual places (``model.layers``, ``model.model.layers``, ``model.transformer.h``, ...)."""
    for p in (path,) if path is not None else _LAYER_PATHS:
        obj = model
        try:
            for part in p.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, (nn.ModuleList, nn.Sequential, list, tuple)) and len(obj) > 0:
            return list(obj)
    raise ValueError(f"no layer list found in {type(model).__name__} (looked at "
                     f"{', '.join(_LAYER_PATHS) if path is None else path}); pass layers=")


class _ContextFront:
    """A mode whose per-layer work is a ``with`` block (keyed swap, keep, compression)."""

    def __init__(self, make):
        self.make = make

    def enter(self, i):
        ctx = self.make(i)
        ctx.__enter__()
        return ctx

    def exit(self, i, ctx):
        ctx.__exit__(None, None, None)


# The handle attached to each layer (one at a time: see ``_refuse_attached``).
_ATTACHED = weakref.WeakKeyDictionary()


def _refuse_attached(layers):
    """Refuses layers another ``attach`` handle still holds (two modes on one layer: the inner
    hooks take every saved tensor, the outer handle does nothing without a word)."""
    for layer in layers:
        other = _ATTACHED.get(layer)
        if other is not None and other.attached:
            raise ValueError(
                f"hprt.torch: layer {type(layer).__name__} is already attached (mode "
                f"{other.mode!r}); detach() that handle before attaching another mode")


class Attached:
    """What ``attach`` returns: ``detach()`` removes every hook it installed (also as a context
    manager), ``stats()`` reports hprt's statistics for the model."""

    def __init__(self, mode, layers, rt, settle, stats_extra=None, on_detach=()):
        self.mode, self.layers, self.runtime = mode, layers, rt
        self._handles, self._settle, self._stats_extra = [], settle, stats_extra
        self._on_detach = list(on_detach)
        for layer in layers:
            _ATTACHED[layer] = self

    def detach(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        for fn in self._settle + self._on_detach:
            fn()
        self._on_detach = []
        for layer in self.layers:
            if _ATTACHED.get(layer) is self:
                del _ATTACHED[layer]

    @property
    def attached(self):
        return bool(self._handles)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def stats(self):
        """Bytes of torch memory hprt keeps referenced (``device_current`` / ``device_peak``),
        offloaded / reloaded / compressed tensors and bytes, host-link bytes, pinned bytes in use
        and held, ``device_allocated`` where torch reports device memory. Every mode that
        compresses counts its tensors in ``compressed_tensors`` / ``compressed_bytes``; the
        compress modes add ``raw_bytes`` (what those tensors held before), ``compress`` its
        ``tensors`` / ``decoded_ahead`` and ``managed_compress`` its per-layer ``layers``."""
        for settle in self._settle:
            settle()
        s = self.runtime.stats()
        kind = self.runtime.device_type
        if kind in _STREAM_ATTR and hasattr(torch, kind) and getattr(torch, kind).is_available():
            s["device_allocated"] = getattr(torch, kind).memory_allocated()
        if self._stats_extra is not None:
            s.update(self._stats_extra())
        return s


def attach(model, mode="swap", *, layers=None, min_bytes=0, predicate=None, compression="off",
           platform=None, runtime_=None, prefetch=True, budget=None, offload_fraction=None,
           max_inflight_offload_bytes=None, max_inflight_reload_bytes=None):
    """Applies a mode to ``model``'s layers (``find_layers``, or ``layers`` given as a list or a
    dotted path) and returns an ``Attached`` handle.

    Modes: ``"swap"`` (hyper_parallel's layer groups), ``"keyed"`` (the keyed swap),
    ``"pipeline"`` (Megatron's fine-grained offload, a group per layer), ``"keep"`` (no swap,
    counted), ``"compress"`` (lossless compression in the pack hook), ``"managed_compress"``
    (MindSpeed's ActivationManager). ``compression`` (``off`` | ``device`` | ``host_stage`` |
    ``auto``) makes the swap modes compress-then-swap. Saved tensors smaller than
    ``min_bytes`` or refused by ``predicate(tensor)`` stay with autograd.

    The swap modes offload every layer but the last unless given ``budget`` (bytes of saved
    activations allowed on the device at the peak, or ``"auto"``: the layers whose copies hide
    behind compute) or ``offload_fraction`` (Megatron-LM's ``activation_offload_fraction``:
    that share of the layers, earliest first); the first forward pass then profiles (see
    ``_OffloadPlan``) and ``stats()["plan"]`` says what was chosen. ``max_inflight_offload_bytes``
    / ``max_inflight_reload_bytes`` bound the bytes on their way (an offload past the bound
    waits on the host for the oldest; a prefetch past it is left to its layer's own load).
    """
    if mode not in MODES:
        raise ValueError(f"unknown hprt.torch mode {mode!r}; one of {', '.join(MODES)}")
    if predicate is not None and mode not in ("swap", "keyed", "pipeline"):
        raise ValueError(f"hprt.torch mode {mode!r} takes no predicate (the swap modes do); "
                         "use min_bytes")
    _check_plan_args(mode, budget, offload_fraction)
    window = dict(max_inflight_offload_bytes=max_inflight_offload_bytes,
                  max_inflight_reload_bytes=max_inflight_reload_bytes)
    _check_attach_args(model, mode, layers, min_bytes, predicate, compression, runtime_,
                       prefetch, window)
    if isinstance(layers, str) or layers is None:
        layers = find_layers(model, layers)
    layers = list(layers)
    _check_layers(layers)
    _refuse_attached(layers)
    rt = runtime_ if runtime_ is not None else Runtime(platform, compression=compression,
                                                        **window)
    if runtime_ is not None and compression not in ("off", rt.compression):
        raise ValueError(
            f"hprt.torch.attach: compression={compression!r}, but the Runtime given "
            f"(runtime_=) compresses with {rt.compression!r}: a runtime's front ends share its "
            "setting; give it to Runtime(compression=...), or attach without runtime_")
    if mode in ("compress", "managed_compress"):
        _check_host_compression(model, mode, rt)
    # Nothing is installed above; from here on a failure removes what was (``undo``).
    undo = []
    try:
        return _attach(model, mode, layers, rt, runtime_, min_bytes, predicate, prefetch, budget,
                       offload_fraction, window, undo)
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise


def _attach(model, mode, layers, rt, runtime_, min_bytes, predicate, prefetch, budget,
            offload_fraction, window, undo):
    """``attach`` once its arguments are checked; appends to ``undo`` what removes each thing
    it installed, for a failure part way."""
    plan = None
    if budget is not None or offload_fraction is not None:
        plan = _OffloadPlan(rt, len(layers), budget, offload_fraction, predicate)
        predicate = plan.takes
    windowed = runtime_ is not None and any(v is not None for v in window.values())
    if mode == "swap":
        live = SwapManager._instances.get(id(rt))
        if live is not None and live.handles:
            # One manager per runtime (hyper_parallel's singleton): a second model's layers
            # would share its hooks, and either handle's detach would remove both.
            raise ValueError(
                "hprt.torch: this Runtime's SwapManager already has hooks on other layers (an "
                "attach(mode='swap') not detached, or set_forward_prefetch_layer); detach() them "
                "first, or attach this model with a Runtime of its own")
        mgr = SwapManager(rt, min_bytes=min_bytes, custom_check_fn=predicate)
        if live is None:  # made here: a failure forgets it again
            undo.append(lambda: SwapManager._instances.pop(id(rt), None))
        on_detach = [mgr.detach]
        if runtime_ is None:  # the handle's own runtime: its SwapManager goes with the handle
            on_detach.append(lambda: SwapManager._instances.pop(id(rt), None))
        handle = Attached(mode, layers, rt, [mgr.flow.settle], on_detach=on_detach,
                          stats_extra=plan and plan.stats)
        undo.append(handle.detach)
        handle._handles = mgr.handles
        if windowed:
            rt.layers.set_window(window["max_inflight_offload_bytes"],
                                 window["max_inflight_reload_bytes"])
        for a, b in zip(layers[:-1], layers[1:]):
            mgr.set_forward_prefetch_layer(a, b)
        if len(layers) == 1:
            mgr._layer(layers[0])
        handle._handles = mgr.handles
        _hook_plan(handle, layers, plan)
        return handle
    settle, extra, on_detach = [], None, []
    if mode == "keyed":
        front_end = rt.new_keyed()
        flow = _Flow(front_end.end_iteration)
        undo.append(lambda: rt.retire(front_end, flow))
        if windowed:
            front_end.set_window(window["max_inflight_offload_bytes"],
                                 window["max_inflight_reload_bytes"])
        tag = f"attach{id(rt)}.layers.*"
        ctxs = [TensorSwapContext(tag, predicate, prefetch, min_bytes, rt, (front_end, flow))
                for _ in layers]
        front, settle = _ContextFront(lambda i: ctxs[i]), [flow.settle]
        on_detach = [undo.pop()]
    elif mode == "pipeline":
        front = _PipelineFront(rt, min_bytes, predicate, prefetch, len(layers))
        undo.append(lambda: rt.retire(front.off, front.flow))
        if windowed:
            front.off.set_window(window["max_inflight_offload_bytes"],
                                 window["max_inflight_reload_bytes"])
        settle, extra = [front.flow.settle], front.stats
        on_detach = [undo.pop()]
    elif mode == "keep":
        front = _ContextFront(lambda i: keep_saved_tensors(rt, min_bytes))
    elif mode == "compress":
        comp = compress_saved_tensors(min_bytes, platform=rt.platform)
        front, extra = _ContextFront(lambda i: comp), lambda: _compress_stats(comp)
    else:
        comp = ManagedCompression(rt.platform, min_numel=max(1, min_bytes // 4),
                                  encode_gbps=1.0, decode_gbps=1.0)
        front, settle = _ContextFront(comp.layer), [comp.flow.settle]
        extra = lambda: _managed_stats(comp)  # noqa: E731
    if plan is not None:
        extra = _merged(extra, plan.stats)
    handle = Attached(mode, layers, rt, settle, extra, on_detach)
    undo.append(handle.detach)
    for i, layer in enumerate(layers):
        opened = []

        def pre(mod, args, i=i, opened=opened):
            opened.append(front.enter(i))

        def post(mod, args, output, i=i, opened=opened):
            ctx = opened.pop() if opened else None
            if ctx is not None:
                front.exit(i, ctx)

        handle._handles.append(layer.register_forward_pre_hook(pre))
        handle._handles.append(layer.register_forward_hook(post, always_call=True))
    _hook_plan(handle, layers, plan)
    return handle


_COMPRESSIONS = ("off", "device", "host_stage", "auto")


def _check_attach_args(model, mode, layers, min_bytes, predicate, compression, runtime_,
                       prefetch, window):
    """``attach``'s arguments, checked before anything is installed (a wrong type failed only
    inside the first forward, or part way through installing hooks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hprt.torch.attach: model must be a torch.nn.Module, not "
                        f"{type(model).__name__}")
    if layers is not None and not isinstance(layers, (str, list, tuple, nn.ModuleList,
                                                      nn.Sequential)):
        raise TypeError("hprt.torch.attach: layers= takes a list (or tuple, nn.ModuleList, "
                        "nn.Sequential) of modules or a dotted path such as 'model.layers', not "
                        f"{type(layers).__name__}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
        raise TypeError(f"hprt.torch.attach: min_bytes must be an int (bytes), not "
                        f"{type(min_bytes).__name__}")
    if min_bytes < 0:
        raise ValueError(f"hprt.torch.attach: min_bytes must be >= 0, not {min_bytes}")
    if predicate is not None and not callable(predicate):
        raise TypeError(f"hprt.torch.attach: predicate must be callable (tensor -> bool), not "
                        f"{type(predicate).__name__}")
    if not isinstance(prefetch, bool):
        raise TypeError(f"hprt.torch.attach: prefetch must be True or False, not {prefetch!r}")
    if not isinstance(compression, str) or compression not in _COMPRESSIONS:
        raise ValueError(f"hprt.torch.attach: compression must be one of "
                         f"{', '.join(map(repr, _COMPRESSIONS))}, not {compression!r}")
    if compression != "off" and mode not in ("swap", "keyed", "pipeline"):
        raise ValueError(
            f"hprt.torch mode {mode!r} does not swap: compression={compression!r} "
            "(compress-then-swap) applies to the swap modes ('swap', 'keyed', 'pipeline'); "
            "mode='compress' or 'managed_compress' compresses without swapping")
    if runtime_ is not None and not isinstance(runtime_, Runtime):
        raise TypeError(f"hprt.torch.attach: runtime_ must be an hprt.torch.Runtime, not "
                        f"{type(runtime_).__name__}")
    for name, value in window.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"hprt.torch.attach: {name} must be a number of bytes (int >= 0) "
                             f"or None, not {value!r}")


def _check_layers(layers):
    """The layer list: not empty, modules only, each once (a block named twice was linked
    after itself: attach failed part way, its hooks left behind)."""
    if not layers:
        raise ValueError("hprt.torch.attach: layers= is empty (nothing would be attached); name "
                         "the model's blocks, or leave layers= out to find them")
    seen = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"hprt.torch.attach: layers= must hold torch.nn.Module objects; "
                            f"item {i} is {type(layer).__name__}")
        j = seen.setdefault(id(layer), i)
        if j != i:
            raise ValueError(f"hprt.torch.attach: layers= names {type(layer).__name__} twice "
                             f"(items {j} and {i}); each layer once, in forward order")


def _merged(first, second):
    """Two ``stats()`` extras as one (either may be None)."""
    if first is None:
        return second
    return lambda: {**first(), **second()}


def _hook_plan(handle, layers, plan):
    """The plan's per-layer hooks (which layer runs, its profile), removed with the handle's.
    Installed after the front end's: the profile times the layer from after the front end's
    pre-hook to before its post-hook, which is where a front end waits for the previous
    layer's copies (on a GPU, whenever the link is slower than the compute; timing those waits
    made slow copies look hidden behind compute)."""
    if plan is None:
        return
    for i, layer in enumerate(layers):
        handle._handles.append(layer.register_forward_pre_hook(
            lambda mod, args, i=i: plan.pre(i)))
        handle._handles.append(layer.register_forward_hook(
            lambda mod, args, output, i=i: plan.post(i), always_call=True, prepend=True))
