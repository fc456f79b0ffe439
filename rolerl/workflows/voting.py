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

Role metrics (`Context.measure`, `workflow/voting/<metric>`, per episode; docs/WORKFLOWS.md):
- `choice_parsed`: the aggregator's reply is a well-formed choice (neither malformed case below): the
  protocol rate a warm start is judged by (`rolerl demos voting`);
- `any_voter_correct`: some voter was right (the best available choice: an aggregator's ceiling);
- `aggregator_choice_acc`: over the episodes where some voter was right, the aggregator chose (well
  formed) a right reply; a malformed choice chose nothing and counts as wrong, whatever voter 1 wrote;
- `majority_acc`: the voters' majority answer (`task.answer_of`; ties to the first seen, replies without
  an answer do not vote: `tasks.base.majority_correct`) is right; only for tasks with `answer_of`.
The episode's accuracy is the chosen reply's, so it against `majority_acc` says whether the aggregator
beats a majority vote.

Warm start: `Voting.aggregator_demonstration` turns voter replies whose rightness the grader knows into an
imitation row for the aggregator (the prompt this workflow sends, a reply choosing a right one), for
`rolerl sft` to teach the protocol before RL; `rolerl demos voting` writes them for every role
(`demos/roles.py`).

The choice is the last `\\boxed{<integer>}` (or `\\boxed{Solution <integer>}`) of the aggregator's reply.
Malformed (counted, `workflow/voting/malformed/<case>`); for both the rule is voter 1's reply (paper 3's
last fallback, `candidates[0]`). The voters are exchangeable samples, so that is a random pick: a better
fallback (the voters' majority answer) would pay an aggregator for not choosing.
- `no_choice`: no boxed integer in the aggregator's reply;
- `bad_index`: the boxed integer is not in 1..voters.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from typing import Any

from rolerl.tasks.base import Example, Messages, Task, majority_correct
from rolerl.types import Episode
from rolerl.workflows.base import Context, derive_seed

AGGREGATOR_PROMPT = (  # paper 3's math aggregator prompt, task-neutral
    "You are an expert reviewer. Your task is to review multiple solutions to the same problem and select "
    "the best one.\n\nProblem: {problem}\n\nSolutions to review:\n{solutions}\n\nInstructions:\n"
    "1. Analyze each solution for correctness and completeness\n"
    "2. Check the reasoning and the final answer\n"
    "3. Select the solution number that is most likely correct\n"
    "4. Output your selection as \\boxed{{N}} where N is the solution number (1 to {n})"
)
CHOICE_REPLY = "Solution {i} is correct: its reasoning holds and its final answer is right.\n\n\\boxed{{{i}}}"
_CHOICE = re.compile(r"\\boxed\{\s*(?:solution\s*)?(\d+)\s*\}", re.IGNORECASE)


def problem_text(messages: Messages) -> str:
    """The problem as the task asks it: its prompt's non-system messages (the answer format is the task's
    system prompt, which the reviewing roles do not follow)."""
    return "\n\n".join(m["content"] for m in messages if m["role"] != "system")


def aggregator_messages(prompt: Messages, texts: Sequence[str]) -> Messages:
    """The aggregator's prompt: the problem of the task's `prompt` and every voter reply, numbered from 1."""
    solutions = "\n\n".join(f"--- Solution {i} ---\n{t.strip() or '(empty)'}" for i, t in enumerate(texts, 1))
    ask = AGGREGATOR_PROMPT.format(problem=problem_text(prompt), solutions=solutions, n=len(texts))
    return [{"role": "user", "content": ask}]


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
        aggregator = await ctx.generate("aggregator", aggregator_messages(prompt, texts))
        choice, case = parse_choice(ctx.text(aggregator), self.voters)
        if case is not None:
            ctx.malformed(case)
        right = [self.correct(example, t) for t in texts]
        final = right[choice]
        self.measure(ctx, texts, right, chose=None if case is not None else choice)
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

    def measure(self, ctx: Context, texts: list[str], right: list[bool], chose: int | None) -> None:
        """The aggregator's choice against the best available one and against majority vote (module doc);
        `chose`: the 0-based reply it picked, None for a malformed choice."""
        ctx.measure("choice_parsed", chose is not None)
        ctx.measure("any_voter_correct", any(right))
        if any(right):
            ctx.measure("aggregator_choice_acc", chose is not None and right[chose])
        answer_of = getattr(self.task, "answer_of", None)
        if answer_of is not None:
            votes = [(answer_of(t), ok) for t, ok in zip(texts, right, strict=True)]
            ctx.measure("majority_acc", majority_correct(votes))

    def aggregator_demonstration(
        self, example: Example, texts: Sequence[str], seed: int = 0
    ) -> dict[str, Any] | None:
        """An imitation row for the aggregator (`rolerl sft`'s JSONL format): the prompt this workflow sends
        for the voter replies `texts`, and a reply that chooses a right one, drawn uniformly among the right
        ones (seeded by `seed` and the example, so the position carries no signal); None when no reply is
        right (nothing to imitate). The replies can be real voter samples (`rolerl eval`'s samples.jsonl) or
        any solutions whose rightness the task's grader knows."""
        right = [i for i, t in enumerate(texts, 1) if self.correct(example, t)]
        if not right:
            return None
        i = random.Random(derive_seed(seed, "aggregator-demo", example.id)).choice(right)
        messages = aggregator_messages(self.task.prompt(example), texts)
        return {
            "role": "aggregator",
            "messages": [*messages, {"role": "assistant", "content": CHOICE_REPLY.format(i=i)}],
        }

    def correct(self, example: Example, text: str) -> bool:
        check = getattr(self.task, "check", None)
        return bool(check(example, text)) if check is not None else self.task.reward(example, text) >= 1.0

    def parseable(self, text: str) -> bool:
        answer_of = getattr(self.task, "answer_of", None)
        return answer_of(text) is not None if answer_of is not None else bool(text.strip())
