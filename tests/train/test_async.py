"""Policy versions on tokens, staleness, and asynchronous training (`train.max_staleness`, issue 50)."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time

import pytest
import torch

import rolerl
from rolerl.algorithms.losses import ppo_clip_loss, tis_weights
from rolerl.rollout.engine import rollout_copy
from rolerl.rollout.recorder import AdapterVersion
from rolerl.run.policy import build_policy
from rolerl.train.checkpoint import RunDir, checkpoints
from rolerl.train.pipeline import RolloutPipeline, RolloutThreadError, snapshot_tensors, staleness
from rolerl.train.policy import token_logprobs
from rolerl.train.rl import train
from rolerl.types import Turn, collate, runs_to_versions, versions_to_runs
from rolerl.workflows import SingleTurn
from tests.models.test_lora import randomize_adapters
from tests.rollout.test_engine import scripted_episodes
from tests.train.test_rl import strip_time, tiny_config
from tests.workflows.test_single_turn import EchoTask

ASYNC = ["algorithm.old_logp=recompute", "algorithm.tis_cap=2.0"]

# ---- versions on tokens ------------------------------------------------------------------------------


def version_gaps(policy, turns, weights, versions, temperature) -> dict[int, float]:
    """max |trainer log-prob - recorded sampling log-prob| over `turns`' sampled tokens, with the adapters of
    each of `versions` (`weights[v]`: the policy's LoRA tensors after step v, keyed `main/<name>`) loaded
    into `policy.model`."""
    gaps = {}
    for w in versions:
        with torch.no_grad():
            for k, p in policy.model.named_parameters():
                if "lora_" in k:
                    p.copy_(weights[w][f"main/{k}"])
            batch = collate(turns, [1.0] * len(turns), policy.route_of)
            logp = token_logprobs(policy.model, batch, temperature=temperature).logp
        mask = batch.loss_mask[:, :-1].bool()
        gaps[w] = float((logp[mask] - batch.old_logp[:, :-1][mask]).abs().max())
    return gaps


def test_versions_run_length_round_trip_and_old_turns_read_as_zero():
    assert versions_to_runs([3, 3, 3, -1, -1, 4]) == [[3, 3], [-1, 2], [4, 1]]
    assert runs_to_versions([[3, 3], [-1, 2], [4, 1]]) == [3, 3, 3, -1, -1, 4]
    assert runs_to_versions(None) == []  # a file written before versions
    old = Turn("policy", [1, 2], [3, 4], ["reasoning"] * 2, [0, 0, 0, 0], [-0.1, -0.2])
    assert old.versions == [] and old.version_list() == [0, 0]
    with pytest.raises(ValueError, match="3 versions for 2 completion ids"):
        Turn("policy", [1, 2], [3, 4], ["reasoning"] * 2, [0, 0, 0, 0], [-0.1, -0.2], versions=[1, 1, 1])


def test_each_token_records_the_version_of_the_adapter_that_sampled_it(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["reason", "tool", "output"], rank=4)
    route_of = {"prompt": 0, "reasoning": 0, "tool_call": 1, "tool_output": 2, "answer": 0}
    engine, reqs = scripted_episodes(model, tok, route_of)
    engine.versions = [3, 7, 11]
    turns = engine.generate(reqs)
    engine.close()
    for turn in turns:
        # independently of the recorder: token j is predicted by a position routed by its own kind (`shift`)
        expected = [-1 if k == "tool_output" else [3, 7, 11][route_of[k]] for k in turn.kinds]
        assert turn.versions == expected
    assert {v for t in turns for v in t.versions} == {3, 7, -1}, "the scripts open tool calls"


def test_sync_to_an_adapter_version_replaces_the_packed_adapters(tokenizer):
    """An engine over its own copy, synced to a version of the adapters after it sampled once (packing
    them), samples what an engine over a model holding that version samples."""
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, ["reason", "tool"], rank=4)
    randomize_adapters(model, std=0.2)
    route_of = {"prompt": 0, "reasoning": 0, "tool_call": 1, "tool_output": 0, "answer": 0}
    copy = rollout_copy(model, torch.float32)
    engine, reqs = scripted_episodes(model, tok, route_of, engine_model=copy, source=model)
    before = engine.generate(reqs)
    randomize_adapters(
        model, seed=1, std=0.2
    )  # the trainer moves on; a version holds only the changed "tool"
    tool = {k: p.detach().clone() for k, p in model.named_parameters() if k.endswith(".tool")}
    engine.sync(AdapterVersion(1, {model: tool}, {model: [0, 5]}))
    after = engine.generate(reqs)
    engine.close()
    reference = rollout_copy(model, torch.float32)
    with torch.no_grad():  # "reason" as the engine's copy holds it (the version did not change it)
        for k, p in reference.named_parameters():
            if k.endswith(".reason"):
                p.copy_(dict(copy.named_parameters())[k])
    ref_engine, _ = scripted_episodes(reference, tok, route_of)
    expected = ref_engine.generate(reqs)
    ref_engine.close()
    for a, b, e in zip(before, after, expected, strict=True):
        assert a.completion_ids == b.completion_ids
        assert b.versions == [-1 if k == "tool_output" else (5 if k == "tool_call" else 0) for k in b.kinds]
        for x, y in zip(b.logprobs, e.logprobs, strict=True):
            assert math.isnan(x) and math.isnan(y) or abs(x - y) < 1e-5
    moved = [abs(x - y) for a, b in zip(before, after, strict=True) for x, y, k in
             zip(a.logprobs, b.logprobs, a.kinds, strict=True) if k == "tool_call"]  # fmt: skip
    assert max(moved) > 1e-3, "the new tool adapter changes its tokens' log-probs"


def test_staleness_histogram_and_too_stale_turns_by_hand():
    # dart-like: route 0 = "reason", 1 = "tool"; turn a: 3 tokens by reason (version 2), 1 by tool (version 4);
    # turn b: tokens by reason at version 4 and a forced tool output token (-1: no version)
    class P:  # the parts of a Policy `staleness` reads
        members = {"main": type("M", (), {"model": None})()}
        topology = type("T", (), {"model": staticmethod(lambda role: "main")})()

    from rolerl.train import pipeline

    names = ["reason", "tool"]
    orig = pipeline.adapter_specs
    pipeline.adapter_specs = lambda model: dict.fromkeys(names)
    try:
        kinds_a = ["reasoning", "reasoning", "tool_call", "reasoning"]
        a = Turn("policy", [9], [1, 2, 3, 4], kinds_a, [0, 0, 1, 0, 0], [-1.0] * 4, versions=[2, 2, 4, 2])
        kinds_b = ["reasoning", "tool_output", "reasoning"]
        b = Turn("policy", [9], [1, 2, 3], kinds_b, [0, 0, 0, 0], [-1.0, math.nan, -1.0], versions=[4, -1, 4])
        steps = {"reason": 4, "tool": 5}
        metrics, stale = staleness([a, b], P(), steps, bound=1)
    finally:
        pipeline.adapter_specs = orig
    # reason: a's 3 tokens 4 - 2 = 2 behind, b's 2 tokens 0 behind; tool: 5 - 4 = 1 behind
    assert metrics == {
        "staleness/reason/mean": 6 / 5, "staleness/reason/max": 2.0,
        "staleness/reason/hist/0": 2.0, "staleness/reason/hist/2": 3.0,
        "staleness/tool/mean": 1.0, "staleness/tool/max": 1.0, "staleness/tool/hist/1": 1.0,
    }  # fmt: skip
    assert stale == [0]


# ---- the decoupled loss --------------------------------------------------------------------------------


def test_decoupled_ppo_loss_by_hand():
    """-min(pi_prox/pi_behav, cap) * min(r A, clip(r) A), r = pi_theta/pi_prox (clip 0.2 / 0.28, cap 2)."""
    behav = torch.log(torch.tensor([[0.5, 0.1, 0.5]]))
    prox = torch.log(torch.tensor([[0.6, 0.4, 0.25]]))
    theta = torch.log(torch.tensor([[0.66, 0.6, 0.15]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    w = tis_weights(prox, behav, cap=2.0)
    # token 1: w = 1.2, r = 1.1 inside the clip: -1.32; token 2: w = 4 -> capped 2, r = 1.5 -> clipped 1.28:
    # -2.56; token 3: w = 0.5, r = 0.6, A < 0: max(0.6, 0.8) = 0.8 (clipped at 1 - 0.2): 0.4
    loss = ppo_clip_loss(theta, prox, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28, is_weights=w)
    torch.testing.assert_close(loss.per_token, torch.tensor([[-1.32, -2.56, 0.4]]), rtol=0, atol=1e-6)


# ---- the loop -----------------------------------------------------------------------------------------


def _run(tmp_path, name, *extra):
    cfg = tiny_config(tmp_path / name, "train.steps=3", *extra)
    task = EchoTask()
    workflow = SingleTurn(task)
    policy = build_policy(cfg, workflow.roles)
    run_dir = train(cfg, task=task, workflow=workflow, policy=policy)
    rows = RunDir(run_dir, tensorboard=False).read_metrics()
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows], snapshot_tensors(policy)


def test_staleness_zero_is_the_synchronous_loop_exactly(tmp_path):
    rows, weights = _run(tmp_path, "sync")
    rows0, weights0 = _run(tmp_path, "zero", "train.max_staleness=0")
    assert rows0 == rows
    assert weights0.keys() == weights.keys()
    assert all(torch.equal(weights0[k], weights[k]) for k in weights)
    assert all(r["staleness/policy/max"] == 0.0 for r in rows)


def test_staleness_one_is_reproducible_and_one_step_behind(tmp_path):
    rows, weights = _run(tmp_path, "a", "train.max_staleness=1", *ASYNC)
    again, weights2 = _run(tmp_path, "b", "train.max_staleness=1", *ASYNC)
    assert again == rows
    assert all(torch.equal(weights2[k], weights[k]) for k in weights)
    # step 1 samples the start; step s >= 2 the adapters after step s - 2, one optimizer step behind
    assert [r["staleness/policy/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["async/dropped_turns"] == 0.0 for r in rows)
    sync, _ = _run(tmp_path, "sync")
    assert rows[0]["reward/mean"] == sync[0]["reward/mean"]  # the same first rollout
    assert rows[1]["reward/mean"] != sync[1]["reward/mean"] or rows[1]["loss/total"] != sync[1]["loss/total"]


def test_staleness_one_tokens_carry_the_version_that_sampled_them(tmp_path, monkeypatch):
    """Every token's recorded version is the one the engine was synced to for its step (the sync log), and
    the trainer's forward with that version's adapters gives the token's sampling log-prob (a later
    version does not)."""
    from rolerl.train import rl
    from rolerl.train.pipeline import RolloutPipeline

    seen = {}

    class Recording(RolloutPipeline):
        def __init__(self, backend, policy, steps, *args, **kwargs):
            super().__init__(backend, policy, steps, *args, **kwargs)
            seen.update(pipeline=self, episodes={}, steps={self.start: dict(steps)})
            seen["weights"] = {self.start: snapshot_tensors(policy)}

        def episodes(self, step):
            seen["episodes"][step] = out = super().episodes(step)
            return out

        def publish(self, step, policy, steps):
            seen["steps"][step], seen["weights"][step] = dict(steps), snapshot_tensors(policy)
            return super().publish(step, policy, steps)

    monkeypatch.setattr(rl, "RolloutPipeline", Recording)
    cfg = tiny_config(tmp_path / "run", "train.steps=4", "train.max_staleness=1", *ASYNC)
    task = EchoTask()
    workflow = SingleTurn(task)
    policy = build_policy(cfg, workflow.roles)
    train(cfg, task=task, workflow=workflow, policy=policy)
    assert seen["pipeline"].log == [(1, 0), (2, 0), (3, 1), (4, 2)]  # step s samples step s - 2's adapters
    for step, want in seen["pipeline"].log:
        turns = [t for ep in seen["episodes"][step] for t in ep.turns]
        version = seen["steps"][want]["policy"]
        assert version == want  # one optimizer step per training step
        assert {v for t in turns for v in t.versions} == {version}  # no tool: every token sampled
        # the version that sampled, and the next one
        gaps = version_gaps(policy, turns, seen["weights"], (want, want + 1), cfg.rollout.temperature)
        assert gaps[want] < 1e-4, f"step {step}: the version recorded reproduces the sampling log-probs"
        assert gaps[want + 1] > 1e-3, f"step {step}: another version does not"


def test_a_batch_beyond_max_staleness_is_dropped(tmp_path):
    # 8 rows in mini-batches of 3: three optimizer steps per training step, which the config cannot know
    # (the lag stays 1 step). The rollout of step 2 (the start's adapters) is three optimizer steps behind
    # by then, over the bound of 1: dropped, nothing trains; step 3's (after step 1) is 0 behind: trained
    rows, _ = _run(tmp_path, "drop", "train.max_staleness=1", "train.mini_batch_size=3", *ASYNC)
    turns = 2 * 4  # tasks_per_step x rollout.n, one call each
    assert [r["async/dropped_turns"] for r in rows] == [0.0, turns, 0.0]
    assert [r["staleness/policy/max"] for r in rows] == [0.0, 3.0, 0.0]
    assert "optimizer_steps" not in rows[1] and rows[2]["optimizer_steps"] == 3.0


# ---- resume and faults --------------------------------------------------------------------------------

RESUMABLE = ("train.steps=4", "run.checkpoint_every=2", "run.keep_last=5", "rollout.max_new_tokens=8")


def _resumable(tmp_path, name, *extra, cut=None):
    """A 4-step run; with `cut`, first stopped after that step (as a kill would) and then resumed. Returns
    its metrics without times and its final adapters."""
    cfg = tiny_config(tmp_path / name, *RESUMABLE, *extra)
    if cut is not None:
        train(cfg, task=EchoTask(), workflow=SingleTurn(EchoTask()), stop_after=cut)
    policy = build_policy(cfg, ("policy",))
    train(cfg, task=EchoTask(), workflow=SingleTurn(EchoTask()), policy=policy, resume=cut is not None)
    return strip_time(RunDir(cfg.run.dir, tensorboard=False).read_metrics()), snapshot_tensors(policy)


def _same(a, b):
    (rows_a, weights_a), (rows_b, weights_b) = a, b
    assert rows_a == rows_b
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.parametrize("k", [1, 2])
def test_an_async_run_resumed_from_its_checkpoint_is_the_uninterrupted_run(tmp_path, k):
    """Cut after step 2 (checkpointed) and resumed: steps 3..2+k sample the adapters after steps 2-k..1,
    which the checkpoint keeps, so every metric and the final adapters are bit-identical. Exact, not close:
    the resumed run does the same operations on the same values (the versions are saved as the fp32
    tensors the trainer cloned, the engine's copy takes them by `copy_`, every sampling seed is a function
    of the run seed and the step, and the trainer's state is restored as in the synchronous resume)."""
    full = _resumable(tmp_path, "full", f"train.max_staleness={k}", *ASYNC)
    resumed = _resumable(tmp_path, "cut", f"train.max_staleness={k}", *ASYNC, cut=2)
    assert [r["step"] for r in resumed[0]] == [1, 2, 3, 4]
    assert [r["staleness/policy/max"] for r in resumed[0]] == [
        0.0,
        *[float(min(s - 1, k)) for s in (2, 3, 4)],
    ]
    _same(resumed, full)
    state = torch.load(tmp_path / "cut" / "checkpoints" / "step_2" / "state.pt", weights_only=False)
    assert sorted(state["rollout"]["versions"]) == list(range(max(0, 2 - k), 2))  # steps 3..2+k sample them


def test_a_checkpoint_without_versions_resumes_from_its_own_adapters_with_a_warning(tmp_path, caplog):
    """A checkpoint a synchronous or older run wrote: the first rollouts sample its adapters (0 behind)."""
    cfg = tiny_config(tmp_path / "old", *RESUMABLE, "train.max_staleness=1", *ASYNC)
    train(cfg, task=EchoTask(), workflow=SingleTurn(EchoTask()), stop_after=2)
    path = tmp_path / "old" / "checkpoints" / "step_2" / "state.pt"
    state = torch.load(path, weights_only=False)
    del state["rollout"]
    torch.save(state, path)
    with caplog.at_level(logging.WARNING, logger="rolerl.train.pipeline"):
        train(cfg, task=EchoTask(), workflow=SingleTurn(EchoTask()), resume=True)
    assert "the checkpoint at step 2 keeps no adapter versions" in caplog.text
    rows = RunDir(cfg.run.dir, tensorboard=False).read_metrics()
    assert [r["staleness/policy/max"] for r in rows] == [0.0, 1.0, 0.0, 1.0]


class FailingTask(EchoTask):
    """Raises at the `at`-th reward (inside the rollout thread); with `release`, waits for it there
    instead (a rollout that takes long), after setting `blocked`."""

    def __init__(self, at: int, release: threading.Event | None = None) -> None:
        self.at, self.calls, self.release, self.blocked = at, 0, release, threading.Event()

    def reward(self, example, text):
        self.calls += 1
        if self.calls == self.at:
            if self.release is None:
                raise OSError("the reward server is gone")
            self.blocked.set()
            self.release.wait()
        return super().reward(example, text)


def bounded(fn, seconds: float):
    """`fn()` in a thread, failing the test if it does not return within `seconds` (no pytest-timeout
    here): a hang fails rather than blocking the suite. Returns its result or raises its error."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_failed_rollout_stops_the_run_naming_its_step_and_resume_is_exact(tmp_path):
    """The rollout of step 3 raises in the thread: the run stops with an error naming step 3 and the
    cause, step 2 is checkpointed on the way out (no regular checkpoint is due), and resuming from it
    gives the uninterrupted run."""
    extra = ("train.max_staleness=1", *ASYNC, "run.checkpoint_every=10")
    cfg = tiny_config(tmp_path / "cut", *RESUMABLE, *extra)
    task = FailingTask(at=2 * 8 + 1)  # 8 rewards a step: step 3's first
    with pytest.raises(RolloutThreadError) as e:
        bounded(lambda: train(cfg, task=task, workflow=SingleTurn(task)), 60)
    assert "the rollout of step 3 failed in the rollout thread: OSError: the reward server is gone" in str(
        e.value
    )
    assert f"step 2 is checkpointed; continue with rolerl train --resume {cfg.run.dir}" in str(e.value)
    assert [s for s, _ in checkpoints(cfg.run.dir)] == [2]
    policy = build_policy(cfg, ("policy",))
    train(cfg, task=EchoTask(), workflow=SingleTurn(EchoTask()), policy=policy, resume=True)
    got = strip_time(RunDir(cfg.run.dir, tensorboard=False).read_metrics()), snapshot_tensors(policy)
    _same(got, _resumable(tmp_path, "full", *extra))


class NoBackend:
    """What the rollout thread calls on a backend: `sync`."""

    def sync(self, version):
        return {}


def _pipeline(generate, cls=RolloutPipeline, **kwargs):
    """A pipeline over a tiny policy whose rollouts are `generate(step)`, steps 1..4, one step behind."""
    policy = build_policy(tiny_config("unused", "train.max_staleness=1", *ASYNC), ("policy",))
    return cls(NoBackend(), policy, {"policy": 0}, generate, **{"lag": 1, "start": 0, "last": 4} | kwargs)


def test_a_rollout_thread_that_ends_without_an_error_is_an_error_at_once():
    class EndsEarly(RolloutPipeline):
        def _run(self):
            self.last = self.start + 1  # the thread's loop ends after step 1's rollout, as a bug would
            super()._run()

    pipeline = _pipeline(lambda step: [], EndsEarly, wait_s=60)
    assert pipeline.episodes(1) == []
    t0 = time.perf_counter()
    with pytest.raises(
        RolloutThreadError, match="ended after step 1's rollout, without step 2's and without"
    ):
        bounded(lambda: pipeline.episodes(2), 10)
    assert time.perf_counter() - t0 < 5, "woken by the thread's end, not by a wait_s timeout"
    bounded(pipeline.close, 10)


def test_close_while_the_thread_waits_for_a_version_returns_at_once():
    """The trainer failed before publishing step 1: the thread, its rollouts of steps 1 and 2 done
    (both sample the start), waits for version 1; `close` ends it."""
    pipeline = _pipeline(lambda step: [], wait_s=60)
    assert pipeline.episodes(2) == []
    t0 = time.perf_counter()
    bounded(pipeline.close, 10)
    assert time.perf_counter() - t0 < 5 and not pipeline._thread.is_alive()
    assert pipeline.log == [(1, 0), (2, 0)]


def test_close_during_a_rollout_that_does_not_end_is_bounded(caplog):
    release, started = threading.Event(), threading.Event()

    def generate(step):
        started.set()
        release.wait()
        return []

    pipeline = _pipeline(generate, close_s=0.5)
    assert started.wait(10)
    try:
        with caplog.at_level(logging.WARNING, logger="rolerl.train.pipeline"):
            bounded(pipeline.close, 10)
        assert "the rollout of step 1 is still running 0 s after the run stopped" in caplog.text
    finally:
        release.set()  # the daemon thread finishes its rollout and stops: closed
    pipeline._thread.join(10)
    assert not pipeline._thread.is_alive() and pipeline.log == [(1, 0)]


def test_a_trainer_error_during_a_rollout_stops_the_run_without_waiting_for_it(tmp_path, monkeypatch):
    """The update of step 2 fails while the rollout of step 3 is stuck (a reward that never returns): the
    trainer's error comes out after `close_s`, with step 1 checkpointed; nothing waits for the rollout."""
    from rolerl.train import rl

    release = threading.Event()
    task = FailingTask(at=2 * 8 + 1, release=release)
    update, calls = rl.ppo_update, []

    def failing_update(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            assert task.blocked.wait(30), "the rollout of step 3 started"
            raise RuntimeError("the update failed")
        return update(*args, **kwargs)

    monkeypatch.setattr(rl, "ppo_update", failing_update)
    monkeypatch.setattr(rl, "RolloutPipeline", functools.partial(RolloutPipeline, close_s=0.5))
    cfg = tiny_config(tmp_path / "run", *RESUMABLE, "train.max_staleness=1", *ASYNC)
    try:
        with pytest.raises(RuntimeError, match="the update failed"):
            bounded(lambda: train(cfg, task=task, workflow=SingleTurn(task)), 60)
    finally:
        release.set()
    assert [s for s, _ in checkpoints(cfg.run.dir)] == [1]
