"""The vLLM backend (issue 17) against a fake vLLM engine (tests/rollout/fake_vllm.py), on a CPU: the same
token stream gives the built-in engine's `Turn`s through the shared recorder (shared and token-routed
topologies, tool splicing, tags split across tokens, with and without vLLM stopping at the tags); request
building; adapter versions (new id per sync, old ones unloaded when idle, unchanged adapters kept); the
stale-adapter check; the top-p refusal; LoRA-only sync; TIS on hand-computed numbers. The real vLLM path
is untested here (vLLM cannot be installed on these machines)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

import rolerl
from rolerl.models.topology import Topology
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.rollout.vllm_backend import VLLMBackend
from tests.models.test_lora import randomize_adapters
from tests.rollout.fake_vllm import API, FakeLLM, patch_offline_vllm
from tests.rollout.test_engine import SCRIPTS, EchoTool, prompt_ids, scripted_sampler

ADAPTERS = ["reason", "tool"]


def tables() -> dict[str, dict[str, int]]:
    dart = Topology.from_preset("dart", ["policy"]).route_of("policy", {"reason": 0, "tool": 1})
    return {"shared": dict.fromkeys(dart, 0), "dart": dict(dart)}


@pytest.fixture
def setup(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ADAPTERS, rank=4)
    randomize_adapters(model, std=0.2)
    return model, tok


def requests(tok, route_of, **sampling) -> list[GenerationRequest]:
    scripts = {seed: prompt_ids(tok, text) for seed, text in enumerate(SCRIPTS)}
    return [
        GenerationRequest(
            prompt_ids(tok, f"Question {seed}: what is it?\n"),
            SamplingParams(temperature=0.7, seed=seed, max_new_tokens=len(s), **sampling),
            route_of=route_of,
            tool="echo",
        )
        for seed, s in scripts.items()
    ], scripts


def reference(model, tok, route_of):
    """The built-in engine's turns for the scripted streams, and those streams for the fake."""
    reqs, scripts = requests(tok, route_of)
    engine = Engine(model, tok, max_batch=3, tools={"echo": EchoTool()}, sampler=scripted_sampler(scripts))
    turns = engine.generate(reqs)
    engine.close()
    streams = [(t.prompt_ids + t.completion_ids, [math.nan] * len(t.prompt_ids) + t.logprobs) for t in turns]
    return reqs, turns, streams, engine


def backend(model, tok, llm, engine, tmp_path, logprobs="recompute") -> VLLMBackend:
    b = VLLMBackend(
        llm, tok, adapters=ADAPTERS, work_dir=tmp_path, tools={"echo": EchoTool()}, max_len=engine.max_len,
        logprobs=logprobs, vocab_size=model.config.vocab_size, eos_ids=sorted(engine.eos_ids), api=API, tag="",
    )  # fmt: skip
    b.sync(model)
    return b


def run_all(b: VLLMBackend, reqs):
    async def main():
        return await asyncio.gather(*[b.episode(b.generate(r)) for r in reqs])

    return asyncio.run(main())


def same_turn(a, b) -> None:
    assert a.completion_ids == b.completion_ids and a.kinds == b.kinds and a.routes == b.routes
    assert a.finish_reason == b.finish_reason
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), equal_nan=True)
    calls = [(c.name, c.args, c.output, c.error, c.start, c.end) for c in a.tool_calls]
    assert calls == [(c.name, c.args, c.output, c.error, c.start, c.end) for c in b.tool_calls]


@pytest.mark.parametrize("topology", ["shared", "dart"])
@pytest.mark.parametrize("honour_stop", [True, False])
def test_same_token_stream_gives_the_engines_turns(setup, tmp_path, topology, honour_stop):
    """With vLLM stopping at the tags, and with an engine that ignores stop strings (then the backend
    cuts each segment itself where the route changes and discards the rest)."""
    model, tok = setup
    route_of = tables()[topology]
    reqs, want, streams, engine = reference(model, tok, route_of)
    llm = FakeLLM(tok, streams, eos_ids=engine.eos_ids, ignore_stop=not honour_stop)
    b = backend(model, tok, llm, engine, tmp_path)
    got = run_all(b, reqs)
    for g, w in zip(got, want, strict=True):
        same_turn(g, w)
    assert sum(len(t.tool_calls) for t in got) == 3 and b.stats["tool_calls"] == 3
    # every segment ran on the adapter of the token it started with (the true routing's)
    for prompt, sp, lora in llm.requests:
        if sp.prompt_logprobs is not None:
            continue  # a sync's probe
        turn = next(t for t in want if (t.prompt_ids + t.completion_ids)[: len(prompt)] == prompt)
        assert lora.lora_name.split("@")[0] == ADAPTERS[turn.routes[len(prompt) - 1]]
    segments_per_call = b.stats["segments"] / len(reqs)
    if topology == "dart":  # switches at <code> and after each output: more segments than tool calls
        assert {r[2].lora_name.split("@")[0] for r in llm.requests if r[2]} == set(ADAPTERS)
        assert segments_per_call > 2
        if not honour_stop:
            assert b.stats["discarded_tokens"] > 0
    else:
        assert segments_per_call == pytest.approx((len(reqs) + 3) / len(reqs))  # one more per tool call
    tags = [t for t in ("<code>", "</code>") if len(tok(t, add_special_tokens=False)["input_ids"]) > 1]
    assert tags, "the test needs a tag that spans several tokens"


