"""hprt.torch under the patterns real training uses, on GPT-2 and Llama built from small
transformers configs: every mode must give the plain-torch run's losses and gradients bit for bit
(``torch.equal``), or raise a clear error naming the pattern; nothing may stay referenced (device
bytes, pinned blocks, torch tensors) once a pattern's graphs are gone and the mode is detached.

``HP_TEST_DEVICE=cuda`` (with ``HP_PLATFORM=cuda``) runs the same tests on CUDA tensors and the
cuda backend, torch in its deterministic mode (what scripts/gpu-check runs on an NVIDIA GPU);
tests of the cpu backend's own machinery (stand-ins, stream jitter) are skipped there."""

import os
import shutil
import types
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hprt  # noqa: E402
import hprt.torch as ht  # noqa: E402

transformers.utils.logging.set_verbosity_error()

VOCAB, BATCH, SEQ = 64, 2, 8

DEVICE = os.environ.get("HP_TEST_DEVICE", "cpu")
if DEVICE == "cuda":
    # Plain torch must repeat itself bit for bit (embedding backward, cuBLAS workspaces).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend's own machinery")


def gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)  # dropout 0.1 everywhere: RNG replayed by checkpointing


def llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": gpt2, "llama": llama}


def new_model(name):
    return MODELS[name]().to(DEVICE)

# Every hprt.torch mode, as ``ht.attach`` keywords. ``min_bytes=0``: the small models' tensors all
# take the hprt path.
MODES = {
    "keep": dict(mode="keep"),
    "keyed": dict(mode="keyed"),
    "layers": dict(mode="swap"),
    "pipeline": dict(mode="pipeline"),
    "compress": dict(mode="compress"),
    "managed": dict(mode="managed_compress"),
    "keyed_host_stage": dict(mode="keyed", compression="host_stage"),
    "layers_device_codec": dict(mode="swap", compression="device"),
    "pipeline_host_stage": dict(mode="pipeline", compression="host_stage"),
    # compress mode with every tensor on its codec thread (these models' tensors are small
    # enough to be encoded in the hooks otherwise)
    "compress_codec_thread": dict(mode="compress", _codec_thread_min_bytes=0),
}
HOST_COMPRESSION = ("compress", "managed_compress")
if DEVICE != "cpu":  # refused there: test_host_compression_modes_refuse_accelerator_tensors
    MODES = {k: v for k, v in MODES.items() if v["mode"] not in HOST_COMPRESSION}


def attach_mode(model, platform, mode):
    """``ht.attach`` of one of ``MODES`` on every layer, every saved tensor eligible."""
    kw = dict(MODES[mode])
    threshold = kw.pop("_codec_thread_min_bytes", None)
    handle = ht.attach(model, platform=platform, min_bytes=0, **kw)
    if threshold is not None:
        old = ht._CODEC_THREAD_MIN_BYTES
        ht._CODEC_THREAD_MIN_BYTES = threshold
        handle._on_detach.append(lambda: setattr(ht, "_CODEC_THREAD_MIN_BYTES", old))
    return handle


class GeluStack(torch.nn.Module):
    """``n`` blocks of a Linear and a GELU, ``dim`` wide: the smallest model whose blocks are
    each a layer the modes find."""

    def __init__(self, n, dim):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU()) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# ---- the patterns: each trains `model` on `data` and returns what it observed -------------------


class Recorder:
    def __init__(self, model):
        self.model, self.values = model, []

    def __call__(self, *tensors):
        self.values.extend(t.detach().clone() for t in tensors)
        self.values.extend(None if p.grad is None else p.grad.clone() for p in self.model.parameters())


def lm_loss(model, ids):
    return model(ids, labels=ids).loss


def step(model, opt, ids, rec):
    opt.zero_grad()
    loss = lm_loss(model, ids)
    loss.backward()
    rec(loss)
    opt.step()


def p_steps(model, opt, data, rec):
    for ids in data[:2]:
        step(model, opt, ids, rec)


