"""Math benchmarks: loaders on the real files, malformed rows reported and skipped, deterministic sampling,
prompts, rewards through the grader, and the optional Hugging Face path."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest

from rolerl.tasks.base import Example, Task
from rolerl.tasks.math import BENCHMARKS, MathTask, at_most, difficulty, load_benchmark, math_task
from rolerl.tasks.math_grader import MathGrader

# (benchmark, split) -> rows kept. math_train: 7500 rows, 4 with an empty answer (SOURCES.md) and one more
# whose gold the source's normalisation broke: row 6811 `2007+\frac{\}{p}i2` (its solution's box says
# `2007 + \frac\pi 2`), unbalanced braces, so unreadable. All 5 are reported and skipped.
COUNTS = {
    ("gsm8k", "test"): 1319,
    ("gsm8k", "train"): 7473,
    ("math500", "test"): 500,
    ("math_train", "train"): 7495,
    ("aime24", "test"): 30,
    ("aime25", "test"): 30,
    ("amc23", "test"): 40,
}
MATH_TRAIN_SKIPPED = {5341: "empty", 5343: "empty", 6627: "empty", 6811: "unbalanced braces", 7301: "empty"}


@pytest.fixture(scope="module")
def grader():
    with MathGrader(workers=2, timeout_s=30.0) as g:
        yield g


@pytest.mark.parametrize(("name", "split"), list(COUNTS))
def test_loaders_read_the_shared_files(shared_data, name, split):
    ds = load_benchmark(name, shared_data, split)
    assert (ds.name, ds.split, len(ds)) == (name, split, COUNTS[name, split])
    assert ds.source.endswith(BENCHMARKS[name].files[split])
    ids = [e.id for e in ds.examples]
    assert len(set(ids)) == len(ids) and all(i.startswith(f"{name}/{split}/") for i in ids)
    for e in ds.examples:
        assert isinstance(e.question, str) and e.question.strip()
        assert isinstance(e.answer, str) and e.answer.strip() and e.answer == e.answer.strip()
    if name != "math_train":
        assert ds.skipped == []


def test_loaded_fields(shared_data):
    gsm = load_benchmark("gsm8k", shared_data, "test").examples[0]
    assert gsm.id == "gsm8k/test/0" and gsm.answer == "18" and gsm.question.startswith("Janet")
    assert "####" not in gsm.meta["solution"] and "9 * 2" in gsm.meta["solution"]
    m = load_benchmark("math500", shared_data).examples[0]
    assert m.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert (m.meta["subject"], m.meta["level"], m.meta["family"]) == ("Precalculus", 2, "Precalculus")
    assert m.meta["unique_id"] == "test/precalculus/807.json"
    assert load_benchmark("amc23", shared_data).examples[0].answer == "27"  # the file's float 27.0
    aime = load_benchmark("aime24", shared_data).examples
    assert aime[0].meta["id"] == 60 and aime[7].answer == "025"  # as written; the grader equates 25
    assert all(a.answer.isdigit() for a in aime)
    assert any("," in r["answer"].split("####")[-1] for r in _jsonl(shared_data / "gsm8k/train.jsonl"))
    assert all("," not in e.answer for e in load_benchmark("gsm8k", shared_data, "train").examples)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_math_train_reports_its_unreadable_rows(shared_data, caplog):
    with caplog.at_level(logging.WARNING, logger="rolerl.tasks.math"):
        ds = load_benchmark("math_train", shared_data)
    assert {s.row: s.reason for s in ds.skipped}.keys() == MATH_TRAIN_SKIPPED.keys()
    assert all(MATH_TRAIN_SKIPPED[s.row] in s.reason for s in ds.skipped)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "skipped 5 of 7500 rows" in message and "row 5341: field 'answer' is empty" in message
    assert "math_train/train/5341" not in {e.id for e in ds.examples}  # ids keep the file's row numbers
    assert ds.examples[5341].id == "math_train/train/5342"


def test_malformed_rows_are_reported_and_skipped(tmp_path, caplog):
    rows = [
        '{"question": "1+1?", "answer": "so\\n#### 2"}',
        "{not json",
        '{"question": "no answer"}',
        '{"question": "2+2?", "answer": "4, without the marker"}',
        '{"question": "", "answer": "#### 3"}',
        '["a", "list"]',
        '{"question": "big", "answer": "#### 1,234"}',
    ]
    path = tmp_path / "test.jsonl"
    path.write_text("\n".join(rows) + "\n\n")  # a trailing blank line is not a row
    with caplog.at_level(logging.WARNING, logger="rolerl.tasks.math"):
        ds = load_benchmark("gsm8k", path, "test")
    assert [(e.id, e.answer) for e in ds.examples] == [("gsm8k/test/0", "2"), ("gsm8k/test/6", "1234")]
    reasons = {s.row: s.reason for s in ds.skipped}
    assert list(reasons) == [1, 2, 3, 4, 5]
    assert "not JSON" in reasons[1] and "missing field 'answer'" in reasons[2]
    assert "#### <number>" in reasons[3] and "'question' is empty" in reasons[4] and "list" in reasons[5]
    assert "skipped 5 of 7 rows" in caplog.text and "row 1: not JSON" in caplog.text


@pytest.mark.parametrize(
    ("answer", "reason"),
    [("", "empty"), (None, "NoneType"), (["1"], "list"), (True, "bool"), ("\\frac{1}{2", "unbalanced")],
)
def test_unreadable_golds_are_skipped(tmp_path, answer, reason):
    path = tmp_path / "math500_test.jsonl"
    good = {"problem": "p", "answer": "\\{1, 2\\}"}  # escaped braces are balanced
    path.write_text(json.dumps(good) + "\n" + json.dumps({"problem": "q", "answer": answer}) + "\n")
    ds = load_benchmark("math500", path)
    assert [e.answer for e in ds.examples] == ["\\{1, 2\\}"]
    (skipped,) = ds.skipped
    assert skipped.row == 1 and reason in skipped.reason


def test_examples_are_deterministic_samples_without_replacement(shared_data):
    task = math_task("math500", shared_data)
    assert isinstance(task, Task)
    a = task.examples("test", 50, seed=3)
    assert a == task.examples("test", 50, seed=3) and len({e.id for e in a}) == 50
    assert task.examples("test", 20, seed=3) == a[:20], "a prefix of a longer draw"
    assert task.examples("test", 50, seed=4) != a
    assert sorted(e.id for e in task.examples("test", 500, seed=0)) == sorted(
        e.id for e in task.dataset("test").examples
    )
    assert task.size("test") == 500
    with pytest.raises(ValueError, match=r"n=501; allowed: 0 <= n <= 500"):
        task.examples("test", 501, 0)
    with pytest.raises(ValueError, match=r"split='train'; allowed: \['test'\]"):
        task.examples("train", 1, 0)


def test_splits_by_directory_and_by_file(shared_data):
    assert math_task("gsm8k", shared_data).splits == ("test", "train")
    assert math_task("gsm8k", shared_data / "gsm8k").size("train") == 7473  # the benchmark's own folder
    by_file = math_task("gsm8k", shared_data / "gsm8k" / "train.jsonl")
    assert by_file.splits == ("train",) and by_file.examples("train", 1, 0)[0].id.startswith("gsm8k/train/")
    with pytest.raises(ValueError, match="is the 'train' split; asked for 'test'"):
        load_benchmark("gsm8k", shared_data / "gsm8k" / "train.jsonl", "test")
    with pytest.raises(FileNotFoundError, match="no gsm8k/test.jsonl under"):
        load_benchmark("gsm8k", shared_data / "math")
    with pytest.raises(FileNotFoundError):
        load_benchmark("gsm8k", "missing/test.jsonl")  # a file name is never read as a hub id
    with pytest.raises(ValueError, match=r"unknown math benchmark 'gsm9k'; allowed: \['gsm8k'"):
        math_task("gsm9k")


def test_prompts():
    ex = Example("x/test/0", "What is 1+1?", "2")
    (system, user) = math_task("math500").prompt(ex)
    assert "\\boxed{}" in system["content"] and user == {"role": "user", "content": "What is 1+1?"}
    (system, _) = math_task("math500", prompt_style="tool").prompt(ex)
    assert "<code></code>" in system["content"] and "<answer></answer>" in system["content"]
    with pytest.raises(ValueError, match="prompt_style='latex'; allowed"):
        math_task("math500", prompt_style="latex")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="format_reward=1"):
        math_task("math500", format_reward=1)


def test_rewards_through_the_grader(grader):
    task = math_task("math500", format_reward=0.1, grader=grader)
    ex = Example("math500/test/0", "p", "\\frac{\\sqrt{3}}{2}")
    assert task.reward(ex, "... so it is $\\boxed{\\dfrac{\\sqrt{3}}{2}}$.") == 1.0
    assert task.check(ex, "<answer>\\frac{\\sqrt3}{2}</answer>")
    assert task.reward(ex, "so \\boxed{\\frac{1}{2}}") == 0.1  # boxed, wrong: the format reward
    assert task.reward(ex, "it is sqrt(3)/2 I think") == 0.0  # no box: no answer read
    assert task.grade(ex, "\\boxed{0.8660254}").correct  # numeric equality to 6 places

    gsm = math_task("gsm8k", grader=grader)
    ex = Example("gsm8k/test/0", "q", "1234")
    assert gsm.check(ex, "She has 1,234 dollars.") and not gsm.check(ex, "She has 1,235 dollars.")
    assert gsm.check(ex, "\\boxed{1234} dollars, from 3 boxes")  # a box beats the last number
    assert not math_task("math500", grader=grader).check(Example("m", "q", "1234"), "She has 1,234.")


def test_tool_style_reward(grader):
    task = math_task("aime24", prompt_style="tool", format_reward=0.2, grader=grader)
    ex = Example("aime24/test/7", "p", "025")
    right = "<code>\nprint(5**2)\n</code><output>\n25\n</output>\nThe answer is <answer>25</answer>."
    assert task.reward(ex, right) == 1.0
    assert task.reward(ex, right.replace(">25<", ">24<")) == 0.2
    assert task.reward(ex, "The answer is <answer>24</answer>.") == 0.0  # no tool call: not the format


def test_answer_of_normalises_for_voting():
    task = math_task("math500")
    assert task.answer_of("so $\\boxed{ \\dfrac{1}{2} }$.") == "\\frac{1}{2}"
    assert task.answer_of("<answer>1,000.0</answer>") == "1000"
    assert task.answer_of("<answer>\\text{Evelyn}</answer>") == "Evelyn"
    assert task.answer_of("\\boxed{90^\\circ}") == "90"
    assert task.answer_of("\\boxed{\\$18}") == "18"
    assert task.answer_of("<answer>025</answer>") == "25" == task.answer_of("\\boxed{25.}")
    assert task.answer_of("nothing") is None


def test_hub_ids_load_lazily_with_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    task = math_task("aime24", "HuggingFaceH4/aime_2024", split="train")  # nothing read yet
    with pytest.raises(ImportError, match=r"needs `datasets`: pip install 'rolerl\[hub\]'"):
        task.dataset("train")

    def offline(*args, **kwargs):
        raise ConnectionError(
            "Couldn't reach 'HuggingFaceH4/aime_2024' on the Hub (LocalEntryNotFoundError)\nmore"
        )

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match=r"'HuggingFaceH4/aime_2024' split 'train'.*offline\?") as err:
        task.dataset("train")
    assert "\n" not in str(err.value)

    calls = []

    def load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return [{"problem": "p", "answer": "5"}, {"problem": "q", "answer": ""}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    ds = MathTask("gsm8k", "openai/gsm8k:main", split="test").dataset("test")
    assert calls == [("openai/gsm8k", "main", "test")] and ds.source == "openai/gsm8k:main"
    assert len(ds) == 0 and len(ds.skipped) == 2  # gsm8k rows need question and '#### n'
    ds = load_benchmark("aime24", "HuggingFaceH4/aime_2024", "train")
    assert [(e.id, e.answer) for e in ds.examples] == [("aime24/train/0", "5")] and ds.skipped[0].row == 1


def test_tir_gets_the_tool_prompt_whatever_the_prompt_style(shared_data):
    from rolerl.tasks.math import math_task

    task = math_task("gsm8k", shared_data)
    (ex,) = task.examples("test", 1, 0)
    assert "\\boxed" in task.prompt(ex)[0]["content"]
    system = task.tool_prompt(ex)[0]["content"]
    assert "<code>" in system and "<answer>" in system


def test_max_difficulty_cuts_the_training_split_only(shared_data):
    """task.max_difficulty: GSM8K's difficulty is its reference solution's lines, counted here from the raw
    file; the cut split draws only those (deterministic, a prefix of a longer draw), the other split is whole."""
    raw = [json.loads(line) for line in (shared_data / "gsm8k" / "train.jsonl").read_text().splitlines()]
    steps = {
        f"gsm8k/train/{i}": len([x for x in r["answer"].split("####")[0].splitlines() if x.strip()])
        for i, r in enumerate(raw)
    }
    easy = at_most(math_task("gsm8k", shared_data), "train", 2)
    assert isinstance(easy, Task) and easy.size("train") == sum(s <= 2 for s in steps.values()) == 1961
    assert easy.size("test") == 1319 and easy.examples("test", 5, 0) == easy.task.examples("test", 5, 0)
    draw = easy.examples("train", 40, seed=1)
    assert all(steps[e.id] <= 2 for e in draw) and len({e.id for e in draw}) == 40
    assert easy.examples("train", 10, seed=1) == draw[:10] and easy.examples("train", 40, seed=2) != draw
    assert sorted(e.id for e in easy.examples("train", 1961, 0)) == sorted(
        i for i, s in steps.items() if s <= 2
    )
    with pytest.raises(
        ValueError, match=r"n=1962; allowed: 0 <= n <= 1961 \(the examples of difficulty <= 2"
    ):
        easy.examples("train", 1962, 0)
    example = draw[0]  # everything else is the task's own
    assert easy.prompt(example) == easy.task.prompt(example) and easy.reward(example, example.answer) == 1.0


def test_difficulty_per_benchmark(shared_data):
    assert difficulty("gsm8k", Example("x", "q", "1", {"solution": "a\n\nb <<1+1=2>>2\nc\n"})) == 3
    assert difficulty("gsm8k", Example("x", "q", "1", {})) is None  # unknown: never drawn
    assert difficulty("math500", Example("x", "q", "1", {"level": 4})) == 4
    assert difficulty("math_train", Example("x", "q", "1", {"level": "Level 2"})) == 2
    assert difficulty("math_train", Example("x", "q", "1", {"level": "Level ?"})) is None
    hard = at_most(math_task("math500", shared_data), "test", 1)
    assert hard.size("test") == sum(e.meta["level"] == 1 for e in hard.task.dataset("test").examples) > 0
    with pytest.raises(
        ValueError, match=r"task 'aime24' tells no difficulty; allowed for \['gsm8k', 'math500'"
    ):
        at_most(math_task("aime24", shared_data), "test", 3)
    with pytest.raises(
        ValueError, match=r"gsm8k/train: none of its 7473 examples is of difficulty <= 1: the reference"
    ):
        at_most(math_task("gsm8k", shared_data), "train", 1)
