"""Each episode advances on its own through an engine that takes requests one at a time (`submit`: vLLM's
AsyncLLM in-process, or a server over HTTP), issue 46 finding 8: a fast episode's tool call runs while a
slow episode still generates, where a batch engine (`LLM.generate`) holds it until the whole batch is done;
the turns are the same either way (each request carries its own seed), in episode order."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import rolerl
from rolerl.rollout.vllm_backend import _segment_seed
from tests.models.test_lora import randomize_adapters
from tests.rollout.fake_vllm import FakeLLM
from tests.rollout.test_engine import EchoTool
from tests.rollout.test_vllm_backend import backend, reference, run_all, same_turn, tables

SLOW_S = 1.5  # every segment of the slow episode (the script without a tool call)
FAST_S = 0.01


class TimedTool(EchoTool):
    """EchoTool that writes down when each call starts."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def run(self, args: str):
        self.starts.append(time.perf_counter())
        return super().run(args)


class TimedLLM(FakeLLM):
    """The fake engine with a duration per request: SLOW_S for the slow stream's, FAST_S for the others'.
    `concurrent`: requests are taken one at a time (`submit`, a thread each, as AsyncLLM or a server
    finish each on its own); else only `generate`, which returns when its slowest request is done."""

    def __init__(self, *a, slow: list[int], concurrent: bool, **kw) -> None:
        super().__init__(*a, **kw)
        self.slow = slow
        self.ends: list[tuple[list[int], float]] = []  # (prompt, when its output was ready)
        self.lock = threading.Lock()
        if concurrent:
            pool = ThreadPoolExecutor(8)
            self.submit = lambda p, s, r=None: pool.submit(self._timed, p.prompt_token_ids, s, r)

    def _timed(self, prompt, sp, lora):
        time.sleep(self._duration(prompt))
        with self.lock:
            out = self._one(prompt, sp, lora)
            self.ends.append((list(prompt), time.perf_counter()))
        return out

    def _duration(self, prompt) -> float:
        return SLOW_S if prompt[: len(self.slow)] == self.slow else FAST_S

    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=True):
        time.sleep(max(self._duration(p.prompt_token_ids) for p in prompts))
        outs = super().generate(prompts, sampling_params, lora_request, use_tqdm)
        now = time.perf_counter()
        self.ends += [(list(p.prompt_token_ids), now) for p in prompts]
        return outs


@pytest.fixture
def setup(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["reason", "tool"], rank=4)
    randomize_adapters(model, std=0.2)
    return model, tok


@pytest.mark.parametrize("concurrent", [True, False])
def test_a_fast_episodes_tool_call_does_not_wait_for_a_slow_episode(setup, tmp_path, concurrent):
    model, tok = setup
    route_of = tables()["shared"]
    reqs, want, streams, engine = reference(model, tok, route_of)
    slow = list(reqs[2].prompt_ids)  # script 2: no tool call, one long segment
    assert not want[2].tool_calls and want[0].tool_calls
    llm = TimedLLM(tok, streams, eos_ids=engine.eos_ids, slow=slow, concurrent=concurrent)
    b = backend(model, tok, llm, engine, tmp_path)
    tool = b.tools["echo"] = TimedTool()
    got = run_all(b, reqs)
    b.close()
    for g, w in zip(got, want, strict=True):  # the same turns, in episode order, either way
        same_turn(g, w)
    slow_end = max(t for p, t in llm.ends if p[: len(slow)] == slow)
    first_tool = min(tool.starts)
    if concurrent:  # episode 0's first tool call starts while episode 2's segment is still generating
        assert first_tool < slow_end - SLOW_S / 2
    else:  # the batch holds it until the slow segment is done: what finding 8 was
        assert first_tool >= slow_end
    # every segment's seed is a function of its request's seed and where the segment starts, nothing else
    for prompt, sp, _ in llm.requests:
        if sp.prompt_logprobs is None:
            i = next(k for k, r in enumerate(reqs) if prompt[: len(r.prompt_ids)] == r.prompt_ids)
            assert sp.seed == _segment_seed(reqs[i].sampling.seed, len(prompt))
