"""hprt.torch's front ends on transformers GPT-2 and Llama models (small configs, no downloads):
a few AdamW steps with saved activations swapped (plain and compress-then-swap) must give the same
losses and gradients as plain torch, compared by ``torch.equal``."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hprt  # noqa: E402
import hprt.torch as ht  # noqa: E402

VOCAB, SEQ, BATCH, LAYERS, STEPS = 64, 16, 2, 4, 3


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    return model, list(model.transformer.h)


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    return model, list(model.model.layers)


MODELS = {"gpt2": gpt2, "llama": llama}


def keyed(rt, blocks):
    """One ``TensorSwapContext`` per block, entered by the block's forward hooks."""
    ht.TensorSwapContext.reset()
    for block in blocks:
        ctx = ht.TensorSwapContext(module_tag="model.layers.*", runtime_=rt)

        def enter(module, args, ctx=ctx):
            ctx.__enter__()

        def leave(module, args, output, ctx=ctx):
            ctx.__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)


def layer_group(rt, blocks):
    ht.SwapManager.reset()
    mgr = ht.SwapManager(rt)
    for a, b in zip(blocks[:-1], blocks[1:]):
        mgr.set_forward_prefetch_layer(a, b)


def train(name, front=None, rt=None):
    """``STEPS`` AdamW steps on random tokens; the losses and every step's gradients."""
    model, blocks = MODELS[name]()
    model.config.use_cache = False
    if front is not None:
        front(rt, blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads


_baselines = {}


def baseline(name):
    if name not in _baselines:
        _baselines[name] = train(name)
    return _baselines[name]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("front", [keyed, layer_group], ids=["keyed", "layer_group"])
@pytest.mark.parametrize("compression", ["off", "host_stage", "device"])
def test_transformers_training_with_swap_is_bit_exact(name, front, compression):
    rt = ht.Runtime(hprt.cpu_platform(device_memory=256 << 20), compression=compression)
    losses, grads = train(name, front, rt)
    ref_losses, ref_grads = baseline(name)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(a, b), (step, a, b)
    for step, (ga, gb) in enumerate(zip(grads, ref_grads)):
        assert len(ga) == len(gb)
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), (step, i)
    s = rt.stats()
    assert s["offloaded_tensors"] > 0 and s["reloaded_tensors"] > 0, s
    assert s["device_current"] == 0, s
    if compression == "off":
        assert s["compressed_tensors"] == 0 and s["link_d2h_bytes"] == s["offloaded_bytes"], s
    else:
        assert s["compressed_tensors"] > 0 and s["codec_ns"] > 0, s
