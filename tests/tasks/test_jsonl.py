"""A task from the user's own JSONL file and reward function: `task.name: jsonl` or `package.module:factory`."""

from __future__ import annotations

import json
import sys

import pytest

from rolerl.config import ConfigError, load_config
from rolerl.tasks import JsonlTask, load_task
from rolerl.tasks.jsonl import exact_match

ROWS = [
    {"question": "Capital of France?", "answer": "Paris"},
    {"question": "Capital of Italy?", "answer": "Rome", "id": "it", "hint": "R"},
    {"question": "Capital of Spain?", "answer": "Madrid", "split": "test"},
    {"question": "2 + 2?", "answer": 4},
]


def write(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_rows_splits_ids_and_meta(tmp_path):
    task = JsonlTask(write(tmp_path / "d.jsonl", ROWS))
    assert (task.size("train"), task.size("test")) == (3, 1)
    train = task.examples("train", 3, seed=0)
    assert sorted(e.id for e in train) == ["jsonl/1", "jsonl/4", "jsonl/it"]  # line numbers, or the row's id
    assert train == task.examples("train", 3, seed=0)  # a pure function of (split, n, seed)
    by_id = {e.id: e for e in train}
    assert by_id["jsonl/it"].meta == {"hint": "R", "split": "train"} and by_id["jsonl/4"].answer == "4"
    (madrid,) = task.examples("test", 1, seed=5)
    assert task.prompt(madrid)[-1] == {"role": "user", "content": "Capital of Spain?"}
    assert task.prompt(madrid)[0]["role"] == "system"
    with pytest.raises(ValueError, match=r"has no rows with \"split\": 'dev'; it has \['test', 'train'\]"):
        task.examples("dev", 1, seed=0)
    with pytest.raises(ValueError, match=r"n=2; .* has 1 'test' rows"):
        task.examples("test", 2, seed=0)


def test_default_reward_is_exact_match_of_the_answer_tag(tmp_path):
    task = JsonlTask(write(tmp_path / "d.jsonl", ROWS))
    (madrid,) = task.examples("test", 1, seed=0)
    assert task.reward(madrid, "I think <answer>Rome</answer>... no: <answer> madrid. </answer>") == 1.0
    assert task.reward(madrid, "<answer>Rome</answer>") == 0.0
    assert task.reward(madrid, "Madrid") == 0.0  # no tag, no credit
    assert task.answer_of("<answer> New  York </answer>") == "new york"


def test_own_reward_is_called_and_checked(tmp_path):
    seen = []

    def reward(example, text):
        seen.append((example.answer, text))
        return 0.5 if text == "half" else "yes"

    task = JsonlTask(write(tmp_path / "d.jsonl", ROWS), reward=reward, name="mine")
    (ex,) = task.examples("test", 1, seed=0)
    assert task.reward(ex, "half") == 0.5 and seen == [("Madrid", "half")]
    with pytest.raises(ValueError, match=r"reward function .*reward returned 'yes' for example 'mine/3'"):
        task.reward(ex, "other")
    with pytest.raises(ValueError, match="allowed: a function"):
        JsonlTask(tmp_path / "d.jsonl", reward="exact")  # type: ignore[arg-type]
    assert exact_match(ex, "<answer>Madrid</answer>") == 1.0


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        (['{"question": "q", "answer": "a"}', "{not json"], r"d.jsonl:2: not valid JSON"),
        ([{"question": "q"}], r"d.jsonl:1: \"answer\" must be a non-empty string or a number; got None"),
        ([{"question": " ", "answer": "a"}], r"d.jsonl:1: \"question\" must be a non-empty string"),
        ([{"question": "q", "answer": True}], r"\"answer\" must be .*; got True"),
        ([{"question": "q", "answer": "a", "split": 3}], r"\"split\" must be a non-empty string; got 3"),
        ([{"question": "q", "answer": "a"}, {"question": "r", "answer": "b", "id": 1}], r":2: \"id\" '1' is"),
        ([["q", "a"]], r"d.jsonl:1: a row must be a JSON object"),
        ([""], r"no rows"),
    ],
)
def test_bad_rows_name_the_line(tmp_path, rows, error):
    with pytest.raises(ValueError, match=error):
        JsonlTask(write(tmp_path / "d.jsonl", rows))


def test_config_and_load_task_by_name_and_by_import_path(tmp_path, monkeypatch):
    data = write(tmp_path / "d.jsonl", ROWS)
    assert isinstance(load_task("jsonl", data), JsonlTask)
    with pytest.raises(ValueError, match="needs task.data"):
        load_task("jsonl")
    with pytest.raises(ConfigError, match=r"task.data=None; allowed: the path of your JSONL file"):
        load_config(None, ["task.name=jsonl"])
    assert load_config(None, ["task.name=my_task:make_task"]).task.name == "my_task:make_task"
    with pytest.raises(ConfigError, match=r"task.name='chess'; allowed: .* or package.module:factory"):
        load_config(None, ["task.name=chess"])
    # the user's module sits in the working directory, which the `rolerl` script's sys.path lacks
    (tmp_path / "my_task.py").write_text(
        "from rolerl.tasks import JsonlTask\n"
        "def reward(example, text):\n    return float(example.answer in text)\n"
        "def make_task(data):\n    return JsonlTask(data, reward=reward, name='capitals')\n"
        "def not_a_task(data):\n    return object()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        task = load_task("my_task:make_task", "d.jsonl")
        (ex,) = task.examples("test", 1, seed=0)
        assert (ex.id, task.reward(ex, "Madrid!"), task.reward(ex, "Rome")) == ("capitals/3", 1.0, 0.0)
        with pytest.raises(
            ValueError, match=r"gave a object without \['name', 'examples', 'prompt', 'reward'\]"
        ):
            load_task("my_task:not_a_task", "d.jsonl")
        with pytest.raises(
            ValueError, match=r"task.name='my_task:nope': cannot import 'nope' from 'my_task'"
        ):
            load_task("my_task:nope", "d.jsonl")
        with pytest.raises(ValueError, match=r"task.name='my_task:': give package.module:Name"):
            load_task("my_task:", "d.jsonl")
    finally:
        sys.modules.pop("my_task", None)
