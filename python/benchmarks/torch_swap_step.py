"""hprt.torch's modes against plain torch and torch's own ``save_on_cpu``, measured in one run:

- the training step of a 16-layer transformer (the hyper_parallel swap test's shape) per mode,
  as a ratio to the plain-torch step;
- the hook cost per saved tensor: a chain of small element-wise ops (one saved tensor each),
  forward and backward, minus the plain-torch time, divided by the number of saved tensors.

    python python/benchmarks/torch_swap_step.py [--layers 16] [--dim 256] [--seq 128] [--steps 2]
        [--rounds 3] [--threads N] [--modes swap,keyed] [--no-hook-cost] [--device cuda]
        [--dtype bf16] [--paired N]

``--paired N`` measures layer-group swap (``mode="swap"``) and the no-swap ``keep`` mode against
plain torch in ``N`` rounds of single steps, one of each per round (plain torch, torch's
``save_on_cpu``, keep, swap), the modes attached to one runtime for the run and detached between
their steps. On a machine whose step time wanders by several per cent from one step to the next
(a shared VM), adjacent steps see the same conditions, and the median of the per-round ratios
converges where grouped rounds' ratios do not. A step's place in its round also moves its time
(measured: the same hooks-only mode 1.015x in second place, 1.06x in fourth), so the order
rotates from round to round. ``save_on_cpu``, which on CPU tensors only runs torch's hooks, is
the control; ``keep`` runs hprt's hooks and accounting without copying.

On the cpu backend "device" memory is host memory and the copies are host memcpys on hprt's
stream threads: the numbers describe hprt.torch's overhead, not accelerator performance.
``--device cuda`` (with ``HP_PLATFORM=cuda``) measures CUDA tensors on the cuda backend: steps
timed between device synchronizations, torch's ``save_on_cpu(pin_memory=True)`` as the baseline
offload, and each mode's ``torch.cuda.max_memory_allocated`` during its steps."""

import argparse
import random
import statistics
import time

import torch
from torch import nn

