"""`rolerl diagnose grad-conflict`: roll out `n` trajectories per query with a model (and adapters), take
each trajectory's partial gradient per token kind (or role), and write the angles (`conflict.py`):

    OUT/pairs.csv     one row per pair: comparison (same | cross), a, b, query, i, j, cos, angle, conflict_frac
    OUT/layers.csv    mean cosine per layer for each comparison
    OUT/modules.csv   mean cosine and share of pairs in conflict per module for each comparison
    OUT/summary.json  per comparison: pairs, mean / median angle, share under 30 degrees, conflict share;
                      and what produced it (model, adapters, task, samples, parameters)
    OUT/angles.png    the angle distributions (same kind across trajectories vs kinds within one) and the
                      per-layer mean cosines
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolerl.diagnostics.conflict import ConflictReport, episode_gradients, select_params
from rolerl.eval.harness import EvalSpec, rollouts, spec_examples, spec_policy
from rolerl.report.plots import save_png


def grad_conflict(
    spec: EvalSpec,
    out: str | Path,
    *,
    params: str = "adapters",
    group_by: str = "kind",
    max_memory_gb: float = 8.0,
    log_line: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure, write OUT/*, return the summary."""
    from rolerl.progress import ProgressBar
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    if group_by not in ("kind", "role"):
        raise ValueError(f"--groups {group_by!r}; allowed: kind, role")
    task = load_task(spec.task, spec.data)
    workflow = load_workflow(spec.workflow, task, spec.workflow_options)
    examples = spec_examples(task, spec)
    policy, cfg, identity = spec_policy(spec, workflow.roles)
    if len(policy.members) != 1:
        raise ValueError(
            "grad-conflict measures one model's parameters; this topology runs several (separate)"
        )
    model = policy.members["main"].model
    chosen = select_params(model, params)
    size = sum(p.numel() for p in chosen.values())
    groups = len(workflow.roles) if group_by == "role" else 3
    need = spec.n * groups * size * 4 / 2**30  # float32 gradients of one query's trajectories
    if need > max_memory_gb:
        raise ValueError(
            f"--params {params}: {size / 1e6:.1f}M parameters x {spec.n} samples x {groups} groups need "
            f"{need:.1f} GiB (--max-memory-gb {max_memory_gb}): use fewer --samples, --params adapters, "
            "or raise the limit"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = ConflictReport()
    temperature = spec.temperature or 1.0
    with ProgressBar("grad-conflict", len(examples) * spec.n, enabled=spec.progress) as bar:
        for chunk, episodes in rollouts(spec, workflow, policy, cfg, examples, range(len(examples)), bar):
            for example, eps in zip(chunk, episodes, strict=True):
                grads = [episode_gradients(model, ep, policy.route_of, chosen, group_by=group_by,
                                           temperature=temperature) for ep in eps]  # fmt: skip
                report.add(example.id, grads)
    summary = {
        "comparisons": report.summary(),
        "identity": identity,
        "task": spec.task,
        "workflow": spec.workflow,
        "queries": len(examples),
        "samples": spec.n,
        "params": params,
        "parameters": size,
        "groups": group_by,
    }
    _write_csv(out / "pairs.csv", [
        {"comparison": p.comparison, "a": p.a, "b": p.b, "query": p.query, "i": p.i, "j": p.j,
         "cos": p.angle.cos, "angle": p.angle.degrees, "conflict_frac": p.angle.conflict_frac}
        for p in report.pairs
    ])  # fmt: skip
    _write_csv(out / "layers.csv", report.layers())
    _write_csv(out / "modules.csv", report.modules())
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "summary.json")
    if report.pairs:
        plot(report, out / "angles.png")
    log_line(table(summary))
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [f"{summary['queries']} queries x {summary['samples']} samples, {summary['parameters'] / 1e6:.2f}M "
             f"parameters ({summary['params']}), groups by {summary['groups']}",
             f"  {'comparison':<34} {'pairs':>6} {'mean':>7} {'median':>7} {'<30deg':>7} {'conflict':>9}"]  # fmt: skip
    for r in summary["comparisons"]:
        what = f"{r['a']} (trajectories i != j)" if r["comparison"] == "same" else f"{r['a']} vs {r['b']}"
        lines.append(f"  {what:<34} {r['pairs']:>6} {r['mean_angle']:>6.1f}d {r['median_angle']:>6.1f}d "
                     f"{100 * r['under_30']:>6.0f}% {100 * r['conflict_frac']:>8.0f}%")  # fmt: skip
    return "\n".join(lines)


def plot(report: ConflictReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    by: dict[str, list[float]] = {}
    for p in report.pairs:
        label = (
            f"{p.a}: same kind, two trajectories"
            if p.comparison == "same"
            else f"{p.a} vs {p.b}: one trajectory"
        )
        by.setdefault(label, []).append(p.angle.degrees)
    for label, degrees in sorted(by.items()):
        left.hist(degrees, bins=30, range=(0, 180), alpha=0.5, label=f"{label} (n={len(degrees)})")
    left.axvline(90, color="grey", lw=0.8, ls="--")
    left.set_xlabel("angle between partial gradients (degrees)")
    left.set_ylabel("pairs")
    left.legend(fontsize=7)
    layers: dict[str, dict[str, float]] = {}
    for row in report.layers():
        what = f"{row['a']} same" if row["comparison"] == "same" else f"{row['a']} vs {row['b']}"
        layers.setdefault(what, {})[row["layer"]] = row["mean_cos"]
    for what, values in sorted(layers.items()):
        names = sorted(values)
        right.plot(range(len(names)), [values[n] for n in names], marker=".", label=what)
        right.set_xticks(range(len(names)), [n.replace("layer ", "") for n in names], fontsize=6)
    right.axhline(0, color="grey", lw=0.8)
    right.set_xlabel("layer")
    right.set_ylabel("mean cosine")
    right.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    tmp.replace(path)
