"""What the RL loop tells its user while it runs: progress inside a long step (rollout tokens, update
micro-batches) and a loud, once-per-run warning when the tool is broken rather than the model's code."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from rolerl.rollout.scheduler import RolloutBackend
from rolerl.types import Episode

log = logging.getLogger(__name__)


class ToolHealth:
    """Says once, loudly, when a run's tool is broken rather than the model's code: a call on which the
    tool itself failed (its exception became the model's observation), or a step in which nearly every
    call errored. The step metrics carry `tools/error_rate` and `tools/failures` either way."""

    HIGH_ERROR_RATE, MIN_CALLS = 0.9, 16

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, step: int, episodes: Sequence[Episode]) -> None:
        calls = [c for e in episodes for t in e.turns for c in t.tool_calls]
        failed = [c for c in calls if c.tool_failed]
        if failed and "failed" not in self.warned:
            self.warned.add("failed")
            log.warning(
                "step %d: the %s tool itself failed on %d of %d calls (first: %s); the model saw that "
                "error as tool output",
                step, failed[0].name, len(failed), len(calls), failed[0].output.strip()[:200],
            )  # fmt: skip
        errors = sum(c.error for c in calls)
        high = len(calls) >= self.MIN_CALLS and errors >= self.HIGH_ERROR_RATE * len(calls)
        if high and "rate" not in self.warned:
            self.warned.add("rate")
            log.warning(
                "step %d: %d of %d tool calls errored (first output: %s); check the tool and the prompt "
                "if this persists",
                step, errors, len(calls), next(c for c in calls if c.error).output.strip()[:200],
            )  # fmt: skip


def sampled_tokens(backend: RolloutBackend) -> int:
    """Tokens the backend's local engines have sampled so far (0 for a backend without one)."""
    if hasattr(backend, "backends"):  # ModelRouter: one backend per model
        return sum(sampled_tokens(b) for b in backend.backends.values())
    engines = getattr(backend, "engines", None) or {"main": backend.__dict__.get("engine")}
    return sum(int(e.stats["decode_rows"]) for e in engines.values() if e is not None)


@contextlib.contextmanager
def ticker(tick: Callable[[], None], every_s: float = 0.5):
    """Call `tick` every `every_s` seconds from a daemon thread while the block runs (progress texts)."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            tick()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
