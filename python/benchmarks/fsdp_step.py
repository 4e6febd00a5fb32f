"""fully_shard step time against the same model unsharded on one rank, and how much of the
all-gathers and gradient reductions overlapped torch's compute (from hprt.fsdp.StreamTrace).

    python python/benchmarks/fsdp_step.py [--layers 4] [--width 256] [--steps 5]

The cpu backend's ranks are threads of this process sharing the machine's cores with torch:
the numbers describe hprt's scheduling, not accelerator performance."""

import argparse
import copy
import statistics
import time

import torch
import transformers

import hprt.torch as ht


def model(args):
    cfg = transformers.GPT2Config(
        vocab_size=512, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def ids(args, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 512, (args.batch, args.seq), generator=g)


def step_times(m, args, rank):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        x = ids(args, step, rank)
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def union(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap_len(xs, ys):
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def sharded_rank(rank, template, args):
    m = copy.deepcopy(template)
    mesh = ht.init_device_mesh("cpu")
    for block in m.transformer.h:
        ht.fully_shard(block, mesh=mesh)
    ht.fully_shard(m, mesh=mesh)
    times = step_times(m, args, rank)  # warm-up included, untraced
    peak = mesh.platform.memory_stats()["device_peak"]  # this rank's device (one per rank)
    mesh.trace = ht.StreamTrace(mesh.platform)
    t0 = time.perf_counter()
    traced = step_times(m, argparse.Namespace(**{**vars(args), "warmup": 0}), rank)
    wall = time.perf_counter() - t0
    spans = mesh.trace.spans()
    comm = union([(a, b) for k, a, b in spans if k in ("all-gather", "reduce")])
    waits = union([(a, b) for k, a, b in spans if k == "wait"])
    comm_s = sum(b - a for a, b in comm)
    exposed = overlap_len(comm, waits)
    return times, traced, wall, comm_s, exposed, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    torch.set_num_threads(1)
    template = model(args)
    params = sum(p.numel() for p in template.parameters())
    print(f"GPT-2 shaped: {args.layers} layers, width {args.width}, {params / 1e6:.2f} M parameters; "
          f"per-rank batch {args.batch} x {args.seq} tokens; torch threads per rank: 1")
    base = statistics.median(step_times(copy.deepcopy(template), args, 0))
    mib = 2**20
    full = 2 * sum(p.numel() * p.element_size() for p in template.parameters()) / mib
    print("| setup | step (ms, median) | vs unsharded | comm per step (ms) | exposed comm (ms) | overlapped "
          "| peak device MiB per rank |")
    print("|---|---|---|---|---|---|---|")
    print(f"| unsharded, 1 rank (plain torch) | {base * 1e3:.1f} | 1.00 | - | - | - | "
          f"{full:.1f} (parameters + gradients, torch's) |")
    for n in args.ranks:
        out = ht.run_on_ranks(n, sharded_rank, template, args)
        step = max(statistics.median(o[0]) for o in out)
        comm = statistics.mean(o[3] for o in out) / args.steps
        exposed = statistics.mean(o[4] for o in out) / args.steps
        frac = 1 - exposed / comm if comm else 0.0
        peak = max(o[5] for o in out) / mib
        print(f"| fully_shard, {n} rank threads | {step * 1e3:.1f} | {step / base:.2f} | "
              f"{comm * 1e3:.1f} | {exposed * 1e3:.1f} | {frac:.0%} | {peak:.1f} |")


if __name__ == "__main__":
    main()
