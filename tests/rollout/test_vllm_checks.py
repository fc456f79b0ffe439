"""What the vLLM backend checks before it trusts vLLM (issue 46; rolerl.rollout.vllm_checks), without vLLM:
the minimum version, the dtype per device, the temperature range, the engine's context length, every
sampling field sent explicitly over HTTP with absolute adapter paths, the raw-log-probs probe, and
evaluation during training going through the vLLM backend. The same findings against real vLLM:
tests/rollout/real_vllm/ (`make test-vllm`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import rolerl
from rolerl.config import ConfigError, load_config
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.vllm_backend import VLLMBackend, check_vllm_config
from rolerl.rollout.vllm_checks import check_vllm_version, parse_version, vllm_dtype
from tests.models.test_lora import randomize_adapters
from tests.rollout.fake_vllm import API, ModelLLM, patch_offline_vllm


def test_versions_before_the_greedy_logprob_fix_are_refused():
    assert parse_version("0.32.0") == (0, 32, 0) and parse_version("0.10.2rc1") == (0, 10, 2)
    assert parse_version("0.13.0+cpu") == (0, 13, 0) and parse_version("1.0") == (1, 0, 0)
    for ok in ("0.13.0", "0.32.0+cpu", "1.0.0"):
        check_vllm_version(ok, "here")
    for old in ("0.10.2", "0.11.0", "0.12.9rc1"):
        with pytest.raises(RuntimeError, match=r"needs vLLM >= 0\.13\.0.*greedy"):
            check_vllm_version(old, "the vLLM server at http://h:8000")


@pytest.mark.parametrize(
    ("requested", "weights", "device", "bf16_ok", "want"),
    [
        ("auto", torch.float32, "cpu", True, "float32"),  # vLLM's CPU LoRA runs fp32: the trainer's dtype
        ("auto", torch.bfloat16, "cpu", True, "bfloat16"),
        ("auto", torch.float32, "cuda", True, "bfloat16"),  # GPU LoRA kernels: fp16/bf16 only
        ("auto", torch.float32, "cuda", False, "float16"),  # a GPU without bf16
        ("auto", torch.float16, "cuda", True, "float16"),
        ("bfloat16", torch.float32, "cuda", True, "bfloat16"),
        ("float32", torch.float32, "cpu", True, "float32"),
    ],
)
def test_vllm_dtype_per_device(requested, weights, device, bf16_ok, want):
    assert vllm_dtype(requested, weights, device, bf16_ok) == want


def test_fp32_on_a_gpu_and_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"rollout\.vllm\.dtype='float32' on a GPU.*'bfloat16', 'float16'"):
        vllm_dtype("float32", torch.float32, "cuda")
    with pytest.raises(ValueError, match=r"rollout\.vllm\.dtype='fp8'; allowed"):
        vllm_dtype("fp8", torch.float32, "cpu")
    with pytest.raises(ConfigError, match=r"rollout\.vllm"):
        load_config(None, ["rollout.vllm={dtype: fp8}"])


def _check(*sets, device: str = "cpu"):
    from rolerl.run.policy import build_policy

    cfg = load_config(None, ["model.spec=tiny:llama", "rollout.backend=vllm", *sets])
    policy = build_policy(cfg, ["policy"])
    check_vllm_config(cfg, dataclasses.replace(policy, device=torch.device(device)))


def test_config_refuses_temperatures_vllm_changes_and_dtype_mismatches():
    _check("rollout.temperature=0.7")
    _check("rollout.temperature=2.0", "eval.every=1", "eval.temperature=0")  # greedy evaluation is fine
    for bad in ("0.005", "2.5"):
        with pytest.raises(ConfigError, match=rf"rollout\.temperature={bad}.*\[0\.01, 2\.0\]"):
            _check(f"rollout.temperature={bad}")
    with pytest.raises(ConfigError, match=r"eval\.temperature=3\.0"):
        _check("eval.every=1", "eval.temperature=3.0")
    _check("eval.temperature=3.0")  # no evaluation during training: not sampled through vLLM
    # an fp32 trainer on a GPU: vLLM serves bf16, so the rollout's log-probs need recomputing
    with pytest.raises(ConfigError, match=r"\['bfloat16'\] on cuda.*old_logp=recompute"):
        _check(device="cuda")
    _check("algorithm.old_logp=recompute", device="cuda")
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.dtype='float32' on a GPU"):
        _check("rollout.vllm={dtype: float32}", "algorithm.old_logp=recompute", device="cuda")
    with pytest.raises(ConfigError, match=r"\['bfloat16'\] on cpu"):
        _check("rollout.vllm={dtype: bfloat16}")
    _check("rollout.vllm={url: 'http://h:8000'}", device="cuda")  # a server's dtype is its own


@pytest.fixture
def tiny(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["policy"], rank=4)
    randomize_adapters(model, std=0.2)
    return model, tok


class RawLLM(ModelLLM):
    """A generating fake that returns raw log-probs (before temperature), as a server started without
    `--logprobs-mode processed_logprobs` does; its prompt log-probs are those of any mode."""

    def _continue(self, prompt, sp, lora):
        for token, _ in super()._continue(prompt, sp, lora):
            from rolerl.models.lora import routes

            with torch.no_grad(), routes(self.model, "policy"):
                logits = self.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
            yield token, float(torch.log_softmax(logits, -1)[token])
            prompt = [*prompt, token]


def test_the_sync_probe_refuses_raw_logprobs_at_the_rollout_temperature(tiny, tmp_path):
    model, tok = tiny

    def backend(llm, temperature):
        b = VLLMBackend(llm, tok, adapters=["policy"], work_dir=tmp_path / str(temperature), api=API,
                        vocab_size=model.config.vocab_size, temperature=temperature)  # fmt: skip
        return b.sync(model)

    metrics = backend(ModelLLM(model, tok), 0.7)
    assert metrics["rollout/probe_sampled_vs_trainer/policy"] < 1e-4  # the same fp32 forward
    with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs"):
        backend(RawLLM(model, tok), 0.7)
    backend(RawLLM(model, tok), 1.0)  # at T = 1 raw and processed are equal: nothing is wrong


def test_requests_outside_vllms_temperature_range_are_refused(tiny, tmp_path):
    import asyncio

    from rolerl.rollout.recorder import GenerationRequest

    model, tok = tiny
    b = VLLMBackend(ModelLLM(model, tok), tok, adapters=["policy"], work_dir=tmp_path, api=API,
                    vocab_size=model.config.vocab_size)  # fmt: skip
    b.sync(model)
    req = GenerationRequest([5, 6, 7], SamplingParams(temperature=2.5, max_new_tokens=2), route_of={})
    with pytest.raises(ValueError, match=r"temperature=2\.5.*\[0\.01, 2\.0\]"):
        asyncio.run(b.generate(req))


def test_sampling_fields_are_explicit_and_max_len_is_checked(tiny, tmp_path):
    from rolerl.rollout.recorder import GenerationRequest, Recorder

    model, tok = tiny

    class Limited(ModelLLM):
        max_model_len = 64  # what a server's /v1/models reports (its --max-model-len)

    with pytest.raises(ValueError, match=r"rollout\.max_len=128 but the vLLM engine accepts at most 64"):
        VLLMBackend(Limited(model, tok), tok, adapters=["policy"], work_dir=tmp_path, api=API, max_len=128)
    b = VLLMBackend(Limited(model, tok), tok, adapters=["policy"], work_dir=tmp_path, api=API, max_len=64)
    sp = b.sampling_params(Recorder(GenerationRequest([5, 6], SamplingParams()), b.table, b.eos_ids, 64))
    # the fields a server would otherwise take from generation_config.json, neutral
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty, sp.min_p) == (
        1.0,
        0.0,
        0.0,
        0.0,
    )


def test_http_payload_carries_every_sampling_field_and_absolute_adapter_paths(tmp_path, monkeypatch, tiny):
    from tests.rollout import test_vllm_http as h

    model, tok = tiny
    bodies = []
    with h.serve(bodies) as url:
        from rolerl.rollout.vllm_http import ServerLLM

        h.FakeServer.llm = ModelLLM(model, tok)
        monkeypatch.chdir(tmp_path)
        llm = ServerLLM(url)
        assert llm.version == "0.32.0" and llm.max_model_len == 256
        b = VLLMBackend(llm, tok, adapters=["policy"], work_dir="run/.vllm_adapters/main", api=h.API,
                        vocab_size=model.config.vocab_size, max_len=256, temperature=0.7)  # fmt: skip
        b.sync(model)
        (load,) = [body for path, body in bodies if path == "/v1/load_lora_adapter"]
        assert Path(load["lora_path"]).is_absolute() and Path(load["lora_path"]).is_dir()
        assert Path(load["lora_path"]).parent == tmp_path / "run/.vllm_adapters/main"
        (probe,) = [body for path, body in bodies if path == "/v1/completions"]
        assert {k: probe[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")} == {
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}  # fmt: skip
        assert probe["temperature"] == 0.7 and probe["top_p"] == 1.0 and probe["top_k"] == -1
        # six stop strings: the server takes four (the recorder enforces all of them itself)
        params = h.API.SamplingParams(max_tokens=2, stop=[f"S{i}" for i in range(6)], temperature=0.7)
        (out,) = llm.generate([h.API.TokensPrompt([5, 6, 7])], [params])
        assert len(out.outputs[0].token_ids) == 2 and bodies[-1][1]["stop"] == ["S0", "S1", "S2", "S3"]
        with pytest.raises(ValueError, match=r"rollout\.max_len=512.*at most 256"):
            VLLMBackend(llm, tok, adapters=["policy"], work_dir="x", api=h.API, max_len=512)
        h.FakeServer.version = "0.10.2"
        with pytest.raises(RuntimeError, match=r"server at http://127\.0\.0\.1:\d+ runs vLLM 0\.10\.2"):
            ServerLLM(url)
        b.close()


def test_evaluation_during_training_samples_through_the_vllm_backend(tmp_path, monkeypatch, tokenizer):
    """`eval.every` with `rollout.backend: vllm`: the held-out episodes go through vLLM (greedy requests
    on the synced adapter), not the built-in engine."""
    from rolerl.train.checkpoint import RunDir
    from rolerl.train.rl import train
    from rolerl.workflows import SingleTurn
    from tests.train.test_rl import tiny_config
    from tests.workflows.test_single_turn import EchoTask

    made = patch_offline_vllm(monkeypatch, tokenizer)
    task = EchoTask()
    cfg = tiny_config(
        tmp_path / "run", "train.steps=2", "rollout.backend=vllm", "eval.every=1", "eval.limit=3"
    )
    rows = RunDir(train(cfg, task=task, workflow=SingleTurn(task)), tensorboard=False).read_metrics()
    assert all(r["eval/samples"] == 3.0 and "eval/pass@1" in r for r in rows)
    (llm,) = made
    greedy = [(sp, lora) for _, sp, lora in llm.requests if sp.temperature == 0.0]
    assert len(greedy) == 2 * 3  # every evaluation's calls, through vLLM
    # each evaluation on the adapter version synced after that step's update
    assert [lora.lora_name.split(".")[0] for _, lora in greedy] == ["policy@v2"] * 3 + ["policy@v3"] * 3


@pytest.mark.parametrize(
    ("device", "installed", "url", "want"),
    [
        ("cpu", True, None, "lockstep"),  # measured: the built-in engine is faster on CPU
        ("cpu", False, None, "lockstep"),
        ("cuda", True, None, "vllm"),
        ("cuda", False, None, "lockstep"),  # no vLLM to use
        ("cpu", False, "http://gpu:8000", "vllm"),  # a server URL is an explicit choice
    ],
)
def test_auto_backend_picks_vllm_on_a_gpu_with_vllm_and_the_built_in_engine_elsewhere(
    monkeypatch, device, installed, url, want
):
    import rolerl.rollout.vllm_checks as checks

    monkeypatch.setattr(checks, "vllm_installed", lambda: installed)
    sets = ["rollout.backend=auto", *([f"rollout.vllm={{url: '{url}'}}"] if url else [])]
    cfg = load_config(None, sets)
    policy = type("FakePolicy", (), {"device": torch.device(device)})()
    resolved, why = checks.resolve_backend(cfg, policy)
    assert resolved.rollout.backend == want and why.startswith(f"rollout.backend=auto -> {want}: ")
    assert cfg.rollout.backend == "auto"  # the given config is left as it was (a resume resolves again)
    explicit = load_config(None, ["rollout.backend=lockstep"])
    assert checks.resolve_backend(explicit, policy)[0] is explicit


def test_auto_backend_resolves_inside_old_logp_resolution(monkeypatch):
    """`algorithm.old_logp: auto` sees the backend `auto` resolves to: vLLM's kernels -> recompute."""
    import rolerl.rollout.vllm_checks as checks
    from rolerl.train.rl import resolve_old_logp

    monkeypatch.setattr(checks, "vllm_installed", lambda: True)
    model, tok = rolerl.tiny_model("llama", seed=0)
    policy = type("FakePolicy", (), {"device": torch.device("cuda"), "bf16": False,
                                     "members": {"main": type("M", (), {"model": model})()}})()  # fmt: skip
    cfg = load_config(None, ["rollout.backend=auto", "algorithm.old_logp=auto"])
    resolved, why = resolve_old_logp(cfg, policy)
    assert resolved.algorithm.old_logp == "recompute" and "vLLM" in why
    policy.device = torch.device("cpu")
    assert resolve_old_logp(cfg, policy)[0].algorithm.old_logp == "rollout"


