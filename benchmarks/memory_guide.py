"""Computed GPU memory guidance for Qwen3 0.6B / 1.7B / 4B / 8B with LoRA (docs/DISTRIBUTED.md).

Nothing here is measured: the parameter counts are exact (each model is built from its published config on
PyTorch's meta device, with rolerl's adapters added), the rest is arithmetic, stated next to each column:

  weights     base parameters x 2 bytes (bf16)
  lora        adapter parameters (rank --rank on every linear layer of every block) x 16 bytes: fp32
              weight, gradient and AdamW's two moments
  kv/token    2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16): the engine's cache per token
  rollout kv  kv/token x --rows x (--prompt + --new) tokens (the engine preallocates this)
  act/token   34 x hidden x layers bytes: activations kept for backward per token in bf16 (Korthikanti et
              al. 2022, without recomputation, with fused SDPA attention so no s^2 term)
  micro-batch act/token x --micro-batch rows x (--prompt + --new) tokens

    python benchmarks/memory_guide.py                       # the table in docs/DISTRIBUTED.md
    python benchmarks/memory_guide.py --rows 128 --new 2048
"""

from __future__ import annotations

import argparse

import torch

GIB = 2**30
QWEN3 = {  # the published configs (hidden, intermediate, layers, heads, kv heads, head dim, tied embeddings)
    "Qwen3-0.6B": (1024, 3072, 28, 16, 8, 128, True),
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, 128, True),
    "Qwen3-4B": (2560, 9728, 36, 32, 8, 128, True),
    "Qwen3-8B": (4096, 12288, 36, 32, 8, 128, False),
}


def counts(name: str, rank: int) -> tuple[int, int]:
    """(base parameters, adapter parameters) of `name` with one rank-`rank` adapter on every linear."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    import rolerl

    hidden, inter, layers, heads, kv, head_dim, tied = QWEN3[name]
    config = Qwen3Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                         vocab_size=151936, tie_word_embeddings=tied)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = sum(p.numel() for p in model.parameters())
    rolerl.add_adapters(model, ["policy"], rank=rank)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return base, lora


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=64, help="rollout rows decoded at once")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=1024, help="new tokens per row")
    ap.add_argument("--micro-batch", type=int, default=4, help="train.micro_batch_size")
    args = ap.parse_args()
    seq = args.prompt + args.new
    print(
        f"rank {args.rank}; rollout {args.rows} rows x {seq} tokens; micro-batch {args.micro_batch} x {seq}"
    )
    print(
        "| model | base params | weights (bf16) | LoRA params | LoRA + grad + AdamW | KV / token "
        "| rollout KV | act / token | micro-batch act |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (hidden, _, layers, _, kv, head_dim, _) in QWEN3.items():
        base, lora = counts(name, args.rank)
        kv_token = 2 * layers * kv * head_dim * 2
        act_token = 34 * hidden * layers
        print(
            f"| {name} | {base / 1e9:.2f} B | {base * 2 / GIB:.1f} GiB | {lora / 1e6:.1f} M "
            f"| {lora * 16 / GIB:.2f} GiB | {kv_token / 2**10:.0f} KiB | {kv_token * args.rows * seq / GIB:.1f} GiB "
            f"| {act_token / 2**20:.2f} MiB | {act_token * args.micro_batch * seq / GIB:.1f} GiB |"
        )


if __name__ == "__main__":
    main()
