"""The activation manager without windows (``schedule="eager"``) as torch's saved-tensor hooks,
written the way a user writes them: GPT-2 and Llama built from configs train under every pattern
of ``test_torch_patterns`` with the plain-torch run's losses and gradients bit for bit, and the
saved activations are really compressed and decoded ahead of backward's reads."""

import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hprt  # noqa: E402
import test_torch_patterns as tp  # noqa: E402

pytestmark = pytest.mark.skipif(tp.DEVICE != "cpu", reason="CPU tensors on the cpu backend")


class _Saved:
    """What pack returns: the manager's key, and the tensor once unpack has read it (a graph
    kept with ``retain_graph`` reads it again). A graph dropped unread discards its key. torch
    does not check a hooked tensor's version counter, so the hooks do: a weak reference and the
    version at save time (an in-place write after the save is an error, as in plain torch)."""

    def __init__(self, hooks, key, t):
        self.key, self.out = key, None
        self.layout = (t.shape, t.stride(), t.dtype)
        self.version, self.ref = t._version, weakref.ref(t)
        self._discard = weakref.finalize(self, hooks.dropped.append, key)


class EagerHooks:
    def __init__(self, platform, decode_ahead=2):
        self.m = hprt.ActivationManager(platform.create_stream(), platform, encode_gbps=1.0,
                                        decode_gbps=1.0, min_numel=64, schedule="eager",
                                        decode_ahead=decode_ahead)
        self.dropped = []

    def pack(self, t):
        while self.dropped:
            self.m.discard(self.dropped.pop())
        if (isinstance(t, torch.nn.Parameter) or t._base is not None or t.storage_offset() != 0
                or not t.is_contiguous() or t.dtype not in (torch.float32, torch.bfloat16)):
            return t
        key = self.m.save(0, t.detach(), borrow=True)
        return t if key is None else _Saved(self, key, t)

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        t = saved.ref()
        if t is not None and t._version != saved.version:
            raise RuntimeError("a saved tensor was modified by an inplace operation")
        if saved.out is None:
            shape, stride, dtype = saved.layout
            saved.out = torch.from_dlpack(self.m.take(saved.key)).as_strided(shape, stride)
            assert saved.out.dtype == dtype
            saved._discard.detach()
        return saved.out

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# ``exception_in_forward`` also checks that hprt.torch's per-layer hooks are gone after the
# error; these hooks span the whole run, so it runs below without that check.
PATTERNS = sorted(p for p in tp.PATTERNS if p != "exception_in_forward")


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("model_name", sorted(tp.MODELS))
@pytest.mark.parametrize("jitter", [None, 3])
def test_eager_manager_hooks_train_bit_exact(model_name, pattern, jitter):
    want = tp.baseline(model_name, pattern)
    platform = hprt.cpu_platform(device_memory=256 << 20, jitter=jitter)
    hooks = EagerHooks(platform)
    torch.manual_seed(0)
    model = tp.new_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = tp.Recorder(model)
    with hooks.hooks():
        tp.PATTERNS[pattern](model, opt, tp.data_for(), rec)
    tp.assert_identical(rec.values, want)
    stats = hooks.m.layer_stats()[0]
    assert stats["compressed"] > 0 and stats["encode_failures"] == 0, stats
    if pattern == "steps":
        # Backward reads in reverse order of saving: the decodes were begun ahead of the reads.
        assert stats["decoded_ahead"] > stats["compressed"] // 2, stats
    del model, opt, rec
    while hooks.dropped:
        hooks.m.discard(hooks.dropped.pop())


def _exception_in_forward(model, opt, data, rec):
    """``exception_in_forward`` without its check on hprt.torch's own hooks: a layer's MLP raises
    in the middle of a forward (its graph, with tensors already saved, is dropped); training
    goes on."""
    tp.step_raising_once(model, opt, data[0], rec,
                         tp.layers_of(model)[1].mlp.register_forward_pre_hook)
    tp.step(model, opt, data[1], rec)
    tp.step(model, opt, data[2], rec)


@pytest.mark.parametrize("model_name", sorted(tp.MODELS))
def test_eager_manager_hooks_survive_an_exception_inside_a_layer(model_name):
    want = tp.baseline(model_name, "exception_in_forward")
    hooks = EagerHooks(hprt.cpu_platform(device_memory=256 << 20, jitter=3))
    torch.manual_seed(0)
    model = tp.new_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = tp.Recorder(model)
    with hooks.hooks():
        _exception_in_forward(model, opt, tp.data_for(), rec)
    tp.assert_identical(rec.values, want)
    assert hooks.m.layer_stats()[0]["compressed"] > 0


def test_an_in_place_write_to_a_saved_tensor_is_an_error_as_in_plain_torch():
    """Writing a saved tensor in place after the forward: plain torch refuses the backward;
    with the hooks it is refused too (never a gradient from the modified bytes, which a borrowed
    tensor's encode may even have read half-written). Without the hooks' own version check the
    backward ran."""
    x = torch.randn(64, 256, requires_grad=True)

    def forward():
        h = x.sigmoid()  # saves its output
        return h, (h * 3).sum() + h.sum()

    h, loss = forward()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    hooks = EagerHooks(hprt.cpu_platform(device_memory=64 << 20))
    with hooks.hooks():
        h, loss = forward()
    assert hooks.m.layer_stats()[0]["saved"] > 0  # the sigmoid's output, its encode queued
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert x.grad is None
