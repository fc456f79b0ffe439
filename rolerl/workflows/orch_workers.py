"""Orchestrator-workers (paper 3's `orchestrator_workers_propose`, PAPERS 1.3): an orchestrator proposes up
to `workers` different solution strategies without solving; one worker per strategy solves the whole
problem with it, all in parallel; a synthesizer compares the workers' solutions and gives the final answer.

Reward: the task's reward on the synthesizer's text, the outcome of every call (paper 3 as launched:
`use_final_outcome_reward=true` broadcasts the synthesizer's correctness; `algorithm.reward: outcome`).
Each worker's own credit (`Turn.reward`, read under `algorithm.reward: role | mix`) is the task's reward
on its own solution: it solves the full problem, so it can be graded like paper 3's Voting generators
without broadcast. Paper 3 gives the workers and the orchestrator 0.0 without broadcast ("relies on final
outcome"), which would leave them nothing to learn from; here the orchestrator has no own reward (the
outcome under `role`, 0 under `mix`). Paper 3 groups all workers of a task's n episodes as one GRPO
group: `algorithm.group_key: role`; `role_instance` would group the k-th worker of each episode, whose
strategies differ from episode to episode.

Role metrics (`Context.measure`, `workflow/orch_workers/<metric>`; docs/WORKFLOWS.md); "right" is
`task.check` (else reward >= 1) on the text:
- `plan_valid`: per episode, the plan parsed into 1 to `workers` strategies (neither malformed case);
- `worker_acc`: per worker call, its solution is right: each worker solves the whole problem, so the
  task's grader judges its reply as it judges a final answer (the strategy's own steps are not judged);
- `any_worker_correct`: per episode, some worker was right (the synthesizer's ceiling);
- `synthesizer_acc`: over the episodes where some worker was right, the final answer is right.

Warm start: `rolerl demos orch-workers` (`demos/roles.py`) writes imitation rows for every role
from the task data: a plan of "Strategy k:" lines whose first strategy follows the reference solution's
computations, a worker solving with one of them, a synthesizer giving the reference answer.

Strategies are parsed from lines that start with "Strategy k:" (any case, markdown bold or headings
around it), "k." or "k)", or a "-", "*", "+" or "•" bullet; unmarked lines continue the item above until
a blank line; text before the first item is ignored; duplicates (same words, any case or punctuation) are
dropped. The orchestrator's call stops where a `workers + 1`-th "Strategy" line would begin (`plan_stop`:
"Strategy 4" for 3 workers): after a small warm start the default model, its strategies written, went on
numbering past `workers` in 11 of 64 plans (docs/WORKFLOWS.md "Warm start"); the stop string ends the
reply it was sampled in and parses as an empty item (dropped). Malformed output (counted,
`workflow/orch_workers/malformed/<case>`):
- `no_strategies`: nothing parsed; the rule: one worker gets the plain problem (no strategy);
- `too_many_strategies`: more than `workers` distinct strategies; the first `workers` are kept;
- `empty_answer`: the synthesizer wrote nothing; graded as the empty text (0 for the built-in tasks).
"""

from __future__ import annotations

import asyncio
import re

from rolerl.tasks.base import Example, Messages, Task
from rolerl.types import Episode
from rolerl.workflows.base import Context

ORCHESTRATOR_SYSTEM = (
    "You are a problem-solving strategist. Propose at most {m} DIFFERENT strategies for solving the problem "
    "below. Do NOT solve it. Write each strategy on its own line as 'Strategy 1: ...', 'Strategy 2: ...'."
)
WORKER_NOTE = "\n\nSolve the problem using this strategy: {strategy}"
SYNTHESIZER_NOTE = (
    "\n\nWorkers solved this problem, each with a different strategy. Their solutions:\n\n{solutions}\n\n"
    "Compare the solutions (answers that agree deserve more confidence), then give the final answer in "
    "the format asked above."
)
_ITEM = re.compile(
    r"^\s*(?:[*_#>]+\s*)?(?:strategy\s*\d+\s*[:.)-]?|\d+[.)](?!\d)|[-*+•](?=\s))[*_]*\s*(.*)$", re.IGNORECASE
)