import hprt
import hprt.torch as ht


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.layers = nn.ModuleList(Block(args.dim, 4) for _ in range(args.layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


MODES = {
    "keep": dict(mode="keep"),
    "swap": dict(mode="swap"),
    "keyed": dict(mode="keyed"),
    "pipeline": dict(mode="pipeline"),
    "swap, host-stage compress-then-swap": dict(mode="swap", compression="host_stage"),
    "swap, device compress-then-swap": dict(mode="swap", compression="device"),
    "compress": dict(mode="compress"),
    "managed_compress": dict(mode="managed_compress"),
}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()  # torch's streams and hprt's: one context


def timed(fn, steps, device="cpu"):
    fn()  # warm-up: pools, first allocations
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def platform_for(args, device_memory):
    return hprt.cpu_platform(device_memory=device_memory) if args.device == "cpu" else hprt.get_platform()


def interleaved(model, run, args, platform, min_bytes):
    """Per mode: the median step over ``args.rounds`` rounds that visit every mode in turn, the
    median over rounds of its ratio to plain torch's median step in the same round (a load
    change on the machine between rounds cancels out), and the last round's statistics."""
    times, ratios, stats, peaks = {}, {}, {}, {}
    cuda = args.device == "cuda"

    def on_cpu():
        with torch.autograd.graph.save_on_cpu(pin_memory=cuda):
            run()

    def measure(name, fn):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = timed(fn, args.steps, args.device)
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated()
        times.setdefault(name, []).extend(t)
        return statistics.median(t)

    for _ in range(args.rounds):
        plain = measure("plain torch", run)
        ratios.setdefault("plain torch", []).append(1.0)
        ratios.setdefault("torch save_on_cpu", []).append(measure("torch save_on_cpu", on_cpu) / plain)
        for name, kw in MODES.items():
            if args.modes and kw["mode"] not in args.modes:
                continue
            if cuda and kw["mode"] in ("compress", "managed_compress"):
                continue  # host compression of CPU tensors: refused on an accelerator
            with ht.attach(model, platform=platform, min_bytes=min_bytes, **kw) as h:
                ratios.setdefault(name, []).append(measure(name, run) / plain)
                stats[name] = h.stats()
    return [(name, statistics.median(t), statistics.median(ratios[name]), stats.get(name),
             peaks.get(name)) for name, t in times.items()]


def step_times(args):
    torch.manual_seed(0)
    model = Transformer(args).to(args.device, DTYPES[args.dtype])
    x = torch.randn(args.batch, args.seq, args.dim, device=args.device, dtype=DTYPES[args.dtype])

    def step():
        for p in model.parameters():
            p.grad = None
        model(x).backward()

    return interleaved(model, step, args, platform_for(args, 4 << 30), args.min_bytes)


def paired(args):
    """Per round, one step each of plain torch, ``save_on_cpu``, keep and layer-group swap, in
    an order rotated every round (see the module docs); returns each mode's median step and
    its per-round ratios to the plain step of the round."""
    torch.manual_seed(0)
    model = Transformer(args).to(args.device, DTYPES[args.dtype])
    x = torch.randn(args.batch, args.seq, args.dim, device=args.device, dtype=DTYPES[args.dtype])
    rt = ht.Runtime(platform_for(args, 4 << 30))

    def step():
        for p in model.parameters():
            p.grad = None
        model(x).backward()

    def on_cpu():
        with torch.autograd.graph.save_on_cpu(pin_memory=args.device == "cuda"):
            step()

    def attached(mode):
        def run():
            with ht.attach(model, mode=mode, runtime_=rt, min_bytes=args.min_bytes):
                step()
        return run

    fns = {"plain torch": step, "torch save_on_cpu": on_cpu, "keep": attached("keep"),
           "swap": attached("swap")}
    names = list(fns)
    for fn in fns.values():  # warm-up: pools, first allocations
        fn()
        fn()
    times = {name: [] for name in fns}
    for r in range(args.paired):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync(args.device)
            t0 = time.perf_counter()
            fns[name]()
            sync(args.device)
            times[name].append(time.perf_counter() - t0)
    plain_t = times["plain torch"]
    return {name: (statistics.median(t), [a / b for a, b in zip(t, plain_t)])
            for name, t in times.items()}


def median_interval(ratios, level=0.95, resamples=2000, seed=0):
    """A bootstrap interval of the median of ``ratios`` (percentile method): where the median
    of another run of as many rounds would fall, ``level`` of the time."""
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def print_paired(args):
    rows = paired(args)
    print(f"\nPaired single steps, {args.paired} rounds (plain torch, save_on_cpu, keep, swap; "
          "order rotated per round):")
    print("| mode | step (ms, median) | median of per-round ratios | 95 % interval of that median "
          "(bootstrap) | interquartile range of the ratios | mean ratio |")
    print("|---|---|---|---|---|---|")
    for name, (t, ratios) in rows.items():
        q = statistics.quantiles(ratios, n=4)
        lo, hi = median_interval(ratios)
        print(f"| {name} | {t * 1e3:.1f} | {statistics.median(ratios):.3f} | {lo:.3f} - {hi:.3f} | "
              f"{q[0]:.3f} - {q[2]:.3f} | {statistics.fmean(ratios):.3f} |")


def hook_cost(args):
    """Per saved tensor: ``n`` sigmoids in a row (each saves its output) on ``numel`` floats."""
    n, numel = args.hook_tensors, args.hook_numel
    x = torch.randn(numel, requires_grad=True, device=args.device)

    class Layer(nn.Module):
        def forward(self, y):
            for _ in range(n):
                y = torch.sigmoid(y)
            return y

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(), Layer()])

    def run():
        y = x
        for layer in model.layers:
            y = layer(y)
        y.sum().backward()
        x.grad = None

    saved = 2 * n
    rows = interleaved(model, run, args, platform_for(args, 1 << 30), 0)
    base = rows[0][1]
    return base, saved, [(name, (t - base) / saved * 1e6) for name, t, *_ in rows[1:]]


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-bytes", type=int, default=64 << 10)
    ap.add_argument("--hook-tensors", type=int, default=500)
    ap.add_argument("--hook-numel", type=int, default=256)
    ap.add_argument("--modes", type=lambda v: v.split(","), default=None,
                    help="comma-separated hprt modes to measure (default: all)")
    ap.add_argument("--no-hook-cost", action="store_true", help="skip the per-tensor loop")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). On a 2-core VM, torch's "
                         "spinning workers and hprt's copy threads take the same cores")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: CUDA tensors on the cuda backend (HP_PLATFORM=cuda)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="f32")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="only layer-group swap and keep against plain torch, in N rounds of "
                         "single steps taken in turn (see the module docs)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.layers}-layer transformer, dim {args.dim}, batch {args.batch} x {args.seq} tokens, "
          f"{args.dtype} on {where}; hprt modes with min_bytes={args.min_bytes}; "
          f"torch threads: {torch.get_num_threads()}")
    if args.paired:
        print_paired(args)
        return
    rows = step_times(args)
    print("| mode | step (ms, median) | vs plain torch (median of rounds) | offloaded MiB per step "
          "| compressed tensors per step | torch peak allocated (MiB) |")
    print("|---|---|---|---|---|---|")
    per_attach = args.steps + 1  # warm-up included
    for name, t, ratio, st, peak in rows:
        off = "-" if st is None else f"{st['offloaded_bytes'] / (1 << 20) / per_attach:.1f}"
        comp = "-" if st is None else st["compressed_tensors"] // per_attach
        peak = "-" if peak is None else f"{peak / (1 << 20):.0f}"
        print(f"| {name} | {t * 1e3:.1f} | {ratio:.3f} | {off} | {comp} | {peak} |")
    if args.no_hook_cost:
        return
    base, saved, hooks = hook_cost(args)
    print(f"\nHook cost per saved tensor ({saved} saved tensors of {args.hook_numel} f32 per "
          f"forward + backward; plain torch {base * 1e3:.2f} ms):")
    print("| mode | µs per saved tensor over plain torch |")
    print("|---|---|")
    for name, us in hooks:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
