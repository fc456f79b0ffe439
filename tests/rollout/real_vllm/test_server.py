"""rolerl's vLLM backend on `vllm serve` over HTTP (real vLLM, CPU build; `make test-vllm`). The server
(conftest.py) runs from another working directory, on a model whose generation_config.json has a
repetition penalty, with `--max-model-len 512`: each test here failed before its fix (issue 46)."""

from __future__ import annotations

import pytest

from rolerl.rollout.vllm_backend import VLLMBackend
from rolerl.rollout.vllm_http import API, ServerLLM
from tests.rollout.real_vllm.conftest import REPORT, SERVER_MAX_LEN
from tests.rollout.real_vllm.parity import (
    FP32_BOUND,
    TEMPERATURE,
    TOPOLOGIES,
    Recording,
    adapted_model,
    adapter_effect,
    parity,
    requests,
    run_all,
)
from tests.rollout.test_engine import EchoTool

pytestmark = pytest.mark.vllm


def server_backend(url, model, tok, adapters, work_dir, temperature=TEMPERATURE) -> VLLMBackend:
    return VLLMBackend(Recording(ServerLLM(url)), tok, adapters=adapters, work_dir=work_dir,
                       tools={"echo": EchoTool()}, max_len=SERVER_MAX_LEN, vocab_size=model.config.vocab_size,
                       eos_ids=[tok.eos_token_id], api=API, temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("topology", ["shared", "dart"])
def test_server_logprobs_match_the_trainer_despite_the_models_repetition_penalty(
    server, default_model_cpu, tmp_path, topology
):
    """Every sampling field is sent: the server would otherwise apply the model's repetition penalty
    (1.3) before its processed log-probs, ~0.26 off on every repeated token."""
    base, tok = default_model_cpu
    adapters, table = TOPOLOGIES[topology]
    model = adapted_model(base, adapters)
    b = server_backend(server.url, model, tok, adapters, tmp_path / "adapters")
    b.sync(model)
    turns = run_all(b, requests(tok, table()))
    b.close()
    seg, routed = parity(model, turns, table(), adapters, b.llm.segments)
    REPORT.append(f"server parity {topology} (segment adapter): {seg.summary()}")
    REPORT.append(f"server parity {topology} (true routing): {routed.summary()}")
    assert seg.max() < FP32_BOUND, seg.summary()
    assert b.stats["tool_calls"] >= 2
    if topology == "shared":
        assert routed.max() < FP32_BOUND, routed.summary()
    assert adapter_effect(model, turns, table()) > 10 * FP32_BOUND


def test_a_relative_run_dir_works_with_the_server_started_elsewhere(server, default_model_cpu, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    """The adapter directories are sent as absolute paths (the server's cwd is not the trainer's)."""
    base, tok = default_model_cpu
    model = adapted_model(base, ["policy"])
    monkeypatch.chdir(tmp_path)
    b = server_backend(server.url, model, tok, ["policy"], "run/.vllm_adapters/main")
    metrics = b.sync(model)
    assert metrics["rollout/sync_check"] == 1.0 and metrics["rollout/probe_vs_trainer/policy"] < FP32_BOUND
    assert b.current["policy"].lora_name in {c for c in b.llm._models()}
    b.close()


def test_rollout_max_len_beyond_the_servers_limit_is_refused(server, tmp_path):
    """`/v1/models` reports the server's --max-model-len: a longer rollout.max_len is refused at start
    (it used to fail later, with HTTP 400 on the first long call); left unset, it is the server's."""
    from rolerl.config import ConfigError, load_config
    from rolerl.rollout.engine import GenerationRequest
    from rolerl.rollout.sampling import SamplingParams
    from rolerl.rollout.vllm_backend import build_vllm_backend
    from rolerl.run.policy import build_policy

    llm = ServerLLM(server.url)
    assert llm.max_model_len == SERVER_MAX_LEN and llm.version.startswith("0.32")
    sets = ["model.spec=default", "model.device=cpu", "rollout.backend=vllm", f"rollout.vllm={{url: '{server.url}'}}",
            f"run.dir={tmp_path}"]  # fmt: skip
    cfg = load_config(None, [*sets, "rollout.max_len=1024"])
    policy = build_policy(cfg, ["policy"])
    with pytest.raises(
        ConfigError, match=rf"rollout\.max_len=1024 .* at most {SERVER_MAX_LEN} .*--max-model-len"
    ):
        build_vllm_backend(cfg, policy, {})
    b = build_vllm_backend(load_config(None, sets), policy, {})
    assert b.max_len == SERVER_MAX_LEN
    b.sync(policy)
    prompt = policy.tokenizer.encode("word " * 600, add_special_tokens=False)[:480]
    req = GenerationRequest(
        prompt,
        SamplingParams(temperature=0.7, max_new_tokens=100, ignore_eos=True),
        route_of={"reasoning": 0, "prompt": 0, "tool_call": 0, "tool_output": 0, "answer": 0},
    )
    (turn,) = run_all(b, [req])  # 480 + 100 > 512: cut at the server's limit, not refused by it
    assert (
        len(turn.prompt_ids) + len(turn.completion_ids) == SERVER_MAX_LEN and turn.finish_reason == "length"
    )
    b.close()


def test_a_server_with_raw_logprobs_is_refused(raw_server, default_model_cpu, tmp_path):
    """Started without --logprobs-mode processed_logprobs, a server returns log-probs before temperature:
    the sync probe samples at the rollout temperature and refuses it (at T = 1 the two agree)."""
    base, tok = default_model_cpu
    model = adapted_model(base, ["policy"])
    with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs"):
        server_backend(raw_server.url, model, tok, ["policy"], tmp_path / "a").sync(model)
    raw_server.drop_loras()
    metrics = server_backend(raw_server.url, model, tok, ["policy"], tmp_path / "b", temperature=1.0).sync(
        model
    )
    assert metrics["rollout/probe_sampled_vs_trainer/policy"] < FP32_BOUND


def test_concurrent_requests_give_the_sequential_paths_tokens(server, default_model_cpu, tmp_path):
    """Episodes advance on their own (one request each in flight, issue 46 finding 8): the same seeds give
    the same tokens as running the episodes one after the other, tool calls included, and log-probs within
    the fp32 bound (other batch compositions sum in another order; parity.py derives the bound)."""
    import time

    base, tok = default_model_cpu
    adapters, table = TOPOLOGIES["shared"]
    model = adapted_model(base, adapters)
    b = server_backend(server.url, model, tok, adapters, tmp_path / "adapters")
    b.sync(model)
    reqs = requests(tok, table())
    t0 = time.perf_counter()
    together = run_all(b, reqs)
    t1 = time.perf_counter()
    alone = [run_all(b, [r])[0] for r in reqs]
    t2 = time.perf_counter()
    b.close()
    REPORT.append(
        f"server: {len(reqs)} episodes concurrently {t1 - t0:.1f} s, one after the other {t2 - t1:.1f} s"
    )
    assert sum(len(t.tool_calls) for t in together) >= 2
    gaps = []
    for a, s in zip(together, alone, strict=True):
        assert a.completion_ids == s.completion_ids and a.kinds == s.kinds
        assert [c.output for c in a.tool_calls] == [c.output for c in s.tool_calls]
        gaps += [
            abs(x - y) for x, y, k in zip(a.logprobs, s.logprobs, a.kinds, strict=True) if k != "tool_output"
        ]
    assert max(gaps) < FP32_BOUND, max(gaps)
