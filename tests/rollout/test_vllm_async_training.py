"""Asynchronous training (`train.max_staleness`) through the vLLM backend (issue 50), with the fake vLLM
engines of tests/rollout/fake_vllm.py: `sync(version)` serves an older version of the adapters (not the
trainer's live weights), each segment's tokens record the step count of the LoRA version it was sent
with, versions in flight stay loaded, and a k=1 run's tokens are reproduced by the trainer's forward with
the version each records. The synchronous loop's tokens record the trainer's step counts too."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest
import torch

import rolerl
from rolerl.errors import ConfigError
from rolerl.models.adapters_io import adapter_state_dict
from rolerl.rollout.engine import rollout_copy
from rolerl.rollout.recorder import AdapterVersion
from rolerl.rollout.vllm_backend import VLLMBackend
from rolerl.run.policy import build_policy
from rolerl.train.checkpoint import RunDir
from rolerl.train.pipeline import RolloutPipeline, snapshot_tensors
from rolerl.workflows import SingleTurn
from tests.models.test_lora import randomize_adapters
from tests.rollout.fake_vllm import API, FakeLLM, patch_offline_vllm
from tests.rollout.test_engine import EchoTool
from tests.rollout.test_vllm_backend import ADAPTERS, reference, run_all, same_turn, tables
from tests.train.test_async import version_gaps
from tests.train.test_rl import tiny_config
from tests.workflows.test_single_turn import EchoTask

ASYNC = ["rollout.backend=vllm", "algorithm.old_logp=recompute", "algorithm.tis_cap=2.0"]


@pytest.fixture
def setup(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ADAPTERS, rank=4)
    randomize_adapters(model, std=0.2)
    return model, tok


def served(model, tok, llm, engine, tmp_path, replica=True) -> VLLMBackend:
    """A backend over `llm` serving `model`'s adapters, with a copy of `model` to load versions into."""
    b = VLLMBackend(
        llm, tok, adapters=ADAPTERS, work_dir=tmp_path, tools={"echo": EchoTool()}, max_len=engine.max_len,
        logprobs="recompute", vocab_size=model.config.vocab_size, eos_ids=sorted(engine.eos_ids), api=API,
        tag="", source=model, replica=rollout_copy(model, torch.float32) if replica else None,
    )  # fmt: skip
    b.sync(model)
    return b


def tool_version(model, step: int, steps: list[int]) -> AdapterVersion:
    """The trainer moves "tool" on (new random weights); the version holds them (cloned) and `steps`."""
    randomize_adapters(model, seed=step, std=0.2)
    tool = {k: p.detach().clone() for k, p in model.named_parameters() if k.endswith(".tool")}
    return AdapterVersion(step, {model: tool}, {model: steps})


def signature(weights) -> float:
    """What the fake engine keys a loaded adapter's weights by (fake_vllm.FakeEngine.add_lora)."""
    return float(sum(float(w.double().abs().sum()) for w in weights))


def test_sync_to_a_version_serves_it_and_tokens_record_each_adapters_version(setup, tmp_path):
    """dart: "reason" and "tool" on different segments. The version changes "tool" only (step count 5;
    "reason" 3, unchanged): vLLM loads the version's "tool" (not the trainer's, which moved on again) as a
    new LoRA, keeps "reason", and every token records the step count of the adapter that sampled it."""
    model, tok = setup
    route_of = tables()["dart"]
    reqs, want, streams, engine = reference(model, tok, route_of)
    llm = FakeLLM(tok, streams)
    b = served(model, tok, llm, engine, tmp_path)
    version = tool_version(model, 1, [3, 5])
    randomize_adapters(model, seed=2, std=0.2)  # the trainer goes on: its live weights are not the version's
    metrics = b.sync(version)
    assert metrics["rollout/adapter_version/tool"] == 2.0 and "rollout/adapter_version/reason" not in metrics
    loads = [(e[0], e[2]) for e in llm.llm_engine.log]
    assert loads == [("load", "reason@v1"), ("load", "tool@v1"), ("load", "tool@v2"), ("unload", "tool@v1")]
    served_tool = llm.llm_engine.loras[b.current["tool"].lora_id][1]
    assert served_tool == pytest.approx(signature(version.tensors[model].values()), rel=1e-6)
    live = signature(adapter_state_dict(model, "tool").values())
    assert abs(served_tool - live) > 1.0, "the trainer's live weights are not what vLLM serves"
    got = run_all(b, reqs)
    for g, w in zip(got, want, strict=True):
        same_turn(g, w)  # the fake replays the same streams: only the versions differ
        # independently of the recorder: token j is sampled at a position routed by its own kind (`shift`)
        assert g.versions == [-1 if k == "tool_output" else [3, 5][route_of[k]] for k in g.kinds]
    assert {v for t in got for v in t.versions} == {3, 5, -1}, "the scripts use both adapters and a tool"


