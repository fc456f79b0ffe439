"""Evaluator-optimizer (paper 3's `evaluator_optimizer`, PAPERS 1.3; prompts and histories of its v2): a
generator answers the task's prompt; an evaluator sees the problem and that answer and replies with
feedback and `\\boxed{Correct}` or `\\boxed{Incorrect}`; on Incorrect the generator writes a revised answer,
up to `rounds` generator calls. The evaluator judges every answer, the last one included, so the episode is
`generator, evaluator, [generator, evaluator, ...]`: paper 3's "generator and evaluator counts are always
equal per episode" (its loop stops after the `rounds`-th review). The final answer is the last generator's.

Each role keeps its own conversation, token in, token out (`ctx.follow_up`): a revision continues the
generator's previous call's exact ids with the reviewer's whole reply as a user message; a later review
continues the evaluator's previous call with the new answer (paper 3's v2: per-agent histories, the
evaluator's prompt embedding the problem and the solution, the feedback embedded in the refinement prompt).

Credit. The task's reward on the final answer is the outcome, broadcast under `algorithm.reward: outcome`
(paper 3 as launched). Each call's own reward (`Turn.reward`, under `role` and `mix`) is paper 3's without
broadcast: a generator call's is the task's reward on its own answer; an evaluator call's is 1 if its
verdict matches the true correctness of the answer it judged (`task.check`, else reward >= 1), else 0.

Role metrics (`Context.measure`, `workflow/eval_opt/<metric>`; docs/WORKFLOWS.md); "right" is `task.check`
(else reward >= 1) on the answer:
- `verdict_parsed`: per review, it holds a verdict (not `no_verdict`): the protocol rate a warm start is
  judged by (`rolerl demos eval-opt`);
- `evaluator_verdict_acc`: per review, its verdict matches the rightness of the answer it judged (no
  verdict: a miss), the evaluator call's own reward;
- `generator_first_acc`: per episode, the first answer is right (the final accuracy minus it is the
  loop's net gain);
- `revision_wrong_to_right`: per revision of a wrong answer, the revision is right;
- `revision_right_to_wrong`: per revision of a right answer (the evaluator wrongly said Incorrect), the
  revision is wrong.

Warm start: `EvalOpt.evaluator_demonstration` turns an answer whose rightness the grader knows into an
imitation row for the evaluator (the first review's prompt, the grader's verdict), for `rolerl sft`;
`rolerl demos eval-opt` writes them for every role (`demos/roles.py`).

Malformed (counted, `workflow/eval_opt/malformed/<case>`):
- `no_verdict`: no `\\boxed{Correct}` / `\\boxed{Incorrect}` in the review (the last one counts); the rule is
  paper 3's (an unknown verdict is "not satisfied"): treated as Incorrect, so the generator revises with the
  reply as feedback, and the evaluator's own reward is 0 (its verdict matches neither);
- `empty_answer`: a generator call wrote nothing; it is judged and graded as the empty text.
"""

from __future__ import annotations

import re
from typing import Any

from rolerl.tasks.base import Example, Task
from rolerl.types import Episode
from rolerl.workflows.base import Context
from rolerl.workflows.voting import problem_text

EVALUATOR_PROMPT = (  # paper 3's v2 math critique prompt, task-neutral
    "You are a reviewer checking a solution for correctness.\n\nProblem: {problem}\n\n"
    "Solution to review:\n{solution}\n\nInstructions:\n"
    "- Check the reasoning for correctness\n"
    "- Provide your verdict as \\boxed{{Correct}} or \\boxed{{Incorrect}}\n"
    "- If incorrect, point out where the reasoning goes wrong and explain why it is flawed\n"
    "- Do NOT solve the problem yourself or reveal the correct answer"
)
REFINE_PROMPT = (  # paper 3's v2 refinement prompt; the answer format is the one asked at the start
    "A reviewer identified an issue in your solution:\n\n{feedback}\n\n"
    "Revise your solution to fix the identified issue. Keep the parts that are correct, fix the flawed part "
    "and what depends on it, and give the final answer in the format asked above."
)
VERDICT_REPLY = {  # a warm start's evaluator replies (`EvalOpt.evaluator_demonstration`)
    True: "The reasoning holds and the final answer is right.\n\n\\boxed{Correct}",
    False: "The final answer is wrong: recheck each step of the computation that leads to it.\n\n\\boxed{Incorrect}",
}
_VERDICT = re.compile(r"\\boxed\{\s*(?:\\text(?:bf)?\{\s*)?(correct|incorrect)\b", re.IGNORECASE)


def parse_verdict(text: str) -> bool | None:
    """True for Correct, False for Incorrect (the review's last boxed verdict), None for neither."""
    found = _VERDICT.findall(text)
    return found[-1].lower() == "correct" if found else None


class EvalOpt:
    name = "eval_opt"
    roles = ("generator", "evaluator")

    def __init__(self, task: Task, rounds: int = 3) -> None:
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
            raise ValueError(f"eval_opt: rounds={rounds!r}; allowed: an integer >= 1")
        self.task, self.rounds = task, rounds

    async def run(self, ctx: Context, example: Example) -> Episode:
        prompt = self.task.prompt(example)
        answer = await ctx.generate("generator", prompt)
        review, was = None, None  # was: the previous answer's rightness
        for r in range(self.rounds):
            text = ctx.text(answer)
            ok = self.correct(example, text)
            if was is None:
                ctx.measure("generator_first_acc", ok)
            else:
                ctx.measure("revision_right_to_wrong" if was else "revision_wrong_to_right", ok != was)
            was = ok
            if not text.strip():
                ctx.malformed("empty_answer")
            ask = EVALUATOR_PROMPT.format(problem=problem_text(prompt), solution=text.strip() or "(empty)")
            asked = [{"role": "user", "content": ask}]  # a later review continues the evaluator's own call
            review = await ctx.generate(
                "evaluator", asked if review is None else ctx.follow_up(review, asked)
            )
            feedback = ctx.text(review)
            verdict = parse_verdict(feedback)
            if verdict is None:
                ctx.malformed("no_verdict")
            answer.reward = self.task.reward(example, text)  # the generator call's own credit
            review.reward = 1.0 if verdict == ok else 0.0
            ctx.measure("verdict_parsed", verdict is not None)
            ctx.measure("evaluator_verdict_acc", verdict == ok)
            if verdict is True or r == self.rounds - 1:
                break
            note = REFINE_PROMPT.format(feedback=feedback.strip() or "(no feedback)")
            answer = await ctx.generate(
                "generator", ctx.follow_up(answer, [{"role": "user", "content": note}])
            )
        return ctx.episode(  # the last answer: the loop always ends with a review of it
            example, self.task.reward(example, text), correct=ok, text=text,
            rounds=r + 1,
        )  # fmt: skip

    def evaluator_demonstration(self, example: Example, text: str) -> dict[str, Any]:
        """An imitation row for the evaluator (`rolerl sft`'s JSONL format): the first review's prompt this
        workflow sends for the answer `text`, and the verdict the task's grader gives it (`VERDICT_REPLY`).
        The answers can be real generator samples or any solutions whose rightness the grader knows."""
        ask = EVALUATOR_PROMPT.format(
            problem=problem_text(self.task.prompt(example)), solution=text.strip() or "(empty)"
        )
        reply = VERDICT_REPLY[self.correct(example, text)]
        return {
            "role": "evaluator",
            "messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}],
        }

    def correct(self, example: Example, text: str) -> bool:
        check = getattr(self.task, "check", None)
        return bool(check(example, text)) if check is not None else self.task.reward(example, text) >= 1.0
