"""rolerl's vLLM backend on vLLM's offline `LLM` (real vLLM, CPU build; `make test-vllm`)."""

from __future__ import annotations

import pytest

from rolerl.rollout.engine import Engine
from rolerl.rollout.vllm_backend import VLLMBackend
from tests.rollout.real_vllm.conftest import REPORT
from tests.rollout.real_vllm.parity import (
    FP32_BOUND,
    TEMPERATURE,
    TOPOLOGIES,
    Recording,
    adapted_model,
    adapter_effect,
    engine_parity,
    parity,
    requests,
    run_all,
)
from tests.rollout.test_engine import EchoTool

pytestmark = pytest.mark.vllm


def backend_for(llm, model, tok, adapters, tmp_path) -> VLLMBackend:
    b = VLLMBackend(llm, tok, adapters=adapters, work_dir=tmp_path / "adapters", tools={"echo": EchoTool()},
                    max_len=1024, vocab_size=model.config.vocab_size, eos_ids=[tok.eos_token_id],
                    temperature=TEMPERATURE)  # fmt: skip
    b.sync(model)
    return b


@pytest.mark.parametrize("topology", ["shared", "dart"])
def test_logprobs_match_the_trainer_per_kind(engine, default_model_cpu, tmp_path, topology):
    """The sampled tokens' processed log-probs from vLLM equal the trainer's forward on the same adapter
    within the fp32 bound (parity.py derives it), per kind, with a tool call spliced (and, under dart, the
    adapter switched at the tags); the adapters move those log-probs by far more than the bound."""
    base, tokenizer = default_model_cpu
    adapters, table = TOPOLOGIES[topology]
    route_of = table()
    model = adapted_model(base, adapters)
    llm = Recording(engine)
    b = backend_for(llm, model, tokenizer, adapters, tmp_path)
    turns = run_all(b, requests(tokenizer, route_of))
    b.close()
    assert b.stats["tool_calls"] >= 2, "the few-shot prompt should make the model call the tool"
    assert all("tool_output" in t.kinds for t in turns if t.tool_calls)
    seg, routed = parity(model, turns, route_of, adapters, llm.segments)
    REPORT.append(f"parity {topology} (segment adapter): {seg.summary()}")
    REPORT.append(f"parity {topology} (true routing): {routed.summary()}")
    assert {"reasoning", "tool_call"} <= set(seg.deltas)
    assert seg.max() < FP32_BOUND, seg.summary()
    if topology == "shared":  # one adapter everywhere: the true routing is the segment's
        assert routed.max() < FP32_BOUND, routed.summary()
    else:
        used = {lora.split("@")[0] for _, lora in llm.segments}
        assert used == {"reason", "tool"}  # the adapter switched at the tags
        # the built-in engine on the same requests routes every position exactly: no mismatch to correct
        mine = Engine(model, tokenizer, tools={"echo": EchoTool()}, max_len=1024).generate(
            requests(tokenizer, route_of)
        )
        exact = engine_parity(model, mine, route_of)
        REPORT.append(f"dart TIS weights (cap 2), vLLM: {routed.tis(2.0)}")
        REPORT.append(f"dart TIS weights (cap 2), built-in engine: {exact.tis(2.0)}")
        assert exact.max() < FP32_BOUND, exact.summary()
    # the adapters matter: the base model's log-probs of the same tokens are far from vLLM's
    assert adapter_effect(model, turns, route_of) > 10 * FP32_BOUND
