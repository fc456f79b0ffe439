"""What a task is: examples, a prompt for each, and a reward for a model's text (DESIGN style 4)."""

from __future__ import annotations

import os
import random
import zlib
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
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


class Subset:
    """`task` with its `split` cut to the examples `keep` accepts (RL drawing only easier problems, say);
    every other split, and everything else, as `task`'s. The task must tell its split's size (`size`).
    `examples` is a seeded shuffle of the kept pool cut at `n`, as `MathTask`'s: a pure function of
    `(split, n, seed)`."""

    def __init__(self, task: Any, split: str, keep: Callable[[Example], bool], about: str = "kept") -> None:
        if not callable(getattr(task, "size", None)):
            raise ValueError(f"{task.name}: a subset needs the task's split size (a `size(split)` method)")
        everything = task.examples(split, task.size(split), 0)
        self.task, self.split, self.about = task, split, about
        self.pool = sorted((e for e in everything if keep(e)), key=lambda e: e.id)
        self.total = len(everything)
        if not self.pool:
            raise ValueError(f"{task.name}/{split}: none of its {self.total} examples is {about}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def size(self, split: str) -> int:
        return len(self.pool) if split == self.split else self.task.size(split)

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        if split != self.split:
            return self.task.examples(split, n, seed)
        if not 0 <= n <= len(self.pool):
            raise ValueError(
                f"{self.task.name}/{split}: n={n}; allowed: 0 <= n <= {len(self.pool)} (the examples {self.about})"
            )
        order = list(range(len(self.pool)))
        random.Random(zlib.crc32(f"{self.task.name}/{split}/{seed}/subset".encode())).shuffle(order)
        return [self.pool[i] for i in order[:n]]
