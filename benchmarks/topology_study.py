"""The topology study of issue 13: `rolerl demo` (imitation warm start, then GRPO with the Python sandbox on
the built-in word problems) under three topologies at the same total LoRA rank, the same seeds and budget:

- `shared`: one adapter (rank 16) for every token;
- `dart`: reasoning tokens to `reason`, tool-call tokens to `tool` (rank 8 each: 16 in all);
- `masked`: one adapter (rank 16), RL loss on reasoning tokens only (the warm start imitates every kind,
  so the tool format is learned; RL then trains only what the model reasons).

    python benchmarks/topology_study.py run --out runs/study --seeds 0 1     # ~15 min per arm and seed
    python benchmarks/topology_study.py summarize runs/study                # table + docs/topology_study.png

`run` skips arms whose `results.json` exists, so it resumes after an interruption. `summarize` prints a
markdown table (held-out accuracy before/after RL per arm and seed, the pooled gain, per-kind RL metrics)
and plots rollout accuracy per step (mean over seeds) per arm.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from _study import demo_runs, main, plot_curves, run_demo_arms

ARMS = {
    "shared": ["adapters.preset=shared", "adapters.rank=16"],
    "dart": ["adapters.preset=dart", "adapters.rank=8"],
    "masked": ["adapters.preset=masked", "adapters.rank=16", "adapters.train_kinds=[reasoning]"],
}


def run(out: Path, seeds: list[int]) -> None:
    run_demo_arms(out, seeds, ARMS)


def summarize(out: Path, plot: Path | None) -> str:
    rows, curves = [], {}
    for arm, seed, res, metrics in demo_runs(out, ARMS):
        ev = res["evals"]
        curves.setdefault(arm, []).append([m["accuracy"] for m in metrics])
        kinds = {k: statistics.mean(m.get(f"kind/{k}/loss_tokens", 0.0) for m in metrics)
                 for k in ("reasoning", "tool_call", "answer")}  # fmt: skip
        rows.append({
            "arm": arm, "seed": seed,
            "warm": ev["warm/rl"]["accuracy"], "after": ev["rl/rl"]["accuracy"],
            "format_after": ev["rl/format"]["accuracy"], "n": ev["rl/rl"]["n"],
            "gain": res["gain"]["points"], "se": res["gain"]["stderr_points"],
            "rl_min": res.get("rl_s", float("nan")) / 60, "kinds": kinds,
            "entropy_tool": _mean(metrics, "kind/tool_call/entropy"),
            "entropy_reason": _mean(metrics, "kind/reasoning/entropy"),
        })  # fmt: skip
    lines = [
        "| arm | seed | warm start: RL families | after RL: RL families | after RL: format families | gain (SE) "
        "| loss tokens per mini-batch: reasoning / tool call / answer | mean entropy: reasoning / tool call "
        "| RL wall time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = r["kinds"]
        lines.append(
            f"| {r['arm']} | {r['seed']} | {100 * r['warm']:.1f}% | {100 * r['after']:.1f}% | "
            f"{100 * r['format_after']:.1f}% | {r['gain']:+.1f} ({r['se']:.1f}) | "
            f"{k['reasoning']:.0f} / {k['tool_call']:.0f} / {k['answer']:.0f} | "
            f"{r['entropy_reason']} / {r['entropy_tool']} | {r['rl_min']:.1f} min |"
        )
    lines += ["", "| arm | seeds | mean after RL (RL families) | mean gain |", "|---|---|---|---|"]
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if mine:
            lines.append(f"| {arm} | {len(mine)} | {100 * statistics.mean(r['after'] for r in mine):.1f}% | "
                         f"{statistics.mean(r['gain'] for r in mine):+.1f} |")  # fmt: skip
    if plot is not None and curves:
        plot_curves(
            curves, plot, "demo: shared vs dart vs masked (reasoning only), total rank 16", "rollout accuracy"
        )
    return "\n".join(lines)


def _mean(metrics: list[dict], key: str) -> str:
    """The mean of `key` over the steps that logged it ("n/a" when none did: e.g. the entropy of a kind
    without loss, which the update does not compute)."""
    values = [m[key] for m in metrics if key in m]
    return f"{statistics.mean(values):.3f}" if values else "n/a"


if __name__ == "__main__":
    main(__doc__, run, summarize, out="runs/study", plot="docs/topology_study.png")
