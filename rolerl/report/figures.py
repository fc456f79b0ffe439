"""The report's figures: which metric keys each one draws, the seesaw's derived curves, and drawing with
matplotlib (Agg) into an inline SVG (each curve an element with a stable id) and a PNG.

A figure has panels; a panel draws curves (a metric of a run over steps). Several runs overlay: one
colour per run, one line style per metric."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rolerl.report.plots import save_png
from rolerl.report.runs import Run, is_number

Points = list[tuple[float, float]]
# eval/* keys that are no rate: counts, sizes, timings (rolerl.eval.harness.summarize)
EVAL_NOT_RATES = re.compile(r"eval/(examples|samples|stderr|stderr/.*|seconds|role/.*|.*/mean)")
LABELS = {"reward/mean": "reward (mean)", "accuracy": "accuracy (rollouts)", "grad_norm": "all adapters"}


@dataclass
class Panel:
    title: str
    ylabel: str = ""
    ylim: tuple[float, float] | None = None
    # per run name: (metric key, legend label, points); the key names the curve's element id
    curves: dict[str, list[tuple[str, str, Points]]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not any(points for curves in self.curves.values() for _, _, points in curves)


@dataclass
class Figure:
    name: str  # PNG file stem and part of the element ids
    title: str
    about: str  # one sentence under the title
    needs: str  # the keys it draws, for the note when no run logged them
    panels: list[Panel]
    svg: str = ""
    series: list[str] = field(default_factory=list)  # element ids of the curves drawn
    png: Path | None = None

    def empty(self) -> bool:
        return all(p.empty() for p in self.panels)


def _panel(runs: Sequence[Run], keys: Sequence[str], title: str, patterns: Sequence[str], ylabel: str = "",
           ylim: tuple[float, float] | None = None, rates: bool = False) -> Panel:  # fmt: skip
    """Curves of the `keys` that fully match one of `patterns` (in that order, then by name); a pattern's
    `label` group names the curve in the legend. `rates`: not the eval counts and timings (EVAL_NOT_RATES),
    and a run's curve only if all its values lie in [0, 1]."""
    chosen: dict[str, str] = {}
    for pattern in patterns:
        for key in keys:
            m = re.fullmatch(pattern, key)
            if m and key not in chosen and not (rates and EVAL_NOT_RATES.fullmatch(key)):
                chosen[key] = LABELS.get(key) or (m.group("label") if "label" in m.groupdict() else key)
    panel = Panel(title, ylabel, ylim)
    for r in runs:
        curves = [(k, label, r.points(k)) for k, label in chosen.items()]
        panel.curves[r.name] = _merge_equal(
            [c for c in curves if c[2] and not (rates and any(not 0 <= v <= 1 for _, v in c[2]))]
        )
    return panel


def _merge_equal(curves: list[tuple[str, str, Points]]) -> list[tuple[str, str, Points]]:
    """One curve for metrics whose points are the same (the demo's reward is its accuracy; with one adapter
    `grad_norm` is that adapter's): a second line exactly under the first would name in the legend a line
    nobody can see. The merged curve keeps the first key and names both (`reward (mean) = accuracy`)."""
    out: list[tuple[str, str, Points]] = []
    for key, label, points in curves:
        twin = next((i for i, c in enumerate(out) if c[2] == points), None)
        if twin is None:
            out.append((key, label, points))
        else:
            k, first, p = out[twin]
            out[twin] = (k, f"{first} = {label}", p)
    return out


