"""Writes real bf16 activations of small transformers as raw files, for measuring the CPU codec
on tensors of 100 MB and more (issue 30 item 6; `compress/examples/codec_real.rs` reads them).

    python python/benchmarks/codec_activations.py OUT_DIR [--tokens 18432]

A GPT-2 (4 layers of GPT-2 small: hidden 768, MLP 3072, 12 heads) and a Llama (2 layers:
hidden 768, SwiGLU 3072, 12 heads), both built from a config with the library's own
initialisation (no pretrained weights are reachable from the build machines), run forward in
float32 on byte-level tokens of this repository's source text (batches of 1024-token
sequences); forward hooks keep, cast to bf16 as a bf16 model would hold them:

- ``gpt2_mlp_act_l0``, ``gpt2_mlp_act_l3``: the GELU output of a GPT-2 MLP (the activation
  saved for the backward of ``c_proj``), ``tokens x 3072``: 113 MB at 18,432 tokens;
- ``gpt2_attn_out``: the attention block outputs of layers 0-3, ``4 x tokens x 768``: 113 MB;
- ``gpt2_mlp_out``: the MLP block outputs of layers 0-3, ``4 x tokens x 768``: 113 MB;
- ``llama_mlp_act_l1``: the input of a Llama ``down_proj`` (``silu(gate) * up``), ``tokens x
  3072``: 113 MB.

Files are little-endian bf16 with no header, named ``NAME.bf16``. The weights come from a fixed
seed; the bytes can differ in the last bits between machines and thread counts (float32 matmul
summation order), which changes neither the distributions nor the codec's speed on them.
"""

import argparse
import os
import pathlib

import torch

SEQ = 1024
BATCH = 2


def tokens(count: int) -> torch.Tensor:
    """Byte-level token ids of the repository's Rust and Python sources, repeated as needed."""
    root = pathlib.Path(__file__).resolve().parents[2]
    text = bytearray()
    for pattern in ("compress/src/**/*.rs", "src/**/*.rs", "python/**/*.py"):
        for p in sorted(root.glob(pattern)):
            text += p.read_bytes()
            if len(text) >= count:
                break
        if len(text) >= count:
            break
    while len(text) < count:
        text += text
    return torch.tensor(list(text[:count]), dtype=torch.long).view(-1, SEQ)


def run(model, ids: torch.Tensor, hooks: dict) -> dict:
    kept = {name: [] for name in hooks}
    handles = []
    for name, (module, kind) in hooks.items():
        if kind == "pre":
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, args, name=name: kept[name].append(
                        args[0].detach().to(torch.bfloat16).reshape(-1)
                    )
                )
            )
        else:
            handles.append(
                module.register_forward_hook(
                    lambda m, args, out, name=name: kept[name].append(
                        (out[0] if isinstance(out, tuple) else out)
                        .detach()
                        .to(torch.bfloat16)
                        .reshape(-1)
                    )
                )
            )
    with torch.no_grad():
        for b in range(0, ids.shape[0], BATCH):
            model(input_ids=ids[b : b + BATCH])
    for h in handles:
        h.remove()
    return {name: torch.cat(parts) for name, parts in kept.items()}


def save(out: pathlib.Path, name: str, t: torch.Tensor) -> None:
    path = out / f"{name}.bf16"
    t.contiguous().view(torch.int16).numpy().tofile(path)
    print(f"{path}: {t.numel()} bf16 elements, {os.path.getsize(path)} bytes")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--tokens", type=int, default=18 * SEQ)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    ids = tokens(args.tokens // SEQ * SEQ)
    gpt2 = GPT2Model(
        GPT2Config(n_layer=4, n_embd=768, n_head=12, n_positions=SEQ, attn_pdrop=0.0,
                   resid_pdrop=0.0, embd_pdrop=0.0)
    ).eval()
    hooks = {f"mlp_act_l{i}": (gpt2.h[i].mlp.act, "post") for i in (0, 3)}
    hooks |= {f"attn_out_{i}": (gpt2.h[i].attn, "post") for i in range(4)}
    hooks |= {f"mlp_out_{i}": (gpt2.h[i].mlp, "post") for i in range(4)}
    kept = run(gpt2, ids, hooks)
    save(args.out, "gpt2_mlp_act_l0", kept["mlp_act_l0"])
    save(args.out, "gpt2_mlp_act_l3", kept["mlp_act_l3"])
    save(args.out, "gpt2_attn_out", torch.cat([kept[f"attn_out_{i}"] for i in range(4)]))
    save(args.out, "gpt2_mlp_out", torch.cat([kept[f"mlp_out_{i}"] for i in range(4)]))
    del gpt2, kept

    llama = LlamaModel(
        LlamaConfig(num_hidden_layers=2, hidden_size=768, intermediate_size=3072,
                    num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                    max_position_embeddings=SEQ)
    ).eval()
    kept = run(llama, ids, {"act": (llama.layers[1].mlp.down_proj, "pre")})
    save(args.out, "llama_mlp_act_l1", kept["act"])


if __name__ == "__main__":
    main()
