"""Megatron-LM's fine-grained activation offloading under its own names, so that model code that
marks offload groups inside a layer runs on hprt's ``PipelineOffload``
(``fine_grained_offloading_*``, ``PipelineOffloadManager``,
``FineGrainedActivationOffloadingInterface``); and the ``pipeline`` mode of ``attach``, which
makes each layer a group for models that mark nothing."""

import contextlib

import torch
from torch import nn

from .passes import _Flow, _Packed, _declined, _load_layer, _pushed, _unpack_with
from .runtimes import _STREAM_ATTR, is_swappable, runtime


def _refuse_graph_capture(what):
    """hprt's copies, pinned pool and host waits cannot be captured in a CUDA graph: offloading
    inside a capture is refused by name, never recorded wrong."""
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available() and cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"hprt.torch: {what} inside a CUDA graph capture is not supported (hprt's offload "
            "stream, pinned pool and waits are not capturable); capture the layer without "
            "fine-grained offloading, or offload only the groups outside the captured scope")


def _not_offloadable(t):
    return (getattr(t, "_do_not_offload", False) or getattr(t, "_TE_do_not_offload", False)
            or getattr(t, "offloading_activation", True) is False)


class PipelineOffloadManager:
    """Megatron-LM's ``PipelineOffloadManager`` (``get_instance()``) over hprt's
    ``PipelineOffload``: a ``with`` block (``get_fine_grained_offloading_context(True)``) around a
    model chunk's forward installs the saved-tensor hooks; ``fine_grained_offloading_group_start``
    / ``_commit`` mark a group; the commit's backward reloads it, the start's backward ends it;
    ``fine_grained_offloading_reset()`` starts an iteration.

    As in Megatron-LM: without a chunk handler (``fine_grained_offloading_init_chunk_handler``)
    the markers are identities; tensors under ``min_offloaded_tensor_size`` elements stay on the
    device; ``set_last_layer(True)`` keeps the groups committed in the chunk's last layer on the
    device while that chunk's backward is the next to run; a commit with ``delay_offload=True``
    launches its offload at ``flush_delayed_groups()``; ``forced_released_tensors`` are released
    (``untyped_storage().resize_(0)``) once their group's offload completed."""

    _instance = None

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def reset_instance(cls, runtime_=None):
        """A fresh singleton (on ``runtime_``)."""
        cls._instance = cls(runtime_)
        return cls._instance

    def __init__(self, runtime_=None):
        self.rt = runtime_ if runtime_ is not None else runtime()
        self.off = self.rt.new_pipeline()
        self.min_elems = 1024 * 1024
        self.group_open = False
        self.has_chunk = False
        self.do_offload = True
        self._hooks = []
        # Storages autograd keeps on the device in this iteration: never force-released (a kept
        # saved tensor reading released memory would crash).
        self._kept = set()
        # (hprt's borrowed buffer, tensor) of forced-released tensors whose group's offload has
        # not completed yet.
        self._forced = []

    def init_model_chunk_offload_handler(self, vp_size=1, vp_stage=None,
                                         min_offloaded_tensor_size=1024 * 1024):
        self.min_elems = min_offloaded_tensor_size
        self.off.init_chunk(vp_size or 1, vp_stage)
        self.has_chunk = True

    def set_last_layer(self, is_last_layer):
        """Megatron-LM: whether the current chunk's forward is in its last layer."""
        if self.has_chunk:
            self.off.set_last_layer(bool(is_last_layer))

    def disable_offload(self):
        """Tensors saved from now on stay on the device."""
        self.do_offload = False
        self.off.disable()

    def enable_offload(self):
        self.do_offload = True
        self.off.enable()

    def flush_delayed_groups(self):
        """Launches the offloads of the groups committed with ``delay_offload=True``."""
        self.off.flush_delayed_groups(self.rt.compute_stream(None))
        self._release_forced()

    def reset(self):
        self.off.reset()
        self.has_chunk = self.group_open = False
        self._kept.clear()
        self._forced = []

    def stats(self):
        return self.rt.stats()

    def mark_not_offloadable(self, tensor):
        """Megatron-LM: ``tensor`` stays on the device when saved (its flag ``_do_not_offload``;
        Transformer Engine's ``_TE_do_not_offload`` and the older ``offloading_activation =
        False`` are honoured too)."""
        if tensor is not None:
            tensor._do_not_offload = True

    def _pack(self, t):
        if (self.group_open and t.numel() >= self.min_elems and is_swappable(t, self.rt)
                and not _not_offloadable(t)):
            _refuse_graph_capture("fine-grained activation offloading")
            tag = self.off.save(self.rt.borrow(t))
            if tag.offloaded:
                return _Packed(tag, t)
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            self._kept.add(t.untyped_storage().data_ptr())
        return _declined(t) if isinstance(t, torch.Tensor) else t

    def _load(self, packed):
        # Handed over, as Megatron-LM's handler pops a tensor at unpack (_Packed keeps it for a
        # retained graph's second read).
        return self.off.take(packed.ref, self.rt.compute_stream(None))

    def _releasable(self, t):
        """Megatron-LM's check for a forced-released tensor (on this platform's device, at least
        ``min_offloaded_tensor_size`` elements), and hprt's: not a parameter, and no tensor saved
        under this manager's hooks in this iteration and kept on the device by autograd shares
        its storage (tensors saved outside the hooks are the caller's contract, as in
        Megatron-LM)."""
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
            return False
        if not self.rt.addressable(t) or t.numel() < max(self.min_elems, 1):
            return False
        storage = t.untyped_storage()
        return storage.nbytes() > 0 and storage.data_ptr() not in self._kept

    def _commit(self, forced, delay):
        _refuse_graph_capture("fine_grained_offloading_group_commit")
        self.group_open = False
        forced = [t for t in forced if self._releasable(t)]
        # The storage of a live torch tensor, which ``t`` keeps alive for hprt.
        bufs = [self.rt.platform.unsafe_wrap_device_memory(t.untyped_storage().data_ptr(),
                                                           t.untyped_storage().nbytes(), t)
                for t in forced]
        self.off.group_commit(self.rt.compute_stream(None), bufs, delay)
        self._forced.extend(zip(bufs, forced))
        self._release_forced()

    def _release_forced(self):
        """Releases the forced-released tensors whose group's offload completed (hprt freed its
        hold on them), as Megatron-LM does: ``untyped_storage().resize_(0)``."""
        waiting = []
        for buf, t in self._forced:
            if not buf.is_freed:
                waiting.append((buf, t))
                continue
            kind = t.device.type
            if kind in _STREAM_ATTR:  # torch's allocator reuses it only after the current stream
                t.record_stream(getattr(torch, kind).current_stream())
            t.untyped_storage().resize_(0)
        self._forced = waiting

    def __enter__(self):
        self._hooks.append(_pushed(self._pack, _unpack_with(self._load)))
        return self

    def __exit__(self, *exc):
        self._hooks.pop().__exit__(*exc)


