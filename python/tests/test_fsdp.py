"""fully_shard on transformers GPT-2 and Llama models built from small configs: every rank's
gradients and weights after three AdamW steps must be bit-identical to a single-rank run of the
same arithmetic (per-rank forward/backward, gradients reduced in rank order, AdamW on the same
padded shards), and close to plain full-batch training."""

import contextlib
import copy
import ctypes
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import transformers  # noqa: E402  (CI installs it: scripts/test)

import hprt  # noqa: E402
import hprt.torch as ht  # noqa: E402
from hprt import fsdp  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402  (FSDP2's placement type)
from emulated import EMULATED  # noqa: E402

BATCH, SEQ, VOCAB, STEPS, LR, WD = 2, 8, 96, 3, 1e-2, 0.1


@pytest.fixture(autouse=True)
def one_thread():
    # Rank threads run concurrently; one intra-op thread each keeps 2-core CI machines sane.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gpt2(layers=2):
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": gpt2, "llama": llama}


def blocks(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


class Case:
    def __init__(self, model="gpt2", world=2, mesh=None, bf16=False, reshard=True, micro=1,
                 offload=False, zero_in_place=False, last_backward=False, shard_dim=None,
                 partial=False):
        self.model, self.world, self.bf16, self.reshard = model, world, bf16, reshard
        self.mesh = mesh or (world,)
        self.micro, self.offload = micro, offload
        self.zero_in_place = zero_in_place  # zero_grad(set_to_none=False)
        # Every micro-batch reduces, all but the last under set_is_last_backward(False).
        self.last_backward = last_backward
        self.shard_dim = shard_dim  # shard_placement_fn: Shard(shard_dim) for matrices
        # Every micro-batch reduce-scatters, only the last all-reduces (set_requires_all_reduce).
        self.partial = partial

    def dim_of(self, t):
        return self.shard_dim % t.ndim if self.shard_dim is not None and t.ndim > 1 else 0

    @property
    def mp(self):
        if self.bf16:
            return ht.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return ht.MixedPrecisionPolicy()


def shard_model(model, case):
    mesh = ht.init_device_mesh(None, case.mesh)
    kw = dict(mesh=mesh, reshard_after_forward=case.reshard, mp_policy=case.mp,
              offload_policy=ht.CPUOffloadPolicy() if case.offload else ht.OffloadPolicy())
    if case.shard_dim is not None:
        kw["shard_placement_fn"] = lambda p: Shard(case.shard_dim) if p.ndim > 1 else None
    for block in blocks(model):
        ht.fully_shard(block, **kw)
    ht.fully_shard(model, **kw)
    return model


def train_rank(rank, template, case, peaks=None, shard=shard_model):
    model = shard(copy.deepcopy(template), case)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    platform = model._hprt_fsdp.mesh.platform
    losses = []
    for step in range(STEPS):
        if step == 1:
            platform.reset_peak_memory()
        for micro in range(case.micro):
            last = micro == case.micro - 1
            if case.last_backward:
                model.set_is_last_backward(last)
            elif case.partial:
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
            loss = loss_of(model, batch(step, micro, rank))
            loss.backward()
            losses.append(loss.item())
            if step == 0 and not last:  # nothing published before the last backward
                assert all(p.grad is None for p in model.parameters())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=not case.zero_in_place)
    if peaks is not None:
        peaks[rank] = platform.memory_stats()["device_peak"]
    shards = {n: p.detach().clone() for n, p in model.named_parameters()}
    index = {n: p._hprt_fsdp_param.sp.shard_index for n, p in model.named_parameters()}
    full = ht.get_model_state_dict(model)
    return grads, shards, index, losses, full


def pad_chunks(t, groups, dim=0):
    """``t`` split into ``groups`` chunks along ``dim``, zero-padded to equal size (hprt's
    shards)."""
    rows = -(-t.shape[dim] // groups)
    shape = list(t.shape)
    shape[dim] = rows * groups
    padded = torch.zeros(shape, dtype=t.dtype)
    padded.narrow(dim, 0, t.shape[dim]).copy_(t)
    return list(padded.split(rows, dim))


def sum_in_order(ts):
    s = ts[0]
    for t in ts[1:]:
        s = s + t
    return s


def reduce_ranks(per_rank, groups):
    """hprt's reduction of one gradient per rank: the mean over each shard group in rank
    order, then the mean over the replicas (HSDP)."""
    out = {}
    for n in per_rank[0]:
        group_means = [sum_in_order([per_rank[r][n] for r in g]) / len(g) for g in groups]
        s = sum_in_order(group_means)
        out[n] = s / len(group_means) if len(group_means) > 1 else s
    return out


def reference(template, case):
    """One rank doing every rank's arithmetic: forward/backward on each rank's batch with the
    gathered (and cast) parameters, the reduce dtype's sum over micro-batches, the average
    over ranks in hprt's order (shard group, then replicas), AdamW on padded shards."""
    world = case.world
    shard_size = case.mesh[-1]
    groups = [list(range(g * shard_size, (g + 1) * shard_size)) for g in range(world // shard_size)]
    master = {n: p.detach().clone() for n, p in template.named_parameters()}
    dims = {n: case.dim_of(t) for n, t in master.items()}
    shards = {n: pad_chunks(t, shard_size, dims[n]) for n, t in master.items()}
    shard_params = [[torch.nn.Parameter(shards[n][k]) for n in master] for k in range(shard_size)]
    opts = [torch.optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=False) for ps in shard_params]
    work = copy.deepcopy(template)
    pdt = torch.bfloat16 if case.bf16 else torch.float32
    grads_out = None
    for step in range(STEPS):
        with torch.no_grad():
            for n, p in work.named_parameters():
                p.data = master[n].to(pdt)
        # grads[micro][rank][name] in the reduce dtype
        grads = [[{} for _ in range(world)] for _ in range(case.micro)]
        for rank in range(world):
            for micro in range(case.micro):
                work.zero_grad(set_to_none=True)
                loss_of(work, batch(step, micro, rank)).backward()
                for n, p in work.named_parameters():
                    grads[micro][rank][n] = p.grad.to(torch.float32)
        if case.partial:  # per replica: the sum of the micro-batches' group means; then the mean
            reduced = {}
            for n in master:
                sums = [sum_in_order([reduce_ranks(per, [g])[n] for per in grads]) for g in groups]
                reduced[n] = sum_in_order(sums) / len(sums) if len(sums) > 1 else sums[0]
        elif case.last_backward:  # a reduction per micro-batch, accumulated into the shard
            reduced = reduce_ranks(grads[0], groups)
            for per in grads[1:]:
                reduced = {n: g + r for (n, g), r in zip(reduced.items(), reduce_ranks(per, groups).values())}
        else:  # summed unsharded (sync off), then one reduction
            summed = [{n: sum_in_order([grads[m][r][n] for m in range(case.micro)]) for n in master}
                      for r in range(world)]
            reduced = reduce_ranks(summed, groups)
        grads_out = {n: pad_chunks(reduced[n], shard_size, dims[n]) for n in master}
        for k in range(shard_size):
            for n, sp in zip(master, shard_params[k]):
                sp.grad = grads_out[n][k].clone()
            opts[k].step()
        for i, n in enumerate(master):
            full = torch.cat([shard_params[k][i].detach() for k in range(shard_size)], dims[n])
            master[n] = full.narrow(dims[n], 0, master[n].shape[dims[n]]).clone()
    return grads_out, [[p.detach() for p in ps] for ps in shard_params], master


def plain_full_batch(template, case):
    model = copy.deepcopy(template)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for step in range(STEPS):
        for micro in range(case.micro):
            ids = torch.cat([batch(step, micro, r) for r in range(case.world)])
            loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def check(case, out, template):
    ref_grads, ref_shards, ref_full = reference(template, case)
    names = list(ref_full)
    for rank, (grads, shards, index, _, full) in enumerate(out):
        assert list(shards) == names
        for i, n in enumerate(names):
            k = index[n]
            assert torch.equal(grads[n], ref_grads[n][k]), f"rank {rank}: gradient of {n}"
            assert torch.equal(shards[n], ref_shards[k][i]), f"rank {rank}: weight of {n}"
            assert torch.equal(full[n], ref_full[n]), f"rank {rank}: full state of {n}"
    if not case.bf16:
        plain = plain_full_batch(template, case)
        for n in names:
            # Adam turns rounding noise in near-zero gradients into steps of up to lr.
            torch.testing.assert_close(ref_full[n], plain[n], rtol=1e-3, atol=5e-4)


CASES = {
    "gpt2-fsdp2": Case("gpt2", 2),
    "llama-fsdp2": Case("llama", 2),
    "gpt2-fsdp4": Case("gpt2", 4),
    "llama-hsdp2x2": Case("llama", 4, mesh=(2, 2)),
    "gpt2-hsdp2x2-bf16": Case("gpt2", 4, mesh=(2, 2), bf16=True),
    "llama-fsdp2-bf16": Case("llama", 2, bf16=True),
    "gpt2-fsdp2-keep-gathered": Case("gpt2", 2, reshard=False),
    "llama-fsdp4-accumulate": Case("llama", 4, micro=2),
    "gpt2-hsdp2x2-not-last-backward": Case("gpt2", 4, mesh=(2, 2), micro=3, last_backward=True),
    "llama-hsdp2x2-no-all-reduce": Case("llama", 4, mesh=(2, 2), micro=3, partial=True),
    "gpt2-fsdp2-offload": Case("gpt2", 2, offload=True),
    "gpt2-fsdp2-zero-in-place": Case("gpt2", 2, zero_in_place=True),
    # Shard(-1) of every matrix over 3 ranks: 32 columns pad to 33.
    "gpt2-fsdp3-shard-last-dim": Case("gpt2", 3, shard_dim=-1),
    "llama-hsdp2x2-shard-dim1-bf16": Case("llama", 4, mesh=(2, 2), shard_dim=1, bf16=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fully_shard_is_bit_exact(name):
    case = CASES[name]
    template = MODELS[case.model]()
    out = ht.run_on_ranks(case.world, train_rank, template, case)
    check(case, out, template)


def test_fully_shard_under_jitter():
    """Random delays on every hprt stream: a missing wait shows up as a wrong bit."""
    case = Case("gpt2", 2, mesh=(2,))
    template = gpt2()
    p = hprt.cpu_platform(devices=2, jitter=int(os.environ.get("HP_CPU_JITTER", "7")))
    out = ht.run_on_ranks(case.world, train_rank, template, case, platform=p)
    check(case, out, template)


def param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_peak_device_memory_is_a_shard_plus_gathered_blocks():
    """Peak hprt device bytes per rank: the shards and sharded gradients (1/N each), the
    root's gathered parameters, the computing block and the prefetched one."""
    case = Case("gpt2", 4)
    template = gpt2(layers=4)
    peaks = [None] * case.world
    ht.run_on_ranks(case.world, train_rank, template, case, peaks=peaks)
    total = param_bytes(template)
    block = max(param_bytes(b) for b in blocks(template))
    root = total - sum(param_bytes(b) for b in blocks(template))
    # Shards and sharded gradients (1/N each, plus padding), the root's gathered parameters
    # (kept from forward to backward), and two gathered blocks: the one computing and the one
    # prefetched.
    bound = 2 * total / case.world * 1.05 + root + 2 * block
    for r, peak in enumerate(peaks):
        assert peak <= bound, f"rank {r}: peak {peak} bytes, bound {bound:.0f} ({total} bytes of parameters)"
        assert peak >= total / case.world + block, f"rank {r}: peak {peak} is below a shard and a block"

    # bf16 parameters reduced in f32: each gradient is staged in f32 for its reduction; at most
    # two modules' reductions are in flight (FSDP2's bound), not every module's until the end
    # of backward. Eight blocks, so that O(model) staging could not pass.
    deep = gpt2(layers=8)
    total8 = param_bytes(deep)
    root8 = total8 - sum(param_bytes(b) for b in blocks(deep))
    bf16 = [None] * case.world
    ht.run_on_ranks(case.world, train_rank, deep, Case("gpt2", 4, bf16=True), peaks=bf16)
    staged = 2 * block  # two blocks' gradients in f32
    bound = 2 * total8 / case.world * 1.05 + root8 + 2 * block / 2 + staged + block / 4
    assert max(bf16) <= bound, (bf16, bound)

    # Without prefetching, one gathered block (the target: a shard and a block, with
    # the sharded gradients and the root's parameters).
    def no_prefetch(rank, template, case, peaks):
        def shard(model, case):
            model = shard_model(model, case)
            for b in blocks(model):
                b.set_modules_to_forward_prefetch([])
                b.set_modules_to_backward_prefetch([])
            return model
        return train_rank(rank, template, case, peaks, shard=shard)

    one = [None] * case.world
    ht.run_on_ranks(case.world, no_prefetch, template, case, peaks=one)
    bound = 2 * total / case.world * 1.05 + root + block
    assert max(one) <= bound < min(peaks), (one, bound, peaks)

    keep = Case("gpt2", 4, reshard=False)
    kept = [None] * keep.world
    ht.run_on_ranks(keep.world, train_rank, template, keep, peaks=kept)
    # Without resharding after forward every block stays gathered until its backward.
    assert min(kept) >= max(peaks) + block, (kept, peaks)


def test_module_methods_and_state_dicts():
    def rank_fn(rank):
        model = shard_model(copy.deepcopy(template), Case("llama", 2))
        layers = blocks(model)
        assert isinstance(model, ht.FSDPModule) and isinstance(layers[0], ht.FSDPModule)
        # The registered parameters are this rank's padded shards.
        for n, p in model.named_parameters():
            sp = p._hprt_fsdp_param.sp
            assert list(p.shape) == sp.shard_shape and sp.state == "sharded"
        handle = layers[0].unshard(async_op=True)
        handle.wait()
        q = layers[0].self_attn.q_proj.weight
        assert q.shape == template.model.layers[0].self_attn.q_proj.weight.shape
        assert torch.equal(q, template.model.layers[0].self_attn.q_proj.weight)
        layers[0].reshard()
        assert layers[0].self_attn.q_proj.weight._hprt_fsdp_param.sp.state == "sharded"

        layers[1].set_modules_to_backward_prefetch([layers[0]])
        layers[0].set_modules_to_forward_prefetch([layers[1]])
        model.set_reshard_after_forward(False)
        loss_of(model, batch(0, 0, rank)).backward()
        assert all(p.grad is not None for p in model.parameters())
        model.zero_grads()
        assert all(p.grad is None for p in model.parameters())

        full = ht.get_model_state_dict(model)
        sharded = ht.get_model_state_dict(model, full_state_dict=False)
        for n, t in template.state_dict().items():
            assert torch.equal(full[n], t), n
        # Load a changed full state dict, read it back, then restore the shards.
        changed = {n: t + 1 if t.is_floating_point() else t for n, t in full.items()}
        ht.set_model_state_dict(model, changed)
        again = ht.get_model_state_dict(model)
        assert all(torch.equal(again[n], changed[n]) for n in changed)
        ht.set_model_state_dict(model, sharded, full_state_dict=False)
        assert all(torch.equal(ht.get_model_state_dict(model)[n], full[n]) for n in full)
        return True

    template = llama()
    assert ht.run_on_ranks(2, rank_fn) == [True, True]


def test_per_parameter_upstream_names():
    """hyper_parallel's HSDPParamV2 names on hprt's ShardedParam (HSDP 2x2)."""
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)

    def rank_fn(rank):
        mesh = ht.init_device_mesh("cpu", (2, 2))
        sp = hprt.ShardedParam(mesh.cache, mesh.streams, mesh.dp, "w", full)
        sp.alloc_all_gather_outputs()
        sp.free_unsharded_param()
        sp.to_unsharded()
        assert sp.state == "unsharded"
        with pytest.raises(hprt.HprtError):
            sp.free_unsharded_param()  # in use
        mesh.streams.compute.synchronize()
        got = torch.from_dlpack(sp.unsharded()).clone()
        sp.to_sharded()
        assert sp.state == "sharded"
        grad = torch.full((5, 3), float(rank + 1))
        with pytest.raises(hprt.HprtError):
            sp.all_reduce_grad()  # before reduce_scatter_grad
        sp.reduce_scatter_grad(grad, op="sum")
        sp.all_reduce_grad()
        sp.wait_for_reduce()
        both = torch.frombuffer(bytearray(sp.read_sharded_grad()), dtype=torch.float32).clone()
        sp.clear_grad()
        sp.reduce_scatter_grad(grad, op="sum")  # replicas skipped
        sp.wait_for_reduce()
        one = torch.frombuffer(bytearray(sp.read_sharded_grad()), dtype=torch.float32).clone()
        valid = sp.valid_rows(sp.shard_index) * 3  # the rest is padding
        return got, both[:valid], one[:valid]

    out = ht.run_on_ranks(4, rank_fn)
    for rank, (got, both, one) in enumerate(out):
        assert torch.equal(got, full) and both.numel() > 0
        assert torch.equal(both, torch.full_like(both, 1 + 2 + 3 + 4))
        pair = (1 + 2) if rank < 2 else (3 + 4)
        assert torch.equal(one, torch.full_like(one, pair))


def test_ranks_need_a_context_and_errors_name_the_rank():
    with pytest.raises(RuntimeError, match="run_on_ranks"):
        ht.init_device_mesh()

    def fail(rank):
        if rank == 1:
            raise ValueError("boom")
        return rank

    with pytest.raises(RuntimeError, match="rank 1 of 2 failed: boom"):
        ht.run_on_ranks(2, fail)
    with pytest.raises(RuntimeError, match="holds 3 ranks"):
        ht.run_on_ranks(2, lambda r: ht.init_device_mesh("cpu", (3,)))
    # torch's device type of the rank's tensors, not a backend's name.
    with pytest.raises(RuntimeError, match="device_type 'cuda': this rank's tensors are 'cpu'"):
        ht.run_on_ranks(2, lambda r: ht.init_device_mesh("cuda"))


def test_each_rank_seeding_and_building_its_model_gets_the_seeded_weights():
    """FSDP2 code ported as is: every rank seeds torch and builds its model. The ranks are
    threads and torch has one global CPU generator: with it shared, the ranks' draws interleave
    (the barrier makes them) and the shards come from different initialisations. Each rank has
    its own generator state; the caller's is untouched."""
    barrier = threading.Barrier(2)

    def build():
        first = torch.nn.Linear(8, 8)
        barrier.wait()  # both ranks drew `first`; now they draw at the same time
        return torch.nn.Sequential(first, torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))

    def rank_fn(rank):
        torch.manual_seed(0)
        model = build()
        assert torch.initial_seed() == 0
        ht.fully_shard(model)
        drop = model(torch.ones(4, 8))  # dropout draws from the rank's generator
        return ht.get_model_state_dict(model), drop.detach()

    torch.manual_seed(123)
    caller = torch.get_rng_state()
    barrier_free = threading.Barrier(1)
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(barrier, "wait", barrier_free.wait)
        ref = build()
    ref_drop = ref(torch.ones(4, 8)).detach()
    torch.set_rng_state(caller)
    out = ht.run_on_ranks(2, rank_fn)
    for rank, (state, drop) in enumerate(out):
        for n, t in ref.state_dict().items():
            assert torch.equal(state[n], t), f"rank {rank}: {n}"
        assert torch.equal(drop, ref_drop), f"rank {rank}: dropout"
    assert torch.equal(torch.get_rng_state(), caller)
    assert torch.initial_seed() == 123


class Failing(Exception):
    pass


@contextlib.contextmanager
def _short_hccl_timeout(ms):
    """The Ascend emulator's HCCL timeout (its test export) set to ``ms`` meanwhile."""
    lib = ctypes.CDLL(os.environ["HP_ACL_LIB"])
    lib.hprtEmuSetHcclTimeoutMs.argtypes = [ctypes.c_uint64]
    assert lib.hprtEmuSetHcclTimeoutMs(ms) == 0
    try:
        yield
    finally:
        lib.hprtEmuSetHcclTimeoutMs(120_000)


@pytest.mark.parametrize("backend", [pytest.param("cpu")] + EMULATED)
@pytest.mark.parametrize("where", ["before fully_shard", "before forward", "in backward"])
def test_a_failing_rank_fails_the_others_at_once_and_is_reported_first(where, backend):
    """Rank 1 raises while rank 0 waits for it in a collective (a group split in fully_shard,
    an all-gather in forward, a reduction in backward): rank 0's collective fails at once (rank
    1 aborted its communicators) instead of at the collective timeout, and the error names
    rank 1's exception as the first failure, with every rank's outcome. HCCL has no abort: on
    npu rank 0 fails at HCCL's timeout (2 s here), and the report is the same."""

    def rank_fn(rank):
        if rank == 1 and where == "before fully_shard":
            raise Failing("boom")
        model = ht.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
        if rank == 1 and where == "before forward":
            raise Failing("boom")
        loss = model(torch.ones(2, 4)).sum()
        if rank == 1:
            raise Failing("boom")
        loss.backward()
        model(torch.ones(2, 4))  # rank 0 never gets here
        return rank

    if backend == "cpu":
        p = hprt.cpu_platform(devices=2, collective_timeout_s=30)
    else:
        p = hprt.open_platform(backend)  # the collective timeout: 120 s
    t0 = time.monotonic()
    with pytest.raises(fsdp.RanksFailed) as e:  # hprt.fsdp's (hprt.torch re-exports a fixed list)
        with _short_hccl_timeout(2000) if backend == "npu" else contextlib.nullcontext():
            ht.run_on_ranks(2, rank_fn, platform=p)
    assert time.monotonic() - t0 < 10, "rank 0 waited for the collective timeout"
    err = e.value
    assert isinstance(err, RuntimeError) and isinstance(err.__cause__, Failing)
    assert err.failed_rank == 1 and isinstance(err.outcomes[1], Failing)
    assert isinstance(err.outcomes[0], hprt.HprtError)
    lines = str(err).splitlines()
    assert lines[0] == "rank 1 of 2 failed: boom"
    assert lines[2] == "  rank 1: Failing: boom  (first failure)"
    assert lines[3].startswith("  rank 0: ") and lines[3].endswith("(after rank 1 failed)")


def test_a_0d_parameter_is_refused_as_fsdp2_refuses_it():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.lin(x) * self.scale

    def rank_fn(rank):
        with pytest.raises(ValueError, match=r"Shard dim 0 is invalid for 0D tensor: torch.Size\(\[\]\) "
                                             r"\(parameter 'scale'\)"):
            ht.fully_shard(Scaled())
        m = Scaled()
        ht.fully_shard(m, ignored_params={m.scale})  # what the message suggests
        return m(torch.ones(1, 4)).shape

    assert ht.run_on_ranks(2, rank_fn) == [torch.Size([1, 4])] * 2


def test_rendezvous_over_a_torch_process_group(tmp_path):
    """Two processes over gloo: rank 0's unique id reaches both; the cpu backend refuses at
    once (its ranks are threads of one process) instead of timing out."""
    import torch.multiprocessing as mp

    from rendezvous_worker import run

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, 2, str(tmp_path / "store"), results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    uids = set()
    for rank, ret, cpu_error, calls in got:
        assert ret == rank
        assert cpu_error is not None and "threads of one process" in cpu_error
        assert calls[0] == ("set_device", rank)
        _, uid, r, world = calls[1]
        assert (r, world) == (rank, 2)
        uids.add(uid)
    assert len(uids) == 1 and next(iter(uids)).startswith(b"id-of-rank-0-")


EMULATED_CASES = ["gpt2-fsdp2", "llama-hsdp2x2", "gpt2-fsdp2-offload", "gpt2-fsdp2-zero-in-place",
                  "gpt2-hsdp2x2-not-last-backward", "gpt2-fsdp3-shard-last-dim",
                  "llama-hsdp2x2-no-all-reduce"]


@pytest.mark.parametrize("name", EMULATED_CASES)
@pytest.mark.parametrize("backend", EMULATED)
def test_fully_shard_on_an_emulated_accelerator_is_bit_exact(backend, name):
    """The emulators' device memory is not torch's: the staging path copies gathered
    parameters D2H and gradients H2D (pinned host memory on torch's side), and the result is
    the same bits as the single-rank reference (also under HP_EMU_DELAY_SEED)."""
    case = CASES[name]
    template = MODELS[case.model]()
    p = hprt.open_platform(backend)

    def rank_fn(rank, *args):
        assert ht.init_device_mesh().memory.name == "staging"
        return train_rank(rank, *args)

    out = ht.run_on_ranks(case.world, rank_fn, template, case, platform=p)
    check(case, out, template)


def test_requires_all_reduce_off_refuses_what_it_cannot_do():
    def rank_fn(rank):
        mesh = ht.init_device_mesh("cpu", (2, 2))
        model = ht.fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        x = torch.ones(2, 4)
        model(x).sum().backward()  # reduced across the replicas: .grad set
        model.set_requires_all_reduce(False)
        with pytest.raises(hprt.UnsupportedError, match="holds reduced gradients"):
            model(x)  # refused at the forward, before anything started
        model.zero_grad()
        model(x).sum().backward()  # now it starts a partial sum
        assert model.weight.grad is None
        offloaded = ht.fully_shard(torch.nn.Linear(4, 4), mesh=mesh, offload_policy=ht.CPUOffloadPolicy())
        with pytest.raises(hprt.UnsupportedError, match="CPUOffloadPolicy"):
            offloaded.set_requires_all_reduce(False)
        return True

    assert ht.run_on_ranks(4, rank_fn) == [True] * 4


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.scale = torch.nn.Parameter(torch.ones(4))  # the root's own parameter

    def forward(self, x):
        return self.layers[1](self.layers[0](x)) * self.scale


def test_reshard_after_forward_default_keeps_only_the_root_gathered():
    def states(model):
        return model._hprt_fsdp.params[0].sp.state, model.layers[0]._hprt_fsdp.params[0].sp.state

    def rank_fn(rank):
        model = TwoLayers()
        for layer in model.layers:
            ht.fully_shard(layer)
        ht.fully_shard(model)
        x = torch.ones(2, 4)
        out = model(x)
        default = states(model)  # None: the blocks reshard, the root stays gathered
        out.sum().backward()
        model.set_reshard_after_forward(True, recurse=False)
        out = model(x)
        root_too = states(model)
        out.sum().backward()
        with pytest.raises(hprt.UnsupportedError, match="smaller world"):
            ht.fully_shard(torch.nn.Linear(4, 4), reshard_after_forward=2)
        with pytest.raises(ValueError, match="should be a bool"):
            model.set_reshard_after_forward(None)
        return default, root_too, model.scale.grad is not None

    out = ht.run_on_ranks(2, rank_fn)
    assert out == [(("unsharded", "sharded"), ("sharded", "sharded"), True)] * 2


def test_shard_placement_fn_takes_shard_or_none():
    from torch.distributed.tensor import Replicate

    def rank_fn(rank):
        with pytest.raises(ValueError, match="Shard\\(dim\\) or None"):
            ht.fully_shard(torch.nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate())
        with pytest.raises(ValueError, match="Shard\\(2\\) of 'weight', a 2-D parameter"):
            ht.fully_shard(torch.nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2))
        lin = ht.fully_shard(torch.nn.Linear(5, 3), shard_placement_fn=lambda p: Shard(p.ndim - 1))
        return lin.weight.shape, lin.bias.shape

    # Linear(5, 3): weight [3, 5] on dim 1 -> [3, 3] (5 columns padded to 6); bias [3] -> [2].
    assert ht.run_on_ranks(2, rank_fn) == [(torch.Size([3, 3]), torch.Size([2]))] * 2


DEVICE_PATH_CASES = ["gpt2-fsdp2", "llama-hsdp2x2-shard-dim1-bf16", "gpt2-fsdp2-offload",
                     "gpt2-fsdp2-zero-in-place", "gpt2-hsdp2x2-not-last-backward"]


@pytest.mark.parametrize("name", DEVICE_PATH_CASES)
def test_torch_allocated_memory_path_is_bit_exact(name):
    """The hardware path (torch allocates the gathered parameters and sharded gradients, hprt
    borrows torch's gradients and copies between the two) on the cpu backend, where torch's
    host tensors are device memory: what hardware adds is only torch's stream as hprt's
    compute stream (untested here)."""
    case = CASES[name]
    template = MODELS[case.model]()

    def rank_fn(rank, *args):
        ctx = fsdp._context()
        ctx._memory = fsdp._HostDeviceMemory(ctx.platform)
        assert ht.init_device_mesh(None, case.mesh).memory is ctx._memory
        return train_rank(rank, *args)

    out = ht.run_on_ranks(case.world, rank_fn, template, case)
    check(case, out, template)


def test_threads_keep_separate_contexts():
    seen = {}
    lock = threading.Lock()

    def rank_fn(rank):
        with lock:
            seen[rank] = (ht.get_rank(), ht.get_world_size())
        return rank

    assert ht.run_on_ranks(3, rank_fn) == [0, 1, 2]
    assert seen == {0: (0, 3), 1: (1, 3), 2: (2, 3)}


def test_ignored_params_output_dtype_and_forward_cast():
    template = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))

    def rank_fn(rank):
        model = copy.deepcopy(template)
        mp = ht.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        ht.fully_shard(model[0], mp_policy=mp)
        ht.fully_shard(model, ignored_params={model[1].bias})
        assert model[1].bias.shape == template[1].bias.shape  # ignored: not sharded
        assert not hasattr(model[1].bias, "_hprt_fsdp_param")
        seen = {}
        model[0].register_forward_hook(lambda m, a, o: seen.update(w=m.weight.dtype))
        # An f32 input meets bf16 weights: it runs only because the input was cast.
        out = model[0](torch.ones(2, 6))
        assert seen == {"w": torch.bfloat16}
        assert out.dtype == torch.float32  # output_dtype
        model(torch.ones(2, 6)).sum().backward()
        return model[0].weight.grad.dtype, model[1].bias.grad is not None

    assert ht.run_on_ranks(2, rank_fn) == [(torch.float32, True)] * 2