def specs(runs: Sequence[Run]) -> list[Figure]:
    """Every figure of the report, its panels filled from `runs` (a figure may come out empty)."""
    unit = (-0.03, 1.03)
    keys = sorted({k for r in runs for row in r.rows for k, v in row.items() if is_number(v)})
    return [
        Figure("reward", "Reward and rollout accuracy", "Outcome reward and the fraction of correct episodes "
               "over each step's rollouts.", "reward/mean, accuracy",
               [_panel(runs, keys, "reward and accuracy per step", ["reward/mean", "accuracy"])]),
        Figure("eval", "Held-out evaluation", "Every eval/* rate, logged every eval.every steps (pass@k, "
               "maj@k, tool call and error rates, task scores).", "eval/*",
               [_panel(runs, keys, "held-out rates", [r"eval/(?P<label>.+)"], "rate", unit, rates=True)]),
        Figure("roles", "Roles and adapters", "Each role's weight in the loss, and each adapter's pre-clip "
               "gradient norm.", "role/<r>/loss_share, adapter/<a>/grad_norm, grad_norm",
               [_panel(runs, keys, "loss share per role", [r"role/(?P<label>[^/]+)/loss_share"], "share", unit),
                _panel(runs, keys, "gradient norm per adapter", [r"adapter/(?P<label>[^/]+)/grad_norm", "grad_norm"],
                       "pre-clip norm")]),
        Figure("entropy", "Entropy", "Mean per-token policy entropy, overall and by the kind of the predicted "
               "token.", "entropy, kind/<k>/entropy",
               [_panel(runs, keys, "entropy", ["entropy", r"kind/(?P<label>[^/]+)/entropy"], "nats")]),
        Figure("tools", "Tools and truncation", "Tool calls per step, the share that errored, calls on which "
               "the tool itself failed, and model calls cut by max_new_tokens.",
               "tools/calls, tools/error_rate, tools/failures, truncated_frac",
               [_panel(runs, keys, "tool calls", ["tools/calls"], "calls"),
                _panel(runs, keys, "tool error rate", ["tools/error_rate"], "rate", unit),
                _panel(runs, keys, "tool failures", ["tools/failures"], "calls"),
                _panel(runs, keys, "truncated calls", ["truncated_frac"], "fraction", unit)]),
        Figure("grad", "Gradient conflict", "Cosine between two groups' gradients on an adapter, and the share "
               "of its modules where it is negative (every diagnostics.grad_every steps).",
               "grad/cos/*, grad/conflict_frac/*",
               [_panel(runs, keys, "gradient cosine", [r"grad/cos/(?P<label>.+)"], "cosine", (-1.03, 1.03)),
                _panel(runs, keys, "conflict fraction", [r"grad/conflict_frac/(?P<label>.+)"], "fraction", unit)]),
        Figure("workflow", "Roles at work", "Each role's own metric, per step over its rollouts "
               "(docs/WORKFLOWS.md: the aggregator's choice, the evaluator's verdicts, the workers' answers, "
               "the coder's code...), and the malformed outputs per episode.",
               "workflow/<name>/<metric>, workflow/<name>/malformed/<case>",
               [_panel(runs, keys, "each role's metric", [r"workflow/[^/]+/(?P<label>[^/]+)"], "rate", unit,
                       rates=True),
                _panel(runs, keys, "malformed outputs", [r"workflow/[^/]+/malformed/(?P<label>.+)"],
                       "per episode")]),
        seesaw(runs),
    ]  # fmt: skip


def seesaw(runs: Sequence[Run]) -> Figure:
    """Tool-call success, tool use, final-answer accuracy and each role's accuracy on one axis, to see one
    capability rise while another falls. At the eval points when every run has them (held-out, greedy by
    default), else per training step (rollouts)."""
    at_eval = all(r.points("eval/pass@1") for r in runs)
    about = (
        "At each held-out evaluation: pass@1, the share of samples that called a tool, and the share of calls "
        "that succeeded; each role's accuracy is that step's rollouts'."
        if at_eval
        else "Per training step (rollouts): accuracy, tool calls per episode (scaled to the runs' peak), and "
        "the share of calls that succeeded; each role's accuracy over the episodes it took part in."
    )
    curves = {r.name: [c for c in _seesaw_curves(r, at_eval) if c[2]] for r in runs}
    if not at_eval:  # calls per episode is no rate: scale it by its peak over all runs to share the axis
        peak = max(
            (v for cs in curves.values() for k, _, ps in cs if k == "tool_use" for _, v in ps), default=0
        )
        for cs in curves.values():
            for i, (k, _, ps) in enumerate(cs):
                if k == "tool_use" and peak > 0:
                    cs[i] = (k, f"tool use (calls/episode ÷ {peak:.3g})", [(x, v / peak) for x, v in ps])
    panel = Panel("capabilities over the run", "rate", (-0.03, 1.03), curves)
    needs = "accuracy or eval/pass@1, tools/error_rate, role/<r>/accuracy"
    return Figure("seesaw", "Seesaw: tool use against accuracy", about, needs, [panel])


def _seesaw_curves(run: Run, at_eval: bool) -> list[tuple[str, str, Points]]:
    rows = [r for r in run.rows if is_number(r.get("eval/pass@1"))] if at_eval else run.rows
    steps = [float(r.get("step", n + 1)) for n, r in enumerate(rows)]

    def curve(value) -> Points:
        out = []
        for x, row in zip(steps, rows, strict=True):
            v = value(row)
            if is_number(v):
                out.append((x, float(v)))
        return out

    def rate(key: str, calls_key: str):  # 1 - error rate, only where calls were made
        return lambda r: 1 - r[key] if is_number(r.get(key)) and (r.get(calls_key) or 0) > 0 else None

    if at_eval:
        acc = ("accuracy", "accuracy (eval pass@1)", curve(lambda r: r.get("eval/pass@1")))
        calls = curve(lambda r: r.get("eval/tool_call_rate"))
        use = ("tool_use", "tool use (eval samples with a call)", calls)
        ok = curve(rate("eval/tool_error_rate", "eval/tool_calls/mean"))
    else:
        acc = ("accuracy", "accuracy (rollouts)", curve(lambda r: r.get("accuracy")))
        use = ("tool_use", "tool use", curve(_calls_per_episode))
        ok = curve(rate("tools/error_rate", "tools/calls"))
    roles = sorted({m.group(1) for r in rows for k in r if (m := re.fullmatch(r"role/([^/]+)/accuracy", k))})
    per_role = [(f"role/{x}/accuracy", f"{x} accuracy", curve(lambda r, x=x: r.get(f"role/{x}/accuracy")))
                for x in roles]  # fmt: skip
    return [acc, ("tool_success", "tool-call success (1 - error rate)", ok), use, *per_role]


