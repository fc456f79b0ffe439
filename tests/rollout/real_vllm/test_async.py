"""Asynchronous training (`train.max_staleness: 1`) through real vLLM's offline engine (CPU build, `make
test-vllm`): step s samples the adapters after step s - 2, loaded into vLLM from the trainer's kept copy of
that version; every token records that version, and the trainer's forward with that version's adapters
gives the token's sampling log-prob within the parity bound (the next version's does not)."""

from __future__ import annotations

import pytest

from rolerl.run.policy import build_policy
from rolerl.train.checkpoint import RunDir
from rolerl.workflows import SingleTurn
from tests.rollout.real_vllm.conftest import REPORT, _drop_loras
from tests.rollout.real_vllm.parity import FP32_BOUND
from tests.rollout.real_vllm.test_train import SETTINGS
from tests.rollout.test_vllm_async_training import Recording
from tests.train.test_async import version_gaps
from tests.workflows.test_single_turn import EchoTask

pytestmark = pytest.mark.vllm


def test_staleness_one_tokens_carry_the_version_vllm_sampled_them_with(engine, tmp_path, monkeypatch):
    import rolerl.rollout.vllm_backend as vb
    from rolerl.config import load_config
    from rolerl.train import rl

    def session_engine(spec, cfg, max_rank, model):  # the session's engine, not a new one
        _drop_loras(engine)
        return engine

    monkeypatch.setattr(vb, "_offline_llm", session_engine)
    monkeypatch.setattr(rl, "RolloutPipeline", Recording)
    sets = [s for s in SETTINGS if not s.startswith(("eval.", "optim.lr"))]
    cfg = load_config(None, [
        *sets, "optim.lr=1e-2", "train.max_staleness=1", "algorithm.old_logp=recompute", "algorithm.tis_cap=2.0",
        f"run.dir={tmp_path / 'run'}",
    ])  # fmt: skip
    task = EchoTask()
    workflow = SingleTurn(task)
    policy = build_policy(cfg, workflow.roles)
    rows = RunDir(
        rl.train(cfg, task=task, workflow=workflow, policy=policy), tensorboard=False
    ).read_metrics()
    seen = Recording.seen
    assert seen["pipeline"].log == [(1, 0), (2, 0), (3, 1)]
    assert [r["staleness/policy/max"] for r in rows] == [0.0, 1.0, 1.0]
    found = []
    for step, want in seen["pipeline"].log:
        turns = [t for ep in seen["episodes"][step] for t in ep.turns]
        assert {v for t in turns for v in t.versions} == {want}
        gaps = version_gaps(policy, turns, seen["weights"], (want, want + 1), cfg.rollout.temperature)
        found.append((round(gaps[want], 6), round(gaps[want + 1], 6)))
        assert gaps[want] < FP32_BOUND, f"step {step}: vLLM sampled with the version recorded"
        assert gaps[want + 1] > 2 * FP32_BOUND, f"step {step}: not with the next one"
    assert len(engine.llm_engine.list_loras()) == 1  # old versions unloaded
    REPORT.append(f"async k=1: max |logp| gap to the recorded version, to the next, per step: {found}")
