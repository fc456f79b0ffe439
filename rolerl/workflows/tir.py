"""Single-agent tool-integrated reasoning (TIR): the model reasons, writes Python between the tool tags,
sees the sandbox's output spliced in by the engine (`<output>...</output>`, kind `tool_output`, no loss),
and ends with the final answer between the answer tags, e.g.

    <code>
    print(23 + 15 - 7)
    </code>
    <output>
    31
    </output>
    The answer is <answer>31</answer>.

The whole exchange is one model call (one `Turn`): tool calls happen inside generation, up to
`rollout.max_tool_calls`. The reward is the task's (`Task.reward` on the final text, which may include a
small format reward); `correct` comes from `Task.check` when the task has one. Under the `dart` preset the
tool-call tokens train the tool adapter and the rest the reasoning adapter; under `shared`, one adapter.
"""

from __future__ import annotations

from rolerl.tasks.base import Example, Task
from rolerl.types import Episode
from rolerl.workflows.base import Context


class TIR:
    name = "tir"
    roles = ("policy",)
    tool = "python"  # the engine tool it needs (`rolerl eval` and `collect` default to it)

    def __init__(self, task: Task) -> None:
        self.task = task

    async def run(self, ctx: Context, example: Example) -> Episode:
        if ctx.tool is None:
            raise ValueError("the tir workflow needs a tool: set rollout.tool (e.g. python)")
        # a task with several prompt styles (math benchmarks) gives its tool-format prompt here
        turn = await ctx.generate("policy", getattr(self.task, "tool_prompt", self.task.prompt)(example))
        text = ctx.text(turn)
        reward = self.task.reward(example, text)
        check = getattr(self.task, "check", None)
        correct = check(example, text) if check is not None else reward >= 1.0
        return ctx.episode(example, reward, correct=correct, text=text, tool_calls=len(turn.tool_calls))
