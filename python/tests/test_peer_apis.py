"""The peers' swap APIs from hprt.torch, used as their own tests use them (imports changed,
``.npu()`` dropped): hyper_parallel's ``SwapManager`` + ``swap_wrapper`` / ``ActivationPolicy``
and Megatron-LM's fine-grained offloading. Losses and gradients are compared with plain torch by
``torch.equal``; the device bytes of saved tensors are hprt's accounting of what stays referenced."""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import hprt.torch as ht  # noqa: E402
from hprt.torch import ActivationPolicy, SwapManager, swap_tensor_wrapper, swap_wrapper  # noqa: E402

DIM, HEADS, DEPTH, BATCH, SEQ, VOCAB, STEPS = 64, 4, 16, 4, 32, 128, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class SimpleTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def apply_swap(model, mode):
    """hyper_parallel's test_act_swap.apply_swap, imports changed."""
    if mode == "none":
        return model
    policy_fn = None
    if mode == "swap_with_policy":
        threshold = BATCH * SEQ * DIM  # tensors the size of the layer input stay; larger ones swap

        def policy_fn(x):
            if x.untyped_storage().size() // x.element_size() <= threshold:
                return ActivationPolicy.SAVE
            return ActivationPolicy.SWAP

    for i, layer in enumerate(model.layers):
        model.layers[i].attn = swap_wrapper(layer.attn, policy_fn)
    for i in range(len(model.layers) - 1):
        SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    return model


