"""`benchmarks/roles_study.py` (issue 48): one arm end to end in `--quick` mode (the tiny random model)
writes its summary, a second `run` skips it without starting anything, and `summarize`'s means, standard
errors and noise verdicts on hand-made summaries match the arithmetic done by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def study(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import roles_study

    return roles_study


def test_quick_run_writes_a_summary_and_a_second_run_skips_it(study, tmp_path, monkeypatch):
    out, results = tmp_path / "runs", tmp_path / "results"
    study.run(out, [0], ["voting-shared"], results, quick=True)
    record = json.loads((results / "voting-shared-s0.json").read_text())
    assert (record["arm"], record["workflow"], record["seed"], record["quick"]) == (
        "voting-shared",
        "voting",
        0,
        True,
    )
    assert "model.spec=tiny:llama" in record["overrides"] and "adapters.preset=shared" in record["overrides"]
    assert record["commit"] and "torch" in record["cpu"] and record["rl_wall_s"] > 0
    for when in ("before", "after"):
        held = record["held_out"][when]
        assert len(held["correct"]) == study.QUICK["eval"]  # the same problems before and after
        assert held["accuracy"] == pytest.approx(sum(held["correct"].values()) / len(held["correct"]))
        assert "workflow/voting/choice_parsed" in held["roles"]
    assert record["held_out"]["before"]["correct"].keys() == record["held_out"]["after"]["correct"].keys()
    assert [s["step"] for s in record["steps"]] == [1] and "workflow/voting/choice_parsed" in record["steps"][
        0
    ]

    def started(*args, **kwargs):
        raise AssertionError(f"a finished run was started again: {args}")

    monkeypatch.setattr(study, "rolerl", started)
    mtime = (results / "voting-shared-s0.json").stat().st_mtime_ns
    study.run(out, [0], ["voting-shared"], results, quick=True)
    assert (results / "voting-shared-s0.json").stat().st_mtime_ns == mtime
    with pytest.raises(SystemExit, match="no-such-arm"):
        study.run(out, [0], ["no-such-arm"], results, quick=True)


def summary(arm: str, seed: int, after: list[int], roles_after: float, before: list[int] = (0, 0, 0, 0)):
    def held(correct, roles):
        return {"accuracy": sum(correct) / len(correct), "stderr": 0.0, "roles": roles,
                "correct": {f"p{i}": float(c) for i, c in enumerate(correct)}}  # fmt: skip

    workflow = arm.split("-")[0]
    return {
        "arm": arm, "workflow": workflow, "seed": seed, "rl_wall_s": 60.0 * (seed + 1), "steps": [],
        "held_out": {"before": held(before, {f"workflow/{workflow}/m": 0.5}),
                     "after": held(after, {f"workflow/{workflow}/m": roles_after})},
    }  # fmt: skip


def test_summarize_means_standard_errors_and_verdicts(study, tmp_path):
    runs = [
        summary("voting-shared", 0, [1, 1, 0, 0], 0.9),  # 0.50
        summary("voting-shared", 1, [1, 1, 1, 0], 0.7),  # 0.75
        summary("voting-isolated", 0, [0, 0, 0, 0], 0.5),  # 0.00
        summary("voting-isolated", 1, [1, 0, 0, 0], 0.5),  # 0.25
        summary("eval_opt-shared", 0, [1, 1, 1, 1], 1.0),
        summary("eval_opt-isolated", 0, [0, 0, 0, 0], 0.0),
    ]
    for r in runs:
        (tmp_path / f"{r['arm']}-s{r['seed']}.json").write_text(json.dumps(r))
    shared = [r for r in runs if r["arm"] == "voting-shared"]
    isolated = [r for r in runs if r["arm"] == "voting-isolated"]
    # two seeds: se = |a - b| / 2; per-problem seed means (1, 1, .5, 0): sample std sqrt(.6875 / 3), / 2
    acc = study.accuracy(shared, "after")
    assert acc["mean"] == 0.625 and acc["se_seeds"] == pytest.approx(0.125, rel=1e-12)
    assert acc["se_problems"] == pytest.approx((0.6875 / 3) ** 0.5 / 2, rel=1e-12)
    # shared - isolated: .625 - .125; seeds sqrt(2) x .125; paired per-problem differences (.5, 1, .5, 0):
    # sample std sqrt(.5 / 3), / 2; noise sqrt(.03125 + .5 / 12) = 0.270 > .5 / 2: within the noise
    d = study.difference(shared, isolated)
    assert d["diff"] == 0.5 and d["se_seeds"] == pytest.approx(0.125 * 2**0.5, rel=1e-12)
    assert d["se_problems"] == pytest.approx((0.5 / 3) ** 0.5 / 2, rel=1e-12)
    assert d["noise"] == pytest.approx((0.03125 + 0.5 / 12) ** 0.5, rel=1e-12)

    text = study.summarize(tmp_path, None)
    assert "| voting-shared | 0,1 | 0.0% | 62.5% (+- 12.5, +- 23.9) | 50.0 -> 80.0 | 1.5 min |" in text
    assert "| voting-isolated | 0,1 | 0.0% | 12.5% (+- 12.5, +- 12.5) | 50.0 -> 50.0 | 1.5 min |" in text
    assert "| voting-shared vs voting-isolated | +50.0 | +- 17.7 | +- 20.4 | 27.0 | no |" in text
    # one seed each: no seed error; every problem differs by 1, so the paired error is 0 and 1 is beyond it
    assert (
        "| eval_opt-shared vs eval_opt-isolated | +100.0 | n/a | +- 0.0 | 0.0 | yes (one seed: problems only) |"
        in text
    )
    assert text.index("### voting") < text.index("### eval_opt") < text.index("### differences")
    assert "orch_workers" not in text, "a workflow without summaries gets no table"


def test_summarize_refuses_summaries_of_different_budgets(study, tmp_path):
    a, b = summary("tir", 0, [1, 0], 0.0), summary("reasoner_tools", 0, [1, 1], 0.0)
    a["budget"], b["budget"] = {"steps": 4}, {"steps": 8}
    for r in (a, b):
        (tmp_path / f"{r['arm']}-s0.json").write_text(json.dumps(r))
    with pytest.raises(
        SystemExit, match=r'different budgets.*"steps": 8\}: reasoner_tools-s0; \{"steps": 4\}: tir-s0'
    ):
        study.summarize(tmp_path, None)


def test_every_arm_loads_and_spends_the_same_budget(study):
    from rolerl.config import load_config

    budgets = set()
    for arm, (workflow, preset, _) in study.ARMS.items():
        cfg = load_config("demo", study.overrides(arm, quick=False))
        assert (cfg.task.workflow, cfg.adapters.preset) == (workflow, preset), arm
        assert cfg.task.workflow_options == study.WORKFLOWS[workflow][0], arm
        budgets.add((cfg.train.steps, cfg.train.tasks_per_step, cfg.rollout.n, cfg.rollout.max_new_tokens))
    assert budgets == {(study.STEPS, study.TASKS, study.SAMPLES, 64)}
    merged = load_config("demo", study.overrides("voting-isolated-merged", quick=False))
    assert (merged.train.step_policy, merged.train.mini_batch_by) == ("merged", "role")
    equal = load_config("demo", study.overrides("voting-shared-equal", quick=False))
    assert (equal.algorithm.role_share, equal.train.mini_batch_by) == ("equal", "batch")


def test_each_warm_start_teaches_every_role(study, tmp_path):
    from rolerl.tasks import load_task
    from rolerl.workflows import load_workflow

    for workflow, (options, _) in study.WORKFLOWS.items():
        path = study.warm_demos(workflow, tmp_path / f"{workflow}.jsonl", 4)
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        roles = load_workflow(workflow, load_task("synthetic"), options).roles
        assert {r["role"] for r in rows} == set(roles), workflow
