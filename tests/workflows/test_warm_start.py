"""Programmatic warm-start demonstrations (issue 48, item 1, begun): the voting aggregator's and the
evaluator's imitation rows carry exactly the prompt the workflow sends, and a well-formed choice of a right
voter reply or the grader's verdict."""

from __future__ import annotations

import json
from collections import Counter

from rolerl.train.sft import read_demonstrations
from rolerl.workflows.eval_opt import EvalOpt, parse_verdict
from rolerl.workflows.voting import Voting, parse_choice
from tests.workflows import test_eval_opt as eval_opt
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
