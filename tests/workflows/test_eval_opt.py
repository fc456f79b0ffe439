"""Evaluator-optimizer on the scripted backend: the turn structure (equal generator and evaluator counts,
stop on Correct, the rounds cap), each role's prompt continuing its own previous call's exact ids, rewards
and group keys under each credit rule, the malformed cases; then training runs on the tiny model and
(slow) on the default model."""

from __future__ import annotations

import asyncio

import pytest

from rolerl.config import AlgorithmConfig, load_config
from rolerl.roles import KINDS
from rolerl.rollout.sampling import SamplingParams
from rolerl.tasks import ArithmeticTask
from rolerl.tasks.base import Example
from rolerl.train.checkpoint import RunDir
from rolerl.train.credit import turn_rewards
from rolerl.train.rl import train
from rolerl.workflows import load_workflow
from rolerl.workflows.base import Context
from rolerl.workflows.eval_opt import EvalOpt, parse_verdict
from tests.train.test_rl import TINY
from tests.workflows.scripted import ScriptedBackend

TASK = ArithmeticTask()
EXAMPLE = Example("arith/0", "What is 2 + 3?", "5")
ROUTES = {role: dict.fromkeys(KINDS, i) for i, role in enumerate(EvalOpt.roles)}
WRONG = "Step 2 is off. \\boxed{Incorrect}"
RIGHT = "Fine. \\boxed{Correct}"


def run(tokenizer, answers, reviews, rounds: int = 3):
    """One episode: the generator's k-th call replies `answers[k]`, the evaluator's k-th `reviews[k]` (each
    role's k-th call is told by how many revisions / reviews its prompt already holds)."""

    def reply(request, prompt: str) -> str:
        if request.role == "generator":
            return answers[prompt.count("A reviewer identified an issue")]
        return reviews[prompt.count("Solution to review:") - 1]

    backend = ScriptedBackend(tokenizer, reply)
    ctx = Context(backend, tokenizer, ROUTES, SamplingParams(), 0)
    return asyncio.run(EvalOpt(TASK, rounds=rounds).run(ctx, EXAMPLE)), backend


def test_parse_verdict():
    assert parse_verdict("ok \\boxed{Correct}") is True
    assert parse_verdict("\\boxed{ incorrect }") is False
    assert parse_verdict("\\boxed{\\text{Correct}}") is True
    assert parse_verdict("not \\boxed{Correct} but \\boxed{Incorrect}") is False, "the last verdict"
    assert parse_verdict("Correct.") is None and parse_verdict("\\boxed{5}") is None


def test_a_revision_continues_each_roles_own_conversation(tokenizer):
    episode, backend = run(tokenizer, ["<answer>6</answer>", "<answer>5</answer>"], [WRONG, RIGHT])
    assert [t.role for t in episode.turns] == ["generator", "evaluator", "generator", "evaluator"]
    gen0, eval0, gen1, eval1 = episode.turns
    plain = tokenizer.apply_chat_template(TASK.prompt(EXAMPLE), add_generation_prompt=True, tokenize=False)
    assert backend.calls[0].prompt == plain, "the generator starts from the task's own prompt"
    review = backend.calls[1].prompt
    assert "Problem: What is 2 + 3?\n\nSolution to review:\n<answer>6</answer>\n\nInstructions:" in review
    assert "<answer></answer> tags" not in review, "the evaluator sees the problem, not the answer format"
    # token in, token out: the revision starts with the previous generator call's exact ids, then the review
    assert gen1.prompt_ids[: len(gen0.ids)] == gen0.ids
    rest = tokenizer.decode(gen1.prompt_ids[len(gen0.ids) :])
    assert "A reviewer identified an issue in your solution:\n\nStep 2 is off. \\boxed{Incorrect}\n\n" in rest
    assert rest.endswith("<|im_start|>assistant\n")
    # the second review continues the evaluator's first call with the revised answer
    assert eval1.prompt_ids[: len(eval0.ids)] == eval0.ids
    assert "Solution to review:\n<answer>5</answer>" in tokenizer.decode(eval1.prompt_ids[len(eval0.ids) :])
    assert episode.reward == 1.0 and episode.metadata["correct"] and episode.metadata["rounds"] == 2
    assert episode.metadata["text"] == "<answer>5</answer>" and "malformed" not in episode.metadata


def test_turn_counts_stop_on_correct_and_at_the_cap(tokenizer):
    episode, _ = run(tokenizer, ["<answer>5</answer>"], [RIGHT])
    assert [t.role for t in episode.turns] == ["generator", "evaluator"] and episode.metadata["rounds"] == 1
    # never Correct: `rounds` answers, each judged, the last one too (equal counts, as in paper 3)
    episode, _ = run(
        tokenizer, ["<answer>6</answer>", "<answer>5</answer>", "<answer>7</answer>"], [WRONG] * 3
    )
    assert [t.role for t in episode.turns] == ["generator", "evaluator"] * 3
    assert episode.metadata["rounds"] == 3 and episode.metadata["text"] == "<answer>7</answer>"
    assert episode.reward == 0.0, "the final answer is the last generator's"
    episode, _ = run(tokenizer, ["<answer>6</answer>"], [WRONG], rounds=1)
    assert [t.role for t in episode.turns] == ["generator", "evaluator"]


