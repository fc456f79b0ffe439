"""Plots of a run: PNG files written with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import json
from pathlib import Path


def save_png(fig, path: str | Path) -> Path:
    """Write `fig` to `path` atomically (a temporary file, then a rename) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_metrics(
    metrics_path: str | Path,
    out: str | Path,
    title: str = "GRPO training",
    held_out: dict[int, float] | None = None,
) -> Path:
    """Reward and accuracy per RL step of a run's `metrics.jsonl` as a PNG at `out` (written atomically);
    `held_out` adds evaluation points `{step: accuracy}` (e.g. step 0 = the warm start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward/mean" in r and "accuracy" in r]  # training steps, not eval rows
    steps = [r["step"] for r in rows]
    reward, accuracy = [r["reward/mean"] for r in rows], [r["accuracy"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if reward == accuracy:  # a 0/1 reward: one line, not one hidden exactly under the other
        ax.plot(steps, accuracy, marker="s", label="accuracy = reward (rollouts)")
    else:
        ax.plot(steps, reward, marker="o", label="reward (mean)")
        ax.plot(steps, accuracy, marker="s", label="accuracy (rollouts)")
    if held_out:
        xs = sorted(held_out)
        ax.plot(xs, [held_out[x] for x in xs], "kD", markersize=8, label="held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    return save_png(fig, out)
