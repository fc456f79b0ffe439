"""Where a math evaluation's answers go wrong: each sample of a `samples.jsonl` in one class, read from what
the sample recorded (finish reasons, the tool calls and their outputs, the final text) and its gold answer.

The classes, first match wins (a sample cut at the token limit is `truncated` whatever else it did):

- `correct`: graded right.
- `truncated`: a turn hit `max_new_tokens`: the episode never finished.
- `tool_limit`: the last turn asked for one tool call more than `max_tool_calls` allows, which ended the
  episode unanswered.
- `format`: finished without a tagged (`<answer>`) or boxed answer (a bare last number may still be graded).
- `tool_error`: a tool call failed (exception, timeout) and the answer is not a value a successful call printed.
- `not_reported`: a tool call printed the gold value, the answer is something else.
- `arithmetic`: a calculation written in the prose (`12 * 3 = 38`, or `400 / 10,440,000 = ` a code call,
  then `3.83` where the tool printed `3.83e-05`) is false and the answer is not a value the tool printed:
  arithmetic by hand, or a tool result restated wrong.
- `reasoning`: everything else: the arithmetic that ran is right (the sandbox computes exactly; the text's
  equations hold) but it is not the computation the problem needs, a wrong expression in the code
  included: from outside, a wrong expression and a wrong plan look the same.

`no_tool` counts, besides, the wrong samples that never called a tool, and `by_difficulty` the samples and
the correct ones per difficulty of their problem (`rolerl.tasks.math.difficulty`: GSM8K's solution steps,
MATH's level), which shows where a policy is right at all (and what `task.max_difficulty` keeps). Needs the
task's `dataset(split)` (the math benchmarks); without it `not_reported` is never assigned and
`by_difficulty` is empty."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rolerl.tasks.math_grader import final_answer

CLASSES = (
    "correct",
    "truncated",
    "tool_limit",
    "format",
    "tool_error",
    "not_reported",
    "arithmetic",
    "reasoning",
)
ABOUT = {
    "correct": "graded right",
    "truncated": "cut at the token limit",
    "tool_limit": "ended by one tool call too many (max_tool_calls)",
    "format": "no tagged or boxed answer",
    "tool_error": "a tool call failed, the answer is not a value printed by a call that ran",
    "not_reported": "the tool printed the gold value, the answer is another",
    "arithmetic": "a calculation or tool result written in the prose is false",
    "reasoning": "the right arithmetic for the wrong computation (plan or code expression)",
}
# tool code, tool output, an MSARL request and its result: not the model's own prose
_BLOCKS = re.compile(r"<(code|output|request|result)>.*?(</\1>|$)", re.S)
_NUMBER = r"\d[\d,]*(?:\.\d+)?|\.\d+"
_NUMBERS = re.compile(rf"-?(?:{_NUMBER})(?:[eE][-+]?\d+)?")  # Python prints 3.8e-05
# an equation of the prose: numbers joined by operators, "=", a number ("3 x $4 = $12", "(5+3)/2 = 4")
_OPERAND = rf"[(]*\s*\$?(?:{_NUMBER})\s*[)]*"
_EQUATION = re.compile(rf"(?<![\w.])(-?{_OPERAND}(?:\s*[-+*/×x÷]\s*{_OPERAND})+)\s*=\s*\$?(-?(?:{_NUMBER}))")


def to_number(text: str | None) -> float | None:
    """`text` as one number (`$1,200`, `18.50`, `-3`), else None."""
    if text is None:
        return None
    s = re.sub(r"\\?\$|,|\s|\\!|\\,", "", text).rstrip(".")
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    try:
        return float(s)
    except ValueError:
        return None


def same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def printed_numbers(output: str) -> list[float]:
    """Every number a tool output shows (`24`, `[3, 4.5]`, `Result: 1,200`)."""
    return [v for v in (to_number(m) for m in _NUMBERS.findall(output or "")) if v is not None]


def false_equations(text: str) -> list[str]:
    """The equations of `text`'s prose (tool code and outputs removed) whose two sides differ beyond the
    right side's own rounding (`10 / 3 = 3.33` holds, `10 / 3 = 3.5` does not)."""
    prose = _BLOCKS.sub(" ", text)
    bad = []
    for m in _EQUATION.finditer(prose):
        left, right = m.group(1), m.group(2)
        expr = re.sub(r"\$|,", "", left).replace("×", "*").replace("÷", "/")
        expr = re.sub(r"(?<=[\d)])\s*x\s*(?=[\d(])", "*", expr)
        if len(expr) > 200 or re.search(r"[^\d.+\-*/() ]|\*\*", expr) or expr.count("(") != expr.count(")"):
            continue  # not a hand calculation (or a power, which could run for ever)
        rhs = to_number(right)
        decimals = len(right.split(".")[1]) if "." in right else 0
        try:
            value = float(eval(expr, {"__builtins__": {}}, {}))  # digits, . + - * / ( ) and spaces only
            if rhs is not None and abs(value - rhs) > 0.5 * 10**-decimals + 1e-9 * max(1.0, abs(rhs)):
                bad.append(m.group(0).strip())
        except (SyntaxError, ZeroDivisionError, TypeError, ValueError, OverflowError):
            continue
    return bad