def parse_strategies(text: str) -> list[str]:
    """The distinct strategies of an orchestrator's reply, in order (uncapped; rules in the module doc)."""
    items: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if m := _ITEM.match(line):
            current = [m.group(1).strip()]
            items.append(current)
        elif not line.strip():
            current = None if current is not None and any(current) else current
        elif current is not None:
            current.append(line.strip())
    out, seen = [], set()
    for parts in items:
        strategy = " ".join(p for p in parts if p)
        key = " ".join(re.findall(r"\w+", strategy.lower()))
        if key and key not in seen:
            seen.add(key)
            out.append(strategy)
    return out


def plan_stop(workers: int) -> tuple[str, ...]:
    """The orchestrator's stop string: the start of a strategy beyond the `workers` the plan may have."""
    return (f"Strategy {workers + 1}",)


def orchestrator_messages(prompt: Messages, workers: int) -> Messages:
    """The orchestrator's prompt: the strategist's system message and the task `prompt`'s question (its
    own system prompt, the answer format, is the workers' and the synthesizer's, not the planner's)."""
    system = {"role": "system", "content": ORCHESTRATOR_SYSTEM.format(m=workers)}
    return [system, *[m for m in prompt if m["role"] != "system"]]


def synthesizer_messages(prompt: Messages, strategies: list[str], texts: list[str]) -> Messages:
    """The synthesizer's prompt: the task `prompt` with every worker's solution, labelled with its strategy
    (no strategy: the plain problem's one worker)."""
    labels = [f"Solution {i + 1} (strategy: {s})" for i, s in enumerate(strategies)] or ["Solution 1"]
    solutions = "\n\n".join(
        f"{label}:\n{t.strip() or '(empty)'}" for label, t in zip(labels, texts, strict=True)
    )
    return with_note(prompt, SYNTHESIZER_NOTE.format(solutions=solutions))


def with_note(messages: Messages, note: str) -> Messages:
    """`messages` with `note` appended to the last user message (the task's system prompt and its answer
    format stay as they are)."""
    out = [dict(m) for m in messages]
    last = next((m for m in reversed(out) if m["role"] == "user"), None)
    if last is None:
        return [*out, {"role": "user", "content": note.strip()}]
    last["content"] += note
    return out


class OrchWorkers:
    name = "orch_workers"
    roles = ("orchestrator", "worker", "synthesizer")

    def __init__(self, task: Task, workers: int = 3) -> None:
        if workers < 1:
            raise ValueError(f"orch_workers: workers={workers}; allowed: an integer >= 1")
        self.task, self.workers = task, workers

    async def run(self, ctx: Context, example: Example) -> Episode:
        plan = await ctx.generate(
            "orchestrator",
            orchestrator_messages(self.task.prompt(example), self.workers),
            stop=plan_stop(self.workers),
        )
        strategies = parse_strategies(ctx.text(plan))
        ctx.measure("plan_valid", 1 <= len(strategies) <= self.workers)
        if not strategies:
            ctx.malformed("no_strategies")
        elif len(strategies) > self.workers:
            ctx.malformed("too_many_strategies")
            strategies = strategies[: self.workers]
        prompts = [with_note(self.task.prompt(example), WORKER_NOTE.format(strategy=s)) for s in strategies]
        solved = await asyncio.gather(
            *[ctx.generate("worker", p) for p in prompts or [self.task.prompt(example)]]
        )
        texts = [ctx.text(t) for t in solved]
        for turn, text in zip(solved, texts, strict=True):
            turn.reward = self.task.reward(example, text)  # the worker's own credit (module doc)
            ctx.measure("worker_acc", self.correct(example, text))
        any_right = any(self.correct(example, t) for t in texts)
        ctx.measure("any_worker_correct", any_right)
        final = await ctx.generate(
            "synthesizer", synthesizer_messages(self.task.prompt(example), strategies, texts)
        )
        text = ctx.text(final)
        if not text.strip():
            ctx.malformed("empty_answer")
        correct = self.correct(example, text)
        if any_right:
            ctx.measure("synthesizer_acc", correct)
        reward = self.task.reward(example, text)
        return ctx.episode(example, reward, correct=correct, text=text, strategies=len(strategies))

    def correct(self, example: Example, text: str) -> bool:
        check = getattr(self.task, "check", None)
        return bool(check(example, text)) if check is not None else self.task.reward(example, text) >= 1.0
