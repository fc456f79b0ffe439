"""`rollout.dtype` (issue 19): the engine samples from a bf16 copy of the model while the trainer keeps its
fp32 weights; the copy's adapters follow the trainer's after every step; the trainer must recompute the
old log-probs (`algorithm.old_logp: auto` does so exactly where the rollout computes otherwise); the
mismatch is logged."""

from __future__ import annotations

import pytest
import torch

import rolerl
from rolerl.config import ConfigError, load_config
from rolerl.rollout.engine import Engine, GenerationRequest, rollout_copy
from rolerl.rollout.sampling import SamplingParams
from rolerl.run.policy import build_policy
from rolerl.train import update
from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import loss_settings, resolve_old_logp, train
from rolerl.workflows import SingleTurn
from tests.train.test_rl import tiny_config
from tests.workflows.test_single_turn import EchoTask


def test_the_copy_follows_the_trainers_adapters_and_leaves_the_trainer_alone(tokenizer):
    model, tok = rolerl.tiny_model("llama", seed=0, tokenizer=tokenizer)
    rolerl.add_adapters(model, "policy", rank=4)
    engine = Engine(rollout_copy(model, torch.bfloat16), tok, max_batch=2, source=model)
    assert engine.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    copy = dict(engine.model.named_parameters())
    stale = [
        n
        for n, p in model.named_parameters()
        if "lora_B" in n and not torch.equal(copy[n], p.to(torch.bfloat16))
    ]
    assert stale, "before sync the copy still holds the old adapters"
    engine.sync()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert torch.equal(copy[name], p.detach().to(torch.bfloat16)), name
        assert p.dtype == torch.float32 and not copy[name].requires_grad
    (turn,) = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=4, seed=1),
                                                 route_of=dict.fromkeys(rolerl.roles.KINDS, 0))])  # fmt: skip
    assert len(turn.completion_ids) == 4


def test_a_bf16_rollout_needs_the_trainer_to_recompute(tmp_path):
    task = EchoTask()
    cfg = tiny_config(tmp_path / "a", "train.steps=1", "rollout.dtype=bfloat16")
    with pytest.raises(ConfigError, match="old_logp=recompute"):
        train(cfg, task=task, workflow=SingleTurn(task))


def test_a_run_with_bf16_rollouts_logs_the_mismatch_and_trains(tmp_path):
    task = EchoTask()
    cfg = tiny_config(tmp_path / "b", "train.steps=2", "rollout.dtype=bfloat16", "algorithm.old_logp=recompute",
                      "algorithm.tis_cap=2.0")  # fmt: skip
    rows = RunDir(train(cfg, task=task, workflow=SingleTurn(task)), tensorboard=False).read_metrics()
    assert len(rows) == 2
    for r in rows:  # bf16 sampling vs the fp32 trainer: a real, bounded mismatch (bf16 has 8 mantissa bits)
        assert 1e-5 < r["logp_mismatch/mean_abs"] < 0.2 and 0.5 < r["logp_mismatch/tis_weight_mean"] < 1.5


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ((), "rollout"),  # fp32 rollouts from the trainer's own weights: the engine's log-probs serve
        (("rollout.dtype=float32",), "rollout"),  # a copy in the trainer's own dtype: the same arithmetic
        (("rollout.dtype=bfloat16",), "recompute"),
        (("train.bf16=true",), "recompute"),  # the trainer autocasts, the rollout does not
    ],
)
def test_auto_old_logp_recomputes_only_where_the_rollout_computes_otherwise(tmp_path, extra, want):
    cfg = tiny_config(tmp_path, "algorithm.old_logp=auto", "algorithm.tis_cap=2.0", *extra)
    policy = build_policy(cfg, ["policy"])
    resolved, why = resolve_old_logp(cfg, policy)
    assert resolved.algorithm.old_logp == want and f"-> {want}" in why
    # TIS needs the trainer's log-probs: it stays where they are recomputed, and goes where they are not
    assert resolved.algorithm.tis_cap == (2.0 if want == "recompute" else None)
    assert loss_settings(cfg, policy).algorithm == resolved.algorithm
    explicit = tiny_config(tmp_path, "algorithm.old_logp=recompute", *extra)
    assert resolve_old_logp(explicit, policy)[0] is explicit, "an explicit choice is never changed"


def test_auto_old_logp_run_takes_the_rollouts_log_probs_and_writes_the_users_config(tmp_path, monkeypatch):
    task = EchoTask()
    cfg = tiny_config(tmp_path / "c", "train.steps=1", "algorithm.old_logp=auto", "algorithm.tis_cap=2.0",
                      "train.mini_batches=2")  # fmt: skip
    calls = []
    real = update.recompute_logprobs
    monkeypatch.setattr(update, "recompute_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_dir = train(cfg, task=task, workflow=SingleTurn(task))
    (row,) = RunDir(run_dir, tensorboard=False).read_metrics()
    assert not calls, "two mini-batches of fp32 rollouts need no recompute pass"
    # measured on the first mini-batch, before any optimizer step: fp32 rounding, no TIS
    assert row["logp_mismatch/max_abs"] < 1e-3 and "logp_mismatch/tis_weight_mean" not in row
    assert row["optimizer_steps"] == 2.0
    assert load_config(run_dir / "config.yaml").algorithm.old_logp == "auto"
