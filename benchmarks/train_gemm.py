"""The trainer's fp32 products with frozen weights, torch's (MKL) against oneDNN's: which `train.kernels`
this CPU wants.

For a model's shapes (default: SmolLM2-135M), the GFLOP/s of each side, alternating, median of `--runs`
after a warm-up, at `--rows` positions per product:
  layers, forward  `x W^T` over one decoder layer's weights (q, k, v, o, gate, up, down); the trainer keeps
                   torch's here (values equal to the forward without grad, bit for bit), shown for reference
  layers, backward `dy W`, the input gradient through the same weights (`rolerl.gemm.matmul`)
  head logits      `h E^T` over the vocabulary, one chunk of positions (`rolerl.algorithms.logprobs`)
  head E_p[W]      `p E`, the head rows averaged under the softmax, the same chunk

    python benchmarks/train_gemm.py [--model default] [--rows 256 600 1300] [--runs 15]
Figures and the CPU they ran on: docs/BENCHMARKS.md ("fp32 training GEMMs through oneDNN").
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from decode_step import median_ms  # (benchmarks/ is the script's path)
from torch.nn import functional as F

from rolerl import gemm
from rolerl.hardware import describe


def layer_shapes(config) -> list[tuple[int, int]]:
    """`(out, in)` of one decoder layer's linear weights, Llama-style."""
    d, ff = config.hidden_size, config.intermediate_size
    head = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    return [(q, d), (kv, d), (kv, d), (d, q), (ff, d), (ff, d), (d, ff)]


def layer_cases(config, rows: int):
    """`name -> (flops, {side: fn})` for one decoder layer's weights at `rows` positions."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) / i**0.5 for o, i in layer_shapes(config)]
    xs = [torch.randn(rows, w.shape[1], generator=g) for w in ws]
    dys = [torch.randn(rows, w.shape[0], generator=g) for w in ws]
    fwd, bwd = list(zip(xs, ws, strict=True)), list(zip(dys, ws, strict=True))
    flops = sum(2 * rows * w.numel() for w in ws)
    dnn = torch.ops.mkldnn._linear_pointwise
    return {
        "layers, forward": (flops, {
            "torch": lambda: [F.linear(x, w) for x, w in fwd],
            "onednn": lambda: [dnn(x, w, None, "none", [], "") for x, w in fwd],
        }),
        "layers, backward": (flops, {
            "torch": lambda: [dy @ w for dy, w in bwd],
            "onednn": lambda: [gemm.matmul(dy, w) for dy, w in bwd],
        }),
    }  # fmt: skip


def head_cases(config, chunk: int):
    """The LM head's two products over one chunk of `chunk` positions."""
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.02
    h = torch.randn(chunk, config.hidden_size, generator=g)
    p = torch.rand(chunk, config.vocab_size, generator=g)
    flops = 2 * chunk * emb.numel()
    return {
        "head logits": (flops, {"torch": lambda: h @ emb.T, "onednn": lambda: gemm.linear(h, emb)}),
        "head E_p[W]": (flops, {"torch": lambda: p @ emb, "onednn": lambda: gemm.matmul(p, emb)}),
    }


def measure(flops: int, sides: dict, runs: int) -> dict[str, float]:
    """GFLOP/s per side: the mean of two rounds (sides alternating, so drift hits both), each a median."""
    times = {side: [] for side in sides}
    for order in (list(sides), list(sides)[::-1]):
        for side in order:
            times[side].append(median_ms(sides[side], runs) / 1e3)
    rate = {side: flops / statistics.mean(t) / 1e9 for side, t in times.items()}
    return rate | {"speedup": rate["onednn"] / rate["torch"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', an HF id or a local dir (its shapes)")
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 600, 1300], help="positions per product")
    ap.add_argument("--chunk", type=int, default=170, help="positions per head chunk (the CPU default)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    if not gemm.onednn_built():
        ap.error("this torch has no oneDNN: the trainer runs torch's products")
    if args.threads:
        torch.set_num_threads(args.threads)
    from rolerl import load_model

    model, _ = load_model(args.model, dtype="float32")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    del model
    gemm.set_backend("onednn")
    out = {"machine": describe(), "model": args.model, "threads": torch.get_num_threads(), "cases": []}
    if not args.json:
        print(out["machine"])
        print(
            f"{'rows':>5} {'product':<17} {'torch GFLOP/s':>14} {'oneDNN GFLOP/s':>15} {'oneDNN speed-up':>16}"
        )
    todo = [(rows, layer_cases(config, rows)) for rows in args.rows] + [
        (args.chunk, head_cases(config, args.chunk))
    ]
    for rows, named in todo:
        for name, (flops, sides) in named.items():
            rate = measure(flops, sides, args.runs)
            out["cases"].append({"rows": rows, "product": name} | rate)
            if not args.json:
                print(
                    f"{rows:>5} {name:<17} {rate['torch']:>14.0f} {rate['onednn']:>15.0f} {rate['speedup']:>15.2f}x"
                )
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
