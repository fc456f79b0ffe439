"""Tasks: `Task` Protocol and the name -> constructor registry the config's `task.name` selects from."""

from __future__ import annotations

from collections.abc import Callable

from rolerl.tasks.arithmetic import ArithmeticTask
from rolerl.tasks.base import Example, Messages, Task
from rolerl.tasks.synthetic import SyntheticTask, format_task, rl_task

TASKS: dict[str, Callable[[], Task]] = {
    "arithmetic": ArithmeticTask,
    "arithmetic_lenient": lambda: ArithmeticTask(lenient=True, format_reward=0.1),
    "synthetic": rl_task,
    "synthetic_format": format_task,
}

__all__ = ["TASKS", "ArithmeticTask", "Example", "Messages", "SyntheticTask", "Task"]
