"""The failure classes of `rolerl failures` (rolerl/eval/failures.py) on hand-built samples.jsonl rows, the
prose-equation checker on adversarial text, and the command on a recipe directory with real gold answers."""

import json
import re

import pytest

from rolerl.cli import main
from rolerl.eval.failures import analyze, classify, false_equations, printed_numbers, table, tally, to_number


def row(completion="", *, correct=False, truncated=False, answer=None, calls=(), turns=None, finish="stop"):
    """A samples.jsonl row of one policy turn; `calls` = (output, error) pairs."""
    tool_calls = [{"args": {"code": "..."}, "output": out, "error": err} for out, err in calls]
    turns = turns or [
        {
            "role": "policy",
            "prompt": "",
            "completion": completion,
            "tool_calls": tool_calls,
            "finish_reason": finish,
        }
    ]
    n = sum(len(t["tool_calls"]) for t in turns)
    return {"id": "gsm8k/test/0", "sample": 0, "correct": correct, "truncated": truncated, "answer": answer,
            "tool_calls": n, "turns": turns}  # fmt: skip


@pytest.mark.parametrize(
    ("sample", "gold", "expected"),
    [
        (row("<answer>18</answer>", correct=True, answer="18"), "18", "correct"),
        # cut at the token limit wins over everything else it did
        (row("3 * 4 = 13 <code>", truncated=True, answer="13", calls=[("", True)]), "18", "truncated"),
        # one call more than max_tool_calls ended it: before format (it has no answer either)
        (
            row(
                "2 - 2 = 0 <code>print(2-2)</code>", answer="0", calls=[("0", False)] * 9, finish="tool_limit"
            ),
            "18",
            "tool_limit",
        ),  # fmt: skip
        (row("so she makes 17 dollars", answer="17"), "18", "format"),  # graded on a bare number, no tag
        (
            row(
                "<code>x</code><output>NameError</output> <answer>17</answer>",
                answer="17",
                calls=[("NameError", True)],
            ),
            "18",
            "tool_error",
        ),  # fmt: skip
        # a failed call, but the answer is what a later call printed: not the tool's fault
        (
            row("<answer>17</answer>", answer="17", calls=[("Traceback", True), ("17", False)]),
            "18",
            "reasoning",
        ),
        (row("<answer>9</answer>", answer="9", calls=[("9", False), ("18", False)]), "18", "not_reported"),
        (row("9 * 2 = 20, so <answer>20</answer>", answer="20", calls=[("9", False)]), "18", "arithmetic"),
        (row("9 * 2 = 20 <answer>20</answer>", answer="20"), "18", "arithmetic"),  # no tool at all
        # the tool printed 3.8e-05, the prose restates it as 3.8: the equation around the call is false
        (
            row(
                "400 / 10,440,000 = <code>print(400/10440000)</code><output>3.8e-05</output> 3.8 years. <answer>3.8</answer>",
                answer="3.8",
                calls=[("3.8e-05", False)],
            ),
            "6",
            "arithmetic",
        ),  # fmt: skip
        # the answer is what the tool printed: the sandbox's arithmetic is right, the computation is not
        (row("9 * 2 = 20 <answer>20</answer>", answer="20", calls=[("20", False)]), "18", "reasoning"),
        (row("16 - 3 = 13 <answer>26</answer>", answer="26"), "18", "reasoning"),
        (row(r"\boxed{$1,700}", answer="1700"), "18", "reasoning"),  # boxed counts as an answer
    ],
)
def test_each_class_from_hand_built_rows(sample, gold, expected):
    assert classify(sample, gold) == expected


def test_msarl_turns_read_every_role_and_the_last_turn_answers():
    reasoner = {"role": "reasoner", "prompt": "", "completion": "<request>compute 9*2</request><result>18</result>",
                "tool_calls": [{"args": {}, "output": "18", "error": False}]}  # fmt: skip
    coder = {"role": "coder", "prompt": "", "completion": "<code>print(9*2)</code>",
             "tool_calls": [{"args": {}, "output": "18\n", "error": False}]}  # fmt: skip
    last = {"role": "reasoner", "prompt": "", "completion": "<answer>16</answer>", "tool_calls": []}
    assert classify(row(turns=[reasoner, coder, last], answer="16"), "18") == "not_reported"
    # a coder turn that hit its own call cap does not end the episode: the reasoner's answer is what counts
    capped = {**coder, "finish_reason": "tool_limit"}
    assert classify(row(turns=[reasoner, capped, last], answer="16"), "18") == "not_reported"
    # the answer tag in an earlier turn does not count: the final turn has none
    assert classify(row(turns=[last, {**coder, "tool_calls": []}], answer="16"), "18") == "format"


