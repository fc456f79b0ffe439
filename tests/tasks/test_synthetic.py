"""The built-in word problems: determinism, disjoint splits, answers, the checker and demonstrations."""

from __future__ import annotations

import json
import re

import pytest

from rolerl.roles import Tags, split_segments
from rolerl.tasks import TASKS, Task
from rolerl.tasks.synthetic import (
    FAMILIES,
    FORMAT_FAMILIES,
    RL_FAMILIES,
    SyntheticTask,
    demonstration_text,
    parse_answer,
)


def test_examples_are_a_pure_function_of_split_n_seed_and_balanced():
    task = TASKS["synthetic"]()
    assert isinstance(task, Task)
    a, b = task.examples("train", 40, seed=7), task.examples("train", 40, seed=7)
    assert a == b and [e.meta for e in a] == [e.meta for e in b]
    assert task.examples("train", 40, seed=8) != a and task.examples("test", 40, seed=7) != a
    assert task.examples("train", 10, seed=7) == a[:10], "a prefix of a longer draw"
    families = [e.meta["family"] for e in a]
    assert all(families.count(f) == 40 // len(RL_FAMILIES) for f in RL_FAMILIES)
    assert len({e.id for e in a}) == 40
    assert {e.meta["family"] for e in TASKS["synthetic_format"]().examples("train", 8, 0)} == set(
        FORMAT_FAMILIES
    )


def test_train_and_test_never_share_a_problem():
    task = SyntheticTask(tuple(FAMILIES))
    train = {e.question for s in range(3) for e in task.examples("train", 300, s)}
    test = {e.question for s in range(3) for e in task.examples("test", 300, s)}
    assert len(test) > 500 and not train & test


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_expression_gives_the_answer_and_uses_the_question_numbers(family):
    task = SyntheticTask((family,))
    for e in task.examples("train", 50, seed=1):
        assert eval(e.meta["expr"]) == int(e.answer)  # noqa: S307 - our own generated expressions
        numbers = set(re.findall(r"\d+", e.question))
        used = set(re.findall(r"\d+", e.meta["expr"]))
        conversion = {"60", "24", "7", "100", "1000"} if family in ("units", "convert") else set()
        assert used <= numbers | conversion, (e.question, e.meta["expr"])
        if family not in ("sub", "two_step", "distractor", "change", "arith"):
            assert int(e.answer) > 0


def test_distractor_problems_really_contain_an_unused_quantity():
    for e in SyntheticTask(("distractor",)).examples("train", 30, seed=0):
        numbers = re.findall(r"\d+", e.question)
        assert len(numbers) == 3 and numbers[1] not in e.meta["expr"].split()


@pytest.mark.parametrize(
    ("text", "correct"),
    [
        ("<answer>54</answer>", True),
        ("The answer is <answer> 54. </answer>", True),
        ("<answer>54.0</answer>", True),
        ("<answer>$54</answer>", True),
        ("<answer>+54</answer>", True),
        ("\\boxed{54}", True),
        ("<answer>53</answer> no wait <answer>54</answer>", True),  # the last answer counts
        ("<answer>54</answer> no wait <answer>53</answer>", False),
        ("<answer>54.5</answer>", False),
        ("<answer>fifty-four</answer>", False),
        ("54", False),  # no tags
        ("<answer>54", False),  # unclosed
        ("", False),
    ],
)
def test_checker_on_right_wrong_and_format_variants(text, correct):
    task = SyntheticTask(("two_step",))
    example = task.examples("train", 1, 0)[0]
    example = type(example)(example.id, example.question, "54", example.meta)
    assert task.check(example, text) is correct
    assert task.reward(example, text) == float(correct)


def test_format_reward_only_for_wrong_but_well_formed_answers():
    task = SyntheticTask(("two_step",), format_reward=0.1)
    ex = task.examples("train", 1, 0)[0]
    right = demonstration_text(ex.meta["expr"], int(ex.answer))
    wrong = demonstration_text("1 + 1", 2) if ex.answer != "2" else demonstration_text("1 + 2", 3)
    assert task.reward(ex, right) == 1.0
    assert task.reward(ex, wrong) == pytest.approx(0.1)
    assert task.reward(ex, "<answer>-1</answer>") == 0.0  # no tool call: not the format
    with pytest.raises(ValueError, match="format_reward"):
        SyntheticTask(format_reward=1.0)
    with pytest.raises(ValueError, match="allowed: a non-empty list"):
        SyntheticTask(("nope",))
    with pytest.raises(ValueError, match="split='dev'"):
        task.examples("dev", 1, 0)


def test_parse_answer():
    assert [parse_answer(s) for s in ["1,234", " 7 ", "-3", "42.00", "4 2", "x", None, "1e3"]] == [
        1234, 7, -3, 42, 42, None, None, None,
    ]  # fmt: skip


def test_demonstrations_are_sft_rows_with_tool_output_in_the_engine_format(tmp_path):
    task = TASKS["synthetic_format"]()
    path = task.write_demonstrations(tmp_path / "d.jsonl", 12, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 12 and not (tmp_path / "d.jsonl.tmp").exists()
    for row, ex in zip(rows, task.examples("train", 12, 3), strict=True):
        assert row["role"] == "policy" and row["messages"][:2] == task.prompt(ex)
        text = row["messages"][2]["content"]
        assert task.check(ex, text)
        kinds = [k for k, _ in split_segments(text, Tags())]
        assert kinds == ["reasoning", "tool_call", "tool_output", "reasoning", "answer", "reasoning"]
