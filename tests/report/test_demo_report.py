"""`rolerl report` of a `rolerl demo` directory: its GRPO run's figures plus the before/after table of its
held-out evaluations (results.json), per family, with the falls marked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rolerl.cli import main
from rolerl.report.html import write_report
from rolerl.report.runs import load_runs


def _summary(acc: float, n: int, families: dict[str, float]) -> dict[str, float]:
    return {"accuracy": acc, "stderr": (acc * (1 - acc) / n) ** 0.5, "n": float(n), "tool_use": 1.0} | {
        f"accuracy/{f}": v for f, v in families.items()
    }


def _demo_dir(root: Path, rl: bool = True) -> Path:
    """A demo directory as `run_demo` leaves it: results.json, sft/ and rl/ runs, eval rows at 0 and 2."""
    evals = {
        "base/format": _summary(0.0, 8, {"tags": 0.0, "units": 0.0}),
        "base/rl": _summary(0.125, 8, {"average": 0.25, "percent": 0.0}),
        "warm/format": _summary(1.0, 64, {"tags": 1.0, "units": 1.0}),
        "warm/rl": _summary(0.41, 256, {"average": 0.5, "percent": 0.32}),
    }
    if rl:
        evals |= {"rl/format": _summary(0.828125, 64, {"tags": 1.0, "units": 0.65625}),
                  "rl/rl": _summary(0.734375, 256, {"average": 0.75, "percent": 0.71875})}  # fmt: skip
    results = {"settings": {"seed": 0}, "evals": evals}
    if rl:
        results["gain"] = {"points": 32.4375, "stderr_points": 4.2}
    root.mkdir(parents=True)
    (root / "results.json").write_text(json.dumps(results))
    (root / "sft").mkdir()
    (root / "sft" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    if rl:
        (root / "rl").mkdir()
        rows = [{"step": s, "reward/mean": 0.4 + 0.1 * s, "accuracy": 0.4 + 0.1 * s} for s in (1, 2)]
        rows += [{"step": 0, "eval/pass@1": 0.41, "eval/format/pass@1": 1.0},
                 {"step": 2, "eval/pass@1": 0.734375, "eval/format/pass@1": 0.828125}]  # fmt: skip
        (root / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _table(page: str, heading: str) -> list[list[str]]:
    m = re.search(rf"<h4>{re.escape(heading)}</h4><table class=\"demo\">(.*?)</table>", page, re.S)
    assert m, heading
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", m.group(1))]


def test_report_of_a_demo_directory_shows_its_before_and_after(tmp_path):
    demo = _demo_dir(tmp_path / "demo-20261204-120000")
    assert main(["report", str(demo)]) == 0
    page = (demo / "report" / "report.html").read_text()  # beside results.json, not in rl/
    assert '<a href="#demo">Before and after</a>' in page
    assert "RL families: +32.4 points over the warm start</strong> (standard error 4.2, +7.7 SE)" in page
    rl = _table(page, "RL families (trained by GRPO)")
    assert rl[0] == ["family", "base model", "warm start", "after RL", "change over RL"]
    assert rl[1] == ["average", "25.0%", "50.0%", "75.0%", "+25.0"]
    assert rl[3] == ["all", "12.5% ± 11.7 (n=8)", "41.0% ± 3.1 (n=256)", "73.4% ± 2.8 (n=256)", "+32.4"]
    fmt = _table(page, "format families (taught by imitation)")
    assert fmt[1] == ["tags", "0.0%", "100.0%", "100.0%", "0.0"]  # no change: no sign, no colour
    assert fmt[2] == ["units", "0.0%", "100.0%", "65.6%", "-34.4"]
    assert '<td class="num down">-34.4</td>' in page and '<td class="num up">+25.0</td>' in page
    assert '<td class="num">0.0</td>' in page
    # the run's own figures: the eval rows at steps 0 and 2 are drawn, the steps column counts training steps
    assert "series-eval-demo_20261204_120000-eval_pass_1" in page
    assert re.search(r'<td class="num">2 \(1–2\)</td>', page)


def test_a_demo_stopped_after_the_warm_start_reports_its_imitation_run(tmp_path):
    demo = _demo_dir(tmp_path / "demo", rl=False)
    [run] = load_runs([demo])
    assert (
        run.path == demo / "sft" and run.name == "demo" and run.demo["evals"]["warm/rl"]["accuracy"] == 0.41
    )
    page = write_report([demo], tmp_path / "out").read_text()
    assert _table(page, "RL families (trained by GRPO)")[0] == ["family", "base model", "warm start"]
    assert "points over the warm start" not in page


def test_two_demos_side_by_side_and_a_demo_without_a_stage(tmp_path):
    a, b = _demo_dir(tmp_path / "seed0"), _demo_dir(tmp_path / "seed1")
    page = write_report([a, b], tmp_path / "out").read_text()
    assert "<h3>seed0</h3>" in page and "<h3>seed1</h3>" in page
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="demo directory without a finished stage"):
        load_runs([bare])
