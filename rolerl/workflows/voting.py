"""Voting (paper 3's `voting`, PAPERS 1.3): `voters` calls answer the task's own prompt in parallel (one
`asyncio.gather`, so the engine batches them), then an aggregator sees the problem and every voter's full
reply, numbered, and picks one with `\\boxed{i}` (1-based). The episode's reward is the task's reward on the
chosen reply.

Credit. `algorithm.reward: outcome` broadcasts that reward to every call (paper 3 as launched,
`use_final_outcome_reward=true`). Each call's own reward (`Turn.reward`, read under `role` and `mix`) is
paper 3's without broadcast: a voter's is the task's reward on its own reply; the aggregator's is the
outcome (no own reward). With `rubric=True` it is `voting_v2`'s rubric instead:
- voter: +0.5 if its own answer is correct, +0.5 if the chosen answer is correct, -1 if its own answer is
  wrong and parseable (`task.answer_of(text)` is not None where the task has `answer_of`, the math
  workflow's "has a `\\boxed{`"; else a non-empty reply, the rubric's default);
- aggregator: 0 if no voter was correct, else +1 if it chose a correct answer, -1 if not (a malformed
  choice chose nothing: -1).
"Correct" is `task.check` where the task has one, else reward >= 1. The voters' calls are the episode's
first turns in voter order, so under `algorithm.group_key: role_instance` voter k of every episode of a
task is one advantage group (paper 3's `generator0/1/2`, PAPERS 1.4); `role` pools all voters.

The choice is the last `\\boxed{<integer>}` (or `\\boxed{Solution <integer>}`) of the aggregator's reply.
Malformed (counted, `workflow/voting/malformed/<case>`); for both the rule is voter 1's reply (paper 3's
last fallback, `candidates[0]`). The voters are exchangeable samples, so that is a random pick: a better
fallback (the voters' majority answer) would pay an aggregator for not choosing.
- `no_choice`: no boxed integer in the aggregator's reply;
- `bad_index`: the boxed integer is not in 1..voters.
"""

from __future__ import annotations

import asyncio
import re

from rolerl.tasks.base import Example, Messages, Task
from rolerl.types import Episode
from rolerl.workflows.base import Context

AGGREGATOR_PROMPT = (  # paper 3's math aggregator prompt, task-neutral
    "You are an expert reviewer. Your task is to review multiple solutions to the same problem and select "
    "the best one.\n\nProblem: {problem}\n\nSolutions to review:\n{solutions}\n\nInstructions:\n"
    "1. Analyze each solution for correctness and completeness\n"
    "2. Check the reasoning and the final answer\n"
    "3. Select the solution number that is most likely correct\n"
    "4. Output your selection as \\boxed{{N}} where N is the solution number (1 to {n})"
)
_CHOICE = re.compile(r"\\boxed\{\s*(?:solution\s*)?(\d+)\s*\}", re.IGNORECASE)


def problem_text(messages: Messages) -> str:
    """The problem as the task asks it: its prompt's non-system messages (the answer format is the task's
    system prompt, which the reviewing roles do not follow)."""
    return "\n\n".join(m["content"] for m in messages if m["role"] != "system")


def parse_choice(text: str, n: int) -> tuple[int, str | None]:
    """The 0-based candidate an aggregator's reply picks and None, or voter 1 and the malformed case."""
    found = _CHOICE.findall(text)
    if not found:
        return 0, "no_choice"
    i = int(found[-1])
    return (i - 1, None) if 1 <= i <= n else (0, "bad_index")


class Voting:
    name = "voting"
    roles = ("voter", "aggregator")

    def __init__(self, task: Task, voters: int = 3, rubric: bool = False) -> None:
        if not isinstance(voters, int) or isinstance(voters, bool) or voters < 1:
            raise ValueError(f"voting: voters={voters!r}; allowed: an integer >= 1")
        if not isinstance(rubric, bool):
            raise ValueError(f"voting: rubric={rubric!r}; allowed: true or false")
        self.task, self.voters, self.rubric = task, voters, rubric

    async def run(self, ctx: Context, example: Example) -> Episode:
        prompt = self.task.prompt(example)  # every voter gets the identical prompt (paper 3)
        voters = await asyncio.gather(*[ctx.generate("voter", prompt) for _ in range(self.voters)])
        texts = [ctx.text(t) for t in voters]
        solutions = "\n\n".join(
            f"--- Solution {i} ---\n{t.strip() or '(empty)'}" for i, t in enumerate(texts, 1)
        )
        ask = AGGREGATOR_PROMPT.format(problem=problem_text(prompt), solutions=solutions, n=self.voters)
        aggregator = await ctx.generate("aggregator", [{"role": "user", "content": ask}])
        choice, case = parse_choice(ctx.text(aggregator), self.voters)
        if case is not None:
            ctx.malformed(case)
        right = [self.correct(example, t) for t in texts]
        final = right[choice]
        for turn, text, ok in zip(voters, texts, right, strict=True):
            if self.rubric:
                turn.reward = 0.5 * ok + 0.5 * final - 1.0 * (not ok and self.parseable(text))
            else:
                turn.reward = self.task.reward(example, text)
        if self.rubric:
            aggregator.reward = 0.0 if not any(right) else 1.0 if final and case is None else -1.0
        return ctx.episode(
            example, self.task.reward(example, texts[choice]), correct=final, text=texts[choice],
            choice=choice + 1, voters_correct=sum(right),
        )  # fmt: skip

    def correct(self, example: Example, text: str) -> bool:
        check = getattr(self.task, "check", None)
        return bool(check(example, text)) if check is not None else self.task.reward(example, text) >= 1.0

    def parseable(self, text: str) -> bool:
        answer_of = getattr(self.task, "answer_of", None)
        return answer_of(text) is not None if answer_of is not None else bool(text.strip())
