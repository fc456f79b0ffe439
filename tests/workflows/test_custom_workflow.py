"""A user's own two-role workflow, loaded by module path (`task.workflow: my_workflows:SolveCheck`) and
trained without editing rolerl: the example of docs/WORKFLOWS.md, run exactly as written there."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from rolerl.config import load_config
from rolerl.tasks import ArithmeticTask
from rolerl.train.checkpoint import RunDir
from rolerl.train.rl import train
from rolerl.workflows import load_workflow
from tests.train.test_rl import TINY

DOC = Path(__file__).resolve().parents[2] / "docs" / "WORKFLOWS.md"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    code = re.search(r"```python\n(# my_workflows\.py\n.*?)```", DOC.read_text(), re.DOTALL).group(1)
    (tmp_path / "my_workflows.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_workflows:SolveCheck"
    sys.modules.pop("my_workflows", None)


def test_a_user_workflow_by_module_path_trains(tmp_path, user_module):
    cfg = load_config(None, [*TINY, f"run.dir={tmp_path / 'run'}", "train.steps=1", "task.name=arithmetic",
                             f"task.workflow={user_module}", "task.workflow_options={revisions: 1}",
                             "adapters.preset=isolated", "algorithm.reward=role", "algorithm.group_key=role",
                             "algorithm.role_share=equal", "rollout.max_new_tokens=8"])  # fmt: skip
    train(cfg)
    (row,) = RunDir(tmp_path / "run", tensorboard=False).read_metrics()
    assert row["role/solver/turns"] == 8.0 and row["role/checker/turns"] == 8.0  # 2 tasks x 4 samples
    # a random tiny model never writes OK or REVISE: every episode's verdict is malformed, counted, not fatal
    assert row["workflow/solve_check/malformed/no_verdict"] == 1.0
    assert row["adapter/solver/steps"] == 1.0 and row["adapter/checker/steps"] == 1.0


def test_workflow_loading_errors(user_module):
    task = ArithmeticTask()
    assert load_workflow(user_module, task, {"revisions": 2}).revisions == 2
    with pytest.raises(ValueError, match="does not take options \\['rounds'\\]"):
        load_workflow(user_module, task, {"rounds": 3})
    with pytest.raises(ValueError, match="cannot import 'Nope' from 'my_workflows'"):
        load_workflow("my_workflows:Nope", task)
    with pytest.raises(ValueError, match="unknown workflow 'voting2'"):
        load_workflow("voting2", task)
