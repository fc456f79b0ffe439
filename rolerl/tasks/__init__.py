"""Tasks: `Task` Protocol and the name -> constructor registry the config's `task.name` selects from."""

from __future__ import annotations

from collections.abc import Callable

from rolerl.tasks.arithmetic import ArithmeticTask
from rolerl.tasks.base import Example, Messages, Task

TASKS: dict[str, Callable[[], Task]] = {"arithmetic": ArithmeticTask}

__all__ = ["TASKS", "ArithmeticTask", "Example", "Messages", "Task"]
