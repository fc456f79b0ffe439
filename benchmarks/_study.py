"""What the study scripts share: their command line (`run` / `summarize`), running `rolerl demo` per arm
and seed, running `rolerl` commands with their logs, the reasoner_tools imitation rows, a held-out
evaluation and a run's step metrics as small JSON-ready records, standard errors over seeds and over
problems, and the accuracy-per-step plot."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any


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


def rolerl(*args: str, log: Path) -> None:
    """`rolerl ARGS` in a subprocess (its memory freed when it ends), its output into `log`."""
    with log.open("w") as f:
        subprocess.run(
            [sys.executable, "-m", "rolerl.cli", *args], stdout=f, stderr=subprocess.STDOUT, check=True
        )


def reasoner_tools_demos(path: Path, n: int) -> Path:
    """`n` imitation rows per role of `reasoner_tools` on the demo's format problems (train split), written
    to `path`: the reasoner asks for the expression in words and answers from the result, the coder prints
    it (MSARL trains its agents by imitation first)."""
    from rolerl.roles import Tags, format_tool_output
    from rolerl.tasks.synthetic import format_task, write_jsonl
    from rolerl.workflows.reasoner_tools import CODER_SYSTEM, REASONER_SYSTEM

    rows = []
    for ex in format_task().examples("train", n, 0):
        expr, answer, question = ex.meta["expr"], int(ex.answer), ex.question
        rows.append({"role": "reasoner", "messages": [
            {"role": "system", "content": REASONER_SYSTEM}, {"role": "user", "content": question},
            {"role": "assistant", "content": f"<request>compute {expr}</request>"},
            {"role": "user", "content": f"Result: {answer}"},
            {"role": "assistant", "content": f"The answer is <answer>{answer}</answer>."}]})  # fmt: skip
        code = f"<code>\nprint({expr})\n</code>" + format_tool_output(Tags(), f"{answer}\n")
        rows.append({"role": "coder", "messages": [
            {"role": "system", "content": CODER_SYSTEM},
            {"role": "user", "content": f"Problem: {question}\n\nRequest: compute {expr}"},
            {"role": "assistant", "content": code}]})  # fmt: skip
    return write_jsonl(path, rows)


def held_out(target: Path) -> dict[str, Any]:
    """A `rolerl eval` directory as a record: accuracy (pass@1) and its standard error over problems, the
    workflow's role metrics (`workflow/...`, malformed cases included) and each problem's 0/1 by id."""
    metrics = json.loads((target / "results.json").read_text())["metrics"]
    rows = [json.loads(x) for x in (target / "samples.jsonl").read_text().splitlines() if x.strip()]
    return {
        "accuracy": metrics["pass@1"],
        "stderr": metrics["stderr"],
        "roles": {k: v for k, v in metrics.items() if k.startswith("workflow/")},
        "correct": {r["id"]: float(r["correct"]) for r in rows},
    }


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """A training run's per-step accuracy, reward, role metrics, optimizer steps per adapter and time."""
    keep = ("step", "accuracy", "reward/mean", "time/step")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [
        {k: v for k, v in m.items() if k in keep or k.startswith("workflow/") or
         (k.startswith("adapter/") and k.endswith("/steps"))}
        for m in rows if "accuracy" in m
    ]  # fmt: skip


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and its standard error (sample std / sqrt(n)); None with fewer than 2 values."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def problem_means(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per problem id, the mean over runs (seeds) of its 0/1, for the ids every run has."""
    ids = set.intersection(*(set(r) for r in runs))
    return {i: statistics.fmean(r[i] for r in runs) for i in sorted(ids)}


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


def main(doc: str, run: Callable[..., None], summarize: Callable[[Path, Path | None], str], out: str,
         plot: str | None, run_options: Callable[[argparse.ArgumentParser], None] | None = None,
         summarize_default: str | None = None, argv: list[str] | None = None) -> None:  # fmt: skip
    """`run --out DIR --seeds ...` calls `run(out, seeds, **the options run_options adds)`; `summarize
    [DIR] --plot PNG` prints `summarize(DIR, PNG)` (DIR required unless `summarize_default` is given)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, default=Path(out))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    if run_options is not None:
        run_options(r)
    s = sub.add_parser("summarize")
    if summarize_default is None:
        s.add_argument("out", type=Path)
    else:
        s.add_argument("out", type=Path, nargs="?", default=Path(summarize_default))
    s.add_argument("--plot", type=Path, default=Path(plot) if plot else None)
    args = vars(p.parse_args(argv))
    command = args.pop("command")
    if command == "run":
        run(args.pop("out"), args.pop("seeds"), **args)
    else:
        print(summarize(args["out"], args["plot"]))
