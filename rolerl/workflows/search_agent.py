"""The search agent (Search-R1's loop, DART's setting): one model call that reasons in `<think>`, searches
with `<search>query</search>` as often as it needs (the engine runs the `search` tool and splices the
passages in as `<information>...</information>` tool output), and answers in `<answer>`. Under the `dart`
topology the query tokens are `tool_call` tokens and train the tool adapter; the reasoning and the answer
train the reasoning adapter. Reward: the task's (EM by default); the episode records EM and F1.

Malformed output needs no special rule: a query never closed ends the call at `max_new_tokens` (reward 0),
a call over `max_tool_calls` ends with finish reason `tool_limit`, and a missing or empty `<answer>` scores
0. Each is counted in the step's metrics (`truncated_frac`, `tools/*`).
"""

from __future__ import annotations

from rolerl.roles import Tags
from rolerl.tasks.base import Example, Task
from rolerl.types import Episode
from rolerl.workflows.base import Context

SEARCH_TAGS = Tags(
    tool_open="<search>", tool_close="</search>", output_open="<information>", output_close="</information>"
)


class SearchAgent:
    name = "search_agent"
    roles = ("policy",)
    tool = "search"  # the engine tool it needs (`rolerl eval` and `collect` default to it)
    role_tags = {"policy": SEARCH_TAGS}  # its calls' tags (demonstrations are cut with them)

    def __init__(self, task: Task) -> None:
        self.task = task

    async def run(self, ctx: Context, example: Example) -> Episode:
        if ctx.tool != "search":
            raise ValueError(
                "the search_agent workflow needs the search tool: rollout.tool=search with "
                "rollout.tool_options={corpus: PASSAGES} or {url: .../retrieve} (rolerl eval: --tool search --corpus)"
            )
        prompt = getattr(self.task, "search_prompt", self.task.prompt)(example)
        turn = await ctx.generate("policy", prompt, tags=SEARCH_TAGS)
        text = ctx.text(turn)
        scores = getattr(self.task, "scores", lambda ex, t: {})(example, text)
        check = getattr(self.task, "check", None)
        correct = check(example, text) if check is not None else self.task.reward(example, text) >= 1.0
        return ctx.episode(
            example, self.task.reward(example, text), correct=correct, text=text,
            tool_calls=len(turn.tool_calls), **scores,
        )  # fmt: skip
