"""The simplest workflow: one model call on the task's prompt, rewarded by the task on the final text."""

from __future__ import annotations

from rolerl.tasks.base import Example, Task
from rolerl.types import Episode
from rolerl.workflows.base import Context


class SingleTurn:
    name = "single_turn"
    roles = ("policy",)

    def __init__(self, task: Task) -> None:
        self.task = task

    async def run(self, ctx: Context, example: Example) -> Episode:
        turn = await ctx.generate("policy", self.task.prompt(example))
        text = ctx.text(turn)
        return ctx.episode(example, self.task.reward(example, text), text=text)
