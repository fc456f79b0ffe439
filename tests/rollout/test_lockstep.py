"""`LockstepBackend`: batch composition is a function of the requests, not of timing."""

from __future__ import annotations

import asyncio
import random

import pytest

from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams


class RecordingEngine(Engine):
    """Records, for every step, the prompts of the rows in the batch, in slot order."""

    def step(self):
        out = super().step()
        self.log.append(tuple(tuple(r.req.prompt_ids[:2]) for r in self.active))
        return out


def run_once(model, tok, jitter_seed: int):
    engine = RecordingEngine(model, tok, max_batch=3)  # fewer slots than requests: admission order matters
    engine.log = []
    backend = LockstepBackend(engine)
    jitter = random.Random(jitter_seed)

    def request(i: int, k: int) -> GenerationRequest:
        return GenerationRequest(
            [10 + i, 20 + k, 30], SamplingParams(seed=100 * i + k, max_new_tokens=3 + i % 3)
        )

    async def episode(i: int):
        await asyncio.sleep(jitter.random() * 0.01)  # arrives late, by a different amount each run
        first = await backend.generate(request(i, 0))
        await asyncio.sleep(jitter.random() * 0.01)
        fan = await asyncio.gather(*(backend.generate(request(i, k)) for k in (1, 2)))  # fan-out
        return [first.completion_ids, *(t.completion_ids for t in fan)]

    async def main():
        return await asyncio.gather(*(backend.episode(episode(i)) for i in range(5)))

    try:
        return asyncio.run(main()), engine.log
    finally:
        backend.close()


def test_same_requests_batch_identically_whatever_the_timing(tiny):
    model, tok = tiny
    out_a, log_a = run_once(model, tok, jitter_seed=1)
    out_b, log_b = run_once(model, tok, jitter_seed=2)
    assert log_a == log_b and out_a == out_b
    assert max(len(step) for step in log_a) == 3  # batches were really shared
    # Every episode's requests were made: 5 episodes x 3 calls.
    assert sum(len(x) for x in out_a) == 15


def test_generate_outside_an_episode_and_bad_requests(tiny):
    model, tok = tiny
    backend = LockstepBackend(Engine(model, tok, max_batch=2))

    async def outside():
        return await backend.generate(GenerationRequest([1, 2], SamplingParams(max_new_tokens=2)))

    async def mixed():
        good = backend.episode(backend.generate(GenerationRequest([1, 2], SamplingParams(max_new_tokens=2))))
        bad = backend.episode(backend.generate(GenerationRequest([1, 2], tool="python")))
        return await asyncio.gather(good, bad, return_exceptions=True)

    try:
        with pytest.raises(RuntimeError, match=r"inside backend.episode"):
            asyncio.run(outside())
        good, bad = asyncio.run(mixed())
    finally:
        backend.close()
    assert len(good.completion_ids) == 2
    assert isinstance(bad, ValueError) and "engine tools" in str(bad)
