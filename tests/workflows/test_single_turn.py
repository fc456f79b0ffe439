"""The arithmetic task, seeds, and `Context.generate` / `SingleTurn` through the real engine (tiny model)."""

from __future__ import annotations

import asyncio

import pytest

import rolerl
from rolerl.models.topology import Topology
from rolerl.roles import shift
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.scheduler import EngineBackend
from rolerl.tasks import TASKS, ArithmeticTask, Task
from rolerl.tasks.arithmetic import extract_answer
from rolerl.workflows import WORKFLOWS, Context, SingleTurn, Workflow, derive_seed


def test_arithmetic_task_is_deterministic_and_splits_differ():
    task = ArithmeticTask()
    assert isinstance(task, Task) and TASKS["arithmetic"] is ArithmeticTask
    a, b = task.examples("train", 5, seed=3), task.examples("train", 5, seed=3)
    assert a == b and len({e.id for e in a}) == 5
    assert task.examples("test", 5, seed=3) != a and task.examples("train", 5, seed=4) != a
    for e in a:
        x, op, y = e.question.removeprefix("What is ").rstrip("?").split()
        assert int(e.answer) == eval(f"{x} {op} {y}")  # noqa: S307 - our own generated digits
    messages = task.prompt(a[0])
    assert messages[-1] == {"role": "user", "content": a[0].question} and messages[0]["role"] == "system"


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("so <answer>12</answer>", 1.0),
        ("\\boxed{12}", 1.0),
        ("<answer> 12. </answer>", 1.0),
        ("<answer>+12</answer>", 1.0),
        ("<answer>11</answer> wait, <answer>12</answer>", 1.0),  # the last answer counts
        ("\\boxed{12} no: <answer>13</answer>", 0.0),
        ("<answer>13</answer>", 0.0),
        ("<answer>twelve</answer>", 0.0),
        ("12", 0.0),  # no tags: not an answer
        ("<answer>12", 0.0),  # unclosed
    ],
)
def test_arithmetic_reward(text, reward):
    task = ArithmeticTask()
    example = task.examples("train", 1, seed=0)[0]
    example = type(example)(example.id, "What is 5 + 7?", "12")
    assert task.reward(example, text) == reward


def test_extract_answer_takes_the_later_format():
    assert extract_answer("<answer>1</answer> then \\boxed{2}") == "2"
    assert extract_answer("nothing") is None


def test_derive_seed_is_pure_and_spreads():
    assert derive_seed(0, 1, 2, 3) == derive_seed(0, 1, 2, 3)
    seeds = {derive_seed(0, s, i, j) for s in range(3) for i in range(3) for j in range(3)}
    assert len(seeds) == 27 and all(0 <= s < 2**63 for s in seeds)


class EchoTask:
    """Reward 1 when the completion's text has an even length (a signal a random model can produce)."""

    name = "echo"

    def examples(self, split, n, seed):
        return ArithmeticTask().examples(split, n, seed)

    def prompt(self, example):
        return [{"role": "user", "content": example.question}]

    def reward(self, example, text):
        return float(len(text) % 2 == 0)


def test_context_generate_applies_template_routes_seeds_and_records(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["reason", "tool"], rank=4)
    topology = Topology.from_preset("dart", ["policy"])
    route_of = {"policy": topology.route_of("policy", {"reason": 0, "tool": 1})}
    engine = Engine(model, tok, max_batch=4)
    backend = EngineBackend(engine)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    task = EchoTask()
    workflow = SingleTurn(task)
    assert isinstance(workflow, Workflow) and WORKFLOWS["single_turn"] is SingleTurn
    example = task.examples("train", 1, 0)[0]
    try:
        ctx = Context(backend, tok, route_of, sampling, seed=123)
        episode = asyncio.run(workflow.run(ctx, example))
        other = Context(backend, tok, route_of, sampling, seed=1)
        with pytest.raises(ValueError, match=r"trainer computes log-probs at the run's temperature \(1.0\)"):
            asyncio.run(other.generate("policy", [1, 2], temperature=0.5))
        with pytest.raises(
            ValueError, match=r"role 'judge' is not in this run's topology; roles: \['policy'\]"
        ):
            asyncio.run(Context(backend, tok, route_of, sampling, seed=1).generate("judge", [1, 2, 3]))
    finally:
        backend.close()
    (turn,) = episode.turns
    expected_prompt = tok.apply_chat_template(
        task.prompt(example), add_generation_prompt=True, return_dict=True
    )
    assert turn.prompt_ids == list(expected_prompt["input_ids"])
    assert turn.role == "policy" and turn.routes == shift(turn.all_kinds, route_of["policy"])
    # The same request, seeded with derive_seed(episode seed, call 0), gives the same tokens on a fresh engine.
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=derive_seed(123, 0))
    again = Engine(model, tok, max_batch=1).generate(
        [GenerationRequest(turn.prompt_ids, params, role="policy", route_of=route_of["policy"])]
    )[0]
    assert again.completion_ids == turn.completion_ids
    text = tok.decode(turn.completion_ids, skip_special_tokens=True)
    assert episode.task_id == example.id and episode.metadata["text"] == text
    assert episode.reward == float(len(text) % 2 == 0) and episode.metadata["correct"] == (
        episode.reward >= 1
    )
