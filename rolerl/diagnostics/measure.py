"""The diagnostics that roll out: `rolerl diagnose grad-conflict` and `rolerl diagnose interaction`.

`grad_conflict` rolls out `n` trajectories per query with a model (and adapters), takes each
trajectory's partial gradient per token kind (or role), and writes the angles (`conflict.py`):

    OUT/pairs.csv     one row per pair: comparison (same | cross), a, b, query, i, j, cos, angle, conflict_frac
    OUT/layers.csv    mean cosine per layer for each comparison
    OUT/modules.csv   mean cosine and share of pairs in conflict per module for each comparison
    OUT/summary.json  per comparison: pairs, mean / median angle, share under 30 degrees, conflict share;
                      and what produced it (model, adapters, task, samples, parameters)
    OUT/angles.png    the angle distributions (same kind across trajectories vs kinds within one) and the
                      per-layer mean cosines

`measure_interaction` evaluates the LEAS variants (`interaction.py`) with `n` samples per question and
writes the per-question coefficients:

    OUT/<variant>/          each variant's `rolerl eval` output (samples.jsonl: resumable)
    OUT/interaction.csv     one row per kept question; OUT/interaction.png the histogram of l23
    OUT/interaction.json    the share of questions with l23 < 0, counts, and each variant's source
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolerl.diagnostics.conflict import ConflictReport, episode_gradients, select_params
from rolerl.eval.harness import EvalSpec, rollouts, spec_examples, spec_policy
from rolerl.files import write_json
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
    total, done = len(examples) * spec.n, 0
    with (
        ProgressBar("rollouts", total, enabled=spec.progress) as rolled,
        ProgressBar("gradients", total, enabled=spec.progress) as graded,
    ):
        for chunk, episodes in rollouts(spec, workflow, policy, cfg, examples, range(len(examples)), rolled):
            for example, eps in zip(chunk, episodes, strict=True):
                grads = []
                for ep in eps:
                    grads.append(episode_gradients(model, ep, policy.route_of, chosen, group_by=group_by,
                                                   temperature=temperature))  # fmt: skip
                    done += 1
                    graded.update(done)
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
    write_json(out / "summary.json", summary)
    if report.pairs:
        plot(report, out / "angles.png")
    log_line(table(summary))
    return summary


def measure_interaction(
    spec: EvalSpec,
    out: str | Path,
    *,
    joint: str,
    reas: str,
    tool: str,
    base: str | None = None,
    hybrids: bool = False,
    log_line: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate each variant (`spec` says the task, workflow, samples and sampling) and attribute. A
    variant is a training run (its newest checkpoint) or a directory that already holds `rolerl eval`
    samples; `base` defaults to the joint run's base model without adapters. The hybrids route one kind
    to a trained adapter and the rest to the base model: `hybrid_tool` = the tool run's adapter on tool-call
    tokens, `hybrid_reas` = the reasoning run's adapter on every kind but tool calls."""
    from rolerl.config import load_config
    from rolerl.diagnostics.interaction import interaction, summary, write_csv
    from rolerl.diagnostics.interaction import plot as plot_interaction
    from rolerl.eval.harness import run_eval

    out = Path(out)
    # made here, not only by an evaluation: when every variant is an eval directory, none runs
    out.mkdir(parents=True, exist_ok=True)
    sources = {"joint": joint, "reas": reas, "tool": tool, "base": base}
    if base is None:
        sources["base"] = load_config(Path(joint) / "config.yaml").model.spec
    dirs: dict[str, Path] = {}
    for name, source in sources.items():
        dirs[name] = _variant(spec, name, source, out, None, run_eval, log_line)
    if hybrids:
        for name, run, on_adapter in [("hybrid_tool", tool, lambda k: k == "tool_call"),
                                      ("hybrid_reas", reas, lambda k: k != "tool_call")]:  # fmt: skip
            dirs[name] = _variant(
                spec, name, run, out, _hybrid_table(spec, run, on_adapter), run_eval, log_line
            )
    result = interaction(dirs)
    write_csv(result, out / "interaction.csv")
    plot_interaction(result, out / "interaction.png")
    report = {"share_l23_negative": result.share_negative, "kept": result.kept, "dropped": result.dropped,
               "mean_l23": float(result.l23.mean()), "median_l23": float(result.l23.quantile(0.5)),
               "samples": spec.n, "sources": {k: str(v) for k, v in sources.items()},
               "hybrids": hybrids, "task": spec.task, "workflow": spec.workflow}  # fmt: skip
    write_json(out / "interaction.json", report)
    log_line(summary(result))
    return report


def _variant(spec: EvalSpec, name: str, source: str, out: Path, table, run_eval, log_line) -> Path:
    """The directory of a variant's samples: `source` itself if it holds them (and is not a run to
    route), else a fresh (or resumed) evaluation under `out/name`."""
    import dataclasses

    path = Path(source)
    if table is None and (path / "samples.jsonl").is_file():
        return path
    target = out / name
    if path.is_dir() and (path / "config.yaml").is_file():
        what = {"run": str(path), "table": table}
    elif table is None and not path.exists():
        what = {"model": source}  # a model spec: the base model alone
    else:
        raise ValueError(
            f"{name}: {source!r} is neither a training run (config.yaml) nor an eval (samples.jsonl)"
        )
    log_line(f"{name}: evaluating {source} ({spec.n} samples per question)")
    resume = (target / "samples.jsonl").exists()
    run_eval(dataclasses.replace(spec, **what, out=str(target), resume=resume), log_line=lambda _: None)
    return target


def _hybrid_table(spec: EvalSpec, run: str, on_adapter) -> dict[str, dict[str, str | None]]:
    """Each role: the run's adapter on the kinds `on_adapter` picks, the base model on the others."""
    from rolerl.config import load_config
    from rolerl.roles import KINDS
    from rolerl.run.policy import build_topology
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    cfg = load_config(Path(run) / "config.yaml")
    roles = load_workflow(spec.workflow, load_task(spec.task, spec.data), spec.workflow_options).roles
    topology = build_topology(cfg, roles)
    return {role: {kind: (topology.adapter_of(role, kind) if on_adapter(kind) else None) for kind in KINDS}
            for role in roles}  # fmt: skip


def table(summary: dict[str, Any]) -> str:
    lines = [f"{summary['queries']} queries x {summary['samples']} samples, {summary['parameters'] / 1e6:.2f}M "
             f"parameters ({summary['params']}), groups by {summary['groups']}",
             f"  {'comparison':<34} {'pairs':>6} {'mean':>7} {'median':>7} {'<30deg':>7} {'conflict':>9} "
             f"{'identical':>9}"]  # fmt: skip
    for r in summary["comparisons"]:
        what = f"{r['a']} (trajectories i != j)" if r["comparison"] == "same" else f"{r['a']} vs {r['b']}"
        lines.append(f"  {what:<34} {r['pairs']:>6} {r['mean_angle']:>6.1f}d {r['median_angle']:>6.1f}d "
                     f"{100 * r['under_30']:>6.0f}% {100 * r['conflict_frac']:>8.0f}% "
                     f"{r['identical_pairs_left_out']:>9}")  # fmt: skip
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
