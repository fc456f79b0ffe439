"""Routed LoRA vs PEFT: forward + backward + AdamW step on the default model.

Sides (each in its own subprocess, same environment, so peak RSS is per side):
  peft          PEFT single LoRA r=16 on all linear layers (what TRL and most users train with)
  single        rolerl one adapter r=16 on every token
  two_random    rolerl two adapters r=8, each token routed at random (worst case for the mask)
  two_contig    rolerl two adapters r=8, contiguous spans (a DART episode: reason / tool / reason)
  two_gather    as two_random with the gather/index_add implementation (to justify the default)

    python benchmarks/routed_lora.py --json            # batch 8 x 384, fp32 and bf16, 2 rounds x 3 steps
    python benchmarks/routed_lora.py --batch 2 --seq 64 --steps 2 --dtypes float32   # a quick look

The last line with --json is one JSON object with the medians, ratios and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from rolerl.hardware import describe, fast_dtypes

SIDES = ["peft", "single", "two_random", "two_contig", "two_gather"]


def child(side: str, dtype: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    import torch

    import rolerl
    from rolerl.models.lora import RoutedLoRALinear

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    torch.manual_seed(0)
    model, _ = rolerl.load_model("default", dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    forward_kwargs = {}
    if side == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
        )
    elif side == "single":
        rolerl.add_adapters(model, ["policy"], rank=16, alpha=32)
        forward_kwargs["routes"] = torch.zeros_like(ids)
    else:
        rolerl.add_adapters(model, ["reason", "tool"], rank=8, alpha=16)
        if side == "two_contig":
            route = torch.zeros_like(ids)
            route[:, seq // 3 : seq // 2] = 1  # one tool span in the middle of each row
        else:
            route = torch.randint(0, 2, ids.shape)
        forward_kwargs["routes"] = route
        RoutedLoRALinear.impl = "gather" if side == "two_gather" else "masked"
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    times, phases = [], []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(ids, labels=ids, **forward_kwargs).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if step >= warmup:
            times.append(t3 - t0)
            phases.append((t1 - t0, t2 - t1, t3 - t2))
    return {
        "side": side,
        "dtype": dtype,
        "step_s": statistics.median(times),
        "steps_s": [round(t, 3) for t in times],
        "fwd_bwd_opt_s": [round(statistics.median(p[i] for p in phases), 3) for i in range(3)],
        "tokens_per_s": batch * seq / statistics.median(times),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainable_params": sum(p.numel() for p in params),
        "loss": float(loss),
    }


def run_side(side: str, dtype: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--dtypes", dtype, "--batch", str(args.batch)]
    cmd += ["--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"side {side} ({dtype}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=fast_dtypes(),
        choices=["float32", "bfloat16"],
        help="default: float32, plus bfloat16 where the CPU has native bf16 (rolerl.hardware)",
    )
    parser.add_argument("--sides", nargs="+", default=SIDES, choices=SIDES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all sides, alternating")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dtypes[0], args.batch, args.seq, args.steps, args.warmup)))
        return

    summary: dict = {
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": int(os.environ.get("BENCH_THREADS", "2")),
        "machine": describe(),  # every figure says which CPU it came from
    }
    for dtype in args.dtypes:
        # Sides alternate in rounds, so load from anything else on the machine spreads over all of them.
        runs: dict[str, list[dict]] = {side: [] for side in args.sides}
        for round_ in range(args.rounds):
            for side in args.sides:
                r = run_side(side, dtype, args)
                runs[side].append(r)
                print(
                    f"[{dtype} round {round_}] {side:11s} {r['step_s']:7.2f} s/step  "
                    f"peak RSS {r['peak_rss_mb']:7.0f} MB  steps {r['steps_s']}  fwd/bwd/opt {r['fwd_bwd_opt_s']}",
                    flush=True,
                )
        res = {
            side: {
                "step_s": statistics.median(t for r in rs for t in r["steps_s"]),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            }
            for side, rs in runs.items()
        }
        d = {f"{side}_step_s": round(r["step_s"], 3) for side, r in res.items()}
        d |= {f"{side}_peak_rss_mb": round(r["peak_rss_mb"]) for side, r in res.items()}
        if {"peft", "single"} <= res.keys():
            d["rolerl_single_vs_peft"] = round(res["single"]["step_s"] / res["peft"]["step_s"], 3)
        if {"two_random", "single"} <= res.keys():
            d["rolerl_two_vs_single"] = round(res["two_random"]["step_s"] / res["single"]["step_s"], 3)
        if {"two_random", "peft"} <= res.keys():
            d["rolerl_two_vs_peft"] = round(res["two_random"]["step_s"] / res["peft"]["step_s"], 3)
            d["mem_two_vs_peft"] = round(res["two_random"]["peak_rss_mb"] / res["peft"]["peak_rss_mb"], 3)
        if {"two_contig", "single"} <= res.keys():
            d["rolerl_two_contig_vs_single"] = round(res["two_contig"]["step_s"] / res["single"]["step_s"], 3)
        if {"two_gather", "two_random"} <= res.keys():
            d["gather_vs_masked"] = round(res["two_gather"]["step_s"] / res["two_random"]["step_s"], 3)
        summary[dtype] = d
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
