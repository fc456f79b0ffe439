"""`rolerl demo` end to end on the tiny model: every stage runs and writes its artefacts."""

from __future__ import annotations

import json
import os

import pytest

from rolerl.cli import main

# only the demo run itself: the settings tests below need no sandbox and run everywhere
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the demo's Python sandbox needs root (CI runs as root)"
)


@needs_root
def test_two_step_demo_on_the_tiny_model_writes_metrics_adapters_and_plot(tmp_path, capsys):
    run = tmp_path / "demo"
    args = ["demo", "--model", "tiny:llama", "--quick", "--run-dir", str(run), "--steps", "2", "--json",
            "--set", "rollout.max_new_tokens=8", "train.tasks_per_step=2", "rollout.n=2"]  # fmt: skip
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(results["evals"]) == {f"{s}/{g}" for s in ("base", "warm", "rl") for g in ("format", "rl")}
    assert results["evals"]["rl/rl"]["n"] == 24 and "gain" in results
    assert json.loads((run / "results.json").read_text()) == results
    rows = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    metrics, evals = rows[:2], rows[2:]
    assert [m["step"] for m in metrics] == [1, 2] and all("reward/mean" in m for m in metrics)
    # quick checks the update too: every row runs its forward and backward, also in groups that scored alike
    assert all(m["update/inert_frac"] == 0.0 and "entropy" in m for m in metrics)
    # the held-out evaluations are the run's eval metrics: the warm start at step 0, after RL at the last
    assert [e["step"] for e in evals] == [0, 2]
    for row, stage in zip(evals, ("warm", "rl"), strict=True):
        rl, fmt = results["evals"][f"{stage}/rl"], results["evals"][f"{stage}/format"]
        assert row["eval/pass@1"] == rl["accuracy"] and row["eval/format/pass@1"] == fmt["accuracy"]
        assert row["eval/examples"] == rl["n"] == 24 and row["eval/stderr"] == rl["stderr"]
        families = {k.split("/")[1]: v for k, v in {**rl, **fmt}.items() if k.startswith("accuracy/")}
        logged = {
            k.split("/")[1]: v for k, v in row.items() if k.count("/") == 2 and k != "eval/format/pass@1"
        }
        assert logged == families
    assert main(["report", str(run)]) == 0  # the demo directory as it is: its before/after table
    page = (run / "report" / "report.html").read_text()
    assert "RL families: " in page and page.count('<table class="demo">') == 2
    adapter = run / "rl" / "checkpoints" / "step_2" / "adapters" / "policy"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    assert (run / "sft" / "adapters" / "policy" / "adapter_config.json").exists()
    assert (run / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((run / "demonstrations.jsonl").read_text().splitlines()) == 48
    assert main(args) == 2, "a finished demo is never overwritten"
    assert "already holds a demo" in capsys.readouterr().err


def test_quick_runs_every_row_of_the_update_unless_told_otherwise():
    from rolerl.demo import DemoSettings, demo_config

    assert demo_config(DemoSettings()).train.skip_inert_rows is True
    assert demo_config(DemoSettings.quick_check()).train.skip_inert_rows is False
    mine = DemoSettings.quick_check(overrides=("train.skip_inert_rows=true",))  # the user's --set wins
    assert demo_config(mine).train.skip_inert_rows is True and demo_config(mine).train.tasks_per_step == 2
