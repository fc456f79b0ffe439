"""Progress for long loops (training steps, SFT steps, evaluation episodes): a rich bar with ETA on a
terminal; plain, rate-limited lines when the output goes to a file or a pipe (no control codes, no blank
lines); nothing when disabled, so callers never branch on it."""

from __future__ import annotations

import os
import sys
import time


def is_rank_zero() -> bool:
    """Whether this process is the one that reports (bars, the run's summary): rank 0 of a torchrun job, or
    a process outside torchrun. Read before the process group exists too (torchrun's `RANK`)."""
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


class ProgressBar:
    """`with ProgressBar("train", total=steps) as bar: ... bar.update(done, "reward 0.4")`.

    `update(completed, description)` may be called often (every episode, every micro-batch): on a
    terminal the bar redraws; in a file a line is written when `completed` moves and `every_s` seconds
    have passed since the last line (always for the last item), or after `idle_s` seconds of description
    updates alone.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        completed: int = 0,
        enabled: bool = True,
        transient: bool = False,
        every_s: float = 10.0,
        idle_s: float = 60.0,
    ) -> None:
        """`transient`: the bar disappears when done (for sub-steps whose result is printed anyway)."""
        self.label, self.total, self.completed, self.enabled = label, total, completed, enabled
        self.transient, self.every_s, self.idle_s = transient, every_s, idle_s
        self._bar = None
        self._plain = False
        self._last_line = time.monotonic()

    def __enter__(self) -> ProgressBar:
        if not self.enabled:
            return self
        from rich.console import Console

        console = Console(stderr=True)
        if not console.is_terminal:
            self._plain = True
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn(f"[bold]{self.label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.description}"), transient=self.transient, console=console,
        )  # fmt: skip
        self._bar.start()
        self._task = self._bar.add_task("", total=self.total, completed=self.completed)
        return self

    def update(self, completed: int, description: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, description=description)
        elif self._plain:
            now = time.monotonic()
            moved, self.completed = completed != self.completed, completed
            due = now - self._last_line >= (self.every_s if moved else self.idle_s)
            if (moved and completed >= self.total) or due:
                self._last_line = now
                text = f"{self.label} {completed}/{self.total}" + (f" {description}" if description else "")
                print(text, file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