def test_request_building(setup, tmp_path):
    model, tok = setup
    reqs, _, streams, engine = reference(model, tok, tables()["dart"])
    b = backend(model, tok, FakeLLM(tok, streams), engine, tmp_path)
    from rolerl.rollout.recorder import Recorder

    req = GenerationRequest(
        [5, 6, 7], SamplingParams(temperature=0.7, max_new_tokens=20, stop=("STOP",), seed=3),
        route_of=tables()["dart"], tool="echo",
    )  # fmt: skip
    rec = Recorder(req, b.table, b.eos_ids, 4096)
    sp = b.sampling_params(rec)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.logprobs) == (0.7, 1.0, -1, 20, 0)
    assert sp.include_stop_str_in_output and not sp.skip_special_tokens
    # the request's stop, the tool's closing tag, and the tags where dart's adapter changes (only those)
    assert sp.stop == ["STOP", "</code>", "<code>"]
    rec.accept(8, -1.0)
    sp2 = b.sampling_params(rec)
    assert sp2.max_tokens == 19 and sp2.seed != sp.seed  # segments never replay each other's draws
    shared = GenerationRequest(
        [5, 6, 7], SamplingParams(max_new_tokens=4, greedy=True), route_of=tables()["shared"]
    )
    sp3 = b.sampling_params(Recorder(shared, b.table, b.eos_ids, 4096))
    assert sp3.stop == [] and sp3.temperature == 0.0  # one adapter, no tool: vLLM runs the call in one go