def test_on_a_cpu_every_prompt_is_prefilled_whole():
    """vLLM's CPU build dies when it splits a seeded request's prefill: the budget per step must hold
    max_num_seqs whole prompts (64 x 1024 by default), a smaller one given is refused, others are kept."""
    from rolerl.rollout.vllm_checks import cpu_scheduling

    assert cpu_scheduling({}, 1024) == {
        "enforce_eager": True,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 65536,
    }
    mine = cpu_scheduling({"max_num_seqs": 8, "enforce_eager": False, "max_loras": 4}, 512)
    assert mine == {"max_num_seqs": 8, "enforce_eager": False, "max_loras": 4, "max_num_batched_tokens": 4096}
    assert (
        cpu_scheduling({"max_num_batched_tokens": 10_000, "max_num_seqs": 8}, 512)["max_num_batched_tokens"]
        == 10_000
    )
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=2048.*8 x 512 = 4096"):
        cpu_scheduling({"max_num_batched_tokens": 2048, "max_num_seqs": 8}, 512)


def test_the_offline_engine_on_a_cpu_gets_the_whole_prefill_budget(monkeypatch, tmp_path, tiny):
    """`_offline_llm` builds vLLM's engine with that budget when the model is on a CPU."""
    import sys
    import types

    import rolerl.models.load as load
    import rolerl.rollout.vllm_async as va
    from rolerl.rollout.vllm_backend import _offline_llm

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))
    monkeypatch.setattr(load, "_resolve_to_directory", lambda spec: spec)
    built = {}
    monkeypatch.setattr(va, "AsyncEngine", lambda **kw: built.update(kw) or "engine")
    cfg = load_config(None, ["rollout.backend=vllm", "rollout.max_len=300", "rollout.vllm={max_num_seqs: 4}"])
    assert _offline_llm(str(tmp_path), cfg, 8, tiny[0]) == "engine"
    assert built["max_num_batched_tokens"] == 1200 and built["max_num_seqs"] == 4 and built["enforce_eager"]
