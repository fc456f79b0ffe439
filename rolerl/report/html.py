"""`rolerl report`: one self-contained HTML page of one or more runs, plus a PNG per figure.

The page needs no network to be viewed: the figures are inline SVG (every curve an element with the id
`series-<figure>-<run>-<metric>`, listed in the page's `<script type="application/json"
id="rolerl-series">` index), the style is inline, and its Content-Security-Policy lets the browser fetch
nothing and run no script. Several runs overlay in each figure, one colour per run. Then each run's config
and a table of the keys whose values differ.
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rolerl.report.figures import Figure, Ids, draw, specs
from rolerl.report.runs import Run, config_diff, load_runs

# The page fetches nothing and runs no script: a browser blocks (and reports) anything else
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { border: 1px solid #ccc; padding: 3px 8px; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 0; } figure svg { max-width: 100%; height: auto; }
.note { color: #777; font-style: italic; } code, pre { font-size: 0.9em; }
pre { background: #f8f8f8; padding: 0.8em; overflow-x: auto; } details { margin: 0.4em 0; }
td.down { color: #b00020; font-weight: 600; } td.up { color: #1b7a1b; }
"""
DEMO_STAGES = {"base": "base model", "warm": "warm start", "rl": "after RL"}  # results.json's eval stages
DEMO_GROUPS = {"rl": "RL families (trained by GRPO)", "format": "format families (taught by imitation)",
               "gsm8k": "GSM8K test set (rolerl recipe)"}  # fmt: skip


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write OUT/report.html (atomically) and OUT/<figure>.png for the runs in `run_dirs`; OUT defaults to
    the first run's `report/` (a demo directory's own, not its rl/'s). Returns the page's path. A path that is
    no run directory is a ValueError."""
    runs = load_runs(run_dirs)
    out_dir = Path(out) if out is not None else Path(run_dirs[0]) / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    ids, names = Ids(), [r.name for r in runs]
    figures = []
    for figure in specs(runs):
        if figure.empty():
            (out_dir / f"{figure.name}.png").unlink(missing_ok=True)  # an earlier report's, now stale
        else:
            draw(figure, names, ids, out_dir)
        figures.append(figure)
    path = out_dir / "report.html"
    _atomic_write(path, page(runs, figures))
    return path


def page(runs: Sequence[Run], figures: Sequence[Figure]) -> str:
    """The HTML document."""
    title = "rolerl report: " + ", ".join(r.name for r in runs)
    demos = [r for r in runs if r.demo is not None]
    toc = [("demo", "Before and after")] * bool(demos) + [(f.name, f.title) for f in figures]
    toc += [("configs", "Configs")]
    index = {
        "runs": [{"name": r.name, "path": str(r.path)} for r in runs],
        "figures": {f.name: f.series for f in figures if not f.empty()},
        "series": [s for f in figures for s in f.series],
    }
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',  # no favicon request
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        _runs_table(runs),
        "<nav><p>" + " · ".join(f'<a href="#{name}">{_e(text)}</a>' for name, text in toc) + "</p></nav>",
        _demo(demos, titled=len(runs) > 1) if demos else "",
        *(_figure(f) for f in figures),
        _configs(runs),
        '<script type="application/json" id="rolerl-series">' + _json_in_html(index) + "</script>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _figure(f: Figure) -> str:
    head = f'<section id="{f.name}"><h2>{_e(f.title)}</h2><p>{_e(f.about)}</p>'
    if f.empty():
        return head + f'<p class="note">No run logged {_e(f.needs)}.</p></section>'
    link = f'<a href="{f.name}.png">{f.name}.png</a>'
    return head + f"<figure>{f.svg}<figcaption>{link}</figcaption></figure></section>"


def _demo(runs: Sequence[Run], titled: bool) -> str:
    """A `rolerl demo`'s held-out evaluations (results.json): per family group, each family's greedy
    accuracy at every stage and its change over RL, a fall marked as plainly as a rise."""
    parts = ['<section id="demo"><h2>Before and after</h2><p>Held-out problems, greedy, from the demo\'s (or '
             "recipe\'s) <code>results.json</code>: the base model, the imitation warm start, and the adapters after GRPO."
             "</p>"]  # fmt: skip
    for run in runs:
        evals, gain = run.demo.get("evals", {}), run.demo.get("gain")
        if titled:
            parts.append(f"<h3>{_e(run.name)}</h3>")
        if gain:
            se = gain["stderr_points"]
            z = f", {gain['points'] / se:+.1f} SE" if se else ""
            what = gain.get("label", "RL families")  # a recipe names its test set
            parts.append(f"<p><strong>{_e(what)}: {gain['points']:+.1f} points over the warm start</strong> "
                         f"(standard error {se:.1f}{z}).</p>")  # fmt: skip
        groups = sorted({key.split("/", 1)[1] for key in evals}, key=lambda g: (g not in DEMO_GROUPS, g))
        for group in groups:
            stages = {s: evals[f"{s}/{group}"] for s in DEMO_STAGES if f"{s}/{group}" in evals}
            parts.append(f"<h4>{_e(DEMO_GROUPS.get(group, group))}</h4>" + _demo_table(stages))
    return "\n".join(parts) + "</section>"


def _demo_table(stages: dict[str, dict[str, float]]) -> str:
    change = "warm" in stages and "rl" in stages
    fams = sorted({k.split("/", 1)[1] for s in stages.values() for k in s if k.startswith("accuracy/")})
    names = ["family", *(DEMO_STAGES[s] for s in stages), *(["change over RL"] if change else [])]
    head = "<tr>" + "".join(f"<th>{n}</th>" for n in names) + "</tr>"
    rows = []
    for fam in [*fams, None]:
        key = "accuracy" if fam is None else f"accuracy/{fam}"
        cells = []
        for summary in stages.values():
            value = summary.get(key)
            text = "" if value is None else f"{100 * value:.1f}%"
            if fam is None and value is not None:
                text += f" ± {100 * summary.get('stderr', 0.0):.1f} (n={int(summary.get('n', 0))})"
            cells.append(f'<td class="num">{text}</td>')
        if change:
            before, after = stages["warm"].get(key), stages["rl"].get(key)
            delta = None if before is None or after is None else 100 * (after - before)
            css = "num" if not delta else ("num down" if delta < 0 else "num up")
            text = "" if delta is None else f"{delta:+.1f}" if delta else "0.0"
            cells.append(f'<td class="{css}">{text}</td>')
        rows.append(f"<tr><td>{_e(fam or 'all')}</td>{''.join(cells)}</tr>")
    return f'<table class="demo">{head}{"".join(rows)}</table>'


def _runs_table(runs: Sequence[Run]) -> str:
    keys = ["reward/mean", "accuracy", "eval/pass@1"]
    head = "<tr><th>run</th><th>directory</th><th>steps</th>" + "".join(
        f"<th>last {_e(k)}</th>" for k in keys
    )
    rows = []
    for r in runs:
        trained = [row for row in r.rows if any(k != "step" and not k.startswith("eval/") for k in row)]
        steps = [float(row.get("step", n + 1)) for n, row in enumerate(trained)]  # not the eval-only rows
        span = f"{len(steps)} ({int(min(steps))}–{int(max(steps))})" if steps else "0"
        last = [r.points(k)[-1][1] if r.points(k) else None for k in keys]
        cells = "".join(f'<td class="num">{"" if v is None else f"{v:.4g}"}</td>' for v in last)
        rows.append(
            f"<tr><td>{_e(r.name)}</td><td><code>{_e(str(r.path))}</code></td>"
            f'<td class="num">{span}</td>{cells}</tr>'
        )
    return f"<table>{head}</tr>{''.join(rows)}</table>"


def _configs(runs: Sequence[Run]) -> str:
    parts = ['<section id="configs"><h2>Configs</h2>']
    for r in runs:
        if r.config_text is None:
            parts.append(f'<p class="note">{_e(r.name)}: no config.yaml.</p>')
            continue
        bad = "" if r.config is not None else " (not a YAML mapping: left out of the differences)"
        parts.append(
            f"<details><summary>{_e(r.name)}: config.yaml{bad}</summary>"
            f"<pre>{_e(r.config_text)}</pre></details>"
        )
    with_config = [r for r in runs if r.config is not None]
    if len(with_config) >= 2:
        diff = config_diff(runs)
        parts.append("<h3>Differences</h3>")
        if not diff:
            parts.append('<p class="note">The configs are the same.</p>')
        else:
            head = "<tr><th>key</th>" + "".join(f"<th>{_e(r.name)}</th>" for r in with_config) + "</tr>"
            body = "".join(
                f"<tr><td><code>{_e(key)}</code></td>"
                + "".join(f"<td><code>{_e(v)}</code></td>" for v in values)
                + "</tr>"
                for key, values in diff
            )
            parts.append(f'<table id="config-diff">{head}{body}</table>')
    parts.append("</section>")
    return "\n".join(parts)


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _json_in_html(data: object) -> str:
    """JSON inside a <script> element: `</` would end the element early."""
    return json.dumps(data, indent=1).replace("</", "<\\/")


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the page from a web server or another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
