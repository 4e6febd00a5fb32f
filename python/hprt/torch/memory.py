"""A reload must hand autograd a tensor indistinguishable from the one it saved, in memory torch
can free again. Here: the layout a reload recreates (shape, strides, storage offset), the memory
it lands in (the cpu platform's caching allocator on the cpu backend, torch's elsewhere), and the
hand-over of memory to torch's stream-ordered allocator on the cuda backend (``record_stream``).
Shared by the swap front ends (through ``Runtime``) and by compress mode's decodes."""

import torch

# This package: tests patch ``_empty_like_layout`` and ``_host_reload`` on ``hprt.torch``,
# so they are called through it.
from hprt import torch as _ht


def _is_dense(t):
    """Whether ``t``'s elements fill exactly ``numel * itemsize`` bytes from ``data_ptr()``."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _span(shape, stride, offset):
    """Elements of storage a tensor of this layout reaches."""
    return offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def _empty_like_layout(shape, stride, offset, dtype, device):
    """A tensor of ``shape`` and ``stride`` at storage offset ``offset``."""
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return torch.empty(_span(shape, stride, offset), dtype=dtype, device=device).as_strided(
        shape, stride, offset)


class _Allocate:
    """What a borrowed payload's reload calls for its memory, on every backend: a tensor of the
    saved layout (``Runtime.empty_layout``), with the stream it was handed out for (see
    ``Runtime.handed_out``). One object holding plain tuples, not a closure's cells: see
    ``_Witness`` on the collector."""

    __slots__ = ("rt", "layout", "device")

    def __init__(self, t, rt):
        self.layout, self.device, self.rt = _layout(t), t.device, rt

    def __call__(self):
        return self.rt.handed_out(self.rt.empty_layout(self.layout, self.device))


def _layout(t):
    """What a reload recreates: shape, strides and storage offset in elements, dtype,
    itemsize."""
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.itemsize


def _host_reload(capsule, layout):
    """The tensor of ``layout`` in a DLPack capsule of the cpu platform's device memory
    (``Platform.alloc_dlpack``: where every reload lands on the cpu backend). That memory comes
    from the platform's caching allocator (the cpu backend's, like a GPU framework's): a reload
    reuses the blocks earlier reloads freed, where torch's CPU allocator would hand glibc's
    memory back and fault fresh pages in for every reload. ``capsule`` is None when the
    platform has no room: torch's allocator makes the tensor.

    The capsule holds the layout itself where it can; a storage offset, or a dtype hprt
    carries as bytes, comes as one row to restride."""
    shape, stride, offset, dtype, _ = layout
    if capsule is None:
        return _ht._empty_like_layout(shape, stride, offset, dtype, "cpu")
    out = torch.from_dlpack(capsule)
    if offset or out.dtype is not dtype:
        return out.view(dtype).as_strided(shape, stride, offset)
    return out


def _platform_empty(platform, shape, stride, offset, dtype):
    """A CPU tensor of this layout in the cpu platform's device memory (see ``_host_reload``)."""
    layout = (shape, stride, offset, dtype, dtype.itemsize)
    return _ht._host_reload(platform.alloc_dlpack(layout, _HPRT_DTYPES.get(dtype, "u8")), layout)


class _StreamRecorder:
    """``FrameworkMemory``'s ``record_stream`` for CUDA tensors: torch's caching allocator
    reuses a tensor's block only after the work queued so far on an hprt copy stream
    (``Tensor.record_stream``), so hprt lets go of an offloaded tensor when its copy is queued
    and of a reloaded one when torch's stream waits for it (on a GPU the host runs far ahead of
    the device: holding them until the host sees the copies finish kept most of a pass's layers
    alive). hprt's streams are few and long-lived: one ``ExternalStream`` each."""

    def __init__(self, kind):
        self.kind, self.streams = kind, {}

    def __call__(self, t, raw):
        s = self.streams.get(raw)
        if s is None:
            s = self.streams[raw] = getattr(torch, self.kind).ExternalStream(raw)
        t.record_stream(s)


def _stream_recorder(device_type):
    """The ``record_stream`` for torch tensors of ``device_type`` where torch puts them in a
    stream-ordered caching allocator (CUDA tensors); None elsewhere (CPU tensors; torch_npu's
    NPU tensors, whose ``record_stream`` hprt has not been tried with on hardware): the platform
    then keeps its reference until it sees the copy finished."""
    return _StreamRecorder(device_type) if device_type == "cuda" else None


# torch dtypes under hprt's names (what compress-then-swap can encode; others travel as bytes).
_HPRT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.float64: "f64"}
