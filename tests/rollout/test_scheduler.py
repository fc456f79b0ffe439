"""Many workflow coroutines awaiting one engine: batched together, each result equal to its solo run."""

from __future__ import annotations

import asyncio

import pytest

import rolerl
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.scheduler import EngineBackend, RolloutBackend
from tests.models.test_lora import randomize_adapters
from tests.rollout.test_engine import assert_same_or_near_tie


def test_concurrent_coroutines_mixing_roles_and_adapters(tiny):
    model, tok = tiny
    rolerl.add_adapters(model, ["generator", "evaluator"], rank=4)
    randomize_adapters(model, std=0.2)
    roles = {"generator": dict.fromkeys(["prompt", "reasoning", "tool_call", "tool_output", "answer"], 0)}
    roles["evaluator"] = dict.fromkeys(roles["generator"], 1)

    def request(i: int) -> GenerationRequest:
        role = "generator" if i % 2 else "evaluator"
        ids = tok.encode(f"Episode {i}: the answer is", add_special_tokens=False)
        return GenerationRequest(
            ids, SamplingParams(seed=i, max_new_tokens=4 + i % 7), role=role, route_of=roles[role]
        )

    engine = Engine(model, tok, max_batch=8)
    backend = EngineBackend(engine)
    assert isinstance(backend, RolloutBackend)

    async def workflow(i: int):
        first = await backend.generate(request(i))  # two dependent calls per workflow
        second = await backend.generate(request(i + 100))
        return first, second

    async def main():
        return await asyncio.gather(*(workflow(i) for i in range(12)))

    results = asyncio.run(main())
    backend.close()
    assert engine.stats["decode_rows"] / engine.stats["steps"] > 2, "requests from coroutines were batched"
    solo = Engine(model, tok, max_batch=1)
    for i, (first, second) in enumerate(results):
        for turn, j in ((first, i), (second, i + 100)):
            expected = solo.generate([request(j)])[0]
            assert turn.role == expected.role
            assert_same_or_near_tie(model, request(j), expected, turn)


def test_bad_request_fails_only_its_caller(tiny):
    model, tok = tiny
    backend = EngineBackend(Engine(model, tok, max_batch=4))

    async def main():
        good = backend.generate(GenerationRequest([5, 6, 7], SamplingParams(greedy=True, max_new_tokens=3)))
        bad = backend.generate(GenerationRequest([5, 6], tool="python"))
        return await asyncio.gather(good, bad, return_exceptions=True)

    good, bad = asyncio.run(main())
    backend.close()
    assert len(good.completion_ids) == 3
    assert isinstance(bad, ValueError) and "engine tools" in str(bad)
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(backend.generate(GenerationRequest([1])))
