"""hprt.torch: a 16-layer transformer-like model trained 3 steps with and without swap and
compression must give bit-identical losses and gradients, and hprt's accounting must show fewer
saved bytes kept on the device with swap than without."""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import hprt  # noqa: E402
import hprt.torch as ht  # noqa: E402
from emulated import EMULATED  # noqa: E402

LAYERS, HIDDEN, BATCH, SEQ, STEPS = 16, 32, 4, 8, 3


class Block(nn.Module):
    """Attention-like mixing, an MLP and layer norms with residuals."""

    def __init__(self, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block(HIDDEN) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x, wrap=None):
        for i, layer in enumerate(self.layers):
            if wrap is None:
                x = layer(x)
            else:
                with wrap(i):
                    x = layer(x)
        return self.head(x).square().mean()


def train(mode, rt=None):
    """Three SGD steps; returns the losses, the gradients of every step and the model."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [torch.randn(BATCH, SEQ, HIDDEN) for _ in range(STEPS)]
    wrap = None
    if mode == "keyed":
        ht.TensorSwapContext.reset()
        ctxs = [ht.TensorSwapContext(module_tag="model.layers.*", runtime_=rt) for _ in range(LAYERS)]
        wrap = lambda i: ctxs[i]  # noqa: E731
    elif mode == "layer_group":
        ht.SwapManager.reset()
        mgr = ht.SwapManager(rt)
        for a, b in zip(model.layers[:-1], model.layers[1:]):
            mgr.set_forward_prefetch_layer(a, b)
            mgr.set_forward_prefetch_layer(a, b)  # idempotent, as in hyper_parallel
    elif mode == "keep":
        wrap = lambda i: ht.keep_saved_tensors(rt)  # noqa: E731
    elif mode == "compress":
        comp = ht.compress_saved_tensors()
        wrap = lambda i: comp  # noqa: E731
    elif mode == "managed":
        comp = ht.ManagedCompression(rt, min_numel=1024, encode_gbps=1.0, decode_gbps=1.0)
        wrap = comp.layer
    losses, grads = [], []
    for x in data:
        opt.zero_grad()
        loss = model(x, wrap)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    if mode == "compress":
        return losses, grads, comp.stats()
    if mode == "managed":
        return losses, grads, comp.stats()
    return losses, grads, None


def assert_identical(a, b):
    (la, ga, _), (lb, gb, _) = a, b
    for x, y in zip(la, lb):
        assert torch.equal(x, y), (x, y)
    for step_a, step_b in zip(ga, gb):
        assert len(step_a) == len(step_b)
        for x, y in zip(step_a, step_b):
            assert torch.equal(x, y)


@pytest.fixture()
def platform():
    return hprt.cpu_platform(device_memory=64 << 20)


@pytest.fixture(scope="module")
def baseline():
    return train("none")


def test_keyed_swap_is_bit_exact_and_keeps_less_on_device(platform, baseline):
    rt_keep = ht.Runtime(platform)
    kept = train("keep", rt_keep)
    assert_identical(baseline, kept)
    rt = ht.Runtime(platform)
    swapped = train("keyed", rt)
    assert_identical(baseline, swapped)
    s, k = rt.stats(), rt_keep.stats()
    assert s["offloaded_bytes"] > 0 and s["reloaded_bytes"] > 0
    # Without swap every layer's saved tensors stay referenced until backward; with swap at
    # most about two layers' do.
    assert k["device_peak"] > 0
    assert s["device_peak"] < k["device_peak"] / 4, (s, k)
    assert s["device_current"] == 0 and k["device_current"] == 0


def test_layer_group_swap_is_bit_exact_and_keeps_less_on_device(platform, baseline):
    rt_keep = ht.Runtime(platform)
    train("keep", rt_keep)
    rt = ht.Runtime(platform)
    swapped = train("layer_group", rt)
    assert_identical(baseline, swapped)
    s, k = rt.stats(), rt_keep.stats()
    assert s["offloaded_bytes"] > 0
    assert s["device_peak"] < k["device_peak"] / 4, (s, k)
    assert s["device_current"] == 0


@pytest.mark.parametrize("codec_thread", [False, True])
def test_compression_is_bit_exact_and_compresses(baseline, monkeypatch, codec_thread):
    """Small tensors are encoded and decoded in the hooks; larger ones (here: every one) on the
    codec thread, decoded ahead of their unpack."""
    if codec_thread:
        monkeypatch.setattr(ht, "_CODEC_THREAD_MIN_BYTES", 0)
    out = train("compress")
    assert_identical(baseline, out)
    stats = out[2]
    assert stats["tensors"] > 0 and stats["compressed_bytes"] < stats["raw_bytes"]
    if codec_thread:
        # Backward reads in reverse order of saving: most reads were decoded ahead of them.
        assert stats["decoded_ahead"] > stats["tensors"] // 2, stats
    else:
        assert stats["decoded_ahead"] == 0, stats


def test_activation_manager_compression_is_bit_exact(platform, baseline):
    out = train("managed", platform)
    assert_identical(baseline, out)
    stats = out[2]
    assert sorted(stats) == list(range(LAYERS))
    # Every layer but the last is encoded in the next layer's forward window, every step, and
    # decoded in the window of the layer before it in backward (which the first step learns:
    # its decodes wait at each layer's backward start).
    for layer, st in stats.items():
        assert st["saved"] > 0
        if layer < LAYERS - 1:
            assert st["compressed"] == st["saved"], (layer, st)
            assert st["recovered_sync"] == st["compressed"] // STEPS, (layer, st)
            assert st["decoded_in_window"] == st["compressed"] - st["recovered_sync"], (layer, st)
    assert sum(st["compressed_bytes"] for st in stats.values()) < sum(
        st["original_bytes"] for st in stats.values())


@pytest.mark.parametrize("jitter", [None, 3, 17])
def test_managed_compression_compresses_the_same_tensors_every_step(jitter):
    """MindSpeed-style compression does not depend on timing: with its cost model measured (no
    throughputs given) and random stream delays, every step compresses every registered tensor
    of every layer but the last (encoded asynchronously in the next layer's forward), and the
    gradients are plain torch's."""
    platform = hprt.cpu_platform(device_memory=256 << 20, jitter=jitter)
    torch.manual_seed(0)
    model = Model()
    xs = [torch.randn(2, 32, HIDDEN) for _ in range(3)]  # ~125 KiB per layer
    want = []
    for x in xs:
        model.zero_grad()
        model(x).backward()
        want.append([p.grad.clone() for p in model.parameters()])
    comp = ht.ManagedCompression(platform, min_numel=1024)
    per_step, before = [], {}
    for x, grads in zip(xs, want):
        model.zero_grad()
        model(x, comp.layer).backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        now = {layer: (st["saved"], st["compressed"]) for layer, st in comp.stats().items()}
        per_step.append({layer: (saved - before.get(layer, (0, 0))[0],
                                 compressed - before.get(layer, (0, 0))[1])
                         for layer, (saved, compressed) in now.items()})
        before = now
    assert per_step[0] == per_step[1] == per_step[2], per_step
    for layer, (saved, compressed) in per_step[0].items():
        assert saved > 0 and compressed == (saved if layer < LAYERS - 1 else 0), per_step[0]


def test_reloads_use_the_cpu_platforms_device_memory_or_torchs_when_it_is_full(baseline,
                                                                               monkeypatch):
    """On the cpu backend a reloaded tensor lives in the platform's (cached) device memory,
    given back once torch is done with it; a platform without room falls back to torch's
    allocator. Both bit-exact."""
    platform = hprt.cpu_platform(device_memory=64 << 20)
    seen, fallbacks = [], []
    real = ht._host_reload

    def spy(capsule, layout):
        out = real(capsule, layout)
        (seen if capsule is not None else fallbacks).append(
            (out.data_ptr(), out.nbytes, out.untyped_storage().nbytes()))
        return out

    monkeypatch.setattr(ht, "_host_reload", spy)
    rt = ht.Runtime(platform)
    try:
        assert_identical(baseline, train("layer_group", rt))
        assert seen and not fallbacks
        assert platform.memory_stats()["device_current"] == 0  # given back
        assert platform.memory_stats()["device_peak"] >= max(n for _, _, n in seen)
        tiny = hprt.cpu_platform(device_memory=4 << 10)  # room for the smallest only
        seen.clear()
        assert_identical(baseline, train("layer_group", ht.Runtime(tiny)))
        assert fallbacks and all(n <= 4 << 10 for _, _, n in seen)
    finally:
        ht.SwapManager.reset()


@pytest.mark.parametrize("shape, stride, offset", [
    ((4, 3, 5), (15, 5, 1), 0),      # row-major: taken as DLPack exports it
    ((5, 1), (1, 1), 0),             # row-major with a size-1 dimension
    ((5, 1), (1, 7), 0),             # same shape, a size-1 dimension's stride torch kept
    ((3, 4), (1, 3), 0),             # transposed
    ((2, 3), (3, 1), 6),             # row-major at a storage offset
    ((2, 2, 2), (8, 2, 1), 1),       # with gaps
    ((), (), 0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_platform_reloads_have_the_saved_layout(shape, stride, offset, dtype):
    """A reload into the cpu platform's device memory has exactly the saved shape, strides,
    storage offset and dtype, whichever way it is made (row-major exports skip restriding)."""
    platform = hprt.cpu_platform(device_memory=1 << 20)
    out = ht._platform_empty(platform, shape, stride, offset, dtype)
    assert (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype) == (
        shape, stride, offset, dtype)
    assert platform.memory_stats()["device_current"] > 0  # the platform's memory, not torch's
    del out
    assert platform.memory_stats()["device_current"] == 0


@pytest.mark.parametrize("codec_thread", [False, True])
def test_a_failed_encode_keeps_the_raw_tensor(baseline, monkeypatch, codec_thread):
    """An encode that fails (in the hook, or on compress mode's codec thread) leaves the raw
    tensor in place of the encoding: nothing lost, gradients exact, a warning."""
    if codec_thread:
        monkeypatch.setattr(ht, "_CODEC_THREAD_MIN_BYTES", 0)
    calls = []

    def failing(t, *a, **k):
        calls.append(t.numel())
        raise hprt.HprtError("test: the encoder failed")

    monkeypatch.setattr(hprt, "compress", failing)
    with pytest.warns(RuntimeWarning, match="encode failed"):
        out = train("compress")
    assert calls
    assert_identical(baseline, out)
    assert out[2]["tensors"] == 0


def test_swap_with_jitter_is_still_bit_exact(baseline):
    """Random stream delays make a missing wait show up as wrong bytes."""
    rt = ht.Runtime(hprt.cpu_platform(device_memory=64 << 20, jitter=7))
    assert_identical(baseline, train("keyed", rt))


@pytest.mark.parametrize("compression", ["off", "device", "host_stage"])
def test_bf16_round_trip_through_a_borrowed_payload(platform, compression):
    """A torch tensor through hyper_parallel's group calls: its memory is released after the
    offload and the reload lands in the tensor the allocator made, strides kept."""
    rt = ht.Runtime(platform)
    mgr = hprt.SwapManager(platform, compression=compression)
    t = torch.randn(8, 64).to(torch.bfloat16).t()  # permuted strides
    expected = t.clone()
    shape, stride = t.size(), t.stride()
    made = []

    def allocate():
        made.append(torch.empty_strided(shape, stride, dtype=torch.bfloat16))
        return made[-1]

    ref = mgr.add_storage("g", rt.memory.tensor(t, allocate, "bf16"))
    assert rt.memory.stats()["device_current"] == t.nbytes
    s = rt.compute_stream(None)
    mgr.launch_offload("g", s)
    mgr.wait_offload("g")
    del t
    assert rt.memory.stats()["device_current"] == 0  # hprt let go of torch's memory
    mgr.launch_load("g")
    mgr.wait_load("g", s)
    back = mgr.get(ref)
    assert back is made[0] and back.stride() == expected.stride()
    assert torch.equal(back, expected)
    st = mgr.stats()
    if compression != "off":
        assert st["compressed_tensors"] == 1 and st["codec_ns"] > 0


def _layouts():
    base = torch.randn(6, 40).to(torch.bfloat16)
    ints = torch.arange(90, dtype=torch.int64).view(9, 10)
    return [
        torch.randn(8, 64),                             # row-major: exported as it is
        torch.randn(8, 64).to(torch.bfloat16).t(),      # permuted strides
        base[2:],                                       # a storage offset
        base.view(6, 4, 10)[1:].transpose(0, 1),        # both
        ints[1:].t(),                                   # int64 (carried as bytes), offset
        torch.rand(7, 9) > 0.5,                         # bool (bytes of the same itemsize)
        torch.randn(()),                                # a scalar
    ]


@pytest.mark.parametrize("i", range(len(_layouts())))
def test_cpu_reloads_recreate_the_saved_layout_in_platform_memory(platform, i):
    """A borrowed payload reloads, through the allocator every backend uses
    (``Runtime.empty_layout``), into the cpu platform's device memory: same shape, strides,
    storage offset, dtype and bytes; the memory is the platform's, given back when torch lets
    go of the tensor."""
    rt = ht.Runtime(platform)
    mgr = hprt.SwapManager(platform)
    t = _layouts()[i]
    assert ht._is_dense(t)  # what swap takes
    expected, layout = t.clone(), ht._layout(t)
    ref = mgr.add_storage("g", rt.borrow(t))
    s = rt.compute_stream(None)
    mgr.launch_offload("g", s)
    mgr.wait_offload("g")
    del t
    before = platform.memory_stats()["device_current"]
    mgr.launch_load("g")
    mgr.wait_load("g", s)
    back = mgr.get(ref)
    assert ht._layout(back) == layout
    assert torch.equal(back, expected)
    assert platform.memory_stats()["device_current"] > before
    mgr.take(ref)
    del back
    assert platform.memory_stats()["device_current"] == before


def test_an_allocator_giving_the_wrong_size_keeps_the_host_copy(platform):
    """The reload writes only into memory of the saved size: an allocator returning another
    size is refused (the payload stays on the host), not written past its end."""
    t = torch.randn(64, 64)
    mem = hprt.FrameworkMemory(platform)
    mgr = hprt.SwapManager(platform)
    ref = mgr.add_storage("g", mem.tensor(t, lambda: torch.empty(32, 64), "f32"))
    s = platform.wrap_stream(0)
    mgr.launch_offload("g", s)
    mgr.wait_offload("g")
    del t
    with pytest.raises(hprt.HprtError, match="8192-byte tensor for 16384 saved bytes"):
        mgr.launch_load("g")
    assert mgr.state(ref) == "host"  # the host copy stays


def test_borrowed_reload_out_of_memory_keeps_the_host_copy_and_retries(platform):
    rt = ht.Runtime(platform)
    mgr = hprt.SwapManager(platform)
    t = torch.arange(256, dtype=torch.float32)
    fail = [True]

    def allocate():
        if fail[0]:
            fail[0] = False
            raise MemoryError("test allocator: out of memory")
        return torch.empty(256)

    ref = mgr.add_storage("g", rt.memory.tensor(t, allocate))
    s = rt.compute_stream(None)
    mgr.launch_offload("g", s)
    mgr.wait_offload("g")
    with pytest.raises(hprt.HprtError):
        mgr.launch_load("g")
    mgr.launch_load("g")  # the retry finds the host copy intact
    mgr.wait_load("g", s)
    assert torch.equal(mgr.get(ref), torch.arange(256, dtype=torch.float32))


def test_parameters_and_leaves_are_not_swapped(platform):
    rt = ht.Runtime(platform)
    p = nn.Parameter(torch.ones(4))
    assert not ht.is_swappable(p, rt)
    assert not ht.is_swappable(torch.ones(4, requires_grad=True), rt)
    assert ht.is_swappable(torch.ones(4) * 2, rt)
    assert not ht.is_swappable(torch.ones(4, 4).t()[:2], rt)  # a non-dense view
    assert ht.is_swappable(torch.ones(4, 4).t(), rt)  # dense, permuted


@pytest.mark.parametrize("compression", ["off", "host_stage"])
def test_every_front_end_takes_borrowed_torch_tensors(platform, compression):
    """Megatron's pipeline offload and the keyed swap's upstream names over borrowed torch
    tensors: the values come back bit-exact in tensors the allocator made."""
    rt = ht.Runtime(platform)
    s = rt.compute_stream(None)
    values = [torch.randn(64, 32) * (i + 1) for i in range(4)]
    expected = [v.clone() for v in values]

    off = hprt.PipelineOffload(platform, min_tensor_elems=1, compression=compression)
    off.init_chunk()
    tags = []
    for i, v in enumerate(values):
        off.group_start(f"g{i}")
        tags.append(off.save(rt.borrow(v)))
        off.group_commit(s)
    for i in reversed(range(4)):
        off.backward_group_begin(f"g{i}", s)
        assert torch.equal(off.get(tags[i], s), expected[i])
        off.backward_group_end()
    off.reset()

    keyed = hprt.KeyedSwap(platform, compression=compression)
    ctxs = [keyed.register_layer("layer.*") for _ in range(4)]
    packed = [keyed.swap_out_cur_and_release_prev(c, rt.borrow(v), s) for c, v in zip(ctxs, values)]
    for i in reversed(range(4)):
        got = keyed.wait_cur_and_prefetch_next(packed[i], s)
        assert torch.equal(got, expected[i])
    if compression != "off":
        assert off.stats()["compressed_tensors"] > 0 and keyed.stats()["compressed_tensors"] > 0


def test_layer_group_swap_survives_an_iteration_aborted_in_backward(platform, baseline):
    """An exception in backward, then ordinary training: bit-exact from there on."""
    rt = ht.Runtime(platform)
    torch.manual_seed(0)
    model = Model()
    ht.SwapManager.reset()
    mgr = ht.SwapManager(rt)
    for a, b in zip(model.layers[:-1], model.layers[1:]):
        mgr.set_forward_prefetch_layer(a, b)

    def boom(mod, grad_output):
        raise RuntimeError("abort")

    h = model.layers[LAYERS // 2].register_full_backward_pre_hook(boom)
    with pytest.raises(RuntimeError):
        model(torch.randn(BATCH, SEQ, HIDDEN)).backward()
    h.remove()
    rt.layers.end_iteration()
    torch.manual_seed(0)
    fresh = Model()
    model.load_state_dict(fresh.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [torch.randn(BATCH, SEQ, HIDDEN) for _ in range(STEPS)]
    for step, x in enumerate(data):
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        assert torch.equal(loss.detach(), baseline[0][step])
        for p, g in zip(model.parameters(), baseline[1][step]):
            assert torch.equal(p.grad, g)
        opt.step()


def test_a_per_tensor_policy_chooses_compress_then_swap(platform):
    """Large tensors compressed, small ones plain, by a policy on the torch tensor."""
    rt = ht.Runtime(platform)
    mgr = hprt.SwapManager(platform)
    mgr.set_compression_policy(lambda t: "host_stage" if t.numel() >= 1024 else "off")
    s = rt.compute_stream(None)
    big, small = torch.randn(64, 32), torch.randn(8)
    expected = [big.clone(), small.clone()]
    refs = [mgr.add_storage("g", rt.borrow(t)) for t in (big, small)]
    mgr.launch_offload("g", s)
    mgr.wait_offload("g")
    mgr.launch_load("g")
    mgr.wait_load("g", s)
    for r, e in zip(refs, expected):
        assert torch.equal(mgr.get(r), e)
    st = mgr.stats()
    assert st["offloaded_tensors"] == 2 and st["compressed_tensors"] == 1
    table = hprt.link_summary_table([st])
    assert table.splitlines()[2].startswith(f"| 0 | {st['offloaded_bytes']} | {st['link_d2h_bytes']} |")
