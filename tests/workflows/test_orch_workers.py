"""Orchestrator-workers on the scripted backend: strategy parsing, one worker per strategy in parallel with
its own strategy in its prompt, the synthesizer's view, rewards and group keys under each credit rule, the
malformed cases; then training runs on the tiny model and (slow) on the default model."""

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
from rolerl.workflows.orch_workers import OrchWorkers, parse_strategies
from tests.train.test_rl import TINY
from tests.workflows.scripted import ScriptedBackend

TASK = ArithmeticTask()
EXAMPLE = Example("arith/0", "What is 2 + 3?", "5")
ROUTES = {role: dict.fromkeys(KINDS, i) for i, role in enumerate(OrchWorkers.roles)}
PLAN = "Some ideas.\nStrategy 1: add directly\n2) count up from 2\n- use a number line\n1. Add directly!\n"


def run(reply, workers: int = 3, tokenizer=None, seed: int = 0):
    backend = ScriptedBackend(tokenizer, reply)
    ctx = Context(backend, tokenizer, ROUTES, SamplingParams(), seed, tool="python")
    episode = asyncio.run(OrchWorkers(TASK, workers=workers).run(ctx, EXAMPLE))
    return episode, backend, ctx


def replies(plan: str = PLAN, synthesis: str = "They mostly agree: <answer>5</answer>"):
    """Workers that count up get it wrong; the others answer 5."""

    def reply(request, prompt: str) -> str:
        if request.role == "orchestrator":
            return plan
        if request.role == "worker":
            return "<answer>6</answer>" if "count up" in prompt else "<answer>5</answer>"
        return synthesis

    return reply


def test_parse_strategies_formats_dedupe_and_continuations():
    text = (
        "Here is my plan:\n**Strategy 1:** Use algebra\n  and check the result\n\nA remark, not a strategy.\n"
        "STRATEGY 2 - guess and check\n### Strategy 3: draw it\n3) Use algebra and check the result.\n"
        "* tabulate\n\n1.5 is a number, not an item\n-5 is not a bullet\n- \n"
    )
    assert parse_strategies(text) == [
        "Use algebra and check the result", "guess and check", "draw it", "tabulate",
    ]  # fmt: skip
    assert parse_strategies("Strategy 1:\nwork backwards") == ["work backwards"]
    assert parse_strategies("I would just add them.") == []
    assert parse_strategies("**Bold**\n") == []


def test_workers_get_one_strategy_each_in_parallel_and_the_synthesizer_sees_them_all(tokenizer):
    episode, backend, _ = run(replies(), tokenizer=tokenizer)
    assert [t.role for t in episode.turns] == ["orchestrator", "worker", "worker", "worker", "synthesizer"]
    assert backend.max_in_flight("worker") == 3, "the workers reach the backend together"
    orchestrator, *workers, synthesizer = backend.calls
    assert "Propose at most 3 DIFFERENT strategies" in orchestrator.prompt
    assert "What is 2 + 3?" in orchestrator.prompt and "<answer></answer>" not in orchestrator.prompt
    strategies = [
        "add directly",
        "count up from 2",
        "use a number line",
    ]  # the duplicate "Add directly!" dropped
    for call, strategy in zip(workers, strategies, strict=True):
        assert call.prompt.count("Solve the problem using this strategy:") == 1
        assert f"Solve the problem using this strategy: {strategy}<|im_end|>" in call.prompt
        assert "<answer></answer> tags" in call.prompt, "workers get the task's own prompt and format"
    for i, (strategy, answer) in enumerate(zip(strategies, ["5", "6", "5"], strict=True)):
        assert f"Solution {i + 1} (strategy: {strategy}):\n<answer>{answer}</answer>" in synthesizer.prompt
    assert "Compare the solutions" in synthesizer.prompt
    assert episode.reward == 1.0 and episode.metadata["correct"] and episode.metadata["strategies"] == 3
    assert episode.metadata["text"] == "They mostly agree: <answer>5</answer>"
    assert "malformed" not in episode.metadata
    assert [t.reward for t in episode.turns] == [None, 1.0, 0.0, 1.0, None]


def test_rewards_and_group_keys_under_each_credit_rule(tokenizer):
    right, _, _ = run(replies(), tokenizer=tokenizer)
    wrong, _, _ = run(replies(synthesis="<answer>6</answer>"), tokenizer=tokenizer, seed=1)
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    # per episode: orchestrator, worker x3 (own rewards 1, 0, 1), synthesizer
    want = {
        "outcome": [1, 1, 1, 1, 1] + [0, 0, 0, 0, 0],
        "role": [1, 1, 0, 1, 1] + [0, 1, 0, 1, 0],  # no own reward: the outcome
        "mix": [0.5, 1.5, 0.5, 1.5, 0.5] + [0, 1, 0, 1, 0],  # 0.5 x outcome + own (0 if none)
    }
    for rule, rewards in want.items():
        credit = turn_rewards([right, wrong], AlgorithmConfig(reward=rule, mix_alpha=0.5))
        assert credit.rewards.tolist() == rewards, rule
        assert credit.units == [0] * 5 + [1] * 5
    roles = turn_rewards([right], AlgorithmConfig(group_key="role")).keys
    assert roles == [("arith/0", r) for r in ["orchestrator", "worker", "worker", "worker", "synthesizer"]]
    instances = turn_rewards([right], AlgorithmConfig(group_key="role_instance")).keys
    assert instances[1:4] == [("arith/0", "worker", k) for k in range(3)]  # the k-th worker of each episode


