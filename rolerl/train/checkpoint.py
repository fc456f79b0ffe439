"""The run directory: resolved config, `metrics.jsonl`, TensorBoard logs, and atomic checkpoints.

```
RUN_DIR/
  config.yaml                 the resolved config (every field, after overrides)
  metrics.jsonl               one flat JSON object per step
  tensorboard/                event files (when `tensorboard` is installed)
  wandb/                      W&B's own files (when `run.wandb` names a project)
  checkpoints/step_N/         adapters/<name>/ (PEFT directories) + state.pt (optimizer, RNG, step, ...)
```

An asynchronous run's `state.pt` also keeps, under `rollout`, the older adapter versions that the rollouts
of the steps after the checkpoint sample (`RolloutPipeline.state`: every adapter's LoRA tensors and step
counts, small), so a run resumed from it equals the uninterrupted run.

A checkpoint is written into a hidden temp directory beside its final place and renamed into place, so
a crash leaves either the whole checkpoint or none; only the newest `keep_last` are kept, and an old one is
renamed out of the `step_N` namespace before it is deleted (a crash mid-delete leaves a hidden directory,
never a half-deleted `step_N`). A write that fails (a full disk) leaves the earlier checkpoints as they
were and raises `CheckpointWriteError` naming the directory. A checkpoint that cannot be read back (a disk
fault) is skipped for the previous one, with a warning naming the file.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rolerl.config import Config
from rolerl.models.adapters_io import CorruptFileError, load_adapter, save_adapter
from rolerl.run.layout import checkpoints
from rolerl.train.distributed import fault_point
from rolerl.train.optim import Optimizer, OptimizerStateError

log = logging.getLogger(__name__)
_WARNED = False
# What a run writes into its directory: what `--overwrite` removes (checkpoints first: see `clear_run`)
RUN_FILES = ("checkpoints", "adapters", "metrics.jsonl", "tensorboard", "wandb", "config.yaml")


class CheckpointError(ValueError):
    """No checkpoint of a run directory can be read back."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only or vanished directory); nothing of it
    was kept and the earlier checkpoints are intact. `errno` is the cause's (`errno.ENOSPC`: disk full)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run, after the last completed step was checkpointed. A KeyboardInterrupt, so code
    that catches `Exception` still lets it through; `str()` is the one line to show the user."""

    def __init__(
        self, step: int, saved: int, run_dir: str | Path, why: str = "interrupted", command: str = "train"
    ) -> None:
        self.step, self.saved, self.run_dir, self.why = step, saved, Path(run_dir), why
        super().__init__(
            f"{why} at step {step} ({self.kept}); continue with rolerl {command} --resume {run_dir}"
        )

    @property
    def kept(self) -> str:
        return f"step {self.saved} is checkpointed" if self.saved else "no step had completed"


def holds_run(run_dir: str | Path) -> list[str]:
    """The run files `run_dir` already holds (empty for a fresh directory)."""
    root = Path(run_dir)
    found = [name for name in ("metrics.jsonl", "adapters") if (root / name).exists()]
    return found + (["checkpoints"] if checkpoints(root) else [])


def prepare_run_dir(run_dir: str | Path, command: str, *, overwrite: bool) -> None:
    """Refuse a directory that holds a run (never mix two runs' metrics), or clear it with `overwrite`."""
    found = holds_run(run_dir)
    if found and not overwrite:
        resume = f"continue it with --resume {run_dir}, " if command in ("train", "sft") else ""
        raise ValueError(
            f"run.dir={str(run_dir)!r} already holds a run; {resume}choose another run.dir, or replace it "
            f"with `rolerl {command} --overwrite` (overwrite=True); it has {', '.join(found)}"
        )
    if overwrite:
        clear_run(run_dir)


def clear_run(run_dir: str | Path) -> None:
    """Delete a run's files (`RUN_FILES`; anything else in the directory stays). Each is first renamed into
    one hidden trash directory, checkpoints first: a crash midway leaves at most old metrics without
    checkpoints, which no run resumes from (`--resume` restarts such a run from step 0)."""
    root = Path(run_dir)
    if not root.is_dir():
        return
    for p in root.glob(".overwritten-*"):  # a previous clear that crashed before deleting
        shutil.rmtree(p, ignore_errors=True)
    present = [root / name for name in RUN_FILES if (root / name).exists()]
    if not present:
        return
    trash = Path(tempfile.mkdtemp(prefix=".overwritten-", dir=root))
    for p in present:
        os.replace(p, trash / p.name)
    log.warning(
        "run.dir=%r: removed the previous run's %s (overwrite)", str(root), ", ".join(p.name for p in present)
    )
    shutil.rmtree(trash, ignore_errors=True)


class RunDir:
    """Writes one run's files. `resume_step` truncates metrics past the checkpoint being resumed;
    `wandb` (a project, with its `wandb_entity`) mirrors the run to W&B (`WandbRun`)."""

    def __init__(
        self,
        path: str | Path,
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
        wandb: str | None = None,
        wandb_entity: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        # first: without the package (or a W&B login) the run stops before it changes a file
        self.wandb = WandbRun(self.path, wandb, wandb_entity) if wandb is not None else None
        self.metrics_path = self.path / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_metrics(resume_step)
        self.writer = _tensorboard_writer(self.path / "tensorboard", resume_step) if tensorboard else None

    def write_config(self, cfg: Config) -> None:
        _atomic_write_text(self.path / "config.yaml", cfg.to_yaml())
        if self.wandb is not None:
            self.wandb.set_config(cfg.to_dict())

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one flat JSON object; mirror the numbers to TensorBoard and W&B."""
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.writer is not None:
            step = int(metrics["step"])
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(metrics)

    def read_metrics(self) -> list[dict[str, Any]]:
        """The logged rows. A last line cut short (the process was killed while appending it) is dropped
        with a warning; a bad line elsewhere is an error naming it."""
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text().split("\n")
        last = max((n for n, line in enumerate(lines) if line.strip()), default=-1)
        rows = []
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                if n != last:
                    raise ValueError(f"{str(self.metrics_path)!r} line {n + 1}: not JSON ({e})") from None
                log.warning("%s line %d is cut short (a killed write): dropping it", self.metrics_path, n + 1)
        return rows

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()

    def _truncate_metrics(self, step: int) -> None:
        """Steps after the resumed checkpoint are run again: drop their old lines."""
        kept = [m for m in self.read_metrics() if int(m["step"]) <= step]
        _atomic_write_text(self.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))


class WandbRun:
    """One run mirrored to Weights & Biases (an optional extra, imported here: DESIGN style 10).

    The W&B run id is a hash of the run directory's absolute path, so `--resume` continues the same W&B
    run. `step` is a metric that every other metric is plotted against, rather than W&B's own step: W&B
    drops rows whose own step goes backwards, and a resumed run logs again the steps after its checkpoint.
    W&B keeps its files in `RUN_DIR/wandb/`; with WANDB_MODE=offline, `wandb sync` uploads them later."""

    def __init__(self, root: Path, project: str, entity: str | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(
                f"run.wandb={project!r} needs the wandb package: pip install 'rolerl[wandb]'"
            ) from None
        self.root, self.last_step, self.wandb = root, None, wandb
        path_hash = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=project, entity=entity, dir=str(root), name=root.name, id=path_hash, resume="allow"
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def set_config(self, config: dict[str, Any]) -> None:
        # allow_val_change: a resumed run may change fields (a larger train.steps)
        self.run.config.update(config, allow_val_change=True)

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        self.last_step = metrics.get("step", self.last_step)

    def close(self) -> None:
        """Log the PNGs in the run directory as `plots/<stem>` (at the last step), then end the run:
        failed if an exception is on its way out (`close` runs in the trainer's `finally`)."""
        plots = {f"plots/{p.stem}": self.wandb.Image(str(p)) for p in sorted(self.root.glob("*.png"))}
        if plots:
            self.run.log(plots | ({"step": self.last_step} if self.last_step is not None else {}))
        self.run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)


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


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    adapters: Mapping[str, nn.Module],
    optimizer: Any,
    scheduler: Any = None,
    *,
    keep_last: int,
    extra: dict[str, Any] | None = None,
    rng: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
) -> Path:
    """Write `checkpoints/step_{step}` atomically, then delete all but the newest `keep_last`.

    `adapters`: adapter name -> the model that holds it (names are unique across models); `optimizer`: an
    `Optimizer` (state by name) or any object with `state_dict()`. `rng`: the RNG states to store
    (default: now), e.g. those captured when `step` completed. `rollout`: an asynchronous run's adapter
    versions (`RolloutPipeline.state`), stored in `state.pt` with the rest."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}-", dir=root))
        for name, model in adapters.items():
            save_adapter(model, name, tmp / "adapters" / name)
        fault_point("checkpoint", step)  # test-only: a rank killed mid-write (tests/train/test_faults.py)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng if rng is not None else rng_state(),
            "extra": extra or {},
        }
        if rollout is not None:
            state["rollout"] = rollout
        with open(tmp / "state.pt", "wb") as f:  # a file object: a write's OSError reaches `_os_error`
            torch.save(state, f)
        if final.exists():  # re-saving a step (a resumed run): replace it whole
            _delete(final)
        os.replace(tmp, final)
    except Exception as e:
        cause = _os_error(e)
        if cause is None:  # not the file system's doing: a bug, shown as it is
            raise
        raise _write_error(run_dir, root, step, cause) from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    for _, path in checkpoints(run_dir)[:-keep_last]:
        _delete(path)
    return final


def _delete(path: Path) -> None:
    """Delete checkpoint `path`: renamed to a hidden name first (atomic), so that a crash midway never
    leaves a half-deleted `step_N` that would count as a checkpoint (`clean_partial` removes the rest)."""
    gone = path.with_name(f".{path.name}.deleted")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _os_error(e: BaseException) -> OSError | None:
    """The OS error behind a failed write: `e`, or one it was raised from or while handling (torch.save's
    writer turns the file's OSError into a RuntimeError), or one safetensors names as `(os error N)`."""
    seen: BaseException | None = e
    for _ in range(8):  # a chain is short; a cycle must not loop
        if seen is None:
            return None
        if isinstance(seen, OSError):
            return seen
        if m := re.search(r"\(os error (\d+)\)", str(seen)):
            return OSError(int(m[1]), os.strerror(int(m[1])))
        seen = seen.__cause__ or seen.__context__
    return None


def _write_error(run_dir: str | Path, root: Path, step: int, e: OSError) -> CheckpointWriteError:
    """The error that says which directory failed, why (a full disk in words), and how to go on."""
    why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    kept = checkpoints(run_dir)
    left = f"step_{kept[-1][0]} is intact" if kept else "no earlier checkpoint exists"
    err = CheckpointWriteError(
        f"could not write checkpoint step_{step} in {str(root)!r}: {why} ({e}); nothing of it was kept and "
        f"{left}; free space there, then continue with rolerl train --resume {run_dir}"
    )
    err.errno = e.errno
    return err


def load_checkpoint(
    path: str | Path,
    adapters: Mapping[str, nn.Module],
    optimizer: Any,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Restore adapters, optimizer, scheduler and RNG from `path`; returns the saved state (with `step`,
    and `rollout` where an asynchronous run wrote it).

    Raises `CorruptFileError` naming the file when `state.pt` or an adapter cannot be read; `state.pt` is
    read first, so a bad one changes nothing. A checkpoint written under another topology (other adapter
    names) raises `OptimizerStateError` naming the adapters that differ, before anything is loaded."""
    path = Path(path)
    try:
        state = torch.load(path / "state.pt", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as e:
        # a truncated zip, a bad pickle: torch raises RuntimeError, UnpicklingError, EOFError
        raise CorruptFileError(path / "state.pt", "checkpoint state", e) from None
    if not isinstance(state, dict) or not {"step", "optimizer", "rng"} <= set(state):
        raise CorruptFileError(path / "state.pt", "checkpoint state", ValueError("keys missing"))
    saved = sorted(p.name for p in (path / "adapters").iterdir()) if (path / "adapters").is_dir() else []
    if saved and saved != sorted(adapters):
        raise OptimizerStateError(
            f"checkpoint {str(path)!r} holds adapters {saved} and this run's topology has {sorted(adapters)}; "
            "resume with the configuration it was written with, or start a fresh run (adapters.init can "
            "warm-start from its adapters)"
        )
    optimizer.load_state_dict(state["optimizer"])  # checks the names of the trained adapters first
    for name, model in adapters.items():
        load_adapter(model, name, path / "adapters" / name)
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state


def load_newest(
    run_dir: str | Path,
    adapters: Mapping[str, nn.Module],
    optimizer: Any,
    scheduler: Any = None,
) -> dict[str, Any] | None:
    """`load_checkpoint` of the newest checkpoint that reads back, warning about each one skipped;
    None if the run has no checkpoint. Raises `CheckpointError` naming the bad file if none reads."""
    found = checkpoints(run_dir)
    errors = []
    for step, path in reversed(found):
        try:
            return load_checkpoint(path, adapters, optimizer, scheduler)
        except (CorruptFileError, FileNotFoundError) as e:
            errors.append(e)
            log.warning("checkpoint step_%d is unusable (%s); falling back to the previous one", step, e)
    if not errors:
        return None
    older = f" (and {len(errors) - 1} older ones)" if len(errors) > 1 else ""
    raise CheckpointError(
        f"no usable checkpoint in {str(run_dir)!r}: {errors[0]}{older}; restore that file from a backup, "
        "or start the run again with --overwrite"
    )


def clean_partial(run_dir: str | Path) -> None:
    """Remove temp directories a crash left behind (they never count as checkpoints)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step_"):
                shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# What an interrupted run needs to checkpoint its last completed step


@dataclass
class Completed:
    """The last step whose update finished and whose metrics are logged, the RNG states and lr as it
    ended, and the newest step that is checkpointed."""

    step: int
    saved: int
    lr: float | None = None
    rng: dict | None = None

    def complete(self, step: int, lr: float) -> None:
        self.step, self.lr, self.rng = step, lr, rng_state()


class StepUndo:
    """Lets an interruption checkpoint the last completed step even mid-update: before a step's first
    optimizer step it copies the adapters and the optimizer state (small for LoRA), which `undo` puts back."""

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: Optimizer) -> None:
        self.params, self.optimizer = list(params), optimizer
        self.armed, self.before = False, None
        self.handle = optimizer.torch.register_step_pre_hook(self._before_step)

    def arm(self) -> None:
        self.armed, self.before = True, None

    def disarm(self) -> None:
        self.armed, self.before = False, None

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self.armed and self.before is None:
            weights = [p.detach().clone() for p in self.params]
            self.before = (weights, copy.deepcopy(self.optimizer.state_dict()))

    def undo(self) -> None:
        if self.before is not None:
            weights, state = self.before
            with torch.no_grad():
                for p, w in zip(self.params, weights, strict=True):
                    p.copy_(w)
            self.optimizer.load_state_dict(state)
            self.before = None

    def close(self) -> None:
        self.handle.remove()
