"""`LockstepBackend`: batch composition is a function of the requests, not of timing."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

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


INTERRUPTED = """
import asyncio
import rolerl
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.lockstep import LockstepBackend
from rolerl.rollout.sampling import SamplingParams
from rolerl.signals import Terminated

class InterruptedEngine(Engine):  # its second step is stopped by SIGTERM (rolerl.signals: as Ctrl-C)
    def step(self):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 2:
            raise Terminated("SIGTERM")
        return super().step()

model, tok = rolerl.tiny_model("llama", seed=0)
backend = LockstepBackend(InterruptedEngine(model, tok, max_batch=2))
request = GenerationRequest([1, 2], SamplingParams(max_new_tokens=4))
try:
    asyncio.run(backend.episode(backend.generate(request)))
except Terminated:
    print("interrupted")
"""


def test_sigterm_in_an_engine_step_reaches_the_caller_once():
    """The interrupt leaves the event loop for the caller to handle, and asyncio does not print it again
    at exit as a task exception that was never retrieved (a process, to see what it prints at exit)."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", done.stderr[-2000:]
    assert "never retrieved" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_pump_that_fails_fails_its_waiting_calls(tiny, monkeypatch):
    model, tok = tiny
    backend = LockstepBackend(Engine(model, tok, max_batch=2))
    monkeypatch.setattr(backend, "_submit_queued", lambda: (_ for _ in ()).throw(RuntimeError("pump bug")))

    async def main():
        return await backend.episode(
            backend.generate(GenerationRequest([1, 2], SamplingParams(max_new_tokens=2)))
        )

    with pytest.raises(RuntimeError, match="pump bug"):
        asyncio.run(asyncio.wait_for(main(), timeout=10))  # failed, not left waiting forever
    backend.close()


def test_a_rollout_with_the_prefix_store_samples_the_same_whatever_ran_before(tiny):
    """Each rollout starts with an empty prefix store (`Engine.forget_kept`): its calls continue only calls
    of the same rollout, so a resumed run, or an evaluation continued from its kept chunks, samples what the
    uninterrupted one did. A reused prefix's keys and values come from another batch than a prefill of
    them, equal only up to rounding: without the reset the second rollout would reuse the first's rows."""
    model, tok = tiny
    engine = Engine(model, tok, max_batch=4, prefix_cache=32768)
    backend = LockstepBackend(engine)

    async def episode(i: int):
        first = await backend.generate(
            GenerationRequest([*range(5, 15), 20 + i], SamplingParams(seed=i, max_new_tokens=4))
        )
        turn = first.prompt_ids + first.completion_ids + [8, 9]  # the next call continues the first
        second = await backend.generate(
            GenerationRequest(turn, SamplingParams(seed=10 + i, max_new_tokens=4))
        )
        return first.completion_ids, first.logprobs, second.completion_ids, second.logprobs

    async def rollout():
        return await asyncio.gather(*(backend.episode(episode(i)) for i in range(3)))

    try:
        runs, hits = [], []
        for _ in range(2):
            before = engine.stats["kept_hits"]
            runs.append(asyncio.run(rollout()))
            hits.append(engine.stats["kept_hits"] - before)
    finally:
        backend.close()
    assert hits == [3, 3]  # each second call continues its own first call, and nothing else is kept
    assert runs[0] == runs[1]  # the same batches, the same history: the same floats