def p_forward_without_backward(model, opt, data, rec):
    step(model, opt, data[0], rec)
    rec(lm_loss(model, data[1]))  # a skipped step: its graph is dropped unused
    step(model, opt, data[2], rec)
    step(model, opt, data[3], rec)


def p_dropped_graph(model, opt, data, rec):
    """A metric computed with grad on between the forward and the backward."""
    for i in range(2):
        opt.zero_grad()
        loss = lm_loss(model, data[2 * i])
        metric = model(data[2 * i + 1]).logits.float().mean().item()
        loss.backward()
        rec(loss, torch.tensor(metric))
        opt.step()


def p_two_forwards_one_backward(model, opt, data, rec):
    """DPO-style: two forwards of the same model, one loss, one backward."""
    for i in range(2):
        opt.zero_grad()
        chosen, rejected = lm_loss(model, data[2 * i]), lm_loss(model, data[2 * i + 1])
        loss = chosen - 0.5 * rejected
        loss.backward()
        rec(loss)
        opt.step()


def p_retain_graph(model, opt, data, rec):
    opt.zero_grad()
    loss = lm_loss(model, data[0])
    loss.backward(retain_graph=True)
    rec(loss)
    (2 * loss).backward()  # the same saved tensors read a second time
    rec(loss)
    opt.step()
    step(model, opt, data[1], rec)


def p_partial_backward(model, opt, data, rec):
    """A backward from the first layer's output: the later layers' saved tensors are never read."""
    opt.zero_grad()
    out = model(data[0], output_hidden_states=True)
    h = out.hidden_states[1].float().square().mean()
    h.backward()
    rec(h)
    del out
    opt.step()
    step(model, opt, data[1], rec)


def p_gradient_accumulation(model, opt, data, rec):
    for i in range(2):
        opt.zero_grad()
        for ids in data[3 * i:3 * i + 3]:
            loss = lm_loss(model, ids) / 3
            loss.backward()
            rec(loss)
        opt.step()


def p_no_grad_eval(model, opt, data, rec):
    step(model, opt, data[0], rec)
    model.eval()
    with torch.no_grad():
        rec(lm_loss(model, data[1]))
    model.train()
    step(model, opt, data[2], rec)


def p_checkpoint_reentrant(model, opt, data, rec):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    p_steps(model, opt, data, rec)


def p_checkpoint_non_reentrant(model, opt, data, rec):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    p_steps(model, opt, data, rec)


def p_bf16_autocast(model, opt, data, rec):
    for ids in data[:2]:
        opt.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = lm_loss(model, ids)
        loss.backward()
        rec(loss)
        opt.step()


class Boom(RuntimeError):
    pass


def step_raising_once(model, opt, ids, rec, register):
    """A step in which the hook that ``register(hook)`` installs raises ``Boom``."""

    def boom(*args):
        raise Boom()

    h = register(boom)
    with pytest.raises(Boom):
        step(model, opt, ids, rec)
    h.remove()


def p_exception_in_forward(model, opt, data, rec):
    """A layer's MLP raises in the middle of a forward; training goes on."""
    step_raising_once(model, opt, data[0], rec, layers_of(model)[1].mlp.register_forward_pre_hook)
    # No saved-tensor hook may be left active by the aborted layer.
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    step(model, opt, data[1], rec)
    step(model, opt, data[2], rec)


def p_exception_in_backward(model, opt, data, rec):
    step_raising_once(model, opt, data[0], rec,
                      layers_of(model)[1].register_full_backward_pre_hook)
    step(model, opt, data[1], rec)
    step(model, opt, data[2], rec)


PATTERNS = {name[2:]: fn for name, fn in globals().copy().items() if name.startswith("p_")}


