"""The modes that do not swap: ``keep`` (saved tensors stay on the device, counted by the same
accounting: the baseline the other modes are measured against) and ``compress`` (lossless
compression of CPU tensors on a codec thread of hprt's, decoded ahead of backward's reads); and
the refusal of host compression where it would compress nothing (an accelerator's tensors)."""

import concurrent.futures
import threading
import warnings
import weakref

import torch
from torch import nn

import hprt
# This package: tests patch ``_CODEC_THREAD_MIN_BYTES`` and ``_empty_like_layout`` on
# ``hprt.torch``, so they are read through it.
from hprt import torch as _ht

from .memory import _is_dense, _platform_empty
from .passes import _Kept, _Packed, _declined, _pushed, _unpack_with
from .runtimes import is_swappable, runtime


class _Hooks:
    """A ``with`` block that installs ``_pack`` / ``_unpack`` as torch's saved-tensor hooks."""

    def __enter__(self):
        self._ctx = _pushed(self._pack, self._unpack)
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None


class keep_saved_tensors(_Hooks):
    """The no-swap baseline: saved tensors stay on the device, counted by the runtime's
    accounting like swapped ones (``with keep_saved_tensors(): loss = model(x)``)."""

    def __init__(self, runtime_=None, min_bytes=0):
        self.rt = runtime_ if runtime_ is not None else runtime()
        self.min_bytes = min_bytes

    def _pack(self, t):
        if not is_swappable(t, self.rt, self.min_bytes):
            return _declined(t)
        return _Kept(self.rt.borrow(t), t)

    _unpack = staticmethod(_unpack_with(None))


_CODEC_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _of_parameter(t):
    """Whether ``t`` is a parameter or a view of one (``nn.Linear``'s backward saves
    ``weight.t()``): its memory lives on whatever hprt does with the saved tensor, so
    compressing it would only cost the encode, every step (the swap modes' ``is_swappable``
    leaves them out the same way)."""
    if isinstance(t, nn.Parameter):
        return True
    base = t._base
    return base is not None and isinstance(base, nn.Parameter)


