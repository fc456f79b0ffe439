"""GRPO through `rollout.backend: vllm` on real vLLM (offline engine; CPU build, `make test-vllm`): three
steps on the default model, shared and dart, cut after step 2 and resumed. Every sync loads a new adapter
version and passes the probe, old versions are unloaded, the metrics are logged, held-out evaluation goes
through vLLM too."""

from __future__ import annotations

import math

import pytest

from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import train
from rolerl.workflows import SingleTurn
from tests.rollout.real_vllm.conftest import REPORT, _drop_loras
from tests.rollout.real_vllm.parity import FP32_BOUND
from tests.workflows.test_single_turn import EchoTask

pytestmark = pytest.mark.vllm

SETTINGS = [
    "model.spec=default", "model.device=cpu", "model.dtype=float32", "train.bf16=false", "rollout.backend=vllm",
    "rollout.n=4", "rollout.max_new_tokens=16", "rollout.max_len=1024", "rollout.temperature=0.7",
    "train.tasks_per_step=2", "train.micro_batch_size=4", "train.steps=3", "run.checkpoint_every=1",
    "optim.lr=1e-3", "optim.warmup_steps=1", "adapters.rank=8", "run.progress=false", "run.tensorboard=false",
    "train.skip_inert_rows=false", "eval.every=3", "eval.limit=2",
]  # fmt: skip
PRESETS = {
    "shared": ["adapters.preset=shared"],
    "dart": ["adapters.preset=dart", "algorithm.old_logp=recompute", "algorithm.tis_cap=2.0"],
}


@pytest.mark.parametrize("preset", ["shared", "dart"])
def test_grpo_steps_sync_probe_unload_and_resume(engine, tmp_path, monkeypatch, preset):
    import rolerl.rollout.vllm_backend as vb
    from rolerl.config import load_config

    built = []

    def session_engine(spec, cfg, max_rank, model):  # the session's engine, not a new one per run
        _drop_loras(engine)
        built.append(cfg)
        return engine

    monkeypatch.setattr(vb, "_offline_llm", session_engine)
    cfg = load_config(None, [*SETTINGS, *PRESETS[preset], f"run.dir={tmp_path / 'run'}"])
    task = EchoTask()
    train(cfg, task=task, workflow=SingleTurn(task), stop_after=2)  # interrupted after step 2
    train(cfg, task=task, workflow=SingleTurn(task), resume=True)
    rows = RunDir(cfg.run.dir, tensorboard=False).read_metrics()
    assert [r["step"] for r in rows] == [1, 2, 3] and len(built) == 2
    trained = "policy" if preset == "shared" else "reason"  # no tool here: dart's tool adapter never trains
    # a new version per step; the resumed run serves the checkpoint's adapters as v1, then step 3's as v2
    assert [r[f"rollout/adapter_version/{trained}"] for r in rows] == [2.0, 3.0, 2.0]
    for r in rows:
        assert r["rollout/sync_check"] == 1.0 and r[f"rollout/probe_delta/{trained}"] > 0
        assert r[f"rollout/probe_vs_trainer/{trained}"] < FP32_BOUND
        assert r[f"rollout/probe_sampled_vs_trainer/{trained}"] < FP32_BOUND
        assert all(
            math.isfinite(r[k]) for k in ("loss/total", "reward/mean", "grad_norm", "logp_mismatch/max_abs")
        )
        if preset == "shared":  # one adapter per call: the rollout's log-probs are the trainer's
            assert r["logp_mismatch/max_abs"] < FP32_BOUND
    assert rows[2]["eval/samples"] == 2.0 and "eval/pass@1" in rows[2]
    # old versions unloaded: the engine holds each adapter's current version only
    assert len(engine.llm_engine.list_loras()) == (1 if preset == "shared" else 2)
    REPORT.append(f"grpo {preset}: logp_mismatch/max_abs per step "
                       f"{[round(r['logp_mismatch/max_abs'], 6) for r in rows]}")  # fmt: skip