def layers_of(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def data_for(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(DEVICE) for _ in range(6)]


def run(model_name, pattern, mode=None, platform=None):
    """``pattern`` on a fresh model (same initial weights for every mode); returns the recorded
    values and the detached handle (None for plain torch)."""
    torch.manual_seed(0)
    model = new_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model)
    handle = None
    if mode is not None:
        handle = attach_mode(model, platform, mode)
    try:
        PATTERNS[pattern](model, opt, data_for(), rec)
    finally:
        if handle is not None:
            handle.detach()
    return rec.values, handle


_baselines = {}


def baseline(model_name, pattern):
    key = (model_name, pattern)
    if key not in _baselines:
        _baselines[key] = run(model_name, pattern)[0]
    return _baselines[key]


def assert_identical(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None:
            assert a is None and b is None, i
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), (i, a.shape)


_cuda_platform = []


@pytest.fixture()
def platform():
    if DEVICE == "cpu":
        return hprt.cpu_platform(device_memory=64 << 20)
    if not _cuda_platform:  # the process-wide platform (HP_PLATFORM), one Runtime for all tests
        _cuda_platform.append(hprt.get_platform())
        assert _cuda_platform[0].backend == DEVICE, "HP_TEST_DEVICE needs HP_PLATFORM of that backend"
    return _cuda_platform[0]


def assert_released(handle):
    # No gc.collect(): what hprt.torch keeps must go by reference counting, when autograd lets go.
    st = handle.stats()
    assert st["device_current"] == 0, st
    assert st["pinned_bytes_in_use"] == 0, st


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_pattern_is_bit_exact(model_name, mode, pattern, platform):
    got, handle = run(model_name, pattern, mode, platform)
    assert_identical(got, baseline(model_name, pattern))
    assert_released(handle)
    if pattern != "checkpoint_reentrant":  # its layers run under no_grad, recomputed in backward
        assert took_tensors(handle), handle.stats()


def took_tensors(handle):
    """Whether the mode handled saved tensors at all (a pass left to autograd must not be
    the only reason a pattern is exact)."""
    st = handle.stats()
    if handle.mode == "keep":
        return st["device_peak"] > 0
    if handle.mode == "compress":
        return st["tensors"] > 0
    if handle.mode == "managed_compress":
        return sum(layer["saved"] for layer in st["layers"].values()) > 0
    return st["offloaded_tensors"] > 0 and st["reloaded_tensors"] > 0


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_inplace_write_to_a_saved_tensor_raises_torchs_error(model_name, mode, platform):
    """The activation an MLP saved is modified in place after the forward: torch refuses the
    backward; so must every mode (not a silently different gradient)."""

    def attempt(handle_mode):
        torch.manual_seed(0)
        model = new_model(model_name)
        handle = None
        if handle_mode is not None:
            handle = attach_mode(model, platform, handle_mode)
        mlp = layers_of(model)[0].mlp
        act = mlp.act if hasattr(mlp, "act") else mlp.act_fn
        kept = []
        act.register_forward_hook(lambda mod, args, out: kept.append(out))

        def modify(mod, args, out):
            kept[-1].mul_(2)  # after c_proj / down_proj saved it

        mlp.register_forward_hook(modify)
        try:
            loss = lm_loss(model, data_for()[0])
            with pytest.raises(RuntimeError) as err:
                loss.backward()
            return str(err.value)
        finally:
            if handle is not None:
                handle.detach()

    want = attempt(None)
    got = attempt(mode)
    shape = r"one of the variables needed for gradient computation has been modified by an " \
            r"inplace operation: \[\S+ \[[0-9, ]+\]\], which is output 0 of \w+, is at version \d+; " \
            r"expected version \d+ instead"
    assert re.search(shape, want), want
    assert re.search(shape, got), got


class SavesViews(torch.autograd.Function):
    """Saves a permuted view and a view at a storage offset; backward reports what it got."""

    seen = []

    @staticmethod
    def forward(ctx, x):
        base = x * 2
        ctx.save_for_backward(base.t(), base[1:])  # strides (1, 12); storage offset 12
        return x * 3

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        SavesViews.seen.append([(t.size(), t.stride(), t.storage_offset(), t.clone()) for t in (a, b)])
        return g * 3 + a.t().sum() + b.sum()


class ViewLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8, 12))

    def forward(self, x):
        return SavesViews.apply(x * self.w)


class ViewModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(ViewLayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize("mode", list(MODES))
def test_reloads_keep_strides_and_storage_offsets(mode, platform):
    def observe(handle_mode):
        SavesViews.seen = []
        model = ViewModel().to(DEVICE)
        handle = None if handle_mode is None else attach_mode(model, platform, handle_mode)
        try:
            model(torch.arange(96, dtype=torch.float32, device=DEVICE).reshape(8, 12)).backward()
        finally:
            if handle is not None:
                handle.detach()
        return SavesViews.seen

    want, got = observe(None), observe(mode)
    assert len(got) == len(want) == 3
    for g_layer, w_layer in zip(got, want):
        for (gs, gst, go, gv), (ws, wst, wo, wv) in zip(g_layer, w_layer):
            assert (gs, gst, go) == (ws, wst, wo)
            assert torch.equal(gv, wv)


# Leaks: test_torch_leaks.py runs 1,000 steps of each pattern in every mode.


# ---- torch.compile: compiled layers' saved tensors go through every mode ----------------------


class CompiledAttention(torch.nn.Module):
    """q, k, v are non-dense chunks of one projection: inductor's backward asserts the saved
    tensors' strides, so a mode that changed them fails here."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class CompiledLayer(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.skipif(shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_torch_compile_in_every_mode(platform):
    torch.manual_seed(0)
    # Three: pipeline mode keeps the last layer and takes back the offload still in flight at
    # backward (Megatron-LM's), so the first layer is the one it reloads.
    blocks = torch.nn.ModuleList(CompiledAttention() for _ in range(3)).to(DEVICE)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(CompiledLayer(torch.compile(b)) for b in blocks)
    x = torch.randn(2, 8, 32, device=DEVICE)

    def grads():
        for p in blocks.parameters():
            p.grad = None
        y = x
        for layer in model.layers:
            y = layer(y)
        y.square().mean().backward()
        return [p.grad.clone() for p in blocks.parameters()]

    want = grads()
    for mode in MODES:
        with attach_mode(model, platform, mode) as handle:
            got = grads()
        assert_identical(got, want)
        assert took_tensors(handle), (mode, handle.stats())


# ---- devices: the accelerator paths with stand-ins (no GPU / NPU here) ------------------------


class StandInStream:
    def __init__(self, attr, raw):
        setattr(self, attr, raw)


class StandInPlatform:
    """What Runtime asks of a platform for stream selection; records the raw streams wrapped."""

    def __init__(self, backend):
        self.backend, self.wrapped = backend, []

    def unsafe_wrap_stream(self, raw):
        self.wrapped.append(raw)
        return ("hprt stream of", raw)


@cpu_only
@pytest.mark.parametrize("kind,attr", [("cuda", "cuda_stream"), ("npu", "npu_stream")])
def test_accelerator_tensors_use_torchs_current_stream(kind, attr, platform, monkeypatch):
    """On the cuda / npu backend, hprt orders its copies after torch's current stream of that
    device (``torch.cuda.current_stream().cuda_stream``, torch_npu's ``npu_stream``), takes that
    device's tensors and leaves others to autograd."""
    rt = ht.Runtime(platform)
    standin = StandInPlatform(kind)
    rt.platform = standin
    module = type("StandInTorchDevice", (), {})()
    module.current_stream = lambda device=None: StandInStream(
        attr, 0xABC0 + (0 if device is None else int(str(device).split(":")[1])))
    monkeypatch.setattr(torch, kind, module, raising=False)
    assert rt.compute_stream() == ("hprt stream of", 0xABC0)
    assert rt.compute_stream(f"{kind}:1") == ("hprt stream of", 0xABC1)
    assert standin.wrapped == [0xABC0, 0xABC1]
    assert rt.compute_stream("cpu") is rt._host_stream  # a CPU tensor on an accelerator backend

    class Like:
        def __init__(self, device_type):
            self.device = types.SimpleNamespace(type=device_type)

    assert rt.addressable(Like(kind)) and not rt.addressable(Like("cpu"))
    assert not ht.Runtime(platform).addressable(Like(kind))  # the cpu backend takes CPU tensors


@pytest.mark.parametrize("mode", list(MODES))
def test_detach_removes_every_hook(mode, platform):
    torch.manual_seed(0)
    model = new_model("gpt2")
    singletons = dict(ht.SwapManager._instances)
    handle = attach_mode(model, platform, mode)
    assert handle.attached and handle.layers == list(model.transformer.h)
    assert any(m._forward_pre_hooks for m in model.modules())
    handle.detach()
    assert not handle.attached
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert ht.SwapManager._instances == singletons


@pytest.mark.parametrize("mode", list(MODES))
def test_a_layer_takes_one_mode_at_a_time(mode, platform):
    """A second attach to layers a handle still holds is refused (before, both hooked the
    layers: the inner hooks took every saved tensor and the first handle did nothing, without
    a word); once detached, another mode attaches."""
    got_plain = run("gpt2", "steps")[0]
    torch.manual_seed(0)
    model = new_model("gpt2")
    handle = attach_mode(model, platform, mode)
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    with pytest.raises(ValueError, match=f"already attached \\(mode '{handle.mode}'\\)"):
        ht.attach(model, mode="keyed", platform=platform)
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == hooks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model)
    p_steps(model, opt, data_for(), rec)
    assert_identical(rec.values, got_plain)
    assert took_tensors(handle), handle.stats()
    handle.detach()
    ht.attach(model, mode="keyed", platform=platform).detach()


def test_swap_mode_on_two_models_needs_a_runtime_each(platform):
    """Layer-group swap has one manager per runtime (hyper_parallel's singleton): a second
    model attached in that mode to the same runtime is refused (before, it shared the first's
    hooks, and detaching the first left the second reporting attached but swapping nothing);
    with a runtime each, detaching one leaves the other swapping."""
    rt = ht.Runtime(platform)
    torch.manual_seed(0)
    a, b = new_model("gpt2"), new_model("llama")
    first = ht.attach(a, runtime_=rt)
    with pytest.raises(ValueError, match="Runtime of its own"):
        ht.attach(b, runtime_=rt)
    second = ht.attach(b, platform=platform)
    first.detach()
    assert not first.attached and second.attached
    opt = torch.optim.AdamW(b.parameters(), lr=1e-2)
    before = second.stats()["offloaded_tensors"]
    p_steps(b, opt, data_for(), Recorder(b))
    assert second.stats()["offloaded_tensors"] > before
    second.detach()


COMPRESSING = [m for m, kw in MODES.items()
               if kw["mode"] in HOST_COMPRESSION or kw.get("compression", "off") != "off"]


@pytest.mark.parametrize("mode", COMPRESSING)
def test_stats_count_compression_in_the_same_keys_in_every_mode(mode, platform):
    """``stats()`` is one dictionary everywhere: a mode that compressed reports it in
    ``compressed_tensors`` / ``compressed_bytes`` (the compress modes reported 0 there, their
    counts only under keys of their own)."""
    _, handle = run("llama", "steps", mode, platform)
    st = handle.stats()
    assert st["compressed_tensors"] > 0 and st["compressed_bytes"] > 0, st
    if handle.mode == "compress":
        assert st["compressed_tensors"] == st["tensors"], st
    if handle.mode == "managed_compress":
        layers = st["layers"].values()
        assert st["compressed_tensors"] == sum(layer["compressed"] for layer in layers), st
        assert st["compressed_bytes"] == sum(layer["compressed_bytes"] for layer in layers), st
        assert st["raw_bytes"] == sum(layer["original_bytes"] for layer in layers), st


@pytest.mark.parametrize("mode", HOST_COMPRESSION)
def test_host_compression_modes_refuse_accelerator_tensors(mode, platform):
    """The compress modes encode CPU tensors on the host; a model on another device (meta
    stands for one here) is refused with the mode that compresses there, not left
    uncompressed without a word."""
    model = MODELS["gpt2"]().to("meta" if DEVICE == "cpu" else DEVICE)
    with pytest.raises(hprt.UnsupportedError, match="compression='device'"):
        ht.attach(model, mode=mode, platform=platform)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@cpu_only
@pytest.mark.parametrize("front", ["compress_saved_tensors", "ManagedCompression"])
def test_host_compression_used_directly_refuses_accelerator_tensors(front, platform):
    """Used without attach, the host compressors raise on the first saved tensor off the CPU
    (meta stands for an accelerator here) instead of leaving every one uncompressed; the hooks
    are gone after the error and the next CPU forward is compressed."""
    if front == "compress_saved_tensors":
        comp = ht.compress_saved_tensors(platform=platform)
        region = lambda: comp  # noqa: E731
    else:
        comp = ht.ManagedCompression(platform, min_numel=1)
        region = lambda: comp.layer(0)  # noqa: E731
    x = torch.randn(64, 64, device="meta", requires_grad=True)
    with pytest.raises(hprt.UnsupportedError, match=f"{front} compresses CPU tensors.*meta"):
        with region():
            x.sigmoid()
    y = torch.randn(64, 64, requires_grad=True)
    with region():
        out = y.sigmoid()
    out.sum().backward()
    assert torch.equal(y.grad, (y.sigmoid() * (1 - y.sigmoid())).detach())
    st = comp.stats()
    packed = st["tensors"] if front == "compress_saved_tensors" else st[0]["saved"]
    assert packed == 1, st


def test_one_keyed_swap_context_class():
    """hprt.torch's TensorSwapContext is hprt's, with the with-block added."""
    assert issubclass(ht.TensorSwapContext, hprt.TensorSwapContext)
    ht.TensorSwapContext.reset()
    ctxs = [ht.TensorSwapContext(module_tag="blocks.*") for _ in range(3)]
    assert [c.layer_idx for c in ctxs] == [0, 1, 2] and ctxs[0].layer_nums == 3
    ht.TensorSwapContext.reset()


def test_layers_are_found_or_named():
    model = llama()
    assert ht.find_layers(model) == list(model.model.layers)
    assert ht.find_layers(model, "model.layers") == list(model.model.layers)
    with pytest.raises(ValueError, match="no layer list"):
        ht.find_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown hprt.torch mode"):
        ht.attach(model, mode="offload_everything")
    with pytest.raises(ValueError, match="takes no predicate"):
        ht.attach(model, mode="compress", predicate=lambda t: True)


@pytest.mark.parametrize("mode", ["swap", "keyed", "pipeline"])
def test_a_predicate_chooses_the_swapped_tensors(mode, platform):
    """Only tensors the predicate accepts are offloaded; the gradients stay exact."""
    want = baseline("gpt2", "steps")
    torch.manual_seed(0)
    model = new_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model)
    seen = []

    def big(t):
        seen.append(t.numel())
        return t.numel() >= 512

    with ht.attach(model, mode=mode, platform=platform, min_bytes=0, predicate=big) as handle:
        p_steps(model, opt, data_for(), rec)
        st = handle.stats()
    assert_identical(rec.values, want)
    taken = sum(n for n in seen if n >= 512) * 4
    assert st["offloaded_tensors"] > 0 and any(n < 512 for n in seen)
    assert st["offloaded_bytes"] <= taken


