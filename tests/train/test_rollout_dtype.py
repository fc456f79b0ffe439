"""`rollout.dtype` (issue 19): the engine samples from a bf16 copy of the model while the trainer keeps its
fp32 weights; the copy's adapters follow the trainer's after every step; the trainer must recompute the
old log-probs; the mismatch is logged."""

from __future__ import annotations

import pytest
import torch

import rolerl
from rolerl.config import ConfigError
from rolerl.rollout.engine import Engine, GenerationRequest, rollout_copy
from rolerl.rollout.sampling import SamplingParams
from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import train
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
