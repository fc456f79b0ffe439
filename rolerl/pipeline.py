"""Numbered, timed stages of a multi-stage command (`rolerl demo`, `rolerl recipe`), optionally resumable.

`Pipeline(total, log)` numbers and times each stage (`3/7 imitation warm start ...`). Given a `root`, a
finished stage leaves a marker, `root/stages/<name>.json` (its inputs, seconds and summary), written only
once the stage's own outputs are complete: a rerun skips every stage that has one, and a stage that was cut
short runs again (each stage continues its own partial work where it can: evaluations their samples.jsonl,
GRPO its newest checkpoint). A marker whose inputs differ from this run's is an error, not a silent reuse:
the stage's outputs would not be what the flags ask for. A stage's seconds are its wall time over every run
it took: one cut short (an exception, Ctrl-C, SIGTERM) leaves the time it ran in `<name>.partial.json`,
which the run that finishes it adds to its own (a kill with no chance to write loses that run's).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rolerl.files import write_json

Log = Callable[[str], None]


class Pipeline:
    def __init__(self, total: int, log: Log = print, root: str | Path | None = None) -> None:
        """`total` stages will run (for the `i/total` numbers); `root` = None: nothing is resumable."""
        self.total, self.log = total, log
        self.root = Path(root) if root is not None else None
        self.index = 0
        self.seconds: dict[str, float] = {}  # each stage's wall time (a skipped one: its first run's)
        self.skipped: list[str] = []  # the stages a rerun found finished

    def marker(self, name: str) -> Path | None:
        return None if self.root is None else self.root / "stages" / f"{name}.json"

    def run(
        self,
        name: str,
        title: str,
        fn: Callable[[], Mapping[str, Any] | None],
        inputs: Mapping[str, Any] = {},
    ) -> dict[str, Any]:
        """Run stage `name` (`fn()` returns its JSON-able summary) unless its marker says it finished with
        the same `inputs`; returns the summary (the marker's when skipped)."""
        self.index += 1
        head = f"{self.index}/{self.total} {title}"
        marker = self.marker(name)
        if marker is not None and marker.is_file():
            done = json.loads(marker.read_text())
            self._check_inputs(name, dict(done.get("inputs", {})), _jsonable(inputs))
            self.seconds[name] = float(done.get("seconds", 0.0))
            self.skipped.append(name)
            self.log(f"{head}: done already ({self.seconds[name]:.0f}s), skipped")
            return dict(done.get("summary") or {})
        partial = None if marker is None else marker.with_suffix(".partial.json")
        before = json.loads(partial.read_text()) if partial is not None and partial.is_file() else {}
        earlier, runs = float(before.get("seconds", 0.0)), int(before.get("runs", 0))
        self.log(
            head + (f" (continued: {earlier:.0f}s in {runs} earlier run{'s' * (runs != 1)})" if runs else "")
        )
        t0 = time.perf_counter()
        try:
            summary = dict(fn() or {})
        except BaseException:
            if partial is not None:
                write_json(partial, {"seconds": earlier + time.perf_counter() - t0, "runs": runs + 1})
            raise
        self.seconds[name] = earlier + time.perf_counter() - t0
        if marker is not None:
            record = {"inputs": _jsonable(inputs), "seconds": self.seconds[name], "runs": runs + 1,
                      "summary": summary, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
            write_json(marker, record)
            partial.unlink(missing_ok=True)
        return summary

    def _check_inputs(self, name: str, before: dict[str, Any], now: dict[str, Any]) -> None:
        was = differences(before, now)
        if was:
            raise ValueError(
                f"{self.root}: stage {name!r} finished with {was}; choose another output directory, or "
                f"delete {self.marker(name)} and that stage's outputs to run it again"
            )


def differences(before: Mapping[str, Any], now: Mapping[str, Any], word: str = "now") -> str:
    """The inputs that differ, as `key=before (now after), ...` ("" when none); `now` is compared as JSON
    reads it back, like a marker's."""
    now = _jsonable(now)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    return ", ".join(f"{k}={before.get(k)!r} ({word} {now.get(k)!r})" for k in changed)


def _jsonable(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """`inputs` as JSON reads them back (tuples as lists), so a marker compares equal to the same inputs."""
    return json.loads(json.dumps(dict(inputs), default=str))


def log_evaluations(
    run_dir: str | Path, rows: Mapping[int, Mapping[str, float]], tensorboard: bool = True
) -> None:
    """A pipeline's own held-out evaluations as its GRPO run's `eval/*` metrics, one row per step (0: the
    warm start), so `rolerl report` draws them beside the run's curves. `rows`: step -> metrics without
    the `eval/` prefix (`pass@1`, `stderr`, `examples`, `tool_call_rate`, ...)."""
    from rolerl.train.checkpoint import RunDir

    run = RunDir(run_dir, tensorboard=tensorboard)
    try:
        for step, row in sorted(rows.items()):
            run.log({"step": step, **{f"eval/{k}": v for k, v in row.items()}})
    finally:
        run.close()
