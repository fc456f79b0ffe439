"""The `smoke` example config shows the loop doing something on the real default model: rewards that vary within
a group, so the first step already has a nonzero loss and gradient (with the strict arithmetic task every
reward, loss and gradient norm was 0)."""

from __future__ import annotations

import json

import pytest

from rolerl.config import load_config
from rolerl.train.rl import train

SMOKE = "smoke"  # the example shipped in the package, rolerl/configs/smoke.yaml


@pytest.mark.slow
def test_smoke_config_has_a_nonzero_gradient_at_step_1(tmp_path):
    cfg = load_config(SMOKE, [f"run.dir={tmp_path}", "train.steps=1", "run.progress=false"])
    assert cfg.task.name == "arithmetic_lenient" and cfg.model.spec == "default"
    train(cfg)
    (step,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert step["reward/std"] > 0 and step["advantage/abs_mean"] > 0
    assert step["grad_norm"] > 0 and step["loss/total"] != 0
