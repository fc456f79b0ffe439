"""`rolerl diagnose interaction` end to end on tiny runs: every variant evaluated with n samples per
question (the hybrids through a routing table: one kind on the trained adapter, the rest on the base),
the coefficients written, and evaluations reused on a second call."""

from __future__ import annotations

import json

import pytest

from rolerl.cli import main
from rolerl.config import load_config
from rolerl.eval.harness import EvalSpec, spec_policy
from rolerl.tasks import TASKS
from rolerl.train.rl import train
from tests.train.test_rl import TINY
from tests.workflows.test_single_turn import EchoTask

VARIANT_RUNS = {
    "joint": ["adapters.preset=shared"],
    "reas": ["adapters.preset=masked", "adapters.train_kinds=[reasoning, answer]"],
    "tool": ["adapters.preset=masked", "adapters.train_kinds=[tool_call]"],
}


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Three one-step tiny runs on a task a random model solves about half the time."""
    monkeypatch.setitem(TASKS, "echo", EchoTask)
    out = {}
    for name, sets in VARIANT_RUNS.items():
        out[name] = tmp_path / name
        train(load_config(None, [*TINY, f"run.dir={out[name]}", "train.steps=1", "task.name=echo", *sets]))
    return out


def test_variants_hybrids_and_coefficients(runs, tmp_path, capsys):
    args = ["diagnose", "interaction", "--task", "echo", "--limit", "6", "--samples", "4",
            "--max-new-tokens", "6", "--joint", str(runs["joint"]), "--reasoning-only", str(runs["reas"]),
            "--tool-only", str(runs["tool"]), "--hybrids", "--out", str(tmp_path / "leas")]  # fmt: skip
    assert main(args) == 0
    out = tmp_path / "leas"
    summary = json.loads((out / "interaction.json").read_text())
    assert summary["kept"] + summary["dropped"] == 6 and summary["kept"] >= 1 and summary["samples"] == 4
    assert summary["sources"]["base"] == "tiny:llama", "the joint run's model without adapters"
    rows = (out / "interaction.csv").read_text().splitlines()
    assert len(rows) == 1 + summary["kept"] and "l23" in rows[0].split(",")  # hybrids: the full solve
    hybrid = json.loads((out / "hybrid_tool" / "results.json").read_text())["identity"]
    assert (
        hybrid["table"]["policy"]["tool_call"] == "policy" and hybrid["table"]["policy"]["reasoning"] is None
    )
    for variant in ("base", "joint", "reas", "tool", "hybrid_tool", "hybrid_reas"):
        assert len((out / variant / "samples.jsonl").read_text().splitlines()) == 6 * 4
    assert f"of {summary['kept']} kept questions" in capsys.readouterr().out
    # a second call evaluates nothing again: every variant's samples are there
    before = {v: (out / v / "samples.jsonl").stat().st_mtime_ns for v in ("base", "hybrid_reas")}
    assert main(args) == 0
    assert {v: (out / v / "samples.jsonl").stat().st_mtime_ns for v in before} == before


def test_a_hybrid_table_routes_one_kind_to_the_adapter_and_the_rest_to_the_base(runs):
    table = {"policy": {"tool_call": "policy", "default": None}}
    spec = EvalSpec(task="echo", run=str(runs["tool"]), table=table, limit=1, progress=False)
    policy, _, identity = spec_policy(spec, ["policy"])
    route = policy.route_of["policy"]
    assert route["tool_call"] == 0 and route["reasoning"] == route["answer"] == route["prompt"] == -1
    with pytest.raises(ValueError, match="--table routes to trained adapters: give --adapters DIR or --run"):
        EvalSpec(task="echo", table=table)


def test_a_variant_that_is_neither_a_run_nor_an_eval_is_refused(runs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    args = ["diagnose", "interaction", "--task", "echo", "--limit", "2", "--samples", "2", "--joint",
            str(runs["joint"]), "--reasoning-only", str(tmp_path / "empty"), "--tool-only", str(runs["tool"]),
            "--out", str(tmp_path / "x")]  # fmt: skip
    assert main(args) == 2
    assert "reas: " in (err := capsys.readouterr().err) and "neither a training run" in err
    assert main([*args[:-2], "--budget", "1", "--out", str(tmp_path / "y")]) == 2
    assert "--budget 1 is below --samples 2" in capsys.readouterr().err
