"""Tasks: `Task` Protocol and the name -> constructor registry the config's `task.name` selects from."""

from __future__ import annotations

from collections.abc import Callable

from rolerl.plugins import import_object
from rolerl.tasks.arithmetic import ArithmeticTask
from rolerl.tasks.base import Example, Messages, Task
from rolerl.tasks.jsonl import JsonlTask, jsonl_task
from rolerl.tasks.synthetic import SyntheticTask, format_task, rl_task

TASKS: dict[str, Callable[[], Task]] = {
    "arithmetic": ArithmeticTask,
    "arithmetic_lenient": lambda: ArithmeticTask(lenient=True, format_reward=0.1),
    "synthetic": rl_task,
    "synthetic_format": format_task,
}

# Benchmarks read from files (or Hugging Face dataset ids): name -> constructor of (data path or id | None).
BENCHMARKS: dict[str, Callable[[str | None], Task]] = {}


def _qa(name: str) -> Callable[[str | None], Task]:
    def build(data: str | None) -> Task:
        from rolerl.tasks.qa import qa_task  # lazily: loading the registry reads no data

        return qa_task(name, data)

    return build


def _code(name: str) -> Callable[[str | None], Task]:
    def build(data: str | None) -> Task:
        from rolerl.tasks.code import code_task

        return code_task(name, data)

    return build


def _math(name: str) -> Callable[[str | None], Task]:
    def build(data: str | None) -> Task:
        from rolerl.tasks.math import math_task

        return math_task(name, data)

    return build


for _name in ("gsm8k", "math500", "math_train", "aime24", "aime25", "amc23"):
    BENCHMARKS[_name] = _math(_name)
for _name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle"):
    BENCHMARKS[_name] = _qa(_name)
for _name in ("humaneval", "mbpp", "mbpp_sanitized"):
    BENCHMARKS[_name] = _code(_name)
BENCHMARKS["jsonl"] = jsonl_task  # your own file (tasks/jsonl.py)


def load_task(name: str, data: str | None = None) -> Task:
    """The task `name`: a benchmark (`BENCHMARKS`, reading `data`: a file, a directory, or a dataset id;
    None = its file under the default data directory), a built-in generator (`TASKS`, no data), or your own
    `package.module:factory`, called with `data` (e.g. a function returning `JsonlTask(data, reward=...)`)."""
    if ":" in name:
        task = import_object(name, "task.name")(data)
        missing = [m for m in ("name", "examples", "prompt", "reward") if not hasattr(task, m)]
        if missing:
            raise ValueError(
                f"task.name={name!r} gave a {type(task).__name__} without {missing}; a task needs name, "
                "examples(split, n, seed), prompt(example) and reward(example, text) (rolerl.tasks.Task)"
            )
        return task
    if name in BENCHMARKS:
        return BENCHMARKS[name](data)
    if name in TASKS:
        if data is not None:
            raise ValueError(f"task {name!r} generates its problems: it takes no data file ({data!r})")
        return TASKS[name]()
    raise ValueError(
        f"unknown task {name!r}; benchmarks: {sorted(BENCHMARKS)}; built-in: {sorted(TASKS)}; or package.module:"
        "factory"
    )


__all__ = [
    "BENCHMARKS",
    "TASKS",
    "ArithmeticTask",
    "Example",
    "JsonlTask",
    "Messages",
    "SyntheticTask",
    "Task",
    "load_task",
]