def train_a_little(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and name.endswith(".reason"):
                p.add_(0.5)


def test_adapter_versions_new_ids_unloading_and_unchanged_adapters(setup, tmp_path):
    model, tok = setup
    _, _, streams, engine = reference(model, tok, tables()["dart"])
    llm = FakeLLM(tok, streams)
    b = backend(model, tok, llm, engine, tmp_path)
    assert [(e[0], e[2]) for e in llm.llm_engine.log] == [("load", "reason@v1"), ("load", "tool@v1")]
    assert llm.llm_engine.list_loras() == {1, 2}
    assert b.sync(model)["rollout/sync_check"] == 1.0 and len(llm.llm_engine.log) == 2  # nothing changed
    b.current["reason"].in_flight = 1  # a segment still runs on reason@v1
    train_a_little(model)
    metrics = b.sync(model)
    assert metrics["rollout/adapter_version/reason"] == 2.0 and "rollout/adapter_version/tool" not in metrics
    assert llm.llm_engine.list_loras() == {1, 2, 3}  # v1 kept while in use, under its own id; v2 is id 3
    assert metrics["rollout/probe_delta/reason"] > 0
    b.loaded[0].in_flight = 0
    train_a_little(model)
    b.sync(model)
    assert ("unload", 1, "reason@v1") in llm.llm_engine.log and (
        "unload",
        3,
        "reason@v2",
    ) in llm.llm_engine.log
    assert llm.llm_engine.list_loras() == {2, 4} and b.current["reason"].lora_name == "reason@v3"
    assert not (tmp_path / "reason-v1").exists() and (tmp_path / "reason-v3").is_dir()


def test_an_engine_serving_a_stale_adapter_is_caught(setup, tmp_path):
    model, tok = setup
    _, _, streams, engine = reference(model, tok, tables()["dart"])
    b = backend(model, tok, FakeLLM(tok, streams, stale=True), engine, tmp_path)
    train_a_little(model)
    with pytest.raises(RuntimeError, match="stale adapter"):
        b.sync(model)


def test_top_p_with_processed_logprobs_is_refused(setup, tmp_path):
    model, tok = setup
    reqs, _, streams, engine = reference(model, tok, tables()["shared"])
    b = backend(model, tok, FakeLLM(tok, streams), engine, tmp_path, logprobs="processed")
    bad, _ = requests(tok, tables()["shared"], top_p=0.9)
    with pytest.raises(ValueError, match="renormalises"):
        run_all(b, bad[:1])
    ok = backend(model, tok, FakeLLM(tok, streams), engine, tmp_path / "r", logprobs="recompute")
    assert run_all(ok, bad[:1])[0].completion_ids  # the trainer recomputes: allowed


def test_sync_refuses_trainable_weights_that_are_not_lora(setup, tmp_path):
    model, tok = setup
    _, _, streams, engine = reference(model, tok, tables()["shared"])
    b = backend(model, tok, FakeLLM(tok, streams), engine, tmp_path)
    model.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(ValueError, match="LoRA adapters only"):
        b.sync(model)


def test_tis_corrects_the_rollout_trainer_mismatch_by_hand(setup, tmp_path):
    """The fake serves log-probs offset from the trainer's by -0.5, +1.0 and -1.0 on alternating tokens:
    with tis_cap 2 the weights are exp(0.5) = 1.6487, exp(-1) = 0.3679 and min(e, 2) = 2."""
    from rolerl.config import AlgorithmConfig
    from rolerl.train.optim import model_optimizer
    from rolerl.train.update import LossSettings, Part, Schedule, ppo_update
    from rolerl.types import collate

    model, tok = setup
    route_of = tables()["shared"]
    reqs, turns, _, engine = reference(model, tok, route_of)
    offsets = [-0.5, 1.0, -1.0]
    streams = []
    for t in turns:
        ids = t.prompt_ids + t.completion_ids
        lps = [math.nan] * len(t.prompt_ids) + [lp + offsets[i % 3] for i, lp in enumerate(t.logprobs)]
        streams.append((ids, lps))
    b = backend(model, tok, FakeLLM(tok, streams), engine, tmp_path)
    got = run_all(b, reqs)
    batch = collate(got, [1.0, -1.0, 0.5], {"policy": route_of}, pad_id=2)
    mask = batch.loss_mask[:, :-1].bool()
    delta = torch.tensor([-offsets[i % 3] for t in got for i, k in enumerate(t.kinds) if k != "tool_output"])
    alg = AlgorithmConfig(old_logp="recompute", tis_cap=2.0)
    s = LossSettings(alg, temperature=0.7, horizon=64, chunk_size=64)
    metrics = ppo_update([Part.of(model, batch)], model_optimizer(model, lr=1e-3), s, Schedule(),
                         micro_batch_size=4, generator=torch.Generator().manual_seed(0))  # fmt: skip
    weights = delta.exp().clamp(max=2.0)
    assert int(mask.sum()) == len(delta)
    assert metrics["logp_mismatch/tis_weight_mean"] == pytest.approx(float(weights.mean()), abs=1e-4)
    assert metrics["logp_mismatch/tis_truncated_frac"] == pytest.approx(
        float((delta.exp() > 2).float().mean()), abs=1e-6
    )
    assert metrics["logp_mismatch/mean_abs"] == pytest.approx(float(delta.abs().mean()), abs=1e-4)
    # per role and per kind of token (one role here: its mean is the overall one)
    assert metrics["logp_mismatch/role/policy/mean_abs"] == pytest.approx(metrics["logp_mismatch/mean_abs"])
    tool = torch.tensor([-offsets[i % 3] for t in got for i, k in enumerate(t.kinds) if k == "tool_call"])
    assert metrics["logp_mismatch/kind/tool_call/mean_abs"] == pytest.approx(
        float(tool.abs().mean()), abs=1e-4
    )


def test_training_runs_through_the_vllm_backend(tmp_path, monkeypatch, tokenizer):
    """`rollout.backend: vllm` in the RL loop, vLLM replaced by a fake that generates with its own copy of
    the model and the adapter files each sync writes: every step syncs a new version, and the rollout's
    log-probs (from the files) equal the trainer's (fp32)."""
    from rolerl.train.checkpoint import RunDir
    from rolerl.train.rl import train
    from rolerl.workflows import SingleTurn
    from tests.train.test_rl import tiny_config
    from tests.workflows.test_single_turn import EchoTask

    made = patch_offline_vllm(monkeypatch, tokenizer)
    task = EchoTask()
    cfg = tiny_config(tmp_path / "run", "train.steps=2", "rollout.backend=vllm")
    rows = RunDir(train(cfg, task=task, workflow=SingleTurn(task)), tensorboard=False).read_metrics()
    assert [r["rollout/adapter_version/policy"] for r in rows] == [2.0, 3.0] and rows[0][
        "rollout/sync_check"
    ] == 1.0
    assert all(r["logp_mismatch/max_abs"] < 1e-3 for r in rows) and rows[0]["role/policy/turns"] == 8.0
    (llm,) = made
    loads = [e for e in llm.llm_engine.log if e[0] == "load"]
    assert [e[2].split(".")[0] for e in loads] == ["policy@v1", "policy@v2", "policy@v3"]
    assert len({e[2].split(".")[1] for e in loads}) == 1  # one backend: one tag in every name
    assert llm.llm_engine.list_loras() == {3}  # old versions unloaded once idle


def test_vllm_config_refuses_what_it_cannot_honour(tokenizer):
    from rolerl.config import ConfigError, load_config
    from rolerl.rollout.vllm_backend import check_vllm_config
    from rolerl.run.policy import build_policy

    def check(*sets):
        cfg = load_config(None, ["model.spec=tiny:llama", "rollout.backend=vllm", *sets])
        check_vllm_config(cfg, build_policy(cfg, ["policy"]))

    check()
    with pytest.raises(ConfigError, match="old_logp=recompute"):
        check("adapters.preset=dart")
    check("adapters.preset=dart", "algorithm.old_logp=recompute", "algorithm.tis_cap=2.0")
    with pytest.raises(ConfigError, match="renormalised"):
        check("rollout.top_p=0.9")
    check("rollout.top_p=0.9", "rollout.vllm={logprobs: recompute}", "algorithm.old_logp=recompute")
    with pytest.raises(ConfigError, match="rollout.vllm"):
        load_config(None, ["rollout.vllm={gpu_mem: 0.5}"])
