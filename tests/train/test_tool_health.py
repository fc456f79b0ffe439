"""A broken tool is surfaced, never silent: the engine marks calls on which the tool itself raised, the
step metrics count them, and the run warns once; a tool that cannot start stops the run before step 1."""

from __future__ import annotations

import logging

import pytest
import torch

from rolerl.models.tiny import tiny_model
from rolerl.roles import encode_exact
from rolerl.rollout.engine import Engine, GenerationRequest
from rolerl.rollout.sampling import SamplingParams
from rolerl.tools.base import ToolResult
from rolerl.train.monitor import ToolHealth, episode_metrics
from rolerl.types import Episode


class Broken:
    name, description = "python", "raises on every call"

    def run(self, args: str) -> ToolResult:
        raise RuntimeError("sandbox worker failed to start")


class Fails:
    name, description = "python", "the code fails"

    def run(self, args: str) -> ToolResult:
        return ToolResult(stderr="NameError: name 'x' is not defined\n", exit_code=1)


def one_call(tool, tokenizer) -> list:
    """A turn that writes one tool call (scripted tokens through the real engine), then ends."""
    model, _ = tiny_model("llama", tokenizer=tokenizer)
    script = [*encode_exact(tokenizer, "<code>print(x)</code>"), tokenizer.eos_token_id]

    def sampler(logits, params, seeds, counters):
        tokens = torch.tensor([script[int(c)] for c in counters])
        return tokens, torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)

    engine = Engine(model, tokenizer, max_batch=2, tools={"python": tool}, sampler=sampler)
    try:
        request = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=32), tool="python")
        turn = engine.generate([request])[0]
    finally:
        engine.close()
    return turn


@pytest.mark.parametrize(("tool", "failed"), [(Broken(), True), (Fails(), False)])
def test_a_tool_that_raises_is_told_apart_from_code_that_fails(tokenizer, tool, failed):
    turn = one_call(tool, tokenizer)
    (call,) = turn.tool_calls
    assert call.error and call.tool_failed is failed
    assert ("sandbox worker failed to start" in call.output) is failed


def test_metrics_count_failures_and_the_run_warns_once(tokenizer, caplog):
    turn = one_call(Broken(), tokenizer)
    episodes = [Episode(task_id="t", turns=[turn], reward=0.0) for _ in range(20)]

    class P:
        route_of = {"policy": {}}

    metrics = episode_metrics(episodes, P())
    assert metrics["tools/calls"] == 20 and metrics["tools/failures"] == 20
    assert metrics["tools/errors"] == 20 and metrics["tools/error_rate"] == 1.0
    health = ToolHealth()
    with caplog.at_level(logging.WARNING, logger="rolerl.train.monitor"):
        health.check(1, episodes)
        health.check(2, episodes)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one "tool failed", one "error rate": each once per run
    assert "the python tool itself failed on 20 of 20 calls" in warnings[0]
    assert "sandbox worker failed to start" in warnings[0]
    assert "20 of 20 tool calls errored" in warnings[1]


def test_code_errors_below_the_threshold_do_not_warn(tokenizer, caplog):
    turn = one_call(Fails(), tokenizer)
    episodes = [Episode(task_id="t", turns=[turn], reward=0.0) for _ in range(ToolHealth.MIN_CALLS - 1)]
    with caplog.at_level(logging.WARNING, logger="rolerl.train.monitor"):
        ToolHealth().check(1, episodes)
    assert not caplog.records


def test_a_run_whose_tool_cannot_start_fails_before_any_step(tmp_path, capsys, monkeypatch):
    """As non-root the sandbox refuses to start: `rolerl train` says so in one line and writes no step."""
    from rolerl.cli import main

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.delenv("ROLERL_SANDBOX_PRIVILEGE", raising=False)
    run = tmp_path / "run"
    argv = ["train", "smoke", "--set", "model.spec=tiny:llama", "task.name=synthetic",
            "task.workflow=tir", "rollout.tool=python", f"run.dir={run}", "run.progress=false"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rolerl train: error:") and "root" in err[-1]
    assert "unprivileged" in err[-1]  # names the weaker mode one can choose
    assert not (run / "metrics.jsonl").exists()
