"""MindSpeed's activation compression (the ``managed_compress`` mode): torch's saved tensors
registered per layer with hprt's ``ActivationManager``, whose cost model decides what to encode
in each operator window and which decodes run ahead of backward."""

import torch

import hprt

from .compression import _CODEC_DTYPES, _of_parameter, _refuse_off_cpu
from .passes import _Flow, _Witness, _declined, _pushed
from .runtimes import _cpu_tensor_stream


class _ManagedKey(_Witness):
    """A tensor registered with the ActivationManager (and its witness); if its graph is
    dropped before the tensor was read, the key is queued for ``discard`` (done at the next
    layer boundary, not in the collector's context)."""

    __slots__ = ("key", "out", "owner", "taken", "pass_")

    def __init__(self, key, t, owner, pass_):
        _Witness.__init__(self, t)
        self.key, self.out, self.owner, self.taken = key, None, owner, False
        self.pass_ = pass_
        pass_.add()

    def __del__(self):
        if not self.taken:
            self.owner._dropped.append(self.key)
        self.pass_.drop()


class ManagedCompression:
    """MindSpeed's activation compression through hprt's ``ActivationManager``.

    ``with comp.layer(i): x = block(x)`` around each layer's forward: tensors the layer saves
    (f32/f16/bf16, contiguous, at least ``min_numel`` elements, not parameters) are registered
    under layer ``i``; the layer's forward is an operator window in which the previous layer's
    tensors are encoded on the manager's side stream and released. By default the window is
    unbounded: every registered tensor of the previous layer is encoded, so the same model and
    inputs compress the same tensors every step whatever the timing (the last layer's tensors,
    read first in backward, are not compressed). ``window_ms`` instead sizes the window by
    hprt's cost model (its codec throughputs are measured unless ``encode_gbps`` is given):
    what fits is encoded. In backward,
    the first tensor read of a layer starts that layer's backward, which decodes its tensors
    still compressed, and opens a window (sized as the forward's) over the rest of that
    layer's backward in which the next layer's tensors decode on the side stream. Layer 0
    begins a forward pass (see ``_Flow``: a pass overlapping a live one is left to autograd). ``stats()`` is ``ActivationManager.layer_stats()``.

    An encode that fails (no device memory for the encoding, say) keeps its tensor uncompressed:
    nothing is lost, the window goes on, ``stats()`` counts it per layer (``encode_failures``)
    and a ``RuntimeWarning`` says why when the window ends.

    Works where the platform addresses torch's memory as device memory (the cpu backend with
    CPU tensors); other tensors are left to autograd.
    """

    def __init__(self, platform=None, min_numel=32768, window_ms=None, encode_gbps=None,
                 decode_gbps=None):
        self.platform = platform if platform is not None else hprt.get_platform()
        # The manager's operators are torch's CPU ops: its waits for the codec stream block
        # the host (the synchronize after a take only reports the stream's errors).
        self.stream = _cpu_tensor_stream(self.platform)
        self.manager = hprt.ActivationManager(
            self.stream, self.platform, encode_gbps=encode_gbps, decode_gbps=decode_gbps,
            min_numel=min_numel)
        self.window_ms = window_ms
        self._backward_layer = None
        self._backward_window = False
        self._dropped = []
        self.flow = _Flow(self._discard_dropped)

    def _window_kw(self):
        return {"unbounded": True} if self.window_ms is None else {"fixed_ms": self.window_ms}

    def _end_backward_window(self):
        """Ends the window of the current layer's backward (the host waits for its decodes;
        a take of a tensor it was decoding may have ended it already)."""
        if self._backward_window:
            self._backward_window = False
            if self.manager.window_open:
                self.manager.end_window()

    def _discard_dropped(self):
        self._end_backward_window()
        while self._dropped:
            self.manager.discard(self._dropped.pop())

    def _eligible(self, t):
        return (
            t.dtype in _CODEC_DTYPES  # and on the CPU: _pack refused the others
            and self.platform.capabilities.device_memory_is_host
            and not _of_parameter(t)
            and not (t.is_leaf and t.requires_grad)
            and t.is_contiguous()
            and t.storage_offset() == 0
            and t.numel() > 0
        )

    def _pack(self, layer, t):
        _refuse_off_cpu("ManagedCompression", t)
        if not self._eligible(t):
            return _declined(t)
        key = self.manager.save(layer, t.detach(), borrow=True)
        return _declined(t) if key is None else _ManagedKey(key, t, self, self.flow.current)

    def _unpack(self, packed):
        if not isinstance(packed, _ManagedKey):
            return packed if isinstance(packed, torch.Tensor) else packed.read()
        packed.check()
        if packed.out is None:
            layer = packed.key[0]
            if self._backward_layer != layer:
                self._end_backward_window()
                self.manager.backward_start(layer)
                self._backward_layer = layer
                # The rest of this layer's backward is the next one's decode window (no hook
                # runs per backward operator: one window spans them).
                self.manager.begin_window(**self._window_kw())
                self._backward_window = True
            out = self.manager.take(packed.key)
            packed.taken = True
            self.stream.synchronize()
            packed.out = torch.from_dlpack(out)
        return packed.out

    def layer(self, layer):
        """The context manager around layer ``layer``'s forward."""
        return _ManagedLayer(self, layer)

    def stats(self):
        return self.manager.layer_stats()


class _ManagedLayer:
    def __init__(self, owner, layer):
        self.owner, self.layer = owner, layer
        self._hooks = None
        self._window = None

    def __enter__(self):
        o = self.owner
        if self.layer == 0:
            o.flow.start()
        if not o.flow.taking():
            return self
        o._discard_dropped()
        o._backward_layer = None
        o.manager.forward_start(self.layer)
        self._window = o.manager.window(**o._window_kw())
        self._window.__enter__()
        self._hooks = _pushed(lambda t: o._pack(self.layer, t), o._unpack)
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        if self._window is not None:
            self._window.__exit__(*exc)
            self._window = None


def _managed_stats(comp):
    """``ManagedCompression``'s per-layer statistics (``layers``) and their totals under
    ``stats()``'s common keys."""
    layers = comp.stats()
    return {"layers": layers,
            "compressed_tensors": sum(s["compressed"] for s in layers.values()),
            "compressed_bytes": sum(s["compressed_bytes"] for s in layers.values()),
            "raw_bytes": sum(s["original_bytes"] for s in layers.values())}
