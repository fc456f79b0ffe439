"""Warm-start demonstrations for every role of a multi-role workflow (issue 48), built from the task data:
`rolerl demos voting | eval-opt | orch-workers --task gsm8k --out FILE` writes them as `rolerl sft` rows.

Before RL a small model does not follow a role's protocol (docs/WORKFLOWS.md "Warm start": the base
aggregator almost never writes `\\boxed{i}`), so RL has nothing to reward. Each row here carries exactly
the prompt the workflow sends that role (the workflows' own message builders) and a reply that follows the
protocol, made from what the task data knows:

- a *reference solution*: the task's own demonstration (`task.demonstration`, the synthetic tasks), else
  the data's worked solution (`example.meta["solution"]`, GSM8K's steps with their calculator
  annotations removed) and the gold answer in the format the task's prompt asks for; kept only if the
  task's grader says it is right;
- a *wrong solution*: the reference with every standalone occurrence of the gold number replaced by
  another number (the grader must say it is wrong), for the roles that judge solutions;
- a *plan*: "Strategy k:" lines (`orch_workers.ORCHESTRATOR_SYSTEM`'s format), the first following the
  reference's computations (GSM8K's `<<a*b=c>>` annotations, the synthetic tasks' expression), the others
  drawn from `STRATEGIES`; it must parse with the workflow's own `parse_strategies`.

Per role: voting's voter and eval_opt's generator answer the task prompt with the reference; the aggregator
chooses among `voters` solutions, 1 to `voters` of them right, in a seeded order
(`Voting.aggregator_demonstration`); the evaluator judges the reference or a wrong solution, one each in
turn, with the grader's verdict (`EvalOpt.evaluator_demonstration`); the orchestrator writes the plan, one
worker solves with one of its strategies, the synthesizer reads `workers` solutions (1 or more right) and
gives the reference. The generator's revision (the optimizer's follow-up call) has no row: `rolerl sft`
trains every assistant message of a conversation, so a revision row would also teach the wrong first
answer; the revision asks for the same answer format as the first call, which the generator rows teach.

Examples come from the train split only. Roles left without rows (a task whose data has no worked solution)
are named in the report; `rolerl demos ... --samples N` then collects them by rejection sampling
(`train/collect.py`) and appends the kept calls.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolerl.tasks.base import Example, Task
from rolerl.workflows.base import derive_seed
from rolerl.workflows.eval_opt import EvalOpt
from rolerl.workflows.orch_workers import (
    WORKER_NOTE,
    OrchWorkers,
    orchestrator_messages,
    parse_strategies,
    synthesizer_messages,
    with_note,
)
from rolerl.workflows.voting import Voting

# CLI name -> (the workflow's registry name, the option that sizes its parallel calls)
WARM_STARTS: dict[str, tuple[str, str | None]] = {
    "voting": ("voting", "voters"),
    "eval-opt": ("eval_opt", None),
    "orch-workers": ("orch_workers", "workers"),
}
SPLIT = "train"  # demonstrations never come from a held-out split
STRATEGIES = (  # task-neutral alternatives beside the reference's own computations
    "List every quantity the problem gives, then combine them one operation at a time in the order the "
    "question needs.",
    "Write one expression for the quantity asked for, built from the given numbers, and evaluate it carefully.",
    "Work backwards from the question: name the last quantity needed, then what it depends on, until only "
    "given numbers remain.",
    "Try the same steps on smaller, easier numbers first, then repeat them with the problem's numbers.",
    "Put the facts in a small table (who or what, how many, at which step) and read the answer from it.",
)
REASONS = {  # why an example gave a role no row
    "no_reference": "the task data has no worked solution for it",
    "reference_wrong": "the worked solution, in the task's answer format, is not graded right",
    "no_wrong_answer": "the gold answer is not a number, so no wrong solution could be made",
}
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


@dataclass
class Report:
    """What a build wrote: rows per role, and the examples that gave a role no row, by reason."""

    examples: int = 0
    rows: Counter[str] = field(default_factory=Counter)  # role -> rows
    dropped: Counter[tuple[str, str]] = field(default_factory=Counter)  # (role, reason) -> examples
    collected: dict[str, Any] | None = None  # `rolerl collect`'s counts, when rejection sampling ran

    def missing(self, roles: Iterable[str]) -> list[str]:
        """The roles without a single row."""
        return [r for r in roles if not self.rows[r]]

    def summary(self) -> dict[str, Any]:
        dropped = {f"{role}/{reason}": n for (role, reason), n in sorted(self.dropped.items())}
        out = {"examples": self.examples, "rows": dict(self.rows), "dropped": dropped}
        return out | ({"collected": self.collected} if self.collected is not None else {})


def reference_text(task: Task, example: Example) -> str | None:
    """A right solution in the task's answer format (module doc), or None when the data has none."""
    demonstration = getattr(task, "demonstration", None)
    if demonstration is not None:
        return demonstration(example)["messages"][-1]["content"]
    solution = example.meta.get("solution")
    if not isinstance(solution, str) or not solution.strip():
        return None
    steps = _ANNOTATION.sub("", solution).strip()
    return f"{steps}\n\n{answer_line(task, example.answer)}"


