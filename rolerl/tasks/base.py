"""What a task is: examples, a prompt for each, and a reward for a model's text (DESIGN style 4)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

Messages = list[dict[str, str]]  # chat messages: {"role": "system" | "user" | "assistant", "content": ...}


@dataclass(frozen=True)
class Example:
    """One task instance. `id` is unique within a step's batch: it is the default advantage group key."""

    id: str
    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


@runtime_checkable
class Task(Protocol):
    name: str

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """`n` examples of `split`, a pure function of `(split, n, seed)`."""
        ...

    def prompt(self, example: Example) -> Messages:
        """The chat messages the workflow sends (the chat template is applied by the workflow context)."""
        ...

    def reward(self, example: Example, text: str) -> float:
        """The outcome reward of a final text; 1.0 means solved (accuracy counts rewards >= 1)."""
        ...


def default_data_dir() -> Path:
    """Where benchmarks are read from when no path is given: `$ROLERL_SHARED_DATA`, else `shared/data`
    beside a development checkout of rolerl (as the tests' `shared_data` fixture)."""
    env = os.environ.get("ROLERL_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def majority_correct(samples: Sequence[tuple[Hashable | None, bool]]) -> bool:
    """maj@k of one problem: whether the most frequent answer among its samples is a correct one.
    `samples` are `(answer, correct)`; samples without an answer (None) do not vote. Ties go to the
    answer seen first (deterministic, and no better informed than any other rule)."""
    votes = Counter(a for a, _ in samples if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a, _ in samples if a is not None and votes[a] == top)
    return any(ok for a, ok in samples if a == winner)
