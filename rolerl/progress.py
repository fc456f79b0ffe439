"""A rich progress bar with ETA for long loops (training steps, SFT steps, evaluation episodes); a no-op
when disabled, so callers never branch on it."""

from __future__ import annotations


class ProgressBar:
    """`with ProgressBar("train", total=steps) as bar: ... bar.update(done, "reward 0.4")`."""

    def __init__(
        self, label: str, total: int, *, completed: int = 0, enabled: bool = True, transient: bool = False
    ) -> None:
        """`transient`: the bar disappears when done (for sub-steps whose result is printed anyway)."""
        self.label, self.total, self.completed, self.enabled = label, total, completed, enabled
        self.transient = transient
        self._bar = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"[bold]{self.label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.description}"), transient=self.transient,
            )  # fmt: skip
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total, completed=self.completed)
        return self

    def update(self, completed: int, description: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, description=description)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
