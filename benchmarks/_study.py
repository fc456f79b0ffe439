"""What the study scripts share: their command line (`run` / `summarize`), running `rolerl demo` per arm
and seed, and the accuracy-per-step plot."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


def run_demo_arms(out: Path, seeds: list[int], arms: dict[str, list[str]]) -> None:
    """`rolerl demo` for every seed and arm (`--set` overrides per arm) into `out/<arm>-s<seed>`, its log
    beside it; an arm whose `results.json` exists is skipped, so a study resumes after an interruption."""
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for arm, sets in arms.items():
            target = out / f"{arm}-s{seed}"
            if (target / "results.json").exists():
                continue
            cmd = [sys.executable, "-m", "rolerl.cli", "demo", "--seed", str(seed), "--run-dir", str(target),
                   "--set", "run.progress=false", *sets]  # fmt: skip
            print(" ".join(cmd), flush=True)
            with (out / f"{arm}-s{seed}.log").open("w") as log:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)


def demo_runs(out: Path, arms: Iterable[str]) -> Iterator[tuple[str, int, dict, list[dict]]]:
    """Every finished `run_demo_arms` run under `out`, arm by arm and seed by seed: `(arm, seed, the demo's
    results.json, its RL metrics.jsonl rows)`."""
    for arm in arms:
        for path in sorted(out.glob(f"{arm}-s*/results.json")):
            seed = int(path.parent.name.rsplit("-s", 1)[1])
            lines = (path.parent / "rl" / "metrics.jsonl").read_text().splitlines()
            yield arm, seed, json.loads(path.read_text()), [json.loads(x) for x in lines]


def plot_curves(curves: dict[str, list[list[float]]], path: Path, title: str, ylabel: str) -> None:
    """Per arm, the mean over seeds of a per-step curve (faint: each seed), one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, runs in curves.items():
        steps = list(range(1, min(len(r) for r in runs) + 1))
        mean = [statistics.mean(r[s - 1] for r in runs) for s in steps]
        ax.plot(steps, mean, marker="o", label=f"{arm} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        for r in runs if len(runs) > 1 else []:
            ax.plot(steps, r[: len(steps)], alpha=0.25, color=ax.lines[-1].get_color())
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(doc: str, run: Callable[[Path, list[int]], None], summarize: Callable[[Path, Path | None], str],
         out: str, plot: str) -> None:  # fmt: skip
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, default=Path(out))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    s = sub.add_parser("summarize")
    s.add_argument("out", type=Path)
    s.add_argument("--plot", type=Path, default=Path(plot))
    args = p.parse_args()
    if args.command == "run":
        run(args.out, args.seeds)
    else:
        print(summarize(args.out, args.plot))
