"""Where a run directory keeps its checkpoints (`checkpoints/step_N/`): what evaluation reads from a run and
training writes (`rolerl.train.checkpoint`, which owns the rest of the layout)."""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temp directories are not listed)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)
