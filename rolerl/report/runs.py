"""The runs a report shows: each run directory's logged steps and config, the names that tell them apart,
and the config keys whose values differ between them."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ABSENT = "(absent)"  # a config key one run has and another has not


@dataclass
class Run:
    path: Path
    name: str  # the legend's name: the directory's name, with its parent's where two names are equal
    rows: list[dict[str, Any]]  # metrics.jsonl, one flat dict per step
    config_text: str | None  # config.yaml as written (None: the run has none)
    config: dict[str, Any] | None  # parsed (None: missing, or not a YAML mapping)
    demo: dict[str, Any] | None = None  # a `rolerl demo` directory's results.json (its run is rl/ or sft/)

    def points(self, key: str) -> list[tuple[float, float]]:
        """`(step, value)` of every row that logged `key` as a finite number (eval and gradient keys are
        logged on some steps only)."""
        out = []
        for n, row in enumerate(self.rows):
            value = row.get(key)
            if is_number(value):
                out.append((float(row.get("step", n + 1)), float(value)))
        return out


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Read each run directory; a path that is not one (no metrics.jsonl) is a ValueError naming it."""
    if not paths:
        raise ValueError("give at least one run directory")
    roots = [Path(p) for p in paths]
    dirs = [_metrics_dir(root) for root in roots]
    from rolerl.train.checkpoint import RunDir  # imports torch: only once the paths are known to be runs

    runs = []
    for root, run_dir, name in zip(roots, dirs, run_names(roots), strict=True):
        rows = RunDir(run_dir, tensorboard=False).read_metrics()
        text, config = _read_config(run_dir / "config.yaml")
        demo = json.loads((root / "results.json").read_text()) if run_dir != root else None
        runs.append(Run(run_dir, name, rows, text, config, demo))
    return runs


def _metrics_dir(root: Path) -> Path:
    """The directory whose metrics.jsonl a path stands for: the path itself, or for a `rolerl demo`
    directory (results.json, no metrics of its own) its GRPO run `rl/` (`sft/` when it stopped before RL)."""
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a run directory: no such directory")
    if (root / "metrics.jsonl").is_file():
        return root
    if (root / "results.json").is_file():
        for stage in ("rl", "sft"):
            if (root / stage / "metrics.jsonl").is_file():
                return root / stage
        raise ValueError(
            f"{str(root)!r} is a demo directory without a finished stage: no rl/ or sft/ metrics"
        )
    raise ValueError(f"{str(root)!r} is not a run directory: it has no metrics.jsonl")


def run_names(roots: Sequence[Path]) -> list[str]:
    """Each run's directory name; runs whose names are equal get their parent's too (`seed0/rl`), and
    a number if even that is equal."""
    full = [r.resolve() for r in roots]
    bare = [p.name or str(p) for p in full]
    names = [f"{p.parent.name}/{p.name}" if bare.count(b) > 1 else b for p, b in zip(full, bare, strict=True)]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        if names.count(name) > 1:
            seen[name] = seen.get(name, 0) + 1
            name = f"{name} #{seen[name]}"
        out.append(name)
    return out


def _read_config(path: Path) -> tuple[str | None, dict[str, Any] | None]:
    import yaml

    if not path.is_file():
        return None, None
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:  # shown as written, left out of the diff
        return text, None
    return text, data if isinstance(data, dict) else None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; an empty mapping stays a value (`{}`)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= flatten(value, name + ".")
        else:
            out[name] = value
    return out


def config_diff(runs: Sequence[Run]) -> list[tuple[str, list[str]]]:
    """`(key, [value per run])` for every config key whose value is not the same in all runs that have a
    config, in the config's own order; a run without the key shows ABSENT."""
    flat = [flatten(r.config) for r in runs if r.config is not None]
    if len(flat) < 2:
        return []
    keys = list(dict.fromkeys(k for f in flat for k in f))
    missing = object()
    rows = []
    for key in keys:
        values = [f.get(key, missing) for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, [ABSENT if v is missing else json.dumps(v, default=str) for v in values]))
    return rows