class _GroupStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, manager, name):
        _refuse_graph_capture("fine_grained_offloading_group_start")
        ctx.manager = manager
        manager.off.group_start(name)
        manager.group_open = True
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.manager.off.backward_group_end()
        return grad, None, None


class _GroupCommit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, manager, name, forced, delay):
        ctx.manager, ctx.name = manager, name
        manager._commit(forced, delay)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        m = ctx.manager
        m.off.backward_group_begin(ctx.name, m.rt.compute_stream(None))
        return grad, None, None, None, None


def fine_grained_offloading_init_chunk_handler(vp_size=1, vp_stage=None,
                                               min_offloaded_tensor_size=1024 * 1024):
    """Megatron-LM: at the start of a micro-batch's forward through one model chunk."""
    PipelineOffloadManager.get_instance().init_model_chunk_offload_handler(
        vp_size, vp_stage, min_offloaded_tensor_size)


def fine_grained_offloading_set_last_layer(is_last_layer):
    """Megatron-LM: the current chunk's forward enters (``True``) or leaves its last layer;
    that layer's groups stay on the device while the chunk's backward is the next to run."""
    PipelineOffloadManager.get_instance().set_last_layer(is_last_layer)


def fine_grained_offloading_group_start(tensor, name=None):
    """Megatron-LM: the group ``name`` begins (identity on ``tensor``; without a chunk handler,
    ``tensor`` itself)."""
    manager = PipelineOffloadManager.get_instance()
    if not manager.has_chunk:
        return tensor
    return _GroupStart.apply(tensor, manager, name or "group")


