"""vLLM's CPU build and seeded requests (real vLLM, `make test-vllm`): vLLM splits a prefill that does not
fit a step's token budget, discards the token sampled at the end of each piece and rewinds the request's
random generator, which on a CPU raises and kills the engine core (vllm_checks.cpu_scheduling). Run last
(its file name): a regression here leaves the session's engine dead for any test after it."""

from __future__ import annotations

import pytest

from rolerl.rollout.engine import GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from tests.rollout.real_vllm.parity import FEW_SHOT, TEMPERATURE, TOPOLOGIES, adapted_model, run_all
from tests.rollout.real_vllm.test_offline import backend_for

pytestmark = pytest.mark.vllm

DEFAULT_BUDGET = 2048  # vLLM 0.32.0's max_num_batched_tokens for its async engine on a CPU


def test_seeded_requests_whose_prompts_overflow_the_default_budget(engine, default_model_cpu, tmp_path):
    """24 concurrent seeded requests of ~130 prompt tokens each, more than vLLM's default budget per step
    together: with it vLLM would split one of their prefills and die; with the budget rolerl gives it on a
    CPU every request finishes."""
    base, tokenizer = default_model_cpu
    model = adapted_model(base, ["policy"])
    b = backend_for(engine, model, tokenizer, ["policy"], tmp_path)
    ids = tokenizer.encode(FEW_SHOT, add_special_tokens=False)
    route_of = TOPOLOGIES["shared"][1]()
    reqs = [
        GenerationRequest(
            [100 + i, *ids],  # each prompt its own from the first token: no prefix cache hit shortens one
            SamplingParams(temperature=TEMPERATURE, seed=i, max_new_tokens=2, ignore_eos=True),
            route_of=route_of,
        )
        for i in range(24)
    ]
    assert 24 * (len(ids) + 1) > DEFAULT_BUDGET
    turns = run_all(b, reqs)
    b.close()
    assert [len(t.completion_ids) for t in turns] == [2] * 24
