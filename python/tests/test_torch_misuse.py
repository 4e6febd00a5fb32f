"""hprt.torch where a real client slips (ISSUE 32 items 1-7): tensors a mode leaves to autograd
(under ``min_bytes``, refused by a predicate, parameters), an evaluation forward with grad on,
weights changed between forward and backward, models built and freed in a loop, and wrong
arguments to ``attach``. On GPT-2 and Llama built from small transformers configs (as
``test_torch_patterns``), gradients compared with plain torch's by ``torch.equal``."""

import gc
import re
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hprt  # noqa: E402
import hprt.torch as ht  # noqa: E402
import test_torch_patterns as tp  # noqa: E402
from test_torch_patterns import platform  # noqa: E402,F401  (the fixture)

ATTACH_MODES = list(ht.MODES)  # keep, keyed, swap, pipeline, compress, managed_compress
if tp.DEVICE != "cpu":
    ATTACH_MODES = [m for m in ATTACH_MODES if m not in tp.HOST_COMPRESSION]
SWAP_MODES = ["swap", "keyed", "pipeline"]
MIB = 1 << 20


def no_hooks_left(model):
    return (not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


def steps(model, data, rec, n=2, first=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in data[first:first + n]:
        tp.step(model, opt, ids, rec)


def eval_forward_then_steps(model, data, rec, between=None):
    """An evaluation forward with grad on whose graph is dropped unused, then training steps."""
    model.eval()
    rec(tp.lm_loss(model, data[0]))
    model.train()
    if between is not None:
        between()
    steps(model, data, rec, first=1)


def plain(model_name, pattern):
    torch.manual_seed(0)
    model = tp.new_model(model_name)
    rec = tp.Recorder(model)
    pattern(model, tp.data_for(), rec)
    return rec.values


# ---- item 1: a declined saved tensor kept its graph alive for good ----------------------------


class Probe:
    def __call__(self, grad):
        return None


@pytest.mark.parametrize("mode", ATTACH_MODES)
@pytest.mark.parametrize("model_name", list(tp.MODELS))
def test_a_dropped_graph_of_declined_tensors_is_freed(model_name, mode, platform):
    """``min_bytes=1 MiB``: every saved tensor of these models is left to autograd. An
    evaluation forward with grad on, its graph dropped: the graph goes at once, by reference
    counting (a declined saved output held its grad_fn, which held the output: a cycle through
    autograd's nodes no collector frees, a whole graph leaked per forward), and the training
    steps after it are plain torch's."""
    freed = []

    def pattern(model, data, rec):
        seen = []

        def probe(mod, args, out):
            # A gradient hook on the first layer's output lives as long as its node does.
            hook = Probe()
            (out[0] if isinstance(out, tuple) else out).register_hook(hook)
            seen.append(weakref.ref(hook))

        handle = tp.layers_of(model)[0].register_forward_hook(probe)
        model.eval()
        loss = tp.lm_loss(model, data[0])
        handle.remove()
        assert seen[0]() is not None
        rec(loss)
        del loss
        freed.append(seen[0]() is None)  # without a collection
        gc.collect()
        freed.append(seen[0]() is None)
        model.train()
        steps(model, data, rec, first=1)

    want = plain(model_name, pattern)
    assert freed == [True, True]
    torch.manual_seed(0)
    model = tp.new_model(model_name)
    rec = tp.Recorder(model)
    with ht.attach(model, mode=mode, platform=platform, min_bytes=MIB):
        pattern(model, tp.data_for(), rec)
    assert freed[2:] == [True, True], "the dropped graph is still alive"
    tp.assert_identical(rec.values, want)


@pytest.mark.parametrize("mode", SWAP_MODES)
@pytest.mark.parametrize("model_name", list(tp.MODELS))
def test_a_predicate_mode_offloads_after_an_evaluation_forward(model_name, mode, platform):
    """With a predicate, the tensors it refuses were returned as they are: the evaluation
    forward's graph stayed alive, the swap modes took its pass for still live and offloaded
    nothing for the rest of the run (an OverlappingForwardWarning at each later step's
    forward). Every step after it offloads as the first one did, exactly."""
    torch.manual_seed(0)
    model = tp.new_model(model_name)
    rec = tp.Recorder(model)
    offloaded = []

    def count():
        offloaded.append(handle.stats()["offloaded_tensors"])

    with warnings.catch_warnings():
        warnings.simplefilter("error", ht.OverlappingForwardWarning)
        with ht.attach(model, mode=mode, platform=platform, min_bytes=0,
                       predicate=lambda t: t.numel() >= 512) as handle:
            data = tp.data_for()
            steps(model, data, rec, n=1)
            count()
            eval_forward_then_steps(model, data[1:], rec, between=count)
            count()
            steps(model, data, rec, n=1, first=4)
            count()
    per_step = offloaded[0]
    assert per_step > 0
    # The evaluation forward may offload too (its pass is the front end's); each step does,
    # as many as the first.
    assert offloaded[2] - offloaded[1] == 2 * per_step, offloaded
    assert offloaded[3] - offloaded[2] == per_step, offloaded

    def pattern(m, d, r):
        steps(m, d, r, n=1)
        eval_forward_then_steps(m, d[1:], r)
        steps(m, d, r, n=1, first=4)

    tp.assert_identical(rec.values, plain(model_name, pattern))


# ---- item 2: managed_compress switched itself off after one forward without backward ----------


@pytest.mark.skipif(tp.DEVICE != "cpu", reason="managed_compress compresses CPU tensors")
@pytest.mark.parametrize("model_name", list(tp.MODELS))
def test_managed_compress_keeps_compressing_after_a_forward_without_backward(model_name, platform):
    """SDPA (transformers' default attention) saves a non-contiguous output the manager
    declines; its graph stayed alive after a forward without backward, and managed_compress
    left every later pass to autograd (Llama: 52 tensors compressed per step, then 0, with a
    warning naming two forwards then one backward). Every step compresses the same tensors, no
    warning, gradients exact."""
    torch.manual_seed(0)
    model = tp.new_model(model_name)
    assert model.config._attn_implementation == "sdpa"
    rec = tp.Recorder(model)
    counts = []
    data = tp.data_for()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ht.attach(model, mode="managed_compress", platform=platform) as handle:
            def count():
                counts.append(handle.stats()["compressed_tensors"])

            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            tp.step(model, opt, data[0], rec)
            count()
            rec(tp.lm_loss(model, data[1]))  # a skipped step: its graph dropped unused
            count()
            for ids in data[2:4]:
                tp.step(model, opt, ids, rec)
                count()
    overlap = [str(w.message) for w in caught
               if issubclass(w.category, ht.OverlappingForwardWarning)]
    assert not overlap, overlap
    per_step = counts[0]
    assert per_step > 0
    assert [b - a for a, b in zip(counts[1:], counts[2:])] == [per_step, per_step], counts

    def pattern(m, d, r):
        tp.p_forward_without_backward(m, torch.optim.AdamW(m.parameters(), lr=1e-2), d, r)

    tp.assert_identical(rec.values, plain(model_name, pattern))


# ---- item 3: an in-place write to a declined saved tensor went undetected ---------------------

VERSION_ERROR = r"one of the variables needed for gradient computation has been modified by " \
                r"an inplace operation: \[(\S+ \[[0-9, ]+\])\](, which is output \d+ of \w+,)? " \
                r"is at version (\d+); expected version (\d+) instead"


def backward_error(model_name, mode, platform, modify, **kw):
    """torch's error when ``modify(model)`` runs between a forward and its backward (the
    message's tensor, node and versions), in ``mode`` or in plain torch (None)."""
    torch.manual_seed(0)
    return version_error(tp.new_model(model_name), mode, platform, modify, **kw)


def version_error(model, mode, platform, modify, **kw):
    """:func:`backward_error` of a model built already (one with hooks of its own)."""
    handle = None if mode is None else ht.attach(model, mode=mode, platform=platform, **kw)
    try:
        loss = tp.lm_loss(model, tp.data_for()[0])
        modify(model)
        with pytest.raises(RuntimeError, match=VERSION_ERROR) as err:
            loss.backward()
        return error_fields(err.value)
    finally:
        if handle is not None:
            handle.detach()


def error_fields(err):
    """The tensor, versions, and whether a node is named, of torch's in-place error. (torch
    names the node a view's grad_fn is regenerated as after its base changed, AsStrided for
    ``weight.t()``; hprt the one that made the tensor when it was saved, TBackward0.)"""
    tensor, node, version, expected = re.search(VERSION_ERROR, str(err)).groups()
    return tensor, node is not None, version, expected


def change_a_weight(model):
    """An optimizer-like update between the forward and the backward: GPT-2's Conv1D weight is
    saved as it is (addmm), Llama's Linear weight as ``weight.t()``."""
    block = tp.layers_of(model)[0]
    weight = block.mlp.c_fc.weight if hasattr(block.mlp, "c_fc") else block.mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(2)


@pytest.mark.parametrize("mode", list(tp.MODES))
@pytest.mark.parametrize("model_name", list(tp.MODELS))
def test_a_weight_changed_before_backward_raises_torchs_error(model_name, mode, platform):
    """A parameter is never swapped nor compressed; it was returned to autograd as it is,
    whose version torch then no longer checked: a silently different gradient. Now torch's
    error, naming the same tensor and versions."""
    want = backward_error(model_name, None, platform, change_a_weight)
    kw = dict(tp.MODES[mode])
    kw.pop("_codec_thread_min_bytes", None)
    assert backward_error(model_name, kw.pop("mode"), platform, change_a_weight, min_bytes=0,
                          **kw) == want


@pytest.mark.parametrize("mode", ATTACH_MODES)
@pytest.mark.parametrize("model_name", list(tp.MODELS))
def test_an_activation_under_min_bytes_written_in_place_raises_torchs_error(model_name, mode,
                                                                            platform):
    """``min_bytes=1 MiB``: the MLP's activation is left to autograd; modified in place after
    the forward, torch refuses the backward, and so does every mode."""

    kept = []

    def caught(model):
        mlp = tp.layers_of(model)[0].mlp
        act = mlp.act if hasattr(mlp, "act") else mlp.act_fn
        act.register_forward_hook(lambda mod, args, out: kept.append(out))
        return model

    def modify(model):
        kept[-1].mul_(2)  # after c_proj / down_proj saved it

    def run(m):
        torch.manual_seed(0)
        return version_error(caught(tp.new_model(model_name)), m, platform, modify,
                             min_bytes=MIB)

    assert run(mode) == run(None)


# ---- item 4: compress mode encoded every nn.Linear weight each step ---------------------------


class ViewOfAParameter(torch.nn.Module):
    """Saves a contiguous view of its parameter (``mul`` saves both operands)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 256))

    def forward(self, x):
        return x * self.w.view(16, 16)


class ViewModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(ViewOfAParameter() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.skipif(tp.DEVICE != "cpu", reason="the compress modes compress CPU tensors")
@pytest.mark.parametrize("mode", ["compress", "compress_codec_thread"])
@pytest.mark.parametrize("model_name", list(tp.MODELS))
def test_compress_mode_leaves_parameter_views_alone(model_name, mode, platform, monkeypatch):
    """Autograd saves ``weight.t()`` for every nn.Linear (Llama), a view of the parameter: it
    was encoded every step, saving no memory (the parameter lives on). Nothing encoded shares
    a parameter's storage; the activations still are; gradients exact."""
    want = tp.baseline(model_name, "steps")
    encoded, models = [], []
    real, new_model = hprt.compress, tp.new_model

    def recording(x, *args, **kwargs):
        encoded.append(x.untyped_storage().data_ptr())
        return real(x, *args, **kwargs)

    monkeypatch.setattr(hprt, "compress", recording)
    monkeypatch.setattr(tp, "new_model", lambda name: models.append(new_model(name)) or models[-1])
    got, handle = tp.run(model_name, "steps", mode, platform)
    tp.assert_identical(got, want)
    params = {p.untyped_storage().data_ptr() for p in models[0].parameters()}
    assert encoded and handle.stats()["tensors"] == len(encoded)
    assert not params & set(encoded), f"{len(params & set(encoded))} of {len(encoded)} encoded"


@pytest.mark.skipif(tp.DEVICE != "cpu", reason="the compress modes compress CPU tensors")
@pytest.mark.parametrize("mode", ["compress", "managed_compress"])
def test_a_contiguous_view_of_a_parameter_is_not_compressed(mode, platform):
    """A contiguous view of a parameter (``w.view(...)``) is left out too, by both compress
    modes: one saved tensor per layer is compressed (the layer's input), not two."""
    torch.manual_seed(0)
    model = ViewModel()
    x = torch.randn(16, 16)
    model(x).backward()
    want = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    with ht.attach(model, mode=mode, platform=platform) as handle:
        model(x).backward()
        st = handle.stats()
    tp.assert_identical([p.grad for p in model.parameters()], want)
    if mode == "compress":
        assert st["tensors"] == 3, st
    else:
        assert [layer["saved"] for _, layer in sorted(st["layers"].items())] == [1, 1, 1], st


# ---- item 5: SwapManager remembered modules by id() --------------------------------------------


class Stack(tp.GeluStack):
    """A scalar loss, so that ``autograd.grad`` needs no output gradient."""

    def __init__(self):
        super().__init__(n=3, dim=16)

    def forward(self, x):
        return super().forward(x).square().mean()


@pytest.mark.skipif(tp.DEVICE != "cpu", reason="address reuse replayed on CPU tensors")
def test_swap_manager_hooks_every_block_of_models_built_in_a_loop(platform):
    """hyper_parallel's ``SwapManager`` singleton, a model built, trained and freed again and
    again (a sweep, a test suite): Python reuses a freed block's id(), and a new block at that
    address was taken for the old one, given no hooks (then a SwapStateError, or nothing
    swapped). Every block of every model is hooked and swaps; gradients exact."""
    rt = ht.Runtime(platform)
    mgr = ht.SwapManager(rt)
    x = torch.randn(8, 16)
    freed, reused, per_model = set(), 0, []
    try:
        for _ in range(30):
            torch.manual_seed(0)
            model = Stack()
            want = torch.autograd.grad(model(x), list(model.parameters()))
            reused += any(id(layer) in freed for layer in model.layers)
            for a, b in zip(model.layers[:-1], model.layers[1:]):
                mgr.set_forward_prefetch_layer(a, b)
            assert all(layer._forward_pre_hooks for layer in model.layers)
            before = rt.stats()["offloaded_tensors"]
            got = torch.autograd.grad(model(x), list(model.parameters()))
            per_model.append(rt.stats()["offloaded_tensors"] - before)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            freed |= {id(layer) for layer in model.layers}
            del model, got, want
    finally:
        mgr.detach()
        ht.SwapManager._instances.pop(id(rt), None)
    assert reused, "no block was built at a freed one's address: the case was not replayed"
    assert per_model[0] > 0 and per_model == [per_model[0]] * len(per_model), per_model


# ---- items 6 and 7: attach checks its arguments and leaves nothing behind ----------------------


def attach_leaves_nothing(model, platform, error, match, **kw):
    singletons = dict(ht.SwapManager._instances)
    with pytest.raises(error, match=match):
        ht.attach(model, platform=platform, **kw)
    assert no_hooks_left(model)
    assert not any(layer in ht._ATTACHED for layer in model.modules())
    assert ht.SwapManager._instances == singletons


def trains_exactly_after(model_name, model, mode, platform, **kw):
    """The model attached properly after the refusal trains as plain torch does."""
    rec = tp.Recorder(model)
    with ht.attach(model, mode=mode, platform=platform, **kw) as handle:
        steps(model, tp.data_for(), rec)
    assert tp.took_tensors(handle), handle.stats()
    tp.assert_identical(rec.values, tp.baseline(model_name, "steps"))


@pytest.mark.parametrize("mode", ATTACH_MODES)
def test_a_layer_named_twice_is_refused_before_anything_is_installed(mode, platform):
    """``layers=[b0, b1, b0]``: swap mode failed part way (b0's hooks left behind), compress
    mode failed in the first forward with its saved-tensor hooks left on torch's global stack,
    the other modes failed in the forward or ran with one layer hooked twice."""
    torch.manual_seed(0)
    model = tp.new_model("gpt2")
    blocks = list(tp.layers_of(model))
    attach_leaves_nothing(model, platform, ValueError, "names GPT2Block twice", mode=mode,
                          layers=[blocks[0], blocks[1], blocks[0]])
    trains_exactly_after("gpt2", model, mode, platform, min_bytes=0)


@pytest.mark.parametrize("mode", ATTACH_MODES)
def test_a_failure_part_way_through_attach_leaves_nothing(mode, platform, monkeypatch):
    """A failure while attach installs its hooks (here the last block refuses a forward hook)
    removes what was installed: module hooks, the layer claims, the SwapManager it made, the
    front end it added to a shared runtime."""
    torch.manual_seed(0)
    model = tp.new_model("gpt2")
    rt = ht.Runtime(platform)
    fronts = list(rt._fronts)

    def refuse(*args, **kwargs):
        raise RuntimeError("no hook for you")

    monkeypatch.setattr(tp.layers_of(model)[-1], "register_forward_hook", refuse)
    attach_leaves_nothing(model, platform, RuntimeError, "no hook for you", mode=mode,
                          runtime_=rt, min_bytes=0)
    rt.stats()
    assert rt._fronts == fronts
    monkeypatch.undo()
    trains_exactly_after("gpt2", model, mode, platform, runtime_=rt, min_bytes=0)


def _blocks(model):
    return list(tp.layers_of(model))


MISUSES = {
    # name: (attach keywords given the model, error, message)
    "no layers": (lambda m: dict(layers=[]), ValueError, "layers= is empty"),
    "empty tuple": (lambda m: dict(layers=()), ValueError, "layers= is empty"),
    "not a module": (lambda m: dict(layers=[_blocks(m)[0], "h.1"]), TypeError,
                     "item 1 is str"),
    "one module": (lambda m: dict(layers=_blocks(m)[0]), TypeError, "layers= takes a list"),
    "min_bytes str": (lambda m: dict(min_bytes="1024"), TypeError, "min_bytes must be an int"),
    "min_bytes float": (lambda m: dict(min_bytes=1024.0), TypeError, "min_bytes must be an int"),
    "min_bytes negative": (lambda m: dict(min_bytes=-1), ValueError, "min_bytes must be >= 0"),
    "min_bytes None": (lambda m: dict(min_bytes=None), TypeError, "min_bytes must be an int"),
    "prefetch str": (lambda m: dict(prefetch="no"), TypeError, "prefetch must be True or False"),
    "compression unknown": (lambda m: dict(compression="zstd"), ValueError,
                            "compression must be one of"),
    "runtime not a Runtime": (lambda m: dict(runtime_=hprt.cpu_platform(device_memory=1 << 20)),
                              TypeError, "runtime_ must be an hprt.torch.Runtime"),
    "window negative": (lambda m: dict(max_inflight_offload_bytes=-1), ValueError,
                        "max_inflight_offload_bytes must be"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
@pytest.mark.parametrize("mode", ATTACH_MODES)
def test_attach_refuses_wrong_arguments_at_once(mode, misuse, platform):
    """Refused by attach itself, with nothing installed (before: ``layers=[]`` did nothing
    without a word, a wrong type failed inside the first forward or part way through
    installing hooks, or was ignored by the modes that do not read it)."""
    torch.manual_seed(0)
    model = tp.new_model("gpt2")
    kw, error, match = MISUSES[misuse]
    attach_leaves_nothing(model, platform, error, match, mode=mode, **kw(model))
    trains_exactly_after("gpt2", model, mode, platform, min_bytes=0)


@pytest.mark.parametrize("mode", SWAP_MODES)
def test_a_predicate_must_be_callable(mode, platform):
    torch.manual_seed(0)
    model = tp.new_model("gpt2")
    attach_leaves_nothing(model, platform, TypeError, "predicate must be callable", mode=mode,
                          predicate=512)


@pytest.mark.parametrize("mode", [m for m in ATTACH_MODES if m not in SWAP_MODES])
@pytest.mark.parametrize("compression", ["device", "host_stage", "auto"])
def test_compression_is_refused_by_modes_that_do_not_swap(mode, compression, platform):
    """compress-then-swap has nothing to do in a mode that swaps nothing: it was ignored
    without a word (keep, compress)."""
    torch.manual_seed(0)
    model = tp.new_model("gpt2")
    attach_leaves_nothing(model, platform, ValueError, f"mode '{mode}' does not swap", mode=mode,
                          compression=compression)


@pytest.mark.parametrize("mode", SWAP_MODES)
def test_compression_other_than_a_given_runtimes_is_refused(mode, platform):
    """With ``runtime_=``, the runtime's compression applies: another one given to attach was
    ignored without a word."""
    torch.manual_seed(0)
    model = tp.new_model("gpt2")
    rt = ht.Runtime(platform)
    attach_leaves_nothing(model, platform, ValueError, "compresses with 'off'", mode=mode,
                          runtime_=rt, compression="host_stage")
    ht.attach(model, mode=mode, runtime_=rt, compression="off").detach()
