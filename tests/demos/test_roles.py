"""Programmatic warm-start demonstrations (issue 48, item 1): every role's imitation rows carry exactly the
prompt the workflow sends and a reply that follows the protocol (a right voter's index, the grader's
verdict, a plan the workflow's parser reads); `rolerl demos WORKFLOW` writes them and says what it kept."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections import Counter

import pytest

from rolerl.demos import roles as ws
from rolerl.tasks.base import Example
from rolerl.train.sft import read_demonstrations
from rolerl.workflows.eval_opt import EvalOpt, parse_verdict
from rolerl.workflows.orch_workers import OrchWorkers, parse_strategies
from rolerl.workflows.voting import Voting, parse_choice
from tests.workflows import test_eval_opt as eval_opt
from tests.workflows import test_orch_workers as orch
from tests.workflows import test_voting as voting

FIVE, SIX, NONE = "<answer>5</answer>", "<answer>6</answer>", "No idea."


def test_aggregator_demonstration_is_the_workflows_prompt_and_a_right_choice(tokenizer, tmp_path):
    texts = [SIX, FIVE, NONE, FIVE]
    _, backend = voting.run(tokenizer, "\\boxed{1}", answers=texts)
    (sent,) = [c.request for c in backend.calls if c.role == "aggregator"]
    workflow = Voting(voting.TASK, voters=len(texts))
    row = workflow.aggregator_demonstration(voting.EXAMPLE, texts)
    assert row["role"] == "aggregator" and [m["role"] for m in row["messages"]] == ["user", "assistant"]
    # the prompt ids are the ones the workflow's aggregator call was given, token for token
    ids = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]  # fmt: skip
    assert list(ids) == list(sent.prompt_ids)
    # the choice is well formed and picks a right reply (2 or 4, never the wrong 1 or the unanswered 3)
    choices = Counter()
    for seed in range(40):
        reply = workflow.aggregator_demonstration(voting.EXAMPLE, texts, seed=seed)["messages"][1]["content"]
        choice, case = parse_choice(reply, len(texts))
        assert case is None
        choices[choice + 1] += 1
    assert set(choices) == {2, 4}, "drawn among the right replies, not always the first"
    # it reads back as `rolerl sft` data
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert read_demonstrations(path) == [row]


def test_no_right_reply_gives_no_demonstration():
    assert Voting(voting.TASK).aggregator_demonstration(voting.EXAMPLE, [SIX, NONE, SIX]) is None


def test_evaluator_demonstration_is_the_first_reviews_prompt_and_the_graders_verdict(tokenizer):
    _, backend = eval_opt.run(tokenizer, [SIX, FIVE], [eval_opt.WRONG, eval_opt.RIGHT])
    sent = [c.request for c in backend.calls if c.role == "evaluator"][0]
    workflow = EvalOpt(eval_opt.TASK)
    row = workflow.evaluator_demonstration(eval_opt.EXAMPLE, SIX)
    assert row["role"] == "evaluator" and [m["role"] for m in row["messages"]] == ["user", "assistant"]
    ids = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]  # fmt: skip
    assert list(ids) == list(sent.prompt_ids)
    verdicts = [parse_verdict(workflow.evaluator_demonstration(eval_opt.EXAMPLE, t)["messages"][1]["content"])
                for t in (SIX, FIVE, NONE, "")]  # fmt: skip
    assert verdicts == [False, True, False, False]


# --- every role's demonstrations from the task data (`demos/roles.py`, `rolerl demos WORKFLOW`) ---

SOLVED = Example(  # a GSM8K-style worked solution: calculator annotations, the gold in its last step
    "arith/1",
    "What is 2 + 3?",
    "5",
    {"solution": "First 1 + 1 = <<1+1=2>>2.\nThen 2 + 3 = <<2+3=5>>5 in all."},
)


def is_right(text: str) -> bool:
    """The workflows' rightness (`task.check`, else reward >= 1) of `text` as an answer to SOLVED."""
    return Voting(voting.TASK).correct(SOLVED, text)