@pytest.mark.parametrize(
    ("text", "false"),
    [
        ("5 * 3 = 15", []),
        ("5 * 3 = 16", ["5 * 3 = 16"]),
        ("(5 + 3) / 2 = 4 and (5+3)/2 = 5", ["(5+3)/2 = 5"]),
        ("$1,200 + $300 = $1,500", []),
        ("3 x 4 = 12 and 3 × 4 = 11 and 12 ÷ 4 = 3", ["3 × 4 = 11"]),
        ("10 / 3 = 3.33 (rounded) but 10 / 3 = 3.4", ["10 / 3 = 3.4"]),  # the right side's own rounding
        ("-3 + 5 = 2", []),
        ("20% of 50 = 10", []),  # not an arithmetic expression: left alone
        (
            "<code>print(2 * 3 = 7)</code><output>2 * 3 = 7</output><result>1 + 1 = 3</result>",
            [],
        ),  # not prose
        ("<code>unclosed 2 * 3 = 7", []),  # an unclosed code block runs to the end
        ("9 ** 9 ** 9 = 1", []),  # never evaluated: no power operator
        ("1 / 0 = 5 and (1 + = 2", []),
        ("7 - 2 = 5. Then 5 * 2 = 11.", ["5 * 2 = 11"]),
        ("1" * 30 + " + 1 = 2", ["1" * 30 + " + 1 = 2"]),
        ("1" * 400 + " * 9 = 2", []),  # too long for a hand calculation: skipped, not an overflow
        ("1e308 * 10 = 5", []),
    ],
)
def test_false_equations_of_the_prose(text, false):
    assert false_equations(text) == false


def test_numbers_from_tool_outputs_and_answers():
    assert printed_numbers("[3, 4.5]\nResult: 1,200\n-7\n3.8e-05") == [3.0, 4.5, 1200.0, -7.0, 3.8e-05]
    assert [to_number(s) for s in ("$1,200", "18.50", r"\$5", "-3.", "1/2", None, "abc")] == [
        1200.0, 18.5, 5.0, -3.0, None, None, None]  # fmt: skip


def test_the_command_on_a_recipe_directory(tmp_path, shared_data, capsys):
    """gsm8k/test/0's gold is 18 (real data): a call that printed 18 makes the wrong answer not_reported."""
    root = tmp_path / "recipe"
    (root / "recipe.json").parent.mkdir()
    (root / "recipe.json").write_text('{"recipe": "gsm8k-tir"}')
    rows = {"base": [row("no answer", answer=None)],
            "warm": [row("<answer>9</answer>", answer="9", calls=[("9", False), ("18", False)]),
                     row("<answer>18</answer>", correct=True, answer="18")]}  # fmt: skip
    for stage, samples in rows.items():
        out = root / "eval" / stage
        out.mkdir(parents=True)
        (out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        (out / "results.json").write_text(
            json.dumps({"spec": {"task": "gsm8k", "data": str(shared_data), "split": "test"}})
        )
    assert main(["failures", str(root), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert list(got) == ["recipe/base", "recipe/warm"]  # no rl evaluation: not listed
    assert got["recipe/base"]["counts"]["format"] == 1 and got["recipe/base"]["no_tool"] == 1
    assert got["recipe/warm"]["counts"] | {} == {**dict.fromkeys(got["recipe/warm"]["counts"], 0),
                                                "correct": 1, "not_reported": 1}  # fmt: skip
    assert got["recipe/warm"]["examples"] == {"not_reported": ["gsm8k/test/0#0"]}
    # gsm8k/test/0's solution has 2 steps (its 2 lines before "#### 18"): difficulty 2
    assert got["recipe/base"]["by_difficulty"] == {"2": [1, 0]}
    assert got["recipe/warm"]["by_difficulty"] == {"2": [2, 1]}
    # an evaluation still running has no results.json: the gold comes from the sample ids and the default data
    (root / "eval" / "warm" / "results.json").unlink()
    assert analyze(root / "eval" / "warm")["counts"]["not_reported"] == 1
    assert main(["failures", str(root / "eval" / "warm")]) == 0
    table = capsys.readouterr().out
    assert "not_reported" in table and "50.0%" in table
    assert re.search(r"^2 +1/2 +50\.0%$", table, re.M)  # the difficulty block: 1 of 2 samples right
    assert main(["failures", str(tmp_path / "nothing")]) == 2
    assert "no samples.jsonl" in capsys.readouterr().err


def test_by_difficulty_counts_samples_and_correct_per_level():
    """Two samples of a level-2 problem (one right), one of a level-5 one (wrong), one whose problem has no
    difficulty (not counted there, still counted as a class)."""
    samples = [dict(row("<answer>18</answer>", correct=True, answer="18"), id="a"),
               dict(row("<answer>9</answer>", answer="9"), id="a", sample=1),
               dict(row("<answer>7</answer>", answer="7"), id="b"),
               dict(row("<answer>1</answer>", answer="1"), id="c")]  # fmt: skip
    got = tally(samples, {}, {"a": 2, "b": 5})
    assert got["by_difficulty"] == {2: [2, 1], 5: [1, 0]} and list(got["by_difficulty"]) == [2, 5]
    assert got["samples"] == 4 and got["counts"]["correct"] == 1
    assert tally(samples, {})["by_difficulty"] == {}
    assert "difficulty" not in table([("x", tally(samples, {}))])
