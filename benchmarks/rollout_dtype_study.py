"""bf16 rollouts with an fp32 trainer vs fp32 rollouts (issue 19) on `rolerl demo`: the same run (imitation
warm start, 10 GRPO steps x 6 problems x 8 samples with the sandbox, greedy held-out evaluation in fp32),
one adapter of rank 16, two arms:

- `fp32`: the engine samples from the trainer's own fp32 weights (`rollout.dtype: model`);
- `bf16`: the engine samples from a bf16 copy of the model, adapters synced after every step
  (`rollout.dtype: bfloat16`), the trainer recomputes the old log-probs and truncated IS corrects the rest
  (`algorithm.old_logp: recompute`, `algorithm.tis_cap: 2.0`).

    python benchmarks/rollout_dtype_study.py run --out runs/bf16 --seeds 0 1   # ~20 min per arm and seed
    python benchmarks/rollout_dtype_study.py summarize runs/bf16              # table + docs/rollout_dtype_study.png

Only meaningful where bf16 is native (AVX512-BF16 or AMX; a GPU): on an AVX2-only CPU a bf16 matmul is
emulated and ~45x slower. `summarize` reports accuracy before/after, the median step, rollout and update
time over the RL steps, and the rollout/trainer mismatch.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from _study import demo_runs, main, plot_curves, run_demo_arms

BASE = ["adapters.preset=shared", "adapters.rank=16"]
ARMS = {
    "fp32": BASE,
    "bf16": [*BASE, "rollout.dtype=bfloat16", "algorithm.old_logp=recompute", "algorithm.tis_cap=2.0"],
}


def run(out: Path, seeds: list[int]) -> None:
    run_demo_arms(out, seeds, ARMS)


def summarize(out: Path, plot: Path | None) -> str:
    rows, curves = [], {}
    for arm, seed, res, metrics in demo_runs(out, ARMS):
        ev = res["evals"]
        curves.setdefault(arm, []).append([m["accuracy"] for m in metrics])

        def median(key: str, metrics=metrics) -> float:
            return statistics.median(m[key] for m in metrics)

        def mean(key: str, metrics=metrics) -> float:
            values = [m[key] for m in metrics if key in m]
            return statistics.mean(values) if values else float("nan")

        rows.append({
            "arm": arm, "seed": seed, "warm": ev["warm/rl"]["accuracy"], "after": ev["rl/rl"]["accuracy"],
            "gain": res["gain"]["points"], "se": res["gain"]["stderr_points"],
            "step": median("time/step"), "rollout": median("time/rollout"), "update": median("time/update"),
            "mismatch": mean("logp_mismatch/mean_abs"), "max": mean("logp_mismatch/max_abs"),
            "tis_w": mean("logp_mismatch/tis_weight_mean"), "tis_cut": mean("logp_mismatch/tis_truncated_frac"),
        })  # fmt: skip
    lines = [
        "| arm | seed | warm start | after RL | gain (SE) | median step / rollout / update (s) "
        "| mean abs logp mismatch (max) | TIS mean weight / share truncated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tis = "n/a" if r["tis_w"] != r["tis_w"] else f"{r['tis_w']:.3f} / {100 * r['tis_cut']:.2f}%"
        lines.append(
            f"| {r['arm']} | {r['seed']} | {100 * r['warm']:.1f}% | {100 * r['after']:.1f}% | "
            f"{r['gain']:+.1f} ({r['se']:.1f}) | {r['step']:.1f} / {r['rollout']:.1f} / {r['update']:.1f} | "
            f"{r['mismatch']:.4f} ({r['max']:.3f}) | {tis} |"
        )
    if plot is not None and curves:
        plot_curves(curves, plot, "demo: bf16 rollouts (fp32 trainer) vs fp32 rollouts", "rollout accuracy")
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__, run, summarize, out="runs/bf16", plot="docs/rollout_dtype_study.png")
