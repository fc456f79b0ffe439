"""Peak memory (and time) of one forward + backward of per-token log-probs: naive vs chunked.

Naive: `logits = hidden @ W.T` then `log_softmax(logits)[target]`, which is what computing log-probs from
a HF model's `(B, T, V)` logits costs. Chunked: `rolerl.algorithms.chunked_logprobs`. Each variant runs
in its own subprocess so one's allocations cannot hide the other's; the figure is the peak memory above
what the inputs already hold (hidden states, LM head, targets), during forward + backward w.r.t. both.

    .venv/bin/python benchmarks/chunked_logprobs.py            # SmolLM2-135M shapes: B=8 T=384 V=49152 d=576
    .venv/bin/python benchmarks/chunked_logprobs.py --json
    .venv/bin/python benchmarks/chunked_logprobs.py --device cuda

CPU peak is the process's resident high-water mark (VmHWM, reset via /proc/self/clear_refs after a
warm-up); CUDA peak is `torch.cuda.max_memory_allocated`. Timing is informative only (2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 2**20


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args: argparse.Namespace) -> dict:
    import torch

    from rolerl.algorithms import chunked_logprobs, logprobs_from_logits

    torch.manual_seed(0)
    dev = torch.device(args.device)
    hidden = torch.randn(args.batch, args.seq, args.dim, device=dev).requires_grad_()  # (B, T, d)
    weight = (0.02 * torch.randn(args.vocab, args.dim, device=dev)).requires_grad_()  # (V, d)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)  # (B, T)
    upstream = torch.randn(args.batch, args.seq, device=dev)  # (B, T) stands in for -advantages * mask

    def step() -> None:
        if args.variant == "naive":
            logp = logprobs_from_logits(hidden @ weight.T, targets)
        else:
            logp = chunked_logprobs(hidden, weight, targets, chunk_size=args.chunk_size).logp
        (logp * upstream).sum().backward()
        hidden.grad = weight.grad = None

    step()  # warm-up: allocator pools, kernels, lazy init
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_kb("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _rss_kb("VmHWM") * 1024
    return {
        "variant": args.variant,
        "chunk_size": args.chunk_size if args.variant == "chunked" else None,
        "peak_extra_mb": round((peak - base) / MB, 1),
        "fwd_bwd_s": round(statistics.median(times), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 512, 256])
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)  # worker mode
    p.add_argument("--chunk-size", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(worker(args)))
        return

    shape = ["--batch", args.batch, "--seq", args.seq, "--vocab", args.vocab, "--dim", args.dim]
    common = [sys.executable, __file__, *map(str, shape), "--device", args.device, "--reps", str(args.reps)]
    runs = [["--variant", "naive"]] + [
        ["--variant", "chunked", "--chunk-size", str(c)] for c in args.chunk_sizes
    ]
    results = []
    for extra in runs:
        out = subprocess.run(common + extra, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    naive = results[0]["peak_extra_mb"]
    for r in results:
        r["mem_ratio_vs_naive"] = round(r["peak_extra_mb"] / naive, 3)
    logits_mb = args.batch * args.seq * args.vocab * 4 / MB
    report = {
        "device": args.device,
        "shape": {"B": args.batch, "T": args.seq, "V": args.vocab, "d": args.dim},
        "fp32_logits_mb": round(logits_mb, 1),  # one (B, T, V) fp32 tensor, for scale
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"B={args.batch} T={args.seq} V={args.vocab} d={args.dim} on {args.device}; "
        f"one fp32 (B, T, V) tensor = {logits_mb:.0f} MB"
    )
    for r in results:
        name = "naive" if r["variant"] == "naive" else f"chunked({r['chunk_size']})"
        print(
            f"  {name:<15} peak extra {r['peak_extra_mb']:>8.1f} MB  ({r['mem_ratio_vs_naive']:.3f}x naive)"
            f"  fwd+bwd {r['fwd_bwd_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