def test_reference_and_wrong_solutions_come_from_the_worked_solution():
    right = ws.reference_text(voting.TASK, SOLVED)
    assert right == "First 1 + 1 = 2.\nThen 2 + 3 = 5 in all.\n\nThe final answer is \\boxed{5}."
    assert is_right(right)
    for seed in range(20):
        wrong = ws.wrong_text(right, "5", random.Random(seed))
        # every standalone 5 replaced by one other number, the other numbers untouched
        value = re.search(r"\\boxed\{(-?\d+)\}", wrong).group(1)
        assert value != "5" and wrong == right.replace("5", value)
        assert not is_right(wrong)
    assert ws.wrong_text("so \\boxed{x+1}", "x+1", random.Random(0)) is None, "no number: no wrong solution"
    assert ws.reference_text(voting.TASK, voting.EXAMPLE) is None, "no worked solution, no reference"


def test_the_plan_follows_the_solution_parses_with_the_workflows_parser_and_does_not_solve():
    for seed in range(30):
        strategies = ws.plan(SOLVED, 3, random.Random(seed))
        assert 2 <= len(strategies) <= 3 and len(set(strategies)) == len(strategies)
        assert strategies[0] == "Compute step by step: 1+1, then 2+3; the last result is the answer."
        assert parse_strategies(ws.plan_text(strategies)) == strategies
        assert "5" not in ws.plan_text(strategies), "the plan names computations, never the answer"
    assert ws.plan(SOLVED, 1, random.Random(0)) == [
        "Compute step by step: 1+1, then 2+3; the last result is the answer."
    ]


def _rows(workflow, examples, tmp_path, seed=0):
    report = ws.build(workflow, examples, tmp_path / "demos.jsonl", seed=seed, progress=False)
    return report, read_demonstrations(tmp_path / "demos.jsonl")


def _solution(prompt: str, i: int) -> str:
    """Solution `i` (1-based) of an aggregator's prompt."""
    return (
        prompt.split(f"--- Solution {i} ---\n")[1].split("\n\n--- Solution")[0].split("\n\nInstructions:")[0]
    )


def test_voting_rows_the_aggregator_picks_a_right_solution_among_right_and_wrong_ones(tmp_path):
    examples = [dataclasses.replace(SOLVED, id=f"arith/{i}") for i in range(40)]
    report, rows = _rows(Voting(voting.TASK, voters=3), examples, tmp_path)
    assert report.rows == {"voter": 40, "aggregator": 40} and not report.dropped
    rights = Counter()
    for row in rows:
        prompt, reply = row["messages"][-2]["content"], row["messages"][-1]["content"]
        if row["role"] == "voter":
            assert is_right(reply) and row["messages"][:-1] == voting.TASK.prompt(SOLVED)
            continue
        choice, case = parse_choice(reply, 3)
        texts = [_solution(prompt, i) for i in (1, 2, 3)]
        right = [is_right(t) for t in texts]
        assert case is None and right[choice], "the target index is a right solution"
        rights[sum(right)] += 1
    assert set(rights) == {1, 2, 3}, "1 to 3 right solutions, so the position and the count carry no signal"


def test_eval_opt_rows_the_evaluator_gives_the_graders_verdict(tmp_path):
    examples = [dataclasses.replace(SOLVED, id=f"arith/{i}") for i in range(6)]
    report, rows = _rows(EvalOpt(eval_opt.TASK), examples, tmp_path)
    assert report.rows == {"generator": 6, "evaluator": 6}
    verdicts = []
    for row in (r for r in rows if r["role"] == "evaluator"):
        judged = row["messages"][0]["content"].split("Solution to review:\n")[1].split("\n\nInstructions:")[0]
        verdict = parse_verdict(row["messages"][1]["content"])
        assert verdict is is_right(judged)
        verdicts.append(verdict)
    assert verdicts == [True, False] * 3, "a right and a known-wrong solution in turn"