def train_one_mode(mode):
    SwapManager.reset()
    rt = ht.runtime()
    torch.manual_seed(0)
    model = apply_swap(SimpleTransformer(), mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    rt.reset_peak()
    observed = []
    for ids in data:
        opt.zero_grad()
        # Everything autograd keeps outside the swapped regions is counted by the same accounting.
        with ht.keep_saved_tensors(rt):
            logits = model(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        observed.append(loss.detach().clone())
        observed.extend(p.grad.clone() for p in model.parameters())
    peak = rt.stats()["device_peak"]
    assert rt.stats()["device_current"] == 0
    SwapManager.reset()
    return observed, peak, model


def test_hyper_parallel_act_swap_memory_comparison():
    results = {mode: train_one_mode(mode) for mode in ("none", "swap", "swap_with_policy")}
    base, peak_none, plain = results["none"]
    for mode in ("swap", "swap_with_policy"):
        got, _, wrapped = results[mode]
        attn = wrapped.layers[0].attn
        assert isinstance(attn, ht.SwapWrapper) and attn.embed_dim == DIM  # attributes reach through
        assert [n for n, _ in attn.named_parameters()] == [
            n for n, _ in plain.layers[0].attn.named_parameters()]  # no wrapper prefix
        assert len(got) == len(base)
        for a, b in zip(got, base):
            assert torch.equal(a, b)
        # Checkpoints load into the unwrapped model and back.
        assert list(wrapped.state_dict()) == list(plain.state_dict())
        wrapped.load_state_dict(plain.state_dict())
    peak_swap, peak_policy = results["swap"][1], results["swap_with_policy"][1]
    assert peak_none > peak_policy > peak_swap, (peak_none, peak_policy, peak_swap)


def test_swap_manager_is_a_singleton_that_refuses_other_settings():
    SwapManager.reset()
    assert SwapManager() is SwapManager()
    with pytest.raises(ValueError, match="singleton"):
        SwapManager(min_bytes=4096)
    SwapManager.reset()
    assert SwapManager(min_bytes=4096).min_bytes == 4096
    SwapManager.reset()


def test_swap_manager_reset_removes_its_hooks():
    SwapManager.reset()
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    SwapManager().set_forward_prefetch_layer(a, b)
    assert a._forward_pre_hooks and b._forward_hooks
    SwapManager.reset()
    assert not a._forward_pre_hooks and not a._forward_hooks and not b._forward_pre_hooks


def test_swap_manager_group_calls_swap_torch_tensors_in_place():
    """hyper_parallel's group calls driven by hand, as its own AsyncSaveOnCpu and layer hooks
    drive them: the tensors added to a group lose their device storage at ``wait_offload`` and
    are the same tensor objects, bytes and version, after ``launch_load`` / ``wait_load``."""
    SwapManager.reset()
    rt = ht.runtime()
    mgr = SwapManager()
    g = torch.Generator().manual_seed(4)
    a = torch.randn(64, 32, generator=g)
    b = torch.randn(16, 48, generator=g).to(torch.bfloat16)
    c = torch.randint(0, 1000, (300,), generator=g)
    view = torch.randn(8, 8, generator=g)[2:]  # part of a storage: stays on the device
    tensors = [a, b, c, view]
    want = [t.clone() for t in tensors]
    versions = [t._version for t in tensors]
    mgr.set_current_group_name("swap_group_x")
    assert mgr.get_current_group_name() == "swap_group_x"
    assert not mgr.is_last_group()
    before = rt.stats()
    mgr.add_storage("swap_group_x", {"attn": [a, (b,)], "mlp": [c, view]})
    mgr.launch_offload("swap_group_x")
    mgr.wait_offload("swap_group_x")
    assert [t.untyped_storage().nbytes() for t in (a, b, c)] == [0, 0, 0]
    assert view.untyped_storage().nbytes() == 8 * 8 * 4
    moved = rt.stats()
    assert moved["offloaded_bytes"] - before["offloaded_bytes"] == a.nbytes + b.nbytes + c.nbytes
    mgr.launch_load("swap_group_x")
    mgr.wait_load("swap_group_x")
    for t, w, v in zip(tensors, want, versions):
        assert torch.equal(t, w) and t._version == v
    assert rt.stats()["device_current"] == before["device_current"]
    SwapManager.reset()


class SwappedTensorBlock(Block):
    """A block whose MLP input is swapped with ``swap_tensor_wrapper``: the MLP runs outside the
    ``swap_wrapper`` region, so autograd itself keeps that input for the MLP's backward."""

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h2 = swap_tensor_wrapper(self.norm2(x), tag="mlp_input")
        self.swapped = h2.detach()  # the same storage, without holding the graph
        return x + self.mlp(h2)


@pytest.mark.filterwarnings("ignore:Tensor mlp_input")  # the plain run has no layer groups
def test_swap_tensor_wrapper_swaps_tensors_autograd_keeps_and_stays_bit_exact():
    def run(swap):
        SwapManager.reset()
        rt = ht.runtime()
        torch.manual_seed(0)
        model = SimpleTransformer()
        model.layers = nn.ModuleList(SwappedTensorBlock() for _ in range(6))
        if swap:
            for layer in model.layers:
                layer.attn = swap_wrapper(layer.attn, group_swap=True)
            for a, b in zip(model.layers[:-1], model.layers[1:]):
                SwapManager().set_forward_prefetch_layer(a, b)
            assert SwapManager().is_last_group(model.layers[-1]._swap_group_name)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
        before = rt.stats()["offloaded_bytes"]
        loss = model(ids).square().mean()
        released = [layer.swapped.untyped_storage().nbytes() == 0 for layer in model.layers]
        loss.backward()
        offloaded = rt.stats()["offloaded_bytes"] - before
        out = [loss.detach()] + [p.grad for p in model.parameters()]
        back = all(layer.swapped.untyped_storage().nbytes() > 0 for layer in model.layers)
        SwapManager.reset()
        return out, released, back, offloaded

    want, _, _, _ = run(False)
    got, released, back, offloaded = run(True)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # Each group's offload is waited for at the next layer's forward; the last group stays.
    assert released == [True] * 5 + [False]
    assert back and offloaded > 0


@pytest.mark.filterwarnings("ignore:Tensor mlp_input")  # the plain run has no layer groups
def test_swap_tensor_wrapper_gives_a_dropped_graph_its_tensors_back():
    """A forward whose graph is dropped before its backward released its in-place tensors: the
    next pass gives them their bytes back (no tensor object is left without storage), and the
    next step is plain torch's."""

    def run(swap):
        SwapManager.reset()
        torch.manual_seed(0)
        model = SimpleTransformer()
        model.layers = nn.ModuleList(SwappedTensorBlock() for _ in range(4))
        if swap:
            for layer in model.layers:
                layer.attn = swap_wrapper(layer.attn)
            for a, b in zip(model.layers[:-1], model.layers[1:]):
                SwapManager().set_forward_prefetch_layer(a, b)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(8))
        dropped = model(ids).square().mean()  # a metric with grad on, never backpropagated
        kept = [layer.swapped for layer in model.layers]
        first = [t.clone() for t in kept] if not swap else None
        released = [t.untyped_storage().nbytes() == 0 for t in kept]
        del dropped
        loss = model(ids).square().mean()
        loss.backward()
        back = [t.untyped_storage().nbytes() > 0 for t in kept]
        out = [loss.detach()] + [p.grad for p in model.parameters()]
        SwapManager.reset()
        return out, released, back, kept, first

    want, _, _, _, first = run(False)
    got, released, back, kept, _ = run(True)
    assert released == [True] * 3 + [False] and all(back)
    for t, w in zip(kept, first):
        assert torch.equal(t, w)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_swap_tensor_wrapper_outside_a_layer_warns_and_returns_its_target():
    SwapManager.reset()
    t = torch.ones(4)
    with pytest.warns(UserWarning, match="unregistered"):
        assert swap_tensor_wrapper(t, tag="x") is t
    assert t.untyped_storage().nbytes() == 16


class MegatronLayer(nn.Module):
    """A layer marking Megatron-LM's offload groups around its norm and MLP."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = ht.fine_grained_offloading_group_start(x, name="mlp_norm")
        h = self.norm(h)
        h = ht.fine_grained_offloading_group_commit(h, name="mlp_norm")
        h = ht.fine_grained_offloading_group_start(h, name="mlp")
        h = self.mlp(h)
        h = ht.fine_grained_offloading_group_commit(h, name="mlp")
        return x + h


def megatron_run(offload):
    torch.manual_seed(0)
    layers = nn.Sequential(*(MegatronLayer() for _ in range(4)))
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    observed = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, SEQ, DIM, generator=g)
        opt.zero_grad()
        ht.fine_grained_offloading_reset()
        ht.fine_grained_offloading_init_chunk_handler(vp_size=1, vp_stage=None,
                                                      min_offloaded_tensor_size=1)
        with ht.get_fine_grained_offloading_context(offload):
            loss = layers(x).square().mean()
        loss.backward()
        opt.step()
        observed.append(loss.detach().clone())
        observed.extend(p.grad.clone() for p in layers.parameters())
    return observed


def test_megatron_fine_grained_offloading_is_bit_exact():
    manager = ht.PipelineOffloadManager.reset_instance()
    want = megatron_run(False)
    got = megatron_run(True)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # The first group's start saw an input that needs no gradient, so its backward (which ends
    # the group) never runs: as in Megatron-LM, the next reset frees it.
    ht.fine_grained_offloading_reset()
    st = manager.stats()
    assert st["offloaded_tensors"] > 0 and st["reloaded_tensors"] > 0
    assert st["device_current"] == 0


# Megatron-LM's markers on transformers models: each layer's attention and MLP are offload groups
# (started on the module's input, committed on its output, as Megatron-LM's ``core_attn`` /
# ``attn_proj`` / ``expert_fc1`` groups are), and the module's input, which nothing reads after
# the module but the module's saved tensors, is forced-released.
def transformers_model(kind):
    """test_torch_transformers' GPT-2 / Llama, its layers and their attention's name."""
    pytest.importorskip("transformers")
    from test_torch_transformers import MODELS

    model, layers = MODELS[kind]()
    model.config.use_cache = False
    return model, layers, "attn" if kind == "gpt2" else "self_attn"


def megatron_markers(layers, attn_name, log, delay_mlp=False):
    """Group markers by module hooks; ``log`` collects (layer, group, forced tensor)."""
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        def layer_pre(module, args, i=i):
            if delay_mlp:  # Megatron-LM flushes delayed groups after the next layer's replay
                ht.fine_grained_offloading_group_flush_delayed_groups()
            ht.fine_grained_offloading_set_last_layer(i == last)

        layer.register_forward_pre_hook(layer_pre)
        for name, module in ((attn_name, getattr(layer, attn_name)), ("mlp", layer.mlp)):
            def pre(module, args, kwargs, name=name):
                if args:
                    return (ht.fine_grained_offloading_group_start(args[0], name),) + args[1:], kwargs
                kwargs["hidden_states"] = ht.fine_grained_offloading_group_start(
                    kwargs["hidden_states"], name)
                return args, kwargs

            def post(module, args, kwargs, out, name=name, i=i):
                x = args[0] if args else kwargs["hidden_states"]
                log.append((i, name, x))
                return ht.fine_grained_offloading_group_commit(
                    out, name, forced_released_tensors=[x], delay_offload=delay_mlp and name == "mlp")

            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, with_kwargs=True)


def megatron_transformers_run(kind, offload, delay_mlp=False, steps=2):
    import test_torch_transformers as tt

    model, layers, attn_name = transformers_model(kind)
    log = []
    if offload:
        megatron_markers(layers, attn_name, log, delay_mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    observed, released = [], []
    for _ in range(steps):
        ids = torch.randint(0, tt.VOCAB, (tt.BATCH, tt.SEQ), generator=g)
        opt.zero_grad()
        ht.fine_grained_offloading_reset()
        ht.fine_grained_offloading_init_chunk_handler(vp_size=1, vp_stage=None,
                                                      min_offloaded_tensor_size=256)
        log.clear()
        with ht.get_fine_grained_offloading_context(offload):
            loss = model(ids, labels=ids).loss
        if offload:
            ht.fine_grained_offloading_group_flush_delayed_groups()
            ht.fine_grained_offloading_forward_record()
            released.append([(i, name, x.untyped_storage().nbytes() == 0) for i, name, x in log])
            loss = ht.fine_grained_offloading_backward_record(loss)
        log.clear()
        loss.backward()
        opt.step()
        observed.append(loss.detach().clone())
        observed.extend(p.grad.clone() for p in model.parameters())
    return observed, released


@pytest.mark.parametrize("kind,delay_mlp", [("llama", False), ("gpt2", True)])
def test_megatron_markers_on_transformers_release_forced_tensors_and_stay_bit_exact(kind, delay_mlp):
    """Forced-released tensors lose their device bytes once their group's offload completed
    (each commit completes the previous group's offload); the last layer's groups
    (``set_last_layer``) stay on the device and release nothing; delayed MLP groups offload at
    the next flush; every loss and gradient equals plain torch's."""
    manager = ht.PipelineOffloadManager.reset_instance()
    want, _ = megatron_transformers_run(kind, offload=False)
    got, released = megatron_transformers_run(kind, offload=True, delay_mlp=delay_mlp)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for step in released:
        by_layer = {}
        for i, name, freed in step:
            by_layer.setdefault(i, []).append(freed)
        n = len(by_layer)
        assert n >= 3
        # Layers 0..L-3 entirely, and layer L-2's first group: a later group's launch completed
        # their offloads (one in flight at a time). The last offloaded group is released if its
        # copy had finished by then; the last layer stayed on the device.
        for i in range(n - 2):
            assert by_layer[i] == [True, True], (i, step)
        assert by_layer[n - 2][0], step
        assert by_layer[n - 1] == [False, False], step
    ht.fine_grained_offloading_reset()
    st = manager.stats()
    assert st["device_current"] == 0
    assert st["offloaded_tensors"] > 0 and st["reloaded_tensors"] > 0


def test_forced_release_spares_storage_autograd_keeps_and_small_tensors():
    """A forced-released tensor is released once its group's offload completed, but not when
    autograd keeps a saved tensor on its storage (it would read released memory) nor when it is
    under ``min_offloaded_tensor_size`` elements; the gradients are plain torch's."""

    def run(offload):
        manager = ht.PipelineOffloadManager.reset_instance()
        torch.manual_seed(3)
        w = torch.randn(32, 32, requires_grad=True)
        x0 = torch.randn(8, 32, requires_grad=True)
        s0 = torch.randn(4, requires_grad=True)
        ht.fine_grained_offloading_init_chunk_handler(min_offloaded_tensor_size=64)
        with ht.get_fine_grained_offloading_context(offload):
            x, small = x0 * 1.0, s0 * 1.0
            kept = x.sin()  # saves x outside any group: autograd keeps its storage
            h = ht.fine_grained_offloading_group_start(x, "g0")
            y = (h @ w).relu()
            y = ht.fine_grained_offloading_group_commit(y, "g0", forced_released_tensors=[x, small])
            forced = y * 2.0
            u = ht.fine_grained_offloading_group_start(forced, "g1")
            v = (u @ w).tanh()
            v = ht.fine_grained_offloading_group_commit(v, "g1", forced_released_tensors=[forced])
            z = ht.fine_grained_offloading_group_start(v, "g2")
            z = ht.fine_grained_offloading_group_commit((z @ w).sigmoid(), "g2")
        freed = [t.untyped_storage().nbytes() == 0 for t in (x, small, forced)]
        del forced
        (z.sum() + kept.sum() + small.sum()).backward()
        ht.fine_grained_offloading_reset()
        assert manager.stats()["device_current"] == 0
        return freed, [w.grad, x0.grad, s0.grad]

    want_freed, want = run(False)
    freed, got = run(True)
    assert want_freed == [False, False, False]
    assert freed == [False, False, True]  # g2's launch completed g1's offload
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class MegatronTransformerLayer(Block):
    """Megatron-LM's TransformerLayer pattern through its interface: the input norms are the
    ``attn_norm`` / ``mlp_norm`` groups, committed after the residual add with the residual
    forced-released (the norm saved it; nothing else reads it)."""

    def forward(self, x):
        off = ht.FineGrainedActivationOffloadingInterface
        residual = x
        attn_norm = off(True, x, "attn_norm")
        with attn_norm as h:
            h = self.norm1(h)
        hidden = residual + self.attn(h, h, h, need_weights=False)[0]
        hidden = attn_norm.group_offload(hidden, forced_released_tensors=[residual])
        residual = hidden
        mlp_norm = off(True, hidden, "mlp_norm")
        with mlp_norm as h:
            h = self.norm2(h)
        out = residual + self.mlp(h)
        return off.group_commit(out, "mlp_norm", forced_released_tensors=[residual])


def test_megatron_interface_layers_release_residuals_and_stay_bit_exact():
    def run(offload):
        manager = ht.PipelineOffloadManager.reset_instance()
        torch.manual_seed(0)
        model = SimpleTransformer()
        model.layers = nn.ModuleList(MegatronTransformerLayer() for _ in range(4))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(9))
        ht.FineGrainedActivationOffloadingInterface.reset()
        if offload:
            ht.FineGrainedActivationOffloadingInterface.init_chunk_handler(1, None, 64)
        inputs = []
        hook = model.layers[1].register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
        loss = model(ids).square().mean()
        hook.remove()
        released = inputs[0].untyped_storage().nbytes() == 0
        del inputs
        loss.backward()
        out = [loss.detach()] + [p.grad for p in model.parameters()]
        ht.FineGrainedActivationOffloadingInterface.reset()
        assert manager.stats()["device_current"] == 0
        return out, released, manager.stats()["offloaded_tensors"]

    want, released_plain, _ = run(False)
    got, released, offloaded = run(True)
    assert not released_plain and released and offloaded > 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_megatron_markers_are_identities_without_a_chunk_and_graph_events_need_a_gpu_backend():
    ht.PipelineOffloadManager.reset_instance()
    t = torch.ones(3)
    assert ht.fine_grained_offloading_group_start(t, "g") is t
    assert ht.fine_grained_offloading_group_commit(t, "g") is t
    pair = (torch.ones(2), torch.zeros(2))
    assert ht.fine_grained_offloading_group_commit(pair, "g") == pair
    manager = ht.PipelineOffloadManager.get_instance()
    ht.fine_grained_offloading_init_chunk_handler(min_offloaded_tensor_size=1)
    marked, plain = torch.randn(64, requires_grad=True) * 1.0, torch.randn(64, requires_grad=True) * 1.0
    ht.FineGrainedActivationOffloadingInterface.mark_not_offloadable(marked)
    before = manager.stats()["offloaded_tensors"]
    with ht.get_fine_grained_offloading_context(True):
        g = ht.fine_grained_offloading_group_start(torch.ones(1, requires_grad=True), "g")
        y = (marked.sin() + plain.sin()).sum() + g.sum()
        y = ht.fine_grained_offloading_group_commit(y, "g")
    assert manager.stats()["offloaded_tensors"] - before == 1  # plain's, not marked's
    y.backward()
    ht.fine_grained_offloading_reset()
    with pytest.raises(NotImplementedError, match="CUDA graph"):
        ht.fine_grained_offloading_forward_record(object())
    with pytest.raises(NotImplementedError, match="CUDA graph"):
        ht.fine_grained_offloading_backward_record(t, object())


def test_checkpoint_wrapper_saves_recomputes_and_swaps_per_operator():
    """Selective checkpointing of each block's MLP: matmul outputs swapped (MUST_SWAP), GELU's
    saved (MUST_SAVE), the rest recomputed; bit-exact with plain torch, and the swapped outputs
    travel with their layer's group."""

    def policy_fn(ctx, op, *args, **kwargs):
        if op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            return ht.CheckpointPolicy.MUST_SWAP
        if op == torch.ops.aten.gelu.default:
            return ht.CheckpointPolicy.MUST_SAVE
        return ht.CheckpointPolicy.PREFER_RECOMPUTE

    def run(wrap):
        SwapManager.reset()
        rt = ht.runtime()
        torch.manual_seed(0)
        model = SimpleTransformer()
        model.layers = model.layers[:4]
        if wrap:
            for layer in model.layers:
                layer.mlp = ht.checkpoint_wrapper(layer.mlp, policy_fn)
            for a, b in zip(model.layers[:-1], model.layers[1:]):
                SwapManager().set_forward_prefetch_layer(a, b)
        before = rt.stats()["offloaded_tensors"]
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        loss = model(ids).square().mean()
        loss.backward()
        out = [loss.detach()] + [p.grad for p in model.parameters()]
        offloaded = rt.stats()["offloaded_tensors"] - before
        SwapManager.reset()
        return out, offloaded

    want, _ = run(False)
    got, offloaded = run(True)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert offloaded > 0
