"""What the RL loop tells its user while it runs: a step's episode metrics (rewards, tools, per role and
per kind), progress inside a long step (rollout tokens, update micro-batches) and a loud, once-per-run
warning when the tool is broken rather than the model's code."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rolerl.roles import KINDS, POLICY_KINDS, PROMPT
from rolerl.rollout.scheduler import RolloutBackend
from rolerl.types import Episode
from rolerl.workflows.base import pooled_measures

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


def episode_metrics(episodes: Sequence[Episode], policy: Any, workflow: str = "workflow") -> dict[str, float]:
    """Rewards, accuracy, lengths, tools, per-role and per-kind counts of a step's episodes, each kind of
    malformed output the workflow met (`workflow/<name>/malformed/<case>`: per episode), and each role's
    own metric the workflow measured (`workflow/<name>/<metric>`, `Context.measure`: docs/WORKFLOWS.md)."""
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    turns = [t for e in episodes for t in e.turns]
    calls = [c for t in turns for c in t.tool_calls]
    out = {
        "reward/mean": float(rewards.mean()) if len(rewards) else math.nan,
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": sum(_correct(e) for e in episodes) / max(len(episodes), 1),
        "episodes": float(len(episodes)),
        "response_length/mean": sum(len(t.completion_ids) for t in turns) / max(len(turns), 1),
        "truncated_frac": sum(t.finish_reason == "length" for t in turns) / max(len(turns), 1),
        "tools/calls": float(len(calls)),
        "tools/errors": float(sum(c.error for c in calls)),  # the code failed, or the tool did
        "tools/error_rate": sum(c.error for c in calls) / len(calls) if calls else 0.0,
        "tools/failures": float(sum(c.tool_failed for c in calls)),  # the tool itself failed
        "tools/timeouts": float(sum(c.timed_out for c in calls)),
    }
    for role in policy.route_of:
        mine = [t for t in turns if t.role == role]
        out[f"role/{role}/turns"] = float(len(mine))
        rewards_of = [e.own_reward(t) for e in episodes for t in e.turns if t.role == role]
        if rewards_of:
            out[f"role/{role}/reward_mean"] = sum(rewards_of) / len(rewards_of)
        out[f"role/{role}/tokens"] = float(sum(k in POLICY_KINDS for t in mine for k in t.kinds))
        acted = [e for e in episodes if any(t.role == role for t in e.turns)]
        if acted:  # the outcome of the episodes the role took part in
            out[f"role/{role}/accuracy"] = sum(_correct(e) for e in acted) / len(acted)
    malformed: Counter[str] = Counter()
    for e in episodes:
        malformed.update(e.metadata.get("malformed", {}))
    for case, count in sorted(malformed.items()):
        out[f"workflow/{workflow}/malformed/{case}"] = count / max(len(episodes), 1)
    for metric, value in pooled_measures([e.metadata.get("measures", {}) for e in episodes]).items():
        out[f"workflow/{workflow}/{metric}"] = value
    kinds = Counter(k for t in turns for k in t.kinds)
    for kind in KINDS:
        if kind != PROMPT:
            out[f"kind/{kind}/tokens"] = float(kinds[kind])
    return out


def _correct(episode: Episode) -> bool:
    return bool(episode.metadata.get("correct", episode.reward >= 1.0))