def test_orch_workers_rows_carry_the_prompts_the_workflow_sends(tokenizer, tmp_path):
    report, rows = _rows(OrchWorkers(orch.TASK, workers=3), [SOLVED], tmp_path)
    assert report.rows == {"orchestrator": 1, "worker": 1, "synthesizer": 1}
    by_role = {r["role"]: r["messages"] for r in rows}
    plan, worker, synthesis = (by_role[r] for r in ("orchestrator", "worker", "synthesizer"))
    solution = ws.reference_text(orch.TASK, SOLVED)

    # the workflow, its orchestrator replying with the demonstrated plan and its workers with the solution
    def reply(request, prompt):
        return {"orchestrator": plan[-1]["content"]}.get(request.role, solution)

    _, backend, _ = orch.run(reply, tokenizer=tokenizer)
    sent = {}
    for call in backend.calls:
        sent.setdefault(call.role, []).append(list(call.request.prompt_ids))

    def ids(messages):
        return tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]  # fmt: skip

    assert sent["orchestrator"] == [ids(plan)]
    assert ids(worker) in sent["worker"] and worker[-1]["content"] == solution
    assert parse_strategies(plan[-1]["content"]) and synthesis[-1]["content"] == solution
    assert "Workers solved this problem" in synthesis[-2]["content"]


def test_a_workflow_without_builders_or_a_task_without_solutions(tmp_path):
    from rolerl.workflows import TIR

    with pytest.raises(ValueError, match="no warm-start demonstrations for workflow 'tir'"):
        ws.build(TIR(voting.TASK), [SOLVED], tmp_path / "x.jsonl", progress=False)
    report, rows = _rows(Voting(voting.TASK), [voting.EXAMPLE], tmp_path)
    assert rows == [] and report.missing(Voting.roles) == ["voter", "aggregator"]
    assert report.dropped == {("voter", "no_reference"): 1, ("aggregator", "no_reference"): 1}


def test_cli_demos_writes_every_roles_rows_and_says_what_it_kept(tmp_path, capsys):
    from rolerl.cli import main

    out = tmp_path / "ow.jsonl"
    argv = ["demos", "orch-workers", "--task", "synthetic", "--limit", "4", "--option", "workers=2",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["rows"] == {"orchestrator": 4, "worker": 4, "synthesizer": 4} and summary["dropped"] == {}
    assert "orchestrator       4 kept" in captured.err
    rows = read_demonstrations(out)
    assert Counter(r["role"] for r in rows) == {"orchestrator": 4, "worker": 4, "synthesizer": 4}
    assert len({r["id"] for r in rows}) == 4 and Counter(r["id"] for r in rows).most_common(1)[0][1] == 3
    for row in rows:
        if row["role"] == "orchestrator":  # the synthetic task's expression is the first strategy
            assert 1 <= len(parse_strategies(row["messages"][-1]["content"])) <= 2
            assert row["messages"][-1]["content"].startswith(
                "Strategy 1: Translate the problem into one expression"
            )


def test_cli_demos_collects_roles_the_data_cannot_give(tmp_path, capsys):
    """arithmetic has no worked solutions: --samples rejection-samples its roles with the (tiny) model."""
    from rolerl.cli import main

    out = tmp_path / "v.jsonl"
    argv = ["demos", "voting", "--task", "arithmetic", "--limit", "2", "--samples", "2", "--model", "tiny:llama",
            "--max-new-tokens", "4", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["collected"]["episodes"] == 2 * 2 and summary["collected"]["examples"] == 2
    assert summary["dropped"] == {"aggregator/no_reference": 2, "voter/no_reference": 2}
    assert len(read_demonstrations(out)) == summary["collected"]["calls"] == sum(summary["rows"].values())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["voting", "--format", "tir"], "--format is for gsm8k"),
        (["voting", "--limit", "0"], "--limit 0; allowed: an integer >= 1"),
        (["voting", "--option", "judges=2"], "does not take options ['judges']"),
        (["voting", "--samples", "-1"], "--samples -1; allowed"),
        (["gsm8k"], "needs --format tir or --format msarl"),
        (["msarl", "--task", "synthetic"], "come from GSM8K's train solutions"),
        (["voting", "--task", "nope"], "unknown task 'nope'"),
    ],
)
def test_cli_demos_bad_input_is_one_clear_line(argv, message, tmp_path, capsys):
    from rolerl.cli import main

    assert main(["demos", *argv, "--out", str(tmp_path / "x.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rolerl demos: error:") and message in err
    assert not (tmp_path / "x.jsonl").exists()