def answer_line(task: Task, answer: str) -> str:
    """The final answer as the task's prompt asks for it: a box, or its answer tags (the tool format)."""
    if getattr(task, "prompt_style", "boxed") == "boxed":
        return f"The final answer is \\boxed{{{answer}}}."
    tags = getattr(task, "tags", None)
    opened, closed = (
        (tags.answer_open, tags.answer_close) if tags and tags.answer_open else ("<answer>", "</answer>")
    )
    return f"{opened}{answer}{closed}"


def wrong_text(right: str, gold: str, rng: random.Random, avoid: Sequence[str] = ()) -> str | None:
    """`right` with the gold number replaced by a nearby other integer (not in `avoid`), or None when the
    gold is not a number."""
    try:
        value = float(gold.replace(",", ""))
    except ValueError:
        return None
    base = int(value)
    while True:
        delta = rng.choice([-1, 1]) * rng.randint(1, max(3, abs(base) // 4))
        wrong = str(base + delta if rng.random() < 0.8 else base * 10)
        if wrong not in avoid and float(wrong) != value:
            break
    pattern = re.compile(rf"(?<![\d.]){re.escape(gold)}(?![\d])")
    return pattern.sub(wrong, right)


def plan(example: Example, workers: int, rng: random.Random) -> list[str]:
    """1 to `workers` strategies (at least `workers - 1`): the reference's computations first where the
    data has them, the rest drawn from `STRATEGIES`."""
    steps = [a.strip() for a, _ in _ANNOTATION.findall(str(example.meta.get("solution", "")))]
    expr = example.meta.get("expr")
    own = []
    if steps:
        own = [f"Compute step by step: {', then '.join(steps)}; the last result is the answer."]
    elif isinstance(expr, str) and expr:
        own = [f"Translate the problem into one expression, {expr}, and evaluate it."]
    k = rng.randint(max(1, workers - 1), workers)
    return (own + rng.sample(STRATEGIES, k=min(k, len(STRATEGIES))))[:k]


def plan_text(strategies: Sequence[str]) -> str:
    return "\n".join(f"Strategy {i}: {s}" for i, s in enumerate(strategies, 1))


def _answer(role: str, messages: list[dict[str, str]], reply: str) -> dict[str, Any]:
    return {"role": role, "messages": [*messages, {"role": "assistant", "content": reply}]}


def _candidates(
    right: str, gold: str, n: int, rng: random.Random, min_right: int = 1
) -> tuple[list[str], list[bool]] | None:
    """`n` solutions, `min_right` to `n` of them right, the rest wrong with distinct wrong numbers, in a
    seeded order (None when no wrong one can be made and some must be)."""
    k = rng.randint(min_right, n)
    texts, wrongs = [right] * k, []
    for _ in range(n - k):
        wrong = wrong_text(right, gold, rng, avoid=wrongs)
        if wrong is None:
            return None
        wrongs.append(wrong)
        texts.append(wrong)
    order = rng.sample(range(n), n)
    return [texts[i] for i in order], [i < k for i in order]


def voting_rows(workflow: Voting, example: Example, right: str, rng: random.Random, report: Report) -> list:
    rows = [_answer("voter", workflow.task.prompt(example), right)]
    picked = _candidates(right, example.answer, workflow.voters, rng)
    if picked is None:
        report.dropped["aggregator", "no_wrong_answer"] += 1
        return rows
    row = workflow.aggregator_demonstration(example, picked[0], seed=rng.randrange(1 << 30))
    return rows + ([row] if row is not None else [])


def eval_opt_rows(
    workflow: EvalOpt, example: Example, right: str, rng: random.Random, report: Report
) -> list:
    rows = [_answer("generator", workflow.task.prompt(example), right)]
    judged = right if report.rows["evaluator"] % 2 == 0 else wrong_text(right, example.answer, rng)
    if judged is None:
        report.dropped["evaluator", "no_wrong_answer"] += 1
        judged = right  # the right one still teaches the verdict's format
    return rows + [workflow.evaluator_demonstration(example, judged)]


def orch_workers_rows(
    workflow: OrchWorkers, example: Example, right: str, rng: random.Random, report: Report
) -> list:
    prompt = workflow.task.prompt(example)
    strategies = plan(example, workflow.workers, rng)
    text = plan_text(strategies)
    assert parse_strategies(text) == strategies, f"a plan that does not parse: {text!r}"  # STRATEGIES' job
    rows = [_answer("orchestrator", orchestrator_messages(prompt, workflow.workers), text)]
    strategy = rng.choice(strategies)
    rows.append(_answer("worker", with_note(prompt, WORKER_NOTE.format(strategy=strategy)), right))
    picked = _candidates(right, example.answer, len(strategies), rng)
    if picked is None:
        report.dropped["synthesizer", "no_wrong_answer"] += 1
        picked = [right] * len(strategies), [True] * len(strategies)
    rows.append(_answer("synthesizer", synthesizer_messages(prompt, strategies, picked[0]), right))
    return rows


BUILDERS: dict[str, Callable[..., list]] = {
    "voting": voting_rows,
    "eval_opt": eval_opt_rows,
    "orch_workers": orch_workers_rows,
}


def build(
    workflow: Any,
    examples: Sequence[Example],
    out: str | Path,
    *,
    seed: int = 0,
    progress: bool = True,
) -> Report:
    """Write every role's demonstrations of `workflow` (a `Voting`, `EvalOpt` or `OrchWorkers`) for
    `examples` (the train split's) to `out` as JSONL; returns the report."""
    from rolerl.progress import ProgressBar
    from rolerl.tasks.synthetic import write_jsonl

    name = getattr(workflow, "name", None)
    if name not in BUILDERS:
        raise ValueError(f"no warm-start demonstrations for workflow {name!r}; built for: {sorted(BUILDERS)}")
    task, report, rows = workflow.task, Report(examples=len(examples)), []
    with ProgressBar("demos", len(examples), enabled=progress) as bar:
        for i, example in enumerate(examples, 1):
            rng = random.Random(derive_seed(seed, "warm-start", name, example.id))
            right = reference_text(task, example)
            reason = "no_reference" if right is None else None
            if right is not None and not workflow.correct(example, right):
                reason = "reference_wrong"
            if reason is not None:
                for role in workflow.roles:
                    report.dropped[role, reason] += 1
            else:
                got = BUILDERS[name](workflow, example, right, rng, report)
                report.rows.update(r["role"] for r in got)
                rows += [{**r, "id": example.id} for r in got]  # one step trains them (rolerl sft)
            bar.update(i, ", ".join(f"{r} {report.rows[r]}" for r in workflow.roles))
    write_jsonl(out, rows)
    return report


def collect_roles(spec: Any, out: str | Path, roles: Sequence[str], report: Report) -> None:
    """Rejection sampling for `roles` (`rolerl collect` with `--roles`, one correct episode per example at
    most, on `spec`'s train split): its kept calls appended to `out`, counted in `report`."""
    import json

    from rolerl.train.collect import Keep, collect

    if spec.split != SPLIT:
        raise ValueError(
            f"split={spec.split!r}; allowed: {SPLIT!r} (demonstrations never come from a held-out split)"
        )
    out = Path(out)
    tmp = out.with_name(out.name + ".collect")
    done = tmp.with_name(tmp.name + ".done")
    tmp.unlink(missing_ok=True)
    report.collected = collect(
        spec, tmp, Keep(roles=tuple(roles), max_per_example=1), log_line=lambda _: None
    )
    lines = [line for line in tmp.read_text().splitlines() if line.strip()]
    with out.open("a") as f:
        f.write("".join(line + "\n" for line in lines))
    report.rows.update(json.loads(line)["role"] for line in lines)
    tmp.unlink()
    done.unlink(missing_ok=True)


def summary_lines(report: Report, roles: Sequence[str], out: str | Path) -> list[str]:
    """The command's printout: rows per role, then each role's dropped examples by reason."""
    lines = [f"{out}: {sum(report.rows.values())} demonstrations from {report.examples} train examples"]
    for role in roles:
        lines.append(f"  {role:<13} {report.rows[role]:6d} kept")
        for (r, reason), n in sorted(report.dropped.items()):
            if r == role:
                lines.append(f"  {'':<13} {n:6d} dropped: {reason} ({REASONS[reason]})")
    if report.collected is not None:
        c = report.collected
        lines.append(
            f"  rejection sampling: {c['calls']} calls kept from {c['kept_episodes']} of {c['episodes']} "
            "episodes (correct ones)"
        )
    return lines