def test_malformed_plans_and_answers(tokenizer):
    episode, backend, _ = run(replies(plan="I would just add them."), tokenizer=tokenizer)
    assert episode.metadata["malformed"] == {"no_strategies": 1} and episode.metadata["strategies"] == 0
    (worker,) = [c for c in backend.calls if c.role == "worker"]
    plain = tokenizer.apply_chat_template(TASK.prompt(EXAMPLE), add_generation_prompt=True, tokenize=False)
    assert worker.prompt == plain, "the rule: one worker with the plain problem"
    assert "Solution 1:\n<answer>5</answer>" in backend.calls[-1].prompt and episode.reward == 1.0

    many = "".join(f"{i}. idea number {i}\n" for i in range(1, 6))
    episode, backend, _ = run(replies(plan=many), workers=2, tokenizer=tokenizer)
    assert episode.metadata["malformed"] == {"too_many_strategies": 1}
    assert [c.prompt.endswith(f"idea number {i}<|im_end|>\n<|im_start|>assistant\n") for i, c in
            enumerate((c for c in backend.calls if c.role == "worker"), 1)] == [True, True]  # fmt: skip
    assert backend.max_in_flight("worker") == 2 and episode.metadata["strategies"] == 2

    episode, _, _ = run(replies(synthesis=""), tokenizer=tokenizer)
    assert episode.metadata["malformed"] == {"empty_answer": 1} and episode.reward == 0.0
    assert not episode.metadata["correct"]


def test_the_plan_stops_before_a_strategy_beyond_the_workers(tokenizer):
    # the engine stops on the stop string and keeps it: the reply ends "Strategy 3"; its empty item is dropped
    plan = "Strategy 1: add directly\n**Strategy 2:** count up from 2\n**Strategy 3"
    episode, backend, _ = run(replies(plan=plan), workers=2, tokenizer=tokenizer)
    orchestrator = backend.calls[0]
    assert orchestrator.role == "orchestrator" and orchestrator.request.sampling.stop == ("Strategy 3",)
    assert all("Strategy 3" not in c.request.sampling.stop for c in backend.calls[1:]), "only the plan stops"
    assert "malformed" not in episode.metadata and episode.metadata["strategies"] == 2


def test_options_are_checked():
    assert load_workflow("rolerl.workflows.orch_workers:OrchWorkers", TASK, {"workers": 2}).workers == 2
    with pytest.raises(ValueError, match="workers=0; allowed: an integer >= 1"):
        OrchWorkers(TASK, workers=0)


def test_orch_workers_trains_on_the_tiny_model(tmp_path):
    cfg = load_config(None, [*TINY, f"run.dir={tmp_path}", "train.steps=1", "task.name=arithmetic",
                             "task.workflow=rolerl.workflows.orch_workers:OrchWorkers",
                             "task.workflow_options={workers: 2}", "adapters.preset=isolated",
                             "algorithm.group_key=role"])  # fmt: skip
    train(cfg)
    (row,) = RunDir(tmp_path, tensorboard=False).read_metrics()
    # a random model proposes no strategy: every episode is malformed and runs one worker (the rule)
    assert row["workflow/orch_workers/malformed/no_strategies"] == 1.0
    # the role metrics (tests/workflows/test_role_metrics.py): no plan is valid; with one worker per episode
    # the workers' accuracy is the share of episodes with a right worker
    assert row["workflow/orch_workers/plan_valid"] == 0.0
    assert row["workflow/orch_workers/worker_acc"] == row["workflow/orch_workers/any_worker_correct"]
    for role in OrchWorkers.roles:  # 2 tasks x 4 samples, one call of each role
        assert row[f"role/{role}/turns"] == 8.0 and row[f"adapter/{role}/steps"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["shared", "isolated"])
def test_orch_workers_on_the_default_model(tmp_path, preset):
    cfg = load_config(None, [
        "model.spec=default", "model.device=cpu", "train.bf16=false", f"run.dir={tmp_path}", "train.steps=2",
        "train.skip_inert_rows=false",  # every row's rollout log-probs against the trainer's (logp_mismatch)
        "train.tasks_per_step=1", "rollout.n=2", "rollout.max_new_tokens=32", "task.name=arithmetic",
        "task.workflow=rolerl.workflows.orch_workers:OrchWorkers", f"adapters.preset={preset}",
        "adapters.rank=4", "run.progress=false", "run.tensorboard=false", "algorithm.group_key=role",
    ])  # fmt: skip
    train(cfg)
    rows = RunDir(tmp_path, tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["role/orchestrator/turns"] == 2.0 and row["role/synthesizer/turns"] == 2.0
        assert 2.0 <= row["role/worker/turns"] <= 6.0  # 1 to 3 workers per episode
        assert row["logp_mismatch/max_abs"] < 1e-3