def test_rewards_and_group_keys_under_each_credit_rule(tokenizer):
    fixed, _ = run(tokenizer, ["<answer>6</answer>", "<answer>5</answer>"], [WRONG, RIGHT])
    broken, _ = run(
        tokenizer, ["<answer>6</answer>", "<answer>5</answer>", "<answer>7</answer>"], [WRONG] * 3
    )
    # own rewards: each answer's reward; each review 1 if its verdict matches that answer's correctness
    assert [t.reward for t in fixed.turns] == [0.0, 1.0, 1.0, 1.0]
    assert [t.reward for t in broken.turns] == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    want = {
        "outcome": [1] * 4 + [0] * 6,
        "role": [0, 1, 1, 1] + [0, 1, 1, 0, 0, 1],
        "mix": [0.5, 1.5, 1.5, 1.5] + [0, 1, 1, 0, 0, 1],  # 0.5 x outcome + own
    }
    for rule, rewards in want.items():
        credit = turn_rewards([fixed, broken], AlgorithmConfig(reward=rule, mix_alpha=0.5))
        assert credit.rewards.tolist() == rewards, rule
    keys = turn_rewards([broken], AlgorithmConfig(group_key="role")).keys
    assert keys == [("arith/0", "generator"), ("arith/0", "evaluator")] * 3, "paper 3's grouping: all calls"
    keys = turn_rewards([broken], AlgorithmConfig(group_key="role_instance")).keys
    assert keys == [("arith/0", r, k) for k in range(3) for r in ("generator", "evaluator")]


def test_no_verdict_counts_as_incorrect_and_an_empty_answer_is_counted(tokenizer):
    episode, backend = run(tokenizer, ["<answer>5</answer>"] * 2, ["Looks fine to me."] * 2, rounds=2)
    assert [t.role for t in episode.turns] == ["generator", "evaluator"] * 2, "the rule: revise"
    assert episode.metadata["malformed"] == {"no_verdict": 2}
    assert [t.reward for t in episode.turns] == [1.0, 0.0, 1.0, 0.0], "no verdict matches nothing"
    revision = [c for c in backend.calls if c.role == "generator"][1]
    assert "issue in your solution:\n\nLooks fine to me.\n\n" in revision.prompt
    assert episode.reward == 1.0

    episode, backend = run(tokenizer, ["", "<answer>5</answer>"], [WRONG, RIGHT])
    assert episode.metadata["malformed"] == {"empty_answer": 1}
    assert "Solution to review:\n(empty)\n\n" in backend.calls[1].prompt
    assert [t.reward for t in episode.turns] == [0.0, 1.0, 1.0, 1.0] and episode.reward == 1.0


def test_options_are_checked():
    assert load_workflow("rolerl.workflows.eval_opt:EvalOpt", TASK, {"rounds": 2}).rounds == 2
    for bad in (0, True):
        with pytest.raises(ValueError, match="rounds=.*; allowed: an integer >= 1"):
            EvalOpt(TASK, rounds=bad)


def test_eval_opt_trains_on_the_tiny_model(tmp_path):
    cfg = load_config(None, [*TINY, f"run.dir={tmp_path}", "train.steps=1", "task.name=arithmetic",
                             "task.workflow=rolerl.workflows.eval_opt:EvalOpt",
                             "task.workflow_options={rounds: 2}", "adapters.preset=isolated",
                             "algorithm.reward=role", "algorithm.group_key=role"])  # fmt: skip
    train(cfg)
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    # a random tiny model never writes a verdict: every review is malformed and the generator revises up to
    # the cap, so 2 tasks x 4 samples x 2 rounds calls of each role
    assert row["workflow/eval_opt/malformed/no_verdict"] == 2.0
    # the role metrics (tests/workflows/test_role_metrics.py): no verdict is never a right one; one revision
    assert row["workflow/eval_opt/evaluator_verdict_acc"] == 0.0
    assert 0.0 <= row["workflow/eval_opt/generator_first_acc"] <= 1.0
    assert {"workflow/eval_opt/revision_wrong_to_right", "workflow/eval_opt/revision_right_to_wrong"} & set(
        row
    )
    assert row["role/generator/turns"] == 16.0 and row["role/evaluator/turns"] == 16.0
    assert row["adapter/generator/steps"] == 1.0 and row["adapter/evaluator/steps"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["shared", "isolated"])
def test_eval_opt_on_the_default_model(tmp_path, preset):
    cfg = load_config(None, [
        "model.spec=default", "model.device=cpu", "train.bf16=false", f"run.dir={tmp_path}", "train.steps=2",
        "train.skip_inert_rows=false",  # every row's rollout log-probs against the trainer's (logp_mismatch)
        "train.tasks_per_step=1", "rollout.n=2", "rollout.max_new_tokens=32", "task.name=arithmetic",
        "task.workflow=rolerl.workflows.eval_opt:EvalOpt", "task.workflow_options={rounds: 2}",
        f"adapters.preset={preset}", "adapters.rank=4", "run.progress=false", "run.tensorboard=false",
        "algorithm.group_key=role",
    ])  # fmt: skip
    train(cfg)
    rows = RunDir(tmp_path, tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 2.0 <= row["role/generator/turns"] == row["role/evaluator/turns"] <= 4.0
        assert row["logp_mismatch/max_abs"] < 1e-3
