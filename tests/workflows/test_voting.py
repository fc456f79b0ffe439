"""Voting on the scripted backend: the voters in parallel and in index order, what the aggregator sees, the
choice, rewards and group keys under each credit rule (plain and rubric), the malformed choices; then
training runs on the tiny model and (slow) on the default model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from rolerl.config import AlgorithmConfig, load_config
from rolerl.roles import KINDS
from rolerl.rollout.engine import GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.tasks import ArithmeticTask
from rolerl.tasks.base import Example
from rolerl.train.checkpoint import RunDir
from rolerl.train.credit import turn_rewards
from rolerl.train.rl import train
from rolerl.types import Turn
from rolerl.workflows import load_workflow
from rolerl.workflows.base import Context, derive_seed
from rolerl.workflows.voting import Voting, parse_choice
from tests.train.test_rl import TINY
from tests.workflows.scripted import ScriptedBackend

TASK = ArithmeticTask()
EXAMPLE = Example("arith/0", "What is 2 + 3?", "5")
ROUTES = {role: dict.fromkeys(KINDS, i) for i, role in enumerate(Voting.roles)}
# right; wrong with an answer (parseable); wrong without one
ANSWERS = ["So <answer>5</answer>", "It is \\boxed{6}", "No idea."]


@dataclass
class LastFirst(ScriptedBackend):
    """Returns calls in reverse order of arrival: each later call waits fewer event-loop rounds."""

    returned: list[Turn] = field(default_factory=list)
    arrived: int = 0

    async def generate(self, request: GenerationRequest) -> Turn:
        k, self.arrived = self.arrived, self.arrived + 1
        turn = await super().generate(request)
        for _ in range(4 * (10 - k)):
            await asyncio.sleep(0)
        self.returned.append(turn)
        return turn


def run(tokenizer, choice: str, answers=ANSWERS, seed: int = 0, backend=ScriptedBackend, **options):
    """One episode; voter k (the k-th call: its seed says which) replies `answers[k]`."""
    voter_of = {derive_seed(seed, k): k for k in range(len(answers))}

    def reply(request, prompt: str) -> str:
        return answers[voter_of[request.sampling.seed]] if request.role == "voter" else choice

    backend = backend(tokenizer, reply)
    ctx = Context(backend, tokenizer, ROUTES, SamplingParams(), seed)
    episode = asyncio.run(Voting(TASK, voters=len(answers), **options).run(ctx, EXAMPLE))
    return episode, backend


def test_parse_choice():
    assert parse_choice("I pick \\boxed{2}.", 3) == (1, None)
    assert parse_choice("\\boxed{ Solution 3 }", 3) == (2, None)
    assert parse_choice("1 says \\boxed{5}, but \\boxed{1} is right", 3) == (0, None), "the last box"
    assert parse_choice("Solution two is best.", 3) == (0, "no_choice")
    assert parse_choice("\\boxed{2.5}", 3) == (0, "no_choice")
    assert parse_choice("\\boxed{4}", 3) == (0, "bad_index")
    assert parse_choice("\\boxed{0}", 3) == (0, "bad_index")


def test_voters_run_in_parallel_in_index_order_and_the_aggregator_sees_every_answer(tokenizer):
    episode, backend = run(tokenizer, "The first is right: \\boxed{1}")
    assert [t.role for t in episode.turns] == ["voter", "voter", "voter", "aggregator"]
    assert backend.max_in_flight("voter") == 3, "the voters reach the backend together"
    # turn k is voter k (its seed is call k's), whatever order the calls return in
    for k, (turn, answer) in enumerate(zip(episode.turns, ANSWERS, strict=False)):
        assert tokenizer.decode(turn.completion_ids, skip_special_tokens=True) == answer, k
    plain = tokenizer.apply_chat_template(TASK.prompt(EXAMPLE), add_generation_prompt=True, tokenize=False)
    voters = [c for c in backend.calls if c.role == "voter"]
    assert [c.prompt for c in voters] == [plain] * 3, "every voter gets the task's own prompt"
    (aggregator,) = [c for c in backend.calls if c.role == "aggregator"]
    assert "Problem: What is 2 + 3?\n\nSolutions to review:\n" in aggregator.prompt
    for i, answer in enumerate(ANSWERS, 1):
        assert f"--- Solution {i} ---\n{answer}\n" in aggregator.prompt
    assert "\\boxed{N} where N is the solution number (1 to 3)" in aggregator.prompt
    assert "<answer></answer> tags" not in aggregator.prompt, "not the task's answer format"
    assert episode.reward == 1.0 and episode.metadata["correct"] and episode.metadata["choice"] == 1
    assert episode.metadata["text"] == ANSWERS[0] and episode.metadata["voters_correct"] == 1
    assert "malformed" not in episode.metadata

    episode, _ = run(tokenizer, "\\boxed{2}")
    assert episode.reward == 0.0 and not episode.metadata["correct"] and episode.metadata["choice"] == 2


def test_voter_order_and_credit_do_not_depend_on_which_call_returns_first(tokenizer):
    episode, backend = run(tokenizer, "\\boxed{1}", backend=LastFirst)
    returned = [t.completion_ids for t in backend.returned[:3]]
    assert returned == [t.completion_ids for t in episode.turns[2::-1]], "voter 3 came back first"
    texts = [tokenizer.decode(t.completion_ids, skip_special_tokens=True) for t in episode.turns[:3]]
    assert texts == ANSWERS and [t.reward for t in episode.turns[:3]] == [1.0, 0.0, 0.0]
    assert episode.reward == 1.0 and episode.metadata["text"] == ANSWERS[0]


def test_rewards_and_group_keys_under_each_credit_rule(tokenizer):
    right, _ = run(tokenizer, "\\boxed{1}")
    wrong, _ = run(tokenizer, "\\boxed{2}", seed=1)
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    # per episode: voters 1-3 (right, wrong + parseable, wrong + unparseable), aggregator
    want = {
        "outcome": [1, 1, 1, 1] + [0, 0, 0, 0],
        "role": [1, 0, 0, 1] + [1, 0, 0, 0],  # voters: their own answer's reward; aggregator: the outcome
        "mix": [1.5, 0.5, 0.5, 0.5] + [1, 0, 0, 0],  # 0.5 x outcome + own (0 if none)
    }
    for rule, rewards in want.items():
        credit = turn_rewards([right, wrong], AlgorithmConfig(reward=rule, mix_alpha=0.5))
        assert credit.rewards.tolist() == rewards, rule
    keys = turn_rewards([right, wrong], AlgorithmConfig(group_key="role_instance")).keys
    voters = [("arith/0", "voter", k) for k in range(3)]
    assert keys == [*voters, ("arith/0", "aggregator", 0)] * 2, "voter k of every episode: one group"
    assert turn_rewards([right], AlgorithmConfig(group_key="role")).keys == [("arith/0", "voter")] * 3 + [
        ("arith/0", "aggregator")
    ]


def test_rubric_rewards(tokenizer):
    right, _ = run(tokenizer, "\\boxed{1}", rubric=True)
    wrong, _ = run(tokenizer, "\\boxed{2}", rubric=True)
    nobody, _ = run(
        tokenizer, "\\boxed{1}", answers=["<answer>6</answer>", "<answer>7</answer>"], rubric=True
    )
    # voter: +0.5 own correct, +0.5 final correct, -1 own wrong and parseable; aggregator: 0 if no voter was
    # right, else +1 / -1 for a right / wrong choice
    assert [t.reward for t in right.turns] == [1.0, -0.5, 0.5, 1.0]
    assert [t.reward for t in wrong.turns] == [0.5, -1.0, 0.0, -1.0]
    assert [t.reward for t in nobody.turns] == [-1.0, -1.0, 0.0]
    assert (right.reward, wrong.reward, nobody.reward) == (1.0, 0.0, 0.0), "the outcome is unchanged"
    credit = turn_rewards([right, wrong], AlgorithmConfig(reward="mix", mix_alpha=0.5))
    assert credit.rewards.tolist() == [1.5, 0.0, 1.0, 1.5] + [0.5, -1.0, 0.0, -1.0]
    assert turn_rewards([right], AlgorithmConfig(reward="outcome")).rewards.tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("choice", "case"), [("Solution 1 looks right.", "no_choice"), ("\\boxed{4}", "bad_index")]
)
def test_a_malformed_choice_takes_voter_1(tokenizer, choice, case):
    episode, _ = run(tokenizer, choice)
    assert episode.metadata["malformed"] == {case: 1}
    assert (
        episode.metadata["choice"] == 1 and episode.metadata["text"] == ANSWERS[0] and episode.reward == 1.0
    )
    episode, _ = run(tokenizer, choice, rubric=True)
    assert episode.turns[-1].reward == -1.0, "a voter was right and the aggregator chose none"
    assert [t.reward for t in episode.turns[:3]] == [1.0, -0.5, 0.5], "the final answer (voter 1's) is right"
    episode, _ = run(tokenizer, choice, answers=["", "<answer>5</answer>"])
    assert episode.reward == 0.0 and episode.metadata["choice"] == 1 and episode.turns[0].reward == 0.0


def test_options_are_checked():
    workflow = load_workflow("rolerl.workflows.voting:Voting", TASK, {"voters": 2, "rubric": True})
    assert (workflow.voters, workflow.rubric, workflow.roles) == (2, True, ("voter", "aggregator"))
    with pytest.raises(ValueError, match="voters=0; allowed: an integer >= 1"):
        Voting(TASK, voters=0)
    with pytest.raises(ValueError, match="rubric='yes'; allowed: true or false"):
        Voting(TASK, rubric="yes")


def test_voting_trains_on_the_tiny_model(tmp_path):
    cfg = load_config(None, [*TINY, f"run.dir={tmp_path}", "train.steps=1", "task.name=arithmetic",
                             "task.workflow=rolerl.workflows.voting:Voting",
                             "task.workflow_options={voters: 2, rubric: true}", "adapters.preset=isolated",
                             "algorithm.reward=role", "algorithm.group_key=role_instance"])  # fmt: skip
    train(cfg)
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    # 2 tasks x 4 samples: two voters and one aggregator each
    assert row["role/voter/turns"] == 16.0 and row["role/aggregator/turns"] == 8.0
    # a random tiny model never writes \boxed{1}: every choice is malformed, counted, not fatal
    assert row["workflow/voting/malformed/no_choice"] == 1.0
    # the role metrics (tests/workflows/test_role_metrics.py): a malformed choice is never a right pick; a
    # right majority needs a right voter
    assert row.get("workflow/voting/aggregator_choice_acc", 0.0) == 0.0
    assert row["workflow/voting/majority_acc"] <= row["workflow/voting/any_voter_correct"] <= 1.0
    assert row["adapter/voter/steps"] == 1.0 and row["adapter/aggregator/steps"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["shared", "isolated"])
def test_voting_on_the_default_model(tmp_path, preset):
    cfg = load_config(None, [
        "model.spec=default", "model.device=cpu", "train.bf16=false", f"run.dir={tmp_path}", "train.steps=2",
        "train.skip_inert_rows=false",  # every row's rollout log-probs against the trainer's (logp_mismatch)
        "train.tasks_per_step=1", "rollout.n=2", "rollout.max_new_tokens=32", "task.name=arithmetic",
        "task.workflow=rolerl.workflows.voting:Voting", f"adapters.preset={preset}", "adapters.rank=4",
        "run.progress=false", "run.tensorboard=false", "algorithm.group_key=role_instance",
    ])  # fmt: skip
    train(cfg)
    rows = RunDir(tmp_path, tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["role/voter/turns"] == 6.0 and row["role/aggregator/turns"] == 2.0
        assert row["logp_mismatch/max_abs"] < 1e-3
