"""The report's "Roles at work" figure: each role's own metric (`workflow/<name>/<metric>`) in one panel of
rates, the malformed outputs per episode in another; a run without them gets the one-line note."""

from __future__ import annotations

import html
import json
import re

from rolerl.report.figures import specs
from rolerl.report.html import write_report
from rolerl.report.runs import load_runs
from tests.report.test_report import _run

ROLE_KEYS = ("aggregator_choice_acc", "any_voter_correct", "majority_acc")


def _rows() -> list[dict]:
    return [{"step": s, "reward/mean": 0.1 * s, "accuracy": 0.1 * s,
             "workflow/voting/aggregator_choice_acc": 0.2 * s, "workflow/voting/any_voter_correct": 0.9,
             "workflow/voting/majority_acc": 0.5 + 0.1 * s, "workflow/voting/malformed/no_choice": 1.0 / s,
             "workflow/voting/malformed/bad_index": 0.0} for s in (1, 2, 3)]  # fmt: skip


def test_roles_at_work_draws_each_role_metric_and_the_malformed_outputs(tmp_path):
    run = _run(tmp_path / "vote", [], _rows())
    figure = next(f for f in specs(load_runs([run])) if f.name == "workflow")
    assert figure.title == "Roles at work"
    rates, malformed = figure.panels
    # the rates in the pattern's order, then by name; labelled by the metric alone
    assert [(k, label) for k, label, _ in rates.curves["vote"]] == [
        (f"workflow/voting/{m}", m) for m in ROLE_KEYS
    ]
    assert rates.curves["vote"][0][2] == [(1.0, 0.2), (2.0, 0.4), (3.0, 0.2 * 3)]
    assert [(k, label) for k, label, _ in malformed.curves["vote"]] == [
        ("workflow/voting/malformed/bad_index", "bad_index"),
        ("workflow/voting/malformed/no_choice", "no_choice"),
    ]
    page = write_report([run], tmp_path / "out").read_text()
    index = json.loads(re.search(r'id="rolerl-series">(.*?)</script>', page, re.S).group(1))
    assert sorted(index["figures"]["workflow"]) == sorted(
        [f"series-workflow-vote-workflow_voting_{m}" for m in ROLE_KEYS]
        + [f"series-workflow-vote-workflow_voting_malformed_{c}" for c in ("bad_index", "no_choice")]
    )
    assert (tmp_path / "out" / "workflow.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Roles at work" in page


def test_a_run_without_role_metrics_gets_the_note(tmp_path):
    run = _run(tmp_path / "plain", [], [{"step": 1, "reward/mean": 0.5, "accuracy": 0.5}])
    page = write_report([run], tmp_path / "out").read_text()
    assert (
        "workflow"
        not in json.loads(re.search(r'id="rolerl-series">(.*?)</script>', page, re.S).group(1))["figures"]
    )
    assert html.escape("No run logged workflow/<name>/<metric>, workflow/<name>/malformed/<case>.") in page
    assert not (tmp_path / "out" / "workflow.png").exists()
