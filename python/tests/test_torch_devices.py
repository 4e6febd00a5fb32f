"""hprt.torch's CUDA and NPU paths without the hardware: on the accelerator backends' emulators
(scripts/test points HP_CUDA_LIB / HP_ACL_LIB at them), torch's CUDA / NPU tensors are stood in
for by objects over emulator device memory that show what hprt.torch reads of a tensor
(``device.type``, ``data_ptr()``, ``nbytes``, sizes, strides, storage offset, ``_version``), and
torch's current stream (``torch.cuda.current_stream().cuda_stream``, torch_npu's
``torch.npu.current_stream().npu_stream``) by an emulator stream's raw handle. These prove the
stream is wrapped and ordered by events (no host wait), the borrowed memory is released and
re-acquired through the allocator with its strides and offset, and the bytes round-trip exactly.
They prove nothing about torch on real devices (the README says: untested on hardware)."""

import types

import pytest

torch = pytest.importorskip("torch")

import hprt  # noqa: E402
import hprt.torch as ht  # noqa: E402
from emulated import EMULATED  # noqa: E402

ITEM = 4  # float32


class StandInTensor:
    """A torch tensor of ``device`` as hprt.torch sees one, over emulator device memory."""

    def __init__(self, buf, shape, stride, offset, device):
        self.buf, self.shape, self._stride, self._offset = buf, tuple(shape), tuple(stride), offset
        self.dtype, self.device, self._version = torch.float32, device, 0
        self.itemsize = ITEM

    def size(self):
        return torch.Size(self.shape)

    def stride(self):
        return self._stride

    def storage_offset(self):
        return self._offset

    def detach(self):
        return self

    def numel(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self):
        return self.numel() * ITEM

    def data_ptr(self):
        return self.buf.ptr + self._offset * ITEM


def span_bytes(shape, stride, offset):
    return (offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))) * ITEM


@pytest.mark.parametrize("backend", EMULATED)
def test_device_tensors_swap_on_torch_current_stream_by_events(backend, monkeypatch):
    p = hprt.open_platform(backend)
    rt = ht.Runtime(p)
    device = types.SimpleNamespace(type=backend, index=0)
    torch_stream = p.create_stream()  # stands for torch's current stream
    asked = []

    def current_stream(device=None):
        asked.append(device)
        return types.SimpleNamespace(**{ht._STREAM_ATTR[backend]: torch_stream.raw})

    monkeypatch.setattr(torch, backend, types.SimpleNamespace(current_stream=current_stream),
                        raising=False)
    made = []

    def allocate(shape, stride, offset, dtype, dev):  # torch.empty_strided on the device
        made.append((tuple(shape), tuple(stride), offset, dtype, dev))
        return StandInTensor(p.alloc_device(span_bytes(shape, stride, offset)), shape, stride,
                             offset, dev)

    monkeypatch.setattr(ht, "_empty_like_layout", allocate)

    # A transposed view 8 elements into its storage: shape (64, 96), strides (1, 64).
    shape, stride, offset = (64, 96), (1, 64), 8
    t = StandInTensor(p.alloc_device(span_bytes(shape, stride, offset)), shape, stride, offset,
                      device)
    assert rt.addressable(t) and not rt.addressable(StandInTensor(t.buf, shape, stride, offset,
                                                                  types.SimpleNamespace(type="cpu")))
    data = bytes((i * 7 + 3) % 251 for i in range(t.nbytes))
    pinned = p.alloc_pinned(t.nbytes)
    pinned.write(data)
    # torch's stream is busy, then writes the tensor: hprt's copy must come after, by an event.
    scratch = p.alloc_device(32 << 20)
    for _ in range(40):  # some 0.2 s of work: the launch below takes far less
        p.memset(scratch, 1, 32 << 20, torch_stream)
    p.copy(t.buf, pinned, torch_stream, nbytes=t.nbytes, dst_offset=offset * ITEM)
    written = torch_stream.record_event()

    ref = rt.layers.add_storage("g", rt.borrow(t))
    assert rt.stats()["device_current"] == t.nbytes
    rt.layers.launch_offload("g", rt.compute_stream(t.device))
    assert asked == [device], "torch's current stream of the tensor's device is used"
    assert not written.query(), "launching the offload waited for torch's stream on the host"
    rt.layers.wait_offload("g")
    assert rt.stats()["device_current"] == 0, "the borrowed memory is released"

    rt.layers.launch_load("g")
    assert made == [(shape, stride, offset, torch.float32, device)]
    rt.layers.wait_load("g", rt.compute_stream(t.device))
    out = rt.layers.take(ref)
    assert isinstance(out, StandInTensor) and out.stride() == stride
    assert out.storage_offset() == offset and out.size() == torch.Size(shape)
    # Read after the work queued on torch's stream: the reload is ordered before it.
    assert p.read(out.buf, t.nbytes, torch_stream, offset * ITEM) == data
    del out
    rt.layers.end_iteration()
    assert rt.stats()["device_current"] == 0