def classify(sample: Mapping[str, Any], gold: str | None = None) -> str:
    """The class (one of `CLASSES`) of one `samples.jsonl` row; `gold` is the example's gold answer."""
    if sample.get("correct"):
        return "correct"
    if sample.get("truncated"):
        return "truncated"
    turns = sample.get("turns") or []
    if (
        turns and turns[-1].get("finish_reason") == "tool_limit"
    ):  # the episode's end (a coder's call cap is not)
        return "tool_limit"
    text = turns[-1]["completion"] if turns else ""
    if final_answer(text, ("tag", "boxed")) is None:
        return "format"
    calls = [c for t in turns for c in t.get("tool_calls") or []]
    printed = [v for c in calls if not c.get("error") for v in printed_numbers(str(c.get("output") or ""))]
    answer = to_number(sample.get("answer"))
    from_tool = answer is not None and any(same(answer, v) for v in printed)
    if any(c.get("error") for c in calls) and not from_tool:
        return "tool_error"
    target = to_number(gold)
    if target is not None and any(same(target, v) for v in printed):
        return "not_reported"
    prose = "\n".join(t["completion"] for t in turns)
    if not from_tool and false_equations(prose):
        return "arithmetic"
    return "reasoning"


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "samples.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no samples.jsonl (give an evaluation's --out directory or the file)"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def examples_for(
    eval_dir: str | Path, samples: Sequence[Mapping[str, Any]] = ()
) -> tuple[str, dict[str, Any]]:
    """The task name and its examples by id for the evaluation in `eval_dir`: the task, data and split its
    results.json names, or (an evaluation still running) the ones its first sample's id names
    (`gsm8k/test/17`, the default data); no examples when neither gives a task that lists them."""
    from rolerl.tasks import load_task

    results = Path(eval_dir) / "results.json"
    if results.is_file():
        spec = json.loads(results.read_text())["spec"]
        name, data, split = spec["task"], spec.get("data"), spec.get("split", "test")
    elif samples and str(samples[0]["id"]).count("/") == 2:
        name, split, _ = str(samples[0]["id"]).split("/")
        data = None
    else:
        return "", {}
    try:
        dataset = getattr(load_task(name, data), "dataset", None)
        return name, {} if dataset is None else {ex.id: ex for ex in dataset(split).examples}
    except (ValueError, KeyError, OSError):  # not a task by that name, or its data is elsewhere
        return name, {}


def tally(
    samples: Iterable[Mapping[str, Any]], golds: Mapping[str, str], levels: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """Counts per class, the wrong samples without a tool call, the first ids of each class, and per
    difficulty (`levels`: example id -> difficulty; samples of an id it lacks are not counted there) the
    samples and the correct ones: `by_difficulty` = {difficulty: [samples, correct]}, in ascending order."""
    counts: Counter[str] = Counter()
    firsts: dict[str, list[str]] = {}
    by_level: dict[int, list[int]] = {}
    no_tool = wrong = total = 0
    for s in samples:
        total += 1
        kind = classify(s, golds.get(s["id"]))
        counts[kind] += 1
        level = (levels or {}).get(s["id"])
        if level is not None:
            cell = by_level.setdefault(level, [0, 0])
            cell[0] += 1
            cell[1] += kind == "correct"
        if kind != "correct":
            wrong += 1
            no_tool += not s.get("tool_calls")
            ids = firsts.setdefault(kind, [])
            if len(ids) < 3:
                ids.append(f"{s['id']}#{s.get('sample', 0)}")
    return {"samples": total, "wrong": wrong, "counts": {k: counts[k] for k in CLASSES},
            "no_tool": no_tool, "examples": firsts,
            "by_difficulty": {level: by_level[level] for level in sorted(by_level)}}  # fmt: skip


def analyze(eval_dir: str | Path) -> dict[str, Any]:
    """`tally` of an evaluation directory (its samples.jsonl, the gold answers and difficulties of its task)."""
    from rolerl.tasks.math import difficulty

    samples = read_samples(eval_dir)
    name, examples = examples_for(eval_dir, samples)
    levels = {i: d for i, ex in examples.items() if (d := difficulty(name, ex)) is not None}
    return tally(samples, {i: ex.answer for i, ex in examples.items()}, levels)


def table(named: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """A plain-text table: one column per evaluation, a row per class (count and share of the samples)."""
    width = max(12, *(len(name) for name, _ in named))
    lines = [f"{'class':<13}" + "".join(f"{name:>{width + 2}}" for name, _ in named) + "   what it means"]
    for kind in (*CLASSES, "no_tool"):
        cells = []
        for _, t in named:
            n = t["no_tool"] if kind == "no_tool" else t["counts"][kind]
            cells.append(f"{n:>{width - 7}} {100 * n / max(t['samples'], 1):5.1f}%")
        about = "wrong, without any tool call" if kind == "no_tool" else ABOUT[kind]
        lines.append(f"{kind:<13}" + "".join(f"  {c:>{width}}" for c in cells) + f"   {about}")
    lines.append(f"{'samples':<13}" + "".join(f"  {t['samples']:>{width}}" for _, t in named))
    levels = sorted({d for _, t in named for d in t.get("by_difficulty", {})})
    if levels:
        lines += ["", f"{'difficulty':<13}" + "".join(f"{name:>{width + 2}}" for name, _ in named)
                  + "   correct of the samples of problems this hard (GSM8K: solution steps; MATH: level)"]  # fmt: skip
        for level in levels:
            cells = []
            for _, t in named:
                n, right = t.get("by_difficulty", {}).get(level, (0, 0))
                cells.append(f"{right}/{n} {100 * right / max(n, 1):5.1f}%")
            lines.append(f"{level:<13}" + "".join(f"  {c:>{width}}" for c in cells))
    return "\n".join(lines)