def test_a_stale_adapter_is_caught_after_a_version_sync(setup, tmp_path):
    """The probe runs on the replica holding the version: its log-probs moved, the served ones did not."""
    model, tok = setup
    _, _, streams, engine = reference(model, tok, tables()["dart"])
    b = served(model, tok, FakeLLM(tok, streams, stale=True), engine, tmp_path)
    with pytest.raises(RuntimeError, match="stale adapter"):
        b.sync(tool_version(model, 1, [0, 1]))


class HeldLLM(FakeLLM):
    """Segments sent one at a time (`submit`, as vLLM's AsyncLLM and a server take them), held unanswered
    until `release`; after it, answered at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: list[tuple] | None = []

    def submit(self, prompt, params, lora=None) -> Future:
        future: Future = Future()
        if self.held is None:
            future.set_result(self._one(prompt.prompt_token_ids, params, lora))
        else:
            self.held.append((prompt, params, lora, future))
        return future

    def release(self) -> None:
        held, self.held = self.held, None
        for prompt, params, lora, future in held:
            future.set_result(self._one(prompt.prompt_token_ids, params, lora))


def test_a_version_in_flight_stays_loaded_and_later_segments_take_the_new_one(setup, tmp_path):
    """A sync while a call's first segment is in flight on reason@v1 (step 2): v1 stays loaded (and its
    directory), the call's later segments go to reason@v2 (step 4); once the call is done, the next sync
    unloads both old versions."""
    model, tok = setup
    route_of = tables()["shared"]  # every kind on "reason"; tool calls cut the call into segments
    reqs, want, streams, engine = reference(model, tok, route_of)
    llm = HeldLLM(tok, streams)
    b = served(model, tok, llm, engine, tmp_path)
    b.stamp([2, 0])
    first = b.current["reason"]
    req = next(r for r, w in zip(reqs, want, strict=True) if w.tool_calls)

    def reason_version(step: int, steps: list[int]) -> AdapterVersion:
        randomize_adapters(model, seed=step, std=0.2)
        reason = {k: p.detach().clone() for k, p in model.named_parameters() if k.endswith(".reason")}
        return AdapterVersion(step, {model: reason}, {model: steps})

    async def main():
        call = asyncio.create_task(b.generate(req))
        while not llm.held:
            await asyncio.sleep(0)
        b.sync(reason_version(1, [4, 0]))
        assert first.in_flight == 1 and first.lora_id in llm.llm_engine.list_loras() and first.path.is_dir()
        assert ("unload", first.lora_id, first.lora_name) not in llm.llm_engine.log
        llm.release()
        return await call

    turn = asyncio.run(main())
    # the first segment ends at the call's first closing tool tag, where its tool output is spliced
    end = turn.tool_calls[0].start  # completion index of the first forced token
    assert turn.versions[:end] == [2] * end
    rest = [v for v, k in zip(turn.versions[end:], turn.kinds[end:], strict=True) if k != "tool_output"]
    assert rest and set(rest) == {4}
    assert all(v == -1 for v, k in zip(turn.versions, turn.kinds, strict=True) if k == "tool_output")
    second = b.current["reason"]
    b.sync(reason_version(2, [6, 0]))
    unloaded = [e[2] for e in llm.llm_engine.log if e[0] == "unload"]
    assert first.lora_name in unloaded and second.lora_name in unloaded
    assert llm.llm_engine.list_loras() == {b.current["tool"].lora_id, b.current["reason"].lora_id}
    assert not first.path.exists() and not second.path.exists()


def test_a_version_sync_needs_a_replica(setup, tmp_path):
    model, tok = setup
    _, _, streams, engine = reference(model, tok, tables()["shared"])
    b = served(model, tok, FakeLLM(tok, streams), engine, tmp_path, replica=False)
    with pytest.raises(RuntimeError, match=r"needs the trainer's model \(`source`\) and a copy of it"):
        b.sync(tool_version(model, 1, [0, 1]))


# ---- the loop -----------------------------------------------------------------------------------------


class Recording(RolloutPipeline):
    """The pipeline, keeping each step's episodes and the adapters (and step counts) of every version."""

    seen: dict = {}

    def __init__(self, backend, policy, steps, *args, **kwargs):
        super().__init__(backend, policy, steps, *args, **kwargs)
        Recording.seen = {"pipeline": self, "episodes": {}, "steps": {self.start: dict(steps)},
                          "weights": {self.start: snapshot_tensors(policy)}}  # fmt: skip

    def episodes(self, step):
        self.seen["episodes"][step] = out = super().episodes(step)
        return out

    def publish(self, step, policy, steps):
        self.seen["steps"][step], self.seen["weights"][step] = dict(steps), snapshot_tensors(policy)
        return super().publish(step, policy, steps)