def _calls_per_episode(row: dict) -> float | None:
    calls = row.get("tools/calls")
    return calls / max(row.get("episodes") or 1, 1) if is_number(calls) else None


class Ids:
    """Element ids of the curves: `series-<figure>-<run>-<metric>`, unique in the page; within a part, any
    run of characters but [A-Za-z0-9_] becomes `_` (so `-` only separates parts)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def new(self, *parts: str) -> str:
        base = "series-" + "-".join(re.sub(r"[^A-Za-z0-9_]+", "_", p).strip("_") or "_" for p in parts)
        name, n = base, 1
        while name in self.used:
            n += 1
            name = f"{base}-{n}"
        self.used.add(name)
        return name


COLOURS = [f"C{i}" for i in range(10)]
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def draw(figure: Figure, runs: Sequence[str], ids: Ids, out_dir: Path) -> Figure:
    """Draw `figure`'s non-empty panels; fill its SVG (internal ids prefixed with the figure's name, so
    several SVGs share a page) and series ids, and write OUT_DIR/<name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in figure.panels if not p.empty()]
    cols = 1 if len(panels) == 1 else 2
    rows = (len(panels) + cols - 1) // cols
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": figure.name}):
        fig, axes = plt.subplots(
            rows, cols, figsize=(6.4 * cols, 3.6 * rows), squeeze=False, layout="constrained"
        )
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        for ax, panel in zip(axes.flat, panels, strict=False):
            figure.series += _draw_panel(ax, panel, figure.name, runs, ids)
        if len(runs) == 1:
            fig.suptitle(runs[0])
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
        figure.svg = _inline_svg(buf.getvalue(), figure.name)
        figure.png = save_png(fig, out_dir / f"{figure.name}.png")
    return figure


def _draw_panel(ax, panel: Panel, figure: str, runs: Sequence[str], ids: Ids) -> list[str]:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    metrics = list(dict.fromkeys((k, label) for run in runs for k, label, _ in panel.curves.get(run, [])))
    drawn = []
    for i, run in enumerate(runs):
        for key, label, points in panel.curves.get(run, []):
            j = metrics.index((key, label))
            colour = COLOURS[(j if len(runs) == 1 else i) % len(COLOURS)]
            style = "-" if len(runs) == 1 else LINESTYLES[j % len(LINESTYLES)]
            marker = MARKERS[j % len(MARKERS)] if len(points) <= 40 else None
            xs, ys = zip(*points, strict=True)
            (line,) = ax.plot(xs, ys, color=colour, linestyle=style, marker=marker, markersize=4, label=label)
            line.set_gid(ids.new(figure, run, key))
            drawn.append(line.get_gid())
    if len(runs) == 1:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    else:  # colour names the run (those drawn here), line style the metric
        shown = [i for i, run in enumerate(runs) if panel.curves.get(run)]
        handles = [Line2D([], [], color=COLOURS[i % len(COLOURS)]) for i in shown]
        handles += [Line2D([], [], color="0.3", linestyle=LINESTYLES[j % len(LINESTYLES)],
                           marker=MARKERS[j % len(MARKERS)], markersize=4) for j in range(len(metrics))]  # fmt: skip
        labels = [runs[i] for i in shown] + [label for _, label in metrics]
        ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(panel.ylabel)
    if panel.ylim:
        ax.set_ylim(*panel.ylim)
    ax.grid(alpha=0.3)
    return drawn


def _inline_svg(svg: str, prefix: str) -> str:
    """matplotlib's SVG file as an element of an HTML page: no XML prolog, doctype or RDF metadata, and
    its own ids (`figure_1`, markers, clip paths) prefixed so two figures' ids never collide; the curves'
    `series-` ids stay as they are."""
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, count=1, flags=re.S)

    def own(m: re.Match) -> str:
        name = m.group(2)
        return m.group(0) if name.startswith("series-") else f"{m.group(1)}{prefix}-{name}{m.group(3)}"

    svg = re.sub(r'(\bid=")([^"]+)(")', own, svg)
    svg = re.sub(r'(href="#)([^"]+)(")', own, svg)
    return re.sub(r"(url\(#)([^)]+)(\))", own, svg)
