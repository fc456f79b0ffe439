"""`rolerl diagnose interaction` end to end on tiny runs: every variant evaluated with n samples per
question (the hybrids through a routing table: one kind on the trained adapter, the rest on the base),
the coefficients written, and evaluations reused on a second call; `--base` as an eval directory and as a
model."""

from __future__ import annotations

import csv
import json
import math

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


def _eval_dir(path, ids, ks, n):
    """A `rolerl eval` output holding only samples.jsonl: question ids[i] with ks[i] of n samples correct."""
    path.mkdir(parents=True)
    rows = [{"id": q, "sample": j, "correct": j < k} for q, k in zip(ids, ks, strict=True) for j in range(n)]
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _l23_by_hand(k: dict[str, int], n: int) -> float:
    """λ23 = z_joint - z_tool - z_reas + z_base with z = log((k + 1/2) / (n - k + 1/2))."""
    z = {v: math.log((c + 0.5) / (n - c + 0.5)) for v, c in k.items()}
    return z["joint"] - z["tool"] - z["reas"] + z["base"]


def _csv_l23(out) -> dict[str, float]:
    with (out / "interaction.csv").open() as f:
        return {row["id"]: float(row["l23_closed"]) for row in csv.DictReader(f)}


TRAINED = {"joint": [2, 1, 0], "reas": [1, 1, 2], "tool": [0, 2, 1]}


@pytest.mark.parametrize("base", [[0, 2, 1], [2, 0, 0]])
def test_base_given_as_an_eval_directory_is_read_not_evaluated(tmp_path, capsys, base):
    """`--base EVAL`: its samples are the base variant (nothing is evaluated; no run is asked for its
    model), and λ23 per question is the hand closed form with those counts: z_base enters with a plus."""
    ids = ["q0", "q1", "q2"]
    dirs = {v: _eval_dir(tmp_path / v, ids, ks, 2) for v, ks in {**TRAINED, "base": base}.items()}
    out = tmp_path / "leas"
    args = ["diagnose", "interaction", "--task", "echo", "--limit", "3", "--samples", "2", "--joint", str(dirs["joint"]),
            "--reasoning-only", str(dirs["reas"]), "--tool-only", str(dirs["tool"]), "--base", str(dirs["base"]),
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "interaction.json").read_text())
    assert report["sources"] == {v: str(d) for v, d in dirs.items()}
    assert not (out / "base").exists(), "an eval directory is read, not evaluated again"
    got = _csv_l23(out)
    assert list(got) == ids
    for i, q in enumerate(ids):
        want = _l23_by_hand({v: ks[i] for v, ks in {**TRAINED, "base": base}.items()}, 2)
        assert got[q] == pytest.approx(want, abs=1e-12)
    assert f"of {report['kept']} kept questions" in capsys.readouterr().out


def test_base_given_as_a_model_is_evaluated_without_adapters(tmp_path, monkeypatch, capsys):
    """`--base MODEL`: the model alone is evaluated (n samples of each question, no adapters) into
    OUT/base, and its counts are the base logits of λ23."""
    monkeypatch.setitem(TASKS, "echo", EchoTask)
    ids = [e.id for e in EchoTask().examples("test", 3, 0)]  # the questions `--limit 3` evaluates
    dirs = {v: _eval_dir(tmp_path / v, ids, ks, 2) for v, ks in TRAINED.items()}
    out = tmp_path / "leas"
    args = ["diagnose", "interaction", "--task", "echo", "--limit", "3", "--samples", "2", "--max-new-tokens", "4",
            "--joint", str(dirs["joint"]), "--reasoning-only", str(dirs["reas"]), "--tool-only", str(dirs["tool"]),
            "--base", "tiny:llama", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "interaction.json").read_text())
    assert report["sources"]["base"] == "tiny:llama"
    identity = json.loads((out / "base" / "results.json").read_text())["identity"]
    assert identity == {"model": "tiny:llama", "dtype": "float32"}  # no adapters, no run
    samples = [json.loads(line) for line in (out / "base" / "samples.jsonl").read_text().splitlines()]
    assert sorted((s["id"], s["sample"]) for s in samples) == sorted((q, j) for q in ids for j in range(2))
    k_base = {q: sum(s["correct"] for s in samples if s["id"] == q) for q in ids}
    got = _csv_l23(out)
    for i, q in enumerate(ids):
        want = _l23_by_hand({**{v: ks[i] for v, ks in TRAINED.items()}, "base": k_base[q]}, 2)
        assert got[q] == pytest.approx(want, abs=1e-12)
    assert "base: evaluating tiny:llama" in capsys.readouterr().out