def test_staleness_one_through_vllm_tokens_carry_the_version_that_sampled_them(
    tmp_path, monkeypatch, tokenizer
):
    """k=1 with the fake offline engine, which samples with its own copy of the model and the adapter
    files each sync writes: step s samples the adapters after step s - 2; each token's recorded version is
    the one whose adapters (the trainer's, kept at that step) reproduce its sampling log-prob, the next
    version's do not; staleness is 1 from step 2 on, no call is dropped; old versions are unloaded."""
    from rolerl.train import rl

    made = patch_offline_vllm(monkeypatch, tokenizer)
    monkeypatch.setattr(rl, "RolloutPipeline", Recording)
    cfg = tiny_config(tmp_path / "run", "train.steps=4", "train.max_staleness=1", *ASYNC)
    task = EchoTask()
    workflow = SingleTurn(task)
    policy = build_policy(cfg, workflow.roles)
    rows = RunDir(
        rl.train(cfg, task=task, workflow=workflow, policy=policy), tensorboard=False
    ).read_metrics()
    seen = Recording.seen
    assert seen["pipeline"].log == [(1, 0), (2, 0), (3, 1), (4, 2)]  # step s samples step s - 2's adapters
    assert [r["staleness/policy/max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["async/dropped_turns"] == 0.0 for r in rows)
    for step, want in seen["pipeline"].log:
        turns = [t for ep in seen["episodes"][step] for t in ep.turns]
        assert seen["steps"][want]["policy"] == want  # one optimizer step per training step
        assert {v for t in turns for v in t.versions} == {want}  # no tool: every token sampled
        # the version that sampled, and the next one
        gaps = version_gaps(policy, turns, seen["weights"], (want, want + 1), cfg.rollout.temperature)
        assert gaps[want] < 1e-4, f"step {step}: the version recorded reproduces the sampling log-probs"
        assert gaps[want + 1] > 1e-3, f"step {step}: another version does not"
    (llm,) = made
    events = [(e[0], e[2].split(".")[0]) for e in llm.llm_engine.log]
    # the start (sync(policy)), then the versions after steps 1 and 2; each older one unloaded once idle
    assert events == [("load", "policy@v1"), ("load", "policy@v2"), ("unload", "policy@v1"),
                      ("load", "policy@v3"), ("unload", "policy@v2")]  # fmt: skip
    assert len(llm.llm_engine.list_loras()) == 1


def test_synchronous_vllm_tokens_record_the_trainers_step_counts(tmp_path, monkeypatch, tokenizer):
    """Without max_staleness vLLM serves the adapters synced after the last update: every token records
    the trainer's step count (0, then 1), so the staleness is 0."""
    from rolerl.train import rl

    patch_offline_vllm(monkeypatch, tokenizer)
    versions = []
    rollout_step = rl.rollout_step

    def recording(*args, **kwargs):
        episodes = rollout_step(*args, **kwargs)
        versions.append({v for ep in episodes for t in ep.turns for v in t.versions})
        return episodes

    monkeypatch.setattr(rl, "rollout_step", recording)
    cfg = tiny_config(tmp_path / "run", "train.steps=2", "rollout.backend=vllm")
    task = EchoTask()
    rows = RunDir(rl.train(cfg, task=task, workflow=SingleTurn(task)), tensorboard=False).read_metrics()
    assert versions == [{0}, {1}]
    assert [r["staleness/policy/max"] for r in rows] == [0.0, 0.0]


def test_asynchronous_vllm_under_torchrun_is_refused(tmp_path, monkeypatch):
    from rolerl.train import rl
    from rolerl.train.distributed import Dist

    class TwoRanks(Dist):  # rank 0 of 2, its collectives no-ops: the refusal comes before any is needed
        def barrier(self) -> None:
            pass

        def broadcast(self, params) -> None:
            pass

    monkeypatch.setattr(rl, "init_from_env", lambda **kw: TwoRanks(rank=0, world=2))
    cfg = tiny_config(tmp_path / "run", "train.steps=1", "train.max_staleness=1", *ASYNC)
    task = EchoTask()
    with pytest.raises(ConfigError, match="train.max_staleness runs in one process for now"):
        rl.train(cfg, task=task, workflow=SingleTurn(task))
