"""A task from your own JSONL file, scored by your own reward function (docs/guides/own-workflow.md).

One example per line: `{"question": ..., "answer": ...}`, optionally `"id"` (default: the line number) and
`"split"` (default `train`; rows with `"split": "test"` are what `eval.split: test` evaluates on); any other
key goes to `Example.meta`, where your reward can read it. The prompt is a system message asking for the
answer in `<answer></answer>` tags, then the question.

    task: {name: jsonl, data: data.jsonl}                 # the default reward: exact match in <answer> tags
    task: {name: "my_task:make_task", data: data.jsonl}   # your factory: JsonlTask(data, reward=my_reward)

A reward is a plain function `(example, text) -> float` (DESIGN style 4): 1.0 means solved (accuracy
counts rewards >= 1); partial credit below 1 gives GRPO a signal before the model solves anything.
"""

from __future__ import annotations

import json
import math
import random
import re
import zlib
from collections.abc import Callable
from pathlib import Path

from rolerl.tasks.base import Example, Messages

SYSTEM = (
    "Answer the question. Put the final answer inside <answer></answer> tags, e.g. <answer>Paris</answer>."
)
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

Reward = Callable[[Example, str], float]


def tagged_answer(text: str) -> str | None:
    """The last `<answer>...</answer>` of `text`, stripped, or None."""
    found = _TAGGED.findall(text)
    return found[-1].strip() if found else None


def normalise(text: str) -> str:
    """Lower case, one space between words, no trailing full stop: `" Paris. "` -> `"paris"`."""
    return " ".join(text.lower().split()).rstrip(".")


def exact_match(example: Example, text: str) -> float:
    """The default reward: 1.0 when the last `<answer>` equals the example's answer (`normalise`d), else 0."""
    answer = tagged_answer(text)
    return float(answer is not None and normalise(answer) == normalise(example.answer))


class JsonlTask:
    """The rows of `data` (a `.jsonl` file) as a `Task`, rewarded by `reward` (default `exact_match`).

    `examples(split, n, seed)` draws `n` rows of `split` without replacement, a pure function of its
    arguments; `size(split)` lets `rolerl eval` run a whole split without `--limit`."""

    def __init__(
        self,
        data: str | Path,
        reward: Reward | None = None,
        *,
        name: str = "jsonl",
        system: str | None = SYSTEM,
    ) -> None:
        if reward is not None and not callable(reward):
            raise ValueError(f"reward={reward!r}; allowed: a function (example, text) -> float, or None")
        self.path, self.name, self.system = Path(data), name, system
        self.reward_fn: Reward = reward or exact_match
        self.rows = read_examples(self.path, name)

    def pool(self, split: str) -> list[Example]:
        return [e for e in self.rows if e.meta["split"] == split]

    def size(self, split: str) -> int:
        return len(self.pool(split))

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        pool = self.pool(split)
        if not pool:
            splits = sorted({e.meta["split"] for e in self.rows})
            raise ValueError(
                f'{self.path} has no rows with "split": {split!r}; it has {splits} (a row without '
                '"split" is in train)'
            )
        if not 0 <= n <= len(pool):
            raise ValueError(f"n={n}; {self.path} has {len(pool)} {split!r} rows (drawn without replacement)")
        rng = random.Random(zlib.crc32(f"{self.name}/{split}/{seed}".encode()))
        return [pool[i] for i in rng.sample(range(len(pool)), n)]

    def prompt(self, example: Example) -> Messages:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": example.question}]

    def answer_of(self, text: str) -> str | None:
        """The final answer, normalised (what maj@k votes on), or None."""
        answer = tagged_answer(text)
        return None if answer is None else normalise(answer)

    def reward(self, example: Example, text: str) -> float:
        value = self.reward_fn(example, text)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            name = getattr(self.reward_fn, "__qualname__", repr(self.reward_fn))
            raise ValueError(
                f"the reward function {name} returned {value!r} for example {example.id!r}; it must return a "
                "finite number (1.0 = solved)"
            )
        return float(value)


def read_examples(path: Path, name: str) -> list[Example]:
    """Every row of the JSONL file `path`; a bad row is an error naming its line and what it needs."""
    if not path.is_file():
        raise ValueError(f"task data {str(path)!r} is not a file: give a JSONL file (task.data)")
    out, seen = [], set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f'{where}: a row must be a JSON object with "question" and "answer"')
        question, answer = row.pop("question", None), row.pop("answer", None)
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f'{where}: "question" must be a non-empty string; got {question!r}')
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise ValueError(f'{where}: "answer" must be a non-empty string or a number; got {answer!r}')
        split = row.setdefault("split", "train")
        if not isinstance(split, str) or not split:
            raise ValueError(f'{where}: "split" must be a non-empty string; got {split!r}')
        key = str(row.pop("id", lineno))
        if key in seen:
            raise ValueError(f'{where}: "id" {key!r} is already used by an earlier row; ids must be unique')
        seen.add(key)
        out.append(Example(f"{name}/{key}", question, str(answer), row))
    if not out:
        raise ValueError(f'{path}: no rows (one JSON object per line: {{"question": ..., "answer": ...}})')
    return out


def jsonl_task(data: str | None) -> JsonlTask:
    """`task.name: jsonl`: the file `task.data`, rewarded by exact match of the `<answer>` tag."""
    if data is None:
        raise ValueError("task.name='jsonl' needs task.data: the path of your JSONL file")
    return JsonlTask(data)