def fine_grained_offloading_group_commit(tensor, name=None, forced_released_tensors=None,
                                         delay_offload=False):
    """Megatron-LM: the group ``name`` ends and is offloaded (identity on ``tensor``; a tuple or
    list gets the marker on its first element). ``forced_released_tensors``: tensors the
    group's saved tensors came from that torch would not free (held by the caller, like
    Megatron-LM's ``residual``); their storage is released (``resize_(0)``) once the group's
    offload completed, so their contents must not be read afterwards except through the
    group's saved tensors. A tensor under ``min_offloaded_tensor_size`` elements, a parameter,
    one whose storage autograd keeps on the device, and those of a group that stays on the
    device are not released. ``delay_offload=True`` queues the offload until
    ``fine_grained_offloading_group_flush_delayed_groups()``."""
    if isinstance(tensor, (tuple, list)):
        if not tensor:
            return tensor
        head = fine_grained_offloading_group_commit(tensor[0], name, forced_released_tensors,
                                                    delay_offload)
        return type(tensor)([head, *tensor[1:]])
    manager = PipelineOffloadManager.get_instance()
    if not manager.has_chunk:
        return tensor
    return _GroupCommit.apply(tensor, manager, name or "group", list(forced_released_tensors or ()),
                              bool(delay_offload))


def fine_grained_offloading_group_flush_delayed_groups():
    """Megatron-LM: launches the offloads committed with ``delay_offload=True``, in order."""
    PipelineOffloadManager.get_instance().flush_delayed_groups()


def fine_grained_offloading_disable_offload():
    PipelineOffloadManager.get_instance().disable_offload()


def fine_grained_offloading_enable_offload():
    PipelineOffloadManager.get_instance().enable_offload()


def _refuse_event_off_cuda(what):
    device_type = runtime().device_type
    if device_type != "cuda":
        raise NotImplementedError(
            f"hprt.torch: {what}(event) records a CUDA event for CUDA graph capture; this "
            f"runtime's tensors are {device_type} tensors, which have no CUDA graphs (call it "
            "without an event for the stream ordering alone)")


def _record_event(event, what):
    """Records ``event`` (a ``torch.cuda.Event``) on torch's current CUDA stream; where the
    runtime's tensors are not CUDA tensors there is no CUDA stream to record it on."""
    if event is None:
        return
    _refuse_event_off_cuda(what)
    torch.cuda.current_stream().record_event(event)


def fine_grained_offloading_forward_record(event=None):
    """Megatron-LM's CUDA-graph forward mark: ``event`` is recorded on the current stream, the
    offloads queued later wait for the current stream's work so far, and the current stream
    waits for the offloads queued so far (events, no host wait). hprt offloads are refused
    inside a capture, so this is the ordering Megatron-LM's eager path has."""
    manager = PipelineOffloadManager.get_instance()
    _record_event(event, "fine_grained_offloading_forward_record")
    manager.off.join_offloads(manager.rt.compute_stream(None))


class _BackwardRecord(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, event):
        ctx.event = event
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        manager = PipelineOffloadManager.get_instance()
        _record_event(ctx.event, "fine_grained_offloading_backward_record")
        manager.off.record_backward(manager.rt.compute_stream(None))
        return grad, None


def fine_grained_offloading_backward_record(tensor, event=None):
    """Megatron-LM's CUDA-graph backward mark (identity on ``tensor``): in backward, ``event``
    is recorded on the current stream and the current stream waits for every reload queued so
    far."""
    if event is not None:  # refused now, not in backward
        _refuse_event_off_cuda("fine_grained_offloading_backward_record")
    return _BackwardRecord.apply(tensor, event)


def fine_grained_offloading_reset():
    """Megatron-LM: the start of a training iteration."""
    PipelineOffloadManager.get_instance().reset()


def get_fine_grained_offloading_context(flag):
    return PipelineOffloadManager.get_instance() if flag else contextlib.nullcontext()