@pytest.mark.parametrize("mode", [m for m in MODES if m not in ("keep", "compress", "compress_codec_thread")])
def test_an_overlapping_forward_is_named_in_one_warning(mode, platform):
    """Modes that follow one pass at a time leave a second forward's tensors to autograd (two
    forwards then one backward, DPO-style): exact, but the memory is not saved, so the user is
    told once, naming the pattern; a plain step warns nothing."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = run("gpt2", "two_forwards_one_backward", mode, platform)
        run("gpt2", "steps", mode, platform)
    overlap = [w for w in caught if issubclass(w.category, ht.OverlappingForwardWarning)]
    assert len(overlap) == 1, [str(w.message) for w in overlap]
    assert "two forwards then one backward, DPO-style" in str(overlap[0].message)
    assert_identical(got, baseline("gpt2", "two_forwards_one_backward"))


def test_pipeline_mode_prefetches_the_next_layer_in_backward(platform):
    """attach(mode="pipeline") reloads layer i-1 while layer i's backward runs, as Megatron-LM's
    chunk handler starts the next group's reload: when a layer's backward begins, its reload
    was already issued (every layer but the first in backward order), gradients exact. The last
    layer, read first, stays on the device (Megatron-LM's set_last_layer)."""
    torch.manual_seed(0)
    model = new_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(model)
    seen = []  # (layer, tensors prefetched so far) as each layer's backward begins
    with ht.attach(model, mode="pipeline", platform=platform, min_bytes=0) as handle:
        for i, layer in enumerate(layers_of(model)):
            def watch(mod, args, out, i=i):
                out = out[0] if isinstance(out, tuple) else out
                out.register_hook(lambda g: seen.append((i, handle.stats()["prefetched_tensors"])))
            layer.register_forward_hook(watch)
        p_steps(model, opt, data_for(), rec)
        st = handle.stats()
    assert_identical(rec.values, baseline("gpt2", "steps"))
    per_layer = st["offloaded_tensors"] // 4  # 2 steps x layers 0 and 1 (2 stays) saving alike
    assert per_layer > 0 and st["offloaded_tensors"] == 4 * per_layer
    # Layers 1 and 0 of each step.
    assert st["prefetched_tensors"] == 2 * 2 * per_layer, st
    for step in (seen[:3], seen[3:]):
        assert [i for i, _ in step] == [2, 1, 0]
        assert [b - a for (_, a), (_, b) in zip(step, step[1:])] == [per_layer, per_layer], seen


@cpu_only
@pytest.mark.parametrize("mode", ["swap", "keyed", "pipeline"])
def test_reloaded_layers_go_once_their_backward_is_done(mode):
    """On the cpu backend reloads live in the platform's device memory: over a step its peak
    stays within three layers' offloaded bytes (the layer in backward, the one prefetched, the
    allocator's slack), whatever the depth. Pipeline mode held every reloaded layer of a pass
    until the next pass began (on an H100 its peak was above plain torch's)."""
    layers = 8
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=2, vocab_size=VOCAB,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    platform = hprt.cpu_platform(device_memory=1 << 30)
    with ht.attach(model, mode=mode, platform=platform, min_bytes=0) as handle:
        for _ in range(2):  # pools, caches
            lm_loss(model, ids).backward()
        platform.reset_peak_memory()
        before = handle.stats()["offloaded_bytes"]
        lm_loss(model, ids).backward()
        offloaded = handle.stats()["offloaded_bytes"] - before
        peak = platform.memory_stats()["device_peak"]
    per_layer = offloaded / (layers - 1)  # the last layer stays on the device in every mode
    assert offloaded > 0 and peak <= 3 * per_layer, (peak / per_layer, offloaded)


@cpu_only
@pytest.mark.parametrize("pattern", ["dropped_graph", "partial_backward", "exception_in_backward"])
@pytest.mark.parametrize("mode", ["keyed", "layers", "pipeline_host_stage"])
def test_patterns_under_stream_jitter(mode, pattern):
    """Random delays on hprt's streams: a wait missing anywhere shows up as wrong bytes."""
    jittered = hprt.cpu_platform(device_memory=64 << 20, jitter=11)
    got, handle = run("llama", pattern, mode, jittered)
    assert_identical(got, baseline("llama", pattern))
    assert_released(handle)