class compress_saved_tensors(_Hooks):
    """Lossless compression of saved f32/f16/bf16 dense CPU tensors: in pack, ``hprt.compress``
    of the tensor's memory is queued on a codec thread of hprt's (the step goes on while it
    encodes, as an accelerator's codec stream would; the raw tensor is let go once its encoding
    exists; tensors under 128 KiB are encoded in the hook); in unpack, ``hprt.decompress_into``
    a tensor of the same shape, strides and storage offset, while the codec thread decodes the
    next ``decode_ahead`` tensors backward will read (the latest saved ones not read yet). A
    failed encode keeps the raw tensor (nothing is lost; unpack returns it) and warns.
    ``platform`` (a cpu platform) gives the decoded tensors its device memory, reused from one
    step to the next (see ``_host_reload``); ``stats()`` counts raw and compressed bytes.
    A saved f32/f16/bf16 tensor on another device raises ``hprt.UnsupportedError`` (on an
    accelerator, compress-then-swap compresses: ``attach(..., compression="device")``)."""

    def __init__(self, min_bytes=0, platform=None, decode_ahead=4):
        self.min_bytes, self.decode_ahead = min_bytes, decode_ahead
        self.platform = (platform if platform is not None and platform.capabilities.device_memory_is_host
                         else None)
        self._stats = {"tensors": 0, "raw_bytes": 0, "compressed_bytes": 0, "decoded_ahead": 0}
        self._stats_lock = threading.Lock()
        self._codec = None
        self._order = []  # weak references to what pack returned, in order of saving
        self._prune_at = 1024

    def _pack(self, t):
        _refuse_off_cpu("compress_saved_tensors", t)
        if (
            t.dtype not in _CODEC_DTYPES
            or _of_parameter(t)
            or (t.is_leaf and t.requires_grad)
            or t.numel() == 0
            or t.nbytes < self.min_bytes
            or not _is_dense(t)
        ):
            return _declined(t)
        flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())  # memory order
        raw = [flat]
        small = t.nbytes < _ht._CODEC_THREAD_MIN_BYTES
        if small:
            encoded = self._encode(raw)
        else:
            if self._codec is None:
                self._codec = concurrent.futures.ThreadPoolExecutor(1, "hprt-codec")
            encoded = self._codec.submit(self._encode, raw)
        # ref[2] holds the decode begun ahead (a future), or _TAKEN once unpack took it.
        packed = _Packed((encoded, raw, [None], tuple(t.shape), t.stride(), t.storage_offset(),
                          t.dtype, self.platform), t)
        if small:
            return packed
        if len(self._order) >= self._prune_at:  # passes whose backward never came
            self._order = [w for w in self._order if self._waiting(w())]
            self._prune_at = max(1024, 2 * len(self._order))
        self._order.append(weakref.ref(packed))
        return packed

    def _encode(self, raw):
        """The encoding of ``raw[0]``, which it then lets go of; None (``raw[0]`` kept) if the
        encode failed."""
        try:
            blob = hprt.compress(raw[0])
        except Exception as e:  # noqa: BLE001  (any failure: the raw bytes stay)
            warnings.warn(f"hprt.torch: a saved tensor's encode failed ({e}); it is kept "
                          "uncompressed", RuntimeWarning, stacklevel=2)
            return None
        with self._stats_lock:
            self._stats["tensors"] += 1
            self._stats["raw_bytes"] += raw[0].nbytes
            self._stats["compressed_bytes"] += len(blob)
        raw[0] = None
        return blob

    def stats(self):
        """Tensors compressed, their raw and compressed bytes, decodes begun ahead of their
        unpack (encodes still queued are waited for first)."""
        if self._codec is not None:
            self._codec.submit(lambda: None).result()
        with self._stats_lock:
            return dict(self._stats)

    @staticmethod
    def _waiting(packed):
        return packed is not None and packed.ref[2][0] is not _TAKEN

    def _load(self, packed):
        slot = packed.ref[2]
        ahead, slot[0] = slot[0], _TAKEN
        self._decode_ahead()
        return ahead.result() if ahead is not None else self._decompress(packed.ref)

    def _decode_ahead(self):
        """Queues the decodes of the next tensors backward reads (the latest saved ones not read
        yet) on the codec thread, up to ``decode_ahead`` of them begun."""
        order = self._order
        while order and not self._waiting(order[-1]()):
            order.pop()
        begun = 0
        for w in reversed(order):
            if begun >= self.decode_ahead:
                break
            p = w()
            if not self._waiting(p):
                continue
            if p.ref[2][0] is None:
                p.ref[2][0] = self._codec.submit(self._decompress, p.ref)
                with self._stats_lock:
                    self._stats["decoded_ahead"] += 1
            begun += 1

    def _unpack(self, packed):
        return packed if isinstance(packed, torch.Tensor) else packed.read(self._load)

    @staticmethod
    def _decompress(ref):
        encoded, raw, _, shape, stride, offset, dtype, platform = ref
        blob = encoded if not isinstance(encoded, concurrent.futures.Future) else encoded.result()
        if blob is None:  # the encode failed: the raw bytes were kept
            return raw[0].as_strided(shape, stride, offset)
        if platform is not None:
            out = _platform_empty(platform, shape, stride, offset, dtype)
        else:
            out = _ht._empty_like_layout(shape, stride, offset, dtype, "cpu")
        flat = out.as_strided((out.numel(),), (1,), offset)
        hprt.decompress_into(blob, flat)
        return out


_TAKEN = object()  # a compressed tensor unpack took (its decode is not begun ahead)

# Tensors under this size are encoded and decoded in the hook itself: handing them to the codec
# thread and back costs more than their encode (~100 µs at ~1.5 GB/s). Read as
# ``hprt.torch._CODEC_THREAD_MIN_BYTES`` (this value, unless a test set another there).
_CODEC_THREAD_MIN_BYTES = 128 << 10


def _host_compression_refused(what, where):
    """The compress modes encode CPU tensors on the host; on an accelerator they would leave
    every saved tensor to autograd, compressing nothing: refused, naming what does compress
    there (compress-then-swap, whose device codec runs on the accelerator)."""
    return hprt.UnsupportedError(
        f"{what} compresses CPU tensors on the cpu backend; {where}. On an accelerator use "
        "mode='swap' (or 'keyed' / 'pipeline') with compression='device' or 'auto': "
        "compress-then-swap, encoded on the device")


def _check_host_compression(model, mode, rt):
    devices = sorted({p.device.type for p in model.parameters()})
    if not rt.platform.capabilities.device_memory_is_host or devices not in ([], ["cpu"]):
        raise _host_compression_refused(
            f"hprt.torch mode {mode!r}",
            f"this model's parameters are on {', '.join(devices) or 'no device'} and the "
            f"platform is {rt.backend!r}")


def _refuse_off_cpu(what, t):
    """A saved tensor the host codec would compress, were it a CPU tensor: refused on any
    other device (see ``_host_compression_refused``)."""
    if t.dtype in _CODEC_DTYPES and not t.is_cpu and t.numel() > 0 and not isinstance(
            t, nn.Parameter):
        raise _host_compression_refused(what, f"autograd saved a tensor on {t.device}")


def _compress_stats(comp):
    """``compress_saved_tensors.stats()`` with its count under ``stats()``'s common key."""
    s = comp.stats()
    s["compressed_tensors"] = s["tensors"]
    return s