class FineGrainedActivationOffloadingInterface:
    """Megatron-LM's interface for marking one offload group in a module's forward:
    ``with FineGrainedActivationOffloadingInterface(offload, tensor, name) as tensor:`` starts
    the group on ``tensor`` and installs the saved-tensor hooks for the block;
    ``group_commit(...)`` (``group_offload`` in newer Megatron-LM) ends it. With ``offload``
    false everything is an identity."""

    def __init__(self, offload, tensor, name):
        self.offload, self.tensor, self.name = offload, tensor, name

    def __enter__(self):
        if self.offload:
            self.tensor = fine_grained_offloading_group_start(self.tensor, self.name)
            PipelineOffloadManager.get_instance().__enter__()
        return self.tensor

    def __exit__(self, *exc):
        if self.offload:
            PipelineOffloadManager.get_instance().__exit__(*exc)

    def group_offload(self, tensor, forced_released_tensors=None, delay_offload=False):
        if not self.offload:
            return tensor
        return fine_grained_offloading_group_commit(tensor, self.name, forced_released_tensors,
                                                    delay_offload)

    @staticmethod
    def group_commit(tensor, name, forced_released_tensors=None, delay_offload=False):
        return fine_grained_offloading_group_commit(tensor, name, forced_released_tensors,
                                                    delay_offload)

    @staticmethod
    def init_chunk_handler(vp_size, vp_stage, min_offloaded_tensor_size):
        fine_grained_offloading_init_chunk_handler(vp_size, vp_stage, min_offloaded_tensor_size)

    get_context = staticmethod(get_fine_grained_offloading_context)
    forward_record = staticmethod(fine_grained_offloading_forward_record)
    backward_record = staticmethod(fine_grained_offloading_backward_record)
    reset = staticmethod(fine_grained_offloading_reset)
    flush_delayed_groups = staticmethod(fine_grained_offloading_group_flush_delayed_groups)
    disable_offload = staticmethod(fine_grained_offloading_disable_offload)
    enable_offload = staticmethod(fine_grained_offloading_enable_offload)

    @staticmethod
    def mark_not_offloadable(tensor):
        PipelineOffloadManager.get_instance().mark_not_offloadable(tensor)

    @staticmethod
    def reset_instance():
        PipelineOffloadManager.reset_instance()


class _PipelineFront:
    """Megatron's pipeline offload driven per layer: one chunk per forward pass, one group per
    layer. A layer's first read in backward loads its group and, like Megatron-LM's chunk
    handler (a group's backward starts the next group's reload), starts reloading the layer
    before it in the same pass, so that reload overlaps this layer's backward (``prefetch``;
    ``stats()["prefetched_tensors"]`` counts the tensors whose reload began that way)."""

    def __init__(self, rt, min_bytes, predicate, prefetch=True, layers=None):
        self.rt, self.min_bytes, self.predicate = rt, min_bytes, predicate
        self.last = None if layers is None else layers - 1
        self.off = rt.new_pipeline()
        self.flow = _Flow(self.off.reset)
        self.layer = None
        self.prefetch, self.prefetched = prefetch, 0

    def _pack(self, t):
        if not is_swappable(t, self.rt, self.min_bytes, self.predicate):
            return _declined(t)
        return _Packed(self.off.save(self.rt.borrow(t)), t, self.layer, self.flow.current)

    def _load_one(self, packed):
        # Handed over: the offload keeps no reloaded tensor until the pass's reset (with `get`
        # every reloaded layer of a pass stayed allocated until the next one began).
        return self.off.take(packed.ref, self.rt.compute_stream())

    def _load(self, packed):
        ahead = None
        if self.prefetch and packed.pass_ is not None:
            ahead = lambda: self._prefetch(packed.pass_, packed.layer - 1)  # noqa: E731
        return _load_layer(packed, self._load_one, self._start, ahead)

    def _start(self, packed):
        self.off.prefetch(packed.ref)

    def _prefetch(self, pass_, layer):
        """Starts the reload of ``layer``'s group (one tag stands for its group)."""
        for ref in pass_.by_layer.get(layer, ()):
            other = ref()
            if other is not None and other.out is None:
                self.prefetched += self.off.prefetch(other.ref)
                return

    def stats(self):
        return {"prefetched_tensors": self.prefetched}

    def enter(self, i):
        if i == 0 and self.flow.start():
            self.off.init_chunk()
        if not self.flow.taking():
            return None
        self.layer = i
        # Megatron-LM's set_last_layer: the last layer's group, read first in backward, stays.
        self.off.set_last_layer(i == self.last)
        self.off.group_start(f"layer{i}")
        return _pushed(self._pack, _unpack_with(self._load))

    def exit(self, i, ctx):
        ctx.__exit__(None, None, None)
        self.off.group_commit(self.rt.compute_stream(None))
