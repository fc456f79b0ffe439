"""The run directory: resolved config, `metrics.jsonl`, TensorBoard logs, and atomic checkpoints.

```
RUN_DIR/
  config.yaml                 the resolved config (every field, after overrides)
  metrics.jsonl               one flat JSON object per step
  tensorboard/                event files (when `tensorboard` is installed)
  checkpoints/step_N/         adapters/<name>/ (PEFT directories) + state.pt (optimizer, scheduler, RNG, step)
```

A checkpoint is written into a hidden temp directory beside its final place and renamed into place, so
a crash leaves either the whole checkpoint or none; only the newest `keep_last` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rolerl.config import Config
from rolerl.models.adapters_io import load_adapter, save_adapter

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
_WARNED = False


class RunDir:
    """Writes one run's files. `resume_step` truncates metrics past the checkpoint being resumed."""

    def __init__(self, path: str | Path, *, tensorboard: bool = True, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_metrics(resume_step)
        self.writer = _tensorboard_writer(self.path / "tensorboard", resume_step) if tensorboard else None

    def write_config(self, cfg: Config) -> None:
        _atomic_write_text(self.path / "config.yaml", cfg.to_yaml())

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one flat JSON object; mirror the numbers to TensorBoard."""
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.writer is not None:
            step = int(metrics["step"])
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _truncate_metrics(self, step: int) -> None:
        """Steps after the resumed checkpoint are run again: drop their old lines."""
        kept = [m for m in self.read_metrics() if int(m["step"]) <= step]
        _atomic_write_text(self.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))


def _tensorboard_writer(path: Path, resume_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional (DESIGN style 10): say so once per process
        global _WARNED
        if not _WARNED:
            log.warning(
                "tensorboard is not installed: skipping TensorBoard logs (metrics.jsonl has everything)"
            )
            _WARNED = True
        return None
    # purge_step drops events a crashed run wrote after the checkpoint we resume from
    return SummaryWriter(str(path), purge_step=None if resume_step is None else resume_step + 1)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temp directories are not listed)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    adapter_names: list[str],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    keep_last: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `checkpoints/step_{step}` atomically, then delete all but the newest `keep_last`."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}-", dir=root))
    try:
        for name in adapter_names:
            save_adapter(model, name, tmp / "adapters" / name)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "extra": extra or {},
        }
        torch.save(state, tmp / "state.pt")
        if final.exists():  # re-saving a step (a resumed run): replace it whole
            old = root / f".step_{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, path in checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    adapter_names: list[str],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict[str, Any]:
    """Restore adapters, optimizer, scheduler and RNG from `path`; returns the saved state (with `step`)."""
    path = Path(path)
    for name in adapter_names:
        load_adapter(model, name, path / "adapters" / name)
    state = torch.load(path / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state


def clean_partial(run_dir: str | Path) -> None:
    """Remove temp directories a crash left behind (they never count as checkpoints)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step_"):
                shutil.rmtree(p, ignore_errors=True)
